//! The Python package (client/python) against this server: builds and installs it the
//! way its README says (`pip install ./client/python`, into a private directory, debug
//! profile), loads a server through the Rust client and records the Rust client's
//! answers, then runs the pytest suite (client/python/tests, the example's test
//! included) with that server, those answers and this server binary.
//!
//! Runs on the tests' Python environment (common::python: scripts/testenv.py makes it,
//! with maturin, pytest and what the suite imports). Without python3 the tests fail
//! naming the command that provides it, unless KVIX_TEST_SKIP names python.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::Server;
use kvix_client::wire::{Feed, Keyspace, Lane};
use kvix_client::{Addr, Client, ClientConfig, QueryOptions, QueryOutcome, WorkerRef};
use serde_json::json;

const MODEL: &str = "rust-answers";
const CAPACITY: u64 = 1 << 20;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `pip install ./client/python` into `site` (debug profile, its own cargo target
/// directory so it never waits on this build's lock).
fn install(python: &Path, site: &Path, cargo_target: &Path) {
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
        ])
        .args(["--upgrade", "--target"])
        .arg(site)
        .arg(repo().join("client/python"))
        .env("CARGO_TARGET_DIR", cargo_target)
        .env("MATURIN_PEP517_ARGS", "--profile dev")
        .output()
        .expect("the tests' Python runs");
    assert!(
        out.status.success(),
        "pip install ./client/python failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A small deterministic generator (the answers file must not change between runs).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Loads the server with placements and returns the Rust client's answers to 200
/// queries (prefixes and extensions of the placed prompts, with top_k and candidates).
async fn rust_answers(server: &Server) -> serde_json::Value {
    let cfg = ClientConfig {
        deadline: Duration::from_secs(2),
        ..ClientConfig::new([Addr::tcp(server.addr.to_string())])
    };
    let client = Client::connect(cfg).await.expect("connects");
    let ks = Keyspace::tokens(MODEL);
    let workers: Vec<String> = (0..6).map(|i| format!("py-worker-{i}")).collect();
    for w in &workers {
        let feed = Feed::Placements {
            capacity_blocks: CAPACITY,
            ttl_ms: 0,
        };
        client
            .announce(w.as_str(), vec![Lane::full(16)], feed)
            .await
            .expect("announce");
    }
    let mut rng = Rng(0x5eed);
    let bases: Vec<Vec<u32>> = (0..20)
        .map(|_| (0..16 * 40).map(|_| rng.below(50_000) as u32).collect())
        .collect();
    for (i, base) in bases.iter().enumerate() {
        for _ in 0..3 {
            let w = &workers[rng.below(workers.len() as u64) as usize];
            let blocks = 1 + rng.below(40) as usize;
            let prompt = &base[..16 * blocks];
            client.publish_placement(w.as_str(), &ks, client.token_chain(&ks, prompt));
            // Placements are fire-and-forget: wait until this one shows.
            let opts = QueryOptions {
                candidates: vec![WorkerRef::from(w.as_str())],
                ..Default::default()
            };
            let mut shown = false;
            for _ in 0..500 {
                let out = client.query_tokens(&ks, prompt, &opts).await;
                if out.best().is_some_and(|s| s.blocks as usize >= blocks) {
                    shown = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(shown, "placement {i} of {blocks} blocks never showed");
        }
    }
    let mut queries = Vec::new();
    for _ in 0..200 {
        let base = &bases[rng.below(bases.len() as u64) as usize];
        let mut tokens = base[..16 * (1 + rng.below(40) as usize)].to_vec();
        if rng.below(3) == 0 {
            tokens.extend((0..16 * rng.below(4)).map(|_| rng.below(50_000) as u32));
        }
        let top_k = [0u32, 1, 3][rng.below(3) as usize];
        let candidates: Vec<String> = if rng.below(3) == 0 {
            workers
                .iter()
                .filter(|_| rng.below(2) == 0)
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let opts = QueryOptions {
            candidates: candidates.iter().map(WorkerRef::from).collect(),
            top_k,
            deadline: None,
            weights: None,
        };
        let out = client.query_tokens(&ks, &tokens, &opts).await;
        let scores: Vec<serde_json::Value> = match &out {
            QueryOutcome::Scores(s) => s
                .iter()
                .map(|s| json!([s.name.as_deref().expect("announced here"), s.blocks]))
                .collect(),
            QueryOutcome::Empty => Vec::new(),
            other => panic!("the Rust client failed a query: {other:?}"),
        };
        queries.push(json!({
            "tokens": tokens, "top_k": top_k, "candidates": candidates,
            "outcome": out.kind(), "scores": scores,
        }));
    }
    json!({
        "server": server.addr.to_string(), "model": MODEL, "workers": workers,
        "capacity_blocks": CAPACITY, "queries": queries,
    })
}

#[test]
fn the_python_package_installs_and_its_pytest_suite_passes() {
    let Some(python) = common::python::interpreter() else {
        return;
    };
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvix-python");
    let site = work.join("site");
    install(&python, &site, &work.join("cargo"));

    let server = Server::start(&["--cores", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let answers = rt.block_on(rust_answers(&server));
    let answers_file = work.join("rust-answers.json");
    std::fs::write(&answers_file, answers.to_string()).unwrap();
    // Certificates for the suite's TLS test.
    let pki = common::tls::Pki::new("python");

    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .arg(repo().join("client/python/tests"))
        .current_dir(repo())
        .env("PYTHONPATH", &site)
        .env("KVIX_SERVER_BIN", env!("CARGO_BIN_EXE_kvix-server"))
        .env("KVIX_RUST_ANSWERS", &answers_file)
        .env("KVIX_TLS_DIR", &pki.dir)
        .output()
        .expect("the tests' Python runs");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(out.status.success(), "pytest failed:\n{report}");
    // Skips are failures here: everything the suite needs was provided.
    assert!(
        !report.contains("skipped"),
        "pytest skipped tests:\n{report}"
    );
}

/// What a fresh venv with the distributed wheel does: the wheel is found, installed
/// without a Rust toolchain, and works against the real server.
const FRESH_VENV_CHECK: &str = r#"
import importlib.metadata as md, shutil, sys
import kvix
assert shutil.which("cargo") is None and shutil.which("rustc") is None, "a Rust toolchain is on PATH"
meta = md.metadata("kvix-client")
assert kvix.__version__ == meta["Version"], (kvix.__version__, meta["Version"])
assert meta["Requires-Python"] == ">=3.11" and "kvix-client" in meta["Description"]
assert "Programming Language :: Python :: 3.11" in meta.get_all("Classifier")
addr = sys.argv[1]
with kvix.Client(addr, deadline_ms=2000) as c:
    c.announce("wheel-w", feed="placements", capacity_blocks=1000)
    p = list(range(64))
    assert c.publish_placement("wheel-w", "m", p)
    for _ in range(500):
        best = c.query_tokens("m", p).best
        if best is not None:
            break
        import time; time.sleep(0.01)
    assert (best.worker, best.blocks) == ("wheel-w", 4), best
print("ok", kvix.__version__)
"#;

/// The wheel as distributed (scripts/build-wheel.sh: abi3, manylinux_2_28, stripped)
/// installs into a fresh venv with no Rust toolchain on PATH and answers a query; its
/// name, version and metadata are what the package index will show.
#[test]
fn the_distributed_wheel_installs_in_a_fresh_venv_without_rust() {
    let Some(python) = common::python::interpreter() else {
        return;
    };
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvix-wheel");
    let _ = std::fs::remove_dir_all(&work);
    let built = Command::new("bash")
        .arg(repo().join("scripts/build-wheel.sh"))
        .arg(work.join("dist"))
        .env("CARGO_TARGET_DIR", work.join("cargo"))
        .env("PYTHON", &python)
        .output()
        .expect("bash runs");
    assert!(
        built.status.success(),
        "scripts/build-wheel.sh failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let wheel = String::from_utf8_lossy(&built.stdout).trim().to_string();
    // The wheel's build tree is made anew on every run: it only took disk from here on.
    let _ = std::fs::remove_dir_all(work.join("cargo"));
    let size = std::fs::metadata(&wheel).expect("the wheel").len();
    // Stripped: 1.6 MB (docs/operations.md); with debug info it was 4.4 MB.
    assert!(size < 2 << 20, "{wheel} is {size} bytes: not stripped?");

    let venv = work.join("venv");
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .expect("python3 runs");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // PATH without ~/.cargo/bin: only the venv and the system's directories.
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    let pip = Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--disable-pip-version-check",
        ])
        .arg(&wheel)
        .env("PATH", &path)
        .env_remove("PYTHONPATH")
        .output()
        .expect("the venv's python runs");
    assert!(
        pip.status.success(),
        "pip install {wheel}: {}",
        String::from_utf8_lossy(&pip.stderr)
    );

    let server = Server::start(&["--cores", "1"]);
    let run = Command::new(venv.join("bin/python"))
        .args(["-c", FRESH_VENV_CHECK])
        .arg(server.addr.to_string())
        .current_dir(&work)
        .env("PATH", &path)
        .env_remove("PYTHONPATH")
        .output()
        .expect("the venv's python runs");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        run.status.success() && report.starts_with("ok "),
        "{report}"
    );
}

/// Two installers at once against an empty environment (two test binaries started
/// together did this, and one failed inside pip): both wait while the lock is held, then
/// both succeed, one making the environment and the other finding it made.
#[test]
fn two_installers_at_once_both_get_a_whole_environment() {
    use std::io::{BufRead, BufReader};
    use std::os::fd::AsRawFd;
    let Some(python) = common::python::interpreter() else {
        return;
    };
    // A cache of its own (so holding its lock holds up no other test) that shares the
    // tests' wheels: the environment is made without the network.
    let real_cache = python.ancestors().nth(3).expect("CACHE/venv-X/bin/python");
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvix-testenv-race");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(real_cache.join("wheels"), work.join("wheels")).unwrap();
    let requirements = work.join("requirements.txt");
    std::fs::write(&requirements, "msgspec==0.23.0\n").unwrap();
    let lock = std::fs::File::create(work.join("lock")).unwrap();
    // SAFETY: flock on a file this test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let installers: Vec<_> = (0..2)
        .map(|_| {
            let mut child = Command::new("python3")
                .arg(repo().join("scripts/testenv.py"))
                .args(["ensure", "--requirements"])
                .arg(&requirements)
                .env("KVIX_CACHE", &work)
                .env("KVIX_VENV", work.join("venv"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("python3 runs");
            let (stderr, tx) = (child.stderr.take().unwrap(), tx.clone());
            let said = std::thread::spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if line.contains("waiting for it") {
                        let _ = tx.send(());
                    }
                    all += &line;
                    all.push('\n');
                }
                all
            });
            (child, said)
        })
        .collect();
    for _ in 0..2 {
        rx.recv().expect("each installer waits on the lock");
    }
    drop(lock);
    let mut paths = Vec::new();
    for (child, said) in installers {
        let out = child.wait_with_output().unwrap();
        let said = said.join().unwrap();
        assert!(out.status.success(), "an installer failed:\n{said}");
        paths.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    assert_eq!(paths[0], paths[1], "both report one environment");
    let import = Command::new(&paths[0])
        .args(["-c", "import msgspec"])
        .output()
        .unwrap();
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
}
