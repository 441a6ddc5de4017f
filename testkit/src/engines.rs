//! The engines' real publishers (scripts/engines.py: each release's own kv_events.py
//! from its wheel), driven one batch at a time from a test.
//!
//! Runs on the tests' Python environment (common::python, which has pyzmq and msgspec);
//! `setup` downloads the engines' wheels once. Without python3 the tests fail naming the
//! command that provides it, unless KVIX_TEST_SKIP names python.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use kvix_wire::EventSource;
use serde_json::Value;

pub const RELEASES: [&str; 3] = ["vllm-0.9.2", "vllm-0.34.0", "sglang-0.5.23"];

fn script() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/engines.py").to_string()
}

/// The interpreter the real publishers run on, once their wheels are fetched; None
/// (after printing why) when the tester opted out of `python`. Panics when setup fails.
pub fn available(test: &str) -> Option<()> {
    python(test).map(|_| ())
}

fn python(test: &str) -> Option<&'static std::path::Path> {
    static READY: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    let ready = READY.get_or_init(|| {
        let python = super::python::interpreter()?;
        let out = Command::new(&python)
            .arg(script())
            .arg("setup")
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("{test}: {} does not run: {e}", python.display()));
        assert!(
            out.status.success(),
            "scripts/engines.py setup failed ({}); it downloads the engine wheels",
            out.status
        );
        Some(python)
    });
    ready.as_deref()
}

pub use super::free_port;

/// The tcp ports of a publisher's events and replay sockets; data parallel rank `r`
/// binds each plus `r`, as every release does.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub publish: u16,
    pub replay: u16,
}

impl Ports {
    /// Starts `ranks` publishers of `release` (ranks 0..ranks) on ports chosen free,
    /// choosing again when a port is taken before a publisher binds it.
    pub fn start_ranks(release: &'static str, ranks: u16) -> (Ports, Vec<Publisher>) {
        for _ in 0..50 {
            let ports = Ports::choose(ranks);
            let started: Vec<Option<Publisher>> = (0..ranks)
                .map(|rank| ports.try_start(release, rank))
                .collect();
            if started.iter().all(Option::is_some) {
                return (ports, started.into_iter().flatten().collect());
            }
            started.into_iter().flatten().for_each(Publisher::kill);
        }
        panic!("{release}: no free ports for {ranks} publishers in 50 tries");
    }

    /// Starts rank 0 of `release` on free ports.
    pub fn start_one(release: &'static str) -> (Ports, Publisher) {
        let (ports, mut started) = Ports::start_ranks(release, 1);
        (ports, started.pop().unwrap())
    }

    /// Starts rank 0 of `release` again on these ports (a restarted engine), waiting
    /// while a port is held, as by a connection that happened to take it.
    pub fn restart(&self, release: &'static str) -> Publisher {
        self.restart_rank(release, 0)
    }

    /// Starts rank `rank` of `release` again on these ports (see [`Ports::restart`]).
    pub fn restart_rank(&self, release: &'static str, rank: u16) -> Publisher {
        for _ in 0..200 {
            if let Some(p) = self.try_start(release, rank) {
                return p;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{release}: {self:?} stayed in use");
    }

    fn try_start(&self, release: &'static str, rank: u16) -> Option<Publisher> {
        Publisher::try_start(
            release,
            &format!("tcp://*:{}", self.publish),
            Some(&format!("tcp://127.0.0.1:{}", self.replay)),
            rank.into(),
        )
    }

    /// Ports free now for `ranks` ranks: the events ports first, then the replay ports,
    /// each range `ranks` long, side by side.
    pub fn choose(ranks: u16) -> Ports {
        let publish = super::free_ports(2 * ranks);
        Ports {
            publish,
            replay: publish + ranks,
        }
    }

    /// Rank `rank`'s events endpoint, as a subscriber dials it.
    pub fn endpoint(&self, rank: u16) -> String {
        format!("tcp://127.0.0.1:{}", self.publish + rank)
    }

    /// Rank `rank`'s replay endpoint.
    pub fn replay(&self, rank: u16) -> String {
        format!("tcp://127.0.0.1:{}", self.replay + rank)
    }

    /// The source a worker is announced with: rank `rank` of the publisher on these
    /// ports, in the tests' model "m".
    pub fn source(&self, rank: u16, salt: &str) -> EventSource {
        EventSource {
            endpoint: self.endpoint(rank),
            replay: self.replay(rank),
            model: "m".into(),
            salt: salt.into(),
        }
    }
}

/// One release's publisher process.
pub struct Publisher {
    pub release: &'static str,
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Publisher {
    /// Starts RELEASE's ZmqEventPublisher binding `endpoint` (and `replay`) for data
    /// parallel rank `rank` (which offsets tcp ports by the rank, as the engines do).
    pub fn start(
        release: &'static str,
        endpoint: &str,
        replay: Option<&str>,
        rank: u32,
    ) -> Publisher {
        Publisher::try_start(release, endpoint, replay, rank)
            .unwrap_or_else(|| panic!("{release}: {endpoint} or {replay:?} is in use"))
    }

    /// As `start`, but None when an address is already in use: a port chosen free can be
    /// taken by any other process (an outgoing connection's ephemeral port) before the
    /// publisher binds it.
    pub fn try_start(
        release: &'static str,
        endpoint: &str,
        replay: Option<&str>,
        rank: u32,
    ) -> Option<Publisher> {
        Publisher::try_start_topic(release, endpoint, replay, rank, "kv")
    }

    /// As `try_start`, publishing under `topic`.
    pub fn try_start_topic(
        release: &'static str,
        endpoint: &str,
        replay: Option<&str>,
        rank: u32,
        topic: &str,
    ) -> Option<Publisher> {
        Publisher::try_start_args(release, endpoint, replay, rank, topic, &[])
    }

    /// As `try_start_topic`, with more of scripts/engines.py's flags (`--buffer N`).
    pub fn try_start_args(
        release: &'static str,
        endpoint: &str,
        replay: Option<&str>,
        rank: u32,
        topic: &str,
        more: &[&str],
    ) -> Option<Publisher> {
        let python = python(release).expect("the tests' Python: engines::available first");
        let mut cmd = Command::new(python);
        cmd.arg(script())
            .args(["publish", release, "--endpoint", endpoint, "--topic", topic])
            .args(more)
            .args(["--rank", &rank.to_string()]);
        if let Some(r) = replay {
            cmd.args(["--replay", r]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the tests' Python starts");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Publisher {
            release,
            child,
            stdin,
            lines,
        };
        if p.expect_one_of(&["ready", "address in use"])
            .starts_with("ready")
        {
            Some(p)
        } else {
            let _ = p.child.wait();
            None
        }
    }

    fn expect(&mut self, prefix: &str) -> String {
        self.expect_one_of(&[prefix])
    }

    fn expect_one_of(&mut self, prefixes: &[&str]) -> String {
        match self.lines.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if prefixes.iter().any(|p| l.starts_with(p)) => l,
            other => panic!("{}: expected {prefixes:?}, got {other:?}", self.release),
        }
    }

    /// Publishes one batch of `events` and returns its seq once it is sent.
    pub fn publish(&mut self, events: Vec<Value>) -> u64 {
        let cmd = serde_json::json!({"op": "publish", "events": events});
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.expect("published ");
        line["published ".len()..].parse().unwrap()
    }

    /// Runs vLLM 0.34's offloading event tracker on `cmd` (scripts/engines.py's
    /// "offload" op) and publishes what it builds as one batch; its seq.
    pub fn offload(&mut self, mut cmd: Value) -> u64 {
        cmd["op"] = "offload".into();
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.expect("published ");
        line["published ".len()..].parse().unwrap()
    }

    /// Publishes one batch per list of events, in order; returns the last one's seq.
    pub fn publish_many(&mut self, batches: Vec<Vec<Value>>) -> u64 {
        let cmd = serde_json::json!({"op": "publish_many", "batches": batches});
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.expect("published ");
        line["published ".len()..].parse().unwrap()
    }

    /// A clean shutdown of the publisher.
    pub fn stop(mut self) {
        writeln!(self.stdin, "{{\"op\": \"stop\"}}").unwrap();
        self.stdin.flush().unwrap();
        self.expect("stopped");
        let _ = self.child.wait();
    }

    /// SIGKILL: the engine process dies, its buffer with it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
