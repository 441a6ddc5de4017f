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
//! Each file begins with a header and holds whole records ([`format`]: every record
//! header carries a check of its own, so a damaged length is never taken for a torn
//! tail). A write that fails part-way (disk full) is cut back to the last whole record
//! before the error reaches the client, so a later record never follows a partial one.
//! On start, a torn tail of the newest file (what a crash mid-write leaves: a header cut
//! short, a valid header whose body runs past the end, zeros to the end) is cut off.
//! Anything else that is not a whole record (a header or body failing its check, a
//! length past the file's bound, a torn tail in an older file) is damage: it refuses
//! the start, naming the file, offset and field, unless `--wal-recover truncate`
//! accepts the loss: the log is then cut at the damage (the damaged file kept beside it
//! as `.damaged`, later generations set aside as `.skipped`), counted in
//! `kvix_wal_damage_total` and logged at ERROR. Bytes cut either way are in
//! `kvix_wal_cut_bytes`. `kvix-server check` reads the log the same way and reports
//! what a start would find.

pub mod format;
mod read;

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use rkyv::rancor;

use crate::write::record::Write;
use format::Field;

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "write-ahead log {path} is damaged at byte {at}, in {}: {why}; {after} bytes of the \
         log follow the damage (start with --wal-recover truncate to drop them)",
        field.name()
    )]
    Damaged {
        path: String,
        at: u64,
        field: Field,
        why: String,
        after: u64,
    },
    #[error(
        "write-ahead log {path}: a record of {len} bytes is past the format's bound of {} bytes",
        format::MAX_RECORD
    )]
    TooLarge { path: String, len: usize },
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
    /// Damage `--wal-recover truncate` cut the log at (0 or 1: nothing after it is read).
    pub damage_cut: u64,
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

    /// The files of the generations from `from` on, oldest first.
    fn paths_from(base: &Path, from: u64) -> Result<Vec<PathBuf>, WalError> {
        Ok(Self::generations(base)?
            .into_iter()
            .filter(|&g| g >= from)
            .map(|g| Self::path(base, g))
            .collect())
    }

    /// What a start would find in the log beside `snapshot` from generation `from` on,
    /// changing nothing: one line, or the damage that would refuse the start.
    pub fn inspect(snapshot: &Path, from: u64) -> Result<String, WalError> {
        read::survey(Self::paths_from(snapshot, from)?)?.describe()
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
        for &g in gens.iter().filter(|&&g| g < from) {
            let path = Self::path(snapshot, g);
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
        let settled = read::survey(Self::paths_from(snapshot, from)?)?.settle(recover)?;
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
            records: settled.records,
            cut_bytes: settled.cut_bytes,
            damage_cut: settled.damage_cut,
        })
    }

    /// Appends `record`. With `--wal-sync-ms 0` the returned receiver resolves once it is
    /// on disk; the caller applies the write after that.
    pub fn append(&self, record: &Write) -> Result<Option<oneshot::Receiver<()>>, WalError> {
        if self.replaying.load(Relaxed) {
            return Ok(None);
        }
        let body = rkyv::to_bytes::<rancor::Error>(record).expect("plain data serializes");
        {
            let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let path = Self::path(&self.base, cur.generation);
            let bytes = format::record(&body).ok_or_else(|| WalError::TooLarge {
                path: path.display().to_string(),
                len: body.len(),
            })?;
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
            len: format::FILE_HEADER as u64,
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

/// A new generation's file, its header written.
fn create(path: &Path) -> Result<File, WalError> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(path)
        .map_err(io(path))?;
    file.write_all(&format::file_header()).map_err(io(path))?;
    Ok(file)
}

#[cfg(test)]
mod tests;
