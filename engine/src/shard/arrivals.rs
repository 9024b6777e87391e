//! When each push arrives, against the first push of its iteration on the shard: the spread a
//! synchronous rule waits out (a BSP round closes at its last arrival) and an asynchronous one
//! does not, as a histogram for the metrics (`syncopate_push_arrival_offset_seconds`).
//!
//! Bounded and allocation-free on the push path: the first arrival of each of the last
//! [`ARRIVAL_WINDOW`] iterations is kept in a ring; a push for an iteration older than that is
//! not counted. Not part of a snapshot: a restored or promoted shard counts afresh.

use serde::{Deserialize, Serialize};

/// Buckets of the histogram: bucket `k < 15` counts offsets below `2^k` ms (and, for `k > 0`,
/// at least `2^(k-1)` ms); the last counts 16.384 s and more.
pub const ARRIVAL_BUCKETS: usize = 16;

/// Iterations whose first arrival is remembered.
pub const ARRIVAL_WINDOW: usize = 64;

/// The histogram of arrival offsets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrivalCounts {
    /// Pushes by offset bucket ([`ARRIVAL_BUCKETS`]).
    pub counts: [u64; ARRIVAL_BUCKETS],
    /// The offsets summed, in nanoseconds.
    pub sum_ns: u64,
}

impl ArrivalCounts {
    /// The upper bound of bucket `k` in seconds; `None` for the last (no bound).
    pub fn upper_s(k: usize) -> Option<f64> {
        (k + 1 < ARRIVAL_BUCKETS).then(|| (1u64 << k) as f64 / 1e3)
    }

    /// The bucket of an offset of `ns` nanoseconds.
    pub fn bucket(ns: u64) -> usize {
        let ms = ns / 1_000_000;
        ((u64::BITS - ms.leading_zeros()) as usize).min(ARRIVAL_BUCKETS - 1)
    }
}

/// The first arrivals of recent iterations, and the histogram.
#[derive(Clone, Debug)]
pub(crate) struct Arrivals {
    /// By iteration modulo [`ARRIVAL_WINDOW`]: the iteration and when its first push came.
    first: [(u64, u64); ARRIVAL_WINDOW],
    counts: ArrivalCounts,
}

impl Default for Arrivals {
    fn default() -> Self {
        Arrivals { first: [(u64::MAX, 0); ARRIVAL_WINDOW], counts: ArrivalCounts::default() }
    }
}

impl Arrivals {
    /// Counts a push of `iteration` arriving at `now_ns`.
    pub(crate) fn record(&mut self, iteration: u64, now_ns: u64) {
        let slot = &mut self.first[(iteration % ARRIVAL_WINDOW as u64) as usize];
        let offset = match *slot {
            (it, at) if it == iteration => now_ns.saturating_sub(at),
            (it, _) if it == u64::MAX || it < iteration => {
                *slot = (iteration, now_ns);
                0
            }
            // Older than the window: its iteration's first arrival is forgotten.
            _ => return,
        };
        self.counts.counts[ArrivalCounts::bucket(offset)] += 1;
        self.counts.sum_ns = self.counts.sum_ns.saturating_add(offset);
    }

    /// The histogram so far.
    pub(crate) fn counts(&self) -> ArrivalCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_fall_in_power_of_two_millisecond_buckets() {
        assert_eq!(ArrivalCounts::bucket(0), 0);
        assert_eq!(ArrivalCounts::bucket(999_999), 0);
        assert_eq!(ArrivalCounts::bucket(1_000_000), 1);
        assert_eq!(ArrivalCounts::bucket(3_999_999), 2);
        assert_eq!(ArrivalCounts::bucket(8_191_000_000), 13);
        assert_eq!(ArrivalCounts::bucket(16_383_000_000), 14);
        assert_eq!(ArrivalCounts::bucket(16_384_000_000), 15);
        assert_eq!(ArrivalCounts::bucket(u64::MAX), 15);
        assert_eq!(ArrivalCounts::upper_s(0), Some(0.001));
        assert_eq!(ArrivalCounts::upper_s(14), Some(16.384));
        assert_eq!(ArrivalCounts::upper_s(15), None);
    }

    #[test]
    fn each_push_is_timed_from_the_first_of_its_iteration() {
        let mut a = Arrivals::default();
        a.record(5, 100_000_000);
        a.record(5, 103_000_000); // 3 ms after
        a.record(6, 104_000_000); // the first of 6
        a.record(5, 150_000_000); // 50 ms after 5's first
        let c = a.counts();
        assert_eq!(c.counts[0], 2);
        assert_eq!(c.counts[2], 1);
        assert_eq!(c.counts[6], 1);
        assert_eq!(c.sum_ns, 53_000_000);
        // 64 iterations on, iteration 5's slot holds 69: a late push of 5 is not counted.
        a.record(69, 200_000_000);
        a.record(5, 201_000_000);
        assert_eq!(a.counts().counts.iter().sum::<u64>(), 5);
    }
}
