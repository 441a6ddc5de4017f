//! A query as an executor answers it, whoever asked: a v4 `Query` (ranked by joint
//! reuse), a v5 `TieredQuery` (ranked by reuse weighed by tier), the HTTP API's
//! `/query`. Each is read in place; only its candidates are copied (into the
//! executor's scratch).

use kvix_engine::Ks;
use kvix_wire::{ArchivedQuery, ArchivedTieredQuery, TierWeights, WorkerId};
use rkyv::rend::u32_le;
use rkyv::vec::ArchivedVec;

use crate::failure::Failure;

/// The workers a query scores: all (empty), or the ones listed.
#[derive(Debug, Clone, Copy)]
pub enum Candidates<'a> {
    Archived(&'a ArchivedVec<u32_le>),
    Native(&'a [WorkerId]),
}

impl Candidates<'_> {
    pub fn is_empty(&self) -> bool {
        match self {
            Candidates::Archived(v) => v.is_empty(),
            Candidates::Native(v) => v.is_empty(),
        }
    }

    /// Appends the listed workers to `out`.
    pub fn copy_to(&self, out: &mut Vec<WorkerId>) {
        match self {
            Candidates::Archived(v) => out.extend(v.iter().map(|w| w.to_native())),
            Candidates::Native(v) => out.extend_from_slice(v),
        }
    }
}

/// What a query asks (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    pub ks: Ks,
    pub chain: &'a [u64],
    pub candidates: Candidates<'a>,
    pub top_k: u32,
    pub want_runs: bool,
    pub weights: TierWeights,
}

impl<'a> Asked<'a> {
    /// A v4 query on a server hashing `block`-token blocks: every tier counts as GPU.
    pub fn joint(q: &'a ArchivedQuery, block: u32) -> Self {
        Asked {
            ks: Ks {
                seed: q.keyspace.seed(block),
                kind: q.keyspace.kind(),
            },
            chain: kvix_wire::u64s(&q.chain),
            candidates: Candidates::Archived(&q.candidates),
            top_k: q.top_k.to_native(),
            want_runs: q.want_runs,
            weights: TierWeights::JOINT,
        }
    }

    /// A v5 query; its tier weights must be numbers in `[0, 1]`.
    pub fn tiered(q: &'a ArchivedTieredQuery, block: u32) -> Result<Self, Failure> {
        let weights = TierWeights {
            cpu: q.weights.cpu.to_native(),
            storage: q.weights.storage.to_native(),
        };
        if !weights.is_valid() {
            return Err(Failure::protocol(
                kvix_wire::ErrorCode::BadRequest,
                format!(
                    "tier weights are numbers in [0, 1], not cpu {} and storage {}",
                    weights.cpu, weights.storage
                ),
            ));
        }
        Ok(Asked {
            ks: Ks {
                seed: q.keyspace.seed(block),
                kind: q.keyspace.kind(),
            },
            chain: kvix_wire::u64s(&q.chain),
            candidates: Candidates::Archived(&q.candidates),
            top_k: q.top_k.to_native(),
            want_runs: q.want_runs,
            weights,
        })
    }
}
