//! Queries: hashed here, sent to the primary server and hedged to another one when the
//! primary is slow, answered by the deadline whatever happens (fail open).

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvix_wire::{Answer, ChunkKind, ErrorCode, ErrorReply, Keyspace, Kind, Query};

use crate::conn::Reply;
use crate::types::{Prompt, QueryOptions, QueryOutcome, WorkerScore};
use crate::wait::Waited;
use crate::{Client, ClientError};

impl Client {
    /// Queries by token ids. See [`Client::query`].
    pub async fn query_tokens(
        &self,
        keyspace: &Keyspace,
        tokens: &[u32],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Tokens(tokens), opts).await
    }

    /// Queries by a string prompt, in the byte kind of `keyspace`. See [`Client::query`].
    pub async fn query_bytes(
        &self,
        keyspace: &Keyspace,
        prompt: impl AsRef<[u8]>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Bytes(prompt.as_ref()), opts)
            .await
    }

    /// Queries by a chain the caller hashed. See [`Client::query`].
    pub async fn query_chain(
        &self,
        keyspace: &Keyspace,
        chain: &[u64],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Chain(chain), opts).await
    }

    /// Asks the primary server which workers can reuse how much of `prompt`.
    ///
    /// Never waits past the deadline (`opts.deadline` or the configured one) and never
    /// fails: with no server up it answers `Disconnected` at once, and a lost or
    /// misbehaving connection answers `Disconnected` to the queries it carried. The
    /// keyspace's kind is set from the prompt (tokens or bytes), except for a chain.
    pub async fn query(
        &self,
        keyspace: &Keyspace,
        prompt: Prompt<'_>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        let start = Instant::now();
        let until = start + opts.deadline.unwrap_or(self.shared.cfg.deadline);
        let outcome = self.query_inner(keyspace, prompt, opts, until).await;
        self.shared.counters.record_query(&outcome, start.elapsed());
        outcome
    }

    async fn query_inner(
        &self,
        keyspace: &Keyspace,
        prompt: Prompt<'_>,
        opts: &QueryOptions,
        until: Instant,
    ) -> QueryOutcome {
        let sh = &self.shared;
        let Some((slot, conn)) = sh.primary() else {
            return QueryOutcome::Disconnected;
        };
        let mut candidates = Vec::with_capacity(opts.candidates.len());
        for c in &opts.candidates {
            if let Some(id) = sh.id_on(slot, c) {
                candidates.push(id);
            }
        }
        if !opts.candidates.is_empty() && candidates.is_empty() {
            return QueryOutcome::Empty;
        }
        let (keyspace, chain) = match prompt {
            Prompt::Tokens(t) => {
                let ks = Keyspace {
                    kind: ChunkKind::Tokens,
                    ..keyspace.clone()
                };
                let chain = self.token_chain(&ks, t);
                (ks, chain)
            }
            Prompt::Bytes(b) => {
                let ks = Keyspace {
                    kind: ChunkKind::Bytes,
                    ..keyspace.clone()
                };
                let chain = self.byte_chain(&ks, b);
                (ks, chain)
            }
            Prompt::Chain(c) => (keyspace.clone(), c.to_vec()),
        };
        let q = Query {
            keyspace,
            chain,
            candidates,
            top_k: opts.top_k,
            want_runs: false,
        };
        let reply = match sh.call(&conn, &q, Kind::Answer, until).await {
            Ok(Waited::Reply(r)) => r,
            Ok(Waited::Closed) => return QueryOutcome::Disconnected,
            Ok(Waited::TimedOut) => return QueryOutcome::Timeout,
            Err(ClientError::Encode(m)) => {
                return QueryOutcome::Rejected(ErrorReply {
                    code: ErrorCode::BadFrame,
                    message: m,
                })
            }
            Err(_) => return QueryOutcome::Disconnected,
        };
        match reply {
            Reply::Answer(a) => self.outcome(slot, a),
            Reply::Error(e) => QueryOutcome::Rejected(e),
            _ => QueryOutcome::Disconnected,
        }
    }

    fn outcome(&self, slot: usize, a: Answer) -> QueryOutcome {
        let c = &self.shared.counters.n.unscorable;
        c.fetch_add(u64::from(a.unscorable), Ordering::Relaxed);
        if a.scores.is_empty() {
            return QueryOutcome::Empty;
        }
        let ids = self.shared.slots[slot].ids.lock().ok();
        QueryOutcome::Scores(
            a.scores
                .iter()
                .map(|s| WorkerScore {
                    worker: s.worker,
                    name: ids.as_ref().and_then(|m| m.by_id.get(&s.worker).cloned()),
                    blocks: s.blocks,
                })
                .collect(),
        )
    }
}
