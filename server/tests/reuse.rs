//! The closed loop: gateways report what the engines say they reused (v5 `ReuseReport`),
//! and the server names the cause when its predictions and the engines disagree, on
//! workers fed by a real vLLM 0.34 publisher. Each cause is named for the worker or the
//! client at fault alone, a healthy one in the same run gets no verdict, and the verdict
//! clears once the fault is fixed (within 13 right reports).

mod common;

use std::time::Duration;

use common::engines::{available, Ports};
use common::*;
use kvix_client::blocking::BlockingClient;
use kvix_client::{Addr, ClientConfig, ReuseSample, WorkerRef};
use kvix_wire::chain::token_chain;
use kvix_wire::*;
use serde_json::{json, Value};

const RELEASE: &str = "vllm-0.34.0";
/// A prompt of 12 blocks and a few tokens: the engines reuse its first 10 blocks.
const PROMPT: u32 = 12 * 16 + 5;
const HELD: u32 = 10 * 16;

fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from..to).map(|i| 1_000 + i).collect()
}

/// The 10 blocks every engine stores, as vLLM 0.34 sends them.
fn stored() -> Value {
    stored_from(0, 10)
}

/// `blocks` blocks of the prompt starting at token `from`, each hashed by the engine
/// under an id of its own.
fn stored_from(from: u32, blocks: u32) -> Value {
    let first = u64::from(from / 16);
    json!({
        "type": "BlockStored",
        "block_hashes": (first..first + u64::from(blocks)).map(|i| 0xF000_0000_0000_0000u64 | i).collect::<Vec<_>>(),
        "parent_block_hash": null,
        "token_ids": tokens(from, from + 16 * blocks),
        "block_size": 16,
        "lora_id": null,
        "medium": "GPU",
        "lora_name": null,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    })
}

fn reuse(worker: WorkerId, predicted: Option<u32>, cached: u32) -> Reuse {
    Reuse {
        worker,
        model: "m".into(),
        predicted_tokens: predicted,
        cached_tokens: cached,
        prompt_tokens: PROMPT,
    }
}

/// Sends `n` rounds of `reports`, each answered before the next.
fn report(c: &mut Conn, n: usize, reports: &[Reuse]) {
    for _ in 0..n {
        let r = c.ask(&ReuseReport {
            reports: reports.to_vec(),
        });
        assert_eq!(r.kind, Kind::Ack, "{:?}", r.message());
    }
}

/// (who, cause) pairs.
type Named<K> = Vec<(K, String)>;

/// The verdicts as the metrics port shows them: cause per worker id, and per client.
fn verdicts(server: &Server) -> (Named<u64>, Named<String>) {
    let body = server.get_metrics_path("/reuse");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    let workers = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| Some((w["worker"].as_u64()?, w["suspect"].as_str()?.to_string())))
        .collect();
    let clients = v["clients"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| {
            let name = c["client"].as_str()?.split('@').next()?.to_string();
            Some((name, c["suspect"].as_str()?.to_string()))
        })
        .collect();
    (workers, clients)
}

fn suspect_in_answer(c: &mut Conn, chain: &[u64]) -> Vec<(WorkerId, Option<SuspectCause>)> {
    let a: TieredAnswer = c
        .ask(&TieredQuery {
            keyspace: Keyspace::tokens("m"),
            chain: chain.to_vec(),
            weights: TierWeights::JOINT,
            ..Default::default()
        })
        .decode();
    a.scores.iter().map(|s| (s.worker, s.suspect)).collect()
}

#[test]
fn each_cause_is_named_for_whoever_is_at_fault_and_clears_once_fixed() {
    if available("reuse_verdicts").is_none() {
        return;
    }
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session_as("gateway-1");
    // Engine a publishes; engine b's events go nowhere kvix listens until it is fixed.
    let (pa, mut a_engine) = Ports::start_one(RELEASE);
    let pb = Ports::choose(1);
    let a = c.announce_source("a", vec![Lane::full(16)], pa.source(0, ""));
    let b = c.announce_source("b", vec![Lane::full(16)], pb.source(0, ""));
    let (a, b) = (a.unwrap().worker, b.unwrap().worker);
    a_engine.publish(vec![stored()]);
    let ks = Keyspace::tokens("m");
    let chain = token_chain(ks.seed(16), 16, &tokens(0, PROMPT));
    wait_until("a's stores", || {
        c.query(&ks, &chain).scores
            == vec![Score {
                worker: a,
                blocks: 10,
            }]
    });

    // b's events are missing: kvix predicts nothing where b's engine reuses 10 blocks.
    report(
        &mut c,
        15,
        &[reuse(a, Some(HELD), HELD), reuse(b, None, HELD)],
    );
    assert_eq!(verdicts(&server).0, vec![], "not before 16 reports");
    report(
        &mut c,
        1,
        &[reuse(a, Some(HELD), HELD), reuse(b, None, HELD)],
    );
    assert_eq!(
        verdicts(&server).0,
        vec![(u64::from(b), "events_missing".into())]
    );
    assert_eq!(
        server.metric("kvix_workers_suspect{cause=\"events_missing\"}"),
        1
    );
    assert!(server.metric("kvix_reuse_predictions_total{outcome=\"missed\"}") >= 16);

    // Fixed: b's engine publishes where kvix listens; its reports agree again.
    let mut b_engine = pb.restart(RELEASE);
    b_engine.publish(vec![stored()]);
    wait_until("b's stores", || c.query(&ks, &chain).scores.len() == 2);
    report(
        &mut c,
        13,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(
        verdicts(&server).0,
        vec![],
        "cleared within 13 right reports"
    );
    assert_eq!(
        server.metric("kvix_workers_suspect{cause=\"events_missing\"}"),
        0
    );

    // a's removals are late: kvix predicts 10 blocks, a's engine reuses none. The answer
    // flags a, and a's score counts half in the client's pick.
    report(
        &mut c,
        16,
        &[reuse(a, Some(HELD), 0), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(
        verdicts(&server).0,
        vec![(u64::from(a), "events_lagging".into())]
    );
    assert_eq!(
        suspect_in_answer(&mut c, &chain),
        vec![(a, Some(SuspectCause::EventsLagging)), (b, None)]
    );
    report(
        &mut c,
        13,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(
        suspect_in_answer(&mut c, &chain),
        vec![(a, None), (b, None)]
    );

    // b's engine reuses more than kvix knows (a tier it does not report), its events
    // coming in all along: every request stores blocks (a prompt of one block each).
    for i in 0..16 {
        let from = 100_000 + 16 * i;
        b_engine.publish(vec![stored_from(from, 1)]);
        let probe = token_chain(ks.seed(16), 16, &tokens(from, from + 16));
        wait_until("b's store of this request", || {
            c.query(&ks, &probe).scores.iter().any(|s| s.worker == b)
        });
        report(
            &mut c,
            1,
            &[reuse(a, Some(HELD), HELD), reuse(b, Some(64), HELD)],
        );
    }
    assert_eq!(
        verdicts(&server).0,
        vec![(u64::from(b), "undercounted".into())]
    );
    report(
        &mut c,
        13,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(verdicts(&server).0, vec![]);

    // b's events stop after what it stored so far: kvix predicts its old blocks, the
    // engine reuses more, and none of its events come in across the reports: its events
    // are missing, not under-counted.
    report(
        &mut c,
        16,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(64), HELD)],
    );
    assert_eq!(
        verdicts(&server).0,
        vec![(u64::from(b), "events_missing".into())]
    );
    report(
        &mut c,
        13,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(verdicts(&server).0, vec![]);

    // Gateway 2 tokenizes otherwise: its chains miss on every worker. It is named, the
    // workers are not (gateway 1's reports on them are right), and once it tokenizes as
    // the engines do, it clears.
    let mut c2 = server.session_as("gateway-2");
    for _ in 0..16 {
        report(&mut c2, 1, &[reuse(a, None, HELD), reuse(b, None, HELD)]);
        report(
            &mut c,
            1,
            &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
        );
    }
    let (workers, clients) = verdicts(&server);
    assert_eq!(workers, vec![]);
    assert_eq!(
        clients,
        vec![("gateway-2".into(), "gateway_tokenization".into())]
    );
    assert_eq!(
        server.metric("kvix_workers_suspect{cause=\"gateway_tokenization\"}"),
        1
    );
    report(
        &mut c2,
        13,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    assert_eq!(verdicts(&server).1, vec![]);

    // The Rust client batches its reports fire-and-forget; a sample without the
    // engine's figure is no report.
    let rc = BlockingClient::connect(ClientConfig::new([Addr::tcp(server.addr.to_string())]))
        .expect("client");
    let before = server.metric("kvix_reuse_reports_total");
    let sample = |cached| ReuseSample {
        worker: WorkerRef::Name("a".into()),
        model: "m".into(),
        predicted_tokens: Some(HELD),
        cached_tokens: cached,
        prompt_tokens: PROMPT,
    };
    assert!(!rc.report_reuse(sample(None)));
    for _ in 0..20 {
        assert!(rc.report_reuse(sample(Some(HELD))));
    }
    wait_until("the client's reports", || {
        server.metric("kvix_reuse_reports_total") == before + 20
    });
    // The client counts a batch once its write returned, which can be after the server
    // read it.
    wait_until("the client counts them sent", || {
        rc.counters().reuse_reports_sent == 20
    });
    let counted = rc.counters();
    assert_eq!(
        (counted.reuse_reports_sent, counted.reuse_unreported),
        (20, 1)
    );
}

/// Waits (at most 30 s) until `f` holds.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..600 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("never happened: {what}");
}

/// A placement-fed worker whose engine lost its cache (a restart kvix cannot see): its
/// engine reports no reuse where its placements promised some. Four such reports in a
/// row drop its placements (a logged write, so every replica drops them) instead of
/// predicting them until they age out and naming the worker for it; a healthy
/// placement-fed worker beside it keeps its own, and a zero broken by one right report
/// starts the count again. The worker used to be named `events_lagging`, a cause with
/// no events to lag, after 8 of its reports (docs/benchmarks.md §13's 100 k leg).
#[test]
fn a_placement_fed_engine_that_lost_its_cache_has_its_placements_dropped() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session_as("gateway-1");
    let feed = Feed::Placements {
        capacity_blocks: 64,
        ttl_ms: 0,
    };
    let a = c.announce("a", vec![Lane::full(16)], feed).unwrap().worker;
    let b = c.announce("b", vec![Lane::full(16)], feed).unwrap().worker;
    let ks = Keyspace::tokens("m");
    let chain = token_chain(ks.seed(16), 16, &tokens(0, PROMPT));
    for w in [a, b] {
        let r = c.ask(&Placement {
            worker: w,
            keyspace: ks.clone(),
            chain: chain[..10].to_vec(),
        });
        assert_eq!(r.kind, Kind::Ack);
    }
    let both = |c: &mut Conn| c.query(&ks, &chain).scores.len() == 2;
    wait_until("both placements", || both(&mut c));
    // Three zeros, then a right report: the count starts again.
    report(
        &mut c,
        3,
        &[reuse(a, Some(HELD), 0), reuse(b, Some(HELD), HELD)],
    );
    report(
        &mut c,
        1,
        &[reuse(a, Some(HELD), HELD), reuse(b, Some(HELD), HELD)],
    );
    report(
        &mut c,
        3,
        &[reuse(a, Some(HELD), 0), reuse(b, Some(HELD), HELD)],
    );
    assert!(both(&mut c), "dropped before four zeros in a row");
    assert_eq!(server.metric("kvix_reuse_caches_lost_total"), 0);
    report(
        &mut c,
        1,
        &[reuse(a, Some(HELD), 0), reuse(b, Some(HELD), HELD)],
    );
    wait_until("a's placements dropped", || {
        c.query(&ks, &chain).scores
            == vec![Score {
                worker: b,
                blocks: 10,
            }]
    });
    assert_eq!(server.metric("kvix_reuse_caches_lost_total"), 1);
    // Its engine fills again: reports on what it was placed since are right, and no
    // verdict was ever held.
    report(&mut c, 16, &[reuse(a, None, 0), reuse(b, Some(HELD), HELD)]);
    assert_eq!(verdicts(&server), (vec![], vec![]), "no verdict");
    for cause in ["events_lagging", "events_missing", "undercounted"] {
        let gauge = format!("kvix_workers_suspect{{cause=\"{cause}\"}}");
        assert_eq!(server.metric(&gauge), 0, "{cause}");
    }
}

/// A worker whose events go elsewhere (announced with an endpoint nothing publishes
/// on): its engine reuses what kvix never heard of. Once named `events_missing`, the
/// gateways' placements on it fill in for what its events would say (a logged write, as
/// for a lost history), so its follow-ups find it again; a placement before the verdict
/// is passed over, as on any event-fed worker. Placements on such a worker used to be
/// passed over for good: the verdict named it, and nothing found it.
#[test]
fn a_worker_whose_events_go_elsewhere_is_filled_in_by_placements_once_named() {
    if available("reuse_fill_in").is_none() {
        return;
    }
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session_as("gateway-1");
    let (pa, mut a_engine) = Ports::start_one(RELEASE);
    let nowhere = Ports::choose(1);
    let a = c.announce_source("a", vec![Lane::full(16)], pa.source(0, ""));
    let b = c.announce_source("b", vec![Lane::full(16)], nowhere.source(0, ""));
    let (a, b) = (a.unwrap().worker, b.unwrap().worker);
    a_engine.publish(vec![stored()]);
    let ks = Keyspace::tokens("m");
    let chain = token_chain(ks.seed(16), 16, &tokens(0, PROMPT));
    let on_b = token_chain(ks.seed(16), 16, &tokens(10_000, 10_000 + PROMPT));
    let place = |c: &mut Conn| {
        let r = c.ask(&Placement {
            worker: b,
            keyspace: ks.clone(),
            chain: on_b[..10].to_vec(),
        });
        assert_eq!(r.kind, Kind::Ack);
    };
    wait_until("a's stores", || c.query(&ks, &chain).scores.len() == 1);
    place(&mut c);
    assert_eq!(c.query(&ks, &on_b).scores, vec![], "passed over before");
    report(
        &mut c,
        16,
        &[reuse(a, Some(HELD), HELD), reuse(b, None, HELD)],
    );
    assert_eq!(
        verdicts(&server).0,
        vec![(u64::from(b), "events_missing".into())]
    );
    wait_until("the placement taken", || {
        place(&mut c);
        c.query(&ks, &on_b).scores
            == vec![Score {
                worker: b,
                blocks: 10,
            }]
    });
    // a, whose events come in, takes no placement.
    let r = c.ask(&Placement {
        worker: a,
        keyspace: ks.clone(),
        chain: on_b.clone(),
    });
    assert_eq!(r.kind, Kind::Ack);
    assert_eq!(
        c.query(&ks, &on_b).scores,
        vec![Score {
            worker: b,
            blocks: 10
        }]
    );
}
