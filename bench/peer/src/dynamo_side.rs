//! Dynamo's side: `ConcurrentRadixTreeCompressed` (the backend its `ThreadPoolIndexer`
//! recommends), applied by its own worker loop (`SyncIndexer::worker`, what each
//! `ThreadPoolIndexer` thread runs) on one writer thread, and queried with
//! `find_matches` (what `ThreadPoolIndexer::find_matches` calls, `early_exit = false`).
//!
//! Each phase is queued whole before the writer takes it, between two `Flush` markers
//! whose wakers stamp the time on the writer thread itself: the figure is the writer's
//! own apply time, with no channel hand-off waiting in it. The tree's per-worker lookup
//! tables live inside that one worker loop, so all phases go through the same writer.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::ConcurrentRadixTreeCompressed;

use crate::workload::{Ev, Query};

/// A Flush marker's waker: records when the writer reached it, after waiting for the
/// gate (held while the phase is being queued, so the writer never waits for it).
struct Stamp {
    at: Mutex<Option<Instant>>,
    reached: Condvar,
    gate: Arc<Mutex<()>>,
}

impl Wake for Stamp {
    fn wake(self: Arc<Self>) {
        drop(self.gate.lock());
        *self.at.lock().expect("stamp") = Some(Instant::now());
        self.reached.notify_all();
    }
}

struct Marker {
    rx: tokio::sync::oneshot::Receiver<()>,
    stamp: Arc<Stamp>,
}

impl Marker {
    fn new(gate: &Arc<Mutex<()>>) -> (WorkerTask, Marker) {
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let stamp = Arc::new(Stamp {
            at: Mutex::new(None),
            reached: Condvar::new(),
            gate: gate.clone(),
        });
        let waker = Waker::from(stamp.clone());
        let mut cx = Context::from_waker(&waker);
        // Registers the waker (a tokio oneshot needs no runtime).
        assert!(matches!(
            std::pin::Pin::new(&mut rx).poll(&mut cx),
            Poll::Pending
        ));
        (WorkerTask::Flush(tx), Marker { rx, stamp })
    }

    /// Waits for the writer to reach the marker (the stamp is the receiver's only
    /// waker: nothing else may poll it); when it did.
    fn wait(self) -> Instant {
        let mut at = self.stamp.at.lock().expect("stamp");
        loop {
            if let Some(t) = *at {
                drop(self.rx);
                return t;
            }
            at = self.stamp.reached.wait(at).expect("stamp");
        }
    }
}

pub struct Dynamo {
    pub tree: Arc<ConcurrentRadixTreeCompressed>,
    tx: flume::Sender<WorkerTask>,
    writer: Option<std::thread::JoinHandle<()>>,
    next_id: u64,
}

/// Events converted ahead of time (not timed).
pub struct Prepared {
    events: Vec<RouterEvent>,
}

impl Prepared {
    pub fn len(&self) -> usize {
        self.events.len()
    }
}

/// Heap bytes an unbounded channel holding `n` tasks keeps (flume keeps its queue's
/// peak capacity): what a phase queued whole leaves behind, to subtract from memory.
pub fn channel_bytes(n: usize, live: impl Fn() -> usize) -> usize {
    let before = live();
    let (tx, rx) = flume::unbounded();
    for _ in 0..n {
        tx.send(WorkerTask::Terminate).expect("receiver alive");
    }
    let bytes = live() - before;
    drop((tx, rx));
    bytes
}

impl Dynamo {
    pub fn new() -> Self {
        let (tx, rx) = flume::unbounded();
        let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
        let t = tree.clone();
        let writer = std::thread::Builder::new()
            .name("crtc-writer".into())
            .spawn(move || {
                t.worker(rx, None).expect("the writer loop ends cleanly");
            })
            .expect("spawn the writer");
        Dynamo {
            tree,
            tx,
            writer: Some(writer),
            next_id: 0,
        }
    }

    pub fn prepare(&mut self, events: &[Ev]) -> Prepared {
        let events = events
            .iter()
            .map(|e| {
                let id = self.next_id;
                self.next_id += 1;
                let data = match e {
                    Ev::Store { parent, blocks, .. } => {
                        KvCacheEventData::Stored(KvCacheStoreData {
                            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.engine)),
                            start_position: None,
                            blocks: blocks
                                .iter()
                                .map(|b| KvCacheStoredBlockData {
                                    block_hash: ExternalSequenceBlockHash(b.engine),
                                    tokens_hash: LocalBlockHash(b.local),
                                    mm_extra_info: None,
                                })
                                .collect(),
                        })
                    }
                    Ev::Remove { blocks, .. } => KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: blocks
                            .iter()
                            .map(|b| ExternalSequenceBlockHash(b.engine))
                            .collect(),
                    }),
                    Ev::Clear { .. } => KvCacheEventData::Cleared,
                };
                RouterEvent::new(
                    e.worker() as u64,
                    KvCacheEvent {
                        event_id: id,
                        data,
                        dp_rank: 0,
                    },
                )
            })
            .collect();
        Prepared { events }
    }

    /// Dynamo's own path from vLLM's bytes to the events its writer applies: each
    /// payload decoded (`zmq_wire::decode_event_batch`, rmp-serde into its wire types)
    /// and each event normalized (`ZmqEventNormalizer::normalize`: the filters, the
    /// token hashing, the conversion) into a `RouterEvent`, as its ZMQ listener does.
    /// Returns the events and the time that took on this thread.
    pub fn decode(&mut self, batches: &crate::ingest_side::Prepared) -> (Prepared, Duration) {
        use dynamo_kv_router::protocols::WorkerWithDpRank;
        use dynamo_kv_router::zmq_wire::{decode_event_batch, ZmqEventNormalizer};
        let mut normalizer = ZmqEventNormalizer::new(crate::workload::TOKEN_BLOCK);
        let mut events = Vec::with_capacity(batches.len());
        let t = Instant::now();
        for (w, _, bytes) in batches {
            let batch = decode_event_batch(bytes).expect("Dynamo decodes vLLM's bytes");
            let worker = WorkerWithDpRank::new(u64::from(*w), 0);
            for raw in batch.events {
                let id = self.next_id;
                self.next_id += 1;
                let placed = normalizer
                    .normalize(raw, id, worker)
                    .and_then(|p| p.into_router_event())
                    .expect("Dynamo takes every store of the load");
                events.push(placed);
            }
        }
        (Prepared { events }, t.elapsed())
    }

    /// Queues a phase between two markers, lets the writer take it, and returns the
    /// writer's own time from the first marker to the second.
    pub fn apply(&mut self, phase: Prepared) -> Duration {
        let gate = Arc::new(Mutex::new(()));
        let queuing = gate.lock().expect("gate");
        let (start, begun) = Marker::new(&gate);
        self.tx.send(start).expect("writer alive");
        for e in phase.events {
            self.tx.send(WorkerTask::Event(e)).expect("writer alive");
        }
        let (end, ended) = Marker::new(&gate);
        self.tx.send(end).expect("writer alive");
        drop(queuing);
        let t0 = begun.wait();
        ended.wait() - t0
    }

    pub fn query(&self, q: &[LocalBlockHash]) -> u64 {
        let t = Instant::now();
        let s = self.tree.find_matches(q, false);
        let ns = t.elapsed().as_nanos() as u64;
        std::hint::black_box(&s);
        ns
    }

    pub fn depths(&self, q: &Query) -> BTreeMap<u64, u32> {
        let locals: Vec<LocalBlockHash> =
            q.blocks.iter().map(|b| LocalBlockHash(b.local)).collect();
        self.tree
            .find_matches(&locals, false)
            .scores
            .iter()
            .filter(|(_, &d)| d > 0)
            .map(|(w, &d)| (w.worker_id, d))
            .collect()
    }
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        let _ = self.tx.send(WorkerTask::Terminate);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
