//! The levelling at a hot swap: how far each worker's clock is raised, the same on every shard.
//!
//! A loose policy may have let the workers drift apart; the incoming one should start with them
//! level, or a swap to BSP makes the fast workers wait while a slow one replays the drift. Each
//! shard cannot level its own clocks to its own largest: the shards commit a swap at different
//! moments, so a push that reached one shard before its commit and another after leaves that
//! worker's clock one apart on the two, and two workers so crossed wait for each other's push at
//! each other's shard (a deadlock the fault search found). Instead the cluster agrees on one raise
//! per worker: every shard reports its clocks when it prepares the swap, the coordinator takes
//! each worker's largest (its frontier) and raises each by what it lacks to the largest frontier
//! ([`levelling`]), and every shard adds that same amount at its commit. A worker's clocks on the
//! shards then differ exactly as they did before (by the pushes in flight), and the workers are
//! level as of the preparation. A shard alone levels to its own largest clock.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{WorkerClock, WorkerId};

/// How far a worker's clock is raised at a swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockRaise {
    /// The worker.
    pub worker: WorkerId,
    /// By how much.
    pub by: u64,
}

/// Each worker's largest clock over several shards' reports: its frontier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontier(BTreeMap<WorkerId, u64>);

impl Frontier {
    /// Takes one shard's (or server's) clocks into account.
    pub fn merge(&mut self, clocks: impl IntoIterator<Item = WorkerClock>) {
        for c in clocks {
            let f = self.0.entry(c.worker).or_default();
            *f = (*f).max(c.clock);
        }
    }

    /// The frontier's clocks, by worker.
    pub fn clocks(&self) -> impl Iterator<Item = WorkerClock> + '_ {
        self.0.iter().map(|(&worker, &clock)| WorkerClock { worker, clock })
    }

    /// What levels the workers: each raised to the largest frontier (workers already there are
    /// not listed).
    pub fn levelling(&self) -> Vec<ClockRaise> {
        levelling(&self.clocks().collect::<Vec<_>>())
    }
}

/// Raises each worker to the largest of `clocks` (one per worker); those already there are not
/// listed.
pub fn levelling(clocks: &[WorkerClock]) -> Vec<ClockRaise> {
    let top = clocks.iter().map(|c| c.clock).max().unwrap_or(0);
    clocks
        .iter()
        .filter(|c| c.clock < top)
        .map(|c| ClockRaise { worker: c.worker, by: top - c.clock })
        .collect()
}

#[cfg(test)]
mod tests {
    //! The raise is agreed, so clocks that differed by pushes in flight still differ so.
    use super::*;

    fn wc(worker: WorkerId, clock: u64) -> WorkerClock {
        WorkerClock { worker, clock }
    }

    #[test]
    fn every_worker_is_raised_to_the_largest_frontier() {
        let mut f = Frontier::default();
        // Shard 0 has worker 1's push 8, shard 1 not yet; worker 0 pushed 3 to both.
        f.merge([wc(0, 3), wc(1, 8)]);
        f.merge([wc(0, 3), wc(1, 7), wc(2, 5)]);
        assert_eq!(f.levelling(), vec![ClockRaise { worker: 0, by: 5 }, ClockRaise { worker: 2, by: 3 }]);
        // Raised alike on both shards, worker 1's clocks stay one apart, as its push in flight
        // will close; nobody's are crossed.
    }

    #[test]
    fn nothing_to_level_is_an_empty_list() {
        assert!(Frontier::default().levelling().is_empty());
        assert!(levelling(&[wc(0, 4), wc(3, 4)]).is_empty());
    }
}
