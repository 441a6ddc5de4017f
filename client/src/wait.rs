//! Waiting for one reply until a deadline: spin, park on a timer, yield the last stretch.

use std::time::{Duration, Instant};

use tokio::runtime::RuntimeFlavor;
use tokio::sync::oneshot;

use crate::conn::Reply;

/// tokio's timers tick in whole milliseconds and round up: the client parks until this
/// long before a deadline and checks the last stretch by yielding, so a query never
/// returns later than its deadline because of timer rounding.
pub(crate) const TIMER_SLACK: Duration = Duration::from_millis(1);

/// What `until` is to a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// A deadline the caller promises: the last [`TIMER_SLACK`] is checked by yielding,
    /// so the wait ends at `until`, not at the timer tick after it.
    Kept,
    /// A point that only has to be reached (when to hedge): parked on the timer to the
    /// end, up to a tick late. Yielding there would spin for nearly every hedged query,
    /// the hedge point being nearer than a tick, and take the runtime's threads from
    /// the replies on a loaded gateway.
    Reached,
}

pub(crate) enum Waited {
    Reply(Reply),
    Closed,
    TimedOut,
}

/// Waits for a reply until `until`: first spinning on it for up to `spin`, then parked
/// on a timer, and (`Until::Kept`) the last [`TIMER_SLACK`] by yielding.
///
/// The spin is a busy loop where another thread can deliver the reply meanwhile: outside
/// any task (the blocking client's caller thread) or on a multi-thread runtime with more
/// than one worker. Where the reader may need this very thread (a current-thread
/// runtime, or a single worker), it spins by yielding to the runtime instead.
pub(crate) async fn wait_reply(
    rx: &mut oneshot::Receiver<Reply>,
    until: Instant,
    kind: Until,
    spin: Option<Duration>,
) -> Waited {
    use oneshot::error::TryRecvError;
    let poll = |rx: &mut oneshot::Receiver<Reply>| match rx.try_recv() {
        Ok(r) => Some(Waited::Reply(r)),
        Err(TryRecvError::Closed) => Some(Waited::Closed),
        Err(TryRecvError::Empty) => None,
    };
    let busy_ok = match tokio::runtime::Handle::try_current() {
        Err(_) => true,
        Ok(h) => {
            tokio::task::try_id().is_none()
                || (h.runtime_flavor() == RuntimeFlavor::MultiThread
                    && h.metrics().num_workers() > 1)
        }
    };
    if let Some(spin) = spin {
        let spin_end = (Instant::now() + spin).min(until);
        loop {
            if let Some(w) = poll(rx) {
                return w;
            }
            if Instant::now() >= spin_end {
                break;
            }
            if busy_ok {
                std::hint::spin_loop();
            } else {
                tokio::task::yield_now().await;
            }
        }
    }
    if kind == Until::Reached {
        return match tokio::time::timeout_at(until.into(), &mut *rx).await {
            Ok(Ok(r)) => Waited::Reply(r),
            Ok(Err(_)) => Waited::Closed,
            Err(_) => Waited::TimedOut,
        };
    }
    if let Some(park_until) = until.checked_sub(TIMER_SLACK) {
        if Instant::now() < park_until {
            match tokio::time::timeout_at(park_until.into(), &mut *rx).await {
                Ok(Ok(r)) => return Waited::Reply(r),
                Ok(Err(_)) => return Waited::Closed,
                Err(_) => {}
            }
        }
    }
    loop {
        if let Some(w) = poll(rx) {
            return w;
        }
        if Instant::now() >= until {
            return Waited::TimedOut;
        }
        tokio::task::yield_now().await;
    }
}

/// Waits for the first of two replies until `until`; a connection that closes leaves
/// the other one to wait for. Returns which one answered (0 or 1) and how.
pub(crate) async fn wait_either(
    a: &mut oneshot::Receiver<Reply>,
    b: &mut oneshot::Receiver<Reply>,
    until: Instant,
) -> (usize, Waited) {
    let (mut a_open, mut b_open) = (true, true);
    let park_until = until.checked_sub(TIMER_SLACK).unwrap_or(until);
    while (a_open || b_open) && Instant::now() < park_until {
        let timer = tokio::time::sleep_until(park_until.into());
        tokio::select! {
            r = &mut *a, if a_open => match r {
                Ok(r) => return (0, Waited::Reply(r)),
                Err(_) => a_open = false,
            },
            r = &mut *b, if b_open => match r {
                Ok(r) => return (1, Waited::Reply(r)),
                Err(_) => b_open = false,
            },
            _ = timer => break,
        }
    }
    loop {
        if a_open {
            match a.try_recv() {
                Ok(r) => return (0, Waited::Reply(r)),
                Err(oneshot::error::TryRecvError::Closed) => a_open = false,
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
        }
        if b_open {
            match b.try_recv() {
                Ok(r) => return (1, Waited::Reply(r)),
                Err(oneshot::error::TryRecvError::Closed) => b_open = false,
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
        }
        if !a_open && !b_open {
            return (0, Waited::Closed);
        }
        if Instant::now() >= until {
            return (0, Waited::TimedOut);
        }
        tokio::task::yield_now().await;
    }
}
