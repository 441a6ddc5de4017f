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

use futures::channel::mpsc;
use futures::SinkExt;
use kvix_wire::WorkerId;

use super::context::{Context, SOCKETS_PER_SOURCE};
use super::socket::{Backoff, Link, ReplayCall, Subscription};
use super::{SourceSpec, METRICS};
use crate::durable::write::Write;
use kvix_events::stream::{Ask, Delivery, LastBatch, Stream, Tally};

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
}

impl Pool {
    /// Starts `threads` threads for up to `max_sources` sources, delivering to `homes`
    /// (one channel per executor; a worker's home is `worker % homes.len()`).
    pub fn start(
        threads: usize,
        max_sources: usize,
        homes: Vec<mpsc::Sender<Write>>,
    ) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        // Twice the sources' sockets: a replaced subscription's sockets keep their slots
        // until libzmq's reaper has closed them, after the new one has opened.
        let sockets = 2 * SOCKETS_PER_SOURCE * max_sources + REPLAYS_AT_ONCE * threads + 64;
        let ctx = Arc::new(Context::new(sockets).map_err(std::io::Error::other)?);
        let stop = Arc::new(AtomicBool::new(false));
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
        let t = (0..load.len()).min_by_key(|&t| load[t]).unwrap_or(0);
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

/// Replays in flight at once per ingest thread: each buffers up to its byte limit, and
/// engines (or the server) restarting together ask for one per source at once. The
/// rest wait their turn in the order they asked.
const REPLAYS_AT_ONCE: usize = 4;

/// What the streams of one thread share to ask for replays.
struct Replays {
    ctx: Arc<Context>,
    /// Replays that may still be started now.
    free: usize,
    /// Orders the waiting ones.
    next_turn: u64,
}

struct Live {
    spec: StreamSpec,
    subscription: Subscription,
    stream: Stream,
    up: bool,
    backoff: Backoff,
    /// The replay the stream waits for: its subscription is not read meanwhile (libzmq
    /// queues what comes), the other streams of the thread go on.
    replay: Option<ReplayCall>,
    /// A replay asked for while `REPLAYS_AT_ONCE` were in flight: (turn, from).
    queued: Option<(u64, u64)>,
}

impl Live {
    /// Whether the stream waits for a replay (in flight or queued).
    fn waiting(&self) -> bool {
        self.replay.is_some() || self.queued.is_some()
    }

    /// Asks for the replay the stream needs, if any; one that cannot be asked (a
    /// backoff after a failed one, a socket error) is answered with why at once.
    fn ask(&mut self, r: &mut Replays, mut ask: Ask, out: &mut Vec<Delivery>, t: &mut Tally) {
        while let Some(from) = ask {
            if r.free == 0 {
                self.queued = Some((r.next_turn, from));
                r.next_turn += 1;
                METRICS.replays_queued.fetch_add(1, Relaxed);
                return;
            }
            let endpoint = &self.spec.source.replay;
            let started = self.backoff.check(endpoint).and_then(|()| {
                ReplayCall::start(&r.ctx, endpoint, from)
                    .inspect_err(|_| self.backoff.record(false))
            });
            match started {
                Ok(call) => {
                    r.free -= 1;
                    METRICS.replays_in_flight.fetch_add(1, Relaxed);
                    self.replay = Some(call);
                    return;
                }
                Err(e) => ask = self.stream.replayed(Err(e), out, t),
            }
        }
    }

    /// Takes what the replay in flight has received; once it ended, hands the stream its
    /// answer.
    fn progress(&mut self, r: &mut Replays, out: &mut Vec<Delivery>, t: &mut Tally) {
        let Some(got) = self.replay.as_mut().and_then(ReplayCall::step) else {
            return;
        };
        self.replay = None;
        r.free += 1;
        METRICS.replays_in_flight.fetch_sub(1, Relaxed);
        self.backoff.record(got.is_ok());
        let ask = self.stream.replayed(got, out, t);
        self.ask(r, ask, out, t);
    }
}

/// What one ingest thread runs: the streams dealt to it, polled together.
struct IngestThread {
    slot: Arc<ThreadSlot>,
    homes: Vec<mpsc::Sender<Write>>,
    stop: Arc<AtomicBool>,
    streams: Vec<Live>,
    replays: Replays,
}

impl IngestThread {
    fn run(mut self) {
        let mut out = Vec::new();
        while !self.stop.load(Relaxed) {
            let commands = std::mem::take(&mut *self.slot.commands.lock().expect("not poisoned"));
            for c in commands {
                match c {
                    Command::Add(spec) => self.add(spec),
                    Command::Remove(w) => self.remove(w),
                }
            }
            if self.streams.is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
                continue;
            }
            while let Some(i) = self.next_queued() {
                let mut tally = Tally::default();
                let s = &mut self.streams[i];
                let from = s.queued.take().map(|(_, from)| from);
                METRICS.replays_queued.fetch_sub(1, Relaxed);
                s.ask(&mut self.replays, from, &mut out, &mut tally);
                METRICS.tally(&tally);
                if !self.deliver(i, &mut out) {
                    return;
                }
            }
            for i in self.ready() {
                self.serve(i, &mut out);
                if !self.deliver(i, &mut out) {
                    return;
                }
            }
        }
    }

    /// The stream whose queued replay is next, if one may be started now.
    fn next_queued(&self) -> Option<usize> {
        if self.replays.free == 0 {
            return None;
        }
        (0..self.streams.len())
            .filter_map(|i| Some((self.streams[i].queued?.0, i)))
            .min()
            .map(|(_, i)| i)
    }

    /// Waits (at most `POLL_MS`, less when a replay's deadline is nearer) for the
    /// streams that have something to read, or a replay in flight that reached its
    /// deadline.
    fn ready(&self) -> Vec<usize> {
        let mut owners = Vec::with_capacity(2 * self.streams.len());
        let mut items: Vec<zmq::PollItem<'_>> = Vec::with_capacity(2 * self.streams.len());
        let mut timeout = std::time::Duration::from_millis(POLL_MS as u64);
        let now = std::time::Instant::now();
        for (i, s) in self.streams.iter().enumerate() {
            match &s.replay {
                Some(call) => {
                    timeout = timeout.min(call.deadline().saturating_duration_since(now));
                    items.push(call.poll_item());
                    owners.push(i);
                }
                None if s.queued.is_some() => {}
                None => {
                    items.push(s.subscription.sub.as_poll_item(zmq::POLLIN));
                    items.push(s.subscription.monitor.as_poll_item(zmq::POLLIN));
                    owners.extend([i, i]);
                }
            }
        }
        // Rounded up: a deadline is found passed when the poll returns.
        let ms = timeout.as_micros().div_ceil(1000) as i64;
        if let Err(e) = zmq::poll(&mut items, ms) {
            tracing::error!("ingest: zmq_poll failed: {e}");
            std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
            return Vec::new();
        }
        let now = std::time::Instant::now();
        let mut ready: Vec<usize> = items
            .iter()
            .zip(&owners)
            .filter(|(item, _)| item.is_readable())
            .map(|(_, &i)| i)
            .chain(
                self.streams
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.replay.as_ref().is_some_and(|c| c.deadline() <= now))
                    .map(|(i, _)| i),
            )
            .collect();
        ready.sort_unstable();
        ready.dedup();
        ready
    }

    fn add(&mut self, spec: StreamSpec) {
        self.remove(spec.worker);
        match Subscription::open(&self.replays.ctx, &spec.source.endpoint) {
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
                    replay: None,
                    queued: None,
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
            if s.replay.is_some() {
                self.replays.free += 1;
                METRICS.replays_in_flight.fetch_sub(1, Relaxed);
            }
            if s.queued.is_some() {
                METRICS.replays_queued.fetch_sub(1, Relaxed);
            }
            METRICS.sources.fetch_sub(1, Relaxed);
            if s.up {
                METRICS.connected.fetch_sub(1, Relaxed);
            }
            tracing::info!(worker = %s.spec.name, "ingest: unsubscribed");
        }
    }

    /// Reads what stream `i` has waiting: its replay's replies if one is in flight, else
    /// monitor events first (a reconnect catches up before the messages that follow
    /// it), then a burst of messages, until the stream asks for a replay.
    fn serve(&mut self, i: usize, out: &mut Vec<Delivery>) {
        let (s, r) = (&mut self.streams[i], &mut self.replays);
        let mut tally = Tally::default();
        s.progress(r, out, &mut tally);
        while !s.waiting() {
            let Some(link) = s.subscription.link() else {
                break;
            };
            match link {
                Link::Up => {
                    if !s.up {
                        METRICS.connected.fetch_add(1, Relaxed);
                        s.up = true;
                    }
                    tracing::info!(worker = %s.spec.name, "ingest: publisher connected");
                    let ask = s.stream.connected();
                    s.ask(r, ask, out, &mut tally);
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
            if s.waiting() {
                break;
            }
            match s.subscription.next() {
                None => break,
                Some(Ok((seq, payload))) => {
                    METRICS.messages.fetch_add(1, Relaxed);
                    let ask = s.stream.live(seq, &payload, out, &mut tally);
                    s.ask(r, ask, out, &mut tally);
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
            let job = Write::Ingest {
                worker: s.spec.worker,
                epoch: s.spec.epoch,
                model: s.spec.source.model.clone(),
                salt: s.spec.source.salt.clone(),
                reset: delivery.reset,
                last: delivery.record,
                after: delivery.after,
                payload: delivery.payload,
                batch: delivery.batch,
            };
            if futures::executor::block_on(self.homes[home].send(job)).is_err() {
                return false;
            }
        }
        true
    }
}
