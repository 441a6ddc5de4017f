//! Client configuration: where the servers are and how patient to be.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use kvix_wire::DEFAULT_MAX_FRAME;

use crate::ClientError;

/// The address of one kvix server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Addr {
    /// A TCP `host:port`, e.g. `127.0.0.1:7420`.
    Tcp(String),
    /// A Unix domain socket path.
    Unix(PathBuf),
}

impl Addr {
    /// A TCP address `host:port`.
    pub fn tcp(host_port: impl Into<String>) -> Self {
        Addr::Tcp(host_port.into())
    }

    /// A Unix socket path.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Addr::Unix(path.into())
    }
}

impl FromStr for Addr {
    type Err = ClientError;

    /// `host:port` or `tcp://host:port` (as the server prints it) is TCP; `unix:/path`,
    /// `unix:///path` or anything else containing a `/` is a Unix socket path. Another
    /// scheme (`http://…`), a missing or out-of-range port is refused here, not left to
    /// fail open on every query.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let refused =
            |why: String| Err(ClientError::Config(format!("server address {s:?}: {why}")));
        if s.is_empty() {
            return Err(ClientError::Config("empty server address".into()));
        }
        if let Some(path) = s
            .strip_prefix("unix://")
            .or_else(|| s.strip_prefix("unix:"))
        {
            return Ok(Addr::Unix(path.into()));
        }
        let host_port = match s.split_once("://") {
            Some(("tcp", rest)) => rest,
            Some((scheme, _)) => {
                return refused(format!(
                    "{scheme}:// is not a kvix address (host:port, tcp://host:port or unix:/path)"
                ))
            }
            None if s.contains('/') => return Ok(Addr::Unix(s.into())),
            None => s,
        };
        let Some((host, port)) = host_port.rsplit_once(':') else {
            return refused("neither host:port nor a socket path".into());
        };
        if host.is_empty() {
            return refused("no host before the port".into());
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(Addr::Tcp(host_port.to_string())),
            _ => refused(format!("the port {port:?} is not a number from 1 to 65535")),
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Tcp(a) => f.write_str(a),
            Addr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// How a [`crate::Client`] connects and waits. `Default` gives one server at
/// `127.0.0.1:7420` with the documented defaults; change fields as needed.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The servers, in order of preference. The client keeps one connection to each;
    /// queries go to the first one that is up (hedged to the next, see `hedge_after`),
    /// writes (announces, placements) go to all of them, or to the first one up when
    /// they are `replicas`.
    pub servers: Vec<Addr>,
    /// Token block size this client hashes with; the server refuses a mismatch at
    /// handshake. Default 16.
    pub token_block: u32,
    /// Shared token sent in `Hello`, when the server requires one.
    pub auth: Option<String>,
    /// How long a query may take in all. Default 2 ms. The client never waits for a
    /// connection (none up → `Disconnected` at once) and checks the last millisecond
    /// before the deadline by yielding rather than on tokio's 1 ms timer, so a query
    /// returns by its deadline up to the scheduling latency of its thread.
    pub deadline: Duration,
    /// Free text naming this client in the server's logs. Default `kvix-client`.
    pub name: String,
    /// First reconnect delay after a connection is lost or refused. Default 10 ms.
    pub reconnect_min: Duration,
    /// Cap of the exponential reconnect delay. Default 1 s.
    pub reconnect_max: Duration,
    /// Placements waiting to be sent (and, apart, reuse reports); when full, new ones
    /// are dropped and counted. Default 4096.
    pub placement_queue: usize,
    /// Spin (checking for the reply) this long before parking the waiting task:
    /// trades a core's time for a shorter wake-up. `None` (default): park at once.
    ///
    /// It busy-spins where another thread delivers the reply (the blocking client's
    /// callers; a multi-thread runtime with two or more workers) and spins by yielding
    /// to the runtime where the reply needs this same thread (current-thread runtime).
    /// Answers are the same either way; only the latency differs.
    pub spin_before_park: Option<Duration>,
    /// Limit on one connection attempt (connect + handshake + re-announces), and on how
    /// long [`crate::Client::connect`] waits for the first attempts. Default 1 s.
    pub connect_timeout: Duration,
    /// Limit on control requests (announce, retire, stats, echo). Default 1 s.
    pub request_timeout: Duration,
    /// Largest reply frame accepted from a server. Default [`DEFAULT_MAX_FRAME`].
    pub max_frame: u32,
    /// The servers are replicas of one write log (`kvix-server --log`): writes
    /// (announces, retires, placements) go to the primary only and the log takes them
    /// to the others; worker ids are the same on all. Default false: independent servers,
    /// each sent every write.
    pub replicas: bool,
    /// Hedged queries: when the primary has not answered after this long, the same query
    /// also goes to the next server up, and the first answer wins. `None` (default): the
    /// 95th percentile of this client's recent query latencies (at least 100 µs; a
    /// quarter of the deadline until 100 queries were seen), never later than half the
    /// deadline. `Some(Duration::MAX)`: never hedge. Only with two servers or more up.
    /// The hedge goes out at the first timer tick (1 ms) from that point, or at the
    /// point itself when `spin_before_park` spins until it: waiting for it is parked, not
    /// spun, so that hedging costs no core.
    pub hedge_after: Option<Duration>,
    /// TLS to the servers at TCP addresses (`kvix-server --tls-cert`). None (default):
    /// plain TCP.
    pub tls: Option<crate::ClientTls>,
    /// What reuse from CPU and from storage is worth against reuse from GPU, for
    /// queries that do not say ([`crate::QueryOptions::weights`]): answers are ranked by
    /// it and each score's `reuse` weighed by it. Default Dynamo's: 0.75 and 0.25.
    pub tier_weights: kvix_wire::TierWeights,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            servers: vec![Addr::tcp("127.0.0.1:7420")],
            token_block: 16,
            auth: None,
            deadline: Duration::from_millis(2),
            name: "kvix-client".into(),
            reconnect_min: Duration::from_millis(10),
            reconnect_max: Duration::from_secs(1),
            placement_queue: 4096,
            spin_before_park: None,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            max_frame: DEFAULT_MAX_FRAME,
            replicas: false,
            hedge_after: None,
            tls: None,
            tier_weights: kvix_wire::TierWeights::DYNAMO,
        }
    }
}

impl ClientConfig {
    /// The defaults, with these servers.
    pub fn new(servers: impl IntoIterator<Item = Addr>) -> Self {
        ClientConfig {
            servers: servers.into_iter().collect(),
            ..Default::default()
        }
    }

    /// Checks the values that would make the client misbehave.
    pub fn validate(&self) -> Result<(), ClientError> {
        let bad = |m: &str| Err(ClientError::Config(m.to_string()));
        if self.servers.is_empty() {
            return bad("no server address");
        }
        if self.token_block == 0 {
            return bad("token_block must be positive");
        }
        if self.deadline.is_zero() {
            return bad("deadline must be positive");
        }
        if self.reconnect_min.is_zero() || self.reconnect_max < self.reconnect_min {
            return bad("reconnect backoff needs 0 < reconnect_min <= reconnect_max");
        }
        if self.placement_queue == 0 {
            return bad("placement_queue must be positive");
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return bad("connect_timeout and request_timeout must be positive");
        }
        if !self.tier_weights.is_valid() {
            return bad("tier_weights: each weight is a number in [0, 1]");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            "127.0.0.1:7420".parse::<Addr>().unwrap(),
            Addr::tcp("127.0.0.1:7420")
        );
        assert_eq!(
            "unix:/tmp/k.sock".parse::<Addr>().unwrap(),
            Addr::unix("/tmp/k.sock")
        );
        assert_eq!(
            "/tmp/k.sock".parse::<Addr>().unwrap(),
            Addr::unix("/tmp/k.sock")
        );
        assert!("nonsense".parse::<Addr>().is_err());
        assert!("".parse::<Addr>().is_err());
        // The forms the server prints are accepted as they are.
        assert_eq!(
            "tcp://127.0.0.1:7420".parse::<Addr>().unwrap(),
            Addr::tcp("127.0.0.1:7420")
        );
        assert_eq!(
            "unix:///tmp/kvix.sock".parse::<Addr>().unwrap(),
            Addr::unix("/tmp/kvix.sock")
        );
        assert_eq!(
            "[::1]:7420".parse::<Addr>().unwrap(),
            Addr::tcp("[::1]:7420")
        );
        // Mistakes are refused at once, saying what is wrong (they used to fail open on
        // every query: "tcp://…" and "http://…" were taken for socket paths).
        for (bad, says) in [
            ("http://127.0.0.1:7420", "http://"),
            ("127.0.0.1:99999", "99999"),
            ("127.0.0.1:0", "\"0\""),
            ("127.0.0.1:", "port"),
            (":7420", "no host"),
            ("tcp://localhost", "neither"),
        ] {
            let e = bad.parse::<Addr>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn defaults_validate_and_bad_values_do_not() {
        ClientConfig::default().validate().unwrap();
        let mut c = ClientConfig::default();
        c.servers.clear();
        assert!(c.validate().is_err());
        let c = ClientConfig {
            token_block: 0,
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }
}
