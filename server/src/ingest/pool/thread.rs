//! One ingest thread: its commands, its poll over every stream it was dealt, and the
//! deliveries it hands to the workers' homes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use futures::channel::mpsc;
use futures::SinkExt;
use kvix_wire::WorkerId;

use super::live::{Input, Live, Replays};
use super::{Command, StreamSpec, ThreadSlot, BURST, POLL_MS};
use crate::ingest::bound::{self, Bound};
use crate::ingest::socket::{Link, Subscription};
use crate::ingest::METRICS;
use crate::write::record::Write;
use kvix_events::stream::{Delivery, Tally};

/// What one ingest thread runs: the streams dealt to it, polled together.
pub(super) struct IngestThread {
    pub(super) slot: Arc<ThreadSlot>,
    pub(super) homes: Vec<mpsc::Sender<Write>>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) streams: Vec<Live>,
    /// Thread 0: the sockets engines connect to, and which stream each (rank, topic) is.
    pub(super) bound: Option<Bound>,
    pub(super) bound_index: HashMap<(usize, String), usize>,
    pub(super) discovering: Arc<AtomicBool>,
    pub(super) replays: Replays,
}

impl IngestThread {
    pub(super) fn run(mut self) {
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
                self.read_stream(i, &mut out);
                if !self.deliver(i, &mut out) {
                    return;
                }
            }
            if !self.retire_gone() {
                return;
            }
        }
    }

    /// The stream whose queued replay is next, if one may be started now.
    pub(super) fn next_queued(&self) -> Option<usize> {
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
    pub(super) fn ready(&self) -> Vec<usize> {
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

    pub(super) fn add(&mut self, spec: StreamSpec) {
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

    pub(super) fn remove(&mut self, worker: WorkerId) {
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
    pub(super) fn read_stream(&mut self, i: usize, out: &mut Vec<Delivery>) {
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
    pub(super) fn deliver(&mut self, i: usize, out: &mut Vec<Delivery>) -> bool {
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
