//! The shared frame vectors (`tests/golden/frames_v5.txt`): every message kind, every
//! error code, the string and frame-size boundaries, the examples of
//! docs/protocol.md §8, and invalid streams with the error each must get. The Go
//! client (client/go/wire) checks the same file: it must encode each `frame` line's
//! message to these bytes and read them back, and refuse each `check` line as said.
//! `KVIX_WRITE_GOLDEN=1 cargo test -p kvix-wire --test vectors` rewrites the file
//! after a deliberate change; otherwise it must equal what this encoder writes.
//!
//! Lines: `frame NAME VERSION REQUEST_ID FLAGS HEX` (the message is named, and built
//! alike, in this file and in client/go/wire/vectors_test.go) and
//! `check NAME MAX_FRAME EXPECT HEX`, EXPECT being `ok:N` (N whole valid frames, a
//! trailing partial frame left unread) or a `FrameError` variant.

mod common;

use kvix_wire::codec::validate_stream;
use kvix_wire::*;

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/frames_v5.txt");

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn ks_full() -> Keyspace {
    Keyspace {
        model: "meta-llama/Llama-3.1-8B".into(),
        lora: "sql".into(),
        salt: "tenant-42-salt".into(),
        kind: ChunkKind::Bytes,
    }
}

fn query_full() -> Query {
    Query {
        keyspace: ks_full(),
        chain: vec![1, u64::MAX, 0x0123_4567_89ab_cdef],
        candidates: vec![7, 9],
        top_k: 3,
        want_runs: true,
    }
}

fn runs() -> Vec<WorkerRuns> {
    vec![
        WorkerRuns {
            worker: 1,
            lanes: vec![
                LaneRuns {
                    lane: 0,
                    runs: vec![Run { start: 0, end: 8 }, Run { start: 9, end: 12 }],
                },
                LaneRuns {
                    lane: 1,
                    runs: vec![],
                },
            ],
        },
        WorkerRuns {
            worker: 2,
            lanes: vec![],
        },
    ]
}

/// A string of n bytes (the inline / out-of-line and 6-bit length boundaries).
fn sized(n: usize) -> String {
    (0..n).map(|i| (b'a' + (i % 26) as u8) as char).collect()
}

/// Collects frames: `(name, bytes)` in file order.
#[derive(Default)]
struct Frames(Vec<(String, u16, u64, u8, Vec<u8>)>);

impl Frames {
    fn add<M: Body>(&mut self, name: impl Into<String>, version: u16, id: u64, flags: u8, m: &M) {
        let bytes = encode_in_version(m, version, id, flags, AlignedVec::new()).unwrap();
        self.0
            .push((name.into(), version, id, flags, bytes.to_vec()));
    }
    fn get(&self, name: &str) -> Vec<u8> {
        self.0.iter().find(|f| f.0 == name).expect(name).4.clone()
    }
}

fn frames() -> Frames {
    let mut f = Frames::default();
    let hello = |client: String, auth: Option<&str>| Hello {
        client,
        token_block: 16,
        auth: auth.map(Into::into),
    };
    f.add("hello", 5, 1, 0, &hello("gw-1".into(), None));
    f.add("hello-v4", 4, 1, 0, &hello("gw-1".into(), None));
    f.add(
        "hello-auth",
        5,
        2,
        0,
        &hello(
            "gateway-replica-0042".into(),
            Some("s3cr3t-token-0123456789"),
        ),
    );
    for n in [0, 8, 9, 63, 64, 300] {
        f.add(
            format!("hello-client-{n}"),
            5,
            n as u64,
            0,
            &hello(sized(n), None),
        );
    }
    f.add(
        "welcome",
        5,
        1,
        0,
        &Welcome {
            server: "kvix-server 0.1.0".into(),
            token_block: 16,
            byte_chunk: 256,
            shards: 2,
            max_frame: 4 << 20,
        },
    );
    f.add(
        "query-empty",
        5,
        3,
        0,
        &Query {
            keyspace: Keyspace::tokens("m"),
            chain: vec![],
            candidates: vec![],
            top_k: 0,
            want_runs: false,
        },
    );
    f.add("query-full", 5, u64::MAX, 0, &query_full());
    f.add("query-v4", 4, 4, 0, &query_full());
    f.add(
        "tiered-query",
        5,
        5,
        0,
        &common::weighed_as_dynamo(query_full()),
    );
    f.add(
        "answer-empty",
        5,
        3,
        0,
        &Answer {
            scores: vec![],
            unscorable: 0,
            runs: vec![],
            history_lost: vec![],
            reissued: 0,
        },
    );
    f.add(
        "answer-full",
        5,
        3,
        0,
        &Answer {
            scores: vec![
                Score {
                    worker: 1,
                    blocks: 8,
                },
                Score {
                    worker: 2,
                    blocks: 7,
                },
            ],
            unscorable: 1,
            runs: runs(),
            history_lost: vec![2],
            reissued: 3,
        },
    );
    f.add(
        "tiered-answer",
        5,
        5,
        0,
        &TieredAnswer {
            scores: vec![
                TieredScore {
                    worker: 2,
                    tiers: Depths::gpu_only(7),
                    suspect: Some(SuspectCause::EventsLagging),
                },
                TieredScore {
                    worker: 1,
                    tiers: Depths {
                        gpu: 0,
                        cpu: 8,
                        storage: 8,
                    },
                    suspect: None,
                },
            ],
            unscorable: 2,
            runs: runs(),
            history_lost: vec![1, 2],
            reissued: 0,
            stale: true,
        },
    );
    f.add(
        "announce-placements",
        5,
        6,
        0,
        &Announce {
            name: "w-0".into(),
            lanes: vec![Lane::full(16)],
            feed: Feed::Placements {
                capacity_blocks: 1000,
                ttl_ms: 60_000,
            },
            source: None,
        },
    );
    let lanes = [
        "full_attention@16",
        "sliding_window:4096@32",
        "chunked_local:8192@16",
    ];
    let lanes = lanes.iter().chain(&["mla_attention@16", "mamba@64"]);
    f.add(
        "announce-events",
        5,
        7,
        0,
        &Announce {
            name: "engine-a/dp1-with-a-long-name".into(),
            lanes: lanes.map(|l| Lane::parse(l).unwrap()).collect(),
            feed: Feed::Events,
            source: Some(EventSource {
                endpoint: "tcp://10.0.0.7:5557".into(),
                replay: "tcp://10.0.0.7:5558".into(),
                model: "meta-llama/Llama-3.1-8B".into(),
                salt: String::new(),
            }),
        },
    );
    f.add(
        "announced",
        5,
        7,
        0,
        &Announced {
            worker: 7,
            created: true,
        },
    );
    f.add("retire", 5, 8, 0, &Retire { worker: 7 });
    f.add(
        "event-batch",
        5,
        9,
        0,
        &EventBatch {
            worker: 3,
            seq: 42,
            keyspace: Keyspace::tokens("m"),
            events: vec![
                Event::Stored {
                    lane: 0,
                    start: 0,
                    parent: None,
                    chain: vec![1, 2],
                    engine: vec![11],
                },
                Event::Stored {
                    lane: 1,
                    start: 2,
                    parent: Some(99),
                    chain: vec![3],
                    engine: vec![],
                },
                Event::Removed {
                    lane: 0,
                    hashes: vec![11],
                },
                Event::Cleared,
                Event::StoredIn {
                    tier: Tier::Cpu,
                    lane: 0,
                    start: 0,
                    parent: None,
                    chain: vec![5],
                    engine: vec![55],
                },
                Event::RemovedFrom {
                    tier: Tier::Storage,
                    lane: 1,
                    hashes: vec![55, 56],
                },
            ],
        },
    );
    let applied = |status| Applied { seq: 42, status };
    f.add("applied", 5, 9, 0, &applied(ApplyStatus::Applied));
    f.add(
        "applied-duplicate",
        5,
        9,
        0,
        &applied(ApplyStatus::Duplicate),
    );
    f.add(
        "applied-gap",
        5,
        9,
        0,
        &applied(ApplyStatus::Gap { expected: 40 }),
    );
    f.add(
        "placement-no-reply",
        5,
        1 << 63 | 10,
        FLAG_NO_REPLY,
        &Placement {
            worker: 3,
            keyspace: Keyspace::tokens("meta-llama/Llama-3.1-8B"),
            chain: vec![7, 8, 9],
        },
    );
    f.add("stats-request", 5, 11, 0, &StatsRequest {});
    f.add(
        "stats",
        5,
        11,
        0,
        &Stats {
            workers: 2,
            blocks: 1 << 40,
            memberships: 3,
            queries: 4,
            events: 5,
            shard_load: vec![10, 20],
        },
    );
    f.add(
        "echo",
        5,
        12,
        0,
        &Echo {
            payload: vec![1, 2, 3],
            reply_len: 64,
        },
    );
    f.add("ack", 5, 13, 0, &Ack {});
    f.add("ack-v4", 4, 13, 0, &Ack {});
    for (i, code) in ErrorCode::ALL.iter().enumerate() {
        let reply = ErrorReply {
            code: *code,
            message: format!("refused: {code:?}"),
        };
        f.add(format!("error-{code:?}"), 5, i as u64, 0, &reply);
    }
    f.add(
        "roster-request",
        5,
        14,
        0,
        &RosterRequest {
            from: 5,
            names: vec!["a".into(), "a-longer-name".into()],
        },
    );
    f.add(
        "roster",
        5,
        14,
        0,
        &Roster {
            workers: vec![
                RosterEntry {
                    worker: 0,
                    name: "w-0".into(),
                },
                RosterEntry {
                    worker: 1,
                    name: "worker-number-one".into(),
                },
            ],
            next: 2,
            more: true,
            reissued: 1,
        },
    );
    f.add(
        "reuse-report",
        5,
        15,
        FLAG_NO_REPLY,
        &ReuseReport {
            reports: vec![
                Reuse {
                    worker: 1,
                    model: "m".into(),
                    predicted_tokens: Some(64),
                    cached_tokens: 48,
                    prompt_tokens: 100,
                },
                Reuse {
                    worker: 2,
                    model: "meta-llama/Llama-3.1-8B".into(),
                    predicted_tokens: None,
                    cached_tokens: 0,
                    prompt_tokens: 17,
                },
            ],
        },
    );
    doc_examples(&mut f);
    f
}

/// The messages of docs/protocol.md §8, named `doc-NAME` after its `hex:NAME` dumps
/// (protocol_doc.rs checks this encoder against the dumps; the Go side checks that
/// each dump is its vector).
fn doc_examples(f: &mut Frames) {
    f.add("doc-hello", 5, 1, 0, &common::hello());
    f.add("doc-query", 5, 2, 0, &common::query());
    f.add("doc-retire", 5, 3, 0, &common::retire());
    f.add("doc-ack", 5, 3, 0, &Ack {});
    f.add("doc-tiered-query", 5, 4, 0, &common::tiered_query());
    f.add("doc-tiered-answer", 5, 4, 0, &common::tiered_answer());
    f.add("doc-ack-v4", 4, 3, 0, &Ack {});
}

/// Invalid (and boundary) streams: `(name, max_frame, bytes)`, each derived from a
/// valid frame by one change.
fn checks(f: &Frames) -> Vec<(String, u32, Vec<u8>)> {
    let m = DEFAULT_MAX_FRAME;
    let with = |name: &str, at: usize, bytes: &[u8]| {
        let mut v = f.get(name);
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    };
    let echo = f.get("echo");
    let mut two = f.get("hello");
    two.extend(f.get("ack"));
    let mut c = vec![
        ("two-frames".into(), m, two.clone()),
        ("partial-frame".into(), m, two[..two.len() - 1].to_vec()),
        ("header-only".into(), m, f.get("echo")[..24].to_vec()),
        ("echo-at-max-frame".into(), echo.len() as u32, echo.clone()),
        ("echo-past-max-frame".into(), echo.len() as u32 - 8, echo),
        ("bad-magic".into(), m, with("ack", 0, b"KVIY")),
        ("version-3".into(), m, with("ack", 4, &[3, 0])),
        ("version-6".into(), m, with("ack", 4, &[6, 0])),
        ("reserved".into(), m, with("ack", 20, &[1])),
        ("kind-0".into(), m, with("ack", 6, &[0])),
        ("kind-21".into(), m, with("ack", 6, &[21])),
        (
            "tiered-query-in-v4".into(),
            m,
            with("tiered-query", 4, &[4]),
        ),
        (
            "reuse-report-in-v4".into(),
            m,
            with("reuse-report", 4, &[4]),
        ),
        ("flag-2".into(), m, with("ack", 7, &[2])),
        (
            "announced-bool-2".into(),
            m,
            with("announced", 24 + 4, &[2]),
        ),
        (
            "error-code-17".into(),
            m,
            with("error-BadFrame", 24 + 24, &[17]),
        ),
        ("retire-short-body".into(), m, with("retire", 16, &[2])),
        ("hello-option-tag-2".into(), m, with("hello", 24 + 12, &[2])),
        ("hello-bad-utf8".into(), m, with("hello", 24, &[0xc3, 0x28])),
        ("chain-past-body".into(), m, with("query-full", 16, &[0x60])),
    ];
    // A query whose chain pointer is moved by 4: no longer 8-aligned.
    let mut q = f.get("query-empty");
    let body_len = u32::from_le_bytes(q[16..20].try_into().unwrap()) as usize;
    let chain_ptr = 24 + body_len - 52 + 28;
    let off = i32::from_le_bytes(q[chain_ptr..chain_ptr + 4].try_into().unwrap()) - 4;
    q[chain_ptr..chain_ptr + 4].copy_from_slice(&off.to_le_bytes());
    // One element, so that the pointer is checked against its element type.
    q[chain_ptr + 4] = 1;
    c.push(("chain-misaligned".into(), m, q));
    // An out-of-line string of 5 bytes (the inline form's job).
    let mut h = f.get("hello-client-9");
    let body_len = u32::from_le_bytes(h[16..20].try_into().unwrap()) as usize;
    let client = 24 + body_len - 24;
    h[client] = 0x80 | 5;
    c.push(("hello-short-out-of-line".into(), m, h));
    for code in [ErrorCode::BadFrame, ErrorCode::Stale] {
        let name = format!("error-{code:?}");
        c.push((format!("{name}-ok"), m, f.get(&name)));
    }
    c
}

fn expect(bytes: &[u8], max: u32) -> String {
    match validate_stream(bytes, max) {
        Ok(n) => format!("ok:{n}"),
        Err(e) => format!("{e:?}")
            .split(['(', ' ', '{'])
            .next()
            .unwrap()
            .to_string(),
    }
}

fn vectors() -> String {
    let f = frames();
    let mut out = format!(
        "# kvix frame vectors, protocol version {PROTOCOL_VERSION}: written by \
         wire/tests/vectors.rs, read by client/go/wire/vectors_test.go\n"
    );
    for (name, version, id, flags, bytes) in &f.0 {
        out += &format!("frame {name} {version} {id} {flags} {}\n", hex(bytes));
    }
    for (name, max, bytes) in checks(&f) {
        out += &format!(
            "check {name} {max} {} {}\n",
            expect(&bytes, max),
            hex(&bytes)
        );
    }
    out
}

#[test]
fn the_shared_vectors_are_what_this_encoder_writes() {
    let now = vectors();
    if std::env::var_os("KVIX_WRITE_GOLDEN").is_some() {
        std::fs::write(PATH, &now).unwrap();
    }
    let file = std::fs::read_to_string(PATH).expect("tests/golden/frames_v5.txt");
    assert!(
        file == now,
        "{PATH} differs from what the encoder writes: a wire change? \
         (KVIX_WRITE_GOLDEN=1 rewrites it, with a protocol version bump)"
    );
}

#[test]
fn every_vector_reads_back_and_every_check_is_refused_as_written() {
    let f = frames();
    for (name, _, id, flags, bytes) in &f.0 {
        let frame = split_frame(bytes, DEFAULT_MAX_FRAME)
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: a whole frame"));
        assert_eq!((frame.header.request_id, frame.header.flags), (*id, *flags));
        frame.message().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let expected = [
        ("two-frames", "ok:2"),
        ("partial-frame", "ok:1"),
        ("header-only", "ok:0"),
        ("echo-at-max-frame", "ok:1"),
        ("echo-past-max-frame", "Oversize"),
        ("bad-magic", "BadMagic"),
        ("version-3", "UnsupportedVersion"),
        ("version-6", "UnsupportedVersion"),
        ("reserved", "Reserved"),
        ("kind-0", "UnknownKind"),
        ("kind-21", "UnknownKind"),
        ("tiered-query-in-v4", "KindTooNew"),
        ("reuse-report-in-v4", "KindTooNew"),
        ("flag-2", "UnknownFlags"),
        ("announced-bool-2", "InvalidBody"),
        ("error-code-17", "InvalidBody"),
        ("retire-short-body", "InvalidBody"),
        ("hello-option-tag-2", "InvalidBody"),
        ("hello-bad-utf8", "InvalidBody"),
        ("chain-past-body", "InvalidBody"),
        ("chain-misaligned", "InvalidBody"),
        ("hello-short-out-of-line", "InvalidBody"),
        ("error-BadFrame-ok", "ok:1"),
        ("error-Stale-ok", "ok:1"),
    ];
    let checks = checks(&f);
    assert_eq!(checks.len(), expected.len());
    for ((name, max, bytes), (want_name, want)) in checks.iter().zip(expected) {
        assert_eq!(name, want_name);
        assert_eq!(expect(bytes, *max), want, "{name}");
    }
}
