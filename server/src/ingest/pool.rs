//! The ingest threads: a fixed number (`--ingest-threads`) of plain OS threads, each
//! polling the subscriptions it was dealt with one `zmq_poll`. A source is dealt to the
//! thread with the fewest; nothing here grows with the number of workers but sockets.
//!
//! A thread decodes and sequences what its publishers send ([`kvix_events::stream`]) and
//! hands each delivery to the worker's home executor over that executor's bounded
//! channel, waiting when it is full (the executors' write queues set the pace).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::channel::mpsc;
use kvix_wire::WorkerId;

use super::bound::{self, BindSpec, Bound};
use super::context::{Context, SOCKETS_PER_SOURCE};
use super::SourceSpec;
use crate::write::record::Write;
use kvix_events::stream::LastBatch;

mod bound_sockets;
mod live;
mod thread;

use live::{Replays, REPLAYS_AT_ONCE};
use thread::IngestThread;

/// How long a thread waits in `zmq_poll` before it looks at its commands again.
const POLL_MS: i64 = 50;
/// Messages taken from one subscription before the others get their turn.
const BURST: usize = 256;
/// Messages a bound stream's inbox holds (a subscription's own queue: its rcvhwm).
const BOUND_INBOX: usize = 100_000;

/// One source to subscribe.
pub struct StreamSpec {
    pub worker: WorkerId,
    pub name: String,
    pub source: Arc<SourceSpec>,
    /// Where the last snapshot left this stream (None: a new stream).
    pub last: Option<LastBatch>,
    /// The ingest lease's epoch (replicas; 0 otherwise).
    pub epoch: u64,
}

enum Command {
    Add(StreamSpec),
    Remove(WorkerId),
}

/// The pool's end of one ingest thread: the commands waiting for it, its join handle.
struct ThreadSlot {
    commands: Mutex<Vec<Command>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

/// The ingest threads and which worker each one serves.
pub struct Pool {
    slots: Vec<Arc<ThreadSlot>>,
    dealt: Mutex<HashMap<WorkerId, usize>>,
    stop: Arc<AtomicBool>,
    /// Whether engines first heard of on the bound sockets are announced (not while the
    /// server restores: an announce would interleave with the log's replay).
    discovering: Arc<AtomicBool>,
    /// The engines connected to the bound sockets (with `--events-bind`).
    pub presence: Option<Arc<bound::Presence>>,
}

/// How long a retire of a gone engine may stay unanswered before it is sent again.
const RETIRE_AGAIN: Duration = Duration::from_secs(10);

impl Pool {
    /// Starts `threads` threads for up to `max_sources` sources, delivering to `homes`
    /// (one channel per executor; a worker's home is `worker % homes.len()`).
    /// Thread 0 binds `bind`'s sockets, if any, and serves every `bound://` source.
    pub fn start(
        threads: usize,
        max_sources: usize,
        homes: Vec<mpsc::Sender<Write>>,
        bind: Option<BindSpec>,
    ) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        // Twice the sources' sockets: a replaced subscription's sockets keep their slots
        // until libzmq's reaper has closed them, after the new one has opened.
        let sockets = 2 * SOCKETS_PER_SOURCE * max_sources + REPLAYS_AT_ONCE * threads + 64;
        let ctx = Arc::new(Context::new(sockets).map_err(std::io::Error::other)?);
        let stop = Arc::new(AtomicBool::new(false));
        let discovering = Arc::new(AtomicBool::new(false));
        let mut bound = match bind {
            Some(spec) => Some(Bound::bind(&ctx, spec).map_err(std::io::Error::other)?),
            None => None,
        };
        let presence = bound.as_ref().map(Bound::presence);
        let mut slots = Vec::new();
        for i in 0..threads {
            let slot = Arc::new(ThreadSlot {
                commands: Mutex::new(Vec::new()),
                handle: Mutex::new(None),
            });
            let thread = IngestThread {
                slot: slot.clone(),
                homes: homes.clone(),
                stop: stop.clone(),
                streams: Vec::new(),
                bound: bound.take(),
                bound_index: HashMap::new(),
                discovering: discovering.clone(),
                replays: Replays {
                    ctx: ctx.clone(),
                    free: REPLAYS_AT_ONCE,
                    next_turn: 0,
                },
            };
            let handle = std::thread::Builder::new()
                .name(format!("kvix-ingest-{i}"))
                .spawn(move || thread.run())?;
            *slot.handle.lock().expect("not poisoned") = Some(handle);
            slots.push(slot);
        }
        Ok(Pool {
            slots,
            dealt: Mutex::new(HashMap::new()),
            stop,
            discovering,
            presence,
        })
    }

    pub fn threads(&self) -> usize {
        self.slots.len()
    }

    /// Subscribes a source (replacing the worker's previous one).
    pub fn subscribe(&self, spec: StreamSpec) {
        self.unsubscribe(spec.worker);
        let mut dealt = self.dealt.lock().expect("not poisoned");
        let mut load = vec![0usize; self.slots.len()];
        for &t in dealt.values() {
            load[t] += 1;
        }
        // Thread 0 holds the bound sockets.
        let t = if bound::parse_source_endpoint(&spec.source.endpoint).is_some() {
            0
        } else {
            (0..load.len()).min_by_key(|&t| load[t]).unwrap_or(0)
        };
        dealt.insert(spec.worker, t);
        self.slots[t]
            .commands
            .lock()
            .expect("not poisoned")
            .push(Command::Add(spec));
    }

    /// Stops the worker's stream, if it has one.
    pub fn unsubscribe(&self, worker: WorkerId) {
        if let Some(t) = self.dealt.lock().expect("not poisoned").remove(&worker) {
            self.slots[t]
                .commands
                .lock()
                .expect("not poisoned")
                .push(Command::Remove(worker));
        }
    }

    /// Engines first heard of on the bound sockets are announced from now on.
    pub fn discover(&self) {
        self.discovering.store(true, Relaxed);
    }

    /// Stops every thread and waits for them.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
        for slot in &self.slots {
            if let Some(h) = slot.handle.lock().expect("not poisoned").take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}
