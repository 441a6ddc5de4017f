//! The frame: a fixed 24-byte little-endian header, then the rkyv body, then zero
//! padding to a multiple of 8 so that every frame of a stream read into an 8-aligned
//! buffer has an 8-aligned body the reader can access in place.
//!
//! ```text
//! offset size field
//!  0     4    magic      b"KVIX"
//!  4     2    version    OLDEST_VERSION ..= PROTOCOL_VERSION
//!  6     1    kind       message kind (see codec::Kind)
//!  7     1    flags      FLAG_* bits; unknown bits refused
//!  8     8    request id echoed in the reply; lets a connection pipeline
//! 16     4    body_len   rkyv body length before padding
//! 20     4    reserved   must be 0
//! 24     ..   body, then 0..7 zero bytes of padding
//! ```

use thiserror::Error;

pub const MAGIC: [u8; 4] = *b"KVIX";
/// The version this side writes by default, and the newest it reads.
pub const PROTOCOL_VERSION: u16 = 5;
/// The oldest version a server still reads and answers (in that version), so that a
/// rolling upgrade (servers first, then clients) never fails a fleet open.
pub const OLDEST_VERSION: u16 = 4;
pub const HEADER_LEN: usize = 24;
/// Bodies start and frames end on this boundary.
pub const FRAME_ALIGN: usize = 8;
/// Default cap on one frame (header + padded body).
pub const DEFAULT_MAX_FRAME: u32 = 4 << 20;
/// Cap on a frame before the session's `Hello` succeeded (a `Hello` is a few hundred
/// bytes; a server does not buffer a stranger's megabytes).
pub const MAX_HELLO_FRAME: u32 = 64 << 10;

/// The sender wants no reply (fire-and-forget placements and events).
pub const FLAG_NO_REPLY: u8 = 1;
const KNOWN_FLAGS: u8 = FLAG_NO_REPLY;

/// Why bytes could not be read as a frame. Every variant is final for the connection
/// except where the caller chooses otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?} (not a kvix peer?)")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this side speaks {OLDEST_VERSION} to {PROTOCOL_VERSION})")]
    UnsupportedVersion(u16),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("message kind {kind} is new in version {since}; the frame says version {version}")]
    KindTooNew { kind: u8, since: u16, version: u16 },
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    #[error("reserved header field is {0:#x}, must be 0")]
    Reserved(u32),
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    Oversize { len: u64, max: u32 },
    #[error("invalid {kind} body: {reason}")]
    InvalidBody { kind: &'static str, reason: String },
    #[error("frame body is not 8-byte aligned in the read buffer")]
    Misaligned,
    #[error("message of kind {got} where {want} was expected")]
    Unexpected {
        want: &'static str,
        got: &'static str,
    },
}

/// The decoded fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The protocol version the sender speaks; a reply is written in its request's.
    pub version: u16,
    pub kind: u8,
    pub flags: u8,
    pub request_id: u64,
    pub body_len: u32,
}

impl Header {
    /// Bytes the whole frame occupies on the wire, padding included.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + padded(self.body_len as usize)
    }

    pub fn wants_reply(&self) -> bool {
        self.flags & FLAG_NO_REPLY == 0
    }

    pub fn write(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6] = self.kind;
        out[7] = self.flags;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        out[20..24].copy_from_slice(&0u32.to_le_bytes());
    }

    /// Reads and checks a header. `since` gives the version a kind byte is defined
    /// from (None: no such kind).
    pub fn read(
        bytes: &[u8; HEADER_LEN],
        max_frame: u32,
        since: impl Fn(u8) -> Option<u16>,
    ) -> Result<Header, FrameError> {
        let magic: [u8; 4] = bytes[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if !(OLDEST_VERSION..=PROTOCOL_VERSION).contains(&version) {
            return Err(FrameError::UnsupportedVersion(version));
        }
        let header = Header {
            version,
            kind: bytes[6],
            flags: bytes[7],
            request_id: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            body_len: u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes")),
        };
        let reserved = u32::from_le_bytes(bytes[20..24].try_into().expect("4 bytes"));
        if reserved != 0 {
            return Err(FrameError::Reserved(reserved));
        }
        match since(header.kind) {
            None => return Err(FrameError::UnknownKind(header.kind)),
            Some(since) if since > version => {
                return Err(FrameError::KindTooNew {
                    kind: header.kind,
                    since,
                    version,
                })
            }
            Some(_) => {}
        }
        if header.flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnknownFlags(header.flags & !KNOWN_FLAGS));
        }
        let len = HEADER_LEN as u64 + padded(header.body_len as usize) as u64;
        if len > u64::from(max_frame) {
            return Err(FrameError::Oversize {
                len,
                max: max_frame,
            });
        }
        Ok(header)
    }
}

/// `len` rounded up to [`FRAME_ALIGN`].
pub fn padded(len: usize) -> usize {
    len.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
}
