//! The worker as a sans-IO state machine: everything a data-parallel worker does between its
//! workload and the shards, with no socket, clock, thread or randomness of its own.
//!
//! A [`WorkerMachine`] runs the iteration loop (pull, compute, push, report), obeys the
//! policies' control messages (pause, batch size, task share) and acknowledges each, takes part
//! in task moves on both sides (hands over the tasks it has not started; computes tasks moved
//! to it on the model it last pulled), and emulates its [`Device`] (slow factor, emulated
//! compute, jitter, stalls). Drivers feed it [`Input`]s, each with the time it happened on the
//! driver's clock, and carry out the [`Action`]s it asks for; [`WorkerMachine::poll_timeout`]
//! says when to wake it if nothing else happens. This is the split of quinn-proto from quinn:
//! the tokio worker (`syncopate worker`), the simulator and the test harness all drive this one
//! machine, so a simulated worker behaves as a real one does.
//!
//! # Rules the machine keeps
//! - One iteration at a time, its steps in order: pull every shard, compute (whole, or task by
//!   task when a policy split iterations, or `H` local steps when the pulls said so), the
//!   injected delay, push, report.
//! - Local steps: an iteration takes the local steps the pulls that began it said (the most any
//!   shard said; 0: one gradient). It is computed whole (never split into tasks, none handed
//!   over) and its push is the pseudo-gradient, marked with its step count so that every shard
//!   applies it with its outer optimizer, whatever the shard's setting is by then.
//! - One computation at a time: moved tasks are computed between this worker's own tasks, while
//!   it waits for a pull or a push, or between iterations, never during its injected delay.
//! - A task is computed once: a hand-over yields only tasks not yet started, and a task handed
//!   over is never started here.
//! - A pull that has waited [`WAIT_NOTICE_NS`] is told to every shard ([`Action::Waiting`]),
//!   once, and so is its end (answered, or given up at a stop): a shard that served it counts
//!   the worker as waiting on another shard meanwhile, which is how a rule that parks pulls on
//!   some shards only is found stalled.
//! - A pause delays the start of the worker's next pull by its length from its arrival; it is
//!   acknowledged at once (as every setting is: "applies from iteration N"). A push codec is
//!   the driver's to apply ([`crate::codec::PushEncoder`]), from the acknowledged iteration.
//! - A stop ([`Input::Stop`]: a target, a time limit, an operator) ends the run whatever the
//!   policies hold: the worker finishes the computation in progress and pushes it, but a pull a
//!   policy keeps deferring is given up at once, and its own push still unacknowledged
//!   [`STOP_GRACE_NS`] after the stop is given up too (the shard's policy decides its fate when
//!   the worker leaves); the report says what was given up ([`WorkerReport::abandoned`]).
//! - A skip ([`Control::SkipTo`]) abandons the iteration in progress at its next step (a pull
//!   that returns is not computed on, a finished computation is not pushed; a push already sent
//!   completes and counts), tells every shard ([`Action::Skip`]) and is acknowledged once done.
//!   An iteration with tasks out with other workers is finished first: its tasks are counted
//!   wherever they are computed.

mod buffers;
pub mod client;
mod device;
pub mod join;
mod report;

use std::collections::VecDeque;
use std::ops::Range;

use syncopate_policy_sdk::abi::{Control, IterationReport, Signals, WorkerId};
pub use syncopate_workloads::StepStats;
use syncopate_workloads::Tasks;

pub use buffers::Buffers;
pub use device::Device;
pub use report::WorkerReport;

use crate::shard::RequestError;
use crate::tasks::{ControlMessage, Handover, MovedTasks, TaskPart, MAX_TASKS};
use device::DeviceState;

/// How long after a stop a worker still waits for its own push's acknowledgement before it
/// gives up and leaves: enough for any transfer, short enough that a limit ends a run whose
/// policy holds pushes for ever.
pub const STOP_GRACE_NS: u64 = 5_000_000_000;

/// How long a pull waits before the worker tells every shard that it waits
/// ([`Action::Waiting`]): a shard that has answered it cannot tell a worker waiting on another
/// shard from one computing, and the stall rule needs to (`shard::Shard::check_progress`). Long
/// beside an answer's usual time, so that a run whose rule decides promptly sends no notice;
/// short beside the no-progress time, which it delays by this much at most.
pub const WAIT_NOTICE_NS: u64 = 1_000_000_000;

/// How a worker is set up.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    /// Its id.
    pub id: WorkerId,
    /// The first iteration it computes (what joining the shards returned).
    pub start: u64,
    /// Train until this iteration (exclusive).
    pub iterations: u64,
    /// Mini-batch size until a policy sets another.
    pub batch: u32,
    /// Its data partition (what moved tasks of its iterations are computed on).
    pub part: u32,
    /// Whether its workload can compute an iteration task by task.
    pub can_split: bool,
    /// Whether every shard numbers its iterations as it does (it joined before training
    /// started): only then can its tasks move.
    pub numbering_shared: bool,
    /// How its device behaves.
    pub device: Device,
    /// Tokens in one sample (a language model's sequence length; 0: the workload has no
    /// tokens), for the tokens its pushes report.
    pub tokens_per_sample: u64,
}

/// Whose work a computation or a push is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// This worker's own iteration.
    Own,
    /// Tasks moved from `owner`'s iteration (this worker's own, when handed back).
    Help {
        /// Whose iteration it is.
        owner: WorkerId,
    },
}

/// A gradient to compute; [`Buffers::compute`] runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeJob {
    /// Whose work.
    pub kind: JobKind,
    /// The iteration (numbered as its owner numbers it), its data part and batch, and which of
    /// its tasks (the whole iteration is task `0..1` of 1, or see `whole`).
    pub work: Tasks,
    /// The whole iteration at once (the workload's `gradient`), not a task range.
    pub whole: bool,
    /// The first task computed of a split iteration: the iteration's gradient starts at zero.
    pub first_of_iteration: bool,
    /// Local steps: compute this many gradients, each applied at once by the worker's inner
    /// optimizer, and leave the pseudo-gradient for the push ([`Buffers::compute`]); 0: one
    /// gradient.
    pub local_steps: u32,
}

/// A push to send to every shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PushJob {
    /// Whose work.
    pub kind: JobKind,
    /// Whose iteration it counts towards.
    pub owner: WorkerId,
    /// The iteration.
    pub iteration: u64,
    /// Some tasks of it, or `None` for the whole iteration.
    pub tasks: Option<TaskPart>,
    /// Samples the gradient was computed on.
    pub samples: u32,
    /// A split iteration's summed gradient, to be divided by this many samples before sending
    /// ([`Buffers::gradient`] does).
    pub mean_over: Option<u32>,
    /// The local steps the push covers (0: a gradient; more: a pseudo-gradient).
    pub local_steps: u32,
    /// What the push reports of its iteration (ABI v3): the mean training loss over its
    /// samples, its tokens, and its compute time (emulated device time included). A helper's
    /// push of moved tasks reports none: it is part of another worker's iteration.
    pub signals: Signals,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Pull every shard's parameters for `iteration` (into [`Buffers::params`]); answer with
    /// [`Input::Pulled`] when every shard has.
    Pull {
        /// The iteration about to be computed.
        iteration: u64,
    },
    /// Compute; answer with [`Input::Computed`].
    Compute(ComputeJob),
    /// Push to every shard; answer with [`Input::Pushed`] when every shard has acknowledged.
    Push(PushJob),
    /// Answer a move request of `shard`'s policy: these tasks go to the helper.
    Handover {
        /// The shard that asked.
        shard: u32,
        /// What is handed over (`count` 0: nothing could be).
        handover: Handover,
    },
    /// Acknowledge a control message of `shard`'s policy: it applies from `iteration` on.
    Applied {
        /// The shard whose policy sent it.
        shard: u32,
        /// The control, as applied.
        control: Control,
        /// The first iteration it applies to.
        iteration: u64,
    },
    /// Tell every shard an iteration is finished.
    Finished(IterationReport),
    /// Tell every shard that this worker's pull of `iteration` has waited [`WAIT_NOTICE_NS`]
    /// (`waiting`), or, after such a notice, that every shard has answered it. Nothing answers;
    /// a notice that cannot be delivered is not an error.
    Waiting {
        /// The iteration pulled.
        iteration: u64,
        /// Whether it still waits.
        waiting: bool,
    },
    /// Tell every shard this worker skips from iteration `from` to `to` (the iterations in
    /// between are never pushed); carry out the actions that follow only once every shard has
    /// taken it.
    Skip {
        /// The first iteration skipped (abandoned, or not yet started).
        from: u64,
        /// The iteration it continues from.
        to: u64,
    },
    /// The worker is done: leave every shard. No action follows.
    Leave,
}

/// What happened, for the machine.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Every shard answered the pull. `deferred`: at least one deferred it; `deferred_ns`:
    /// the longest any did; `local_steps`: the most local steps any said to take.
    Pulled {
        /// Whether any shard deferred it.
        deferred: bool,
        /// The longest deferral, in nanoseconds.
        deferred_ns: u64,
        /// Local steps for this iteration (0: one gradient).
        local_steps: u32,
    },
    /// The computation finished: what it computed (`None`: the workload cannot split
    /// iterations) and how long the arithmetic took (0 in virtual time).
    Computed {
        /// Samples and loss.
        step: Option<StepStats>,
        /// Real compute time, in nanoseconds.
        compute_ns: u64,
    },
    /// The push of `kind` was acknowledged by every shard, or refused.
    Pushed {
        /// Whose push.
        kind: JobKind,
        /// `Ok`: how many shards' policies dropped it (0: applied everywhere); `Err`: why it
        /// was not taken.
        result: Result<u32, PushFailed>,
    },
    /// A hand-over was refused: the tasks stay this worker's, and it computes them (the
    /// driver, which has the refusal, logs why).
    HandoverRefused {
        /// The refused hand-over.
        handover: Handover,
    },
    /// A control message from a shard.
    Control(ControlMessage),
    /// The time [`WorkerMachine::poll_timeout`] named has come.
    Timer,
    /// Stop after the current iteration (a target or budget was reached), giving up what
    /// policies keep waiting (module docs).
    Stop,
}

/// Why a push was not taken ([`Input::Pushed`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PushFailed {
    /// A shard refused it, for this reason.
    #[error("a shard refused it: {0}")]
    Refused(RequestError),
    /// It did not reach every shard: a server refused it itself or could not be reached (the
    /// driver, which has the error, logs it).
    #[error("it did not reach every shard")]
    Undelivered,
}

/// A worker that cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkerError {
    /// Tasks were moved to a worker whose workload cannot split iterations.
    #[error("moved tasks of worker {owner} arrived, but the workload cannot split iterations")]
    CannotSplit {
        /// Whose tasks.
        owner: WorkerId,
    },
    /// This worker's own push was not taken.
    #[error("push for iteration {iteration} not taken: {why}")]
    PushRefused {
        /// The iteration.
        iteration: u64,
        /// Why.
        why: PushFailed,
    },
    /// The device settings are invalid.
    #[error("device: {0}")]
    Device(String),
    /// An input came that the machine was not waiting for (a driver bug).
    #[error("unexpected input {input} while {state}")]
    Unexpected {
        /// The input.
        input: &'static str,
        /// What the machine was doing.
        state: String,
    },
}

/// Where the worker's own iteration stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Own {
    /// Between iterations.
    Start,
    Pulling,
    Computing,
    /// The injected delay after computing, until then.
    Delaying(u64),
    Pushing,
    Done,
}

/// The iteration being worked on, as far as computing and task moves are concerned.
#[derive(Clone, Copy, Debug, Default)]
struct Current {
    iteration: u64,
    /// Tasks it is split into.
    total: u32,
    batch: u32,
    /// The next task to start (`total`: all started, or the iteration is done computing).
    next: u32,
    /// Tasks handed to other workers.
    given: u64,
    /// Whether task gradients were summed into the iteration's gradient.
    folded: bool,
    samples: u32,
    /// Samples-weighted loss sum.
    loss: f32,
    /// Compute and emulated device time.
    busy_ns: u64,
    started_at: u64,
    pulled_at: u64,
    pushed_at: u64,
    /// How long its push waited for its acknowledgements.
    acked_after_ns: u64,
    /// Local steps (0: one gradient), from the pulls.
    local_steps: u32,
    /// Whether the shards were told that its pull waits ([`Action::Waiting`]).
    told_waiting: bool,
    /// Tokens the caller says it trained on ([`WorkerMachine::took_tokens`]; 0: counted from
    /// the samples).
    tokens: u64,
}

/// Tasks moved to this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HelpJob {
    owner: WorkerId,
    iteration: u64,
    first: u32,
    count: u32,
    moved: MovedTasks,
}

/// What follows the emulated device time of a computation.
#[derive(Clone, Copy, Debug)]
enum After {
    OwnTask,
    Help(HelpJob, u32),
}

/// The one computation in progress.
#[derive(Clone, Copy, Debug)]
enum Busy {
    Computing(Option<HelpJob>),
    Pacing { until: u64, from: u64, then: After },
    HelpPushing(HelpJob),
}

/// One worker's behaviour; see the module docs.
#[derive(Debug)]
pub struct WorkerMachine {
    cfg: WorkerConfig,
    device: DeviceState,
    report: WorkerReport,
    began: u64,
    now: u64,
    /// The current iteration, or the next to start.
    iteration: u64,
    batch: u32,
    tasks: u32,
    cur: Current,
    own: Own,
    busy: Option<Busy>,
    help: VecDeque<HelpJob>,
    pause_until: u64,
    /// Skips to carry out: (the shard whose policy asked, the iteration to continue from); the
    /// furthest wins, and each is acknowledged.
    skips: Vec<(u32, u64)>,
    stop: bool,
    /// When the stop came.
    stop_at: u64,
    /// Whether it gave up its own pull or push at a stop: a late answer to it is ignored.
    gave_up: bool,
    out: VecDeque<Action>,
}

impl WorkerMachine {
    /// A worker starting at `now_ns` on the driver's clock.
    pub fn new(cfg: WorkerConfig, now_ns: u64) -> Result<Self, WorkerError> {
        let device = DeviceState::new(cfg.device.clone()).map_err(WorkerError::Device)?;
        Ok(WorkerMachine {
            report: WorkerReport { worker: cfg.id, start: cfg.start, ..WorkerReport::default() },
            device,
            began: now_ns,
            now: now_ns,
            iteration: cfg.start,
            batch: cfg.batch.max(1),
            tasks: 1,
            cur: Current::default(),
            own: Own::Start,
            busy: None,
            help: VecDeque::new(),
            pause_until: 0,
            skips: Vec::new(),
            stop: false,
            stop_at: 0,
            gave_up: false,
            out: VecDeque::new(),
            cfg,
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// What it has done so far.
    pub fn report(&self) -> &WorkerReport {
        &self.report
    }

    /// Its report so far as of `now`: once it has left, the final one; before, with the time
    /// elapsed since it started (a driver whose caller ends training itself reports this).
    pub fn report_at(&self, now: u64) -> WorkerReport {
        let mut r = self.report.clone();
        if !matches!(self.own, Own::Done) {
            r.elapsed_ns = now.saturating_sub(self.began);
        }
        r
    }

    /// Its report, once done.
    pub fn into_report(self) -> WorkerReport {
        self.report
    }

    /// The iteration it is on (or starts next).
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// The batch size its next iteration uses.
    pub fn batch(&self) -> u32 {
        self.batch
    }

    /// Whether it has left.
    pub fn is_done(&self) -> bool {
        self.own == Own::Done
    }

    /// When to call [`handle`](Self::handle) with [`Input::Timer`] if nothing else happens.
    pub fn poll_timeout(&self) -> Option<u64> {
        let pacing = match self.busy {
            Some(Busy::Pacing { until, .. }) => Some(until),
            _ => None,
        };
        let delay = match self.own {
            Own::Delaying(until) => Some(until),
            _ => None,
        };
        let pause = (self.own == Own::Start && self.pause_until > self.now).then_some(self.pause_until);
        let give_up =
            (self.stop && self.own == Own::Pushing).then(|| self.stop_at.saturating_add(STOP_GRACE_NS));
        [pacing, delay, pause, give_up, self.notice_due()].into_iter().flatten().min()
    }

    /// The next thing to do, if any. Call until `None` after every input.
    pub fn poll_action(&mut self, now_ns: u64) -> Option<Action> {
        self.now = self.now.max(now_ns);
        if self.out.is_empty() {
            self.advance();
        }
        self.out.pop_front()
    }

    /// Something happened at `now_ns`.
    pub fn handle(&mut self, now_ns: u64, input: Input) -> Result<(), WorkerError> {
        self.now = self.now.max(now_ns);
        let now = self.now;
        match input {
            // The answer to a request given up at a stop.
            Input::Pulled { .. } | Input::Pushed { kind: JobKind::Own, .. }
                if self.gave_up && !matches!(self.own, Own::Pulling | Own::Pushing) => {}
            Input::Pulled { deferred, deferred_ns, local_steps } => {
                self.expect(self.own == Own::Pulling, "Pulled")?;
                self.waited_no_more();
                self.cur.pulled_at = now;
                self.cur.local_steps = local_steps;
                self.report.wait_ns += now - self.cur.started_at;
                self.report.deferred_ns += deferred_ns;
                self.report.deferred_pulls += u64::from(deferred);
                self.own = Own::Computing;
                self.abandon_for_skip();
            }
            Input::Computed { step, compute_ns } => {
                let Some(Busy::Computing(help)) = self.busy else {
                    return Err(self.unexpected("Computed"));
                };
                match help {
                    None => {
                        let step = step.unwrap_or_default();
                        let extra =
                            self.device.extra_ns(compute_ns, step.samples, self.cfg.batch, now - self.began);
                        self.cur.busy_ns += compute_ns + extra;
                        self.cur.samples += step.samples;
                        self.cur.loss += step.samples as f32 * step.loss;
                        self.pace(extra, After::OwnTask);
                    }
                    Some(job) => {
                        let Some(step) = step else {
                            return Err(WorkerError::CannotSplit { owner: job.owner });
                        };
                        let extra =
                            self.device.extra_ns(compute_ns, step.samples, self.cfg.batch, now - self.began);
                        self.pace(extra, After::Help(job, step.samples));
                    }
                }
            }
            Input::Pushed { kind: JobKind::Own, result } => {
                self.expect(self.own == Own::Pushing, "Pushed")?;
                let dropped = match result {
                    Ok(d) => d,
                    Err(why) => return Err(WorkerError::PushRefused { iteration: self.cur.iteration, why }),
                };
                if dropped > 0 {
                    self.report.pushes_dropped += 1;
                }
                self.cur.acked_after_ns = now.saturating_sub(self.cur.pushed_at);
                self.report.push_wait_ns += self.cur.acked_after_ns;
                let c = self.cur;
                let report = self.report_of_push().expect("pushing");
                self.report.compute_ns += c.busy_ns;
                self.report.steps += u64::from(c.local_steps.max(1));
                self.report.local_iterations += u64::from(c.local_steps > 0);
                self.report.last_loss = c.loss / c.samples.max(1) as f32;
                self.out.push_back(Action::Finished(report));
                self.end_iteration();
            }
            Input::Pushed { kind: JobKind::Help { owner }, result } => {
                let Some(Busy::HelpPushing(job)) = self.busy else {
                    return Err(self.unexpected("Pushed (help)"));
                };
                self.busy = None;
                match result {
                    // The owner may have left meanwhile (its iteration is void): not our error.
                    Err(e) => tracing::warn!(
                        worker = self.cfg.id,
                        owner,
                        job.iteration,
                        "moved tasks not taken: {e}"
                    ),
                    Ok(_) if owner == self.cfg.id => {
                        // Our own tasks, returned because the worker that took them left.
                        self.report.tasks_given =
                            self.report.tasks_given.saturating_sub(u64::from(job.count));
                    }
                    Ok(_) => self.report.tasks_helped += u64::from(job.count),
                }
            }
            Input::HandoverRefused { handover: h } => {
                // The tasks stay ours if the hand-over is refused: nothing is lost.
                if h.iteration == self.cur.iteration {
                    self.cur.given &= !TaskPart::range(h.first, h.count, self.cur.total.max(1)).mask;
                    self.cur.next = self.cur.next.min(h.first);
                }
                self.report.tasks_given = self.report.tasks_given.saturating_sub(u64::from(h.count));
            }
            Input::Control(msg) => self.control(msg),
            Input::Timer => {
                if let Some(Busy::Pacing { until, from, then }) = self.busy {
                    if now >= until {
                        self.device.debt_ns -= (now - from) as i64;
                        self.busy = None;
                        self.paced(then);
                    }
                }
            }
            Input::Stop if !self.stop => (self.stop, self.stop_at) = (true, now),
            Input::Stop => {}
        }
        Ok(())
    }

    /// The own iteration being computed took `steps` local steps (0: one gradient), whatever
    /// its pulls said: a driver whose caller runs the training loop (a Python session) decides
    /// for itself. Its push is marked so, and the report counts them. Outside a computation of
    /// the own iteration it does nothing.
    pub fn took_local_steps(&mut self, steps: u32) {
        if self.own == Own::Computing {
            self.cur.local_steps = steps;
        }
    }

    /// The caller of a session says how many tokens the iteration it computes trained on
    /// (reported to policies with its push, in place of samples times
    /// [`WorkerConfig::tokens_per_sample`]). Only while computing, as for local steps.
    pub fn took_tokens(&mut self, tokens: u64) {
        if self.own == Own::Computing {
            self.cur.tokens = tokens;
        }
    }

    fn expect(&self, ok: bool, input: &'static str) -> Result<(), WorkerError> {
        if ok {
            Ok(())
        } else {
            Err(self.unexpected(input))
        }
    }

    fn unexpected(&self, input: &'static str) -> WorkerError {
        WorkerError::Unexpected { input, state: format!("{:?}, {:?}", self.own, self.busy) }
    }

    /// The first iteration a setting received now can apply to.
    fn next_applicable(&self) -> u64 {
        if self.own == Own::Start {
            self.iteration
        } else {
            self.iteration + 1
        }
    }

    fn control(&mut self, msg: ControlMessage) {
        self.report.controls += 1;
        let me = self.cfg.id;
        match (msg.control, msg.yield_to, msg.moved) {
            (Control::MoveTasks { from, iteration, first, count }, Some(to), _) if from == me => {
                let c = self.cur;
                let (lo, hi) = (first.max(c.next), first.saturating_add(count).min(c.total));
                let mut end = lo;
                while end < hi && c.given & (1 << end) == 0 {
                    end += 1;
                }
                let splittable = self.cfg.can_split && self.cfg.numbering_shared && c.local_steps == 0;
                let (first, count) = if iteration == c.iteration && splittable && end > lo {
                    (lo, end - lo)
                } else {
                    (first, 0)
                };
                let total = c.total.max(1);
                self.cur.given |= TaskPart::range(first, count, total).mask;
                self.report.tasks_given += u64::from(count);
                tracing::debug!(worker = me, to, iteration, first, count, "tasks handed over");
                let split = MovedTasks { total, batch: c.batch, part: self.cfg.part };
                let handover = Handover { owner: me, to, iteration, first, count, split };
                self.out.push_back(Action::Handover { shard: msg.shard, handover });
            }
            (Control::MoveTasks { from, iteration, first, count }, None, Some(moved)) => {
                self.help.push_back(HelpJob { owner: from, iteration, first, count, moved });
            }
            (control, _, _) => {
                match control {
                    Control::Pause { for_ns } => {
                        tracing::debug!(worker = me, shard = msg.shard, for_ns, "paused by the policy");
                        self.pause_until = self.pause_until.max(self.now).saturating_add(for_ns);
                    }
                    Control::SetBatchSize { samples } if samples > 0 => self.batch = samples,
                    Control::SetTaskShare { tasks } if (1..=MAX_TASKS).contains(&tasks) => {
                        self.tasks = if self.cfg.can_split { tasks } else { 1 };
                    }
                    Control::Resume => {}
                    // The driver encodes pushes: it takes the codec from the acknowledgement.
                    Control::SetPushCodec { codec } if codec.check().is_ok() => {}
                    Control::SkipTo { iteration: to } => {
                        if self.cfg.numbering_shared && to > self.iteration {
                            // Acknowledged once carried out (see `advance`).
                            self.skips.push((msg.shard, to));
                            self.abandon_for_skip();
                            return;
                        }
                    }
                    other => {
                        tracing::warn!(
                            worker = me,
                            shard = msg.shard,
                            ?other,
                            "control message not understood"
                        );
                        return;
                    }
                }
                let iteration = self.next_applicable();
                self.out.push_back(Action::Applied { shard: msg.shard, control, iteration });
            }
        }
    }

    /// Abandons the own iteration for a pending skip where it can be: between its pull and its
    /// push, with no computation of it running and none of its tasks out with other workers.
    fn abandon_for_skip(&mut self) {
        let Some(to) = self.skips.iter().map(|s| s.1).max() else { return };
        if to <= self.cur.iteration || self.cur.given != 0 {
            return;
        }
        let own_running =
            matches!(self.busy, Some(Busy::Computing(None) | Busy::Pacing { then: After::OwnTask, .. }));
        if matches!(self.own, Own::Computing | Own::Delaying(_)) && !own_running {
            tracing::debug!(worker = self.cfg.id, iteration = self.cur.iteration, to, "iteration abandoned");
            self.own = Own::Start;
        }
    }

    /// Carries out the pending skips between iterations: tells the shards, moves on to the
    /// furthest, acknowledges each.
    fn skip_now(&mut self) {
        let to = self.skips.iter().map(|s| s.1).max().unwrap_or(0);
        if to > self.iteration {
            self.report.iterations_skipped += to - self.iteration;
            self.out.push_back(Action::Skip { from: self.iteration, to });
            self.iteration = to;
        }
        for (shard, to) in std::mem::take(&mut self.skips) {
            let control = Control::SkipTo { iteration: to };
            self.out.push_back(Action::Applied { shard, control, iteration: self.iteration });
        }
    }

    /// Owes `extra` emulated device time, then goes on with `then`.
    fn pace(&mut self, extra: u64, then: After) {
        self.device.debt_ns += extra as i64;
        let debt = self.device.debt_ns;
        if debt > 0 && debt >= self.device.device.granularity_ns as i64 {
            self.busy = Some(Busy::Pacing { until: self.now + debt as u64, from: self.now, then });
        } else {
            self.busy = None;
            self.paced(then);
        }
    }

    fn paced(&mut self, then: After) {
        if let After::Help(job, samples) = then {
            let tasks = Some(TaskPart::range(job.first, job.count, job.moved.total));
            let kind = JobKind::Help { owner: job.owner };
            let push = PushJob {
                kind,
                owner: job.owner,
                iteration: job.iteration,
                tasks,
                samples,
                mean_over: None,
                local_steps: 0,
                signals: Signals::default(),
            };
            self.out.push_back(Action::Push(push));
            self.busy = Some(Busy::HelpPushing(job));
        }
    }

    /// Makes every step that needs no input.
    fn advance(&mut self) {
        let now = self.now;
        loop {
            let before = self.out.len();
            self.abandon_for_skip();
            self.give_up_at_stop();
            self.tell_if_waiting();
            match self.own {
                Own::Start if !self.skips.is_empty() => self.skip_now(),
                Own::Start if self.stop || self.iteration >= self.cfg.iterations => self.leave_when_idle(),
                Own::Start if now >= self.pause_until => {
                    let total = self.tasks;
                    self.cur = Current {
                        iteration: self.iteration,
                        total,
                        batch: self.batch,
                        started_at: now,
                        ..Current::default()
                    };
                    self.own = Own::Pulling;
                    self.out.push_back(Action::Pull { iteration: self.iteration });
                }
                Own::Delaying(until) if now >= until => self.after_delay(),
                _ => {}
            }
            let own_may_compute = !matches!(self.own, Own::Delaying(_) | Own::Done);
            if self.busy.is_none() && own_may_compute {
                if let Some(job) = self.help.pop_front() {
                    self.busy = Some(Busy::Computing(Some(job)));
                    let work = Tasks {
                        part: job.moved.part,
                        iteration: job.iteration,
                        batch: job.moved.batch,
                        tasks: job.first..job.first + job.count,
                        total: job.moved.total,
                    };
                    self.out.push_back(Action::Compute(ComputeJob {
                        kind: JobKind::Help { owner: job.owner },
                        work,
                        whole: false,
                        first_of_iteration: false,
                        local_steps: 0,
                    }));
                } else if self.own == Own::Computing {
                    self.next_own_task();
                }
            }
            if self.out.len() == before {
                return;
            }
        }
    }

    /// After a stop, gives up a pull still waiting (at once) and its own push still waiting
    /// ([`STOP_GRACE_NS`] on): a policy that never decides cannot keep the worker.
    fn give_up_at_stop(&mut self) {
        if !self.stop {
            return;
        }
        let what = match self.own {
            Own::Pulling => format!(
                "its pull for iteration {}, still deferred {:.1} s after it asked",
                self.cur.iteration,
                self.now.saturating_sub(self.cur.started_at) as f64 / 1e9
            ),
            Own::Pushing if self.now >= self.stop_at.saturating_add(STOP_GRACE_NS) => format!(
                "its push of iteration {}, not acknowledged {:.1} s after it was sent (the policy \
                 decides it as the worker leaves: applied unless it drops it)",
                self.cur.iteration,
                self.now.saturating_sub(self.cur.pushed_at) as f64 / 1e9
            ),
            _ => return,
        };
        tracing::warn!(worker = self.cfg.id, "stopping: gave up {what}");
        if self.own == Own::Pulling {
            self.waited_no_more();
        }
        self.report.abandoned.push(what);
        self.gave_up = true;
        self.own = Own::Start;
    }

    /// When its pull, not yet told of, is due to be told to the shards.
    fn notice_due(&self) -> Option<u64> {
        (self.own == Own::Pulling && !self.cur.told_waiting)
            .then(|| self.cur.started_at.saturating_add(WAIT_NOTICE_NS))
    }

    /// Tells the shards, once per pull, that it has waited [`WAIT_NOTICE_NS`].
    fn tell_if_waiting(&mut self) {
        if self.notice_due().is_some_and(|due| self.now >= due) {
            self.cur.told_waiting = true;
            self.out.push_back(Action::Waiting { iteration: self.cur.iteration, waiting: true });
        }
    }

    /// Its pull ended (answered, or given up): the shards told that it waits hear that it no
    /// longer does.
    fn waited_no_more(&mut self) {
        if std::mem::take(&mut self.cur.told_waiting) {
            self.out.push_back(Action::Waiting { iteration: self.cur.iteration, waiting: false });
        }
    }

    /// Leaves once the computation in progress (moved tasks) is done; no new iteration starts.
    fn leave_when_idle(&mut self) {
        if self.busy.is_some() {
            return;
        }
        self.report.stopped_early = self.stop && self.iteration < self.cfg.iterations;
        self.report.elapsed_ns = self.now - self.began;
        // Tasks moved to us and not started go back to their owners when we leave.
        self.help.clear();
        self.own = Own::Done;
        self.out.push_back(Action::Leave);
    }

    /// Starts the next task of the own iteration, or ends its computation.
    fn next_own_task(&mut self) {
        let c = self.cur;
        let part = self.cfg.part;
        let job = |tasks: Range<u32>, whole: bool, first: bool| ComputeJob {
            kind: JobKind::Own,
            work: Tasks { part, iteration: c.iteration, batch: c.batch, tasks, total: c.total.max(1) },
            whole,
            first_of_iteration: first,
            local_steps: if whole { c.local_steps } else { 0 },
        };
        if c.next == 0 && (c.total <= 1 || c.local_steps > 0) && c.given == 0 {
            // Computed whole: no task of it is left to start.
            self.cur.next = c.total.max(1);
            self.busy = Some(Busy::Computing(None));
            self.out.push_back(Action::Compute(job(0..1, true, false)));
            return;
        }
        let task = (c.next..c.total).find(|t| c.given & (1 << t) == 0);
        match task {
            Some(t) if c.total > 1 || c.given != 0 => {
                self.cur.next = t + 1;
                self.cur.folded = true;
                self.busy = Some(Busy::Computing(None));
                self.out.push_back(Action::Compute(job(t..t + 1, false, !c.folded)));
            }
            _ => {
                self.cur.next = c.total;
                let delay = self.device.delay_ns(self.now - self.began);
                if delay > 0 {
                    self.own = Own::Delaying(self.now + delay);
                } else {
                    self.after_delay();
                }
            }
        }
    }

    /// Pushes the own iteration (or ends it, when every task went to other workers).
    fn after_delay(&mut self) {
        let c = self.cur;
        if c.samples == 0 {
            self.end_iteration();
            return;
        }
        let tasks = (c.given != 0)
            .then(|| TaskPart { mask: TaskPart::full_mask(c.total) & !c.given, total: c.total });
        let push = PushJob {
            kind: JobKind::Own,
            owner: self.cfg.id,
            iteration: c.iteration,
            tasks,
            samples: c.samples,
            mean_over: c.folded.then_some(c.samples),
            local_steps: c.local_steps,
            signals: Signals {
                loss: (c.samples > 0 && c.loss.is_finite()).then(|| c.loss / c.samples as f32),
                norm: None,
                tokens: match c.tokens {
                    0 => u64::from(c.samples).saturating_mul(self.cfg.tokens_per_sample),
                    told => told,
                }
                .min(Signals::MAX_TOKENS),
                step_ns: c.busy_ns.min(Signals::MAX_STEP_NS),
            },
        };
        self.own = Own::Pushing;
        self.cur.pushed_at = self.now;
        self.out.push_back(Action::Push(push));
    }

    /// The iteration this worker pulls next, if nothing comes in before its push in progress
    /// is acknowledged (no stop, skip, pause, moved tasks or end of the budget): a driver may
    /// send that pull shard by shard as each shard acknowledges its part of the push, before
    /// the machine asks for it (a push overlapped with the backward pass does, so that the
    /// model comes back while the rest is still pushed). Each shard still sees this worker's
    /// push of an iteration before its pull of the next. `None` while no own push is in
    /// progress or the next action is not sure to be that pull; if it turns out otherwise,
    /// the driver drops what it pulled early, as it does a pull a skip abandons.
    pub fn next_pull_if_quiet(&self) -> Option<u64> {
        let next = self.iteration + 1;
        let quiet = self.own == Own::Pushing
            && self.skips.is_empty()
            && !self.stop
            && next < self.cfg.iterations
            && self.now >= self.pause_until
            && self.help.is_empty()
            && self.busy.is_none();
        quiet.then_some(next)
    }

    /// The report this worker gives every shard once its own push in progress is
    /// acknowledged ([`Action::Finished`]), known as soon as the push starts: a driver that
    /// pulls early ([`next_pull_if_quiet`](Self::next_pull_if_quiet)) tells each shard before
    /// that shard's early pull, so that every shard still sees this worker's push, report and
    /// next pull in that order (a shard answers a worker's requests in order: a report sent
    /// after a pull it defers would wait for it). `None` while no own push is in progress.
    pub fn report_of_push(&self) -> Option<IterationReport> {
        let c = &self.cur;
        (self.own == Own::Pushing).then_some(IterationReport {
            worker: self.cfg.id,
            iteration: c.iteration,
            compute_ns: c.busy_ns,
            samples: c.samples,
        })
    }

    /// The mean loss of the iteration last pushed, when the driver learns it only after the
    /// push (a push overlapped with the backward pass): the report's `last_loss`.
    pub fn record_loss(&mut self, loss: f32) {
        self.report.last_loss = loss;
    }

    /// Of the iteration last pushed, the nanoseconds the caller still computed after its push
    /// had started (a push overlapped with the backward pass): the report's
    /// `timeline_overlap`.
    pub fn overlapped(&mut self, ns: u64) {
        let n = self.report.timeline.len();
        self.report.timeline_overlap.resize(n, 0.0);
        if let Some(last) = self.report.timeline_overlap.last_mut() {
            *last = ns as f32 / 1e9;
        }
    }

    fn end_iteration(&mut self) {
        let c = self.cur;
        self.report.iterations += 1;
        self.report.timeline.push((
            c.started_at as f64 / 1e9,
            (c.pulled_at - c.started_at) as f32 / 1e9,
            (self.now - c.pulled_at) as f32 / 1e9,
        ));
        self.report.timeline_acks.push(c.acked_after_ns as f32 / 1e9);
        self.iteration += 1;
        self.own = Own::Start;
    }
}

#[cfg(test)]
mod tests;
