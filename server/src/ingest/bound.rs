//! Engines that find kvix (`--events-bind`): the engine's PUB socket connects to a SUB
//! the server binds, as vLLM and SGLang do when their endpoint names a host
//! (`tcp://kvix:5557`), and the message topic names the engine (llm-d's
//! `kv@<host>@<model>`). Rank `r` of a data-parallel engine offsets the endpoint as the
//! engines do (tcp port + r, `_dp<r>` after an ipc path), so the server binds one socket
//! per rank and a stream is one (rank, topic).
//!
//! The first message of a (rank, topic) no worker has yet announces its worker through
//! the one write route, as a client's announce would: named by the topic's host (with
//! `/dp<r>` past rank 0), with `--events-lanes`, its source `bound://<rank>/<topic>`, its replay endpoint the
//! host at `--events-replay-port` (+ rank). What it published before its worker was
//! subscribed comes back from that replay (a stream without one starts at the next
//! message). A bound worker whose engine has had no connection for `--events-grace` is
//! retired: its engine is gone, and what it held would be false hits.
//!
//! Which connection a message came on is known by the peer's address (libzmq's
//! `Peer-Address` message property) and the socket it came to; connections come and go
//! by the bound socket's monitor (accepted, disconnected: a file descriptor each, whose
//! peer address is read at accept).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvix_wire::EventSource;

use super::context::{Context, Kind};
pub use super::socket::Frame;
use super::socket::MAX_FRAME;

pub mod topic;
mod zap;

pub use topic::{BadTopic, TopicTemplate};

/// The source endpoint form of a bound stream.
pub const SCHEME: &str = "bound://";

/// How long an announce of a discovered engine may stay unanswered before its next
/// message asks again (it was refused, or lost while the server stopped).
const ANNOUNCE_AGAIN: Duration = Duration::from_secs(10);

/// Messages held for streams whose announce is on its way, handed to each once it is
/// subscribed (an engine without replay would lose them): at most this many per stream,
/// and this many payload bytes in all.
const EARLY_PER_STREAM: usize = 1024;
const EARLY_BYTES: usize = 64 << 20;

/// Rank `rank`'s endpoint of an engine configured with `base`, as vLLM and SGLang offset
/// it (`offset_endpoint_port`): the tcp port plus the rank, `_dp<rank>` after an ipc path.
/// The error names `base` (the caller says where it came from).
pub fn rank_endpoint(base: &str, rank: usize) -> Result<String, BadEndpoint> {
    if rank == 0 {
        return Ok(base.to_string());
    }
    if base.starts_with("ipc://") {
        return Ok(format!("{base}_dp{rank}"));
    }
    let bad = || BadEndpoint::Form(base.to_string());
    let (addr, port) = base.rsplit_once(':').ok_or_else(bad)?;
    let port: usize = port.parse().map_err(|_| bad())?;
    match u16::try_from(port + rank) {
        Ok(p) if port > 0 => Ok(format!("{addr}:{p}")),
        _ => Err(BadEndpoint::PastPorts {
            base: base.to_string(),
            rank,
        }),
    }
}

/// An engine endpoint a rank's cannot be made from.
#[derive(Debug, thiserror::Error)]
pub enum BadEndpoint {
    #[error("{0:?}: expected tcp://HOST:PORT or ipc://PATH")]
    Form(String),
    #[error("{base:?}: rank {rank}'s port is past 65535")]
    PastPorts { base: String, rank: usize },
}

/// An `--events-bind` socket that could not be made.
#[derive(Debug, thiserror::Error)]
#[error("--events-bind {endpoint}: {source}")]
pub struct BindError {
    endpoint: String,
    source: zmq::Error,
}

/// The source endpoint of rank `rank`'s stream of `topic`.
pub fn source_endpoint(rank: usize, topic: &str) -> String {
    format!("{SCHEME}{rank}/{topic}")
}

/// The rank and topic a `bound://` source endpoint names.
pub fn parse_source_endpoint(endpoint: &str) -> Option<(usize, &str)> {
    let (rank, topic) = endpoint.strip_prefix(SCHEME)?.split_once('/')?;
    Some((rank.parse().ok()?, topic))
}

/// What the server binds for engines to connect to, and how it names what comes.
#[derive(Debug, Clone)]
pub struct BindSpec {
    /// Rank r's endpoint at index r.
    pub endpoints: Vec<String>,
    pub topic: TopicTemplate,
    pub replay_port: Option<u16>,
    /// The lanes a discovered engine is announced with.
    pub lanes: Vec<kvix_wire::Lane>,
    pub grace: Duration,
    /// The networks engines may publish from (`--source-allow`); None: any.
    pub allow: Option<Vec<ipnet::IpNet>>,
}

/// The announce of an engine first heard of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    pub name: String,
    pub source: EventSource,
}

impl BindSpec {
    /// Whether a message from `peer` may be read (an ipc peer has no address: local).
    pub fn allows(&self, peer: Option<IpAddr>) -> bool {
        match (&self.allow, peer) {
            (Some(nets), Some(ip)) => nets.iter().any(|n| n.contains(&ip)),
            _ => true,
        }
    }

    /// What rank `rank`'s stream of `topic` is announced as; None when the topic does
    /// not have the template's form.
    pub fn discover(&self, rank: usize, topic: &str) -> Option<Discovered> {
        let (host, model) = self.topic.parse(topic)?;
        let name = match rank {
            0 => host.clone(),
            r => format!("{host}/dp{r}"),
        };
        let replay = match self.replay_port {
            Some(p) => {
                let port = usize::from(p) + rank;
                let host = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                format!("tcp://{host}:{port}")
            }
            None => String::new(),
        };
        Some(Discovered {
            name,
            source: EventSource {
                endpoint: source_endpoint(rank, topic),
                replay,
                model,
                salt: String::new(),
            },
        })
    }

    /// The address a stream's engine connects from, where its topic's host is an address.
    pub fn peer_of(&self, topic: &str) -> Option<IpAddr> {
        let (host, _) = self.topic.parse(topic)?;
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    }
}

/// Which engines are connected to this server's bound sockets, for the replicas' lease
/// thread (a replica ingests a bound engine only while the engine is connected to it):
/// open connections by (rank, peer), and the address each topic was last heard from.
pub struct Presence {
    spec: BindSpec,
    open: std::sync::Mutex<HashMap<(usize, IpAddr), usize>>,
    heard: std::sync::Mutex<HashMap<(usize, String), IpAddr>>,
}

impl Presence {
    fn new(spec: BindSpec) -> Presence {
        Presence {
            spec,
            open: Default::default(),
            heard: Default::default(),
        }
    }

    /// Whether the engine of rank `rank`'s stream of `topic` is connected here: from the
    /// address its messages came from, else its topic's host.
    pub fn connected(&self, rank: usize, topic: &str) -> bool {
        let heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        let peer = heard
            .get(&(rank, topic.to_string()))
            .copied()
            .or_else(|| self.spec.peer_of(topic));
        drop(heard);
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        peer.is_some_and(|p| open.get(&(rank, p)).is_some_and(|&n| n > 0))
    }

    /// How long a bound worker may go without a connection before it is retired.
    pub fn grace(&self) -> std::time::Duration {
        self.spec.grace
    }
}

/// One message from a bound socket: the peer it came from, its topic, seq and payload.
pub struct BoundMessage {
    pub rank: usize,
    pub peer: Option<IpAddr>,
    pub topic: String,
    pub frame: Frame,
}

/// A connection opened or closed on rank `rank`'s socket, from `peer`.
pub struct ConnectionChange {
    pub rank: usize,
    pub peer: IpAddr,
    /// Connections from that peer to that socket now.
    pub open: usize,
}

struct RankSocket {
    sub: zmq::Socket,
    monitor: zmq::Socket,
}

/// The bound sockets and the connections on them.
pub struct Bound {
    pub spec: BindSpec,
    sockets: Vec<RankSocket>,
    /// Each open connection's peer, by (rank, file descriptor).
    peers: HashMap<(usize, i32), IpAddr>,
    /// Open connections by (rank, peer).
    open: HashMap<(usize, IpAddr), usize>,
    /// Announces sent for streams not yet subscribed, and when.
    announced: HashMap<(usize, String), Instant>,
    /// What those streams sent meanwhile, and its payload bytes in all.
    early: HashMap<(usize, String), std::collections::VecDeque<Frame>>,
    early_bytes: usize,
    /// What the replicas' lease thread reads of `open` and of the topics heard.
    presence: std::sync::Arc<Presence>,
    /// Refuses connections from outside `--source-allow` at their handshake; dropped
    /// after the sockets (declared after them).
    _zap: Option<zap::Zap>,
}

impl Bound {
    /// Binds every rank's endpoint.
    pub fn bind(ctx: &Context, spec: BindSpec) -> Result<Bound, BindError> {
        let zap = match &spec.allow {
            Some(_) => {
                let allow = spec.clone();
                let zap = zap::Zap::start(ctx, move |peer| allow.allows(peer));
                Some(zap.map_err(|source| BindError {
                    endpoint: "the ZAP handler (inproc://zeromq.zap.01)".into(),
                    source,
                })?)
            }
            None => None,
        };
        let presence = std::sync::Arc::new(Presence::new(spec.clone()));
        let mut sockets = Vec::new();
        for (rank, endpoint) in spec.endpoints.iter().enumerate() {
            let err = |source| BindError {
                endpoint: endpoint.clone(),
                source,
            };
            let sub = ctx.socket(Kind::Sub).map_err(err)?;
            sub.set_maxmsgsize(MAX_FRAME).map_err(err)?;
            sub.set_rcvhwm(100_000).map_err(err)?;
            sub.set_linger(0).map_err(err)?;
            sub.set_subscribe(b"").map_err(err)?;
            if zap.is_some() {
                sub.set_zap_domain(zap::DOMAIN).map_err(err)?;
            }
            let name = format!("inproc://kvix-ingest-bound-{rank}");
            sub.monitor(
                &name,
                (zmq::SocketEvent::ACCEPTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32),
            )
            .map_err(err)?;
            let monitor = ctx.socket(Kind::Pair).map_err(err)?;
            monitor.set_linger(0).map_err(err)?;
            monitor.connect(&name).map_err(err)?;
            sub.bind(endpoint).map_err(err)?;
            sockets.push(RankSocket { sub, monitor });
        }
        Ok(Bound {
            spec,
            sockets,
            peers: HashMap::new(),
            open: HashMap::new(),
            announced: HashMap::new(),
            early: HashMap::new(),
            early_bytes: 0,
            presence,
            _zap: zap,
        })
    }

    /// Poll items: each rank's SUB, then its monitor.
    pub fn poll_items(&self) -> Vec<zmq::PollItem<'_>> {
        self.sockets
            .iter()
            .flat_map(|s| {
                [
                    s.sub.as_poll_item(zmq::POLLIN),
                    s.monitor.as_poll_item(zmq::POLLIN),
                ]
            })
            .collect()
    }

    /// The connections opened and closed since last asked.
    pub fn connection_changes(&mut self) -> Vec<ConnectionChange> {
        let mut changes = Vec::new();
        for rank in 0..self.sockets.len() {
            while let Ok(frames) = self.sockets[rank].monitor.recv_multipart(zmq::DONTWAIT) {
                let Some(event) = frames.first().filter(|f| f.len() >= 6) else {
                    continue;
                };
                let id = u16::from_le_bytes([event[0], event[1]]);
                let fd = i32::from_le_bytes([event[2], event[3], event[4], event[5]]);
                let peer = if id == zmq::SocketEvent::ACCEPTED as u16 {
                    // Read now: the descriptor is the connection's until it closes.
                    let Some(peer) = peer_address(fd) else {
                        continue;
                    };
                    self.peers.insert((rank, fd), peer);
                    *self.open.entry((rank, peer)).or_default() += 1;
                    peer
                } else {
                    let Some(peer) = self.peers.remove(&(rank, fd)) else {
                        continue;
                    };
                    let n = self.open.entry((rank, peer)).or_default();
                    *n = n.saturating_sub(1);
                    peer
                };
                let open = self.open[&(rank, peer)];
                let mut shown = self.presence.open.lock().unwrap_or_else(|p| p.into_inner());
                shown.insert((rank, peer), open);
                drop(shown);
                if open == 0 {
                    // Every engine there is gone: what it spoke for is forgotten.
                    let mut heard = self
                        .presence
                        .heard
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    heard.retain(|(r, _), from| (*r, *from) != (rank, peer));
                }
                changes.push(ConnectionChange { rank, peer, open });
            }
        }
        changes
    }

    /// The connections from `peer` to rank `rank`'s socket.
    pub fn connections(&self, rank: usize, peer: IpAddr) -> usize {
        self.open.get(&(rank, peer)).copied().unwrap_or(0)
    }

    /// Whether an engine at `peer` has a connection to rank `rank`'s socket.
    pub fn connected(&self, rank: usize, peer: IpAddr) -> bool {
        self.open.get(&(rank, peer)).is_some_and(|&n| n > 0)
    }

    /// The next message waiting on rank `rank`'s socket, if any.
    pub fn next(&self, rank: usize) -> Option<BoundMessage> {
        let sub = &self.sockets[rank].sub;
        let mut first = sub.recv_msg(zmq::DONTWAIT).ok()?;
        let peer = first
            .gets("Peer-Address")
            .and_then(|a| a.trim_start_matches("::ffff:").parse().ok());
        let topic = String::from_utf8_lossy(&first).into_owned();
        let mut frames = vec![first.to_vec()];
        while sub.get_rcvmore().unwrap_or(false) {
            match sub.recv_bytes(0) {
                Ok(f) => frames.push(f),
                Err(_) => break,
            }
        }
        Some(BoundMessage {
            rank,
            peer,
            topic,
            frame: super::socket::seq_and_payload(frames),
        })
    }

    /// Notes that a message under `topic` on rank `rank` came from `peer` and was taken
    /// (an impostor's is not: it would move the topic to its address).
    pub fn hear(&self, rank: usize, topic: &str, peer: Option<IpAddr>) {
        let Some(p) = peer else { return };
        let mut heard = self
            .presence
            .heard
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match heard.get_mut(&(rank, topic.to_string())) {
            Some(from) => *from = p,
            None => {
                heard.insert((rank, topic.to_string()), p);
            }
        }
    }

    /// How many topics were heard from each (rank, address) since it last had no
    /// connection: the engines there.
    pub fn topics_heard(&self) -> HashMap<(usize, IpAddr), usize> {
        let heard = self
            .presence
            .heard
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut counts = HashMap::new();
        for ((rank, _), from) in heard.iter() {
            *counts.entry((*rank, *from)).or_default() += 1;
        }
        counts
    }

    /// What the replicas' lease thread reads of the connections.
    pub fn presence(&self) -> std::sync::Arc<Presence> {
        self.presence.clone()
    }

    pub fn ranks(&self) -> usize {
        self.sockets.len()
    }

    /// Whether the stream's announce is to be sent now (none in the last
    /// `ANNOUNCE_AGAIN`), noting it as sent.
    pub fn announce_due(&mut self, rank: usize, topic: &str) -> bool {
        let now = Instant::now();
        let key = (rank, topic.to_string());
        match self.announced.get(&key) {
            Some(at) if now.duration_since(*at) < ANNOUNCE_AGAIN => false,
            _ => {
                self.announced.insert(key, now);
                true
            }
        }
    }

    /// Holds a message of a stream whose announce is on its way; false (dropped) past
    /// the limits.
    pub fn hold_early(&mut self, rank: usize, topic: &str, frame: Frame) -> bool {
        let bytes = frame.as_ref().map_or(0, |(_, p)| p.len());
        let held = self.early.entry((rank, topic.to_string())).or_default();
        if held.len() >= EARLY_PER_STREAM || self.early_bytes + bytes > EARLY_BYTES {
            return false;
        }
        held.push_back(frame);
        self.early_bytes += bytes;
        true
    }

    /// The stream is subscribed: no announce is pending for it; what it sent meanwhile.
    pub fn subscribed(&mut self, rank: usize, topic: &str) -> std::collections::VecDeque<Frame> {
        let key = (rank, topic.to_string());
        self.announced.remove(&key);
        let held = self.early.remove(&key).unwrap_or_default();
        let bytes: usize = held
            .iter()
            .map(|f| f.as_ref().map_or(0, |(_, p)| p.len()))
            .sum();
        self.early_bytes -= bytes;
        held
    }
}

/// The address of the peer of socket `fd`, if it is a TCP connection still open.
fn peer_address(fd: i32) -> Option<IpAddr> {
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: getpeername writes at most `len` bytes into `addr`, which is that large.
    let rc = unsafe {
        libc::getpeername(
            fd,
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    match i32::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a =
                unsafe { *(&addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes()))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a =
                unsafe { *(&addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4))
        }
        // A Unix socket (ipc://): every engine on it is local.
        _ => Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
    }
}

#[cfg(test)]
mod tests;
