//! `trace`: the Mooncake trace (`shared/data/mooncake_synthetic_trace.jsonl`) — parsing,
//! the `hash_ids` → chain mapping, and the in-process replay.
//!
//! A trace block is 512 tokens and `hash_ids` are prefix-aware (equal id at equal
//! position = reusable block), so the ids of a request form a chain the same way token
//! blocks do: block `i`'s chain hash is the kvix chain hasher over that block's id, seeded
//! by block `i − 1`'s chain hash (block 0: the keyspace seed). Each trace block can be
//! split into `sub` keyspace blocks (`sub = 32` gives 16-token blocks, the length the
//! index would see from a real 512-token-block prompt at block size 16).

use std::io::BufRead;
use std::path::Path;

use kvix_wire::chain::chain_tokens;
use serde::{Deserialize, Serialize};

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival, ms from the start of the trace.
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// A line of the trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: line {line}: {msg}")]
    Line {
        path: String,
        line: usize,
        msg: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// Parses a JSON-lines trace; blank lines are skipped, anything else that is not a
/// record is an error naming its 1-based line.
pub fn parse_trace(reader: impl BufRead, name: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: name.to_string(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: TraceRecord = serde_json::from_str(&line).map_err(|e| TraceError::Line {
            path: name.to_string(),
            line: i + 1,
            msg: e.to_string(),
        })?;
        if !rec.timestamp.is_finite() || rec.timestamp < 0.0 {
            return Err(TraceError::Line {
                path: name.to_string(),
                line: i + 1,
                msg: format!("timestamp {} is not a non-negative number", rec.timestamp),
            });
        }
        out.push(rec);
    }
    Ok(out)
}

/// Reads the trace file at `path`.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let name = path.display().to_string();
    let f = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    parse_trace(std::io::BufReader::new(f), &name)
}

/// The chain of a request: `sub` keyspace blocks per trace block, each hashed by the
/// kvix chain hasher over the tokens `[id_lo, id_hi, j]`, seeded by the previous block.
pub fn trace_chain(seed: u64, sub: u32, hash_ids: &[u64]) -> Vec<u64> {
    let sub = sub.max(1);
    let mut tokens = Vec::with_capacity(hash_ids.len() * sub as usize * 3);
    for &id in hash_ids {
        for j in 0..sub {
            tokens.extend_from_slice(&[id as u32, (id >> 32) as u32, j]);
        }
    }
    let mut out = Vec::with_capacity(hash_ids.len() * sub as usize);
    chain_tokens(seed, 3, &tokens, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_names_the_bad_one() {
        let text = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [0, 1]}\n\
                    \n\
                    {\"timestamp\": 12.5, \"input_length\": 600, \"output_length\": 9, \"hash_ids\": [0]}\n";
        let recs = parse_trace(text.as_bytes(), "t").unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[1].hash_ids, vec![0]);
        assert_eq!(recs[1].timestamp, 12.5);

        let bad = format!("{text}{{\"timestamp\": 13, \"input_length\": 1}}\n");
        let err = parse_trace(bad.as_bytes(), "t").unwrap_err().to_string();
        assert!(err.starts_with("t: line 4: "), "{err}");
        assert!(err.contains("output_length"), "{err}");

        let err = parse_trace("not json\n".as_bytes(), "x")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("x: line 1: "), "{err}");
    }

    #[test]
    fn shared_prefixes_give_equal_chains() {
        let a = trace_chain(7, 1, &[0, 1, 2, 3]);
        let b = trace_chain(7, 1, &[0, 1, 9, 3]);
        assert_eq!(a.len(), 4);
        assert_eq!(a[..2], b[..2]);
        // Once the prefix differs, every later hash differs, even for an equal id.
        assert_ne!(a[2], b[2]);
        assert_ne!(a[3], b[3]);
        // The same id at another position is another block.
        let c = trace_chain(7, 1, &[1]);
        assert_ne!(c[0], a[1]);
        // Sub-blocks extend the chain; its prefix matches on whole trace blocks.
        let s = trace_chain(7, 4, &[0, 1]);
        let t = trace_chain(7, 4, &[0, 5]);
        assert_eq!(s.len(), 8);
        assert_eq!(s[..4], t[..4]);
        assert_ne!(s[4], t[4]);
        // Another keyspace seed: nothing in common.
        assert!(trace_chain(8, 1, &[0, 1])
            .iter()
            .zip(&a)
            .all(|(x, y)| x != y));
    }
}
