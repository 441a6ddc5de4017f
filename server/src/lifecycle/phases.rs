//! The executors' way through start and stop, one primitive for all of it:
//!
//! 1. **restored**: every executor has its copy of the snapshot (or failed to);
//! 2. **wired**: every executor has its mesh end, write queue and inboxes running, so
//!    work sent to any of them is taken;
//! 3. **replayed**: executor 0 has replayed the write-ahead log (and, a replica, caught
//!    up with its log): connections are taken from then on;
//! 4. **drained**: executor 0 has written the last snapshot; the others answer its
//!    export until then.
//!
//! The first two are barriers every executor arrives at, from its own thread, before it
//! serves: an executor that failed arrives too, and the wait ends for all (they stop,
//! its reason is reported). The last two are set by executor 0 and awaited by tasks.

use std::sync::{Condvar, Mutex};

use crate::error::StartError;
use crate::latch::Latch;

/// A barrier of the start, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Barrier {
    Restored = 0,
    Wired = 1,
}

pub struct Phases {
    executors: usize,
    /// Executors arrived at each barrier, and whether any failed.
    arrived: Mutex<([usize; 2], bool)>,
    changed: Condvar,
    replayed: Latch,
    drained: Latch,
}

impl Phases {
    pub fn new(executors: usize) -> Self {
        Phases {
            executors,
            arrived: Mutex::new(([0; 2], false)),
            changed: Condvar::new(),
            replayed: Latch::new(),
            drained: Latch::new(),
        }
    }

    /// Arrives at `barrier` (`ok`: this executor got there whole) and waits, blocking
    /// the thread, until every executor has; `PeerFailed` once any failed.
    pub fn arrive(&self, barrier: Barrier, ok: bool) -> Result<(), StartError> {
        let mut st = self.arrived.lock().unwrap_or_else(|p| p.into_inner());
        st.0[barrier as usize] += 1;
        st.1 |= !ok;
        self.changed.notify_all();
        while st.0[barrier as usize] < self.executors && !st.1 {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.1 {
            return Err(StartError::PeerFailed);
        }
        Ok(())
    }

    /// Executor 0: the log is replayed, connections may be taken.
    pub fn replayed(&self) {
        self.replayed.set();
    }

    pub async fn until_replayed(&self) {
        self.replayed.wait().await;
    }

    /// Executor 0: the last snapshot is written (or failed).
    pub fn drained(&self) {
        self.drained.set();
    }

    pub async fn until_drained(&self) {
        self.drained.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_executor_waits_for_all_and_a_failure_releases_them() {
        let phases = Arc::new(Phases::new(3));
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let p = phases.clone();
                std::thread::spawn(move || p.arrive(Barrier::Restored, true))
            })
            .collect();
        assert!(phases.arrive(Barrier::Restored, true).is_ok());
        for w in waiting {
            assert!(w.join().unwrap().is_ok());
        }
        // At the next barrier one fails: the others stop waiting, told a peer failed.
        let waiting = {
            let p = phases.clone();
            std::thread::spawn(move || p.arrive(Barrier::Wired, true))
        };
        assert!(matches!(
            phases.arrive(Barrier::Wired, false),
            Err(StartError::PeerFailed)
        ));
        assert!(matches!(
            waiting.join().unwrap(),
            Err(StartError::PeerFailed)
        ));
    }
}
