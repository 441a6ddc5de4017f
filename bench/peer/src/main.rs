//! kvix-engine and NVIDIA Dynamo's indexer (`dynamo-kv-router` 1.6.1, its recommended
//! `ConcurrentRadixTreeCompressed` backend), side by side in one process: the same
//! events in the same order, one writer thread each, the same queries timed interleaved
//! (A/B, alternating which goes first), every answer compared per worker, heap bytes
//! counted by one allocator. Ratios are kvix / Dynamo (below 1: kvix is faster / smaller).
//!
//!     cargo run --release --manifest-path bench/peer/Cargo.toml -- [--quick] [--reps N]
//!         [--no-trace] [--trace PATH]

mod dynamo_side;
mod ingest_side;
mod kvix_side;
mod workload;

#[path = "../../../server/engine/benches/common/counting.rs"]
mod counting;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use dynamo_kv_router::protocols::LocalBlockHash;

use dynamo_side::Dynamo;
use kvix_side::Kvix;
use workload::{FleetShape, Workload};

#[global_allocator]
static ALLOC: counting::Counting = counting::Counting;

const HELP: &str = r#"kvix-peer-bench: kvix-engine vs dynamo-kv-router 1.6.1, same workload, same answers

  --quick        a tenth of the fleet (for a smoke run)
  --reps N       timed queries per prompt and side (default 3000)
  --rounds N     loads per side and workload, alternating which goes first;
                 the median time is reported (default 3)
  --trace PATH   the Mooncake trace (default: shared/data/mooncake_synthetic_trace.jsonl)
  --no-trace     skip the trace workload
  --only SIDE    only load the 32-block fleet into one side, three times (for a
                 profiler): kvix (events as the ingest sends them), kvix-named
                 (blocks named by engine hash), kvix-ingest (vLLM batches through
                 the server's translator, then the engine), kvix-decode (the
                 same from vLLM's msgpack bytes, decode included), kvix-translate
                 (the translator alone), index (the bare index), dynamo, or
                 dynamo-decode (from the same bytes: Dynamo's decode and
                 normalization, then its apply);
                 KVIX_PEER_WORKLOAD=decode loads the 1-block fleet instead,
                 KVIX_PEER_WORKLOAD=mooncake the trace; KVIX_PEER_VLLM=0.34
                 encodes the bytes as vLLM 0.34 does (tagged maps; default:
                 vLLM 0.9's arrays)
"#;

struct Args {
    reps: usize,
    rounds: usize,
    quick: bool,
    trace: Option<PathBuf>,
    /// Only load one side's fleet (for profiling): "kvix" or "dynamo".
    only: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        reps: 3000,
        rounds: 3,
        quick: false,
        only: None,
        trace: Some(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/data/mooncake_synthetic_trace.jsonl"),
        ),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--reps" => {
                a.reps = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--reps takes a number of timed queries per prompt")?
            }
            "--rounds" => {
                a.rounds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n > 0)
                    .ok_or("--rounds takes a positive number of loads per side")?
            }
            "--no-trace" => a.trace = None,
            "--only" => {
                a.only = Some(it.next().ok_or(
                    "--only takes kvix, kvix-named, kvix-ingest, kvix-decode, kvix-translate, index, dynamo or dynamo-decode",
                )?)
            }
            "--trace" => a.trace = Some(it.next().ok_or("--trace takes a path")?.into()),
            "-h" | "--help" => {
                print!("{HELP}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(a)
}

/// One workload loaded into both sides.
struct Pair {
    name: String,
    kvix: Kvix,
    dynamo: Dynamo,
    blocks: u64,
    stored: u64,
    /// Median load time over the rounds: kvix, Dynamo.
    load: (Duration, Duration),
    /// Median load time of kvix fed engine hashes (a client's feed, not the ingest's).
    named: Duration,
    /// Median load time of kvix fed vLLM's batches through the server's translator.
    ingest: Duration,
    /// The same from vLLM's msgpack bytes (the server's decode included).
    decoded: Duration,
    /// Heap bytes of that path: the translators' engine-hash maps and the engine.
    ingest_bytes: usize,
    /// Per round, Dynamo's load time over kvix's: both sides timed back to back, so a
    /// slow spell of the machine weighs on both alike.
    paired: Vec<f64>,
    /// Heap bytes: kvix engine (index + feeds), kvix index alone, Dynamo tree + lookups.
    memory: (usize, usize, usize),
}

fn load_kvix(w: &Workload, named: bool) -> (Kvix, Duration, usize) {
    let prepared = kvix_side::prepare(&w.load, named);
    let before = counting::live();
    let mut kvix = Kvix::new(w.workers);
    let t = kvix.apply(&prepared);
    let bytes = counting::live() - before;
    (kvix, t, bytes)
}

fn load_dynamo(w: &Workload) -> (Dynamo, Duration, usize) {
    let before = counting::live();
    let mut dynamo = Dynamo::new();
    let prepared = dynamo.prepare(&w.load);
    let queued = prepared.len() + 2;
    let t = dynamo.apply(prepared);
    let bytes = counting::live() - before - dynamo_side::channel_bytes(queued, counting::live);
    (dynamo, t, bytes)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Loads `w` into both sides `rounds` times, alternating which goes first, and reports
/// the median time. The first round's structures are kept for the queries (built in
/// fresh memory, as a server builds its index); later rounds are timed and dropped
/// (they reuse memory the allocator kept, so they time the index's own work rather than
/// the kernel faulting fresh pages in).
fn load(w: &Workload, rounds: usize) -> Pair {
    let stored: u64 = w.load.iter().map(|e| e.blocks()).sum();
    let (mut kt, mut dt, mut nt, mut it) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut ct = Vec::new();
    let batches = ingest_side::prepare(&w.load);
    let (mut first, mut ingest_bytes) = (None, None);
    for r in 0..rounds {
        let (k, d) = if r % 2 == 0 {
            let k = load_kvix(w, false);
            (k, load_dynamo(w))
        } else {
            let d = load_dynamo(w);
            (load_kvix(w, false), d)
        };
        nt.push(load_kvix(w, true).1);
        let through = |path| {
            let loaded = ingest_side::apply(w.workers, &batches, path, counting::live);
            assert_eq!(
                loaded.engine.stats().blocks,
                k.0.engine.stats().blocks,
                "the ingest path ({path:?}) stores the same tree"
            );
            loaded
        };
        let ingested = through(ingest_side::Path::Whole);
        it.push(ingested.took);
        ingest_bytes.get_or_insert(ingested.bytes);
        ct.push(through(ingest_side::Path::Decoded).took);
        kt.push(k.1);
        dt.push(d.1);
        if first.is_none() {
            first = Some((k, d));
        }
    }
    let ((kvix, _, kvix_bytes), (dynamo, _, dynamo_bytes)) = first.expect("at least one round");
    let blocks = kvix.engine.stats().blocks;
    let (index_bytes, index_blocks) = kvix_side::index_only(w, counting::live);
    assert_eq!(index_blocks, blocks);
    Pair {
        name: w.name.clone(),
        kvix,
        dynamo,
        blocks,
        stored,
        paired: kt
            .iter()
            .zip(&dt)
            .map(|(k, d)| d.as_secs_f64() / k.as_secs_f64())
            .collect(),
        load: (median(kt), median(dt)),
        named: median(nt),
        ingest: median(it),
        decoded: median(ct),
        ingest_bytes: ingest_bytes.expect("at least one round"),
        memory: (kvix_bytes, index_bytes, dynamo_bytes),
    }
}

/// Per-worker depths of every query on both sides; the count that agree.
fn agree(p: &mut Pair, w: &Workload) -> usize {
    let mut same = 0;
    for q in &w.queries {
        let (a, b) = (p.kvix.depths(q), p.dynamo.depths(q));
        if a == b {
            same += 1;
        } else if same + 5 > w.queries.len() {
            eprintln!("  {}: {} disagree: kvix {a:?} dynamo {b:?}", p.name, q.name);
        }
    }
    same
}

struct Timed {
    kvix: Vec<u64>,
    dynamo: Vec<u64>,
}

fn pct(v: &mut [u64], f: f64) -> f64 {
    v.sort_unstable();
    v[((v.len() as f64 * f) as usize).min(v.len() - 1)] as f64 / 1000.0
}

/// Times every query of `w` on both sides of every pair, `reps` times, interleaved:
/// per query, the sides go in turn, and which goes first alternates.
fn time_queries(pairs: &mut [&mut Pair], w: &Workload, reps: usize) -> Vec<Vec<Timed>> {
    let chains: Vec<Vec<u64>> = w
        .queries
        .iter()
        .map(|q| q.blocks.iter().map(|b| b.chain).collect())
        .collect();
    let locals: Vec<Vec<LocalBlockHash>> = w
        .queries
        .iter()
        .map(|q| q.blocks.iter().map(|b| LocalBlockHash(b.local)).collect())
        .collect();
    let mut out: Vec<Vec<Timed>> = pairs
        .iter()
        .map(|_| {
            (0..w.queries.len())
                .map(|_| Timed {
                    kvix: Vec::with_capacity(reps),
                    dynamo: Vec::with_capacity(reps),
                })
                .collect()
        })
        .collect();
    for r in 0..reps {
        for (i, p) in pairs.iter_mut().enumerate() {
            for q in 0..chains.len() {
                let t = &mut out[i][q];
                if (r + q) % 2 == 0 {
                    t.kvix.push(p.kvix.query(&chains[q]));
                    t.dynamo.push(p.dynamo.query(&locals[q]));
                } else {
                    t.dynamo.push(p.dynamo.query(&locals[q]));
                    t.kvix.push(p.kvix.query(&chains[q]));
                }
            }
        }
    }
    out
}

fn rate(blocks: u64, d: Duration) -> f64 {
    blocks as f64 / d.as_secs_f64() / 1e6
}

fn report_load(p: &Pair) {
    let (k, d) = p.load;
    let (km, im, dm) = p.memory;
    let per = |b: usize| b as f64 / p.blocks as f64;
    println!("\n## {}", p.name);
    println!(
        "{} distinct blocks in {} runs, {} block stores",
        p.blocks,
        p.kvix.engine.stats().runs,
        p.stored
    );
    let mut paired = p.paired.clone();
    paired.sort_unstable_by(f64::total_cmp);
    println!(
        "apply, Dynamo's time / kvix's in each round (both loaded back to back): {} (median {:.2})",
        p.paired
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        paired[paired.len() / 2]
    );
    println!("| figure | kvix | Dynamo CRTC | kvix / Dynamo |");
    println!("|---|---|---|---|");
    println!(
        "| apply stores, M block events/s (one writer thread) | {:.2} | {:.2} | {:.2}x faster |",
        rate(p.stored, k),
        rate(p.stored, d),
        d.as_secs_f64() / k.as_secs_f64()
    );
    println!(
        "| the same, kvix fed engine hashes (a client's feed; the ingest sends chain hashes) | {:.2} | {:.2} | {:.2}x faster |",
        rate(p.stored, p.named),
        rate(p.stored, d),
        d.as_secs_f64() / p.named.as_secs_f64()
    );
    println!(
        "| the same, kvix fed vLLM's batches through its ingest's translator (token rehash included) | {:.2} | {:.2} | {:.2}x faster |",
        rate(p.stored, p.ingest),
        rate(p.stored, d),
        d.as_secs_f64() / p.ingest.as_secs_f64()
    );
    println!(
        "| the same, from vLLM's msgpack bytes (the ingest's decode included) | {:.2} | {:.2} | {:.2}x faster |",
        rate(p.stored, p.decoded),
        rate(p.stored, d),
        d.as_secs_f64() / p.decoded.as_secs_f64()
    );
    println!(
        "| longest apply of one event, ms (kvix; an executor answers nothing meanwhile) | {:.2} | | |",
        p.kvix.longest.as_secs_f64() * 1e3
    );
    println!(
        "| heap B / distinct block: kvix index + feeds vs tree + lookups | {:.1} | {:.1} | {:.2} |",
        per(km),
        per(dm),
        km as f64 / dm as f64
    );
    println!(
        "| heap B / distinct block: kvix index alone vs tree + lookups | {:.1} | {:.1} | {:.2} |",
        per(im),
        per(dm),
        im as f64 / dm as f64
    );
    println!(
        "| heap B / distinct block: kvix ingest translators + engine vs tree + lookups | {:.1} | {:.1} | {:.2} |",
        per(p.ingest_bytes),
        per(dm),
        p.ingest_bytes as f64 / dm as f64
    );
}

fn report_queries(p: &Pair, w: &Workload, t: &mut [Timed]) {
    if w.queries.len() <= 4 {
        for (q, t) in w.queries.iter().zip(t.iter_mut()) {
            let (k50, k99) = (pct(&mut t.kvix, 0.5), pct(&mut t.kvix, 0.99));
            let (d50, d99) = (pct(&mut t.dynamo, 0.5), pct(&mut t.dynamo, 0.99));
            println!(
                "| query {}, p50 / p99 µs | {k50:.2} / {k99:.2} | {d50:.2} / {d99:.2} | {:.2} / {:.2} |",
                q.name,
                k50 / d50,
                k99 / d99
            );
        }
        return;
    }
    let mut all = Timed {
        kvix: t.iter().flat_map(|t| t.kvix.iter().copied()).collect(),
        dynamo: t.iter().flat_map(|t| t.dynamo.iter().copied()).collect(),
    };
    let (k50, k99) = (pct(&mut all.kvix, 0.5), pct(&mut all.kvix, 0.99));
    let (d50, d99) = (pct(&mut all.dynamo, 0.5), pct(&mut all.dynamo, 0.99));
    println!(
        "| query every request ({} prompts), p50 / p99 µs | {k50:.2} / {k99:.2} | {d50:.2} / {d99:.2} | {:.2} / {:.2} |",
        w.queries.len(),
        k50 / d50,
        k99 / d99
    );
    let _ = p;
}

extern "C" {
    fn mallopt(param: i32, value: i32) -> i32;
}

/// Keeps freed memory in the process (no mmap'd chunks, no trimming), so a structure
/// built after another was dropped reuses pages already faulted in: later rounds measure
/// the index's own work, not the kernel zeroing fresh pages (costly on this VM).
fn keep_freed_memory() {
    const M_TRIM_THRESHOLD: i32 = -1;
    const M_MMAP_MAX: i32 = -4;
    // SAFETY: mallopt only changes glibc malloc's tunables; called before any threads.
    unsafe {
        mallopt(M_MMAP_MAX, 0);
        mallopt(M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn main() {
    keep_freed_memory();
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvix-peer-bench: {e}");
            std::process::exit(2);
        }
    };
    let mut shape = FleetShape::default();
    if args.quick {
        shape.workers = 24;
        shape.chains = 20;
    }
    if let Some(side) = &args.only {
        let w = match std::env::var("KVIX_PEER_WORKLOAD").as_deref() {
            Ok("mooncake") => workload::mooncake(args.trace.as_deref().expect("a trace"), 16, 32)
                .expect("the trace loads"),
            Ok("decode") => workload::fleet(FleetShape {
                per_event: 1,
                ..shape
            }),
            _ => workload::fleet(shape),
        };
        for _ in 0..3 {
            let t = match side.as_str() {
                "kvix" | "kvix-named" => {
                    let mut k = Kvix::new(w.workers);
                    let t = k.apply(&kvix_side::prepare(&w.load, side == "kvix-named"));
                    println!("kvix: longest apply of one event {:?}", k.longest);
                    t
                }
                "kvix-ingest" | "kvix-decode" | "kvix-translate" => {
                    let path = match side.as_str() {
                        "kvix-ingest" => ingest_side::Path::Whole,
                        "kvix-decode" => ingest_side::Path::Decoded,
                        _ => ingest_side::Path::TranslatorOnly,
                    };
                    let batches = ingest_side::prepare(&w.load);
                    ingest_side::apply(w.workers, &batches, path, counting::live).took
                }
                "index" => {
                    let t = std::time::Instant::now();
                    kvix_side::index_only(&w, counting::live);
                    t.elapsed()
                }
                "dynamo" => {
                    let mut d = Dynamo::new();
                    let p = d.prepare(&w.load);
                    d.apply(p)
                }
                "dynamo-decode" => {
                    // From vLLM's bytes: Dynamo's decode and normalization (its
                    // listener's work), then its writer's apply; the sum is what one
                    // core spends, as kvix-decode's figure is.
                    let mut d = Dynamo::new();
                    let (p, decoding) = d.decode(&ingest_side::prepare(&w.load));
                    let applying = d.apply(p);
                    println!("dynamo-decode: decode + normalize {decoding:?}, apply {applying:?}");
                    decoding + applying
                }
                other => {
                    eprintln!(
                        "kvix-peer-bench: --only {other:?}: kvix, kvix-named, kvix-ingest, kvix-decode, kvix-translate, index, dynamo or dynamo-decode"
                    );
                    std::process::exit(2);
                }
            };
            println!(
                "{side}: {:.2} M block events/s",
                rate(w.load.iter().map(|e| e.blocks()).sum(), t)
            );
        }
        return;
    }
    println!("# kvix-engine vs dynamo-kv-router 1.6.1 (ConcurrentRadixTreeCompressed)");
    let mut runs: BTreeMap<&str, (Workload, Pair)> = BTreeMap::new();
    for (key, per_event) in [("a-multi", 32), ("b-decode", 1)] {
        shape.per_event = per_event;
        eprintln!("loading the fleet in {per_event}-block stores ...");
        let w = workload::fleet(shape);
        let mut p = load(&w, args.rounds);
        let same = agree(&mut p, &w);
        println!(
            "\n{}: answers agree on {same} of {} prompts after the load",
            w.name,
            w.queries.len()
        );
        runs.insert(key, (w, p));
    }
    // Queries on both load styles, interleaved with each other too.
    {
        let [(wa, pa), (wb, pb)] = ["a-multi", "b-decode"].map(|k| runs.remove(k).expect("loaded"));
        let (mut pa, mut pb) = (pa, pb);
        eprintln!("timing queries ...");
        let mut t = time_queries(&mut [&mut pa, &mut pb], &wa, args.reps);
        for (p, t) in [&pa, &pb].into_iter().zip(t.iter_mut()) {
            report_load(p);
            report_queries(p, &wa, t);
        }
        let style = |t: &mut Timed| pct(&mut t.kvix, 0.5);
        let [multi, single] = &mut t[..] else {
            unreachable!("two loads were timed")
        };
        for ((q, a), b) in wa.queries.iter().zip(multi).zip(single) {
            println!(
                "\nkvix query {} after 1-block stores / after 32-block stores, p50: {:.2}",
                q.name,
                style(b) / style(a)
            );
        }
        for (w, p) in [(&wa, &mut pa), (&wb, &mut pb)] {
            let prepared = kvix_side::prepare(&w.removals, false);
            let k = p.kvix.apply(&prepared);
            let removals = p.dynamo.prepare(&w.removals);
            let d = p.dynamo.apply(removals);
            let removed: u64 = w.removals.iter().map(|e| e.blocks()).sum();
            let (kl, dl) = p.load;
            println!(
                "\n{}: removals {:.2} vs {:.2} M block events/s; stores + removals {:.2} vs {:.2} M/s ({:.2}x faster); answers agree on {} of {} prompts after removals",
                w.name,
                rate(removed, k),
                rate(removed, d),
                rate(p.stored + removed, kl + k),
                rate(p.stored + removed, dl + d),
                (dl + d).as_secs_f64() / (kl + k).as_secs_f64(),
                agree(p, w),
                w.queries.len()
            );
        }
    }
    if let Some(path) = args.trace {
        eprintln!("routing the Mooncake trace ...");
        match workload::mooncake(&path, 16, 32) {
            Err(e) => eprintln!("kvix-peer-bench: skipping the trace: {e}"),
            Ok(w) => {
                let mut p = load(&w, args.rounds);
                let same = agree(&mut p, &w);
                let reps = (args.reps / 300).max(3);
                let mut t = time_queries(&mut [&mut p], &w, reps);
                report_load(&p);
                report_queries(&p, &w, &mut t[0]);
                println!("answers agree on {same} of {} prompts", w.queries.len());
            }
        }
    }
}
