//! Request/reply between shards over glommio's channel mesh.
//!
//! Every shard pair has a FIFO request channel and a FIFO reply channel. A call to a
//! peer is queued locally (never blocks the caller, so two shards calling each other
//! cannot deadlock on full channels) and forwarded by one task per peer. Requests from
//! one peer are started in arrival order, and a handler's synchronous prefix runs
//! before the next one starts: what one shard sends another is applied in order.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

use futures::channel::oneshot;
use glommio::channels::channel_mesh::{Full, MeshBuilder, Receivers, Senders};
use glommio::channels::local_channel::{self, LocalSender};

pub type LocalFuture<T> = Pin<Box<dyn Future<Output = T>>>;

/// What crosses between shards: a request or a reply, tagged with the caller's token.
pub enum Envelope<Req, Rep> {
    Request { token: u64, req: Req },
    Reply { token: u64, rep: Rep },
}

pub type Builder<Req, Rep> = MeshBuilder<Envelope<Req, Rep>, Full>;

pub fn builder<Req: Send + 'static, Rep: Send + 'static>(shards: usize) -> Builder<Req, Rep> {
    MeshBuilder::full(shards, 1024)
}

/// This shard's end of the mesh.
pub struct Mesh<Req, Rep> {
    me: usize,
    shards: usize,
    outbox: Vec<Option<LocalSender<Envelope<Req, Rep>>>>,
    pending: RefCell<HashMap<u64, oneshot::Sender<Rep>>>,
    next_token: Cell<u64>,
}

/// A peer went away (its executor stopped): only during shutdown.
#[derive(Debug, thiserror::Error)]
#[error("shard {0} is gone")]
pub struct PeerGone(pub usize);

impl<Req: Send + 'static, Rep: Send + 'static> Mesh<Req, Rep> {
    /// Joins the mesh and starts the forwarding tasks; `handle` serves peers' requests.
    pub async fn join(
        builder: Builder<Req, Rep>,
        handle: impl Fn(Req) -> LocalFuture<Rep> + 'static,
    ) -> anyhow::Result<Rc<Self>> {
        let (senders, mut receivers): (Senders<_>, Receivers<_>) = builder
            .join()
            .await
            .map_err(|_| anyhow::anyhow!("joining the shard mesh failed"))?;
        let (me, shards) = (senders.peer_id(), senders.nr_consumers());
        let senders = Rc::new(senders);
        let mut outbox = Vec::with_capacity(shards);
        for peer in 0..shards {
            if peer == me {
                outbox.push(None);
                continue;
            }
            let (tx, rx) = local_channel::new_unbounded();
            let senders = senders.clone();
            glommio::spawn_local(async move {
                while let Some(env) = rx.recv().await {
                    if senders.send_to(peer, env).await.is_err() {
                        break;
                    }
                }
            })
            .detach();
            outbox.push(Some(tx));
        }
        let mesh = Rc::new(Mesh {
            me,
            shards,
            outbox,
            pending: RefCell::new(HashMap::new()),
            next_token: Cell::new(0),
        });
        let handle = Rc::new(handle);
        for (peer, rx) in receivers.streams() {
            let (mesh, handle) = (Rc::downgrade(&mesh), handle.clone());
            glommio::spawn_local(async move {
                while let Some(env) = rx.recv().await {
                    let Some(mesh) = mesh.upgrade() else { break };
                    match env {
                        Envelope::Request { token, req } => {
                            let fut = handle(req);
                            glommio::spawn_local(async move {
                                let rep = fut.await;
                                mesh.send(peer, Envelope::Reply { token, rep });
                            })
                            .detach();
                        }
                        Envelope::Reply { token, rep } => {
                            if let Some(waiter) = mesh.pending.borrow_mut().remove(&token) {
                                let _ = waiter.send(rep);
                            }
                        }
                    }
                }
            })
            .detach();
        }
        Ok(mesh)
    }

    pub fn me(&self) -> usize {
        self.me
    }

    pub fn shards(&self) -> usize {
        self.shards
    }

    fn send(&self, peer: usize, env: Envelope<Req, Rep>) {
        if let Some(Some(tx)) = self.outbox.get(peer) {
            let _ = tx.try_send(env);
        }
    }

    /// Sends `req` to `peer` now (queued in order) and returns the wait for its reply.
    pub fn call(
        &self,
        peer: usize,
        req: Req,
    ) -> impl Future<Output = Result<Rep, PeerGone>> + 'static {
        debug_assert_ne!(peer, self.me, "local requests are served directly");
        let token = self.next_token.get();
        self.next_token.set(token.wrapping_add(1));
        let (tx, rx) = oneshot::channel();
        self.pending.borrow_mut().insert(token, tx);
        self.send(peer, Envelope::Request { token, req });
        async move { rx.await.map_err(|_| PeerGone(peer)) }
    }
}
