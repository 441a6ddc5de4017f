//! One publisher's stream, as a state machine: which batches to apply, which to drop
//! as duplicates, when to replay, and when the publisher is a new process. Pure logic:
//! the stream says which seq to ask a replay from (an [`Ask`]), the caller's socket
//! fetches it and hands back what came ([`Stream::replayed`]), and the output is a list
//! of [`Delivery`].
//!
//! A publisher numbers its batches 0, 1, 2, … per process and keeps the last ones for
//! replay. The stream remembers the last batch it applied as a [`LastBatch`]: its seq, its
//! timestamp and a fingerprint (xxh3) of its payload. Identity is checked whenever
//! continuity is in doubt:
//!
//! - **(re)connected, or a gap** (seq beyond last + 1): replay from the last seq. If the
//!   publisher still has that batch with the same fingerprint, it is the same process:
//!   apply what follows. If not (a new process that already published past our seq,
//!   or one that has not reached it, or a buffer that no longer reaches back), resync:
//!   replay from 0 and apply it all onto a cleared worker.
//! - **seq at or below the last**: a batch of the same process is a duplicate (its
//!   timestamp is not later than the last applied one's); a later timestamp means a new
//!   process counting from 0 again: resync.
//!
//! A replay that lost replies in the middle (a publisher's send queue overflowed) is
//! applied up to the hole and asked again from there.
//!
//! Without a replay endpoint nothing can be recovered: gaps are counted, a new process
//! is still detected by the timestamp rule and clears the worker, and so does the first
//! batch after a (re)connection that does not follow the last one (a new process that
//! published past the old seq while the subscription was away cannot be told apart).

use xxhash_rust::xxh3::xxh3_64;

use crate::payload::{self, Batch};

/// The last batch applied from a stream.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct LastBatch {
    pub seq: u64,
    /// The batch's own timestamp (the engine's clock, seconds).
    pub ts: f64,
    /// xxh3 of the payload bytes.
    pub fp: u64,
}

/// Whether a delivery that continues `after` follows `last`, the last batch an applier
/// took from the stream: the same batch (seq and fingerprint; the timestamp may be NaN).
pub fn continues(after: Option<LastBatch>, last: Option<LastBatch>) -> bool {
    match (after, last) {
        (None, None) => true,
        (Some(a), Some(l)) => a.seq == l.seq && a.fp == l.fp,
        _ => false,
    }
}

/// What to apply to the stream's worker, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// Drop everything the worker holds first (a new engine process).
    pub reset: bool,
    /// The stream's last batch once this one is applied (None after a reset alone).
    pub record: Option<LastBatch>,
    /// The batch this delivery continues: the stream's last batch before it (before the
    /// reset, for one that clears). An applier whose last batch is another one missed
    /// or already has what comes between, and drops it ([`continues`]).
    pub after: Option<LastBatch>,
    /// None: nothing to apply (a reset alone, or a payload that did not decode).
    pub batch: Option<Batch>,
    /// The payload the batch was decoded from (what the write-ahead log keeps).
    pub payload: Option<Vec<u8>>,
}

/// What a replay returned: the batches from the asked seq on, in order, as (seq,
/// payload), or why there are none.
pub type Replayed = Result<Vec<(u64, Vec<u8>)>, ReplayError>;

/// Why a replay brought nothing: the reader's own error (a socket, a silent endpoint).
pub type ReplayError = Box<dyn std::error::Error + Send + Sync>;

/// What happened, for the metrics and the log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub applied: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub replayed: u64,
    pub replay_failures: u64,
    /// Replays that came back with a hole and were asked again from it.
    pub holes: u64,
    pub restarts: u64,
    pub malformed: u64,
}

#[derive(Debug, Default)]
pub struct Stream {
    last: Option<LastBatch>,
    has_replay: bool,
    /// The next delivery must clear the worker (a resync found no replay to apply).
    reset_pending: bool,
    /// The last batch when the pending reset was decided (what the clearing continues).
    reset_from: Option<LastBatch>,
    /// A replay from 0 found nothing: the publisher's seq 0 needs no replay.
    empty: bool,
    /// Without replay: the subscription (re)connected and no message came since.
    reconnected: bool,
    /// The replay asked for and not yet answered: what its answer continues.
    waiting: Option<Then>,
    /// The live message that asked for it, (seq, payload, decoded): taken once it is
    /// answered.
    held: Option<Held>,
}

type Held = (u64, Vec<u8>, Result<Batch, payload::DecodeError>);

/// What a replay's answer continues.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// Whether the publisher still has this batch (the same process).
    Verify(LastBatch),
    /// Apply all it has onto a cleared worker.
    Resync,
}

/// A replay the stream needs before it can go on: the batches from this seq. The
/// caller asks the publisher and hands the answer to [`Stream::replayed`], and gives the
/// stream nothing else meanwhile.
pub type Ask = Option<u64>;

impl Stream {
    /// A stream that resumes after `last` (None: a new one), with or without replay.
    pub fn new(last: Option<LastBatch>, has_replay: bool) -> Self {
        Stream {
            last,
            has_replay,
            ..Stream::default()
        }
    }

    pub fn last(&self) -> Option<LastBatch> {
        self.last
    }

    /// The subscription (re)connected: catch up, checking identity.
    pub fn connected(&mut self) -> Ask {
        debug_assert!(self.waiting.is_none(), "fed while a replay is awaited");
        if self.has_replay {
            return self.verify();
        }
        self.reconnected = true;
        None
    }

    /// A live message.
    pub fn live(
        &mut self,
        seq: u64,
        payload: &[u8],
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) -> Ask {
        let decoded = payload::decode(payload);
        let ts = decoded.as_ref().map_or(f64::NAN, |b| b.ts);
        let reconnected = std::mem::take(&mut self.reconnected);
        let ask = match self.last {
            Some(l) if seq <= l.seq => {
                // Same process: not later than what was applied. An undecodable
                // payload (NaN) counts as a duplicate.
                let later = ts.partial_cmp(&l.ts) == Some(std::cmp::Ordering::Greater);
                if !later {
                    t.duplicates += 1;
                    return None;
                }
                t.restarts += 1;
                self.resync()
            }
            Some(l) if seq > l.seq + 1 => {
                t.gaps += 1;
                if self.has_replay {
                    self.verify()
                } else if reconnected {
                    // Nothing to ask whether this is the process we followed: a new one
                    // that published past our seq while we were away looks the same.
                    // What the worker held may be gone: start again from this batch.
                    t.restarts += 1;
                    self.resync()
                } else {
                    None
                }
            }
            None if self.has_replay && !(self.empty && seq == 0) => self.verify(),
            _ => None,
        };
        if ask.is_some() {
            self.held = Some((seq, payload.to_vec(), decoded));
            return ask;
        }
        self.after_catch_up(seq, payload, decoded, out, t);
        None
    }

    /// The answer to the replay the stream asked for; it may ask for another (a
    /// publisher found to be a new process is replayed from 0).
    pub fn replayed(&mut self, got: Replayed, out: &mut Vec<Delivery>, t: &mut Tally) -> Ask {
        let replayed_before = t.replayed;
        let ask = match self.waiting.take() {
            Some(Then::Verify(l)) => self.verified(l, got, out, t),
            Some(Then::Resync) => self.resynced(got, out, t),
            None => None,
        };
        if ask.is_some() {
            return ask;
        }
        if let Some((seq, payload, decoded)) = self.held.take() {
            // A replay whose last replies and end marker were dropped ends short of the
            // held message: asked again from where it ended while replays bring batches
            // (one that brought none is applied past, so a publisher that keeps losing
            // the same replies cannot hold its stream).
            let short = self.last.is_some_and(|l| seq > l.seq + 1);
            if short && self.has_replay && t.replayed > replayed_before {
                self.held = Some((seq, payload, decoded));
                return self.verify();
            }
            self.after_catch_up(seq, &payload, decoded, out, t);
        }
        None
    }

    /// A live message once whatever it asked for is applied: a duplicate of the replay,
    /// or the next batch.
    fn after_catch_up(
        &mut self,
        seq: u64,
        payload: &[u8],
        decoded: Result<Batch, payload::DecodeError>,
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) {
        if self.last.is_some_and(|l| seq <= l.seq) {
            t.duplicates += 1;
            return;
        }
        self.accept(seq, xxh3_64(payload), decoded, payload, out, t);
    }

    fn accept(
        &mut self,
        seq: u64,
        fp: u64,
        decoded: Result<Batch, payload::DecodeError>,
        bytes: &[u8],
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) {
        let (ts, batch) = match decoded {
            Ok(b) => (b.ts, Some(b)),
            Err(e) => {
                t.malformed += 1;
                tracing::debug!(seq, "ingest: undecodable payload skipped: {e}");
                (self.last.map_or(0.0, |l| l.ts), None)
            }
        };
        let record = LastBatch { seq, ts, fp };
        let reset = std::mem::take(&mut self.reset_pending);
        let after = if reset { self.reset_from } else { self.last };
        self.last = Some(record);
        t.applied += u64::from(batch.is_some());
        out.push(Delivery {
            reset,
            record: Some(record),
            after,
            payload: batch.is_some().then(|| bytes.to_vec()),
            batch,
        });
    }

    /// Asks for a replay from the last seq, to continue if the publisher is the same
    /// process.
    fn verify(&mut self) -> Ask {
        let Some(l) = self.last else {
            return self.resync();
        };
        self.waiting = Some(Then::Verify(l));
        Some(l.seq)
    }

    fn verified(
        &mut self,
        l: LastBatch,
        got: Replayed,
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) -> Ask {
        let replies = match got {
            Ok(r) => r,
            Err(e) => {
                t.replay_failures += 1;
                tracing::debug!("ingest: replay from {} failed: {e}", l.seq);
                return None;
            }
        };
        let same = replies
            .first()
            .is_some_and(|(s, p)| *s == l.seq && xxh3_64(p) == l.fp);
        if !same {
            t.restarts += 1;
            return self.resync();
        }
        self.apply_replay(&replies[1..], out, t)
    }

    /// Starts over: the worker is to be cleared and given everything the publisher
    /// still has (asked for here).
    fn resync(&mut self) -> Ask {
        if !self.reset_pending {
            self.reset_from = self.last;
        }
        self.last = None;
        self.reset_pending = true;
        if !self.has_replay {
            return None;
        }
        self.waiting = Some(Then::Resync);
        Some(0)
    }

    fn resynced(&mut self, got: Replayed, out: &mut Vec<Delivery>, t: &mut Tally) -> Ask {
        let ask = match got {
            Ok(replies) => {
                self.empty = replies.is_empty();
                self.apply_replay(&replies, out, t)
            }
            Err(e) => {
                t.replay_failures += 1;
                tracing::debug!("ingest: replay from 0 failed: {e}");
                None
            }
        };
        if self.reset_pending {
            // Nothing to apply: still clear the worker now, not at the next batch.
            out.push(Delivery {
                reset: true,
                record: None,
                after: self.reset_from,
                batch: None,
                payload: None,
            });
            self.reset_pending = false;
        }
        ask
    }

    /// Applies a replay's batches in order. At a hole (a seq missing in the middle: the
    /// publisher dropped replies it could not queue) it stops and asks again from there;
    /// a replay that brought nothing before its hole is applied past it, the hole
    /// counted as a gap, so a publisher that keeps dropping the same replies cannot hold
    /// its stream forever.
    fn apply_replay(
        &mut self,
        replies: &[(u64, Vec<u8>)],
        out: &mut Vec<Delivery>,
        t: &mut Tally,
    ) -> Ask {
        let mut took = false;
        for (seq, p) in replies {
            if self.last.is_some_and(|l| *seq <= l.seq) {
                continue;
            }
            if self.last.is_some_and(|l| *seq != l.seq + 1) {
                if took {
                    t.holes += 1;
                    return self.verify();
                }
                t.gaps += 1;
            }
            took = true;
            t.replayed += 1;
            self.accept(*seq, xxh3_64(p), payload::decode(p), p, out, t);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publisher process: its buffer of (seq, payload), all of it kept.
    #[derive(Default)]
    struct Publisher {
        buffer: Vec<(u64, Vec<u8>)>,
        /// Oldest seq still kept.
        keeps_from: u64,
        down: bool,
        /// Seqs the next replay drops (a send queue that overflowed).
        drops: Option<std::ops::Range<u64>>,
    }

    impl Publisher {
        fn replay(&mut self, from: u64) -> Replayed {
            if self.down {
                return Err("no answer".into());
            }
            let dropped = self.drops.take();
            Ok(self
                .buffer
                .iter()
                .filter(|(s, _)| *s >= from && *s >= self.keeps_from)
                .filter(|(s, _)| !dropped.as_ref().is_some_and(|d| d.contains(s)))
                .cloned()
                .collect())
        }
    }

    /// A payload `[ts, [["AllBlocksCleared"] × n], 0]`: n tells batches apart.
    fn payload(ts: f64, n: usize) -> Vec<u8> {
        use rmpv::Value;
        let ev = Value::Array(vec![Value::from("AllBlocksCleared")]);
        let v = Value::Array(vec![
            Value::F64(ts),
            Value::Array(vec![ev; n]),
            Value::from(0),
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    impl Publisher {
        fn publish(&mut self, ts: f64, n: usize) -> (u64, Vec<u8>) {
            let seq = self.buffer.len() as u64;
            let p = payload(ts, n);
            self.buffer.push((seq, p.clone()));
            (seq, p)
        }
    }

    /// The stream driven as the ingest thread drives it, `p` answering every replay it
    /// asks for at once.
    impl Stream {
        fn live_from(
            &mut self,
            seq: u64,
            b: &[u8],
            p: &mut Publisher,
            out: &mut Vec<Delivery>,
            t: &mut Tally,
        ) {
            let ask = self.live(seq, b, out, t);
            self.answer(ask, p, out, t);
        }
        fn connected_to(&mut self, p: &mut Publisher, out: &mut Vec<Delivery>, t: &mut Tally) {
            let ask = self.connected();
            self.answer(ask, p, out, t);
        }
        fn answer(
            &mut self,
            mut ask: Ask,
            p: &mut Publisher,
            out: &mut Vec<Delivery>,
            t: &mut Tally,
        ) {
            while let Some(from) = ask {
                ask = self.replayed(p.replay(from), out, t);
            }
        }
    }

    /// (reset, seq) of each delivery; and every delivery continues the one before it,
    /// as an applier checks.
    fn seqs(out: &[Delivery]) -> Vec<(bool, u64)> {
        for pair in out.windows(2) {
            assert!(
                continues(pair[1].after, pair[0].record),
                "{:?} does not continue {:?}",
                pair[1],
                pair[0]
            );
        }
        out.iter()
            .map(|d| (d.reset, d.record.map_or(0, |r| r.seq)))
            .collect()
    }

    #[test]
    fn a_late_join_replays_the_whole_buffer_then_drops_live_duplicates() {
        let mut p = Publisher::default();
        for i in 0..3 {
            p.publish(1.0 + i as f64, 1);
        }
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        s.connected_to(&mut p, &mut out, &mut t);
        assert_eq!(seqs(&out), vec![(true, 0), (false, 1), (false, 2)]);
        out.clear();
        // The SUB also got seq 2 live, then 3.
        let two = p.buffer[2].1.clone();
        s.live_from(2, &two, &mut p, &mut out, &mut t);
        let (seq, three) = p.publish(4.0, 1);
        s.live_from(seq, &three, &mut p, &mut out, &mut t);
        assert_eq!(seqs(&out), vec![(false, 3)]);
        assert_eq!((t.duplicates, t.replayed, t.restarts), (1, 3, 0));
    }

    #[test]
    fn a_gap_is_filled_from_the_replay_of_the_same_process() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, false), Vec::new(), Tally::default());
        let (q, b) = p.publish(1.0, 1);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        s.has_replay = true;
        p.publish(2.0, 2);
        p.publish(3.0, 3);
        let (q, b) = p.publish(4.0, 4);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        assert_eq!(
            seqs(&out),
            vec![(false, 0), (false, 1), (false, 2), (false, 3)]
        );
        assert_eq!((t.gaps, t.restarts), (1, 0));
    }

    #[test]
    fn a_message_that_asks_for_a_replay_is_applied_after_its_answer() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        let (q, b) = p.publish(1.0, 1);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        (out, t) = (Vec::new(), Tally::default());
        p.publish(2.0, 2);
        let (q, b) = p.publish(3.0, 3);
        // A gap: nothing is delivered until the replay from seq 0 is answered.
        assert_eq!(s.live(q, &b, &mut out, &mut t), Some(0));
        assert!(out.is_empty());
        let answer = p.replay(0);
        assert_eq!(s.replayed(answer, &mut out, &mut t), None);
        assert_eq!(seqs(&out), vec![(false, 1), (false, 2)]);
        // The held message was the replay's last batch: a duplicate.
        assert_eq!((t.gaps, t.replayed, t.duplicates), (1, 2, 1));
        // A failed replay lets the held message through as it is.
        out.clear();
        p.publish(4.0, 4);
        let (q, b) = p.publish(5.0, 5);
        assert_eq!(s.live(q, &b, &mut out, &mut t), Some(2));
        assert_eq!(s.replayed(Err("silent".into()), &mut out, &mut t), None);
        assert_eq!(seqs(&out), vec![(false, 4)]);
        assert_eq!(t.replay_failures, 1);
    }

    #[test]
    fn a_restart_below_the_last_seq_clears_and_replays_the_new_process() {
        let mut old = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        for i in 0..5 {
            let (q, b) = old.publish(1.0 + i as f64, 1);
            s.live_from(q, &b, &mut old, &mut out, &mut t);
        }
        out.clear();
        // The new process lost its first message to the slow joiner; we see seq 1.
        let mut new = Publisher::default();
        new.publish(10.0, 7);
        let (q, b) = new.publish(11.0, 8);
        s.live_from(q, &b, &mut new, &mut out, &mut t);
        assert_eq!(seqs(&out), vec![(true, 0), (false, 1)]);
        assert_eq!(out[0].batch.as_ref().unwrap().events.len(), 7);
        assert_eq!(t.restarts, 1);
    }

    #[test]
    fn a_restart_that_published_past_the_last_seq_is_not_taken_for_a_gap() {
        let mut old = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        for i in 0..3 {
            let (q, b) = old.publish(1.0 + i as f64, 1);
            s.live_from(q, &b, &mut old, &mut out, &mut t);
        }
        out.clear();
        let mut new = Publisher::default();
        for i in 0..6 {
            new.publish(10.0 + i as f64, 2 + i);
        }
        // Reconnected: the new process has seq 2 too, with another payload.
        s.connected_to(&mut new, &mut out, &mut t);
        assert_eq!(
            seqs(&out),
            vec![
                (true, 0),
                (false, 1),
                (false, 2),
                (false, 3),
                (false, 4),
                (false, 5)
            ]
        );
        assert_eq!(t.restarts, 1);
        // Seen as a gap first (seq 6 live), the same holds.
        let (mut s2, mut out2, mut t2) = (Stream::new(None, false), Vec::new(), Tally::default());
        for (q, b) in old.buffer.clone() {
            s2.live_from(q, &b, &mut old, &mut out2, &mut t2);
        }
        s2.has_replay = true;
        out2.clear();
        let (q, b) = new.publish(20.0, 9);
        s2.live_from(q, &b, &mut new, &mut out2, &mut t2);
        assert_eq!(out2.len(), 7);
        assert!(out2[0].reset);
        assert_eq!((t2.gaps, t2.restarts), (1, 1));
    }

    #[test]
    fn an_idle_new_process_clears_the_worker_with_nothing_to_apply() {
        let mut old = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        let (q, b) = old.publish(1.0, 1);
        s.live_from(q, &b, &mut old, &mut out, &mut t);
        out.clear();
        let mut new = Publisher::default();
        s.connected_to(&mut new, &mut out, &mut t);
        assert_eq!(seqs(&out), vec![(true, 0)]);
        assert!(out[0].batch.is_none());
        assert_eq!(s.last(), None);
        // Its first batch then applies without another reset.
        out.clear();
        let (q, b) = new.publish(5.0, 2);
        s.live_from(q, &b, &mut new, &mut out, &mut t);
        assert_eq!(seqs(&out), vec![(false, 0)]);
    }

    #[test]
    fn a_buffer_that_no_longer_reaches_back_resyncs_from_what_is_kept() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        let (q, b) = p.publish(1.0, 1);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        for i in 0..10 {
            p.publish(2.0 + i as f64, 1);
        }
        p.keeps_from = 6;
        out.clear();
        s.connected_to(&mut p, &mut out, &mut t);
        assert_eq!(seqs(&out)[0], (true, 6));
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn without_replay_gaps_are_counted_and_a_new_process_still_clears() {
        let mut p = Publisher {
            down: true,
            ..Default::default()
        };
        let (mut s, mut out, mut t) = (Stream::new(None, false), Vec::new(), Tally::default());
        for (q, ts) in [(0, 1.0), (3, 2.0), (1, 9.0)] {
            s.live_from(q, &payload(ts, 1), &mut p, &mut out, &mut t);
        }
        assert_eq!(seqs(&out), vec![(false, 0), (false, 3), (true, 1)]);
        assert_eq!((t.gaps, t.restarts, t.replay_failures), (1, 1, 0));
    }

    #[test]
    fn a_batch_without_a_finite_timestamp_does_not_hide_the_next_restart() {
        for bad in [f64::NAN, f64::INFINITY] {
            let mut p = Publisher {
                down: true,
                ..Default::default()
            };
            let (mut s, mut out, mut t) = (Stream::new(None, false), Vec::new(), Tally::default());
            for (q, ts) in [(0, 1.0), (1, bad)] {
                s.live_from(q, &payload(ts, 1), &mut p, &mut out, &mut t);
            }
            // A new process (seq from 0 again, later clock): cleared, then applied.
            s.live_from(0, &payload(9.0, 3), &mut p, &mut out, &mut t);
            assert_eq!(
                seqs(&out),
                vec![(false, 0), (false, 1), (true, 0)],
                "ts {bad}"
            );
            assert!(out[1].batch.is_none(), "ts {bad}: refused as malformed");
            assert_eq!(
                (t.malformed, t.restarts, t.duplicates),
                (1, 1, 0),
                "ts {bad}"
            );
        }
    }

    #[test]
    fn a_silent_replay_socket_keeps_the_state_and_counts() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        let (q, b) = p.publish(1.0, 1);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        p.down = true;
        out.clear();
        s.connected_to(&mut p, &mut out, &mut t);
        assert!(out.is_empty());
        assert_eq!(t.replay_failures, 1);
        assert_eq!(s.last().map(|l| l.seq), Some(0));
    }

    /// An applier that took batches up to 2 (3 was refused on its way) drops what does
    /// not continue its last batch; a stream started again from that batch (a rewind)
    /// re-sends 3 on, each continuing the one before, so nothing is missed or doubled.
    #[test]
    fn a_stream_rewound_to_the_last_batch_applied_resends_what_was_refused() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        s.connected_to(&mut p, &mut out, &mut t);
        for i in 0..6 {
            let (seq, b) = p.publish(i as f64, i + 1);
            s.live_from(seq, &b, &mut p, &mut out, &mut t);
        }
        // A new publisher's stream starts by clearing the worker.
        assert_eq!(
            seqs(&out),
            [
                (true, 0),
                (false, 0),
                (false, 1),
                (false, 2),
                (false, 3),
                (false, 4),
                (false, 5)
            ]
        );
        let mut applied = None;
        let take = |d: &Delivery, applied: &mut Option<LastBatch>| {
            let ok = continues(d.after, *applied);
            if ok {
                *applied = d.record;
            }
            ok
        };
        for d in &out[..4] {
            assert!(take(d, &mut applied));
        }
        // 3 refused: 4 and 5 do not continue batch 2.
        assert!(!take(&out[5], &mut applied));
        assert!(!take(&out[6], &mut applied));
        assert_eq!(applied.map(|l| l.seq), Some(2));
        let (mut again, mut out2) = (Stream::new(applied, true), Vec::new());
        again.connected_to(&mut p, &mut out2, &mut t);
        assert_eq!(seqs(&out2), [(false, 3), (false, 4), (false, 5)]);
        for d in &out2 {
            assert!(take(d, &mut applied));
        }
        // Late copies of the first stream's 4 and 5 change nothing.
        assert!(!take(&out[5], &mut applied));
        assert!(!take(&out[6], &mut applied));
        assert_eq!(applied, out[6].record);
    }

    /// A replay that lost replies in the middle (vLLM 0.9.2's and SGLang's replay socket
    /// drops what overflows its send queue) is applied up to the hole and asked again
    /// from there: nothing past a hole is applied before the hole is filled.
    #[test]
    fn a_replay_with_a_hole_is_asked_again_from_the_hole() {
        let mut p = Publisher::default();
        for i in 0..10 {
            p.publish(i as f64, i + 1);
        }
        p.drops = Some(3..6);
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        s.connected_to(&mut p, &mut out, &mut t);
        let want: Vec<(bool, u64)> = (0..10).map(|i| (i == 0, i)).collect();
        assert_eq!(seqs(&out), want);
        assert_eq!((t.holes, t.gaps, t.replayed), (1, 0, 10));
        // Asked again from the last batch before the hole, still the same process.
        assert_eq!(t.restarts, 0);
    }

    /// A replay whose last replies and end marker were dropped (the publisher's send
    /// queue overflowed at its end) ends short of the live message that asked for it:
    /// asked again from where it ended, so nothing is applied past the missing batches.
    /// Applied past them, the worker lost their removals (`engines.rs`:
    /// `a_long_replay_that_loses_replies_is_asked_again_and_nothing_is_missed`).
    #[test]
    fn a_replay_that_ends_short_of_the_held_message_is_asked_again() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, false), Vec::new(), Tally::default());
        for i in 0..3 {
            let (q, b) = p.publish(i as f64, i + 1);
            s.live_from(q, &b, &mut p, &mut out, &mut t);
        }
        s.has_replay = true;
        p.publish(3.0, 4);
        p.publish(4.0, 5);
        let (q, b) = p.publish(5.0, 6);
        // 3 and 4 went by; the replay from 2 brings 3 and ends (4 and 5 dropped).
        p.drops = Some(4..6);
        s.live_from(q, &b, &mut p, &mut out, &mut t);
        let want: Vec<(bool, u64)> = (0..6).map(|i| (false, i)).collect();
        assert_eq!(seqs(&out), want);
        assert_eq!((t.gaps, t.replayed, t.duplicates), (1, 3, 1));
    }

    /// A publisher that drops the same replies every time, right after the last batch
    /// applied, cannot hold the stream: the replay is applied past the hole, counted.
    #[test]
    fn a_hole_right_after_the_last_batch_is_applied_past_and_counted() {
        let mut p = Publisher::default();
        for i in 0..3 {
            p.publish(i as f64, i + 1);
        }
        let (mut s, mut out, mut t) = (Stream::new(None, true), Vec::new(), Tally::default());
        s.connected_to(&mut p, &mut out, &mut t);
        for i in 3..8 {
            p.publish(i as f64, i + 1);
        }
        p.drops = Some(3..5);
        // Reconnected: the replay from batch 2 lacks 3 and 4 and brings nothing before.
        let (start, mut more) = (out.len(), Vec::new());
        s.connected_to(&mut p, &mut more, &mut t);
        out.extend(more);
        let got: Vec<u64> = out[start..]
            .iter()
            .filter_map(|d| d.record)
            .map(|r| r.seq)
            .collect();
        assert_eq!(got, [5, 6, 7]);
        assert_eq!((t.holes, t.gaps), (0, 1));
    }

    /// Without replay, the first batch after a reconnection that does not follow the
    /// last one clears the worker: a new process that published past the old seq while
    /// the server was away looks just like it, and keeping the old blocks reported them
    /// as held. A gap while connected is only counted, as before.
    #[test]
    fn without_replay_a_reconnection_past_the_last_seq_clears_the_worker() {
        let mut p = Publisher::default();
        let (mut s, mut out, mut t) = (Stream::new(None, false), Vec::new(), Tally::default());
        s.connected_to(&mut p, &mut out, &mut t);
        for i in 0..3 {
            let (seq, b) = p.publish(i as f64, 1);
            s.live_from(seq, &b, &mut p, &mut out, &mut t);
        }
        // A gap while connected: counted, applied.
        p.publish(3.0, 1);
        let (seq, b) = p.publish(4.0, 1);
        s.live_from(seq, &b, &mut p, &mut out, &mut t);
        assert_eq!(seqs(&out), [(false, 0), (false, 1), (false, 2), (false, 4)]);
        assert_eq!((t.gaps, t.restarts), (1, 0));
        // Reconnected right after the last one: goes on.
        s.connected_to(&mut p, &mut out, &mut t);
        let (seq, b) = p.publish(5.0, 1);
        s.live_from(seq, &b, &mut p, &mut out, &mut t);
        // Reconnected past it: cleared, then the batch.
        s.connected_to(&mut p, &mut out, &mut t);
        p.publish(6.0, 1);
        let (seq, b) = p.publish(7.0, 1);
        s.live_from(seq, &b, &mut p, &mut out, &mut t);
        assert_eq!(
            seqs(&out),
            [
                (false, 0),
                (false, 1),
                (false, 2),
                (false, 4),
                (false, 5),
                (true, 7)
            ]
        );
        assert_eq!((t.gaps, t.restarts), (2, 1));
    }
}
