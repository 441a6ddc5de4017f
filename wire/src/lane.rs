//! The lane vocabulary: the one place a lane kind is spelled.
//!
//! A lane is one independently evicted cache group of a worker (vLLM's KV cache
//! group). Every other crate parses and prints lanes through this module, so the
//! names below exist exactly once.

use std::fmt;

use rkyv::{Archive, Deserialize, Serialize};

/// What kind of cache a lane keeps, which decides the prefix positions it can resume from.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug))]
pub enum LaneKind {
    /// Full attention: every block before the hit must be held.
    FullAttention,
    /// Multi-head latent attention: scored like full attention.
    MlaAttention,
    /// Sliding window of `window` tokens: only the blocks covering the window before the hit.
    SlidingWindow { window: u32 },
    /// Chunked local attention with chunks of `chunk` tokens: the hit's chunk up to the hit.
    ChunkedLocal { chunk: u32 },
    /// Recurrent state (Mamba): a saved state exactly at the hit.
    Mamba,
}

/// One lane of a worker's roster: its kind and the engine block size in tokens.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug))]
pub struct Lane {
    pub kind: LaneKind,
    /// Engine block size of this lane in tokens (a multiple of the keyspace block size).
    pub block_tokens: u32,
}

/// A lane description that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaneError {
    #[error("unknown lane kind {0:?} (known: full_attention, mla_attention, sliding_window, chunked_local, mamba)")]
    UnknownKind(String),
    #[error("lane kind {kind} needs a positive {param} (write it as {kind}:N)")]
    MissingParam {
        kind: &'static str,
        param: &'static str,
    },
    #[error("lane kind {0} takes no parameter")]
    UnexpectedParam(&'static str),
    #[error("lane parameter {0:?} is not a positive integer")]
    BadParam(String),
    #[error("lane block size {block} tokens is not a positive multiple of the keyspace block size {keyspace_block}")]
    BlockSize { block: u32, keyspace_block: u32 },
    #[error("a sliding window must be at least 1 token")]
    ZeroWindow,
    #[error("vLLM never reuses {0} blocks across requests, so kvix cannot score them: leave that cache group out of the roster")]
    NotReusable(&'static str),
}

const FULL: &str = "full_attention";
const MLA: &str = "mla_attention";
const SLIDING: &str = "sliding_window";
const CHUNKED: &str = "chunked_local";
const MAMBA: &str = "mamba";
/// vLLM `KVCacheSpecKind`s with no prefix reuse: refused, by name, wherever a kind is read.
const NOT_REUSABLE: [&str; 3] = ["encoder_only_attention", "cross_attention", "unknown"];

impl LaneKind {
    /// The canonical name of the kind, without its parameter.
    pub fn name(&self) -> &'static str {
        match self {
            LaneKind::FullAttention => FULL,
            LaneKind::MlaAttention => MLA,
            LaneKind::SlidingWindow { .. } => SLIDING,
            LaneKind::ChunkedLocal { .. } => CHUNKED,
            LaneKind::Mamba => MAMBA,
        }
    }

    /// Builds a kind from its name and optional parameter (window or chunk, in tokens).
    ///
    /// Accepts vLLM's spellings too, so the event ingest and the CLI share this one
    /// decoder: every `KVCacheSpecKind` of vLLM 0.34 maps to a kind (`sink_full_attention`
    /// is full attention, `sliding_window_mla` a sliding window) or is refused with
    /// [`LaneError::NotReusable`] (`encoder_only_attention`, `cross_attention`, `unknown`).
    pub fn from_parts(name: &str, param: Option<u32>) -> Result<Self, LaneError> {
        let positive = |kind, what| match param {
            Some(v) if v > 0 => Ok(v),
            _ => Err(LaneError::MissingParam { kind, param: what }),
        };
        let bare = |kind: LaneKind| match param {
            None => Ok(kind),
            Some(_) => Err(LaneError::UnexpectedParam(kind.name())),
        };
        match name {
            FULL | "full" | "attention" | "sink_full_attention" => bare(LaneKind::FullAttention),
            MLA | "mla" => bare(LaneKind::MlaAttention),
            SLIDING | "sliding_window_attention" | "swa" | "sliding_window_mla" => {
                Ok(LaneKind::SlidingWindow {
                    window: positive(SLIDING, "window")?,
                })
            }
            CHUNKED | "chunked_local_attention" => Ok(LaneKind::ChunkedLocal {
                chunk: positive(CHUNKED, "chunk")?,
            }),
            MAMBA | "mamba2" | "recurrent" => bare(LaneKind::Mamba),
            other => match NOT_REUSABLE.iter().find(|k| **k == other) {
                Some(k) => Err(LaneError::NotReusable(k)),
                None => Err(LaneError::UnknownKind(other.to_string())),
            },
        }
    }

    /// Parses the text form `name` or `name:param` (e.g. `sliding_window:4096`).
    pub fn parse(text: &str) -> Result<Self, LaneError> {
        let (name, param) = match text.split_once(':') {
            Some((n, p)) => {
                let v: u32 = p
                    .trim()
                    .parse()
                    .map_err(|_| LaneError::BadParam(p.to_string()))?;
                (n.trim(), Some(v))
            }
            None => (text.trim(), None),
        };
        Self::from_parts(name, param)
    }

    /// Whether acceptance is monotone in the hit length (every block from 0 must be held).
    pub fn is_full(&self) -> bool {
        matches!(self, LaneKind::FullAttention | LaneKind::MlaAttention)
    }
}

impl fmt::Display for LaneKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaneKind::SlidingWindow { window } => write!(f, "{SLIDING}:{window}"),
            LaneKind::ChunkedLocal { chunk } => write!(f, "{CHUNKED}:{chunk}"),
            other => f.write_str(other.name()),
        }
    }
}

impl Lane {
    /// A plain worker's only lane: full attention in keyspace-sized blocks.
    pub fn full(block_tokens: u32) -> Self {
        Lane {
            kind: LaneKind::FullAttention,
            block_tokens,
        }
    }

    /// Parses `kind[:param]@block_tokens`, e.g. `sliding_window:4096@16` or `mamba@64`.
    pub fn parse(text: &str) -> Result<Self, LaneError> {
        let (kind, block) = text
            .rsplit_once('@')
            .ok_or_else(|| LaneError::BadParam(format!("{text} (expected kind@block_tokens)")))?;
        let block_tokens: u32 = block
            .trim()
            .parse()
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| LaneError::BadParam(block.to_string()))?;
        Ok(Lane {
            kind: LaneKind::parse(kind)?,
            block_tokens,
        })
    }

    /// Checks the lane against a token keyspace's block size and returns its engine
    /// block size in keyspace blocks.
    pub fn blocks_in(&self, keyspace_block: u32) -> Result<u32, LaneError> {
        if keyspace_block == 0
            || self.block_tokens == 0
            || !self.block_tokens.is_multiple_of(keyspace_block)
        {
            return Err(LaneError::BlockSize {
                block: self.block_tokens,
                keyspace_block,
            });
        }
        Ok(self.block_tokens / keyspace_block)
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.kind, self.block_tokens)
    }
}

impl ArchivedLaneKind {
    /// The native kind of an archived (possibly zero-copy) lane kind.
    pub fn to_native(&self) -> LaneKind {
        match self {
            ArchivedLaneKind::FullAttention => LaneKind::FullAttention,
            ArchivedLaneKind::MlaAttention => LaneKind::MlaAttention,
            ArchivedLaneKind::SlidingWindow { window } => LaneKind::SlidingWindow {
                window: window.to_native(),
            },
            ArchivedLaneKind::ChunkedLocal { chunk } => LaneKind::ChunkedLocal {
                chunk: chunk.to_native(),
            },
            ArchivedLaneKind::Mamba => LaneKind::Mamba,
        }
    }
}

impl ArchivedLane {
    pub fn to_native(&self) -> Lane {
        Lane {
            kind: self.kind.to_native(),
            block_tokens: self.block_tokens.to_native(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips_for_every_kind() {
        for kind in [
            LaneKind::FullAttention,
            LaneKind::MlaAttention,
            LaneKind::SlidingWindow { window: 4096 },
            LaneKind::ChunkedLocal { chunk: 8192 },
            LaneKind::Mamba,
        ] {
            assert_eq!(LaneKind::parse(&kind.to_string()), Ok(kind));
            let lane = Lane {
                kind,
                block_tokens: 32,
            };
            assert_eq!(Lane::parse(&lane.to_string()), Ok(lane));
        }
    }

    #[test]
    fn every_vllm_spec_kind_maps_to_a_lane_kind_or_is_refused_by_name() {
        // vLLM 0.34's KVCacheSpecKind values, as its events spell them.
        let window = Some(128);
        for (kind, param, want) in [
            ("full_attention", None, Ok(LaneKind::FullAttention)),
            ("mla_attention", None, Ok(LaneKind::MlaAttention)),
            ("sink_full_attention", None, Ok(LaneKind::FullAttention)),
            (
                "sliding_window",
                window,
                Ok(LaneKind::SlidingWindow { window: 128 }),
            ),
            (
                "sliding_window_mla",
                window,
                Ok(LaneKind::SlidingWindow { window: 128 }),
            ),
            (
                "chunked_local_attention",
                window,
                Ok(LaneKind::ChunkedLocal { chunk: 128 }),
            ),
            ("mamba", None, Ok(LaneKind::Mamba)),
            (
                "encoder_only_attention",
                None,
                Err(LaneError::NotReusable("encoder_only_attention")),
            ),
            (
                "cross_attention",
                None,
                Err(LaneError::NotReusable("cross_attention")),
            ),
            ("unknown", None, Err(LaneError::NotReusable("unknown"))),
        ] {
            assert_eq!(LaneKind::from_parts(kind, param), want, "{kind}");
        }
        assert!(LaneKind::parse("cross_attention")
            .unwrap_err()
            .to_string()
            .contains("leave that cache group out"));
    }

    #[test]
    fn unknown_and_malformed_kinds_are_typed_errors() {
        assert_eq!(
            LaneKind::parse("linear_attention"),
            Err(LaneError::UnknownKind("linear_attention".into()))
        );
        assert!(matches!(
            LaneKind::parse("sliding_window"),
            Err(LaneError::MissingParam { .. })
        ));
        assert!(matches!(
            LaneKind::parse("sliding_window:0"),
            Err(LaneError::MissingParam { .. })
        ));
        assert!(matches!(
            LaneKind::parse("mamba:3"),
            Err(LaneError::UnexpectedParam("mamba"))
        ));
        assert!(matches!(
            LaneKind::parse("chunked_local:x"),
            Err(LaneError::BadParam(_))
        ));
        assert!(Lane::parse("mamba").is_err());
        assert!(Lane::parse("mamba@0").is_err());
    }

    #[test]
    fn vllm_spellings_decode_to_the_same_kinds() {
        assert_eq!(
            LaneKind::from_parts("chunked_local_attention", Some(8)),
            Ok(LaneKind::ChunkedLocal { chunk: 8 })
        );
        assert_eq!(
            LaneKind::from_parts("full", None),
            Ok(LaneKind::FullAttention)
        );
    }

    #[test]
    fn block_size_must_be_a_multiple_of_the_keyspace_block() {
        assert_eq!(Lane::full(64).blocks_in(16), Ok(4));
        assert!(Lane::full(24).blocks_in(16).is_err());
        assert!(Lane::full(8).blocks_in(16).is_err());
    }
}
