//! Replicas over a real redis-server (`--log redis://…`): writes spread over three
//! servers, one order for all of them, identical answers; a replica that starts empty
//! converges; Redis going away refuses writes without losing or doubling any.

mod common;

use common::redis::{available, Redis};
use common::*;
use kvix_wire::*;

/// A replica of `redis`'s log `kvix`, which begins the log where the key is empty (the
/// fleet's first start).
fn replica(redis: &Redis, extra: &[&str]) -> Server {
    let mut args = vec!["--log-new"];
    args.extend_from_slice(extra);
    joining(redis, &args)
}

/// A replica of `redis`'s log `kvix` as an operator restarts one: where the key is
/// empty, it waits for it to be rebuilt.
fn joining(redis: &Redis, extra: &[&str]) -> Server {
    let url = redis.url("kvix");
    let mut args = vec!["--cores", "2", "--log", &url];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// Waits (bounded) until every replica has dispatched the log to the same entry and
/// applied all it dispatched (its last write's reply came back: see `write_fleet`).
fn settle(replicas: &[&Server]) {
    let position = |s: &Server| {
        (
            s.metric("kvix_log_position_ms"),
            s.metric("kvix_log_position_seq"),
        )
    };
    for _ in 0..600 {
        let first = position(replicas[0]);
        if first.0 > 0 && replicas.iter().all(|s| position(s) == first) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("the replicas did not settle");
}

/// A small deterministic generator for the random queries.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn keyspaces() -> [Keyspace; 2] {
    [
        Keyspace::tokens("m"),
        Keyspace {
            lora: "x".into(),
            ..Keyspace::tokens("m")
        },
    ]
}

/// Writes from every replica in turn: announces, event batches (stores, a removal),
/// placements, a retire.
fn write_fleet(replicas: &[&Server], tag: &str) {
    let mut conns: Vec<Conn> = replicas.iter().map(|s| s.session()).collect();
    let n = conns.len();
    let kss = keyspaces();
    for i in 0..12usize {
        let name = format!("{tag}-w{i}");
        let w = conns[i % n].events_worker(&name);
        let ks = &kss[i % 2];
        let chain = chain_of(ks, (i % 4) as u32 * 10_000, 48);
        let depth = 10 + 3 * i;
        for (seq, (from, to)) in [(0, depth / 2), (depth / 2, depth)].into_iter().enumerate() {
            let batch = stored_at(w, seq as u64, ks, from as u32, &chain[from..to]);
            let r = conns[(i + seq + 1) % n].ask(&batch);
            assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
        }
        if i % 3 == 0 {
            let r = conns[(i + 2) % n].ask(&EventBatch {
                worker: w,
                seq: 2,
                keyspace: ks.clone(),
                events: vec![Event::Removed {
                    lane: 0,
                    hashes: vec![chain[depth - 2]],
                }],
            });
            assert_eq!(r.kind, Kind::Applied);
        }
        if i == 11 {
            assert_eq!(conns[2 % n].ask(&Retire { worker: w }).kind, Kind::Ack);
        }
    }
    for j in 0..3usize {
        let p = conns[j % n]
            .announce(
                &format!("{tag}-p{j}"),
                vec![Lane::full(16)],
                Feed::Placements {
                    capacity_blocks: 64,
                    ttl_ms: 0,
                },
            )
            .unwrap()
            .worker;
        for k in 0..4u32 {
            let r = conns[(j + k as usize) % n].ask(&Placement {
                worker: p,
                keyspace: kss[0].clone(),
                chain: chain_of(&kss[0], (k % 4) * 10_000, 12 + 4 * k as usize),
            });
            assert_eq!(r.kind, Kind::Ack);
        }
    }
}

/// 1,000 random queries, every answer compared whole across the replicas.
fn assert_identical(replicas: &[&Server]) {
    let mut conns: Vec<Conn> = replicas.iter().map(|s| s.session()).collect();
    let kss = keyspaces();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut nonempty = 0;
    for q in 0..1000 {
        let ks = &kss[rng.below(2) as usize];
        let chain = chain_of(ks, rng.below(5) as u32 * 10_000, 1 + rng.below(48) as usize);
        let answers: Vec<Answer> = conns.iter_mut().map(|c| c.query(ks, &chain)).collect();
        for a in &answers[1..] {
            assert_eq!(a, &answers[0], "query {q}");
        }
        nonempty += usize::from(!answers[0].scores.is_empty());
    }
    assert!(
        nonempty > 300,
        "the queries must hit something ({nonempty})"
    );
}

#[test]
fn three_replicas_apply_one_log_and_answer_identically() {
    if available("three_replicas").is_none() {
        return;
    }
    let redis = Redis::start("three");
    let (a, b, c) = (
        replica(&redis, &[]),
        replica(&redis, &[]),
        replica(&redis, &[]),
    );
    write_fleet(&[&a, &b, &c], "one");
    settle(&[&a, &b, &c]);
    assert_identical(&[&a, &b, &c]);

    // One is killed, the fleet goes on, it comes back empty and catches up.
    c.kill();
    write_fleet(&[&a, &b], "two");
    let c = replica(&redis, &[]);
    settle(&[&a, &b, &c]);
    assert_identical(&[&a, &b, &c]);
}

/// Replicas whose source checks come out differently (here another `--source-allow`;
/// in the field a resolver that fails on one of them): an announce the log took is
/// registered by every replica, so worker ids stay in step, and one a replica refuses
/// is refused before the log takes it.
#[test]
fn a_logged_announce_registers_on_every_replica_whatever_its_source_checks() {
    if available("logged_announce").is_none() {
        return;
    }
    let redis = Redis::start("announce");
    let a = replica(&redis, &[]);
    let b = replica(&redis, &["--source-allow", "10.0.0.0/8"]);
    let loopback = EventSource {
        endpoint: "tcp://127.0.0.1:1".into(),
        replay: String::new(),
        model: "m".into(),
        salt: String::new(),
    };
    let (mut ca, mut cb) = (a.session(), b.session());
    let sourced = ca
        .announce_source("sourced", vec![Lane::full(16)], loopback.clone())
        .unwrap()
        .worker;
    let refused = cb
        .announce_source("refused", vec![Lane::full(16)], loopback)
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::BadSource, "{}", refused.message);
    let plain = ca.events_worker("plain");
    assert_ne!(plain, sourced);
    // Announced again through the other replica: the same ids there.
    assert_eq!(cb.events_worker("plain"), plain);
    settle(&[&a, &b]);
    for s in [&a, &b] {
        assert_eq!(s.metric("kvix_workers"), 2, "{}", s.scrape());
    }
}

/// Past `--max-workers`, an id retired through one replica is given again through
/// another: both number from the log, so both give it to the same name.
#[test]
fn replicas_give_a_retired_id_again_alike() {
    if available("id_reuse").is_none() {
        return;
    }
    let redis = Redis::start("reuse");
    let a = replica(&redis, &["--max-workers", "2"]);
    let b = replica(&redis, &["--max-workers", "2"]);
    let (mut ca, mut cb) = (a.session(), b.session());
    let first = ca.events_worker("a");
    ca.events_worker("b");
    assert_eq!(ca.ask(&Retire { worker: first }).kind, Kind::Ack);
    assert_eq!(cb.events_worker("c"), first);
    settle(&[&a, &b]);
    for c in [&mut ca, &mut cb] {
        assert_eq!(c.worker_id("c"), Some(first));
        assert_eq!(c.worker_id("a"), None);
    }
}

#[test]
fn a_worker_replacing_its_source_is_not_one_more_whichever_executor_takes_it() {
    if available("source_limit").is_none() {
        return;
    }
    let redis = Redis::start("source-limit");
    // One connection per executor: the second is handed to the other executor.
    let s = replica(&redis, &["--max-sources", "1", "--max-connections", "1"]);
    let mut on = [s.session(), s.session()];
    let per_executor =
        [0, 1].map(|e| s.metric(&format!("kvix_executor_connections{{executor=\"{e}\"}}")));
    assert_eq!(per_executor, [1, 1], "a connection on each executor");
    let src = |port: u16| EventSource {
        endpoint: format!("tcp://127.0.0.1:{port}"),
        replay: String::new(),
        model: "m".into(),
        salt: String::new(),
    };
    let lanes = || vec![Lane::full(16)];
    let w = on[0].announce_source("a", lanes(), src(1)).unwrap().worker;
    for (i, c) in on.iter_mut().enumerate() {
        let again = c.announce_source("a", lanes(), src(2 + i as u16));
        assert_eq!(
            again.map(|a| a.worker),
            Ok(w),
            "re-announced through connection {i}"
        );
        let more = c.announce_source("b", lanes(), src(9)).unwrap_err();
        assert_eq!(more.code, ErrorCode::TooManySources, "{}", more.message);
    }
}

#[test]
fn a_new_replica_starts_from_the_stored_snapshot_once_the_log_is_trimmed() {
    if available("stored_snapshot").is_none() {
        return;
    }
    let redis = Redis::start("stored");
    let dir = std::env::temp_dir().join(format!("kvix-replica-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("a.snapshot");
    let a = replica(
        &redis,
        &[
            "--snapshot",
            snap.to_str().unwrap(),
            "--snapshot-every",
            "1",
        ],
    );
    write_fleet(&[&a], "one");
    // Two snapshots after the writes: one of them is stored and has trimmed the log.
    let from = a.metric("kvix_snapshots_written_total");
    for _ in 0..600 {
        if a.metric("kvix_snapshots_written_total") >= from + 2
            && a.metric("kvix_log_trimmed_total") > 0
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        a.metric("kvix_log_trimmed_total") > 0,
        "the log was trimmed"
    );
    let fresh = replica(&redis, &[]);
    settle(&[&a, &fresh]);
    assert_identical(&[&a, &fresh]);
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Replicas without snapshot files still store snapshots in Redis and trim the stream
/// below them (it grew without bound: 21 k entries, none trimmed), a new replica starts
/// from the stored one, and positions reported by replicas gone for good are dropped.
#[test]
fn replicas_without_snapshot_files_trim_the_log_and_forget_dead_replicas() {
    if available("trim_without_files").is_none() {
        return;
    }
    let redis = Redis::start("trim-nofile");
    let a = replica(&redis, &["--snapshot-every", "1"]);
    let _: u64 = redis_cmd(
        redis.port,
        ::redis::cmd("HSET")
            .arg("kvix:positions")
            .arg("a-replica-gone-long-ago")
            .arg("1-0 1000"),
    )
    .unwrap();
    write_fleet(&[&a], "one");
    let from = a.metric("kvix_log_snapshots_stored_total");
    wait_for(
        "two snapshots stored after the writes, the log trimmed",
        &|| {
            a.metric("kvix_log_snapshots_stored_total") >= from + 2
                && a.metric("kvix_log_trimmed_total") > 0
        },
    );
    let gone: u64 = redis_cmd(
        redis.port,
        ::redis::cmd("HEXISTS")
            .arg("kvix:positions")
            .arg("a-replica-gone-long-ago"),
    )
    .unwrap();
    assert_eq!(gone, 0, "a dead replica's position was dropped");
    let fresh = replica(&redis, &[]);
    settle(&[&a, &fresh]);
    assert_identical(&[&a, &fresh]);
}

/// The gauge saying a replica stopped following its log for `reason`.
fn stopped(reason: &str) -> String {
    format!("kvix_log_stopped{{reason=\"{reason}\"}}")
}

/// A replica paused while the log is trimmed past its position (here by hand; in a
/// fleet, by the others' snapshots once it stopped reporting) does not skip what it
/// missed: it heals in place from the snapshot the fleet stores, the same process with
/// the same connections, and answers exactly as a fresh replica after. Until then it
/// says so: its answers carry `stale`, /readyz fails (it is out of rotation) and /livez
/// does not (no restart). It used to stop following for good, healthy again only once
/// restarted (and before that read on from the hole, answering wrong).
#[test]
fn a_replica_behind_the_trim_point_heals_in_place() {
    if available("behind_trim").is_none() {
        return;
    }
    let redis = Redis::start("behind-trim");
    // a stores a snapshot in Redis only when it stops: the heal waits for it.
    let (a, b) = (
        replica(&redis, &["--snapshot-every", "0"]),
        replica(&redis, &[]),
    );
    write_fleet(&[&a, &b], "one");
    settle(&[&a, &b]);
    let (mut kept, pid) = (b.session(), b.pid());
    b.pause(true);
    write_fleet(&[&a], "two");
    let last: ::redis::streams::StreamRangeReply = redis_cmd(
        redis.port,
        ::redis::cmd("XREVRANGE")
            .arg("kvix")
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1),
    )
    .unwrap();
    let last_id = last.ids[0].id.clone();
    let trimmed: u64 = redis_cmd(
        redis.port,
        ::redis::cmd("XTRIM").arg("kvix").arg("MINID").arg(&last_id),
    )
    .unwrap();
    assert!(trimmed > 0);
    let _: u64 = redis_cmd(redis.port, ::redis::cmd("DEL").arg("kvix:snapshot")).unwrap();
    b.pause(false);

    // Healing, and waiting for a snapshot past the hole: live, not ready, stale.
    let probe = |s: &Server, path: &str| http_get(s.metrics.unwrap(), path);
    wait_for("b finds the hole and heals", &|| {
        probe(&b, "/readyz").contains("healing in place")
    });
    assert!(probe(&b, "/readyz").starts_with("HTTP/1.1 503"));
    assert!(probe(&b, "/livez").starts_with("HTTP/1.1 200"));
    assert!(probe(&b, "/healthz").starts_with("HTTP/1.1 200"));
    assert_eq!(b.metric(&stopped("behind_trim")), 0);
    assert!(probe(&a, "/readyz").starts_with("HTTP/1.1 200"));
    let ks = &keyspaces()[0];
    let written_meanwhile = chain_of(ks, 20_000, 48);
    let tiered = |c: &mut Conn| -> TieredAnswer {
        c.ask(&TieredQuery {
            keyspace: ks.clone(),
            chain: written_meanwhile.clone(),
            weights: TierWeights::default(),
            ..Default::default()
        })
        .decode()
    };
    let behind = tiered(&mut kept);
    let current = tiered(&mut a.session());
    assert!(behind.stale, "{behind:?}");
    assert!(!current.stale);
    assert_ne!(
        behind.scores, current.scores,
        "b misses what was written meanwhile"
    );

    // a stops, storing its snapshot: b loads it in place and follows the log from it.
    a.stop();
    wait_for("b healed", &|| {
        b.metric("kvix_log_heals_total") == 1 && b.metric("kvix_log_caught_up") == 1
    });
    assert!(probe(&b, "/readyz").starts_with("HTTP/1.1 200"));
    assert_eq!(b.pid(), pid, "healed in the same process");
    let c = replica(&redis, &[]);
    settle(&[&b, &c]);
    assert_identical(&[&b, &c]);
    let healed = tiered(&mut kept);
    assert!(!healed.stale);
    assert_eq!(
        healed,
        tiered(&mut c.session()),
        "the kept connection reads the healed copy"
    );
    // And takes writes again: a worker's stream continues from the snapshot's batch.
    let kss = keyspaces();
    let w = kept.events_worker("two-w1");
    let chain = chain_of(&kss[1], 10_000, 48);
    let r = kept.ask(&stored_at(w, 2, &kss[1], 13, &chain[13..20]));
    assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
    write_fleet(&[&b, &c], "three");
    settle(&[&b, &c]);
    assert_identical(&[&b, &c]);
}

/// A record no replica can read (another kvix version's, or another program writing to
/// the key) stops every replica there, loudly, instead of each skipping it and going on
/// as if it held what the writer meant: it says so (the gauge, /livez, writes refused)
/// and exits non-zero, for its supervisor to start it again (a start reads the log
/// afresh). It used to be skipped with an ERROR line, and then to stay up answering.
#[test]
fn a_record_the_replicas_cannot_read_stops_them_instead_of_being_skipped() {
    if available("unreadable").is_none() {
        return;
    }
    let redis = Redis::start("unreadable");
    let (a, b) = (replica(&redis, &[]), replica(&redis, &[]));
    write_fleet(&[&a, &b], "one");
    settle(&[&a, &b]);
    let _: String = redis_cmd(
        redis.port,
        ::redis::cmd("XADD")
            .arg("kvix")
            .arg("*")
            .arg("r")
            .arg(&b"not a record of this version"[..])
            .arg("o")
            .arg(""),
    )
    .unwrap();
    for mut s in [a, b] {
        let status = s.exited();
        assert!(!status.success(), "{status}");
    }
}

/// A replica of another fleet (`--fleet`), or with another block size, started on a
/// key a fleet already uses refuses to start, naming both, instead of loading that
/// fleet's index and mixing its writes into it (its batches were all Duplicate, its
/// placements credited to the other fleet's workers).
#[test]
fn a_replica_of_another_fleet_refuses_to_start_on_its_key() {
    if available("two_fleets").is_none() {
        return;
    }
    let redis = Redis::start("fleets");
    let a = replica(&redis, &["--fleet", "one"]);
    write_fleet(&[&a], "one");
    let url = redis.url("kvix");
    for (extra, why) in [
        (["--fleet", "two", "--block-size", "16"], "fleet \"two\""),
        (["--fleet", "one", "--block-size", "32"], "--block-size 32"),
    ] {
        let mut args = vec!["--cores", "1", "--log", url.as_str()];
        args.extend_from_slice(&extra);
        let out = bare_command(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} started");
        assert!(
            err.contains("belongs to another fleet")
                && err.contains("fleet \"one\"")
                && err.contains(why),
            "{err}"
        );
    }
    // The same fleet joins.
    let b = replica(&redis, &["--fleet", "one"]);
    settle(&[&a, &b]);
    assert_identical(&[&a, &b]);
}

/// A Redis that requires a password: replicas whose URL carries it log in on the
/// start's connection, each executor's appender and the follower, and agree; a wrong
/// password refuses the start, saying so without showing it.
#[test]
fn replicas_log_in_to_a_redis_that_requires_a_password() {
    if available("password").is_none() {
        return;
    }
    let redis = Redis::with_password("password", "s3cret");
    let url = redis.url_with_password("s3cret", "kvix");
    let a = Server::start(&["--cores", "2", "--log", &url, "--log-new"]);
    let b = Server::start(&["--cores", "2", "--log", &url]);
    write_fleet(&[&a, &b], "pw");
    settle(&[&a, &b]);
    assert_identical(&[&a, &b]);
    assert_eq!(
        a.metric("kvix_log_read_failures_total"),
        0,
        "{}",
        a.scrape()
    );
    let wrong = redis.url_with_password("wrong", "kvix");
    let out = bare_command(&["--cores", "1", "--log", &wrong])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with a wrong password");
    assert!(err.contains("authentication failed"), "{err}");
    assert!(!err.contains("wrong"), "the password is shown: {err}");
}

/// SIGTERM while Redis is down: the last snapshot is cut without Redis (its store in
/// Redis fails, counted) and the replica exits cleanly, with and without a snapshot file.
/// The cut waited for a follower that served it only while connected: the stop hung.
#[test]
fn a_replica_stops_cleanly_while_redis_is_down() {
    if available("stop_without_redis").is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvix-stop-down-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("a.snapshot");
    for extra in [vec![], vec!["--snapshot", snap.to_str().unwrap()]] {
        let mut redis = Redis::start("stop-down");
        let a = replica(&redis, &extra);
        write_fleet(&[&a], "one");
        redis.kill();
        let status = a.stop();
        assert!(status.success(), "{extra:?}: {status:?}");
    }
    assert!(snap.exists(), "the last snapshot was written to its file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_replica_started_while_redis_is_down_waits_for_it_instead_of_exiting() {
    if available("start_waits").is_none() {
        return;
    }
    let mut redis = Redis::start("start-waits");
    let fleet = replica(&redis, &[]);
    write_fleet(&[&fleet], "before");
    redis.kill();
    // Hold Redis's port so the new replica's first try is seen to fail (a connection
    // closed unanswered), then let Redis come back on it.
    let holder = std::net::TcpListener::bind(("127.0.0.1", redis.port)).unwrap();
    let url = redis.url("kvix");
    let starting = std::thread::spawn(move || Server::start(&["--cores", "2", "--log", &url]));
    drop(holder.accept().unwrap());
    drop(holder);
    redis.restart();
    let late = starting
        .join()
        .expect("the replica waits for a Redis that comes back");
    settle(&[&fleet, &late]);
    assert_identical(&[&fleet, &late]);
}

#[test]
fn with_redis_away_writes_are_refused_queries_answered_and_nothing_lost_or_doubled() {
    if available("redis_away").is_none() {
        return;
    }
    let mut redis = Redis::start("away");
    let (a, b) = (replica(&redis, &[]), replica(&redis, &[]));
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 12);
    let mut ca = a.session();
    let w = ca.events_worker("w");
    let stored =
        |seq: u64, from: usize, to: usize| stored_at(w, seq, &ks, from as u32, &chain[from..to]);
    assert_eq!(ca.ask(&stored(0, 0, 4)).kind, Kind::Applied);
    // Acknowledged by A once A applied it; B reads it on its own time.
    settle(&[&a, &b]);
    redis.kill();
    // Writes are refused, typed; queries still answer from memory.
    let refused = ca.ask(&stored(1, 4, 8));
    assert_eq!(refused.error().code, ErrorCode::LogUnavailable);
    let mut cb = b.session();
    assert_eq!(
        cb.query(&ks, &chain).scores,
        vec![Score {
            worker: w,
            blocks: 4
        }]
    );
    redis.restart();
    // The writer retries its refused batch; it is applied once.
    let retried = until_applied(&mut ca, &stored(1, 4, 8), || {});
    assert_eq!(retried.status, ApplyStatus::Applied);
    assert_eq!(ca.ask(&stored(2, 8, 12)).kind, Kind::Applied);
    settle(&[&a, &b]);
    whole_and_once(&[&a, &b], &ks, &chain, w, 12, &[stored(2, 8, 12)]);
}

/// The log lost whole (FLUSHALL, or Redis restarted without persistence) while a client
/// writes, with one replica paused just before (behind the others): the running
/// replicas post their positions, the most advanced is chosen, its state becomes the new
/// log's base, and every replica (the paused one once resumed) loads it in place. No
/// process restarts, no acknowledged write is lost, and all answer as a replica started
/// afterwards. The replicas used to stop following (refusing writes, failing /healthz)
/// until restarted, and then started from the empty log: all the fleet held was gone.
#[test]
fn a_lost_log_is_rebuilt_from_the_most_advanced_replica() {
    if available("lost_log").is_none() {
        return;
    }
    lost_log_rebuilt(Redis::start("lost"), |redis, _| {
        let _: () = redis_cmd(redis.port, &mut ::redis::cmd("FLUSHALL")).unwrap();
    });
}

/// The same with Redis restarted without persistence: the replicas' connections drop,
/// and the Redis they reach again holds nothing.
#[test]
fn a_log_lost_to_a_redis_restarted_empty_is_rebuilt() {
    if available("lost_log_restart").is_none() {
        return;
    }
    lost_log_rebuilt(Redis::start("lost-restart"), |redis, _| {
        redis.restart_empty()
    });
}

/// The same with a log that lost its tail (a Sentinel failover to a Redis that had not
/// received it; here its entries from the running replicas' positions on deleted, at
/// once with their connections): their positions are past what the stream holds. (A
/// replica that had not read into the lost tail cannot tell it went: it reads on, and
/// loads the rebuilt log once a replica that had read it, such as the one that
/// acknowledged a write lost with it, rebuilds.)
#[test]
fn a_log_that_lost_its_tail_is_rebuilt() {
    if available("lost_tail").is_none() {
        return;
    }
    lost_log_rebuilt(Redis::start("lost-tail"), |redis, running| {
        let position = |s: &Server| {
            (
                s.metric("kvix_log_position_ms"),
                s.metric("kvix_log_position_seq"),
            )
        };
        let (ms, seq) = running.iter().map(|s| position(s)).min().unwrap();
        let tail: ::redis::streams::StreamRangeReply = redis_cmd(
            redis.port,
            ::redis::cmd("XRANGE")
                .arg("kvix")
                .arg(format!("{ms}-{seq}"))
                .arg("+"),
        )
        .unwrap();
        let ids: Vec<String> = tail.ids.into_iter().map(|e| e.id).collect();
        // At once with the failover's broken connections, so no read sees the hole open.
        let mut failover = ::redis::pipe();
        failover
            .atomic()
            .cmd("XDEL")
            .arg("kvix")
            .arg(&ids)
            .cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes");
        let client = ::redis::Client::open(format!("redis://127.0.0.1:{}", redis.port)).unwrap();
        let mut c = client.get_connection().unwrap();
        let (deleted, _killed): (usize, u64) = failover.query(&mut c).unwrap();
        assert_eq!(deleted, ids.len());
        assert!(deleted > 0);
    });
}

/// Three replicas, one paused, a client announcing through the first; `lose` loses the
/// log; see above.
fn lost_log_rebuilt(mut redis: Redis, lose: impl FnOnce(&mut Redis, &[&Server])) {
    let (a, b, c) = (
        replica(&redis, &[]),
        replica(&redis, &[]),
        replica(&redis, &[]),
    );
    write_fleet(&[&a, &b, &c], "one");
    settle(&[&a, &b, &c]);
    let pids = [a.pid(), b.pid(), c.pid()];
    c.pause(true);
    write_fleet(&[&a, &b], "two");
    // A client announcing workers through a until told to stop: what it was told is
    // announced must be there after.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let before = a.metric("kvix_workers");
    let writer = {
        let (mut s, stop) = (a.session(), stop.clone());
        std::thread::spawn(move || {
            let mut acked = Vec::new();
            for n in 0.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let name = format!("live-{n}");
                match s.announce(&name, vec![Lane::full(16)], Feed::Events) {
                    Ok(_) => acked.push(name),
                    Err(e) => assert_eq!(e.code, ErrorCode::LogUnavailable, "{}", e.message),
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            acked
        })
    };
    wait_for("the writer's first acks", &|| {
        a.metric("kvix_workers") >= before + 5
    });
    lose(&mut redis, &[&a, &b]);
    rebuilt(&[&a, &b]);
    c.pause(false);
    rebuilt(&[&c]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = writer.join().unwrap();
    assert!(acked.len() > 5, "{acked:?}");
    assert_eq!([a.pid(), b.pid(), c.pid()], pids, "no replica restarted");
    for s in [&a, &b, &c] {
        for reason in ["replaced", "behind_trim", "unreadable"] {
            assert_eq!(s.metric(&stopped(reason)), 0, "{reason}");
        }
    }
    let d = replica(&redis, &[]);
    settle(&[&a, &b, &c, &d]);
    assert_identical(&[&a, &b, &c, &d]);
    let mut on_d = d.session();
    for name in acked
        .iter()
        .chain(["two-w0".to_string(), "two-p2".to_string()].iter())
    {
        assert!(
            on_d.worker_id(name).is_some(),
            "{name} was acknowledged, and is gone"
        );
    }
    write_fleet(&[&a, &b, &c, &d], "three");
    settle(&[&a, &b, &c, &d]);
    assert_identical(&[&a, &b, &c, &d]);
}

/// The log lost whole while its replicas, which keep snapshot files, were down: each
/// restarted finds the key empty and posts its snapshot's position; the most advanced
/// (b's, which went on alone after a stopped) is chosen and its snapshot becomes the new
/// log's base, which the others (c has no file) load. Replicas used to begin a new,
/// empty log at once and drop their snapshots as another log's: the fleet's state was
/// gone.
#[test]
fn after_the_log_is_lost_replicas_restarted_with_snapshots_rebuild_it_from_the_most_advanced() {
    if available("lost_log_snapshots").is_none() {
        return;
    }
    let redis = Redis::start("lost-snap");
    let dir = std::env::temp_dir().join(format!("kvix-lost-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let (sa, sb) = (snap("a.snapshot"), snap("b.snapshot"));
    let (a, b) = (
        replica(&redis, &["--snapshot", &sa]),
        replica(&redis, &["--snapshot", &sb]),
    );
    write_fleet(&[&a, &b], "one");
    settle(&[&a, &b]);
    assert!(a.stop().success());
    write_fleet(&[&b], "two");
    assert!(b.stop().success());
    let _: () = redis_cmd(redis.port, &mut ::redis::cmd("FLUSHALL")).unwrap();
    let restart = |path: Option<String>| {
        let url = redis.url("kvix");
        std::thread::spawn(move || {
            let mut args = vec!["--cores", "2", "--log", &url, "--log-empty-wait", "10"];
            if let Some(path) = &path {
                args.extend_from_slice(&["--snapshot", path]);
            }
            Server::start(&args)
        })
    };
    let started = [restart(Some(sa)), restart(Some(sb)), restart(None)];
    let [a, b, c] = started.map(|s| s.join().expect("each replica starts from the rebuilt log"));
    let mut on_c = c.session();
    for name in ["one-w0", "one-p1", "two-w0", "two-p2"] {
        assert!(on_c.worker_id(name).is_some(), "{name} is gone");
    }
    write_fleet(&[&a, &b, &c], "three");
    settle(&[&a, &b, &c]);
    assert_identical(&[&a, &b, &c]);
    drop((a, b, c));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A replica started while the log is lost and the running replica that holds the
/// fleet's state has not rebuilt it yet (here: paused) waits for it, unready and
/// creating nothing, and starts from the rebuilt log. It used to begin a new, empty log
/// at once: the running replica's rebuild then found another generation and stopped,
/// and the fleet's state was gone.
#[test]
fn a_replica_started_on_a_lost_log_waits_for_the_running_ones_to_rebuild_it() {
    if available("lost_log_join").is_none() {
        return;
    }
    let redis = Redis::start("lost-join");
    let a = replica(&redis, &[]);
    write_fleet(&[&a], "one");
    settle(&[&a]);
    a.pause(true);
    let _: () = redis_cmd(redis.port, &mut ::redis::cmd("FLUSHALL")).unwrap();
    let connections = || redis_info(&redis, "stats", "total_connections_received").unwrap();
    let before = connections();
    let starting = {
        let url = redis.url("kvix");
        std::thread::spawn(move || Server::start(&["--cores", "2", "--log", &url]))
    };
    // Its start and two looks at the empty key (a, paused, connects nowhere).
    wait_for("the new replica looks at the key", &|| {
        connections() >= before + 3
    });
    let generation: Option<String> =
        redis_cmd(redis.port, ::redis::cmd("GET").arg("kvix:generation")).unwrap();
    assert_eq!(
        generation, None,
        "a replica began a new log while the fleet's state was held"
    );
    a.pause(false);
    let c = starting.join().expect("it starts once the log is rebuilt");
    rebuilt(&[&a]);
    assert!(c.session().worker_id("one-w0").is_some());
    write_fleet(&[&a, &c], "two");
    settle(&[&a, &c]);
    assert_identical(&[&a, &c]);
    assert_eq!(a.metric(&stopped("replaced")), 0);
}

/// A replica that finds the key empty and nobody to rebuild it refuses to start after
/// --log-empty-wait, naming the ways to begin an empty fleet, and creates nothing;
/// `kvix-server log reset` begins one, which a waiting replica then starts on, and
/// refuses to touch a live log.
#[test]
fn an_empty_log_is_begun_only_on_the_operators_word() {
    if available("empty_key").is_none() {
        return;
    }
    let redis = Redis::start("empty-key");
    let url = redis.url("kvix");
    let out = bare_command(&["--cores", "1", "--log", &url, "--log-empty-wait", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a replica began a log on its own: {err}"
    );
    for says in ["is empty", "--log-new", "kvix-server log reset"] {
        assert!(err.contains(says), "{says}: {err}");
    }
    let keys: Vec<String> = redis_cmd(redis.port, ::redis::cmd("KEYS").arg("*")).unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    let waiting = {
        let url = url.clone();
        std::thread::spawn(move || Server::start(&["--cores", "2", "--log", &url]))
    };
    let reset = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvix-server"))
            .args(["log", "reset", "--log", &url])
            .output()
            .unwrap()
    };
    let out = reset();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("a new, empty log"), "{said}");
    let a = waiting
        .join()
        .expect("the waiting replica starts on the reset log");
    write_fleet(&[&a], "one");
    let out = reset();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a live log was reset");
    assert!(
        err.contains("is live") && err.contains("nothing was reset"),
        "{err}"
    );
    assert!(a.session().worker_id("one-w0").is_some());
}

/// Redis at maxmemory refuses every append (writes get LogUnavailable) and the log
/// heals by itself: the next snapshot trims the stream before it stores itself, which
/// frees the memory. The snapshot's store used to abort under OOM before the trim, so
/// the stream was never trimmed and writes stayed refused until an operator stepped in.
#[test]
fn redis_out_of_memory_refuses_writes_then_heals_by_itself() {
    if available("redis_oom").is_none() {
        return;
    }
    let redis = Redis::start("oom");
    let dir = std::env::temp_dir().join(format!("kvix-replica-oom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("a.snapshot");
    let snap = snap.to_str().unwrap();
    let a = replica(&redis, &["--snapshot", snap, "--snapshot-every", "1"]);
    let ks = Keyspace::tokens("m");
    let mut c = a.session();
    let w = c.events_worker("w");
    let chain = chain_of(&ks, 0, 4096);
    // A little above what Redis uses now: the stream fills it within a few hundred
    // batches.
    let used = redis_info(&redis, "memory", "used_memory").unwrap();
    set_maxmemory(&redis, used + (256 << 10));
    let batch = |seq: u64| {
        let at = (seq as usize * 4) % 4000;
        stored_at(w, seq, &ks, at as u32, &chain[at..at + 4])
    };
    let mut seq = 0;
    let refused = loop {
        let r = c.ask(&batch(seq));
        if r.kind != Kind::Applied {
            break r.error();
        }
        seq += 1;
        assert!(seq < 100_000, "Redis never ran out of memory");
    };
    assert_eq!(
        refused.code,
        ErrorCode::LogUnavailable,
        "{}",
        refused.message
    );
    // No operator: the next snapshot trims the log before it stores itself, and the
    // refused batch is applied. (Memory at the limit comes and goes by some 20 KB as
    // client buffers do: a write may get through before the trim, so the trim is
    // waited for first.)
    wait_for("a snapshot's trim", &|| {
        a.metric("kvix_log_trimmed_total") > 0
    });
    let applied = until_applied(&mut c, &batch(seq), || {});
    assert_eq!(applied.status, ApplyStatus::Applied);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis out of memory refuses a replica's position report (sent every 5 s) as it
/// refuses appends: the follower reports again later and reads on, on the same
/// connection. A refused command is not a lost connection: a follower that took it for
/// one reconnected in a loop, counting each as a failed read.
#[test]
fn a_refused_position_report_does_not_cost_the_follower_its_connection() {
    if available("refused_report").is_none() {
        return;
    }
    let redis = Redis::start("report");
    let a = replica(&redis, &[]);
    let ks = Keyspace::tokens("m");
    let mut c = a.session();
    let w = c.events_worker("w");
    let chain = chain_of(&ks, 0, 8);
    let refused = || redis_info(&redis, "errorstats", "errorstat_OOM").unwrap_or(0);
    set_maxmemory(&redis, 1);
    // Two reports refused: the follower went on after the first.
    wait_for("two refused position reports", &|| refused() >= 2);
    assert_eq!(
        a.metric("kvix_log_read_failures_total"),
        0,
        "{}",
        a.scrape()
    );
    set_maxmemory(&redis, 0);
    let r = c.ask(&stored_at(w, 0, &ks, 0, &chain));
    assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
}

/// Redis refusing the follower's reads (here an ACL that denies XREAD; in the field a
/// Redis still loading its AOF): the follower keeps its connection and asks again after
/// a pause that grows, and follows again once reads are allowed. A follower that took
/// a refusal for a lost connection reconnected and read again in a loop, as fast as
/// Redis answered.
#[test]
fn a_refused_read_is_asked_again_later_on_the_same_connection() {
    if available("refused_read").is_none() {
        return;
    }
    let redis = Redis::start("refused-read");
    let (a, b) = (replica(&redis, &[]), replica(&redis, &[]));
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 8);
    let mut ca = a.session();
    let w = ca.events_worker("w");
    settle(&[&a, &b]);
    let acl = |rule: &str| {
        let _: () = redis_cmd(
            redis.port,
            ::redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule),
        )
        .unwrap();
    };
    // The followers' connections, by id (each names itself kvix-follow-REPLICA).
    let followers = || -> Vec<String> {
        let list: String = redis_cmd(redis.port, ::redis::cmd("CLIENT").arg("LIST")).unwrap();
        let mut ids: Vec<String> = list
            .lines()
            .filter(|l| l.contains("name=kvix-follow-"))
            .filter_map(|l| l.split(' ').next().map(str::to_string))
            .collect();
        ids.sort();
        ids
    };
    let before = followers();
    assert_eq!(before.len(), 2, "{before:?}");
    acl("-xread");
    wait_for("three refused reads on each replica", &|| {
        [&a, &b]
            .iter()
            .all(|s| s.metric("kvix_log_read_failures_total") >= 3)
    });
    assert_eq!(followers(), before, "the followers reconnected");
    acl("+xread");
    let r = ca.ask(&stored_at(w, 0, &ks, 0, &chain));
    assert_eq!(r.kind, Kind::Applied, "{:?}", r.message());
    settle(&[&a, &b]);
    let held = vec![Score {
        worker: w,
        blocks: 8,
    }];
    assert_eq!(b.session().query(&ks, &chain).scores, held);
}

/// A write appended while the follower cannot read the log back (here an ACL that
/// denies XREAD; in the field Redis killed between the append and the read) is answered
/// `LogUnavailable` at the follower's next failed read, not held until the log returns:
/// a client waiting on it waited for ever. Once reads are allowed it applies, once, and
/// the client's retry is answered `Duplicate`.
#[test]
fn a_write_appended_while_the_log_cannot_be_read_back_is_refused_not_held() {
    if available("unread_append").is_none() {
        return;
    }
    let redis = Redis::start("unread-append");
    let a = replica(&redis, &[]);
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 8);
    let mut c = a.session();
    let w = c.events_worker("w");
    settle(&[&a]);
    let acl = |rule: &str| {
        let _: () = redis_cmd(
            redis.port,
            ::redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule),
        )
        .unwrap();
    };
    acl("-xread");
    // The read already blocked in Redis passed its check: wait for one refused.
    wait_for("a refused read", &|| {
        a.metric("kvix_log_read_failures_total") >= 1
    });
    let batch = stored_at(w, 0, &ks, 0, &chain);
    let refused = c.ask(&batch).error();
    assert_eq!(refused.code, ErrorCode::LogUnavailable);
    assert!(
        refused.message.contains("may still apply"),
        "{}",
        refused.message
    );
    acl("+xread");
    let again = until_applied(&mut c, &batch, || {});
    assert_eq!(again.status, ApplyStatus::Duplicate, "applied once");
    let held = vec![Score {
        worker: w,
        blocks: 8,
    }];
    assert_eq!(c.query(&ks, &chain).scores, held);
}

/// Redis's `maxmemory` (0: no limit).
fn set_maxmemory(redis: &Redis, bytes: u64) {
    let mut set = ::redis::cmd("CONFIG");
    set.arg("SET").arg("maxmemory").arg(bytes);
    let _: () = redis_cmd(redis.port, &mut set).unwrap();
}

/// A number in Redis's `INFO section`: `field:N`, or `field:count=N,...` (errorstats).
fn redis_info(redis: &Redis, section: &str, field: &str) -> Option<u64> {
    let info: String = redis_cmd(redis.port, ::redis::cmd("INFO").arg(section)).unwrap();
    let value = info
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let value = value.strip_prefix("count=").unwrap_or(value);
    value.split(',').next()?.trim().parse().ok()
}

/// Every replica holds all `blocks` of `chain` for `w`, and applied each of `again`
/// once (sent again, it is a duplicate).
fn whole_and_once(
    replicas: &[&Server],
    ks: &Keyspace,
    chain: &[u64],
    w: WorkerId,
    blocks: u32,
    again: &[EventBatch],
) {
    for s in replicas {
        let mut c = s.session();
        let want = vec![Score { worker: w, blocks }];
        assert_eq!(c.query(ks, chain).scores, want, "nothing lost");
        for b in again {
            // A write may be refused while the log is failing over (a Sentinel on a loaded
            // machine can flag the new primary down for a moment): the client retries.
            let status = until_applied(&mut c, b, || {}).status;
            assert_eq!(
                status,
                ApplyStatus::Duplicate,
                "batch {} applied once",
                b.seq
            );
        }
    }
}

/// Sends `batch` until it is applied (10 s at most), as a writer does while the log is
/// away: every refusal must be `LogUnavailable`, and is reported to `refused`.
fn until_applied(c: &mut Conn, batch: &EventBatch, refused: impl Fn()) -> Applied {
    for _ in 0..500 {
        let r = c.ask(batch);
        if r.kind == Kind::Applied {
            return r.decode();
        }
        assert_eq!(
            r.error().code,
            ErrorCode::LogUnavailable,
            "batch {}",
            batch.seq
        );
        refused();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("batch {} never applied", batch.seq);
}

/// Block `seq` of `chain` stored alone, as vLLM sends a decoded block.
fn decode_block(w: WorkerId, ks: &Keyspace, chain: &[u64], seq: u64) -> EventBatch {
    let at = seq as usize;
    stored_at(w, seq, ks, seq as u32, &chain[at..at + 1])
}

/// Waits (at most 30 s) until `f` holds.
fn wait_for(what: &str, f: &dyn Fn() -> bool) {
    for _ in 0..1500 {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("never happened: {what}");
}

/// A writer that sends one-block event batches (vLLM decode's shape) to two replicas in
/// turn, retrying each refused batch until it is applied, and a reader querying
/// throughout: Redis is paused, or killed and restarted, once `at` batches are in and
/// brought back after `refusals` refused writes. Every query must be answered, every
/// batch applied once, and the replicas identical.
fn outage_under_load(kill: bool) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::sync::Arc;
    const BATCHES: u64 = 60;
    let (at, refusals) = (20, 3);
    let mut redis = Redis::start(if kill { "killed" } else { "paused" });
    let (a, b) = (replica(&redis, &[]), replica(&redis, &[]));
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, BATCHES as usize);
    let w = a.session().events_worker("decoder");
    let batch = |seq: u64| decode_block(w, &ks, &chain, seq);
    let (applied, refused, done) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let writer = {
        let (mut conns, batches) = (
            [a.session(), b.session()],
            (0..BATCHES).map(batch).collect::<Vec<_>>(),
        );
        let (applied, refused) = (applied.clone(), refused.clone());
        std::thread::spawn(move || {
            for (seq, msg) in batches.iter().enumerate() {
                until_applied(&mut conns[seq % 2], msg, || {
                    refused.fetch_add(1, SeqCst);
                });
                applied.fetch_add(1, SeqCst);
            }
        })
    };
    let reader = {
        let (mut c, ks, chain, done) = (b.session(), ks.clone(), chain.clone(), done.clone());
        std::thread::spawn(move || {
            let mut answered = 0u64;
            while !done.load(SeqCst) {
                // Answered from memory whatever Redis does: `query` fails the test on
                // anything but an Answer.
                let depth = c.query(&ks, &chain).scores.first().map_or(0, |s| s.blocks);
                assert!(u64::from(depth) <= BATCHES);
                answered += 1;
            }
            answered
        })
    };
    wait_for("20 batches in", &|| applied.load(SeqCst) >= at);
    if kill {
        redis.kill();
    } else {
        redis.pause(true);
    }
    wait_for("writes refused", &|| refused.load(SeqCst) >= refusals);
    if kill {
        redis.restart();
    } else {
        redis.pause(false);
    }
    writer
        .join()
        .expect("the writer got only Applied or LogUnavailable");
    done.store(true, SeqCst);
    assert!(reader.join().expect("every query answered") > 0);
    settle(&[&a, &b]);
    let again: Vec<EventBatch> = [0, at, BATCHES - 1].into_iter().map(batch).collect();
    whole_and_once(&[&a, &b], &ks, &chain, w, BATCHES as u32, &again);
    assert!(refused.load(SeqCst) >= refusals);
}

#[test]
fn redis_paused_under_load_refuses_writes_answers_queries_and_loses_or_doubles_nothing() {
    if available("redis_paused_under_load").is_none() {
        return;
    }
    outage_under_load(false);
}

#[test]
fn redis_killed_under_load_refuses_writes_answers_queries_and_loses_or_doubles_nothing() {
    if available("redis_killed_under_load").is_none() {
        return;
    }
    outage_under_load(true);
}

/// Runs one Redis command against a server of the test, with a timeout.
fn redis_cmd<T: ::redis::FromRedisValue>(
    port: u16,
    cmd: &mut ::redis::Cmd,
) -> ::redis::RedisResult<T> {
    let client = ::redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut c = client.get_connection_with_timeout(std::time::Duration::from_secs(2))?;
    cmd.query(&mut c)
}

#[test]
fn through_sentinel_the_log_follows_a_redis_failover_and_loses_nothing_acknowledged() {
    if available("sentinel_failover").is_none() {
        return;
    }
    let mut primary = Redis::start("sentinel-primary");
    let standby = Redis::replica_of("sentinel-standby", &primary);
    let sentinel = Redis::sentinel("sentinel", &primary, "logmaster");
    let master_port = || {
        redis_cmd::<Vec<String>>(
            sentinel.port,
            ::redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg("logmaster"),
        )
        .ok()
        .and_then(|a| a.get(1)?.parse::<u16>().ok())
    };
    // WAIT below counts only a standby that finished its first sync (on a loaded
    // machine that may take longer than WAIT's own timeout).
    wait_for("the standby is in sync with the primary", &|| {
        redis_cmd::<String>(standby.port, ::redis::cmd("INFO").arg("replication"))
            .is_ok_and(|info| info.contains("master_link_status:up"))
    });
    wait_for("the sentinel knows the standby", &|| {
        redis_cmd::<Vec<::redis::Value>>(
            sentinel.port,
            ::redis::cmd("SENTINEL").arg("replicas").arg("logmaster"),
        )
        .is_ok_and(|r| !r.is_empty())
    });
    let url = format!(
        "redis+sentinel://127.0.0.1:{}/logmaster/kvix",
        sentinel.port
    );
    let a = Server::start(&["--cores", "2", "--log", &url, "--log-new"]);
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 20);
    let mut c = a.session();
    let w = c.events_worker("w");
    let batch = |seq: u64| decode_block(w, &ks, &chain, seq);
    for seq in 0..10 {
        assert_eq!(c.ask(&batch(seq)).kind, Kind::Applied);
    }
    // Acknowledged writes are on the standby before the primary dies (Redis replicates
    // asynchronously: docs/operations.md says what a failover can lose otherwise).
    let waited: i64 = redis_cmd(primary.port, ::redis::cmd("WAIT").arg(1).arg(5000)).unwrap();
    assert_eq!(waited, 1);
    primary.kill();
    wait_for("the sentinel promoted the standby", &|| {
        master_port() == Some(standby.port)
    });
    // Writes are refused until the log reconnects to the new primary, then applied.
    for seq in 10..20 {
        until_applied(&mut c, &batch(seq), || {});
    }
    // A replica that starts now reads the whole log from the new primary.
    let b = Server::start(&["--cores", "2", "--log", &url]);
    settle(&[&a, &b]);
    whole_and_once(&[&a, &b], &ks, &chain, w, 20, &[batch(5)]);
}

/// A real vLLM publisher whose worker the replicas ingest under a lease, and the
/// 8-block prompt it stores piece by piece.
struct Leased {
    publisher: common::engines::Publisher,
    ks: Keyspace,
    tokens: Vec<u32>,
    chain: Vec<u64>,
    w: WorkerId,
}

impl Leased {
    /// Whether redis-server and the real publishers can run here (see `available`).
    fn available(test: &str) -> bool {
        available(test).is_some() && common::engines::available(test).is_some()
    }

    /// Starts the publisher and announces its worker through `via`.
    fn start(via: &Server) -> Leased {
        let (ports, publisher) = common::engines::Ports::start_one("vllm-0.34.0");
        let w = via
            .session()
            .announce_source("engine", vec![Lane::full(16)], ports.source(0, ""))
            .unwrap()
            .worker;
        let ks = Keyspace::tokens("m");
        let tokens: Vec<u32> = (0..128).collect();
        let chain = chain::token_chain(ks.seed(16), 16, &tokens);
        Leased {
            publisher,
            ks,
            tokens,
            chain,
            w,
        }
    }

    /// Publishes blocks `from..to` of the prompt in one BlockStored event.
    fn store(&mut self, from: usize, to: usize) {
        let event = serde_json::json!({
            "type": "BlockStored",
            "block_hashes": (from..to).map(|i| 1000 + i as u64).collect::<Vec<_>>(),
            "parent_block_hash": (from > 0).then_some(1000 + from as u64 - 1),
            "token_ids": &self.tokens[from * 16..to * 16],
            "block_size": 16,
            "lora_id": null,
            "medium": "GPU",
            "lora_name": null,
        });
        self.publisher.publish(vec![event]);
    }

    /// Publishes blocks `from..to` and waits until every one of `on` holds them.
    fn store_on(&mut self, from: usize, to: usize, on: &[&Server]) {
        self.store(from, to);
        for s in on {
            self.await_score(s, to as u32);
        }
    }

    /// Waits (at most 30 s) until `s` answers that the worker holds `blocks` blocks.
    fn await_score(&self, s: &Server, blocks: u32) {
        let mut c = s.session();
        let want = vec![Score {
            worker: self.w,
            blocks,
        }];
        for _ in 0..600 {
            if c.query(&self.ks, &self.chain).scores == want {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("never scored {blocks}:\n{}", s.scrape());
    }
}

/// Two replicas of `redis`'s log and an engine announced through the first, its first 3
/// blocks stored and applied on both.
fn two_replicas_and_an_engine(redis: &Redis) -> (Server, Server, Leased) {
    let (a, b) = (replica(redis, &[]), replica(redis, &[]));
    let mut engine = Leased::start(&a);
    engine.store_on(0, 3, &[&a, &b]);
    (a, b, engine)
}

/// Redis drops every client connection (the replicas' ones).
fn drop_connections(redis: &Redis) -> u64 {
    redis_cmd(
        redis.port,
        ::redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"),
    )
    .expect("CLIENT KILL")
}

/// Waits (bounded) until each of `replicas` rebuilt the lost log once and caught up.
fn rebuilt(replicas: &[&Server]) {
    wait_for("the replicas rebuild the log", &|| {
        replicas.iter().all(|s| {
            s.metric("kvix_log_rebuilds_total") == 1 && s.metric("kvix_log_caught_up") == 1
        })
    });
}

fn leases_held(s: &Server) -> u64 {
    s.metric("kvix_ingest_leases_held")
}

#[test]
fn one_replica_ingests_each_engine_and_another_takes_over_when_it_dies() {
    if !Leased::available("ingest_lease") {
        return;
    }
    let redis = Redis::start("lease");
    let (a, b, mut engine) = two_replicas_and_an_engine(&redis);
    assert_eq!(
        leases_held(&a) + leases_held(&b),
        1,
        "exactly one replica ingests the engine:\n{}\n{}",
        a.scrape(),
        b.scrape()
    );
    let (holder, other) = if leases_held(&a) == 1 { (a, b) } else { (b, a) };
    holder.kill();
    // Published while nobody ingests: the next holder catches up from the replay.
    engine.store(3, 5);
    engine.store(5, 8);
    engine.await_score(&other, 8);
    assert_eq!(leases_held(&other), 1);
    engine.publisher.stop();
}

/// Engines that connect (`--events-bind`) to replicas behind one address, as a
/// Kubernetes Service spreads connections: vLLM 0.34's real publisher connects through a
/// TCP proxy to the first replica up, which takes the engine's ingest lease and logs its
/// batches for every replica to apply. Killed (-9), its connection drops with it; the
/// publisher reconnects through the proxy to the other replica, which takes the lease
/// once the dead one's runs out and asks the engine's replay from the last batch the
/// log holds, so what was published meanwhile is not lost. `--events-bind` was refused
/// with `--log`.
#[test]
fn a_connecting_engine_moves_to_another_replica_when_its_replica_dies() {
    if !Leased::available("bound_replicas") {
        return;
    }
    let redis = Redis::start("bound");
    let port = common::free_ports(3);
    let (replay, bind) = (port + 2, |p: u16| format!("tcp://127.0.0.1:{p}"));
    let bound = |events: u16| {
        replica(
            &redis,
            &[
                "--events-bind",
                &bind(events),
                "--events-replay-port",
                &replay.to_string(),
                "--events-grace",
                "3",
            ],
        )
    };
    let (a, b) = (bound(port), bound(port + 1));
    let proxy = proxy(vec![port, port + 1]);
    let publisher = common::engines::Publisher::try_start_topic(
        "vllm-0.34.0",
        &bind(proxy),
        Some(&bind(replay)),
        0,
        "kv@127.0.0.1@m",
    )
    .expect("the replay port is free");
    let ks = Keyspace::tokens("m");
    let tokens: Vec<u32> = (0..128).collect();
    let mut engine = Leased {
        publisher,
        chain: chain::token_chain(ks.seed(16), 16, &tokens),
        ks,
        tokens,
        w: 0,
    };
    let mut on_b = b.session();
    for _ in 0..600 {
        if let Some(w) = on_b.worker_id("127.0.0.1") {
            engine.w = w;
            break;
        }
        engine.publisher.publish(Vec::new());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        on_b.worker_id("127.0.0.1"),
        Some(engine.w),
        "never announced"
    );
    engine.store_on(0, 3, &[&a, &b]);
    assert_eq!(
        (leases_held(&a), leases_held(&b)),
        (1, 0),
        "the replica the engine is connected to ingests it"
    );
    a.kill();
    // Published while the connection moves: the next holder gets them from the replay.
    engine.store(3, 5);
    engine.store(5, 8);
    engine.await_score(&b, 8);
    assert_eq!(leases_held(&b), 1);
    assert_eq!(b.metric("kvix_ingest_engines_gone_total"), 0);
    // Gone from every replica past --events-grace: retired.
    engine.publisher.stop();
    let on_b = std::cell::RefCell::new(on_b);
    wait_for("the gone engine retired", &|| {
        on_b.borrow_mut().worker_id("127.0.0.1").is_none()
    });
    assert!(b.metric("kvix_ingest_engines_gone_total") >= 1);
}

/// A TCP proxy on a free port (returned) that sends each new connection to the first of
/// `backends` (ports) that accepts it, as a Kubernetes Service sends connections to live
/// pods; a connection ends when either side does.
fn proxy(backends: Vec<u16>) -> u16 {
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Some(server) = backends
                .iter()
                .find_map(|p| TcpStream::connect(("127.0.0.1", *p)).ok())
            else {
                continue;
            };
            let ends = [
                (client.try_clone(), server.try_clone()),
                (Ok(server), Ok(client)),
            ];
            for (from, to) in ends {
                let (Ok(mut from), Ok(mut to)) = (from, to) else {
                    continue;
                };
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                });
            }
        }
    });
    port
}

/// A renewal that fails (here: Redis drops the replica's connections) makes the replica
/// stop ingesting; its lease is still in Redis under its name when it reconnects, and
/// renewing it must mean leading the engine again, not assuming it already does.
#[test]
fn a_lease_renewed_after_a_failed_round_is_led_again() {
    if !Leased::available("lease_renewed") {
        return;
    }
    let redis = Redis::start("renewed");
    let a = replica(&redis, &[]);
    let mut engine = Leased::start(&a);
    engine.store(0, 3);
    engine.await_score(&a, 3);
    wait_for("the lease taken", &|| leases_held(&a) == 1);
    let taken = a.metric("kvix_ingest_lease_changes_total");
    let killed = drop_connections(&redis);
    assert!(killed > 0, "the replica's connections were dropped");
    // The lease thread's next round finds its connection gone and takes the lease up
    // again (its appends may have gone through before, on connections made anew).
    wait_for("the renewed lease taken up again", &|| {
        a.metric("kvix_ingest_lease_changes_total") > taken
    });
    engine.store(3, 8);
    engine.await_score(&a, 8);
    assert_eq!(leases_held(&a), 1);
    engine.publisher.stop();
}

/// A lost log rebuilt under an engine's event stream: the new log's ingest leases count
/// on from the base's epochs, so the engine's next batches are applied, not dropped as a
/// deposed holder's (the flushed epoch counter would start again below the epoch every
/// replica has applied), and every replica holds what the engine holds.
#[test]
fn an_engine_stream_goes_on_through_a_rebuilt_log() {
    if !Leased::available("rebuilt_lease") {
        return;
    }
    let redis = Redis::start("rebuilt-lease");
    let (a, b, mut engine) = two_replicas_and_an_engine(&redis);
    // The lease taken again four times (its connection dropped): epoch 5, above what a
    // flushed counter gives before the stream is led again.
    let changes = || {
        a.metric("kvix_ingest_lease_changes_total") + b.metric("kvix_ingest_lease_changes_total")
    };
    for _ in 0..4 {
        let taken = changes();
        drop_connections(&redis);
        wait_for("the lease taken again", &|| changes() > taken);
    }
    // Applied under epoch 5 everywhere.
    engine.store_on(3, 5, &[&a, &b]);
    let _: () = redis_cmd(redis.port, &mut ::redis::cmd("FLUSHALL")).unwrap();
    rebuilt(&[&a, &b]);
    engine.store_on(5, 8, &[&a, &b]);
    engine.publisher.stop();
}

/// Redis refuses appends (maxmemory) while the ingest holder keeps its lease (a renewal
/// needs no memory): the batches the engine published meanwhile were refused on their
/// way, after the holder's stream had moved past them. Once the log takes writes again
/// they come back from the engine's replay (the stream is rewound to the last batch
/// applied) and every replica holds what the engine holds. They used to be skipped for
/// good: every replica answered 3 blocks where the engine held 8.
#[test]
fn engine_batches_the_log_refused_are_replayed_not_skipped() {
    if !Leased::available("refused_ingest") {
        return;
    }
    let redis = Redis::start("refused-ingest");
    let (a, b, mut engine) = two_replicas_and_an_engine(&redis);
    wait_for("one lease held", &|| leases_held(&a) + leases_held(&b) == 1);
    let holder = if leases_held(&a) == 1 { &a } else { &b };
    let refused = holder.metric("kvix_log_append_failures_total");
    let maxmemory = |bytes: u64| {
        let _: () = redis_cmd(
            redis.port,
            ::redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(bytes),
        )
        .unwrap();
    };
    maxmemory(1);
    engine.store(3, 5);
    wait_for("the holder's appends refused", &|| {
        holder.metric("kvix_log_append_failures_total") > refused
    });
    maxmemory(0);
    engine.store_on(5, 8, &[&a, &b]);
    assert_eq!(leases_held(holder), 1, "the lease stayed put");
    assert!(
        holder.metric("kvix_ingest_rewinds_total") >= 1,
        "{}",
        holder.scrape()
    );
    engine.publisher.stop();
}

/// A placement-fed engine that lost its cache, as one replica's gateway reports it: the
/// replica drops the worker's placements through the log, so every replica drops them
/// (a verdict stays each replica's own; what the index holds may not differ).
#[test]
fn a_lost_cache_reported_to_one_replica_is_dropped_by_every_replica() {
    if available("lost_cache").is_none() {
        return;
    }
    let redis = Redis::start("lost-cache");
    let (a, b) = (replica(&redis, &[]), replica(&redis, &[]));
    let mut on_a = a.session_as("gateway-1");
    let feed = Feed::Placements {
        capacity_blocks: 64,
        ttl_ms: 0,
    };
    let w = on_a
        .announce("p", vec![Lane::full(16)], feed)
        .unwrap()
        .worker;
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 10);
    let placed = on_a.ask(&Placement {
        worker: w,
        keyspace: ks.clone(),
        chain: chain.clone(),
    });
    assert_eq!(placed.kind, Kind::Ack);
    wait_for("b holds the placement", &|| {
        b.session().query(&ks, &chain).scores.len() == 1
    });
    let lost = Reuse {
        worker: w,
        model: "m".into(),
        predicted_tokens: Some(160),
        cached_tokens: 0,
        prompt_tokens: 170,
    };
    for _ in 0..4 {
        let r = on_a.ask(&ReuseReport {
            reports: vec![lost.clone()],
        });
        assert_eq!(r.kind, Kind::Ack);
    }
    wait_for("both replicas drop it", &|| {
        a.session().query(&ks, &chain).scores.is_empty()
            && b.session().query(&ks, &chain).scores.is_empty()
    });
    assert_eq!(a.metric("kvix_reuse_caches_lost_total"), 1);
    assert_eq!(b.metric("kvix_reuse_caches_lost_total"), 0);
}
