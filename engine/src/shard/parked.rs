//! The pulls a shard has parked until their release condition holds.
//!
//! After every event the shard asks which parked pulls are now due. Scanning them all each time
//! costs O(parked) per event, which is quadratic in the workers under BSP (every worker's pull
//! waits for the slowest, 10,000 of them on a large simulated cluster). The set keeps a lower bound
//! on the smallest min-clock any parked pull waits for, so the common answer, "none", costs one
//! comparison; it scans only when the shard's min clock has reached that bound, i.e. about once per
//! round. The scan order is the one a plain vector with `swap_remove` gives, so which pull is
//! served first does not depend on the shortcut.

use syncopate_policy_sdk::abi::{Release, RequestId, ShardView, WorkerId};

use super::Parked;

/// Parked pulls, with a lower bound on the min clock at which the next one can be due.
#[derive(Debug)]
pub(super) struct ParkedPulls {
    pulls: Vec<Parked>,
    /// No parked pull with `MinClockAtLeast(c)` has `c` below this; `u64::MAX` when none waits
    /// on the min clock. Removing a pull leaves it as it is (still a lower bound); a scan makes it
    /// exact again.
    due_from: u64,
}

impl ParkedPulls {
    pub(super) fn new() -> Self {
        ParkedPulls { pulls: Vec::new(), due_from: u64::MAX }
    }

    pub(super) fn len(&self) -> usize {
        self.pulls.len()
    }

    /// The parked pulls, in their order (for snapshots).
    pub(super) fn as_slice(&self) -> &[Parked] {
        &self.pulls
    }

    /// The id of `worker`'s parked pull for `iteration`, if there is one.
    pub(super) fn find(&self, worker: WorkerId, iteration: u64) -> Option<RequestId> {
        self.pulls
            .iter()
            .find(|p| p.pull.worker == worker && p.pull.iteration == iteration)
            .map(|p| p.pull.id)
    }

    pub(super) fn contains(&self, pull: RequestId) -> bool {
        self.pulls.iter().any(|p| p.pull.id == pull)
    }

    pub(super) fn push(&mut self, p: Parked) {
        if let Release::MinClockAtLeast(c) = p.until {
            self.due_from = self.due_from.min(c);
        }
        self.pulls.push(p);
    }

    /// Takes out the parked pull with this id, if there is one.
    pub(super) fn take(&mut self, pull: RequestId) -> Option<Parked> {
        let pos = self.pulls.iter().position(|p| p.pull.id == pull)?;
        Some(self.pulls.swap_remove(pos))
    }

    /// Drops a departed worker's pulls: nobody is left to answer.
    pub(super) fn forget_worker(&mut self, worker: WorkerId) {
        self.pulls.retain(|p| p.pull.worker != worker);
    }

    /// Puts every explicitly parked pull under BSP's rule (the fallback once a policy is
    /// quarantined: nobody will release them explicitly any more).
    pub(super) fn explicit_to_fallback(&mut self) {
        for p in &mut self.pulls {
            if p.until == Release::Explicit {
                p.until = Release::MinClockAtLeast(p.pull.clock);
                self.due_from = self.due_from.min(p.pull.clock);
            }
        }
    }

    /// Puts every parked pull under BSP's rule at its worker's clock now (`clock_of`; the pull's
    /// own clock for a worker that has none): a stalled policy's pulls, which the fallback rules
    /// decide from then on.
    pub(super) fn all_to_fallback(&mut self, clock_of: impl Fn(WorkerId) -> Option<u64>) {
        for p in &mut self.pulls {
            let clock = clock_of(p.pull.worker).unwrap_or(p.pull.clock);
            p.until = Release::MinClockAtLeast(clock);
            self.due_from = self.due_from.min(clock);
        }
    }

    /// Empties the set, in parking order as far as `swap_remove` kept it.
    pub(super) fn drain(&mut self) -> impl Iterator<Item = Parked> + '_ {
        self.due_from = u64::MAX;
        self.pulls.drain(..)
    }

    /// Whether a pull may be due under `view`; `false` means none is.
    pub(super) fn may_be_due(&self, view: ShardView) -> bool {
        view.min_clock >= self.due_from
    }

    /// Takes out the next pull that is due under `view`, continuing a scan at `*cursor` (start it
    /// at 0 and hold the view fixed through one scan). When the scan ends (`None`), the lower bound
    /// is exact again.
    pub(super) fn next_due(&mut self, view: ShardView, cursor: &mut Scan) -> Option<Parked> {
        while cursor.at < self.pulls.len() {
            let until = self.pulls[cursor.at].until;
            if until.is_met(view) {
                return Some(self.pulls.swap_remove(cursor.at));
            }
            if let Release::MinClockAtLeast(c) = until {
                cursor.lowest = cursor.lowest.min(c);
            }
            cursor.at += 1;
        }
        self.due_from = cursor.lowest;
        None
    }
}

/// Where a scan of [`ParkedPulls::next_due`] is, and the smallest threshold it has passed.
pub(super) struct Scan {
    at: usize,
    lowest: u64,
}

impl Scan {
    pub(super) fn new() -> Self {
        Scan { at: 0, lowest: u64::MAX }
    }
}
