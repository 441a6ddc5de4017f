//! kvix-client against the real kvix-server binary: announce + feed + query by tokens
//! (names in the answers), fail-open while the server is killed mid-load, reconnect to a
//! fresh server on the same port with every announced worker re-announced,
//! the Unix socket transport, the blocking client, and a query whose server is killed
//! under it answered by the next server. No assertion on durations
//! tighter than deadline + 1 s; every wait is a bounded loop.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvix_client::blocking::BlockingClient;
use kvix_client::wire::{
    Applied, ApplyStatus, ChunkKind, ErrorCode, Feed, Keyspace, Kind, Lane, Retire, Stats,
    StatsRequest,
};
use kvix_client::{
    Addr, Client, ClientConfig, ClientError, QueryOptions, QueryOutcome, WorkerRef, WorkerScore,
};

const PATIENCE: Duration = Duration::from_secs(5);

fn config(server: Addr) -> ClientConfig {
    ClientConfig {
        // Generous: the tests share a loaded 2-core machine with the server.
        deadline: Duration::from_secs(2),
        reconnect_min: Duration::from_millis(5),
        reconnect_max: Duration::from_millis(50),
        ..ClientConfig::new([server])
    }
}

fn tcp(s: &Server) -> Addr {
    Addr::tcp(s.addr.to_string())
}

fn ks() -> Keyspace {
    Keyspace::tokens("m")
}

fn opts() -> QueryOptions {
    QueryOptions::default()
}

/// `blocks` full blocks of 16 tokens, `base, base+1, ...` (as `common::chain_of` hashes).
fn tokens(base: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks as u32 * 16)).map(|i| base + i).collect()
}

fn full() -> Vec<Lane> {
    vec![Lane::full(16)]
}

fn placements(capacity_blocks: u64) -> Feed {
    Feed::Placements {
        capacity_blocks,
        ttl_ms: 0,
    }
}

/// Stores `chain[..]` from block 0 for `worker` on lane 0, over a raw connection.
fn store(conn: &mut Conn, worker: u32, seq: u64, keyspace: &Keyspace, chain: &[u64]) {
    let r = conn.ask(&stored_batch(worker, seq, keyspace, chain));
    assert_eq!(r.decode::<Applied>().status, ApplyStatus::Applied);
}

fn raw_stats(conn: &mut Conn) -> Stats {
    conn.ask(&StatsRequest {}).decode()
}

fn score(worker: u32, name: &str, blocks: u32) -> WorkerScore {
    WorkerScore::on_gpu(worker, Some(name.into()), blocks)
}

/// Queries until `done` holds for the outcome (placements are fire-and-forget, so they
/// land some time after `publish_placement`); returns the last outcome.
async fn query_until(
    c: &Client,
    keyspace: &Keyspace,
    prompt: &[u32],
    done: impl Fn(&QueryOutcome) -> bool,
) -> QueryOutcome {
    let mut out = QueryOutcome::Empty;
    for _ in 0..500 {
        out = c.query_tokens(keyspace, prompt, &opts()).await;
        if done(&out) {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    out
}

fn best_is(out: &QueryOutcome, name: &str, blocks: u32) -> bool {
    out.best()
        .is_some_and(|b| b.name.as_deref() == Some(name) && b.blocks == blocks)
}

#[tokio::test]
async fn announced_workers_fed_by_events_and_placements_score_by_name() {
    let server = Server::start(&["--cores", "2"]);
    let c = Client::connect(config(tcp(&server))).await.unwrap();
    assert!(c.is_connected());
    let a = c.announce("ev-a", full(), Feed::Events).await.unwrap();
    let b = c.announce("ev-b", full(), Feed::Events).await.unwrap();
    let p = c.announce("pl", full(), placements(1000)).await.unwrap();
    assert!(a != b && b != p && a != p, "{a} {b} {p}");
    assert_eq!(
        (c.worker_id("ev-a"), c.worker_id("ev-b"), c.worker_id("pl")),
        (Some(a), Some(b), Some(p))
    );
    // Announcing again under the same name is the same worker.
    assert_eq!(c.announce("ev-a", full(), Feed::Events).await.unwrap(), a);
    assert_eq!(c.stats().await.unwrap().workers, 3);

    let prompt = tokens(0, 20);
    let chain = c.token_chain(&ks(), &prompt);
    // The client hashes exactly as the server's own tests do.
    assert_eq!(chain, chain_of(&ks(), 0, 20));

    // Engine events over a raw connection, for the ids the client was given.
    let mut raw = server.session();
    store(&mut raw, a, 0, &ks(), &chain);
    store(&mut raw, b, 0, &ks(), &chain[..7]);
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Scores(vec![score(a, "ev-a", 20), score(b, "ev-b", 7)])
    );

    // A placement through the client, by name.
    assert!(c.publish_placement("pl", &ks(), chain[..12].to_vec()));
    // It lands shard by shard (fire-and-forget), so wait for the whole of it.
    let want = QueryOutcome::Scores(vec![
        score(a, "ev-a", 20),
        score(p, "pl", 12),
        score(b, "ev-b", 7),
    ]);
    let out = query_until(&c, &ks(), &prompt, |o| *o == want).await;
    assert_eq!(out, want);
    assert_eq!(c.counters().placements_sent, 1);

    // A trailing partial block does not count; a prompt that diverges at block 5 scores 5.
    let mut longer = prompt.clone();
    longer.extend([9, 9, 9]);
    assert_eq!(
        c.query_tokens(&ks(), &longer, &opts()).await.best(),
        Some(&score(a, "ev-a", 20))
    );
    let mut diverged = prompt.clone();
    diverged[5 * 16 + 3] = 77_777;
    // (Ties come in an order the server chooses.)
    let QueryOutcome::Scores(mut tied) = c.query_tokens(&ks(), &diverged, &opts()).await else {
        panic!("no scores for a diverged prompt");
    };
    tied.sort_by_key(|s| s.worker);
    let mut want = vec![score(a, "ev-a", 5), score(b, "ev-b", 5), score(p, "pl", 5)];
    want.sort_by_key(|s| s.worker);
    assert_eq!(tied, want);
    // Candidates by name and by id, top-k, a pre-hashed chain.
    let by_name = QueryOptions {
        candidates: vec![WorkerRef::from("ev-b"), WorkerRef::from("pl")],
        ..opts()
    };
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &by_name).await,
        QueryOutcome::Scores(vec![score(p, "pl", 12), score(b, "ev-b", 7)])
    );
    let by_id = QueryOptions {
        candidates: vec![WorkerRef::Id(b)],
        ..opts()
    };
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &by_id).await,
        QueryOutcome::Scores(vec![score(b, "ev-b", 7)])
    );
    let unknown = QueryOptions {
        candidates: vec![WorkerRef::from("nobody")],
        ..opts()
    };
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &unknown).await,
        QueryOutcome::Empty
    );
    let top1 = QueryOptions { top_k: 1, ..opts() };
    assert_eq!(
        c.query_chain(&ks(), &chain, &top1).await,
        QueryOutcome::Scores(vec![score(a, "ev-a", 20)])
    );
    // Nothing shared: another prompt, another keyspace.
    assert_eq!(
        c.query_tokens(&ks(), &tokens(100_000, 4), &opts()).await,
        QueryOutcome::Empty
    );
    assert_eq!(
        c.query_tokens(&Keyspace::tokens("other"), &prompt, &opts())
            .await,
        QueryOutcome::Empty
    );

    // Retired: gone from the answers and from the server.
    c.retire("ev-b").await.unwrap();
    assert_eq!(c.worker_id("ev-b"), None);
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Scores(vec![score(a, "ev-a", 20), score(p, "pl", 12)])
    );
    assert_eq!(c.stats().await.unwrap().workers, 2);
    assert_eq!(c.echo(vec![1; 8], 32).await.unwrap().len(), 32);
    let n = c.counters();
    assert_eq!((n.disconnected, n.timeouts, n.rejected), (0, 0, 0), "{n:?}");
}

#[tokio::test]
async fn string_prompts_query_the_byte_keyspace() {
    let server = Server::start(&["--cores", "2"]);
    let c = Client::connect(config(tcp(&server))).await.unwrap();
    let w = c.announce("s", full(), placements(100)).await.unwrap();
    let bytes_ks = Keyspace {
        kind: ChunkKind::Bytes,
        ..ks()
    };
    let prompt: Vec<u8> = (0..(3 * 256 + 10)).map(|i| (i % 251) as u8).collect();
    let chain = c.byte_chain(&bytes_ks, &prompt);
    assert_eq!(chain.len(), 3);
    assert!(c.publish_placement(w, &bytes_ks, chain));
    let mut out = QueryOutcome::Empty;
    for _ in 0..500 {
        out = c.query_bytes(&ks(), &prompt, &opts()).await;
        if out.best().is_some_and(|b| b.blocks == 3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(out, QueryOutcome::Scores(vec![score(w, "s", 3)]));
    // The same keyspace's token kind shares nothing with its byte kind.
    let as_tokens: Vec<u32> = prompt.iter().map(|&b| u32::from(b)).collect();
    assert_eq!(
        c.query_tokens(&ks(), &as_tokens, &opts()).await,
        QueryOutcome::Empty
    );
}

#[tokio::test]
async fn the_real_server_refuses_a_block_size_mismatch_and_a_bad_token_at_connect() {
    let server = Server::start(&["--cores", "1", "--block-size", "32"]);
    let e = Client::connect(config(tcp(&server))).await.err().unwrap();
    assert!(matches!(e, ClientError::Refused { .. }), "{e:?}");
    assert_eq!(e.code(), Some(ErrorCode::BlockSizeMismatch));
    let ok = Client::connect(ClientConfig {
        token_block: 32,
        ..config(tcp(&server))
    })
    .await
    .unwrap();
    assert!(ok.is_connected());

    let server = Server::start(&["--cores", "1", "--auth-token", "s3cret"]);
    let e = Client::connect(config(tcp(&server))).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e:?}");
    let ok = Client::connect(ClientConfig {
        auth: Some("s3cret".into()),
        ..config(tcp(&server))
    })
    .await
    .unwrap();
    assert!(ok.is_connected());
}

/// One query of the background load: the phases it started and ended in, its outcome,
/// how long it took.
type Record = (u8, u8, QueryOutcome, Duration);

const RUNNING: u8 = 0;
/// SIGKILL about to be sent, or sent and the process not yet reaped.
const KILLING: u8 = 1;
const KILLED: u8 = 2;
const RESTARTING: u8 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_load_fails_open_then_reconnects_and_reannounces_to_a_fresh_server() {
    let first = Server::start_restartable(&["--cores", "1"]);
    let at = first.addr;
    let c = Client::connect(config(tcp(&first))).await.unwrap();
    let hybrid = vec![
        Lane::full(16),
        Lane::parse("sliding_window:128@16").unwrap(),
    ];
    c.announce("ev", full(), Feed::Events).await.unwrap();
    c.announce("pl", full(), placements(100)).await.unwrap();
    c.announce("hy", hybrid.clone(), Feed::Events)
        .await
        .unwrap();
    c.announce("gone", full(), Feed::Events).await.unwrap();
    c.retire("gone").await.unwrap();
    assert_eq!(c.stats().await.unwrap().workers, 3);

    let prompt = tokens(5, 6);
    let chain = c.token_chain(&ks(), &prompt);
    assert!(c.publish_placement("pl", &ks(), chain.clone()));
    assert!(best_is(
        &query_until(&c, &ks(), &prompt, |o| best_is(o, "pl", 6)).await,
        "pl",
        6
    ));

    // Background load: queries back to back (a short pause between), each under a
    // 200 ms deadline, recorded with the phase it started in.
    let deadline = Duration::from_millis(200);
    let phase = Arc::new(AtomicU8::new(RUNNING));
    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<Record>>> = Arc::default();
    let load = {
        let (c, phase, stop, log, prompt) = (
            c.clone(),
            phase.clone(),
            stop.clone(),
            log.clone(),
            prompt.clone(),
        );
        tokio::spawn(async move {
            let o = QueryOptions {
                deadline: Some(deadline),
                ..QueryOptions::default()
            };
            while !stop.load(Ordering::Acquire) {
                let p = phase.load(Ordering::Acquire);
                let t = Instant::now();
                let out = c.query_tokens(&ks(), &prompt, &o).await;
                let took = t.elapsed();
                let end = phase.load(Ordering::Acquire);
                log.lock().unwrap().push((p, end, out, took));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let count = |log: &Mutex<Vec<Record>>, ph: u8| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _, _)| *p == ph)
            .count()
    };
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let end = Instant::now() + PATIENCE;
        while !cond() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_for("queries before the kill", &|| count(&log, RUNNING) >= 20);

    phase.store(KILLING, Ordering::Release);
    first.kill();
    phase.store(KILLED, Ordering::Release);
    wait_for("queries while the server is dead", &|| {
        count(&log, KILLED) >= 20 && !c.is_connected()
    });

    phase.store(RESTARTING, Ordering::Release);
    let second = tokio::task::spawn_blocking(move || Server::start_on(at, &["--cores", "1"]))
        .await
        .unwrap();
    assert_eq!(second.addr, at);
    assert!(c.wait_connected(PATIENCE).await, "no reconnect");
    stop.store(true, Ordering::Release);
    load.await.unwrap();

    let log = std::mem::take(&mut *log.lock().unwrap());
    for (p, end, out, took) in log.iter() {
        assert!(
            *took < deadline + Duration::from_secs(1),
            "phase {p}..{end}: {out:?} took {took:?}"
        );
        match (*p, *end) {
            // The server was up all along: scored (a deadline missed on a loaded machine
            // is still failing open, never an error).
            (RUNNING, RUNNING) => assert!(
                matches!(out, QueryOutcome::Scores(_) | QueryOutcome::Timeout),
                "{out:?}"
            ),
            // Started after the process was dead: fail open.
            (KILLED, _) => assert!(
                matches!(out, QueryOutcome::Disconnected | QueryOutcome::Timeout),
                "{out:?}"
            ),
            _ => assert!(!matches!(out, QueryOutcome::Rejected(_)), "{out:?}"),
        }
    }
    assert!(log
        .iter()
        .any(|(p, _, o, _)| *p == RUNNING && matches!(o, QueryOutcome::Scores(_))));
    let n = c.counters();
    assert!(n.reconnects >= 1 && n.connection_losses >= 1, "{n:?}");

    // Trap 5: the fresh server knows every worker the client announced (and not the
    // retired one), with their rosters, because the client re-announced them.
    let mut raw = second.session();
    assert_eq!(raw_stats(&mut raw).workers, 3);
    for (name, lanes, feed) in [
        ("ev", full(), Feed::Events),
        ("pl", full(), placements(100)),
        ("hy", hybrid, Feed::Events),
    ] {
        let id = c
            .worker_id(name)
            .unwrap_or_else(|| panic!("no id for {name}"));
        let again = raw.announce(name, lanes, feed).unwrap();
        assert_eq!((again.worker, again.created), (id, false), "{name}");
    }
    assert_eq!(c.worker_id("gone"), None);
    assert_eq!(raw_stats(&mut raw).workers, 3);

    // The fresh server has no blocks; feeding it through the new ids scores by name.
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Empty
    );
    assert!(c.publish_placement("pl", &ks(), chain.clone()));
    let ev = c.worker_id("ev").unwrap();
    store(&mut raw, ev, 0, &ks(), &chain[..4]);
    let want = QueryOutcome::Scores(vec![
        score(c.worker_id("pl").unwrap(), "pl", 6),
        score(ev, "ev", 4),
    ]);
    let out = query_until(&c, &ks(), &prompt, |o| *o == want).await;
    assert_eq!(out, want);
}

#[tokio::test]
async fn the_unix_socket_transport_against_the_real_server() {
    let path = std::env::temp_dir().join(format!("kvix-e2e-client-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvix-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--metrics", "", "--cores", "2"])
        .args(["--unix", path.to_str().unwrap()]);
    let server = Server::spawn(cmd);
    let c = Client::connect(config(Addr::unix(&path))).await.unwrap();
    assert!(c.is_connected());
    assert_eq!(c.primary(), Some(Addr::unix(&path)));
    let e = c.announce("ev", full(), Feed::Events).await.unwrap();
    let p = c.announce("pl", full(), placements(100)).await.unwrap();
    let prompt = tokens(40, 9);
    let chain = c.token_chain(&ks(), &prompt);
    // Events over TCP, placements and queries over the Unix socket: one index.
    store(&mut server.session(), e, 0, &ks(), &chain[..3]);
    assert!(c.publish_placement(p, &ks(), chain));
    let want = QueryOutcome::Scores(vec![score(p, "pl", 9), score(e, "ev", 3)]);
    let out = query_until(&c, &ks(), &prompt, |o| *o == want).await;
    assert_eq!(out, want);
    assert_eq!(c.stats().await.unwrap().workers, 2);
    assert_eq!(c.echo(vec![0; 4], 100).await.unwrap().len(), 100);
    drop(c);
    server.stop();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_blocking_client_against_the_real_server() {
    let server = Server::start(&["--cores", "2"]);
    let c = BlockingClient::connect(ClientConfig {
        spin_before_park: Some(Duration::from_micros(100)),
        ..config(tcp(&server))
    })
    .unwrap();
    assert!(c.is_connected());
    let a = c.announce("a", full(), Feed::Events).unwrap();
    let p = c.announce("p", full(), placements(100)).unwrap();
    assert_eq!(c.worker_id("a"), Some(a));
    let prompt = tokens(7, 33);
    let chain = c.token_chain(&ks(), &prompt);
    store(&mut server.session(), a, 0, &ks(), &chain);
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()),
        QueryOutcome::Scores(vec![score(a, "a", 33)])
    );
    assert!(c.publish_placement("p", &ks(), chain[..10].to_vec()));
    // Fire-and-forget, landing shard by shard: wait for the whole placement.
    let want = QueryOutcome::Scores(vec![score(a, "a", 33), score(p, "p", 10)]);
    let mut out = QueryOutcome::Empty;
    for _ in 0..500 {
        out = c.query_chain(&ks(), &chain, &opts());
        if out == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(out, want);
    let stats = c.stats().unwrap();
    assert_eq!(stats.workers, 2);
    assert!(stats.queries >= 2, "{stats:?}");
    assert_eq!(c.echo(vec![0; 8], 16).unwrap().len(), 16);
    c.retire(a).unwrap();
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()),
        QueryOutcome::Scores(vec![score(p, "p", 10)])
    );
    let n = c.counters();
    assert!(n.scores >= 2, "{n:?}");
    assert_eq!((n.disconnected, n.timeouts), (0, 0), "{n:?}");
    drop(c);
    assert!(server.stop().success());
}

#[tokio::test]
async fn a_query_whose_real_server_dies_under_it_is_answered_by_the_next_one() {
    let (a, b) = (
        Server::start(&["--cores", "1"]),
        Server::start(&["--cores", "1"]),
    );
    // The same worker and blocks on both, as two replicas hold them.
    let prompt = tokens(11, 4);
    let chain = chain_of(&ks(), 11, 4);
    let mut ids = Vec::new();
    for s in [&a, &b] {
        let mut conn = s.session();
        let w = conn.announce("w", full(), Feed::Events).unwrap().worker;
        store(&mut conn, w, 0, &ks(), &chain);
        ids.push(w);
    }
    let c = Client::connect(ClientConfig {
        // No hedge: the query waits on the first server until its connection is lost.
        hedge_after: Some(Duration::MAX),
        deadline: Duration::from_secs(10),
        ..ClientConfig::new([tcp(&a), tcp(&b)])
    })
    .await
    .unwrap();
    assert!(c.wait_server(&tcp(&a), PATIENCE).await);
    assert!(c.wait_server(&tcp(&b), PATIENCE).await);
    assert_eq!(c.primary(), Some(tcp(&a)));
    // The first server stops; the query reaches its socket and lies there unread. Then
    // it is killed: the kernel resets the connection under the query.
    a.pause(true);
    let query = {
        let (c, prompt) = (c.clone(), prompt.clone());
        tokio::spawn(async move { c.query_tokens(&ks(), &prompt, &opts()).await })
    };
    let end = Instant::now() + PATIENCE;
    while a.unread_bytes() == 0 {
        assert!(
            Instant::now() < end,
            "the query never reached the first server"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.kill();
    // Named from the second server's roster, though this client announced nothing.
    let want = score(ids[1], "w", 4);
    assert_eq!(query.await.unwrap(), QueryOutcome::Scores(vec![want]));
    let n = c.counters();
    assert_eq!(
        (n.failovers, n.disconnected, n.timeouts),
        (1, 0, 0),
        "{n:?}"
    );
}

/// A fire-and-forget placement the server refuses (here: a worker it does not know) is
/// counted by the client under its error code, not taken for a late reply or lost
/// without a word.
#[tokio::test]
async fn refused_fire_and_forget_placements_are_counted_by_code() {
    let server = Server::start(&["--cores", "2"]);
    let c = Client::connect(config(tcp(&server))).await.unwrap();
    let p = c.announce("pl", full(), placements(100)).await.unwrap();
    let chain = chain_of(&ks(), 0, 4);
    assert!(c.publish_placement(p, &ks(), chain.clone()));
    assert!(c.publish_placement(p + 1000, &ks(), chain));
    for _ in 0..1000 {
        if c.counters().writes_refused_total() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let n = c.counters();
    assert_eq!(n.writes_refused, vec![(ErrorCode::UnknownWorker, 1)]);
    assert_eq!((n.placements_sent, n.late_replies), (2, 0));
}

/// A placement refused for a moment (the replicas' log is full: Redis at maxmemory) is
/// sent again once the log takes writes, and lands; it used to be lost without a word.
#[tokio::test]
async fn a_placement_the_log_refused_for_a_moment_is_sent_again_and_lands() {
    use common::redis::{available, Redis};
    if available("placement_retry").is_none() {
        return;
    }
    let redis = Redis::start("placement-retry");
    let url = redis.url("kvix");
    let server = Server::start(&["--cores", "2", "--log-new", "--log", &url]);
    let c = Client::connect(config(tcp(&server))).await.unwrap();
    let p = c.announce("pl", full(), placements(100)).await.unwrap();
    let maxmemory = |bytes: u64| {
        let mut conn = ::redis::Client::open(format!("redis://127.0.0.1:{}", redis.port))
            .unwrap()
            .get_connection()
            .unwrap();
        let _: () = ::redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query(&mut conn)
            .unwrap();
    };
    maxmemory(1);
    let prompt = tokens(0, 12);
    let chain = c.token_chain(&ks(), &prompt);
    assert!(c.publish_placement("pl", &ks(), chain));
    for _ in 0..1000 {
        if c.counters().writes_refused_total() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        c.counters().writes_refused,
        vec![(ErrorCode::LogUnavailable, 1)]
    );
    maxmemory(0);
    let want = QueryOutcome::Scores(vec![score(p, "pl", 12)]);
    let out = query_until(&c, &ks(), &prompt, |o| *o == want).await;
    assert_eq!(out, want);
    assert!(c.counters().placements_retried >= 1);
}

/// A gateway that announced nothing (a controller announces the engines) names every
/// score, resolves candidates, places for and retires the controller's workers, and
/// learns a worker announced after it connected from the first answer that scores it.
/// A placement for a name nobody announced is refused at once and counted. Before
/// rosters, the gateway's answers had no names, its candidates were "empty" and its
/// placements returned true and were dropped.
#[tokio::test]
async fn a_gateway_that_announced_nothing_names_places_and_retires_any_clients_workers() {
    let server = Server::start(&["--cores", "2"]);
    let controller = Client::connect(config(tcp(&server))).await.unwrap();
    let w0 = controller
        .announce("w0", full(), placements(1000))
        .await
        .unwrap();
    let w1 = controller
        .announce("w1", full(), placements(1000))
        .await
        .unwrap();
    let gateway = Client::connect(config(tcp(&server))).await.unwrap();
    assert!(gateway.announced().is_empty());
    assert_eq!(
        (gateway.worker_id("w0"), gateway.worker_id("w1")),
        (Some(w0), Some(w1))
    );

    let p0 = tokens(0, 3);
    assert!(controller.publish_placement("w0", &ks(), controller.token_chain(&ks(), &p0)));
    let out = query_until(&gateway, &ks(), &p0, |o| best_is(o, "w0", 3)).await;
    assert!(best_is(&out, "w0", 3), "{out:?}");
    let only_w1 = QueryOptions {
        candidates: vec!["w1".into()],
        ..opts()
    };
    assert_eq!(
        gateway.query_tokens(&ks(), &p0, &only_w1).await,
        QueryOutcome::Empty
    );

    // The gateway's placement lands on the controller's worker.
    let p1 = tokens(1000, 2);
    assert!(gateway.publish_placement("w1", &ks(), gateway.token_chain(&ks(), &p1)));
    let out = query_until(&controller, &ks(), &p1, |o| best_is(o, "w1", 2)).await;
    assert!(best_is(&out, "w1", 2), "{out:?}");

    // A worker announced after the gateway connected: the first answer scoring it names
    // it (looked up then, not a second later).
    let late = controller
        .announce("late", full(), placements(1000))
        .await
        .unwrap();
    let p2 = tokens(2000, 4);
    assert!(controller.publish_placement("late", &ks(), controller.token_chain(&ks(), &p2)));
    let first = query_until(&gateway, &ks(), &p2, |o| {
        matches!(o, QueryOutcome::Scores(_))
    })
    .await;
    assert_eq!(first.best(), Some(&score(late, "late", 4)));

    // Candidates naming a worker announced a moment ago resolve in the query.
    let newest = controller
        .announce("newest", full(), placements(1000))
        .await
        .unwrap();
    assert!(controller.publish_placement("newest", &ks(), controller.token_chain(&ks(), &p2)));
    let only_newest = QueryOptions {
        candidates: vec!["newest".into()],
        ..opts()
    };
    let mut out = QueryOutcome::Empty;
    for _ in 0..500 {
        out = gateway.query_tokens(&ks(), &p2, &only_newest).await;
        if matches!(out, QueryOutcome::Scores(_)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(out.best(), Some(&score(newest, "newest", 4)));

    // Nobody announced it: refused at once, counted, nothing sent.
    let sent = gateway.counters().placements_sent;
    assert!(!gateway.publish_placement("nobody", &ks(), vec![1, 2]));
    assert_eq!(gateway.counters().unknown_workers, 1);
    assert_eq!(gateway.counters().placements_sent, sent);

    // The gateway retires a worker it never announced; the controller sees it go.
    gateway.retire("w1").await.unwrap();
    assert_eq!(controller.stats().await.unwrap().workers, 3);
    match gateway.retire("nobody").await {
        Err(ClientError::Rejected(e)) => assert_eq!(e.code, ErrorCode::UnknownWorker),
        other => panic!("{other:?}"),
    }
}

/// Once every id below `--max-workers` was given, a new name takes the id retired
/// longest ago. A gateway that learnt the old name for that id names the new worker
/// in its answers (the answer's `reissued` count differs from the one its names were
/// learnt under, so it lists the roster again first) and forgets the old name.
#[tokio::test]
async fn a_gateway_names_an_id_given_again_by_its_new_worker() {
    let server = Server::start(&["--cores", "2", "--max-workers", "2"]);
    let mut raw = server.session();
    let a = raw.events_worker("a");
    let b = raw.events_worker("b");
    let refused = raw.announce("c", full(), Feed::Events).unwrap_err();
    assert!(
        refused.message.contains("no more worker ids"),
        "{refused:?}"
    );
    let gateway = Client::connect(config(tcp(&server))).await.unwrap();
    let chain = chain_of(&ks(), 0, 6);
    store(&mut raw, a, 0, &ks(), &chain);
    store(&mut raw, b, 0, &ks(), &chain[..2]);
    assert_eq!(
        gateway.query_chain(&ks(), &chain, &opts()).await,
        QueryOutcome::Scores(vec![score(a, "a", 6), score(b, "b", 2)])
    );
    assert_eq!(gateway.worker_id("a"), Some(a));

    assert_eq!(raw.ask(&Retire { worker: a }).kind, Kind::Ack);
    let c = raw.events_worker("c");
    assert_eq!(c, a, "the retired id is given again");
    store(&mut raw, c, 0, &ks(), &chain[..4]);
    assert_eq!(
        gateway.query_chain(&ks(), &chain, &opts()).await,
        QueryOutcome::Scores(vec![score(c, "c", 4), score(b, "b", 2)])
    );
    assert_eq!(gateway.worker_id("a"), None, "the old name is forgotten");
    assert_eq!(gateway.worker_id("c"), Some(c));
    // "a" lost its claim to the id: announced again, it waits for a free one.
    let again = raw.announce("a", full(), Feed::Events).unwrap_err();
    assert!(again.message.contains("no more worker ids"), "{again:?}");
}
