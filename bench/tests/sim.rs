//! The routing simulation: deterministic for a seed, and the shared index beats
//! per-gateway guesses with 8 gateways on a small configuration.

use indicatif::ProgressBar;
use kvix_bench::sim::{run, LegResult, Regime, SimConfig};
use kvix_bench::workload::Workload;

fn small(regime: Regime, gateways: u32, seed: u64) -> SimConfig {
    SimConfig {
        workers: 8,
        gateways,
        sessions: 300,
        session_rate: 20.0,
        regime,
        workload: Workload {
            seed,
            system_tokens: 256,
            user_tokens: 256,
            followup_tokens: 32,
            output_tokens: 64,
            capacity_blocks: 1024,
            ..Workload::default()
        },
        ..SimConfig::default()
    }
}

fn leg(cfg: &SimConfig) -> LegResult {
    let mut r = run(cfg, &ProgressBar::hidden()).expect("sim runs");
    r.wall_s = 0.0;
    r
}

#[test]
fn deterministic_for_a_seed() {
    for regime in [Regime::Shared, Regime::Local] {
        let a = leg(&small(regime, 8, 42));
        let b = leg(&small(regime, 8, 42));
        assert_eq!(a, b);
        assert_eq!(a.requests, 600);
        assert_eq!(a.followups, 300);
    }
    // Another seed is another workload.
    let c = leg(&small(Regime::Shared, 8, 43));
    assert_ne!(c, leg(&small(Regime::Shared, 8, 42)));
}

#[test]
fn shared_index_hits_at_least_as_often_as_local_guesses_with_8_gateways() {
    let shared = leg(&small(Regime::Shared, 8, 7));
    let local = leg(&small(Regime::Local, 8, 7));
    assert!(
        shared.followup_hit >= local.followup_hit,
        "shared {shared:?} local {local:?}"
    );
    // Sprayed over 8 gateways, a local guess mostly misses the session's worker.
    assert!(shared.same_worker > local.same_worker);
    assert!(shared.followup_hit > 0.0 && shared.followup_hit <= 1.0);
}

#[test]
fn json_output_of_a_leg_round_trips() {
    let r = leg(&small(Regime::Local, 1, 1));
    let text = serde_json::to_string(&r).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["regime"], "local");
    let back: LegResult = serde_json::from_value(v).unwrap();
    assert_eq!(back, r);
}
