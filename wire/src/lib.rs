//! kvix-wire: the one place the kvix protocol is spelled.
//!
//! - [`frame`]: the fixed header and frame validation,
//! - [`message`]: the rkyv message bodies,
//! - [`codec`]: encoding messages into frames and reading them in place,
//! - [`chain`]: the chain hasher, [`keyspace`]: keyspace seeds,
//! - [`lane`]: the lane vocabulary.

pub mod chain;
pub mod keyspace;
pub mod lane;

pub use keyspace::{ChunkKind, Keyspace, BYTE_CHUNK};
pub use lane::{Lane, LaneError, LaneKind};

/// A worker as the server numbers it: names cross the wire once, at announce.
pub type WorkerId = u32;
