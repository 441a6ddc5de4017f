//! `kvix._kvix.Core`: one kvix-client `Client`; every call either blocks the calling
//! thread (GIL released) or, given the event loop's `Completer`, returns a future of
//! that loop.

use std::future::Future;
use std::mem::ManuallyDrop;
use std::task::{Context, Waker};
use std::time::Duration;

use kvix_client::wire::{Announce, Stats as WireStats};
use kvix_client::{Client, QueryOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::IntoPyObjectExt;

use kvix_client::ClientError;

use crate::args::{self, EventSource, PromptKind};
use crate::completer::Completer;
use crate::errors::to_py;
use crate::results::{QueryResult, Stats};
use crate::runtime;

#[pyclass(frozen, module = "kvix._kvix")]
pub struct Core {
    /// Dropped only in the process that made it ([`Drop for Core`]).
    client: ManuallyDrop<Client>,
    /// The fork generation and process it was made in.
    generation: u64,
    pid: u32,
}

impl Drop for Core {
    fn drop(&mut self) {
        // In a fork's child the client's sockets are the parent's and registered in the
        // epoll instance both share: dropping them would deregister the parent's.
        if self.generation == crate::generation() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.client) };
        }
    }
}

/// How often a blocking call that may wait long (control calls, connecting) looks for
/// a signal, so that Ctrl-C interrupts it (queries end by their deadline).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Runs `fut` to its end: on this thread with the GIL released (`done` None), or on
/// the I/O thread, answering a future of `done`'s event loop.
fn finish<T, F>(py: Python<'_>, done: Option<&Bound<'_, Completer>>, fut: F) -> PyResult<Py<PyAny>>
where
    F: Future<Output = Result<T, ClientError>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    finish_as(py, done, fut, false)
}

/// [`finish`] for a call that may wait up to the request timeout: a blocking one
/// returns to Python every [`SIGNAL_CHECK`] to run signal handlers (KeyboardInterrupt
/// ends the wait; the request is abandoned as a timed-out one would be).
fn finish_control<T, F>(
    py: Python<'_>,
    done: Option<&Bound<'_, Completer>>,
    fut: F,
) -> PyResult<Py<PyAny>>
where
    F: Future<Output = Result<T, ClientError>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    finish_as(py, done, fut, true)
}

fn finish_as<T, F>(
    py: Python<'_>,
    done: Option<&Bound<'_, Completer>>,
    fut: F,
    interruptible: bool,
) -> PyResult<Py<PyAny>>
where
    F: Future<Output = Result<T, ClientError>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    let rt = runtime()?;
    match done {
        None if interruptible => {
            let mut fut = Box::pin(fut);
            loop {
                // The timer is made inside block_on: it needs the runtime's context.
                let step = py.detach(|| {
                    rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, fut.as_mut()).await })
                });
                match step {
                    Ok(Ok(v)) => return v.into_py_any(py),
                    Ok(Err(e)) => return Err(to_py(py, e)),
                    Err(_) => py.check_signals()?,
                }
            }
        }
        None => match py.detach(|| rt.block_on(fut)) {
            Ok(v) => v.into_py_any(py),
            Err(e) => Err(to_py(py, e)),
        },
        Some(done) => {
            let done = done.get();
            let (future, queue) = done.future(py)?;
            let handle = future.clone_ref(py);
            let mut task = Box::pin(async move {
                let r = fut.await;
                queue.push(
                    handle,
                    Box::new(move |py| match r {
                        Ok(v) => v.into_py_any(py),
                        Err(e) => Err(to_py(py, e)),
                    }),
                );
            });
            // The first poll here sends the request from this thread at once (as the
            // blocking call does); only the wait for the reply goes to the I/O thread.
            // Without the GIL: with `spin_us` the first poll may spin on the reply.
            py.detach(|| {
                let _rt = rt.enter();
                let mut cx = Context::from_waker(Waker::noop());
                if task.as_mut().poll(&mut cx).is_pending() {
                    rt.spawn(task);
                }
            });
            done.drain_ready(py);
            Ok(future)
        }
    }
}

fn ms_opt(what: &str, v: Option<f64>) -> PyResult<Option<Duration>> {
    v.map(|v| args::ms(what, v)).transpose()
}

#[pymethods]
impl Core {
    /// Connects (see `kvix.Client`); returns a Core, or (given `done`) a future of one.
    #[staticmethod]
    #[pyo3(signature = (servers, options, done))]
    fn open(
        py: Python<'_>,
        servers: Vec<String>,
        options: Option<&Bound<'_, PyDict>>,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let cfg = args::config(py, servers, options)?;
        let generation = crate::generation();
        finish_control(py, done, async move {
            let client = ManuallyDrop::new(Client::connect(cfg).await?);
            let pid = std::process::id();
            Ok(Core {
                client,
                generation,
                pid,
            })
        })
    }

    /// Asks which workers can reuse how much of the prompt. `kind`: 0 token ids, 1 text
    /// (str / bytes), 2 a chain of block hashes.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (keyspace, kind, prompt, deadline_ms, candidates, top_k, done))]
    fn query(
        &self,
        py: Python<'_>,
        keyspace: &Bound<'_, PyAny>,
        kind: u8,
        prompt: &Bound<'_, PyAny>,
        deadline_ms: Option<f64>,
        candidates: Option<&Bound<'_, PyAny>>,
        top_k: i64,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let ks = args::keyspace(keyspace)?;
        let prompt = args::prompt(prompt_kind(kind)?, prompt)?;
        let opts = QueryOptions {
            candidates: args::workers(candidates)?,
            top_k: args::top_k(top_k)?,
            deadline: ms_opt("deadline_ms", deadline_ms)?,
            weights: None,
        };
        let client = self.client()?.clone();
        finish(py, done, async move {
            let outcome = client.query(&ks, prompt.as_client(), &opts).await;
            Ok::<_, ClientError>(QueryResult::from(outcome))
        })
    }

    /// Announces a worker (remembered and re-announced on every reconnect); returns the
    /// primary server's id for it.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, lanes, feed, capacity_blocks, ttl_ms, source, done))]
    fn announce(
        &self,
        py: Python<'_>,
        name: String,
        lanes: Option<Vec<String>>,
        feed: &str,
        capacity_blocks: u64,
        ttl_ms: u64,
        source: Option<&Bound<'_, EventSource>>,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let msg = Announce {
            name,
            lanes: args::lanes(lanes, self.client()?.config().token_block)?,
            feed: args::feed(feed, capacity_blocks, ttl_ms)?,
            source: source.map(|s| s.get().into()),
        };
        let client = self.client()?.clone();
        finish_control(py, done, async move { client.announce_worker(msg).await })
    }

    /// For benchmarks: `n` token queries through the Rust client alone, one after the
    /// other, each timed in Rust (nanoseconds): blocking this thread the way the
    /// blocking Python call does, or (given `done`) as a task on the I/O runtime the
    /// way a Rust async gateway would. The baseline the Python calls are compared with.
    #[pyo3(signature = (keyspace, token_ids, n, done))]
    fn rust_baseline(
        &self,
        py: Python<'_>,
        keyspace: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        n: usize,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let ks = args::keyspace(keyspace)?;
        let args::Prompt::Tokens(tokens) = args::prompt(PromptKind::Tokens, token_ids)? else {
            unreachable!("a token prompt")
        };
        let client = self.client()?.clone();
        let opts = QueryOptions::default();
        if done.is_none() {
            let rt = runtime()?;
            let times = py.detach(|| {
                (0..n)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        let _ = rt.block_on(client.query_tokens(&ks, &tokens, &opts));
                        t.elapsed().as_nanos() as u64
                    })
                    .collect::<Vec<u64>>()
            });
            return times.into_py_any(py);
        }
        finish(py, done, async move {
            let mut times = Vec::with_capacity(n);
            for _ in 0..n {
                let t = std::time::Instant::now();
                let _ = client.query_tokens(&ks, &tokens, &opts).await;
                times.push(t.elapsed().as_nanos() as u64);
            }
            Ok::<_, ClientError>(times)
        })
    }

    /// Retires a worker (by name or id) on every server and stops re-announcing it.
    fn retire(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let worker = args::worker(worker)?;
        let client = self.client()?.clone();
        finish_control(py, done, async move { client.retire(worker).await })
    }

    /// The primary server's counters.
    fn stats(&self, py: Python<'_>, done: Option<&Bound<'_, Completer>>) -> PyResult<Py<PyAny>> {
        let client = self.client()?.clone();
        finish_control(
            py,
            done,
            async move { client.stats().await.map(Stats::from) },
        )
    }

    /// Waits until some server is up, at most `timeout_ms`; whether one is.
    fn wait_connected(
        &self,
        py: Python<'_>,
        timeout_ms: f64,
        done: Option<&Bound<'_, Completer>>,
    ) -> PyResult<Py<PyAny>> {
        let timeout = args::ms("timeout_ms", timeout_ms)?;
        let client = self.client()?.clone();
        finish_control(py, done, async move {
            Ok::<_, ClientError>(client.wait_connected(timeout).await)
        })
    }

    /// Queues a placement (the request for this prompt went to `worker`); never blocks.
    /// False when it was dropped: the queue was full, or the name is not announced.
    fn publish_placement(
        &self,
        worker: &Bound<'_, PyAny>,
        keyspace: &Bound<'_, PyAny>,
        kind: u8,
        prompt: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let worker = args::worker(worker)?;
        let ks = args::keyspace(keyspace)?;
        let (ks, chain) = self.chain_of(ks, prompt_kind(kind)?, prompt)?;
        Ok(self.client()?.publish_placement(worker, &ks, chain))
    }

    /// Queues a reuse report (what the engine said it reused for a request routed to
    /// `worker`); never blocks. False when nothing was queued: no `cached_tokens`, or
    /// the queue was full.
    fn report_reuse(
        &self,
        worker: &Bound<'_, PyAny>,
        model: String,
        predicted_tokens: Option<u32>,
        cached_tokens: Option<u32>,
        prompt_tokens: u32,
    ) -> PyResult<bool> {
        let worker = args::worker(worker)?;
        Ok(self.client()?.report_reuse(kvix_client::ReuseSample {
            worker,
            model,
            predicted_tokens,
            cached_tokens,
            prompt_tokens,
        }))
    }

    /// The prompt's chain of block hashes, as the server would index it.
    fn chain(
        &self,
        keyspace: &Bound<'_, PyAny>,
        kind: u8,
        prompt: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        let ks = args::keyspace(keyspace)?;
        Ok(self.chain_of(ks, prompt_kind(kind)?, prompt)?.1)
    }

    fn is_connected(&self) -> PyResult<bool> {
        Ok(self.client()?.is_connected())
    }

    fn primary(&self) -> PyResult<Option<String>> {
        Ok(self.client()?.primary().map(|a| a.to_string()))
    }

    fn worker_id(&self, name: &str) -> PyResult<Option<u32>> {
        Ok(self.client()?.worker_id(name))
    }

    /// The client's counters: outcomes, placements, connections, hedges, latency.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.client()?.counters();
        let d = PyDict::new(py);
        for (k, v) in [
            ("queries", c.queries()),
            ("scores", c.scores),
            ("empty", c.empty),
            ("timeouts", c.timeouts),
            ("disconnected", c.disconnected),
            ("rejected", c.rejected),
            ("failed_open", c.failed_open()),
            ("unscorable", c.unscorable),
            ("placements_sent", c.placements_sent),
            ("placement_drops", c.placement_drops),
            ("placements_unsent", c.placements_unsent),
            ("placements_retried", c.placements_retried),
            ("unknown_workers", c.unknown_workers),
            ("connects", c.connects),
            ("reconnects", c.reconnects),
            ("connection_losses", c.connection_losses),
            ("connect_failures", c.connect_failures),
            ("handshake_refusals", c.handshake_refusals),
            ("malformed_replies", c.malformed_replies),
            ("late_replies", c.late_replies),
            ("hedges", c.hedges),
            ("hedges_won", c.hedges_won),
            ("failovers", c.failovers),
            ("stale_answers", c.stale_answers),
            ("reuse_reports_sent", c.reuse_reports_sent),
            ("reuse_unreported", c.reuse_unreported),
            ("reuse_drops", c.reuse_drops),
            ("reuse_unsent", c.reuse_unsent),
            ("writes_refused", c.writes_refused_total()),
        ] {
            d.set_item(k, v)?;
        }
        // Fire-and-forget writes refused, by error code: `writes_refused.LogUnavailable`...
        for (code, n) in &c.writes_refused {
            d.set_item(format!("writes_refused.{code:?}"), n)?;
        }
        for (k, q) in [
            ("latency_p50_us", 0.5),
            ("latency_p99_us", 0.99),
            ("latency_max_us", 1.0),
        ] {
            d.set_item(k, c.latency_quantile(q).as_secs_f64() * 1e6)?;
        }
        Ok(d)
    }
}

impl Core {
    /// The client, in the process that made it; a clear error in a fork's child.
    fn client(&self) -> PyResult<&Client> {
        if self.generation == crate::generation() {
            return Ok(&self.client);
        }
        Err(crate::errors::KvixError::new_err(format!(
            "this kvix client was made in process {} before it forked: its connections \
             and I/O thread stayed there; make a new client in this process ({})",
            self.pid,
            std::process::id()
        )))
    }

    fn chain_of(
        &self,
        ks: kvix_client::wire::Keyspace,
        kind: PromptKind,
        prompt: &Bound<'_, PyAny>,
    ) -> PyResult<(kvix_client::wire::Keyspace, Vec<u64>)> {
        let prompt = args::prompt(kind, prompt)?;
        Ok(self.client()?.prompt_chain(&ks, prompt.as_client()))
    }
}

fn prompt_kind(kind: u8) -> PyResult<PromptKind> {
    match kind {
        0 => Ok(PromptKind::Tokens),
        1 => Ok(PromptKind::Bytes),
        2 => Ok(PromptKind::Chain),
        k => Err(crate::errors::bad_arg(format!(
            "prompt kind {k} (0 tokens, 1 text, 2 chain)"
        ))),
    }
}

impl From<WireStats> for Stats {
    fn from(s: WireStats) -> Self {
        Stats {
            workers: s.workers,
            blocks: s.blocks,
            memberships: s.memberships,
            queries: s.queries,
            events: s.events,
            shard_load: s.shard_load,
        }
    }
}
