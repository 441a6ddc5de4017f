//! The server's clock: milliseconds since the process started, read through [`Clock`] so
//! that a test can move time by hand ([`ManualClock`]) and see placements expire, or
//! not, without waiting on the wall clock.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

pub trait Clock: Send + Sync {
    /// Milliseconds since the clock's start.
    fn now_ms(&self) -> u64;
}

/// The wall clock, from the moment it was made.
pub struct SystemClock(Instant);

impl SystemClock {
    pub fn new() -> Self {
        SystemClock(Instant::now())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// Time that moves only when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Relaxed)
    }
}
