//! Reading the log at start, and for `kvix-server check`: first a survey that changes
//! nothing (what each generation holds and where it stops being whole), then, at start,
//! the cuts the survey calls for.

use std::fs::{File, OpenOptions};
use std::io::Read as _;
use std::path::{Path, PathBuf};

use rkyv::rancor;

use super::format::{self, End, Field};
use super::{io, Recover, WalError};
use crate::write::record::Write;

/// One generation's file as read.
struct Surveyed {
    path: PathBuf,
    len: u64,
    records: Vec<Write>,
    /// Where its whole records end; a torn tail only in the newest file.
    end: End,
    /// The format version it is written in (1: an older kvix).
    version: u8,
}

/// Every generation from the snapshot's on, read; nothing changed on disk.
pub struct Survey {
    files: Vec<Surveyed>,
}

/// What the start keeps of the log.
pub struct Settled {
    pub records: Vec<Write>,
    pub cut_bytes: u64,
    pub damage_cut: u64,
}

/// Reads the files at `paths`, oldest first. A file after the first damage is only
/// measured: nothing after damage is replayed.
pub fn survey(paths: Vec<PathBuf>) -> Result<Survey, WalError> {
    let mut files: Vec<Surveyed> = Vec::with_capacity(paths.len());
    let newest = paths.len().saturating_sub(1);
    for (i, path) in paths.into_iter().enumerate() {
        let after_damage = files.iter().any(|f| matches!(f.end, End::Damaged { .. }));
        if after_damage {
            let len = std::fs::metadata(&path).map_err(io(&path))?.len();
            files.push(Surveyed {
                path,
                len,
                records: Vec::new(),
                end: End::Whole,
                version: 2,
            });
            continue;
        }
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(io(&path))?;
        let (records, end, version) = records_of(&bytes, i == newest);
        files.push(Surveyed {
            path,
            len: bytes.len() as u64,
            records,
            end,
            version,
        });
    }
    Ok(Survey { files })
}

/// The whole records of one file's bytes, where they end, and the file's version. A
/// whole record this version cannot decode, or a torn tail anywhere but in the newest
/// file, is damage.
fn records_of(bytes: &[u8], newest: bool) -> (Vec<Write>, End, u8) {
    let scan = format::scan(bytes);
    let mut records = Vec::with_capacity(scan.bodies.len());
    for body in &scan.bodies {
        let mut aligned = kvix_wire::AlignedVec::with_capacity(body.len());
        aligned.extend_from_slice(&bytes[body.clone()]);
        match rkyv::from_bytes::<Write, rancor::BoxedError>(&aligned) {
            Ok(r) => records.push(r),
            Err(e) => {
                let why = format!("a whole record this version cannot read (written by another kvix version?): {e}");
                let at = scan.record_start(body);
                let end = End::Damaged {
                    at,
                    field: Field::RecordBody,
                    why,
                };
                return (records, end, scan.version);
            }
        }
    }
    let end = match scan.end {
        End::Torn { at, field, why } if !newest => End::Damaged {
            at,
            field,
            why: format!("{why}, in a file a newer one follows (a crash tears only the newest)"),
        },
        end => end,
    };
    (records, end, scan.version)
}

impl Survey {
    /// The refusal a start without `--wal-recover truncate` gives, if the log is damaged;
    /// it counts every byte truncating would drop.
    pub fn refusal(&self) -> Option<WalError> {
        let i = self
            .files
            .iter()
            .position(|f| matches!(f.end, End::Damaged { .. }))?;
        let End::Damaged { at, field, why } = &self.files[i].end else {
            unreachable!("found above")
        };
        let later: u64 = self.files[i + 1..].iter().map(|f| f.len).sum();
        Some(WalError::Damaged {
            path: self.files[i].path.display().to_string(),
            at: *at as u64,
            field: *field,
            why: why.clone(),
            after: self.files[i].len - *at as u64 + later,
        })
    }

    /// What a start would find, in one line (`kvix-server check`).
    pub fn describe(&self) -> Result<String, WalError> {
        if let Some(refused) = self.refusal() {
            return Err(refused);
        }
        let records: usize = self.files.iter().map(|f| f.records.len()).sum();
        let mut out = format!("{records} records in {} files", self.files.len());
        if let Some(f) = self.files.last() {
            if let End::Torn { at, field, why } = &f.end {
                out += &format!(
                    "; a torn tail of {} bytes at byte {at} of {} ({}: {why}) is cut off at start",
                    f.len - *at as u64,
                    f.path.display(),
                    field.name()
                );
            }
        }
        if self.files.iter().any(|f| f.version == 1) {
            out += "; files written by an older kvix are read by their own rules";
        }
        Ok(out)
    }

    /// Cuts what the survey found (a torn tail; damage only as `recover` allows) and
    /// returns the records to replay.
    pub fn settle(self, recover: Recover) -> Result<Settled, WalError> {
        if recover == Recover::Refuse {
            if let Some(refused) = self.refusal() {
                return Err(refused);
            }
        }
        let mut out = Settled {
            records: Vec::new(),
            cut_bytes: 0,
            damage_cut: 0,
        };
        for f in self.files {
            if out.damage_cut > 0 {
                set_aside(&f.path)?;
                out.cut_bytes += f.len;
                continue;
            }
            out.records.extend(f.records);
            match f.end {
                End::Whole => {}
                End::Torn { at, field, why } => {
                    tracing::warn!(path = %f.path.display(), at, "write-ahead log: cutting off a torn tail ({}: {why})", field.name());
                    cut(&f.path, at as u64)?;
                    out.cut_bytes += f.len - at as u64;
                }
                End::Damaged { at, field, why } => {
                    let kept = PathBuf::from(format!("{}.damaged", f.path.display()));
                    std::fs::copy(&f.path, &kept).map_err(io(&kept))?;
                    cut(&f.path, at as u64)?;
                    tracing::error!(
                        path = %f.path.display(), at, field = field.name(), %why,
                        dropped_bytes = f.len - at as u64, kept = %kept.display(),
                        "write-ahead log: damaged; --wal-recover truncate cut the log here"
                    );
                    out.cut_bytes += f.len - at as u64;
                    out.damage_cut += 1;
                }
            }
        }
        Ok(out)
    }
}

fn cut(path: &Path, at: u64) -> Result<(), WalError> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(at))
        .map_err(io(path))
}

/// A generation after accepted damage: kept beside the log, never replayed.
fn set_aside(path: &Path) -> Result<(), WalError> {
    let aside = PathBuf::from(format!("{}.skipped", path.display()));
    std::fs::rename(path, &aside).map_err(io(path))?;
    tracing::error!(path = %path.display(), "write-ahead log: generation after the damage set aside, not replayed");
    Ok(())
}
