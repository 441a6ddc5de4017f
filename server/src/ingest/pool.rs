//! The ingest threads: a fixed number (`--ingest-threads`) of plain OS threads, each
//! polling the subscriptions it was dealt with one `zmq_poll`. A source is dealt to the
//! thread with the fewest; nothing here grows with the number of workers but sockets.
//!
//! A thread decodes and sequences what its publishers send ([`kvix_events::stream`]) and
//! hands each delivery to the worker's home executor over that executor's bounded
//! channel, waiting when it is full (the executors' write queues set the pace).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures::channel::mpsc;
use futures::SinkExt;
use kvix_wire::{Feed, WorkerId};

use super::bound::{self, BindSpec, Bound, Frame};
use super::context::{Context, SOCKETS_PER_SOURCE};
use super::socket::{Backoff, Link, ReplayCall, Subscription};
use super::{SourceSpec, METRICS};
use crate::loud::count_loudly;
use crate::write::record::Write;
use kvix_events::stream::{Ask, Delivery, LastBatch, Stream, Tally};

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

/// Where a stream's messages come from.
enum Input {
    /// Its own subscription to the engine's publisher.
    Own(Subscription),
    /// The bound sockets: the thread puts its messages here.
    Bound(BoundStream),
}

struct BoundStream {
    rank: usize,
    topic: String,
    /// The address its engine connects from (its topic's host, else its messages').
    peer: Option<IpAddr>,
    inbox: VecDeque<Frame>,
    /// A connection change not yet handed to the stream.
    link: Option<Link>,
    /// Since when its engine has had no connection, as the bound sockets last told
    /// (None: connected).
    down_since: Option<Instant>,
    /// When its retire was sent (the engine gone past the grace period).
    retire_sent: Option<Instant>,
}

struct Live {
    spec: StreamSpec,
    input: Input,
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
    /// A stream of `spec` reading from `input`, counted as a source.
    fn new(spec: StreamSpec, input: Input) -> Live {
        METRICS.sources.fetch_add(1, Relaxed);
        let stream = Stream::new(spec.last, !spec.source.replay.is_empty());
        Live {
            spec,
            input,
            stream,
            up: false,
            backoff: Backoff::default(),
            replay: None,
            queued: None,
        }
    }

    /// The next connection change of its publisher, if one is waiting.
    fn next_link(&mut self) -> Option<Link> {
        match &mut self.input {
            Input::Own(sub) => sub.link(),
            Input::Bound(b) => b.link.take(),
        }
    }

    /// The next live message, if one is waiting.
    fn next_message(&mut self) -> Option<Frame> {
        match &mut self.input {
            Input::Own(sub) => sub.next(),
            Input::Bound(b) => b.inbox.pop_front(),
        }
    }

    /// Whether it has something to serve that no socket of its own signals.
    fn has_pending(&self) -> bool {
        match &self.input {
            Input::Own(_) => false,
            Input::Bound(b) => !self.waiting() && (b.link.is_some() || !b.inbox.is_empty()),
        }
    }

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
                Err(e) => ask = self.stream.replayed(Err(e.into()), out, t),
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
    /// Thread 0: the sockets engines connect to, and which stream each (rank, topic) is.
    bound: Option<Bound>,
    bound_index: HashMap<(usize, String), usize>,
    discovering: Arc<AtomicBool>,
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
            if self.streams.is_empty() && self.bound.is_none() {
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
            let mut ready = self.ready();
            if self.bound.is_some() {
                if !self.read_bound() {
                    return;
                }
                ready.extend((0..self.streams.len()).filter(|&i| self.streams[i].has_pending()));
                ready.sort_unstable();
                ready.dedup();
            }
            for i in ready {
                self.serve(i, &mut out);
                if !self.deliver(i, &mut out) {
                    return;
                }
            }
            if !self.retire_gone() {
                return;
            }
        }
    }

    /// Reads what the bound sockets have: connection changes, then each message into its
    /// stream's inbox, announcing the engines first heard of. False once the server stops.
    fn read_bound(&mut self) -> bool {
        let Some(bound) = self.bound.as_mut() else {
            return true;
        };
        let now = Instant::now();
        for change in bound.connection_changes() {
            for s in &mut self.streams {
                if let Input::Bound(b) = &mut s.input {
                    if b.rank == change.rank && b.peer == Some(change.peer) {
                        set_link(b, change.open > 0, now);
                    }
                }
            }
        }
        let mut announces = Vec::new();
        for rank in 0..bound.ranks() {
            for _ in 0..BURST {
                let Some(m) = bound.next(rank) else { break };
                METRICS.messages.fetch_add(1, Relaxed);
                let key = (m.rank, m.topic);
                match self.bound_index.get(&key) {
                    Some(&i) => {
                        let Input::Bound(b) = &mut self.streams[i].input else {
                            continue;
                        };
                        // Where its messages come from says more than its topic's host.
                        if m.peer.is_some() {
                            b.peer = m.peer;
                        }
                        // A message comes over a connection: the engine is there.
                        set_link(b, true, now);
                        // As libzmq's queue of a subscription of its own would, past
                        // its bound (a stream waiting for a long replay): the stream
                        // meets a gap, which its replay fills.
                        if b.inbox.len() < BOUND_INBOX {
                            b.inbox.push_back(m.frame);
                        } else {
                            if let Some(n) = count_loudly(&METRICS.inbox_dropped) {
                                tracing::warn!(topic = %key.1, "ingest: a message on --events-bind dropped, its stream holding {BOUND_INBOX} unread (a long replay; {n} dropped so far): its replay fills the gap");
                            }
                        }
                    }
                    None => {
                        if !self.discovering.load(Relaxed) {
                            continue;
                        }
                        match bound.spec.discover(key.0, &key.1) {
                            Some(d) => {
                                if bound.announce_due(key.0, &key.1) {
                                    announces.push(d);
                                }
                                if !bound.hold_early(key.0, &key.1, m.frame) {
                                    if let Some(n) = count_loudly(&METRICS.inbox_dropped) {
                                        tracing::warn!(topic = %key.1, "ingest: a message on --events-bind dropped while its worker's announce was on its way (held messages full; {n} dropped so far): its replay fills the gap, without --events-replay-port its history is lost");
                                    }
                                }
                            }
                            None => {
                                if let Some(n) = count_loudly(&METRICS.unknown_topics) {
                                    tracing::warn!(topic = %key.1, "ingest: a message on --events-bind whose topic does not have the --events-topic form was dropped ({n} so far)");
                                }
                            }
                        }
                    }
                }
            }
        }
        let lanes = bound.spec.lanes.clone();
        for d in announces {
            tracing::info!(worker = %d.name, endpoint = %d.source.endpoint, replay = %d.source.replay, "ingest: an engine connected for the first time; announcing it");
            METRICS.engines_announced.fetch_add(1, Relaxed);
            let announce = Write::Announce {
                name: d.name,
                lanes: lanes.clone(),
                feed: Feed::Events,
                source: Some(d.source),
            };
            if futures::executor::block_on(self.homes[0].send(announce)).is_err() {
                return false;
            }
        }
        true
    }

    /// Retires the bound workers whose engine has had no connection for the grace period.
    /// False once the server stops.
    fn retire_gone(&mut self) -> bool {
        let Some(grace) = self.bound.as_ref().map(|b| b.spec.grace) else {
            return true;
        };
        let now = Instant::now();
        for s in &mut self.streams {
            let Input::Bound(b) = &mut s.input else {
                continue;
            };
            let gone = b.down_since.is_some_and(|t| now.duration_since(t) >= grace);
            let sent = b
                .retire_sent
                .is_some_and(|t| now.duration_since(t) < RETIRE_AGAIN);
            if !gone || sent {
                continue;
            }
            b.retire_sent = Some(now);
            METRICS.engines_gone.fetch_add(1, Relaxed);
            tracing::warn!(worker = %s.spec.name, topic = %b.topic, "ingest: the engine has had no connection for {grace:?} (--events-grace); retiring its worker");
            let retire = Write::Retire {
                worker: s.spec.worker,
            };
            if futures::executor::block_on(self.homes[0].send(retire)).is_err() {
                return false;
            }
        }
        true
    }

    fn index_bound(&mut self) {
        self.bound_index = self
            .streams
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.input {
                Input::Bound(b) => Some(((b.rank, b.topic.clone()), i)),
                Input::Own(_) => None,
            })
            .collect();
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
                None => match &s.input {
                    Input::Own(sub) => {
                        items.push(sub.sub.as_poll_item(zmq::POLLIN));
                        items.push(sub.monitor.as_poll_item(zmq::POLLIN));
                        owners.extend([i, i]);
                    }
                    Input::Bound(_) if s.has_pending() => timeout = std::time::Duration::ZERO,
                    Input::Bound(_) => {}
                },
            }
        }
        // The bound sockets are read after the poll whatever it says (read_bound).
        if let Some(b) = &self.bound {
            items.extend(b.poll_items());
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
            // The bound sockets' items have no owner.
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
        let bound = bound::parse_source_endpoint(&spec.source.endpoint)
            .map(|(rank, topic)| (rank, topic.to_string()));
        if let Some((rank, topic)) = bound {
            self.add_bound(spec, rank, topic);
            return;
        }
        match Subscription::open(&self.replays.ctx, &spec.source.endpoint) {
            Ok(subscription) => {
                tracing::info!(worker = %spec.name, endpoint = %spec.source.endpoint, replay = %spec.source.replay, "ingest: subscribing");
                self.streams.push(Live::new(spec, Input::Own(subscription)));
            }
            Err(e) => {
                METRICS.connect_failures.fetch_add(1, Relaxed);
                tracing::error!(worker = %spec.name, endpoint = %spec.source.endpoint, "ingest: cannot subscribe: {e}");
            }
        }
    }

    /// A stream of the bound sockets: up at once if its engine is connected (it catches
    /// up as after a reconnect), else its grace period starts now (a message or a
    /// connection from its engine ends it).
    fn add_bound(&mut self, spec: StreamSpec, rank: usize, topic: String) {
        let Some(bound) = self.bound.as_mut().filter(|b| rank < b.ranks()) else {
            METRICS.connect_failures.fetch_add(1, Relaxed);
            tracing::error!(worker = %spec.name, endpoint = %spec.source.endpoint, "ingest: cannot subscribe: no --events-bind socket for that rank");
            return;
        };
        let early = bound.subscribed(rank, &topic);
        let peer = bound.spec.peer_of(&topic);
        let connected = peer.is_some_and(|p| bound.connected(rank, p));
        tracing::info!(worker = %spec.name, endpoint = %spec.source.endpoint, replay = %spec.source.replay, connected, "ingest: serving a bound stream");
        let b = BoundStream {
            rank,
            topic,
            peer,
            inbox: early,
            // It catches up now (the engine spoke a moment ago, or the server
            // restarted): what came before its worker was subscribed is in the replay.
            link: Some(Link::Up),
            down_since: (!connected).then(Instant::now),
            retire_sent: None,
        };
        self.streams.push(Live::new(spec, Input::Bound(b)));
        self.index_bound();
    }

    fn remove(&mut self, worker: WorkerId) {
        if let Some(i) = self.streams.iter().position(|s| s.spec.worker == worker) {
            let s = self.streams.swap_remove(i);
            self.index_bound();
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
            let Some(link) = s.next_link() else {
                break;
            };
            match link {
                Link::Up => {
                    // A bound stream is told to catch up when it starts, connected or not.
                    let connected = match &s.input {
                        Input::Own(_) => true,
                        Input::Bound(b) => b.down_since.is_none(),
                    };
                    if connected && !s.up {
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
                    match &s.input {
                        Input::Own(_) => {
                            tracing::warn!(worker = %s.spec.name, "ingest: publisher disconnected; libzmq reconnects")
                        }
                        Input::Bound(_) => {
                            tracing::warn!(worker = %s.spec.name, "ingest: the engine disconnected; its worker is retired unless it connects again within --events-grace")
                        }
                    }
                }
            }
        }
        for _ in 0..BURST {
            if s.waiting() {
                break;
            }
            match s.next_message() {
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

/// Notes whether a bound stream's engine is connected; a change is handed to the stream.
fn set_link(b: &mut BoundStream, up: bool, now: Instant) {
    if up == b.down_since.is_none() {
        return;
    }
    if up {
        b.down_since = None;
        b.retire_sent = None;
        b.link = Some(Link::Up);
    } else {
        b.down_since = Some(now);
        b.link = Some(Link::Down);
    }
}
