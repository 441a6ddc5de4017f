//! One worker's event stream: SUB on its publisher, sequence tracking (gap → replay,
//! back to 0 → restart), decode, translate, and apply through a loopback kvix client.
//!
//! Unreachable publishers are retried with backoff (logged once per state change);
//! nothing here panics on anything a publisher sends.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvix_wire::{
    codec, encode, split_frame, to_native, AlignedVec, Announce, Announced, Body, ErrorCode,
    ErrorReply, Event, EventBatch, EventSource, Feed, Hello, Kind, Lane, WorkerId,
};

use super::translate::{Counts, Outgoing, Translator};
use super::zmtp::{Socket, SocketType};
use super::{vllm, Settings, METRICS};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(200);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(3);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Logs the first few of a kind, then only at powers of two.
fn noisy(counter: &AtomicU64) -> bool {
    let n = counter.load(Relaxed);
    n <= 10 || n.is_power_of_two()
}

pub struct Stream {
    settings: Arc<Settings>,
    name: String,
    lanes: Vec<Lane>,
    source: EventSource,
    stop: Arc<AtomicBool>,
    translator: Translator,
    /// Last publisher sequence applied (or skipped as malformed).
    last: Option<u64>,
    /// The SUB connection is new and no message came on it yet.
    fresh: bool,
    server: Option<Kvix>,
    /// Holder of each data-parallel rank (rank 0: the announced worker).
    rank_workers: HashMap<u32, WorkerId>,
    /// The next EventBatch seq per holder. Starts at the wall clock in ns, so a new
    /// stream for a worker (re-announce) always continues above an older one's.
    seqs: HashMap<WorkerId, u64>,
}

impl Stream {
    pub fn new(
        settings: Arc<Settings>,
        worker: WorkerId,
        name: String,
        lanes: Vec<Lane>,
        source: EventSource,
        stop: Arc<AtomicBool>,
    ) -> Self {
        let translator = Translator::new(settings.block_size, &source.model, &source.salt, &lanes);
        Stream {
            settings,
            name,
            lanes,
            source,
            stop,
            translator,
            last: None,
            fresh: false,
            server: None,
            rank_workers: HashMap::from([(0, worker)]),
            seqs: HashMap::new(),
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// Connects, reads, reconnects, until stopped.
    pub fn run(mut self) {
        tracing::info!(
            worker = %self.name,
            endpoint = %self.source.endpoint,
            replay = %self.source.replay,
            "ingest: subscribing"
        );
        let mut backoff = BACKOFF_MIN;
        let mut last_error: Option<String> = None;
        let mut connected_once = false;
        while !self.stopped() {
            match Socket::connect(&self.source.endpoint, SocketType::Sub, CONNECT_TIMEOUT) {
                Ok(sock) => {
                    tracing::info!(worker = %self.name, endpoint = %self.source.endpoint, "ingest: publisher connected");
                    METRICS.connected.fetch_add(1, Relaxed);
                    last_error = None;
                    backoff = BACKOFF_MIN;
                    self.fresh = connected_once;
                    connected_once = true;
                    let why = self.read(sock);
                    METRICS.connected.fetch_sub(1, Relaxed);
                    if self.stopped() {
                        break;
                    }
                    tracing::warn!(worker = %self.name, "ingest: publisher lost ({why}); reconnecting");
                }
                Err(e) => {
                    METRICS.connect_failures.fetch_add(1, Relaxed);
                    let text = e.to_string();
                    if last_error.as_deref() != Some(&text) {
                        tracing::warn!(
                            worker = %self.name,
                            endpoint = %self.source.endpoint,
                            "ingest: publisher unreachable ({text}); retrying"
                        );
                        last_error = Some(text);
                    }
                    self.sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        tracing::info!(worker = %self.name, "ingest: stream stopped");
    }

    fn sleep(&self, d: Duration) {
        let step = Duration::from_millis(20);
        let mut left = d;
        while !left.is_zero() && !self.stopped() {
            let s = left.min(step);
            std::thread::sleep(s);
            left -= s;
        }
    }

    /// Reads messages until the connection fails or the stream is stopped.
    fn read(&mut self, mut sock: Socket) -> io::Error {
        loop {
            if self.stopped() {
                return io::Error::other("stopped");
            }
            match sock.recv(POLL) {
                Ok(Some(frames)) => self.on_message(frames),
                Ok(None) => {}
                Err(e) => return e,
            }
        }
    }

    fn on_message(&mut self, frames: Vec<Vec<u8>>) {
        METRICS.messages.fetch_add(1, Relaxed);
        let [_topic, seq, payload] = &frames[..] else {
            self.malformed(format_args!("{} frames, expected 3", frames.len()));
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
            self.malformed(format_args!("a {}-byte sequence frame", seq.len()));
            return;
        };
        let seq = u64::from_be_bytes(seq);
        let fresh = std::mem::take(&mut self.fresh);
        match self.last {
            None if seq > 0 => self.replay(0, "catching up"),
            None => {}
            Some(l) if seq == l + 1 => {}
            Some(l) if seq > l + 1 => {
                METRICS.gaps.fetch_add(1, Relaxed);
                tracing::warn!(
                    worker = %self.name,
                    "ingest: sequence gap {}..{seq}",
                    l + 1
                );
                self.replay(l + 1, "gap");
            }
            Some(l) if seq == 0 || fresh => {
                METRICS.restarts.fetch_add(1, Relaxed);
                tracing::warn!(
                    worker = %self.name,
                    "ingest: publisher restarted (seq {seq} after {l}); clearing and rebuilding"
                );
                self.restart();
                if seq > 0 {
                    self.replay(0, "restart");
                }
            }
            Some(_) => {
                METRICS.duplicates.fetch_add(1, Relaxed);
                return;
            }
        }
        if self.last.is_some_and(|l| seq <= l) {
            return; // the replay already covered it
        }
        self.apply(seq, payload);
    }

    fn malformed(&self, what: std::fmt::Arguments<'_>) {
        METRICS.malformed.fetch_add(1, Relaxed);
        if noisy(&METRICS.malformed) {
            tracing::warn!(worker = %self.name, "ingest: malformed message skipped: {what}");
        }
    }

    /// Applies the buffered batches from `from` on, via the replay socket.
    fn replay(&mut self, from: u64, why: &str) {
        if self.source.replay.is_empty() {
            if why != "catching up" {
                tracing::warn!(worker = %self.name, "ingest: {why} from {from} and no replay endpoint: the index may miss blocks");
            }
            return;
        }
        let mut sock = match Socket::connect(
            &self.source.replay,
            SocketType::Dealer,
            CONNECT_TIMEOUT,
        )
        .and_then(|mut s| s.send(&[b"", &from.to_be_bytes()]).map(|()| s))
        {
            Ok(s) => s,
            Err(e) => {
                METRICS.replay_failures.fetch_add(1, Relaxed);
                tracing::warn!(worker = %self.name, replay = %self.source.replay, "ingest: replay ({why}) failed: {e}");
                return;
            }
        };
        let mut got = 0u64;
        loop {
            match sock.recv(REPLAY_TIMEOUT) {
                Ok(Some(mut frames)) => {
                    if frames.len() == 3 && frames[0].is_empty() {
                        frames.remove(0);
                    }
                    let [seq, payload] = &frames[..] else {
                        self.malformed(format_args!("replay reply of {} frames", frames.len()));
                        continue;
                    };
                    let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
                        self.malformed(format_args!("replay seq of {} bytes", seq.len()));
                        continue;
                    };
                    let seq = i64::from_be_bytes(seq);
                    if seq < 0 {
                        break; // end marker
                    }
                    let seq = seq as u64;
                    if seq >= from && self.last.is_none_or(|l| seq > l) {
                        METRICS.replayed.fetch_add(1, Relaxed);
                        got += 1;
                        self.apply(seq, payload);
                    }
                }
                Ok(None) | Err(_) => {
                    METRICS.replay_failures.fetch_add(1, Relaxed);
                    tracing::warn!(worker = %self.name, "ingest: replay ({why}) did not finish");
                    break;
                }
            }
        }
        tracing::info!(worker = %self.name, "ingest: replayed {got} batches from {from} ({why})");
    }

    /// The publisher started over: everything its ranks held is gone.
    fn restart(&mut self) {
        let mut ranks = self.translator.ranks();
        if !ranks.contains(&0) {
            ranks.push(0);
        }
        for rank in ranks {
            let ks = self.translator.keyspace(None, None);
            self.send(Outgoing {
                rank,
                keyspace: ks,
                events: vec![Event::Cleared],
            });
        }
        self.translator.reset();
        self.last = None;
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.last = Some(seq);
        let batch = match vllm::decode(payload) {
            Ok(b) => b,
            Err(e) => {
                self.malformed(format_args!("batch {seq}: {e}"));
                return;
            }
        };
        let (mut out, mut counts) = (Vec::new(), Counts::default());
        self.translator.apply(&batch, &mut out, &mut counts);
        METRICS.record(&counts);
        if counts.skipped.iter().any(|&n| n > 0) {
            tracing::debug!(worker = %self.name, "ingest: batch {seq} skipped events {:?}", counts.skipped);
        }
        for o in out {
            if self.stopped() {
                return;
            }
            self.send(o);
        }
    }

    /// Sends one translated batch to the server, reconnecting as needed.
    fn send(&mut self, o: Outgoing) {
        let Some(worker) = self.holder(o.rank) else {
            return;
        };
        let seq = self.seqs.entry(worker).or_insert_with(wall_ns);
        let batch = EventBatch {
            worker,
            seq: *seq,
            keyspace: o.keyspace,
            events: o.events,
        };
        *seq += 1;
        match self.call(&batch) {
            Some(Reply::Ok | Reply::Announced(_)) => {}
            Some(Reply::Refused(e)) => {
                METRICS.refused.fetch_add(1, Relaxed);
                if e.code == ErrorCode::UnknownWorker {
                    tracing::warn!(worker = %self.name, "ingest: worker retired; stopping its stream");
                    self.stop.store(true, Relaxed);
                } else if noisy(&METRICS.refused) {
                    tracing::warn!(worker = %self.name, "ingest: server refused a batch: {:?} {}", e.code, e.message);
                }
            }
            None => {}
        }
    }

    /// The holder of rank `rank`, announcing `name#dpN` the first time.
    fn holder(&mut self, rank: u32) -> Option<WorkerId> {
        if let Some(&w) = self.rank_workers.get(&rank) {
            return Some(w);
        }
        let announce = Announce {
            name: format!("{}#dp{rank}", self.name),
            lanes: self.lanes.clone(),
            feed: Feed::Events,
            source: None,
        };
        match self.call(&announce)? {
            Reply::Announced(a) => {
                tracing::info!(worker = %self.name, "ingest: data-parallel rank {rank} is worker {}", a.worker);
                self.rank_workers.insert(rank, a.worker);
                Some(a.worker)
            }
            Reply::Refused(e) => {
                METRICS.refused.fetch_add(1, Relaxed);
                tracing::warn!(worker = %self.name, "ingest: announcing rank {rank} refused: {}", e.message);
                None
            }
            Reply::Ok => None,
        }
    }

    /// One request to the server; a broken connection is reopened and the request
    /// retried (an EventBatch retried after it was applied is a harmless duplicate).
    fn call<M: Body>(&mut self, msg: &M) -> Option<Reply> {
        let mut backoff = BACKOFF_MIN;
        for attempt in 0..8 {
            if self.stopped() {
                return None;
            }
            let conn = match self.server.take() {
                Some(c) => Ok(c),
                None => Kvix::connect(&self.settings),
            };
            match conn.and_then(|mut c| c.call(msg).map(|r| (c, r))) {
                Ok((c, r)) => {
                    self.server = Some(c);
                    return Some(r);
                }
                Err(e) => {
                    if attempt == 0 {
                        tracing::warn!(worker = %self.name, "ingest: loopback to the server failed: {e}; retrying");
                    }
                    self.sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        tracing::error!(worker = %self.name, "ingest: could not reach the server; batch dropped");
        None
    }
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

enum Reply {
    Ok,
    Announced(Announced),
    Refused(ErrorReply),
}

/// A blocking kvix client of this server, over loopback.
struct Kvix {
    stream: TcpStream,
    buf: AlignedVec,
    next_id: u64,
}

impl Kvix {
    fn connect(s: &Settings) -> io::Result<Kvix> {
        let ip = match s.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let stream =
            TcpStream::connect_timeout(&SocketAddr::new(ip, s.addr.port()), CONNECT_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut c = Kvix {
            stream,
            buf: AlignedVec::new(),
            next_id: 1,
        };
        let hello = Hello {
            client: "kvix-server ingest".into(),
            token_block: s.block_size,
            auth: s.auth.clone(),
        };
        match c.call(&hello)? {
            Reply::Ok => Ok(c),
            Reply::Refused(e) => Err(io::Error::other(format!("Hello refused: {}", e.message))),
            Reply::Announced(_) => Err(io::Error::other("unexpected reply to Hello")),
        }
    }

    fn call<M: Body>(&mut self, msg: &M) -> io::Result<Reply> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode(msg, id, 0).map_err(io::Error::other)?;
        self.stream.write_all(&frame)?;
        loop {
            let found = split_frame(&self.buf, u32::MAX)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
                .map(|f| {
                    let mut body = AlignedVec::new();
                    body.extend_from_slice(f.body);
                    (f.header.request_id, f.kind, body, f.len)
                });
            if let Some((rid, kind, body, len)) = found {
                let rest = self.buf[len..].to_vec();
                self.buf.clear();
                self.buf.extend_from_slice(&rest);
                if rid != id {
                    continue;
                }
                let bad = |e: kvix_wire::FrameError| {
                    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
                };
                return Ok(match kind {
                    Kind::ErrorReply => {
                        Reply::Refused(to_native(codec::access::<ErrorReply>(&body).map_err(bad)?))
                    }
                    Kind::Announced => {
                        Reply::Announced(to_native(codec::access::<Announced>(&body).map_err(bad)?))
                    }
                    _ => Reply::Ok,
                });
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk)? {
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    ))
                }
                n => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}
