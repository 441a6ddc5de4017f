//! Placement soak: a placement worker with a fixed capacity is fed many distinct
//! chains for many rounds; live heap bytes (counted, so deterministic) must stay flat.

#[path = "../benches/common/counting.rs"]
mod counting;

use kvix_engine::{Engine, Ks};
use kvix_wire::{chain::token_chain, Feed, Lane};

#[global_allocator]
static ALLOC: counting::Counting = counting::Counting;

const TB: u32 = 16;
/// Hash tables reach their steady size (one doubling caused by churn tombstones, at
/// most 2x the tight size) within the first ~60 rounds; flatness is judged after that.
const ROUNDS: u32 = 300;
const KS: Ks = Ks {
    seed: 0x0009_0000_0000_0001,
    kind: kvix_wire::ChunkKind::Tokens,
};

fn main() {
    soak("one keyspace", |_| KS);
    // Every request salted on its own (per-user cache salts): keyspaces come and go with
    // the blocks placed in them.
    soak("a keyspace per request", |request| Ks {
        seed: KS.seed ^ (u64::from(request) << 32),
        ..KS
    });
}

/// Places `ROUNDS` rounds of 64 requests, request `r` in keyspace `keyspace(r)`.
fn soak(what: &str, keyspace: impl Fn(u32) -> Ks) {
    let before = counting::live();
    let mut e = Engine::new(TB);
    let feed = Feed::Placements {
        capacity_blocks: 4096,
        ttl_ms: 0,
    };
    let (gw, _) = e.announce("gateway-view", &[Lane::full(TB)], feed).unwrap();
    let ttl = Feed::Placements {
        capacity_blocks: 1 << 20,
        ttl_ms: 500,
    };
    let (aged, _) = e.announce("aged-view", &[Lane::full(TB)], ttl).unwrap();
    let system: Vec<u32> = (0..16 * TB).collect();
    let mut tokens = Vec::new();
    let mut at = [0usize; 3];
    for round in 1..=ROUNDS {
        for i in 0..64u32 {
            // A shared 16-block system prompt, then 32 blocks unique to this request.
            tokens.clear();
            tokens.extend_from_slice(&system);
            tokens.extend((0..32 * TB).map(|t| (round * 64 + i) * 100_000 + t));
            let request = round * 64 + i;
            let ks = keyspace(request);
            let chain = token_chain(ks.seed, TB, &tokens);
            let now = request as u64;
            e.place(gw, ks, &chain, now).unwrap();
            e.place(aged, ks, &chain, now).unwrap();
        }
        e.expire((round * 64 + 63) as u64).unwrap();
        if std::env::var("SOAK_TRACE").is_ok() && round % 10 == 0 {
            let s = e.stats();
            println!(
                "round {round}: {} B, {} blocks, {} runs",
                counting::live(),
                s.blocks,
                s.runs
            );
        }
        match round {
            10 => at[0] = counting::live() - before,
            100 => at[1] = counting::live() - before,
            ROUNDS => at[2] = counting::live() - before,
            _ => {}
        }
    }
    let stats = e.stats();
    println!(
        "placement soak, {what}: {} B after round 10, {} B after round 100, {} B after round {ROUNDS} ({:.3}x of round 100), {} blocks held",
        at[0],
        at[1],
        at[2],
        at[2] as f64 / at[1] as f64,
        stats.blocks
    );
    assert!(
        (at[2] as f64) <= at[1] as f64 * 1.05,
        "{what}: placement memory grew at a flat block count: {} -> {} B",
        at[1],
        at[2]
    );
    assert!(
        at[2] <= at[0] * 2,
        "{what}: more than one table doubling: {at:?}"
    );
    e.check_invariants().unwrap();
}
