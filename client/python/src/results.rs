//! What a query answers, as Python objects.

use kvix_client::{QueryOutcome, WorkerScore};
use pyo3::prelude::*;

/// One worker's joint reusable prefix.
#[pyclass(frozen, get_all, module = "kvix", eq)]
#[derive(Clone, PartialEq)]
pub struct Score {
    /// The worker's name (None when this client does not know it).
    pub worker: Option<String>,
    /// The worker's id on the server that answered.
    pub worker_id: u32,
    /// Reusable prefix, in keyspace blocks.
    pub blocks: u32,
}

#[pymethods]
impl Score {
    fn __repr__(&self) -> String {
        match &self.worker {
            Some(w) => format!(
                "Score(worker={w:?}, worker_id={}, blocks={})",
                self.worker_id, self.blocks
            ),
            None => format!(
                "Score(worker=None, worker_id={}, blocks={})",
                self.worker_id, self.blocks
            ),
        }
    }
}

/// What a query came to. Only `outcome == "scores"` carries scores; "empty" means the
/// server knows no worker holding any of the prompt; "timeout", "disconnected" and
/// "rejected" mean: route without the index (fail open).
#[pyclass(frozen, get_all, module = "kvix")]
pub struct QueryResult {
    /// "scores", "empty", "timeout", "disconnected" or "rejected".
    pub outcome: &'static str,
    /// Workers that can reuse part of the prompt, best first.
    pub scores: Vec<Score>,
    /// Why the server refused the query ("rejected" only).
    pub error: Option<String>,
}

#[pymethods]
impl QueryResult {
    /// The best worker, or None.
    #[getter]
    fn best(&self) -> Option<Score> {
        self.scores.first().cloned()
    }

    /// True when the query failed open (timeout or no connection).
    #[getter]
    fn failed_open(&self) -> bool {
        matches!(self.outcome, "timeout" | "disconnected")
    }

    fn __len__(&self) -> usize {
        self.scores.len()
    }

    fn __repr__(&self) -> String {
        let scores: Vec<String> = self.scores.iter().map(Score::__repr__).collect();
        match &self.error {
            Some(e) => format!("QueryResult(outcome={:?}, error={e:?})", self.outcome),
            None => format!(
                "QueryResult(outcome={:?}, scores=[{}])",
                self.outcome,
                scores.join(", ")
            ),
        }
    }
}

fn score(s: WorkerScore) -> Score {
    Score {
        worker: s.name.as_deref().map(str::to_string),
        worker_id: s.worker,
        blocks: s.blocks,
    }
}

impl From<QueryOutcome> for QueryResult {
    fn from(o: QueryOutcome) -> Self {
        let outcome = o.kind();
        let (scores, error) = match o {
            QueryOutcome::Scores(s) => (s.into_iter().map(score).collect(), None),
            QueryOutcome::Rejected(e) => (Vec::new(), Some(format!("{:?}: {}", e.code, e.message))),
            _ => (Vec::new(), None),
        };
        QueryResult {
            outcome,
            scores,
            error,
        }
    }
}

/// The primary server's counters (`Client.stats()`).
#[pyclass(frozen, get_all, module = "kvix")]
pub struct Stats {
    /// Workers announced.
    pub workers: u32,
    /// Distinct blocks held.
    pub blocks: u64,
    /// (block, holder) memberships.
    pub memberships: u64,
    pub queries: u64,
    pub events: u64,
    /// Work done per shard.
    pub shard_load: Vec<u64>,
}

#[pymethods]
impl Stats {
    fn __repr__(&self) -> String {
        format!(
            "Stats(workers={}, blocks={}, memberships={}, queries={}, events={}, shard_load={:?})",
            self.workers, self.blocks, self.memberships, self.queries, self.events, self.shard_load
        )
    }
}
