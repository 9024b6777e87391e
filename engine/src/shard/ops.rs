//! A shard's inputs as values: [`Op`]s, which a primary applies and streams to its backup.
//!
//! Every change to a shard is one of these, applied with [`Shard::apply_op`] at a time its driver
//! stamps ([`Stamped`]). The engine is deterministic, so two shards that start equal (created
//! from the same parameters, or restored from the same snapshot) and apply the same ops at the
//! same times stay equal, policy instance included: that is state-machine replication, and
//! the server's backups are built on it (`host/src/server/shard_task.rs`). Reading the
//! parameters, status and snapshots change nothing and are not ops.

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, Signals, WorkerId};

use super::{ClockRaise, Handover, PullRequest, PushRequest, Shard, ShardError, ShardSink, TaskPart};
use crate::runtime::PolicyModule;

/// What a push says besides its gradient: one shape from the server's data plane through the
/// node ([`super::ShardNode::push`]) to the op a backup applies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PushHeader {
    /// The worker pushing.
    pub worker: WorkerId,
    /// The iteration, as the shard numbers the worker's iterations.
    pub iteration: u64,
    /// Samples it was computed on.
    pub samples: u32,
    /// The version it was computed from, if the worker says.
    pub based_on: Option<u64>,
    /// Some tasks only: their owner and which.
    pub tasks: Option<(WorkerId, TaskPart)>,
    /// The local steps it covers (0: a gradient; [`PushRequest::local_steps`]).
    pub local_steps: u32,
    /// What the worker reports of the iteration ([`PushRequest::signals`]; protocol 18, added
    /// last: the fields before it are encoded as they were).
    pub signals: Signals,
}

impl PushHeader {
    /// A worker's gradient of its whole iteration, of no stated version.
    pub fn gradient(worker: WorkerId, iteration: u64, samples: u32) -> Self {
        PushHeader {
            worker,
            iteration,
            samples,
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        }
    }
}

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
    /// gradient is the op's payload. (Encoded as the struct variant it was before protocol 16:
    /// the same bytes.)
    Push(PushHeader),
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
    /// [`Shard::commit_swap`] to the module with this SHA-256 (which the applier must have:
    /// swaps are prepared on every server before any commits).
    Swap {
        /// The module's SHA-256.
        sha256: [u8; 32],
        /// Its configuration for this shard.
        config: Vec<(String, String)>,
        /// How far each worker's clock is raised (the cluster's levelling).
        raise: Vec<ClockRaise>,
        /// The cluster's number of the swap ([`Shard::swap`]).
        swap: u64,
    },
    /// Only the time moves: timers due fire.
    Advance,
    /// [`Shard::pull_waiting`] (protocol 14; added last, as the op stream is positional).
    Waiting {
        /// The worker.
        worker: WorkerId,
        /// The iteration whose pull it waits on.
        iteration: u64,
        /// Whether it waits on another shard (`false`: every shard answered).
        waiting: bool,
    },
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
    /// Applies `op` at driver time `now` (due timers fire first, as before any request):
    /// the one way a primary and its backup change a shard. `grad` is a push's gradient (empty
    /// otherwise); `module` finds a swap's module by its SHA-256.
    pub fn apply_op(
        &mut self,
        op: Op,
        grad: Vec<f32>,
        now: u64,
        module: impl FnOnce(&[u8; 32]) -> Option<PolicyModule>,
        sink: &mut dyn ShardSink,
    ) -> Outcome {
        self.advance(now, sink);
        match op {
            Op::Create | Op::Advance => Outcome::Done(Ok(())),
            Op::Join { worker } => Outcome::Joined(self.join(worker, now, sink)),
            Op::Push(PushHeader { worker, iteration, samples, based_on, tasks, local_steps, signals }) => {
                let r = match tasks {
                    Some((owner, part)) => {
                        let req = PushRequest {
                            worker: owner,
                            iteration,
                            samples,
                            grad,
                            based_on,
                            tasks: Some(part),
                            local_steps,
                            signals,
                        };
                        self.push_by(worker, req, now, sink)
                    }
                    None => {
                        let req = PushRequest {
                            worker,
                            iteration,
                            samples,
                            grad,
                            based_on,
                            tasks: None,
                            local_steps,
                            signals,
                        };
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
            Op::Waiting { worker, iteration, waiting } => {
                Outcome::Done(self.pull_waiting(worker, iteration, waiting, now))
            }
            Op::Leave { worker, reason } => Outcome::Done(self.leave(worker, reason, now, sink)),
            Op::Goodbye { worker } => Outcome::Left(self.goodbye(worker, now, sink)),
            Op::Swap { sha256, config, raise, swap } => match module(&sha256) {
                Some(m) => Outcome::Swapped(
                    self.commit_swap(&m, &config, &raise, swap, now, sink).map_err(|e| e.to_string()),
                ),
                None => Outcome::Swapped(Err("the swapped-in module is not here".into())),
            },
        }
    }
}

#[cfg(test)]
mod wire {
    use super::*;

    /// The op stream a primary sends its backup is positional (postcard): a worker's wait notice
    /// is variant 12, added last.
    #[test]
    fn a_wait_notice_op_encodes_as_pinned() {
        let op = Op::Waiting { worker: 3, iteration: 9, waiting: true };
        let bytes = postcard::to_allocvec(&op).expect("encodes");
        assert_eq!(bytes, [12, 3, 9, 1]);
        assert_eq!(postcard::from_bytes::<Op>(&bytes).expect("decodes"), op);
    }

    /// A push op carries its [`PushHeader`] as the struct variant before it did: the same bytes
    /// (variant 2, then the fields in order), so the stream between servers did not change.
    #[test]
    fn a_push_op_encodes_as_pinned() {
        let op = Op::Push(PushHeader {
            worker: 1,
            iteration: 2,
            samples: 3,
            based_on: Some(4),
            tasks: Some((5, TaskPart { mask: 6, total: 7 })),
            local_steps: 8,
            signals: Signals { loss: Some(0.5), norm: None, tokens: 9, step_ns: 10 },
        });
        let bytes = postcard::to_allocvec(&op).expect("encodes");
        // Protocol 18 appended the signals: Some(0.5f32), None, 9, 10.
        assert_eq!(bytes, [2, 1, 2, 3, 1, 4, 1, 5, 6, 7, 8, 1, 0, 0, 0, 0x3f, 0, 9, 10]);
        assert_eq!(postcard::from_bytes::<Op>(&bytes).expect("decodes"), op);
        let plain = postcard::to_allocvec(&Op::Push(PushHeader::gradient(1, 2, 3))).expect("encodes");
        assert_eq!(plain, [2, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0]);
    }
}

#[cfg(test)]
mod tests {
    //! Failover, modelled exactly: a primary applies each op and streams it to its backup, which
    //! receives it `lag` ops later; a push is acknowledged to its worker only once the backup has
    //! the op that admitted it (as the server does). The primary dies after op `f`, for every `f`
    //! of the run; the backup, promoted, has what was delivered, and the workers retry what was
    //! not acknowledged. With exact (dyadic) gradients the run must end with the very parameters
    //! of the run that never failed, bit for bit.

    use std::collections::VecDeque;

    use super::*;
    use crate::shard::{AckGate, OptimizerConfig, PullReply, PushWeight, ShardConfig};
    use syncopate_policy_sdk::abi::RequestId;

    const WORKERS: u32 = 3;
    const ITERATIONS: u64 = 12;

    /// What a shard said to its workers.
    #[derive(Default)]
    struct Said {
        served: Vec<(WorkerId, u64)>,
        acked: Vec<(WorkerId, u64)>,
    }

    impl ShardSink for Said {
        fn pull_served(&mut self, r: PullReply<'_>) {
            self.served.push((r.worker, r.iteration));
        }
        fn push_acked(&mut self, _id: RequestId, worker: WorkerId, iteration: u64) {
            self.acked.push((worker, iteration));
        }
    }

    impl crate::shard::Observer for Said {}

    fn grad(w: u32, i: u64) -> f32 {
        0.5 * (w + 1) as f32 + i as f32 / 32.0
    }

    /// A worker: the iteration it pulled (and whether that was served), and its pushes not yet
    /// acknowledged.
    #[derive(Clone, Default)]
    struct Worker {
        pulled: u64,
        served: bool,
        unacked: Vec<u64>,
        done: bool,
    }

    struct Cluster {
        primary: Shard,
        backup: Option<Shard>,
        /// Ops applied by the primary, not yet delivered to the backup.
        in_flight: VecDeque<(Stamped, Vec<f32>)>,
        lag: usize,
        /// Op numbering and the acknowledgements held for the backup, as the server keeps them.
        gate: AckGate<(WorkerId, u64)>,
        said: Said,
        workers: Vec<Worker>,
        now: u64,
    }

    impl Cluster {
        fn new(module: &PolicyModule, lag: usize) -> Self {
            let optimizer = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
            let cfg = ShardConfig { optimizer, push_weight: PushWeight::Sum, ..ShardConfig::default() };
            let mut quiet = Said::default();
            let primary = Shard::new(cfg.clone(), vec![0.0; 4], module, &[], &mut quiet).unwrap();
            let backup = Shard::new(cfg, vec![0.0; 4], module, &[], &mut quiet).unwrap();
            Cluster {
                primary,
                backup: Some(backup),
                in_flight: VecDeque::new(),
                lag,
                gate: {
                    let mut g = AckGate::default();
                    g.attach(0);
                    g
                },
                said: Said::default(),
                workers: vec![Worker::default(); WORKERS as usize],
                now: 0,
            }
        }

        /// The primary applies `op`; it goes to the backup's stream.
        fn op(&mut self, op: Op, grad: Vec<f32>) {
            self.now += 1_000;
            let seq = self.gate.stamp();
            let mut said = Said::default();
            let out = self.primary.apply_op(op.clone(), grad.clone(), self.now, |_| None, &mut said);
            match out {
                Outcome::Pushed(Err(ShardError::Duplicate { worker, iteration, .. })) => {
                    said.acked.push((worker, iteration))
                }
                Outcome::Pushed(Err(e)) | Outcome::Done(Err(e)) | Outcome::Joined(Err(e)) => {
                    panic!("{op:?}: {e}")
                }
                _ => {}
            }
            self.said.served.extend(said.served);
            let released = said.acked.into_iter().filter_map(|a| self.gate.ack(a));
            self.said.acked.extend(released);
            if self.backup.is_some() {
                self.in_flight.push_back((Stamped { seq, now_ns: self.now, op }, grad));
            }
            self.deliver(self.lag);
        }

        /// Delivers ops to the backup until at most `keep` are in flight, and releases the
        /// acknowledgements they cover.
        fn deliver(&mut self, keep: usize) {
            let Some(backup) = self.backup.as_mut() else { return };
            while self.in_flight.len() > keep {
                let (s, grad) = self.in_flight.pop_front().expect("checked");
                backup.apply_op(s.op, grad, s.now_ns, |_| None, &mut Said::default());
                self.gate.confirm(s.seq, |a| self.said.acked.push(a));
            }
        }

        /// The primary dies: what it had not delivered is lost with it, and so are the
        /// acknowledgements it held back. The backup takes over; every worker rejoins it and
        /// asks again for what it had no answer to.
        fn fail_over(&mut self) {
            self.in_flight.clear();
            self.gate.lose();
            self.primary = self.backup.take().expect("a backup");
            for w in 0..WORKERS {
                if !self.primary.is_member(w) {
                    // Its join was not delivered: it joins again.
                    self.op(Op::Join { worker: w }, Vec::new());
                }
                let worker = self.workers[w as usize].clone();
                for i in worker.unacked {
                    self.op(Op::Push(PushHeader::gradient(w, i, 1)), vec![grad(w, i); 4]);
                }
                if !worker.done && !worker.served {
                    self.op(Op::Pull { worker: w, iteration: worker.pulled }, Vec::new());
                }
            }
        }

        /// Lets the workers see what the shard said.
        fn hear(&mut self) {
            for (w, i) in self.said.served.drain(..) {
                let wk = &mut self.workers[w as usize];
                if wk.pulled == i {
                    wk.served = true;
                }
            }
            for (w, i) in self.said.acked.drain(..) {
                self.workers[w as usize].unacked.retain(|u| *u != i);
            }
        }

        /// Worker `w` acts if it can: pushes the iteration it was served, reports it, pulls
        /// the next. Returns whether it did.
        fn act(&mut self, w: u32) -> bool {
            self.hear();
            let wk = self.workers[w as usize].clone();
            if wk.done || !wk.served {
                return false;
            }
            let i = wk.pulled;
            self.workers[w as usize].unacked.push(i);
            self.op(Op::Push(PushHeader::gradient(w, i, 1)), vec![grad(w, i); 4]);
            let report = IterationReport { worker: w, iteration: i, samples: 1, compute_ns: 1_000 };
            self.op(Op::Finished { report }, Vec::new());
            let wk = &mut self.workers[w as usize];
            if i + 1 == ITERATIONS {
                wk.done = true;
            } else {
                (wk.pulled, wk.served) = (i + 1, false);
                self.op(Op::Pull { worker: w, iteration: i + 1 }, Vec::new());
            }
            true
        }

        /// Runs to the end, failing the primary over after op `fail_at` (if any). Returns the
        /// final parameters and how many ops the primary applied.
        fn run(mut self, fail_at: Option<u64>) -> (Vec<f32>, u64) {
            for w in 0..WORKERS {
                self.op(Op::Join { worker: w }, Vec::new());
            }
            for w in 0..WORKERS {
                self.op(Op::Pull { worker: w, iteration: 0 }, Vec::new());
            }
            let mut failed = false;
            let mut turn = 0u32;
            let mut idle = 0;
            while self.workers.iter().any(|w| !w.done || !w.unacked.is_empty()) {
                if !failed && fail_at.is_some_and(|f| self.gate.seq() >= f) {
                    self.fail_over();
                    failed = true;
                }
                // Worker 2 acts at a third of the others' pace.
                let w = turn % WORKERS;
                turn += 1;
                if (w != 2 || turn.is_multiple_of(3)) && self.act(w) {
                    idle = 0;
                } else {
                    idle += 1;
                    // Nothing to do: the stream catches up (the backup is only ever behind).
                    self.deliver(0);
                    self.hear();
                    assert!(
                        idle < 1_000,
                        "stuck: {:?}",
                        self.workers
                            .iter()
                            .map(|w| (w.pulled, w.served, w.unacked.clone()))
                            .collect::<Vec<_>>()
                    );
                }
            }
            for w in 0..WORKERS {
                self.op(Op::Goodbye { worker: w }, Vec::new());
            }
            self.deliver(0);
            (self.primary.values().to_vec(), self.gate.seq())
        }
    }

    /// BSP, SSP and ASP: the gradients are dyadic and summed at lr 1, so any order of
    /// application gives the same bits, and every run must end at the exact sum.
    #[test]
    fn a_primary_failing_after_any_op_loses_no_acknowledged_push_and_doubles_none() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let expected: f32 = -(0..WORKERS).flat_map(|w| (0..ITERATIONS).map(move |i| grad(w, i))).sum::<f32>();
        for name in ["bsp", "ssp", "asp"] {
            let module = rt.compile(name, crate::builtin::wasm(name).unwrap()).unwrap();
            for lag in [0, 1, 4] {
                let (clean, ops) = Cluster::new(&module, lag).run(None);
                assert!(ops > 100, "{ops} ops");
                assert_eq!(clean, [expected; 4], "{name}: the run without a failure");
                for f in 1..=ops {
                    let (after, _) = Cluster::new(&module, lag).run(Some(f));
                    assert_eq!(after, clean, "{name}, lag {lag}: primary lost after op {f} of {ops}");
                }
            }
        }
    }
}
