//! An error that goes back to the client as an `ErrorReply`.

use kvix_engine::EngineError;
use kvix_wire::ErrorCode;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        let code = match e {
            EngineError::UnknownWorker(_) => ErrorCode::UnknownWorker,
            EngineError::LanesInByteKeyspace { .. } => ErrorCode::LanesInByteKeyspace,
            EngineError::Roster(_)
            | EngineError::WrongFeed { .. }
            | EngineError::Refused { .. } => ErrorCode::BadLane,
            EngineError::BadSequence { .. } => ErrorCode::BadSequence,
            EngineError::Index(_) => ErrorCode::Internal,
        };
        Failure::new(code, e.to_string())
    }
}
