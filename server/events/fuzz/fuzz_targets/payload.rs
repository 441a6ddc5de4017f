//! Feeds arbitrary bytes to the engine-event decoding, as an engine (or anyone who can
//! reach `--events-bind`) sends them: both readers of a payload must return a batch or a
//! typed error, never panic, and agree wherever the tree-less one answers; a batch that
//! decodes is then translated as the ingest would (hybrid lanes included), which must not
//! panic either. Run (nightly toolchain, `cargo install cargo-fuzz`):
//!
//!     cd server/events/fuzz && cargo +nightly fuzz run payload corpus/payload seeds/payload
//!
//! `seeds/payload` holds vLLM's encodings of typical batches (kept current by
//! server/events/tests/fuzz_seeds.rs); new inputs go to `corpus/payload` (not committed).
#![no_main]

use kvix_events::payload::both_readers;
use kvix_events::translate::{Counts, Translator};
use kvix_wire::{Lane, LaneKind};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (fast, general) = both_readers(data);
    if let Some(fast) = &fast {
        assert_eq!(Some(fast), general.as_ref().ok(), "the two readers disagree");
    }
    let Ok(batch) = general else {
        return;
    };
    let lanes = [
        Lane::full(16),
        Lane {
            kind: LaneKind::SlidingWindow { window: 64 },
            block_tokens: 16,
        },
    ];
    for lanes in [&lanes[..1], &lanes[..]] {
        let mut tr = Translator::new(16, "model", "", lanes);
        let (mut groups, mut counts) = (Vec::new(), Counts::default());
        tr.apply(&batch, &mut groups, &mut counts);
        // Twice: the second continues the first's parents.
        groups.clear();
        tr.apply(&batch, &mut groups, &mut counts);
    }
});
