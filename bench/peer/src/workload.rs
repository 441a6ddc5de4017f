//! The workloads both indexes are fed: the same events, in the same order, and the same
//! queries. A block carries three hashes: `local`, the hash of its own tokens (what
//! Dynamo's tree is keyed by); `chain`, the hash of the whole prefix up to it (what kvix
//! is keyed by); and `engine`, the engine's own block hash (vLLM's, identical on every
//! worker with the same hash seed), which stores name and removals use.

use std::io::BufRead;
use std::path::Path;

use kvix_engine::{Engine, Ks};
use kvix_wire::{Event, Feed, Lane};

pub const TOKEN_BLOCK: u32 = 16;
pub const KS: Ks = Ks {
    seed: 0x0000_0042_0000_0001,
    kind: kvix_wire::ChunkKind::Tokens,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub local: u64,
    pub chain: u64,
    pub engine: u64,
}

/// One engine event of one worker.
#[derive(Debug, Clone)]
pub enum Ev {
    /// Blocks `start..` of a chain, after the block `parent`.
    Store {
        worker: u32,
        start: u32,
        parent: Option<Block>,
        blocks: Vec<Block>,
    },
    /// Blocks evicted (Dynamo and an engine-named kvix feed name them by engine hash).
    Remove {
        worker: u32,
        blocks: Vec<Block>,
    },
    Clear {
        worker: u32,
    },
}

impl Ev {
    pub fn worker(&self) -> u32 {
        match self {
            Ev::Store { worker, .. } | Ev::Remove { worker, .. } | Ev::Clear { worker } => *worker,
        }
    }

    pub fn blocks(&self) -> u64 {
        match self {
            Ev::Store { blocks, .. } => blocks.len() as u64,
            Ev::Remove { blocks, .. } => blocks.len() as u64,
            Ev::Clear { .. } => 0,
        }
    }

    /// The event as kvix's wire event (lane 0): as the server's ingest sends it (stores
    /// without engine hashes, removals by chain hash: the ingest's translator maps engine
    /// hashes), or, `named`, as a client that names blocks by engine hash sends it.
    pub fn to_kvix(&self, named: bool) -> Event {
        let name = |b: &Block| if named { b.engine } else { b.chain };
        match self {
            Ev::Store {
                start,
                parent,
                blocks,
                ..
            } => Event::Stored {
                lane: 0,
                start: *start,
                parent: parent.map(|p| p.chain),
                chain: blocks.iter().map(|b| b.chain).collect(),
                engine: if named {
                    blocks.iter().map(|b| b.engine).collect()
                } else {
                    Vec::new()
                },
            },
            Ev::Remove { blocks, .. } => Event::Removed {
                lane: 0,
                hashes: blocks.iter().map(name).collect(),
            },
            Ev::Clear { .. } => Event::Cleared,
        }
    }
}

/// A prompt to query, as both indexes see it.
#[derive(Debug, Clone)]
pub struct Query {
    pub name: String,
    pub blocks: Vec<Block>,
}

pub struct Workload {
    pub name: String,
    pub workers: u32,
    /// Stores, interleaved across workers (each worker's own order kept).
    pub load: Vec<Ev>,
    pub removals: Vec<Ev>,
    pub queries: Vec<Query>,
}

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// An engine with `workers` plain event-fed workers, `w0`.., whose ids are 0.. in order.
pub fn fleet_engine(workers: u32) -> Engine {
    let mut engine = Engine::new(TOKEN_BLOCK);
    for w in 0..workers {
        let (id, _) = engine
            .announce(&format!("w{w}"), &[Lane::full(TOKEN_BLOCK)], Feed::Events)
            .expect("a plain worker announces");
        assert_eq!(id, w);
    }
    engine
}

/// Extends a chain whose last chain hash is `prev` by blocks with these local hashes.
fn chain_on(prev: u64, locals: impl Iterator<Item = u64>) -> Vec<Block> {
    let mut prev = prev;
    locals
        .map(|local| {
            prev = splitmix(prev ^ local.rotate_left(17));
            Block {
                local,
                chain: prev,
                engine: splitmix(prev ^ 0xE1E1_E1E1),
            }
        })
        .collect()
}

/// Shape of the synthetic fleet.
#[derive(Debug, Clone, Copy)]
pub struct FleetShape {
    pub workers: u32,
    pub prefix: u32,
    pub chains: u32,
    pub min_tail: u32,
    pub max_tail: u32,
    /// Blocks per store event: 32 (prefill) or 1 (vLLM decode).
    pub per_event: usize,
}

impl Default for FleetShape {
    fn default() -> Self {
        FleetShape {
            workers: 240,
            prefix: 125,
            chains: 20,
            min_tail: 100,
            max_tail: 1250,
            per_event: 32,
        }
    }
}

/// Deep prompt depths (whole chain, prefix included) of workers 0..4.
const DEEP: [u32; 4] = [1250, 1000, 700, 400];

/// The fleet: every worker holds a shared prefix and `chains` private chains branching
/// off it (tails of `min_tail..max_tail` blocks); workers 0..4 also hold a deep prompt
/// to 1250 / 1000 / 700 / 400 blocks. Removals: every worker evicts the last 100 blocks
/// of its first chain (tail first), worker 1 evicts prefix blocks 100.., worker 2 clears.
pub fn fleet(shape: FleetShape) -> Workload {
    let prefix = chain_on(
        0xC0FFEE,
        (0..shape.prefix as u64).map(|i| splitmix(0x5EED << 40 | i)),
    );
    let tail_of_prefix = prefix.last().map_or(0xC0FFEE, |b| b.chain);
    let deep_tail = chain_on(
        tail_of_prefix,
        (0..(DEEP[0] - shape.prefix.min(DEEP[0])) as u64).map(|i| splitmix(0xDEE9 << 40 | i)),
    );
    let span = (shape.max_tail - shape.min_tail).max(1);
    let mut per_worker: Vec<Vec<Ev>> = Vec::new();
    let mut removals = Vec::new();
    for w in 0..shape.workers {
        let mut evs = Vec::new();
        let mut segment = |parent: Option<Block>, start: u32, blocks: &[Block]| {
            let mut parent = parent;
            for (i, piece) in blocks.chunks(shape.per_event).enumerate() {
                evs.push(Ev::Store {
                    worker: w,
                    start: start + (i * shape.per_event) as u32,
                    parent,
                    blocks: piece.to_vec(),
                });
                parent = piece.last().copied();
            }
        };
        segment(None, 0, &prefix);
        let parent = prefix.last().copied();
        if let Some(&depth) = DEEP.get(w as usize) {
            let n = (depth - shape.prefix) as usize;
            segment(parent, shape.prefix, &deep_tail[..n.min(deep_tail.len())]);
        }
        let mut first_chain = Vec::new();
        for c in 0..shape.chains {
            let len = shape.min_tail + splitmix((w as u64) << 20 | c as u64) as u32 % span;
            let tail = chain_on(
                tail_of_prefix,
                (0..len as u64).map(|j| splitmix((w as u64 + 1) << 44 | (c as u64) << 24 | j)),
            );
            segment(parent, shape.prefix, &tail);
            if c == 0 {
                first_chain = tail;
            }
        }
        per_worker.push(evs);
        let evict = first_chain.len().min(100);
        removals.push(Ev::Remove {
            worker: w,
            blocks: first_chain.iter().rev().take(evict).copied().collect(),
        });
        if w == 1 && shape.prefix > 100 {
            removals.push(Ev::Remove {
                worker: w,
                blocks: prefix[100..].to_vec(),
            });
        }
        if w == 2 {
            removals.push(Ev::Clear { worker: w });
        }
    }
    let deep: Vec<Block> = prefix.iter().chain(&deep_tail).copied().collect();
    Workload {
        name: format!(
            "fleet: {} workers, {}-block shared prefix, {} chains of {}..{} blocks each, {}-block stores",
            shape.workers, shape.prefix, shape.chains, shape.min_tail, shape.max_tail, shape.per_event
        ),
        workers: shape.workers,
        load: interleave(per_worker),
        removals,
        queries: vec![
            Query {
                name: format!("{}-block prompt", prefix.len()),
                blocks: prefix,
            },
            Query {
                name: format!("{}-block prompt", deep.len()),
                blocks: deep,
            },
        ],
    }
}

/// Event k of every worker, then event k + 1, ...: each worker's order is kept.
fn interleave(per_worker: Vec<Vec<Ev>>) -> Vec<Ev> {
    let max = per_worker.iter().map(Vec::len).max().unwrap_or(0);
    let mut its: Vec<_> = per_worker.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    for _ in 0..max {
        for it in &mut its {
            out.extend(it.next());
        }
    }
    out
}

/// The Mooncake trace routed over `workers` workers: each request goes to the worker
/// holding the longest prefix of it (ties: lower id; none: round robin), which then
/// stores the blocks it lacked, 32 per event, naming their parent. Each 512-token trace
/// block becomes `sub` keyspace blocks. Every request is a query afterwards.
pub fn mooncake(path: &Path, workers: u32, sub: u32) -> Result<Workload, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut requests = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
        let ids = v["hash_ids"]
            .as_array()
            .ok_or_else(|| format!("{}: line {}: no hash_ids", path.display(), i + 1))?;
        let locals = ids
            .iter()
            .map(|id| id.as_u64())
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| format!("{}: line {}: a hash id is not a u64", path.display(), i + 1))?
            .into_iter()
            .flat_map(|id| (0..sub as u64).map(move |s| splitmix(id << 6 | s)));
        requests.push(chain_on(0x7ACE, locals));
    }
    let mut router = fleet_engine(workers);
    let mut load = Vec::new();
    let mut seqs = vec![0u64; workers as usize];
    for (i, blocks) in requests.iter().enumerate() {
        let chain: Vec<u64> = blocks.iter().map(|b| b.chain).collect();
        let answer = router.query(KS, &chain, None, 1, false);
        let (w, held) = answer
            .scores
            .first()
            .copied()
            .unwrap_or((i as u32 % workers, 0));
        let mut parent = (held > 0).then(|| blocks[held as usize - 1]);
        for (j, piece) in blocks[held as usize..].chunks(32).enumerate() {
            let ev = Ev::Store {
                worker: w,
                start: held + 32 * j as u32,
                parent,
                blocks: piece.to_vec(),
            };
            router
                .apply(w, seqs[w as usize], KS, &[ev.to_kvix(false)])
                .map_err(|e| e.to_string())?;
            seqs[w as usize] += 1;
            parent = piece.last().copied();
            load.push(ev);
        }
    }
    Ok(Workload {
        name: format!(
            "mooncake trace: {} requests over {workers} workers, {sub} blocks per trace block",
            requests.len()
        ),
        workers,
        load,
        removals: Vec::new(),
        queries: requests
            .into_iter()
            .enumerate()
            .map(|(i, blocks)| Query {
                name: format!("request {i}"),
                blocks,
            })
            .collect(),
    })
}
