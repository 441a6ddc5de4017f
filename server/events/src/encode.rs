//! The other direction: a [`Batch`] as vLLM 0.34's `ZmqEventPublisher` encodes it, for
//! mock engines (`kvix-bench fleet`) that must look to kvix exactly like a real one.
//!
//! msgspec writes `KVEventBatch` `array_like` (`[ts, events, data_parallel_rank]`, the
//! rank always present once published) and each event as a map tagged `"type"`, its
//! fields in declaration order, the required ones always (nil when None), the defaulted
//! ones only when set. Ints take msgpack's smallest form, `ts` a float64. A test in
//! `server/tests/engines.rs` checks the bytes against the real publisher's.
//!
//! Only what a plain engine sends is written: no LoRA, extra keys or cache salt (their
//! fields are left out or nil), group and lane kind only when not the defaults.

use rmp::encode;

use crate::payload::{Batch, EngineEvent, Locality, Medium, Removed, Stored};

/// The payload (third frame) of one published batch.
pub fn vllm_batch(batch: &Batch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    // Writing into a Vec cannot fail.
    let w = &mut out;
    encode::write_array_len(w, 3).unwrap();
    encode::write_f64(w, batch.ts).unwrap();
    encode::write_array_len(w, batch.events.len() as u32).unwrap();
    for ev in &batch.events {
        match ev {
            EngineEvent::Stored(s) => stored(w, s),
            EngineEvent::Removed(r) => removed(w, r),
            EngineEvent::Cleared => {
                map_header(w, 1, 1);
                str(w, "type");
                str(w, "AllBlocksCleared");
            }
            EngineEvent::Unknown(tag) => {
                map_header(w, 1, 1);
                str(w, "type");
                str(w, tag);
            }
        }
    }
    uint(w, u64::from(batch.dp_rank));
    out
}

fn str(w: &mut Vec<u8>, s: &str) {
    encode::write_str(w, s).unwrap();
}

fn medium(w: &mut Vec<u8>, m: Medium) {
    str(
        w,
        match m {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Unknown => "FS",
        },
    );
}

/// `locality` and `ownership` where they are not the defaults (a secondary tier is
/// written as `"secondary"`).
fn whereabouts(w: &mut Vec<u8>, locality: Locality, secondary: bool) {
    if locality != Locality::Local {
        str(w, "locality");
        str(
            w,
            if locality == Locality::Remote {
                "REMOTE"
            } else {
                "ELSEWHERE"
            },
        );
    }
    if secondary {
        str(w, "ownership");
        str(w, "secondary");
    }
}

fn whereabouts_set(locality: Locality, secondary: bool) -> u32 {
    u32::from(locality != Locality::Local) + u32::from(secondary)
}

/// msgspec sizes a struct's map header for all its fields and the tag, whatever it
/// omits: map16 for `BlockStored` (15 fields and the tag), a fixmap for the others.
fn map_header(w: &mut Vec<u8>, len: u32, fields: u32) {
    if fields < 16 {
        encode::write_map_len(w, len).unwrap();
    } else {
        w.push(0xde);
        w.extend_from_slice(&(len as u16).to_be_bytes());
    }
}

/// The fields of vLLM 0.34's events, with the tag.
const STORED_FIELDS: u32 = 16;
const REMOVED_FIELDS: u32 = 6;

fn uint(w: &mut Vec<u8>, v: u64) {
    encode::write_uint(w, v).unwrap();
}

fn hashes(w: &mut Vec<u8>, hs: &[u64]) {
    encode::write_array_len(w, hs.len() as u32).unwrap();
    for &h in hs {
        uint(w, h);
    }
}

/// The defaulted fields a store or removal carries: group_idx, and for a store its
/// lane kind and window.
fn defaulted(s: &Stored) -> u32 {
    u32::from(s.group_idx != 0)
        + u32::from(s.spec_kind.is_some())
        + u32::from(s.sliding_window.is_some())
        + whereabouts_set(s.locality, s.secondary)
}

fn stored(w: &mut Vec<u8>, s: &Stored) {
    map_header(w, 8 + defaulted(s), STORED_FIELDS);
    str(w, "type");
    str(w, "BlockStored");
    str(w, "block_hashes");
    hashes(w, &s.block_hashes);
    str(w, "parent_block_hash");
    match s.parent {
        Some(p) => uint(w, p),
        None => encode::write_nil(w).unwrap(),
    }
    str(w, "token_ids");
    encode::write_array_len(w, s.token_ids.len() as u32).unwrap();
    for &t in &s.token_ids {
        uint(w, u64::from(t));
    }
    str(w, "block_size");
    uint(w, u64::from(s.block_size));
    str(w, "lora_id");
    match s.lora_id {
        Some(id) => encode::write_sint(w, id).map(|_| ()).unwrap(),
        None => encode::write_nil(w).unwrap(),
    }
    str(w, "medium");
    medium(w, s.medium);
    str(w, "lora_name");
    match &s.lora_name {
        Some(n) => str(w, n),
        None => encode::write_nil(w).unwrap(),
    }
    if s.group_idx != 0 {
        str(w, "group_idx");
        uint(w, u64::from(s.group_idx));
    }
    if let Some(kind) = &s.spec_kind {
        str(w, "kv_cache_spec_kind");
        str(w, kind);
    }
    if let Some(window) = s.sliding_window {
        str(w, "kv_cache_spec_sliding_window");
        uint(w, u64::from(window));
    }
    whereabouts(w, s.locality, s.secondary);
}

fn removed(w: &mut Vec<u8>, r: &Removed) {
    let defaulted = u32::from(r.group_idx != 0) + whereabouts_set(r.locality, r.secondary);
    map_header(w, 3 + defaulted, REMOVED_FIELDS);
    str(w, "type");
    str(w, "BlockRemoved");
    str(w, "block_hashes");
    hashes(w, &r.block_hashes);
    str(w, "medium");
    medium(w, r.medium);
    if r.group_idx != 0 {
        str(w, "group_idx");
        uint(w, u64::from(r.group_idx));
    }
    whereabouts(w, r.locality, r.secondary);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::decode;
    use proptest::prelude::*;

    fn arb_stored() -> impl Strategy<Value = Stored> {
        (
            proptest::collection::vec(any::<u64>(), 1..6),
            proptest::option::of(any::<u64>()),
            1u32..64,
            0u32..3,
            arb_medium(),
            proptest::option::of(1u32..8192),
            arb_whereabouts(),
        )
            .prop_flat_map(
                |(hashes, parent, bs, group, medium, window, (locality, secondary))| {
                    let n = hashes.len() * bs as usize;
                    proptest::collection::vec(any::<u32>(), n..=n).prop_map(move |tokens| {
                        let mut s = Stored::plain(hashes.clone(), parent, tokens, bs);
                        s.medium = medium;
                        s.locality = locality;
                        s.secondary = secondary;
                        s.group_idx = group;
                        if let Some(w) = window {
                            s.spec_kind = Some("sliding_window".into());
                            s.sliding_window = Some(w);
                        }
                        s
                    })
                },
            )
    }

    fn arb_medium() -> impl Strategy<Value = Medium> {
        prop_oneof![
            Just(Medium::Gpu),
            Just(Medium::Cpu),
            Just(Medium::Storage),
            Just(Medium::Unknown)
        ]
    }

    fn arb_whereabouts() -> impl Strategy<Value = (Locality, bool)> {
        (
            prop_oneof![
                4 => Just(Locality::Local),
                1 => Just(Locality::Remote),
                1 => Just(Locality::Unknown)
            ],
            proptest::bool::weighted(0.2),
        )
    }

    fn arb_event() -> impl Strategy<Value = EngineEvent> {
        prop_oneof![
            arb_stored().prop_map(EngineEvent::Stored),
            (
                proptest::collection::vec(any::<u64>(), 0..6),
                arb_medium(),
                0u32..3,
                arb_whereabouts(),
            )
                .prop_map(
                    |(block_hashes, medium, group_idx, (locality, secondary))| {
                        EngineEvent::Removed(Removed {
                            block_hashes,
                            medium,
                            group_idx,
                            locality,
                            secondary,
                        })
                    }
                ),
            Just(EngineEvent::Cleared),
        ]
    }

    proptest! {
        #[test]
        fn what_is_encoded_decodes_to_the_same_batch(
            ts in 0.0f64..4e9,
            events in proptest::collection::vec(arb_event(), 0..8),
            dp_rank in 0u32..1024,
        ) {
            let batch = Batch { ts, events, dp_rank };
            prop_assert_eq!(decode(&vllm_batch(&batch)).unwrap(), batch);
        }
    }
}
