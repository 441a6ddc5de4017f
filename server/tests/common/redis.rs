//! A private `redis-server` for a test: its own port and directory, append-only file on
//! (so a restart keeps the stream), stopped on drop. A missing redis-server is installed
//! from the distribution's packages when this runs as root with apt-get; otherwise the
//! test fails saying how to get it (or skips, saying so, when `KVIX_TEST_SKIP` names
//! `redis`).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Extra arguments (a replica's `--replicaof`, a sentinel's config file first).
    args: Vec<String>,
}

fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs redis-server with apt-get, once per test binary; why not, when it cannot.
fn install() -> Result<(), String> {
    static TRIED: OnceLock<Result<(), String>> = OnceLock::new();
    TRIED
        .get_or_init(|| {
            super::apt_install("redis-server")?;
            installed()
                .then_some(())
                .ok_or_else(|| "installed, but redis-server does not run".into())
        })
        .clone()
}

/// Whether redis-server can run here (installing it when it can); None when the tester
/// opted out of it. Otherwise a missing one fails the test with the command to run.
pub fn available(test: &str) -> Option<()> {
    if installed() {
        return Some(());
    }
    match install() {
        Ok(()) => Some(()),
        Err(why) => {
            let how = format!("redis-server is missing ({why}); `apt-get install redis-server`");
            super::missing_part("redis", &format!("{test}: {how}"));
            None
        }
    }
}

impl Redis {
    pub fn start(tag: &str) -> Redis {
        Self::start_with(tag, |_, _| Vec::new())
    }

    /// One that serves only clients that log in with `password` (`--requirepass`).
    pub fn with_password(tag: &str, password: &str) -> Redis {
        Self::start_with(tag, |_, _| vec!["--requirepass".into(), password.into()])
    }

    /// A replica of `primary`.
    pub fn replica_of(tag: &str, primary: &Redis) -> Redis {
        let port = primary.port.to_string();
        Self::start_with(tag, |_, _| {
            vec!["--replicaof".into(), "127.0.0.1".into(), port.clone()]
        })
    }

    /// A Sentinel (redis-server in sentinel mode) watching `primary` as `master`, with a
    /// quorum of one and a half-second down-after.
    pub fn sentinel(tag: &str, primary: &Redis, master: &str) -> Redis {
        Self::start_with(tag, |dir, port| {
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {master} 127.0.0.1 {} 1\n\
                     sentinel down-after-milliseconds {master} 500\n\
                     sentinel failover-timeout {master} 3000\n",
                    dir.display(),
                    primary.port
                ),
            )
            .unwrap();
            vec![conf.display().to_string(), "--sentinel".into()]
        })
    }

    fn start_with(tag: &str, args: impl Fn(&PathBuf, u16) -> Vec<String>) -> Redis {
        let dir = std::env::temp_dir().join(format!("kvix-redis-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A port chosen free may be taken before redis-server binds it; choose again.
        for _ in 0..20 {
            let port = super::engines::free_port();
            let args = args(&dir, port);
            if let Some(child) = launch(&args, port, &dir) {
                return Redis {
                    port,
                    dir,
                    child: Some(child),
                    args,
                };
            }
        }
        panic!("redis-server ({tag}) found no free port in 20 tries");
    }

    pub fn url(&self, key: &str) -> String {
        format!("redis://127.0.0.1:{}/{key}", self.port)
    }

    /// The log URL that logs in with `password`.
    pub fn url_with_password(&self, password: &str, key: &str) -> String {
        format!("redis://:{password}@127.0.0.1:{}/{key}", self.port)
    }

    /// Starts (again) on the same port and directory; waits until it answers.
    pub fn restart(&mut self) {
        let child = launch(&self.args, self.port, &self.dir);
        assert!(
            child.is_some(),
            "redis-server exited: port {} is taken",
            self.port
        );
        self.child = child;
    }

    /// Starts again on the same port with nothing: its append-only files removed, as a
    /// Redis without persistence (or with its volume lost) comes back.
    #[allow(dead_code)]
    pub fn restart_empty(&mut self) {
        self.kill();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
        self.restart();
    }

    /// SIGKILL: Redis is gone until `restart`.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP (`true`) or SIGCONT: a paused Redis keeps its connections open and
    /// answers nothing, as in a long GC-like stall or a network partition.
    pub fn pause(&self, paused: bool) {
        super::pause_process(self.child.as_ref().expect("running"), paused);
    }
}

/// Runs redis-server on `port` and waits until it answers; None when it exits instead
/// (its port was taken).
fn launch(args: &[String], port: u16, dir: &Path) -> Option<Child> {
    let mut child = Command::new("redis-server")
        .args(args)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    for _ in 0..200 {
        if child.try_wait().ok().flatten().is_some() {
            return None;
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(child);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("redis-server did not listen on {}", port);
}

impl Drop for Redis {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.pause(false);
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
