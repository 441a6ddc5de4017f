//! Table tests for the joint reuse rules and the feed rules, through [`Engine`].

use std::ops::Range;

use kvix_engine::{Engine, EngineError, Ks};
use kvix_wire::{chain::token_chain, ApplyStatus, Event, Feed, Lane, WorkerId};

const TB: u32 = 16;
const KS: Ks = Ks {
    seed: 0x1234_5678_9abc_def0,
    kind: kvix_wire::ChunkKind::Tokens,
};

fn chain(n: u32) -> Vec<u64> {
    let tokens: Vec<u32> = (0..n * TB).collect();
    token_chain(KS.seed, TB, &tokens)
}

fn lanes(spec: &[&str]) -> Vec<Lane> {
    spec.iter().map(|s| Lane::parse(s).unwrap()).collect()
}

fn store(lane: u8, r: Range<u32>, c: &[u64]) -> Event {
    Event::Stored {
        lane,
        start: r.start,
        parent: None,
        chain: c[r.start as usize..r.end as usize].to_vec(),
        engine: vec![],
    }
}

/// Score of one worker with roster `spec` holding `held` (lane, range), for `n` blocks;
/// also whether it counted as unscorable.
fn score(spec: &[&str], held: &[(u8, Range<u32>)], n: u32) -> (u32, u32) {
    let mut e = Engine::new(TB);
    let (w, _) = e.announce("w", &lanes(spec), Feed::Events).unwrap();
    let c = chain(24);
    let events: Vec<Event> = held.iter().map(|(l, r)| store(*l, r.clone(), &c)).collect();
    let report = e.apply(w, 0, KS, &events).unwrap();
    assert_eq!(report.events as usize, events.len(), "{report:?}");
    let a = e.query(KS, &c[..n as usize], None, 0, false);
    (a.scores.first().map_or(0, |s| s.1), a.unscorable)
}

#[test]
fn full_attention_needs_every_block_from_zero() {
    let full = ["full_attention@16"];
    assert_eq!(score(&full, &[(0, 0..10)], 10), (10, 0));
    assert_eq!(score(&full, &[(0, 0..10)], 7), (7, 0));
    assert_eq!(score(&full, &[(0, 0..4), (0, 5..10)], 10), (4, 0));
    assert_eq!(score(&full, &[(0, 2..10)], 10), (0, 1));
    assert_eq!(score(&["mla_attention@16"], &[(0, 0..3)], 10), (3, 0));
    // 32-token engine blocks: hits are even.
    assert_eq!(score(&["full_attention@32"], &[(0, 0..7)], 10), (6, 0));
}

#[test]
fn sliding_window_needs_the_blocks_covering_the_window() {
    // W = 33, b = 16: m = ceil(32 / 16) = 2 engine blocks before the hit.
    let swa = ["full_attention@16", "sliding_window:33@16"];
    assert_eq!(score(&swa, &[(0, 0..10), (1, 7..10)], 10), (10, 0));
    assert_eq!(score(&swa, &[(0, 0..10), (1, 8..10)], 10), (10, 0));
    assert_eq!(score(&swa, &[(0, 0..10), (1, 9..10)], 10), (0, 1));
    assert_eq!(score(&swa, &[(0, 0..10), (1, 4..6)], 10), (6, 0));
    // A window smaller than a block still needs one engine block.
    let small = ["full_attention@16", "sliding_window:5@16"];
    assert_eq!(score(&small, &[(0, 0..10), (1, 9..10)], 10), (10, 0));
    let one = ["full_attention@16", "sliding_window:1@16"];
    assert_eq!(score(&one, &[(0, 0..10), (1, 9..10)], 10), (10, 0));
    // A window larger than the held tail: m = ceil(99 / 16) = 7.
    let large = ["full_attention@16", "sliding_window:100@16"];
    assert_eq!(score(&large, &[(0, 0..10), (1, 3..10)], 10), (10, 0));
    assert_eq!(score(&large, &[(0, 0..10), (1, 4..10)], 10), (0, 1));
    // Near the start the window is cut at 0.
    assert_eq!(score(&large, &[(0, 0..3), (1, 0..3)], 10), (3, 0));
    // Engine block of 2 keyspace blocks: m = ceil(32 / 32) = 1 engine block = 2 blocks,
    // hits on even positions only.
    let wide = ["full_attention@16", "sliding_window:33@32"];
    assert_eq!(score(&wide, &[(0, 0..9), (1, 6..9)], 9), (8, 0));
    assert_eq!(score(&wide, &[(0, 0..9), (1, 7..9)], 9), (0, 1));
}

#[test]
fn chunked_local_needs_its_chunk_up_to_the_hit() {
    // C = 64 tokens = 4 keyspace blocks.
    let ch = ["full_attention@16", "chunked_local:64@16"];
    assert_eq!(score(&ch, &[(0, 0..10), (1, 8..10)], 10), (10, 0));
    assert_eq!(score(&ch, &[(0, 0..10), (1, 9..10)], 10), (8, 0));
    assert_eq!(score(&ch, &[(0, 0..8), (1, 7..8)], 10), (8, 0));
    assert_eq!(score(&ch, &[(0, 0..10), (1, 4..6)], 10), (8, 0));
    assert_eq!(score(&ch, &[(0, 0..10), (1, 4..7)], 7), (7, 0));
    assert_eq!(score(&ch, &[(0, 0..10), (1, 5..7)], 7), (4, 0));
    // No coverage at all on the chunked lane: only p = 0, though the literal
    // rule would accept chunk boundaries.
    assert_eq!(score(&ch, &[(0, 0..10)], 10), (0, 1));
}

#[test]
fn mamba_needs_a_state_exactly_at_the_hit_in_either_encoding() {
    let m = ["full_attention@16", "mamba@32"];
    // Whole engine block marked (both keyspace blocks) or only its last unit: same.
    assert_eq!(score(&m, &[(0, 0..10), (1, 8..10)], 10), (10, 0));
    assert_eq!(score(&m, &[(0, 0..10), (1, 9..10)], 10), (10, 0));
    assert_eq!(score(&m, &[(0, 0..10), (1, 4..6)], 10), (6, 0));
    assert_eq!(score(&m, &[(0, 0..10), (1, 5..6)], 10), (6, 0));
    // A mark on the first unit of an engine block ends at no candidate.
    assert_eq!(score(&m, &[(0, 0..10), (1, 6..7)], 10), (0, 1));
    // The full lane still caps it.
    assert_eq!(score(&m, &[(0, 0..5), (1, 8..10)], 10), (0, 1));
}

#[test]
fn mixed_rosters_take_the_largest_hit_all_lanes_accept() {
    let mix = ["full_attention@16", "sliding_window:33@16", "mamba@16"];
    let base = [(0, 0..12), (1, 6..12)];
    let with = |marks: &[u32]| {
        let mut h = base.to_vec();
        h.extend(marks.iter().map(|&m| (2u8, m..m + 1)));
        score(&mix, &h, 12)
    };
    assert_eq!(with(&[7, 11]), (12, 0));
    assert_eq!(with(&[7]), (8, 0));
    // The window does not reach back to a state at 3.
    assert_eq!(with(&[2]), (0, 1));
    // A lane absent from the query path is not "no constraint".
    assert_eq!(score(&mix, &base, 12), (0, 1));
    // lcm alignment: engine blocks of 2 and 3 keyspace blocks → hits at multiples of 6.
    let lcm = ["full_attention@32", "mamba@48"];
    assert_eq!(
        score(&lcm, &[(0, 0..11), (1, 5..6), (1, 9..10)], 11),
        (6, 0)
    );
    assert_eq!(score(&lcm, &[(0, 0..13), (1, 11..12)], 13), (12, 0));
}

#[test]
fn ranking_ties_top_k_candidates_and_unscorable() {
    let mut e = Engine::new(TB);
    let c = chain(10);
    let full = lanes(&["full_attention@16"]);
    let hybrid = lanes(&["full_attention@16", "mamba@16"]);
    let ids: Vec<WorkerId> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| {
            e.announce(n, if *n == "d" { &hybrid } else { &full }, Feed::Events)
                .unwrap()
                .0
        })
        .collect();
    for (w, end) in ids.iter().zip([6, 9, 6, 9]) {
        e.apply(*w, 0, KS, &[store(0, 0..end, &c)]).unwrap();
    }
    let a = e.query(KS, &c, None, 0, true);
    assert_eq!(a.scores, vec![(1, 9), (0, 6), (2, 6)]);
    assert_eq!(a.unscorable, 1); // d's mamba lane holds nothing
    assert_eq!(a.runs.len(), 4);
    assert_eq!(a.runs[3].lanes.len(), 2);
    assert!(a.runs[3].lanes[1].runs.is_empty());
    assert_eq!(e.query(KS, &c, None, 2, false).scores, vec![(1, 9), (0, 6)]);
    let only = e.query(KS, &c, Some(&[2, 3]), 0, false);
    assert_eq!((only.scores, only.unscorable), (vec![(2, 6)], 1));
    assert!(e.query(KS, &c, Some(&[]), 0, false).scores.is_empty());
    let wire = e.query(KS, &c, None, 1, false).to_wire();
    assert_eq!((wire.scores[0].worker, wire.scores[0].blocks), (1, 9));
}

#[test]
fn byte_keyspaces_refuse_lanes_but_score_plain_workers() {
    let mut e = Engine::new(TB);
    let bytes = Ks::bytes(0x77 << 32);
    let (plain, _) = e
        .announce("p", &lanes(&["full_attention@32"]), Feed::Events)
        .unwrap();
    let (hybrid, _) = e
        .announce(
            "h",
            &lanes(&["full_attention@16", "sliding_window:64@16"]),
            Feed::Events,
        )
        .unwrap();
    let c = token_chain(bytes.seed, 64, &(0..64 * 5).collect::<Vec<u32>>());
    let err = e
        .apply(hybrid, 0, bytes, &[store(0, 0..5, &c)])
        .unwrap_err();
    assert!(matches!(err, EngineError::LanesInByteKeyspace { .. }));
    assert!(err.to_string().contains("byte keyspace"), "{err}");
    // A plain worker's lane counts one chunk per block in a byte keyspace: odd hits score.
    e.apply(plain, 0, bytes, &[store(0, 0..5, &c)]).unwrap();
    assert_eq!(e.query(bytes, &c, None, 0, false).scores, vec![(plain, 5)]);
}

#[test]
fn sequences_skip_duplicates_and_report_gaps() {
    let mut e = Engine::new(TB);
    let (w, _) = e
        .announce("w", &lanes(&["full_attention@16"]), Feed::Events)
        .unwrap();
    let c = chain(6);
    assert_eq!(
        e.apply(w, 5, KS, &[store(0, 0..2, &c)]).unwrap().status,
        ApplyStatus::Applied
    );
    let dup = e.apply(w, 5, KS, &[store(0, 2..6, &c)]).unwrap();
    assert_eq!((dup.status, dup.events), (ApplyStatus::Duplicate, 0));
    assert_eq!(e.query(KS, &c, None, 0, false).scores, vec![(w, 2)]);
    let gap = e.apply(w, 8, KS, &[store(0, 2..4, &c)]).unwrap();
    assert_eq!(gap.status, ApplyStatus::Gap { expected: 6 });
    assert_eq!(e.query(KS, &c, None, 0, false).scores, vec![(w, 4)]);
    assert_eq!(
        e.apply::<Event>(w, 7, KS, &[]).unwrap().status,
        ApplyStatus::Duplicate
    );
    e.reset_sequence(w).unwrap();
    assert_eq!(
        e.apply::<Event>(w, 0, KS, &[]).unwrap().status,
        ApplyStatus::Applied
    );
}

#[test]
fn removal_by_engine_hash_drops_whole_engine_blocks() {
    let mut e = Engine::new(TB);
    let (w, _) = e
        .announce("w", &lanes(&["full_attention@64"]), Feed::Events)
        .unwrap();
    let c = chain(10);
    let stored = Event::Stored {
        lane: 0,
        start: 0,
        parent: None,
        chain: c.clone(),
        engine: vec![0xe0, 0xe1, 0xe2],
    };
    e.apply(w, 0, KS, &[stored]).unwrap();
    assert_eq!(e.stats().blocks, 10);
    // Engine block 2 covers the partial group [8, 10).
    let r = e
        .apply(
            w,
            1,
            KS,
            &[Event::Removed {
                lane: 0,
                hashes: vec![0xe2, 0xbad],
            }],
        )
        .unwrap();
    // 0xbad is no engine hash: taken as a chain hash, which no block has.
    assert_eq!(r.block_events, 3);
    assert_eq!(e.stats().blocks, 8);
    assert_eq!(e.query(KS, &c, None, 0, false).scores, vec![(w, 8)]);
    e.apply(
        w,
        2,
        KS,
        &[Event::Removed {
            lane: 0,
            hashes: vec![0xe1],
        }],
    )
    .unwrap();
    assert_eq!(e.query(KS, &c, None, 0, false).scores, vec![(w, 4)]);
    assert_eq!(e.stats().blocks, 4);
    // A wrong count of engine hashes refuses the whole batch, and its seq stays free.
    let bad = Event::Stored {
        lane: 0,
        start: 0,
        parent: None,
        chain: c.clone(),
        engine: vec![1],
    };
    let refused = e.apply(w, 3, KS, &[Event::Cleared, bad]).unwrap_err();
    assert!(
        matches!(
            refused,
            EngineError::Refused {
                seq: 3,
                index: 1,
                ..
            }
        ),
        "{refused}"
    );
    assert_eq!(e.stats().blocks, 4);
    e.apply(w, 3, KS, &[Event::Cleared]).unwrap();
    assert_eq!(e.stats().blocks, 0);
}

#[test]
fn placements_cut_oldest_then_deepest_and_expire() {
    let mut e = Engine::new(TB);
    let feed = Feed::Placements {
        capacity_blocks: 8,
        ttl_ms: 100,
    };
    let (w, _) = e
        .announce("g", &lanes(&["full_attention@16"]), feed)
        .unwrap();
    let a = chain(6);
    let b = token_chain(KS.seed, TB, &(1000..1000 + 5 * TB).collect::<Vec<u32>>());
    e.place(w, KS, &a, 0).unwrap();
    e.place(w, KS, &b, 50).unwrap();
    // 11 blocks placed into 8: a's three deepest are cut; its prefix stays whole.
    assert_eq!(e.query(KS, &a, None, 0, false).scores, vec![(w, 3)]);
    assert_eq!(e.query(KS, &b, None, 0, false).scores, vec![(w, 5)]);
    // Re-placing a refreshes its prefix, so b (now the oldest) loses its tail.
    e.place(w, KS, &a[..4], 60).unwrap();
    assert_eq!(e.query(KS, &b, None, 0, false).scores, vec![(w, 4)]);
    assert_eq!(e.stats().blocks, 8);
    // TTL: b was last placed at 50, a's prefix at 60.
    e.expire(155).unwrap();
    assert_eq!(e.query(KS, &b, None, 0, false).scores, vec![]);
    assert_eq!(e.query(KS, &a, None, 0, false).scores, vec![(w, 4)]);
    e.expire(161).unwrap();
    assert_eq!(e.stats().blocks, 0);
    // Placement and event feeds are not interchangeable.
    assert!(matches!(
        e.apply::<Event>(w, 0, KS, &[]),
        Err(EngineError::WrongFeed { .. })
    ));
}

/// A placement-fed worker whose engine lost its cache: what it holds goes, the feed
/// takes placements afresh, another worker keeps its own; an event-fed worker is not
/// touched (its events say what its engine holds).
#[test]
fn forgetting_a_workers_placements_drops_only_its_blocks() {
    let mut e = Engine::new(TB);
    let feed = Feed::Placements {
        capacity_blocks: 8,
        ttl_ms: 0,
    };
    let full = lanes(&["full_attention@16"]);
    let (w, _) = e.announce("g", &full, feed).unwrap();
    let (other, _) = e.announce("h", &full, feed).unwrap();
    let (fed, _) = e.announce("e", &full, Feed::Events).unwrap();
    let a = chain(6);
    e.place(w, KS, &a, 0).unwrap();
    e.place(other, KS, &a[..4], 0).unwrap();
    e.apply(fed, 0, KS, &[store(0, 0..2, &a)]).unwrap();
    e.forget_placements(w).unwrap();
    assert_eq!(
        e.query(KS, &a, None, 0, false).scores,
        vec![(other, 4), (fed, 2)]
    );
    e.place(w, KS, &a[..3], 10).unwrap();
    let now = vec![(other, 4), (w, 3), (fed, 2)];
    assert_eq!(e.query(KS, &a, None, 0, false).scores, now);
    assert!(matches!(
        e.forget_placements(fed),
        Err(EngineError::WrongFeed { .. })
    ));
    assert_eq!(e.query(KS, &a, None, 0, false).scores, now);
}

#[test]
fn announce_resets_only_on_change_and_retire_forgets() {
    let mut e = Engine::new(TB);
    let full = lanes(&["full_attention@16"]);
    let (w, _) = e.announce("w", &full, Feed::Events).unwrap();
    let c = chain(4);
    e.apply(w, 0, KS, &[store(0, 0..4, &c)]).unwrap();
    assert_eq!(e.announce("w", &full, Feed::Events).unwrap().0, w);
    assert_eq!(e.stats().blocks, 4);
    let hybrid = lanes(&["full_attention@16", "mamba@16"]);
    assert_eq!(e.announce("w", &hybrid, Feed::Events).unwrap().0, w);
    assert_eq!(e.stats().blocks, 0);
    e.apply(w, 0, KS, &[store(1, 0..4, &c)]).unwrap();
    e.retire(w).unwrap();
    assert_eq!((e.stats().blocks, e.stats().workers), (0, 0));
    assert!(matches!(e.retire(w), Err(EngineError::UnknownWorker(_))));
    assert!(matches!(
        e.place(9, KS, &c, 0),
        Err(EngineError::UnknownWorker(9))
    ));
    assert!(e.announce("x", &[], Feed::Events).is_err());
}
