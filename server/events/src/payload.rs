//! vLLM / SGLang KV event payloads: msgpack → typed events. Pure, no I/O.
//!
//! A payload is an `EventBatch` `[ts, events, rank]` (msgspec `array_like` in every
//! release: vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`); a map with the same
//! field names is accepted too. Each event is a tagged array (vLLM 0.9: `["BlockStored",
//! block_hashes, parent_block_hash, token_ids, block_size, lora_id]`, later fields
//! `medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//! kv_cache_spec_sliding_window` when present) or a map with a `"type"` key (vLLM 0.34,
//! SGLang, whose `cache_salt` field exists only in maps).
//!
//! Engine block hashes arrive as ints (u64, or negative i64 for older builds) or as
//! raw bytes (32 for sha256); either becomes a u64 key ([`hash_key`]). Decoding is
//! all-or-nothing: any malformed field fails the whole payload with a typed error, so a
//! bad message is never applied half-way. Unknown event types are kept as
//! [`EngineEvent::Unknown`] (newer engines may add some) for the caller to count.

use kvix_wire::chain::ExtraKey;
use kvix_wire::Tier;
use rmpv::Value;

use crate::msgpack::{self, Aside, Hashes};
pub use crate::msgpack::{bytes_key, hash_key};

/// Nesting deeper than this is not a vLLM payload (and would cost stack).
const MAX_DEPTH: usize = 16;
/// Data-parallel ranks above this are refused: each rank becomes a holder.
pub const MAX_DP_RANK: u32 = 1023;

/// Where a block lives, as the engine reports it (`None` in vLLM means GPU). Names map
/// to tiers as Dynamo's indexer maps them (`StorageTier::from_kv_medium`), case aside:
/// external and shared stores count as storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    /// Disk, NVMe, a connector's shared or remote store.
    Storage,
    /// A name no engine documents (vLLM's connectors' `FS`, `OBJ`, ...): its blocks are
    /// not credited to any tier (counted as `unknown_medium`).
    Unknown,
}

impl Medium {
    /// The media credited to a tier, in [`Tier::ALL`] order.
    pub const ALL: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Storage];
    /// The labels of [`Medium::ALL`], in its order.
    pub const LABELS: [&'static str; 3] = [
        Tier::ALL[0].label(),
        Tier::ALL[1].label(),
        Tier::ALL[2].label(),
    ];

    fn parse(v: Option<&Value>) -> Result<Medium, DecodeError> {
        match v {
            None | Some(Value::Nil) => Ok(Medium::Gpu),
            Some(Value::String(s)) => match s.as_str() {
                Some(m) => Ok(Medium::named(m)),
                None => Err(DecodeError::field("medium", "a UTF-8 string")),
            },
            Some(_) => Err(DecodeError::field("medium", "a string or nil")),
        }
    }

    /// The medium an engine's name for it stands for.
    pub(crate) fn named(m: &str) -> Medium {
        const GPU: [&str; 4] = ["", "gpu", "device", "cuda"];
        const CPU: [&str; 3] = ["cpu", "cpu_pinned", "cpu_tier1"];
        const STORAGE: [&str; 8] = [
            "cpu_tier2",
            "disk",
            "nvme",
            "storage",
            "external",
            "network",
            "remote",
            "shared",
        ];
        let is = |names: &[&str]| names.iter().any(|n| m.eq_ignore_ascii_case(n));
        if is(&GPU) {
            Medium::Gpu
        } else if is(&CPU) {
            Medium::Cpu
        } else if is(&STORAGE) {
            Medium::Storage
        } else {
            Medium::Unknown
        }
    }

    /// The tier its blocks are credited to; None for an unknown medium.
    pub fn tier(self) -> Option<Tier> {
        match self {
            Medium::Gpu => Some(Tier::Gpu),
            Medium::Cpu => Some(Tier::Cpu),
            Medium::Storage => Some(Tier::Storage),
            Medium::Unknown => None,
        }
    }
}

/// Where the publisher says a block is, relative to itself (vLLM 0.34's `locality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Locality {
    /// `LOCAL`, or not said.
    Local,
    /// `REMOTE`: held elsewhere, not loadable as this worker's own.
    Remote,
    /// A value no engine documents: taken as not local.
    Unknown,
}

impl Locality {
    fn parse(v: Option<&Value>) -> Result<Locality, DecodeError> {
        match v {
            None | Some(Value::Nil) => Ok(Locality::Local),
            Some(Value::String(s)) => Ok(s.as_str().map_or(Locality::Unknown, Locality::named)),
            Some(_) => Err(DecodeError::field("locality", "a string or nil")),
        }
    }

    pub(crate) fn named(s: &str) -> Locality {
        if s.eq_ignore_ascii_case("local") {
            Locality::Local
        } else if s.eq_ignore_ascii_case("remote") {
            Locality::Remote
        } else {
            Locality::Unknown
        }
    }
}

/// vLLM 0.34's `ownership`: set when a secondary offloading tier stored or removed the
/// block (None: the engine's own tiers).
fn secondary(v: Option<&Value>) -> Result<bool, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(false),
        Some(Value::String(_)) => Ok(true),
        Some(_) => Err(DecodeError::field("ownership", "a string or nil")),
    }
}

/// `BlockStored`: engine blocks `block_hashes` (each `block_size` tokens, in order)
/// follow `parent` (None: they start the prompt) and hold `token_ids`. A store with no
/// tokens (block size 0) is a placeholder: a copy of blocks already known by hash
/// (vLLM's offloading connector without `self_describing_kv_events`).
///
/// Not kept: `session_id` (the request that stored it: no bearing on who can reuse it)
/// and `lookahead_token_ids` (tokens past each block that vLLM's hash takes in when
/// lookahead hashing is on; kvix chains the block's own tokens, so a prompt that matches
/// a block but not the tokens after it scores that block where the engine would not:
/// at most one block more, at the end of the match).
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    /// Per block, the extra keys the engine hashed into it besides its tokens (vLLM's
    /// multimodal items and prompt-embedding digests); empty when there are none. The
    /// LoRA name and the cache salt are not in here.
    pub extras: Vec<Vec<ExtraKey>>,
    /// The request's cache salt: SGLang's `cache_salt`, or the text extra key vLLM
    /// gives the first block of a salted prompt.
    pub cache_salt: Option<String>,
    pub group_idx: u32,
    pub spec_kind: Option<String>,
    pub sliding_window: Option<u32>,
    pub locality: Locality,
    /// Stored by a secondary offloading tier (`ownership` set).
    pub secondary: bool,
}

impl Stored {
    /// A GPU store of group 0 with no LoRA, salt, extra keys or lane kind: what an engine
    /// without those features sends.
    pub fn plain(
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extras: Vec::new(),
            cache_salt: None,
            group_idx: 0,
            spec_kind: None,
            sliding_window: None,
            locality: Locality::Local,
            secondary: false,
        }
    }

    /// A placeholder: blocks named by hash alone (no tokens, no parent).
    pub fn is_placeholder(&self) -> bool {
        self.block_size == 0
    }
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq)]
pub struct Removed {
    pub block_hashes: Vec<u64>,
    pub medium: Medium,
    pub group_idx: u32,
    pub locality: Locality,
    pub secondary: bool,
}

impl Removed {
    /// A removal from the engine's own `medium`, on this worker.
    pub fn new(block_hashes: Vec<u64>, medium: Medium, group_idx: u32) -> Self {
        Removed {
            block_hashes,
            medium,
            group_idx,
            locality: Locality::Local,
            secondary: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed(Removed),
    /// `AllBlocksCleared`.
    Cleared,
    /// An event type this decoder does not know (its tag).
    Unknown(String),
}

/// One decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    pub dp_rank: u32,
}

/// Why a payload is not a vLLM event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("{0} trailing bytes after the payload")]
    Trailing(usize),
    #[error("the batch is {0}, expected an array or a map")]
    BatchShape(&'static str),
    #[error("event {index}: {what}")]
    Event {
        index: usize,
        what: Box<DecodeError>,
    },
    #[error("event is {0}, expected a tagged array or a map with \"type\"")]
    EventShape(&'static str),
    #[error("missing field {0}")]
    Missing(&'static str),
    #[error("field {field} must be {want}")]
    Field {
        field: &'static str,
        want: &'static str,
    },
    #[error("{field}[{index}] must be {want}")]
    Item {
        field: &'static str,
        index: usize,
        want: &'static str,
    },
}

impl DecodeError {
    fn field(field: &'static str, want: &'static str) -> Self {
        DecodeError::Field { field, want }
    }
}

/// Decodes one payload (the third frame of a PUB message, or a replayed one).
pub fn decode(payload: &[u8]) -> Result<Batch, DecodeError> {
    // The engines' common shapes without a tree; the rest (and every error) here.
    if let Some(batch) = crate::known::batch(payload) {
        return Ok(batch);
    }
    decode_general(payload)
}

/// Both readers of one payload: the tree-less reader's batch, where it takes the
/// payload, and the general reader's result. For the fuzz target
/// (`server/events/fuzz`), which checks that they agree wherever the first answers.
#[doc(hidden)]
pub fn both_readers(payload: &[u8]) -> (Option<Batch>, Result<Batch, DecodeError>) {
    (crate::known::batch(payload), decode_general(payload))
}

/// [`decode`] through the `Value` tree, whatever the payload.
fn decode_general(payload: &[u8]) -> Result<Batch, DecodeError> {
    let (read, rest) = msgpack::read(payload, MAX_DEPTH).map_err(DecodeError::Msgpack)?;
    if !rest.is_empty() {
        return Err(DecodeError::Trailing(rest.len()));
    }
    batch(&read.value, read.aside)
}

fn shape(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "binary",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// Fields of a struct encoded either positionally or by name.
enum Fields<'a> {
    /// Positional values after the tag (if any).
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// The field at `pos` (array form) or named `name` (map form); absent or past the
    /// end = None.
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(items) => items.get(pos),
            Fields::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        }
    }

    fn required(&self, pos: usize, name: &'static str) -> Result<&'a Value, DecodeError> {
        self.get(pos, name).ok_or(DecodeError::Missing(name))
    }
}

/// The batch in `v`; `aside` holds what its events' token ids and hashes were read into.
fn batch(v: &Value, mut aside: Vec<Aside>) -> Result<Batch, DecodeError> {
    let fields = match v {
        Value::Array(items) => Fields::Array(items),
        Value::Map(pairs) => Fields::Map(pairs),
        other => return Err(DecodeError::BatchShape(shape(other))),
    };
    let ts = match fields.required(0, "ts")? {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or_default(),
        _ => return Err(DecodeError::field("ts", "a number")),
    };
    // A restart is told by a later ts: NaN or infinity would hide every one after it.
    if !ts.is_finite() {
        return Err(DecodeError::field("ts", "a finite number"));
    }
    let Value::Array(raw) = fields.required(1, "events")? else {
        return Err(DecodeError::field("events", "an array"));
    };
    let rank = fields
        .get(2, "data_parallel_rank")
        .or_else(|| fields.get(usize::MAX, "attn_dp_rank"));
    let dp_rank = match rank {
        None | Some(Value::Nil) => 0,
        Some(v) => v
            .as_u64()
            .filter(|r| *r <= u64::from(MAX_DP_RANK))
            .ok_or(DecodeError::field(
                "data_parallel_rank",
                "nil or an integer in 0..=1023",
            ))? as u32,
    };
    let events = raw
        .iter()
        .enumerate()
        .map(|(index, e)| {
            let read = aside.get_mut(index).map(std::mem::take).unwrap_or_default();
            event(e, read).map_err(|what| DecodeError::Event {
                index,
                what: Box::new(what),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Batch {
        ts,
        events,
        dp_rank,
    })
}

fn event(v: &Value, aside: Aside) -> Result<EngineEvent, DecodeError> {
    let (tag, fields) = match v {
        Value::Array(items) => match items.split_first() {
            Some((Value::String(tag), rest)) => (tag.as_str(), Fields::Array(rest)),
            _ => return Err(DecodeError::EventShape("an array without a string tag")),
        },
        Value::Map(pairs) => {
            let tag = pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .map(|(_, v)| v.as_str());
            match tag {
                Some(Some(t)) => (Some(t), Fields::Map(pairs)),
                _ => return Err(DecodeError::EventShape("a map without a string \"type\"")),
            }
        }
        other => return Err(DecodeError::EventShape(shape(other))),
    };
    let tag = tag.ok_or(DecodeError::EventShape("tagged with invalid UTF-8"))?;
    match tag {
        "BlockStored" => stored(&fields, aside).map(EngineEvent::Stored),
        "BlockRemoved" => Ok(EngineEvent::Removed(Removed {
            block_hashes: hashes(fields.required(0, "block_hashes")?, aside.hashes)?,
            medium: Medium::parse(fields.get(1, "medium"))?,
            group_idx: opt_u32(fields.get(2, "group_idx"), "group_idx")?.unwrap_or(0),
            locality: Locality::parse(fields.get(3, "locality"))?,
            secondary: secondary(fields.get(4, "ownership"))?,
        })),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.to_string())),
    }
}

fn stored(f: &Fields<'_>, aside: Aside) -> Result<Stored, DecodeError> {
    let parent = match f.required(1, "parent_block_hash")? {
        Value::Nil => None,
        v => Some(hash_key(v).ok_or(DecodeError::field(
            "parent_block_hash",
            "nil, an integer or raw bytes",
        ))?),
    };
    // Token ids are read aside in the one pass (msgpack.rs) wherever they are an array.
    let ids = match (f.required(2, "token_ids")?, aside.tokens) {
        (Value::Array(_), Some(ids)) => ids,
        _ => return Err(DecodeError::field("token_ids", "an array")),
    };
    let token_ids = ids.map_err(|index| DecodeError::Item {
        field: "token_ids",
        index,
        want: "an integer in 0..2^32 or a pair of them",
    })?;
    // Block size 0 only for a placeholder, which carries no tokens.
    let block_size = opt_u32(Some(f.required(3, "block_size")?), "block_size")?
        .filter(|b| *b > 0 || token_ids.is_empty())
        .ok_or(DecodeError::field(
            "block_size",
            "a positive integer (0 only without token_ids)",
        ))?;
    let lora_id = match f.get(4, "lora_id") {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or(DecodeError::field("lora_id", "nil or an integer"))?,
        ),
    };
    let lora_name = match f.get(6, "lora_name") {
        None | Some(Value::Nil) => None,
        Some(Value::String(s)) => Some(
            s.as_str()
                .ok_or(DecodeError::field("lora_name", "UTF-8"))?
                .to_string(),
        ),
        Some(_) => return Err(DecodeError::field("lora_name", "nil or a string")),
    };
    let block_hashes = hashes(f.required(0, "block_hashes")?, aside.hashes)?;
    let (extras, vllm_salt) = extra_keys(
        f.get(7, "extra_keys"),
        block_hashes.len(),
        lora_name.as_deref(),
        parent.is_none(),
    )?;
    let cache_salt = match f.get(usize::MAX, "cache_salt") {
        None | Some(Value::Nil) => vllm_salt,
        Some(Value::String(s)) => Some(
            s.as_str()
                .ok_or(DecodeError::field("cache_salt", "UTF-8"))?
                .to_string(),
        ),
        Some(_) => return Err(DecodeError::field("cache_salt", "nil or a string")),
    };
    let spec_kind = match f.get(9, "kv_cache_spec_kind") {
        None | Some(Value::Nil) => None,
        Some(Value::String(s)) => Some(
            s.as_str()
                .ok_or(DecodeError::field("kv_cache_spec_kind", "UTF-8"))?
                .to_string(),
        ),
        Some(_) => return Err(DecodeError::field("kv_cache_spec_kind", "nil or a string")),
    };
    Ok(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_id,
        medium: Medium::parse(f.get(5, "medium"))?,
        lora_name,
        extras,
        cache_salt,
        group_idx: opt_u32(f.get(8, "group_idx"), "group_idx")?.unwrap_or(0),
        spec_kind,
        sliding_window: opt_u32(
            f.get(10, "kv_cache_spec_sliding_window"),
            "kv_cache_spec_sliding_window",
        )?,
        locality: Locality::parse(f.get(11, "locality"))?,
        secondary: secondary(f.get(12, "ownership"))?,
    })
}

/// vLLM's `extra_keys`: one entry per block, nil or the block's keys untagged (a LoRA
/// name, `[mm_identifier, offset]` for a multimodal item, the cache salt as text on the
/// first block of a prompt, a prompt-embedding digest as bytes). Returns the keys per
/// block without the LoRA name and the salt, and the salt. More entries than the
/// store's `blocks` are refused (the keys are kept with the batch until it is applied).
fn extra_keys(
    v: Option<&Value>,
    blocks: usize,
    lora_name: Option<&str>,
    starts_prompt: bool,
) -> Result<(Vec<Vec<ExtraKey>>, Option<String>), DecodeError> {
    let entries = match v {
        None | Some(Value::Nil) => return Ok((Vec::new(), None)),
        Some(Value::Array(a)) if a.len() <= blocks => a,
        Some(Value::Array(_)) => {
            return Err(DecodeError::field(
                "extra_keys",
                "at most one entry per block hash",
            ))
        }
        Some(_) => return Err(DecodeError::field("extra_keys", "nil or an array")),
    };
    let mut salt = None;
    let mut out = Vec::with_capacity(entries.len());
    for (block, entry) in entries.iter().enumerate() {
        let keys = match entry {
            Value::Nil => &[][..],
            Value::Array(keys) => &keys[..],
            _ => {
                return Err(DecodeError::Item {
                    field: "extra_keys",
                    index: block,
                    want: "nil or an array of keys",
                })
            }
        };
        let mut mine = Vec::new();
        for key in keys {
            match key {
                Value::String(t) => match t.as_str() {
                    Some(t) if Some(t) == lora_name => {}
                    Some(t) if block == 0 && starts_prompt && salt.is_none() => {
                        salt = Some(t.to_string())
                    }
                    Some(t) => mine.push(ExtraKey::Text(t.to_string())),
                    None => mine.push(ExtraKey::Bytes(t.as_bytes().to_vec())),
                },
                Value::Array(mm) if mm.len() == 2 && mm[1].as_i64().is_some() => {
                    let identifier = match &mm[0] {
                        Value::String(s) => s.as_str().unwrap_or_default().to_string(),
                        other => other.to_string(),
                    };
                    mine.push(ExtraKey::Multimodal {
                        identifier,
                        offset: mm[1].as_i64().unwrap_or_default(),
                    })
                }
                Value::Binary(b) => mine.push(ExtraKey::Bytes(b.clone())),
                Value::Integer(i) => mine.push(ExtraKey::Int(
                    i.as_i64()
                        .unwrap_or_else(|| i.as_u64().unwrap_or_default() as i64),
                )),
                other => mine.push(ExtraKey::Text(other.to_string())),
            }
        }
        out.push(mine);
    }
    if out.iter().all(Vec::is_empty) {
        out = Vec::new();
    }
    Ok((out, salt))
}

fn opt_u32(v: Option<&Value>, field: &'static str) -> Result<Option<u32>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(DecodeError::field(field, "nil or an integer in 0..2^32")),
    }
}

/// An event's block hashes: read aside in the one pass (msgpack.rs) wherever they are
/// an array.
fn hashes(v: &Value, aside: Option<Hashes>) -> Result<Vec<u64>, DecodeError> {
    let field = "block_hashes";
    match (v, aside) {
        (Value::Array(_), Some(hashes)) => hashes.map_err(|index| DecodeError::Item {
            field,
            index,
            want: "an integer or raw bytes",
        }),
        _ => Err(DecodeError::field(field, "an array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn stored_array(trailing: usize) -> Value {
        let all = vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(7u64), Value::from(-3i64)]),
            Value::Nil,
            Value::Array((0..8u32).map(Value::from).collect()),
            Value::from(4u32),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Nil,
            Value::from(1u32),
            s("sliding_window"),
            Value::from(128u32),
        ];
        Value::Array(all[..5 + trailing].to_vec())
    }

    #[test]
    fn array_encoding_with_and_without_trailing_defaults() {
        for trailing in 0..=7 {
            let batch = Value::Array(vec![
                Value::F64(1.5),
                Value::Array(vec![stored_array(trailing)]),
            ]);
            let b = decode(&enc(&batch)).unwrap();
            assert_eq!(b.dp_rank, 0);
            let EngineEvent::Stored(st) = &b.events[0] else {
                panic!("{b:?}")
            };
            assert_eq!(st.block_hashes, vec![7, (-3i64) as u64]);
            assert_eq!(st.parent, None);
            assert_eq!(st.token_ids, (0..8).collect::<Vec<_>>());
            assert_eq!(st.block_size, 4);
            assert_eq!(st.medium, Medium::Gpu);
            assert_eq!(st.group_idx, if trailing >= 5 { 1 } else { 0 });
            assert_eq!(
                st.sliding_window,
                if trailing >= 7 { Some(128) } else { None }
            );
        }
    }

    #[test]
    fn map_encoding_at_both_levels_and_mixed() {
        let ev = map(vec![
            ("type", s("BlockStored")),
            (
                "block_hashes",
                Value::Array(vec![Value::Binary(vec![0xab; 32])]),
            ),
            ("parent_block_hash", Value::from(u64::MAX)),
            ("token_ids", Value::Array(vec![Value::from(1u32); 4])),
            ("block_size", Value::from(4u32)),
            ("medium", s("CPU")),
            ("lora_name", s("ad")),
            ("group_idx", Value::from(2u32)),
            ("kv_cache_spec_kind", s("full_attention")),
            ("some_future_field", Value::from(true)),
        ]);
        let removed = Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(vec![Value::from(5u64)]),
        ]);
        let cleared = map(vec![("type", s("AllBlocksCleared"))]);
        let batch = map(vec![
            ("ts", Value::F32(2.0)),
            ("events", Value::Array(vec![ev, removed, cleared])),
            ("data_parallel_rank", Value::from(3u32)),
        ]);
        let b = decode(&enc(&batch)).unwrap();
        assert_eq!(b.dp_rank, 3);
        assert_eq!(b.ts, 2.0);
        let EngineEvent::Stored(st) = &b.events[0] else {
            panic!()
        };
        assert_eq!(st.block_hashes, vec![bytes_key(&[0xab; 32])]);
        assert_eq!(st.parent, Some(u64::MAX));
        assert_eq!(st.medium, Medium::Cpu);
        assert_eq!(st.lora_name.as_deref(), Some("ad"));
        assert_eq!(st.group_idx, 2);
        assert_eq!(st.spec_kind.as_deref(), Some("full_attention"));
        assert_eq!(
            b.events[1],
            EngineEvent::Removed(Removed::new(vec![5], Medium::Gpu, 0))
        );
        assert_eq!(b.events[2], EngineEvent::Cleared);
    }

    #[test]
    fn extra_keys_split_into_lora_salt_and_block_keys_and_bigrams_keep_the_token() {
        // vLLM 0.34's untagged keys as observed: LoRA name, image, salt on block 0.
        let keys = Value::Array(vec![
            Value::Array(vec![
                s("ad"),
                Value::Array(vec![s("mm-abc"), Value::from(-2)]),
                s("salt-1"),
            ]),
            Value::Nil,
            Value::Array(vec![Value::Binary(vec![9; 32])]),
        ]);
        let ev = |parent: Value, keys: Value| {
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(1u32); 3])),
                ("parent_block_hash", parent),
                ("token_ids", Value::Array(vec![Value::from(1u32); 6])),
                ("block_size", Value::from(2u32)),
                ("lora_id", Value::Nil),
                ("medium", Value::Nil),
                ("lora_name", s("ad")),
                ("extra_keys", keys),
            ])
        };
        let one = |e: Value| {
            let b = decode(&enc(&Value::Array(vec![
                Value::F64(0.0),
                Value::Array(vec![e]),
            ])))
            .unwrap();
            match b.events.into_iter().next() {
                Some(EngineEvent::Stored(st)) => st,
                other => panic!("{other:?}"),
            }
        };
        let st = one(ev(Value::Nil, keys.clone()));
        assert_eq!(st.cache_salt.as_deref(), Some("salt-1"));
        assert_eq!(
            st.extras,
            vec![
                vec![ExtraKey::Multimodal {
                    identifier: "mm-abc".into(),
                    offset: -2
                }],
                vec![],
                vec![ExtraKey::Bytes(vec![9; 32])],
            ]
        );
        // Continuing a prompt, a text key is not a salt (vLLM salts block 0 only).
        let st = one(ev(Value::from(5u32), keys.clone()));
        assert_eq!(st.cache_salt, None);
        assert!(st.extras[0].contains(&ExtraKey::Text("salt-1".into())));
        // SGLang: cache_salt as a field, and bigram token pairs.
        let sg = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(-7i64)])),
            ("parent_block_hash", Value::Nil),
            (
                "token_ids",
                Value::Array(vec![
                    Value::Array(vec![Value::from(4u32), Value::from(5u32)]),
                    Value::Array(vec![Value::from(5u32), Value::from(6u32)]),
                ]),
            ),
            ("block_size", Value::from(2u32)),
            ("lora_id", Value::Nil),
            ("cache_salt", s("tenant")),
        ]);
        let st = one(sg);
        assert_eq!(st.token_ids, vec![4, 5]);
        assert_eq!(st.cache_salt.as_deref(), Some("tenant"));
        assert!(st.extras.is_empty());
        // More entries than blocks (keys a batch would carry to its apply for nothing).
        let Value::Array(mut four) = keys else {
            unreachable!()
        };
        four.push(Value::Nil);
        let batch = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![ev(Value::Nil, Value::Array(four))]),
        ]);
        assert!(matches!(
            decode(&enc(&batch)),
            Err(DecodeError::Event { index: 0, .. })
        ));
    }

    #[test]
    fn signed_and_unsigned_ints_of_the_same_bits_are_one_key() {
        assert_eq!(
            hash_key(&Value::from(-1i64)),
            hash_key(&Value::from(u64::MAX))
        );
        assert_eq!(hash_key(&Value::from(42u8)), Some(42));
        assert_eq!(hash_key(&Value::Binary(vec![])), None);
        assert_eq!(hash_key(&s("x")), None);
    }

    #[test]
    fn unknown_events_are_kept_for_counting_not_errors() {
        let batch = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![s("BlockPinned"), Value::Nil])]),
            Value::Nil,
        ]);
        assert_eq!(
            decode(&enc(&batch)).unwrap().events,
            vec![EngineEvent::Unknown("BlockPinned".into())]
        );
    }

    #[test]
    fn one_bad_event_fails_the_whole_batch() {
        let good = stored_array(2);
        let bad = Value::Array(vec![s("BlockStored"), s("not-a-list")]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![good, bad])]);
        assert!(matches!(
            decode(&enc(&batch)),
            Err(DecodeError::Event { index: 1, .. })
        ));
    }

    #[test]
    fn typed_errors_for_bad_fields() {
        let with = |ev: Value| Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])]);
        let mut tokens_neg = stored_array(0);
        if let Value::Array(a) = &mut tokens_neg {
            a[3] = Value::Array(vec![Value::from(-1i64)]);
        }
        assert!(decode(&enc(&with(tokens_neg))).is_err());
        let mut zero_block = stored_array(0);
        if let Value::Array(a) = &mut zero_block {
            a[4] = Value::from(0u32);
        }
        assert!(decode(&enc(&with(zero_block))).is_err());
        // Missing required fields.
        let short = Value::Array(vec![s("BlockStored"), Value::Array(vec![])]);
        assert_eq!(
            decode(&enc(&with(short))),
            Err(DecodeError::Event {
                index: 0,
                what: Box::new(DecodeError::Missing("parent_block_hash"))
            })
        );
        assert!(matches!(
            decode(&enc(&Value::from(3u8))),
            Err(DecodeError::BatchShape(_))
        ));
        let mut trailing = enc(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
        trailing.push(0xc0);
        assert_eq!(decode(&trailing), Err(DecodeError::Trailing(1)));
        assert!(matches!(
            decode(&[0xc1]),
            Err(DecodeError::Msgpack(_)) | Err(DecodeError::BatchShape(_))
        ));
        let rank = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![]),
            Value::from(5000u32),
        ]);
        assert!(decode(&enc(&rank)).is_err());
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let mut bytes = vec![0x91u8; 100_000];
        bytes.push(0xc0);
        assert!(decode(&bytes).is_err());
    }

    fn arb_hash() -> impl Strategy<Value = (Value, u64)> {
        prop_oneof![
            any::<u64>().prop_map(|h| (Value::from(h), h)),
            any::<i64>().prop_map(|h| (Value::from(h), h as u64)),
            proptest::collection::vec(any::<u8>(), 32).prop_map(|b| {
                let k = bytes_key(&b);
                (Value::Binary(b), k)
            }),
        ]
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn mutated_payloads_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let batch = Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![stored_array(7), stored_array(3)]),
                Value::from(1u32),
            ]);
            let mut bytes = enc(&batch);
            for (at, b) in flips {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            bytes.truncate(cut % (bytes.len() + 1));
            let _ = decode(&bytes);
        }

        #[test]
        fn stores_round_trip_in_both_encodings(
            hashes in proptest::collection::vec(arb_hash(), 0..6),
            parent in proptest::option::of(arb_hash()),
            tokens in proptest::collection::vec(any::<u32>(), 0..40),
            block_size in 1u32..64,
            group in 0u32..4,
            rank in 0u32..8,
            as_map in any::<bool>(),
            medium in prop_oneof![Just(None), Just(Some("GPU")), Just(Some("CPU")), Just(Some("DISK"))],
        ) {
            let hv = Value::Array(hashes.iter().map(|(v, _)| v.clone()).collect());
            let pv = parent.as_ref().map_or(Value::Nil, |(v, _)| v.clone());
            let tv = Value::Array(tokens.iter().map(|t| Value::from(*t)).collect());
            let mv = medium.map_or(Value::Nil, Value::from);
            let (ev, batch) = if as_map {
                let ev = map(vec![
                    ("type", s("BlockStored")), ("block_hashes", hv), ("parent_block_hash", pv),
                    ("token_ids", tv), ("block_size", Value::from(block_size)),
                    ("medium", mv), ("group_idx", Value::from(group)),
                ]);
                let b = map(vec![("ts", Value::F64(0.0)), ("events", Value::Array(vec![ev.clone()])),
                    ("data_parallel_rank", Value::from(rank))]);
                (ev, b)
            } else {
                let ev = Value::Array(vec![s("BlockStored"), hv, pv, tv, Value::from(block_size),
                    Value::Nil, mv, Value::Nil, Value::Nil, Value::from(group)]);
                let b = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev.clone()]), Value::from(rank)]);
                (ev, b)
            };
            let _ = ev;
            let b = decode(&enc(&batch)).unwrap();
            prop_assert_eq!(b.dp_rank, rank);
            let EngineEvent::Stored(st) = &b.events[0] else { panic!() };
            prop_assert_eq!(&st.block_hashes, &hashes.iter().map(|(_, k)| *k).collect::<Vec<_>>());
            prop_assert_eq!(st.parent, parent.map(|(_, k)| k));
            prop_assert_eq!(&st.token_ids, &tokens);
            prop_assert_eq!(st.block_size, block_size);
            prop_assert_eq!(st.group_idx, group);
            let want = match medium { None | Some("GPU") => Medium::Gpu, Some("CPU") => Medium::Cpu, _ => Medium::Storage };
            prop_assert_eq!(st.medium, want);
        }
    }

    /// A field value: what engines send there, or something else.
    fn arb_field(good: Value) -> impl Strategy<Value = Value> {
        prop_oneof![
            24 => Just(good),
            1 => Just(Value::Nil),
            1 => any::<i64>().prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => ".{0,6}".prop_map(Value::from),
            1 => proptest::collection::vec(any::<u8>(), 0..70).prop_map(Value::Binary),
            1 => Just(Value::Array(vec![Value::from(1u8), Value::from(2u8)])),
        ]
    }

    /// Events as engines send them (tagged arrays and maps), with any field now and then
    /// something else, keys dropped, doubled or unknown.
    fn arb_event() -> impl Strategy<Value = Value> {
        let hashes = proptest::collection::vec(arb_hash(), 0..5)
            .prop_map(|h| Value::Array(h.into_iter().map(|(v, _)| v).collect()));
        let tokens = proptest::collection::vec(
            prop_oneof![
                200 => any::<u32>().prop_map(Value::from),
                1 => (0u64..1 << 40).prop_map(Value::from)
            ],
            0..40,
        )
        .prop_map(Value::Array);
        let tag = prop_oneof![
            4 => Just("BlockStored"),
            2 => Just("BlockRemoved"),
            1 => Just("AllBlocksCleared"),
            1 => Just("Other")
        ];
        (
            tag,
            hashes.prop_flat_map(arb_field),
            prop_oneof![Just(Value::Nil), arb_hash().prop_map(|(v, _)| v)].prop_flat_map(arb_field),
            tokens.prop_flat_map(arb_field),
            arb_field(Value::from(16u32)),
            prop_oneof![Just(Value::Nil), any::<i64>().prop_map(Value::from)]
                .prop_flat_map(arb_field),
            prop_oneof![Just("GPU"), Just("cpu"), Just("CUDA"), Just("DISK")]
                .prop_flat_map(|m| arb_field(Value::from(m))),
            arb_field(Value::Nil),
            arb_field(Value::from(1u32)),
            (
                any::<bool>(),
                prop_oneof![3 => Just(16usize), 1 => 0usize..16],
                proptest::bool::weighted(0.15),
                proptest::bool::weighted(0.15),
            ),
            (
                prop_oneof![
                    Just(Value::Nil),
                    Just(s("LOCAL")),
                    Just(s("REMOTE")),
                    Just(s("x"))
                ]
                .prop_flat_map(arb_field),
                prop_oneof![3 => Just(Value::Nil), 1 => Just(s("kvcr"))].prop_flat_map(arb_field),
            ),
        )
            .prop_map(
                |(tag, h, p, t, b, lora, m, lname, g, (as_map, keep, twice, odd), (loc, own))| {
                    let fields: Vec<(&str, Value)> = match tag {
                        "BlockRemoved" => vec![
                            ("block_hashes", h),
                            ("medium", m),
                            ("group_idx", g),
                            ("locality", loc),
                            ("ownership", own),
                        ],
                        "AllBlocksCleared" | "Other" => vec![],
                        _ => vec![
                            ("block_hashes", h),
                            ("parent_block_hash", p),
                            ("token_ids", t),
                            ("block_size", b),
                            ("lora_id", lora),
                            ("medium", m),
                            ("lora_name", lname),
                            ("extra_keys", Value::Nil),
                            ("group_idx", g),
                            ("kv_cache_spec_kind", Value::Nil),
                            ("kv_cache_spec_sliding_window", Value::Nil),
                            ("locality", loc),
                            ("ownership", own),
                        ],
                    };
                    let keep = keep.min(fields.len());
                    if as_map {
                        let mut pairs = vec![(s("type"), s(tag))];
                        pairs.extend(fields.iter().take(keep).map(|(k, v)| (s(k), v.clone())));
                        if twice {
                            if let Some((k, v)) = fields.first() {
                                pairs.push((s(k), v.clone()));
                            }
                        }
                        if odd {
                            pairs.push((s("odd"), Value::Nil));
                        }
                        Value::Map(pairs)
                    } else {
                        let mut items = vec![s(tag)];
                        items.extend(fields.into_iter().take(keep).map(|(_, v)| v));
                        if odd {
                            items.push(Value::Nil);
                        }
                        Value::Array(items)
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Where the tree-less reader (known.rs) gives a batch, it is the one the general
        /// reader gives: engine-shaped batches with odd fields, keys and ranks, and the
        /// same bytes broken.
        #[test]
        fn the_treeless_reader_agrees_with_the_general_one(
            events in proptest::collection::vec(arb_event(), 1..4),
            ts in prop_oneof![3 => Just(Value::F64(2.5)), 1 => Just(Value::F64(f64::NAN)), 1 => Just(Value::from(-3i64)), 1 => Just(Value::F32(1.5))],
            rank in prop_oneof![1 => Just(Value::Nil), 3 => (0u64..1100).prop_map(Value::from), 1 => Just(Value::from(-1i64))],
            fields in prop_oneof![4 => Just(3usize), 1 => 1usize..5],
            flips in prop_oneof![
                3 => Just(Vec::new()),
                1 => proptest::collection::vec((any::<usize>(), any::<u8>()), 1..3)
            ],
            tail in prop_oneof![3 => Just(Vec::new()), 1 => proptest::collection::vec(any::<u8>(), 1..2)],
        ) {
            let items = [ts, Value::Array(events), rank, Value::Nil];
            let mut bytes = enc(&Value::Array(items[..fields].to_vec()));
            for (at, b) in flips {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            bytes.extend_from_slice(&tail);
            if let Some(fast) = crate::known::batch(&bytes) {
                prop_assert_eq!(Some(fast), decode_general(&bytes).ok());
            }
        }

        /// What a plain engine publishes (vLLM 0.34's encoding: `encode::vllm_batch`)
        /// takes the tree-less reader, whole.
        #[test]
        fn plain_batches_take_the_treeless_reader(
            stores in proptest::collection::vec(
                (proptest::collection::vec(any::<u64>(), 1..5), proptest::option::of(any::<u64>()), 1u32..4, 0u32..3, any::<bool>(), proptest::option::of(any::<i64>())),
                0..4,
            ),
            removed in proptest::collection::vec(any::<u64>(), 0..4),
            rank in 0u32..8,
        ) {
            let mut events: Vec<EngineEvent> = stores
                .into_iter()
                .map(|(hashes, parent, block, group, cpu, lora_id)| {
                    let tokens = (0..hashes.len() as u32 * block).collect();
                    let mut st = Stored::plain(hashes, parent, tokens, block);
                    st.group_idx = group;
                    st.lora_id = lora_id;
                    if cpu {
                        st.medium = Medium::Cpu;
                    }
                    EngineEvent::Stored(st)
                })
                .collect();
            events.push(EngineEvent::Removed(Removed::new(removed, Medium::Gpu, 0)));
            events.push(EngineEvent::Cleared);
            let batch = Batch { ts: 7.25, events, dp_rank: rank };
            let bytes = crate::encode::vllm_batch(&batch);
            prop_assert_eq!(crate::known::batch(&bytes), Some(batch.clone()));
            prop_assert_eq!(decode_general(&bytes), Ok(batch));
        }
    }
}
