//! `latency --http`: kvix's HTTP API (kvix-server `--http`) and Dynamo's standalone KV
//! indexer (`bench/peer`'s `dynamo-indexer`) queried side by side with the same
//! keep-alive client, the order of the two and of the floor rotating, the floor an HTTP
//! echo of the same request and reply sizes on kvix's listener (`POST /echo`).
//!
//! Both are fed the same way, by this process: one bound vLLM-style publisher per
//! engine (a PUB socket and a replay ROUTER, vLLM 0.34's batches byte for byte),
//! registered with each (`POST /register`); every engine holds the dataset's system
//! prefix, and each prompt is held whole by one engine, to half by another and to a
//! quarter by a third. The run waits until the two answer every prompt alike.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvix_events::payload::{EngineEvent, Stored};
use kvix_testkit::http::{Http, Reply};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::fleet::engine::payload_now;
use crate::net::Dataset;
use crate::rng::Rng;
use crate::stats::{histogram, record, Ratios, Summary};

/// The model every engine serves here.
const MODEL: &str = "kvix-bench";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HttpLatencyConfig {
    pub kvix: SocketAddr,
    pub dynamo: Option<SocketAddr>,
    pub blocks: Vec<u32>,
    pub queries: usize,
    pub warmup: usize,
    pub engines: usize,
    pub chains_per_length: usize,
    pub system_blocks: u32,
    pub token_block: u32,
    pub seed: u64,
    pub max_seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HttpLatencyRow {
    pub blocks: u32,
    /// Mean request and kvix reply bytes (bodies).
    pub request_bytes: usize,
    pub reply_bytes: usize,
    pub kvix: Summary,
    pub floor: Summary,
    pub dynamo: Option<Summary>,
    /// kvix / floor per percentile.
    pub kvix_over_floor: Ratios,
    /// Dynamo / kvix per percentile: how many times faster kvix answers.
    pub dynamo_over_kvix: Option<Ratios>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HttpLatencyReport {
    pub command: String,
    pub config: HttpLatencyConfig,
    pub rows: Vec<HttpLatencyRow>,
}

/// One engine's event sockets, served by a thread of its own: its batches first, then
/// an empty batch every 100 ms (a subscriber that joined late sees the gap and asks
/// the replay for what it missed), and the replay meanwhile.
struct Engine {
    endpoint: String,
    replay: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    fn start(ctx: &zmq::Context, batches: Vec<Vec<EngineEvent>>) -> anyhow::Result<Engine> {
        let publisher = ctx.socket(zmq::PUB)?;
        publisher.set_linger(0)?;
        publisher.set_sndhwm(100_000)?;
        publisher.bind("tcp://127.0.0.1:*")?;
        let replay = ctx.socket(zmq::ROUTER)?;
        replay.set_linger(0)?;
        replay.set_sndhwm(100_000)?;
        replay.bind("tcp://127.0.0.1:*")?;
        let endpoint = last_endpoint(&publisher)?;
        let replay_at = last_endpoint(&replay)?;
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::spawn(move || {
            let topic = b"kv".to_vec();
            let mut sent: Vec<Vec<u8>> = Vec::new();
            let send = |events: Vec<EngineEvent>, sent: &mut Vec<Vec<u8>>| {
                let payload = payload_now(events);
                let seq = sent.len() as u64;
                let frames = [&topic[..], &seq.to_be_bytes()[..], &payload[..]];
                let _ = publisher.send_multipart(frames, 0);
                sent.push(payload);
            };
            for b in batches {
                send(b, &mut sent);
            }
            let mut beat = Instant::now();
            while !halt.load(Ordering::Relaxed) {
                if replay.poll(zmq::POLLIN, 20).unwrap_or(0) > 0 {
                    serve_replay(&replay, &topic, &sent);
                }
                if beat.elapsed() > Duration::from_millis(100) {
                    send(Vec::new(), &mut sent);
                    beat = Instant::now();
                }
            }
        });
        Ok(Engine {
            endpoint,
            replay: replay_at,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn last_endpoint(s: &zmq::Socket) -> anyhow::Result<String> {
    s.get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("a bound socket's endpoint is not UTF-8"))
}

/// `[id, "", start]` gets `[id, "", topic, seq, payload]` for every batch from `start`,
/// then the end marker (seq -1, empty payload), as vLLM 0.34's replay answers.
fn serve_replay(replay: &zmq::Socket, topic: &[u8], sent: &[Vec<u8>]) {
    while let Ok(req) = replay.recv_multipart(zmq::DONTWAIT) {
        let [id, _, start] = &req[..] else { continue };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            continue;
        };
        for (seq, payload) in sent.iter().enumerate().skip(start as usize) {
            let seq = (seq as u64).to_be_bytes();
            let _ = replay.send_multipart([&id[..], b"", topic, &seq[..], &payload[..]], 0);
        }
        let end = (-1i64).to_be_bytes();
        let _ = replay.send_multipart([&id[..], b"", b"", &end[..], b""], 0);
    }
}

/// The engine hash of a block after `parent` (the same on every engine, as vLLM's with
/// a fixed hash seed).
fn engine_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1 << 63
}

/// A GPU store of `tokens`' whole blocks from the start of a prompt.
fn store(tokens: &[u32], block: u32) -> EngineEvent {
    let mut parent = 0x5EED;
    let hashes: Vec<u64> = tokens
        .chunks_exact(block as usize)
        .map(|b| {
            parent = engine_hash(parent, b);
            parent
        })
        .collect();
    let n = hashes.len() * block as usize;
    EngineEvent::Stored(Stored::plain(hashes, None, tokens[..n].to_vec(), block))
}

/// Each engine's stores: the system prefix, then its holdings.
fn engine_batches(ds: &Dataset) -> Vec<Vec<Vec<EngineEvent>>> {
    let b = ds.token_block;
    let sys = ds
        .tokens
        .iter()
        .flatten()
        .find(|t| t.len() >= (ds.system_blocks * b) as usize)
        .map(|t| t[..(ds.system_blocks * b) as usize].to_vec())
        .unwrap_or_default();
    let mut out: Vec<Vec<Vec<EngineEvent>>> = vec![vec![vec![store(&sys, b)]]; ds.workers.len()];
    for &(w, g, c, depth) in &ds.holdings {
        let tokens = &ds.tokens[g][c][..(depth * b) as usize];
        out[w].push(vec![store(tokens, b)]);
    }
    out
}

fn post(http: &mut Http, path: &str, body: &[u8]) -> anyhow::Result<Reply> {
    http.request("POST", path, &[("Content-Type", "application/json")], body)
        .ok_or_else(|| anyhow::anyhow!("the connection closed on {path}"))
}

pub fn run(
    cfg: &HttpLatencyConfig,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<HttpLatencyReport> {
    let ds = Dataset::build(
        cfg.seed,
        cfg.token_block,
        cfg.engines,
        &cfg.blocks,
        cfg.chains_per_length,
        cfg.system_blocks,
    );
    let ctx = zmq::Context::new();
    let engines: Vec<Engine> = engine_batches(&ds)
        .into_iter()
        .map(|b| Engine::start(&ctx, b))
        .collect::<anyhow::Result<_>>()?;
    let mut kvix = Http::open(cfg.kvix);
    let mut dynamo = cfg.dynamo.map(Http::open);
    // A fresh instance id range each run, so a service left running from an earlier run
    // does not refuse the registrations.
    let first_id = Rng::new(cfg.seed ^ u64::from(std::process::id())).next_u64() >> 16;
    for (i, e) in engines.iter().enumerate() {
        let body = json!({
            "instance_id": first_id + i as u64,
            "endpoint": e.endpoint,
            "replay_endpoint": e.replay,
            "model_name": MODEL,
            "block_size": cfg.token_block,
        })
        .to_string();
        for http in std::iter::once(&mut kvix).chain(dynamo.as_mut()) {
            let r = post(http, "/register", body.as_bytes())?;
            anyhow::ensure!(r.status == 201, "/register: {} {}", r.status, r.text());
        }
    }
    let bodies: Vec<Vec<Vec<u8>>> = ds
        .tokens
        .iter()
        .map(|group| {
            group
                .iter()
                .map(|t| {
                    json!({"token_ids": t, "model_name": MODEL})
                        .to_string()
                        .into_bytes()
                })
                .collect()
        })
        .collect();
    let reply_bytes = settle(&mut kvix, dynamo.as_mut(), &bodies, &ds, cfg.engines)?;
    pb.set_length((cfg.blocks.len() * (cfg.queries + cfg.warmup)) as u64);
    let mut rng = Rng::new(cfg.seed ^ 0x4874_7470);
    let mut rows = Vec::new();
    for (g, &len) in ds.lengths.iter().enumerate() {
        let mut hk = histogram();
        let mut hd = histogram();
        let mut hf = histogram();
        let (mut req_sum, mut rep_sum, mut n) = (0usize, 0usize, 0usize);
        let start = Instant::now();
        for i in 0..cfg.warmup + cfg.queries {
            if start.elapsed().as_secs_f64() > cfg.max_seconds {
                break;
            }
            let c = rng.below(bodies[g].len() as u64) as usize;
            let body = &bodies[g][c];
            let echo = format!("/echo?bytes={}", reply_bytes[g][c]);
            let measured = i >= cfg.warmup;
            // Rotate which of the three goes first.
            for step in 0..3 {
                let t = Instant::now();
                match (i + step) % 3 {
                    0 => {
                        let r = post(&mut kvix, "/query", body)?;
                        anyhow::ensure!(r.status == 200, "kvix /query: {}", r.status);
                        if measured {
                            record(&mut hk, t.elapsed().as_nanos() as u64);
                            (req_sum, rep_sum, n) =
                                (req_sum + body.len(), rep_sum + r.body.len(), n + 1);
                        }
                    }
                    1 => {
                        let Some(d) = dynamo.as_mut() else { continue };
                        let r = post(d, "/query", body)?;
                        anyhow::ensure!(r.status == 200, "Dynamo /query: {}", r.status);
                        if measured {
                            record(&mut hd, t.elapsed().as_nanos() as u64);
                        }
                    }
                    _ => {
                        let r = post(&mut kvix, &echo, body)?;
                        anyhow::ensure!(r.status == 200, "kvix /echo: {}", r.status);
                        if measured {
                            record(&mut hf, t.elapsed().as_nanos() as u64);
                        }
                    }
                }
            }
            pb.inc(1);
        }
        let (k, f) = (Summary::of(&hk), Summary::of(&hf));
        let d = dynamo.is_some().then(|| Summary::of(&hd));
        rows.push(HttpLatencyRow {
            blocks: len,
            request_bytes: req_sum / n.max(1),
            reply_bytes: rep_sum / n.max(1),
            kvix_over_floor: k.ratio(&f),
            dynamo_over_kvix: d.as_ref().map(|d| d.ratio(&k)),
            kvix: k,
            floor: f,
            dynamo: d,
        });
    }
    pb.finish_and_clear();
    drop(engines);
    Ok(HttpLatencyReport {
        command: "latency --http".into(),
        config: cfg.clone(),
        rows,
    })
}

/// Waits until both services answer every prompt, and alike (Dynamo's as kvix's, as
/// parsed JSON) with every engine in the system prefix's answer; the bytes of kvix's
/// answer to each prompt, for the floor's echo.
fn settle(
    kvix: &mut Http,
    mut dynamo: Option<&mut Http>,
    bodies: &[Vec<Vec<u8>>],
    ds: &Dataset,
    engines: usize,
) -> anyhow::Result<Vec<Vec<usize>>> {
    let sys = ds.tokens.iter().flatten().next().map(|t| {
        let n = (ds.system_blocks * ds.token_block) as usize;
        json!({"token_ids": &t[..n.min(t.len())], "model_name": MODEL}).to_string()
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let answer = |http: &mut Http, body: &[u8]| -> anyhow::Result<Value> {
        let r = post(http, "/query", body)?;
        Ok(serde_json::from_slice(&r.body).unwrap_or(Value::Null))
    };
    if let Some(sys) = sys {
        loop {
            let k = answer(kvix, sys.as_bytes())?;
            let all = |v: &Value| v["scores"].as_object().is_some_and(|s| s.len() == engines);
            let d_all = match dynamo.as_deref_mut() {
                Some(d) => all(&answer(d, sys.as_bytes())?),
                None => true,
            };
            if all(&k) && d_all {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the engines' stores never all arrived"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut sizes = Vec::new();
    for group in bodies {
        let mut row = Vec::new();
        for body in group {
            loop {
                let r = post(kvix, "/query", body)?;
                let k: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                let same = match dynamo.as_deref_mut() {
                    Some(d) => answer(d, body)? == k,
                    None => true,
                };
                if same && k["scores"].as_object().is_some_and(|s| !s.is_empty()) {
                    row.push(r.body.len());
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "kvix and Dynamo never agreed on a prompt"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        sizes.push(row);
    }
    Ok(sizes)
}
