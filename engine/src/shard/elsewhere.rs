//! Which workers wait on other shards, as far as one shard can tell: the half of the stall
//! rule ([`super::Shard::check_progress`]) that a shard cannot see in its own queues.
//!
//! A worker waits on the whole cluster: it computes once every shard has answered its pull, and
//! reports (then pulls again) once every shard has acknowledged its push. A rule that parks
//! pulls or holds pushes on some shards and not others stalls the run while each shard sees
//! some worker not waiting on it. Two marks close that gap:
//! - **acknowledged, not reported**: its push of an iteration was acknowledged here and its
//!   report of that iteration has not come (a worker reports once every shard acknowledged), so
//!   it waits on another shard's acknowledgement;
//! - **waiting on a pull elsewhere**: the worker said so ([`Op::Waiting`](super::Op::Waiting)).
//!   Its pull, served here, cannot be told from one it is computing on, so a worker whose pull
//!   has waited a while ([`crate::worker::WAIT_NOTICE_NS`]) tells every shard, and tells them
//!   again when the pull is answered. The notices travel apart and may arrive in either order:
//!   an iteration's end is kept, and a later notice of its start is void; its push, its next
//!   pull or its departure end the mark too (a push only once the shard took it, a pull only
//!   if it follows a push the shard has seen, so that a bad request cannot void a notice).
//!
//! Marks are per worker (bounded by the shard's worker limit: only a live worker sets one) and
//! cost nothing on the per-event path beyond a slot write. They are part of the shard's
//! snapshot (format 6) and of its op stream, so a backup counts as its primary does.

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::WorkerId;

/// One worker's marks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Marks {
    /// Its push of this iteration acknowledged here, not yet reported, since this time.
    acked: Option<(u64, u64)>,
    /// It waits on another shard's answer to its pull of this iteration, since this time.
    pulling: Option<(u64, u64)>,
    /// The last iteration whose pull it is known to have ended (a notice of an earlier or the
    /// same iteration's wait is stale).
    pulled: Option<u64>,
}

impl Marks {
    /// Its pull of `iteration` (and every earlier one) has ended.
    fn pull_ended(&mut self, iteration: u64) {
        self.pulled = Some(self.pulled.map_or(iteration, |p| p.max(iteration)));
        if self.pulling.is_some_and(|(i, _)| i <= iteration) {
            self.pulling = None;
        }
    }
}

/// Per worker, what it waits on elsewhere (see the module docs). Part of a shard's snapshot
/// (format 6), so that a backup started from one counts as its primary does.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Elsewhere {
    marks: Vec<Marks>,
}

impl Elsewhere {
    fn slot(&mut self, worker: WorkerId) -> &mut Marks {
        let i = worker as usize;
        if self.marks.len() <= i {
            self.marks.resize(i + 1, Marks::default());
        }
        &mut self.marks[i]
    }

    /// Its push of `iteration` was acknowledged here at `now` (admitted, grouped or dropped).
    pub(super) fn acked(&mut self, worker: WorkerId, iteration: u64, now: u64) {
        self.slot(worker).acked = Some((iteration, now));
    }

    /// Its report of `iteration` came: every shard acknowledged its push.
    pub(super) fn reported(&mut self, worker: WorkerId, iteration: u64) {
        if let Some(m) = self.marks.get_mut(worker as usize) {
            if m.acked.is_some_and(|(i, _)| i <= iteration) {
                m.acked = None;
            }
        }
    }

    /// It says, at `now`, that its pull of `iteration` waits on another shard (`waiting`), or
    /// that the pull was answered everywhere.
    pub(super) fn pull_waiting(&mut self, worker: WorkerId, iteration: u64, waiting: bool, now: u64) {
        let m = self.slot(worker);
        if waiting {
            let stale = m.pulled.is_some_and(|p| p >= iteration);
            let same = m.pulling.is_some_and(|(i, _)| i == iteration);
            if !stale && !same {
                m.pulling = Some((iteration, now));
            }
        } else {
            m.pull_ended(iteration);
        }
    }

    /// A request of `worker`'s that follows its pull of `iteration` arrived here (its push of
    /// it; the pull of a later one): that pull has ended.
    pub(super) fn moved_on(&mut self, worker: WorkerId, iteration: u64) {
        if let Some(m) = self.marks.get_mut(worker as usize) {
            m.pull_ended(iteration);
        }
    }

    /// It left: it waits on nothing.
    pub(super) fn forget(&mut self, worker: WorkerId) {
        if let Some(m) = self.marks.get_mut(worker as usize) {
            *m = Marks::default();
        }
    }

    /// Since when `worker` has waited on other shards, if it does.
    pub(super) fn since(&self, worker: WorkerId) -> Option<u64> {
        let m = self.marks.get(worker as usize)?;
        [m.acked, m.pulling].into_iter().flatten().map(|(_, t)| t).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_on_another_shards_pull_lasts_until_the_worker_says_it_ended() {
        let mut e = Elsewhere::default();
        e.pull_waiting(1, 4, true, 10);
        assert_eq!(e.since(1), Some(10));
        e.pull_waiting(1, 4, true, 20);
        assert_eq!(e.since(1), Some(10), "a repeated notice keeps the first time");
        e.pull_waiting(1, 4, false, 30);
        assert_eq!(e.since(1), None);
        assert_eq!(e.since(0), None);
    }

    #[test]
    fn a_notice_that_arrives_after_its_end_is_void() {
        let mut e = Elsewhere::default();
        e.pull_waiting(0, 7, false, 5);
        e.pull_waiting(0, 7, true, 6);
        assert_eq!(e.since(0), None, "the start of iteration 7's wait came after its end");
        e.pull_waiting(0, 8, true, 9);
        assert_eq!(e.since(0), Some(9), "the next iteration's wait counts");
        e.moved_on(0, 8);
        assert_eq!(e.since(0), None, "its push of iteration 8 ends the wait");
        e.pull_waiting(0, 8, true, 12);
        assert_eq!(e.since(0), None, "a late notice after the push is void");
    }

    #[test]
    fn the_earliest_wait_counts_and_departure_clears_it() {
        let mut e = Elsewhere::default();
        e.acked(2, 3, 100);
        e.pull_waiting(2, 4, true, 50);
        assert_eq!(e.since(2), Some(50));
        e.reported(2, 3);
        assert_eq!(e.since(2), Some(50));
        e.acked(2, 4, 60);
        e.forget(2);
        assert_eq!(e.since(2), None);
    }
}
