//! The exact feed: a worker's own engine events, in its sequence order.

use kvix_wire::{ApplyStatus, Event, WorkerId};

use super::BlockOp;
use crate::error::{EventError, IndexError};
use crate::hashing::FastMap;
use crate::Holder;

/// Tracks a worker's batch sequence numbers.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sequencer {
    last: Option<u64>,
}

impl Sequencer {
    /// Classifies batch `seq`: at or below the last applied → duplicate (ignore it);
    /// beyond the next expected → applied with a gap; the first batch sets the baseline.
    pub fn admit(&mut self, seq: u64) -> ApplyStatus {
        let status = match self.last {
            Some(last) if seq <= last => return ApplyStatus::Duplicate,
            Some(last) if seq != last + 1 => ApplyStatus::Gap { expected: last + 1 },
            _ => ApplyStatus::Applied,
        };
        self.last = Some(seq);
        status
    }

    /// Forgets the baseline (the producer restarted and counts from 0 again).
    pub fn reset(&mut self) {
        self.last = None;
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Resumes from a snapshot's baseline.
    pub fn restore(&mut self, last: Option<u64>) {
        self.last = last;
    }
}

/// What became of one event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    pub status: ApplyStatus,
    /// Events applied.
    pub events: u32,
    /// Keyspace blocks stored or removed.
    pub block_events: u64,
    /// Removals naming a hash this feed never saw stored (or already removed).
    pub unknown_removals: u32,
    /// Events skipped, by index in the batch.
    pub rejected: Vec<(u32, EventError)>,
}

impl ApplyReport {
    fn new(status: ApplyStatus) -> Self {
        ApplyReport {
            status,
            events: 0,
            block_events: 0,
            unknown_removals: 0,
            rejected: Vec::new(),
        }
    }
}

/// Where a stored name (engine hash, or chain hash when the store carried none) lives:
/// 16 bytes, since the feed keeps one per stored engine block (BRIEF §5).
#[derive(Debug, Clone, Copy)]
struct Named {
    /// The chain hash of its one block, or (when `MULTI` is set) an index into `groups`.
    word: u64,
    pos: u32,
    /// Keyspace index into `keyspaces`, with `MULTI` set when the name covers a group.
    tag: u32,
}

const MULTI: u32 = 1 << 31;

/// Event-feed state of one worker: its sequence and, per lane, name → blocks.
#[derive(Debug, Default)]
pub struct EventFeed {
    seq: Sequencer,
    lanes: Vec<FastMap<u64, Named>>,
    /// Keyspace seeds this feed stored into (names refer to them by index).
    keyspaces: Vec<u64>,
    keyspace_ids: FastMap<u64, u32>,
    /// Chain hashes of names that cover more than one keyspace block.
    groups: Vec<Box<[u64]>>,
    free_groups: Vec<u32>,
}

impl EventFeed {
    pub fn new(lanes: usize) -> Self {
        EventFeed {
            lanes: (0..lanes).map(|_| FastMap::default()).collect(),
            ..Default::default()
        }
    }

    pub fn sequencer(&mut self) -> &mut Sequencer {
        &mut self.seq
    }

    /// Names tracked for removals, over all lanes.
    pub fn names(&self) -> usize {
        self.lanes.iter().map(|m| m.len()).sum()
    }

    /// Applies batch `seq` of `worker` in keyspace `ks`, where lane `i`'s engine block
    /// is `lane_blocks[i]` keyspace blocks, appending the block operations to `out`.
    pub fn apply<'a>(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: u64,
        lane_blocks: &[u32],
        events: &'a [Event],
        out: &mut Vec<BlockOp<'a>>,
    ) -> ApplyReport {
        let mut report = ApplyReport::new(self.seq.admit(seq));
        if report.status == ApplyStatus::Duplicate {
            return report;
        }
        for (i, event) in events.iter().enumerate() {
            match self.one(worker, ks, lane_blocks, event, out, &mut report) {
                Ok(()) => report.events += 1,
                Err(e) => report.rejected.push((i as u32, e)),
            }
        }
        report
    }

    /// Checks a whole batch without applying any of it: the first event that would be
    /// refused, by index. Lets a caller refuse a batch as a whole instead of in part.
    pub fn check(&self, lane_blocks: &[u32], events: &[Event]) -> Result<(), (u32, EventError)> {
        for (i, e) in events.iter().enumerate() {
            self.validate(lane_blocks, e)
                .map_err(|err| (i as u32, err))?;
        }
        Ok(())
    }

    /// Why `event` would be refused; for a store, its lane's engine block (keyspace blocks).
    fn validate(&self, lane_blocks: &[u32], event: &Event) -> Result<u32, EventError> {
        let lane_of = |lane: u8| {
            lane_blocks
                .get(lane as usize)
                .copied()
                .filter(|_| (lane as usize) < self.lanes.len())
                .ok_or(EventError::NoSuchLane {
                    lane,
                    lanes: lane_blocks.len(),
                })
        };
        match event {
            Event::Stored {
                lane,
                start,
                chain,
                engine,
            } => {
                let k = lane_of(*lane)?;
                if *start as u64 + chain.len() as u64 > u32::MAX as u64 {
                    return Err(IndexError::PositionOverflow {
                        start: *start,
                        len: chain.len(),
                    }
                    .into());
                }
                let expected = chain.len().div_ceil(k as usize);
                if !engine.is_empty() && engine.len() != expected {
                    return Err(EventError::EngineHashCount {
                        blocks: chain.len(),
                        engine_block: k,
                        expected,
                        got: engine.len(),
                    });
                }
                Ok(k)
            }
            Event::Removed { lane, .. } => lane_of(*lane),
            Event::Cleared => Ok(1),
        }
    }

    fn one<'a>(
        &mut self,
        worker: WorkerId,
        ks: u64,
        lane_blocks: &[u32],
        event: &'a Event,
        out: &mut Vec<BlockOp<'a>>,
        report: &mut ApplyReport,
    ) -> Result<(), EventError> {
        let k = self.validate(lane_blocks, event)? as usize;
        match event {
            Event::Stored {
                lane,
                start,
                chain,
                engine,
            } => {
                let ksi = self.keyspace_index(ks);
                if engine.is_empty() {
                    for (i, &h) in chain.iter().enumerate() {
                        self.name(*lane, h, start + i as u32, ksi, &[h]);
                    }
                } else {
                    // Engine block j covers the keyspace blocks [j·k, (j+1)·k) of the store.
                    for (j, (&e, group)) in engine.iter().zip(chain.chunks(k)).enumerate() {
                        self.name(*lane, e, start + (j * k) as u32, ksi, group);
                    }
                }
                if !chain.is_empty() {
                    out.push(BlockOp::Insert {
                        ks,
                        holder: Holder::new(worker, *lane),
                        start: *start,
                        chain,
                    });
                }
                report.block_events += chain.len() as u64;
            }
            Event::Removed { lane, hashes } => {
                let holder = Holder::new(worker, *lane);
                for h in hashes {
                    let Some(named) = self.lanes[*lane as usize].remove(h) else {
                        report.unknown_removals += 1;
                        continue;
                    };
                    let ks = self.keyspaces[(named.tag & !MULTI) as usize];
                    let group = self.group(&named);
                    for (i, &hash) in group.iter().enumerate() {
                        out.push(BlockOp::Remove {
                            ks,
                            holder,
                            pos: named.pos + i as u32,
                            hash,
                        });
                    }
                    report.block_events += group.len() as u64;
                    self.release(named);
                }
                let names = &mut self.lanes[*lane as usize];
                if names.len() < names.capacity() / 4 {
                    names.shrink_to(names.len() * 2);
                }
            }
            Event::Cleared => {
                let lanes = self.lanes.len();
                *self = EventFeed {
                    seq: self.seq,
                    ..EventFeed::new(lanes)
                };
                out.push(BlockOp::DropWorker { worker });
            }
        }
        Ok(())
    }

    /// The feed as plain data (sequence baseline and removal names).
    pub fn export(&self) -> crate::EventFeedImage {
        let mut names = Vec::new();
        for (lane, map) in self.lanes.iter().enumerate() {
            for (&name, named) in map {
                names.push(crate::NameImage {
                    lane: lane as u8,
                    name,
                    ks: self.keyspaces[(named.tag & !MULTI) as usize],
                    pos: named.pos,
                    chain: self.group(named).to_vec(),
                });
            }
        }
        names.sort_unstable_by_key(|n| (n.lane, n.ks, n.pos, n.name));
        crate::EventFeedImage {
            last_seq: self.seq.last(),
            names,
        }
    }

    /// Restores an exported feed into a fresh one; names of lanes beyond the roster are skipped.
    pub fn import(&mut self, image: &crate::EventFeedImage) {
        self.seq.restore(image.last_seq);
        for n in &image.names {
            if (n.lane as usize) < self.lanes.len() && !n.chain.is_empty() {
                let ksi = self.keyspace_index(n.ks);
                self.name(n.lane, n.name, n.pos, ksi, &n.chain);
            }
        }
    }

    fn keyspace_index(&mut self, ks: u64) -> u32 {
        if let Some(&i) = self.keyspace_ids.get(&ks) {
            return i;
        }
        let i = self.keyspaces.len() as u32;
        self.keyspaces.push(ks);
        self.keyspace_ids.insert(ks, i);
        i
    }

    /// Records that `name` on `lane` covers the blocks `chain` from `pos`.
    fn name(&mut self, lane: u8, name: u64, pos: u32, ksi: u32, chain: &[u64]) {
        let named = match chain {
            [one] => Named {
                word: *one,
                pos,
                tag: ksi,
            },
            many => {
                let g: Box<[u64]> = many.into();
                let id = match self.free_groups.pop() {
                    Some(id) => {
                        self.groups[id as usize] = g;
                        id
                    }
                    None => {
                        self.groups.push(g);
                        (self.groups.len() - 1) as u32
                    }
                };
                Named {
                    word: id as u64,
                    pos,
                    tag: ksi | MULTI,
                }
            }
        };
        if let Some(old) = self.lanes[lane as usize].insert(name, named) {
            self.release(old);
        }
    }

    fn group<'s>(&'s self, named: &'s Named) -> &'s [u64] {
        if named.tag & MULTI != 0 {
            &self.groups[named.word as usize]
        } else {
            std::slice::from_ref(&named.word)
        }
    }

    fn release(&mut self, named: Named) {
        if named.tag & MULTI != 0 {
            self.groups[named.word as usize] = Box::new([]);
            self.free_groups.push(named.word as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_baseline_duplicates_and_gaps() {
        let mut s = Sequencer::default();
        assert_eq!(s.admit(5), ApplyStatus::Applied);
        assert_eq!(s.admit(5), ApplyStatus::Duplicate);
        assert_eq!(s.admit(4), ApplyStatus::Duplicate);
        assert_eq!(s.admit(6), ApplyStatus::Applied);
        assert_eq!(s.admit(9), ApplyStatus::Gap { expected: 7 });
        assert_eq!(s.admit(10), ApplyStatus::Applied);
        assert_eq!(s.admit(u64::MAX), ApplyStatus::Gap { expected: 11 });
        assert_eq!(s.admit(u64::MAX), ApplyStatus::Duplicate);
        s.reset();
        assert_eq!(s.admit(0), ApplyStatus::Applied);
    }

    #[test]
    fn engine_hashes_group_blocks_from_start() {
        let mut f = EventFeed::new(2);
        let chain: Vec<u64> = (10..15).collect();
        let events = vec![
            Event::Stored {
                lane: 1,
                start: 3,
                chain: chain.clone(),
                engine: vec![900, 901, 902],
            },
            Event::Removed {
                lane: 1,
                hashes: vec![901, 777],
            },
            Event::Stored {
                lane: 1,
                start: 3,
                chain: chain.clone(),
                engine: vec![1],
            },
            Event::Stored {
                lane: 2,
                start: 0,
                chain: vec![1],
                engine: vec![],
            },
        ];
        let mut out = Vec::new();
        let r = f.apply(4, 0, 77, &[1, 2], &events, &mut out);
        assert_eq!(r.events, 2);
        assert_eq!(r.unknown_removals, 1);
        assert_eq!(r.block_events, 7);
        assert!(matches!(
            r.rejected[0],
            (2, EventError::EngineHashCount { expected: 3, .. })
        ));
        assert!(matches!(
            r.rejected[1],
            (3, EventError::NoSuchLane { lane: 2, .. })
        ));
        let h = Holder::new(4, 1);
        assert_eq!(
            out[1..],
            [
                BlockOp::Remove {
                    ks: 77,
                    holder: h,
                    pos: 5,
                    hash: 12
                },
                BlockOp::Remove {
                    ks: 77,
                    holder: h,
                    pos: 6,
                    hash: 13
                },
            ]
        );
        assert_eq!(f.names(), 2);
    }
}
