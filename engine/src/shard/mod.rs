//! The shard engine: one shard's parameters, optimizer, clocks and policy, with no networking.
//!
//! A [`Shard`] takes pushes, pulls, membership changes and timer ticks (each with the host time
//! it happened at), asks its policy what to do, and reports what came of it to a [`ShardSink`]:
//! pull replies with the parameters, push acknowledgements, control messages, metrics and policy
//! failures. The network layer drives shards; tests and the simulator drive them directly.
//!
//! # Guarantees
//! - Every admitted push reaches the parameters exactly once: through one optimizer step on
//!   arrival, or in its iteration's aggregate. Duplicates and out-of-order pushes are refused.
//! - No request is left hanging by a misbehaving policy. When a policy call fails (trap, deadline,
//!   memory cap, panic, nonsense decision) the failure is reported, the event's own request gets
//!   the fallback verdict — a push is admitted; a pull is deferred under BSP's rule
//!   (`min_clock >= clock[w]`), the strictest rule, which cannot deadlock while workers push — the
//!   policy restarts from its last checkpoint, and every pending request is handed to it again.
//!   Failures that repeat back off the restarts and quarantine the module (the shard runs on the
//!   fallback rules alone until a swap): `max_consecutive_failures` in a row on one kind of event
//!   (pushes, pulls, timers...; successes on other kinds do not reset the count), or a crash loop
//!   (a few failures within a minute, however many successes came between), counted across
//!   restarts (`supervisor`'s docs).
//! - No rule stalls the run. When every live worker has waited on the policy (a pull parked, a
//!   push held) for the no-progress time ([`SupervisorConfig::no_progress_ns`]), that is the
//!   rule's failure: every stuck request is resolved by the fallback rules, the failure says
//!   what was stuck and for how long, and the policy restarts, backs off or is quarantined as for
//!   any failure.
//! - A hot swap hands the old policy's state to the new one; if the new one refuses, nothing
//!   changes. Pending requests are handed to the new policy as fresh events; none is dropped.
//!
//! # Task accounting
//! A push may cover only some of an iteration's tasks ([`TaskPart`]): the rest come from other
//! workers a policy moved them to ([`Control::MoveTasks`]). The shard keeps, per (worker,
//! iteration), the tasks that have arrived and their samples-weighted gradient sum; each task is
//! accepted once. When all tasks of the worker's next iteration are in, the policy sees one push
//! for it, exactly as if the worker had computed it alone. Later iterations that arrive meanwhile
//! wait their turn, so a worker's iterations still complete in order.

mod arrivals;
mod elsewhere;
mod gate;
mod layout;
mod level;
mod local;
mod node;
mod ops;
mod parked;
mod snapshot;
mod supervisor;

pub use arrivals::{ArrivalCounts, ARRIVAL_BUCKETS, ARRIVAL_WINDOW};
pub use gate::AckGate;
pub use layout::{ModelLayout, Partition, TensorSpec};
pub use level::{levelling, ClockRaise, Frontier};
pub use local::{LocalSgd, LocalSgdConfig};
pub use node::{
    Joined, NodeConfig, NodeOutput, PushOutcome, Quiet, Reply, RequestError, Served, ShardNode, SwapTo,
    Token, Waiting,
};
pub use ops::{Op, Outcome, PushHeader, Stamped};
pub use snapshot::{ShardSnapshot, SnapshotError, SNAPSHOT_FORMAT};
pub use supervisor::{CrashLoop, Health, SupervisorConfig, DEFAULT_NO_PROGRESS_NS};
pub use syncopate_policy_sdk::optimizer::{Optimizer, OptimizerConfig};

pub use crate::codec::Codec;
pub use crate::tasks::{ControlMessage, Handover, MovedTasks, TaskLedger, TaskPart, MAX_TASKS};

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use syncopate_policy_sdk::abi::{
    Control, Decision, Envelope, Event, IterationReport, LeaveReason, Pull, Push, Release, RequestId,
    ShardView, Signals, Tensor, TimerId, UpdateMode, WorkerClock, WorkerId,
};
use syncopate_policy_sdk::clocks::Clocks;
use syncopate_policy_sdk::measure::{self, Scaled};
use syncopate_policy_sdk::rules::{DecisionState, EventRules};

use crate::recording::{PolicyStart, StartKind};
use crate::runtime::{PolicyError, PolicyModule};
use elsewhere::Elsewhere;
use parked::{ParkedPulls, Scan};
use supervisor::{EventKind, Recovery, Supervisor};

/// How to build a shard.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// This shard's index.
    pub shard: u32,
    /// How many shards the model is split into.
    pub shards: u32,
    /// Seed of the random source policies draw from.
    pub seed: u64,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Local steps and the outer optimizer until a policy says otherwise, and again after
    /// every hot swap.
    pub local_sgd: LocalSgdConfig,
    /// The codec pulls are answered in until a policy sets another.
    pub pull_codec: Codec,
    /// Checkpointing and quarantine.
    pub supervisor: SupervisorConfig,
    /// The weight of a push whose policy admits it without one.
    pub push_weight: PushWeight,
    /// Worker ids are `0..max_workers`: a join with any other id is refused before the shard
    /// sizes anything by it. What the shard keeps per worker is a few dozen bytes (its clock,
    /// next and applied iterations, time waited) in vectors indexed by id, so this bounds them.
    pub max_workers: u32,
}

/// The `max_workers` a shard and a cluster have unless told otherwise.
pub const DEFAULT_MAX_WORKERS: u32 = 4096;

/// The weight a push gets when its policy admits it without naming one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PushWeight {
    /// `1 / live workers`: each optimizer step moves by the mean gradient (the usual choice).
    #[default]
    Mean,
    /// 1: gradients are summed (as ps-lite and BytePS servers do); the workers scale them.
    Sum,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            shard: 0,
            shards: 1,
            seed: 0,
            optimizer: OptimizerConfig::default(),
            local_sgd: LocalSgdConfig::default(),
            pull_codec: Codec::None,
            supervisor: SupervisorConfig::default(),
            push_weight: PushWeight::Mean,
            max_workers: DEFAULT_MAX_WORKERS,
        }
    }
}

/// A gradient pushed by a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct PushRequest {
    /// The worker.
    pub worker: WorkerId,
    /// The iteration the gradient was computed for.
    pub iteration: u64,
    /// Samples it was computed on.
    pub samples: u32,
    /// The gradient for this shard's parameters.
    pub grad: Vec<f32>,
    /// The shard version (optimizer steps) of the parameters the gradient was computed from,
    /// when the worker says: the gradient's staleness is counted at admission.
    pub based_on: Option<u64>,
    /// Which of the iteration's tasks the gradient covers; `None` is the whole iteration.
    pub tasks: Option<TaskPart>,
    /// The local steps it covers: 0, a gradient (applied by the shard's optimizer); more, a
    /// pseudo-gradient (applied by the outer optimizer, see [`LocalSgd`]).
    pub local_steps: u32,
    /// What the worker reports of the iteration (loss, tokens, step time; ABI v3), checked by
    /// [`Signals::check_reported`]. Its norm is ignored: the shard measures the push's itself.
    pub signals: Signals,
}

/// How far ahead of its oldest incomplete iteration a worker's parts may run.
const MAX_OPEN_ITERATIONS: u64 = 64;

/// Staleness histogram buckets: 0, 1, ..., 14 steps, and 15 or more.
pub const STALENESS_BUCKETS: usize = 16;

/// A worker's request for the parameters before computing `iteration`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullRequest {
    /// The worker.
    pub worker: WorkerId,
    /// The iteration it is about to compute.
    pub iteration: u64,
}

/// The answer to a pull.
#[derive(Debug)]
pub struct PullReply<'a> {
    /// The pull.
    pub id: RequestId,
    /// Who asked.
    pub worker: WorkerId,
    /// The iteration it asked for.
    pub iteration: u64,
    /// The worker's clock when served.
    pub clock: u64,
    /// Optimizer steps applied to the shard so far.
    pub version: u64,
    /// The fewest iterations of any live worker that the parameters include.
    pub min_applied: u64,
    /// How long the pull was parked, in host nanoseconds.
    pub waited_ns: u64,
    /// The local steps the worker takes in the iteration it pulled for (0: it pushes a
    /// gradient); see [`LocalSgd`].
    pub local_steps: u32,
    /// The codec to send the parameters in.
    pub codec: Codec,
    /// The parameters, shared: a sink that keeps them (to send them, say) clones the `Arc`,
    /// which copies nothing; the shard copies its parameters before it next changes them if a
    /// clone is still alive then.
    pub values: &'a Arc<Vec<f32>>,
}

/// Where a shard reports what happened. The network layer sends these to workers; tests record.
pub trait ShardSink: Observer {
    /// A pull is answered.
    fn pull_served(&mut self, reply: PullReply<'_>);
    /// A push was admitted (applied or aggregated).
    fn push_acked(&mut self, _id: RequestId, _worker: WorkerId, _iteration: u64) {}
    /// A push was dropped by its policy: acknowledged, but its gradient was discarded. By
    /// default the same as [`push_acked`](Self::push_acked).
    fn push_dropped(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
        self.push_acked(id, worker, iteration);
    }
    /// A control message for a worker: a policy's, or a step of a task hand-over (see
    /// [`crate::tasks`]; a policy's [`Control::MoveTasks`] goes to the tasks' owner first).
    fn control(&mut self, _worker: WorkerId, _msg: ControlMessage) {}
    /// A worker has left the shard: it said goodbye (once none of its tasks were still out),
    /// or it was dropped.
    fn left(&mut self, _worker: WorkerId) {}
}

/// What a shard (or a [`ShardNode`]) tells its driver that is not protocol: metrics, policy
/// failures and starts, recordings, and the tensor buffers it borrows and gives back. Every
/// method has a default that keeps nothing (or allocates).
pub trait Observer {
    /// A policy records a metric.
    fn metric(&mut self, _name: &str, _value: f64) {}
    /// The policy failed; the shard recovered as described in the module docs. The shard logs
    /// it at debug level only: the driver says it where it is news (a server warns).
    fn policy_failed(&mut self, _error: &PolicyError) {}
    /// The policy failed too often: the shard no longer calls it, and runs on the fallback
    /// rules until a swap. Logged by the driver, as [`policy_failed`](Self::policy_failed).
    fn policy_quarantined(&mut self, _policy: &str) {}
    /// A policy instance started: the first, one swapped in, or a restart (for recordings:
    /// [`crate::recording`]).
    fn policy_started(&mut self, _start: &PolicyStart<'_>) {}
    /// The policy answered an event with these decisions, or failed on it (for recordings).
    fn policy_called(&mut self, _env: &Envelope, _answer: Result<&[u8], &PolicyError>) {}
    /// A gradient buffer the shard is done with, for the host to reuse (dropped by default).
    fn recycle(&mut self, _buffer: Vec<f32>) {}
    /// A buffer of exactly `len` values, which the shard overwrites: where it copies its parameters
    /// when a served pull still holds them and they are about to change.
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    /// A [`ShardNode`]'s output that need not wait for the end of the call: a primary's op for
    /// its backup ([`NodeOutput::Replicate`]), handed over before the primary applies it, and a
    /// backup's confirmation ([`NodeOutput::Confirm`]), given before the backup applies the op.
    /// A driver that can send it at once (the servers) takes it and returns `None`, so the
    /// network works while the node applies the op. Returned (the default), it comes out of
    /// [`ShardNode::poll_output`] after the call, in order.
    fn send_now(&mut self, out: NodeOutput) -> Option<NodeOutput> {
        Some(out)
    }
}

/// A request the shard refused before any policy saw it. It crosses the wire as it is (in a
/// `DataResponse::Refused`), so a worker can tell one refusal from another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum ShardError {
    /// The worker has not joined (or has left).
    #[error("worker {0} is not a member of shard {1}")]
    UnknownWorker(WorkerId, u32),
    /// The worker joined twice.
    #[error("worker {0} has already joined shard {1}")]
    AlreadyJoined(WorkerId, u32),
    /// The worker's id is not below the shard's `max_workers`.
    #[error("worker id {worker} is out of range for shard {shard}, which admits ids below {max}")]
    WorkerOutOfRange {
        /// The id.
        worker: WorkerId,
        /// The shard.
        shard: u32,
        /// Its `max_workers`.
        max: u32,
    },
    /// The gradient has the wrong length.
    #[error("gradient for shard {shard} has {got} values, expected {expected}")]
    WrongLength {
        /// The shard.
        shard: u32,
        /// Its parameter count.
        expected: usize,
        /// What came.
        got: usize,
    },
    /// The gradient contains NaN or infinity.
    #[error("gradient from worker {0} for iteration {1} contains NaN or infinity")]
    NonFinite(WorkerId, u64),
    /// The push was already received.
    #[error("duplicate push from worker {worker} for iteration {iteration} (next expected: {expected})")]
    Duplicate {
        /// The worker.
        worker: WorkerId,
        /// The iteration pushed.
        iteration: u64,
        /// The next iteration the shard expects from it.
        expected: u64,
    },
    /// Some of the pushed tasks had already arrived, or the task split is not the iteration's.
    #[error("tasks {mask:#x} of worker {worker}'s iteration {iteration}: {reason}")]
    BadTasks {
        /// The worker whose iteration it is.
        worker: WorkerId,
        /// The iteration.
        iteration: u64,
        /// The tasks pushed.
        mask: u64,
        /// What is wrong.
        reason: String,
    },
    /// The push skips iterations.
    #[error("push from worker {worker} for iteration {iteration} skips ahead (next expected: {expected})")]
    OutOfOrder {
        /// The worker.
        worker: WorkerId,
        /// The iteration pushed.
        iteration: u64,
        /// The next iteration the shard expects from it.
        expected: u64,
    },
    /// A skip too far ahead to be a real iteration number.
    #[error("worker {worker} asks to skip from iteration {from} to {to}: more than 2^40 iterations ahead")]
    SkipTooFar {
        /// The worker.
        worker: WorkerId,
        /// Its next iteration.
        from: u64,
        /// Where it asked to go.
        to: u64,
    },
    /// The push's report of its iteration is out of bounds (a loss that is not finite, a step
    /// time or token count no iteration has). Protocol 18; last, as refusals cross the wire by
    /// variant index.
    #[error("worker {worker}'s push for iteration {iteration} reports {reason}")]
    BadSignals {
        /// The worker.
        worker: WorkerId,
        /// The iteration.
        iteration: u64,
        /// What is wrong.
        reason: String,
    },
}

/// Counters a shard keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardStats {
    /// Pushes admitted.
    pub pushes_admitted: u64,
    /// Pulls served.
    pub pulls_served: u64,
    /// Pulls that were deferred.
    pub pulls_deferred: u64,
    /// Total time pulls spent deferred, in nanoseconds.
    pub deferred_ns: u64,
    /// Optimizer steps.
    pub steps: u64,
    /// Policy failures (each reported to the sink).
    pub policy_failures: u64,
    /// Successful hot swaps.
    pub swaps: u64,
    /// Times the policy held a push before deciding it.
    pub pushes_held: u64,
    /// Pushes the policy dropped (acknowledged, gradient discarded, no optimizer step).
    #[serde(default)]
    pub pushes_dropped: u64,
    /// Round aggregates the policy completed early (each one optimizer step).
    #[serde(default)]
    pub aggregates_completed_early: u64,
    /// Worker clocks raised at hot swaps (the rebase that levels the workers).
    #[serde(default)]
    pub clocks_rebased: u64,
    /// Iterations workers skipped on a policy's `SkipTo` (their clocks moved past them).
    #[serde(default)]
    pub iterations_skipped: u64,
    /// Admitted pushes of local steps (pseudo-gradients, applied by the outer optimizer).
    #[serde(default)]
    pub local_pushes: u64,
    /// Admitted pushes by staleness: how many optimizer steps the shard took between the pull
    /// the gradient was computed from and its admission (last bucket: that many or more).
    pub staleness: [u64; STALENESS_BUCKETS],
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Parked {
    pull: Pull,
    until: Release,
    since_ns: u64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Held {
    push: Push,
    grad: Vec<f32>,
    based_on: Option<u64>,
    /// The local steps it covers (0: a gradient).
    local_steps: u32,
}

/// The tasks of one (worker, iteration) received so far.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Partial {
    worker: WorkerId,
    iteration: u64,
    id: RequestId,
    total: u32,
    mask: u64,
    /// Sum of each part's gradient times its samples.
    sum: Vec<f32>,
    samples: u32,
    based_on: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Aggregate {
    sum: Vec<f32>,
    /// The sum of the contributions' weights.
    weight: f32,
    /// The weighted sum of the pseudo-gradients among the contributions (empty: none), which
    /// the outer optimizer steps, and the sum of their weights.
    outer_sum: Vec<f32>,
    outer_weight: f32,
    contributors: Vec<WorkerId>,
    /// How many contributors have left since: a mean push of the round still counts them (see
    /// `round_size`). Kept as leaves and joins happen, so pushes need not scan the
    /// contributors; not in snapshots, but counted again from the clocks on restore.
    #[serde(skip)]
    departed: u32,
}

impl Aggregate {
    /// Contributors that are not live workers.
    fn count_departed(&self, clocks: &Clocks) -> u32 {
        self.contributors.iter().filter(|&&w| !clocks.is_live(w)).count() as u32
    }
}

/// A metric a policy records, as the shard keeps it: the last value and a running count and sum.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Metric {
    /// Its name.
    pub name: String,
    /// The last value recorded.
    pub last: f64,
    /// Samples recorded.
    pub count: u64,
    /// Their sum (the mean is `sum / count`).
    pub sum: f64,
}

/// The most metric names one shard keeps; samples of further names are not kept (the sink still
/// hears every sample).
pub const MAX_METRICS: usize = 64;

/// A request handed to the policy again after a recovery or a swap.
#[derive(Debug)]
enum Pending {
    Pull(Parked),
    Push(Held),
}

/// The answers to one event's measures, waiting to be sent right after it.
#[derive(Debug, Default)]
struct Answers {
    /// Query and value, in the order asked.
    queue: VecDeque<(u64, f64)>,
    /// Values read to compute them, charged to the call that hears the first.
    read: u64,
}

/// One shard: parameters, optimizer, clocks, pending requests and the supervised policy.
#[derive(Debug)]
pub struct Shard {
    shard: u32,
    /// Pushes' arrival offsets within their iteration (not snapshotted).
    arrivals: arrivals::Arrivals,
    /// Nanoseconds pushes were held by the policy, summed over holds that ended (not
    /// snapshotted).
    held_ns: u64,
    /// Shared with the pulls being sent; copied on write (see [`unshare`]).
    params: Arc<Vec<f32>>,
    optimizer: Optimizer,
    push_weight: PushWeight,
    /// Worker ids are below this ([`ShardConfig::max_workers`]).
    max_workers: u32,
    clocks: Clocks,
    floor: u64,
    next_push: Vec<u64>,
    applied: Vec<u64>,
    /// The fewest iterations any live worker has applied, and how many live workers are there;
    /// `None` when it must be counted again (a worker joined or left). Kept so that serving a
    /// pull does not scan every worker: the minimum moves once per round, not once per push.
    applied_min: Option<(u64, usize)>,
    /// Per worker: nanoseconds its pulls spent deferred.
    waited: Vec<u64>,
    /// Per worker (by id): the compute time its pushes reported, summed, how many did, and
    /// the last loss one reported (for the cluster policy's figures; not in snapshots).
    worked: Vec<(u64, u64, Option<f32>)>,
    version: u64,
    mode: UpdateMode,
    aggregates: BTreeMap<u64, Aggregate>,
    /// Buffers of applied aggregates, reused so aggregate mode does not allocate per iteration.
    spare_sums: Vec<Vec<f32>>,
    parked: ParkedPulls,
    held: Vec<Held>,
    /// When each push still held was held (its time here; a restored shard counts from the
    /// restore): how long a policy has held one, for operators. Pruned as pushes are held.
    held_at: Vec<(RequestId, u64)>,
    /// The policy's open groups ([`Decision::AdmitToGroup`]), by name.
    groups: BTreeMap<u64, Aggregate>,
    /// Local steps and the outer optimizer.
    local: LocalSgd,
    /// The codec pulls are answered in (a policy's [`Decision::SetPullCodec`]).
    pull_codec: Codec,
    partials: Vec<Partial>,
    ledger: TaskLedger,
    incoming: Option<Held>,
    /// Measures answered, not yet sent.
    answers: Answers,
    undecided_pull: Option<Parked>,
    timers: Vec<(TimerId, u64)>,
    supervisor: Supervisor,
    rng: ChaCha8Rng,
    next_id: RequestId,
    scratch: Vec<u8>,
    queue: VecDeque<Pending>,
    stats: ShardStats,
    metrics: Vec<Metric>,
    /// The last policy failure, for operators.
    last_failure: Option<String>,
    /// When to look whether every live worker waits on the policy for the no-progress time
    /// (armed when a request starts waiting; see [`Shard::check_progress`]).
    stall_check_at: Option<u64>,
    /// The worker whose departure the policy is hearing of ([`Shard::leave`]).
    leaving: Option<WorkerId>,
    /// Per worker, what it waits on elsewhere: another shard's acknowledgement of its push, or
    /// its answer to its pull (see [`Shard::check_progress`]).
    elsewhere: Elsewhere,
    /// The driver's time of the event being handled.
    now_ns: u64,
    /// The cluster's number of the swap that put the running policy in (0: the first policy),
    /// and what it raised the workers' clocks by ([`Shard::commit_swap`]).
    swap: (u64, Vec<ClockRaise>),
}

impl DecisionState for Shard {
    fn is_live(&self, worker: WorkerId) -> bool {
        self.clocks.is_live(worker) && self.leaving != Some(worker)
    }
    fn is_parked(&self, pull: RequestId) -> bool {
        self.parked.contains(pull)
    }
    fn is_held(&self, push: RequestId) -> bool {
        self.held.iter().any(|h| h.push.id == push)
    }
    fn has_timer(&self, timer: TimerId) -> bool {
        self.timers.iter().any(|t| t.0 == timer)
    }
    fn timers(&self) -> usize {
        self.timers.len()
    }
}

/// The parameters, for writing: copied first (into a buffer from `sink`) when a served pull
/// still shares them, so what a pull sent is what the parameters were when it was served.
fn unshare<'a>(params: &'a mut Arc<Vec<f32>>, sink: &mut dyn ShardSink) -> &'a mut [f32] {
    if Arc::get_mut(params).is_none() {
        let mut copy = sink.buffer(params.len());
        copy.copy_from_slice(params);
        *params = Arc::new(copy);
    }
    Arc::get_mut(params).expect("unshared just above")
}

impl Shard {
    /// A shard holding `params`, run by `policy` with `config`.
    pub fn new(
        cfg: ShardConfig,
        params: Vec<f32>,
        policy: &PolicyModule,
        config: &[(String, String)],
        sink: &mut dyn ShardSink,
    ) -> Result<Self, PolicyError> {
        let (supervisor, start) = Supervisor::start(cfg.supervisor, cfg.shard, cfg.shards, policy, config)?;
        sink.policy_started(&PolicyStart {
            kind: StartKind::First,
            module: policy,
            config,
            shard: cfg.shard,
            shards: cfg.shards,
            now_ns: 0,
            decisions: &start,
            workers: &[],
        });
        let params_len = params.len();
        let mut shard = Shard {
            shard: cfg.shard,
            arrivals: Default::default(),
            held_ns: 0,
            optimizer: Optimizer::new(cfg.optimizer, params.len()),
            push_weight: cfg.push_weight,
            max_workers: cfg.max_workers,
            params: Arc::new(params),
            clocks: Clocks::new(),
            floor: 0,
            next_push: Vec::new(),
            applied: Vec::new(),
            applied_min: None,
            waited: Vec::new(),
            worked: Vec::new(),
            version: 0,
            mode: UpdateMode::OnArrival,
            aggregates: BTreeMap::new(),
            spare_sums: Vec::new(),
            parked: ParkedPulls::new(),
            held: Vec::new(),
            held_at: Vec::new(),
            groups: BTreeMap::new(),
            local: LocalSgd::new(cfg.local_sgd, params_len),
            pull_codec: cfg.pull_codec,
            partials: Vec::new(),
            ledger: TaskLedger::default(),
            incoming: None,
            answers: Answers::default(),
            undecided_pull: None,
            timers: Vec::new(),
            supervisor,
            rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ (u64::from(cfg.shard) << 32)),
            next_id: 0,
            scratch: Vec::with_capacity(256),
            queue: VecDeque::new(),
            stats: ShardStats::default(),
            metrics: Vec::new(),
            last_failure: None,
            stall_check_at: None,
            leaving: None,
            elsewhere: Elsewhere::default(),
            now_ns: 0,
            swap: (0, Vec::new()),
        };
        shard.apply_start(&start, 0, sink)?;
        Ok(shard)
    }

    /// The current parameters.
    pub fn values(&self) -> &[f32] {
        &self.params
    }

    /// The current parameters, to keep without a copy: the shard copies them before its next
    /// change while a clone is alive, so a clone never changes.
    pub fn shared_values(&self) -> &Arc<Vec<f32>> {
        &self.params
    }

    /// Optimizer steps applied so far.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The shard's clocks.
    pub fn view(&self) -> ShardView {
        self.clocks.view()
    }

    /// The live workers and their clocks.
    pub fn workers(&self) -> Vec<WorkerClock> {
        self.clocks.workers().collect()
    }

    /// What levels this shard's workers at a swap when it is the only one: each raised to the
    /// largest clock (a cluster agrees on one levelling for all its shards, see [`Frontier`]).
    pub fn levelling(&self) -> Vec<ClockRaise> {
        levelling(&self.workers())
    }

    /// Per live worker: nanoseconds its pulls have spent deferred on this shard.
    pub fn worker_waits(&self) -> Vec<(WorkerId, u64)> {
        self.clocks
            .workers()
            .map(|w| (w.worker, self.waited.get(w.worker as usize).copied().unwrap_or(0)))
            .collect()
    }

    /// Per live worker, by id: its clock, its work here as its pushes reported it, and its waits.
    pub fn worker_work(&self) -> Vec<crate::pilot::WorkerWork> {
        self.clocks
            .workers()
            .map(|w| {
                let i = w.worker as usize;
                let (step_ns, pushes, loss) = self.worked.get(i).copied().unwrap_or_default();
                let waited_ns = self.waited.get(i).copied().unwrap_or(0);
                crate::pilot::WorkerWork {
                    worker: w.worker,
                    clock: w.clock,
                    step_ns,
                    pushes,
                    loss,
                    waited_ns,
                }
            })
            .collect()
    }

    /// Counters.
    pub fn stats(&self) -> ShardStats {
        self.stats
    }

    /// The update mode in force.
    pub fn update_mode(&self) -> UpdateMode {
        self.mode
    }

    /// The policy module running (or quarantined) on this shard.
    pub fn policy(&self) -> &PolicyModule {
        self.supervisor.module()
    }

    /// The policy's configuration.
    pub fn policy_config(&self) -> &[(String, String)] {
        self.supervisor.config()
    }

    /// Whether the policy is quarantined (the shard runs on fallback rules until a swap).
    pub fn is_quarantined(&self) -> bool {
        self.supervisor.is_quarantined()
    }

    /// Until when a crash loop keeps the policy out (the shard runs on fallback rules until
    /// then, and restarts it), if it does.
    pub fn backoff_until(&self) -> Option<u64> {
        self.supervisor.backoff_until()
    }

    /// The cluster's number of the swap that put the running policy in (0: the first one), and
    /// what that swap raised the workers' clocks by: a server tells a restarted coordinator the
    /// newest swap its copies run, so that a swap interrupted by its crash is finished alike.
    pub fn swap(&self) -> (u64, &[ClockRaise]) {
        (self.swap.0, &self.swap.1)
    }

    /// Failures of the running policy since it started on this shard (its swap, or the shard's
    /// start): what a swap's watcher judges the new policy by. [`ShardStats::policy_failures`]
    /// counts every module's.
    pub fn module_failures(&self) -> u64 {
        self.supervisor.failures()
    }

    /// When pushes arrived against the first push of their iteration, since this shard started
    /// in this process (whole pushes; a shard restored from a snapshot counts afresh).
    pub fn arrival_offsets(&self) -> ArrivalCounts {
        self.arrivals.counts()
    }

    /// Nanoseconds pushes were held by the policy, summed over the holds that ended since this
    /// shard started in this process (a restart that hands a held push back ends its hold).
    pub fn held_ns(&self) -> u64 {
        self.held_ns
    }

    /// Times the policy was restarted after a failure on this shard since it started in this
    /// process (from its last checkpoint, at once or after a backoff).
    pub fn policy_restarts(&self) -> u64 {
        self.supervisor.restarts()
    }

    /// What the policy's event calls have cost on this shard since it started in this process
    /// (every instance: restarts and swaps included).
    pub fn policy_usage(&self) -> crate::runtime::PolicyUsage {
        self.supervisor.usage()
    }

    /// The metrics the policy has recorded (at most [`MAX_METRICS`] names).
    pub fn metrics(&self) -> &[Metric] {
        &self.metrics
    }

    /// The last policy failure on this shard, if any.
    pub fn last_failure(&self) -> Option<&str> {
        self.last_failure.as_deref()
    }

    /// Pulls currently parked.
    pub fn parked_pulls(&self) -> usize {
        self.parked.len()
    }

    /// Pushes currently held.
    pub fn held_pushes(&self) -> usize {
        self.held.len()
    }

    /// The pull parked longest, if any: its worker, iteration and since when (the shard's time).
    /// A rule that parks a pull and never releases it hangs its worker; operators see this.
    pub fn oldest_parked(&self) -> Option<(WorkerId, u64, u64)> {
        self.parked
            .as_slice()
            .iter()
            .map(|p| (p.pull.worker, p.pull.iteration, p.since_ns))
            .min_by_key(|p| p.2)
    }

    /// The push held longest, if any: its worker, iteration and since when (the shard's time).
    /// A rule that holds a push and never admits it hangs its worker; operators see this.
    pub fn oldest_held(&self) -> Option<(WorkerId, u64, u64)> {
        self.held
            .iter()
            .map(|h| {
                let since = self.held_at.iter().find(|a| a.0 == h.push.id).map_or(0, |a| a.1);
                (h.push.worker, h.push.iteration, since)
            })
            .min_by_key(|h| h.2)
    }

    /// (worker, iteration) pairs whose tasks have partly arrived, or that wait for an earlier
    /// incomplete iteration of the same worker.
    pub fn open_iterations(&self) -> Vec<(WorkerId, u64)> {
        self.partials.iter().map(|p| (p.worker, p.iteration)).collect()
    }

    /// When the shard next wants [`advance`](Self::advance), if ever: a policy timer, the end
    /// of a crash loop's backoff, or the next look for a stall.
    pub fn next_timer_ns(&self) -> Option<u64> {
        let timer = self.timers.iter().map(|t| t.1).min();
        let stall = self.stall_check_at.filter(|_| self.supervisor.is_running());
        [timer, self.supervisor.backoff_until(), stall].into_iter().flatten().min()
    }

    /// A worker joins. Returns the clock (iteration) it starts at: the shard's minimum clock, so
    /// a late joiner starts with the slowest worker.
    pub fn join(
        &mut self,
        worker: WorkerId,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<u64, ShardError> {
        if worker >= self.max_workers {
            return Err(ShardError::WorkerOutOfRange { worker, shard: self.shard, max: self.max_workers });
        }
        let view = self.clocks.view();
        let clock = if view.workers == 0 { self.floor } else { view.min_clock };
        if !self.clocks.join(worker, clock) {
            return Err(ShardError::AlreadyJoined(worker, self.shard));
        }
        let i = worker as usize;
        if self.next_push.len() <= i {
            self.next_push.resize(i + 1, 0);
            self.applied.resize(i + 1, 0);
            self.waited.resize(i + 1, 0);
            self.worked.resize(i + 1, (0, 0, None));
        }
        self.next_push[i] = clock;
        self.applied[i] = clock;
        self.applied_min = None;
        self.recount_departed();
        self.run(Event::WorkerJoined { worker, clock }, view, now_ns, sink);
        Ok(clock)
    }

    /// A worker leaves (or is dropped). Its policy hears it first ([`Event::WorkerLeft`]) with
    /// the worker's held pushes still held, and decides their fate (admit or drop them); those
    /// it leaves held are admitted, since their gradients are valid (the default, also for
    /// modules that never look). Then its parked pulls are dropped (nobody is left to answer)
    /// and the barrier it held opens.
    pub fn leave(
        &mut self,
        worker: WorkerId,
        reason: LeaveReason,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(worker) || self.leaving == Some(worker) {
            return Err(ShardError::UnknownWorker(worker, self.shard));
        }
        let before = self.partials.len();
        self.partials.retain(|p| p.worker != worker);
        if self.partials.len() < before {
            tracing::warn!(
                shard = self.shard,
                worker,
                dropped = before - self.partials.len(),
                "worker left with incomplete iterations; their partial gradients are dropped"
            );
        }
        // The policy decides on the worker's held pushes while they are held (and its clock
        // still counts); to it, the worker is gone: no control may go to it.
        let view = self.clocks.view();
        self.leaving = Some(worker);
        self.run(Event::WorkerLeft { worker, reason }, view, now_ns, sink);
        self.leaving = None;
        while let Some(pos) = self.held.iter().position(|h| h.push.worker == worker) {
            let h = self.held.remove(pos);
            self.unhold(h.push.id, now_ns);
            self.admit(h, None, sink);
        }
        self.parked.forget_worker(worker);
        self.local.forget(worker);
        self.elsewhere.forget(worker);
        self.clocks.leave(worker);
        self.applied_min = None;
        self.recount_departed();
        self.floor = self.floor.max(self.clocks.view().min_clock);
        self.complete_aggregates(sink);
        self.release_ready(now_ns, sink);
        // The workers left may all be waiting now (the one that left was the only one that was
        // not): look again at once.
        self.look_again(now_ns);
        sink.left(worker);
        // Tasks it took and never pushed go back to their owners, who compute them themselves,
        // so no iteration is left incomplete.
        for m in self.ledger.left(worker) {
            tracing::warn!(
                shard = self.shard,
                owner = m.owner,
                helper = worker,
                "moved tasks returned to their owner"
            );
            if self.clocks.is_live(m.owner) {
                sink.control(m.owner, m.message(self.shard));
            }
        }
        self.finish_goodbyes(now_ns, sink);
        Ok(())
    }

    /// A worker says goodbye. It leaves at once ([`leave`](Self::leave) with
    /// [`LeaveReason::Finished`]) unless tasks of its iterations are still being computed by
    /// other workers: then it leaves when they are in, so nothing it trained is lost. Returns
    /// whether it left now; the sink hears [`ShardSink::left`] either way when it does.
    pub fn goodbye(
        &mut self,
        worker: WorkerId,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<bool, ShardError> {
        if !self.clocks.is_live(worker) {
            return Err(ShardError::UnknownWorker(worker, self.shard));
        }
        if self.ledger.has_out(worker) {
            self.ledger.wait_to_leave(worker);
            return Ok(false);
        }
        self.leave(worker, LeaveReason::Finished, now_ns, sink)?;
        Ok(true)
    }

    /// Completes the goodbyes that waited for tasks which are now all in.
    fn finish_goodbyes(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        while let Some(owner) = self.ledger.next_ready_to_leave() {
            if self.leave(owner, LeaveReason::Finished, now_ns, sink).is_err() {
                self.ledger.left(owner);
            }
        }
    }

    /// The owner of tasks a policy moved answers the move ([`crate::tasks`]): the tasks it
    /// hands over go to the helper (or, if the helper has gone, back to the owner), and the
    /// policy hears how many moved as an `Event::ControlApplied` for the helper.
    pub fn tasks_yielded(
        &mut self,
        h: Handover,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(h.owner) {
            return Err(ShardError::UnknownWorker(h.owner, self.shard));
        }
        if !h.is_valid() {
            let mask = TaskPart::range(h.first, h.count, MAX_TASKS).mask;
            let reason =
                format!("a hand-over of tasks {}..{} of {}", h.first, h.first + h.count, h.split.total);
            return Err(ShardError::BadTasks { worker: h.owner, iteration: h.iteration, mask, reason });
        }
        let count = if h.count > 0 && self.clocks.is_live(h.to) {
            sink.control(h.to, h.message(self.shard));
            self.ledger.handed(h);
            h.count
        } else {
            if h.count > 0 {
                // The helper has gone: the owner keeps its tasks and computes them.
                sink.control(h.owner, h.message(self.shard));
            }
            0
        };
        let control = Control::MoveTasks { from: h.owner, iteration: h.iteration, first: h.first, count };
        let applied = syncopate_policy_sdk::abi::Applied { worker: h.to, control, iteration: h.iteration };
        self.control_applied(applied, now_ns, sink)
    }

    /// Worker `by` pushes: its own iteration (as [`push`](Self::push)), or tasks of
    /// `req.worker`'s iteration that were moved to it, which completes their hand-over.
    pub fn push_by(
        &mut self,
        by: WorkerId,
        req: PushRequest,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<RequestId, ShardError> {
        if let Some(part) = req.tasks {
            self.ledger.pushed(by, req.worker, req.iteration, part.mask);
        }
        let result = self.push(req, now_ns, sink);
        self.finish_goodbyes(now_ns, sink);
        result
    }

    /// The most iterations one skip may jump: far beyond any run, and far from overflowing a clock.
    const MAX_SKIP: u64 = 1 << 40;

    /// `worker` skips from its next push to iteration `to` (a policy's `SkipTo`): its clock
    /// moves past the iterations it will never push, as if each had been dropped, and the rounds
    /// and pulls that waited on it go on. A skip to an iteration already reached changes
    /// nothing. The worker sends it only with no push of its in flight.
    pub fn skip(
        &mut self,
        worker: WorkerId,
        to: u64,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(worker) {
            return Err(ShardError::UnknownWorker(worker, self.shard));
        }
        let next = &mut self.next_push[worker as usize];
        if to <= *next {
            return Ok(());
        }
        let n = to - *next;
        if n > Self::MAX_SKIP {
            return Err(ShardError::SkipTooFar { worker, from: *next, to });
        }
        *next = to;
        self.clocks.advance(worker, n);
        self.stats.iterations_skipped += n;
        self.complete_aggregates(sink);
        self.release_ready(now_ns, sink);
        Ok(())
    }

    /// A worker pushes a gradient. Returns the request id; the acknowledgement goes to the sink
    /// when the push is admitted.
    pub fn push(
        &mut self,
        req: PushRequest,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<RequestId, ShardError> {
        let PushRequest { worker, iteration, tasks, local_steps, .. } = req;
        if !self.clocks.is_live(worker) {
            return Err(ShardError::UnknownWorker(worker, self.shard));
        }
        if req.grad.len() != self.params.len() {
            return Err(ShardError::WrongLength {
                shard: self.shard,
                expected: self.params.len(),
                got: req.grad.len(),
            });
        }
        // A gradient that is not finite is refused even for an iteration the shard has: a
        // duplicate of a held push takes the place of the push's acknowledgement, which a bad
        // request must not take. For a whole push to a module that sees norms, the sum of squares
        // is the check (finite exactly when every value is: an f32 squared never overflows an
        // f64), so the norm costs no second pass over the gradient; parts are summed first.
        let partial =
            tasks.is_some_and(|t| !t.is_whole()) || self.partials.iter().any(|p| p.worker == worker);
        let sumsq = if partial { None } else { self.sum_of_squares(&req.grad) };
        if !sumsq.map_or_else(|| all_finite(&req.grad), f64::is_finite) {
            return Err(ShardError::NonFinite(worker, iteration));
        }
        if let Err(reason) = req.signals.check_reported() {
            return Err(ShardError::BadSignals { worker, iteration, reason });
        }
        let expected = self.next_push[worker as usize];
        if iteration < expected {
            return Err(ShardError::Duplicate { worker, iteration, expected });
        }
        if iteration > expected && (!partial || iteration - expected >= MAX_OPEN_ITERATIONS) {
            return Err(ShardError::OutOfOrder { worker, iteration, expected });
        }
        if partial && local_steps > 0 {
            let part = tasks.unwrap_or(TaskPart { mask: 1, total: 1 });
            let reason = "local steps cannot be split into tasks".to_string();
            return Err(ShardError::BadTasks { worker, iteration, mask: part.mask, reason });
        }
        if !partial {
            self.arrivals.record(iteration, now_ns);
        }
        let id = if partial {
            let part = tasks.unwrap_or(TaskPart { mask: 1, total: 1 });
            self.push_part(req, part, now_ns, sink)?
        } else {
            let id = self.id();
            self.offer(id, req, sumsq, now_ns, sink);
            id
        };
        // Its pull of this iteration has ended (whoever computed these tasks). Only a push the
        // shard took says so: a refused one (one that skips iterations, say) must not void the
        // worker's notice that it waits on its pull.
        self.elsewhere.moved_on(worker, iteration);
        Ok(id)
    }

    /// Hands the policy a worker's next iteration, complete (`req`'s tasks are not looked at:
    /// they are all there).
    /// The sum of the squares of `values` in f64 (their squared L2 norm), when the running module
    /// sees norms (ABI v3); `None` for a v2 module, which would not, so that nothing is computed
    /// for it.
    fn sum_of_squares(&self, values: &[f32]) -> Option<f64> {
        (self.supervisor.module().abi() >= 3).then(|| measure::dot(values, values))
    }

    /// `sumsq`: the gradient's [`sum_of_squares`](Self::sum_of_squares), its norm's square.
    fn offer(
        &mut self,
        id: RequestId,
        req: PushRequest,
        sumsq: Option<f64>,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) {
        let PushRequest { worker, iteration, samples, grad, based_on, local_steps, signals, .. } = req;
        let clock = self.clocks.get(worker).unwrap_or(0);
        self.next_push[worker as usize] = iteration + 1;
        let (version, staleness) = (self.version, based_on.map_or(0, |b| self.version.saturating_sub(b)));
        let signals = Signals { norm: sumsq.map(|s| s.sqrt() as f32), ..signals };
        if let Some(w) = self.worked.get_mut(worker as usize) {
            if signals.step_ns > 0 {
                w.0 = w.0.saturating_add(signals.step_ns);
                w.1 += 1;
            }
            w.2 = signals.loss.or(w.2);
        }
        let push = Push { id, worker, iteration, clock, samples, staleness, version, signals };
        self.incoming = Some(Held { push, grad, based_on, local_steps });
        let view = self.clocks.view();
        self.run(Event::Push(push), view, now_ns, sink);
    }

    /// Adds `part`, some tasks of an iteration, to its accounting; offers every iteration that
    /// is now complete and next in line. Returns the id the iteration's push will have.
    fn push_part(
        &mut self,
        req: PushRequest,
        part: TaskPart,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<RequestId, ShardError> {
        let PushRequest { worker, iteration, samples, grad, based_on, .. } = req;
        let bad = |reason: String| ShardError::BadTasks { worker, iteration, mask: part.mask, reason };
        if !part.is_valid() {
            return Err(bad(format!("not a set of tasks out of {}", part.total)));
        }
        let pos = match self.partials.iter().position(|p| p.worker == worker && p.iteration == iteration) {
            Some(pos) => {
                let p = &self.partials[pos];
                if p.total != part.total {
                    return Err(bad(format!("the iteration has {} tasks, not {}", p.total, part.total)));
                }
                if p.mask & part.mask != 0 {
                    return Err(bad(format!("tasks {:#x} have already arrived", p.mask & part.mask)));
                }
                pos
            }
            None => {
                let id = self.id();
                self.partials.push(Partial {
                    worker,
                    iteration,
                    id,
                    total: part.total,
                    mask: 0,
                    sum: {
                        let mut sum = self.spare_sums.pop().unwrap_or_default();
                        sum.clear();
                        sum.resize(self.params.len(), 0.0);
                        sum
                    },
                    samples: 0,
                    based_on: None,
                });
                self.partials.len() - 1
            }
        };
        let p = &mut self.partials[pos];
        let w = samples.max(1) as f32;
        for (s, g) in p.sum.iter_mut().zip(&grad) {
            *s += w * g;
        }
        sink.recycle(grad);
        p.mask |= part.mask;
        p.samples += samples.max(1);
        p.based_on = match (p.based_on, based_on) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let id = p.id;
        self.complete_parts(worker, now_ns, sink);
        Ok(id)
    }

    /// Offers, in order, every complete iteration of `worker` that is next in line.
    fn complete_parts(&mut self, worker: WorkerId, now_ns: u64, sink: &mut dyn ShardSink) {
        while self.clocks.is_live(worker) {
            let next = self.next_push[worker as usize];
            let Some(pos) = self.partials.iter().position(|p| {
                p.worker == worker && p.iteration == next && p.mask == TaskPart::full_mask(p.total)
            }) else {
                return;
            };
            let mut p = self.partials.swap_remove(pos);
            // Division, not a reciprocal: (n * g) / n is exactly g.
            let n = p.samples as f32;
            p.sum.iter_mut().for_each(|g| *g /= n);
            let (iteration, samples, based_on) = (p.iteration, p.samples, p.based_on);
            let req = PushRequest {
                worker,
                iteration,
                samples,
                grad: p.sum,
                based_on,
                tasks: None,
                local_steps: 0,
                signals: Signals::default(),
            };
            let sumsq = self.sum_of_squares(&req.grad);
            self.offer(p.id, req, sumsq, now_ns, sink);
        }
    }

    /// A worker acknowledged a control message this shard's policy sent.
    pub fn control_applied(
        &mut self,
        applied: syncopate_policy_sdk::abi::Applied,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(applied.worker) {
            return Err(ShardError::UnknownWorker(applied.worker, self.shard));
        }
        let view = self.clocks.view();
        self.run(Event::ControlApplied(applied), view, now_ns, sink);
        Ok(())
    }

    /// A worker asks for the parameters. Returns the request id; the reply goes to the sink when
    /// the pull is served (at once, or when released). Asking again for a pull that is parked
    /// changes nothing: the parked pull is the answer.
    pub fn pull(
        &mut self,
        req: PullRequest,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<RequestId, ShardError> {
        let clock = self.clocks.get(req.worker).ok_or(ShardError::UnknownWorker(req.worker, self.shard))?;
        // Its pull of the iteration before has ended, if this pull follows a push the shard
        // has seen: one numbered past that (a buggy or hostile peer's) must not void the
        // worker's notice that it waits on its pull.
        let expected = self.next_push.get(req.worker as usize).copied().unwrap_or(0);
        if let Some(before) = req.iteration.checked_sub(1).filter(|_| req.iteration <= expected) {
            self.elsewhere.moved_on(req.worker, before);
        }
        if let Some(p) = self.parked.find(req.worker, req.iteration) {
            // The worker asks again for a pull that is parked (it reconnected after a restore):
            // the parked one answers it when released; the policy has decided it already.
            return Ok(p);
        }
        let id = self.id();
        let pull = Pull { id, worker: req.worker, iteration: req.iteration, clock, version: self.version };
        self.undecided_pull = Some(Parked { pull, until: Release::Explicit, since_ns: now_ns });
        let view = self.clocks.view();
        self.run(Event::Pull(pull), view, now_ns, sink);
        Ok(id)
    }

    /// A worker reports a finished iteration.
    pub fn iteration_finished(
        &mut self,
        report: IterationReport,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(report.worker) {
            return Err(ShardError::UnknownWorker(report.worker, self.shard));
        }
        self.elsewhere.reported(report.worker, report.iteration);
        let view = self.clocks.view();
        self.run(Event::IterationFinished(report), view, now_ns, sink);
        Ok(())
    }

    /// `worker`'s push of `iteration` is acknowledged here (admitted, grouped or dropped): until
    /// its report of that iteration comes, it waits on the other shards' acknowledgements.
    fn acked_here(&mut self, worker: WorkerId, iteration: u64) {
        self.elsewhere.acked(worker, iteration, self.now_ns);
    }

    /// `worker` says its pull of `iteration` waits on another shard's answer (`waiting`), or
    /// that every shard has answered it ([`Op::Waiting`]): while it waits, it counts as waiting
    /// here too, and the shard looks at once whether the rule stalled the run.
    pub fn pull_waiting(
        &mut self,
        worker: WorkerId,
        iteration: u64,
        waiting: bool,
        now_ns: u64,
    ) -> Result<(), ShardError> {
        if !self.clocks.is_live(worker) {
            return Err(ShardError::UnknownWorker(worker, self.shard));
        }
        self.elsewhere.pull_waiting(worker, iteration, waiting, now_ns);
        if waiting {
            self.look_again(now_ns);
        }
        Ok(())
    }

    /// Moves the shard's time to `now_ns`: a policy whose crash-loop backoff is over restarts,
    /// every policy timer due fires, and a policy under which every live worker has waited for
    /// the no-progress time fails ([`SupervisorConfig::no_progress_ns`]).
    pub fn advance(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        self.now_ns = self.now_ns.max(now_ns);
        match self.supervisor.resume(now_ns) {
            None => {}
            Some(Ok(())) => {
                tracing::debug!(shard = self.shard, "policy restarted after its backoff");
                self.policy_started(StartKind::Restart, now_ns, &[], &[], sink);
                self.requeue_pending(now_ns);
                self.drain(now_ns, sink);
                self.release_ready(now_ns, sink);
            }
            Some(Err(e)) => {
                self.stats.policy_failures += 1;
                self.last_failure = Some(e.to_string());
                sink.policy_failed(&e);
                sink.policy_quarantined(self.supervisor.module().display_name());
            }
        }
        while let Some(pos) = self.timers.iter().position(|t| t.1 <= now_ns) {
            let (timer, _) = self.timers.swap_remove(pos);
            let view = self.clocks.view();
            self.run(Event::Timer { timer }, view, now_ns, sink);
        }
        self.check_progress(now_ns, sink);
    }

    /// Arms the look for a stall, once a request starts waiting on the policy at `now_ns`.
    fn arm_stall_check(&mut self, now_ns: u64) {
        let wait = self.supervisor.cfg().no_progress_ns;
        if wait > 0 && self.stall_check_at.is_none() {
            self.stall_check_at = Some(now_ns.saturating_add(wait));
        }
    }

    /// Looks for a stall at the next [`advance`](Self::advance) (at `now_ns`), if requests wait.
    fn look_again(&mut self, now_ns: u64) {
        let waiting = self.parked.len() + self.held.len() > 0;
        if waiting && self.supervisor.cfg().no_progress_ns > 0 {
            self.stall_check_at = Some(self.stall_check_at.map_or(now_ns, |t| t.min(now_ns)));
        }
    }

    /// Looks, once due, whether every live worker has waited for the no-progress time: on this
    /// policy (a parked pull, a held push), or on other shards (its push acknowledged here and
    /// its report not come; its pull served here and, as it told us, waiting on another
    /// shard's answer: see [`elsewhere`]). A rule that parks pulls or holds pushes on some
    /// shards and not others deadlocks the workers across shards, while each shard sees
    /// someone not waiting on it. With at least one request waiting here, the rule has
    /// stalled (see [`SupervisorConfig::no_progress_ns`]). Otherwise it looks again when the
    /// request that started waiting last could make it so, or, if some worker waits on
    /// nothing, when a request next starts waiting, a worker says it waits elsewhere, or a
    /// worker leaves. Costs O(workers), once per no-progress time.
    fn check_progress(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        let Some(at) = self.stall_check_at else { return };
        if at > now_ns {
            return;
        }
        self.stall_check_at = None;
        let live = self.clocks.view().workers as usize;
        if !self.supervisor.is_running() || live == 0 || self.parked.len() + self.held.len() == 0 {
            return;
        }
        // Per live worker, since when it has waited (its longest-waiting request).
        let mut waiting: BTreeMap<WorkerId, u64> = BTreeMap::new();
        let mut wait = |worker: WorkerId, since: u64| {
            let t = waiting.entry(worker).or_insert(since);
            *t = (*t).min(since);
        };
        for p in self.parked.as_slice() {
            wait(p.pull.worker, p.since_ns);
        }
        for h in &self.held {
            let since = self.held_at.iter().find(|a| a.0 == h.push.id).map_or(now_ns, |a| a.1);
            wait(h.push.worker, since);
        }
        waiting.retain(|w, _| self.clocks.is_live(*w));
        if waiting.is_empty() {
            return;
        }
        for w in self.clocks.workers().map(|c| c.worker) {
            if let Some(since) = self.elsewhere.since(w) {
                let t = waiting.entry(w).or_insert(since);
                *t = (*t).min(since);
            }
        }
        if waiting.len() < live {
            return;
        }
        let all_since = waiting.values().copied().max().unwrap_or(now_ns);
        let wait_ns = self.supervisor.cfg().no_progress_ns;
        if all_since.saturating_add(wait_ns) > now_ns {
            self.stall_check_at = Some(all_since.saturating_add(wait_ns));
            return;
        }
        self.stalled(now_ns, &waiting, sink);
    }

    /// The policy stalled the run: reports it with what was stuck, resolves every stuck request
    /// by the fallback rules (held pushes admitted, parked pulls under BSP's rule), and restarts,
    /// backs off or quarantines the policy. The restarted policy is not handed the requests
    /// again: the fallback decided them.
    fn stalled(&mut self, now_ns: u64, waiting: &BTreeMap<WorkerId, u64>, sink: &mut dyn ShardSink) {
        let secs = |t: u64| now_ns.saturating_sub(t) as f64 / 1e9;
        let all_for = waiting.values().copied().max().map_or(0.0, secs);
        let mut longest: Vec<String> = Vec::new();
        if let Some((w, i, t)) = self.oldest_parked() {
            longest.push(format!("worker {w}'s pull for iteration {i} parked {:.1} s", secs(t)));
        }
        if let Some((w, i, t)) = self.oldest_held() {
            longest.push(format!("worker {w}'s push of iteration {i} held {:.1} s", secs(t)));
        }
        let stuck = format!(
            "on shard {}, all {} live workers waited on its decisions for {all_for:.1} s or more \
             ({}, {}; longest: {}); the fallback rules resolved them",
            self.shard,
            waiting.len(),
            counted(self.parked.len(), "pull", "parked"),
            counted(self.held.len(), "push", "held"),
            longest.join(", ")
        );
        let error =
            PolicyError::NoProgress { policy: self.supervisor.module().display_name().to_owned(), stuck };
        tracing::debug!(shard = self.shard, now_ns, %error, "policy stalled");
        self.stats.policy_failures += 1;
        self.last_failure = Some(error.to_string());
        sink.policy_failed(&error);
        let clocks = &self.clocks;
        self.parked.all_to_fallback(|w| clocks.get(w));
        let held: Vec<Held> = self.held.drain(..).collect();
        for h in held {
            self.unhold(h.push.id, now_ns);
            self.admit(h, None, sink);
        }
        let recovery = self.supervisor.failed(EventKind::Stall, now_ns);
        self.recovered(recovery, false, now_ns, sink);
        self.release_ready(now_ns, sink);
    }

    /// Replaces the policy with `module` and `config`, handing over the old policy's state. The
    /// live workers' clocks are raised by `raise` (the cluster's [`levelling`]; [`Shard::levelling`]
    /// on a shard alone), so a policy with a tighter bound does not make the fast workers wait
    /// while a slow one replays the drift the outgoing policy allowed; aggregates of rounds now
    /// passed are applied. On error (the module refuses the state or its configuration, or fails
    /// to start) the old policy keeps running and nothing changes.
    pub fn swap_policy(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        raise: &[ClockRaise],
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), PolicyError> {
        // The incoming policy starts with the workers level (see `ShardView`), and its hand-over
        // already shows them so; the clocks move only if the swap succeeds.
        let workers = self.raised(raise);
        let start = self.supervisor.swap(module, config, workers.clone(), now_ns)?;
        self.swapped(module, raise, &workers, start, now_ns, sink);
        Ok(())
    }

    /// A cluster's committed swap ([`Op::Swap`]): [`swap_policy`](Self::swap_policy), and if the
    /// new module refuses the hand-over now (it took it at the swap's preparation, see
    /// [`check_swap`](Self::check_swap), but the state has moved since), it starts afresh from its
    /// configuration instead, as on a new shard: every shard of a committed swap runs the module
    /// the cluster records. Only a module that cannot start at all leaves the old one running.
    /// `swap` is the cluster's number of the swap ([`Shard::swap`]).
    pub fn commit_swap(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        raise: &[ClockRaise],
        swap: u64,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), PolicyError> {
        // Already running it (a shard created with the module after the swap, or restored
        // from a snapshot that kept no swap number): only the swap's number is taken. So a
        // swap to the very module and configuration that run changes nothing else.
        let running = self.policy().sha256() == module.sha256() && self.policy_config() == config;
        let done = match running {
            true => Ok(()),
            false => self.commit_or_start(module, config, raise, now_ns, sink),
        };
        if done.is_ok() {
            self.swap = (swap, raise.to_vec());
        }
        done
    }

    fn commit_or_start(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        raise: &[ClockRaise],
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), PolicyError> {
        match self.swap_policy(module, config, raise, now_ns, sink) {
            Err(refused @ PolicyError::Refused { .. }) => {
                let workers = self.raised(raise);
                let start = self.supervisor.swap_fresh(module, config, workers.clone(), now_ns)?;
                tracing::warn!(
                    shard = self.shard,
                    "{refused}; it starts afresh from its configuration, without the old policy's state"
                );
                self.swapped(module, raise, &workers, start, now_ns, sink);
                Ok(())
            }
            other => other,
        }
    }

    /// What follows a new policy's start in a swap: its clocks raised, its start-up decisions
    /// applied, every pending request handed to it.
    fn swapped(
        &mut self,
        module: &PolicyModule,
        raise: &[ClockRaise],
        workers: &[WorkerClock],
        start: Vec<u8>,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) {
        self.policy_started(StartKind::Swap, now_ns, &start, workers, sink);
        self.stats.swaps += 1;
        self.timers.clear();
        self.local.reset(self.params.len());
        self.stats.clocks_rebased += u64::from(self.clocks.raise(raise.iter().map(|r| (r.worker, r.by))));
        self.floor = self.floor.max(self.clocks.view().min_clock);
        self.complete_aggregates(sink);
        tracing::info!(shard = self.shard, policy = module.display_name(), "policy swapped");
        if let Err(e) = self.apply_start(&start, now_ns, sink) {
            self.fail(e, EventKind::Start, now_ns, sink);
        }
        self.requeue_pending(now_ns);
        self.drain(now_ns, sink);
    }

    /// Whether [`swap_policy`](Self::swap_policy) to `module` with `config` would succeed now:
    /// the new policy is created from the running one's state, as the swap would, and thrown
    /// away. A cluster's swap tries this on every shard before any commits (its preparation),
    /// so a module that refuses the hand-over is refused everywhere and changes nothing.
    pub fn check_swap(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        raise: &[ClockRaise],
        now_ns: u64,
    ) -> Result<(), PolicyError> {
        let workers = self.raised(raise);
        self.supervisor.try_swap(module, config, workers, now_ns)
    }

    /// The live workers with their clocks raised by `raise`.
    fn raised(&self, raise: &[ClockRaise]) -> Vec<WorkerClock> {
        let by =
            |w: WorkerId| raise.iter().filter(|r| r.worker == w).fold(0u64, |n, r| n.saturating_add(r.by));
        self.clocks
            .workers()
            .map(|w| WorkerClock { clock: w.clock.saturating_add(by(w.worker)), ..w })
            .collect()
    }

    fn policy_started(
        &self,
        kind: StartKind,
        now_ns: u64,
        decisions: &[u8],
        workers: &[WorkerClock],
        sink: &mut dyn ShardSink,
    ) {
        sink.policy_started(&PolicyStart {
            kind,
            module: self.supervisor.module(),
            config: self.supervisor.config(),
            shard: self.shard,
            shards: self.supervisor.shards(),
            now_ns,
            decisions,
            workers,
        });
    }

    fn id(&mut self) -> RequestId {
        self.next_id += 1;
        self.next_id
    }

    /// Handles one event, then whatever it queued.
    fn run(&mut self, event: Event, view: ShardView, now_ns: u64, sink: &mut dyn ShardSink) {
        self.now_ns = self.now_ns.max(now_ns);
        self.dispatch(event, view, true, now_ns, sink);
        self.drain(now_ns, sink);
    }

    fn drain(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        while let Some(p) = self.queue.pop_front() {
            let view = self.clocks.view();
            match p {
                Pending::Pull(mut parked) => {
                    parked.pull.clock = self.clocks.get(parked.pull.worker).unwrap_or(parked.pull.clock);
                    let pull = parked.pull;
                    self.undecided_pull = Some(parked);
                    self.dispatch(Event::Pull(pull), view, false, now_ns, sink);
                }
                Pending::Push(mut held) => {
                    held.push.clock = self.clocks.get(held.push.worker).unwrap_or(held.push.clock);
                    let push = held.push;
                    self.incoming = Some(held);
                    self.dispatch(Event::Push(push), view, false, now_ns, sink);
                }
            }
        }
    }

    /// Asks the policy about one event and applies its answer. `fresh` is false for requests
    /// handed over again after a recovery or a swap.
    fn dispatch(
        &mut self,
        event: Event,
        view: ShardView,
        fresh: bool,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) {
        let env = Envelope { now_ns, random: self.rng.next_u64(), view, event };
        let kind = EventKind::of(&event);
        let called = match self.supervisor.call(&env) {
            None => None,
            Some(Ok(bytes)) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(bytes);
                sink.policy_called(&env, Ok(&self.scratch));
                Some(Ok(()))
            }
            Some(Err(e)) => {
                sink.policy_called(&env, Err(&e));
                Some(Err(e))
            }
        };
        match called {
            None => self.fallback(now_ns, sink),
            Some(Err(e)) => self.fail(e, kind, now_ns, sink),
            Some(Ok(())) => {
                let bytes = std::mem::take(&mut self.scratch);
                let applied = self.apply(&bytes, &event, now_ns, sink);
                self.scratch = bytes;
                let result = applied.map_err(|detail| PolicyError::BadDecision {
                    policy: self.supervisor.module().display_name().to_owned(),
                    event: crate::runtime::describe_event(&env),
                    detail,
                });
                // A success clears only its own kind's failure count: a module that fails on
                // every push must not be kept alive by the pulls, reports and timers in between.
                match result.and_then(|()| self.supervisor.succeeded(kind, fresh, &self.clocks)) {
                    Ok(()) => self.answer_measures(fresh, now_ns, sink),
                    Err(e) => {
                        // The instance that asked is gone: its questions go unanswered.
                        self.answers = Answers::default();
                        self.fail(e, kind, now_ns, sink)
                    }
                }
            }
        }
        self.release_ready(now_ns, sink);
    }

    /// Sends the answers to the measures the event just decided asked for, in order, before any
    /// other event; the first answer's call is charged the fuel they cost. (Answers ask for no
    /// more measures: the decision rules refuse it.)
    fn answer_measures(&mut self, fresh: bool, now_ns: u64, sink: &mut dyn ShardSink) {
        if self.answers.queue.is_empty() {
            return;
        }
        let read = std::mem::take(&mut self.answers.read);
        self.supervisor.charge(read.div_ceil(crate::runtime::MEASURE_VALUES_PER_FUEL));
        while let Some((query, value)) = self.answers.queue.pop_front() {
            let view = self.clocks.view();
            self.dispatch(Event::Measured { query, value }, view, fresh, now_ns, sink);
        }
    }

    /// Computes a measure of this shard's tensors for the policy (see [`measure`]).
    fn measure(&self, m: syncopate_policy_sdk::abi::Measure) -> measure::Measured {
        // A group of gradients, or else of pseudo-gradients.
        fn mean(a: &Aggregate) -> Option<Scaled<'_>> {
            Scaled::mean(&a.sum, a.weight).or_else(|| Scaled::mean(&a.outer_sum, a.outer_weight))
        }
        measure::evaluate(m, |t| match t {
            Tensor::Push(id) => match &self.incoming {
                Some(h) if h.push.id == id => Some(Scaled::plain(&h.grad)),
                _ => self.held.iter().find(|h| h.push.id == id).map(|h| Scaled::plain(&h.grad)),
            },
            Tensor::Params => Some(Scaled::plain(&self.params)),
            Tensor::Group(g) => self.groups.get(&g).and_then(mean),
            Tensor::Round(r) => self.aggregates.get(&r).and_then(mean),
        })
    }

    /// Applies one event's decisions. Each decision is checked against the decision rules
    /// ([`syncopate_policy_sdk::rules`], shared with the SDK's test driver) before it takes
    /// effect, so on the first nonsense one the shard is still consistent.
    fn apply(
        &mut self,
        mut bytes: &[u8],
        event: &Event,
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), String> {
        let mut rules = EventRules::new(event);
        while !bytes.is_empty() {
            let (decision, rest) = postcard::take_from_bytes::<Decision<'_>>(bytes)
                .map_err(|e| format!("undecodable decision: {e}"))?;
            bytes = rest;
            let verdict = rules.check(&decision, &*self)?;
            self.apply_one(decision, verdict, now_ns, sink);
        }
        rules.finish()
    }

    /// Carries out one decision that [`EventRules::check`] has passed; `verdict`: it is the
    /// event's verdict on its own request.
    fn apply_one(&mut self, d: Decision<'_>, verdict: bool, now_ns: u64, sink: &mut dyn ShardSink) {
        match d {
            Decision::ServePull { .. } => {
                if let Some(p) = self.undecided_pull.take() {
                    self.serve(p, now_ns, sink);
                }
            }
            Decision::DeferPull { until, .. } => {
                if let Some(mut p) = self.undecided_pull.take() {
                    p.until = until;
                    p.since_ns = now_ns;
                    self.stats.pulls_deferred += 1;
                    self.parked.push(p);
                    self.arm_stall_check(now_ns);
                }
            }
            Decision::ReleasePull { pull } => {
                if let Some(p) = self.parked.take(pull) {
                    self.serve(p, now_ns, sink);
                }
            }
            Decision::AdmitPush { push, weight } => {
                match self.decided_push(push, verdict, now_ns) {
                    // Weight 0 is a drop: no optimizer step (momentum and decay would move
                    // the parameters even for a zero gradient).
                    Some(held) if weight == Some(0.0) => self.drop_push(held, sink),
                    Some(held) => self.admit(held, weight, sink),
                    None => {}
                }
            }
            Decision::DropPush { push } => {
                if let Some(held) = self.decided_push(push, verdict, now_ns) {
                    self.drop_push(held, sink);
                }
            }
            Decision::AdmitToGroup { push, group, weight } => {
                if let Some(held) = self.decided_push(push, verdict, now_ns) {
                    self.admit_to_group(held, group, weight.unwrap_or(1.0), sink);
                }
            }
            Decision::CompleteGroup { group } => {
                if let Some(agg) = self.groups.remove(&group) {
                    // One step on the group's weighted mean.
                    self.apply_aggregate(agg, true, sink);
                }
            }
            Decision::CompleteAggregate { clock } => {
                if self.mode == UpdateMode::Aggregate {
                    if let Some(agg) = self.aggregates.remove(&clock) {
                        // The weighted mean of the contributions present, scaled in the step.
                        self.stats.aggregates_completed_early += 1;
                        self.apply_aggregate(agg, true, sink);
                    }
                }
            }
            Decision::HoldPush { .. } => {
                if let Some(h) = self.incoming.take() {
                    self.stats.pushes_held += 1;
                    let held = &self.held;
                    self.held_at.retain(|(id, _)| held.iter().any(|h| h.push.id == *id));
                    self.held_at.push((h.push.id, now_ns));
                    self.held.push(h);
                    self.arm_stall_check(now_ns);
                }
            }
            Decision::SetUpdateMode(mode) => self.set_mode(mode, sink),
            Decision::SetLocalSteps { worker, steps } => self.local.set_steps(worker, steps),
            Decision::SetOuterOptimizer { lr, momentum, nesterov } => {
                self.local.set_outer(lr, momentum, nesterov, self.params.len())
            }
            Decision::SetOuterDelay { period } => self.local.set_delay(period, self.params.len()),
            Decision::SetPullCodec { codec } => self.pull_codec = codec,
            Decision::Control { worker, control: control @ Control::MoveTasks { from, .. } } => {
                // The owner is asked first; it hands over what it has not started.
                let ask =
                    ControlMessage { yield_to: Some(worker), ..ControlMessage::plain(self.shard, control) };
                sink.control(from, ask);
            }
            Decision::Control { worker, control } => {
                sink.control(worker, ControlMessage::plain(self.shard, control))
            }
            Decision::SetTimer { timer, after_ns } => {
                let due = now_ns.saturating_add(after_ns);
                match self.timers.iter_mut().find(|t| t.0 == timer) {
                    Some(t) => t.1 = due,
                    None => self.timers.push((timer, due)),
                }
            }
            Decision::CancelTimer { timer } => self.timers.retain(|t| t.0 != timer),
            Decision::Metric { name, value } => {
                self.record_metric(name, value);
                sink.metric(name, value);
            }
            Decision::Measure { query, measure } => {
                let answer = self.measure(measure);
                self.answers.queue.push_back((query, answer.value));
                self.answers.read += answer.read as u64;
            }
        }
    }

    /// The push a verdict (`verdict`: this event's own) or a later decision on held push `push`
    /// decides, taken out of where it waits.
    fn decided_push(&mut self, push: RequestId, verdict: bool, now_ns: u64) -> Option<Held> {
        let h = if verdict {
            self.incoming.take()
        } else {
            self.held.iter().position(|h| h.push.id == push).map(|pos| self.held.remove(pos))
        };
        if let Some(h) = &h {
            self.unhold(h.push.id, now_ns);
        }
        h
    }

    /// Ends push `id`'s hold at `now_ns`, if it was held: its time counts in
    /// [`Shard::held_ns`].
    fn unhold(&mut self, id: RequestId, now_ns: u64) {
        if let Some(pos) = self.held_at.iter().position(|a| a.0 == id) {
            let (_, since) = self.held_at.swap_remove(pos);
            self.held_ns = self.held_ns.saturating_add(now_ns.saturating_sub(since));
        }
    }

    /// Keeps a policy's metric sample (allocates only for a name not seen before).
    fn record_metric(&mut self, name: &str, value: f64) {
        if let Some(m) = self.metrics.iter_mut().find(|m| m.name == name) {
            m.last = value;
            m.count += 1;
            m.sum += value;
        } else if self.metrics.len() < MAX_METRICS {
            self.metrics.push(Metric { name: name.to_owned(), last: value, count: 1, sum: value });
        }
    }

    fn apply_start(
        &mut self,
        bytes: &[u8],
        now_ns: u64,
        sink: &mut dyn ShardSink,
    ) -> Result<(), PolicyError> {
        let mut rest = bytes;
        let mut rules = EventRules::without_event();
        while !rest.is_empty() {
            let policy = self.supervisor.module().display_name().to_owned();
            let bad = |detail: String| PolicyError::BadDecision { policy, event: "start-up".into(), detail };
            let (d, r) = match postcard::take_from_bytes::<Decision<'_>>(rest) {
                Ok(x) => x,
                Err(e) => return Err(bad(format!("undecodable decision: {e}"))),
            };
            rest = r;
            if let Err(detail) = rules.check(&d, &*self) {
                return Err(bad(detail));
            }
            self.apply_one(d, false, now_ns, sink);
        }
        Ok(())
    }

    /// A policy call failed: report it, resolve the event's request by the fallback rules, and
    /// restart, back off or quarantine the policy.
    fn fail(&mut self, error: PolicyError, kind: EventKind, now_ns: u64, sink: &mut dyn ShardSink) {
        self.stats.policy_failures += 1;
        tracing::debug!(shard = self.shard, %error, "policy failure");
        self.last_failure = Some(error.to_string());
        sink.policy_failed(&error);
        self.fallback(now_ns, sink);
        let recovery = self.supervisor.failed(kind, now_ns);
        self.recovered(recovery, true, now_ns, sink);
    }

    /// Carries out what the supervisor decided after a failure: a restarted policy is handed
    /// every pending request again (with `requeue`); a policy backing off or quarantined leaves
    /// them to the fallback rules (explicitly parked pulls put under BSP's rule, held pushes
    /// admitted), for a while or until a swap.
    fn recovered(&mut self, recovery: Recovery, requeue: bool, now_ns: u64, sink: &mut dyn ShardSink) {
        match recovery {
            Recovery::Restarted => {
                self.policy_started(StartKind::Restart, now_ns, &[], &[], sink);
                if requeue {
                    self.requeue_pending(now_ns);
                }
            }
            Recovery::BackingOff { until } => {
                tracing::debug!(
                    shard = self.shard,
                    policy = self.supervisor.module().display_name(),
                    backoff_ms = until.saturating_sub(now_ns) / 1_000_000,
                    "policy failing repeatedly; fallback rules in force until it restarts"
                );
                self.leave_to_fallback(now_ns, sink);
            }
            Recovery::Quarantined(cause) => {
                if let Some(e) = cause {
                    sink.policy_failed(&e);
                }
                let policy = self.supervisor.module().display_name();
                tracing::debug!(
                    shard = self.shard,
                    policy,
                    "policy quarantined; fallback rules in force until a swap"
                );
                sink.policy_quarantined(policy);
                self.leave_to_fallback(now_ns, sink);
            }
        }
    }

    /// No policy runs: nobody will release explicitly parked pulls (they go under BSP's rule)
    /// or decide held pushes (admitted). Requests still queued for re-delivery meet the
    /// fallback rules in `dispatch`.
    fn leave_to_fallback(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        self.parked.explicit_to_fallback();
        let held: Vec<Held> = self.held.drain(..).collect();
        for h in held {
            self.unhold(h.push.id, now_ns);
            self.admit(h, None, sink);
        }
    }

    /// Resolves the current event's request without the policy: admit a push; park a pull
    /// under BSP's rule.
    fn fallback(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        if let Some(h) = self.incoming.take() {
            self.unhold(h.push.id, now_ns);
            self.admit(h, None, sink);
        }
        if let Some(mut p) = self.undecided_pull.take() {
            p.until = Release::MinClockAtLeast(p.pull.clock);
            p.since_ns = now_ns;
            self.parked.push(p);
        }
    }

    fn requeue_pending(&mut self, now_ns: u64) {
        self.queue.extend(self.parked.drain().map(Pending::Pull));
        // A held push handed back ends its hold here (a new one starts if it is held again,
        // as a pull deferred again waits afresh for the no-progress rule).
        let held = std::mem::take(&mut self.held);
        for h in &held {
            self.unhold(h.push.id, now_ns);
        }
        self.queue.extend(held.into_iter().map(Pending::Push));
    }

    fn serve(&mut self, p: Parked, now_ns: u64, sink: &mut dyn ShardSink) {
        let waited_ns = if p.until == Release::Explicit && p.since_ns == now_ns {
            0
        } else {
            now_ns.saturating_sub(p.since_ns)
        };
        self.stats.pulls_served += 1;
        self.stats.deferred_ns += waited_ns;
        let min_applied = self.min_applied();
        if let Some(w) = self.waited.get_mut(p.pull.worker as usize) {
            *w += waited_ns;
        }
        sink.pull_served(PullReply {
            id: p.pull.id,
            worker: p.pull.worker,
            iteration: p.pull.iteration,
            clock: self.clocks.get(p.pull.worker).unwrap_or(p.pull.clock),
            version: self.version,
            min_applied,
            waited_ns,
            local_steps: self.local.steps_of(p.pull.worker),
            codec: self.pull_codec,
            values: &self.params,
        });
    }

    fn admit(&mut self, h: Held, weight: Option<f32>, sink: &mut dyn ShardSink) {
        let Held { push, grad, based_on, local_steps } = h;
        self.count_staleness(based_on);
        let round = self.clocks.get(push.worker).unwrap_or(push.clock);
        let weight = weight.unwrap_or_else(|| match self.push_weight {
            PushWeight::Mean => 1.0 / self.round_size(round) as f32,
            PushWeight::Sum => 1.0,
        });
        self.clocks.tick(push.worker);
        self.stats.pushes_admitted += 1;
        let outer = local_steps > 0;
        self.stats.local_pushes += u64::from(outer);
        match self.mode {
            UpdateMode::OnArrival => {
                let params = unshare(&mut self.params, sink);
                match outer {
                    true => self.local.step(params, &grad, weight),
                    false => self.optimizer.step(params, &grad, weight),
                }
                self.version += 1;
                self.stats.steps += 1;
                self.bump_applied(push.worker);
            }
            UpdateMode::Aggregate => {
                let c = Contribution { grad: &grad, weight, worker: push.worker, outer };
                contribute(&mut self.aggregates, round, &mut self.spare_sums, c);
                self.complete_aggregates(sink);
            }
        }
        sink.recycle(grad);
        self.acked_here(push.worker, push.iteration);
        sink.push_acked(push.id, push.worker, push.iteration);
    }

    /// Admits a push into the policy's group `group` at `weight`, whatever its worker's clock:
    /// acknowledged, the clock ticks, and the gradient waits in the group for its step
    /// ([`Decision::CompleteGroup`]).
    fn admit_to_group(&mut self, h: Held, group: u64, weight: f32, sink: &mut dyn ShardSink) {
        let Held { push, grad, based_on, local_steps } = h;
        self.count_staleness(based_on);
        self.clocks.tick(push.worker);
        self.stats.pushes_admitted += 1;
        let outer = local_steps > 0;
        self.stats.local_pushes += u64::from(outer);
        let c = Contribution { grad: &grad, weight, worker: push.worker, outer };
        contribute(&mut self.groups, group, &mut self.spare_sums, c);
        self.complete_aggregates(sink);
        sink.recycle(grad);
        self.acked_here(push.worker, push.iteration);
        sink.push_acked(push.id, push.worker, push.iteration);
    }

    /// Counts an admitted push's staleness (the steps since the version it was computed from).
    fn count_staleness(&mut self, based_on: Option<u64>) {
        if let Some(base) = based_on {
            let staleness = self.version.saturating_sub(base) as usize;
            self.stats.staleness[staleness.min(STALENESS_BUCKETS - 1)] += 1;
        }
    }

    /// The workers a mean push of `round` is averaged over: the live ones and, in aggregate
    /// mode, those that contributed to the round's aggregate and have left since (a worker that
    /// finished says goodbye before a straggler's last push; that push must not count for three).
    fn round_size(&self, round: u64) -> u32 {
        let gone = match (self.mode, self.aggregates.get(&round)) {
            (UpdateMode::Aggregate, Some(agg)) => agg.departed,
            _ => 0,
        };
        (self.clocks.view().workers + gone).max(1)
    }

    /// Counts again, in every open aggregate, the contributors that are not live (after a
    /// worker joined or left: rare, unlike pushes).
    fn recount_departed(&mut self) {
        for agg in self.aggregates.values_mut() {
            agg.departed = agg.count_departed(&self.clocks);
        }
    }

    /// Discards a push its policy dropped: the worker's clock advances and it is acknowledged;
    /// the gradient reaches nothing and counts in no step or staleness figure.
    fn drop_push(&mut self, h: Held, sink: &mut dyn ShardSink) {
        let Held { push, grad, .. } = h;
        self.clocks.tick(push.worker);
        self.stats.pushes_dropped += 1;
        sink.recycle(grad);
        self.complete_aggregates(sink);
        self.acked_here(push.worker, push.iteration);
        sink.push_dropped(push.id, push.worker, push.iteration);
    }

    /// Applies, in round order, every aggregate whose round all live workers have passed
    /// (`round < min_clock`), whatever mode their pushes arrived in.
    fn complete_aggregates(&mut self, sink: &mut dyn ShardSink) {
        // With no live worker left, nobody can add to a round: every one is complete (its
        // pushes were acknowledged when they were counted).
        let view = self.clocks.view();
        let min_clock = if view.workers == 0 { u64::MAX } else { view.min_clock };
        while let Some(entry) = self.aggregates.first_entry() {
            if *entry.key() >= min_clock {
                break;
            }
            let agg = entry.remove();
            self.apply_aggregate(agg, false, sink);
        }
    }

    /// One more of `worker`'s iterations is in the parameters.
    fn bump_applied(&mut self, worker: WorkerId) {
        let Some(a) = self.applied.get_mut(worker as usize) else { return };
        if let Some((min, at_min)) = &mut self.applied_min {
            if *a == *min && self.clocks.is_live(worker) {
                *at_min -= 1;
                if *at_min == 0 {
                    self.applied_min = None;
                }
            }
        }
        *a += 1;
    }

    /// The fewest iterations of any live worker that the parameters include.
    fn min_applied(&mut self) -> u64 {
        if self.applied_min.is_none() {
            let applied = &self.applied;
            let min = self.clocks.workers().map(|w| applied[w.worker as usize]).min();
            self.applied_min =
                min.map(|m| (m, self.clocks.workers().filter(|w| applied[w.worker as usize] == m).count()));
        }
        self.applied_min.map_or(0, |m| m.0)
    }

    /// One step on an aggregate: its gradients' sum by the optimizer, its pseudo-gradients'
    /// by the outer optimizer (each part only if it has a contribution), each sum as it stands
    /// or, with `mean`, divided by its weights.
    fn apply_aggregate(&mut self, agg: Aggregate, mean: bool, sink: &mut dyn ShardSink) {
        let scale = |w: f32| if mean { 1.0 / w.max(f32::MIN_POSITIVE) } else { 1.0 };
        if !agg.sum.is_empty() {
            self.optimizer.step(unshare(&mut self.params, sink), &agg.sum, scale(agg.weight));
        }
        if !agg.outer_sum.is_empty() {
            let params = unshare(&mut self.params, sink);
            self.local.step(params, &agg.outer_sum, scale(agg.outer_weight));
        }
        for sum in [agg.sum, agg.outer_sum] {
            if self.spare_sums.len() < 4 && !sum.is_empty() {
                self.spare_sums.push(sum);
            }
        }
        self.version += 1;
        self.stats.steps += 1;
        for &w in &agg.contributors {
            self.bump_applied(w);
        }
    }

    fn set_mode(&mut self, mode: UpdateMode, sink: &mut dyn ShardSink) {
        if self.mode == UpdateMode::Aggregate && mode == UpdateMode::OnArrival {
            // Partial aggregates are applied as they stand: each push keeps the weight it had.
            while let Some((_, agg)) = self.aggregates.pop_first() {
                self.apply_aggregate(agg, false, sink);
            }
        }
        self.mode = mode;
    }

    fn release_ready(&mut self, now_ns: u64, sink: &mut dyn ShardSink) {
        let view = self.clocks.view();
        if !self.parked.may_be_due(view) {
            return;
        }
        let mut scan = Scan::new();
        while let Some(p) = self.parked.next_due(view, &mut scan) {
            self.serve(p, now_ns, sink);
        }
    }
}

/// "1 pull parked", "2 pushes held".
fn counted(n: usize, what: &str, how: &str) -> String {
    let plural = if n == 1 {
        ""
    } else if what.ends_with('h') {
        "es"
    } else {
        "s"
    };
    format!("{n} {what}{plural} {how}")
}

/// Whether every value is finite. The check runs on every push, over every parameter: blocks
/// without an early exit inside let the compiler vectorize it (a short-circuiting `all` is a
/// scalar loop, several times slower on large tensors).
fn all_finite(values: &[f32]) -> bool {
    const EXPONENT: u32 = 0x7f80_0000;
    values.chunks(256).all(|block| {
        block.iter().fold(0u32, |bad, v| bad | u32::from(v.to_bits() & EXPONENT == EXPONENT)) == 0
    })
}

/// One push's part in an aggregate.
struct Contribution<'a> {
    grad: &'a [f32],
    weight: f32,
    worker: WorkerId,
    /// A pseudo-gradient (for the outer optimizer), not a gradient.
    outer: bool,
}

/// Adds `weight * grad` from `worker` to the aggregate `key` of `open` (a round's, or a
/// policy's group), to its gradients' sum or its pseudo-gradients', started from a spare buffer
/// if it is new.
fn contribute(open: &mut BTreeMap<u64, Aggregate>, key: u64, spare: &mut Vec<Vec<f32>>, c: Contribution<'_>) {
    let len = c.grad.len();
    let mut zeroed = || {
        let mut sum = spare.pop().unwrap_or_default();
        sum.clear();
        sum.resize(len, 0.0);
        sum
    };
    let agg = open.entry(key).or_insert_with(|| Aggregate {
        sum: Vec::new(),
        weight: 0.0,
        outer_sum: Vec::new(),
        outer_weight: 0.0,
        contributors: Vec::new(),
        departed: 0,
    });
    let (sum, weight) =
        if c.outer { (&mut agg.outer_sum, &mut agg.outer_weight) } else { (&mut agg.sum, &mut agg.weight) };
    if sum.is_empty() {
        *sum = zeroed();
    }
    for (s, g) in sum.iter_mut().zip(c.grad) {
        *s += c.weight * g;
    }
    *weight += c.weight;
    agg.contributors.push(c.worker);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps every served pull's parameters, as the server does while QUIC sends them.
    #[derive(Default)]
    struct Keep {
        pulls: Vec<Arc<Vec<f32>>>,
        buffers_given: usize,
    }

    impl ShardSink for Keep {
        fn pull_served(&mut self, r: PullReply<'_>) {
            self.pulls.push(Arc::clone(r.values));
        }
    }

    impl Observer for Keep {
        fn buffer(&mut self, len: usize) -> Vec<f32> {
            self.buffers_given += 1;
            vec![0.0; len]
        }
    }

    /// ABI v2: a push carries its staleness (steps since the pull it was computed from was
    /// served) and the shard's version; a pull carries the version it would see.
    #[test]
    fn pushes_carry_their_staleness_and_pulls_the_version_they_see() {
        #[derive(Default)]
        struct Seen(Vec<Event>);
        impl ShardSink for Seen {
            fn pull_served(&mut self, _r: PullReply<'_>) {}
        }
        impl Observer for Seen {
            fn policy_called(&mut self, env: &Envelope, _answer: Result<&[u8], &PolicyError>) {
                self.0.push(env.event);
            }
        }
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let asp = rt.compile("asp", crate::builtin::wasm("asp").unwrap()).unwrap();
        let mut sink = Seen::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 2], &asp, &[], &mut sink).unwrap();
        for w in 0..2 {
            shard.join(w, 0, &mut sink).unwrap();
        }
        let push = |worker, iteration, based_on| PushRequest {
            worker,
            iteration,
            samples: 1,
            grad: vec![1.0; 2],
            based_on: Some(based_on),
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        shard.pull(PullRequest { worker: 0, iteration: 0 }, 0, &mut sink).unwrap();
        for i in 0..3 {
            shard.push(push(1, i, i), 1, &mut sink).unwrap();
        }
        shard.push(push(0, 0, 0), 2, &mut sink).unwrap();
        shard.pull(PullRequest { worker: 0, iteration: 1 }, 3, &mut sink).unwrap();
        let pushes: Vec<(WorkerId, u64, u64)> = sink
            .0
            .iter()
            .filter_map(
                |e| if let Event::Push(p) = e { Some((p.worker, p.staleness, p.version)) } else { None },
            )
            .collect();
        assert_eq!(
            pushes,
            vec![(1, 0, 0), (1, 0, 1), (1, 0, 2), (0, 3, 3)],
            "worker 0's push is 3 steps stale"
        );
        let pulls: Vec<u64> = sink
            .0
            .iter()
            .filter_map(|e| if let Event::Pull(p) = e { Some(p.version) } else { None })
            .collect();
        assert_eq!(pulls, vec![0, 4]);
    }

    /// Seed 83330 of the fault search: a refused push that skipped iterations ended the
    /// worker's pull as far as the shard could tell, so its later notice that the pull waited
    /// on another shard was void, no shard saw every worker waiting, and a rule that parked
    /// pulls on the other shards stalled the run to its end.
    #[test]
    fn a_refused_or_impossible_request_does_not_void_a_notice_that_a_worker_waits_elsewhere() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let asp = rt.compile("asp", crate::builtin::wasm("asp").unwrap()).unwrap();
        let mut sink = Keep::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 2], &asp, &[], &mut sink).unwrap();
        shard.join(0, 0, &mut sink).unwrap();
        let push = |iteration| PushRequest {
            worker: 0,
            iteration,
            samples: 1,
            grad: vec![1.0; 2],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        shard.pull(PullRequest { worker: 0, iteration: 0 }, 0, &mut sink).unwrap();
        shard.push(push(0), 1, &mut sink).unwrap();
        let report = IterationReport { worker: 0, iteration: 0, compute_ns: 1, samples: 1 };
        shard.iteration_finished(report, 1, &mut sink).unwrap();
        shard.pull(PullRequest { worker: 0, iteration: 1 }, 2, &mut sink).unwrap();
        assert_eq!(shard.elsewhere.since(0), None, "it waits on nothing elsewhere");
        match shard.push(push(5), 3, &mut sink) {
            Err(ShardError::OutOfOrder { iteration: 5, expected: 1, .. }) => {}
            other => panic!("a push that skips iterations was taken: {other:?}"),
        }
        shard.pull(PullRequest { worker: 0, iteration: 9 }, 4, &mut sink).unwrap();
        shard.pull_waiting(0, 1, true, 5).unwrap();
        assert_eq!(shard.elsewhere.since(0), Some(5), "its pull of iteration 1 still waits elsewhere");
        shard.push(push(1), 6, &mut sink).unwrap();
        let report = IterationReport { worker: 0, iteration: 1, compute_ns: 1, samples: 1 };
        shard.iteration_finished(report, 6, &mut sink).unwrap();
        assert_eq!(shard.elsewhere.since(0), None, "its push of iteration 1 ended the wait");
        shard.pull_waiting(0, 1, true, 7).unwrap();
        assert_eq!(shard.elsewhere.since(0), None, "a late notice after the push is void");
    }

    /// Seed 220839 of the fault search: a bad push (a NaN) of an iteration that a promoted
    /// backup held for its policy was taken as the worker's retry of its held push (a
    /// duplicate), so it took the place of the push's acknowledgement and the worker's own
    /// retry was refused. A gradient that is not finite is refused as such first.
    #[test]
    fn a_push_that_is_not_finite_is_refused_as_such_even_for_an_iteration_the_shard_has() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let asp = rt.compile("asp", crate::builtin::wasm("asp").unwrap()).unwrap();
        let mut sink = Keep::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 2], &asp, &[], &mut sink).unwrap();
        shard.join(0, 0, &mut sink).unwrap();
        let push = |grad: Vec<f32>| PushRequest {
            worker: 0,
            iteration: 0,
            samples: 1,
            grad,
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        shard.push(push(vec![1.0; 2]), 1, &mut sink).unwrap();
        match shard.push(push(vec![f32::NAN, 1.0]), 2, &mut sink) {
            Err(ShardError::NonFinite(0, 0)) => {}
            other => panic!("a NaN push of an iteration the shard has: {other:?}"),
        }
        match shard.push(push(vec![1.0; 2]), 3, &mut sink) {
            Err(ShardError::Duplicate { worker: 0, iteration: 0, expected: 1 }) => {}
            other => panic!("a retry of an iteration the shard has: {other:?}"),
        }
        // A v3 module's check is the sum of squares: infinity is refused, the largest finite
        // values are not (their squares fit an f64), and the norm is theirs.
        let next = |grad: Vec<f32>| PushRequest { iteration: 1, ..push(grad) };
        match shard.push(next(vec![f32::INFINITY, 1.0]), 4, &mut sink) {
            Err(ShardError::NonFinite(0, 1)) => {}
            other => panic!("an infinite push: {other:?}"),
        }
        assert!(shard.push(next(vec![f32::MAX, -f32::MAX]), 5, &mut sink).is_ok());
    }

    #[test]
    fn a_join_past_max_workers_is_refused_and_changes_nothing() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let bsp = rt.compile("bsp", crate::builtin::wasm("bsp").unwrap()).unwrap();
        let mut sink = Keep::default();
        let cfg = ShardConfig { max_workers: 4, ..ShardConfig::default() };
        let mut shard = Shard::new(cfg, vec![1.0; 8], &bsp, &[], &mut sink).unwrap();
        for w in [4, 4_000_000_000, WorkerId::MAX] {
            match shard.join(w, 0, &mut sink) {
                Err(ShardError::WorkerOutOfRange { worker, max: 4, .. }) => assert_eq!(worker, w),
                other => panic!("joined {w}: {other:?}"),
            }
        }
        assert_eq!(shard.next_push.len(), 0, "nothing was sized by the refused ids");
        assert_eq!(shard.join(3, 0, &mut sink).unwrap(), 0);
        assert_eq!(shard.next_push.len(), 4);
    }

    #[test]
    fn a_served_pull_keeps_what_it_was_served_while_the_shard_moves_on() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let asp = rt.compile("asp", crate::builtin::wasm("asp").unwrap()).unwrap();
        let optimizer = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let mut sink = Keep::default();
        let cfg = ShardConfig { optimizer, ..ShardConfig::default() };
        let mut shard = Shard::new(cfg, vec![1.0; 8], &asp, &[], &mut sink).unwrap();
        shard.join(0, 0, &mut sink).unwrap();
        let push = |iteration| PushRequest {
            worker: 0,
            iteration,
            samples: 1,
            grad: vec![0.5; 8],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        shard.pull(PullRequest { worker: 0, iteration: 0 }, 0, &mut sink).unwrap();
        assert!(Arc::ptr_eq(&sink.pulls[0], shard.shared_values()), "served without a copy");
        shard.push(push(0), 1, &mut sink).unwrap();
        assert_eq!(*sink.pulls[0], [1.0; 8], "the pull still holds what it was served");
        assert_eq!(shard.values(), [0.5; 8]);
        assert_eq!(sink.buffers_given, 1, "the step copied first, into the host's buffer");
        // Once nobody holds them, the parameters change in place.
        sink.pulls.clear();
        shard.push(push(1), 2, &mut sink).unwrap();
        assert_eq!(shard.values(), [0.0; 8]);
        assert_eq!(sink.buffers_given, 1);
    }

    /// A BSP round's pushes are acknowledged once counted in its aggregate. If the round's last
    /// contributor never pushes (its process died, and the servers made it leave) after the
    /// others have left, the round still happens: found by `syncopate simtest` (a worker death
    /// during the last round lost that round's acknowledged pushes).
    #[test]
    fn a_round_whose_missing_contributor_leaves_last_is_applied() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let bsp = rt.compile("bsp", crate::builtin::wasm("bsp").unwrap()).unwrap();
        let optimizer = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let mut sink = Keep::default();
        let cfg = ShardConfig { optimizer, push_weight: PushWeight::Sum, ..ShardConfig::default() };
        let mut shard = Shard::new(cfg, vec![0.0; 2], &bsp, &[], &mut sink).unwrap();
        shard.join(0, 0, &mut sink).unwrap();
        shard.join(1, 0, &mut sink).unwrap();
        let push = PushRequest {
            worker: 0,
            iteration: 0,
            samples: 1,
            grad: vec![1.0; 2],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        shard.push(push, 1, &mut sink).unwrap();
        assert_eq!(shard.values(), [0.0; 2], "the round waits for worker 1");
        shard.leave(0, LeaveReason::Finished, 2, &mut sink).unwrap();
        assert_eq!(shard.values(), [0.0; 2], "worker 1 may still push");
        shard.leave(1, LeaveReason::TimedOut, 3, &mut sink).unwrap();
        assert_eq!(shard.values(), [-1.0; 2], "worker 0's acknowledged push is applied");
        assert_eq!(shard.stats().steps, 1);
    }

    #[test]
    fn all_finite_finds_any_nan_or_infinity_anywhere() {
        let mut v = vec![1.0f32; 1000];
        v[3] = f32::MAX;
        v[4] = f32::MIN_POSITIVE / 2.0; // subnormal
        v[5] = -0.0;
        assert!(all_finite(&v));
        assert!(all_finite(&[]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            for at in [0, 255, 256, 999] {
                let mut w = v.clone();
                w[at] = bad;
                assert!(!all_finite(&w), "{bad} at {at}");
            }
        }
    }
}
