//! A write, as the server accepts it and the logs keep it: the one type the protocol
//! handler, the write-ahead log's replay, the replicated log and the engine-event ingest
//! hand to [`crate::write::route_write`], and what `--wal` and `--log` store (rkyv).

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
        body: FrameBytes,
    },
    /// A `Placement` frame body.
    Place {
        body: FrameBytes,
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
    /// A placement-fed worker's engine lost its cache (its own reuse reports say so):
    /// everything its placements hold is dropped (`crate::reuse`).
    ForgetPlacements {
        worker: WorkerId,
    },
    /// An event-fed worker whose events do not arrive (its engine reuses what kvix never
    /// heard of, by its own reuse reports): gateways' placements fill in for it from now
    /// on, as for a worker whose history is lost, until its events' clear.
    FillIn {
        worker: WorkerId,
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
    /// placement's body is read for it, validated unless that was done already (by the
    /// protocol handler, or an earlier reader on its way), and remembered as such.
    pub fn home_worker(&mut self) -> Result<Option<WorkerId>, kvix_wire::FrameError> {
        use kvix_wire::{EventBatch, Placement};
        Ok(match self {
            Write::Announce { .. } | Write::Retire { .. } => None,
            Write::Events { body } => Some(body.validate::<EventBatch>()?.worker.to_native()),
            Write::Place { body } => Some(body.validate::<Placement>()?.worker.to_native()),
            Write::Ingest { worker, .. }
            | Write::ForgetPlacements { worker }
            | Write::FillIn { worker } => Some(*worker),
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
/// It remembers the message kind it was validated as (by the frame reader, or the first
/// [`FrameBytes::validate`] on its way), so that a body read on the route and again in the write
/// queue is validated once: a client's event batch was validated three times.
#[derive(Clone, Debug, Default)]
pub struct FrameBytes {
    bytes: AlignedVec,
    /// Validated as this kind's archived message (not stored: a log is read afresh).
    checked: Option<kvix_wire::Kind>,
}

impl From<&[u8]> for FrameBytes {
    fn from(bytes: &[u8]) -> Self {
        let mut v = AlignedVec::with_capacity(bytes.len());
        v.extend_from_slice(bytes);
        FrameBytes {
            bytes: v,
            checked: None,
        }
    }
}

impl FrameBytes {
    /// Bytes the frame reader validated as a `kind` message.
    pub fn validated(bytes: &[u8], kind: kvix_wire::Kind) -> Self {
        FrameBytes {
            checked: Some(kind),
            ..FrameBytes::from(bytes)
        }
    }

    /// The archived `M` the body holds, validated unless it was as `M` already.
    pub fn access<M: kvix_wire::Body>(&self) -> Result<&M::Archived, kvix_wire::FrameError> {
        if self.checked == Some(M::KIND) {
            // SAFETY: these bytes, which never change, were validated as an `M` (by
            // `codec::access::<M>` in `check`, or by the frame reader for `validated`),
            // and an AlignedVec keeps them aligned.
            return Ok(unsafe { rkyv::access_unchecked::<M::Archived>(&self.bytes) });
        }
        kvix_wire::codec::access::<M>(&self.bytes)
    }

    /// [`FrameBytes::access`], remembering the body as validated.
    pub fn validate<M: kvix_wire::Body>(&mut self) -> Result<&M::Archived, kvix_wire::FrameError> {
        if self.checked != Some(M::KIND) {
            kvix_wire::codec::access::<M>(&self.bytes)?;
            self.checked = Some(M::KIND);
        }
        self.access::<M>()
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl PartialEq for FrameBytes {
    fn eq(&self, other: &Self) -> bool {
        self.bytes[..] == other.bytes[..]
    }
}

// Archived exactly as a `Vec<u8>` (what the logs held before bodies were kept aligned).
impl Archive for FrameBytes {
    type Archived = ArchivedVec<u8>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<ArchivedVec<u8>>) {
        ArchivedVec::resolve_from_len(self.bytes.len(), resolver, out)
    }
}

impl<S: Fallible + Allocator + Writer + ?Sized> Serialize<S> for FrameBytes {
    fn serialize(&self, s: &mut S) -> Result<VecResolver, S::Error> {
        ArchivedVec::<u8>::serialize_from_slice(&self.bytes[..], s)
    }
}

impl<D: Fallible + ?Sized> Deserialize<FrameBytes, D> for ArchivedVec<u8> {
    fn deserialize(&self, _: &mut D) -> Result<FrameBytes, D::Error> {
        Ok(FrameBytes::from(self.as_slice()))
    }
}

#[cfg(test)]
mod body_tests {
    use super::*;
    use kvix_wire::{codec, EventBatch, Keyspace, Kind, Placement};

    fn event_batch_body() -> Vec<u8> {
        let batch = EventBatch {
            worker: 3,
            seq: 1,
            keyspace: Keyspace::tokens("m"),
            events: vec![],
        };
        let frame = codec::encode(&batch, 1, 0).unwrap();
        codec::split_frame(&frame, u32::MAX)
            .unwrap()
            .unwrap()
            .body
            .to_vec()
    }

    #[test]
    fn a_body_is_validated_once_as_its_kind_and_never_trusted_as_another() {
        let bytes = event_batch_body();
        let mut body = FrameBytes::from(&bytes[..]);
        assert_eq!(body.checked, None);
        assert_eq!(body.validate::<EventBatch>().unwrap().worker.to_native(), 3);
        assert_eq!(body.checked, Some(Kind::EventBatch));
        assert_eq!(body.access::<EventBatch>().unwrap().seq.to_native(), 1);
        // Checked as an event batch says nothing of it as a placement: validated again.
        let _ = body.access::<Placement>();
        assert_eq!(body.checked, Some(Kind::EventBatch));
        // What a log holds is read afresh: the mark is not stored.
        let mut write = Write::Events {
            body: FrameBytes::validated(&bytes, Kind::EventBatch),
        };
        let stored = rkyv::to_bytes::<rkyv::rancor::Error>(&write).unwrap();
        let mut back = rkyv::from_bytes::<Write, rkyv::rancor::Error>(&stored).unwrap();
        let Write::Events { body: read } = &back else {
            panic!("an event batch")
        };
        assert_eq!(read.checked, None);
        assert_eq!(back.home_worker().unwrap(), Some(3));
        assert_eq!(write.home_worker().unwrap(), Some(3));
        // Damaged bytes are refused, not trusted.
        let mut damaged = Write::Events {
            body: FrameBytes::from(&bytes[..bytes.len() / 2]),
        };
        assert!(damaged.home_worker().is_err());
    }
}
