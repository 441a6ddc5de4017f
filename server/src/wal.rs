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
//! record: len u32 LE | xxh3-64 of the body u64 LE | body (rkyv Record)
//! ```
//! A torn record at the end of the newest file (a crash mid-write) is cut off; a damaged
//! record anywhere else refuses the start.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use kvix_wire::{EventSource, Feed, Lane, WorkerId};
use rkyv::{rancor, Archive, Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// One accepted write.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Record {
    Announce {
        name: String,
        lanes: Vec<Lane>,
        feed: Feed,
        source: Option<EventSource>,
    },
    Retire {
        worker: WorkerId,
    },
    /// An `EventBatch` frame body.
    Events {
        body: Vec<u8>,
    },
    /// A `Placement` frame body.
    Place {
        body: Vec<u8>,
    },
    /// A delivery of the engine-event ingest.
    Ingest {
        worker: WorkerId,
        /// The ingest lease's epoch it was read under (0 without replicas).
        epoch: u64,
        model: String,
        salt: String,
        reset: bool,
        last: Option<crate::ingest::stream::Record>,
        payload: Option<Vec<u8>>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("write-ahead log {path} is damaged at byte {at}: {why}")]
    Damaged { path: String, at: u64, why: String },
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

    /// Opens the log beside `snapshot`: returns it (appending to a new generation) and
    /// the records to replay, from generation `from` on (older ones are deleted).
    pub fn open(
        snapshot: &Path,
        from: u64,
        sync_ms: u64,
    ) -> Result<(Arc<Wal>, Vec<Record>), WalError> {
        let gens = Self::generations(snapshot)?;
        let mut records = Vec::new();
        for (i, &g) in gens.iter().enumerate() {
            let path = Self::path(snapshot, g);
            if g < from {
                std::fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            read_records(&path, i + 1 == gens.len(), &mut records)?;
        }
        let generation = gens.last().map_or(from, |g| (g + 1).max(from));
        let path = Self::path(snapshot, generation);
        let file = create(&path)?;
        let syncer = Arc::new(Syncer {
            state: Mutex::new(SyncState {
                file: Some(file.try_clone().map_err(io(&path))?),
                ..Default::default()
            }),
            wake: Condvar::new(),
        });
        let wal = Arc::new(Wal {
            base: snapshot.to_path_buf(),
            current: Mutex::new(Current { generation, file }),
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
        Ok((wal, records))
    }

    /// Appends `record`. With `--wal-sync-ms 0` the returned receiver resolves once it is
    /// on disk; the caller applies the write after that.
    pub fn append(&self, record: &Record) -> Result<Option<oneshot::Receiver<()>>, WalError> {
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
            cur.file.write_all(&bytes).map_err(io(&path))?;
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

/// Reads every whole record of one file; a torn tail is cut off when `last` (the newest
/// file, where a crash can leave one), anything else damaged is an error.
fn read_records(path: &Path, last: bool, out: &mut Vec<Record>) -> Result<(), WalError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(io(path))?;
    let damaged = |at: usize, why: String| WalError::Damaged {
        path: path.display().to_string(),
        at: at as u64,
        why,
    };
    let mut at = 0;
    while at < bytes.len() {
        let torn = |why: &str| -> Result<(), WalError> {
            if last {
                tracing::warn!(path = %path.display(), at, "write-ahead log: cutting off a torn record ({why})");
                OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(at as u64))
                    .map_err(io(path))
            } else {
                Err(damaged(at, why.to_string()))
            }
        };
        if bytes.len() - at < 12 {
            return torn("a short header");
        }
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let sum = u64::from_le_bytes(bytes[at + 4..at + 12].try_into().expect("8 bytes"));
        let Some(body) = bytes.get(at + 12..at + 12 + len) else {
            return torn("a short body");
        };
        if xxh3_64(body) != sum {
            return torn("a checksum mismatch");
        }
        let mut aligned = kvix_wire::AlignedVec::with_capacity(len);
        aligned.extend_from_slice(body);
        let record = rkyv::from_bytes::<Record, rancor::Error>(&aligned)
            .map_err(|e| damaged(at, e.to_string()))?;
        out.push(record);
        at += 12 + len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvix-wal-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn retire(w: WorkerId) -> Record {
        Record::Retire { worker: w }
    }

    #[test]
    fn records_replay_in_order_across_generations_and_old_ones_go() {
        let d = dir("gens");
        let snap = d.join("s.snapshot");
        {
            let (wal, old) = Wal::open(&snap, 0, 50).unwrap();
            assert!(old.is_empty());
            wal.append(&retire(1)).unwrap();
            assert_eq!(wal.rotate().unwrap(), 0);
            wal.append(&retire(2)).unwrap();
            wal.replaying(true);
            wal.append(&retire(99)).unwrap();
        }
        let (_, records) = Wal::open(&snap, 0, 50).unwrap();
        assert_eq!(records, vec![retire(1), retire(2)]);
        // A snapshot that started at generation 1 needs only what follows.
        let (wal, records) = Wal::open(&snap, 1, 50).unwrap();
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
            let (wal, _) = Wal::open(&snap, 0, 50).unwrap();
            wal.append(&retire(1)).unwrap();
            wal.append(&retire(2)).unwrap();
        }
        let path = Wal::path(&snap, 0);
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        let (_, records) = Wal::open(&snap, 0, 50).unwrap();
        assert_eq!(
            records,
            vec![retire(1)],
            "the torn second record is cut off"
        );
        // Generation 0 is no longer the newest: damage in it refuses the start.
        let mut bad = std::fs::read(&path).unwrap();
        bad[14] ^= 0xff;
        std::fs::write(&path, &bad).unwrap();
        assert!(matches!(
            Wal::open(&snap, 0, 50),
            Err(WalError::Damaged { .. })
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn sync_on_every_write_answers_once_on_disk() {
        let d = dir("sync");
        let (wal, _) = Wal::open(&d.join("s.snapshot"), 0, 0).unwrap();
        let rx = wal
            .append(&retire(1))
            .unwrap()
            .expect("a durability receipt");
        futures::executor::block_on(rx).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }
}
