//! Per-query latency distribution (p50 / p99 / p99.9) for the seed's shape, from a sorted
//! vector of individually timed queries. `cargo bench -p kvix-engine --bench latency`

mod common;

use std::hint::black_box;
use std::time::Instant;

use kvix_engine::Answer;

fn main() {
    // `cargo bench` passes `--bench`; anything else is ignored.
    let rounds = 20_000;
    {
        let (mut e, prompt) = common::fleet(20);
        let mut out = Answer::default();
        for _ in 0..2_000 {
            e.query_into(common::KS, &prompt, None, 0, false, &mut out);
        }
        let mut ns: Vec<u64> = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            e.query_into(common::KS, black_box(&prompt), None, 0, false, &mut out);
            ns.push(t.elapsed().as_nanos() as u64);
            black_box(&out);
        }
        ns.sort_unstable();
        let q = |f: f64| ns[((ns.len() as f64 * f) as usize).min(ns.len() - 1)] as f64 / 1000.0;
        println!(
            "query 1250 blocks x 240 workers: p50 {:.2} us  p99 {:.2} us  p99.9 {:.2} us  max {:.2} us  ({} scores)",
            q(0.50),
            q(0.99),
            q(0.999),
            *ns.last().unwrap() as f64 / 1000.0,
            out.scores.len()
        );
    }
}
