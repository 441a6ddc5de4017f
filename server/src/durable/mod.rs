//! What outlives the process, and the types it is kept as: [`write::Write`] (an
//! accepted write, as the write-ahead log and the replicas' shared log hold it),
//! [`snapshot`] (the image of the whole index and its parts), [`wal`] (`--wal`) and
//! [`replica`] (`--log`: the Redis Stream every replica applies in order).

pub mod replica;
pub mod snapshot;
pub mod wal;
