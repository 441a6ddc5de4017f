//! Test harness: runs the real kvix-server binary on loopback and talks to it with a
//! small blocking wire client built on kvix-wire.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvix_wire::*;

// Each test binary takes what it needs of these.
#[allow(unused_imports)]
pub use kvix_testkit::{engines, free_port, free_ports, http, missing_part, python};
pub mod redis;
pub mod tls;

/// A server run in this process (`kvix_server::run_with`) on `clock`, a clock only the
/// test moves, with `args` besides its addresses: its address, and the connection that
/// found it listening (made first, so it lands on executor 0).
pub fn in_process(
    args: &[&str],
    clock: std::sync::Arc<kvix_server::clock::ManualClock>,
) -> (SocketAddr, TcpStream) {
    use clap::Parser;
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let listen = addr.to_string();
    let own = [
        "kvix-server",
        "--listen",
        &listen,
        "--unix",
        "",
        "--metrics",
        "",
    ];
    let config = kvix_server::Config::parse_from(own.iter().chain(args));
    std::thread::spawn(move || kvix_server::run_with(config, clock));
    let first = eventually("the server listens", || TcpStream::connect(addr).ok());
    (addr, first)
}

pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// The HTTP API's address (`--http`).
    pub http: Option<SocketAddr>,
    pub stdout_lines: Vec<String>,
}

/// Waits (bounded: 20 s) until `f` gives a value.
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..400 {
        if let Some(v) = f() {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} never happened");
}

/// The server binary listening on TCP `listen`, without a Unix socket, with metrics on an
/// ephemeral port.
fn listening_on(listen: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvix-server"));
    cmd.args(["--listen", listen, "--unix", "", "--metrics", "127.0.0.1:0"]);
    cmd
}

/// How long a test waits for a server to listen: a replica catching up with its log, or
/// waiting for an unreachable one (30 s), takes longest.
pub const START_WAIT: Duration = Duration::from_secs(90);

impl Server {
    /// Starts the binary with `args` on an ephemeral port, no Unix socket, metrics on an
    /// ephemeral port, and waits for it to print its addresses.
    pub fn start(args: &[&str]) -> Server {
        let mut cmd = listening_on("127.0.0.1:0");
        cmd.args(args);
        Self::spawn(cmd)
    }

    pub fn spawn(cmd: Command) -> Server {
        Self::try_spawn(cmd).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts the binary with `args` on a port a later [`Server::start_on`] can come
    /// back to once it is killed: one below the kernel's ephemeral range, which no other
    /// test's server (bound to port 0) can be given while this one is down.
    pub fn start_restartable(args: &[&str]) -> Server {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], free_port())), args)
    }

    /// Starts the binary with `args` listening on TCP `listen` (a fixed port, to come
    /// back where a killed server was), no Unix socket, metrics on an ephemeral port.
    /// Retries a few times while the port is still busy.
    pub fn start_on(listen: SocketAddr, args: &[&str]) -> Server {
        let listen = listen.to_string();
        let mut last = String::new();
        for _ in 0..20 {
            let mut cmd = listening_on(&listen);
            cmd.args(args);
            match Self::try_spawn(cmd) {
                Ok(s) => return s,
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("kvix-server never listened on {listen}: {last}");
    }

    /// Like `spawn`, but a server that exits before listening, or does not listen within
    /// [`START_WAIT`], is an error, not a panic.
    pub fn try_spawn(mut cmd: Command) -> Result<Server, String> {
        if !cmd.get_envs().any(|(k, _)| k == "KVIX_LOG") {
            cmd.env("KVIX_LOG", "warn");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvix-server starts");
        // Read on a thread of its own, which keeps draining stdout afterwards so the
        // server never blocks on a full pipe; the start is waited for at most START_WAIT.
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let deadline = std::time::Instant::now() + START_WAIT;
        let (mut addr, mut metrics, mut lines) = (None, None, Vec::new());
        let args: Vec<_> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let given = |flag: &str| {
            args.windows(2)
                .rev()
                .find(|w| w[0] == flag)
                .map(|w| w[1].clone())
        };
        let wants_metrics = given("--metrics").is_none_or(|v| !v.is_empty());
        let wants_unix = given("--unix").is_some_and(|v| !v.is_empty());
        let wants_http = given("--http").is_some();
        let (mut unix, mut http) = (false, None);
        while addr.is_none()
            || (wants_metrics && metrics.is_none())
            || (wants_unix && !unix)
            || (wants_http && http.is_none())
        {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = match rx.recv_timeout(left) {
                Ok(line) => line,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = child.wait();
                    return Err(format!(
                        "kvix-server exited before listening; output so far: {lines:?}"
                    ));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "kvix-server did not listen within {} s (killed); output so far: {lines:?}",
                        START_WAIT.as_secs()
                    ));
                }
            };
            if let Some(rest) = line.split("listening on tcp://").nth(1) {
                addr = Some(rest.split_whitespace().next().unwrap().parse().unwrap());
            }
            unix |= line.contains("listening on unix://");
            if let Some(rest) = line.split("metrics on http://").nth(1) {
                metrics = Some(rest.trim().trim_end_matches("/metrics").parse().unwrap());
            }
            if let Some(rest) = line.split("HTTP API on http://").nth(1) {
                http = Some(rest.trim().parse().unwrap());
            }
            lines.push(line);
        }
        Ok(Server {
            child,
            addr: addr.unwrap(),
            metrics,
            http,
            stdout_lines: lines,
        })
    }

    pub fn connect(&self) -> Conn {
        Conn::open(self.addr)
    }

    /// Waits (bounded: 30 s) until the server exits by itself; its exit status.
    #[allow(dead_code)]
    pub fn exited(&mut self) -> std::process::ExitStatus {
        for _ in 0..600 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the server did not exit by itself");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The value of an unlabelled metric.
    pub fn metric(&self, name: &str) -> u64 {
        let text = self.scrape();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// A connection of the client named `client`, handshake done with 16-token blocks.
    #[allow(dead_code)]
    pub fn session_as(&self, client: &str) -> Conn {
        let mut c = self.connect();
        c.hello_as(client, 16, None).expect("welcome");
        c
    }

    /// A connection that has completed the handshake with 16-token blocks.
    pub fn session(&self) -> Conn {
        let mut c = self.connect();
        let w = c.hello(16, None).expect("welcome");
        assert_eq!(w.token_block, 16);
        c
    }

    /// The body of `GET path` on the metrics port.
    #[allow(dead_code)]
    pub fn get_metrics_path(&self, path: &str) -> String {
        let mut s = TcpStream::connect(self.metrics.expect("metrics enabled")).unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        let mut response = String::new();
        s.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").expect("a whole response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_string()
    }

    pub fn scrape(&self) -> String {
        let mut s = TcpStream::connect(self.metrics.expect("metrics enabled")).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    }

    /// SIGKILL: the process dies at once, with no clean shutdown (its sockets are
    /// closed by the kernel). Waits only to reap it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP (`true`) or SIGCONT: a stopped server keeps its sockets open, and the
    /// kernel keeps accepting bytes for it that nobody reads.
    pub fn pause(&self, paused: bool) {
        pause_process(&self.child, paused);
    }

    /// Bytes received and not yet read on the server's side of its TCP connections (from
    /// /proc/net/tcp): a paused server's unread requests.
    pub fn unread_bytes(&self) -> u64 {
        let port = format!(":{:04X}", self.addr.port());
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                // local address, remote address, state, "tx_queue:rx_queue"; state 01 is
                // ESTABLISHED (the listener itself is 0A).
                (f.len() > 4 && f[1].ends_with(&port) && f[3] == "01").then(|| f[4])
            })
            .filter_map(|q| u64::from_str_radix(q.split(':').nth(1)?, 16).ok())
            .sum()
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.terminate()
    }

    fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: a plain kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..200 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let _ = self.child.kill();
        self.child.wait().unwrap()
    }
}

/// SIGSTOP (`true`) or SIGCONT to a child process: stopped, it keeps its sockets open
/// and answers nothing.
pub fn pause_process(child: &Child, paused: bool) {
    let sig = if paused { libc::SIGSTOP } else { libc::SIGCONT };
    // SAFETY: a plain kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    // kill(2) returns before the threads have stopped: one may still answer a request
    // sent right after. Wait until every thread shows as stopped.
    if paused {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !all_threads_stopped(child.id()) {
            assert!(
                std::time::Instant::now() < deadline,
                "process {} never stopped",
                child.id()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in /proc).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit_once(") ")
                    .map(|(_, rest)| rest.starts_with('T'))
            })
            .unwrap_or(true)
    })
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.terminate();
        }
    }
}

/// A blocking, one-request-at-a-time (or hand-pipelined) wire client.
pub struct Conn {
    pub stream: TcpStream,
    frames: FrameReader,
    next_id: u64,
    /// The protocol version its frames say.
    pub version: u16,
}

/// A received frame, owned.
pub struct Received {
    pub header: Header,
    pub kind: Kind,
    body: AlignedVec,
}

impl Received {
    pub fn message(&self) -> MessageRef<'_> {
        MessageRef::view(self.kind, &self.body).expect("server sends valid bodies")
    }

    pub fn decode<M: Body>(&self) -> M {
        assert_eq!(
            self.kind,
            M::KIND,
            "expected {:?}, got {:?}: {:?}",
            M::KIND,
            self.kind,
            self.message()
        );
        to_native::<M>(codec::access::<M>(&self.body).unwrap())
    }

    pub fn error(&self) -> ErrorReply {
        self.decode::<ErrorReply>()
    }
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        Self::over(TcpStream::connect(addr).expect("connects"))
    }

    /// A connection from loopback address `from` (e.g. 127.0.0.2): another client host.
    pub fn open_from(from: std::net::Ipv4Addr, addr: SocketAddr) -> Conn {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from((from, 0)).into()).unwrap();
        s.connect(&addr.into()).expect("connects");
        Self::over(s.into())
    }

    /// A connection over `stream`, already connected.
    pub fn over(stream: TcpStream) -> Conn {
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Conn {
            stream,
            frames: FrameReader::new(u32::MAX),
            next_id: 1,
            version: PROTOCOL_VERSION,
        }
    }

    pub fn send<M: Body>(&mut self, msg: &M) -> u64 {
        self.send_flags(msg, 0)
    }

    pub fn send_flags<M: Body>(&mut self, msg: &M, flags: u8) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode_in_version(msg, self.version, id, flags, AlignedVec::new()).unwrap();
        self.stream.write_all(&frame).unwrap();
        id
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// The next frame, or None when the server closed the connection.
    pub fn recv(&mut self) -> Option<Received> {
        loop {
            if let Some(f) = self.frames.next().expect("server frames are valid") {
                let (header, kind, len) = (f.header, f.kind, f.len);
                let mut body = AlignedVec::new();
                body.extend_from_slice(f.body);
                self.frames.consume(len);
                return Some(Received { header, kind, body });
            }
            match self.stream.read(self.frames.spare()) {
                Ok(0) => return None,
                Ok(n) => self.frames.filled(n),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("reading from server: {e}"),
            }
        }
    }

    /// Sends a request and returns its reply.
    pub fn ask<M: Body>(&mut self, msg: &M) -> Received {
        let id = self.send(msg);
        let r = self.recv().expect("a reply before close");
        assert_eq!(r.header.request_id, id);
        r
    }

    pub fn hello(&mut self, token_block: u32, auth: Option<&str>) -> Result<Welcome, ErrorReply> {
        self.hello_as("test", token_block, auth)
    }

    /// A Hello naming the client `client`.
    pub fn hello_as(
        &mut self,
        client: &str,
        token_block: u32,
        auth: Option<&str>,
    ) -> Result<Welcome, ErrorReply> {
        let r = self.ask(&Hello {
            client: client.into(),
            token_block,
            auth: auth.map(str::to_string),
        });
        match r.kind {
            Kind::Welcome => Ok(r.decode()),
            _ => Err(r.error()),
        }
    }

    pub fn announce(
        &mut self,
        name: &str,
        lanes: Vec<Lane>,
        feed: Feed,
    ) -> Result<Announced, ErrorReply> {
        self.announce_with(name, lanes, feed, None)
    }

    /// Announces a plain worker fed by event batches (one full lane of 16-token blocks);
    /// its id.
    pub fn events_worker(&mut self, name: &str) -> WorkerId {
        self.announce(name, vec![Lane::full(16)], Feed::Events)
            .unwrap()
            .worker
    }

    /// Announces an event-fed worker that the server subscribes to.
    pub fn announce_source(
        &mut self,
        name: &str,
        lanes: Vec<Lane>,
        source: EventSource,
    ) -> Result<Announced, ErrorReply> {
        self.announce_with(name, lanes, Feed::Events, Some(source))
    }

    pub fn announce_with(
        &mut self,
        name: &str,
        lanes: Vec<Lane>,
        feed: Feed,
        source: Option<EventSource>,
    ) -> Result<Announced, ErrorReply> {
        let r = self.ask(&Announce {
            name: name.into(),
            lanes,
            feed,
            source,
        });
        match r.kind {
            Kind::Announced => Ok(r.decode()),
            _ => Err(r.error()),
        }
    }

    pub fn query(&mut self, keyspace: &Keyspace, chain: &[u64]) -> Answer {
        self.ask(&Query {
            keyspace: keyspace.clone(),
            chain: chain.to_vec(),
            ..Default::default()
        })
        .decode()
    }
    /// The id of the active worker `name`, if there is one.
    #[allow(dead_code)]
    pub fn worker_id(&mut self, name: &str) -> Option<WorkerId> {
        let page: Roster = self
            .ask(&RosterRequest {
                from: WorkerId::MAX,
                names: vec![name.to_string()],
            })
            .decode();
        page.workers.first().map(|e| e.worker)
    }
}

/// The server binary run with `args`, on an ephemeral port, without a Unix socket or
/// metrics (for runs that are expected to stop on their own).
pub fn bare_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvix-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--unix", "", "--metrics", ""])
        .args(args);
    cmd
}

/// A batch storing `chain` from block 0 on lane 0.
pub fn stored_batch(worker: WorkerId, seq: u64, keyspace: &Keyspace, chain: &[u64]) -> EventBatch {
    stored_at(worker, seq, keyspace, 0, chain)
}

/// A batch storing `chain` as blocks `start..` on lane 0.
pub fn stored_at(
    worker: WorkerId,
    seq: u64,
    keyspace: &Keyspace,
    start: u32,
    chain: &[u64],
) -> EventBatch {
    EventBatch {
        worker,
        seq,
        keyspace: keyspace.clone(),
        events: vec![Event::Stored {
            lane: 0,
            start,
            parent: None,
            chain: chain.to_vec(),
            engine: vec![],
        }],
    }
}

/// The chain of `n` blocks of a prompt whose tokens are `base, base+1, ...`.
pub fn chain_of(keyspace: &Keyspace, base: u32, n: usize) -> Vec<u64> {
    let tokens: Vec<u32> = (0..(n as u32 * 16)).map(|i| base.wrapping_add(i)).collect();
    chain::token_chain(keyspace.seed(16), 16, &tokens)
}

/// Installs a Debian package with apt-get (running as root); why not, when it cannot.
#[allow(dead_code)]
pub fn apt_install(package: &str) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root, so apt-get cannot install it".into());
    }
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .output()
            .map_err(|e| format!("apt-get: {e}"))
            .and_then(|o| {
                o.status
                    .success()
                    .then_some(())
                    .ok_or_else(|| String::from_utf8_lossy(&o.stderr).trim().to_string())
            })
    };
    eprintln!("{package} is missing: installing it with apt-get");
    apt(&["update", "-qq"])?;
    apt(&["install", "-y", "-qq", "--no-install-recommends", package])
}

/// A small tmpfs mounted for one test (a disk that fills up), unmounted when dropped.
pub struct Tmpfs {
    pub dir: std::path::PathBuf,
}

impl Tmpfs {
    /// Mounts `bytes` of tmpfs; None when the tester opted out of it.
    pub fn mount(tag: &str, bytes: u64) -> Option<Tmpfs> {
        let dir = std::env::temp_dir().join(format!("kvix-tmpfs-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Tmpfs { dir }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                let _ = std::fs::remove_dir(&dir);
                let how = format!(
                    "mounting a tmpfs failed ({}); run the tests as root",
                    why.trim()
                );
                missing_part("tmpfs", &how);
                None
            }
        }
    }

    /// Fills the file system with `name` until a write is refused.
    pub fn fill(&self, name: &str) {
        let mut f = std::fs::File::create(self.dir.join(name)).unwrap();
        let chunk = [0xa5u8; 4096];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                    break;
                }
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A plain HTTP GET of `path` on `addr`: status line, headers and body.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}
