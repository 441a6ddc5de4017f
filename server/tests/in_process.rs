//! The server in this process (`kvix_server::run_with`, two executors) on a
//! `ManualClock`: a placement's TTL is measured on a clock only the test moves, whatever
//! the machine's load, so expiry is tested against the order of the writes around it.

mod common;

use std::sync::Arc;

use common::*;
use kvix_server::clock::ManualClock;
use kvix_wire::*;

#[test]
fn placements_expire_after_their_ttl_on_every_executor_and_not_before() {
    let clock = Arc::new(ManualClock::default());
    // One connection per executor: the second is handed to the other one.
    let args = ["--cores", "2", "--max-connections", "1"];
    let (addr, first) = in_process(&args, clock.clone());
    let mut on = [Conn::over(first), Conn::open(addr)];
    for c in &mut on {
        c.hello(16, None).expect("welcome");
    }
    let ks = Keyspace::tokens("m");
    let feed = |ttl_ms| Feed::Placements {
        capacity_blocks: 100,
        ttl_ms,
    };
    let w = on[0]
        .announce("expiring", vec![Lane::full(16)], feed(1000))
        .unwrap()
        .worker;
    let kept = on[0]
        .announce("kept", vec![Lane::full(16)], feed(0))
        .unwrap()
        .worker;
    let chain = chain_of(&ks, 0, 8);
    for worker in [w, kept] {
        let placed = on[0].ask(&Placement {
            worker,
            keyspace: ks.clone(),
            chain: chain.clone(),
        });
        assert_eq!(placed.kind, Kind::Ack);
    }
    let holders = |c: &mut Conn| {
        let mut ws: Vec<_> = c
            .query(&ks, &chain)
            .scores
            .iter()
            .map(|s| s.worker)
            .collect();
        ws.sort_unstable();
        ws
    };
    for c in &mut on {
        assert_eq!(holders(c), [w, kept]);
    }
    // Before the TTL: expiry runs every second of wall time; give it two, then both
    // placements are still held everywhere.
    clock.advance(900);
    std::thread::sleep(std::time::Duration::from_millis(2200));
    for c in &mut on {
        assert_eq!(holders(c), [w, kept], "nothing expires before its TTL");
    }
    // Past it: the expiring worker's placement goes from every copy, the other stays.
    clock.advance(200);
    for (i, c) in on.iter_mut().enumerate() {
        eventually(
            &format!("the placement expires on connection {i}'s executor"),
            || (holders(c) == [kept]).then_some(()),
        );
    }
}

/// Two connections, one on each executor (`--max-connections 1`: the second is handed to
/// the other one), past the handshake.
fn both_executors(clock: &Arc<ManualClock>) -> [Conn; 2] {
    let args = ["--cores", "2", "--max-connections", "1"];
    let (addr, first) = in_process(&args, clock.clone());
    let mut on = [Conn::over(first), Conn::open(addr)];
    for c in &mut on {
        c.hello(16, None).expect("welcome");
    }
    on
}

/// The blocks of `chain` each connection's executor credits to `worker`.
fn held(on: &mut [Conn; 2], ks: &Keyspace, chain: &[u64], worker: WorkerId) -> [u32; 2] {
    on.each_mut().map(|c| {
        let a = c.query(ks, chain);
        a.scores
            .iter()
            .find(|s| s.worker == worker)
            .map_or(0, |s| s.blocks)
    })
}

/// A placement's age is each block's: placing blocks again (through either executor,
/// both routed to the worker's home, in order with the first placement) makes them
/// young again everywhere, and only the blocks not placed again expire at the TTL.
#[test]
fn blocks_placed_again_before_their_ttl_outlive_the_rest_on_every_executor() {
    let clock = Arc::new(ManualClock::default());
    let mut on = both_executors(&clock);
    let ks = Keyspace::tokens("m");
    let feed = Feed::Placements {
        capacity_blocks: 100,
        ttl_ms: 1000,
    };
    let w = on[0]
        .announce("gateway-view", vec![Lane::full(16)], feed)
        .unwrap()
        .worker;
    let chain = chain_of(&ks, 0, 8);
    let place = |c: &mut Conn, blocks: &[u64]| {
        let placed = c.ask(&Placement {
            worker: w,
            keyspace: ks.clone(),
            chain: blocks.to_vec(),
        });
        assert_eq!(placed.kind, Kind::Ack);
    };
    place(&mut on[0], &chain);
    assert_eq!(held(&mut on, &ks, &chain, w), [8, 8]);
    // At 600 ms the first four blocks are placed again, two through each executor.
    clock.advance(600);
    place(&mut on[0], &chain[..2]);
    place(&mut on[1], &chain[..4]);
    // At 1100 ms the last four are past the TTL, the first four 500 ms old.
    clock.advance(500);
    eventually("the blocks not placed again expire everywhere", || {
        (held(&mut on, &ks, &chain, w) == [4, 4]).then_some(())
    });
    // At 1700 ms the first four are past it too.
    clock.advance(600);
    eventually("the blocks placed again expire at their own TTL", || {
        (held(&mut on, &ks, &chain, w) == [0, 0]).then_some(())
    });
}

/// A client that sends a pipeline of event batches, closes its side and never reads a
/// reply: every batch it sent is applied on both executors, in its order (the last
/// batch removes what the first stored). (It half-closes rather than dropping its
/// socket: a socket closed with replies unread resets the connection, and the kernel
/// may then discard what the server had not read yet.)
#[test]
fn a_client_gone_before_its_replies_has_every_batch_applied_everywhere() {
    let clock = Arc::new(ManualClock::default());
    let mut on = both_executors(&clock);
    let ks = Keyspace::tokens("m");
    let w = on[0].events_worker("engine");
    const BATCHES: u64 = 200;
    let chains: Vec<Vec<u64>> = (0..BATCHES)
        .map(|i| chain_of(&ks, i as u32 * 1000, 2))
        .collect();
    for (seq, chain) in chains.iter().enumerate() {
        on[1].send(&stored_batch(w, seq as u64, &ks, chain));
    }
    on[1].send(&EventBatch {
        worker: w,
        seq: BATCHES,
        keyspace: ks.clone(),
        events: vec![Event::Removed {
            lane: 0,
            hashes: chains[0].clone(),
        }],
    });
    let [mut first, gone] = on;
    gone.stream.shutdown(std::net::Shutdown::Write).unwrap();
    // Every batch applied, the removal (sent last) included: one worker's batches apply
    // in their order everywhere, so this holds once the last one is in.
    let all_seen = |c: &mut Conn| {
        c.query(&ks, &chains[0]).scores.is_empty()
            && chains[1..].iter().all(|chain| {
                c.query(&ks, chain).scores
                    == vec![Score {
                        worker: w,
                        blocks: 2,
                    }]
            })
    };
    eventually(
        "every batch is applied on the remaining connection's executor",
        || all_seen(&mut first).then_some(()),
    );
    // A new connection: on the other executor, once the server closed the half-closed
    // one (its replies written) and its place is free again.
    let addr = first.stream.peer_addr().unwrap();
    let mut again = eventually("the closed connection's place is free", || {
        let mut c = Conn::open(addr);
        c.send(&Hello {
            client: "test".into(),
            token_block: 16,
            auth: None,
        });
        c.recv().filter(|r| r.kind == Kind::Welcome).map(|_| c)
    });
    eventually("every batch is applied on the other executor", || {
        all_seen(&mut again).then_some(())
    });
    drop(gone);
}
