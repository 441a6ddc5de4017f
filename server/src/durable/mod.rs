//! What outlives the process: [`snapshot`] (the image of the whole index and its parts)
//! and the log every accepted write is kept in ([`Log`]: [`wal`] for one server, the
//! [`replica`] stream for several).

use std::sync::Arc;

pub mod replica;
pub mod snapshot;
pub mod wal;

/// Where accepted writes are kept, so that a restart, or another replica, has every
/// one acknowledged: one value for the three ways a server runs, so that no part of it
/// can see both logs, and a part that does something per log says what for each.
#[derive(Clone, Default)]
pub enum Log {
    /// Nothing kept: writes since the last snapshot are lost on kill -9.
    #[default]
    None,
    /// `--wal`: appended beside the snapshot before the write is applied.
    Wal(Arc<wal::Wal>),
    /// `--log`: appended to the replicas' shared stream first; every replica applies it
    /// when its follower reads it back.
    Shared(Arc<replica::Replica>),
}

impl Log {
    pub fn wal(&self) -> Option<&Arc<wal::Wal>> {
        match self {
            Log::Wal(w) => Some(w),
            _ => None,
        }
    }

    pub fn shared(&self) -> Option<&Arc<replica::Replica>> {
        match self {
            Log::Shared(r) => Some(r),
            _ => None,
        }
    }
}
