//! The binary's configuration as an operator meets it: `--config FILE` (its flags under
//! the command line and the environment) and `kvix-server check`, which says what a
//! start with those flags would trip on and exits.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::redis::{self, Redis};
use common::*;
use kvix_wire::Keyspace;

fn file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvix-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn server(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvix-server"));
    cmd.args(args)
        .env_remove("KVIX_LISTEN")
        .env_remove("KVIX_METRICS");
    cmd
}

/// A server on port 0 with no metrics or Unix socket.
const QUIET: [&str; 6] = ["--listen", "127.0.0.1:0", "--metrics", "", "--unix", ""];

/// `kvix-server check` of a server on port 0 with no metrics or Unix socket, and `more`.
fn check_quiet(more: &[&str]) -> Output {
    let mut args = vec!["check"];
    args.extend_from_slice(&QUIET);
    args.extend_from_slice(more);
    server(&args).output().unwrap()
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_config_file_configures_a_server() {
    let port = free_port();
    let metrics = free_port();
    let conf = file(
        "serve.toml",
        &format!(
            "listen = \"127.0.0.1:{port}\"\nmetrics = \"127.0.0.1:{metrics}\"\nunix = \"\"\ncores = 1\nmax-blocks = 12345\n"
        ),
    );
    let mut cmd = server(&["--config", conf.to_str().unwrap()]);
    cmd.stdout(std::process::Stdio::piped());
    let s = Server::spawn(cmd);
    assert_eq!(s.addr.port(), port, "the file's listen address");
    assert_eq!(s.metric("kvix_executors"), 1, "the file's --cores");
    let mut c = s.session();
    assert!(c.query(&Keyspace::tokens("m"), &[1, 2]).scores.is_empty());
}

#[test]
fn check_passes_a_start_that_would_work_and_names_what_would_not() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let ok = check_quiet(&[]);
    assert!(ok.status.success(), "{}", said(&ok));
    assert!(
        said(&ok).contains("ok    --listen 127.0.0.1:0: free"),
        "{}",
        said(&ok)
    );
    let not_a_socket = file("not-a-socket", "x");
    let bad = server(&[
        "check",
        "--listen",
        &taken,
        "--metrics",
        "",
        "--unix",
        not_a_socket.to_str().unwrap(),
        "--snapshot",
        "/nonexistent-kvix-dir/index.snapshot",
    ])
    .output()
    .unwrap();
    let text = said(&bad);
    assert!(!bad.status.success(), "{text}");
    for fails in [
        format!("FAIL  --listen {taken}: in use"),
        "is not a socket".to_string(),
        "FAIL  --snapshot /nonexistent-kvix-dir/index.snapshot".to_string(),
    ] {
        assert!(text.contains(&fails), "{fails:?} not in:\n{text}");
    }
    // The environment wins over the file, the command line over both.
    let conf = file(
        "check.toml",
        &format!("listen = \"{taken}\"\nmetrics = \"{taken}\"\nunix = \"\"\n"),
    );
    let out = server(&[
        "check",
        "--config",
        conf.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ])
    .env("KVIX_METRICS", "")
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", said(&out));
    // A file that does not read stops before anything is checked, naming the key.
    let conf = file("bad.toml", "colour = \"red\"\n");
    let out = server(&["check", "--config", conf.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        said(&out).contains("colour: no such flag"),
        "{}",
        said(&out)
    );
}

#[test]
fn check_reaches_the_replicas_redis_or_says_it_cannot() {
    if redis::available("check_reaches_the_replicas_redis").is_none() {
        return;
    }
    let r = Redis::start("check");
    let args = |url: &str| check_quiet(&["--log", url]);
    let up = args(&r.url("kvix"));
    assert!(up.status.success(), "{}", said(&up));
    assert!(said(&up).contains("answers (PONG)"), "{}", said(&up));
    drop(r);
    let down = args(&format!("redis://127.0.0.1:{}/kvix", free_port()));
    assert!(!down.status.success());
    assert!(said(&down).contains("FAIL  --log"), "{}", said(&down));
}

/// A value of the wrong type in the file names the file and the key (clap's own message
/// named only the flag, though the operator never typed it).
#[test]
fn a_bad_value_in_the_config_file_names_the_file_and_the_key() {
    let conf = file("bad-value.toml", "cores = \"two\"\n");
    let out = server(&["--config", conf.to_str().unwrap()])
        .output()
        .unwrap();
    let text = said(&out);
    assert!(!out.status.success());
    assert!(
        text.contains(&format!(
            "--config {}: cores: invalid value 'two'",
            conf.display()
        )),
        "{text}"
    );
}

/// `--help` names `check`; a fatal error is one line with one prefix; the log has no
/// colour codes when it is not a terminal, and none with NO_COLOR.
#[test]
fn help_names_check_and_errors_and_logs_are_plain() {
    let help = server(&["--help"]).output().unwrap();
    let text = said(&help);
    assert!(
        help.status.success() && text.contains("kvix-server check [FLAGS]"),
        "{text}"
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = server(&["--listen", &addr, "--metrics", "", "--unix", ""])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let fatal: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("kvix-server:"))
        .collect();
    assert_eq!(fatal.len(), 1, "{stderr}");
    assert!(!fatal[0].contains("kvix-server: kvix-server"), "{stderr}");
    for (tty, no_color, coloured) in [
        (true, false, true),
        (true, true, false),
        (false, false, false),
    ] {
        let log = log_of_a_start_and_stop(tty, no_color);
        assert!(log.contains("executor stopping"), "{log:?}");
        assert_eq!(
            log.contains('\u{1b}'),
            coloured,
            "a terminal: {tty}, NO_COLOR: {no_color}: {log:?}"
        );
    }
}

/// What a server started and stopped (SIGTERM) logs at info, its stderr a terminal (a
/// pseudo-terminal of the test's) or a pipe.
fn log_of_a_start_and_stop(tty: bool, no_color: bool) -> String {
    use std::io::{BufRead, Read};
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut cmd = server(&[&QUIET[..], &["--cores", "1"]].concat());
    cmd.env("KVIX_LOG", "info").env_remove("NO_COLOR");
    if no_color {
        cmd.env("NO_COLOR", "1");
    }
    let mut master = None;
    if tty {
        let (mut m, mut s) = (0, 0);
        // SAFETY: openpty writes two descriptors this test then owns.
        let r = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty");
        // SAFETY: both were just opened and are owned here only.
        let (m, s) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        cmd.stderr(std::process::Stdio::from(s));
        master = Some(std::fs::File::from(m));
    } else {
        cmd.stderr(std::process::Stdio::piped());
    }
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    drop(cmd);
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("listening on"), "{first}");
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut log = Vec::new();
    match master {
        // A pseudo-terminal's master reads until the child's side is closed (then EIO).
        Some(mut m) => {
            let mut buf = [0u8; 4096];
            while let Ok(n) = m.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.extend_from_slice(&buf[..n]);
            }
        }
        None => {
            child.stderr.take().unwrap().read_to_end(&mut log).unwrap();
        }
    }
    child.wait().unwrap();
    String::from_utf8_lossy(&log).into_owned()
}
