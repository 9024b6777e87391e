//! A shard's inputs as values: [`Op`]s, which a primary applies and streams to its backup.
//!
//! Every change to a shard is one of these, applied with [`Shard::apply_op`] at a time its driver
//! stamps ([`Stamped`]). The engine is deterministic, so two shards that start equal (created
//! from the same parameters, or restored from the same snapshot) and apply the same ops at the
//! same times stay equal, policy instance included: that is state-machine replication, and
//! the server's backups are built on it (`host/src/server/shard_task.rs`). Reading the
//! parameters, status and snapshots change nothing and are not ops.

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, WorkerId};

use super::{Handover, PullRequest, PushRequest, Shard, ShardError, ShardSink, TaskPart};
use crate::runtime::PolicyModule;

/// One change to a shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// The shard is created with the op's payload as its parameters ([`Shard::new`]; the
    /// driver does it, [`Shard::apply_op`] does nothing with it).
    Create,
    /// [`Shard::join`].
    Join {
        /// The worker.
        worker: WorkerId,
    },
    /// [`Shard::push`] (or, with `tasks`, [`Shard::push_by`] for the tasks' owner); the
    /// gradient is the op's payload.
    Push {
        /// The worker pushing.
        worker: WorkerId,
        /// The iteration.
        iteration: u64,
        /// Samples it was computed on.
        samples: u32,
        /// The version it was computed from.
        based_on: Option<u64>,
        /// Some tasks only: their owner and which.
        tasks: Option<(WorkerId, TaskPart)>,
    },
    /// [`Shard::tasks_yielded`].
    Yielded {
        /// The hand-over.
        handover: Handover,
    },
    /// [`Shard::control_applied`].
    Applied {
        /// What was applied.
        applied: Applied,
    },
    /// [`Shard::skip`].
    Skip {
        /// The worker.
        worker: WorkerId,
        /// The iteration it skips to.
        to: u64,
    },
    /// [`Shard::pull`].
    Pull {
        /// The worker.
        worker: WorkerId,
        /// The iteration.
        iteration: u64,
    },
    /// [`Shard::iteration_finished`].
    Finished {
        /// The report.
        report: IterationReport,
    },
    /// [`Shard::leave`].
    Leave {
        /// The worker.
        worker: WorkerId,
        /// Why.
        reason: LeaveReason,
    },
    /// [`Shard::goodbye`].
    Goodbye {
        /// The worker.
        worker: WorkerId,
    },
    /// [`Shard::swap_policy`] to the module with this SHA-256 (which the applier must have:
    /// swaps are prepared on every server before any commits).
    Swap {
        /// The module's SHA-256.
        sha256: [u8; 32],
        /// Its configuration for this shard.
        config: Vec<(String, String)>,
    },
    /// Only the time moves: timers due fire.
    Advance,
}

/// An op with its place in the stream and its driver's time when it was applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stamped {
    /// 1, 2, 3... in the order applied.
    pub seq: u64,
    /// The driver's time.
    pub now_ns: u64,
    /// The op.
    pub op: Op,
}

/// What applying an op gave.
#[derive(Debug)]
pub enum Outcome {
    /// A join: the clock the worker starts at.
    Joined(Result<u64, ShardError>),
    /// A push.
    Pushed(Result<(), ShardError>),
    /// A goodbye: whether the worker left now.
    Left(Result<bool, ShardError>),
    /// A swap.
    Swapped(Result<(), String>),
    /// The shard was created: what a driver reports for [`Op::Create`], which it carries out
    /// itself.
    Created(Result<(), String>),
    /// Anything else.
    Done(Result<(), ShardError>),
}

impl Shard {
    /// Applies `op` at driver time `now_ns` (due timers fire first, as before any request):
    /// the one way a primary and its backup change a shard. `grad` is a push's gradient (empty
    /// otherwise); `module` finds a swap's module by its SHA-256.
    pub fn apply_op(
        &mut self,
        op: Op,
        grad: Vec<f32>,
        now_ns: u64,
        module: impl FnOnce(&[u8; 32]) -> Option<PolicyModule>,
        sink: &mut dyn ShardSink,
    ) -> Outcome {
        let now = now_ns;
        self.advance(now, sink);
        match op {
            Op::Create | Op::Advance => Outcome::Done(Ok(())),
            Op::Join { worker } => Outcome::Joined(self.join(worker, now, sink)),
            Op::Push { worker, iteration, samples, based_on, tasks } => {
                let r = match tasks {
                    Some((owner, part)) => {
                        let req = PushRequest {
                            worker: owner,
                            iteration,
                            samples,
                            grad,
                            based_on,
                            tasks: Some(part),
                        };
                        self.push_by(worker, req, now, sink)
                    }
                    None => {
                        let req = PushRequest { worker, iteration, samples, grad, based_on, tasks: None };
                        self.push(req, now, sink)
                    }
                };
                Outcome::Pushed(r.map(|_| ()))
            }
            Op::Yielded { handover } => Outcome::Done(self.tasks_yielded(handover, now, sink)),
            Op::Applied { applied } => Outcome::Done(self.control_applied(applied, now, sink)),
            Op::Skip { worker, to } => Outcome::Done(self.skip(worker, to, now, sink)),
            Op::Pull { worker, iteration } => {
                Outcome::Done(self.pull(PullRequest { worker, iteration }, now, sink).map(|_| ()))
            }
            Op::Finished { report } => Outcome::Done(self.iteration_finished(report, now, sink)),
            Op::Leave { worker, reason } => Outcome::Done(self.leave(worker, reason, now, sink)),
            Op::Goodbye { worker } => Outcome::Left(self.goodbye(worker, now, sink)),
            Op::Swap { sha256, config } => match module(&sha256) {
                Some(m) => {
                    Outcome::Swapped(self.swap_policy(&m, &config, now, sink).map_err(|e| e.to_string()))
                }
                None => Outcome::Swapped(Err("the swapped-in module is not here".into())),
            },
        }
    }
}
