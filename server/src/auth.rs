//! The Hello gate's token check: a constant-time compare, and a per-address slow-down
//! of wrong tokens so guessing costs the guesser time, not the server.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

/// Whether `given` is `token`, in time that depends on the lengths only.
pub fn same_token(given: &[u8], token: &[u8]) -> bool {
    if given.len() != token.len() {
        return false;
    }
    let diff = given
        .iter()
        .zip(token)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Wrong tokens an address may send before its refusals are delayed.
const FREE_FAILURES: u32 = 3;
/// Added delay per failure past the free ones, up to [`MAX_DELAY`].
const STEP: Duration = Duration::from_millis(20);
const MAX_DELAY: Duration = Duration::from_secs(1);
/// An address that sent no wrong token for this long starts again from zero.
const FORGET_AFTER_MS: u64 = 60_000;
/// Addresses remembered at once (an executor's table is cleared when it fills).
const MAX_ADDRESSES: usize = 4096;

/// Wrong-token Hellos per source address, on one executor.
#[derive(Default)]
pub struct Throttle {
    failures: HashMap<IpAddr, (u32, u64)>,
}

impl Throttle {
    /// Records a wrong token from `peer` at `now_ms`; how long to hold its refusal.
    pub fn failed(&mut self, peer: Option<IpAddr>, now_ms: u64) -> Duration {
        let Some(peer) = peer else {
            return Duration::ZERO;
        };
        if self.failures.len() >= MAX_ADDRESSES && !self.failures.contains_key(&peer) {
            self.failures.clear();
        }
        let entry = self.failures.entry(peer).or_insert((0, now_ms));
        if now_ms.saturating_sub(entry.1) > FORGET_AFTER_MS {
            entry.0 = 0;
        }
        *entry = (entry.0.saturating_add(1), now_ms);
        STEP.saturating_mul(entry.0.saturating_sub(FREE_FAILURES))
            .min(MAX_DELAY)
    }

    /// A right token from `peer`: its past failures are forgiven.
    pub fn passed(&mut self, peer: Option<IpAddr>) {
        if let Some(peer) = peer {
            self.failures.remove(&peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token(b"secret", b"secret"));
        assert!(!same_token(b"secreT", b"secret"));
        assert!(!same_token(b"secret!", b"secret"));
        assert!(!same_token(b"", b"secret"));
    }

    #[test]
    fn refusals_slow_down_per_address_and_are_forgotten() {
        let mut t = Throttle::default();
        let (a, b) = (
            Some("10.0.0.1".parse().unwrap()),
            Some("10.0.0.2".parse().unwrap()),
        );
        let delays: Vec<u64> = (0..6).map(|_| t.failed(a, 0).as_millis() as u64).collect();
        assert_eq!(delays, [0, 0, 0, 20, 40, 60]);
        assert_eq!(
            t.failed(b, 0),
            Duration::ZERO,
            "another address is not slowed"
        );
        for _ in 0..100 {
            t.failed(a, 0);
        }
        assert_eq!(t.failed(a, 0), MAX_DELAY);
        assert_eq!(
            t.failed(a, FORGET_AFTER_MS + 1),
            Duration::ZERO,
            "forgotten"
        );
        t.failed(a, FORGET_AFTER_MS + 1);
        t.failed(a, FORGET_AFTER_MS + 1);
        t.passed(a);
        assert_eq!(t.failed(a, FORGET_AFTER_MS + 1), Duration::ZERO, "forgiven");
        assert_eq!(t.failed(None, 0), Duration::ZERO, "Unix socket peers");
    }
}
