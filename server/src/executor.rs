//! One executor: its copy of the engine ([`kvix_engine::Core`]: roster, whole index,
//! the feeds of the workers it is home to), the registry of names (on
//! executor 0), its end of the mesh, and its write queue.
//!
//! A query is answered here, from this copy, without leaving the executor. A write is
//! done by the worker's home (`worker % executors`): its write queue turns it into an
//! update, applies it in bounded slices and hands it to every other executor's queue;
//! the reply goes out once every executor applied it (see [`crate::write`]). Work for
//! another executor is a closure run there ([`Executor::on`]), in place when local.

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::oneshot;
use futures::Future;
use glommio::channels::local_channel::LocalSender;
use kvix_engine::{Answer, Ask, Core, Registry};
use kvix_wire::WorkerId;

use crate::config::ExecutorSettings;
use crate::durable::replica::appender::Appender;
use crate::durable::Log;
use crate::failure::Failure;
use crate::ingest::states::{IngestStates, LOST};
use crate::ingest::Ingest;
use crate::mesh::{LocalFuture, QueryScope};
use crate::metrics::{ExecutorMetrics, QueryOutcome};
use crate::query::Asked;
use crate::write::job::{answer, stopping, Queued, Written};
use crate::write::record::Write;

pub type Mesh = crate::mesh::Mesh<Executor>;

/// The process-wide services every executor reaches.
#[derive(Clone)]
pub struct Services {
    /// The engine-event ingest (executor 0 subscribes and retires sources).
    pub ingest: Arc<Ingest>,
    /// Where accepted writes are kept (`--wal`, `--log`, or nothing).
    pub log: Log,
    /// Set once the process is stopping: client writes are refused from then on.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
    /// The placement clock (milliseconds since the process started).
    pub clock: Arc<dyn crate::clock::Clock>,
    /// TLS on the TCP port (`--tls-cert`).
    pub tls: Option<futures_rustls::TlsAcceptor>,
}

pub struct Executor {
    me: usize,
    executors: usize,
    settings: ExecutorSettings,
    metrics: Arc<[ExecutorMetrics]>,
    core: RefCell<Core>,
    /// Names → ids: executor 0's alone (it numbers every worker).
    registry: Option<RefCell<Registry>>,
    mesh: Mesh,
    writes: LocalSender<Queued>,
    /// This executor's appends to the replicated write log (`--log`).
    log_appender: Option<Appender>,
    /// What the executors share with the rest of the process.
    services: Services,
    /// Ingest state of the event-source workers homed here.
    ingest_states: RefCell<IngestStates>,
    answer: RefCell<Answer>,
    candidates: RefCell<Vec<WorkerId>>,
    /// Wrong-token Hellos per source address seen by this executor.
    auth_failures: RefCell<crate::auth::Throttle>,
}

impl Executor {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: ExecutorSettings,
        metrics: Arc<[ExecutorMetrics]>,
        mesh: Mesh,
        core: Core,
        registry: Registry,
        ingest_states: IngestStates,
        services: Services,
        writes: LocalSender<Queued>,
        log_appender: Option<Appender>,
    ) -> Rc<Self> {
        Rc::new(Executor {
            me: mesh.me(),
            executors: mesh.executors(),
            settings,
            metrics,
            core: RefCell::new(core),
            registry: (mesh.me() == 0).then(|| RefCell::new(registry)),
            mesh,
            writes,
            log_appender,
            services,
            ingest_states: RefCell::new(ingest_states),
            answer: RefCell::new(Answer::default()),
            candidates: RefCell::new(Vec::new()),
            auth_failures: RefCell::default(),
        })
    }

    pub fn me(&self) -> usize {
        self.me
    }

    /// Whether this replica knows its copy is behind its log (healing, stopped): its
    /// answers say so, for clients to ask another replica.
    pub fn stale(&self) -> bool {
        self.services
            .log
            .shared()
            .is_some_and(|r| !r.caught_up.load(Relaxed))
    }

    /// Replaces this executor's state (a replica healing in place; `registry` is kept
    /// on executor 0 only).
    pub fn install(&self, core: Core, registry: Registry, ingest_states: IngestStates) {
        *self.core.borrow_mut() = core;
        if let Some(r) = &self.registry {
            *r.borrow_mut() = registry;
        }
        *self.ingest_states.borrow_mut() = ingest_states;
    }

    pub fn executors(&self) -> usize {
        self.executors
    }

    pub fn auth_failures(&self) -> RefMut<'_, crate::auth::Throttle> {
        self.auth_failures.borrow_mut()
    }

    /// Whether the process is stopping (client writes are refused).
    pub fn stopping(&self) -> bool {
        self.services.stopping.load(Relaxed)
    }

    pub fn settings(&self) -> &ExecutorSettings {
        &self.settings
    }

    pub fn metrics(&self) -> &ExecutorMetrics {
        &self.metrics[self.me]
    }

    pub fn all_metrics(&self) -> &Arc<[ExecutorMetrics]> {
        &self.metrics
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The executor keeping `worker`'s feed and ordering its writes.
    pub fn home_of(&self, worker: WorkerId) -> usize {
        worker as usize % self.executors
    }

    /// Milliseconds since the process started (the placement clock of its workers).
    pub fn now_ms(&self) -> u64 {
        self.services.clock.now_ms()
    }

    /// This executor's engine. Never held across an await.
    pub fn core(&self) -> RefMut<'_, Core> {
        self.core.borrow_mut()
    }

    /// The registry of names, on executor 0 (announces, retires and their checks are
    /// routed there: [`crate::write`]).
    pub fn registry(&self) -> RefMut<'_, Registry> {
        self.registry
            .as_ref()
            .expect("only executor 0 numbers workers")
            .borrow_mut()
    }

    pub fn ingest(&self) -> &Arc<Ingest> {
        &self.services.ingest
    }

    /// The TLS handshake TCP connections begin with, if the port speaks TLS.
    pub fn tls(&self) -> Option<&futures_rustls::TlsAcceptor> {
        self.services.tls.as_ref()
    }

    /// Where accepted writes are kept.
    pub fn log(&self) -> &Log {
        &self.services.log
    }

    /// Where this executor's clients' writes go to the replicated log, with `--log`.
    pub fn log_appender(&self) -> Option<&Appender> {
        self.log_appender.as_ref()
    }

    /// Appends an accepted write to the write-ahead log (if there is one) and waits
    /// until it is as durable as `--wal-sync-ms` promises; a log that refuses the write
    /// refuses it to the client.
    pub async fn keep(&self, record: &Write) -> Result<(), Failure> {
        let Some(wal) = self.services.log.wal() else {
            return Ok(());
        };
        match wal.append(record) {
            Ok(None) => Ok(()),
            Ok(Some(on_disk)) => {
                let _ = on_disk.await;
                Ok(())
            }
            Err(e) => {
                ExecutorMetrics::add(&self.metrics().wal_failures, 1);
                tracing::error!("{e}");
                Err(Failure::Wal(Arc::new(e)))
            }
        }
    }

    /// The ingest state of the workers homed here. Never held across an await.
    pub fn ingest_states(&self) -> RefMut<'_, IngestStates> {
        self.ingest_states.borrow_mut()
    }

    /// Runs `f` on executor `to`: in place when that is this one, else over the mesh.
    pub fn on<T: Send + 'static>(
        self: &Rc<Self>,
        to: usize,
        f: impl FnOnce(&Rc<Executor>) -> LocalFuture<Result<T, Failure>> + Send + 'static,
    ) -> LocalFuture<Result<T, Failure>> {
        if to == self.me {
            return f(self);
        }
        let reply = self.mesh.invoke_on(to, f);
        Box::pin(async move { reply.await.unwrap_or_else(|_| Err(stopping())) })
    }

    /// Queues `work` on this executor's write queue; answers with its result once what
    /// it published is applied everywhere.
    pub fn queue<T: 'static, F>(
        self: &Rc<Self>,
        work: impl FnOnce(Rc<Executor>) -> F + 'static,
    ) -> LocalFuture<Result<T, Failure>>
    where
        F: Future<Output = Written<Result<T, Failure>>> + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let write = work(self.clone());
        self.enqueue(Queued::Other(Box::pin(
            async move { answer(tx, write.await) },
        )));
        Box::pin(async move { rx.await.unwrap_or_else(|_| Err(stopping())) })
    }

    /// Queues `write`, of a worker homed here, on this executor's write queue; answers
    /// once it is applied everywhere.
    pub fn queue_home(
        &self,
        write: Write,
    ) -> LocalFuture<Result<crate::write::record::Outcome, Failure>> {
        let (reply, rx) = oneshot::channel();
        self.enqueue(Queued::Home { write, reply });
        Box::pin(async move { rx.await.unwrap_or_else(|_| Err(stopping())) })
    }

    /// Puts `job` in this executor's write queue, with no reply (see [`Executor::queue`]).
    pub fn enqueue(&self, job: Queued) {
        if self.writes.try_send(job).is_err() {
            tracing::error!("the write queue is closed; a write was dropped");
        }
    }

    /// Queues `work` on executor `to`'s write queue (see [`Executor::queue`]).
    pub fn queue_on<T: Send + 'static, F>(
        self: &Rc<Self>,
        to: usize,
        work: impl FnOnce(Rc<Executor>) -> F + Send + 'static,
    ) -> LocalFuture<Result<T, Failure>>
    where
        F: Future<Output = Written<Result<T, Failure>>> + 'static,
    {
        self.on(to, move |ex| ex.queue(work))
    }

    /// Answers a query from this executor's copy; `f` reads the answer in place.
    pub fn query<R>(&self, q: &Asked<'_>, f: impl FnOnce(&Answer) -> R) -> R {
        let _scope = QueryScope::enter();
        let started = Instant::now();
        let mut candidates = self.candidates.borrow_mut();
        candidates.clear();
        q.candidates.copy_to(&mut candidates);
        let ask = Ask {
            candidates: (!q.candidates.is_empty()).then_some(&candidates[..]),
            top_k: q.top_k,
            want_runs: q.want_runs,
            weights: q.weights,
        };
        let mut answer = self.answer.borrow_mut();
        let mut core = self.core.borrow_mut();
        core.query_into(q.ks, q.chain, &ask, &mut answer);
        let a = &mut *answer;
        a.reissued = core.roster().reissued();
        drop(core);
        a.history_lost.clear();
        if LOST.any() {
            let lost = a
                .scores
                .iter()
                .map(|&(w, _)| w)
                .filter(|&w| LOST.contains(w));
            a.history_lost.extend(lost);
            a.history_lost.sort_unstable();
        }
        a.suspect.clear();
        if crate::reuse::SUSPECT.any() {
            let suspect = a
                .scores
                .iter()
                .filter_map(|&(w, _)| Some((w, crate::reuse::SUSPECT.of(w)?)));
            a.suspect.extend(suspect);
            a.suspect.sort_unstable_by_key(|&(w, _)| w);
        }
        let outcome = if !answer.scores.is_empty() {
            QueryOutcome::Hit
        } else if answer.unscorable > 0 {
            QueryOutcome::Unscorable
        } else {
            QueryOutcome::Empty
        };
        self.metrics().query(outcome, started.elapsed());
        f(&answer)
    }

    /// Refreshes the gauges of this executor's copy.
    pub fn refresh_gauges(&self) {
        let core = self.core.borrow();
        let m = self.metrics();
        m.blocks.store(core.index().blocks(), Relaxed);
        m.memberships.store(core.index().memberships(), Relaxed);
        m.workers.store(core.roster().len() as u64, Relaxed);
    }
}
