//! Placement expiry with time moved by hand: the server runs in this process
//! (`kvix_server::run_with`) on a `ManualClock`, so a placement's TTL is measured on a
//! clock only the test moves, whatever the machine's load.

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
