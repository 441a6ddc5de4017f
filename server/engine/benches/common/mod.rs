//! Shared bench fixtures.

#![allow(dead_code)]

use kvix_engine::{Engine, Ks};
use kvix_wire::{chain::token_chain, Event, Feed, Lane};

pub const TB: u32 = 16;
pub const KS: Ks = Ks {
    seed: 0x0003_0000_0000_0042,
    kind: kvix_wire::ChunkKind::Tokens,
};

/// A chain of `n` blocks whose tokens start at `salt` (distinct salts: distinct chains).
pub fn chain(salt: u32, n: u32) -> Vec<u64> {
    let tokens: Vec<u32> = (0..n * TB)
        .map(|t| salt.wrapping_mul(7919).wrapping_add(t))
        .collect();
    token_chain(KS.seed, TB, &tokens)
}

pub fn store(lane: u8, start: u32, chain: &[u64]) -> Event {
    Event::Stored {
        lane,
        start,
        parent: None,
        chain: chain.to_vec(),
        engine: vec![],
    }
}

/// The seed's shape: 240 plain workers; a 1250-block prompt whose first 125 blocks all
/// of them hold and whose rest 4 of them hold to various depths; plus `background`
/// distinct 100-block chains per worker so the maps have a realistic size.
pub fn fleet(background: u32) -> (Engine, Vec<u64>) {
    let mut e = Engine::new(TB);
    let prompt = chain(1, 1250);
    let full = [Lane::full(TB)];
    for w in 0..240u32 {
        let (id, _) = e
            .announce(&format!("worker-{w}"), &full, Feed::Events)
            .unwrap();
        let depth = match w {
            0 => 1250,
            1 => 1000,
            2 => 700,
            3 => 400,
            _ => 125,
        };
        let mut events = vec![store(0, 0, &prompt[..depth])];
        for b in 0..background {
            events.push(store(0, 0, &chain(10_000 + w * background + b, 100)));
        }
        e.apply(id, 0, KS, &events).unwrap();
    }
    (e, prompt)
}
