//! Query time for the seed's shape (1250-block prompt, 125 blocks held by 240 workers;
//! and those 125 blocks alone).
//! `cargo bench -p kvix-engine --bench query`

mod common;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvix_engine::Answer;

fn query(c: &mut Criterion) {
    {
        let (mut e, prompt) = common::fleet(20);
        let mut out = Answer::default();
        c.bench_function("query_1250x240", |b| {
            b.iter(|| {
                e.query_into(common::KS, black_box(&prompt), None, 0, false, &mut out);
                black_box(out.scores.len())
            })
        });
        // The shared prefix alone: every worker holds all of it.
        c.bench_function("query_125x240", |b| {
            b.iter(|| {
                e.query_into(
                    common::KS,
                    black_box(&prompt[..125]),
                    None,
                    0,
                    false,
                    &mut out,
                );
                black_box(out.scores.len())
            })
        });
        c.bench_function("query_1250x240_top8", |b| {
            b.iter(|| {
                e.query_into(common::KS, black_box(&prompt), None, 8, false, &mut out);
                black_box(out.scores.len())
            })
        });
    }
    // A miss: nothing of the prompt is held (one lookup per block).
    let (mut e, _) = common::fleet(20);
    let miss = common::chain(999_999, 1250);
    let mut out = Answer::default();
    c.bench_function("query_1250_miss", |b| {
        b.iter(|| {
            e.query_into(common::KS, black_box(&miss), None, 0, false, &mut out);
            black_box(out.scores.len())
        })
    });
}

criterion_group!(benches, query);
criterion_main!(benches);
