//! The engines' real publishers (scripts/engines.py: each release's own kv_events.py
//! from its wheel), driven one batch at a time from a test.
//!
//! Needs python3; `setup` installs pyzmq and msgspec and downloads the wheels once. A
//! machine without python3 skips (printing why), except under CI=true, where it fails.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

pub const RELEASES: [&str; 3] = ["vllm-0.9.2", "vllm-0.34.0", "sglang-0.5.23"];

fn script() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/engines.py").to_string()
}

/// Whether the real publishers can run here; None (after printing why) when the test
/// should be skipped. Panics under CI=true, and when setup itself fails.
pub fn available(test: &str) -> Option<()> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let ready = READY.get_or_init(|| {
        let out = Command::new("python3")
            .arg(script())
            .arg("setup")
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("no python3 ({e})"))?;
        if !out.status.success() {
            panic!(
                "scripts/engines.py setup failed ({}); it installs pyzmq and msgspec and downloads the engine wheels",
                out.status
            );
        }
        Ok(())
    });
    match ready {
        Ok(()) => Some(()),
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("{test} needs python3 under CI: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}; install python3 to run it");
            None
        }
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
        let mut cmd = Command::new("python3");
        cmd.arg(script())
            .args(["publish", release, "--endpoint", endpoint, "--topic", "kv"])
            .args(["--rank", &rank.to_string()]);
        if let Some(r) = replay {
            cmd.args(["--replay", r]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 starts");
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
        p.expect("ready");
        p
    }

    fn expect(&mut self, prefix: &str) -> String {
        match self.lines.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if l.starts_with(prefix) => l,
            other => panic!("{}: expected {prefix:?}, got {other:?}", self.release),
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
