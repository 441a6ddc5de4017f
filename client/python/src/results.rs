//! What a query answers, as Python objects.

use kvix_client::{QueryOutcome, WorkerScore};
use pyo3::prelude::*;

/// One worker's reusable prefix, by tier.
#[pyclass(frozen, get_all, module = "kvix", eq)]
#[derive(Clone, PartialEq)]
pub struct Score {
    /// The worker's name (None when this client does not know it).
    pub worker: Option<String>,
    /// The worker's id on the server that answered.
    pub worker_id: u32,
    /// Reusable prefix loading from any tier, in keyspace blocks (= `storage`).
    pub blocks: u32,
    /// The prefix from GPU alone, then continuing from CPU, then from storage: blocks,
    /// cumulative (gpu <= cpu <= storage).
    pub gpu: u32,
    pub cpu: u32,
    pub storage: u32,
    /// The tiers weighed by the client's `tier_weights`, in GPU blocks: what `pick` weighs.
    pub reuse: f64,
    /// The worker's history is lost: its engine may hold more than `blocks` until it
    /// clears its cache or restarts.
    pub history_lost: bool,
    /// Why the server doubts this score (None: it does not), e.g. "EventsMissing".
    pub suspect: Option<String>,
}

#[pymethods]
impl Score {
    fn __repr__(&self) -> String {
        let worker = match &self.worker {
            Some(w) => format!("{w:?}"),
            None => "None".to_string(),
        };
        let lost = match self.history_lost {
            true => ", history_lost=True",
            false => "",
        };
        let tiers = match (self.gpu, self.cpu) == (self.blocks, self.blocks) {
            true => String::new(),
            false => format!(
                ", gpu={}, cpu={}, storage={}",
                self.gpu, self.cpu, self.storage
            ),
        };
        format!(
            "Score(worker={worker}, worker_id={}, blocks={}{tiers}{lost})",
            self.worker_id, self.blocks
        )
    }
}

/// What a query came to. Only `outcome == "scores"` carries scores; "empty" means the
/// server knows no worker holding any of the prompt; "timeout" and "disconnected" mean
/// the query failed open (`failed_open`); "rejected" means the server refused the query
/// (`error` says why: a bug to fix, not a fault to ride out). In all but "scores", route
/// without the index (`kvix.pick` then picks by load alone).
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
        gpu: s.tiers.gpu,
        cpu: s.tiers.cpu,
        storage: s.tiers.storage,
        reuse: s.reuse,
        history_lost: s.history_lost,
        suspect: s.suspect.map(|c| format!("{c:?}")),
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

/// A worker chosen by `kvix.pick`: its name and the blocks of the prompt it can reuse.
#[pyclass(frozen, get_all, module = "kvix", eq)]
#[derive(Clone, PartialEq)]
pub struct Pick {
    pub worker: String,
    /// The expected hit in keyspace blocks, from any tier (0: none of the workers
    /// holds any of it).
    pub blocks: u32,
    /// The expected hit weighed by tier, in GPU blocks (what the pick weighed).
    pub reuse: f64,
}

#[pymethods]
impl Pick {
    fn __repr__(&self) -> String {
        format!(
            "Pick(worker={:?}, blocks={}, reuse={})",
            self.worker, self.blocks, self.reuse
        )
    }
}

impl QueryResult {
    /// The outcome as kvix-client's pick reads it: the scores with their names.
    pub fn as_outcome(&self) -> QueryOutcome {
        if self.scores.is_empty() {
            return QueryOutcome::Empty;
        }
        QueryOutcome::Scores(
            self.scores
                .iter()
                .map(|s| WorkerScore {
                    worker: s.worker_id,
                    name: s.worker.as_deref().map(Into::into),
                    blocks: s.blocks,
                    tiers: kvix_client::Depths {
                        gpu: s.gpu,
                        cpu: s.cpu,
                        storage: s.storage,
                    },
                    reuse: s.reuse,
                    history_lost: s.history_lost,
                    suspect: None,
                })
                .collect(),
        )
    }
}

/// Picks the worker for a request among `loads` (name -> load: a dict, or (name, load)
/// pairs) given a query's result: the most reusable prefix less `alpha` blocks per unit
/// of load (kvix-client's `pick`: with load in KV blocks and alpha 1, Dynamo's default
/// cost); equal workers are taken in a different order on every call. Raises ValueError
/// when `loads` is empty.
#[pyfunction]
#[pyo3(signature = (result, loads, alpha = kvix_client::DEFAULT_ALPHA))]
pub fn pick(result: &QueryResult, loads: &Bound<'_, PyAny>, alpha: f64) -> PyResult<Pick> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let workers: Vec<(String, f64)> = match loads.cast::<pyo3::types::PyDict>() {
        Ok(d) => d
            .iter()
            .map(|(k, v)| Ok((k.extract()?, v.extract()?)))
            .collect::<PyResult<_>>()
            .map_err(|_: PyErr| {
                pyo3::exceptions::PyTypeError::new_err(
                    "loads: worker names (str) -> loads (numbers)",
                )
            })?,
        Err(_) => loads.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "loads: a dict of worker name -> load, or (name, load) pairs",
            )
        })?,
    };
    if !alpha.is_finite() || alpha < 0.0 {
        return Err(crate::errors::bad_arg(format!(
            "alpha: a finite number of blocks per unit of load, 0 or more, not {alpha}"
        )));
    }
    let tie = CALLS.fetch_add(1, Ordering::Relaxed);
    let picked = kvix_client::pick(&result.as_outcome(), &workers, alpha, tie)
        .ok_or_else(|| crate::errors::bad_arg("loads: no workers to pick from"))?;
    let worker = workers[picked.index].0.clone();
    let blocks = result
        .scores
        .iter()
        .find(|s| s.worker.as_deref() == Some(worker.as_str()))
        .map_or(0, |s| s.blocks);
    Ok(Pick {
        worker,
        blocks,
        reuse: picked.reuse,
    })
}
