//! The Go code under the race detector, against this build's kvix-server: the Go client
//! (client/go: its shared wire vectors, chain hash vectors, fuzz seed corpus and
//! contract tests) and the endpoint picker's kvix-scorer (gateway/epp: GAIE v1.5.0's
//! own loader and scheduler with kvix beside GAIE's scorers). Go is a test dependency
//! like Python: missing, the test fails saying how to get it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `go test -race -count=1 ./...` in `module`; every package in `packages` must pass.
fn go_test(module: &str, gocache: Option<&Path>, packages: &[&str]) {
    let mut cmd = Command::new("go");
    cmd.args(["test", "-race", "-count=1", "./..."])
        .current_dir(repo().join(module))
        .env("KVIX_SERVER_BIN", env!("CARGO_BIN_EXE_kvix-server"));
    if let Some(cache) = gocache {
        cmd.env("GOCACHE", cache);
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("go test could not start ({e}): install Go 1.25 or later (https://go.dev/dl)")
    });
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(
        out.status.success(),
        "go test in {module} failed:\n{report}"
    );
    for package in packages {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("ok") && l.contains(&format!("{package}\t"))),
            "{package} did not pass:\n{report}"
        );
    }
    assert!(!report.contains("SKIP"), "a Go test skipped:\n{report}");
}

#[test]
fn the_go_client_passes_its_vectors_and_contract_tests_under_the_race_detector() {
    go_test(
        "client/go",
        None,
        &[
            "github.com/kvix/kvix/client/go",
            "github.com/kvix/kvix/client/go/wire",
        ],
    );
}

#[test]
fn the_epp_scorer_passes_gaies_own_scheduler_under_the_race_detector() {
    // GAIE and Kubernetes' client libraries build to about a gigabyte of cache: a cache
    // of this test's own, shared with .ci/run's go vet, removed once the test passed.
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-epp-cache");
    go_test(
        "gateway/epp",
        Some(&cache),
        &["github.com/kvix/kvix/gateway/epp/scorer"],
    );
    let _ = std::fs::remove_dir_all(&cache);
}
