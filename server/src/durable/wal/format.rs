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

fn check(bytes: &[u8]) -> u32 {
    xxh3_64(bytes) as u32
}

/// A new file's header.
pub fn file_header() -> [u8; FILE_HEADER] {
    let mut h = [0; FILE_HEADER];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&MAX_RECORD.to_le_bytes());
    let c = check(&h[..12]);
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
    let c = check(&out[..12]);
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
    if check(&h[..12]) != u32_at(h, 12) {
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
    if check(&rest[..12]) != u32_at(rest, 12) {
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A file of `bodies` as the writer lays it out, and where each record starts.
    fn file(bodies: &[Vec<u8>]) -> (Vec<u8>, Vec<usize>) {
        let mut out = file_header().to_vec();
        let mut starts = Vec::new();
        for b in bodies {
            starts.push(out.len());
            out.extend(record(b).unwrap());
        }
        (out, starts)
    }

    fn read(bytes: &[u8], scan: &Scan) -> Vec<Vec<u8>> {
        scan.bodies
            .iter()
            .map(|r| bytes[r.clone()].to_vec())
            .collect()
    }

    fn bodies() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..200), 1..12)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any one bit flipped anywhere: the damage is refused at or before the record
        /// holding the bit, and every record before that one is read whole. Nothing is
        /// ever cut as a torn tail: no crash leaves a whole file with one bit changed.
        #[test]
        fn a_flipped_bit_is_damage_never_a_torn_tail(bodies in bodies(), pick in any::<prop::sample::Index>(), bit in 0..8u8) {
            let (mut bytes, starts) = file(&bodies);
            let at = pick.index(bytes.len());
            bytes[at] ^= 1 << bit;
            let scan = scan(&bytes);
            let holder = starts.iter().rposition(|&s| s <= at);
            match scan.end {
                End::Damaged { at: found, .. } => {
                    let from = holder.map_or(0, |r| starts[r]);
                    prop_assert_eq!(found, from, "refused where the damaged record starts");
                    let before = holder.unwrap_or(0);
                    prop_assert_eq!(read(&bytes, &scan), bodies[..before].to_vec());
                }
                other => prop_assert!(false, "a flip at {} read as {:?}", at, other),
            }
        }

        /// A file cut anywhere (a crash mid-write): the records before the cut are read
        /// whole and the rest is a torn tail starting at a record boundary.
        #[test]
        fn a_file_cut_short_is_a_torn_tail_after_its_whole_records(bodies in bodies(), pick in any::<prop::sample::Index>()) {
            let (bytes, starts) = file(&bodies);
            let cut = pick.index(bytes.len());
            let scan = scan(&bytes[..cut]);
            let whole = starts.iter().enumerate().filter(|&(i, _)| {
                starts.get(i + 1).copied().unwrap_or(bytes.len()) <= cut
            }).count();
            prop_assert_eq!(read(&bytes, &scan), bodies[..whole].to_vec());
            match scan.end {
                End::Torn { at, .. } => {
                    let boundary = if cut < FILE_HEADER { 0 } else { starts[whole] };
                    prop_assert_eq!(at, boundary);
                    prop_assert!(bytes[..cut][at..] == bytes[at..cut], "the cut bytes are a prefix of what was written");
                }
                End::Whole => prop_assert!(cut == FILE_HEADER && whole == 0 || cut == 0 || starts.get(whole) == Some(&cut)),
                other => prop_assert!(false, "a cut at {} read as {:?}", cut, other),
            }
        }

        /// A bit flipped in a whole record of a file that was then cut short: refused at
        /// the flipped record, never taken for the torn tail that follows.
        #[test]
        fn damage_before_a_torn_tail_is_refused(bodies in bodies(), pick in any::<prop::sample::Index>(), bit in 0..8u8, tail in 1..16usize) {
            let (mut bytes, starts) = file(&bodies);
            let last = *starts.last().unwrap();
            prop_assume!(last > FILE_HEADER);
            let cut = (last + tail).min(bytes.len() - 1);
            let at = FILE_HEADER + pick.index(last - FILE_HEADER);
            bytes[at] ^= 1 << bit;
            let scan = scan(&bytes[..cut]);
            let holder = starts.iter().rposition(|&s| s <= at).unwrap();
            prop_assert!(matches!(scan.end, End::Damaged { at, .. } if at == starts[holder]), "{:?}", scan.end);
        }

        /// Arbitrary bytes: an answer, never a panic, and every record read lies inside.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), magic in any::<bool>()) {
            let mut bytes = bytes;
            if magic && bytes.len() >= FILE_HEADER {
                bytes[..FILE_HEADER].copy_from_slice(&file_header());
            }
            let scan = scan(&bytes);
            prop_assert!(scan.bodies.iter().all(|r| r.end <= bytes.len()));
        }
    }

    #[test]
    fn a_length_flipped_to_two_to_the_31_is_damage() {
        let (mut bytes, starts) = file(&[vec![1; 40], vec![2; 40], vec![3; 40]]);
        bytes[starts[1] + 3] ^= 0x80;
        let scan = scan(&bytes);
        assert_eq!(read(&bytes, &scan), vec![vec![1; 40]]);
        assert!(
            matches!(&scan.end, End::Damaged { at, field: Field::RecordHeader, why }
                if *at == starts[1] && why.contains("2147483688")),
            "{:?}",
            scan.end
        );
    }

    #[test]
    fn zeros_from_a_record_boundary_are_a_torn_tail() {
        let (mut bytes, starts) = file(&[vec![1; 40], vec![2; 40]]);
        bytes.extend([0; 4096]);
        let scan = scan(&bytes);
        assert_eq!(scan.bodies.len(), 2);
        assert_eq!(
            scan.end,
            End::Torn {
                at: starts[1] + RECORD_HEADER + 40,
                field: Field::RecordHeader,
                why: "zeros to the end"
            }
        );
    }

    #[test]
    fn a_version_one_file_is_read_by_its_own_rules() {
        let mut v1 = Vec::new();
        for b in [vec![7u8; 30], vec![8; 30]] {
            v1.extend((b.len() as u32).to_le_bytes());
            v1.extend(xxh3_64(&b).to_le_bytes());
            v1.extend(&b);
        }
        let whole = scan(&v1);
        assert_eq!(
            (whole.version, whole.bodies.len(), whole.end),
            (1, 2, End::Whole)
        );
        let torn = scan(&v1[..v1.len() - 5]);
        assert_eq!(torn.bodies.len(), 1);
        assert!(matches!(torn.end, End::Torn { at: 42, .. }));
    }

    #[test]
    fn a_body_past_the_bound_is_not_written() {
        assert!(record(&vec![0; MAX_RECORD as usize + 1]).is_none());
    }
}
