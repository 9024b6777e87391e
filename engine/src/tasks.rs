//! Tasks: splitting an iteration's mini-batch into tasks, and moving tasks between workers.
//!
//! A policy may split each iteration into up to [`MAX_TASKS`] equal tasks
//! ([`Control::SetTaskShare`]) and move tasks of a slow worker's iteration to another worker
//! ([`Control::MoveTasks`]). A move is a handshake that the shard runs for any policy, with its
//! [`TaskLedger`]:
//! 1. the policy's move goes to the tasks' **owner** first, as a [`ControlMessage`] with
//!    `yield_to` set;
//! 2. the owner answers with the tasks it had not started ([`crate::shard::Shard::tasks_yielded`]);
//!    only those are forwarded to the **helper** (with `moved` set: how the owner split the
//!    iteration), and the ledger records them; the policy hears the outcome as an
//!    `Event::ControlApplied`;
//! 3. the helper computes them on its last pulled model and pushes them on the owner's behalf
//!    ([`crate::shard::Shard::push_by`]), which clears them from the ledger.
//!
//! If the helper leaves first, the tasks go back to their owner, who computes them itself; an
//! owner that says goodbye while tasks of its own are still out leaves when they are in. So no
//! task is computed twice, none is lost, and every iteration counts once.

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Control, WorkerId};

pub use syncopate_policy_sdk::rules::MAX_TASKS;

/// Some of an iteration's tasks: bit `t` of `mask` is task `t` of `total` (at most
/// [`MAX_TASKS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPart {
    /// The tasks covered.
    pub mask: u64,
    /// How many tasks the iteration has.
    pub total: u32,
}

impl TaskPart {
    /// Every task of an iteration of `total` tasks.
    pub fn full_mask(total: u32) -> u64 {
        if total >= MAX_TASKS {
            u64::MAX
        } else {
            (1u64 << total) - 1
        }
    }

    /// Tasks `first..first + count` of `total`.
    pub fn range(first: u32, count: u32, total: u32) -> Self {
        let mask = if count == 0 || first >= MAX_TASKS { 0 } else { Self::full_mask(count) << first };
        TaskPart { mask: mask & Self::full_mask(total), total }
    }

    /// Whether it covers the whole iteration.
    pub fn is_whole(&self) -> bool {
        self.mask == Self::full_mask(self.total)
    }

    /// Whether `total` is a valid number of tasks and `mask` a non-empty set of them.
    pub fn is_valid(&self) -> bool {
        (1..=MAX_TASKS).contains(&self.total)
            && self.mask != 0
            && self.mask & !Self::full_mask(self.total) == 0
    }
}

/// A control message from a shard's policy to one worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControlMessage {
    /// The shard whose policy sent it.
    pub shard: u32,
    /// What the worker should do.
    pub control: Control,
    /// For [`Control::MoveTasks`] sent to the tasks' owner: the worker that asks for them. The
    /// owner answers with the tasks it has not started.
    pub yield_to: Option<WorkerId>,
    /// For [`Control::MoveTasks`] sent to the worker that computes them: how the owner split
    /// its iteration.
    pub moved: Option<MovedTasks>,
}

impl ControlMessage {
    /// A plain control message from `shard`.
    pub fn plain(shard: u32, control: Control) -> Self {
        ControlMessage { shard, control, yield_to: None, moved: None }
    }
}

/// How a moved iteration is split, so its new worker computes exactly the owner's samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedTasks {
    /// Tasks in the iteration.
    pub total: u32,
    /// The iteration's batch size.
    pub batch: u32,
    /// The owner's data partition.
    pub part: u32,
}

/// Tasks `first..first + count` of `owner`'s `iteration`, handed to worker `to`: the owner's
/// answer to a move request (`count` 0: it could hand over none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handover {
    /// The worker whose iteration it is.
    pub owner: WorkerId,
    /// The worker that computes the tasks.
    pub to: WorkerId,
    /// The owner's iteration.
    pub iteration: u64,
    /// The first task handed over.
    pub first: u32,
    /// How many tasks.
    pub count: u32,
    /// How the owner split the iteration.
    pub split: MovedTasks,
}

impl Handover {
    /// Whether the tasks handed over exist: within the split's tasks, which number 1 to
    /// [`MAX_TASKS`] (nothing handed over is always valid).
    pub fn is_valid(&self) -> bool {
        self.count == 0
            || ((1..=MAX_TASKS).contains(&self.split.total)
                && self.first.saturating_add(self.count) <= self.split.total)
    }

    /// The tasks, as a message for whoever computes them.
    pub fn message(&self, shard: u32) -> ControlMessage {
        let control = Control::MoveTasks {
            from: self.owner,
            iteration: self.iteration,
            first: self.first,
            count: self.count,
        };
        ControlMessage { moved: Some(self.split), ..ControlMessage::plain(shard, control) }
    }
}

/// A shard's record of the tasks in flight between workers, and of the goodbyes that wait for
/// them.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskLedger {
    moved: Vec<Handover>,
    leaving: Vec<WorkerId>,
}

impl TaskLedger {
    /// Records tasks handed to a helper.
    pub(crate) fn handed(&mut self, m: Handover) {
        self.moved.push(m);
    }

    /// `helper` pushed tasks `mask` of `owner`'s `iteration`: every hand-over they cover is done.
    pub(crate) fn pushed(&mut self, helper: WorkerId, owner: WorkerId, iteration: u64, mask: u64) {
        self.moved.retain(|m| {
            let handed = TaskPart::range(m.first, m.count, MAX_TASKS).mask;
            !(m.owner == owner && m.to == helper && m.iteration == iteration && handed & !mask == 0)
        });
    }

    /// Whether tasks of `owner`'s iterations are still being computed elsewhere.
    pub fn has_out(&self, owner: WorkerId) -> bool {
        self.moved.iter().any(|m| m.owner == owner)
    }

    /// Tasks handed over and not yet pushed.
    pub fn in_flight(&self) -> usize {
        self.moved.len()
    }

    /// `owner` said goodbye with tasks still out: it leaves once they are in.
    pub(crate) fn wait_to_leave(&mut self, owner: WorkerId) {
        if !self.leaving.contains(&owner) {
            self.leaving.push(owner);
        }
    }

    /// Worker `gone` left: hand-overs to it are returned (the messages that send them back to
    /// their owners), and hand-overs of its own iterations are forgotten.
    pub(crate) fn left(&mut self, gone: WorkerId) -> Vec<Handover> {
        self.leaving.retain(|w| *w != gone);
        let (back, keep): (Vec<Handover>, Vec<Handover>) =
            self.moved.drain(..).filter(|m| m.owner != gone).partition(|m| m.to == gone);
        self.moved = keep;
        back
    }

    /// A waiting goodbye that can now complete (none of its tasks are out), if any.
    pub(crate) fn next_ready_to_leave(&self) -> Option<WorkerId> {
        self.leaving.iter().copied().find(|o| !self.has_out(*o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_masks() {
        assert_eq!(TaskPart::range(1, 2, 4).mask, 0b0110);
        assert_eq!(TaskPart::range(3, 5, 4).mask, 0b1000, "clipped to the iteration");
        assert_eq!(TaskPart::range(0, 0, 4).mask, 0);
        assert_eq!(TaskPart::full_mask(MAX_TASKS), u64::MAX);
        assert!(TaskPart::range(0, 4, 4).is_whole());
        assert!(!TaskPart { mask: 0b10000, total: 4 }.is_valid());
        assert!(!TaskPart { mask: 1, total: MAX_TASKS + 1 }.is_valid());
        let split = |total| MovedTasks { total, batch: 32, part: 0 };
        let h = |first, count, total| Handover {
            owner: 0,
            to: 1,
            iteration: 0,
            first,
            count,
            split: split(total),
        };
        assert!(h(2, 2, 4).is_valid() && h(9, 0, 0).is_valid(), "in range, or nothing handed over");
        assert!(!h(3, 2, 4).is_valid() && !h(0, 1, 0).is_valid() && !h(0, 1, MAX_TASKS + 1).is_valid());
    }

    #[test]
    fn the_ledger_returns_a_gone_helpers_tasks_and_releases_waiting_goodbyes() {
        let split = MovedTasks { total: 4, batch: 32, part: 0 };
        let mut l = TaskLedger::default();
        l.handed(Handover { owner: 0, to: 1, iteration: 5, first: 2, count: 2, split });
        l.handed(Handover { owner: 2, to: 1, iteration: 7, first: 3, count: 1, split });
        l.wait_to_leave(0);
        assert_eq!(l.next_ready_to_leave(), None, "its tasks are out");
        // A push that covers only part of a hand-over does not clear it.
        l.pushed(1, 0, 5, 0b0100);
        assert!(l.has_out(0));
        l.pushed(1, 0, 5, 0b1100);
        assert!(!l.has_out(0));
        assert_eq!(l.next_ready_to_leave(), Some(0));
        let back = l.left(1);
        assert_eq!(back.len(), 1, "worker 2's task goes back to it");
        assert_eq!(back[0].owner, 2);
        assert_eq!(l.in_flight(), 0);
    }
}
