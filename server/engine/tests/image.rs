//! Export → import gives an engine that answers, removes and evicts exactly like the
//! original, and a part exported by one home (its own workers only) restores them too.

use kvix_engine::{Engine, EngineImage, FillIn, Ks};
use kvix_wire::{chain::token_chain, Event, Feed, Keyspace, Lane, LaneKind};

fn engine() -> Engine {
    Engine::new(16).with_fill_in(FillIn {
        capacity_blocks: 100,
        ttl_ms: 1000,
    })
}

fn chain(base: u32, blocks: u32) -> Vec<u64> {
    let tokens: Vec<u32> = (0..blocks * 16).map(|i| base + i).collect();
    token_chain(Keyspace::tokens("m").seed(16), 16, &tokens)
}

/// A mixed state: an event worker with engine hashes, a hybrid worker, a retired
/// worker, a placement worker near its capacity, an event worker whose history is lost
/// with placements filling in.
fn populated() -> (Engine, Ks) {
    let mut e = engine();
    let ks = Ks::of(&Keyspace::tokens("m"), 16);
    let (a, _) = e.announce("a", &[Lane::full(32)], Feed::Events).unwrap();
    let c = chain(0, 12);
    let engine_hashes: Vec<u64> = (0..6).map(|i| 900 + i).collect();
    e.apply(
        a,
        0,
        ks,
        &[Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: c.clone(),
            engine: engine_hashes,
        }],
    )
    .unwrap();
    let hybrid = [
        Lane::full(16),
        Lane {
            kind: LaneKind::Mamba,
            block_tokens: 32,
        },
    ];
    let (h, _) = e.announce("h", &hybrid, Feed::Events).unwrap();
    e.apply(
        h,
        3,
        ks,
        &[Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: c[..8].to_vec(),
            engine: vec![],
        }],
    )
    .unwrap();
    e.apply(
        h,
        4,
        ks,
        &[Event::Stored {
            lane: 1,
            start: 6,
            parent: Some(c[5]),
            chain: c[6..8].to_vec(),
            engine: vec![],
        }],
    )
    .unwrap();
    let (gone, _) = e.announce("gone", &[Lane::full(16)], Feed::Events).unwrap();
    e.retire(gone).unwrap();
    let (p, _) = e
        .announce(
            "p",
            &[Lane::full(16)],
            Feed::Placements {
                capacity_blocks: 10,
                ttl_ms: 1000,
            },
        )
        .unwrap();
    e.place(p, ks, &chain(5000, 6), 100).unwrap();
    e.place(p, ks, &chain(0, 4), 200).unwrap();
    let (f, _) = e.announce("f", &[Lane::full(16)], Feed::Events).unwrap();
    assert!(e.fill_in(f));
    assert!(e.place(f, ks, &chain(7000, 5), 150).unwrap());
    (e, ks)
}

fn answers(e: &mut Engine, ks: Ks) -> Vec<Vec<(u32, u32)>> {
    [chain(0, 12), chain(5000, 6), chain(0, 3), chain(7000, 5)]
        .iter()
        .map(|c| e.query(ks, c, None, 0, false).scores)
        .collect()
}

#[test]
fn images_round_trip() {
    {
        let (mut a, ks) = populated();
        let image: EngineImage = a.export(300);
        let mut b = engine();
        b.import(&image, 300).unwrap();
        b.check_invariants().unwrap();
        assert_eq!(answers(&mut a, ks), answers(&mut b, ks),);
        let (sa, sb) = (a.stats(), b.stats());
        assert_eq!(
            (sa.workers, sa.blocks, sa.memberships),
            (sb.workers, sb.blocks, sb.memberships)
        );
        // The exported image of the import is the same image (up to run layout).
        let again = b.export(300);
        assert_eq!(again.workers, image.workers);
        assert_eq!(again.feeds, image.feeds);

        // Removal by engine hash, sequences, placement recency and TTL all survive.
        for e in [&mut a, &mut b] {
            let id = |n: &str| e.registry().id_of(n).unwrap();
            let (aw, hw, pw) = (id("a"), id("h"), id("p"));
            assert_eq!(id("gone"), 2, "a retired name keeps its id");
            let r = e
                .apply(
                    aw,
                    1,
                    ks,
                    &[Event::Removed {
                        lane: 0,
                        hashes: vec![903],
                    }],
                )
                .unwrap();
            assert_eq!(r.block_events, 2);
            assert_eq!(
                e.apply(hw, 4, ks, &[Event::Cleared]).unwrap().status,
                kvix_wire::ApplyStatus::Duplicate
            );
            e.place(pw, ks, &chain(9000, 5), 400).unwrap();
            e.expire(1250).unwrap();
        }
        assert_eq!(
            answers(&mut a, ks),
            answers(&mut b, ks),
            "after more traffic"
        );
    }
}

#[test]
fn a_snapshot_without_workers_restores_to_an_empty_engine() {
    let mut e = engine();
    e.import(&EngineImage::default(), 0).unwrap();
    assert_eq!(e.stats().blocks, 0);
}

/// A damaged image (or one from a roster since changed) naming a lane its worker does not
/// have: the phantom holder is dropped, not restored where no sweep would ever reach it.
#[test]
fn holders_on_lanes_the_roster_lacks_are_dropped_on_import() {
    let (mut a, ks) = populated();
    let mut image: EngineImage = a.export(300);
    let id = a.registry().id_of("a").unwrap();
    let run = image
        .runs
        .iter_mut()
        .find(|r| r.holders.contains(&(id, 0)))
        .expect("a run of worker a");
    run.holders.push((id, 5));
    let mut b = engine();
    assert_eq!(
        b.import(&image, 300).unwrap(),
        1,
        "the dropped holder is counted"
    );
    b.check_invariants().unwrap();
    assert_eq!(a.stats().memberships, b.stats().memberships);
    assert_eq!(answers(&mut a, ks), answers(&mut b, ks));
}

/// A holder no roster can have (lane 200; at most 16 lanes) is not a roster that
/// changed but a forged or damaged image: the import refuses it, naming the holder,
/// instead of restoring the rest without a word.
#[test]
fn holders_no_roster_can_have_refuse_the_import() {
    let (a, _) = populated();
    let mut image: EngineImage = a.export(300);
    let id = a.registry().id_of("a").unwrap();
    image.runs[0].holders.push((id, 200));
    let err = engine().import(&image, 300).unwrap_err().to_string();
    assert!(err.contains("lane 200"), "{err}");
}
