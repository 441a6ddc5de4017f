//! The verdicts' rules, on the state itself (no server).

use std::sync::Arc;

use super::judge::Worker;
use super::window::Window;
use super::*;

#[test]
fn a_report_is_exact_within_one_block_and_below_the_prompt() {
    let cases = [
        // predicted, cached, prompt, outcome
        (Some(160), 160, 200, Outcome::Exact),
        (Some(160), 144, 200, Outcome::Exact),
        (Some(160), 176, 200, Outcome::Exact),
        (Some(160), 100, 200, Outcome::Over),
        (Some(64), 160, 200, Outcome::Under),
        (Some(0), 160, 200, Outcome::Missed),
        (None, 160, 200, Outcome::Missed),
        (None, 0, 200, Outcome::Exact),
        // The whole prompt predicted: the engine recomputes its last block.
        (Some(320), 304, 320, Outcome::Exact),
        (Some(320), 288, 320, Outcome::Exact),
    ];
    for (predicted, cached, prompt, want) in cases {
        assert_eq!(
            classify(predicted, cached, prompt, 16),
            want,
            "{predicted:?} {cached} {prompt}"
        );
    }
}

#[test]
fn a_worker_is_named_at_half_wrong_and_cleared_within_thirteen_right_reports() {
    let kind = WorkerKind {
        event_fed: true,
        history_lost: false,
    };
    let mut st = State::default();
    let key: Arc<str> = "g".into();
    let report = |st: &mut State, o| {
        let w = st.workers.entry(7).or_insert_with(|| Worker {
            window: Window::new(WINDOW),
            cause: None,
            heard_then: 0,
            quiet: 0,
            zeros: 0,
        });
        w.window.push(key.clone(), o);
        st.judge_worker(7, kind);
        st.workers[&7].cause
    };
    for _ in 0..WINDOW - RAISE {
        report(&mut st, Outcome::Exact);
    }
    for i in 0..RAISE - 1 {
        assert_eq!(report(&mut st, Outcome::Missed), None, "{i}");
    }
    assert_eq!(
        report(&mut st, Outcome::Missed),
        Some(SuspectCause::EventsMissing)
    );
    let mut right = 0;
    while report(&mut st, Outcome::Exact).is_some() {
        right += 1;
    }
    assert!(right < WINDOW - CLEAR, "{right}");
    // Hysteresis: a few wrong reports do not raise it again.
    for _ in 0..CLEAR + 1 {
        assert_eq!(report(&mut st, Outcome::Over), None);
    }
    st.set_worker(7, None);
}

/// A feed that under-predicts every gateway's follow-ups alike (placements never
/// learn outputs) names no gateway, even while the workers' windows still hold the
/// exact first turns; one gateway wrong on everything among them is named.
#[test]
fn a_gateway_is_named_only_for_being_wrong_where_the_others_are_right() {
    let kind = |_| {
        Some(WorkerKind {
            event_fed: false,
            history_lost: false,
        })
    };
    let mut st = State::default();
    let report = |worker, cached| Report {
        worker,
        predicted: Some(160),
        cached,
        prompt: 400,
    };
    for g in ["a", "b", "c"] {
        let first: Vec<_> = (0..40).map(|w| report(w, 160)).collect();
        st.take(g, &first, 16, &kind);
    }
    for round in 0..32 {
        for g in ["a", "b", "c"] {
            let cached = if round % 2 == 0 { 160 } else { 320 };
            st.take(g, &[report(round % 40, cached)], 16, &kind);
        }
    }
    assert!(
        st.clients.values().all(|c| !c.window.bad),
        "{:?}",
        st.clients
    );
    for round in 0..32 {
        st.take("d", &[report(round % 40, 0)], 16, &kind);
    }
    let named: Vec<&str> = (st.clients.iter())
        .filter(|(_, c)| c.window.bad)
        .map(|(k, _)| &**k)
        .collect();
    assert_eq!(named, ["d"]);
    let gauge = &METRICS.suspect[cause_index(SuspectCause::GatewayTokenization)];
    gauge.fetch_sub(1, Relaxed);
}
