use super::*;
use kvix_wire::WorkerId;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvix-wal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn retire(w: WorkerId) -> Write {
    Write::Retire { worker: w }
}

fn open(snap: &Path, from: u64, sync_ms: u64) -> Result<(Arc<Wal>, Vec<Write>), WalError> {
    Wal::open(snap, from, sync_ms, Recover::Refuse).map(|o| (o.wal, o.records))
}

#[test]
fn records_replay_in_order_across_generations_and_old_ones_go() {
    let d = dir("gens");
    let snap = d.join("s.snapshot");
    {
        let (wal, old) = open(&snap, 0, 50).unwrap();
        assert!(old.is_empty());
        wal.append(&retire(1)).unwrap();
        assert_eq!(wal.rotate().unwrap(), 0);
        wal.append(&retire(2)).unwrap();
        wal.replaying(true);
        wal.append(&retire(99)).unwrap();
    }
    let (_, records) = open(&snap, 0, 50).unwrap();
    assert_eq!(records, vec![retire(1), retire(2)]);
    // A snapshot that started at generation 1 needs only what follows.
    let (wal, records) = open(&snap, 1, 50).unwrap();
    assert_eq!(records, vec![retire(2)]);
    assert!(!Wal::path(&snap, 0).exists());
    wal.drop_below(3).unwrap();
    assert_eq!(Wal::generations(&snap).unwrap(), vec![3]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_torn_tail_is_cut_off_and_damage_elsewhere_refuses() {
    let d = dir("torn");
    let snap = d.join("s.snapshot");
    {
        let (wal, _) = open(&snap, 0, 50).unwrap();
        wal.append(&retire(1)).unwrap();
        wal.append(&retire(2)).unwrap();
    }
    let path = Wal::path(&snap, 0);
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 3]).unwrap();
    let (_, records) = open(&snap, 0, 50).unwrap();
    assert_eq!(
        records,
        vec![retire(1)],
        "the torn second record is cut off"
    );
    // Generation 0 is no longer the newest: damage in it refuses the start.
    let mut bad = std::fs::read(&path).unwrap();
    bad[14] ^= 0xff;
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(open(&snap, 0, 50), Err(WalError::Damaged { .. })));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sync_on_every_write_answers_once_on_disk() {
    let d = dir("sync");
    let (wal, _) = open(&d.join("s.snapshot"), 0, 0).unwrap();
    let rx = wal
        .append(&retire(1))
        .unwrap()
        .expect("a durability receipt");
    futures::executor::block_on(rx).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Writes `n` retire records into generation 0 (the only one) and returns its path.
fn log_of(snap: &Path, n: u32) -> PathBuf {
    let (wal, _) = open(snap, 0, 50).unwrap();
    for w in 0..n {
        wal.append(&retire(w)).unwrap();
    }
    Wal::path(snap, 0)
}

/// The size of one retire record, header included.
fn record_len() -> usize {
    let body = rkyv::to_bytes::<rancor::Error>(&retire(0)).unwrap();
    format::RECORD_HEADER + body.len()
}

#[test]
fn a_flipped_byte_mid_file_in_the_newest_generation_refuses_the_start() {
    let d = dir("flip");
    let snap = d.join("s.snapshot");
    let path = log_of(&snap, 100);
    let mut bytes = std::fs::read(&path).unwrap();
    let (head, record) = (format::FILE_HEADER, record_len());
    assert_eq!(bytes.len(), head + 100 * record);
    bytes[head + 40 * record + 18] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let err = open(&snap, 0, 50).err().expect("refused");
    let text = err.to_string();
    assert!(
        text.contains(&path.display().to_string())
            && text.contains(&format!("byte {}", head + 40 * record))
            && text.contains("a record body")
            && text.contains("--wal-recover truncate"),
        "{text}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "nothing cut on refusal"
    );
    // The operator accepts the loss: the 40 records before the damage come back.
    let opened = Wal::open(&snap, 0, 50, Recover::Truncate).unwrap();
    assert_eq!(opened.records, (0..40).map(retire).collect::<Vec<_>>());
    assert_eq!(opened.cut_bytes, (60 * record) as u64);
    assert_eq!(opened.damage_cut, 1);
    let kept = PathBuf::from(format!("{}.damaged", path.display()));
    assert_eq!(std::fs::read(kept).unwrap(), bytes);
    let _ = std::fs::remove_dir_all(&d);
}

/// The operator's case: 1,000 records, record 100's length set to 2^31. Read as a
/// torn tail, this served 99 of them; it is damage in a record header.
#[test]
fn a_damaged_length_is_refused_not_cut_as_a_torn_tail() {
    let d = dir("length");
    let snap = d.join("s.snapshot");
    let path = log_of(&snap, 1000);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = format::FILE_HEADER + 99 * record_len();
    bytes[at..at + 4].copy_from_slice(&(1u32 << 31).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let inspected = Wal::inspect(&snap, 0).unwrap_err().to_string();
    let err = open(&snap, 0, 50).err().expect("refused").to_string();
    assert_eq!(inspected, err, "check reports what a start refuses");
    assert!(
        err.contains(&format!("byte {at}")) && err.contains("a record header"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn truncating_at_damage_sets_later_generations_aside() {
    let d = dir("aside");
    let snap = d.join("s.snapshot");
    let path = log_of(&snap, 10);
    let (wal, _) = open(&snap, 0, 50).unwrap();
    wal.append(&retire(77)).unwrap();
    drop(wal);
    let mut bytes = std::fs::read(&path).unwrap();
    let first = format::FILE_HEADER as u64;
    bytes[first as usize + 20] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    // The refusal counts everything truncating would drop, later generations too.
    let all = bytes.len() as u64 - first + std::fs::metadata(Wal::path(&snap, 1)).unwrap().len();
    assert!(matches!(
        open(&snap, 0, 50),
        Err(WalError::Damaged { at, after, .. }) if at == first && after == all
    ));
    let opened = Wal::open(&snap, 0, 50, Recover::Truncate).unwrap();
    assert!(
        opened.records.is_empty(),
        "nothing after the damage is replayed"
    );
    let later = Wal::path(&snap, 1);
    assert!(PathBuf::from(format!("{}.skipped", later.display())).exists());
    assert!(!later.exists());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn zeros_are_a_torn_tail_and_a_bad_last_record_is_damage() {
    let d = dir("zeros");
    let snap = d.join("s.snapshot");
    let path = log_of(&snap, 3);
    let whole = std::fs::read(&path).unwrap();
    let mut zeros = whole.clone();
    zeros.extend_from_slice(&[0; 4096]);
    std::fs::write(&path, &zeros).unwrap();
    let opened = Wal::open(&snap, 0, 50, Recover::Refuse).unwrap();
    assert_eq!(opened.records, (0..3).map(retire).collect::<Vec<_>>());
    assert_eq!(opened.cut_bytes, 4096);
    assert_eq!(std::fs::read(&path).unwrap(), whole);
    drop(opened);
    std::fs::remove_file(Wal::path(&snap, 1)).unwrap();
    // A whole last record with a byte changed is not what a crash leaves.
    let mut last_bad = whole.clone();
    let n = last_bad.len();
    last_bad[n - 1] ^= 0x01;
    std::fs::write(&path, &last_bad).unwrap();
    assert!(matches!(
        Wal::open(&snap, 0, 50, Recover::Refuse),
        Err(WalError::Damaged { .. })
    ));
    let _ = std::fs::remove_dir_all(&d);
}
