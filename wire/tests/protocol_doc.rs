//! Keeps `docs/protocol.md` true: its constants, kind table, enum tag tables, layout
//! table and hex dumps are read out of the document (between `<!-- table:NAME -->` /
//! `<!-- hex:NAME -->` and `<!-- /table -->` / `<!-- /hex -->` markers) and checked
//! against the code. A failure here means the document or the wire format changed:
//! fix the document, or (for a format change) bump the protocol version.

mod common;

use std::collections::BTreeSet;
use std::mem::{align_of, size_of};

use kvix_wire::frame::FRAME_ALIGN;
use kvix_wire::keyspace::{ArchivedChunkKind, ArchivedKeyspace};
use kvix_wire::lane::{ArchivedLane, ArchivedLaneKind};
use kvix_wire::*;
use rkyv::rancor;

const DOC: &str = include_str!("../../docs/protocol.md");
const GOLDEN: &str = include_str!("golden/chain_v1.txt");

/// The text between `<!-- {open} -->` (which must occur once) and the next `close`.
fn between(open: &str, close: &str) -> &'static str {
    let marker = format!("<!-- {open} -->");
    let mut hits = DOC.match_indices(&marker);
    let (at, _) = hits
        .next()
        .unwrap_or_else(|| panic!("docs/protocol.md lacks the marker {marker}"));
    assert!(hits.next().is_none(), "marker {marker} occurs twice");
    let rest = &DOC[at + marker.len()..];
    let end = rest
        .find(close)
        .unwrap_or_else(|| panic!("marker {marker} is not closed by {close}"));
    &rest[..end]
}

/// The body rows of the markdown table `name`, cells trimmed and without backticks.
fn table(name: &str) -> Vec<Vec<String>> {
    let rows: Vec<Vec<String>> = between(&format!("table:{name}"), "<!-- /table -->")
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().replace('`', ""))
                .collect()
        })
        .collect();
    assert!(rows.len() > 2, "table {name} has no rows");
    assert!(
        rows[1].iter().all(|c| c.chars().all(|ch| ch == '-')),
        "table {name}: second line is not a header separator"
    );
    rows[2..].to_vec()
}

/// The bytes of hex dump `name`: lines `offset: xx xx .. # comment`; offsets must count.
fn hex(name: &str) -> Vec<u8> {
    let mut bytes = Vec::new();
    for line in between(&format!("hex:{name}"), "<!-- /hex -->").lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with("```") {
            continue;
        }
        let mut tokens = line.split_whitespace();
        let offset = tokens.next().expect("an offset");
        let offset = offset
            .strip_suffix(':')
            .and_then(|o| usize::from_str_radix(o, 16).ok())
            .unwrap_or_else(|| panic!("hex:{name}: bad offset {offset:?} in {line:?}"));
        assert_eq!(
            offset,
            bytes.len(),
            "hex:{name}: line {line:?} starts at the wrong offset"
        );
        for t in tokens {
            assert_eq!(t.len(), 2, "hex:{name}: {t:?} is not one byte");
            bytes.push(u8::from_str_radix(t, 16).expect("a hex byte"));
        }
    }
    bytes
}

/// Asserts `got` (an encoding) equals `doc` (a dump), naming the first differing byte.
fn same_bytes(name: &str, got: &[u8], doc: &[u8]) {
    if let Some(at) = got.iter().zip(doc).position(|(a, b)| a != b) {
        panic!(
            "hex:{name}: byte {at:#06x} is {:02x} in the encoding but {:02x} in the document",
            got[at], doc[at]
        );
    }
    assert_eq!(
        got.len(),
        doc.len(),
        "hex:{name}: the encoding and the document differ in length"
    );
}

fn golden(name: &str) -> u64 {
    let line = GOLDEN
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("golden vector {name} missing"));
    u64::from_str_radix(line, 16).expect("hex golden value")
}

/// Checks that `frame` (one frame, from the document) reads back as `msg`; its header.
fn reads_back<M: Body + PartialEq + std::fmt::Debug>(frame: &[u8], msg: &M, id: u64) -> Header {
    let mut buf = rkyv::util::AlignedVec::<16>::new();
    buf.extend_from_slice(frame);
    let f = split_frame(&buf, DEFAULT_MAX_FRAME)
        .expect("a valid frame")
        .expect("a whole frame");
    assert_eq!(f.len, frame.len());
    assert_eq!(f.header.request_id, id);
    assert_eq!(f.kind, M::KIND);
    let archived = codec::access::<M>(f.body).expect("a valid body");
    assert_eq!(&to_native::<M>(archived), msg);
    f.header
}

#[test]
fn header_constants_match_the_document() {
    assert_eq!(HEADER_LEN, 24);
    assert_eq!(PROTOCOL_VERSION, 5);
    assert_eq!(OLDEST_VERSION, 4);
    let code: Vec<(&str, u64)> = vec![
        ("PROTOCOL_VERSION", PROTOCOL_VERSION.into()),
        ("OLDEST_VERSION", OLDEST_VERSION.into()),
        ("HEADER_LEN", HEADER_LEN as u64),
        ("FRAME_ALIGN", FRAME_ALIGN as u64),
        ("DEFAULT_MAX_FRAME", DEFAULT_MAX_FRAME.into()),
        ("FLAG_NO_REPLY", FLAG_NO_REPLY.into()),
        ("BYTE_CHUNK", BYTE_CHUNK.into()),
    ];
    let rows = table("constants");
    assert_eq!(rows.len(), code.len(), "constants table rows");
    for (name, value) in code {
        let row = rows
            .iter()
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("constant {name} missing from the document"));
        assert_eq!(row[1].parse::<u64>().ok(), Some(value), "constant {name}");
    }
}

#[test]
fn kind_table_matches_the_codec() {
    let rows = table("kinds");
    let mut seen = BTreeSet::new();
    for row in &rows {
        let byte: u8 = row[0].parse().expect("a decimal kind byte");
        assert_eq!(row[1], format!("{byte:#04x}"), "hex of kind {byte}");
        let kind = Kind::from_byte(byte).unwrap_or_else(|| panic!("kind byte {byte} unknown"));
        assert_eq!(kind.name(), row[2], "name of kind byte {byte}");
        assert_eq!(
            row[3].parse::<u16>().ok(),
            Some(kind.since()),
            "version kind byte {byte} exists from"
        );
        assert!((OLDEST_VERSION..=PROTOCOL_VERSION).contains(&kind.since()));
        assert_eq!(kind as u8, byte);
        assert!(seen.insert(byte), "kind byte {byte} listed twice");
    }
    let known: BTreeSet<u8> = (0..=255)
        .filter(|b| Kind::from_byte(*b).is_some())
        .collect();
    assert_eq!(seen, known, "the document lists every kind and only those");
}

const ERROR_CODES: [ErrorCode; 17] = ErrorCode::ALL;

/// Fails to compile when a code is added: add it to `ErrorCode::ALL` and to the document.
fn _every_error_code_is_listed(c: ErrorCode) {
    match c {
        ErrorCode::BadFrame
        | ErrorCode::UnsupportedVersion
        | ErrorCode::NoHello
        | ErrorCode::Unauthorized
        | ErrorCode::BlockSizeMismatch
        | ErrorCode::UnknownWorker
        | ErrorCode::BadLane
        | ErrorCode::LanesInByteKeyspace
        | ErrorCode::Overloaded
        | ErrorCode::Internal
        | ErrorCode::BadSource
        | ErrorCode::TooManySources
        | ErrorCode::TooLarge
        | ErrorCode::BadSequence
        | ErrorCode::LogUnavailable
        | ErrorCode::BadRequest
        | ErrorCode::Stale => {}
    }
}

#[test]
fn error_code_tags_match_the_document() {
    let rows = table("error-codes");
    assert_eq!(rows.len(), ERROR_CODES.len(), "error code rows");
    for row in rows {
        let tag: u8 = row[0].parse().expect("a decimal tag");
        let code = *ERROR_CODES
            .iter()
            .find(|c| format!("{c:?}") == row[1])
            .unwrap_or_else(|| panic!("no error code {}", row[1]));
        let frame = encode(
            &ErrorReply {
                code,
                message: String::new(),
            },
            0,
            0,
        )
        .unwrap();
        let body_len = u32::from_le_bytes(frame[16..20].try_into().unwrap()) as usize;
        let root = HEADER_LEN + body_len - size_of::<ArchivedErrorReply>();
        assert_eq!(frame[root], tag, "wire tag of {code:?}");
        assert_eq!(
            format!("{:?}", code.for_version(4)),
            row[4],
            "what a version 4 client reads for {code:?}"
        );
        assert_eq!(code.for_version(PROTOCOL_VERSION), code);
    }
}

/// Fails to compile when a lane kind is added: add it to the document's lane table.
fn _every_lane_kind_is_listed(k: LaneKind) -> &'static str {
    match k {
        LaneKind::FullAttention => "full_attention",
        LaneKind::MlaAttention => "mla_attention",
        LaneKind::SlidingWindow { .. } => "sliding_window",
        LaneKind::ChunkedLocal { .. } => "chunked_local",
        LaneKind::Mamba => "mamba",
    }
}

#[test]
fn lane_kind_table_matches_the_vocabulary() {
    let rows = table("lane-kinds");
    assert_eq!(rows.len(), 5, "lane kind rows");
    for (i, row) in rows.iter().enumerate() {
        let tag: u8 = row[0].parse().expect("a decimal tag");
        assert_eq!(usize::from(tag), i, "lane tags are listed in order");
        let text = &row[2];
        let kind = LaneKind::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(&kind.to_string(), text, "canonical text form");
        assert_eq!(_every_lane_kind_is_listed(kind), kind.name());
        let lane = Lane {
            kind,
            block_tokens: 16,
        };
        assert_eq!(Lane::parse(&format!("{text}@16")), Ok(lane));
        let bytes = rkyv::to_bytes::<rancor::Error>(&lane).unwrap();
        assert_eq!(bytes.len(), size_of::<ArchivedLane>());
        assert_eq!(bytes[0], tag, "wire tag of {text}");
        let param = text
            .split_once(':')
            .map(|(_, p)| format!(":{p}"))
            .unwrap_or_default();
        for alias in row[4].split(',').map(str::trim) {
            assert_eq!(
                LaneKind::parse(&format!("{alias}{param}")),
                Ok(kind),
                "alias {alias}"
            );
        }
    }
    assert_eq!(
        LaneKind::parse("linear_attention"),
        Err(LaneError::UnknownKind("linear_attention".into()))
    );
}

macro_rules! layouts {
    ($($name:literal => $ty:ty),* $(,)?) => {
        vec![$(($name, size_of::<$ty>(), align_of::<$ty>())),*]
    };
}

#[test]
fn archived_layouts_match_the_document() {
    use rkyv::option::ArchivedOption;
    use rkyv::string::ArchivedString;
    use rkyv::vec::ArchivedVec;
    let code = layouts! {
        "String" => ArchivedString,
        "Vec<T>" => ArchivedVec<rkyv::rend::u64_le>,
        "Option<String>" => ArchivedOption<ArchivedString>,
        "ChunkKind" => ArchivedChunkKind,
        "Keyspace" => ArchivedKeyspace,
        "LaneKind" => ArchivedLaneKind,
        "Lane" => ArchivedLane,
        "Hello" => ArchivedHello,
        "Welcome" => ArchivedWelcome,
        "Query" => ArchivedQuery,
        "Score" => ArchivedScore,
        "Run" => ArchivedRun,
        "LaneRuns" => ArchivedLaneRuns,
        "WorkerRuns" => ArchivedWorkerRuns,
        "Answer" => ArchivedAnswer,
        "Tier" => ArchivedTier,
        "TierWeights" => ArchivedTierWeights,
        "TieredQuery" => ArchivedTieredQuery,
        "Depths" => ArchivedDepths,
        "SuspectCause" => ArchivedSuspectCause,
        "Option<SuspectCause>" => ArchivedOption<ArchivedSuspectCause>,
        "TieredScore" => ArchivedTieredScore,
        "TieredAnswer" => ArchivedTieredAnswer,
        "Option<u32>" => ArchivedOption<rkyv::rend::u32_le>,
        "Reuse" => ArchivedReuse,
        "ReuseReport" => ArchivedReuseReport,
        "Feed" => ArchivedFeed,
        "EventSource" => ArchivedEventSource,
        "Option<EventSource>" => ArchivedOption<ArchivedEventSource>,
        "Announce" => ArchivedAnnounce,
        "Announced" => ArchivedAnnounced,
        "Retire" => ArchivedRetire,
        "Event" => ArchivedEvent,
        "EventBatch" => ArchivedEventBatch,
        "ApplyStatus" => ArchivedApplyStatus,
        "Applied" => ArchivedApplied,
        "Placement" => ArchivedPlacement,
        "StatsRequest" => ArchivedStatsRequest,
        "Stats" => ArchivedStats,
        "Echo" => ArchivedEcho,
        "Ack" => ArchivedAck,
        "ErrorCode" => ArchivedErrorCode,
        "ErrorReply" => ArchivedErrorReply,
        "RosterRequest" => ArchivedRosterRequest,
        "RosterEntry" => ArchivedRosterEntry,
        "Roster" => ArchivedRoster,
    };
    let rows = table("layouts");
    assert_eq!(rows.len(), code.len(), "layout rows");
    for (name, size, align) in code {
        let row = rows
            .iter()
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("layout of {name} missing from the document"));
        assert_eq!(row[1].parse::<usize>().ok(), Some(size), "size of {name}");
        assert_eq!(row[2].parse::<usize>().ok(), Some(align), "align of {name}");
    }
    // Every message kind has its layout listed.
    for b in 0..=255 {
        if let Some(kind) = Kind::from_byte(b) {
            assert!(rows.iter().any(|r| r[0] == kind.name()), "{}", kind.name());
        }
    }
}

#[test]
fn the_hello_example_is_the_encoding() {
    let hello = common::hello();
    let doc = hex("hello");
    same_bytes("hello", &encode(&hello, 1, 0).unwrap(), &doc);
    assert_eq!(reads_back(&doc, &hello, 1).version, PROTOCOL_VERSION);
}

#[test]
fn the_query_example_is_the_encoding() {
    let query = common::query();
    assert_eq!(query.keyspace.seed(16), golden("seed/base/b16"));
    assert_eq!(
        query.chain,
        [golden("chain/base/b16/0"), golden("chain/base/b16/1")]
    );
    let doc = hex("query");
    same_bytes("query", &encode(&query, 2, 0).unwrap(), &doc);
    reads_back(&doc, &query, 2);
}

#[test]
fn the_retire_and_ack_examples_are_the_encoding() {
    let retire = common::retire();
    let doc = hex("retire");
    same_bytes("retire", &encode(&retire, 3, 0).unwrap(), &doc);
    reads_back(&doc, &retire, 3);
    let doc = hex("ack");
    same_bytes("ack", &encode(&Ack {}, 3, 0).unwrap(), &doc);
    assert_eq!(reads_back(&doc, &Ack {}, 3).version, PROTOCOL_VERSION);
}

#[test]
fn the_tiered_query_example_is_the_encoding() {
    let query = common::tiered_query();
    let doc = hex("tiered-query");
    same_bytes("tiered-query", &encode(&query, 4, 0).unwrap(), &doc);
    assert_eq!(reads_back(&doc, &query, 4).version, 5);
    // The same bytes with the header saying version 4 are refused.
    let mut v4 = rkyv::util::AlignedVec::<16>::new();
    v4.extend_from_slice(&doc);
    v4[4] = 4;
    assert_eq!(
        split_frame(&v4, DEFAULT_MAX_FRAME).unwrap_err(),
        FrameError::KindTooNew {
            kind: 18,
            since: 5,
            version: 4
        }
    );
}

#[test]
fn the_tiered_answer_example_is_the_encoding() {
    let answer = common::tiered_answer();
    assert_eq!(answer.scores[0].tiers.weighed(&TierWeights::DYNAMO), 1.75);
    assert_eq!(answer.scores[0].tiers.weighed(&TierWeights::JOINT), 2.0);
    let doc = hex("tiered-answer");
    same_bytes("tiered-answer", &encode(&answer, 4, 0).unwrap(), &doc);
    assert_eq!(reads_back(&doc, &answer, 4).version, 5);
}

#[test]
fn the_version_4_ack_example_is_the_encoding() {
    let doc = hex("ack-v4");
    let frame = encode_in_version(&Ack {}, 4, 3, 0, AlignedVec::new()).unwrap();
    same_bytes("ack-v4", &frame, &doc);
    assert_eq!(reads_back(&doc, &Ack {}, 3).version, 4);
    // It differs from the version 5 Ack of §8.3 in the version bytes only.
    let v5 = hex("ack");
    assert_eq!(doc.len(), v5.len());
    let differ: Vec<usize> = (0..doc.len()).filter(|&i| doc[i] != v5[i]).collect();
    assert_eq!(differ, [4]);
}

#[test]
fn the_keyspace_seed_is_the_documented_byte_string() {
    // §5.1: tag, three length-prefixed fields, kind byte, block size.
    let mut bytes = b"kvix-keyspace-v1".to_vec();
    for field in ["m", "", ""] {
        bytes.extend_from_slice(&(field.len() as u32).to_le_bytes());
        bytes.extend_from_slice(field.as_bytes());
    }
    bytes.push(0);
    bytes.extend_from_slice(&16u32.to_le_bytes());
    assert_eq!(
        xxhash_rust::xxh3::xxh3_64(&bytes),
        Keyspace::tokens("m").seed(16)
    );
    // A byte keyspace uses its 256-byte chunk whatever the server's token block.
    assert_eq!(Keyspace::bytes("m").seed(16), Keyspace::bytes("m").seed(32));
}
