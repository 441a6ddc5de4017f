//! The write-ahead log (`--wal`): every write the server accepts is appended here before
//! it is applied, so a kill -9 loses nothing that was acknowledged (at most the last
//! `--wal-sync-ms` on a machine crash). Replayed on start after the snapshot, dropped
//! once a snapshot covers it.
//!
//! Files `SNAPSHOT.wal.N`, one generation per snapshot period. A snapshot rotates to a
//! new generation before it gathers its parts and records the generation it started
//! from; replay applies every generation from there. Records of that generation may
//! already be in the snapshot: replaying them again is harmless (event batches are
//! sequenced, the rest are last-writer-wins), and every later record is replayed too.
//!
//! ```text
//! record: len u32 LE | xxh3-64 of the body u64 LE | body (rkyv [`Write`])
//! ```
//! A write that fails part-way (disk full) is cut back to the last whole record before
//! the error reaches the client, so a later record never follows a partial one. On
//! start, a torn record at the end of the newest file (a crash mid-write: a record
//! whose declared length runs past the end, or the file's last record failing its
//! checksum, or zeros to the end) is cut off. Damage anywhere else (a record that fails
//! its checksum with more records after it, in any generation) refuses the start,
//! naming the file and offset, unless `--wal-recover truncate` accepts the loss: the
//! log is then cut at the damage (the damaged file kept beside it as `.damaged`, later
//! generations set aside as `.skipped`). Both are counted in `kvix_wal_cut_bytes`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use rkyv::rancor;
use xxhash_rust::xxh3::xxh3_64;

use crate::durable::write::Write;

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "write-ahead log {path} is damaged at byte {at}: {why}; {after} bytes of the log \
         follow the damage (start with --wal-recover truncate to drop them)"
    )]
    Damaged {
        path: String,
        at: u64,
        why: String,
        after: u64,
    },
}

/// What start does with damage before the tail of the log.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recover {
    /// Refuse to start, naming the file and offset.
    #[default]
    Refuse,
    /// Cut the log at the damage and start with what precedes it.
    Truncate,
}

/// What opening the log found.
pub struct Opened {
    pub wal: Arc<Wal>,
    /// Records to replay, oldest first.
    pub records: Vec<Write>,
    /// Bytes cut off: a torn tail, or the log after damage `--wal-recover truncate`
    /// accepted.
    pub cut_bytes: u64,
}

/// The log of one server process.
pub struct Wal {
    base: PathBuf,
    current: Mutex<Current>,
    /// Set while the log itself is replayed: those writes are in it already.
    replaying: AtomicBool,
    sync_ms: u64,
    syncer: Arc<Syncer>,
    pub appended: AtomicU64,
}

struct Current {
    generation: u64,
    file: File,
    /// Bytes of whole records in `file`: where a failed write is cut back to.
    len: u64,
    /// A failed write's bytes could not be cut off yet: nothing is appended until they are.
    torn: bool,
}

/// Flushes the current file to disk every `sync_ms`, or on demand.
struct Syncer {
    state: Mutex<SyncState>,
    wake: Condvar,
}

#[derive(Default)]
struct SyncState {
    file: Option<File>,
    waiting: Vec<oneshot::Sender<()>>,
    stop: bool,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Wal {
    /// The generations present beside `snapshot`, oldest first.
    fn generations(base: &Path) -> Result<Vec<u64>, WalError> {
        let dir = base
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let prefix = format!(
            "{}.wal.",
            base.file_name().unwrap_or_default().to_string_lossy()
        );
        let mut gens: Vec<u64> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.strip_prefix(&prefix)?.parse().ok())
            .collect();
        gens.sort_unstable();
        Ok(gens)
    }

    fn path(base: &Path, generation: u64) -> PathBuf {
        let mut p = base.as_os_str().to_owned();
        p.push(format!(".wal.{generation}"));
        PathBuf::from(p)
    }

    /// Opens the log beside `snapshot`: the log (appending to a new generation) and the
    /// records to replay, from generation `from` on (older ones are deleted).
    pub fn open(
        snapshot: &Path,
        from: u64,
        sync_ms: u64,
        recover: Recover,
    ) -> Result<Opened, WalError> {
        let gens = Self::generations(snapshot)?;
        let (mut records, mut cut_bytes, mut stopped) = (Vec::new(), 0, false);
        for (i, &g) in gens.iter().enumerate() {
            let path = Self::path(snapshot, g);
            if g < from {
                std::fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            if stopped {
                // After damage the operator accepted: the rest of the log is set aside.
                cut_bytes += std::fs::metadata(&path).map_or(0, |m| m.len());
                let aside = PathBuf::from(format!("{}.skipped", path.display()));
                std::fs::rename(&path, &aside).map_err(io(&path))?;
                tracing::error!(path = %path.display(), "write-ahead log: generation after the damage set aside, not replayed");
                continue;
            }
            let read = match read_records(&path, i + 1 == gens.len(), recover, &mut records) {
                // The refusal counts what truncating would drop: the later generations too.
                Err(WalError::Damaged {
                    path,
                    at,
                    why,
                    after,
                }) => {
                    let later: u64 = gens[i + 1..]
                        .iter()
                        .map(|&g| std::fs::metadata(Self::path(snapshot, g)).map_or(0, |m| m.len()))
                        .sum();
                    return Err(WalError::Damaged {
                        path,
                        at,
                        why,
                        after: after + later,
                    });
                }
                read => read?,
            };
            cut_bytes += read.cut;
            stopped = read.damaged;
        }
        let generation = gens.last().map_or(from, |g| (g + 1).max(from));
        let path = Self::path(snapshot, generation);
        let file = create(&path)?;
        let len = file.metadata().map_err(io(&path))?.len();
        let syncer = Arc::new(Syncer {
            state: Mutex::new(SyncState {
                file: Some(file.try_clone().map_err(io(&path))?),
                ..Default::default()
            }),
            wake: Condvar::new(),
        });
        let wal = Arc::new(Wal {
            base: snapshot.to_path_buf(),
            current: Mutex::new(Current {
                generation,
                file,
                len,
                torn: false,
            }),
            replaying: AtomicBool::new(false),
            sync_ms,
            syncer: syncer.clone(),
            appended: AtomicU64::new(0),
        });
        let period = Duration::from_millis(sync_ms.max(1));
        std::thread::Builder::new()
            .name("kvix-wal-sync".into())
            .spawn(move || syncer.run(period))
            .map_err(io(snapshot))?;
        Ok(Opened {
            wal,
            records,
            cut_bytes,
        })
    }

    /// Appends `record`. With `--wal-sync-ms 0` the returned receiver resolves once it is
    /// on disk; the caller applies the write after that.
    pub fn append(&self, record: &Write) -> Result<Option<oneshot::Receiver<()>>, WalError> {
        if self.replaying.load(Relaxed) {
            return Ok(None);
        }
        let body = rkyv::to_bytes::<rancor::Error>(record).expect("plain data serializes");
        let mut bytes = Vec::with_capacity(12 + body.len());
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&xxh3_64(&body).to_le_bytes());
        bytes.extend_from_slice(&body);
        {
            let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let path = Self::path(&self.base, cur.generation);
            if cur.torn {
                cur.file.set_len(cur.len).map_err(io(&path))?;
                cur.torn = false;
            }
            if let Err(e) = cur.file.write_all(&bytes) {
                // Part of the record may be in the file: cut it off now (or before the
                // next append), so no later record follows a partial one.
                cur.torn = cur.file.set_len(cur.len).is_err();
                return Err(io(&path)(e));
            }
            cur.len += bytes.len() as u64;
        }
        self.appended.fetch_add(1, Relaxed);
        Ok((self.sync_ms == 0).then(|| self.syncer.request()))
    }

    /// Sets or clears replay mode.
    pub fn replaying(&self, on: bool) {
        self.replaying.store(on, Relaxed);
    }

    /// Starts a new generation and returns the one that was current: a snapshot taken
    /// now covers everything before it.
    pub fn rotate(&self) -> Result<u64, WalError> {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let old = cur.generation;
        let path = Self::path(&self.base, old + 1);
        let file = create(&path)?;
        let _ = cur.file.sync_data();
        self.syncer.replace(file.try_clone().map_err(io(&path))?);
        *cur = Current {
            generation: old + 1,
            file,
            len: 0,
            torn: false,
        };
        Ok(old)
    }

    /// Deletes the generations below `generation` (a snapshot covers them).
    pub fn drop_below(&self, generation: u64) -> Result<(), WalError> {
        for g in Self::generations(&self.base)? {
            if g < generation {
                let path = Self::path(&self.base, g);
                std::fs::remove_file(&path).map_err(io(&path))?;
            }
        }
        Ok(())
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        let mut st = self.syncer.state.lock().unwrap_or_else(|p| p.into_inner());
        st.stop = true;
        self.syncer.wake.notify_all();
    }
}

impl Syncer {
    fn request(&self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.waiting.push(tx);
        self.wake.notify_all();
        rx
    }

    fn replace(&self, file: File) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.file = Some(file);
    }

    fn run(&self, period: Duration) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while !st.stop {
            if st.waiting.is_empty() {
                st = self
                    .wake
                    .wait_timeout(st, period)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let waiting = std::mem::take(&mut st.waiting);
            let file = st.file.as_ref().and_then(|f| f.try_clone().ok());
            drop(st);
            if let Some(f) = file {
                if let Err(e) = f.sync_data() {
                    tracing::error!("write-ahead log: fsync failed: {e}");
                }
            }
            for w in waiting {
                let _ = w.send(());
            }
            st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn create(path: &Path) -> Result<File, WalError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io(path))
}

/// What reading one file found beyond its whole records.
struct FileRead {
    /// Bytes cut off the file.
    cut: u64,
    /// The file was cut at damage `--wal-recover truncate` accepted: stop replaying.
    damaged: bool,
}

/// Reads every whole record of one file. A torn tail is cut off when `last` (the newest
/// file, where a crash can leave one); other damage refuses, or with
/// [`Recover::Truncate`] is cut off too.
fn read_records(
    path: &Path,
    last: bool,
    recover: Recover,
    out: &mut Vec<Write>,
) -> Result<FileRead, WalError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(io(path))?;
    let cut_at = |at: usize| {
        OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|f| f.set_len(at as u64))
            .map_err(io(path))
    };
    let mut at = 0;
    while at < bytes.len() {
        match next_record(&bytes, at) {
            Ok(len) => {
                let mut aligned = kvix_wire::AlignedVec::with_capacity(len);
                aligned.extend_from_slice(&bytes[at + 12..at + 12 + len]);
                match rkyv::from_bytes::<Write, rancor::BoxedError>(&aligned) {
                    Ok(r) => out.push(r),
                    Err(e) => {
                        let why = format!(
                            "a whole record this version cannot read (written by another \
                             kvix version?): {e}"
                        );
                        return damage(path, at, why, &bytes, recover, cut_at);
                    }
                }
                at += 12 + len;
            }
            Err((why, true)) if last => {
                tracing::warn!(path = %path.display(), at, "write-ahead log: cutting off a torn record ({why})");
                cut_at(at)?;
                return Ok(FileRead {
                    cut: (bytes.len() - at) as u64,
                    damaged: false,
                });
            }
            Err((why, _)) => return damage(path, at, why.to_string(), &bytes, recover, cut_at),
        }
    }
    Ok(FileRead {
        cut: 0,
        damaged: false,
    })
}

/// The record at `at`: its body length, or why it is not whole and whether that is
/// what a crash mid-write leaves (a record running past the end, the last record
/// failing its checksum, zeros to the end).
fn next_record(bytes: &[u8], at: usize) -> Result<usize, (&'static str, bool)> {
    let rest = &bytes[at..];
    if rest.iter().all(|&b| b == 0) {
        return Err(("zeros to the end", true));
    }
    if rest.len() < 12 {
        return Err(("a short header", true));
    }
    let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
    let sum = u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes"));
    let Some(body) = rest.get(12..12 + len) else {
        return Err(("a short body", true));
    };
    if xxh3_64(body) != sum {
        return Err(("a checksum mismatch", 12 + len == rest.len()));
    }
    Ok(len)
}

/// Damage before the tail: refused, or cut off with what follows when the operator
/// said so.
fn damage(
    path: &Path,
    at: usize,
    why: String,
    bytes: &[u8],
    recover: Recover,
    cut_at: impl Fn(usize) -> Result<(), WalError>,
) -> Result<FileRead, WalError> {
    let after = (bytes.len() - at) as u64;
    if recover == Recover::Refuse {
        return Err(WalError::Damaged {
            path: path.display().to_string(),
            at: at as u64,
            why,
            after,
        });
    }
    let kept = PathBuf::from(format!("{}.damaged", path.display()));
    std::fs::write(&kept, bytes).map_err(io(&kept))?;
    cut_at(at)?;
    tracing::error!(
        path = %path.display(), at, %why, dropped_bytes = after, kept = %kept.display(),
        "write-ahead log: damaged; --wal-recover truncate cut the log here"
    );
    Ok(FileRead {
        cut: after,
        damaged: true,
    })
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn a_flipped_byte_mid_file_in_the_newest_generation_refuses_the_start() {
        let d = dir("flip");
        let snap = d.join("s.snapshot");
        let path = log_of(&snap, 100);
        let mut bytes = std::fs::read(&path).unwrap();
        let record = bytes.len() / 100;
        bytes[40 * record + 14] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = open(&snap, 0, 50).err().expect("refused");
        let text = err.to_string();
        assert!(
            text.contains(&path.display().to_string())
                && text.contains(&format!("byte {}", 40 * record))
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
        let kept = PathBuf::from(format!("{}.damaged", path.display()));
        assert_eq!(std::fs::read(kept).unwrap(), bytes);
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
        bytes[20] ^= 0x80;
        std::fs::write(&path, &bytes).unwrap();
        // The refusal counts everything truncating would drop, later generations too.
        let all = bytes.len() as u64 + std::fs::metadata(Wal::path(&snap, 1)).unwrap().len();
        assert!(matches!(
            open(&snap, 0, 50),
            Err(WalError::Damaged { at: 0, after, .. }) if after == all
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
    fn zeros_or_a_bad_last_record_are_a_torn_tail() {
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
        let mut last_bad = whole.clone();
        let n = last_bad.len();
        last_bad[n - 1] ^= 0x01;
        std::fs::write(&path, &last_bad).unwrap();
        let opened = Wal::open(&snap, 0, 50, Recover::Refuse).unwrap();
        assert_eq!(opened.records, (0..2).map(retire).collect::<Vec<_>>());
        let _ = std::fs::remove_dir_all(&d);
    }
}
