//! The engines' KV-cache events, without sockets, threads or a server: what the ingest
//! of `kvix-server` runs on each message.
//!
//! [`payload`] decodes an engine's msgpack message (every vLLM and SGLang release's
//! encodings, read in one pass) into typed engine events; [`stream`]
//! orders one source's messages (duplicates, gaps, replays, a new engine process);
//! [`translate`] turns engine events into kvix events (rehashing token blocks into kvix
//! keyspaces, pages and salts; `pending` holds an unfinished lane block's tokens);
//! [`encode`] writes a batch as vLLM does, for mock engines.

pub mod encode;
mod known;
mod msgpack;
pub mod payload;
mod pending;
pub mod stream;
pub mod translate;
