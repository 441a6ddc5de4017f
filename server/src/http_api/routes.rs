//! The routes of Dynamo's standalone indexer API and what each does here: one function
//! per route, each given the request's parsed head and whole body.

use std::rc::Rc;

use kvix_engine::Ks;
use kvix_wire::{chain, ChunkKind, EventSource, Feed, Keyspace, Lane, TierWeights, WorkerId};

use super::head::{self, Head, Method};
use super::instances::{Member, Rank, View};
use super::json::{self, RankTokens, Rejection};
use super::Response;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::ingest::SourceError;
use crate::metrics::ExecutorMetrics;
use crate::query::{Asked, Candidates};
use crate::write::{route_write, Origin, Outcome, Write};

/// A known route: its metric label, and what a request for it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Route {
    Register,
    Unregister,
    Workers,
    Query,
    QueryByHash,
    Health,
    /// kvix's own: the body sent back at a given length, the transport's floor for the
    /// latency bench (`POST /echo?bytes=N`).
    Echo,
    /// Dynamo's dump and peer routes: 501 here.
    Unsupported,
}

// One `route` label per route, in order, then `unknown` (metrics::HTTP_ROUTES).
const _: () = assert!(Route::Unsupported as usize + 2 == crate::metrics::HTTP_ROUTES.len());

impl Route {
    /// The route a path names, with the methods it takes.
    pub fn of(path: &str) -> Option<(Route, &'static [Method])> {
        const POST: &[Method] = &[Method::Post];
        const GET: &[Method] = &[Method::Get, Method::Head];
        Some(match path {
            "/register" => (Route::Register, POST),
            "/unregister" => (Route::Unregister, POST),
            "/workers" => (Route::Workers, GET),
            "/query" => (Route::Query, POST),
            "/query_by_hash" => (Route::QueryByHash, POST),
            "/health" => (Route::Health, GET),
            "/echo" => (Route::Echo, POST),
            "/dump" | "/peers" => (Route::Unsupported, GET),
            "/register_peer" | "/deregister_peer" | "/reopen_logs" => (Route::Unsupported, POST),
            _ => return None,
        })
    }

    /// Whether the route reads a JSON body.
    pub fn takes_json(self) -> bool {
        matches!(
            self,
            Route::Register | Route::Unregister | Route::Query | Route::QueryByHash
        )
    }

    /// The largest body taken: 8 MiB for the query routes, 2 MiB for the others (axum's
    /// default), as Dynamo's indexer takes them.
    pub fn max_body(self) -> u64 {
        match self {
            Route::Query | Route::QueryByHash | Route::Echo => 8 << 20,
            _ => 2 << 20,
        }
    }
}

thread_local! {
    /// This executor's view of the partitions, from its own roster.
    static VIEW: std::cell::RefCell<View> = std::cell::RefCell::new(View::default());
}

/// Runs `f` on this executor's partitions, brought up to its roster.
fn with_view<T>(ex: &Executor, f: impl FnOnce(&View) -> T) -> T {
    VIEW.with(|v| {
        let mut v = v.borrow_mut();
        v.refresh(ex.core().roster());
        f(&v)
    })
}

/// Bodies this large are parsed (and their tokens hashed) on a thread aside, so that
/// queries on this executor are not held up meanwhile. Below it a body is read in the
/// executor's turn: 256 KiB of tokens (2,000 blocks of 16) take ~130 µs, well inside a
/// turn (`write::apply::TURN_EVERY`), and the hand-off would cost more than it saves.
const PARSE_ASIDE: usize = 256 << 10;

pub async fn handle(ex: &Rc<Executor>, route: Route, head: &Head, body: Vec<u8>) -> Response {
    match route {
        Route::Health => Response::empty(200),
        Route::Echo => echo(head),
        Route::Register => register(ex, &body).await,
        Route::Unregister => unregister(ex, &body).await,
        Route::Workers => workers(ex, head),
        Route::Query => query(ex, body).await,
        Route::QueryByHash => query_by_hash(ex, &body),
        Route::Unsupported => Response::json(
            501,
            json::error(format!(
                "{} is not implemented by kvix (docs/operations.md, \"HTTP API\")",
                head.path
            )),
        ),
    }
}

/// The longest echo: an answer's size, not an amplifier for whoever reaches the port.
const ECHO_MAX: u64 = 64 << 10;

/// `bytes` bytes back (at most [`ECHO_MAX`]), whatever was sent.
fn echo(head: &Head) -> Response {
    match head::query_value(&head.query, "bytes").map(|b| b.map(|b| b.parse::<u64>())) {
        Ok(Some(Ok(n))) if n <= ECHO_MAX => Response::text(200, " ".repeat(n as usize)),
        _ => Response::text(400, "POST /echo?bytes=N, N up to 65536"),
    }
}

/// A body that did not parse, as axum answers it.
fn rejected(r: Rejection) -> Response {
    match r {
        Rejection::Syntax(m) => Response::text(400, m),
        Rejection::Shape(m) => Response::text(422, m),
    }
}

/// The reply to a registration's write that failed.
fn refused(f: &Failure) -> Response {
    let status = match f {
        Failure::Source {
            source: SourceError::NotAllowed { .. },
            ..
        } => 403,
        Failure::Source {
            source: SourceError::TooMany { .. },
            ..
        } => 429,
        Failure::Source { .. } | Failure::SourceField { .. } | Failure::NameLength { .. } => 400,
        Failure::Engine(kvix_engine::EngineError::UnknownWorker(_)) => 404,
        Failure::LogUnavailable(_) | Failure::Stopping | Failure::IndexFull { .. } => 503,
        _ => 500,
    };
    Response::json(status, json::error(f))
}

async fn register(ex: &Rc<Executor>, body: &[u8]) -> Response {
    let req: json::RegisterRequest = match json::parse(body) {
        Ok(r) => r,
        Err(r) => return rejected(r),
    };
    if let Err(why) = super::endpoint::check(&req.endpoint) {
        return Response::json(400, json::error(why));
    }
    if let Some(replay) = &req.replay_endpoint {
        if let Err(why) = super::endpoint::check(replay) {
            let why = format!("invalid replay endpoint `{replay}`: {why}");
            return Response::json(400, json::error(why));
        }
    }
    let (model, group, id) = (&req.model_name, &req.routing_group, req.instance_id);
    let block = ex.settings().index.block_size;
    if req.block_size != block {
        let why = format!(
            "block_size mismatch for model={model} routing_group={group}: existing={block}, requested={}",
            req.block_size
        );
        return Response::json(409, json::error(why));
    }
    let rank = req.dp_rank.unwrap_or(0);
    let taken = with_view(ex, |v| match v.instance(id) {
        Some((m, g)) if (m, g) != (model.as_str(), group.as_str()) => Some(format!(
            "instance {id} is already registered for model={m} routing_group={g}"
        )),
        Some(_) if v.ranks(id).iter().any(|r| r.rank == rank) => {
            Some(format!("instance {id} dp_rank {rank} already registered"))
        }
        _ => None,
    });
    if let Some(why) = taken {
        return Response::json(409, json::error(why));
    }
    let name = Rank {
        instance: id,
        rank,
        group: group.clone(),
        model: model.clone(),
    }
    .name();
    let announce = kvix_wire::Announce {
        name,
        lanes: vec![Lane::full(block)],
        feed: Feed::Events,
        source: Some(EventSource {
            endpoint: req.endpoint.clone(),
            replay: req.replay_endpoint.clone().unwrap_or_default(),
            model: model.clone(),
            salt: String::new(),
        }),
    };
    if let Err(f) = crate::handler::check_announce(&announce) {
        return refused(&f);
    }
    let write = Write::Announce {
        name: announce.name,
        lanes: announce.lanes,
        feed: announce.feed,
        source: announce.source,
    };
    match route_write(ex, write, Origin::Accepted).await {
        Ok(Outcome::Announced(a)) if a.created => Response::json(201, json::ok()),
        // Registered meanwhile through another connection.
        Ok(_) => Response::json(
            409,
            json::error(format!("instance {id} dp_rank {rank} already registered")),
        ),
        Err(f) => refused(&f),
    }
}

/// What `/unregister` names that is not registered, in Dynamo's words.
#[derive(Debug, thiserror::Error)]
enum NotRegistered {
    #[error("instance {0} not found")]
    Instance(u64),
    #[error("instance {id} is registered for model={model} routing_group={group}")]
    Elsewhere {
        id: u64,
        model: String,
        group: String,
    },
    #[error("instance {id} dp_rank {rank} not found")]
    Rank { id: u64, rank: u32 },
}

async fn unregister(ex: &Rc<Executor>, body: &[u8]) -> Response {
    let req: json::UnregisterRequest = match json::parse(body) {
        Ok(r) => r,
        Err(r) => return rejected(r),
    };
    let id = req.instance_id;
    let chosen: Result<Vec<Member>, NotRegistered> = with_view(ex, |v| {
        let Some((m, g)) = v.instance(id) else {
            return Err(NotRegistered::Instance(id));
        };
        let wrong_place = match &req.routing_group {
            Some(group) => (m, g) != (req.model_name.as_str(), group.as_str()),
            None => m != req.model_name,
        };
        if wrong_place {
            let (model, group) = (m.to_string(), g.to_string());
            return Err(NotRegistered::Elsewhere { id, model, group });
        }
        let ranks = v.ranks(id);
        match (req.routing_group.is_some(), req.dp_rank) {
            // A rank alone only with its group named, as Dynamo takes it.
            (true, Some(rank)) => match ranks.iter().find(|r| r.rank == rank) {
                Some(r) => Ok(vec![*r]),
                None => Err(NotRegistered::Rank { id, rank }),
            },
            _ => Ok(ranks),
        }
    });
    let members = match chosen {
        Ok(m) => m,
        Err(why) => return Response::json(404, json::error(why)),
    };
    for m in members {
        let retire = Write::Retire { worker: m.worker };
        if let Err(f) = route_write(ex, retire, Origin::Accepted).await {
            return refused(&f);
        }
    }
    Response::json(200, json::ok())
}

fn workers(ex: &Rc<Executor>, head: &Head) -> Response {
    let filter = |key| head::query_value(&head.query, key);
    let (model, group) = match (filter("model_name"), filter("routing_group")) {
        (Ok(m), Ok(g)) => (m, g),
        (Err(e), _) | (_, Err(e)) => {
            return Response::text(400, format!("Failed to deserialize query string: {e}"))
        }
    };
    let sources: std::collections::HashMap<WorkerId, EventSource> =
        ex.ingest().sources().into_iter().collect();
    let block = ex.settings().index.block_size;
    let list = with_view(ex, |v| {
        let mut out = Vec::new();
        for ((m, g), members) in v.partitions() {
            if model.as_ref().is_some_and(|x| x != m) || group.as_ref().is_some_and(|x| x != g) {
                continue;
            }
            let mut by_instance: std::collections::BTreeMap<u64, Vec<&Member>> = Default::default();
            for member in members {
                by_instance.entry(member.instance).or_default().push(member);
            }
            for (instance, ranks) in by_instance {
                let mut endpoints = serde_json::Map::new();
                let mut listeners = serde_json::Map::new();
                for r in ranks {
                    let ep = sources
                        .get(&r.worker)
                        .map_or(String::new(), |s| s.endpoint.clone());
                    listeners.insert(
                        r.rank.to_string(),
                        serde_json::json!({"endpoint": ep, "status": "active"}),
                    );
                    endpoints.insert(r.rank.to_string(), ep.into());
                }
                out.push(serde_json::json!({
                    "instance_id": instance,
                    "source": "zmq",
                    "status": "active",
                    "model_name": m,
                    "routing_group": g,
                    "block_size": block,
                    "endpoints": endpoints,
                    "listeners": listeners,
                }));
            }
        }
        out
    });
    Response::json(200, serde_json::Value::Array(list).to_string().into_bytes())
}

/// A query's request, its chain hashed: what parsing a body comes to.
struct Prepared {
    model: String,
    group: String,
    ks: Ks,
    chain: Vec<u64>,
}

/// Parses a `/query` body and hashes its tokens as the engines' events are rehashed:
/// the model, the LoRA adapter and the cache salt choose the keyspace.
fn prepare(body: &[u8], block: u32) -> Result<Prepared, Rejection> {
    let req = match super::query_body::read(body) {
        Some(req) => req,
        None => json::parse::<json::QueryRequest>(body)?,
    };
    let named = |s: Option<String>| s.filter(|s| !s.is_empty()).unwrap_or_default();
    let keyspace = Keyspace {
        model: req.model_name.clone(),
        lora: named(req.lora_name),
        salt: named(req.cache_salt),
        kind: ChunkKind::Tokens,
    };
    let ks = Ks::of(&keyspace, block);
    Ok(Prepared {
        chain: chain::token_chain(ks.seed, block, &req.token_ids),
        model: req.model_name,
        group: req.routing_group,
        ks,
    })
}

async fn query(ex: &Rc<Executor>, body: Vec<u8>) -> Response {
    let block = ex.settings().index.block_size;
    let prepared = if body.len() < PARSE_ASIDE {
        prepare(&body, block)
    } else {
        let parsing = &ex.metrics().http_parsing_aside;
        ExecutorMetrics::add(parsing, 1);
        let done = super::aside::run(move || prepare(&body, block)).await;
        parsing.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        match done {
            Some(p) => p,
            None => return Response::json(503, json::error("could not parse the body aside")),
        }
    };
    let p = match prepared {
        Ok(p) => p,
        Err(r) => return rejected(r),
    };
    let answered = with_view(ex, |v| {
        let members = v.partition(&p.model, &p.group)?;
        let ids: Vec<WorkerId> = members.iter().map(|m| m.worker).collect();
        let asked = Asked {
            ks: p.ks,
            chain: &p.chain,
            candidates: Candidates::Native(&ids),
            top_k: 0,
            want_runs: false,
            weights: TierWeights::JOINT,
        };
        let tokens = |blocks: u32| blocks.saturating_mul(block);
        Some(ex.query(&asked, |a| {
            let ranks: Vec<RankTokens> = a
                .scores
                .iter()
                .zip(&a.tiers)
                .filter_map(|(&(w, _), d)| {
                    let (instance, rank) = v.rank_of(w)?;
                    Some(RankTokens {
                        instance,
                        rank,
                        gpu: tokens(d.gpu),
                        cpu: tokens(d.cpu),
                        disk: tokens(d.storage),
                    })
                })
                .collect();
            json::scores(&ranks)
        }))
    });
    match answered {
        Some(v) => Response::json(200, v),
        None => Response::json(404, json::error(no_indexer(&p.model, &p.group))),
    }
}

fn no_indexer(model: &str, group: &str) -> String {
    format!("no indexer for model={model} routing_group={group}")
}

/// Dynamo's per-block token hashes are not indexed here (they would cost 8 bytes a
/// block more: docs/design.md): a query by them is a 501, after the checks Dynamo makes
/// first (a cache salt, an unknown partition).
fn query_by_hash(ex: &Rc<Executor>, body: &[u8]) -> Response {
    let req: json::QueryByHashRequest = match json::parse(body) {
        Ok(r) => r,
        Err(r) => return rejected(r),
    };
    if req.cache_salt.is_some() {
        let why = "cache_salt is not accepted by /query_by_hash; block_hashes must already include the intended cache salt";
        return Response::json(400, json::error(why));
    }
    let known = with_view(ex, |v| {
        v.partition(&req.model_name, &req.routing_group).is_some()
    });
    if !known {
        return Response::json(
            404,
            json::error(no_indexer(&req.model_name, &req.routing_group)),
        );
    }
    Response::json(
        501,
        json::error(
            "kvix does not index Dynamo's per-block token hashes: query with /query and token_ids (docs/operations.md, \"HTTP API\")",
        ),
    )
}
