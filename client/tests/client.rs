//! The client against a fake server (tests/common): handshake, outcomes, pipelining,
//! deadlines, fail-open, reconnect with re-announce, failover, malformed replies,
//! placement drops, spin vs park. No assertion on durations tighter than deadline + 1 s.

mod common;

use std::time::{Duration, Instant};

use common::{BadWelcome, FakeServer, Mode, Msg, Opts};
use kvix_client::wire::{ChunkKind, ErrorCode, Feed, Keyspace, Lane, FLAG_NO_REPLY};
use kvix_client::{Addr, Client, ClientConfig, ClientError, QueryOptions, QueryOutcome};

const PATIENCE: Duration = Duration::from_secs(5);

fn config(servers: Vec<Addr>) -> ClientConfig {
    ClientConfig {
        // Generous: the tests run on a loaded 2-core machine. Deadline tests set their own.
        deadline: Duration::from_secs(2),
        reconnect_min: Duration::from_millis(5),
        reconnect_max: Duration::from_millis(50),
        ..ClientConfig::new(servers)
    }
}

fn ks() -> Keyspace {
    Keyspace::tokens("m")
}

fn tokens(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| i * 7 + salt).collect()
}

fn opts() -> QueryOptions {
    QueryOptions::default()
}

/// A port nothing listens on.
async fn dead_addr() -> Addr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    Addr::tcp(a.to_string())
}

/// Two fake servers; the second numbers workers from 50, so answers show which replied.
async fn two_servers() -> (FakeServer, FakeServer) {
    let b = Opts {
        first_worker_id: 50,
        ..Opts::default()
    };
    (
        FakeServer::start(Opts::default()).await,
        FakeServer::start(b).await,
    )
}

async fn full_worker(c: &Client, name: &str) -> u32 {
    c.announce(name, vec![Lane::full(16)], Feed::Events)
        .await
        .expect("announce")
}

/// Publishes a placement and waits until the fake has it.
async fn place(c: &Client, s: &FakeServer, worker: &str, chain: Vec<u64>) {
    let want = s.count(|m| matches!(m, Msg::Placement(_))) + 1;
    assert!(c.publish_placement(worker, &ks(), chain));
    assert!(
        s.wait_until(PATIENCE, |st| st
            .received
            .iter()
            .filter(|g| matches!(g.msg, Msg::Placement(_)))
            .count()
            >= want)
            .await
    );
}

#[tokio::test]
async fn handshake_sends_hello_first_with_block_size_name_and_auth() {
    let s = FakeServer::start(Opts {
        auth: Some("s3cret".into()),
        ..Opts::default()
    })
    .await;
    let c = Client::connect(ClientConfig {
        auth: Some("s3cret".into()),
        name: "gw-1".into(),
        ..config(vec![s.addr.clone()])
    })
    .await
    .unwrap();
    assert!(c.is_connected());
    assert_eq!(c.primary(), Some(s.addr.clone()));
    let got = s.received();
    let Msg::Hello(h) = &got[0].msg else {
        panic!("first frame {:?}", got[0])
    };
    assert_eq!(
        (h.client.as_str(), h.token_block, h.auth.as_deref()),
        ("gw-1", 16, Some("s3cret"))
    );
    assert_eq!(c.counters().connects, 1);
}

#[tokio::test]
async fn block_size_mismatch_and_bad_auth_are_refused_at_connect() {
    let s = FakeServer::start(Opts {
        token_block: 32,
        ..Opts::default()
    })
    .await;
    let e = Client::connect(config(vec![s.addr.clone()]))
        .await
        .err()
        .expect("refused");
    assert_eq!(e.code(), Some(ErrorCode::BlockSizeMismatch), "{e}");
    assert!(matches!(e, ClientError::Refused { .. }));

    let s = FakeServer::start(Opts {
        auth: Some("s3cret".into()),
        ..Opts::default()
    })
    .await;
    let e = Client::connect(ClientConfig {
        auth: Some("wrong".into()),
        ..config(vec![s.addr.clone()])
    })
    .await
    .err()
    .expect("refused");
    assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e}");

    let bad = Client::connect(ClientConfig {
        servers: vec![],
        ..ClientConfig::default()
    })
    .await;
    assert!(matches!(bad, Err(ClientError::Config(_))));
}

#[tokio::test]
async fn query_outcomes_scores_empty_candidates_top_k_rejected() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    let (w0, w1) = (full_worker(&c, "w0").await, full_worker(&c, "w1").await);
    assert_ne!(w0, w1);
    assert_eq!(c.worker_id("w1"), Some(w1));
    assert_eq!(c.worker_name(w0).as_deref(), Some("w0"));

    let prompt = tokens(64, 1); // 4 blocks
    let chain = c.token_chain(&ks(), &prompt);
    assert_eq!(chain.len(), 4);
    place(&c, &s, "w0", chain.clone()).await;
    place(&c, &s, "w1", chain[..2].to_vec()).await;

    let QueryOutcome::Scores(sc) = c.query_tokens(&ks(), &prompt, &opts()).await else {
        panic!("scores expected")
    };
    assert_eq!(sc.len(), 2);
    assert_eq!(
        (sc[0].worker, sc[0].name.as_deref(), sc[0].blocks),
        (w0, Some("w0"), 4)
    );
    assert_eq!(
        (sc[1].worker, sc[1].name.as_deref(), sc[1].blocks),
        (w1, Some("w1"), 2)
    );

    // The chain the server received is the wire crate's chain of the prompt.
    let last_query = s
        .received()
        .into_iter()
        .rev()
        .find_map(|g| match g.msg {
            Msg::Query(q) => Some(q),
            _ => None,
        })
        .unwrap();
    assert_eq!(last_query.chain, chain);
    assert_eq!(last_query.keyspace.kind, ChunkKind::Tokens);

    let top1 = QueryOptions { top_k: 1, ..opts() };
    let out = c.query_tokens(&ks(), &prompt, &top1).await;
    assert_eq!(out.best().map(|b| b.worker), Some(w0));
    assert!(matches!(&out, QueryOutcome::Scores(v) if v.len() == 1));

    let only_w1 = QueryOptions {
        candidates: vec!["w1".into()],
        ..opts()
    };
    let out = c.query_tokens(&ks(), &prompt, &only_w1).await;
    assert_eq!(out.best().map(|b| (b.worker, b.blocks)), Some((w1, 2)));
    let by_id = QueryOptions {
        candidates: vec![w1.into()],
        ..opts()
    };
    assert_eq!(c.query_tokens(&ks(), &prompt, &by_id).await, out);
    let unknown = QueryOptions {
        candidates: vec!["nobody".into()],
        ..opts()
    };
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &unknown).await,
        QueryOutcome::Empty
    );

    assert_eq!(
        c.query_tokens(&ks(), &tokens(64, 99), &opts()).await,
        QueryOutcome::Empty
    );
    // Pre-hashed chain: passed through as is.
    assert_eq!(
        c.query_chain(&ks(), &chain[..3], &opts())
            .await
            .best()
            .map(|b| b.blocks),
        Some(3)
    );
    // A string prompt goes in the byte kind of the keyspace, 256-byte chunks.
    let text = "x".repeat(600);
    assert_eq!(
        c.query_bytes(&ks(), &text, &opts()).await,
        QueryOutcome::Empty
    );
    let q = s
        .received()
        .into_iter()
        .rev()
        .find_map(|g| match g.msg {
            Msg::Query(q) => Some(q),
            _ => None,
        })
        .unwrap();
    assert_eq!(q.keyspace.kind, ChunkKind::Bytes);
    assert_eq!(q.chain, c.byte_chain(&ks(), text.as_bytes()));
    assert_eq!(q.chain.len(), 2);

    s.set_mode(Mode::Reject(ErrorCode::Overloaded));
    let out = c.query_tokens(&ks(), &prompt, &opts()).await;
    assert!(
        matches!(&out, QueryOutcome::Rejected(e) if e.code == ErrorCode::Overloaded),
        "{out:?}"
    );

    let n = c.counters();
    // scores: full, top1, only_w1, by_id, chain = 5; empty: unknown, no match, bytes = 3.
    assert_eq!(
        (n.scores, n.empty, n.rejected, n.timeouts, n.disconnected),
        (5, 3, 1, 0, 0)
    );
    assert_eq!(n.queries(), 9);
    assert_eq!(n.latency_ns.len(), 9);
    assert!(n.latency_quantile(0.5) > Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_queries_match_out_of_order_replies_by_id() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    let w = full_worker(&c, "w").await;
    let prompt = tokens(16 * 8, 3);
    place(&c, &s, "w", c.token_chain(&ks(), &prompt)).await;
    s.set_mode(Mode::Hold(4));
    let q = |blocks: usize| {
        let (c, p) = (c.clone(), prompt[..16 * blocks].to_vec());
        tokio::spawn(async move { c.query_tokens(&ks(), &p, &opts()).await })
    };
    let handles = [q(1), q(2), q(3), q(4)];
    for (i, h) in handles.into_iter().enumerate() {
        let out = h.await.unwrap();
        assert_eq!(
            out.best().map(|b| (b.worker, b.blocks)),
            Some((w, i as u32 + 1)),
            "{out:?}"
        );
    }
    assert_eq!(s.queries(), 4);
}

#[tokio::test]
async fn a_slow_answer_is_a_timeout_and_the_late_reply_is_harmless() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    full_worker(&c, "w").await;
    let prompt = tokens(32, 5);
    place(&c, &s, "w", c.token_chain(&ks(), &prompt)).await;
    s.set_mode(Mode::Delay(Duration::from_millis(300)));
    let deadline = Duration::from_millis(20);
    let o = QueryOptions {
        deadline: Some(deadline),
        ..opts()
    };
    let t = Instant::now();
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &o).await,
        QueryOutcome::Timeout
    );
    assert!(t.elapsed() < deadline + Duration::from_secs(1));
    // The reply comes later, finds nobody waiting, and leaves the connection up.
    let mut late = false;
    for _ in 0..500 {
        if c.counters().late_replies == 1 {
            late = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(late);
    s.set_mode(Mode::Normal);
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &o)
            .await
            .best()
            .map(|b| b.blocks),
        Some(2)
    );
    let n = c.counters();
    assert_eq!(
        (n.timeouts, n.malformed_replies, n.connection_losses),
        (1, 0, 0)
    );

    // The configured deadline applies too, spin mode included.
    s.set_mode(Mode::Silent);
    let c2 = Client::connect(ClientConfig {
        deadline: Duration::from_millis(5),
        spin_before_park: Some(Duration::from_micros(500)),
        ..config(vec![s.addr.clone()])
    })
    .await
    .unwrap();
    let t = Instant::now();
    assert_eq!(
        c2.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Timeout
    );
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn no_server_means_disconnected_at_once() {
    let addr = dead_addr().await;
    let c = Client::connect(ClientConfig {
        connect_timeout: Duration::from_millis(200),
        request_timeout: Duration::from_millis(100),
        ..config(vec![addr])
    })
    .await
    .expect("fail open: connect succeeds without a server");
    assert!(!c.is_connected());
    let t = Instant::now();
    assert_eq!(
        c.query_tokens(&ks(), &tokens(32, 0), &opts()).await,
        QueryOutcome::Disconnected
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(matches!(c.stats().await, Err(ClientError::NotConnected)));
    assert!(matches!(
        c.announce("w", vec![Lane::full(16)], Feed::Events).await,
        Err(ClientError::NotConnected)
    ));
    // Still remembered, for when a server comes.
    assert_eq!(c.announced().len(), 1);
    let n = c.counters();
    assert_eq!(n.disconnected, 1);
    assert!(n.connect_failures >= 1);
}

#[tokio::test]
async fn server_killed_fails_open_then_the_client_reconnects() {
    let s = FakeServer::start(Opts::default()).await;
    let at = s.socket.unwrap();
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    full_worker(&c, "w").await;
    let prompt = tokens(32, 9);
    let chain = c.token_chain(&ks(), &prompt);
    place(&c, &s, "w", chain.clone()).await;
    assert!(matches!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Scores(_)
    ));

    s.kill().await;
    let o = QueryOptions {
        deadline: Some(Duration::from_millis(50)),
        ..opts()
    };
    for _ in 0..5 {
        let t = Instant::now();
        let out = c.query_tokens(&ks(), &prompt, &o).await;
        assert!(
            matches!(out, QueryOutcome::Disconnected | QueryOutcome::Timeout),
            "{out:?}"
        );
        assert!(t.elapsed() < Duration::from_millis(50) + Duration::from_secs(1));
    }
    assert!(!c.is_connected());

    let s = FakeServer::start_tcp(at, Opts::default()).await;
    assert!(c.wait_connected(PATIENCE).await);
    // The new server knows the worker again (re-announced) but has no placements yet.
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Empty
    );
    place(&c, &s, "w", chain).await;
    assert!(matches!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Scores(_)
    ));
    let n = c.counters();
    assert!(n.reconnects >= 1 && n.connection_losses >= 1, "{n:?}");
}

#[tokio::test]
async fn reconnect_reannounces_every_worker_first_and_adopts_new_ids() {
    let s = FakeServer::start(Opts::default()).await;
    let at = s.socket.unwrap();
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    let sliding = vec![
        Lane::full(16),
        Lane::parse("sliding_window:128@16").unwrap(),
    ];
    assert_eq!(
        c.announce("a", vec![Lane::full(16)], Feed::Events)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        c.announce(
            "b",
            sliding.clone(),
            Feed::Placements {
                capacity_blocks: 100,
                ttl_ms: 0
            }
        )
        .await
        .unwrap(),
        2
    );
    assert_eq!(full_worker(&c, "gone").await, 3);
    c.retire("gone").await.unwrap();
    s.kill().await;

    // The restarted server numbers workers differently.
    let s = FakeServer::start_tcp(
        at,
        Opts {
            first_worker_id: 100,
            ..Opts::default()
        },
    )
    .await;
    assert!(c.wait_connected(PATIENCE).await);
    assert_eq!(c.worker_id("a"), Some(100));
    assert_eq!(c.worker_id("b"), Some(101));
    assert_eq!(c.worker_id("gone"), None);
    let prompt = tokens(48, 2);
    place(&c, &s, "b", c.token_chain(&ks(), &prompt)).await;
    let out = c.query_tokens(&ks(), &prompt, &opts()).await;
    let best = out.best().expect("scores");
    assert_eq!(
        (best.worker, best.name.as_deref(), best.blocks),
        (101, Some("b"), 3)
    );

    let got = s.received();
    let kinds: Vec<String> = got
        .iter()
        .map(|g| match &g.msg {
            Msg::Hello(_) => "hello".to_string(),
            Msg::Announce(a) => format!("announce:{}", a.name),
            Msg::Placement(p) => format!("placement:{}", p.worker),
            Msg::Query(_) => "query".to_string(),
            Msg::Roster(r) => format!("roster:{}", r.from),
            other => format!("{other:?}"),
        })
        .collect();
    // The roster is learnt whole at connect; later polls (every second) may follow.
    assert_eq!(kinds[..2], ["hello", "roster:0"]);
    let kinds: Vec<&String> = kinds[2..]
        .iter()
        .filter(|k| !k.starts_with("roster"))
        .collect();
    assert_eq!(
        kinds,
        ["announce:a", "announce:b", "placement:101", "query"]
    );
    // The roster is re-sent as announced.
    let Msg::Announce(b) = &got[3].msg else {
        unreachable!()
    };
    assert_eq!(b.lanes, sliding);
    assert!(got.iter().all(|g| g.conn == got[0].conn));
}

#[tokio::test]
async fn failover_to_the_second_server_and_back() {
    let (a, b) = two_servers().await;
    let at = a.socket.unwrap();
    let c = Client::connect(config(vec![a.addr.clone(), b.addr.clone()]))
        .await
        .unwrap();
    assert!(c.wait_server(&b.addr, PATIENCE).await);
    assert_eq!(c.primary(), Some(a.addr.clone()));
    // Announces go to every server; the primary's id is returned.
    assert_eq!(full_worker(&c, "w").await, 1);
    assert_eq!(b.count(|m| matches!(m, Msg::Announce(_))), 1);
    let prompt = tokens(32, 4);
    let chain = c.token_chain(&ks(), &prompt);
    // Placements too, each with the server's own id for the worker.
    place(&c, &a, "w", chain.clone()).await;
    assert!(
        b.wait_until(PATIENCE, |s| s.placements.get(&50) == Some(&chain))
            .await
    );

    assert!(matches!(
        c.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Scores(_)
    ));
    assert_eq!((a.queries(), b.queries()), (1, 0));

    a.kill().await;
    let mut answered = None;
    for _ in 0..100 {
        match c.query_tokens(&ks(), &prompt, &opts()).await {
            QueryOutcome::Scores(s) => {
                answered = Some(s);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let s = answered.expect("the second server answers");
    assert_eq!((s[0].worker, s[0].name.as_deref()), (50, Some("w")));
    assert_eq!(c.primary(), Some(b.addr.clone()));
    assert_eq!(c.worker_id("w"), Some(50));
    assert!(b.queries() >= 1);

    // The first server comes back: it is preferred again.
    let a = FakeServer::start_tcp(at, Opts::default()).await;
    assert!(c.wait_server(&a.addr, PATIENCE).await);
    assert_eq!(c.primary(), Some(a.addr.clone()));
    c.query_tokens(&ks(), &prompt, &opts()).await;
    assert_eq!(a.queries(), 1);
}

#[tokio::test]
async fn a_query_whose_connection_is_lost_is_answered_by_the_next_server() {
    let (a, b) = two_servers().await;
    a.set_mode(Mode::CloseOnQuery);
    // Without hedging the query is sent again once its connection is lost; with it, the
    // lost primary is hedged at once. Either way the second server answers.
    for (hedge_after, failovers, hedges) in [(Some(Duration::MAX), 1, 0), (None, 0, 1)] {
        let cfg = ClientConfig {
            hedge_after,
            ..config(vec![a.addr.clone(), b.addr.clone()])
        };
        let c = Client::connect(cfg).await.unwrap();
        assert!(c.wait_server(&a.addr, PATIENCE).await);
        assert!(c.wait_server(&b.addr, PATIENCE).await);
        let before = b.queries();
        assert_eq!(
            c.query_tokens(&ks(), &tokens(32, 9), &opts()).await,
            QueryOutcome::Empty,
            "hedge_after {hedge_after:?}"
        );
        assert_eq!(b.queries(), before + 1);
        let n = c.counters();
        assert_eq!(
            (n.disconnected, n.failovers, n.hedges),
            (0, failovers, hedges),
            "hedge_after {hedge_after:?}"
        );
    }
    // With no other server, a lost connection fails the query open.
    let c = Client::connect(config(vec![a.addr.clone()])).await.unwrap();
    assert!(c.wait_connected(PATIENCE).await);
    assert_eq!(
        c.query_tokens(&ks(), &tokens(32, 9), &opts()).await,
        QueryOutcome::Disconnected
    );
}

#[tokio::test]
async fn the_first_server_down_at_start_means_the_second_answers() {
    let dead = dead_addr().await;
    let b = FakeServer::start(Opts::default()).await;
    let c = Client::connect(ClientConfig {
        connect_timeout: Duration::from_millis(300),
        ..config(vec![dead, b.addr.clone()])
    })
    .await
    .unwrap();
    assert_eq!(c.primary(), Some(b.addr.clone()));
    assert_eq!(
        c.query_tokens(&ks(), &tokens(32, 1), &opts()).await,
        QueryOutcome::Empty
    );
    assert_eq!(b.queries(), 1);
}

async fn malformed_case(mode: Mode) {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    full_worker(&c, "w").await;
    let prompt = tokens(32, 8);
    place(&c, &s, "w", c.token_chain(&ks(), &prompt)).await;
    s.set_mode(mode.clone());
    let out = c.query_tokens(&ks(), &prompt, &opts()).await;
    assert_eq!(out, QueryOutcome::Disconnected, "{mode:?}");
    let n = c.counters();
    assert_eq!(n.malformed_replies, 1, "{mode:?}");
    s.set_mode(Mode::Normal);
    assert!(c.wait_connected(PATIENCE).await);
    let out = c.query_tokens(&ks(), &prompt, &opts()).await;
    assert!(matches!(out, QueryOutcome::Scores(_)), "{mode:?}: {out:?}");
    assert!(c.counters().reconnects >= 1);
}

#[tokio::test]
async fn a_reply_with_bad_magic_closes_the_connection_and_it_recovers() {
    malformed_case(Mode::BadMagic).await;
}

#[tokio::test]
async fn a_reply_with_a_garbage_body_closes_the_connection_and_it_recovers() {
    malformed_case(Mode::GarbageBody).await;
}

#[tokio::test]
async fn a_reply_of_the_wrong_kind_closes_the_connection_and_it_recovers() {
    malformed_case(Mode::WrongKind).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_reply_fails_every_pending_query_on_that_connection() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    // Three queries in flight, the server holds them, then answers with garbage.
    s.set_mode(Mode::Hold(3));
    let q = |salt| {
        let c = c.clone();
        tokio::spawn(async move { c.query_tokens(&ks(), &tokens(32, salt), &opts()).await })
    };
    let (h1, h2) = (q(1), q(2));
    assert!(
        s.wait_until(PATIENCE, |st| st
            .received
            .iter()
            .filter(|g| matches!(g.msg, Msg::Query(_)))
            .count()
            == 2)
            .await
    );
    s.set_mode(Mode::BadMagic);
    let h3 = q(3);
    for h in [h1, h2, h3] {
        assert_eq!(h.await.unwrap(), QueryOutcome::Disconnected);
    }
    assert_eq!(c.counters().malformed_replies, 1);
}

#[tokio::test]
async fn a_connection_closed_mid_request_fails_open_and_recovers() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    s.set_mode(Mode::CloseOnQuery);
    assert_eq!(
        c.query_tokens(&ks(), &tokens(32, 1), &opts()).await,
        QueryOutcome::Disconnected
    );
    s.set_mode(Mode::Normal);
    assert!(c.wait_connected(PATIENCE).await);
    assert_eq!(
        c.query_tokens(&ks(), &tokens(32, 1), &opts()).await,
        QueryOutcome::Empty
    );
    let n = c.counters();
    assert!(n.connection_losses >= 1 && n.reconnects >= 1);
    assert_eq!(n.malformed_replies, 0);
}

// Current-thread runtime: the placement pump cannot run while this test does not
// yield, so exactly `capacity` placements fit and the rest are dropped.
#[tokio::test(flavor = "current_thread")]
async fn a_full_placement_queue_drops_and_counts_without_blocking() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(ClientConfig {
        placement_queue: 4,
        ..config(vec![s.addr.clone()])
    })
    .await
    .unwrap();
    full_worker(&c, "w").await;
    let chain = c.token_chain(&ks(), &tokens(32, 1));
    let queued: Vec<bool> = (0..10)
        .map(|_| c.publish_placement("w", &ks(), chain.clone()))
        .collect();
    assert_eq!(queued.iter().filter(|q| **q).count(), 4);
    assert_eq!(c.counters().placement_drops, 6);
    assert!(
        s.wait_until(PATIENCE, |st| st
            .received
            .iter()
            .filter(|g| matches!(g.msg, Msg::Placement(_)))
            .count()
            == 4)
            .await
    );
    let got = s.received();
    let placements: Vec<_> = got
        .iter()
        .filter(|g| matches!(g.msg, Msg::Placement(_)))
        .collect();
    assert!(placements.iter().all(|g| g.flags & FLAG_NO_REPLY != 0));
    let n = c.counters();
    assert_eq!(
        (n.placements_sent, n.placement_drops, n.placements_unsent),
        (4, 6, 0)
    );
    // A name no client announced is refused at once, and counted.
    assert!(!c.publish_placement("nobody", &ks(), chain));
    let n = c.counters();
    assert_eq!((n.unknown_workers, n.placements_unsent), (1, 0));
}

async fn spin_and_park_agree() {
    let s = FakeServer::start(Opts::default()).await;
    let park = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    let spin = Client::connect(ClientConfig {
        spin_before_park: Some(Duration::from_micros(200)),
        ..config(vec![s.addr.clone()])
    })
    .await
    .unwrap();
    for (i, name) in ["w0", "w1", "w2"].iter().enumerate() {
        let id = full_worker(&park, name).await;
        assert_eq!(full_worker(&spin, name).await, id);
        let chain = park.token_chain(&ks(), &tokens(16 * (i as u32 + 2), 1));
        place(&park, &s, name, chain).await;
    }
    for n in 0..12u32 {
        let p = tokens(16 * (n % 6), n / 6);
        let o = QueryOptions {
            top_k: n % 3,
            ..opts()
        };
        let a = park.query_tokens(&ks(), &p, &o).await;
        let b = spin.query_tokens(&ks(), &p, &o).await;
        assert_eq!(a, b, "query {n}");
        assert!(
            matches!(a, QueryOutcome::Scores(_) | QueryOutcome::Empty),
            "{a:?}"
        );
    }
    assert_eq!(
        park.echo(vec![1; 64], 256).await.unwrap(),
        spin.echo(vec![1; 64], 256).await.unwrap()
    );
    assert_eq!(park.counters().scores, spin.counters().scores);
    assert!(park.counters().scores > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spin_and_park_modes_give_the_same_answers() {
    spin_and_park_agree().await;
}

#[tokio::test(flavor = "current_thread")]
async fn spin_and_park_agree_on_a_current_thread_runtime_too() {
    spin_and_park_agree().await;
}

#[tokio::test]
async fn echo_stats_and_retire() {
    let s = FakeServer::start(Opts::default()).await;
    let c = Client::connect(config(vec![s.addr.clone()])).await.unwrap();
    let reply = c.echo(vec![7; 64], 256).await.unwrap();
    assert_eq!(reply.len(), 256);
    let w = full_worker(&c, "w").await;
    full_worker(&c, "v").await;
    assert_eq!(c.stats().await.unwrap().workers, 2);
    c.retire(w).await.unwrap();
    assert!(s
        .received()
        .iter()
        .any(|g| matches!(&g.msg, Msg::Retire(r) if r.worker == w)));
    assert_eq!(c.stats().await.unwrap().workers, 1);
    assert_eq!(c.announced().len(), 1);
    let e = c.retire("w").await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::UnknownWorker));
}

#[tokio::test]
async fn unix_socket_servers_work_too() {
    let path = std::env::temp_dir().join(format!("kvix-client-test-{}.sock", std::process::id()));
    let s = FakeServer::start_unix(path.clone(), Opts::default()).await;
    let c = Client::connect(config(vec![Addr::unix(&path)]))
        .await
        .unwrap();
    assert!(c.is_connected());
    full_worker(&c, "w").await;
    let prompt = tokens(32, 3);
    place(&c, &s, "w", c.token_chain(&ks(), &prompt)).await;
    assert_eq!(
        c.query_tokens(&ks(), &prompt, &opts())
            .await
            .best()
            .map(|b| b.blocks),
        Some(2)
    );
    s.kill().await;
}

#[test]
fn the_blocking_client_works_from_a_plain_thread() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(FakeServer::start(Opts::default()));
    let c = kvix_client::blocking::BlockingClient::connect(ClientConfig {
        spin_before_park: Some(Duration::from_micros(100)),
        ..config(vec![s.addr.clone()])
    })
    .unwrap();
    assert!(c.is_connected());
    let w = c.announce("w", vec![Lane::full(16)], Feed::Events).unwrap();
    let prompt = tokens(64, 6);
    assert!(c.publish_placement(w, &ks(), c.token_chain(&ks(), &prompt)));
    assert!(rt.block_on(s.wait_until(PATIENCE, |st| !st.placements.is_empty())));
    let out = c.query_tokens(&ks(), &prompt, &QueryOptions::default());
    assert_eq!(out.best().map(|b| (b.worker, b.blocks)), Some((w, 4)));
    assert_eq!(c.echo(vec![0; 8], 16).unwrap().len(), 16);
    assert_eq!(c.stats().unwrap().workers, 1);
    assert_eq!(c.counters().scores, 1);
    drop(c);
}

#[tokio::test]
async fn a_bad_welcome_never_connects_and_never_panics() {
    for bad in [
        BadWelcome::OtherBlock(32),
        BadWelcome::Garbage,
        BadWelcome::WrongKind,
    ] {
        let s = FakeServer::start(Opts {
            bad_welcome: Some(bad),
            ..Opts::default()
        })
        .await;
        let r = Client::connect(ClientConfig {
            connect_timeout: Duration::from_millis(300),
            ..config(vec![s.addr.clone()])
        })
        .await;
        match bad {
            // A server hashing other blocks is refused like a refusal from the server.
            BadWelcome::OtherBlock(_) => {
                let e = r.err().expect("refused");
                assert_eq!(e.code(), Some(ErrorCode::BlockSizeMismatch), "{e}");
            }
            _ => {
                let c = r.expect("fail open");
                assert!(!c.is_connected());
                assert_eq!(
                    c.query_tokens(&ks(), &tokens(16, 0), &opts()).await,
                    QueryOutcome::Disconnected
                );
                let n = c.counters();
                assert!(
                    n.malformed_replies >= 1 && n.connect_failures >= 1,
                    "{bad:?}: {n:?}"
                );
            }
        }
    }
}

/// Two fake servers that both hold worker "w" with a 32-token prompt, the first the
/// primary of a client made with `cfg` (its servers filled in): the client, the servers
/// and the prompt.
async fn two_holding_the_prompt(cfg: ClientConfig) -> (Client, FakeServer, FakeServer, Vec<u32>) {
    let (a, b) = (
        FakeServer::start(Opts::default()).await,
        FakeServer::start(Opts::default()).await,
    );
    let c = Client::connect(ClientConfig {
        servers: vec![a.addr.clone(), b.addr.clone()],
        ..cfg
    })
    .await
    .unwrap();
    assert!(c.wait_server(&b.addr, PATIENCE).await);
    full_worker(&c, "w").await;
    let prompt = tokens(32, 5);
    let chain = c.token_chain(&ks(), &prompt);
    place(&c, &a, "w", chain.clone()).await;
    place(&c, &b, "w", chain).await;
    (c, a, b, prompt)
}

#[tokio::test]
async fn a_silent_primary_is_hedged_to_the_next_server_and_replicas_take_writes_once() {
    let (c, a, b, prompt) = two_holding_the_prompt(ClientConfig {
        hedge_after: Some(Duration::from_millis(5)),
        ..config(Vec::new())
    })
    .await;
    let servers = vec![a.addr.clone(), b.addr.clone()];
    a.set_mode(Mode::Silent);
    for _ in 0..20 {
        let got = c.query_tokens(&ks(), &prompt, &opts()).await;
        assert_eq!(got.best().map(|s| s.blocks), Some(2), "{got:?}");
    }
    let n = c.counters();
    assert_eq!((n.hedges, n.hedges_won, n.timeouts), (20, 20, 0));

    // Hedging off: the silent primary times the query out.
    let off = Client::connect(ClientConfig {
        hedge_after: Some(Duration::MAX),
        deadline: Duration::from_millis(50),
        ..config(servers.clone())
    })
    .await
    .unwrap();
    assert!(off.wait_server(&b.addr, PATIENCE).await);
    assert_eq!(
        off.query_tokens(&ks(), &prompt, &opts()).await,
        QueryOutcome::Timeout
    );
    assert_eq!(off.counters().hedges, 0);

    // Replicas of one log: a write goes to the primary alone.
    let announces =
        |s: &FakeServer, name: &str| s.count(|m| matches!(m, Msg::Announce(x) if x.name == name));
    let r = Client::connect(ClientConfig {
        replicas: true,
        ..config(servers)
    })
    .await
    .unwrap();
    assert!(r.wait_server(&b.addr, PATIENCE).await);
    full_worker(&r, "only-once").await;
    assert_eq!(
        (announces(&a, "only-once"), announces(&b, "only-once")),
        (1, 0)
    );
}

/// A replica that says its copy is behind its log (`stale`: healing in place, or stopped
/// following it) is passed over: the query goes on to the next server, whose answer is
/// taken; with every server stale, the first stale answer is better than none.
#[tokio::test]
async fn a_stale_answer_sends_the_query_on_to_the_next_server() {
    let (c, a, b, prompt) = two_holding_the_prompt(ClientConfig {
        hedge_after: Some(Duration::MAX),
        ..config(Vec::new())
    })
    .await;
    a.set_mode(Mode::Stale);
    let asked = |s: &FakeServer| s.count(|m| matches!(m, Msg::Query(_)));
    let before = asked(&b);
    for _ in 0..10 {
        let got = c.query_tokens(&ks(), &prompt, &opts()).await;
        assert_eq!(got.best().map(|s| s.blocks), Some(2), "{got:?}");
    }
    assert_eq!(asked(&b) - before, 10);
    assert_eq!(c.counters().stale_answers, 10);
    b.set_mode(Mode::Stale);
    let got = c.query_tokens(&ks(), &prompt, &opts()).await;
    assert_eq!(got.best().map(|s| s.blocks), Some(2), "{got:?}");
    assert_eq!(c.counters().stale_answers, 12);
}

/// A query waiting for its hedge point parks on its reply. It used to yield in a loop
/// whenever the hedge point was nearer than a timer tick (1 ms), which with two servers
/// up and the default hedge (the 95th percentile, at most half the deadline) is nearly
/// every query: the gateway's runtime spun instead of reading replies, and once a
/// replica restart had raised the percentile, a fifth of a loaded fleet's queries timed
/// out (kvix-bench fleet --chaos replica-restart). Counted in polls, not timed.
#[tokio::test]
async fn a_query_waiting_for_its_hedge_point_parks_instead_of_spinning() {
    let (c, a, _b, prompt) = two_holding_the_prompt(ClientConfig {
        hedge_after: Some(Duration::from_micros(900)),
        deadline: Duration::from_secs(1),
        ..config(Vec::new())
    })
    .await;
    a.set_mode(Mode::Delay(Duration::from_millis(500)));
    let (keyspace, options) = (ks(), opts());
    let mut query = Box::pin(c.query_tokens(&keyspace, &prompt, &options));
    let mut polls = 0u32;
    let got = std::future::poll_fn(|cx| {
        polls += 1;
        std::future::Future::poll(query.as_mut(), cx)
    })
    .await;
    assert_eq!(got.best().map(|s| s.blocks), Some(2), "{got:?}");
    let n = c.counters();
    assert_eq!((n.hedges, n.hedges_won), (1, 1));
    // Parked: woken by the hedge timer and by the reply, a few more at most.
    assert!(polls <= 10, "the query was polled {polls} times");
}
