//! The fuzz target's seed corpus (wire/fuzz/seeds/frame): one valid frame of every
//! message kind, and a frame of the oldest version still read, kept equal to what this
//! version encodes. `KVIX_WRITE_SEEDS=1 cargo test
//! -p kvix-wire --test fuzz_seeds` rewrites them after a protocol change.

use std::path::PathBuf;

use kvix_wire::chain::token_chain;
use kvix_wire::*;

fn seeds() -> Vec<(&'static str, AlignedVec)> {
    let ks = Keyspace::tokens("meta-llama/Llama-3.1-8B");
    let chain = token_chain(ks.seed(16), 16, &(0..64).collect::<Vec<u32>>());
    let lanes = vec![
        Lane::full(16),
        Lane {
            kind: LaneKind::SlidingWindow { window: 64 },
            block_tokens: 32,
        },
    ];
    vec![
        (
            "hello",
            encode(
                &Hello {
                    client: "gw".into(),
                    token_block: 16,
                    auth: Some("t".into()),
                },
                1,
                0,
            ),
        ),
        (
            "welcome",
            encode(
                &Welcome {
                    server: "kvix".into(),
                    token_block: 16,
                    byte_chunk: 256,
                    shards: 2,
                    max_frame: 1 << 22,
                },
                1,
                0,
            ),
        ),
        (
            "query",
            encode(
                &Query {
                    keyspace: ks.clone(),
                    chain: chain.clone(),
                    candidates: vec![1],
                    top_k: 4,
                    want_runs: true,
                },
                2,
                0,
            ),
        ),
        (
            "query_v4",
            encode_in_version(
                &Query {
                    keyspace: ks.clone(),
                    chain: chain.clone(),
                    candidates: vec![],
                    top_k: 0,
                    want_runs: false,
                },
                OLDEST_VERSION,
                2,
                0,
                AlignedVec::new(),
            ),
        ),
        (
            "tiered_query",
            encode(
                &TieredQuery {
                    keyspace: ks.clone(),
                    chain: chain.clone(),
                    candidates: vec![1],
                    top_k: 4,
                    want_runs: true,
                    weights: TierWeights::DYNAMO,
                },
                11,
                0,
            ),
        ),
        (
            "tiered_answer",
            encode(
                &TieredAnswer {
                    scores: vec![TieredScore {
                        worker: 1,
                        tiers: Depths {
                            gpu: 1,
                            cpu: 2,
                            storage: 3,
                        },
                        suspect: Some(SuspectCause::EventsMissing),
                    }],
                    runs: vec![WorkerRuns {
                        worker: 1,
                        lanes: vec![LaneRuns {
                            lane: 0,
                            runs: vec![Run { start: 0, end: 3 }],
                        }],
                    }],
                    stale: true,
                    ..Default::default()
                },
                11,
                0,
            ),
        ),
        (
            "reuse_report",
            encode(
                &ReuseReport {
                    reports: vec![Reuse {
                        worker: 1,
                        model: "meta-llama/Llama-3.1-8B".into(),
                        predicted_tokens: Some(48),
                        cached_tokens: 32,
                        prompt_tokens: 64,
                    }],
                },
                12,
                FLAG_NO_REPLY,
            ),
        ),
        (
            "answer",
            encode(
                &Answer {
                    scores: vec![Score {
                        worker: 1,
                        blocks: 3,
                    }],
                    ..Default::default()
                },
                2,
                0,
            ),
        ),
        (
            "announce",
            encode(
                &Announce {
                    name: "w".into(),
                    lanes,
                    feed: Feed::Events,
                    source: Some(EventSource {
                        endpoint: "tcp://127.0.0.1:5557".into(),
                        replay: String::new(),
                        model: "m".into(),
                        salt: String::new(),
                    }),
                },
                3,
                0,
            ),
        ),
        (
            "announced",
            encode(
                &Announced {
                    worker: 1,
                    created: true,
                },
                3,
                0,
            ),
        ),
        ("retire", encode(&Retire { worker: 1 }, 4, 0)),
        (
            "event_batch",
            encode(
                &EventBatch {
                    worker: 1,
                    seq: 0,
                    keyspace: ks.clone(),
                    events: vec![
                        Event::Stored {
                            lane: 0,
                            start: 0,
                            parent: None,
                            chain: chain.clone(),
                            engine: vec![],
                        },
                        Event::Removed {
                            lane: 0,
                            hashes: vec![9],
                        },
                        Event::Cleared,
                        Event::StoredIn {
                            tier: Tier::Cpu,
                            lane: 0,
                            start: 1,
                            parent: Some(chain[0]),
                            chain: chain[1..].to_vec(),
                            engine: vec![],
                        },
                        Event::RemovedFrom {
                            tier: Tier::Gpu,
                            lane: 0,
                            hashes: vec![chain[0]],
                        },
                    ],
                },
                5,
                0,
            ),
        ),
        (
            "applied",
            encode(
                &Applied {
                    seq: 0,
                    status: ApplyStatus::Gap { expected: 3 },
                },
                5,
                0,
            ),
        ),
        (
            "placement",
            encode(
                &Placement {
                    worker: 1,
                    keyspace: ks,
                    chain,
                },
                6,
                FLAG_NO_REPLY,
            ),
        ),
        ("stats_request", encode(&StatsRequest {}, 7, 0)),
        (
            "stats",
            encode(
                &Stats {
                    workers: 1,
                    shard_load: vec![1, 2],
                    ..Default::default()
                },
                7,
                0,
            ),
        ),
        (
            "echo",
            encode(
                &Echo {
                    payload: vec![1, 2, 3],
                    reply_len: 16,
                },
                8,
                0,
            ),
        ),
        ("ack", encode(&Ack {}, 8, 0)),
        (
            "roster_request",
            encode(
                &RosterRequest {
                    from: 3,
                    names: vec!["w-7".into()],
                },
                10,
                0,
            ),
        ),
        (
            "roster",
            encode(
                &Roster {
                    workers: vec![RosterEntry {
                        worker: 7,
                        name: "w-7".into(),
                    }],
                    next: 9,
                    more: false,
                    reissued: 1,
                },
                10,
                0,
            ),
        ),
        (
            "error_reply",
            encode(
                &ErrorReply {
                    code: ErrorCode::BadSequence,
                    message: "why".into(),
                },
                9,
                0,
            ),
        ),
    ]
    .into_iter()
    .map(|(name, frame)| (name, frame.expect("encodes")))
    .collect()
}

#[test]
fn the_seed_corpus_has_one_current_frame_of_every_kind() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/frame");
    let seeds = seeds();
    let mut kinds: Vec<Kind> = seeds
        .iter()
        .map(|(_, f)| split_frame(f, DEFAULT_MAX_FRAME).unwrap().unwrap().kind)
        .collect();
    kinds.sort_by_key(|k| *k as u8);
    kinds.dedup();
    assert_eq!(
        kinds.len(),
        (0..=255u8)
            .filter(|b| Kind::from_byte(*b).is_some())
            .count()
    );
    if std::env::var("KVIX_WRITE_SEEDS").is_ok() {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, frame) in &seeds {
            std::fs::write(dir.join(name), &frame[..]).unwrap();
        }
    }
    for (name, frame) in &seeds {
        let on_disk = std::fs::read(dir.join(name))
            .unwrap_or_else(|e| panic!("seed {name}: {e} (KVIX_WRITE_SEEDS=1 writes them)"));
        assert_eq!(
            on_disk,
            &frame[..],
            "seed {name} is stale (KVIX_WRITE_SEEDS=1 rewrites it)"
        );
    }
}
