//! Faults that can come in floods (dropped messages, failed handshakes) are counted
//! each and logged at the 1st, 2nd, 4th, 8th, ...: loud without a line apiece.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

/// Counts one more of what `counter` counts; the count when it is the 1st, 2nd, 4th,
/// 8th, ...: when a WARN line names it.
pub fn count_loudly(counter: &AtomicU64) -> Option<u64> {
    let n = counter.fetch_add(1, Relaxed) + 1;
    n.is_power_of_two().then_some(n)
}
