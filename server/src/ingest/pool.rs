//! The ingest threads: a fixed number (`--ingest-threads`) of plain OS threads, each
//! polling the subscriptions it was dealt with one `zmq_poll`. A source is dealt to the
//! thread with the fewest; nothing here grows with the number of workers but sockets.
//!
//! A thread decodes and sequences what its publishers send ([`super::stream`]) and
//! hands each delivery to the worker's home executor over that executor's bounded
//! channel, waiting when it is full (the executors' write queues set the pace).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use futures::channel::mpsc;
use futures::SinkExt;
use kvix_wire::WorkerId;

use super::socket::{Backoff, Link, Replayer, Subscription};
use super::stream::{Delivery, Record, Stream, Tally};
use super::{IngestJob, SourceSpec, METRICS};

/// How long a thread waits in `zmq_poll` before it looks at its commands again.
const POLL_MS: i64 = 50;
/// Messages taken from one subscription before the others get their turn.
const BURST: usize = 256;

/// One source to subscribe.
pub struct StreamSpec {
    pub worker: WorkerId,
    pub name: String,
    pub source: Arc<SourceSpec>,
    /// Where the last snapshot left this stream (None: a new stream).
    pub last: Option<Record>,
    /// The ingest lease's epoch (replicas; 0 otherwise).
    pub epoch: u64,
}

enum Command {
    Add(StreamSpec),
    Remove(WorkerId),
}

struct Lane {
    commands: Mutex<Vec<Command>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

/// The ingest threads and which worker each one serves.
pub struct Pool {
    lanes: Vec<Arc<Lane>>,
    dealt: Mutex<HashMap<WorkerId, usize>>,
    stop: Arc<AtomicBool>,
}

impl Pool {
    /// Starts `threads` threads delivering to `homes` (one channel per executor; a
    /// worker's home is `worker % homes.len()`).
    pub fn start(threads: usize, homes: Vec<mpsc::Sender<IngestJob>>) -> std::io::Result<Pool> {
        let ctx = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let mut lanes = Vec::new();
        for i in 0..threads.max(1) {
            let lane = Arc::new(Lane {
                commands: Mutex::new(Vec::new()),
                handle: Mutex::new(None),
            });
            let worker = Worker {
                ctx: ctx.clone(),
                lane: lane.clone(),
                homes: homes.clone(),
                stop: stop.clone(),
                streams: Vec::new(),
            };
            let handle = std::thread::Builder::new()
                .name(format!("kvix-ingest-{i}"))
                .spawn(move || worker.run())?;
            *lane.handle.lock().expect("not poisoned") = Some(handle);
            lanes.push(lane);
        }
        Ok(Pool {
            lanes,
            dealt: Mutex::new(HashMap::new()),
            stop,
        })
    }

    pub fn threads(&self) -> usize {
        self.lanes.len()
    }

    /// Subscribes a source (replacing the worker's previous one).
    pub fn subscribe(&self, spec: StreamSpec) {
        self.unsubscribe(spec.worker);
        let mut dealt = self.dealt.lock().expect("not poisoned");
        let mut load = vec![0usize; self.lanes.len()];
        for &t in dealt.values() {
            load[t] += 1;
        }
        let t = (0..load.len()).min_by_key(|&t| load[t]).unwrap_or(0);
        dealt.insert(spec.worker, t);
        self.lanes[t]
            .commands
            .lock()
            .expect("not poisoned")
            .push(Command::Add(spec));
    }

    /// Stops the worker's stream, if it has one.
    pub fn unsubscribe(&self, worker: WorkerId) {
        if let Some(t) = self.dealt.lock().expect("not poisoned").remove(&worker) {
            self.lanes[t]
                .commands
                .lock()
                .expect("not poisoned")
                .push(Command::Remove(worker));
        }
    }

    /// Stops every thread and waits for them.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
        for lane in &self.lanes {
            if let Some(h) = lane.handle.lock().expect("not poisoned").take() {
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

struct Live {
    spec: StreamSpec,
    subscription: Subscription,
    stream: Stream,
    up: bool,
    backoff: Backoff,
}

struct Worker {
    ctx: zmq::Context,
    lane: Arc<Lane>,
    homes: Vec<mpsc::Sender<IngestJob>>,
    stop: Arc<AtomicBool>,
    streams: Vec<Live>,
}

impl Worker {
    fn run(mut self) {
        let mut out = Vec::new();
        while !self.stop.load(Relaxed) {
            let commands = std::mem::take(&mut *self.lane.commands.lock().expect("not poisoned"));
            for c in commands {
                match c {
                    Command::Add(spec) => self.add(spec),
                    Command::Remove(w) => self.remove(w),
                }
            }
            let ready: Vec<usize> = {
                let mut items: Vec<zmq::PollItem<'_>> = self
                    .streams
                    .iter()
                    .flat_map(|s| {
                        [
                            s.subscription.sub.as_poll_item(zmq::POLLIN),
                            s.subscription.monitor.as_poll_item(zmq::POLLIN),
                        ]
                    })
                    .collect();
                if items.is_empty() {
                    std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
                    continue;
                }
                match zmq::poll(&mut items, POLL_MS) {
                    Ok(0) => continue,
                    Ok(_) => (0..self.streams.len())
                        .filter(|&i| items[2 * i].is_readable() || items[2 * i + 1].is_readable())
                        .collect(),
                    Err(e) => {
                        tracing::error!("ingest: zmq_poll failed: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
                        continue;
                    }
                }
            };
            for i in ready {
                self.serve(i, &mut out);
                if !self.deliver(i, &mut out) {
                    return;
                }
            }
        }
    }

    fn add(&mut self, spec: StreamSpec) {
        self.remove(spec.worker);
        match Subscription::open(&self.ctx, &spec.source.endpoint) {
            Ok(subscription) => {
                tracing::info!(worker = %spec.name, endpoint = %spec.source.endpoint, replay = %spec.source.replay, "ingest: subscribing");
                METRICS.sources.fetch_add(1, Relaxed);
                let stream = Stream::new(spec.last, !spec.source.replay.is_empty());
                self.streams.push(Live {
                    spec,
                    subscription,
                    stream,
                    up: false,
                    backoff: Backoff::default(),
                });
            }
            Err(e) => {
                METRICS.connect_failures.fetch_add(1, Relaxed);
                tracing::error!(worker = %spec.name, endpoint = %spec.source.endpoint, "ingest: cannot subscribe: {e}");
            }
        }
    }

    fn remove(&mut self, worker: WorkerId) {
        if let Some(i) = self.streams.iter().position(|s| s.spec.worker == worker) {
            let s = self.streams.swap_remove(i);
            METRICS.sources.fetch_sub(1, Relaxed);
            if s.up {
                METRICS.connected.fetch_sub(1, Relaxed);
            }
            tracing::info!(worker = %s.spec.name, "ingest: unsubscribed");
        }
    }

    /// Reads what stream `i` has waiting: monitor events first (a reconnect catches up
    /// before the messages that follow it), then a burst of messages.
    fn serve(&mut self, i: usize, out: &mut Vec<Delivery>) {
        let s = &mut self.streams[i];
        let mut tally = Tally::default();
        let mut replay = Replayer {
            ctx: &self.ctx,
            endpoint: &s.spec.source.replay,
            backoff: &mut s.backoff,
        };
        while let Some(link) = s.subscription.link() {
            match link {
                Link::Up => {
                    if !s.up {
                        METRICS.connected.fetch_add(1, Relaxed);
                        s.up = true;
                    }
                    tracing::info!(worker = %s.spec.name, "ingest: publisher connected");
                    s.stream.connected(&mut replay, out, &mut tally);
                }
                Link::Down => {
                    if s.up {
                        METRICS.connected.fetch_sub(1, Relaxed);
                        s.up = false;
                    }
                    tracing::warn!(worker = %s.spec.name, "ingest: publisher disconnected; libzmq reconnects");
                }
            }
        }
        for _ in 0..BURST {
            match s.subscription.next() {
                None => break,
                Some(Ok((seq, payload))) => {
                    METRICS.messages.fetch_add(1, Relaxed);
                    s.stream.live(seq, &payload, &mut replay, out, &mut tally);
                }
                Some(Err(frames)) => {
                    METRICS.malformed.fetch_add(1, Relaxed);
                    tracing::debug!(worker = %s.spec.name, "ingest: a message of {frames} frames skipped");
                }
            }
        }
        METRICS.tally(&tally);
    }

    /// Hands stream `i`'s deliveries to its worker's home; false once the server stops.
    fn deliver(&mut self, i: usize, out: &mut Vec<Delivery>) -> bool {
        let s = &self.streams[i];
        let home = s.spec.worker as usize % self.homes.len();
        for delivery in out.drain(..) {
            let job = IngestJob {
                worker: s.spec.worker,
                epoch: s.spec.epoch,
                source: s.spec.source.clone(),
                delivery,
            };
            if futures::executor::block_on(self.homes[home].send(job)).is_err() {
                return false;
            }
        }
        true
    }
}
