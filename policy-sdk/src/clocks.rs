//! Per-shard worker clocks: the one implementation of the clock rules in [`ShardView`]'s docs,
//! used by the host's shards and by the native [`Driver`](crate::testing::Driver) alike.

use alloc::vec::Vec;

use crate::abi::{ShardView, WorkerClock, WorkerId};

/// The clocks of the live workers of one shard, with O(1) minimum and maximum.
///
/// Workers are indexed by id, so ids should be small and dense (as the coordinator assigns them).
/// Joins, leaves and ticks update the minimum and maximum in O(1) from the counts of workers at
/// each; only the last worker leaving the minimum (once per round) or the maximum rescans, so a
/// cluster of N workers joining, ticking and leaving costs O(N) per round, not O(N²).
#[derive(Clone, Debug, Default)]
pub struct Clocks {
    clock: Vec<Option<u64>>,
    live: u32,
    min: u64,
    at_min: u32,
    max: u64,
    at_max: u32,
}

impl Clocks {
    /// No workers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The shard's view: minimum, maximum and live count.
    pub fn view(&self) -> ShardView {
        ShardView { min_clock: self.min, max_clock: self.max, workers: self.live }
    }

    /// The clock of `worker`, if it is live.
    pub fn get(&self, worker: WorkerId) -> Option<u64> {
        self.clock.get(worker as usize).copied().flatten()
    }

    /// Whether `worker` is live.
    pub fn is_live(&self, worker: WorkerId) -> bool {
        self.get(worker).is_some()
    }

    /// Adds `worker` at `clock`. Returns `false` (and changes nothing) if it is already live.
    pub fn join(&mut self, worker: WorkerId, clock: u64) -> bool {
        let idx = worker as usize;
        if self.clock.len() <= idx {
            self.clock.resize(idx + 1, None);
        }
        if self.clock[idx].is_some() {
            return false;
        }
        self.clock[idx] = Some(clock);
        self.live += 1;
        if self.live == 1 {
            (self.min, self.at_min, self.max, self.at_max) = (clock, 1, clock, 1);
            return true;
        }
        if clock < self.min {
            (self.min, self.at_min) = (clock, 1);
        } else if clock == self.min {
            self.at_min += 1;
        }
        if clock > self.max {
            (self.max, self.at_max) = (clock, 1);
        } else if clock == self.max {
            self.at_max += 1;
        }
        true
    }

    /// Removes `worker`; returns its clock if it was live.
    pub fn leave(&mut self, worker: WorkerId) -> Option<u64> {
        let old = self.clock.get_mut(worker as usize)?.take()?;
        self.live -= 1;
        if old == self.min {
            self.at_min -= 1;
        }
        if old == self.max {
            self.at_max -= 1;
        }
        if self.live == 0 || self.at_min == 0 || self.at_max == 0 {
            self.recompute();
        }
        Some(old)
    }

    /// Advances `worker`'s clock by one. Returns the new clock, or `None` if it is not live.
    pub fn tick(&mut self, worker: WorkerId) -> Option<u64> {
        let slot = self.clock.get_mut(worker as usize)?.as_mut()?;
        let old = *slot;
        *slot = old + 1;
        if old + 1 > self.max {
            (self.max, self.at_max) = (old + 1, 1);
        } else if old + 1 == self.max {
            self.at_max += 1;
        }
        if old == self.min {
            self.at_min -= 1;
            if self.at_min == 0 {
                self.recompute();
            }
        }
        Some(old + 1)
    }

    /// Advances `worker`'s clock by `n` (a skip: iterations it will never push). Returns the new
    /// clock, or `None` if it is not live.
    pub fn advance(&mut self, worker: WorkerId, n: u64) -> Option<u64> {
        let slot = self.clock.get_mut(worker as usize)?.as_mut()?;
        *slot += n;
        let new = *slot;
        self.recompute();
        Some(new)
    }

    /// Raises every live worker's clock to the largest (the rebase at a hot swap, see
    /// [`ShardView`]). Returns how many clocks moved.
    pub fn rebase_to_max(&mut self) -> u32 {
        let max = self.max;
        let mut moved = 0;
        for c in self.clock.iter_mut().flatten() {
            if *c < max {
                *c = max;
                moved += 1;
            }
        }
        self.recompute();
        moved
    }

    /// Raises live workers' clocks, each by its amount (the levelling a cluster agrees on at a
    /// hot swap, see [`ShardView`]); workers not live are passed over. Returns how many clocks
    /// moved.
    pub fn raise(&mut self, by: impl IntoIterator<Item = (WorkerId, u64)>) -> u32 {
        let mut moved = 0;
        for (worker, n) in by {
            if let Some(Some(c)) = self.clock.get_mut(worker as usize) {
                if n > 0 {
                    *c = c.saturating_add(n);
                    moved += 1;
                }
            }
        }
        self.recompute();
        moved
    }

    /// The live workers and their clocks, by worker id.
    pub fn workers(&self) -> impl Iterator<Item = WorkerClock> + '_ {
        self.clock
            .iter()
            .enumerate()
            .filter_map(|(w, c)| c.map(|clock| WorkerClock { worker: w as WorkerId, clock }))
    }

    fn recompute(&mut self) {
        let mut min = u64::MAX;
        let mut max = 0;
        let mut at_min = 0;
        let mut at_max = 0;
        for &c in self.clock.iter().flatten() {
            if c < min {
                min = c;
                at_min = 1;
            } else if c == min {
                at_min += 1;
            }
            if c > max {
                max = c;
                at_max = 1;
            } else if c == max {
                at_max += 1;
            }
        }
        if self.live == 0 {
            min = 0;
        }
        self.min = min;
        self.max = max;
        self.at_min = at_min;
        self.at_max = at_max;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_max_follow_ticks_joins_and_leaves() {
        let mut c = Clocks::new();
        assert_eq!(c.view(), ShardView { min_clock: 0, max_clock: 0, workers: 0 });
        c.join(0, 0);
        c.join(2, 0);
        c.tick(0);
        assert_eq!(c.view(), ShardView { min_clock: 0, max_clock: 1, workers: 2 });
        c.tick(2);
        assert_eq!(c.view().min_clock, 1);
        c.tick(2);
        c.tick(2);
        assert_eq!(c.view(), ShardView { min_clock: 1, max_clock: 3, workers: 2 });
        assert_eq!(c.leave(0), Some(1));
        assert_eq!(c.view(), ShardView { min_clock: 3, max_clock: 3, workers: 1 });
        assert!(!c.join(2, 0));
        assert_eq!(c.tick(7), None);
        c.join(5, 1);
        assert_eq!(c.rebase_to_max(), 1, "only worker 5 was behind");
        assert_eq!(c.view(), ShardView { min_clock: 3, max_clock: 3, workers: 2 });
        assert_eq!(c.get(5), Some(3));
        assert_eq!(c.raise([(2, 2), (5, 1), (9, 4), (5, 0)]), 2, "worker 9 is not live");
        assert_eq!(c.view(), ShardView { min_clock: 4, max_clock: 5, workers: 2 });
    }

    /// The incremental minimum and maximum (and their counts) equal a rescan after every one of
    /// many pseudo-random joins, leaves, ticks and skips.
    #[test]
    fn incremental_min_max_match_a_rescan() {
        let mut c = Clocks::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let worker = (x % 12) as WorkerId;
            match (x >> 8) % 10 {
                0 | 1 => {
                    c.join(worker, (x >> 16) % 6);
                }
                2 => {
                    c.leave(worker);
                }
                3 => {
                    c.advance(worker, (x >> 16) % 3);
                }
                _ => {
                    c.tick(worker);
                }
            }
            let mut fresh = c.clone();
            fresh.recompute();
            assert_eq!(c.view(), fresh.view(), "step {step}");
            assert_eq!((c.at_min, c.at_max), (fresh.at_min, fresh.at_max), "step {step}");
        }
    }
}
