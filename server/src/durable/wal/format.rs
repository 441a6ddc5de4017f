//! The write-ahead log's bytes, and what reading them finds (no I/O here).
//!
//! ```text
//! file:   "KVIXWAL" 0x02 | largest record u32 LE | check u32 LE               16 B
//! record: body length u32 LE | xxh3-64 of the body u64 LE | check u32 LE | body
//! check:  the low 32 bits of xxh3-64 of the 12 bytes before it
//! ```
//!
//! Why a check on each header: a record's length decides where the next one starts, so a
//! damaged length must be told from a crash mid-write. Without it, a length flipped to a
//! large value read as "a record running past the end" (a torn tail) and the reader cut
//! every record after it. With it, a header that fails its check is damage wherever it
//! is, and only what a crash can leave is a torn tail: a header cut short, a whole valid
//! header whose body runs past the end, or zeros from a record's start to the end.
//!
//! Version 1 files (no file header: they begin with a record's length, below 2^28, where
//! "KVIX" read as a length is past 2^28 even with one bit flipped) are read by the version 1
//! rules, whose torn tail cannot tell a damaged length from a crash.

use std::ops::Range;

use xxhash_rust::xxh3::xxh3_64;

/// The file header's first eight bytes.
pub const MAGIC: [u8; 8] = *b"KVIXWAL\x02";
pub const FILE_HEADER: usize = 16;
pub const RECORD_HEADER: usize = 16;
const V1_HEADER: usize = 12;
/// The largest body a record may have, written in every file's header. Ingest records
/// reach 64 MiB (a 16 MiB engine message of one-token pages carries four bytes a token
/// and more); a length past the file's bound is damage even where its check passes.
pub const MAX_RECORD: u32 = 256 << 20;

fn header_check(bytes: &[u8]) -> u32 {
    xxh3_64(bytes) as u32
}

/// A new file's header.
pub fn file_header() -> [u8; FILE_HEADER] {
    let mut h = [0; FILE_HEADER];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&MAX_RECORD.to_le_bytes());
    let c = header_check(&h[..12]);
    h[12..].copy_from_slice(&c.to_le_bytes());
    h
}

/// One record's bytes; None when the body is past [`MAX_RECORD`].
pub fn record(body: &[u8]) -> Option<Vec<u8>> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l <= MAX_RECORD)?;
    let mut out = Vec::with_capacity(RECORD_HEADER + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&xxh3_64(body).to_le_bytes());
    let c = header_check(&out[..12]);
    out.extend_from_slice(&c.to_le_bytes());
    out.extend_from_slice(body);
    Some(out)
}

/// The part of a file that is not as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    FileHeader,
    RecordHeader,
    RecordBody,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::FileHeader => "the file header",
            Field::RecordHeader => "a record header",
            Field::RecordBody => "a record body",
        }
    }
}

/// How a file's bytes end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Every byte is in a whole record.
    Whole,
    /// What a crash mid-write leaves, from `at` to the end: cut off in the newest file.
    Torn {
        at: usize,
        field: Field,
        why: &'static str,
    },
    /// Bytes no crash leaves, at `at`: refused unless the operator accepts the loss.
    Damaged {
        at: usize,
        field: Field,
        why: String,
    },
}

/// What reading one file's bytes found.
#[derive(Debug)]
pub struct Scan {
    /// The bodies of the whole records, in order.
    pub bodies: Vec<Range<usize>>,
    pub end: End,
    /// 1 for a file without a file header (an older kvix), else 2.
    pub version: u8,
}

impl Scan {
    /// Where the record of body `body` starts.
    pub fn record_start(&self, body: &Range<usize>) -> usize {
        body.start
            - if self.version == 1 {
                V1_HEADER
            } else {
                RECORD_HEADER
            }
    }
}

/// Reads a file's records up to its first byte that is not part of a whole record.
pub fn scan(bytes: &[u8]) -> Scan {
    if is_v1(bytes) {
        return scan_v1(bytes);
    }
    let mut out = Scan {
        bodies: Vec::new(),
        end: End::Whole,
        version: 2,
    };
    match file_bound(bytes) {
        Ok(bound) => {
            let mut at = FILE_HEADER;
            while at < bytes.len() {
                match next_record(bytes, at, bound) {
                    Ok(body) => {
                        at = body.end;
                        out.bodies.push(body);
                    }
                    Err(end) => {
                        out.end = end;
                        break;
                    }
                }
            }
        }
        Err(end) => out.end = end,
    }
    out
}

/// Whether `bytes` begin as a version 1 file: with a record length below 2^28 (version
/// 1 records stay under 64 MiB), which the magic, even with a bit flipped, never reads as.
fn is_v1(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && u32_at(bytes, 0) < 1 << 28
}

/// The file header's record bound, or how the file's start is not one.
fn file_bound(bytes: &[u8]) -> Result<u32, End> {
    if bytes.is_empty() {
        return Ok(MAX_RECORD);
    }
    if bytes.len() < FILE_HEADER {
        return Err(if MAGIC.starts_with(&bytes[..bytes.len().min(8)]) {
            End::Torn {
                at: 0,
                field: Field::FileHeader,
                why: "it is cut short",
            }
        } else {
            damaged(0, Field::FileHeader, "not a kvix write-ahead log".into())
        });
    }
    let h = &bytes[..FILE_HEADER];
    if h[..8] != MAGIC {
        return Err(damaged(
            0,
            Field::FileHeader,
            format!("version byte {:#04x} is not one this kvix reads", h[7]),
        ));
    }
    if header_check(&h[..12]) != u32_at(h, 12) {
        return Err(damaged(0, Field::FileHeader, "it fails its check".into()));
    }
    Ok(u32_at(h, 8))
}

/// The body of the record at `at`, or how the bytes from `at` are not a whole record.
fn next_record(bytes: &[u8], at: usize, bound: u32) -> Result<Range<usize>, End> {
    let rest = &bytes[at..];
    if rest.iter().all(|&b| b == 0) {
        return Err(End::Torn {
            at,
            field: Field::RecordHeader,
            why: "zeros to the end",
        });
    }
    if rest.len() < RECORD_HEADER {
        return Err(End::Torn {
            at,
            field: Field::RecordHeader,
            why: "it is cut short",
        });
    }
    let len = u32_at(rest, 0);
    if header_check(&rest[..12]) != u32_at(rest, 12) {
        return Err(damaged(
            at,
            Field::RecordHeader,
            format!("it fails its check (length field {len})"),
        ));
    }
    if len > bound {
        return Err(damaged(
            at,
            Field::RecordHeader,
            format!("length {len} is past the file's bound of {bound}"),
        ));
    }
    let body = at + RECORD_HEADER..at + RECORD_HEADER + len as usize;
    if body.end > bytes.len() {
        return Err(End::Torn {
            at,
            field: Field::RecordBody,
            why: "it runs past the end of the file",
        });
    }
    if xxh3_64(&bytes[body.clone()]) != u64_at(rest, 4) {
        return Err(damaged(
            at,
            Field::RecordBody,
            "it fails its checksum".into(),
        ));
    }
    Ok(body)
}

/// A version 1 file: `len u32 | xxh3-64 u64 | body`, no header check.
fn scan_v1(bytes: &[u8]) -> Scan {
    let mut out = Scan {
        bodies: Vec::new(),
        end: End::Whole,
        version: 1,
    };
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let torn = |field, why| End::Torn { at, field, why };
        let body = at + V1_HEADER..at + V1_HEADER + u32_at(rest, 0) as usize;
        out.end = if rest.iter().all(|&b| b == 0) {
            torn(Field::RecordHeader, "zeros to the end")
        } else if rest.len() < V1_HEADER {
            torn(Field::RecordHeader, "it is cut short")
        } else if body.end > bytes.len() {
            torn(
                Field::RecordBody,
                "it runs past the end of the file (version 1 cannot tell a damaged length)",
            )
        } else if xxh3_64(&bytes[body.clone()]) != u64_at(rest, 4) {
            if body.end == bytes.len() {
                torn(Field::RecordBody, "the last record fails its checksum")
            } else {
                damaged(at, Field::RecordBody, "it fails its checksum".into())
            }
        } else {
            at = body.end;
            out.bodies.push(body);
            continue;
        };
        break;
    }
    out
}

fn damaged(at: usize, field: Field, why: String) -> End {
    End::Damaged { at, field, why }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests;
