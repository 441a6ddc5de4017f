//! The ZMQ side of one source, over libzmq (the `zmq` crate: the same ZMTP the engines'
//! pyzmq speaks, over `tcp://` and `ipc://`, with reconnects done by libzmq): a SUB on the
//! publisher with a monitor that reports each (re)connection, and one-shot DEALER
//! replays.
//!
//! Frames, as the engines send them: live `[topic, seq (8 bytes BE), payload]`; a replay
//! request `["", start (8 bytes BE)]`; replay replies `["", seq, payload]` (vLLM 0.9) or
//! `["", topic, seq, payload]` (vLLM 0.34, SGLang), ending with seq −1 and an empty
//! payload. Both are read the same way: seq is the second-to-last frame, the payload the
//! last.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::context::{Context, Kind};
use kvix_events::stream::Replayed;

/// Longest frame accepted from a publisher (a batch of many long stores still fits).
pub const MAX_FRAME: i64 = 64 << 20;
/// How long a replay may wait for its first reply (the engine's publisher thread serves
/// replays between batches, ~100 ms apart at most) and then between replies.
const REPLAY_FIRST: Duration = Duration::from_secs(3);
const REPLAY_NEXT: Duration = Duration::from_secs(1);
/// Most batches one replay takes (engines keep 10,000 by default).
const REPLAY_MAX: usize = 1 << 20;
/// Most payload bytes one replay buffers before anything of it is delivered.
const REPLAY_BYTES: usize = 1 << 30;
/// Longest one replay may take in all (a reply every second would go on for days).
const REPLAY_TOTAL: Duration = Duration::from_secs(60);
/// After a failed replay the next one of the same source waits this long, doubling up
/// to `BACKOFF_MAX` while they keep failing.
const BACKOFF_FIRST: Duration = Duration::from_secs(5);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// What the monitor reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Up,
    Down,
}

/// A message's seq and payload, or the frame count of one that is not
/// `[topic, seq, payload]`.
pub type Frame = Result<(u64, Vec<u8>), usize>;

/// A subscription to one publisher.
pub struct Subscription {
    pub sub: zmq::Socket,
    pub monitor: zmq::Socket,
}

impl Subscription {
    /// Connects (in the background: libzmq retries until the publisher is there).
    pub fn open(ctx: &Context, endpoint: &str) -> Result<Self, zmq::Error> {
        // A fresh monitor name each time: a closed socket's monitor endpoint is released
        // by libzmq later, so a worker subscribing again cannot reuse its old name.
        static MONITORS: AtomicU64 = AtomicU64::new(0);
        let id = MONITORS.fetch_add(1, Relaxed);
        let sub = ctx.socket(Kind::Sub)?;
        sub.set_maxmsgsize(MAX_FRAME)?;
        sub.set_rcvhwm(100_000)?;
        sub.set_linger(0)?;
        sub.set_reconnect_ivl(100)?;
        sub.set_reconnect_ivl_max(2000)?;
        sub.set_subscribe(b"")?;
        let name = format!("inproc://kvix-ingest-monitor-{id}");
        sub.monitor(
            &name,
            (zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32)
                | (zmq::SocketEvent::DISCONNECTED as i32),
        )?;
        let monitor = ctx.socket(Kind::Pair)?;
        monitor.set_linger(0)?;
        monitor.connect(&name)?;
        sub.connect(endpoint)?;
        Ok(Subscription { sub, monitor })
    }

    /// The next live message, if one is waiting: (seq, payload), or Err for a message
    /// that is not `[topic, seq, payload]`.
    pub fn next(&self) -> Option<Frame> {
        let frames = self.sub.recv_multipart(zmq::DONTWAIT).ok()?;
        Some(seq_and_payload(frames))
    }

    /// The next monitor event, if one is waiting.
    pub fn link(&self) -> Option<Link> {
        let frames = self.monitor.recv_multipart(zmq::DONTWAIT).ok()?;
        let event = frames.first().filter(|f| f.len() >= 2)?;
        let id = u16::from_le_bytes([event[0], event[1]]);
        Some(if id == zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16 {
            Link::Up
        } else {
            Link::Down
        })
    }
}

/// seq and payload of a live or replayed message: the last two frames.
pub(super) fn seq_and_payload(mut frames: Vec<Vec<u8>>) -> Frame {
    let n = frames.len();
    if n < 2 || frames[n - 2].len() != 8 {
        return Err(n);
    }
    let payload = frames.pop().expect("n >= 2");
    let seq = u64::from_be_bytes(frames[n - 2][..].try_into().expect("8 bytes"));
    Ok((seq, payload))
}

/// When a source's next replay may be asked for. A replay that failed (an endpoint that
/// never answers) is not asked again at every gap: its stream waits for each one.
#[derive(Debug, Default)]
pub struct Backoff {
    until: Option<Instant>,
    wait: Duration,
}

impl Backoff {
    /// Err while the wait after a failed replay lasts.
    pub fn may_ask(&self, endpoint: &str) -> Result<(), ReplayCallError> {
        let now = Instant::now();
        match self.until.filter(|u| now < *u) {
            Some(until) => Err(ReplayCallError::BackingOff {
                endpoint: endpoint.to_string(),
                left: until - now,
            }),
            None => Ok(()),
        }
    }

    /// A replay ended: a failed one starts (or doubles) the wait.
    pub fn record(&mut self, ok: bool) {
        *self = if ok {
            Backoff::default()
        } else {
            let wait = (self.wait * 2).clamp(BACKOFF_FIRST, BACKOFF_MAX);
            Backoff {
                until: Some(Instant::now() + wait),
                wait,
            }
        };
    }
}

/// Why a replay call brought nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReplayCallError {
    #[error("replay {endpoint} not asked: {left:?} left of the wait after a failed one")]
    BackingOff { endpoint: String, left: Duration },
    #[error("replay socket {endpoint}: {source}")]
    Socket {
        endpoint: String,
        source: zmq::Error,
    },
    #[error("replay {endpoint}: a reply of {frames} frames")]
    Frames { endpoint: String, frames: usize },
    #[error("replay {endpoint} sent more than {REPLAY_MAX} batches or {REPLAY_BYTES} bytes")]
    TooMuch { endpoint: String },
    #[error("replay {endpoint} did not finish: no reply within {within:?} (or {REPLAY_TOTAL:?} in all) after {batches} batches")]
    Silent {
        endpoint: String,
        within: Duration,
        batches: usize,
    },
}

/// One replay in flight over a fresh DEALER: the ingest thread polls it with its
/// subscriptions, so a slow or silent replay endpoint holds up only its own stream.
pub struct ReplayCall {
    dealer: zmq::Socket,
    endpoint: String,
    got: Vec<(u64, Vec<u8>)>,
    bytes: usize,
    /// When it fails unless another reply comes.
    next_by: Instant,
    /// When it fails however the replies come.
    end: Instant,
}

impl ReplayCall {
    /// Sends the request for the batches from `from` on.
    pub fn start(ctx: &Context, endpoint: &str, from: u64) -> Result<Self, ReplayCallError> {
        let err = |source| ReplayCallError::Socket {
            endpoint: endpoint.to_string(),
            source,
        };
        let dealer = ctx.socket(Kind::Dealer).map_err(err)?;
        dealer.set_linger(0).map_err(err)?;
        dealer.set_maxmsgsize(MAX_FRAME).map_err(err)?;
        dealer.set_rcvhwm(0).map_err(err)?;
        dealer.connect(endpoint).map_err(err)?;
        dealer
            .send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)
            .map_err(err)?;
        let now = Instant::now();
        Ok(ReplayCall {
            dealer,
            endpoint: endpoint.to_string(),
            got: Vec::new(),
            bytes: 0,
            next_by: now + REPLAY_FIRST,
            end: now + REPLAY_TOTAL,
        })
    }

    pub fn poll_item(&self) -> zmq::PollItem<'_> {
        self.dealer.as_poll_item(zmq::POLLIN)
    }

    /// When it gives up unless a reply comes first.
    pub fn deadline(&self) -> Instant {
        self.next_by.min(self.end)
    }

    /// Takes the replies that have come; the replay's result once it ended (its end
    /// marker, a malformed reply, too much, or its deadline passed: the replies that came,
    /// if any), None while it goes on.
    pub fn step(&mut self) -> Option<Replayed> {
        loop {
            let mut frames = match self.dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => break,
                Err(source) => {
                    let endpoint = self.endpoint.clone();
                    return Some(Err(ReplayCallError::Socket { endpoint, source }.into()));
                }
            };
            if frames.first().is_some_and(Vec::is_empty) {
                frames.remove(0);
            }
            let (seq, payload) = match seq_and_payload(frames) {
                Ok(reply) => reply,
                Err(frames) => {
                    let endpoint = self.endpoint.clone();
                    return Some(Err(ReplayCallError::Frames { endpoint, frames }.into()));
                }
            };
            if seq == u64::MAX {
                return Some(Ok(std::mem::take(&mut self.got)));
            }
            self.bytes += payload.len();
            if self.got.len() >= REPLAY_MAX || self.bytes > REPLAY_BYTES {
                let endpoint = self.endpoint.clone();
                return Some(Err(ReplayCallError::TooMuch { endpoint }.into()));
            }
            self.got.push((seq, payload));
            self.next_by = Instant::now() + REPLAY_NEXT;
        }
        (Instant::now() >= self.deadline()).then(|| {
            if !self.got.is_empty() && Instant::now() < self.end {
                // Replies stopped without the end marker: a publisher whose send queue
                // overflowed drops it like any reply. What came is applied; the rest is
                // asked for by the stream (at once when a live batch waits past it, else at
                // the next gap). Counted: no gap may come for a while.
                super::METRICS.replay_holes.fetch_add(1, Relaxed);
                return Ok(std::mem::take(&mut self.got));
            }
            Err(ReplayCallError::Silent {
                endpoint: self.endpoint.clone(),
                within: if self.got.is_empty() {
                    REPLAY_FIRST
                } else {
                    REPLAY_NEXT
                },
                batches: self.got.len(),
            }
            .into())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_replay_framings_and_live_frames_read_the_last_two_frames() {
        let seq = 7u64.to_be_bytes().to_vec();
        assert_eq!(
            seq_and_payload(vec![b"topic".to_vec(), seq.clone(), b"p".to_vec()]),
            Ok((7, b"p".to_vec()))
        );
        assert_eq!(
            seq_and_payload(vec![seq.clone(), b"p".to_vec()]),
            Ok((7, b"p".to_vec()))
        );
        let end = seq_and_payload(vec![Vec::new(), vec![0xff; 8], Vec::new()]);
        assert_eq!(end, Ok((u64::MAX, Vec::new())));
        assert_eq!(seq_and_payload(vec![b"p".to_vec()]), Err(1));
        assert_eq!(seq_and_payload(vec![vec![1, 2], b"p".to_vec()]), Err(2));
    }
}
