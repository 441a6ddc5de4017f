//! Why a request failed: the typed cause travels with the failure (across executors, out
//! of the write queue) and becomes an `ErrorReply` only at the frame edge
//! ([`Failure::code`] and its message).

use std::sync::Arc;

use kvix_engine::{EngineError, RosterError};
use kvix_wire::{ErrorCode, FrameError, WorkerId};

use crate::durable::wal::WalError;
use crate::ingest::SourceError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Failure {
    /// The engine refused the write (unknown worker, bad sequence, a refused event…).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The registry refused an announce's roster.
    #[error(transparent)]
    Roster(#[from] RosterError),
    /// An announce's event source: its form, the sources limit, the allowed networks.
    #[error("worker {worker:?}: {source}")]
    Source {
        worker: String,
        #[source]
        source: SourceError,
    },
    /// An announce's name empty or over its length limit.
    #[error("a worker name is 1 to {max} bytes, not {len}")]
    NameLength { len: usize, max: usize },
    /// A field of an announce's event source over its length limit.
    #[error("worker {worker:?}: the source's {field} is at most {max} bytes, not {len}")]
    SourceField {
        worker: String,
        field: &'static str,
        max: usize,
        len: usize,
    },
    /// A write body that does not validate where it is read again.
    #[error("{what}: {source}")]
    Invalid {
        what: &'static str,
        #[source]
        source: FrameError,
    },
    /// `--max-blocks` reached: batches that store blocks wait for removals.
    #[error("the index holds {held} blocks (--max-blocks {max}): batches that store blocks are refused until removals make room")]
    IndexFull { held: u64, max: u64 },
    /// The answer would be over `--max-frame`.
    #[error("the answer is {bytes} bytes, over --max-frame {max}: ask without want_runs, or name candidates")]
    AnswerTooLarge { bytes: usize, max: usize },
    /// The write-ahead log refused the append (a full disk…).
    #[error("the write was not accepted: {0}")]
    Wal(Arc<WalError>),
    /// The replicas' shared log cannot take the write now (Redis away, full, failing
    /// over, or this replica stopped following it).
    #[error("{0}")]
    LogUnavailable(String),
    /// An engine delivery that does not continue the last batch applied from its stream
    /// (one before it was refused, or it was applied already): dropped, and the stream
    /// rewound to the last batch applied.
    #[error(
        "worker {worker}: the delivery does not continue the last batch applied from its stream"
    )]
    OutOfStep { worker: WorkerId },
    /// The process is stopping.
    #[error("the server is stopping")]
    Stopping,
    /// A request that breaks the protocol (before Hello, a second Hello, a reply sent as
    /// a request, a wrong token or block size).
    #[error("{message}")]
    Protocol { code: ErrorCode, message: String },
    /// A path that should not be taken.
    #[error("{0} (a bug)")]
    Bug(&'static str),
}

impl Failure {
    /// The code the client reads.
    pub fn code(&self) -> ErrorCode {
        match self {
            Failure::Engine(e) => match e {
                EngineError::UnknownWorker(_) => ErrorCode::UnknownWorker,
                EngineError::LanesInByteKeyspace { .. } => ErrorCode::LanesInByteKeyspace,
                EngineError::Roster(_)
                | EngineError::WrongFeed { .. }
                | EngineError::Refused { .. } => ErrorCode::BadLane,
                EngineError::BadSequence { .. } => ErrorCode::BadSequence,
                EngineError::Index(_) => ErrorCode::Internal,
            },
            Failure::Roster(_) => ErrorCode::BadLane,
            Failure::Source {
                source: SourceError::TooMany { .. },
                ..
            } => ErrorCode::TooManySources,
            Failure::Source { .. } => ErrorCode::BadSource,
            Failure::NameLength { .. } => ErrorCode::BadLane,
            Failure::SourceField { .. } => ErrorCode::BadSource,
            Failure::Invalid { .. } => ErrorCode::BadFrame,
            Failure::IndexFull { .. } => ErrorCode::Overloaded,
            Failure::AnswerTooLarge { .. } => ErrorCode::TooLarge,
            Failure::Wal(_) | Failure::Stopping | Failure::Bug(_) | Failure::OutOfStep { .. } => {
                ErrorCode::Internal
            }
            Failure::LogUnavailable(_) => ErrorCode::LogUnavailable,
            Failure::Protocol { code, .. } => *code,
        }
    }

    /// A protocol refusal with its code.
    pub fn protocol(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure::Protocol {
            code,
            message: message.into(),
        }
    }
}
