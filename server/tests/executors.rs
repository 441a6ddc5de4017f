//! Every executor answers from its own copy: queries make no cross-executor call, a
//! write acknowledged on one connection is seen by the next query on any executor, and
//! a long write is applied in slices that queries can run between.

mod common;

use common::*;
use kvix_wire::*;

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
}

/// Per executor: queries it answered.
fn per_executor(text: &str) -> Vec<u64> {
    text.lines()
        .filter(|l| l.starts_with("kvix_executor_queries_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn queries_never_leave_their_executor_and_see_writes_acknowledged_anywhere() {
    let server = Server::start(&["--cores", "2", "--pin", "false", "--steering", "none"]);
    let ks = Keyspace::tokens("m");
    // Enough connections that both executors get some (kernel 4-tuple hashing).
    let mut conns: Vec<Conn> = (0..16).map(|_| server.session()).collect();
    let ids: Vec<u32> = (0..8)
        .map(|w| conns[0].events_worker(&format!("w{w}")))
        .collect();
    for (round, &w) in ids.iter().enumerate() {
        let chain = chain_of(&ks, round as u32 * 1000, 4 + round);
        // Written on one connection, read at once on every other: an acknowledged write
        // is in every executor's copy (the reply waits for all of them).
        let writer = round % conns.len();
        let r = conns[writer].ask(&stored_batch(w, 0, &ks, &chain));
        assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
        for c in &mut conns {
            let a = c.query(&ks, &chain);
            assert_eq!(
                a.scores,
                vec![Score {
                    worker: w,
                    blocks: chain.len() as u32
                }]
            );
        }
    }
    let text = server.scrape();
    let spread = per_executor(&text);
    assert_eq!(spread.len(), 2, "{text}");
    assert!(
        spread.iter().all(|&q| q > 0),
        "both executors answered queries: {spread:?}"
    );
    assert_eq!(metric(&text, "kvix_query_hops_total"), 0);
}

/// A 4 MiB event batch (half a million blocks: a store with engine hashes, then their
/// removal) is fed in slices as well as applied in them: its feed step on the home (a
/// name per block) used to run whole, tens of milliseconds that queries waited behind.
#[test]
fn a_huge_event_batch_is_fed_and_applied_in_slices() {
    let server = Server::start(&[
        "--cores",
        "2",
        "--pin",
        "false",
        "--max-frame",
        &(64u32 << 20).to_string(),
    ]);
    let ks = Keyspace::tokens("m");
    let mut c = server.session();
    let w = c.events_worker("engine");
    const N: u32 = 250_000;
    let chain = chain_of(&ks, 0, N as usize);
    let engine: Vec<u64> = (0..N as u64).map(|i| i | 1 << 62).collect();
    let before = metric(&server.scrape(), "kvix_write_slices_total");
    let r = c.ask(&EventBatch {
        worker: w,
        seq: 0,
        keyspace: ks.clone(),
        events: vec![Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: chain.clone(),
            engine: engine.clone(),
        }],
    });
    assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
    let slices = metric(&server.scrape(), "kvix_write_slices_total") - before;
    // The home's feed step and both executors' apply, each cut every 512 blocks.
    let at_least = 3 * (N as u64 / 512);
    assert!(
        slices >= at_least,
        "{slices} slices for a {N}-block store, expected at least {at_least}"
    );
    assert_eq!(
        c.query(&ks, &chain).scores,
        vec![Score {
            worker: w,
            blocks: N
        }]
    );
    // Removed by their engine hashes: a name looked up per block, in slices too.
    let before = metric(&server.scrape(), "kvix_write_slices_total");
    let r = c.ask(&EventBatch {
        worker: w,
        seq: 1,
        keyspace: ks.clone(),
        events: vec![Event::Removed {
            lane: 0,
            hashes: engine,
        }],
    });
    assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
    let slices = metric(&server.scrape(), "kvix_write_slices_total") - before;
    assert!(slices >= at_least, "{slices} slices for the removal");
    assert!(c.query(&ks, &chain).scores.is_empty());
}

#[test]
fn a_long_placement_is_applied_in_slices() {
    let server = Server::start(&[
        "--cores",
        "2",
        "--pin",
        "false",
        "--max-frame",
        &(64u32 << 20).to_string(),
    ]);
    let ks = Keyspace::tokens("m");
    let mut c = server.session();
    let w = c
        .announce(
            "gateway-view",
            vec![Lane::full(16)],
            Feed::Placements {
                capacity_blocks: 1 << 22,
                ttl_ms: 0,
            },
        )
        .unwrap()
        .worker;
    let before = metric(&server.scrape(), "kvix_write_slices_total");
    const N: u32 = 400_000;
    let chain: Vec<u64> = (0..N as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let r = c.ask(&Placement {
        worker: w,
        keyspace: ks.clone(),
        chain: chain.clone(),
    });
    assert_eq!(r.kind, Kind::Ack);
    let slices = metric(&server.scrape(), "kvix_write_slices_total") - before;
    // The home's feed step (2 passes over the chain) and every executor's apply, each
    // cut every 512 blocks.
    let at_least = 2 * (N as u64 / 512) + 2 * (N as u64 / 512);
    assert!(
        slices >= at_least,
        "{slices} slices for a {N}-block placement, expected at least {at_least}"
    );
    let a = c.query(&ks, &chain);
    assert_eq!(
        a.scores,
        vec![Score {
            worker: w,
            blocks: N
        }]
    );
}

/// The CPUs each thread of process `pid` may run on, by thread name.
fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or_default()
            .trim()
            .to_string();
        out.push((comm.to_string(), allowed));
    }
    out.sort();
    out
}

/// Executors are pinned to CPUs the process may run on (a container's cpuset, an
/// operator's `taskset`): with `taskset -c 1`, executor 0 on CPU 1. It was pinned to
/// CPU 0, escaping taskset (and refused outright by a cgroup cpuset).
#[test]
fn executors_are_pinned_within_the_cpus_the_process_may_use() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        missing_part("two CPUs", "run on a machine with at least two CPUs");
        return;
    }
    let mut cmd = std::process::Command::new("taskset");
    cmd.args(["-c", "1", env!("CARGO_BIN_EXE_kvix-server")])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--unix",
            "",
            "--metrics",
            "",
            "--cores",
            "1",
        ]);
    let server = Server::spawn(cmd);
    // The address is printed before the executors start: one answering has pinned itself.
    server.session();
    let threads = eventually("the executor's thread", || {
        let threads = thread_cpus(server.pid());
        threads
            .iter()
            .any(|(name, _)| name.starts_with("kvix-0"))
            .then_some(threads)
    });
    assert!(threads.iter().all(|(_, cpus)| cpus == "1"), "{threads:?}");
}

/// The `le` buckets of kvix_query_write_slices, summed over executors.
fn slice_waits(text: &str) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("kvix_query_write_slices_bucket{") else {
            continue;
        };
        let le = rest
            .split("le=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let n: u64 = l.rsplit(' ').next().unwrap().parse().unwrap();
        match out.iter_mut().find(|(b, _)| b == le) {
            Some((_, v)) => *v += n,
            None => out.push((le.to_string(), n)),
        }
    }
    out
}

/// One executor, two connections: one sends a 4 MiB event batch (half a million blocks,
/// then their removal), the other queries meanwhile. The executor turns from the write
/// to its reactor at least every 128 slices, so a query waits behind at most two turns'
/// slices (one before it is read, one before its reply leaves); before, glommio ran the
/// write queue for its 100 ms preemption period between polls, and a query's reply
/// waited behind hundreds of slices.
#[test]
fn a_query_waits_behind_at_most_two_turns_of_write_slices() {
    let server = Server::start(&["--cores", "1", "--pin", "false"]);
    let ks = Keyspace::tokens("m");
    let mut writer = server.session();
    let w = writer.events_worker("engine");
    let mut reader = server.session();
    let probe = chain_of(&ks, 7_000_000, 125);
    let r = writer.ask(&stored_batch(w, 0, &ks, &probe));
    assert_eq!(r.kind, Kind::Applied);
    const N: u32 = 500_000;
    let chain = chain_of(&ks, 0, N as usize);
    let slices_before = metric(&server.scrape(), "kvix_write_slices_total");
    let mut during = 0;
    for (seq, event) in [
        Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: chain.clone(),
            engine: vec![],
        },
        Event::Removed {
            lane: 0,
            hashes: chain.clone(),
        },
    ]
    .into_iter()
    .enumerate()
    {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let batch = EventBatch {
            worker: w,
            seq: 1 + seq as u64,
            keyspace: ks.clone(),
            events: vec![event],
        };
        let sent = {
            let (done, mut writer) = (
                done.clone(),
                std::mem::replace(&mut writer, server.session()),
            );
            std::thread::spawn(move || {
                let r = writer.ask(&batch);
                done.store(true, std::sync::atomic::Ordering::SeqCst);
                (r.kind, writer)
            })
        };
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            assert_eq!(reader.query(&ks, &probe).scores.len(), 1);
            during += 1;
        }
        let (kind, back) = sent.join().unwrap();
        assert_eq!(kind, Kind::Applied);
        writer = back;
    }
    let text = server.scrape();
    let slices = metric(&text, "kvix_write_slices_total") - slices_before;
    assert!(slices >= 2 * (N as u64 / 512), "{slices} slices");
    let waits = slice_waits(&text);
    let at = |le: &str| waits.iter().find(|(b, _)| b == le).unwrap().1;
    assert_eq!(
        at("256"),
        at("+Inf"),
        "queries waited behind more than two turns of 128 slices: {waits:?}"
    );
    assert!(during >= 20, "only {during} queries overlapped the writes");
}
