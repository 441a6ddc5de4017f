//! One executor's counters, for a `StatsRequest`.

use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;

use kvix_wire::Stats;

use crate::executor::Executor;
use crate::mesh::{Call, LocalFuture};

pub struct StatsPart;

impl Call for StatsPart {
    type Reply = Stats;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Stats> {
        let m = on.metrics();
        let queries = m.queries.iter().map(|q| q.load(Relaxed)).sum();
        let core = on.core();
        let stats = Stats {
            workers: core.roster().len(),
            blocks: core.index().blocks(),
            memberships: core.index().memberships(),
            queries,
            events: m.block_events.load(Relaxed),
            shard_load: vec![queries],
        };
        Box::pin(std::future::ready(stats))
    }
}
