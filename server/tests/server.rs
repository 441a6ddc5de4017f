//! The real binary on loopback, driven over the wire.

mod common;

use common::*;
use kvix_wire::*;

fn full() -> Vec<Lane> {
    vec![Lane::full(16)]
}

fn stored(lane: u8, start: u32, chain: &[u64]) -> Event {
    Event::Stored {
        lane,
        start,
        parent: None,
        chain: chain.to_vec(),
        engine: vec![],
    }
}

fn batch(worker: WorkerId, seq: u64, keyspace: &Keyspace, events: Vec<Event>) -> EventBatch {
    EventBatch {
        worker,
        seq,
        keyspace: keyspace.clone(),
        events,
    }
}

#[test]
fn handshake_accepts_matching_block_size_and_refuses_others() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.connect();
    let w = c.hello(16, None).unwrap();
    assert_eq!((w.token_block, w.byte_chunk, w.shards), (16, BYTE_CHUNK, 2));

    let mut bad = server.connect();
    let e = bad.hello(32, None).unwrap_err();
    assert_eq!(e.code, ErrorCode::BlockSizeMismatch);
    assert!(
        e.message.contains("32") && e.message.contains("16"),
        "{}",
        e.message
    );
    assert!(bad.recv().is_none(), "refused connections are closed");
}

#[test]
fn requests_before_hello_and_bad_frames_get_an_error_then_close() {
    let server = Server::start(&["--cores", "1"]);
    let mut c = server.connect();
    let r = c.ask(&StatsRequest {});
    assert_eq!(r.error().code, ErrorCode::NoHello);
    assert!(c.recv().is_none());

    let mut c = server.session();
    c.send_raw(b"GET / HTTP/1.1\r\n\r\n\0\0\0\0\0\0");
    assert_eq!(c.recv().unwrap().error().code, ErrorCode::BadFrame);
    assert!(c.recv().is_none());

    // A header announcing a frame over the limit is refused before its body arrives.
    let mut c = server.session();
    let mut frame = encode(&Ack {}, 5, 0).unwrap().to_vec();
    frame[16..20].copy_from_slice(&(64u32 << 20).to_le_bytes());
    c.send_raw(&frame[..24]);
    let e = c.recv().unwrap().error();
    assert_eq!(e.code, ErrorCode::BadFrame);
    assert!(e.message.contains("exceeds"), "{}", e.message);

    // A valid header over an invalid body.
    let mut c = server.session();
    let mut frame = encode(
        &Query {
            chain: vec![1, 2, 3],
            ..Default::default()
        },
        6,
        0,
    )
    .unwrap()
    .to_vec();
    let n = frame.len();
    frame[n - 8..].fill(0xff);
    c.send_raw(&frame);
    assert_eq!(c.recv().unwrap().error().code, ErrorCode::BadFrame);

    let metrics = server.scrape();
    for reason in ["no_hello", "bad_magic", "oversize", "invalid_body"] {
        assert!(
            metrics.contains(&format!(
                "kvix_rejected_frames_total{{reason=\"{reason}\"}} 1"
            )),
            "{reason}:\n{metrics}"
        );
    }
    // The server is still healthy for everyone else.
    let mut c = server.session();
    assert_eq!(c.ask(&StatsRequest {}).kind, Kind::Stats);
}

#[test]
fn auth_token_is_required_when_configured() {
    let server = Server::start(&["--cores", "1", "--auth-token", "s3cret"]);
    assert_eq!(
        server.connect().hello(16, None).unwrap_err().code,
        ErrorCode::Unauthorized
    );
    assert_eq!(
        server.connect().hello(16, Some("wrong")).unwrap_err().code,
        ErrorCode::Unauthorized
    );
    assert!(server.connect().hello(16, Some("s3cret")).is_ok());
}

#[test]
fn events_then_queries_score_the_holders_best_first() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let a = c.announce("a", full(), Feed::Events).unwrap();
    let b = c.announce("b", full(), Feed::Events).unwrap();
    assert!(a.created && b.created && a.worker != b.worker);
    assert_eq!(
        c.announce("a", full(), Feed::Events).unwrap(),
        Announced {
            worker: a.worker,
            created: false
        }
    );

    let chain = chain_of(&ks, 0, 20);
    assert_eq!(
        c.ask(&batch(a.worker, 0, &ks, vec![stored(0, 0, &chain)]))
            .decode::<Applied>()
            .status,
        ApplyStatus::Applied
    );
    assert_eq!(
        c.ask(&batch(b.worker, 0, &ks, vec![stored(0, 0, &chain[..7])]))
            .decode::<Applied>()
            .status,
        ApplyStatus::Applied
    );

    let ans = c.query(&ks, &chain);
    assert_eq!(
        ans.scores,
        vec![
            Score {
                worker: a.worker,
                blocks: 20
            },
            Score {
                worker: b.worker,
                blocks: 7
            }
        ]
    );
    // Another keyspace shares nothing.
    assert!(c
        .query(&Keyspace::tokens("other"), &chain)
        .scores
        .is_empty());
    // Candidates and top-k.
    let q = Query {
        keyspace: ks.clone(),
        chain: chain.clone(),
        candidates: vec![b.worker],
        top_k: 0,
        want_runs: false,
    };
    assert_eq!(
        c.ask(&q).decode::<Answer>().scores,
        vec![Score {
            worker: b.worker,
            blocks: 7
        }]
    );
    let q = Query {
        keyspace: ks.clone(),
        chain: chain.clone(),
        candidates: vec![],
        top_k: 1,
        want_runs: true,
    };
    let ans = c.ask(&q).decode::<Answer>();
    assert_eq!(ans.scores.len(), 1);
    assert!(!ans.runs.is_empty());

    // Duplicates are ignored, gaps reported.
    assert_eq!(
        c.ask(&batch(a.worker, 0, &ks, vec![Event::Cleared]))
            .decode::<Applied>()
            .status,
        ApplyStatus::Duplicate
    );
    assert_eq!(c.query(&ks, &chain).scores[0].blocks, 20);
    let gap = c.ask(&batch(
        a.worker,
        5,
        &ks,
        vec![Event::Removed {
            lane: 0,
            hashes: vec![chain[10]],
        }],
    ));
    assert_eq!(
        gap.decode::<Applied>().status,
        ApplyStatus::Gap { expected: 1 }
    );
    assert_eq!(
        c.query(&ks, &chain).scores[0],
        Score {
            worker: a.worker,
            blocks: 10
        }
    );

    // Retire forgets the worker.
    assert_eq!(c.ask(&Retire { worker: a.worker }).kind, Kind::Ack);
    assert_eq!(
        c.query(&ks, &chain).scores,
        vec![Score {
            worker: b.worker,
            blocks: 7
        }]
    );
    assert_eq!(
        c.ask(&Retire { worker: a.worker }).error().code,
        ErrorCode::UnknownWorker
    );
}

#[test]
fn unknown_workers_bad_lanes_and_byte_keyspace_lanes_are_refused() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let e = c.ask(&batch(99, 0, &ks, vec![Event::Cleared])).error();
    assert_eq!(e.code, ErrorCode::UnknownWorker);
    assert_eq!(
        c.announce("x", vec![Lane::full(24)], Feed::Events)
            .unwrap_err()
            .code,
        ErrorCode::BadLane
    );
    assert_eq!(
        c.announce("x", vec![], Feed::Events).unwrap_err().code,
        ErrorCode::BadLane
    );
    let hybrid = vec![
        Lane::full(16),
        Lane {
            kind: LaneKind::Mamba,
            block_tokens: 64,
        },
    ];
    let h = c.announce("h", hybrid, Feed::Events).unwrap();
    let bytes = Keyspace::bytes("m");
    let e = c
        .ask(&batch(h.worker, 0, &bytes, vec![stored(0, 0, &[1, 2])]))
        .error();
    assert_eq!(e.code, ErrorCode::LanesInByteKeyspace);
    let e = c
        .ask(&batch(h.worker, 1, &ks, vec![stored(7, 0, &[1, 2])]))
        .error();
    assert_eq!(e.code, ErrorCode::BadLane);
    // A batch is applied whole or not at all, and a refused batch does not take its seq.
    let chain = chain_of(&ks, 3, 4);
    let mixed = batch(
        h.worker,
        2,
        &ks,
        vec![stored(0, 0, &chain), stored(7, 0, &chain)],
    );
    let e = c.ask(&mixed).error();
    assert_eq!(e.code, ErrorCode::BadLane);
    assert!(
        e.message.contains("event 1") && e.message.contains("nothing"),
        "{}",
        e.message
    );
    assert_eq!(
        c.query(&ks, &chain).unscorable,
        0,
        "nothing of the refused batch was stored"
    );
    let good = c.ask(&batch(h.worker, 2, &ks, vec![stored(0, 0, &chain)]));
    assert_eq!(good.decode::<Applied>().status, ApplyStatus::Applied);
    assert_eq!(
        c.query(&ks, &chain).unscorable,
        1,
        "the hybrid worker now holds its full lane only"
    );
}

#[test]
fn hybrid_worker_with_an_empty_lane_scores_zero_and_counts_unscorable() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let lanes = vec![
        Lane::full(16),
        Lane {
            kind: LaneKind::SlidingWindow { window: 64 },
            block_tokens: 16,
        },
    ];
    let w = c.announce("hy", lanes, Feed::Events).unwrap().worker;
    let chain = chain_of(&ks, 7, 12);
    c.ask(&batch(w, 0, &ks, vec![stored(0, 0, &chain)]));
    let ans = c.query(&ks, &chain);
    assert!(
        ans.scores.is_empty(),
        "an empty sliding-window lane accepts only 0: {ans:?}"
    );
    assert_eq!(ans.unscorable, 1);
    c.ask(&batch(w, 1, &ks, vec![stored(1, 8, &chain[8..12])]));
    assert_eq!(
        c.query(&ks, &chain).scores,
        vec![Score {
            worker: w,
            blocks: 12
        }]
    );
    assert!(server
        .scrape()
        .contains("kvix_queries_total{outcome=\"unscorable\"} 1"));
}

/// A write sent without wanting a reply gets none when it is applied, and its error
/// frame, under its own id, when it is refused: a fire-and-forget sender can count what
/// was lost. Refusals used to be dropped unanswered.
#[test]
fn fire_and_forget_writes_are_answered_only_when_refused() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let w = c
        .announce(
            "p",
            full(),
            Feed::Placements {
                capacity_blocks: 10,
                ttl_ms: 0,
            },
        )
        .unwrap()
        .worker;
    let place = |worker| Placement {
        worker,
        keyspace: ks.clone(),
        chain: chain_of(&ks, 0, 4),
    };
    c.send_flags(&place(w), FLAG_NO_REPLY);
    let refused = c.send_flags(&place(w + 100), FLAG_NO_REPLY);
    c.send_flags(&Retire { worker: w + 200 }, FLAG_NO_REPLY);
    let stats = c.send(&StatsRequest {});
    // The two refusals, each under its id, and the stats (in any order: replies need
    // not keep the requests' order); nothing for the placement that was applied.
    let mut got = Vec::new();
    while got.len() < 3 {
        let r = c.recv().expect("replies before close");
        let code = (r.kind == Kind::ErrorReply).then(|| r.error().code);
        got.push((r.header.request_id, code));
    }
    got.sort_unstable_by_key(|(id, _)| *id);
    let echo = c.ask(&Echo {
        payload: vec![],
        reply_len: 0,
    });
    assert_eq!(echo.kind, Kind::Echo, "nothing else was answered");
    assert_eq!(
        got,
        [
            (refused, Some(ErrorCode::UnknownWorker)),
            (refused + 1, Some(ErrorCode::UnknownWorker)),
            (stats, None)
        ]
    );
}

#[test]
fn placements_fire_and_forget_and_are_capped() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let w = c
        .announce(
            "p",
            full(),
            Feed::Placements {
                capacity_blocks: 10,
                ttl_ms: 0,
            },
        )
        .unwrap()
        .worker;
    let (one, two) = (chain_of(&ks, 0, 8), chain_of(&ks, 1000, 8));
    c.send_flags(
        &Placement {
            worker: w,
            keyspace: ks.clone(),
            chain: one.clone(),
        },
        FLAG_NO_REPLY,
    );
    // A reply-wanted placement orders after the fire-and-forget one on this connection.
    assert_eq!(
        c.ask(&Placement {
            worker: w,
            keyspace: ks.clone(),
            chain: two.clone()
        })
        .kind,
        Kind::Ack
    );
    // 16 placed blocks over a capacity of 10: the older chain is cut from its end.
    assert_eq!(
        c.query(&ks, &two).scores,
        vec![Score {
            worker: w,
            blocks: 8
        }]
    );
    assert_eq!(
        c.query(&ks, &one).scores,
        vec![Score {
            worker: w,
            blocks: 2
        }]
    );
}

#[test]
fn pipelined_requests_are_all_answered_by_id() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let w = c.announce("a", full(), Feed::Events).unwrap().worker;
    let chain = chain_of(&ks, 0, 64);
    c.ask(&batch(w, 0, &ks, vec![stored(0, 0, &chain)]));
    let mut buf = AlignedVec::new();
    for i in 0..200u64 {
        let q = Query {
            keyspace: ks.clone(),
            chain: chain[..(i as usize % 64) + 1].to_vec(),
            ..Default::default()
        };
        buf = encode_into(&q, 1000 + i, 0, buf).unwrap();
    }
    c.send_raw(&buf);
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..200 {
        let r = c.recv().unwrap();
        seen.insert(r.header.request_id, r.decode::<Answer>().scores[0].blocks);
    }
    assert_eq!(seen.len(), 200);
    for (id, blocks) in seen {
        assert_eq!(blocks as u64, (id - 1000) % 64 + 1);
    }
}

/// Shards must not change answers: one, two and four executors, same feed, same queries.
#[test]
fn answers_do_not_depend_on_the_shard_count() {
    let ks = Keyspace::tokens("m");
    let mut results = Vec::new();
    for cores in ["1", "2", "4"] {
        let server = Server::start(&["--cores", cores, "--pin", "false"]);
        let mut c = server.session();
        let mut ids = Vec::new();
        for w in 0..6u32 {
            ids.push(
                c.announce(&format!("w{w}"), full(), Feed::Events)
                    .unwrap()
                    .worker,
            );
        }
        for (i, &w) in ids.iter().enumerate() {
            let chain = chain_of(&ks, (i as u32 % 3) * 100_000, 10 + i * 7);
            c.ask(&batch(w, 0, &ks, vec![stored(0, 0, &chain)]));
            let drop: Vec<u64> = chain.iter().skip(3 + i).step_by(11).copied().collect();
            c.ask(&batch(
                w,
                1,
                &ks,
                vec![Event::Removed {
                    lane: 0,
                    hashes: drop,
                }],
            ));
        }
        let answers: Vec<Vec<(String, u32)>> = (0..3u32)
            .map(|k| {
                let ans = c.query(&ks, &chain_of(&ks, k * 100_000, 60));
                ans.scores
                    .iter()
                    .map(|s| {
                        (
                            format!("w{}", ids.iter().position(|&x| x == s.worker).unwrap()),
                            s.blocks,
                        )
                    })
                    .collect()
            })
            .collect();
        results.push(answers);
    }
    assert!(results[0].iter().any(|a| !a.is_empty()));
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}

#[test]
fn every_steering_mode_serves_connections() {
    for mode in ["ebpf", "cbpf", "none"] {
        let server = Server::start(&["--cores", "2", "--steering", mode]);
        let banner = server.stdout_lines.join("");
        let mut conns: Vec<Conn> = (0..8).map(|_| server.session()).collect();
        for c in &mut conns {
            assert_eq!(
                c.ask(&Echo {
                    payload: vec![1; 64],
                    reply_len: 256
                })
                .decode::<Echo>()
                .payload
                .len(),
                256
            );
        }
        let metrics = server.scrape();
        assert!(
            metrics.contains("kvix_connections_total 8"),
            "{mode}: {metrics}"
        );
        assert!(banner.contains("steering"), "{banner}");
    }
}

#[test]
fn unix_socket_speaks_the_same_protocol() {
    let path = std::env::temp_dir().join(format!("kvix-test-{}.sock", std::process::id()));
    let p = path.to_str().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvix-server"));
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "",
        "--cores",
        "1",
        "--unix",
        p,
    ]);
    let server = Server::spawn(cmd);
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    use std::io::{Read, Write};
    s.write_all(
        &encode(
            &Hello {
                client: "u".into(),
                token_block: 16,
                auth: None,
            },
            1,
            0,
        )
        .unwrap(),
    )
    .unwrap();
    let mut buf = AlignedVec::new();
    let mut chunk = [0u8; 4096];
    while split_frame(&buf, u32::MAX).unwrap().is_none() {
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0);
        buf.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(
        split_frame(&buf, u32::MAX).unwrap().unwrap().kind,
        Kind::Welcome
    );
    assert!(server.stop().success());
    assert!(!path.exists(), "the socket file is removed on shutdown");
}

#[test]
fn stats_sum_the_shards() {
    let server = Server::start(&["--cores", "2"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("m");
    let w = c.announce("a", full(), Feed::Events).unwrap().worker;
    c.ask(&batch(w, 0, &ks, vec![stored(0, 0, &chain_of(&ks, 0, 10))]));
    let s: Stats = c.ask(&StatsRequest {}).decode();
    assert_eq!((s.workers, s.blocks, s.memberships), (1, 10, 10));
    assert_eq!(s.shard_load.len(), 2);
}

#[test]
fn connections_over_the_limit_get_overloaded_and_are_closed() {
    let server = Server::start(&["--cores", "1", "--max-connections", "2"]);
    let _a = server.session();
    let _b = server.session();
    let mut c = server.connect();
    let r = c.recv().expect("an error frame before the close");
    assert_eq!(r.error().code, ErrorCode::Overloaded);
    assert!(c.recv().is_none());
    assert!(server
        .scrape()
        .contains("kvix_rejected_frames_total{reason=\"overloaded\"} 1"));
}

/// Pins the calling thread to one CPU.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// Steering sends every connection of a thread pinned to one CPU to that CPU's
/// executor: past its --max-connections share they are served by the other executor,
/// and a client is refused only once both are full.
#[test]
fn a_full_executor_hands_new_connections_to_one_with_room() {
    let server = Server::start(&["--cores", "2", "--max-connections", "4"]);
    let server = &server;
    let held = std::thread::scope(|s| {
        s.spawn(|| {
            pin_to(0);
            (0..8).map(|_| server.session()).collect::<Vec<_>>()
        })
        .join()
        .unwrap()
    });
    assert_eq!(held.len(), 8);
    let split =
        [0, 1].map(|e| server.metric(&format!("kvix_executor_connections{{executor=\"{e}\"}}")));
    assert_eq!(split, [4, 4], "each executor serves its share");
    let spilled = server.metric("kvix_connections_spilled_total");
    assert!(spilled >= 1, "connections moved to the executor with room");
    let mut c = server.connect();
    let r = c.recv().expect("an error frame before the close");
    assert_eq!(r.error().code, ErrorCode::Overloaded);
    // A slot freed anywhere is a slot for the next client, whichever CPU it runs on.
    drop(held);
    eventually("slots given back", || {
        (server.metric("kvix_connections") == 0).then_some(())
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_to(0);
            let _more: Vec<Conn> = (0..8).map(|_| server.session()).collect();
        });
    });
}

/// A client that pipelines without ever reading its replies stalls only itself.
#[test]
fn a_client_that_never_reads_does_not_stall_others() {
    let server = Server::start(&["--cores", "1", "--max-inflight", "8"]);
    let ks = Keyspace::tokens("m");
    let mut hog = server.session();
    hog.stream.set_nonblocking(true).unwrap();
    // Small queries: a reply is about as large as its query, so the socket buffers (the
    // server's send buffer alone grows to 4 MiB) fill after a few MiB of queries, far
    // below the 64 MiB this test allows. Large ones made it fail where the kernel grew
    // the buffers past a query-to-reply ratio of 16.
    let q = encode(
        &Query {
            keyspace: ks.clone(),
            chain: chain_of(&ks, 0, 4),
            ..Default::default()
        },
        1,
        0,
    )
    .unwrap();
    // Write until the socket buffers fill: the server has stopped reading this client.
    let mut sent = 0usize;
    let mut stalled = 0;
    while sent < 64 << 20 && stalled < 200 {
        use std::io::Write;
        match hog.stream.write(&q[sent % q.len()..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                stalled += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        sent < 64 << 20,
        "the server kept reading a client that never reads its replies"
    );
    let mut other = server.session();
    let w = other.events_worker("w");
    let chain = chain_of(&ks, 0, 4);
    other.ask(&EventBatch {
        worker: w,
        seq: 0,
        keyspace: ks.clone(),
        events: vec![stored(0, 0, &chain)],
    });
    assert_eq!(
        other.query(&ks, &chain).scores,
        vec![Score {
            worker: w,
            blocks: 4
        }]
    );
}

/// Every connection, whichever executor holds it, lists the workers any client
/// announced: paged at about a quarter of the frame limit, each listed once, retired
/// ones left out; names asked for are listed whatever their id.
#[test]
fn the_roster_lists_every_clients_workers_in_pages() {
    let server = Server::start(&["--cores", "2", "--max-frame", "16384"]);
    let mut controller = server.session();
    let names: Vec<String> = (0..120)
        .map(|i| format!("{i:03}-{}", "w".repeat(200)))
        .collect();
    let ids: Vec<WorkerId> = names.iter().map(|n| controller.events_worker(n)).collect();
    let retired = ids[7];
    let r = controller.ask(&Retire { worker: retired });
    assert_eq!(r.kind, Kind::Ack);
    // Gateways on both executors (connections are spread over them), announcing nothing.
    for _ in 0..4 {
        let mut gateway = server.session();
        let mut listed = Vec::new();
        let (mut from, mut pages) = (0, 0);
        loop {
            let page: Roster = gateway
                .ask(&RosterRequest {
                    from,
                    names: Vec::new(),
                })
                .decode();
            pages += 1;
            listed.extend(page.workers.into_iter().map(|e| (e.worker, e.name)));
            if !page.more {
                assert_eq!(page.next, ids.iter().max().unwrap() + 1);
                break;
            }
            assert!(page.next > from, "a page moves on");
            from = page.next;
        }
        assert!(
            pages >= 4,
            "120 names of 204 bytes take several 4 KiB pages"
        );
        let want: Vec<(WorkerId, String)> = ids
            .iter()
            .zip(&names)
            .filter(|(id, _)| **id != retired)
            .map(|(id, n)| (*id, n.clone()))
            .collect();
        assert_eq!(listed, want);
        // By name: from the end, so only the names asked for (the retired one not).
        let page: Roster = gateway
            .ask(&RosterRequest {
                from: u32::MAX,
                names: vec![names[7].clone(), names[9].clone(), "nobody".into()],
            })
            .decode();
        assert_eq!(
            page.workers,
            vec![RosterEntry {
                worker: ids[9],
                name: names[9].clone()
            }]
        );
        assert!(!page.more);
    }
}

fn stored_in(tier: Tier, start: u32, chain: &[u64]) -> Event {
    Event::StoredIn {
        tier,
        lane: 0,
        start,
        parent: None,
        chain: chain.to_vec(),
        engine: vec![],
    }
}

fn tiered_query(ks: &Keyspace, chain: &[u64], weights: TierWeights) -> TieredQuery {
    TieredQuery {
        keyspace: ks.clone(),
        chain: chain.to_vec(),
        weights,
        ..Default::default()
    }
}

/// A rolling upgrade: servers speak v4 and v5 at once. A v4 client reads v4 frames with
/// the joint figure (any tier), ranked by it; a v5 client reads each tier and a ranking
/// weighed by tier; a v5 request in a v4 frame is refused, naming the version.
#[test]
fn v4_clients_get_the_joint_figure_and_v5_clients_the_tiers() {
    let server = Server::start(&["--cores", "2"]);
    let ks = Keyspace::tokens("m");
    let chain = chain_of(&ks, 0, 8);
    let mut c = server.session();
    let (gpu, cpu) = (c.events_worker("gpu"), c.events_worker("cpu"));
    // gpu: blocks 0..4 on GPU. cpu: block 0 on GPU, 0..6 on CPU, then storage to 7.
    let r = c.ask(&batch(gpu, 0, &ks, vec![stored(0, 0, &chain[..4])]));
    assert_eq!(r.kind, Kind::Applied);
    let events = vec![
        stored(0, 0, &chain[..1]),
        stored_in(Tier::Cpu, 0, &chain[..6]),
        stored_in(Tier::Storage, 6, &chain[6..7]),
    ];
    assert_eq!(c.ask(&batch(cpu, 0, &ks, events)).kind, Kind::Applied);

    let mut old = server.connect();
    old.version = 4;
    old.hello(16, None).unwrap();
    let r = old.ask(&Query {
        keyspace: ks.clone(),
        chain: chain.clone(),
        ..Default::default()
    });
    assert_eq!((r.header.version, r.kind), (4, Kind::Answer));
    let a: Answer = r.decode();
    let joint: Vec<(WorkerId, u32)> = a.scores.iter().map(|s| (s.worker, s.blocks)).collect();
    assert_eq!(joint, [(cpu, 7), (gpu, 4)], "ranked by the joint depth");

    let depths = |gpu, cpu, storage| Depths { gpu, cpu, storage };
    // Dynamo's weights: cpu is worth 1 + 0.75·5 + 0.25·1 = 5, over gpu's 4.
    let r = c.ask(&tiered_query(&ks, &chain, TierWeights::DYNAMO));
    assert_eq!(r.header.version, 5);
    let a: TieredAnswer = r.decode();
    let got: Vec<(WorkerId, Depths)> = a.scores.iter().map(|s| (s.worker, s.tiers)).collect();
    assert_eq!(got, [(cpu, depths(1, 6, 7)), (gpu, depths(4, 4, 4))]);
    // CPU worth a third of GPU: 1 + 5/3 + 0.25 < 4, so gpu ranks first.
    let third = TierWeights {
        cpu: 1.0 / 3.0,
        storage: 0.25,
    };
    let a: TieredAnswer = c.ask(&tiered_query(&ks, &chain, third)).decode();
    let order: Vec<WorkerId> = a.scores.iter().map(|s| s.worker).collect();
    assert_eq!(order, [gpu, cpu]);

    // Weights out of range: a typed refusal.
    let nan = TierWeights {
        cpu: f32::NAN,
        storage: 0.0,
    };
    let e = c.ask(&tiered_query(&ks, &chain, nan)).error();
    assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
    let e = c
        .ask(&tiered_query(
            &ks,
            &chain,
            TierWeights {
                cpu: 1.5,
                storage: 0.0,
            },
        ))
        .error();
    assert_eq!(e.code, ErrorCode::BadRequest);

    // A v5 kind in a v4 frame: refused as a version error, and the connection closed.
    let mut frame = encode(&tiered_query(&ks, &chain, TierWeights::DYNAMO), 9, 0)
        .unwrap()
        .to_vec();
    frame[4..6].copy_from_slice(&4u16.to_le_bytes());
    old.send_raw(&frame);
    let r = old.recv().unwrap();
    assert_eq!(r.header.version, 4, "a refusal a v4 client can read");
    let e = r.error();
    assert_eq!(e.code, ErrorCode::UnsupportedVersion, "{}", e.message);
    assert!(old.recv().is_none());
    assert!(server
        .scrape()
        .contains("kvix_rejected_frames_total{reason=\"version\"} 1"));
}

/// Reuse reports are taken (acknowledged, counted), in batches and fire-and-forget.
#[test]
fn reuse_reports_are_counted() {
    let server = Server::start(&["--cores", "1"]);
    let mut c = server.session();
    let w = c.events_worker("w");
    let report = |n: usize| ReuseReport {
        reports: (0..n)
            .map(|i| Reuse {
                worker: w,
                model: "m".into(),
                predicted_tokens: (i % 2 == 0).then_some(32),
                cached_tokens: 16,
                prompt_tokens: 100,
            })
            .collect(),
    };
    assert_eq!(c.ask(&report(3)).kind, Kind::Ack);
    c.send_flags(&report(2), FLAG_NO_REPLY);
    assert_eq!(c.ask(&StatsRequest {}).kind, Kind::Stats);
    assert_eq!(server.metric("kvix_reuse_reports_total"), 5);
}
