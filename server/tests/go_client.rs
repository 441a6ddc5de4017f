//! The Go client (client/go): its shared wire vectors, chain hash vectors, fuzz seed
//! corpus and contract tests against this build's kvix-server, under the race
//! detector. Go is a test dependency like Python: missing, the test fails saying how
//! to get it.

use std::path::Path;
use std::process::Command;

#[test]
fn the_go_client_passes_its_vectors_and_contract_tests_under_the_race_detector() {
    let module = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/go");
    let out = Command::new("go")
        .args(["test", "-race", "-count=1", "./..."])
        .current_dir(&module)
        .env("KVIX_SERVER_BIN", env!("CARGO_BIN_EXE_kvix-server"))
        .output()
        .unwrap_or_else(|e| {
            panic!("go test could not start ({e}): install Go 1.22 or later (https://go.dev/dl, or apt-get install golang)")
        });
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(out.status.success(), "go test failed:\n{report}");
    for package in [
        "github.com/kvix/kvix/client/go\t",
        "github.com/kvix/kvix/client/go/wire\t",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("ok") && l.contains(package)),
            "{package} did not pass:\n{report}"
        );
    }
    assert!(!report.contains("SKIP"), "a Go test skipped:\n{report}");
}
