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

/// `kvix-server check` of a server on port 0 with no metrics or Unix socket, and `more`.
fn check_quiet(more: &[&str]) -> Output {
    let mut args = vec![
        "check",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "",
        "--unix",
        "",
    ];
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
