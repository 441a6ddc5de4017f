//! The kvix-server a leg runs against: started from its binary on loopback ports, its
//! log kept in a file (quoted when it fails to start), its CPU time and peak resident
//! memory read from /proc.

use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Until `child` accepts connections on `addr`: an error saying it exited (and how) or
/// did not listen `within`.
fn await_listening(child: &mut Child, addr: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while TcpStream::connect(addr).is_err() {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("exited ({status}) at start on {addr}");
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "did not listen on {addr} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The last 20 lines of a log file.
fn tail(log: &Path) -> String {
    let mut s = String::new();
    let _ = File::open(log).and_then(|mut f| f.read_to_string(&mut s));
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A free loopback port (free now: the caller binds it soon after).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The causes a reuse verdict names (`kvix_workers_suspect{cause}`).
pub const SUSPECT_CAUSES: [&str; 4] = [
    "gateway_tokenization",
    "events_missing",
    "events_lagging",
    "undercounted",
];

pub struct Server {
    child: Child,
    pub addr: String,
    metrics: String,
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    cpu_at_start: f64,
    started: Instant,
}

/// CPU seconds, peak resident memory and query time of a leg's server.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// Average cores busy over the leg.
    pub cores: f64,
    pub peak_rss_mib: f64,
    /// Its own query time (`kvix_query_latency_us`), p99.
    pub query_p99_us: Option<u64>,
}

impl Server {
    /// Starts `bin` with `args` on a free port and waits until it accepts connections.
    pub fn start(bin: &Path, args: &[String]) -> anyhow::Result<Server> {
        let (port, metrics) = (free_port()?, free_port()?);
        Server::start_at(
            bin,
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{metrics}"),
            args,
        )
    }

    fn start_at(
        bin: &Path,
        addr: String,
        metrics: String,
        args: &[String],
    ) -> anyhow::Result<Server> {
        static STARTS: AtomicU64 = AtomicU64::new(0);
        let n = STARTS.fetch_add(1, Ordering::Relaxed);
        let log = std::env::temp_dir().join(format!("kvix-fleet-{}-{n}.log", std::process::id()));
        let out = File::create(&log)?;
        let child = Command::new(bin)
            .args(["--listen", &addr, "--metrics", &metrics, "--unix", ""])
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| {
                anyhow::anyhow!(
                    "{}: {e} (build it: cargo build --release -p kvix-server)",
                    bin.display()
                )
            })?;
        let mut server = Server {
            child,
            addr,
            metrics,
            bin: bin.to_path_buf(),
            args: args.to_vec(),
            log,
            cpu_at_start: 0.0,
            started: Instant::now(),
        };
        let (addr, log) = (server.addr.clone(), server.log.clone());
        await_listening(&mut server.child, &addr, Duration::from_secs(30))
            .map_err(|e| anyhow::anyhow!("kvix-server {e}:\n{}", tail(&log)))?;
        server.cpu_at_start = server.cpu_seconds().unwrap_or(0.0);
        server.started = Instant::now();
        Ok(server)
    }

    /// kill -9, then the same command on the same address.
    pub fn restart(&mut self, down: Duration) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(down);
        let (bin, addr, metrics, args) = (
            self.bin.clone(),
            self.addr.clone(),
            self.metrics.clone(),
            self.args.clone(),
        );
        *self = Server::start_at(&bin, addr, metrics, &args)?;
        Ok(())
    }

    /// utime + stime of the process, in seconds.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
            + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // USER_HZ is 100 on every Linux the kernel ABI promises it to.
        Ok(ticks / 100.0)
    }

    /// The server's use since it started listening.
    /// The server's reuse verdicts now: `kvix_workers_suspect` by cause, in
    /// `kvix_server`'s cause order (None when the metrics do not read).
    pub fn suspects(&self) -> Option<[u64; 4]> {
        let page = crate::metrics::page(self.metrics.parse().ok()?).ok()?;
        let mut out = [0; 4];
        for (slot, cause) in out.iter_mut().zip(SUSPECT_CAUSES) {
            let name = format!("kvix_workers_suspect{{cause=\"{cause}\"}}");
            *slot = crate::metrics::value(&page, &name)?;
        }
        Some(out)
    }

    pub fn usage(&self) -> Usage {
        let busy = self.cpu_seconds().unwrap_or(0.0) - self.cpu_at_start;
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let peak_kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let query_p99_us = self.metrics.parse().ok().and_then(|addr| {
            let page = crate::metrics::page(addr).ok()?;
            crate::metrics::value(&page, r#"kvix_query_latency_us{quantile="0.99"}"#)
        });
        Usage {
            cores: busy / self.started.elapsed().as_secs_f64().max(1e-9),
            peak_rss_mib: peak_kib / 1024.0,
            query_p99_us,
        }
    }
}

/// A `redis-server` of its own for a leg's replicas: no persistence, a free port.
pub struct Redis {
    child: std::sync::Mutex<Child>,
    pub port: u16,
}

impl Redis {
    pub fn start() -> anyhow::Result<Redis> {
        let port = free_port()?;
        Ok(Redis {
            child: std::sync::Mutex::new(Self::spawn(port)?),
            port,
        })
    }

    fn spawn(port: u16) -> anyhow::Result<Child> {
        let mut child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                anyhow::anyhow!(
                    "redis-server: {e} (replicas need it: apt-get install redis-server)"
                )
            })?;
        let addr = format!("127.0.0.1:{port}");
        await_listening(&mut child, &addr, Duration::from_secs(10))
            .map_err(|e| anyhow::anyhow!("redis-server {e}"))?;
        Ok(child)
    }

    /// Killed (-9) and started again on its port: with no persistence it comes back
    /// empty, as a Redis pod without a volume does; every connection drops.
    pub fn restart(&self) -> anyhow::Result<()> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        child.kill()?;
        child.wait()?;
        *child = Self::spawn(self.port)?;
        Ok(())
    }

    /// FLUSHALL: Redis loses every key, the log included.
    pub fn flush(&self) -> anyhow::Result<()> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        c.write_all(b"*1\r\n$8\r\nFLUSHALL\r\n")?;
        let mut reply = [0u8; 5];
        c.read_exact(&mut reply)?;
        anyhow::ensure!(
            &reply == b"+OK\r\n",
            "FLUSHALL: {:?}",
            String::from_utf8_lossy(&reply)
        );
        Ok(())
    }

    /// SIGSTOP (`true`) or SIGCONT: Redis stops answering, connections stay open.
    pub fn pause(&self, stop: bool) -> anyhow::Result<()> {
        let signal = if stop { "-STOP" } else { "-CONT" };
        let pid = self.child.lock().unwrap_or_else(|e| e.into_inner()).id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill {signal} redis-server: {status}");
        Ok(())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.pause(false);
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
