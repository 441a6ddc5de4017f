//! kvix's HTTP API against NVIDIA Dynamo's standalone KV indexer (`dynamo-kv-router`
//! 1.6.1, feature `standalone-indexer`), value for value. Dynamo's indexer runs in
//! process (its own router on a listener of this test's, `AppState::new`,
//! `signal_ready`); kvix-server runs as built, with `--http`. The same real vLLM 0.34
//! publishers (scripts/engines.py: the release's own `kv_events.py`) feed both: three
//! engines (an instance of two DP ranks and one of one), each a GPU cache that spills
//! its least recently used blocks into a CPU cache that spills into storage, as vLLM's
//! offloading connector publishes it (a self-describing store in the lower tier, then
//! the removal from the upper), and one engine restarted mid-way (re-registered, as an
//! operator would). Prompts drawn from the published sequences and cut at random
//! points, with divergent suffixes, go to both; the answers (`scores`, `frequencies`,
//! `instances`) must be equal as JSON values, with coverage floors so the comparison
//! cannot pass on empty answers. Bad requests (an unknown model, a cache salt on
//! `/query_by_hash`, malformed and oversized bodies) get the same status codes and
//! error shapes.
//!
//! Kept out on purpose (docs/operations.md, "HTTP API"): hybrid lanes, legacy
//! offloading placeholders, raw vLLM salts, wildcard endpoints.
//!
//! Needs kvix-server built (`cargo build -p kvix-server` in the repository root, or
//! `KVIX_SERVER` naming the binary) and the tests' Python (scripts/testenv.py).

use std::collections::HashMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dynamo_kv_router::services::indexer::server::{create_router, AppState};
use kvix_testkit::engines::{available, Ports, Publisher};
use kvix_testkit::http::{Http, Reply};
use serde_json::{json, Value};

const V034: &str = "vllm-0.34.0";
const BLOCK: u32 = 16;
const MODEL: &str = "llama";

/// Dynamo's indexer, served on a runtime of its own.
struct Dynamo {
    addr: SocketAddr,
    _runtime: tokio::runtime::Runtime,
}

impl Dynamo {
    fn start() -> Dynamo {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("a port for Dynamo's indexer");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(AppState::new(1).expect("Dynamo's indexer state"));
        // Without it Dynamo's listeners never consume (run_server calls it once ready).
        state.registry.signal_ready();
        let app = create_router(state);
        runtime.spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("Dynamo's indexer serves");
        });
        Dynamo {
            addr,
            _runtime: runtime,
        }
    }
}

/// kvix-server with `--http`, killed when dropped.
struct Kvix {
    child: Child,
    http: SocketAddr,
}

impl Kvix {
    fn start() -> Kvix {
        let bin = std::env::var_os("KVIX_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/kvix-server")
            });
        assert!(
            bin.exists(),
            "{} is missing: run `cargo build -p kvix-server` in the repository root (or set KVIX_SERVER)",
            bin.display()
        );
        let mut child = Command::new(&bin)
            .args(["--cores", "2", "--listen", "127.0.0.1:0", "--unix", ""])
            .args(["--metrics", "", "--http", "127.0.0.1:0"])
            .env("KVIX_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .expect("kvix-server starts");
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // Dropped (killed and waited for) however the start goes.
        let mut kvix = Kvix {
            child,
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("kvix-server prints its HTTP address");
            if let Some(rest) = line.split("HTTP API on http://").nth(1) {
                kvix.http = rest.trim().parse().unwrap();
                return kvix;
            }
        }
    }
}

impl Drop for Kvix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small deterministic generator (splitmix64), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The engine hash of a block after `parent`: the same on every engine (vLLM with a
/// fixed hash seed), above 2^63 as vLLM's u64 hashes often are.
fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = parent.unwrap_or(0x5EED) ^ 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1 << 63
}

/// One cache tier of an engine: blocks by engine hash with their last use.
#[derive(Default)]
struct Tier {
    capacity: usize,
    used: HashMap<u64, u64>,
}

impl Tier {
    fn with(capacity: usize) -> Tier {
        Tier {
            capacity,
            used: HashMap::new(),
        }
    }
    /// The least recently used block, when over capacity.
    fn over(&mut self) -> Option<u64> {
        if self.used.len() <= self.capacity {
            return None;
        }
        let (&h, _) = self.used.iter().min_by_key(|(&h, &t)| (t, h))?;
        self.used.remove(&h);
        Some(h)
    }
}

/// A block's content, for stores in any tier.
#[derive(Clone)]
struct Block {
    parent: Option<u64>,
    tokens: Vec<u32>,
}

/// One engine (a DP rank): its caches, its publisher, where it is registered.
struct Engine {
    instance: u64,
    rank: u32,
    ports: Ports,
    /// None only while it restarts.
    publisher: Option<Publisher>,
    gpu: Tier,
    cpu: Tier,
    storage: Tier,
    clock: u64,
}

fn store(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Value {
    json!({
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": null,
        "medium": medium,
        "lora_name": null,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    })
}

fn removal(h: u64, medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0})
}

impl Engine {
    /// Serves a prompt: stores on GPU what it lacks (its GPU cache holds whole prefixes,
    /// so the first missing block's parent is there), uses the prefix newest-first from
    /// its end (vLLM frees a request's blocks tail first), then spills what is over each
    /// tier's capacity into the next: a store there, then the removal here.
    fn serve(&mut self, prompt: &[u32], blocks: &mut HashMap<u64, Block>) -> Vec<Value> {
        let mut hashes = Vec::new();
        let mut parent = None;
        for tokens in prompt.chunks_exact(BLOCK as usize) {
            let h = engine_hash(parent, tokens);
            blocks.entry(h).or_insert_with(|| Block {
                parent,
                tokens: tokens.to_vec(),
            });
            hashes.push(h);
            parent = Some(h);
        }
        let mut events = Vec::new();
        let held = hashes
            .iter()
            .take_while(|h| self.gpu.used.contains_key(h))
            .count();
        if held < hashes.len() {
            let from = held * BLOCK as usize;
            let to = hashes.len() * BLOCK as usize;
            let parent = held.checked_sub(1).map(|i| hashes[i]);
            events.push(store(&hashes[held..], parent, &prompt[from..to], "GPU"));
        }
        for &h in hashes.iter().rev() {
            self.clock += 1;
            self.gpu.used.insert(h, self.clock);
        }
        while let Some(h) = self.gpu.over() {
            if !self.cpu.used.contains_key(&h) {
                let b = &blocks[&h];
                events.push(store(&[h], b.parent, &b.tokens, "CPU"));
                self.clock += 1;
                self.cpu.used.insert(h, self.clock);
            }
            events.push(removal(h, "GPU"));
            while let Some(c) = self.cpu.over() {
                if !self.storage.used.contains_key(&c) {
                    let b = &blocks[&c];
                    events.push(store(&[c], b.parent, &b.tokens, "STORAGE"));
                    self.clock += 1;
                    self.storage.used.insert(c, self.clock);
                }
                events.push(removal(c, "CPU"));
            }
        }
        events
    }

    fn registration(&self) -> Value {
        json!({
            "instance_id": self.instance,
            "endpoint": self.ports.endpoint(self.rank as u16),
            "replay_endpoint": self.ports.replay(self.rank as u16),
            "model_name": MODEL,
            "block_size": BLOCK,
            "dp_rank": self.rank,
        })
    }
}

/// Both indexers' HTTP APIs.
struct Both {
    kvix: Http,
    dynamo: Http,
}

impl Both {
    fn post(&mut self, path: &str, body: &Value) -> (Reply, Reply) {
        (self.kvix.post(path, body), self.dynamo.post(path, body))
    }

    /// Registers (or unregisters) on both; both must take it.
    fn must(&mut self, path: &str, body: &Value, status: u16) {
        let (k, d) = self.post(path, body);
        assert_eq!(
            (k.status, d.status),
            (status, status),
            "{path} {body}: kvix {} / Dynamo {}",
            k.text(),
            d.text()
        );
    }

    /// Both answers to a query, once they agree (Dynamo applies lower tiers on threads
    /// of its own, so its answer may lag a moment); the last pair when they never do.
    fn query(&mut self, body: &Value) -> (Value, Value) {
        let mut last = (Value::Null, Value::Null);
        for _ in 0..100 {
            let (k, d) = self.post("/query", body);
            last = (reply_value(&k), reply_value(&d));
            if last.0 == last.1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last
    }
}

/// A reply as one comparable value: status, and the JSON body (or the text).
fn reply_value(r: &Reply) -> Value {
    let body = match r.header("content-type") {
        Some("application/json") => serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        _ => Value::String(r.text()),
    };
    json!({"status": r.status, "body": body})
}

/// What a set of answers covered.
#[derive(Debug, Default)]
struct Coverage {
    queries: usize,
    non_empty: usize,
    cpu_past_gpu: usize,
    disk_past_cpu: usize,
    two_ranks: usize,
}

impl Coverage {
    fn add(&mut self, answer: &Value) {
        self.queries += 1;
        let Some(instances) = answer["body"]["instances"].as_object() else {
            return;
        };
        self.non_empty += usize::from(!instances.is_empty());
        let any = |f: &dyn Fn(&Value) -> bool| instances.values().any(f);
        let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
        self.cpu_past_gpu += usize::from(any(&|i| n(i, "cpu") > n(i, "gpu")));
        self.disk_past_cpu += usize::from(any(&|i| n(i, "disk") > n(i, "cpu")));
        let ranks = |i: &Value| {
            i["dp"]
                .as_object()
                .map_or(0, |dp| dp.values().filter(|v| v.as_u64() > Some(0)).count())
        };
        self.two_ranks += usize::from(any(&|i| ranks(i) >= 2));
    }
}

/// Sequences from a prefix tree: system prompts, each with conversations that go on.
fn corpus(rng: &mut Rng) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for s in 0..6u32 {
        let system: Vec<u32> = (0..3 * BLOCK).map(|i| 1_000 + s * 1_000 + i).collect();
        for c in 0..6u32 {
            let turns = 2 + rng.below(10) as u32;
            let convo: Vec<u32> = (0..turns * BLOCK)
                .map(|i| 100_000 + s * 10_000 + c * 1_000 + i)
                .collect();
            out.push([system.clone(), convo].concat());
        }
    }
    out
}

#[test]
fn kvix_and_dynamos_indexer_answer_alike() {
    if available("kvix_and_dynamos_indexer_answer_alike").is_none() {
        return;
    }
    let dynamo = Dynamo::start();
    let kvix = Kvix::start();
    let mut both = Both {
        kvix: Http::open(kvix.http),
        dynamo: Http::open(dynamo.addr),
    };
    let mut rng = Rng(0x4b56_4958);
    let sequences = corpus(&mut rng);
    let (ports_a, pubs_a) = Ports::start_ranks(V034, 2);
    let (ports_b, pubs_b) = Ports::start_ranks(V034, 1);
    let engine = |instance, rank: u32, ports: Ports, publisher, gpu| Engine {
        instance,
        rank,
        ports,
        publisher: Some(publisher),
        gpu: Tier::with(gpu),
        cpu: Tier::with(60),
        storage: Tier::with(usize::MAX),
        clock: 0,
    };
    let mut engines = Vec::new();
    for (rank, p) in pubs_a.into_iter().enumerate() {
        engines.push(engine(10, rank as u32, ports_a, p, 30));
    }
    for p in pubs_b {
        engines.push(engine(11, 0, ports_b, p, 45));
    }
    for e in &engines {
        both.must("/register", &e.registration(), 201);
    }

    let mut blocks: HashMap<u64, Block> = HashMap::new();
    let mut served: Vec<Vec<u32>> = Vec::new();
    let mut coverage = Coverage::default();
    let mut mismatches = Vec::new();
    for round in 0..4 {
        for _ in 0..25 {
            for e in engines.iter_mut() {
                let seq = &sequences[rng.below(sequences.len() as u64) as usize];
                // A prefix of the sequence, whole blocks (a conversation so far).
                let upto =
                    (4 + rng.below(seq.len() as u64 / BLOCK as u64)) as usize * BLOCK as usize;
                let prompt = &seq[..upto.min(seq.len())];
                let events = e.serve(prompt, &mut blocks);
                e.publisher.as_mut().expect("a publisher").publish(events);
                served.push(prompt.to_vec());
            }
        }
        if round == 1 {
            // Engine 1 (instance 10, rank 1) restarts: a new process with an empty cache;
            // its registration is renewed on both, as an operator's controller would.
            let e = &mut engines[1];
            let unregister = json!({"instance_id": e.instance, "model_name": MODEL,
                "routing_group": "default", "dp_rank": e.rank});
            both.must("/unregister", &unregister, 200);
            // The old process goes first: the new one binds the same ports.
            if let Some(old) = e.publisher.take() {
                old.stop();
            }
            e.publisher = Some(e.ports.restart_rank(V034, 1));
            (e.gpu, e.cpu, e.storage) = (Tier::with(30), Tier::with(60), Tier::with(usize::MAX));
            both.must("/register", &e.registration(), 201);
        }
        // Prompts from what was served, cut anywhere, with a suffix of their own.
        for q in 0..120 {
            let base = &served[rng.below(served.len() as u64) as usize];
            let cut = rng.below(base.len() as u64 + 1) as usize;
            let suffix: Vec<u32> = (0..rng.below(40) as u32)
                .map(|i| 900_000 + q * 50 + i)
                .collect();
            let tokens = [&base[..cut], &suffix[..]].concat();
            let body = json!({"token_ids": tokens, "model_name": MODEL});
            let (k, d) = both.query(&body);
            if k != d {
                mismatches.push(format!(
                    "round {round}, query {q} (cut {cut}):\n kvix   {k}\n Dynamo {d}"
                ));
            }
            coverage.add(&k);
        }
    }
    for p in engines.into_iter().filter_map(|e| e.publisher) {
        p.stop();
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} answers differ; first: {}",
        mismatches.len(),
        coverage.queries,
        mismatches
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let share = |n: usize| n as f64 / coverage.queries as f64;
    eprintln!("coverage: {coverage:?}");
    assert!(share(coverage.non_empty) >= 0.5, "{coverage:?}");
    assert!(share(coverage.cpu_past_gpu) >= 0.10, "{coverage:?}");
    assert!(share(coverage.disk_past_cpu) >= 0.01, "{coverage:?}");
    assert!(coverage.two_ranks >= 1, "{coverage:?}");
}

/// Bad requests: the same status codes and error shapes from both (the text of an
/// axum rejection may differ by serde's path prefix: compared up to its first colon).
#[test]
fn bad_requests_are_refused_alike() {
    let dynamo = Dynamo::start();
    let kvix = Kvix::start();
    let mut both = Both {
        kvix: Http::open(kvix.http),
        dynamo: Http::open(dynamo.addr),
    };
    let register = json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": MODEL, "block_size": BLOCK});
    both.must("/register", &register, 201);
    let shape = |r: &Reply| -> Value {
        let body = match r.header("content-type") {
            Some("application/json") => serde_json::from_slice(&r.body).unwrap_or(Value::Null),
            _ => Value::String(r.text().split(':').next().unwrap_or("").to_string()),
        };
        json!({"status": r.status, "type": r.header("content-type"), "body": body})
    };
    // (path, headers, body)
    type Case = (&'static str, Vec<(&'static str, &'static str)>, Vec<u8>);
    let cases: Vec<Case> = vec![
        ("/query", vec![("Content-Type", "application/json")], br#"{"token_ids":[1,2,3],"model_name":"unknown"}"#.to_vec()),
        ("/query_by_hash", vec![("Content-Type", "application/json")], br#"{"block_hashes":[1],"model_name":"llama","cache_salt":"s"}"#.to_vec()),
        ("/query_by_hash", vec![("Content-Type", "application/json")], br#"{"block_hashes":[1],"model_name":"unknown"}"#.to_vec()),
        ("/query", vec![], br#"{"token_ids":[1],"model_name":"llama"}"#.to_vec()),
        ("/query", vec![("Content-Type", "text/json")], br#"{"token_ids":[1],"model_name":"llama"}"#.to_vec()),
        ("/query", vec![("Content-Type", "application/json")], br#"{"token_ids":[1,"#.to_vec()),
        ("/query", vec![("Content-Type", "application/json")], br#"{"token_ids":[1]}"#.to_vec()),
        ("/query", vec![("Content-Type", "application/json")], br#"{"token_ids":[-1],"model_name":"llama"}"#.to_vec()),
        ("/register", vec![("Content-Type", "application/json")], br#"{"instance_id":2,"endpoint":"localhost:5557","model_name":"llama","block_size":16}"#.to_vec()),
        ("/register", vec![("Content-Type", "application/json")], register.to_string().into_bytes()),
        ("/unregister", vec![("Content-Type", "application/json")], br#"{"instance_id":99,"model_name":"llama"}"#.to_vec()),
    ];
    for (path, headers, body) in cases {
        // A connection each: after a refusal a server may close one (hyper does when it
        // did not read the body).
        let ask = |addr| Http::open(addr).request("POST", path, &headers, &body);
        let k = ask(kvix.http).expect("kvix replies");
        let d = ask(dynamo.addr).expect("Dynamo replies");
        assert_eq!(
            shape(&k),
            shape(&d),
            "{path} {}",
            String::from_utf8_lossy(&body)
        );
    }
    // Over 8 MiB: refused by both, from its length alone.
    let huge = vec![b' '; (8 << 20) + 1];
    let mut statuses = Vec::new();
    for addr in [kvix.http, dynamo.addr] {
        let mut c = Http::open(addr);
        let r = c.request(
            "POST",
            "/query",
            &[("Content-Type", "application/json")],
            &huge,
        );
        statuses.push(r.map(|r| r.status));
    }
    assert_eq!(statuses, [Some(413), Some(413)]);
    let (k, d) = (both.kvix.get("/health"), both.dynamo.get("/health"));
    assert_eq!((k.status, k.body.len()), (d.status, d.body.len()));
}
