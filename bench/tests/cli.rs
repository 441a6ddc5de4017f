//! The binary: `--json` output parses, and a malformed trace line is reported by number.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvix-bench"))
}

#[test]
fn sim_json_parses() {
    let out = bench()
        .args([
            "sim",
            "--json",
            "--quiet",
            "--workers",
            "4",
            "--sessions",
            "60",
            "--session-rate",
            "10",
            "--system-tokens",
            "64",
            "--user-tokens",
            "64",
            "--output-tokens",
            "16",
            "--followup-tokens",
            "16",
            "--capacity-blocks",
            "256",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["command"], "sim");
    let legs = v["legs"].as_array().unwrap();
    assert_eq!(legs.len(), 4); // shared/local × G = 1, 8
    for l in legs {
        let hit = l["followup_hit"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit));
    }
}

#[test]
fn trace_in_process_json_parses() {
    let dir = std::env::temp_dir().join(format!("kvix-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 5, \"input_length\": 1536, \"output_length\": 4, \"hash_ids\": [0, 1, 2]}\n\
         {\"timestamp\": 9, \"input_length\": 512, \"output_length\": 4, \"hash_ids\": [3]}\n",
    )
    .unwrap();
    let out = bench()
        .args([
            "trace",
            "--in-process",
            "--json",
            "--quiet",
            "--workers",
            "2",
            "--path",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["result"]["requests"], 3);
    // Request 2 reuses request 1's two blocks on the same worker: 2 of 6 blocks.
    let depth = v["result"]["hit_depth"].as_f64().unwrap();
    assert!((depth - 2.0 / 6.0).abs() < 1e-9, "{depth}");

    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n{oops\n",
    )
    .unwrap();
    let out = bench()
        .args(["trace", "--in-process", "--quiet", "--path"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_unreachable_server_is_an_error_line_not_a_panic() {
    // Nothing listens on port 1.
    for cmd in ["latency", "load"] {
        let out = bench()
            .args([cmd, "--server", "127.0.0.1:1", "--quiet"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("kvix-bench: "), "{cmd}: {err}");
        assert!(!err.contains("panicked"), "{cmd}: {err}");
    }
}
