//! The Rust side of scripts/go-overhead.sh: blocking queries on command, timed in Rust.
//! Reads lines `N` from stdin; for each, runs N blocking `query_tokens` calls over the
//! prompts both sides derive alike (`prompt` below, client/go/cmd/overhead) and prints
//! their latencies in nanoseconds on one line. The Go side loads the server.
//!
//!     cargo run --release -p kvix-client --example blocking_rounds -- ADDR [BLOCKS] [WORKERS]

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use kvix_client::blocking::BlockingClient;
use kvix_client::wire::Keyspace;
use kvix_client::{Addr, ClientConfig, QueryOptions, QueryOutcome};

/// Worker w's prompt: the same token ids client/go/cmd/overhead places and queries.
fn prompt(w: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16)
        .map(|i| (w.wrapping_mul(1_000_003).wrapping_add(i.wrapping_mul(7919))) % (1 << 17))
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .expect("usage: blocking_rounds ADDR [BLOCKS] [WORKERS]");
    let blocks: u32 = args.get(1).map_or(125, |b| b.parse().expect("BLOCKS"));
    let workers: u32 = args.get(2).map_or(16, |w| w.parse().expect("WORKERS"));
    let mut cfg = ClientConfig::new([Addr::tcp(addr.as_str())]);
    cfg.name = "overhead-rust".into();
    cfg.deadline = Duration::from_millis(50);
    let client = BlockingClient::connect(cfg).expect("connect");
    assert!(
        client.wait_connected(Duration::from_secs(10)),
        "not connected"
    );
    let ks = Keyspace::tokens("overhead-bench");
    let prompts: Vec<Vec<u32>> = (0..workers).map(|w| prompt(w, blocks)).collect();
    let opts = QueryOptions::default();
    let stdout = std::io::stdout();
    let mut i = 0usize;
    for line in std::io::stdin().lock().lines() {
        let n: usize = line.expect("stdin").trim().parse().expect("a count");
        let mut out = String::new();
        for _ in 0..n {
            let p = &prompts[i % prompts.len()];
            i += 1;
            let t = Instant::now();
            let o = client.query_tokens(&ks, p, &opts);
            let took = t.elapsed().as_nanos();
            assert!(matches!(o, QueryOutcome::Scores(_)), "{}", o.kind());
            out += &format!("{took} ");
        }
        let mut lock = stdout.lock();
        writeln!(lock, "{}", out.trim_end()).unwrap();
        lock.flush().unwrap();
    }
}
