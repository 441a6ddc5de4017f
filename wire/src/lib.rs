//! kvix-wire: the one place the kvix protocol is spelled.
//!
//! - [`frame`]: the fixed header and frame validation,
//! - [`reader`]: [`FrameReader`], the one reader that turns a byte stream into frames,
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

pub mod codec;
pub mod frame;
pub mod message;
pub mod reader;

pub use codec::{
    encode, encode_in_version, encode_into, split_frame, to_native, u64s, Body, EncodeError, Frame,
    Kind, MessageRef,
};
pub use frame::{
    FrameError, Header, DEFAULT_MAX_FRAME, FLAG_NO_REPLY, HEADER_LEN, MAX_HELLO_FRAME,
    OLDEST_VERSION, PROTOCOL_VERSION,
};
pub use message::*;
pub use reader::FrameReader;
/// The aligned buffer frames are encoded into and read from (16-byte aligned).
pub type AlignedVec = rkyv::util::AlignedVec<16>;
