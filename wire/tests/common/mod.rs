//! The messages of docs/protocol.md §8's worked examples, each named after its
//! `hex:NAME` dump: protocol_doc.rs checks that the dumps are their encoding, and
//! vectors.rs carries them to the Go side as its `doc-NAME` vectors.

use kvix_wire::*;

pub fn hello() -> Hello {
    Hello {
        client: "gw-1".into(),
        token_block: 16,
        auth: Some("s3cr3t".into()),
    }
}

/// §8.2: the first two chain hashes of the golden vectors (`chain/base/b16/0`, `/1`).
pub fn query() -> Query {
    Query {
        keyspace: Keyspace::tokens("meta-llama/Llama-3.1-8B"),
        chain: vec![0x884d_938a_f32e_36f4, 0x56ef_dfc1_cc32_333e],
        candidates: vec![7],
        top_k: 4,
        want_runs: false,
    }
}

pub fn retire() -> Retire {
    Retire { worker: 7 }
}

/// §8.4: the fields of §8.2's `Query`, weighed as Dynamo's router weighs tiers.
pub fn tiered_query() -> TieredQuery {
    weighed_as_dynamo(query())
}

/// `q`'s fields in a v5 `TieredQuery`, weighed as Dynamo's router weighs tiers.
pub fn weighed_as_dynamo(q: Query) -> TieredQuery {
    let Query {
        keyspace,
        chain,
        candidates,
        top_k,
        want_runs,
    } = q;
    TieredQuery {
        keyspace,
        chain,
        candidates,
        top_k,
        want_runs,
        weights: TierWeights::DYNAMO,
    }
}

pub fn tiered_answer() -> TieredAnswer {
    TieredAnswer {
        scores: vec![TieredScore {
            worker: 7,
            tiers: Depths {
                gpu: 1,
                cpu: 2,
                storage: 2,
            },
            suspect: None,
        }],
        unscorable: 0,
        runs: vec![],
        history_lost: vec![],
        reissued: 0,
        stale: false,
    }
}
