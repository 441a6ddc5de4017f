//! Feeds arbitrary bytes to the frame reader: it must return frames or a typed error,
//! never panic or read out of bounds. Run: `cd wire/fuzz && cargo fuzz run frame`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvix_wire::codec::validate_stream(data, 1 << 16);
});
