//! Typed calls between executors over glommio's channel mesh.
//!
//! A [`Call`] is a request type with its own reply type, run on another executor by
//! [`Mesh::invoke_on`]. What crosses the channel is the call boxed with the sending half
//! of a oneshot for its reply: no request or reply enum, each handler its own file (see
//! `calls/`). Calls to one peer are queued locally in call order and forwarded by one
//! task per peer, so a caller never blocks on a full channel (two executors calling each
//! other cannot deadlock), and a peer starts them in arrival order: the synchronous part
//! of each call runs before the next one starts, which is what keeps one sender's writes
//! in order everywhere.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use futures::channel::oneshot;
use glommio::channels::channel_mesh::{Full, MeshBuilder, Receivers, Senders};
use glommio::channels::local_channel::{self, LocalSender};

use crate::executor::Executor;

pub type LocalFuture<T> = Pin<Box<dyn Future<Output = T>>>;

/// A request run on another executor, with its own reply type.
pub trait Call: Send + 'static {
    type Reply: Send + 'static;

    /// Starts the call on `on`. Whatever runs before the returned future is first polled
    /// runs in the order calls arrived.
    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply>;
}

/// What crosses the mesh: a call, ready to run and answer on the receiving executor.
type Job = Box<dyn FnOnce(&Rc<Executor>) + Send>;

pub type Builder = MeshBuilder<Job, Full>;

pub fn builder(executors: usize) -> Builder {
    MeshBuilder::full(executors, 1024)
}

/// The executor went away (only while the process stops).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("executor {0} is gone")]
pub struct PeerGone(pub usize);

/// This executor's sending end of the mesh.
pub struct Mesh {
    me: usize,
    outbox: Vec<Option<LocalSender<Job>>>,
    /// Calls sent while answering a query (`kvix_query_hops_total`): zero by design.
    hops: Arc<AtomicU64>,
}

/// This executor's receiving end: run by [`Inbox::serve`] once the executor exists.
pub struct Inbox {
    receivers: Receivers<Job>,
}

thread_local! {
    /// Set while a query is being answered: any call sent then is a hop the query caused.
    static IN_QUERY: Cell<bool> = const { Cell::new(false) };
}

/// Marks the current (synchronous) stretch of code as answering a query.
pub struct QueryScope(());

impl QueryScope {
    pub fn enter() -> Self {
        IN_QUERY.with(|q| q.set(true));
        QueryScope(())
    }
}

impl Drop for QueryScope {
    fn drop(&mut self) {
        IN_QUERY.with(|q| q.set(false));
    }
}

impl Mesh {
    /// Joins the mesh (every executor must call it) and starts the forwarding tasks.
    pub async fn join(
        builder: Builder,
        metrics: &[crate::metrics::ExecutorMetrics],
    ) -> anyhow::Result<(Mesh, Inbox)> {
        let (senders, receivers): (Senders<Job>, Receivers<Job>) = builder
            .join()
            .await
            .map_err(|e| anyhow::anyhow!("joining the executor mesh: {e}"))?;
        let (me, executors) = (senders.peer_id(), senders.nr_consumers());
        let senders = Rc::new(senders);
        let outbox = (0..executors)
            .map(|peer| {
                (peer != me).then(|| {
                    let (tx, rx) = local_channel::new_unbounded();
                    let senders = senders.clone();
                    glommio::spawn_local(async move {
                        while let Some(job) = rx.recv().await {
                            if senders.send_to(peer, job).await.is_err() {
                                break;
                            }
                        }
                    })
                    .detach();
                    tx
                })
            })
            .collect();
        let hops = metrics[me].query_hops.clone();
        Ok((Mesh { me, outbox, hops }, Inbox { receivers }))
    }

    /// This executor's index in the mesh.
    pub fn me(&self) -> usize {
        self.me
    }

    pub fn executors(&self) -> usize {
        self.outbox.len()
    }

    /// Runs `call` on executor `to` (queued now, in call order) and waits for its reply.
    pub fn invoke_on<C: Call>(
        &self,
        to: usize,
        call: C,
    ) -> impl Future<Output = Result<C::Reply, PeerGone>> + 'static {
        if IN_QUERY.with(Cell::get) {
            self.hops.fetch_add(1, Relaxed);
        }
        let (tx, rx) = oneshot::channel();
        self.spawn_on(to, move |on| {
            let reply = call.run(on);
            glommio::spawn_local(async move {
                let _ = tx.send(reply.await);
            })
            .detach();
        });
        async move { rx.await.map_err(|_| PeerGone(to)) }
    }

    /// Runs `job` on executor `to` (queued now, in call order), with no reply.
    pub fn spawn_on(&self, to: usize, job: impl FnOnce(&Rc<Executor>) + Send + 'static) {
        debug_assert_ne!(to, self.me, "local work is done in place");
        if let Some(Some(out)) = self.outbox.get(to) {
            let _ = out.try_send(Box::new(job) as Job);
        }
    }
}

impl Inbox {
    /// Runs the calls other executors send to `on`, in arrival order per sender.
    pub fn serve(mut self, on: &Rc<Executor>) {
        for (_, rx) in self.receivers.streams() {
            let on = Rc::downgrade(on);
            glommio::spawn_local(async move {
                while let Some(job) = rx.recv().await {
                    let Some(on) = on.upgrade() else { break };
                    job(&on);
                }
            })
            .detach();
        }
    }
}
