//! What thread 0 does for the bound sockets (`--events-bind`): connection changes,
//! messages into their streams' inboxes, engines announced when first heard and
//! retired after their grace period.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use futures::SinkExt;
use kvix_wire::Feed;

use super::live::{BoundStream, Input, Live};
use super::thread::IngestThread;
use super::{StreamSpec, BOUND_INBOX, BURST, RETIRE_AGAIN};
use crate::ingest::socket::Link;
use crate::ingest::METRICS;
use crate::loud::count_loudly;
use crate::write::record::Write;

impl IngestThread {
    /// Reads what the bound sockets have: connection changes, then each message into its
    /// stream's inbox, announcing the engines first heard of. False once the server stops.
    pub(super) fn read_bound(&mut self) -> bool {
        let Some(bound) = self.bound.as_mut() else {
            return true;
        };
        let now = Instant::now();
        take_connection_changes(bound, &mut self.streams, now);
        // Topics heard from each address on each rank since it last had no connection:
        // one engine, one connection each (whether this server ingests it or, with
        // replicas, not yet).
        // Counted once per read, and only when a message needs it.
        let mut pinned = None;
        let mut announces = Vec::new();
        for rank in 0..bound.ranks() {
            for _ in 0..BURST {
                let Some(m) = bound.next(rank) else { break };
                // libzmq queues a connection's `accepted` event before any message of
                // it can be read: taken now, a process that just connected beside an
                // engine counts before its first message is judged, not after it.
                if take_connection_changes(bound, &mut self.streams, now) {
                    pinned = None;
                }
                METRICS.messages.fetch_add(1, Relaxed);
                if !bound.spec.allows(m.peer) {
                    if let Some(n) = count_loudly(&METRICS.peers_refused) {
                        let from = m.peer.map_or("?".into(), |p| p.to_string());
                        tracing::warn!(topic = %m.topic, %from, "ingest: a message on --events-bind from {from}, outside --source-allow: refused, not applied ({n} so far)");
                    }
                    continue;
                }
                let key = (m.rank, m.topic);
                match self.bound_index.get(&key) {
                    Some(&i) => {
                        let Input::Bound(b) = &mut self.streams[i].input else {
                            continue;
                        };
                        // A topic speaks for one engine: while the address it was
                        // pinned to is connected, the same topic from another address
                        // is an impostor, refused (a new address once the old one is
                        // gone is the engine restarted elsewhere).
                        match (b.peer, m.peer) {
                            (Some(pinned), Some(from))
                                if pinned != from && bound.connected(rank, pinned) =>
                            {
                                METRICS.impostors.fetch_add(1, Relaxed);
                                tracing::warn!(topic = %key.1, %pinned, %from, "ingest: a message on --events-bind under a topic another address speaks for (its engine is connected from {pinned}) came from {from}: refused, not applied");
                                continue;
                            }
                            // More connections from its address than topics pinned
                            // there: a process beside the engine may be speaking
                            // under its topic, and messages cannot be told apart by
                            // connection. None is applied until the extra one goes
                            // (the engine's replay fills the gap).
                            (Some(pinned_to), Some(from))
                                if pinned_to == from
                                    && bound.connections(rank, from)
                                        > pinned
                                            .get_or_insert_with(|| bound.topics_heard())
                                            .get(&(rank, from))
                                            .copied()
                                            .unwrap_or(0) =>
                            {
                                if let Some(n) = count_loudly(&METRICS.impostors) {
                                    tracing::warn!(topic = %key.1, %from, connections = bound.connections(rank, from), "ingest: more connections to --events-bind from {from} than engines speaking from there: a message under its topic refused, not applied, until the extra connection goes ({n} so far)");
                                }
                                continue;
                            }
                            // Where its messages come from says more than its topic's host.
                            (_, Some(from)) => b.peer = Some(from),
                            _ => {}
                        }
                        bound.hear(rank, &key.1, m.peer);
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
                                bound.hear(rank, &key.1, m.peer);
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
    pub(super) fn retire_gone(&mut self) -> bool {
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
    pub(super) fn index_bound(&mut self) {
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
    /// A stream of the bound sockets: up at once if its engine is connected (it catches
    /// up as after a reconnect), else its grace period starts now (a message or a
    /// connection from its engine ends it).
    pub(super) fn add_bound(&mut self, spec: StreamSpec, rank: usize, topic: String) {
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
}

/// Notes whether a bound stream's engine is connected; a change is handed to the stream.
/// The connections opened and closed since last asked, onto the streams they carry;
/// whether there were any.
fn take_connection_changes(
    bound: &mut crate::ingest::bound::Bound,
    streams: &mut [Live],
    now: Instant,
) -> bool {
    let changes = bound.connection_changes();
    for change in &changes {
        for s in streams.iter_mut() {
            if let Input::Bound(b) = &mut s.input {
                if b.rank == change.rank && b.peer == Some(change.peer) {
                    set_link(b, change.open > 0, now);
                }
            }
        }
    }
    !changes.is_empty()
}

pub(super) fn set_link(b: &mut BoundStream, up: bool, now: Instant) {
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
