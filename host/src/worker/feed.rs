//! A push fed in pieces: the gradient of one iteration handed over a bucket at a time, each
//! shard's part sent as soon as it is whole, while the caller still computes the rest (a push
//! overlapped with the backward pass, as Horovod's and BytePS's hooks overlap theirs).
//!
//! [`PushFeed::new`] makes the two halves: the [`PushFeed`] the caller's hooks fill
//! ([`put`](PushFeed::put)), and the [`FedParts`] that [`Session::exchange`](super::Session::exchange)
//! waits on, one part per shard. Each shard's part lives in a buffer of the session's pool;
//! once every value of its key range was put, it goes to the push, which sends it as it is
//! (no copy). The pieces may come in any order (backward produces the last layers first) and
//! of any size, but each value exactly once: a piece out of the model or over one already
//! put is refused, and nothing of it is kept.
//!
//! The policy sees what it sees of a whole push: one push per shard per iteration.

use std::collections::BTreeMap;
use std::ops::Range;

use tokio::sync::oneshot;

use crate::net::pool::TensorPool;

/// Why a piece was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FeedError {
    /// The piece reaches past the model.
    #[error("values {start}..{end} are not all in the model, which has {len}")]
    OutOfRange {
        /// First value of the piece.
        start: usize,
        /// One past its last.
        end: usize,
        /// The model's length.
        len: usize,
    },
    /// Part of the piece was put already in this iteration.
    #[error(
        "values {start}..{end} overlap values put already in this iteration ({other_start}..{other_end})"
    )]
    Overlap {
        /// First value of the piece.
        start: usize,
        /// One past its last.
        end: usize,
        /// First value of the piece put before.
        other_start: usize,
        /// One past its last.
        other_end: usize,
    },
}

/// One shard's part of the push while it is filled.
#[derive(Debug)]
struct Part {
    /// The shard's key range in the whole model.
    range: Range<usize>,
    /// Its values, taken from the pool at the first piece.
    values: Vec<f32>,
    /// What was put, as ranges relative to the part: start to end, never overlapping.
    filled: BTreeMap<usize, usize>,
    /// Values put.
    count: usize,
    /// Where the part goes once whole (`None`: sent).
    send: Option<oneshot::Sender<Vec<f32>>>,
}

impl Part {
    /// Refuses `rel` (relative to the part) if it overlaps what was put.
    fn check(&self, rel: &Range<usize>) -> Result<(), Range<usize>> {
        // The piece put last that starts before `rel` ends is the only one that can overlap
        // it, since pieces never overlap each other.
        match self.filled.range(..rel.end).next_back() {
            Some((&s, &e)) if e > rel.start => Err(s..e),
            _ => Ok(()),
        }
    }
}

/// The caller's half of a fed push: see the module docs.
#[derive(Debug)]
pub struct PushFeed {
    parts: Vec<Part>,
    pool: TensorPool,
    len: usize,
}

/// The push's half: one part per shard, in shard order, each resolving once it is whole (or
/// failing if the feed was dropped first).
#[derive(Debug)]
pub struct FedParts(pub(crate) Vec<oneshot::Receiver<Vec<f32>>>);

impl PushFeed {
    /// A feed for shards with key ranges `ranges` (in order, together the whole model), whose
    /// parts are buffers of `pool`.
    pub fn new(ranges: Vec<Range<usize>>, pool: TensorPool) -> (PushFeed, FedParts) {
        let len = ranges.last().map_or(0, |r| r.end);
        let mut recv = Vec::with_capacity(ranges.len());
        let parts = ranges
            .into_iter()
            .map(|range| {
                let (send, r) = oneshot::channel();
                recv.push(r);
                Part { range, values: Vec::new(), filled: BTreeMap::new(), count: 0, send: Some(send) }
            })
            .collect();
        (PushFeed { parts, pool, len }, FedParts(recv))
    }

    /// Whether every value was put (every part sent).
    pub fn is_complete(&self) -> bool {
        self.parts.iter().all(|p| p.send.is_none())
    }

    /// Whether `len` values may be put at `offset`: within the model, and over nothing put in
    /// this iteration. Returns their range.
    pub fn check(&self, offset: usize, len: usize) -> Result<Range<usize>, FeedError> {
        let end = offset.checked_add(len).filter(|e| *e <= self.len);
        let Some(end) = end else {
            return Err(FeedError::OutOfRange {
                start: offset,
                end: offset.saturating_add(len),
                len: self.len,
            });
        };
        if len == 0 {
            return Ok(offset..end);
        }
        for p in &self.parts[self.touched(offset..end)] {
            let rel = offset.max(p.range.start) - p.range.start..end.min(p.range.end) - p.range.start;
            if let Err(o) = p.check(&rel) {
                let base = p.range.start;
                return Err(FeedError::Overlap {
                    start: offset,
                    end,
                    other_start: o.start + base,
                    other_end: o.end + base,
                });
            }
        }
        Ok(offset..end)
    }

    /// Puts `values` at `offset` of the whole model, and sends every part it makes whole.
    /// Returns how many it sent. A refused piece ([`check`](Self::check)) changes nothing.
    pub fn put(&mut self, offset: usize, values: &[f32]) -> Result<usize, FeedError> {
        let Range { start: offset, end } = self.check(offset, values.len())?;
        if values.is_empty() {
            return Ok(0);
        }
        let touched = self.touched(offset..end);
        let mut sent = 0;
        for p in &mut self.parts[touched] {
            let rel = offset.max(p.range.start) - p.range.start..end.min(p.range.end) - p.range.start;
            if p.values.is_empty() {
                p.values = self.pool.take(p.range.len());
            }
            let from = rel.start + p.range.start - offset;
            p.values[rel.clone()].copy_from_slice(&values[from..from + rel.len()]);
            p.count += rel.len();
            // Merged with its neighbours, so that the map stays as small as the gaps.
            let (mut s, mut e) = (rel.start, rel.end);
            if let Some((&ps, &pe)) = p.filled.range(..s).next_back() {
                if pe == s {
                    p.filled.remove(&ps);
                    s = ps;
                }
            }
            if let Some(ne) = p.filled.remove(&e) {
                e = ne;
            }
            p.filled.insert(s, e);
            if p.count == p.range.len() {
                sent += usize::from(Self::send(p, &self.pool));
            }
        }
        Ok(sent)
    }

    /// Puts `value` wherever nothing was put (a parameter no gradient reached), sending every
    /// part that was not. Returns how many it sent.
    pub fn fill_rest(&mut self, value: f32) -> usize {
        let mut sent = 0;
        for p in &mut self.parts {
            if p.send.is_none() {
                continue;
            }
            if p.values.is_empty() {
                p.values = self.pool.take(p.range.len());
            }
            let mut at = 0;
            for (&s, &e) in &p.filled {
                p.values[at..s].fill(value);
                at = e;
            }
            p.values[at..].fill(value);
            p.count = p.range.len();
            p.filled.clear();
            p.filled.insert(0, p.range.len());
            sent += usize::from(Self::send(p, &self.pool));
        }
        sent
    }

    /// The indices of the parts that `range` (non-empty, within the model) touches.
    fn touched(&self, range: Range<usize>) -> Range<usize> {
        let first = self.parts.partition_point(|p| p.range.end <= range.start);
        let last = self.parts.partition_point(|p| p.range.start < range.end);
        first..last
    }

    /// Sends a whole part; false if the push is gone (its buffer then goes back to the pool).
    fn send(p: &mut Part, pool: &TensorPool) -> bool {
        let values = std::mem::take(&mut p.values);
        let unsent = match p.send.take() {
            Some(s) => match s.send(values) {
                Ok(()) => return true,
                Err(values) => values,
            },
            None => values,
        };
        pool.give(unsent);
        false
    }
}

impl Drop for PushFeed {
    /// Parts never sent go back to the pool (their push fails: the feed is gone).
    fn drop(&mut self) {
        for p in &mut self.parts {
            if !p.values.is_empty() {
                self.pool.give(std::mem::take(&mut p.values));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(ranges: &[Range<usize>]) -> (PushFeed, FedParts) {
        PushFeed::new(ranges.to_vec(), TensorPool::default())
    }

    #[test]
    fn pieces_in_any_order_make_each_part_whole_once_and_in_place() {
        let (mut f, FedParts(mut parts)) = feed(&[0..3, 3..8]);
        // Backward's order: the last values first, a piece straddling the two shards.
        assert_eq!(f.put(6, &[6.0, 7.0]), Ok(0));
        assert_eq!(f.put(2, &[2.0, 3.0, 4.0, 5.0]), Ok(1));
        assert!(parts[0].try_recv().is_err(), "shard 0 still lacks values 0 and 1");
        assert_eq!(parts[1].try_recv().unwrap(), vec![3.0, 4.0, 5.0, 6.0, 7.0]);
        assert!(!f.is_complete());
        assert_eq!(f.put(0, &[0.0, 1.0]), Ok(1));
        assert_eq!(parts[0].try_recv().unwrap(), vec![0.0, 1.0, 2.0]);
        assert!(f.is_complete());
    }

    #[test]
    fn overlapping_or_outside_pieces_are_refused_and_change_nothing() {
        let (mut f, FedParts(mut parts)) = feed(&[0..4, 4..8]);
        f.put(2, &[2.0, 3.0, 4.0]).unwrap();
        let err = f.put(0, &[0.0, 1.0, 9.0]).unwrap_err();
        assert_eq!(err, FeedError::Overlap { start: 0, end: 3, other_start: 2, other_end: 4 });
        assert_eq!(
            f.put(4, &[9.0]).unwrap_err(),
            FeedError::Overlap { start: 4, end: 5, other_start: 4, other_end: 5 }
        );
        assert!(matches!(f.put(7, &[1.0, 2.0]), Err(FeedError::OutOfRange { start: 7, end: 9, len: 8 })));
        assert!(matches!(f.put(usize::MAX, &[1.0]), Err(FeedError::OutOfRange { .. })));
        // The refused pieces left nothing: what is missing can still be put, once.
        assert_eq!(f.put(0, &[0.0, 1.0]), Ok(1));
        assert_eq!(parts[0].try_recv().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
        assert_eq!(f.put(5, &[5.0, 6.0, 7.0]), Ok(1));
        assert_eq!(parts[1].try_recv().unwrap(), vec![4.0, 5.0, 6.0, 7.0]);
        assert!(f.put(3, &[0.0]).is_err(), "a sent part takes nothing more");
        assert_eq!(f.put(8, &[]), Ok(0));
        assert_eq!(f.put(2, &[]), Ok(0), "an empty piece puts nothing, wherever it is");
    }

    #[test]
    fn fill_rest_zeroes_the_gaps_and_sends_what_was_not_sent() {
        let (mut f, FedParts(mut parts)) = feed(&[0..2, 2..6, 6..7]);
        f.put(0, &[1.0, 1.0]).unwrap();
        f.put(3, &[3.0]).unwrap();
        f.put(5, &[5.0]).unwrap();
        assert_eq!(f.fill_rest(0.0), 2);
        assert_eq!(parts[0].try_recv().unwrap(), vec![1.0, 1.0]);
        assert_eq!(parts[1].try_recv().unwrap(), vec![0.0, 3.0, 0.0, 5.0]);
        assert_eq!(parts[2].try_recv().unwrap(), vec![0.0]);
        assert!(f.is_complete());
        assert_eq!(f.fill_rest(0.0), 0);
    }

    #[test]
    fn a_dropped_feed_fails_the_parts_it_did_not_send() {
        let (mut f, FedParts(mut parts)) = feed(&[0..1, 1..2]);
        f.put(0, &[1.0]).unwrap();
        drop(f);
        assert_eq!(parts[0].try_recv().unwrap(), vec![1.0]);
        assert!(matches!(parts[1].try_recv(), Err(oneshot::error::TryRecvError::Closed)));
    }
}
