//! Typed errors of the control calls and of [`crate::Client::connect`].

use std::sync::Arc;

use kvix_wire::{ErrorCode, ErrorReply};
use thiserror::Error;

use crate::Addr;

/// Why a control call (announce, retire, stats, echo) or `connect` failed. Queries never
/// fail: they answer a [`crate::QueryOutcome`].
#[derive(Debug, Clone, Error)]
pub enum ClientError {
    /// The configuration cannot work.
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// No server connection is up (the client keeps reconnecting in the background).
    #[error("no kvix server is connected")]
    NotConnected,
    /// The reply did not come within the request timeout.
    #[error("no reply within the request timeout")]
    Timeout,
    /// The connection was lost (or closed for a malformed reply) before the reply.
    #[error("connection lost before the reply came")]
    Disconnected,
    /// The server answered the request with an error.
    #[error("server refused the request: {}", describe(.0))]
    Rejected(ErrorReply),
    /// The server refused the handshake (block size mismatch, bad auth token, ...).
    #[error("server {addr} refused the handshake: {}", describe(.reply))]
    Refused {
        /// The server that refused.
        addr: Addr,
        /// What it said.
        reply: ErrorReply,
    },
    /// The TLS handshake with a server failed (its certificate is not trusted or does not
    /// name it, the server wants a client certificate, or it does not speak TLS): that
    /// needs an operator, not a retry.
    #[error("TLS with server {addr} failed: {message}")]
    Tls {
        /// The server.
        addr: Addr,
        /// rustls's reason.
        message: String,
    },
    /// The server spoke, but not the kvix protocol as this client reads it.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A socket error.
    #[error("i/o error: {0}")]
    Io(Arc<std::io::Error>),
    /// The request could not be encoded (too large, or larger than the server accepts).
    #[error("could not encode the request: {0}")]
    Encode(String),
}

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> Self {
        ClientError::Io(Arc::new(e))
    }
}

impl ClientError {
    /// The server's error code, for `Rejected` and `Refused`.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Rejected(r) | ClientError::Refused { reply: r, .. } => Some(r.code),
            _ => None,
        }
    }
}

fn describe(r: &ErrorReply) -> String {
    format!("{:?}: {}", r.code, r.message)
}
