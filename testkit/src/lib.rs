//! What kvix's tests drive from outside: the engines' real KV-event publishers
//! ([`engines`]: each release's own `kv_events.py`, run by `scripts/engines.py`), the
//! tests' Python environment ([`python`]), loopback ports chosen free ([`free_ports`]),
//! and a plain HTTP/1.1 client ([`http`]). Shared by the server's tests and the peer
//! bench's differential test against Dynamo's indexer, so both drive the same real parts
//! the same way.

pub mod engines;
pub mod http;
pub mod python;

/// The repository's root (scripts live in `scripts/`).
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A loopback port nobody listens on now, outside the kernel's ephemeral port range (the
/// ports it hands out for port 0): a server or publisher killed and started again on it
/// cannot lose it meanwhile to another test's socket bound to port 0.
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `count` consecutive loopback ports nobody listens on now, outside the
/// kernel's ephemeral range. Successive calls walk on from a place that depends on the
/// process id, so that threads and test binaries running at once do not pick the same
/// ones; a walk that finds none panics instead of spinning.
pub fn free_ports(count: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (from, span) = outside_ephemeral();
    let count = u32::from(count.max(1));
    let base = std::process::id().wrapping_mul(7919);
    let free = |p: u32| std::net::TcpListener::bind(("127.0.0.1", p as u16)).is_ok();
    for _ in 0..span {
        let first = base.wrapping_add(NEXT.fetch_add(count, Ordering::Relaxed)) % span;
        if first + count <= span && (0..count).all(|i| free(from + first + i)) {
            return (from + first) as u16;
        }
    }
    panic!(
        "no {count} consecutive free loopback ports in {from}..{}",
        from + span
    );
}

/// The larger of the port ranges below and above the kernel's ephemeral range (from
/// 10000 up, leaving the well-known and registered-low ports alone), as (first, length).
/// A machine whose ephemeral range covers both gets 10000..65536: ports there can then
/// be taken by a port-0 bind, which the tests' retries absorb.
fn outside_ephemeral() -> (u32, u32) {
    const FROM: u32 = 10_000;
    const END: u32 = 65_536;
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let mut bounds = range
        .iter()
        .flat_map(|s| s.split_whitespace())
        .map(|n| n.parse::<u32>().ok());
    let (low, high) = match (bounds.next().flatten(), bounds.next().flatten()) {
        (Some(low), Some(high)) => (low, high),
        _ => (32_768, 60_999),
    };
    let below = (FROM, low.saturating_sub(FROM));
    let above_from = high.max(FROM - 1) + 1;
    let above = (above_from, END.saturating_sub(above_from));
    let best = if below.1 >= above.1 { below } else { above };
    if best.1 >= 1_000 {
        best
    } else {
        (FROM, END - FROM)
    }
}

/// A real part a test needs is missing: the test fails saying how to get it, unless
/// the tester opted out of that part by name (`KVIX_TEST_SKIP=tmpfs,...`), when it
/// returns (the caller skips, and says so).
pub fn missing_part(part: &str, how_to_get_it: &str) {
    let skip = std::env::var("KVIX_TEST_SKIP").unwrap_or_default();
    if skip.split(',').any(|s| s.trim() == part) {
        eprintln!("SKIPPED: KVIX_TEST_SKIP names {part}");
        return;
    }
    panic!("this test needs {part}: {how_to_get_it} (or set KVIX_TEST_SKIP={part} to skip it)");
}
