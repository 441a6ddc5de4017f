//! Every message survives encode → split → validate → native unchanged, alone and
//! pipelined in one buffer, in every protocol version that has its kind; random and
//! mutated bytes never panic the decoder; the header's version is checked.

use kvix_wire::*;
use proptest::collection::vec;
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    "[a-z0-9/_.-]{0,24}"
}

fn keyspace() -> impl Strategy<Value = Keyspace> {
    (text(), text(), text(), any::<bool>()).prop_map(|(model, lora, salt, bytes)| Keyspace {
        model,
        lora,
        salt,
        kind: if bytes {
            ChunkKind::Bytes
        } else {
            ChunkKind::Tokens
        },
    })
}

fn lane() -> impl Strategy<Value = Lane> {
    let kind = prop_oneof![
        Just(LaneKind::FullAttention),
        Just(LaneKind::MlaAttention),
        (1u32..1 << 20).prop_map(|window| LaneKind::SlidingWindow { window }),
        (1u32..1 << 20).prop_map(|chunk| LaneKind::ChunkedLocal { chunk }),
        Just(LaneKind::Mamba),
    ];
    (kind, 1u32..4096).prop_map(|(kind, block_tokens)| Lane { kind, block_tokens })
}

fn run() -> impl Strategy<Value = Run> {
    (any::<u32>(), any::<u32>()).prop_map(|(start, end)| Run { start, end })
}

fn feed() -> impl Strategy<Value = Feed> {
    prop_oneof![
        Just(Feed::Events),
        (any::<u64>(), any::<u64>()).prop_map(|(capacity_blocks, ttl_ms)| Feed::Placements {
            capacity_blocks,
            ttl_ms
        }),
    ]
}

fn tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(Tier::ALL.to_vec())
}

/// Any f32 but NaN (which is not equal to itself, so cannot be compared after a round
/// trip; `tier_weights_travel_bit_for_bit` sends NaN). Out-of-range weights are valid
/// on the wire: the server refuses them.
fn weight() -> impl Strategy<Value = f32> {
    use prop::num::f32;
    prop_oneof![
        0.0f32..=1.0,
        f32::POSITIVE | f32::NEGATIVE | f32::NORMAL | f32::SUBNORMAL | f32::ZERO | f32::INFINITE,
    ]
}

fn tier_weights() -> impl Strategy<Value = TierWeights> {
    (weight(), weight()).prop_map(|(cpu, storage)| TierWeights { cpu, storage })
}

fn depths() -> impl Strategy<Value = Depths> {
    // The wire does not enforce gpu <= cpu <= storage; the server always sends it so.
    (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(gpu, cpu, storage)| Depths {
        gpu,
        cpu,
        storage,
    })
}

fn suspect_cause() -> impl Strategy<Value = SuspectCause> {
    prop::sample::select(vec![
        SuspectCause::GatewayTokenization,
        SuspectCause::EventsMissing,
        SuspectCause::EventsLagging,
        SuspectCause::Undercounted,
    ])
}

fn worker_runs() -> impl Strategy<Value = WorkerRuns> {
    (
        any::<u32>(),
        vec(
            (any::<u8>(), vec(run(), 0..5)).prop_map(|(lane, runs)| LaneRuns { lane, runs }),
            0..4,
        ),
    )
        .prop_map(|(worker, lanes)| WorkerRuns { worker, lanes })
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (
            any::<u8>(),
            any::<u32>(),
            any::<Option<u64>>(),
            vec(any::<u64>(), 0..40),
            vec(any::<u64>(), 0..10)
        )
            .prop_map(|(lane, start, parent, chain, engine)| Event::Stored {
                lane,
                start,
                parent,
                chain,
                engine
            }),
        (any::<u8>(), vec(any::<u64>(), 0..40))
            .prop_map(|(lane, hashes)| Event::Removed { lane, hashes }),
        Just(Event::Cleared),
        (
            tier(),
            any::<u8>(),
            any::<u32>(),
            any::<Option<u64>>(),
            vec(any::<u64>(), 0..40),
            vec(any::<u64>(), 0..10)
        )
            .prop_map(
                |(tier, lane, start, parent, chain, engine)| Event::StoredIn {
                    tier,
                    lane,
                    start,
                    parent,
                    chain,
                    engine
                }
            ),
        (tier(), any::<u8>(), vec(any::<u64>(), 0..40))
            .prop_map(|(tier, lane, hashes)| Event::RemovedFrom { tier, lane, hashes }),
    ]
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    prop::sample::select(ErrorCode::ALL.to_vec())
}

/// Encodes `msg` (by default, then in every version the reader reads), finds it again
/// in the buffer, validates it and compares the copy; a version older than its kind
/// cannot be written.
fn round_trip<M: Body + PartialEq + std::fmt::Debug>(msg: &M, id: u64, flags: u8) {
    let default = encode(msg, id, flags).expect("encodes");
    assert_eq!(
        split_frame(&default, DEFAULT_MAX_FRAME)
            .unwrap()
            .unwrap()
            .header
            .version,
        PROTOCOL_VERSION,
        "encode writes the newest version"
    );
    for version in OLDEST_VERSION..=PROTOCOL_VERSION {
        let encoded = encode_in_version(msg, version, id, flags, AlignedVec::new());
        if version < M::KIND.since() {
            assert!(
                matches!(encoded, Err(EncodeError::TooNew { since, version: v, .. })
                    if since == M::KIND.since() && v == version),
                "{} written in version {version}",
                M::KIND.name()
            );
            continue;
        }
        let buf = encoded.expect("encodes");
        if version == PROTOCOL_VERSION {
            assert_eq!(&buf[..], &default[..]);
        } else {
            // Versions differ in the header's version bytes only.
            assert_eq!(buf[6..], default[6..]);
        }
        round_trip_frame(msg, &buf, version, id, flags);
    }
}

fn round_trip_frame<M: Body + PartialEq + std::fmt::Debug>(
    msg: &M,
    buf: &AlignedVec,
    version: u16,
    id: u64,
    flags: u8,
) {
    assert_eq!(buf.len() % 8, 0, "frames end on 8-byte boundaries");
    let frame = split_frame(buf, DEFAULT_MAX_FRAME)
        .expect("valid")
        .expect("whole");
    assert_eq!(frame.len, buf.len());
    assert_eq!(frame.kind, M::KIND);
    assert_eq!(frame.header.version, version);
    assert_eq!(frame.header.request_id, id);
    assert_eq!(frame.header.flags, flags);
    let archived = codec::access::<M>(frame.body).expect("body validates");
    assert_eq!(&to_native::<M>(archived), msg);
    assert_eq!(frame.message().expect("view").kind(), M::KIND);
    // Every strict prefix is "need more bytes", never an error or a panic.
    for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, buf.len() - 1] {
        assert!(
            split_frame(&buf[..cut.min(buf.len() - 1)], DEFAULT_MAX_FRAME)
                .unwrap()
                .is_none()
        );
    }
}

macro_rules! round_trip_props {
    ($($test:ident: $strategy:expr;)*) => {
        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            $(
                #[test]
                fn $test(msg in $strategy, id in any::<u64>(), no_reply in any::<bool>()) {
                    round_trip(&msg, id, if no_reply { FLAG_NO_REPLY } else { 0 });
                }
            )*
        }
    };
}

round_trip_props! {
    hello: (text(), any::<u32>(), prop::option::of(text()))
        .prop_map(|(client, token_block, auth)| Hello { client, token_block, auth });
    welcome: (text(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>())
        .prop_map(|(server, token_block, byte_chunk, shards, max_frame)| Welcome { server, token_block, byte_chunk, shards, max_frame });
    query: (keyspace(), vec(any::<u64>(), 0..300), vec(any::<u32>(), 0..20), any::<u32>(), any::<bool>())
        .prop_map(|(keyspace, chain, candidates, top_k, want_runs)| Query { keyspace, chain, candidates, top_k, want_runs });
    answer: (
        vec((any::<u32>(), any::<u32>()).prop_map(|(worker, blocks)| Score { worker, blocks }), 0..50),
        any::<u32>(),
        vec(worker_runs(), 0..6),
        vec(any::<u32>(), 0..6),
        any::<u32>(),
    ).prop_map(|(scores, unscorable, runs, history_lost, reissued)| Answer { scores, unscorable, runs, history_lost, reissued });
    announce: (text(), vec(lane(), 0..6), feed(), prop::option::of((text(), text(), text(), text())))
        .prop_map(|(name, lanes, feed, source)| Announce {
            name, lanes, feed,
            source: source.map(|(endpoint, replay, model, salt)| EventSource { endpoint, replay, model, salt }),
        });
    announced: (any::<u32>(), any::<bool>()).prop_map(|(worker, created)| Announced { worker, created });
    retire: any::<u32>().prop_map(|worker| Retire { worker });
    event_batch: (any::<u32>(), any::<u64>(), keyspace(), vec(event(), 0..8))
        .prop_map(|(worker, seq, keyspace, events)| EventBatch { worker, seq, keyspace, events });
    applied: (any::<u64>(), prop_oneof![
        Just(ApplyStatus::Applied), Just(ApplyStatus::Duplicate), any::<u64>().prop_map(|expected| ApplyStatus::Gap { expected })
    ]).prop_map(|(seq, status)| Applied { seq, status });
    placement: (any::<u32>(), keyspace(), vec(any::<u64>(), 0..300))
        .prop_map(|(worker, keyspace, chain)| Placement { worker, keyspace, chain });
    stats_request: Just(StatsRequest {});
    stats: (any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), vec(any::<u64>(), 0..16))
        .prop_map(|(workers, blocks, memberships, queries, events, shard_load)| Stats { workers, blocks, memberships, queries, events, shard_load });
    echo: (vec(any::<u8>(), 0..600), any::<u32>()).prop_map(|(payload, reply_len)| Echo { payload, reply_len });
    ack: Just(Ack {});
    roster_request: (any::<u32>(), vec(text(), 0..5)).prop_map(|(from, names)| RosterRequest { from, names });
    roster: (vec((any::<u32>(), text()).prop_map(|(worker, name)| RosterEntry { worker, name }), 0..20), any::<u32>(), any::<bool>(), any::<u32>())
        .prop_map(|(workers, next, more, reissued)| Roster { workers, next, more, reissued });
    error_reply: (error_code(), text()).prop_map(|(code, message)| ErrorReply { code, message });
    tiered_query: (keyspace(), vec(any::<u64>(), 0..300), vec(any::<u32>(), 0..20), any::<u32>(), any::<bool>(), tier_weights())
        .prop_map(|(keyspace, chain, candidates, top_k, want_runs, weights)| TieredQuery { keyspace, chain, candidates, top_k, want_runs, weights });
    tiered_answer: (
        vec((any::<u32>(), depths(), prop::option::of(suspect_cause()))
            .prop_map(|(worker, tiers, suspect)| TieredScore { worker, tiers, suspect }), 0..50),
        any::<u32>(),
        vec(worker_runs(), 0..6),
        vec(any::<u32>(), 0..6),
        any::<u32>(),
        any::<bool>(),
    ).prop_map(|(scores, unscorable, runs, history_lost, reissued, stale)| TieredAnswer { scores, unscorable, runs, history_lost, reissued, stale });
    reuse_report: vec(
        (any::<u32>(), text(), any::<Option<u32>>(), any::<u32>(), any::<u32>())
            .prop_map(|(worker, model, predicted_tokens, cached_tokens, prompt_tokens)| Reuse { worker, model, predicted_tokens, cached_tokens, prompt_tokens }),
        0..20,
    ).prop_map(|reports| ReuseReport { reports });
}

fn drain(buf: &[u8]) {
    let _ = codec::validate_stream(buf, 1 << 16);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..512)) {
        drain(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(
        chain in vec(any::<u64>(), 0..64),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        truncate in any::<prop::sample::Index>(),
    ) {
        let q = Query { keyspace: Keyspace::tokens("m"), chain, candidates: vec![1, 2], top_k: 3, want_runs: true };
        let mut buf = encode(&q, 9, 0).unwrap().to_vec();
        buf.extend_from_slice(&encode(&Ack {}, 10, 0).unwrap());
        for (at, x) in flips {
            let i = at.index(buf.len());
            buf[i] ^= x;
        }
        let cut = truncate.index(buf.len() + 1);
        drain(&buf[..cut]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The write-side bodies (event batches with every event kind, announces with lanes
    /// and sources), bit-flipped in place: validated or refused, never a panic, and what
    /// validates also converts.
    #[test]
    fn mutated_event_batches_and_announces_never_panic(
        chain in vec(any::<u64>(), 0..32),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        announce in any::<bool>(),
    ) {
        let buf = if announce {
            encode(&Announce {
                name: "worker-0".into(),
                lanes: vec![Lane::full(16), Lane { kind: LaneKind::SlidingWindow { window: 64 }, block_tokens: 32 }],
                feed: Feed::Placements { capacity_blocks: 9, ttl_ms: 3 },
                source: Some(EventSource {
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay: "tcp://127.0.0.1:5558".into(),
                    model: "m".into(),
                    salt: "s".into(),
                }),
            }, 5, 0)
        } else {
            encode(&EventBatch {
                worker: 3,
                seq: 7,
                keyspace: Keyspace::tokens("m"),
                events: vec![
                    Event::Stored { lane: 0, start: 2, parent: Some(1), chain: chain.clone(), engine: chain.clone() },
                    Event::Removed { lane: 1, hashes: chain.clone() },
                    Event::Cleared,
                    Event::StoredIn { tier: Tier::Cpu, lane: 1, start: 0, parent: None, chain: chain.clone(), engine: vec![] },
                    Event::RemovedFrom { tier: Tier::Storage, lane: 0, hashes: chain.clone() },
                ],
            }, 6, 0)
        };
        let mut buf = buf.unwrap().to_vec();
        for (at, x) in flips {
            let i = at.index(buf.len());
            buf[i] ^= x;
        }
        if let Ok(Some(frame)) = split_frame(&buf, DEFAULT_MAX_FRAME) {
            match frame.message() {
                Ok(MessageRef::Announce(a)) => drop(to_native::<Announce>(a)),
                Ok(MessageRef::EventBatch(b)) => drop(to_native::<EventBatch>(b)),
                Ok(_) | Err(_) => {}
            }
        }
    }

    /// The version 5 bodies (tiered queries and answers with every option set, reuse
    /// reports), bit-flipped in place, header included: validated or refused, never a
    /// panic, and what validates also converts.
    #[test]
    fn mutated_tiered_bodies_never_panic(
        chain in vec(any::<u64>(), 0..32),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        which in 0..3u8,
    ) {
        let buf = match which {
            0 => encode(&TieredQuery {
                keyspace: Keyspace::tokens("m"),
                chain,
                candidates: vec![1, 2],
                top_k: 3,
                want_runs: true,
                weights: TierWeights::DYNAMO,
            }, 7, 0),
            1 => encode(&TieredAnswer {
                scores: vec![
                    TieredScore { worker: 1, tiers: Depths { gpu: 1, cpu: 2, storage: 3 }, suspect: Some(SuspectCause::EventsLagging) },
                    TieredScore { worker: 2, tiers: Depths::gpu_only(2), suspect: None },
                ],
                unscorable: 1,
                runs: vec![WorkerRuns { worker: 1, lanes: vec![LaneRuns { lane: 0, runs: vec![Run { start: 0, end: 3 }] }] }],
                history_lost: vec![2],
                reissued: 1,
                stale: true,
            }, 7, 0),
            _ => encode(&ReuseReport {
                reports: vec![
                    Reuse { worker: 1, model: "meta-llama/Llama-3.1-8B".into(), predicted_tokens: Some(32), cached_tokens: 16, prompt_tokens: 40 },
                    Reuse { worker: 2, model: "m".into(), predicted_tokens: None, cached_tokens: 0, prompt_tokens: chain.len() as u32 },
                ],
            }, 7, FLAG_NO_REPLY),
        };
        let mut buf = buf.unwrap().to_vec();
        for (at, x) in flips {
            let i = at.index(buf.len());
            buf[i] ^= x;
        }
        let mut aligned = AlignedVec::new();
        aligned.extend_from_slice(&buf);
        if let Ok(Some(frame)) = split_frame(&aligned, DEFAULT_MAX_FRAME) {
            prop_assert!(frame.header.version >= frame.kind.since());
            match frame.message() {
                Ok(MessageRef::TieredQuery(q)) => drop(to_native::<TieredQuery>(q)),
                Ok(MessageRef::TieredAnswer(a)) => drop(to_native::<TieredAnswer>(a)),
                Ok(MessageRef::ReuseReport(r)) => drop(to_native::<ReuseReport>(r)),
                Ok(_) | Err(_) => {}
            }
        }
    }
}

#[test]
fn pipelined_frames_are_found_in_order() {
    let mut buf = AlignedVec::new();
    for id in 0..5u64 {
        buf = encode_into(&Retire { worker: id as u32 }, id, 0, buf).unwrap();
        buf = encode_into(
            &Echo {
                payload: vec![7; id as usize * 3],
                reply_len: 1,
            },
            100 + id,
            0,
            buf,
        )
        .unwrap();
    }
    assert_eq!(codec::validate_stream(&buf, DEFAULT_MAX_FRAME), Ok(10));
    let mut at = 0;
    let mut ids = Vec::new();
    while let Some(f) = split_frame(&buf[at..], DEFAULT_MAX_FRAME).unwrap() {
        f.message()
            .expect("each pipelined body is aligned and valid");
        ids.push(f.header.request_id);
        at += f.len;
    }
    assert_eq!(ids, vec![0, 100, 1, 101, 2, 102, 3, 103, 4, 104]);
    assert_eq!(at, buf.len());
}

#[test]
fn header_errors_are_typed() {
    let good = encode(&Ack {}, 1, 0).unwrap().to_vec();
    let check = |mutate: &dyn Fn(&mut Vec<u8>), max: u32| {
        let mut b = AlignedVec::new();
        let mut v = good.clone();
        mutate(&mut v);
        b.extend_from_slice(&v);
        split_frame(&b, max).map(|f| f.map(|f| f.kind))
    };
    assert!(matches!(
        check(&|v| v[0] = b'X', 1024),
        Err(FrameError::BadMagic(_))
    ));
    assert_eq!(
        check(&|v| v[4] = 9, 1024).unwrap_err(),
        FrameError::UnsupportedVersion(9)
    );
    assert_eq!(
        check(&|v| v[6] = 200, 1024).unwrap_err(),
        FrameError::UnknownKind(200)
    );
    assert_eq!(
        check(&|v| v[7] = 0x80, 1024).unwrap_err(),
        FrameError::UnknownFlags(0x80)
    );
    assert_eq!(
        check(&|v| v[20] = 1, 1024).unwrap_err(),
        FrameError::Reserved(1)
    );
    assert!(matches!(
        check(
            &|v| v[16..20].copy_from_slice(&1_000_000u32.to_le_bytes()),
            1024
        ),
        Err(FrameError::Oversize { .. })
    ));
    assert!(matches!(
        check(&|_| {}, 8),
        Err(FrameError::Oversize { .. })
    ));
    assert_eq!(check(&|_| {}, 1024).unwrap(), Some(Kind::Ack));
}

#[test]
fn a_body_of_the_wrong_kind_is_refused_not_misread() {
    let mut buf = encode(
        &Query {
            chain: vec![1, 2, 3],
            ..Default::default()
        },
        1,
        0,
    )
    .unwrap();
    buf[6] = Kind::Welcome as u8;
    let frame = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
    assert!(matches!(
        frame.message(),
        Err(FrameError::InvalidBody {
            kind: "Welcome",
            ..
        })
    ));
}

#[test]
fn misaligned_bodies_are_reported() {
    let frame = encode(&Retire { worker: 3 }, 1, 0).unwrap();
    let mut shifted = AlignedVec::new();
    shifted.push(0);
    shifted.extend_from_slice(&frame);
    let f = split_frame(&shifted[1..], DEFAULT_MAX_FRAME)
        .unwrap()
        .unwrap();
    assert_eq!(f.message().unwrap_err(), FrameError::Misaligned);
}

#[test]
fn chains_read_in_place_match_the_sent_hashes() {
    let chain: Vec<u64> = (0..100u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let buf = encode(
        &Placement {
            worker: 1,
            keyspace: Keyspace::tokens("m"),
            chain: chain.clone(),
        },
        1,
        0,
    )
    .unwrap();
    let f = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
    let MessageRef::Placement(p) = f.message().unwrap() else {
        panic!("kind")
    };
    assert_eq!(u64s(&p.chain), &chain[..]);
}

#[test]
fn a_body_that_does_not_validate_says_why() {
    let buf = encode(
        &Announce {
            name: "worker-with-a-long-name".into(),
            lanes: vec![Lane::full(16)],
            feed: Feed::Events,
            source: None,
        },
        9,
        0,
    )
    .unwrap();
    // The root sits at the end of the body: set each of its bytes to 0xff in turn.
    let body_len = u32::from_le_bytes(buf[16..20].try_into().unwrap()) as usize;
    let root = HEADER_LEN + body_len - std::mem::size_of::<ArchivedAnnounce>();
    let mut refused = 0;
    for at in root..HEADER_LEN + body_len {
        let mut bad = buf.clone();
        bad[at] = 0xff;
        let frame = split_frame(&bad, DEFAULT_MAX_FRAME).unwrap().unwrap();
        if let Err(e) = frame.message() {
            let e = e.to_string();
            assert!(e.starts_with("invalid Announce body: "), "{e}");
            assert!(!e.contains("without error information"), "{e}");
            refused += 1;
        }
    }
    assert!(refused > 0, "some byte of the root must matter");
}

/// A frame of `msg` whose header says `version` (written over a version 5 encoding).
fn with_version<M: Body>(msg: &M, version: u16) -> AlignedVec {
    let mut buf = encode(msg, 1, 0).unwrap();
    buf[4..6].copy_from_slice(&version.to_le_bytes());
    buf
}

#[test]
fn a_version_5_kind_in_a_version_4_header_is_refused() {
    let frames = [
        (Kind::TieredQuery, with_version(&TieredQuery::default(), 4)),
        (
            Kind::TieredAnswer,
            with_version(&TieredAnswer::default(), 4),
        ),
        (Kind::ReuseReport, with_version(&ReuseReport::default(), 4)),
    ];
    for (kind, buf) in frames {
        let refused = FrameError::KindTooNew {
            kind: kind as u8,
            since: 5,
            version: 4,
        };
        assert_eq!(split_frame(&buf, DEFAULT_MAX_FRAME).unwrap_err(), refused);
        // Refused from the header alone, before the body is buffered.
        assert_eq!(
            split_frame(&buf[..HEADER_LEN], DEFAULT_MAX_FRAME).unwrap_err(),
            refused
        );
        assert_eq!(
            codec::validate_stream(&buf, DEFAULT_MAX_FRAME),
            Err(refused)
        );
        // The same frame in version 5 reads.
        let mut v5 = buf.clone();
        v5[4] = 5;
        assert_eq!(
            split_frame(&v5, DEFAULT_MAX_FRAME).unwrap().unwrap().kind,
            kind
        );
    }
    // Every kind is new in 4 or 5, and only 18..=20 in 5.
    for b in 0..=255u8 {
        if let Some(kind) = Kind::from_byte(b) {
            assert_eq!(kind.since(), if (18..=20).contains(&b) { 5 } else { 4 });
        }
    }
}

#[test]
fn versions_outside_4_to_5_are_refused() {
    for version in [0, 1, 2, 3, 6, 7, 0x0500, u16::MAX] {
        for buf in [
            with_version(&Ack {}, version),
            with_version(&Query::default(), version),
            with_version(&TieredQuery::default(), version),
        ] {
            assert_eq!(
                split_frame(&buf, DEFAULT_MAX_FRAME).unwrap_err(),
                FrameError::UnsupportedVersion(version),
                "version {version}"
            );
        }
    }
}

#[test]
fn a_version_4_frame_of_a_version_4_kind_reads() {
    let query = Query {
        keyspace: Keyspace::tokens("m"),
        chain: vec![1, 2, 3],
        candidates: vec![7],
        top_k: 2,
        want_runs: true,
    };
    let buf = encode_in_version(&query, 4, 11, FLAG_NO_REPLY, AlignedVec::new()).unwrap();
    assert_eq!(&buf[4..6], &[4, 0]);
    let frame = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
    assert_eq!(frame.header.version, 4);
    assert_eq!(frame.header.request_id, 11);
    assert!(!frame.header.wants_reply());
    let MessageRef::Query(q) = frame.message().unwrap() else {
        panic!("kind")
    };
    assert_eq!(to_native::<Query>(q), query);
    // Pipelined with version 5 frames, each keeps its own version.
    let mut stream = encode(&Retire { worker: 1 }, 1, 0).unwrap();
    stream = encode_into(&Echo::default(), 2, 0, stream).unwrap();
    stream.extend_from_slice(&buf);
    stream = encode_into(&TieredQuery::default(), 3, 0, stream).unwrap();
    let (mut at, mut versions) = (0, vec![]);
    while let Some(f) = split_frame(&stream[at..], DEFAULT_MAX_FRAME).unwrap() {
        f.message().unwrap();
        versions.push((f.header.request_id, f.header.version));
        at += f.len;
    }
    assert_eq!(versions, [(1, 5), (2, 5), (11, 4), (3, 5)]);
}

#[test]
fn a_version_5_kind_cannot_be_encoded_in_version_4() {
    let too_new = |e: Result<AlignedVec, EncodeError>| match e {
        Err(EncodeError::TooNew {
            kind,
            since,
            version,
        }) => (kind, since, version),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        too_new(encode_in_version(
            &TieredAnswer::default(),
            4,
            1,
            0,
            AlignedVec::new()
        )),
        ("TieredAnswer", 5, 4)
    );
    assert_eq!(
        too_new(encode_in_version(
            &TieredQuery::default(),
            4,
            1,
            0,
            AlignedVec::new()
        )),
        ("TieredQuery", 5, 4)
    );
    assert_eq!(
        too_new(encode_in_version(
            &ReuseReport::default(),
            4,
            1,
            0,
            AlignedVec::new()
        )),
        ("ReuseReport", 5, 4)
    );
    assert!(encode_in_version(&TieredAnswer::default(), 5, 1, 0, AlignedVec::new()).is_ok());
}

#[test]
fn error_codes_new_in_version_5_map_for_version_4_clients() {
    assert_eq!(ErrorCode::BadRequest.for_version(4), ErrorCode::BadFrame);
    assert_eq!(ErrorCode::Stale.for_version(4), ErrorCode::Overloaded);
    assert_eq!(ErrorCode::BadRequest.for_version(5), ErrorCode::BadRequest);
    assert_eq!(ErrorCode::Stale.for_version(5), ErrorCode::Stale);
    // The codes a version 4 client knows are the same in both versions.
    let v4_codes: Vec<ErrorCode> = ErrorCode::ALL
        .into_iter()
        .filter(|c| !matches!(c, ErrorCode::BadRequest | ErrorCode::Stale))
        .collect();
    assert_eq!(v4_codes.len(), 15);
    for &code in &v4_codes {
        assert_eq!(code.for_version(4), code);
        assert_eq!(code.for_version(5), code);
    }
    // What a version 4 reply carries is a code a version 4 client knows.
    for code in [ErrorCode::BadRequest, ErrorCode::Stale] {
        assert!(v4_codes.contains(&code.for_version(4)));
    }
}

#[test]
fn tier_weights_travel_bit_for_bit_and_only_0_to_1_is_valid() {
    for (cpu, storage) in [
        (f32::NAN, 0.5),
        (-0.0, f32::INFINITY),
        (f32::from_bits(0x7fc0_1234), f32::NEG_INFINITY),
        (1.5, -0.25),
    ] {
        let q = TieredQuery {
            weights: TierWeights { cpu, storage },
            ..Default::default()
        };
        let buf = encode(&q, 1, 0).unwrap();
        let f = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
        let MessageRef::TieredQuery(a) = f.message().unwrap() else {
            panic!("kind")
        };
        let back = to_native::<TieredQuery>(a).weights;
        assert_eq!(back.cpu.to_bits(), cpu.to_bits());
        assert_eq!(back.storage.to_bits(), storage.to_bits());
        assert!(!back.is_valid(), "{cpu} {storage}");
    }
    for w in [
        TierWeights::DYNAMO,
        TierWeights::JOINT,
        TierWeights {
            cpu: 0.0,
            storage: 0.0,
        },
        TierWeights {
            cpu: -0.0,
            storage: 1.0,
        },
    ] {
        assert!(w.is_valid(), "{w:?}");
    }
    assert_eq!(TierWeights::default(), TierWeights::DYNAMO);
    assert_eq!(TieredQuery::default().weights, TierWeights::DYNAMO);
}

#[test]
fn depths_weigh_each_tier_by_its_weight() {
    let d = Depths {
        gpu: 1,
        cpu: 3,
        storage: 7,
    };
    assert_eq!(d.weighed(&TierWeights::JOINT), 7.0);
    assert_eq!(
        d.weighed(&TierWeights::DYNAMO),
        1.0 + 0.75 * 2.0 + 0.25 * 4.0
    );
    assert_eq!(
        d.weighed(&TierWeights {
            cpu: 0.0,
            storage: 0.0
        }),
        1.0
    );
    assert_eq!(Depths::gpu_only(5).weighed(&TierWeights::DYNAMO), 5.0);
    // A deep CPU-only prefix weighs less than a shorter GPU prefix under DYNAMO (§4.4).
    let cpu_only = Depths {
        gpu: 0,
        cpu: 8,
        storage: 8,
    };
    assert_eq!(cpu_only.weighed(&TierWeights::DYNAMO), 6.0);
    assert!(
        cpu_only.weighed(&TierWeights::DYNAMO) < Depths::gpu_only(7).weighed(&TierWeights::DYNAMO)
    );
    assert!(
        cpu_only.weighed(&TierWeights::JOINT) > Depths::gpu_only(7).weighed(&TierWeights::JOINT)
    );
}
