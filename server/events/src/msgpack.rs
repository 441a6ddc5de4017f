//! Reading a payload's msgpack in one pass: the structure into `rmpv::Value`s, except
//! the stores' token ids and the stores' and removals' block hashes, read straight into
//! their vectors. A `Value` tree holds 32 bytes and an array slot per item, which made
//! decoding most of the ingest's work.
//!
//! A store's `token_ids` (field 3 of an event array tagged `"BlockStored"`, or the first
//! `"token_ids"` entry of an event map) and an event's `block_hashes` (field 1 of an array
//! tagged `"BlockStored"` or `"BlockRemoved"`, or the first `"block_hashes"` entry of a
//! map) are kept in [`Read::aside`] under their event's index, and left in the tree as
//! empty arrays.

use rmp::Marker;
use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Token ids of one store, or the index of the first item that is not a token id (an
/// integer in 0..2^32, or a pair whose first is one: SGLang's EAGLE bigram pages send
/// each token as the pair (token, next token)).
pub type TokenIds = Result<Vec<u32>, usize>;

/// Block hashes of one event as u64 keys ([`hash_key`]), or the index of the first item
/// that is not a hash.
pub type Hashes = Result<Vec<u64>, usize>;

/// Raw-bytes engine hashes longer than this are not hashes (sha256 gives 32).
pub const MAX_HASH_BYTES: usize = 64;

/// The key of a raw-bytes engine hash.
pub fn bytes_key(b: &[u8]) -> u64 {
    xxh3_64(b)
}

/// An engine block hash as a u64 key: ints as their 64-bit two's complement (so a
/// negative i64 and the u64 with the same bits are one key), raw bytes (1 to
/// [`MAX_HASH_BYTES`] of them) through xxh3.
pub fn hash_key(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        Value::Binary(b) if !b.is_empty() && b.len() <= MAX_HASH_BYTES => Some(bytes_key(b)),
        _ => None,
    }
}

/// What one event held that was read aside.
#[derive(Debug, Default, PartialEq)]
pub struct Aside {
    pub tokens: Option<TokenIds>,
    pub hashes: Option<Hashes>,
}

/// What one pass read.
pub struct Read {
    pub value: Value,
    /// Per event of the batch's `events` array, what was read aside of it.
    pub aside: Vec<Aside>,
}

/// Reads the one value at the start of `bytes` (nested at most `max_depth` deep),
/// returning it and the bytes after it.
pub fn read(bytes: &[u8], max_depth: usize) -> Result<(Read, &[u8]), String> {
    let mut r = Reader {
        rd: bytes,
        aside: Vec::new(),
        max_depth,
    };
    let value = r.batch()?;
    Ok((
        Read {
            value,
            aside: r.aside,
        },
        r.rd,
    ))
}

struct Reader<'a> {
    rd: &'a [u8],
    aside: Vec<Aside>,
    max_depth: usize,
}

/// A field a record reads aside: at `pos` of an array whose first item is one of
/// `tags` (any, when empty), or the first entry named `name` of a map.
struct Field<'f, R> {
    tags: &'f [&'f str],
    pos: usize,
    name: &'f str,
    read: fn(&mut R) -> Result<Value, String>,
}

impl Reader<'_> {
    fn marker(&self) -> Option<Marker> {
        self.rd.first().map(|&b| Marker::from_u8(b))
    }

    /// Any value, `depth` containers down.
    fn value(&mut self, depth: usize) -> Result<Value, String> {
        let left = self.max_depth.saturating_sub(depth);
        rmpv::decode::read_value_with_max_depth(&mut self.rd, left).map_err(|e| e.to_string())
    }

    /// A container header coming next (`maps`: a map's, else an array's), read; None
    /// (nothing read) if none comes, or it would nest past the limit at `depth`.
    fn header(&mut self, maps: bool, depth: usize) -> Result<Option<usize>, String> {
        let is = match self.marker() {
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => !maps,
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => maps,
            _ => false,
        };
        if !is || depth >= self.max_depth {
            return Ok(None);
        }
        let n = if maps {
            rmp::decode::read_map_len(&mut self.rd)
        } else {
            rmp::decode::read_array_len(&mut self.rd)
        };
        n.map(|n| Some(n as usize)).map_err(|e| e.to_string())
    }

    /// A struct encoded as an array or a map, `depth` containers down, whose `fields`
    /// are read by their own readers; the others, and anything else, as values.
    fn record(&mut self, depth: usize, fields: &[Field<'_, Self>]) -> Result<Value, String> {
        if let Some(n) = self.header(false, depth)? {
            let mut items = Vec::with_capacity(n.min(16));
            for i in 0..n {
                let tag = items.first().and_then(Value::as_str);
                let field = fields.iter().find(|f| {
                    f.pos == i && (f.tags.is_empty() || tag.is_some_and(|t| f.tags.contains(&t)))
                });
                items.push(match field {
                    Some(f) => (f.read)(self)?,
                    None => self.value(depth + 1)?,
                });
            }
            return Ok(Value::Array(items));
        }
        if let Some(n) = self.header(true, depth)? {
            let mut pairs = Vec::with_capacity(n.min(16));
            let mut seen = 0u32;
            for _ in 0..n {
                let k = self.value(depth + 1)?;
                let field = fields
                    .iter()
                    .enumerate()
                    .find(|(i, f)| seen & 1 << i == 0 && k.as_str() == Some(f.name));
                let v = match field {
                    Some((i, f)) => {
                        seen |= 1 << i;
                        (f.read)(self)?
                    }
                    None => self.value(depth + 1)?,
                };
                pairs.push((k, v));
            }
            return Ok(Value::Map(pairs));
        }
        self.value(depth)
    }

    /// `[ts, events, rank]` or a map of them.
    fn batch(&mut self) -> Result<Value, String> {
        let events = Field {
            tags: &[],
            pos: 1,
            name: "events",
            read: Self::events,
        };
        self.record(0, &[events])
    }

    fn events(&mut self) -> Result<Value, String> {
        let Some(n) = self.header(false, 1)? else {
            return self.value(1);
        };
        let mut events = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            self.aside.push(Aside::default());
            events.push(self.event()?);
        }
        Ok(Value::Array(events))
    }

    /// A tagged array or a map with `"type"`: a store's token ids and an event's block
    /// hashes are read aside.
    fn event(&mut self) -> Result<Value, String> {
        let fields = [
            Field {
                tags: &["BlockStored", "BlockRemoved"],
                pos: 1,
                name: "block_hashes",
                read: Self::block_hashes,
            },
            Field {
                tags: &["BlockStored"],
                pos: 3,
                name: "token_ids",
                read: Self::token_ids,
            },
        ];
        self.record(2, &fields)
    }

    /// An array of block hashes into the event's entry of [`Reader::aside`], an empty
    /// array in its place; anything else as a value.
    fn block_hashes(&mut self) -> Result<Value, String> {
        self.read_aside(
            |r| match r.int_bits() {
                Some(k) => Ok(Some(k)),
                None => Ok(hash_key(&r.value(4)?)),
            },
            |entry, hashes| entry.hashes = Some(hashes),
        )
    }

    /// An array of token ids into the event's entry of [`Reader::aside`], an empty
    /// array in its place; anything else as a value.
    fn token_ids(&mut self) -> Result<Value, String> {
        self.read_aside(
            |r| {
                let id = match r.uint() {
                    Some(t) => Some(t),
                    None if r.marker() == Some(Marker::FixArray(2)) && r.max_depth > 5 => {
                        r.rd = &r.rd[1..];
                        let first = r.uint();
                        if first.is_none() {
                            r.value(5)?;
                        }
                        r.value(5)?;
                        first
                    }
                    None => {
                        r.value(4)?;
                        None
                    }
                };
                Ok(id.and_then(|t| u32::try_from(t).ok()))
            },
            |entry, ids| entry.tokens = Some(ids),
        )
    }

    /// An array (at depth 3) whose items `item` reads, each the value or None when it is
    /// not one: kept by `keep` in the event's entry of [`Reader::aside`] as the values,
    /// or the index of the first that is not one; an empty array in its place in the
    /// tree. Anything but an array is read as a value.
    fn read_aside<T>(
        &mut self,
        item: impl Fn(&mut Self) -> Result<Option<T>, String>,
        keep: impl FnOnce(&mut Aside, Result<Vec<T>, usize>),
    ) -> Result<Value, String> {
        let Some(n) = self.header(false, 3)? else {
            return self.value(3);
        };
        // Each item takes a byte at least: a header cannot reserve more than the payload holds.
        let mut items = Vec::with_capacity(n.min(self.rd.len()));
        let mut bad = None;
        for index in 0..n {
            match item(self)? {
                Some(v) if bad.is_none() => items.push(v),
                Some(_) => {}
                None => {
                    bad.get_or_insert(index);
                }
            }
        }
        if let Some(entry) = self.aside.last_mut() {
            keep(entry, bad.map_or(Ok(items), Err));
        }
        Ok(Value::Array(Vec::new()))
    }

    /// The integer that comes next, read, as its 64-bit two's complement (as
    /// [`hash_key`] takes it); nothing read if it is not one.
    fn int_bits(&mut self) -> Option<u64> {
        let (len, bits, _) = next_int(self.rd)?;
        self.rd = &self.rd[len..];
        Some(bits)
    }

    /// The integer that comes next, read, if it is one in 0..2^64 (as
    /// `Value::as_u64`); nothing read otherwise.
    fn uint(&mut self) -> Option<u64> {
        match next_int(self.rd)? {
            (_, _, true) => None,
            (len, v, false) => {
                self.rd = &self.rd[len..];
                Some(v)
            }
        }
    }
}

/// The integer that comes next (not read): its length in bytes, its 64-bit two's
/// complement, and whether it is negative.
pub fn next_int(b: &[u8]) -> Option<(usize, u64, bool)> {
    let be = |n: usize| {
        b.get(1..1 + n)
            .map(|x| x.iter().fold(0u64, |a, &y| a << 8 | u64::from(y)))
    };
    let unsigned = |v: Option<u64>| v.map(|v| (v, false));
    let signed = |v: Option<u64>, bits: u32| {
        v.map(|v| {
            let v = ((v << (64 - bits)) as i64) >> (64 - bits);
            (v as u64, v < 0)
        })
    };
    let (len, v) = match Marker::from_u8(*b.first()?) {
        Marker::FixPos(n) => (1, Some((u64::from(n), false))),
        Marker::FixNeg(n) => (1, Some((i64::from(n) as u64, true))),
        Marker::U8 => (2, unsigned(be(1))),
        Marker::U16 => (3, unsigned(be(2))),
        Marker::U32 => (5, unsigned(be(4))),
        Marker::U64 => (9, unsigned(be(8))),
        Marker::I8 => (2, signed(be(1), 8)),
        Marker::I16 => (3, signed(be(2), 16)),
        Marker::I32 => (5, signed(be(4), 32)),
        Marker::I64 => (9, signed(be(8), 64)),
        _ => return None,
    };
    let (bits, negative) = v?;
    Some((len, bits, negative))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    /// The events of a batch as rmpv reads it.
    fn events_of(want: &mut Value) -> Option<&mut Vec<Value>> {
        let events = match want {
            Value::Array(items) => items.get_mut(1),
            Value::Map(pairs) => pairs
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some("events"))
                .map(|(_, v)| v),
            _ => None,
        };
        match events {
            Some(Value::Array(events)) => Some(events),
            _ => None,
        }
    }

    /// Where an event keeps the field read aside at `pos` of an array tagged one of
    /// `tags`, or as a map's first entry `name`; only if it is an array.
    fn slot<'v>(e: &'v mut Value, tags: &[&str], pos: usize, name: &str) -> Option<&'v mut Value> {
        let slot = match e {
            Value::Array(items)
                if items
                    .first()
                    .and_then(Value::as_str)
                    .is_some_and(|t| tags.contains(&t)) =>
            {
                items.get_mut(pos)
            }
            Value::Map(pairs) => pairs
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            _ => None,
        };
        slot.filter(|v| matches!(v, Value::Array(_)))
    }

    const HASHES: (&[&str], usize, &str) = (&["BlockStored", "BlockRemoved"], 1, "block_hashes");
    const TOKENS: (&[&str], usize, &str) = (&["BlockStored"], 3, "token_ids");

    /// `want` (rmpv's tree) with what the one pass reads aside taken out, as it keeps
    /// it: each event's token ids (ints, or pairs whose first is one, in 0..2^32) and
    /// block hashes (`hash_key`), or the index of the first item that is not one.
    fn aside_of(want: &Value) -> (Value, Vec<Aside>) {
        let mut v = want.clone();
        let Some(events) = events_of(&mut v) else {
            return (v, Vec::new());
        };
        // The one pass leaves an empty array where it read aside.
        let taken = |slot: Option<&mut Value>| match slot
            .map(|v| std::mem::replace(v, Value::Array(Vec::new())))
        {
            Some(Value::Array(items)) => Some(items),
            _ => None,
        };
        let mut aside = Vec::new();
        for e in events.iter_mut() {
            let (tags, pos, name) = HASHES;
            let hashes = taken(slot(e, tags, pos, name)).map(|items| {
                items
                    .iter()
                    .enumerate()
                    .map(|(i, h)| hash_key(h).ok_or(i))
                    .collect::<Hashes>()
            });
            let (tags, pos, name) = TOKENS;
            let tokens = taken(slot(e, tags, pos, name)).map(|items| {
                let one = |t: &Value| {
                    let t = match t {
                        Value::Array(pair) if pair.len() == 2 => &pair[0],
                        t => t,
                    };
                    t.as_u64().and_then(|t| u32::try_from(t).ok())
                };
                items
                    .iter()
                    .enumerate()
                    .map(|(i, t)| one(t).ok_or(i))
                    .collect::<TokenIds>()
            });
            aside.push(Aside { tokens, hashes });
        }
        (v, aside)
    }

    fn arb_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::Boolean),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u32..70_000).prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::F64),
            ".{0,12}".prop_map(Value::from),
            Just(Value::from("BlockStored")),
            Just(Value::from("BlockRemoved")),
            Just(Value::from("token_ids")),
            Just(Value::from("block_hashes")),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
            (any::<i8>(), proptest::collection::vec(any::<u8>(), 0..6))
                .prop_map(|(t, d)| Value::Ext(t, d)),
        ]
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        arb_leaf().prop_recursive(5, 96, 12, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..12).prop_map(Value::Array),
                proptest::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Map),
            ]
        })
    }

    /// Batches shaped like the engines' (arrays and maps, stores with token ids that
    /// are ints, pairs or not tokens at all) and anything else.
    fn arb_payload() -> impl Strategy<Value = Value> {
        let token = prop_oneof![
            (0u64..70_000).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (0u32..9, any::<i64>())
                .prop_map(|(a, b)| Value::Array(vec![Value::from(a), Value::from(b)])),
            arb_leaf(),
        ];
        let ids = proptest::collection::vec(token, 0..20).prop_map(Value::Array);
        let hash = prop_oneof![
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            proptest::collection::vec(any::<u8>(), 0..70).prop_map(Value::Binary),
            arb_leaf(),
        ];
        let hashes = proptest::collection::vec(hash, 0..12).prop_map(Value::Array);
        let stored = (ids.clone(), hashes.clone(), arb_value(), any::<bool>()).prop_map(
            |(ids, hashes, other, as_map)| {
                if as_map {
                    Value::Map(vec![
                        (Value::from("type"), Value::from("BlockStored")),
                        (Value::from("block_hashes"), hashes.clone()),
                        (Value::from("token_ids"), ids.clone()),
                        (Value::from("token_ids"), ids),
                        (Value::from("block_hashes"), hashes),
                        (Value::from("x"), other),
                    ])
                } else {
                    Value::Array(vec![
                        Value::from("BlockStored"),
                        hashes,
                        Value::Nil,
                        ids,
                        other,
                    ])
                }
            },
        );
        let removed = (hashes, any::<bool>()).prop_map(|(hashes, as_map)| {
            if as_map {
                Value::Map(vec![
                    (Value::from("type"), Value::from("BlockRemoved")),
                    (Value::from("block_hashes"), hashes),
                ])
            } else {
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    hashes,
                    Value::from("GPU"),
                ])
            }
        });
        let event = prop_oneof![stored, removed, arb_value()];
        let events = proptest::collection::vec(event, 0..5).prop_map(Value::Array);
        prop_oneof![
            (events.clone(), arb_leaf()).prop_map(|(e, l)| Value::Array(vec![
                Value::F64(1.0),
                e,
                l
            ])),
            (events, arb_leaf(), any::<bool>()).prop_map(|(e, l, twice)| {
                let mut pairs = vec![(Value::from("ts"), Value::F64(1.0))];
                if twice {
                    pairs.push((Value::from("events"), l));
                }
                pairs.push((Value::from("events"), e));
                Value::Map(pairs)
            }),
            arb_value(),
        ]
    }

    proptest! {
        /// One pass reads what rmpv reads: the same tree but for the token ids and hashes
        /// it keeps aside, which are each event's as rmpv reads them; the same bytes
        /// left over; an error where rmpv has one.
        #[test]
        fn one_pass_reads_what_rmpv_reads(v in arb_payload(), tail in proptest::collection::vec(any::<u8>(), 0..3)) {
            let mut bytes = enc(&v);
            bytes.extend_from_slice(&tail);
            let mut rd = &bytes[..];
            let reference = rmpv::decode::read_value_with_max_depth(&mut rd, 16);
            match (read(&bytes, 16), reference) {
                (Ok((got, rest)), Ok(want)) => {
                    prop_assert_eq!(rest, rd);
                    let (tree, aside) = aside_of(&want);
                    prop_assert_eq!(&got.aside, &aside);
                    prop_assert_eq!(&got.value, &tree);
                }
                (Err(_), Err(_)) => {}
                (got, want) => prop_assert!(false, "{:?} vs {:?}", got.map(|r| r.0.value), want),
            }
        }

        /// Broken bytes are an error, never a panic.
        #[test]
        fn broken_bytes_never_panic(v in arb_value(), cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>()) {
            let mut bytes = enc(&v);
            let i = flip.0.index(bytes.len());
            bytes[i] ^= flip.1;
            bytes.truncate(cut.index(bytes.len() + 1));
            let _ = read(&bytes, 16);
        }
    }

    #[test]
    fn every_integer_marker_reads_as_rmpv_reads_it() {
        let cases: [&[u8]; 9] = [
            &[0xd0, 0x05],
            &[0xd0, 0xff],
            &[0xd1, 0x01, 0x00],
            &[0xd2, 0x80, 0, 0, 0],
            &[0xd3, 0, 0, 0, 0, 0, 0, 0, 7],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            &[0xcc, 0xc8],
            &[0xe0],
            &[0xcd, 0x01],
        ];
        for bytes in cases {
            let mut r = Reader {
                rd: bytes,
                aside: Vec::new(),
                max_depth: 16,
            };
            let mut rd = bytes;
            let value = rmpv::decode::read_value(&mut rd).ok();
            let want = value.as_ref().and_then(|v| v.as_u64());
            assert_eq!(r.uint(), want, "{bytes:02x?}");
            assert_eq!(
                r.rd.is_empty(),
                want.is_some(),
                "{bytes:02x?}: consumed when read"
            );
            let mut r = Reader {
                rd: bytes,
                aside: Vec::new(),
                max_depth: 16,
            };
            let key = value.as_ref().and_then(hash_key);
            assert_eq!(r.int_bits(), key, "{bytes:02x?}: as a hash");
            assert_eq!(r.rd.is_empty(), key.is_some(), "{bytes:02x?}");
        }
    }
}
