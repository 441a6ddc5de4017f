//! Applying an update: published to every other executor's write queue and applied
//! here, in slices of [`SLICE_BLOCKS`] blocks between which queries run and the executor
//! turns to its reactor often enough ([`slice_done`]).

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kvix_engine::{Cursor, Update};

use super::job::{Acks, Countdown, Queued};
use crate::executor::Executor;
use crate::metrics::ExecutorMetrics;

/// Blocks applied between two yields to the query task queue (about 50 µs of work).
pub const SLICE_BLOCKS: u64 = 512;

/// Hands `update` to every other executor's write queue and applies it here; what it
/// returns resolves once every other executor applied it (None: nothing to wait for).
/// The peers count down one shared tally, the last one answers: one reply per update,
/// not one per peer (this is the hot path of every write).
pub(super) async fn publish(ex: &Rc<Executor>, update: Update) -> Option<Acks> {
    if update.is_empty() {
        return None;
    }
    let update = Arc::new(update);
    let peers = ex.executors() - 1;
    let acked = (peers > 0).then(|| {
        let (tally, acks) = Countdown::new(peers);
        for peer in (0..ex.executors()).filter(|&p| p != ex.me()) {
            let (update, tally) = (update.clone(), tally.clone());
            ex.mesh()
                .spawn_on(peer, move |on| on.enqueue(Queued::Apply { update, tally }));
        }
        acks
    });
    apply_here(ex, &update).await;
    // A peer gone drops the tally unanswered: the process is stopping, nothing to wait for.
    acked
}

/// Applies `update` to this executor's copy in slices, yielding to queries between them.
pub(super) async fn apply_here(ex: &Executor, update: &Update) {
    let mut cursor = Cursor::default();
    loop {
        if let Err(e) = ex.core().apply_some(update, &mut cursor, SLICE_BLOCKS) {
            tracing::error!("the index refused a block operation (a bug): {e}");
        }
        if cursor.is_finished() {
            break;
        }
        slice_done(ex).await;
    }
    ex.refresh_gauges();
}

thread_local! {
    /// This executor's slices since its last turn to the reactor, and when that was.
    static SINCE_TURN: Cell<(u32, Option<Instant>)> = const { Cell::new((0, None)) };
    /// Its write slices when it took its last two turns (the older first).
    static TURNS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Ends one slice of a long write: counted, and queries get their turn. The write
/// queue yields to the query queue, so queries already read run now. A query's bytes
/// are read only when the executor turns to its reactor (polls for I/O), which glommio
/// does when no task is runnable or its preemption timer (100 ms) fires: so after
/// [`TURN_EVERY`] of write work, or [`SLICES_PER_TURN`] slices, the write waits on a
/// timer, which leaves nothing of it runnable until the reactor has been polled.
pub(super) async fn slice_done(ex: &Executor) {
    let m = ex.metrics();
    ExecutorMetrics::add(&m.write_slices, 1);
    let (since, last) = SINCE_TURN.get();
    let now = Instant::now();
    let due = since + 1 >= SLICES_PER_TURN || last.is_none_or(|t| now - t >= TURN_EVERY);
    if !due {
        SINCE_TURN.set((since + 1, last));
        glommio::executor().yield_task_queue_now().await;
        return;
    }
    ExecutorMetrics::add(&m.write_turns, 1);
    let slices = m.write_slices.load(std::sync::atomic::Ordering::Relaxed);
    TURNS.set((TURNS.get().1, slices));
    glommio::timer::sleep(std::time::Duration::from_micros(1)).await;
    SINCE_TURN.set((0, Some(Instant::now())));
}

/// This executor's write slices at its turn to the reactor before the latest one: a
/// query read now arrived after that turn, so the slices run since bound what it
/// waited behind (conn.rs observes them in `kvix_query_write_slices`).
pub fn slices_at_turn_before_last() -> u64 {
    TURNS.get().0
}

/// Write work between two turns to the reactor. A turn costs a kernel timer (29 µs on
/// the 2-vCPU VM, more than a 512-block slice's work), so one after every slice more than
/// halved the write rate there; one a millisecond costs ~3 %. Shortening glommio's own
/// preemption period instead (500 µs) lost wakeups in glommio 0.9 here: servers hung at
/// start and under descriptor exhaustion (server/tests/attacks.rs).
pub const TURN_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// Slices after which a long write turns to the reactor whatever the time (a count the
/// tests can bound: a query waits behind at most two turns' worth).
pub const SLICES_PER_TURN: u32 = 128;
