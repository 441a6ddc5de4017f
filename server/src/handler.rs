//! Message → shard work → reply frame. One function per request kind; the handshake
//! gate in front of them. Everything here runs on the connection's executor.

use std::time::Instant;

use kvix_wire::{
    encode, u64s, AlignedVec, ArchivedAnnounce, ArchivedEventBatch, ArchivedHello,
    ArchivedPlacement, ArchivedQuery, Body, ErrorCode, ErrorReply, Header, MessageRef, Welcome,
    BYTE_CHUNK,
};

use crate::mesh::LocalFuture;
use crate::metrics::Rejected;
use crate::ops::{Failure, FeedReq, ShardRep, ShardReq};
use crate::shard::Shard;

/// Per-connection protocol state.
#[derive(Default)]
pub struct Session {
    pub hello: bool,
    /// Set when the reply being sent is the last one on this connection.
    pub closing: bool,
}

/// What a handled request gives back to the connection.
pub enum Reply {
    Now(AlignedVec),
    Later(LocalFuture<AlignedVec>),
    Nothing,
}

/// Encodes a reply frame; a reply too large to encode becomes an Internal error frame.
pub fn frame<M: Body>(id: u64, msg: &M) -> AlignedVec {
    encode(msg, id, 0).unwrap_or_else(|e| {
        error_frame(
            id,
            &ErrorReply {
                code: ErrorCode::Internal,
                message: e.to_string(),
            },
        )
    })
}

pub fn error_frame(id: u64, e: &ErrorReply) -> AlignedVec {
    encode(e, id, 0).expect("an error reply always encodes")
}

fn failure_frame(id: u64, f: Failure) -> AlignedVec {
    error_frame(
        id,
        &ErrorReply {
            code: f.code,
            message: f.message,
        },
    )
}

impl Shard {
    /// Routes one validated message. Requests start here, in arrival order.
    pub fn handle(
        self: &std::rc::Rc<Self>,
        session: &mut Session,
        header: &Header,
        msg: MessageRef<'_>,
    ) -> Reply {
        let id = header.request_id;
        if !session.hello {
            return match msg {
                MessageRef::Hello(h) => self.hello(session, id, h),
                other => {
                    self.metrics().reject(Rejected::NoHello);
                    session.closing = true;
                    Reply::Now(failure_frame(
                        id,
                        Failure::new(
                            ErrorCode::NoHello,
                            format!("{} before Hello", other.kind().name()),
                        ),
                    ))
                }
            };
        }
        let reply = match msg {
            MessageRef::Query(q) => self.query(id, q),
            MessageRef::Announce(a) => self.announce(id, a),
            MessageRef::Retire(r) => self.forward(id, 0, ShardReq::Retire(r.worker.to_native())),
            MessageRef::EventBatch(b) => self.events(id, b),
            MessageRef::Placement(p) => self.placement(id, p),
            MessageRef::StatsRequest(_) => self.stats(id),
            MessageRef::Echo(e) => self.echo(id, e.reply_len.to_native()),
            MessageRef::Hello(_) => Reply::Now(failure_frame(
                id,
                Failure::new(ErrorCode::BadFrame, "second Hello"),
            )),
            other => Reply::Now(failure_frame(
                id,
                Failure::new(
                    ErrorCode::BadFrame,
                    format!("{} is a reply, not a request", other.kind().name()),
                ),
            )),
        };
        if header.wants_reply() {
            reply
        } else {
            // Fire-and-forget: the work still completes, only the reply is dropped.
            if let Reply::Later(fut) = reply {
                glommio::spawn_local(fut).detach();
            }
            Reply::Nothing
        }
    }

    fn hello(&self, session: &mut Session, id: u64, h: &ArchivedHello) -> Reply {
        let cfg = self.config();
        let refuse = |session: &mut Session, why: Rejected, code, message: String| {
            self.metrics().reject(why);
            session.closing = true;
            Reply::Now(failure_frame(id, Failure::new(code, message)))
        };
        if let Some(token) = &cfg.auth_token {
            if h.auth.as_ref().map(|a| a.as_str()) != Some(token.as_str()) {
                return refuse(
                    session,
                    Rejected::Unauthorized,
                    ErrorCode::Unauthorized,
                    "missing or wrong auth token".into(),
                );
            }
        }
        let block = h.token_block.to_native();
        if block != cfg.block_size {
            return refuse(
                session,
                Rejected::BlockSize,
                ErrorCode::BlockSizeMismatch,
                format!(
                    "client hashes {block}-token blocks, this server {}-token blocks",
                    cfg.block_size
                ),
            );
        }
        session.hello = true;
        tracing::debug!(client = %h.client.as_str(), "hello");
        Reply::Now(frame(
            id,
            &Welcome {
                server: format!("kvix-server {}", env!("CARGO_PKG_VERSION")),
                token_block: cfg.block_size,
                byte_chunk: BYTE_CHUNK,
                shards: self.shards() as u32,
                max_frame: cfg.max_frame,
            },
        ))
    }

    fn query(self: &std::rc::Rc<Self>, id: u64, q: &ArchivedQuery) -> Reply {
        let started = Instant::now();
        let plan = self.plan_query(q);
        let ready = self.finish_query(id, plan, started);
        match ready {
            Ok(frame) => Reply::Now(frame),
            Err(fut) => Reply::Later(fut),
        }
    }

    fn announce(self: &std::rc::Rc<Self>, id: u64, a: &ArchivedAnnounce) -> Reply {
        match crate::ops::announce_request(a) {
            Ok(req) => self.forward(id, 0, ShardReq::Announce(req)),
            Err(f) => Reply::Now(failure_frame(id, f)),
        }
    }

    fn events(self: &std::rc::Rc<Self>, id: u64, b: &ArchivedEventBatch) -> Reply {
        let worker = b.worker.to_native();
        let req = FeedReq::Events {
            worker,
            seq: b.seq.to_native(),
            keyspace: b.keyspace.to_native(),
            events: b.events.iter().map(crate::ops::event_native).collect(),
        };
        self.forward(id, self.home_of(worker), ShardReq::Feed(req))
    }

    fn placement(self: &std::rc::Rc<Self>, id: u64, p: &ArchivedPlacement) -> Reply {
        let worker = p.worker.to_native();
        let req = FeedReq::Place {
            worker,
            keyspace: p.keyspace.to_native(),
            chain: u64s(&p.chain).to_vec(),
        };
        self.forward(id, self.home_of(worker), ShardReq::Feed(req))
    }

    fn echo(&self, id: u64, reply_len: u32) -> Reply {
        let cap = self.config().max_frame as usize - kvix_wire::HEADER_LEN - 64;
        let payload = vec![0u8; (reply_len as usize).min(cap)];
        Reply::Now(frame(id, &kvix_wire::Echo { payload, reply_len }))
    }

    fn stats(self: &std::rc::Rc<Self>, id: u64) -> Reply {
        let me = self.clone();
        Reply::Later(Box::pin(async move { frame(id, &me.gather_stats().await) }))
    }

    /// Runs `req` on shard `to` (here, or over the mesh) and frames its reply.
    fn forward(self: &std::rc::Rc<Self>, id: u64, to: usize, req: ShardReq) -> Reply {
        let fut = self.call(to, req);
        Reply::Later(Box::pin(async move {
            match fut.await {
                Ok(rep) => reply_frame(id, rep),
                Err(f) => failure_frame(id, f),
            }
        }))
    }
}

/// The client-facing frame for a shard's reply to a forwarded request.
fn reply_frame(id: u64, rep: ShardRep) -> AlignedVec {
    match rep {
        ShardRep::Announced(a) => frame(id, &a),
        ShardRep::Applied(a) => frame(id, &a),
        ShardRep::Done => frame(id, &kvix_wire::Ack {}),
        ShardRep::Failed(f) => failure_frame(id, f),
        other => failure_frame(
            id,
            Failure::new(
                ErrorCode::Internal,
                format!("unexpected shard reply {other:?}"),
            ),
        ),
    }
}
