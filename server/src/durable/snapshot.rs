//! Snapshots: the whole index in one file, written atomically (temp file, fsync,
//! rename) and checked whole before anything is restored.
//!
//! ```text
//! offset size field
//!  0     8    magic      b"KVIXSNAP"
//!  8     4    version    SNAPSHOT_VERSION (u32 LE)
//! 12     4    token block size the chains were hashed with (u32 LE)
//! 16     8    body length (u64 LE)
//! 24     8    xxh3-64 of the body (u64 LE)
//! 32     ..   body: rkyv archive of ServerImage (the engine's image, the event
//!             sources, the ingest state of their workers)
//! ```
//! A torn file (short body), a flipped bit (checksum), another block size or a body that
//! does not validate is refused with a message saying which; nothing is half-loaded.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use kvix_engine::EngineImage;
use kvix_wire::{EventSource, WorkerId};
use rkyv::rancor;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"KVIXSNAP";
pub const SNAPSHOT_VERSION: u32 = 6;
const HEADER: usize = 32;

#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("cannot read snapshot {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("snapshot {path} is not a kvix snapshot (bad magic)")]
    Magic { path: String },
    #[error("snapshot {path} has version {got}; this server reads version {SNAPSHOT_VERSION}")]
    Version { path: String, got: u32 },
    #[error("snapshot {path} was taken with {got}-token blocks but the server uses --block-size {want}; its chains cannot be reused")]
    BlockSize { path: String, got: u32, want: u32 },
    #[error("snapshot {path} is torn: header promises {want} body bytes, the file has {got}")]
    Torn { path: String, want: u64, got: u64 },
    #[error("snapshot {path} is corrupt: checksum mismatch")]
    Checksum { path: String },
    #[error("snapshot {path} is corrupt: {reason}")]
    Invalid { path: String, reason: String },
    #[error("cannot write snapshots beside {path}: {source}")]
    Unwritable {
        path: String,
        source: std::io::Error,
    },
}

/// One executor's part of a snapshot: the feeds of its workers, and their runs (taken
/// from its own copy, where their writes are applied in order with their feeds).
#[derive(Debug, Default)]
pub struct Part {
    pub feeds: Vec<(WorkerId, kvix_engine::FeedImage)>,
    pub runs: Vec<kvix_engine::RunImage>,
    pub ingest_states: Vec<(WorkerId, crate::ingest::states::IngestStateImage)>,
}

/// What a snapshot holds.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ServerImage {
    pub engine: EngineImage,
    /// The event sources subscribed, by worker: resubscribed on restore.
    pub sources: Vec<(WorkerId, EventSource)>,
    /// The ingest state of event-source workers: where their streams left off.
    pub ingest_states: Vec<(WorkerId, crate::ingest::states::IngestStateImage)>,
    /// The write-ahead log generation this snapshot started in: replay from there.
    pub wal_from: u64,
    /// Replicas: the last stream entry every part includes ("" without `--log`).
    pub log_position: String,
}

/// Serializes `image` into the snapshot format.
pub fn encode(image: &ServerImage, token_block: u32) -> Vec<u8> {
    let body = rkyv::to_bytes::<rancor::Error>(image).expect("plain data serializes");
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    out.extend_from_slice(&token_block.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&xxh3_64(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Writes `bytes` to `path` atomically: a crash leaves the old snapshot or the new one.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Checks at start that snapshots can be written beside `path` (a missing or read-only
/// directory would otherwise only show at the first write, or at shutdown).
pub fn check_writable(path: &Path) -> Result<(), SnapshotError> {
    let probe = path.with_extension("probe");
    let io = |source| SnapshotError::Unwritable {
        path: path.display().to_string(),
        source,
    };
    write(&probe, b"kvix").map_err(io)?;
    std::fs::remove_file(&probe).map_err(io)
}

/// Checks and decodes snapshot bytes.
pub fn decode(bytes: &[u8], token_block: u32, path: &str) -> Result<ServerImage, SnapshotError> {
    let path = path.to_string();
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(SnapshotError::Magic { path });
    }
    let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let long = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if word(8) != SNAPSHOT_VERSION {
        return Err(SnapshotError::Version { path, got: word(8) });
    }
    if word(12) != token_block {
        return Err(SnapshotError::BlockSize {
            path,
            got: word(12),
            want: token_block,
        });
    }
    let (want, got) = (long(16), (bytes.len() - HEADER) as u64);
    if want != got {
        return Err(SnapshotError::Torn { path, want, got });
    }
    let body = &bytes[HEADER..];
    if xxh3_64(body) != long(24) {
        return Err(SnapshotError::Checksum { path });
    }
    // The body must be aligned for in-place validation; copy when it is not (a mapped
    // file is page-aligned, so this only happens for bytes held elsewhere).
    let mut aligned = kvix_wire::AlignedVec::with_capacity(body.len());
    aligned.extend_from_slice(body);
    rkyv::from_bytes::<ServerImage, rancor::BoxedError>(&aligned).map_err(|e| {
        SnapshotError::Invalid {
            path,
            reason: e.to_string(),
        }
    })
}

/// Reads the snapshot at `path`: `Ok(None)` when there is none yet.
pub fn load(path: &Path, token_block: u32) -> Result<Option<ServerImage>, SnapshotError> {
    let shown = path.display().to_string();
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SnapshotError::Io {
                path: shown,
                source,
            })
        }
    };
    // SAFETY: the file is only read; a concurrent writer renames a new file into place
    // rather than writing this one, so the mapping does not change under us.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| SnapshotError::Io {
        path: shown.clone(),
        source,
    })?;
    decode(&map, token_block, &shown).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvix_engine::{RunImage, WorkerImage};
    use kvix_wire::{Feed, Lane};

    fn image() -> ServerImage {
        let engine = EngineImage {
            workers: vec![WorkerImage {
                id: 0,
                name: "w".into(),
                lanes: vec![Lane::full(16)],
                feed: Feed::Events,
                active: true,
                retired_at: 0,
            }],
            runs: vec![RunImage {
                ks: 7,
                start: 0,
                parent: None,
                hashes: vec![1, 2, 3],
                holders: vec![(0, 0)],
            }],
            feeds: vec![],
        };
        ServerImage {
            engine,
            sources: vec![(
                0,
                EventSource {
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay: String::new(),
                    model: "m".into(),
                    salt: String::new(),
                },
            )],
            ingest_states: vec![],
            wal_from: 3,
            log_position: "17-2".into(),
        }
    }

    #[test]
    fn round_trips_and_refuses_every_kind_of_damage() {
        let bytes = encode(&image(), 16);
        assert_eq!(decode(&bytes, 16, "s").unwrap(), image());
        assert!(matches!(
            decode(&bytes[..bytes.len() - 1], 16, "s"),
            Err(SnapshotError::Torn { .. })
        ));
        assert!(matches!(
            decode(&bytes[..10], 16, "s"),
            Err(SnapshotError::Magic { .. })
        ));
        assert!(matches!(
            decode(&bytes, 32, "s"),
            Err(SnapshotError::BlockSize {
                got: 16,
                want: 32,
                ..
            })
        ));
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            decode(&flipped, 16, "s"),
            Err(SnapshotError::Checksum { .. })
        ));
        let mut version = bytes.clone();
        version[8] = 9;
        assert!(matches!(
            decode(&version, 16, "s"),
            Err(SnapshotError::Version { got: 9, .. })
        ));
        // A body that checksums but does not validate (the header re-signed over junk).
        let junk = vec![0xffu8; 64];
        let mut forged = bytes[..HEADER].to_vec();
        forged[16..24].copy_from_slice(&(junk.len() as u64).to_le_bytes());
        forged[24..32].copy_from_slice(&xxh3_64(&junk).to_le_bytes());
        forged.extend_from_slice(&junk);
        assert!(matches!(
            decode(&forged, 16, "s"),
            Err(SnapshotError::Invalid { .. })
        ));
    }

    #[test]
    fn write_is_atomic_and_load_reads_it_back() {
        let dir = std::env::temp_dir().join(format!("kvix-snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("index.snapshot");
        assert!(
            load(&path, 16).unwrap().is_none(),
            "no snapshot yet is not an error"
        );
        write(&path, &encode(&image(), 16)).unwrap();
        assert_eq!(load(&path, 16).unwrap(), Some(image()));
        assert!(!path.with_extension("tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
