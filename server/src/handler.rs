//! Message → executor work → reply frame. One function per request kind, behind the
//! handshake gate; the executor returns answers and this module frames them. Everything
//! here runs on the connection's executor.

use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;

use kvix_wire::{
    encode_in_version, AlignedVec, ArchivedHello, Body, ErrorCode, ErrorReply, Header, MessageRef,
    Stats, Welcome, BYTE_CHUNK, OLDEST_VERSION,
};

use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::LocalFuture;
use crate::metrics::Rejected;
use crate::query;
use crate::write::{route_write, Origin};
use crate::write::{FrameBytes, Outcome, Write};

/// Longest worker name accepted (names are kept for the life of the server).
pub const MAX_NAME: usize = 256;
/// Longest event-source endpoint (ZMQ address) an announce may carry.
pub const MAX_ENDPOINT: usize = 1024;
/// Longest cache salt an event source may carry.
pub const MAX_SALT: usize = 1024;

/// Per-connection protocol state.
#[derive(Default)]
pub struct Session {
    /// The client's address (None on the Unix socket).
    pub peer: Option<std::net::IpAddr>,
    pub hello: bool,
    /// Who the client is to the reuse verdicts: its Hello's name and its address.
    pub client: Option<std::sync::Arc<str>>,
    /// Set when the reply being sent is the last one on this connection.
    pub closing: bool,
}

/// What a handled request gives back to the connection.
pub enum Reply {
    Now(AlignedVec),
    Later(LocalFuture<AlignedVec>),
    /// A write the client wants no reply to: it still counts against the connection's
    /// in-flight limit until done, and only a refusal is answered (its error frame).
    Quiet(LocalFuture<Option<AlignedVec>>),
    Nothing,
}

/// Where a reply goes: the request it answers, in the protocol version the request
/// came in (a v4 client reads v4 frames only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    pub id: u64,
    pub version: u16,
}

impl ReplyTo {
    pub fn of(header: &Header) -> Self {
        ReplyTo {
            id: header.request_id,
            version: header.version,
        }
    }

    /// A reply to a request whose header could not be read: in the oldest version, which
    /// every client reads.
    pub const fn unread(id: u64) -> Self {
        ReplyTo {
            id,
            version: OLDEST_VERSION,
        }
    }
}

/// Encodes a reply frame; a reply too large to encode becomes an Internal error frame.
pub fn frame<M: Body>(to: ReplyTo, msg: &M) -> AlignedVec {
    encode_in_version(msg, to.version, to.id, 0, AlignedVec::new()).unwrap_or_else(|e| {
        error_frame(
            to,
            &ErrorReply {
                code: ErrorCode::Internal,
                message: e.to_string(),
            },
        )
    })
}

/// An error reply, its code as the request's version knows it.
pub fn error_frame(to: ReplyTo, e: &ErrorReply) -> AlignedVec {
    let e = ErrorReply {
        code: e.code.for_version(to.version),
        message: e.message.clone(),
    };
    encode_in_version(&e, to.version, to.id, 0, AlignedVec::new())
        .expect("an error reply always encodes")
}

/// The frame edge: a failure becomes the `ErrorReply` its client reads.
pub fn failure_frame(to: ReplyTo, f: Failure) -> AlignedVec {
    error_frame(
        to,
        &ErrorReply {
            code: f.code(),
            message: f.to_string(),
        },
    )
}

/// Routes one validated message; `body` is its frame body (writes carry it to the
/// worker's home as it is). Requests start here, in arrival order.
pub fn handle(
    ex: &Rc<Executor>,
    session: &mut Session,
    header: &Header,
    msg: MessageRef<'_>,
    body: &[u8],
) -> Reply {
    let id = ReplyTo::of(header);
    if !session.hello {
        return match msg {
            MessageRef::Hello(h) => hello(ex, session, id, h),
            other => {
                ex.metrics().reject(Rejected::NoHello);
                session.closing = true;
                Reply::Now(failure_frame(
                    id,
                    Failure::protocol(
                        ErrorCode::NoHello,
                        format!("{} before Hello", other.kind().name()),
                    ),
                ))
            }
        };
    }
    if is_write(&msg) && ex.stopping() {
        // The last snapshot is being taken: it covers what was accepted before this.
        ex.metrics().reject(Rejected::Stopping);
        return Reply::Now(failure_frame(id, Failure::Stopping));
    }
    if is_write(&msg) {
        let applied = match write_of(&msg, body) {
            Ok(w) => route_write(ex, w, Origin::Accepted),
            Err(f) => Box::pin(std::future::ready(Err(f))),
        };
        return if header.wants_reply() {
            Reply::Later(Box::pin(async move { reply_frame(id, applied.await) }))
        } else {
            // Success is not answered; a refusal is, so that a fire-and-forget sender
            // can count what it lost.
            Reply::Quiet(Box::pin(async move {
                applied.await.err().map(|f| failure_frame(id, f))
            }))
        };
    }
    let block = ex.settings().index.block_size;
    let reply = match msg {
        MessageRef::Query(q) => Reply::Now(ex.query(&query::Asked::joint(q, block), |a| {
            bounded(ex, id, frame(id, &a.to_wire()))
        })),
        MessageRef::TieredQuery(q) => Reply::Now(match query::Asked::tiered(q, block) {
            Ok(asked) => ex.query(&asked, |a| {
                let answer = kvix_wire::TieredAnswer {
                    stale: ex.stale(),
                    ..a.to_tiered()
                };
                bounded(ex, id, frame(id, &answer))
            }),
            Err(f) => failure_frame(id, f),
        }),
        MessageRef::ReuseReport(r) => Reply::Now(reuse(ex, session, id, r)),
        MessageRef::StatsRequest(_) => stats(ex, id),
        MessageRef::RosterRequest(r) => Reply::Now(roster(ex, id, r)),
        MessageRef::Echo(e) => echo(ex, id, e.reply_len.to_native()),
        MessageRef::Hello(_) => Reply::Now(failure_frame(
            id,
            Failure::protocol(ErrorCode::BadFrame, "second Hello"),
        )),
        other => Reply::Now(failure_frame(
            id,
            Failure::protocol(
                ErrorCode::BadFrame,
                format!("{} is a reply, not a request", other.kind().name()),
            ),
        )),
    };
    match reply {
        Reply::Later(_) | Reply::Now(_) if !header.wants_reply() => Reply::Nothing,
        reply => reply,
    }
}

/// An answer's frame, or the refusal of one past the frame limit.
fn bounded(ex: &Executor, id: ReplyTo, bytes: AlignedVec) -> AlignedVec {
    let max = ex.settings().conn.max_frame as usize;
    if bytes.len() <= max {
        return bytes;
    }
    failure_frame(
        id,
        Failure::AnswerTooLarge {
            bytes: bytes.len(),
            max,
        },
    )
}

/// Takes a gateway's reuse reports (what the engines say they reused) into the
/// verdicts ([`crate::reuse`]), judged against this executor's roster. A placement-fed
/// worker whose engine lost its cache has its placements dropped, by a write of its
/// own on the one write route (logged, and applied by every replica).
fn reuse(
    ex: &Rc<Executor>,
    session: &Session,
    id: ReplyTo,
    r: &kvix_wire::ArchivedReuseReport,
) -> AlignedVec {
    let reports: Vec<crate::reuse::Report> = r
        .reports
        .iter()
        .map(|r| crate::reuse::Report {
            worker: r.worker.to_native(),
            predicted: r.predicted_tokens.as_ref().map(|p| p.to_native()),
            cached: r.cached_tokens.to_native(),
            prompt: r.prompt_tokens.to_native(),
        })
        .collect();
    let core = ex.core();
    let kind = |w| {
        let entry = core.roster().get(w)?;
        Some(crate::reuse::WorkerKind {
            event_fed: matches!(entry.feed, kvix_wire::Feed::Events),
            history_lost: crate::ingest::states::LOST.contains(w),
        })
    };
    let client = session.client.as_deref().unwrap_or("unknown");
    let learned = crate::reuse::take(client, &reports, ex.settings().index.block_size, &kind);
    drop(core);
    for worker in learned.caches_lost {
        tracing::warn!(
            worker,
            "reuse reports: placement-fed worker {worker}'s engine reused nothing of {} \
             prompts in a row where its placements promised reuse: its cache was lost (a \
             restart); its placements are dropped",
            crate::reuse::CACHE_LOST
        );
        learn(ex, Write::ForgetPlacements { worker }, worker);
    }
    for worker in learned.fill_in {
        tracing::warn!(
            worker,
            "reuse reports: worker {worker}'s events do not arrive: gateways' placements \
             fill in for it until its engine's events clear it"
        );
        learn(ex, Write::FillIn { worker }, worker);
    }
    frame(id, &kvix_wire::Ack {})
}

/// Sends what the reuse reports taught the index on the one write route (so that every
/// replica learns it), not holding up the reports' answer.
fn learn(ex: &Rc<Executor>, write: Write, worker: kvix_wire::WorkerId) {
    let written = route_write(ex, write, Origin::Accepted);
    glommio::spawn_local(async move {
        if let Err(f) = written.await {
            tracing::warn!(worker, "a write the reuse reports called for failed: {f}");
        }
    })
    .detach();
}

fn is_write(msg: &MessageRef<'_>) -> bool {
    matches!(
        msg,
        MessageRef::Announce(_)
            | MessageRef::Retire(_)
            | MessageRef::EventBatch(_)
            | MessageRef::Placement(_)
    )
}

/// The write a message asks for, as the logs keep it; `body` is the frame body `msg`
/// was validated from (the write keeps it as validated).
fn write_of(msg: &MessageRef<'_>, body: &[u8]) -> Result<Write, Failure> {
    Ok(match msg {
        MessageRef::Announce(a) => {
            let a: kvix_wire::Announce = kvix_wire::to_native(*a);
            check_announce(&a)?;
            Write::Announce {
                name: a.name,
                lanes: a.lanes,
                feed: a.feed,
                source: a.source,
            }
        }
        MessageRef::Retire(r) => Write::Retire {
            worker: r.worker.to_native(),
        },
        // `body` is the frame body `msg` was read (and validated) from.
        MessageRef::EventBatch(_) => Write::Events {
            body: FrameBytes::validated(body, kvix_wire::Kind::EventBatch),
        },
        MessageRef::Placement(_) => Write::Place {
            body: FrameBytes::validated(body, kvix_wire::Kind::Placement),
        },
        _ => return Err(Failure::Bug("write_of is given writes")),
    })
}

/// The outcome of one applied write as the reply frame its client waits for.
fn reply_frame(id: ReplyTo, outcome: Result<Outcome, Failure>) -> AlignedVec {
    match outcome {
        Ok(Outcome::Announced(a)) => frame(id, &a),
        Ok(Outcome::Applied(a)) => frame(id, &a),
        Ok(Outcome::Done) => frame(id, &kvix_wire::Ack {}),
        Err(f) => failure_frame(id, f),
    }
}

/// The lengths an announce's strings may have: each is kept per worker, in every
/// executor's copy, the log and the snapshot.
pub(crate) fn check_announce(a: &kvix_wire::Announce) -> Result<(), Failure> {
    if a.name.is_empty() || a.name.len() > MAX_NAME {
        return Err(Failure::NameLength {
            len: a.name.len(),
            max: MAX_NAME,
        });
    }
    let Some(src) = &a.source else {
        return Ok(());
    };
    let fields = [
        ("endpoint", &src.endpoint, MAX_ENDPOINT),
        ("replay", &src.replay, MAX_ENDPOINT),
        ("model", &src.model, MAX_NAME),
        ("salt", &src.salt, MAX_SALT),
    ];
    match fields.into_iter().find(|(_, v, max)| v.len() > *max) {
        Some((field, v, max)) => Err(Failure::SourceField {
            worker: a.name.clone(),
            field,
            max,
            len: v.len(),
        }),
        None => Ok(()),
    }
}

fn hello(ex: &Executor, session: &mut Session, id: ReplyTo, h: &ArchivedHello) -> Reply {
    let cfg = &ex.settings().conn;
    let refuse = |session: &mut Session, why: Rejected, code, message: String| {
        ex.metrics().reject(why);
        session.closing = true;
        failure_frame(id, Failure::protocol(code, message))
    };
    if let Some(token) = &cfg.auth_token {
        let given = h.auth.as_ref().map(|a| a.as_bytes());
        if !given.is_some_and(|g| crate::auth::same_token(g, token.as_bytes())) {
            let failed = ex.metrics().rejected[Rejected::Unauthorized as usize].load(Relaxed);
            if (failed + 1).is_power_of_two() {
                tracing::warn!(
                    peer = ?session.peer,
                    "{} Hellos with a missing or wrong auth token so far",
                    failed + 1
                );
            }
            // Refusals to an address that keeps guessing are held back (up to 1 s each).
            let hold = ex.auth_failures().failed(session.peer, ex.now_ms());
            let frame = refuse(
                session,
                Rejected::Unauthorized,
                ErrorCode::Unauthorized,
                "missing or wrong auth token".into(),
            );
            if hold.is_zero() {
                return Reply::Now(frame);
            }
            return Reply::Later(Box::pin(async move {
                glommio::timer::sleep(hold).await;
                frame
            }));
        }
        ex.auth_failures().passed(session.peer);
    }
    let block = h.token_block.to_native();
    if block != cfg.block_size {
        return Reply::Now(refuse(
            session,
            Rejected::BlockSize,
            ErrorCode::BlockSizeMismatch,
            format!(
                "client hashes {block}-token blocks, this server {}-token blocks",
                cfg.block_size
            ),
        ));
    }
    session.hello = true;
    session.client = Some(match session.peer {
        Some(ip) => format!("{}@{ip}", h.client.as_str()).into(),
        None => format!("{}@local", h.client.as_str()).into(),
    });
    tracing::debug!(client = %h.client.as_str(), "hello");
    Reply::Now(frame(
        id,
        &Welcome {
            server: format!("kvix-server {}", env!("CARGO_PKG_VERSION")),
            token_block: cfg.block_size,
            byte_chunk: BYTE_CHUNK,
            shards: ex.executors() as u32,
            max_frame: cfg.max_frame,
        },
    ))
}

/// Names a client asks for, at most, in one `RosterRequest`.
const MAX_ROSTER_NAMES: usize = 256;

/// The active workers the request asks for, from this executor's roster (every
/// executor installs every announce before it is answered). The id-ordered part stops
/// at about a quarter of the frame limit; the client asks again from `next`.
fn roster(ex: &Executor, id: ReplyTo, r: &kvix_wire::ArchivedRosterRequest) -> AlignedVec {
    let core = ex.core();
    let roster = core.roster();
    let entry = |w: &kvix_engine::WorkerEntry| kvix_wire::RosterEntry {
        worker: w.id,
        name: w.name.clone(),
    };
    let mut workers: Vec<_> = r
        .names
        .iter()
        .take(MAX_ROSTER_NAMES)
        .filter_map(|n| roster.named(n.as_str()).map(entry))
        .collect();
    let budget = ex.settings().conn.max_frame as usize / 4;
    let mut used: usize = workers.iter().map(|w| w.name.len() + 16).sum();
    let mut next = roster.end();
    let mut more = false;
    for w in roster.from(r.from.to_native()) {
        if used > budget {
            (next, more) = (w.id, true);
            break;
        }
        used += w.name.len() + 16;
        workers.push(entry(w));
    }
    frame(
        id,
        &kvix_wire::Roster {
            workers,
            next,
            more,
            reissued: roster.reissued(),
        },
    )
}

fn echo(ex: &Executor, id: ReplyTo, reply_len: u32) -> Reply {
    let cap = ex.settings().conn.max_frame as usize - kvix_wire::HEADER_LEN - 64;
    let payload = vec![0u8; (reply_len as usize).min(cap)];
    Reply::Now(frame(id, &kvix_wire::Echo { payload, reply_len }))
}

/// Every executor's counters: the roster and index are whole on each (one copy counts),
/// queries and events add up.
fn stats(ex: &Rc<Executor>, id: ReplyTo) -> Reply {
    let parts: Vec<_> = (0..ex.executors())
        .map(|e| ex.on(e, |on| Box::pin(std::future::ready(Ok(stats_part(on))))))
        .collect();
    Reply::Later(Box::pin(async move {
        let mut total = Stats::default();
        for (i, part) in parts.into_iter().enumerate() {
            let Ok(s) = part.await else { continue };
            if i == 0 {
                (total.workers, total.blocks, total.memberships) =
                    (s.workers, s.blocks, s.memberships);
            }
            total.queries += s.queries;
            total.events += s.events;
            total.shard_load.extend(s.shard_load);
        }
        frame(id, &total)
    }))
}

/// One executor's counters.
fn stats_part(ex: &Executor) -> Stats {
    let m = ex.metrics();
    let queries = m.queries.iter().map(|q| q.load(Relaxed)).sum();
    let core = ex.core();
    Stats {
        workers: core.roster().len(),
        blocks: core.index().blocks(),
        memberships: core.index().memberships(),
        queries,
        events: m.block_events.load(Relaxed),
        shard_load: vec![queries],
    }
}
