//! Per-shard worker clocks: the one implementation of the clock rules in [`ShardView`]'s docs,
//! used by the host's shards and by the native [`Driver`](crate::testing::Driver) alike.

use alloc::vec::Vec;

use crate::abi::{ShardView, WorkerClock, WorkerId};

/// The clocks of the live workers of one shard, with O(1) minimum and maximum.
///
/// Workers are indexed by id, so ids should be small and dense (as the coordinator assigns them).
#[derive(Clone, Debug, Default)]
pub struct Clocks {
    clock: Vec<Option<u64>>,
    live: u32,
    min: u64,
    at_min: u32,
    max: u64,
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
        self.recompute();
        true
    }

    /// Removes `worker`; returns its clock if it was live.
    pub fn leave(&mut self, worker: WorkerId) -> Option<u64> {
        let old = self.clock.get_mut(worker as usize)?.take()?;
        self.live -= 1;
        self.recompute();
        Some(old)
    }

    /// Advances `worker`'s clock by one. Returns the new clock, or `None` if it is not live.
    pub fn tick(&mut self, worker: WorkerId) -> Option<u64> {
        let slot = self.clock.get_mut(worker as usize)?.as_mut()?;
        let old = *slot;
        *slot = old + 1;
        if old + 1 > self.max {
            self.max = old + 1;
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
        for c in self.clock.iter().flatten() {
            if *c < min {
                min = *c;
                at_min = 1;
            } else if *c == min {
                at_min += 1;
            }
            max = max.max(*c);
        }
        if self.live == 0 {
            min = 0;
        }
        self.min = min;
        self.max = max;
        self.at_min = at_min;
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
    }
}
