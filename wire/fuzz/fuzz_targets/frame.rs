//! Feeds arbitrary bytes to the frame reader: it must return frames or a typed error,
//! never panic or read out of bounds. Run (nightly toolchain, `cargo install cargo-fuzz`):
//!
//!     cd wire/fuzz && cargo +nightly fuzz run frame corpus/frame seeds/frame
//!
//! `seeds/frame` holds one frame of every kind (kept current by wire/tests/fuzz_seeds.rs);
//! new inputs go to `corpus/frame` (not committed).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvix_wire::codec::validate_stream(data, 1 << 16);
});
