//! The one place bytes read from a stream become frames: the server, the client and the
//! bench all read through a [`FrameReader`], whatever their I/O (glommio, tokio, std).
//!
//! The reader owns an 8-aligned buffer; the caller reads socket bytes into
//! [`FrameReader::spare`], reports them with [`FrameReader::filled`], and takes whole
//! frames with [`FrameReader::next`] / [`FrameReader::consume`]. Frames are multiples of
//! 8 bytes, so every body sits 8-aligned and is read in place. The buffer starts small
//! and grows as bytes arrive (at most doubling what is buffered per read), never past
//! one largest frame plus one read: a header announcing megabytes pins no more memory
//! than the bytes that actually came.

use crate::codec::{split_frame, Frame};
use crate::frame::FrameError;
use crate::AlignedVec;

/// The buffer's starting size, and the least room a read gets.
pub const READ_CHUNK: usize = 4 * 1024;

/// Buffered frame reader (see the module docs).
pub struct FrameReader {
    buf: AlignedVec,
    start: usize,
    end: usize,
    max_frame: u32,
}

impl FrameReader {
    /// A reader refusing frames over `max_frame` bytes.
    pub fn new(max_frame: u32) -> Self {
        let mut buf = AlignedVec::with_capacity(READ_CHUNK);
        buf.resize(READ_CHUNK, 0);
        FrameReader {
            buf,
            start: 0,
            end: 0,
            max_frame,
        }
    }

    /// Refuses frames over `max_frame` bytes from the next one on (a server reads small
    /// frames until a connection has said Hello, then its configured limit).
    pub fn set_max_frame(&mut self, max_frame: u32) {
        self.max_frame = max_frame;
    }

    /// The frame at the front of the buffer, if it is whole. Its header is checked as soon
    /// as it is in, so an oversize or foreign frame is refused before its body is read.
    pub fn next(&self) -> Result<Option<Frame<'_>>, FrameError> {
        split_frame(&self.buf[self.start..self.end], self.max_frame)
    }

    /// The request id of the frame at the front, when its header got that far and is a
    /// kvix header (so an error reply can name the request it answers).
    pub fn request_id(&self) -> Option<u64> {
        let b = &self.buf[self.start..self.end];
        (b.len() >= 16 && b[..4] == crate::frame::MAGIC)
            .then(|| u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")))
    }

    /// Drops `n` bytes (a frame just handled) from the front.
    pub fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Bytes buffered and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Heap bytes the buffer holds.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Where the next read goes: room for at least [`READ_CHUNK`] bytes, or for what the
    /// frame being read still lacks, but never more than is buffered already. Moves unread bytes to the front or grows the buffer
    /// when needed (frames are multiples of 8 bytes, so the front keeps bodies aligned).
    pub fn spare(&mut self) -> &mut [u8] {
        let want = self.want();
        if self.buf.len() - self.end < want {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            if self.buf.len() - self.end < want {
                let grown = (self.end + want).next_power_of_two().max(self.buf.len());
                self.buf.resize(grown, 0);
            }
        }
        &mut self.buf[self.end..]
    }

    /// Records that `n` bytes were read into [`FrameReader::spare`].
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// Gives back a grown buffer once it is empty (an idle connection keeps only the
    /// starting size).
    pub fn shrink(&mut self) {
        if self.start == self.end && self.buf.len() > READ_CHUNK {
            self.buf = AlignedVec::with_capacity(READ_CHUNK);
            self.buf.resize(READ_CHUNK, 0);
            (self.start, self.end) = (0, 0);
        }
    }

    /// How many bytes the next read should have room for.
    fn want(&self) -> usize {
        let head = &self.buf[self.start..self.end];
        let frame = head
            .get(..crate::HEADER_LEN)
            .and_then(|h| {
                let h: &[u8; crate::HEADER_LEN] = h.try_into().ok()?;
                crate::Header::read(h, self.max_frame, |_| Some(crate::OLDEST_VERSION)).ok()
            })
            .map_or(0, |h| h.frame_len());
        // Growth follows the bytes that came, not what a header claims is coming.
        frame
            .saturating_sub(head.len())
            .min(head.len())
            .max(READ_CHUNK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode, Echo, MessageRef, DEFAULT_MAX_FRAME};

    /// Feeds `bytes` through a reader in pieces of `step`, collecting the echo lengths.
    fn read_all(bytes: &[u8], step: usize) -> Vec<u32> {
        let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
        let (mut at, mut out) = (0, Vec::new());
        while at < bytes.len() || r.buffered() > 0 {
            while let Some(f) = r.next().unwrap() {
                let len = f.len;
                if let MessageRef::Echo(e) = f.message().unwrap() {
                    out.push(e.reply_len.to_native());
                }
                r.consume(len);
            }
            if at == bytes.len() {
                break;
            }
            let spare = r.spare();
            let n = step.min(spare.len()).min(bytes.len() - at);
            spare[..n].copy_from_slice(&bytes[at..at + n]);
            r.filled(n);
            at += n;
        }
        out
    }

    #[test]
    fn frames_come_out_whole_however_the_bytes_arrive() {
        let mut stream = Vec::new();
        for (i, size) in [0usize, 10, 100_000, 3, 40_000].into_iter().enumerate() {
            let echo = Echo {
                payload: vec![i as u8; size],
                reply_len: i as u32,
            };
            stream.extend_from_slice(&encode(&echo, i as u64, 0).unwrap());
        }
        for step in [1, 7, 4096, READ_CHUNK, usize::MAX] {
            assert_eq!(read_all(&stream, step), vec![0, 1, 2, 3, 4], "step {step}");
        }
    }

    #[test]
    fn an_oversize_header_is_refused_before_its_body_and_buffers_shrink() {
        let mut r = FrameReader::new(1024);
        let big = encode(
            &Echo {
                payload: vec![0; 4096],
                reply_len: 0,
            },
            1,
            0,
        )
        .unwrap();
        let spare = r.spare();
        spare[..24].copy_from_slice(&big[..24]);
        r.filled(24);
        assert!(matches!(r.next(), Err(FrameError::Oversize { .. })));
        // A header announcing a frame of the largest size gets no buffer sized for it.
        let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
        let huge = encode(
            &Echo {
                payload: vec![0; DEFAULT_MAX_FRAME as usize - 4096],
                reply_len: 0,
            },
            1,
            0,
        )
        .unwrap();
        let spare = r.spare();
        spare[..24].copy_from_slice(&huge[..24]);
        r.filled(24);
        assert!(r.next().unwrap().is_none());
        let room = r.spare().len();
        assert!(
            room <= 2 * READ_CHUNK && r.capacity() <= 2 * READ_CHUNK,
            "{room} {}",
            r.capacity()
        );
        let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
        let _ = r.spare();
        let start = r.capacity();
        let frame = encode(
            &Echo {
                payload: vec![0; 200_000],
                reply_len: 0,
            },
            1,
            0,
        )
        .unwrap();
        let mut at = 0;
        while at < frame.len() {
            let spare = r.spare();
            let n = spare.len().min(frame.len() - at);
            spare[..n].copy_from_slice(&frame[at..at + n]);
            r.filled(n);
            at += n;
        }
        assert!(r.capacity() >= frame.len());
        let len = r.next().unwrap().unwrap().len;
        r.consume(len);
        r.shrink();
        assert_eq!(r.capacity(), start);
    }
}
