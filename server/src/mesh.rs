//! Work sent from one executor to another over glommio's channel mesh.
//!
//! What crosses a channel is a closure run on the receiving executor's state `T`
//! ([`Mesh::invoke_on`], with a oneshot for its reply; [`Mesh::spawn_on`], without): no
//! request or reply enums. Closures to one peer are queued locally in call order and
//! forwarded by one task per peer, so a caller never blocks on a full channel (two
//! executors calling each other cannot deadlock), and a peer starts them in arrival
//! order: the synchronous part of each runs before the next one starts, which is what
//! keeps one sender's writes in order everywhere.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

use futures::channel::oneshot;
use glommio::channels::channel_mesh::{Full, MeshBuilder, Receivers, Senders};
use glommio::channels::local_channel::{self, LocalSender};

pub type LocalFuture<T> = Pin<Box<dyn Future<Output = T>>>;

/// What crosses the mesh: work to run on the receiving executor's state.
type Sent<T> = Box<dyn FnOnce(&Rc<T>) + Send>;

pub type Builder<T> = MeshBuilder<Sent<T>, Full>;

pub fn builder<T: 'static>(executors: usize) -> Builder<T> {
    MeshBuilder::full(executors, 1024)
}

/// The executor went away (only while the process stops).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("executor {0} is gone")]
pub struct PeerGone(pub usize);

/// This executor's sending end of the mesh.
pub struct Mesh<T> {
    me: usize,
    outbox: Vec<Option<LocalSender<Sent<T>>>>,
    /// Counts a call sent while answering a query (`kvix_query_hops_total`): none by
    /// design.
    hop: Box<dyn Fn()>,
}

/// This executor's receiving end: run by [`Inbox::run_for`] once the executor exists.
pub struct Inbox<T> {
    receivers: Receivers<Sent<T>>,
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

impl<T: 'static> Mesh<T> {
    /// Joins the mesh (every executor must call it) and starts the forwarding tasks;
    /// `hop(me)` counts a call this executor sends while a query is answered.
    pub async fn join(
        builder: Builder<T>,
        hop: impl FnOnce(usize) -> Box<dyn Fn()>,
    ) -> Result<(Self, Inbox<T>), crate::error::StartError> {
        let (senders, receivers): (Senders<Sent<T>>, Receivers<Sent<T>>) = builder
            .join()
            .await
            .map_err(crate::error::StartError::spawn("the executor mesh"))?;
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
        let hop = hop(me);
        Ok((Mesh { me, outbox, hop }, Inbox { receivers }))
    }

    /// This executor's index in the mesh.
    pub fn me(&self) -> usize {
        self.me
    }

    pub fn executors(&self) -> usize {
        self.outbox.len()
    }

    /// Runs `f` on executor `to` (queued now, in call order) and waits for the reply
    /// its future gives.
    pub fn invoke_on<R: Send + 'static>(
        &self,
        to: usize,
        f: impl FnOnce(&Rc<T>) -> LocalFuture<R> + Send + 'static,
    ) -> impl Future<Output = Result<R, PeerGone>> + 'static {
        if IN_QUERY.with(Cell::get) {
            (self.hop)();
        }
        let (tx, rx) = oneshot::channel();
        self.spawn_on(to, move |on| {
            let reply = f(on);
            glommio::spawn_local(async move {
                let _ = tx.send(reply.await);
            })
            .detach();
        });
        async move { rx.await.map_err(|_| PeerGone(to)) }
    }

    /// Runs `job` on executor `to` (queued now, in call order), with no reply.
    pub fn spawn_on(&self, to: usize, job: impl FnOnce(&Rc<T>) + Send + 'static) {
        debug_assert_ne!(to, self.me, "local work is done in place");
        if let Some(Some(out)) = self.outbox.get(to) {
            let _ = out.try_send(Box::new(job) as Sent<T>);
        }
    }
}

impl<T: 'static> Inbox<T> {
    /// Runs what other executors send to `on`, in arrival order per sender.
    pub fn run_for(mut self, on: &Rc<T>) {
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
