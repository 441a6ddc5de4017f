//! The engines' common payloads read straight into a [`Batch`], without the `Value`
//! tree the general reader ([`crate::msgpack`], [`crate::payload`]) builds: a batch
//! `[ts, events, rank]` whose events are stores, removals and clears as vLLM 0.9 writes
//! them (tagged arrays) or vLLM 0.34 does (maps tagged `"type"`), without LoRA names,
//! extra keys or salts. The tree cost an allocation per container, tag, medium and map
//! key: most of the ingest's time on short stores. Anything else (another field, a
//! duplicate key, a LoRA name, a malformed value, trailing bytes) returns None, and the
//! general reader decides, errors included; so this path gives what that one gives
//! wherever it gives anything (a differential test checks it).

use std::str;

use rmp::Marker;

use crate::msgpack::{bytes_key, next_int, MAX_HASH_BYTES};
use crate::payload::{Batch, EngineEvent, Locality, Medium, Removed, Stored, MAX_DP_RANK};

/// The batch in `bytes` if it is one this path knows, whole.
pub fn batch(bytes: &[u8]) -> Option<Batch> {
    let mut r = Cursor(bytes);
    let fields = r.array()?;
    if !(2..=3).contains(&fields) {
        return None;
    }
    let ts = r.number()?;
    if !ts.is_finite() {
        return None;
    }
    let n = r.array()?;
    let mut events = Vec::with_capacity(n.min(bytes.len()));
    for _ in 0..n {
        events.push(r.event()?);
    }
    let dp_rank = match fields {
        3 => match r.opt_uint()? {
            None => 0,
            Some(rank) if rank <= u64::from(MAX_DP_RANK) => rank as u32,
            Some(_) => return None,
        },
        _ => 0,
    };
    r.0.is_empty().then_some(Batch {
        ts,
        events,
        dp_rank,
    })
}

/// An event's tag.
#[derive(Clone, Copy, PartialEq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

impl Tag {
    /// The keys (bits of [`Key`]) its map may hold besides `"type"`.
    fn keys(self) -> u16 {
        let all = |keys: &[Key]| keys.iter().fold(0u16, |m, k| m | 1 << *k as u16);
        match self {
            Tag::Stored => all(&Key::STORED),
            Tag::Removed => all(&Key::REMOVED),
            Tag::Cleared => 0,
        }
    }

    fn of(s: &[u8]) -> Option<Tag> {
        match s {
            b"BlockStored" => Some(Tag::Stored),
            b"BlockRemoved" => Some(Tag::Removed),
            b"AllBlocksCleared" => Some(Tag::Cleared),
            _ => None,
        }
    }
}

/// The fields of an event, as read (None: absent or nil).
#[derive(Default)]
struct Fields {
    hashes: Option<Vec<u64>>,
    /// Read, and its value (nil: None).
    parent: Option<Option<u64>>,
    tokens: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    group_idx: Option<u32>,
    spec_kind: Option<String>,
    sliding_window: Option<u32>,
    locality: Option<Locality>,
    /// `ownership` was a string (a secondary tier's).
    secondary: Option<bool>,
}

/// Which field a map key or an array position names.
#[derive(Clone, Copy, PartialEq)]
enum Key {
    Hashes,
    Parent,
    Tokens,
    BlockSize,
    LoraId,
    Medium,
    /// Known and taken only as nil (a LoRA name, extra keys, a salt: the general reader's).
    NilOnly,
    GroupIdx,
    SpecKind,
    Window,
    Locality,
    Ownership,
}

impl Key {
    fn named(k: &[u8]) -> Option<Key> {
        Some(match k {
            b"block_hashes" => Key::Hashes,
            b"parent_block_hash" => Key::Parent,
            b"token_ids" => Key::Tokens,
            b"block_size" => Key::BlockSize,
            b"lora_id" => Key::LoraId,
            b"medium" => Key::Medium,
            b"lora_name" | b"extra_keys" | b"cache_salt" => Key::NilOnly,
            b"group_idx" => Key::GroupIdx,
            b"kv_cache_spec_kind" => Key::SpecKind,
            b"kv_cache_spec_sliding_window" => Key::Window,
            b"locality" => Key::Locality,
            b"ownership" => Key::Ownership,
            b"session_id" | b"lookahead_token_ids" => Key::NilOnly,
            _ => return None,
        })
    }

    /// A store's fields in their array positions (after the tag): vLLM's `BlockStored`.
    const STORED: [Key; 15] = [
        Key::Hashes,
        Key::Parent,
        Key::Tokens,
        Key::BlockSize,
        Key::LoraId,
        Key::Medium,
        Key::NilOnly,
        Key::NilOnly,
        Key::GroupIdx,
        Key::SpecKind,
        Key::Window,
        Key::Locality,
        Key::Ownership,
        Key::NilOnly,
        Key::NilOnly,
    ];
    /// A removal's: vLLM's `BlockRemoved`.
    const REMOVED: [Key; 5] = [
        Key::Hashes,
        Key::Medium,
        Key::GroupIdx,
        Key::Locality,
        Key::Ownership,
    ];

    /// The field at `pos` (after the tag) of an array tagged `tag`.
    fn at(tag: Tag, pos: usize) -> Option<Key> {
        match tag {
            Tag::Stored => Key::STORED.get(pos).copied(),
            Tag::Removed => Key::REMOVED.get(pos).copied(),
            Tag::Cleared => None,
        }
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    fn marker(&self) -> Option<Marker> {
        self.0.first().map(|&b| Marker::from_u8(b))
    }

    /// A big-endian length of `n` bytes after the marker.
    fn len(&mut self, n: usize) -> Option<usize> {
        let b = self.take(1 + n)?;
        Some(b[1..].iter().fold(0usize, |a, &y| a << 8 | usize::from(y)))
    }

    fn array(&mut self) -> Option<usize> {
        match self.marker()? {
            Marker::FixArray(n) => self.take(1).map(|_| usize::from(n)),
            Marker::Array16 => self.len(2),
            Marker::Array32 => self.len(4),
            _ => None,
        }
    }

    fn map(&mut self) -> Option<usize> {
        match self.marker()? {
            Marker::FixMap(n) => self.take(1).map(|_| usize::from(n)),
            Marker::Map16 => self.len(2),
            Marker::Map32 => self.len(4),
            _ => None,
        }
    }

    fn str(&mut self) -> Option<&'a [u8]> {
        let n = match self.marker()? {
            Marker::FixStr(n) => self.take(1).map(|_| usize::from(n))?,
            Marker::Str8 => self.len(1)?,
            Marker::Str16 => self.len(2)?,
            Marker::Str32 => self.len(4)?,
            _ => return None,
        };
        self.take(n)
    }

    fn nil(&mut self) -> bool {
        let nil = self.marker() == Some(Marker::Null);
        if nil {
            self.0 = &self.0[1..];
        }
        nil
    }

    /// An integer as its 64-bit two's complement, and whether it is negative.
    fn int(&mut self) -> Option<(u64, bool)> {
        let (len, bits, negative) = next_int(self.0)?;
        self.take(len)?;
        Some((bits, negative))
    }

    fn uint(&mut self) -> Option<u64> {
        match self.int()? {
            (v, false) => Some(v),
            _ => None,
        }
    }

    /// Nil or an integer in 0..2^64.
    fn opt_uint(&mut self) -> Option<Option<u64>> {
        if self.nil() {
            return Some(None);
        }
        self.uint().map(Some)
    }

    fn opt_u32(&mut self) -> Option<Option<u32>> {
        match self.opt_uint()? {
            None => Some(None),
            Some(v) => u32::try_from(v).ok().map(Some),
        }
    }

    fn number(&mut self) -> Option<f64> {
        match self.marker()? {
            Marker::F64 => {
                let b = self.take(9)?;
                Some(f64::from_be_bytes(b[1..].try_into().ok()?))
            }
            Marker::F32 => {
                let b = self.take(5)?;
                Some(f64::from(f32::from_be_bytes(b[1..].try_into().ok()?)))
            }
            _ => {
                let (bits, negative) = self.int()?;
                Some(match negative {
                    true => bits as i64 as f64,
                    false => bits as f64,
                })
            }
        }
    }

    /// An engine hash ([`crate::payload::hash_key`]'s rules).
    fn hash(&mut self) -> Option<u64> {
        let n = match self.marker()? {
            Marker::Bin8 => self.len(1)?,
            Marker::Bin16 => self.len(2)?,
            Marker::Bin32 => self.len(4)?,
            _ => return self.int().map(|(bits, _)| bits),
        };
        if n == 0 || n > MAX_HASH_BYTES {
            return None;
        }
        self.take(n).map(bytes_key)
    }

    fn hashes(&mut self) -> Option<Vec<u64>> {
        let n = self.array()?;
        let mut out = Vec::with_capacity(n.min(self.0.len()));
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Some(out)
    }

    fn tokens(&mut self) -> Option<Vec<u32>> {
        let n = self.array()?;
        let mut out = Vec::with_capacity(n.min(self.0.len()));
        for _ in 0..n {
            out.push(u32::try_from(self.uint()?).ok()?);
        }
        Some(out)
    }

    fn medium(&mut self) -> Option<Medium> {
        if self.nil() {
            return Some(Medium::Gpu);
        }
        str::from_utf8(self.str()?).ok().map(Medium::named)
    }

    /// One field's value into `f`; None when it is not one this path takes (or was
    /// there already).
    fn field(&mut self, key: Key, f: &mut Fields) -> Option<()> {
        fn once<T>(slot: &mut Option<T>, v: T) -> Option<()> {
            slot.is_none().then(|| *slot = Some(v))
        }
        match key {
            Key::Hashes => once(&mut f.hashes, self.hashes()?),
            Key::Parent => {
                let parent = match self.nil() {
                    true => None,
                    false => Some(self.hash()?),
                };
                once(&mut f.parent, parent)
            }
            Key::Tokens => once(&mut f.tokens, self.tokens()?),
            Key::BlockSize => once(&mut f.block_size, self.uint()?),
            Key::LoraId => match self.nil() {
                true => Some(()),
                false => match self.int()? {
                    (bits, true) => once(&mut f.lora_id, bits as i64),
                    (bits, false) => once(&mut f.lora_id, i64::try_from(bits).ok()?),
                },
            },
            Key::Medium => once(&mut f.medium, self.medium()?),
            Key::NilOnly => self.nil().then_some(()),
            Key::GroupIdx => match self.opt_u32()? {
                None => Some(()),
                Some(g) => once(&mut f.group_idx, g),
            },
            Key::SpecKind => match self.nil() {
                true => Some(()),
                false => {
                    let kind = str::from_utf8(self.str()?).ok()?.to_string();
                    once(&mut f.spec_kind, kind)
                }
            },
            Key::Window => match self.opt_u32()? {
                None => Some(()),
                Some(w) => once(&mut f.sliding_window, w),
            },
            Key::Locality => match self.nil() {
                true => Some(()),
                false => {
                    let l = Locality::named(str::from_utf8(self.str()?).ok()?);
                    once(&mut f.locality, l)
                }
            },
            Key::Ownership => match self.nil() {
                true => Some(()),
                false => {
                    self.str()?;
                    once(&mut f.secondary, true)
                }
            },
        }
    }

    fn event(&mut self) -> Option<EngineEvent> {
        let mut f = Fields::default();
        let tag = if let Some(n) = self.array() {
            if n == 0 {
                return None;
            }
            let tag = Tag::of(self.str()?)?;
            for pos in 0..n - 1 {
                self.field(Key::at(tag, pos)?, &mut f)?;
            }
            tag
        } else {
            let n = self.map()?;
            let mut tag = None;
            // A key twice: the general reader takes the first, this path none.
            let mut seen = 0u16;
            for _ in 0..n {
                let k = self.str()?;
                if k == b"type" {
                    if tag.is_some() {
                        return None;
                    }
                    tag = Some(Tag::of(self.str()?)?);
                    continue;
                }
                let key = Key::named(k)?;
                let bit = 1u16 << key as u16;
                if seen & bit != 0 && key != Key::NilOnly {
                    return None;
                }
                seen |= bit;
                self.field(key, &mut f)?;
            }
            let tag = tag?;
            // Fields another tag does not have are the general reader's to judge.
            if seen & !tag.keys() != 0 {
                return None;
            }
            tag
        };
        match tag {
            Tag::Cleared => Some(EngineEvent::Cleared),
            Tag::Removed => Some(EngineEvent::Removed(Removed {
                block_hashes: f.hashes?,
                medium: f.medium.unwrap_or(Medium::Gpu),
                group_idx: f.group_idx.unwrap_or(0),
                locality: f.locality.unwrap_or(Locality::Local),
                secondary: f.secondary.unwrap_or(false),
            })),
            Tag::Stored => {
                let tokens = f.tokens?;
                let block_size = u32::try_from(f.block_size?)
                    .ok()
                    .filter(|b| *b > 0 || tokens.is_empty())?;
                Some(EngineEvent::Stored(Stored {
                    block_hashes: f.hashes?,
                    parent: f.parent?,
                    token_ids: tokens,
                    block_size,
                    lora_id: f.lora_id,
                    medium: f.medium.unwrap_or(Medium::Gpu),
                    lora_name: None,
                    extras: Vec::new(),
                    cache_salt: None,
                    group_idx: f.group_idx.unwrap_or(0),
                    spec_kind: f.spec_kind,
                    sliding_window: f.sliding_window,
                    locality: f.locality.unwrap_or(Locality::Local),
                    secondary: f.secondary.unwrap_or(false),
                }))
            }
        }
    }
}
