//! Queries: hashed here, sent to the primary server and hedged to another one when the
//! primary is slow, sent again to the next server up when a connection is lost under
//! them, answered by the deadline whatever happens (fail open).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvix_wire::{ErrorCode, ErrorReply, Keyspace, Kind, TierWeights, TieredAnswer, TieredQuery};

use crate::conn::Reply;
use crate::counters::Counters;
use crate::roster::Want;
use crate::types::{Prompt, QueryOptions, QueryOutcome, WorkerScore};
use crate::wait::{wait_either, wait_reply, Until, Waited};
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
        if sh.primary().is_none() {
            return QueryOutcome::Disconnected;
        }
        let (keyspace, chain) = self.prompt_chain(keyspace, prompt);
        let mut q = TieredQuery {
            keyspace,
            chain,
            candidates: Vec::new(),
            top_k: opts.top_k,
            want_runs: false,
            weights: opts.weights.unwrap_or(sh.cfg.tier_weights),
        };
        // Servers whose connection was lost under this query: it goes to the next one
        // up while time is left, so a server dying fails no query another could answer.
        let mut lost: Vec<usize> = Vec::new();
        // The first answer of a replica that said it is behind its log: kept in case no
        // other replica answers (a stale answer is better than none).
        let mut stale: Option<(usize, TieredAnswer)> = None;
        loop {
            let live = sh.live_conns();
            let mut fresh = live.into_iter().filter(|(i, _)| !lost.contains(i));
            let Some((slot, conn)) = fresh.next() else {
                return match stale {
                    Some((slot, a)) => self.named(slot, a, q.weights, until).await,
                    None => QueryOutcome::Disconnected,
                };
            };
            if !lost.is_empty() {
                Counters::bump(&sh.counters.n.failovers);
            }
            q.candidates = sh.ids_on(slot, &opts.candidates);
            if q.candidates.len() < opts.candidates.len() {
                // Names this client has not seen: announced lately, by another client.
                let missing = sh.unresolved(slot, &opts.candidates);
                if !missing.is_empty() {
                    if sh
                        .learn(slot, Want::Names(&missing), Instant::now(), until)
                        .await
                    {
                        q.candidates = sh.ids_on(slot, &opts.candidates);
                    }
                    let still = sh.unresolved(slot, &opts.candidates).len() as u64;
                    sh.counters
                        .n
                        .unknown_workers
                        .fetch_add(still, Ordering::Relaxed);
                }
            }
            if !opts.candidates.is_empty() && q.candidates.is_empty() {
                return QueryOutcome::Empty;
            }
            let mut hedged_to = None;
            let attempt = match (fresh.next(), self.hedge_at(until)) {
                (Some(second), Some(at)) => {
                    hedged_to = Some(second.0);
                    self.hedged(&q, opts, (slot, conn), second, at, until).await
                }
                _ => match sh.call(&conn, &q, Kind::TieredAnswer, until).await {
                    Ok(w) => Ok((slot, w)),
                    Err(e) => Err(failed(e)),
                },
            };
            let (slot, reply) = match attempt {
                Ok((_, Waited::Closed)) | Err(QueryOutcome::Disconnected)
                    if Instant::now() < until =>
                {
                    // Both lost when a hedge went out (it goes at once to a lost primary).
                    lost.push(slot);
                    lost.extend(hedged_to);
                    continue;
                }
                Ok((slot, Waited::Reply(r))) => (slot, r),
                Ok((_, Waited::Closed)) | Ok((_, Waited::TimedOut)) | Err(_) if stale.is_some() => {
                    let (slot, a) = stale.take().expect("kept");
                    return self.named(slot, a, q.weights, until).await;
                }
                Ok((_, Waited::Closed)) => return QueryOutcome::Disconnected,
                Ok((_, Waited::TimedOut)) => return QueryOutcome::Timeout,
                Err(outcome) => return outcome,
            };
            if let Reply::Answer(a) = &reply {
                if a.stale && Instant::now() < until {
                    // That replica is behind its log (healing, or stopped): ask the next.
                    Counters::bump(&sh.counters.n.stale_answers);
                    lost.push(slot);
                    if stale.is_none() {
                        let Reply::Answer(a) = reply else {
                            unreachable!("matched")
                        };
                        stale = Some((slot, a));
                    }
                    continue;
                }
            }
            return match reply {
                Reply::Answer(a) => self.named(slot, a, q.weights, until).await,
                Reply::Error(e) => QueryOutcome::Rejected(e),
                _ => QueryOutcome::Disconnected,
            };
        }
    }

    /// When to hedge a query that must be answered by `until`, if at all.
    fn hedge_at(&self, until: Instant) -> Option<Instant> {
        let cfg = &self.shared.cfg;
        let now = Instant::now();
        let budget = until.saturating_duration_since(now);
        let after = match cfg.hedge_after {
            Some(d) => d,
            None => self
                .shared
                .counters
                .latency_quantile(0.95)
                .unwrap_or(budget / 4)
                .max(Duration::from_micros(100))
                .min(budget / 2),
        };
        (after < budget).then(|| now + after)
    }

    /// Sends `q` to the primary and, if it has not answered by `hedge_at`, to `second`
    /// too: the first answer wins. Returns the answering server's slot and its reply.
    async fn hedged(
        &self,
        q: &TieredQuery,
        opts: &QueryOptions,
        (slot, conn): (usize, std::sync::Arc<crate::conn::Conn>),
        (slot2, conn2): (usize, std::sync::Arc<crate::conn::Conn>),
        hedge_at: Instant,
        until: Instant,
    ) -> Result<(usize, Waited), QueryOutcome> {
        let sh = &self.shared;
        let id = conn.next_id();
        let Some(mut rx) = sh
            .send_request(&conn, id, q, 0, Some(Kind::TieredAnswer))
            .map_err(failed)?
        else {
            return Err(QueryOutcome::Disconnected);
        };
        // Hedge when the primary is slow, and at once when its connection went.
        let primary_gone =
            match wait_reply(&mut rx, hedge_at, Until::Reached, sh.cfg.spin_before_park).await {
                Waited::TimedOut => false,
                Waited::Closed => true,
                w => return Ok((slot, w)),
            };
        // The candidates as the second server numbers them.
        let mut q2 = q.clone();
        q2.candidates = sh.ids_on(slot2, &opts.candidates);
        let id2 = conn2.next_id();
        let Ok(Some(mut rx2)) = sh.send_request(&conn2, id2, &q2, 0, Some(Kind::TieredAnswer))
        else {
            if primary_gone {
                return Ok((slot, Waited::Closed));
            }
            let w = wait_reply(&mut rx, until, Until::Kept, None).await;
            if matches!(w, Waited::TimedOut) {
                conn.forget(id);
            }
            return Ok((slot, w));
        };
        Counters::bump(&sh.counters.n.hedges);
        if primary_gone {
            // The primary's reply channel is finished: wait on the hedge alone.
            let w = wait_reply(&mut rx2, until, Until::Kept, sh.cfg.spin_before_park).await;
            match w {
                Waited::Reply(_) => Counters::bump(&sh.counters.n.hedges_won),
                Waited::TimedOut => conn2.forget(id2),
                Waited::Closed => {}
            }
            return Ok((slot2, w));
        }
        let (first, w) = wait_either(&mut rx, &mut rx2, until).await;
        conn.forget(id);
        conn2.forget(id2);
        if first == 1 && matches!(w, Waited::Reply(_)) {
            Counters::bump(&sh.counters.n.hedges_won);
        }
        Ok((if first == 0 { slot } else { slot2 }, w))
    }

    /// The answer's outcome, every score named: ids this client cannot name are
    /// looked up in the server's roster first, while the deadline allows.
    async fn named(
        &self,
        slot: usize,
        a: TieredAnswer,
        weights: TierWeights,
        until: Instant,
    ) -> QueryOutcome {
        let sh = &self.shared;
        let known = sh.slots[slot].ids.lock().map_or(0, |m| m.reissued);
        if a.reissued != known {
            sh.learn(slot, Want::Reissued(a.reissued), Instant::now(), until)
                .await;
        }
        let lowest = sh.slots[slot].ids.lock().ok().and_then(|ids| {
            a.scores
                .iter()
                .map(|s| s.worker)
                .filter(|w| !ids.by_id.contains_key(w))
                .min()
        });
        if let Some(id) = lowest {
            sh.learn(slot, Want::Ids(id), Instant::now(), until).await;
        }
        self.outcome(slot, a, weights)
    }

    fn outcome(&self, slot: usize, a: TieredAnswer, weights: TierWeights) -> QueryOutcome {
        let c = &self.shared.counters.n.unscorable;
        c.fetch_add(u64::from(a.unscorable), Ordering::Relaxed);
        if a.scores.is_empty() {
            return QueryOutcome::Empty;
        }
        // Names learnt under another reissue count may be an id's old worker's: none
        // is better than a wrong one (the roster could not be listed again in time).
        let ids = self.shared.slots[slot]
            .ids
            .lock()
            .ok()
            .filter(|m| m.reissued == a.reissued);
        QueryOutcome::Scores(
            a.scores
                .iter()
                .map(|s| WorkerScore {
                    worker: s.worker,
                    name: ids.as_ref().and_then(|m| m.by_id.get(&s.worker).cloned()),
                    blocks: s.tiers.storage,
                    tiers: s.tiers,
                    reuse: s.tiers.weighed(&weights),
                    history_lost: a.history_lost.contains(&s.worker),
                    suspect: s.suspect,
                })
                .collect(),
        )
    }
}

/// A request that could not be sent, as the query's outcome.
fn failed(e: ClientError) -> QueryOutcome {
    match e {
        ClientError::Encode(m) => QueryOutcome::Rejected(ErrorReply {
            code: ErrorCode::BadFrame,
            message: m,
        }),
        _ => QueryOutcome::Disconnected,
    }
}
