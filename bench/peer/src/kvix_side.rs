//! kvix's side: one `kvix_engine::Engine` (one core, home to every worker) applying the
//! events on the calling thread, and answering queries.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvix_engine::{Answer, Engine, Holder};
use kvix_wire::Event;

use crate::workload::{self, Ev, Query, Workload, KS};

pub struct Kvix {
    pub engine: Engine,
    seqs: Vec<u64>,
    answer: Answer,
    /// The longest single event's apply so far: an executor answers no query meanwhile.
    pub longest: Duration,
}

/// Events converted ahead of time (not timed), with their worker.
pub type Prepared = Vec<(u32, Event)>;

/// The events as the server's ingest hands them to the engine or, `named`, as a client
/// naming blocks by engine hash sends them ([`Ev::to_kvix`]).
pub fn prepare(events: &[Ev], named: bool) -> Prepared {
    events
        .iter()
        .map(|e| (e.worker(), e.to_kvix(named)))
        .collect()
}

impl Kvix {
    pub fn new(workers: u32) -> Self {
        Kvix {
            engine: workload::fleet_engine(workers),
            seqs: vec![0; workers as usize],
            answer: Answer::default(),
            longest: Duration::ZERO,
        }
    }

    /// Applies every event as its own batch; returns the time it took.
    pub fn apply(&mut self, events: &Prepared) -> Duration {
        let t = Instant::now();
        for (w, e) in events {
            let seq = &mut self.seqs[*w as usize];
            let one = Instant::now();
            self.engine
                .apply(*w, *seq, KS, std::slice::from_ref(e))
                .expect("events of the workload apply");
            self.longest = self.longest.max(one.elapsed());
            *seq += 1;
        }
        t.elapsed()
    }

    /// One query, timed: (ns, per-worker depth).
    pub fn query(&mut self, q: &[u64]) -> u64 {
        let t = Instant::now();
        self.engine
            .query_into(KS, q, None, 0, false, &mut self.answer);
        let ns = t.elapsed().as_nanos() as u64;
        std::hint::black_box(&self.answer);
        ns
    }

    pub fn depths(&mut self, q: &Query) -> BTreeMap<u64, u32> {
        let chain: Vec<u64> = q.blocks.iter().map(|b| b.chain).collect();
        self.query(&chain);
        self.answer
            .scores
            .iter()
            .map(|&(w, d)| (w as u64, d))
            .collect()
    }
}

/// The bare index fed the same stores (no feeds): its bytes per block, on their own.
pub fn index_only(w: &Workload, live: impl Fn() -> usize) -> (usize, u64) {
    let before = live();
    let mut ix = kvix_engine::BlockIndex::new();
    for e in &w.load {
        if let Ev::Store {
            worker,
            start,
            parent,
            blocks,
        } = e
        {
            let chain: Vec<u64> = blocks.iter().map(|b| b.chain).collect();
            ix.insert(
                KS.seed,
                Holder::new(*worker, 0),
                *start,
                parent.map(|p| p.chain),
                &chain,
            )
            .expect("stores insert");
        }
    }
    (live() - before, ix.blocks())
}
