//! kvix's HTTP API against NVIDIA Dynamo's standalone KV indexer, value for value
//! (`bench/peer/tests/http_differential.rs`). The peer bench is a cargo workspace of its
//! own (dynamo-kv-router pins tokio), so it is built and run from here with cargo, on
//! this build's kvix-server: `cargo test --workspace` runs every test.

use std::process::Command;

#[test]
fn kvix_and_dynamos_indexer_answer_alike_with_real_publishers() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let peer = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/peer/Cargo.toml");
    let status = Command::new(&cargo)
        .args(["test", "--locked", "--manifest-path", peer])
        .args(["--test", "http_differential"])
        .env("KVIX_SERVER", env!("CARGO_BIN_EXE_kvix-server"))
        .status()
        .unwrap_or_else(|e| panic!("{cargo} does not run: {e}"));
    assert!(
        status.success(),
        "`cargo test --manifest-path bench/peer/Cargo.toml --test http_differential` failed ({status}): its output is above"
    );
}
