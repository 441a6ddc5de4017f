//! A stream an ingest thread reads: its source (its own subscription, or its share of
//! the bound sockets), its sequencing, and its replays.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use super::StreamSpec;
use crate::ingest::bound::Frame;
use crate::ingest::context::Context;
use crate::ingest::socket::{Backoff, Link, ReplayCall, Subscription};
use crate::ingest::METRICS;
use kvix_events::stream::{Ask, Delivery, Stream, Tally};

/// Replays in flight at once per ingest thread: each buffers up to its byte limit, and
/// engines (or the server) restarting together ask for one per source at once. The
/// rest wait their turn in the order they asked.
pub(super) const REPLAYS_AT_ONCE: usize = 4;

/// What the streams of one thread share to ask for replays.
pub(super) struct Replays {
    pub(super) ctx: Arc<Context>,
    /// Replays that may still be started now.
    pub(super) free: usize,
    /// Orders the waiting ones.
    pub(super) next_turn: u64,
}

/// Where a stream's messages come from.
pub(super) enum Input {
    /// Its own subscription to the engine's publisher.
    Own(Subscription),
    /// The bound sockets: the thread puts its messages here.
    Bound(BoundStream),
}

pub(super) struct BoundStream {
    pub(super) rank: usize,
    pub(super) topic: String,
    /// The address its engine connects from (its topic's host, else its messages').
    pub(super) peer: Option<IpAddr>,
    pub(super) inbox: VecDeque<Frame>,
    /// A connection change not yet handed to the stream.
    pub(super) link: Option<Link>,
    /// Since when its engine has had no connection, as the bound sockets last told
    /// (None: connected).
    pub(super) down_since: Option<Instant>,
    /// When its retire was sent (the engine gone past the grace period).
    pub(super) retire_sent: Option<Instant>,
}

pub(super) struct Live {
    pub(super) spec: StreamSpec,
    pub(super) input: Input,
    pub(super) stream: Stream,
    pub(super) up: bool,
    pub(super) backoff: Backoff,
    /// The replay the stream waits for: its subscription is not read meanwhile (libzmq
    /// queues what comes), the other streams of the thread go on.
    pub(super) replay: Option<ReplayCall>,
    /// A replay asked for while `REPLAYS_AT_ONCE` were in flight: (turn, from).
    pub(super) queued: Option<(u64, u64)>,
}

impl Live {
    /// A stream of `spec` reading from `input`, counted as a source.
    pub(super) fn new(spec: StreamSpec, input: Input) -> Live {
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
    pub(super) fn next_link(&mut self) -> Option<Link> {
        match &mut self.input {
            Input::Own(sub) => sub.link(),
            Input::Bound(b) => b.link.take(),
        }
    }

    /// The next live message, if one is waiting.
    pub(super) fn next_message(&mut self) -> Option<Frame> {
        match &mut self.input {
            Input::Own(sub) => sub.next(),
            Input::Bound(b) => b.inbox.pop_front(),
        }
    }

    /// Whether it has something to serve that no socket of its own signals.
    pub(super) fn has_pending(&self) -> bool {
        match &self.input {
            Input::Own(_) => false,
            Input::Bound(b) => !self.waiting() && (b.link.is_some() || !b.inbox.is_empty()),
        }
    }

    /// Whether the stream waits for a replay (in flight or queued).
    pub(super) fn waiting(&self) -> bool {
        self.replay.is_some() || self.queued.is_some()
    }

    /// Asks for the replay the stream needs, if any; one that cannot be asked (a
    /// backoff after a failed one, a socket error) is answered with why at once.
    pub(super) fn ask(
        &mut self,
        r: &mut Replays,
        mut ask: Ask,
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) {
        while let Some(from) = ask {
            if r.free == 0 {
                self.queued = Some((r.next_turn, from));
                r.next_turn += 1;
                METRICS.replays_queued.fetch_add(1, Relaxed);
                return;
            }
            let endpoint = &self.spec.source.replay;
            let started = self.backoff.may_ask(endpoint).and_then(|()| {
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
    pub(super) fn progress(&mut self, r: &mut Replays, out: &mut Vec<Delivery>, t: &mut Tally) {
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
