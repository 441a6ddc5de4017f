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
