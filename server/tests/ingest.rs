//! End to end: a Python publisher writing exactly vLLM's ZMQ frames (pyzmq + msgpack,
//! scripts/vllm_publisher.py) drives the real server, which subscribes on its own.
//!
//! The scenario is built here from deterministic token ids; the expected scores are
//! worked out below from those ids and the joint reuse rules, independently of the
//! server's code. Skipped (passing, with a message) only when python3 with zmq and
//! msgpack is missing; CI installs both.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use kvix_wire::*;
use serde_json::{json, Value};

/// Engine block size (tokens) of both lanes; the server hashes 16-token blocks, so one
/// engine block is 2 keyspace blocks.
const EB: u32 = 32;

fn python_ready() -> Result<(), String> {
    match Command::new("python3")
        .args(["-c", "import zmq, msgpack"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Err(format!("no python3: {e}")),
    }
}

/// Tokens of engine blocks `from..to` of prompt `p` (prompt p's token i is p·10⁴ + i).
fn tokens(p: u32, from: u32, to: u32) -> Vec<u32> {
    (from * EB..to * EB).map(|i| p * 10_000 + i).collect()
}

fn keyspace() -> Keyspace {
    Keyspace {
        model: "m".into(),
        lora: String::new(),
        salt: "s".into(),
        kind: ChunkKind::Tokens,
    }
}

/// The query chain of the first `blocks` keyspace blocks of prompt `p`.
fn query_chain(p: u32, blocks: u32) -> Vec<u64> {
    let t = tokens(p, 0, blocks.div_ceil(2));
    chain::token_chain(keyspace().seed(16), 16, &t[..(blocks * 16) as usize])
}

fn lanes() -> Vec<Lane> {
    vec![
        Lane::full(EB),
        Lane {
            kind: LaneKind::SlidingWindow { window: 64 },
            block_tokens: EB,
        },
    ]
}

/// A BlockStored of engine blocks `from..to` of prompt `p` with engine hashes `hashes`.
fn stored(p: u32, from: u32, to: u32, hashes: Vec<Value>, parent: Value, lane: u32) -> Value {
    let mut ev = json!({
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens(p, from, to),
        "block_size": EB,
        "lora_id": null,
        "medium": "GPU",
        "group_idx": lane,
    });
    if lane == 1 {
        ev["kv_cache_spec_kind"] = json!("sliding_window");
        ev["kv_cache_spec_sliding_window"] = json!(64);
    } else if p.is_multiple_of(2) {
        ev["kv_cache_spec_kind"] = json!("full_attention");
    }
    ev
}

/// Both lanes store the same engine blocks (hybrid model: one event per KV group).
fn stored_both(p: u32, from: u32, to: u32, hashes: Vec<Value>, parent: Value) -> Vec<Value> {
    vec![
        stored(p, from, to, hashes.clone(), parent.clone(), 0),
        stored(p, from, to, hashes, parent, 1),
    ]
}

fn removed(hashes: Vec<Value>, lane: u32, medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": lane})
}

fn msg(dp: Option<u32>, events: Vec<Value>) -> Value {
    json!({"dp_rank": dp, "events": events})
}

// Prompts and their engine hashes. A: u64 above 2^63; B: small ints (rank 1);
// C: 32 raw bytes; D: negative ints; E: the gap; F: the malformed batch; G: restart.
const A: u32 = 1;
const B: u32 = 2;
const C: u32 = 3;
const D: u32 = 4;
const E: u32 = 5;
const F: u32 = 6;
const G: u32 = 7;

fn a(i: u64) -> Value {
    json!((1u64 << 63) + 100 + i)
}

fn hashes(base: i64, from: i64, to: i64) -> Vec<Value> {
    (from..to).map(|i| json!(base + i)).collect()
}

fn a_hashes(from: u64, to: u64) -> Vec<Value> {
    (from..to).map(a).collect()
}

fn c_hash(i: u8) -> Value {
    json!({"hex": format!("{:02x}", 0xc0 + i).repeat(32)})
}

fn scenario(encoding: &str) -> Value {
    let mut p1 = vec![
        msg(None, stored_both(A, 0, 4, a_hashes(0, 4), Value::Null)),
        msg(Some(0), stored_both(A, 4, 6, a_hashes(4, 6), a(3))),
        msg(
            Some(1),
            stored_both(B, 0, 2, hashes(200, 0, 2), Value::Null),
        ),
    ];
    let mut seq3 = stored_both(C, 0, 3, (0..3).map(c_hash).collect(), Value::Null);
    seq3.extend(stored_both(D, 0, 3, hashes(-300, -3, 0), Value::Null));
    // A continuation of a block this engine never reported: skipped, not guessed.
    seq3.push(stored(F, 1, 2, vec![json!(999)], json!(424242), 0));
    p1.push(msg(Some(0), seq3));

    let mut seq4 = vec![removed(a_hashes(0, 2), 1, "GPU")];
    seq4.push(removed(a_hashes(5, 6), 0, "GPU"));
    let mut cpu = stored(A, 2, 3, a_hashes(2, 3), a(1), 0);
    cpu["medium"] = json!("CPU");
    let p2 = vec![
        // Sliding-window lane dropped A's first two engine blocks; full lane its last.
        msg(Some(0), seq4),
        // Published to the replay buffer only: the subscriber sees a gap.
        json!({"dp_rank": 0, "skip_pub": true, "events": stored_both(E, 0, 2, hashes(500, 0, 2), Value::Null)}),
        // A's block 2 offloaded to CPU, then evicted from GPU: still held.
        msg(Some(0), vec![cpu, removed(a_hashes(2, 3), 0, "GPU")]),
        // One valid event, one malformed: the whole batch is skipped.
        msg(
            Some(0),
            vec![
                stored(F, 0, 1, hashes(600, 0, 1), Value::Null, 0),
                json!({"type": "BlockStored", "malformed": true}),
            ],
        ),
        // Continues E: resolvable only if the replay delivered E's first blocks.
        msg(Some(0), stored_both(E, 2, 3, hashes(500, 2, 3), json!(501))),
    ];
    let p3 = vec![msg(
        Some(0),
        stored_both(G, 0, 2, hashes(700, 0, 2), Value::Null),
    )];
    json!({
        "encoding": encoding,
        "phases": [
            {"messages": p1},
            {"messages": p2},
            {"restart": true, "messages": p3},
        ],
    })
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    ports: (u16, u16),
}

impl Publisher {
    fn start(scenario: &Value, dir: &std::path::Path) -> Publisher {
        let path = dir.join("scenario.json");
        std::fs::write(&path, scenario.to_string()).unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/vllm_publisher.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(&path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 starts");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("publisher prints its ports");
        let p: Vec<u16> = first
            .strip_prefix("ports ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        Publisher {
            child,
            stdin,
            lines,
            ports: (p[0], p[1]),
        }
    }

    fn wait_phase(&self, n: u32) {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|_| panic!("publisher never finished phase {n}"));
        assert_eq!(line, format!("phase-done {n}"));
    }

    fn next(&mut self) {
        writeln!(self.stdin, "next").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls (a bounded number of times) until `p`'s first `blocks` keyspace blocks score
/// exactly `want` (worker, blocks), best first; panics with the last answer otherwise.
fn await_scores(c: &mut Conn, p: u32, blocks: u32, want: &[(WorkerId, u32)]) {
    let chain = query_chain(p, blocks);
    let want: Vec<Score> = want
        .iter()
        .map(|&(worker, blocks)| Score { worker, blocks })
        .collect();
    let mut last = None;
    for _ in 0..300 {
        let ans = c.query(&keyspace(), &chain);
        if ans.scores == want {
            return;
        }
        last = Some(ans);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("prompt {p}: expected {want:?}, last answer {last:?}");
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

fn drive(encoding: &str) {
    if let Err(why) = python_ready() {
        eprintln!("SKIPPED ingest::{encoding}: python3 with zmq and msgpack is missing ({why}); `pip install pyzmq msgpack` to run it");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvix-ingest-{encoding}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = Server::start(&["--cores", "2"]);
    let mut publisher = Publisher::start(&scenario(encoding), &dir);
    let mut c = server.session();
    let (pub_port, replay_port) = publisher.ports;
    let announce = |name: &str, source: Option<EventSource>| Announce {
        name: name.into(),
        lanes: lanes(),
        feed: Feed::Events,
        source,
    };
    let w0: Announced = c
        .ask(&announce(
            "w0",
            Some(EventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay: format!("tcp://127.0.0.1:{replay_port}"),
                model: "m".into(),
                salt: "s".into(),
            }),
        ))
        .decode();
    let w0 = w0.worker;

    // Phase 1. A: 6 engine blocks on both lanes = 12 keyspace blocks (a longer query
    // still scores 12). C (raw-byte hashes) and D (negative ints): 3 engine blocks = 6.
    publisher.wait_phase(1);
    await_scores(&mut c, A, 12, &[(w0, 12)]);
    await_scores(&mut c, A, 16, &[(w0, 12)]);
    await_scores(&mut c, C, 6, &[(w0, 6)]);
    await_scores(&mut c, D, 6, &[(w0, 6)]);
    // B came from data-parallel rank 1: its own holder, "w0#dp1", not w0.
    let chain_b = query_chain(B, 4);
    let mut tries = 0;
    while c.query(&keyspace(), &chain_b).scores.is_empty() && tries < 300 {
        std::thread::sleep(Duration::from_millis(50));
        tries += 1;
    }
    let dp1: Announced = c.ask(&announce("w0#dp1", None)).decode();
    assert!(!dp1.created, "the ingest announced rank 1 itself");
    assert_ne!(dp1.worker, w0);
    await_scores(&mut c, B, 4, &[(dp1.worker, 4)]);
    // The store with an unknown parent was skipped, not guessed.
    await_scores(&mut c, F, 4, &[]);

    // Phase 2. A: the full lane lost engine block 5 (holds keyspace [0,10)); the
    // sliding-window lane (W=64, 32-token blocks: the 2 engine blocks before p) lost
    // blocks 0-1 and holds [4,12). p must be even (lcm of the lanes' engine blocks);
    // p=12 fails the full lane, p=10 needs [6,10) on the window lane: held. So 10.
    // Block 2's GPU eviction does not count: its CPU copy still holds it.
    // E: its first two engine blocks came only through the replay of the gap, the
    // third continued them: 6. F's batch was malformed: nothing of it applied.
    publisher.next();
    publisher.wait_phase(2);
    await_scores(&mut c, E, 6, &[(w0, 6)]);
    await_scores(&mut c, A, 12, &[(w0, 10)]);
    await_scores(&mut c, F, 2, &[]);
    await_scores(&mut c, C, 6, &[(w0, 6)]);
    let m = server.scrape();
    assert_eq!(metric(&m, "kvix_ingest_gaps_total"), 1, "{m}");
    assert!(metric(&m, "kvix_ingest_replayed_total") >= 1, "{m}");
    assert_eq!(metric(&m, "kvix_ingest_malformed_total"), 1, "{m}");
    assert_eq!(
        metric(
            &m,
            "kvix_ingest_skipped_events_total{reason=\"unknown_parent\"}"
        ),
        1,
        "{m}"
    );
    assert_eq!(
        metric(&m, "kvix_ingest_blocks_stored_total{medium=\"cpu\"}"),
        1,
        "{m}"
    );

    // Phase 3: the engine restarted (seq back to 0): everything it and its rank 1 held
    // is gone; only what the new process stored counts.
    publisher.next();
    publisher.wait_phase(3);
    await_scores(&mut c, G, 4, &[(w0, 4)]);
    await_scores(&mut c, A, 12, &[]);
    await_scores(&mut c, B, 4, &[]);
    await_scores(&mut c, E, 6, &[]);
    let m = server.scrape();
    assert_eq!(metric(&m, "kvix_ingest_restarts_total"), 1, "{m}");
    assert_eq!(metric(&m, "kvix_ingest_refused_total"), 0, "{m}");
    publisher.next();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn vllm_array_encoding_end_to_end() {
    drive("array");
}

#[test]
fn vllm_map_encoding_end_to_end() {
    drive("map");
}

#[test]
fn an_unreachable_publisher_is_retried_and_never_hurts_the_server() {
    let server = Server::start(&["--cores", "1"]);
    let mut c = server.session();
    // A port nobody listens on (bound then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a: Announced = c
        .ask(&Announce {
            name: "ghost".into(),
            lanes: vec![Lane::full(16)],
            feed: Feed::Events,
            source: Some(EventSource {
                endpoint: format!("tcp://127.0.0.1:{port}"),
                replay: String::new(),
                model: "m".into(),
                salt: String::new(),
            }),
        })
        .decode();
    assert!(a.created);
    let mut failures = 0;
    for _ in 0..200 {
        failures = metric(&server.scrape(), "kvix_ingest_connect_failures_total");
        if failures >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(failures >= 2, "retried");
    assert_eq!(c.ask(&StatsRequest {}).kind, Kind::Stats);
    assert!(server.stop().success());
}
