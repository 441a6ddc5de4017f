//! Engine events → kvix events. Pure state, no I/O.
//!
//! The engine's own block hashes depend on its hash seed, so a gateway cannot compute
//! them: each stored block's `token_ids` are rehashed into the keyspace chain. A store
//! whose parent is an engine hash resolves its start position and chain seed through
//! the map kept here (engine hash → last chain hash and end position of that engine
//! block), per data-parallel rank and lane; a store with an unknown parent is skipped
//! and counted, never guessed. Removals are forwarded by engine hash (the server's feed
//! maps them to chain blocks) once no medium holds the block any more.

use std::collections::HashMap;

use kvix_wire::{chain::token_chain, Event, Keyspace, Lane, LaneKind};

use super::vllm::{Batch, EngineEvent, Medium, Removed, Stored};

/// Why an event was skipped (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Skip {
    /// A store whose parent hash this stream never stored (or already removed).
    UnknownParent,
    /// group_idx beyond the roster, or its block size / kind / window differs.
    LaneMismatch,
    /// token_ids is not block_hashes × block_size tokens.
    BadStore,
    /// An event type the decoder does not know.
    UnknownEvent,
}

pub const SKIPS: [(Skip, &str); 4] = [
    (Skip::UnknownParent, "unknown_parent"),
    (Skip::LaneMismatch, "lane_mismatch"),
    (Skip::BadStore, "bad_store"),
    (Skip::UnknownEvent, "unknown_event"),
];

/// What one batch did, for the metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub skipped: [u64; SKIPS.len()],
    /// Engine blocks stored / removed, by medium (`Medium::ALL` order).
    pub stored: [u64; 3],
    pub removed: [u64; 3],
    /// Removals naming a block this stream does not hold.
    pub unknown_removals: u64,
    /// Stores whose engine hashes covered extra keys (multimodal, salts).
    pub extra_keys: u64,
}

fn medium_index(m: Medium) -> usize {
    match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::Other => 2,
    }
}

/// kvix events for one holder (data-parallel rank) in one keyspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub rank: u32,
    pub keyspace: Keyspace,
    pub events: Vec<Event>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Chain hash of the last keyspace block of this engine block.
    chain: u64,
    /// Keyspace position just past it.
    end: u32,
    /// Media holding it (`Medium::bit`).
    media: u8,
}

/// The engine-hash map of one stream (one engine process, all its DP ranks).
#[derive(Debug)]
pub struct Translator {
    keyspace_block: u32,
    model: String,
    salt: String,
    lanes: Vec<Lane>,
    /// Per rank, per lane: engine hash → entry.
    ranks: HashMap<u32, Vec<HashMap<u64, Entry>>>,
}

impl Translator {
    pub fn new(keyspace_block: u32, model: &str, salt: &str, lanes: &[Lane]) -> Self {
        Translator {
            keyspace_block,
            model: model.to_string(),
            salt: salt.to_string(),
            lanes: lanes.to_vec(),
            ranks: HashMap::new(),
        }
    }

    /// Ranks seen since the last reset.
    pub fn ranks(&self) -> Vec<u32> {
        let mut r: Vec<u32> = self.ranks.keys().copied().collect();
        r.sort_unstable();
        r
    }

    /// Engine blocks tracked, over all ranks and lanes.
    pub fn tracked(&self) -> usize {
        self.ranks.values().flatten().map(|m| m.len()).sum()
    }

    /// Forgets everything (the engine restarted).
    pub fn reset(&mut self) {
        self.ranks.clear();
    }

    /// The keyspace the engine's blocks are rehashed into (the base model unless the
    /// event names a LoRA adapter; an adapter known only by id gets `lora-id:N`, so it
    /// never mixes with the base model).
    pub fn keyspace(&self, lora_name: Option<&str>, lora_id: Option<i64>) -> Keyspace {
        let lora = match (lora_name, lora_id) {
            (Some(name), _) => name.to_string(),
            (None, Some(id)) => format!("lora-id:{id}"),
            (None, None) => String::new(),
        };
        Keyspace {
            model: self.model.clone(),
            lora,
            salt: self.salt.clone(),
            kind: kvix_wire::ChunkKind::Tokens,
        }
    }

    /// Translates one decoded batch, appending kvix events to `out` grouped in order by
    /// (rank, keyspace).
    pub fn apply(&mut self, batch: &Batch, out: &mut Vec<Outgoing>, counts: &mut Counts) {
        let rank = batch.dp_rank;
        let lanes = self.lanes.len();
        self.ranks
            .entry(rank)
            .or_insert_with(|| (0..lanes).map(|_| HashMap::new()).collect());
        for ev in &batch.events {
            match ev {
                EngineEvent::Stored(st) => {
                    if st.extra_keys {
                        counts.extra_keys += 1;
                    }
                    match self.store(rank, st, counts) {
                        Ok(event) => {
                            let ks = self.keyspace(st.lora_name.as_deref(), st.lora_id);
                            push(out, rank, ks, event);
                        }
                        Err(skip) => counts.skipped[skip as usize] += 1,
                    }
                }
                EngineEvent::Removed(rm) => match self.remove(rank, rm, counts) {
                    Ok(Some(event)) => {
                        let ks = out
                            .last()
                            .filter(|o| o.rank == rank)
                            .map_or_else(|| self.keyspace(None, None), |o| o.keyspace.clone());
                        push(out, rank, ks, event);
                    }
                    Ok(None) => {}
                    Err(skip) => counts.skipped[skip as usize] += 1,
                },
                EngineEvent::Cleared => {
                    for m in self.ranks.get_mut(&rank).into_iter().flatten() {
                        m.clear();
                    }
                    let ks = self.keyspace(None, None);
                    push(out, rank, ks, Event::Cleared);
                }
                EngineEvent::Unknown(_) => counts.skipped[Skip::UnknownEvent as usize] += 1,
            }
        }
    }

    fn lane(&self, group: u32, block_size: u32, st: Option<&Stored>) -> Result<u8, Skip> {
        let lane = self
            .lanes
            .get(group as usize)
            .filter(|_| group < 256)
            .ok_or(Skip::LaneMismatch)?;
        if lane.block_tokens != block_size || !block_size.is_multiple_of(self.keyspace_block) {
            return Err(Skip::LaneMismatch);
        }
        if let Some(kind) = st.and_then(|s| s.spec_kind.as_deref()) {
            if !kind_matches(lane.kind, kind, st.and_then(|s| s.sliding_window)) {
                return Err(Skip::LaneMismatch);
            }
        }
        Ok(group as u8)
    }

    fn store(&mut self, rank: u32, st: &Stored, counts: &mut Counts) -> Result<Event, Skip> {
        let lane = self.lane(st.group_idx, st.block_size, Some(st))?;
        let n = st.block_hashes.len();
        if st.token_ids.len() as u64 != n as u64 * u64::from(st.block_size) {
            return Err(Skip::BadStore);
        }
        let k = (st.block_size / self.keyspace_block) as usize;
        let seed_ks = self.keyspace(st.lora_name.as_deref(), st.lora_id);
        let map = &mut self.ranks.get_mut(&rank).expect("rank entry made")[lane as usize];
        let (seed, start) = match st.parent {
            None => (seed_ks.seed(self.keyspace_block), 0u32),
            Some(p) => {
                let e = map.get(&p).ok_or(Skip::UnknownParent)?;
                (e.chain, e.end)
            }
        };
        if u64::from(start) + (n * k) as u64 > u64::from(u32::MAX) {
            return Err(Skip::BadStore);
        }
        let chain = token_chain(seed, self.keyspace_block, &st.token_ids);
        let bit = st.medium.bit();
        for (j, &h) in st.block_hashes.iter().enumerate() {
            let end = start + ((j + 1) * k) as u32;
            let last = chain[(j + 1) * k - 1];
            let e = map.entry(h).or_insert(Entry {
                chain: last,
                end,
                media: 0,
            });
            // A hash re-stored at another position (engine reuse of a hash for other
            // content would be a collision): the newest wins.
            e.chain = last;
            e.end = end;
            e.media |= bit;
        }
        counts.stored[medium_index(st.medium)] += n as u64;
        Ok(Event::Stored {
            lane,
            start,
            // The parent's chain hash seeds this store's chain: naming it lets the index
            // extend the parent's run (decode streams store one block at a time).
            parent: st.parent.map(|_| seed),
            chain,
            engine: st.block_hashes.clone(),
        })
    }

    fn remove(
        &mut self,
        rank: u32,
        rm: &Removed,
        counts: &mut Counts,
    ) -> Result<Option<Event>, Skip> {
        let lane = self
            .lanes
            .get(rm.group_idx as usize)
            .filter(|_| rm.group_idx < 256)
            .map(|_| rm.group_idx as u8)
            .ok_or(Skip::LaneMismatch)?;
        let map = &mut self.ranks.get_mut(&rank).expect("rank entry made")[lane as usize];
        let bit = rm.medium.bit();
        let mut gone = Vec::new();
        for &h in &rm.block_hashes {
            match map.get_mut(&h) {
                Some(e) if e.media & bit != 0 => {
                    e.media &= !bit;
                    counts.removed[medium_index(rm.medium)] += 1;
                    if e.media == 0 {
                        map.remove(&h);
                        gone.push(h);
                    }
                }
                _ => counts.unknown_removals += 1,
            }
        }
        if map.len() < map.capacity() / 4 {
            map.shrink_to(map.len() * 2);
        }
        Ok((!gone.is_empty()).then_some(Event::Removed { lane, hashes: gone }))
    }
}

/// Whether vLLM's `kv_cache_spec_kind` (and window) describe the roster lane's kind.
fn kind_matches(lane: LaneKind, kind: &str, window: Option<u32>) -> bool {
    let parsed = LaneKind::from_parts(kind, None)
        .or_else(|_| LaneKind::from_parts(kind, Some(window.unwrap_or(1).max(1))));
    match parsed {
        Ok(k) if k.name() == lane.name() => match (lane, window) {
            (LaneKind::SlidingWindow { window: w }, Some(got)) => w == got,
            _ => true,
        },
        _ => false,
    }
}

fn push(out: &mut Vec<Outgoing>, rank: u32, keyspace: Keyspace, event: Event) {
    match out.last_mut() {
        Some(o) if o.rank == rank && o.keyspace == keyspace => o.events.push(event),
        _ => out.push(Outgoing {
            rank,
            keyspace,
            events: vec![event],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KB: u32 = 16;

    fn st(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> Stored {
        Stored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens.collect(),
            block_size: 32,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: false,
            group_idx: 0,
            spec_kind: None,
            sliding_window: None,
        }
    }

    fn batch(rank: u32, events: Vec<EngineEvent>) -> Batch {
        Batch {
            ts: 0.0,
            events,
            dp_rank: rank,
        }
    }

    fn run(t: &mut Translator, b: Batch) -> (Vec<Outgoing>, Counts) {
        let (mut out, mut c) = (Vec::new(), Counts::default());
        t.apply(&b, &mut out, &mut c);
        (out, c)
    }

    #[test]
    fn stores_rehash_tokens_and_parents_resolve_position_and_seed() {
        let mut t = Translator::new(KB, "m", "s", &[Lane::full(32)]);
        let ks = Keyspace {
            salt: "s".into(),
            ..Keyspace::tokens("m")
        };
        let whole = token_chain(ks.seed(KB), KB, &(0..128).collect::<Vec<_>>());
        let (out, _) = run(
            &mut t,
            batch(0, vec![EngineEvent::Stored(st(&[10, 11], None, 0..64))]),
        );
        assert_eq!(
            out,
            vec![Outgoing {
                rank: 0,
                keyspace: ks.clone(),
                events: vec![Event::Stored {
                    lane: 0,
                    start: 0,
                    parent: None,
                    chain: whole[..4].to_vec(),
                    engine: vec![10, 11]
                }]
            }]
        );
        let (out, _) = run(
            &mut t,
            batch(
                0,
                vec![EngineEvent::Stored(st(&[12, 13], Some(11), 64..128))],
            ),
        );
        let Event::Stored { start, chain, .. } = &out[0].events[0] else {
            panic!()
        };
        assert_eq!((*start, &chain[..]), (4, &whole[4..]));
        // Mid-chain parent too.
        let (out, _) = run(
            &mut t,
            batch(0, vec![EngineEvent::Stored(st(&[20], Some(10), 32..64))]),
        );
        let Event::Stored { start, chain, .. } = &out[0].events[0] else {
            panic!()
        };
        assert_eq!((*start, &chain[..]), (2, &whole[2..4]));
    }

    #[test]
    fn unknown_parents_wrong_lanes_and_bad_stores_are_skipped_and_counted() {
        let lanes = [
            Lane::full(32),
            Lane {
                kind: LaneKind::SlidingWindow { window: 64 },
                block_tokens: 32,
            },
        ];
        let mut t = Translator::new(KB, "m", "", &lanes);
        let mut swa = st(&[1], None, 0..32);
        swa.group_idx = 1;
        swa.spec_kind = Some("sliding_window".into());
        swa.sliding_window = Some(64);
        let mut wrong_window = swa.clone();
        wrong_window.sliding_window = Some(128);
        let mut wrong_kind = st(&[2], None, 0..32);
        wrong_kind.spec_kind = Some("mamba".into());
        let mut wrong_size = st(&[3], None, 0..16);
        wrong_size.block_size = 16;
        let mut no_group = st(&[4], None, 0..32);
        no_group.group_idx = 2;
        let (out, c) = run(
            &mut t,
            batch(
                0,
                vec![
                    EngineEvent::Stored(swa),
                    EngineEvent::Stored(wrong_window),
                    EngineEvent::Stored(wrong_kind),
                    EngineEvent::Stored(wrong_size),
                    EngineEvent::Stored(no_group),
                    EngineEvent::Stored(st(&[5], Some(99), 0..32)),
                    EngineEvent::Stored(st(&[6], None, 0..31)),
                    EngineEvent::Unknown("X".into()),
                ],
            ),
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].events.len(), 1);
        assert_eq!(c.skipped, [1, 4, 1, 1]);
        assert_eq!(c.stored, [1, 0, 0]);
    }

    #[test]
    fn removals_wait_for_the_last_medium_and_dp_ranks_are_separate() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let mut cpu = st(&[7], None, 0..32);
        cpu.medium = Medium::Cpu;
        run(
            &mut t,
            batch(
                0,
                vec![
                    EngineEvent::Stored(st(&[7], None, 0..32)),
                    EngineEvent::Stored(cpu),
                ],
            ),
        );
        run(
            &mut t,
            batch(1, vec![EngineEvent::Stored(st(&[7], None, 0..32))]),
        );
        let rm = |m| {
            EngineEvent::Removed(Removed {
                block_hashes: vec![7],
                medium: m,
                group_idx: 0,
            })
        };
        let (out, c) = run(&mut t, batch(0, vec![rm(Medium::Gpu)]));
        assert!(out.is_empty(), "the CPU copy still holds it");
        assert_eq!(c.removed, [1, 0, 0]);
        let (out, _) = run(&mut t, batch(0, vec![rm(Medium::Cpu)]));
        assert_eq!(
            out[0].events,
            vec![Event::Removed {
                lane: 0,
                hashes: vec![7]
            }]
        );
        assert_eq!(out[0].rank, 0);
        let (out, c) = run(&mut t, batch(0, vec![rm(Medium::Cpu)]));
        assert!(out.is_empty());
        assert_eq!(c.unknown_removals, 1);
        // Rank 1 still holds its own copy.
        let (out, _) = run(&mut t, batch(1, vec![rm(Medium::Gpu)]));
        assert_eq!(out[0].rank, 1);
        assert_eq!(t.ranks(), vec![0, 1]);
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn lora_names_pick_the_keyspace_and_clears_drop_the_map() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let mut lora = st(&[8], None, 0..32);
        lora.lora_name = Some("ad".into());
        let mut by_id = st(&[9], None, 0..32);
        by_id.lora_id = Some(3);
        let (out, _) = run(
            &mut t,
            batch(
                0,
                vec![
                    EngineEvent::Stored(lora),
                    EngineEvent::Stored(by_id),
                    EngineEvent::Cleared,
                    EngineEvent::Stored(st(&[1], Some(8), 32..64)),
                ],
            ),
        );
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].keyspace.lora, "ad");
        assert_eq!(out[1].keyspace.lora, "lora-id:3");
        assert_eq!(out[2].events, vec![Event::Cleared]);
        assert_eq!(t.tracked(), 0, "cleared, and the orphan store was skipped");
    }
}
