//! A write, as the server accepts it and the logs keep it: the one type the protocol
//! handler, the write-ahead log's replay, the replicated log and the engine-event ingest
//! hand to [`crate::route::route_write`], and what `--wal` and `--log` store (rkyv).

use kvix_wire::{AlignedVec, Announced, Applied, EventSource, Feed, Lane, WorkerId};
use rkyv::rancor::Fallible;
use rkyv::ser::{Allocator, Writer};
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Deserialize, Place, Serialize};

use kvix_events::payload::Batch;
use kvix_events::stream::LastBatch;

/// One accepted write.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Write {
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
        body: Body,
    },
    /// A `Placement` frame body.
    Place {
        body: Body,
    },
    /// A delivery of the engine-event ingest.
    Ingest {
        worker: WorkerId,
        /// The ingest lease's epoch it was read under (0 without replicas).
        epoch: u64,
        model: String,
        salt: String,
        /// Drop everything the worker holds first (a new engine process).
        reset: bool,
        /// The stream's last batch once this one is applied.
        last: Option<LastBatch>,
        /// The stream's last batch before it: applied only where it is the last one
        /// applied (`kvix_events::stream::continues`), so a delivery refused on its way
        /// is never skipped over and one re-sent is never applied twice.
        after: Option<LastBatch>,
        /// The engine's message the events come from (what the logs keep).
        payload: Option<Vec<u8>>,
        /// `payload` decoded: by the ingest thread that read it, or again from `payload`
        /// when read back from a log. Not stored.
        #[rkyv(with = rkyv::with::Skip)]
        batch: Option<Batch>,
    },
}

impl Write {
    /// Whether it numbers workers or changes every executor's roster (announce, retire):
    /// such a write waits for every write before it.
    pub fn changes_roster(&self) -> bool {
        matches!(self, Write::Announce { .. } | Write::Retire { .. })
    }

    /// The worker whose home executor orders this write; None for announces and
    /// retires, which executor 0 orders (it numbers workers). An event batch's or
    /// placement's body is read, and so validated, for it.
    pub fn home_worker(&self) -> Result<Option<WorkerId>, kvix_wire::FrameError> {
        use kvix_wire::{codec, EventBatch, Placement};
        Ok(match self {
            Write::Announce { .. } | Write::Retire { .. } => None,
            Write::Events { body } => Some(codec::access::<EventBatch>(body)?.worker.to_native()),
            Write::Place { body } => Some(codec::access::<Placement>(body)?.worker.to_native()),
            Write::Ingest { worker, .. } => Some(*worker),
        })
    }
}

/// What a write gives back to the client that sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Announced(Announced),
    Applied(Applied),
    Done,
}

/// A frame body, kept aligned so the frame reads in place (rkyv), stored as its bytes.
#[derive(Clone, Debug, Default)]
pub struct Body(pub AlignedVec);

impl From<&[u8]> for Body {
    fn from(bytes: &[u8]) -> Self {
        let mut v = AlignedVec::with_capacity(bytes.len());
        v.extend_from_slice(bytes);
        Body(v)
    }
}

impl std::ops::Deref for Body {
    type Target = AlignedVec;
    fn deref(&self) -> &AlignedVec {
        &self.0
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        self.0[..] == other.0[..]
    }
}

// Archived exactly as a `Vec<u8>` (what the logs held before bodies were kept aligned).
impl Archive for Body {
    type Archived = ArchivedVec<u8>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<ArchivedVec<u8>>) {
        ArchivedVec::resolve_from_len(self.0.len(), resolver, out)
    }
}

impl<S: Fallible + Allocator + Writer + ?Sized> Serialize<S> for Body {
    fn serialize(&self, s: &mut S) -> Result<VecResolver, S::Error> {
        ArchivedVec::<u8>::serialize_from_slice(&self.0[..], s)
    }
}

impl<D: Fallible + ?Sized> Deserialize<Body, D> for ArchivedVec<u8> {
    fn deserialize(&self, _: &mut D) -> Result<Body, D::Error> {
        Ok(Body::from(self.as_slice()))
    }
}
