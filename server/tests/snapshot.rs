//! Snapshots through the real binary: written on shutdown, restored on start (with
//! another shard count too), refused whole when torn or corrupt.

mod common;

use common::*;
use kvix_wire::*;

fn snapshot_path(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvix-snapshot-test-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("index.snapshot")
}

fn start(path: &std::path::Path, cores: &str) -> Server {
    Server::start(&[
        "--cores",
        cores,
        "--pin",
        "false",
        "--snapshot",
        path.to_str().unwrap(),
    ])
}

#[test]
fn state_survives_a_restart_even_with_another_executor_count() {
    let path = snapshot_path("restart");
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 30);
    let server = start(&path, "2");
    let mut c = server.session();
    let a = c
        .announce("a", vec![Lane::full(32)], Feed::Events)
        .unwrap()
        .worker;
    let p = c
        .announce(
            "p",
            vec![Lane::full(16)],
            Feed::Placements {
                capacity_blocks: 12,
                ttl_ms: 0,
            },
        )
        .unwrap()
        .worker;
    let engine: Vec<u64> = (0..15).map(|i| 5000 + i).collect();
    let stored = Event::Stored {
        lane: 0,
        start: 0,
        parent: None,
        chain: chain.clone(),
        engine,
    };
    c.ask(&EventBatch {
        worker: a,
        seq: 7,
        keyspace: ks.clone(),
        events: vec![stored],
    });
    c.ask(&Placement {
        worker: p,
        keyspace: ks.clone(),
        chain: chain[..10].to_vec(),
    });
    let before = c.query(&ks, &chain);
    assert!(server.stop().success());
    assert!(path.exists(), "a snapshot is written on shutdown");

    let server = start(&path, "3");
    let mut c = server.session();
    assert_eq!(
        c.query(&ks, &chain),
        before,
        "same answer after restoring into 3 shards"
    );
    // Ids, sequences, engine-hash names and placement capacity survive.
    assert_eq!(
        c.announce("a", vec![Lane::full(32)], Feed::Events).unwrap(),
        Announced {
            worker: a,
            created: false
        }
    );
    let dup = c.ask(&EventBatch {
        worker: a,
        seq: 7,
        keyspace: ks.clone(),
        events: vec![Event::Cleared],
    });
    assert_eq!(dup.decode::<Applied>().status, ApplyStatus::Duplicate);
    let rm = EventBatch {
        worker: a,
        seq: 8,
        keyspace: ks.clone(),
        events: vec![Event::Removed {
            lane: 0,
            hashes: vec![5005],
        }],
    };
    assert_eq!(c.ask(&rm).decode::<Applied>().status, ApplyStatus::Applied);
    assert_eq!(
        c.query(&ks, &chain).scores[0],
        Score {
            worker: a,
            blocks: 10
        }
    );
    c.ask(&Placement {
        worker: p,
        keyspace: ks.clone(),
        chain: chain_of(&ks, 777, 5),
    });
    let placed = c
        .query(&ks, &chain[..10])
        .scores
        .iter()
        .find(|s| s.worker == p)
        .map(|s| s.blocks);
    assert_eq!(
        placed,
        Some(7),
        "capacity 12: the restored 10 blocks are cut by 3 from the end"
    );
    drop(server);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn torn_or_corrupt_snapshots_are_refused_with_a_clear_message() {
    let path = snapshot_path("corrupt");
    let server = start(&path, "1");
    let mut c = server.session();
    c.announce("a", vec![Lane::full(16)], Feed::Events).unwrap();
    assert!(server.stop().success());
    let good = std::fs::read(&path).unwrap();
    for (damage, expect) in [
        (good[..good.len() - 3].to_vec(), "torn"),
        (
            {
                let mut b = good.clone();
                *b.last_mut().unwrap() ^= 0x40;
                b
            },
            "checksum",
        ),
        (
            b"not a snapshot at all, certainly longer than a header".to_vec(),
            "not a kvix snapshot",
        ),
    ] {
        std::fs::write(&path, &damage).unwrap();
        let out = bare_command(&["--snapshot", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!out.status.success(), "a damaged snapshot stops the start");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(expect) && err.contains(path.to_str().unwrap()),
            "{expect}: {err}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            damage,
            "the damaged file is left for the operator"
        );
    }
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// Waits (bounded) until `name` has grown by at least `by` from what it is now.
fn await_growth(server: &Server, name: &str, by: u64) {
    let from = server.metric(name);
    for _ in 0..600 {
        if server.metric(name) >= from + by {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("{name} did not grow by {by}");
}

/// Two executors, the write-ahead log beside `path`, a snapshot every `every` seconds.
fn wal_args<'a>(path: &'a std::path::Path, every: &'a str) -> [&'a str; 7] {
    let path = path.to_str().unwrap();
    [
        "--cores",
        "2",
        "--snapshot",
        path,
        "--snapshot-every",
        every,
        "--wal",
    ]
}

#[test]
fn with_the_write_ahead_log_a_kill_9_loses_no_acknowledged_write() {
    let path = snapshot_path("wal");
    let args = wal_args(&path, "1");
    let ks = Keyspace::tokens("m");
    let (a_chain, b_chain) = (chain_of(&ks, 0, 8), chain_of(&ks, 100_000, 6));
    let server = Server::start(&args);
    let mut c = server.session();
    let a = c.events_worker("a");
    let gone = c.events_worker("gone");
    let stored = |chain: &[u64], start: u32, engine: u64| Event::Stored {
        lane: 0,
        start,
        parent: None,
        chain: chain.to_vec(),
        engine: (0..chain.len() as u64).map(|i| engine + i).collect(),
    };
    let batch = |seq, events| EventBatch {
        worker: a,
        seq,
        keyspace: ks.clone(),
        events,
    };
    c.ask(&batch(0, vec![stored(&a_chain[..4], 0, 100)]));
    // A snapshot covering the first batch, then writes it does not have.
    await_growth(&server, "kvix_snapshots_written_total", 2);
    c.ask(&batch(1, vec![stored(&a_chain[4..], 4, 104)]));
    c.ask(&batch(
        2,
        vec![Event::Removed {
            lane: 0,
            hashes: vec![107],
        }],
    ));
    let late = c.events_worker("late");
    c.ask(&stored_batch(late, 0, &ks, &b_chain));
    assert_eq!(c.ask(&Retire { worker: gone }).kind, Kind::Ack);
    let before = (c.query(&ks, &a_chain), c.query(&ks, &b_chain));
    assert_eq!(
        before.0.scores,
        vec![Score {
            worker: a,
            blocks: 7
        }]
    );
    server.kill();

    let server = Server::start(&args);
    let mut c = server.session();
    assert_eq!((c.query(&ks, &a_chain), c.query(&ks, &b_chain)), before);
    // Sequences and engine-hash names came back with the log.
    assert_eq!(
        c.ask(&batch(2, vec![Event::Cleared]))
            .decode::<Applied>()
            .status,
        ApplyStatus::Duplicate
    );
    c.ask(&batch(
        3,
        vec![Event::Removed {
            lane: 0,
            hashes: vec![101],
        }],
    ));
    assert_eq!(
        c.query(&ks, &a_chain).scores,
        vec![Score {
            worker: a,
            blocks: 1
        }]
    );
    assert_eq!(
        c.ask(&stored_batch(gone, 0, &ks, &b_chain)).error().code,
        ErrorCode::UnknownWorker
    );
    assert!(server.stop().success());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// A long log, replayed in batches per home (256 records to a job, one update each):
/// 24 workers on both executors, 1,200 batches that store and remove, a worker retired
/// and another announced in the middle. After kill -9 every answer is what it was.
#[test]
fn a_long_write_ahead_log_replays_to_the_same_answers() {
    let path = snapshot_path("wal-long");
    let args = wal_args(&path, "0");
    let ks = Keyspace::tokens("m");
    let server = Server::start(&args);
    let mut c = server.session();
    let mut workers: Vec<WorkerId> = (0..24).map(|i| c.events_worker(&format!("w{i}"))).collect();
    let chains: Vec<Vec<u64>> = (0..24u32).map(|i| chain_of(&ks, i * 10_000, 60)).collect();
    let mut seqs = [0u64; 24];
    for round in 0..50u32 {
        for (i, &w) in workers.iter().enumerate() {
            let b = (round as usize) % 60;
            let batch = if round % 7 == 6 {
                EventBatch {
                    worker: w,
                    seq: seqs[i],
                    keyspace: ks.clone(),
                    events: vec![Event::Removed {
                        lane: 0,
                        hashes: vec![chains[i][b - 1]],
                    }],
                }
            } else {
                stored_at(w, seqs[i], &ks, b as u32, &chains[i][b..b + 1])
            };
            seqs[i] += 1;
            assert_eq!(c.ask(&batch).kind, Kind::Applied, "w{i} round {round}");
        }
        if round == 20 {
            assert_eq!(c.ask(&Retire { worker: workers[5] }).kind, Kind::Ack);
            workers[5] = c.events_worker("w5-again");
            seqs[5] = 0;
        }
    }
    let before: Vec<_> = chains.iter().map(|ch| c.query(&ks, ch).scores).collect();
    assert!(
        before.iter().filter(|s| !s.is_empty()).count() >= 20,
        "{before:?}"
    );
    server.kill();

    let server = Server::start(&args);
    let mut c = server.session();
    let after: Vec<_> = chains.iter().map(|ch| c.query(&ks, ch).scores).collect();
    assert_eq!(after, before);
    assert!(server.metric("kvix_wal_replayed_records") >= 1_200);
    drop(server);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// A disk that fills up mid-record: the refused write (the client gets an error) is cut
/// back before the error is sent, so once space returns the writes acknowledged after it
/// survive a kill -9. Before, the partial record stayed in the file: the restart then
/// took it for a torn tail and dropped every later acknowledged write.
#[test]
fn a_write_refused_for_a_full_disk_leaves_no_partial_record_behind() {
    let Some(disk) = Tmpfs::mount("wal-full", 1 << 20) else {
        return;
    };
    let path = disk.dir.join("index.snapshot");
    let args = [
        "--cores",
        "1",
        "--snapshot",
        path.to_str().unwrap(),
        "--snapshot-every",
        "0",
        "--wal",
    ];
    let server = Server::start_restartable(&args);
    let mut c = server.session();
    let mut acknowledged = 0u32;
    let mut announce = |c: &mut Conn, name: String| {
        let r = c.announce(&name, vec![Lane::full(16)], Feed::Events);
        acknowledged += u32::from(r.is_ok());
        r
    };
    announce(&mut c, "before-0".into()).unwrap();
    disk.fill("filler");
    // The log's last page still has room for a few records; one then runs out of space
    // part-way through.
    let refused = (0..1000)
        .map(|i| announce(&mut c, format!("filling-{i}")))
        .find_map(Result::err)
        .expect("a write refused once the disk is full");
    assert_eq!(refused.code, ErrorCode::Internal, "{}", refused.message);
    assert!(server.metric("kvix_wal_failures_total") >= 1);
    std::fs::remove_file(disk.dir.join("filler")).unwrap();
    for i in 0..300 {
        announce(&mut c, format!("after-{i}")).expect("space is back");
    }
    let addr = server.addr;
    server.kill();
    let server = Server::start_on(addr, &args);
    let mut c = server.session();
    let s: Stats = c.ask(&StatsRequest {}).decode();
    assert_eq!(
        s.workers, acknowledged,
        "every acknowledged announce came back"
    );
    assert_eq!(
        server.metric("kvix_wal_cut_bytes"),
        0,
        "nothing torn to cut"
    );
    assert!(server.stop().success());
}

/// A clean stop (SIGTERM) refuses new writes, waits for the accepted ones to be applied
/// everywhere and writes a snapshot that covers the whole log: the next start replays
/// nothing (it replayed the last generation, up to a snapshot period of writes). A
/// kill -9 still replays what the snapshot lacks.
#[test]
fn a_clean_stop_leaves_nothing_to_replay() {
    let path = snapshot_path("clean-stop");
    let args = wal_args(&path, "0");
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 40);
    let server = Server::start_restartable(&args);
    let addr = server.addr;
    let mut c = server.session();
    let workers: Vec<WorkerId> = (0..4).map(|i| c.events_worker(&format!("w{i}"))).collect();
    for (i, &w) in workers.iter().enumerate() {
        for seq in 0..10 {
            let part = &chain[seq * 4..seq * 4 + 4];
            let start = (seq * 4) as u32;
            c.ask(&stored_at(w, seq as u64, &ks, start, part));
        }
        assert_eq!(c.query(&ks, &chain).scores.len(), i + 1);
    }
    let before = c.query(&ks, &chain);
    assert!(server.stop().success());

    let server = Server::start_on(addr, &args);
    assert_eq!(server.metric("kvix_wal_replayed_records"), 0);
    let mut c = server.session();
    assert_eq!(c.query(&ks, &chain), before);
    c.ask(&stored_batch(workers[0], 10, &ks, &chain_of(&ks, 9, 3)));
    server.kill();

    let server = Server::start_on(addr, &args);
    assert_eq!(
        server.metric("kvix_wal_replayed_records"),
        1,
        "the write after the stop"
    );
    assert!(server.stop().success());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// With `--max-workers 3` every id is given by the third name; retired ids are given
/// again oldest retire first, and that order survives a kill -9 (the log replays the
/// retires in order) and a clean restart (the snapshot keeps each id's retire number).
#[test]
fn retired_ids_are_given_again_in_retire_order_across_restarts() {
    let path = snapshot_path("reuse");
    let mut args = wal_args(&path, "0").to_vec();
    args.extend(["--max-workers", "3"]);
    let server = Server::start_restartable(&args);
    let addr = server.addr;
    let mut c = server.session();
    let ids: Vec<WorkerId> = ["a", "b", "c"].map(|n| c.events_worker(n)).to_vec();
    assert_eq!(ids, [0, 1, 2]);
    for w in [1, 0] {
        assert_eq!(c.ask(&Retire { worker: w }).kind, Kind::Ack);
    }
    server.kill();

    let server = Server::start_on(addr, &args);
    assert!(server.metric("kvix_wal_replayed_records") >= 5);
    let mut c = server.session();
    assert_eq!(c.events_worker("d"), 1, "b was retired first");
    assert!(server.stop().success());

    let server = Server::start_on(addr, &args);
    assert_eq!(server.metric("kvix_wal_replayed_records"), 0);
    let mut c = server.session();
    assert_eq!(c.events_worker("e"), 0);
    let full = c.announce("a", vec![Lane::full(16)], Feed::Events);
    let refused = full.unwrap_err();
    assert!(
        refused.message.contains("no more worker ids"),
        "{refused:?}"
    );
    assert!(server.stop().success());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// The WAL file of `path` whose records hold the writes (the newest non-empty one).
fn wal_with_records(path: &std::path::Path) -> std::path::PathBuf {
    let dir = path.parent().unwrap();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.to_string_lossy().contains(".wal.") && std::fs::metadata(p).unwrap().len() > 16
        })
        .collect();
    files.sort();
    files.pop().expect("a write-ahead log file with records")
}

/// An operator's bad day: 1,000 acknowledged batches, kill -9, then the length of record
/// 100 set to 2^31. That read as a torn tail: the server started and served 99 of the
/// 1,000 batches, with a WARN. It is damage: `check` names the file, offset and field,
/// the start refuses, and `--wal-recover truncate` starts with what precedes it,
/// counting the damage.
#[test]
fn a_damaged_record_length_refuses_the_start_and_check_names_it() {
    let path = snapshot_path("wal-length");
    let p = path.to_str().unwrap();
    let args = [
        "--cores",
        "1",
        "--snapshot",
        p,
        "--snapshot-every",
        "0",
        "--wal",
    ];
    let server = Server::start(&args);
    let ks = Keyspace::tokens("m");
    let mut c = server.session();
    let w = c.events_worker("w");
    for seq in 0..1000u64 {
        let chain = chain_of(&ks, seq as u32 * 10, 2);
        assert_eq!(
            c.ask(&stored_batch(w, seq, &ks, &chain)).kind,
            Kind::Applied
        );
    }
    server.kill();
    let wal = wal_with_records(&path);
    let mut bytes = std::fs::read(&wal).unwrap();
    // The file header, then records: length u32, body checksum u64, header check u32.
    let mut at = 16;
    for _ in 0..100 {
        at += 16 + u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    }
    bytes[at..at + 4].copy_from_slice(&(1u32 << 31).to_le_bytes());
    std::fs::write(&wal, &bytes).unwrap();

    let run = |more: &[&str], check: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvix-server"));
        if check {
            cmd.arg("check");
        }
        let out = cmd
            .args(["--listen", "127.0.0.1:0", "--metrics", "", "--unix", ""])
            .args(args)
            .args(more)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let named = |text: &str| {
        text.contains(&wal.display().to_string())
            && text.contains(&format!("damaged at byte {at}, in a record header"))
            && text.contains("--wal-recover truncate")
    };
    let (ok, text) = run(&[], true);
    assert!(
        !ok && text.contains("FAIL  --wal") && named(&text),
        "{text}"
    );
    // The start refuses the same way (bounded by the start's own wait: it exits).
    let (ok, text) = run(&[], false);
    assert!(!ok && named(&text), "{text}");
    assert_eq!(
        std::fs::read(&wal).unwrap(),
        bytes,
        "nothing cut on refusal"
    );

    let mut truncate = args.to_vec();
    truncate.extend(["--wal-recover", "truncate"]);
    let server = Server::start(&truncate);
    assert_eq!(server.metric("kvix_wal_damage_total"), 1);
    let mut c = server.session();
    let held =
        |c: &mut Conn, seq: u32| !c.query(&ks, &chain_of(&ks, seq * 10, 2)).scores.is_empty();
    // The announce is record 0: batches 0..99 precede the damage.
    assert!(held(&mut c, 0) && held(&mut c, 98));
    assert!(!held(&mut c, 99) && !held(&mut c, 999));
}
