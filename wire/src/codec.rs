//! Messages ↔ frames. The `messages!` table below is the only place a kind byte is
//! bound to a body type; encoding, validation and the borrowed view all come from it.

use crate::AlignedVec;
use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::{Archive, Deserialize, Portable, Serialize};
use thiserror::Error;

use crate::frame::{
    padded, FrameError, Header, FRAME_ALIGN, HEADER_LEN, OLDEST_VERSION, PROTOCOL_VERSION,
};
use crate::message::*;

/// A message body type with its kind byte.
pub trait Body:
    Sized
    + Archive<Archived: Checked<Self>>
    + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
{
    const KIND: Kind;
}

/// What an archived body must be: validatable in place and convertible back.
pub trait Checked<M>:
    Portable
    + for<'a> CheckBytes<HighValidator<'a, rancor::BoxedError>>
    + Deserialize<M, HighDeserializer<rancor::Error>>
{
}
impl<M, T> Checked<M> for T where
    T: Portable
        + for<'a> CheckBytes<HighValidator<'a, rancor::BoxedError>>
        + Deserialize<M, HighDeserializer<rancor::Error>>
{
}

macro_rules! messages {
    ($($name:ident = $byte:literal since $since:literal),* $(,)?) => {
        /// The message kinds, as the header's `kind` byte spells them.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Kind { $($name = $byte),* }

        impl Kind {
            pub fn from_byte(b: u8) -> Option<Kind> {
                match b { $($byte => Some(Kind::$name),)* _ => None }
            }
            pub fn name(self) -> &'static str {
                match self { $(Kind::$name => stringify!($name)),* }
            }
            /// The protocol version the kind is defined from.
            pub fn since(self) -> u16 {
                match self { $(Kind::$name => $since),* }
            }
        }

        $(impl Body for $name { const KIND: Kind = Kind::$name; })*

        /// A validated message, borrowed in place from the read buffer.
        #[derive(Debug)]
        pub enum MessageRef<'a> {
            $($name(&'a <$name as Archive>::Archived)),*
        }

        impl<'a> MessageRef<'a> {
            /// Validates `body` as a message of `kind` and borrows it.
            pub fn view(kind: Kind, body: &'a [u8]) -> Result<Self, FrameError> {
                Ok(match kind {
                    $(Kind::$name => MessageRef::$name(access::<$name>(body)?),)*
                })
            }
            pub fn kind(&self) -> Kind {
                match self { $(MessageRef::$name(_) => Kind::$name),* }
            }
        }
    };
}

messages! {
    Hello = 1 since 4,
    Welcome = 2 since 4,
    Query = 3 since 4,
    Answer = 4 since 4,
    Announce = 5 since 4,
    Announced = 6 since 4,
    Retire = 7 since 4,
    EventBatch = 8 since 4,
    Applied = 9 since 4,
    Placement = 10 since 4,
    StatsRequest = 11 since 4,
    Stats = 12 since 4,
    Echo = 13 since 4,
    Ack = 14 since 4,
    ErrorReply = 15 since 4,
    RosterRequest = 16 since 4,
    Roster = 17 since 4,
    TieredQuery = 18 since 5,
    TieredAnswer = 19 since 5,
    ReuseReport = 20 since 5,
}

#[derive(Debug, Error)]
pub enum EncodeError {
    #[error("could not serialize {kind}: {reason}")]
    Serialize { kind: &'static str, reason: String },
    #[error("{kind} body of {len} bytes does not fit in a frame")]
    TooLarge { kind: &'static str, len: usize },
    #[error(
        "protocol version {0} is not one this side speaks ({OLDEST_VERSION} to {PROTOCOL_VERSION})"
    )]
    Version(u16),
    #[error("{kind} is new in protocol version {since}, not in version {version}")]
    TooNew {
        kind: &'static str,
        since: u16,
        version: u16,
    },
}

/// Appends one frame carrying `msg` to `out`, which may already hold whole frames.
pub fn encode_into<M: Body>(
    msg: &M,
    request_id: u64,
    flags: u8,
    out: AlignedVec,
) -> Result<AlignedVec, EncodeError> {
    encode_in_version(msg, PROTOCOL_VERSION, request_id, flags, out)
}

/// [`encode_into`] with the header saying `version` (a server answers a request in the
/// version it came in).
pub fn encode_in_version<M: Body>(
    msg: &M,
    version: u16,
    request_id: u64,
    flags: u8,
    mut out: AlignedVec,
) -> Result<AlignedVec, EncodeError> {
    let kind = M::KIND.name();
    if !(OLDEST_VERSION..=PROTOCOL_VERSION).contains(&version) {
        return Err(EncodeError::Version(version));
    }
    if M::KIND.since() > version {
        return Err(EncodeError::TooNew {
            kind,
            since: M::KIND.since(),
            version,
        });
    }
    debug_assert_eq!(
        out.len() % FRAME_ALIGN,
        0,
        "frames are appended on 8-byte boundaries"
    );
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    // rkyv aligns relative to the buffer start; the header keeps the body 8-aligned.
    let mut out = rkyv::api::high::to_bytes_in::<_, rancor::Error>(msg, out).map_err(|e| {
        EncodeError::Serialize {
            kind,
            reason: e.to_string(),
        }
    })?;
    let body_len = out.len() - start - HEADER_LEN;
    let body_len32 = u32::try_from(body_len).map_err(|_| EncodeError::TooLarge {
        kind,
        len: body_len,
    })?;
    out.extend_from_slice(&[0u8; FRAME_ALIGN][..padded(body_len) - body_len]);
    let header = Header {
        version,
        kind: M::KIND as u8,
        flags,
        request_id,
        body_len: body_len32,
    };
    let head: &mut [u8; HEADER_LEN] = (&mut out[start..start + HEADER_LEN])
        .try_into()
        .expect("header slot");
    header.write(head);
    Ok(out)
}

/// One frame carrying `msg`, in a buffer of its own.
pub fn encode<M: Body>(msg: &M, request_id: u64, flags: u8) -> Result<AlignedVec, EncodeError> {
    encode_into(msg, request_id, flags, AlignedVec::new())
}

/// A whole frame found at the front of a read buffer.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    pub header: Header,
    pub kind: Kind,
    /// The body without padding.
    pub body: &'a [u8],
    /// Bytes to consume from the buffer (header + padded body).
    pub len: usize,
}

impl<'a> Frame<'a> {
    /// Validates the body and borrows it as a message.
    pub fn message(&self) -> Result<MessageRef<'a>, FrameError> {
        MessageRef::view(self.kind, self.body)
    }
}

/// Finds the frame at the front of `buf`: `Ok(None)` when more bytes are needed.
/// The header is checked as soon as its 24 bytes are in, so an oversize or foreign
/// frame is refused before its body is buffered.
pub fn split_frame(buf: &[u8], max_frame: u32) -> Result<Option<Frame<'_>>, FrameError> {
    let Some(head) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let header = Header::read(head.try_into().expect("header"), max_frame, |b| {
        Kind::from_byte(b).map(Kind::since)
    })?;
    let kind = Kind::from_byte(header.kind).ok_or(FrameError::UnknownKind(header.kind))?;
    let len = header.frame_len();
    if buf.len() < len {
        return Ok(None);
    }
    let body = &buf[HEADER_LEN..HEADER_LEN + header.body_len as usize];
    Ok(Some(Frame {
        header,
        kind,
        body,
        len,
    }))
}

/// Validates and borrows `body` as an `M`.
pub fn access<M: Body>(body: &[u8]) -> Result<&M::Archived, FrameError> {
    // An empty body (a message without fields) has nothing to misread, and an empty
    // buffer's pointer need not be aligned.
    if !body.is_empty() && !(body.as_ptr() as usize).is_multiple_of(FRAME_ALIGN) {
        return Err(FrameError::Misaligned);
    }
    // BoxedError keeps the reason in release builds too (rancor::Error is a bare
    // "failed" there); it allocates only when validation fails.
    rkyv::access::<M::Archived, rancor::BoxedError>(body).map_err(|e| FrameError::InvalidBody {
        kind: M::KIND.name(),
        reason: e.to_string(),
    })
}

/// Copies an archived message out into its native type.
pub fn to_native<M: Body>(archived: &M::Archived) -> M {
    // Validated archives of plain data cannot fail to deserialize.
    rkyv::deserialize::<M, rancor::Error>(archived).expect("validated archive deserializes")
}

/// The chain hashes of an archived `Vec<u64>` as a native slice, without copying.
pub fn u64s(v: &rkyv::vec::ArchivedVec<rkyv::rend::u64_le>) -> &[u64] {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `u64_le` is `repr(C, align(8))` around one u64; on a little-endian
        // target its bytes are exactly a native u64, and the slice was validated.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u64>(), v.len()) }
    }
    #[cfg(not(target_endian = "little"))]
    compile_error!("kvix-wire reads chain hashes in place and needs a little-endian target");
}

/// Reads `bytes` as a stream of frames, validating every body: the number of whole,
/// valid frames, or the first error. What the fuzz target and the no-panic property
/// tests drive; it copies into an aligned buffer first, as a reader's buffer would be.
pub fn validate_stream(bytes: &[u8], max_frame: u32) -> Result<usize, FrameError> {
    let mut buf = AlignedVec::with_capacity(bytes.len());
    buf.extend_from_slice(bytes);
    let (mut at, mut frames) = (0, 0);
    while let Some(frame) = split_frame(&buf[at..], max_frame)? {
        frame.message()?;
        at += frame.len;
        frames += 1;
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_bodies_read_from_any_address() {
        let bytes = [0u8; 9];
        assert!(access::<Ack>(&bytes[1..1]).is_ok());
        assert!(access::<StatsRequest>(&[]).is_ok());
        let mut odd = AlignedVec::new();
        odd.extend_from_slice(&[0u8; 16]);
        assert!(matches!(
            access::<Retire>(&odd[1..5]),
            Err(FrameError::Misaligned)
        ));
    }
}
