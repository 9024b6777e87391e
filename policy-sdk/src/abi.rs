//! Policy ABI v3: every type that crosses the boundary between the host and a policy module.
//!
//! This module is the single definition of the wire contract. The host encodes [`Envelope`]s and
//! decodes [`Decision`]s with these types; the guest glue does the reverse. Everything is encoded
//! with [postcard](https://docs.rs/postcard), which is positional: **a field list never changes
//! and enums only grow at the end**. A change that breaks either rule is a new ABI version, with a
//! new marker export.
//!
//! # The module contract
//! A policy module is a core wasm module that
//! - imports **nothing** (no WASI, no host functions: time and randomness arrive in events);
//! - exports its linear memory as `memory` and the marker function [`ABI_MARKER`];
//! - exports the functions named in [`exports`]. Functions that return data return an `i64` packing
//!   `(ptr << 32) | len` of a postcard value in guest memory, valid until the next call.
//!
//! | export | signature | input (in the buffer) | output |
//! |---|---|---|---|
//! | `sp_buffer` | `(len: i32) -> i32` | - | pointer to a guest buffer of at least `len` bytes |
//! | `sp_info` | `() -> i64` | - | [`PolicyInfo`] |
//! | `sp_init` | `(len: i32) -> i64` | [`InitArgs`] | `Result<(), String>` then the start-up [`Decision`]s |
//! | `sp_import_state` | `(len: i32) -> i64` | [`InitArgs`] + [`Handoff`] | `Result<(), String>` then [`Decision`]s |
//! | `sp_event` | `(len: i32) -> i64` | [`Envelope`] (fixed 128-byte record, not postcard; 88 bytes for a v2 module) | a run of [`Decision`]s |
//! | `sp_export_state` | `() -> i64` | - | opaque state bytes |
//! | `sp_last_panic` | `() -> i64` | - | UTF-8 panic message, empty if none |
//!
//! # Obligations the host checks
//! Every [`Event::Pull`] gets exactly one verdict ([`Decision::ServePull`] or
//! [`Decision::DeferPull`]) and every [`Event::Push`] exactly one ([`Decision::AdmitPush`] or
//! [`Decision::HoldPush`]); releases and admissions name requests that are actually parked or held;
//! workers named in decisions are live. A module that breaks these rules is treated like one that
//! traps: the host reports it and falls back (see the host's `shard` module).

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

pub use crate::codec::Codec;

/// The ABI version this crate speaks.
pub const ABI_VERSION: u32 = 3;

/// Name of the exported marker function that declares ABI v3 (v3 added training signals to
/// pushes, [`Signals`], and the host's measures, [`Decision::Measure`]). Modules built for
/// another version export `syncopate_abi_v<N>` instead; the host loads v2 modules as they were
/// (see [`ABI_MARKER_V2`]) and names any other version it found in its error.
pub const ABI_MARKER: &str = "syncopate_abi_v3";

/// The marker of ABI v2 modules (v2 added staleness and versions to pushes and pulls). The host
/// still loads them: it sends them the first [`ENVELOPE_LEN_V2`] bytes of each envelope, the
/// record they were built for, and they never send a decision v3 added.
pub const ABI_MARKER_V2: &str = "syncopate_abi_v2";

/// Prefix shared by the ABI marker exports of every version.
pub const ABI_MARKER_PREFIX: &str = "syncopate_abi_v";

/// Names of the functions (and memory) a policy module exports.
pub mod exports {
    /// The module's linear memory.
    pub const MEMORY: &str = "memory";
    /// `(len: i32) -> i32`: a guest buffer of at least `len` bytes for the next input.
    pub const BUFFER: &str = "sp_buffer";
    /// `() -> i64`: the policy's [`PolicyInfo`](super::PolicyInfo).
    pub const INFO: &str = "sp_info";
    /// `(len: i32) -> i64`: create the policy from [`InitArgs`](super::InitArgs).
    pub const INIT: &str = "sp_init";
    /// `(len: i32) -> i64`: create the policy from [`InitArgs`](super::InitArgs) and a
    /// [`Handoff`](super::Handoff) during a hot swap.
    pub const IMPORT_STATE: &str = "sp_import_state";
    /// `(len: i32) -> i64`: handle one [`Envelope`](super::Envelope).
    pub const EVENT: &str = "sp_event";
    /// `() -> i64`: the policy's state for a checkpoint or a hot swap.
    pub const EXPORT_STATE: &str = "sp_export_state";
    /// `() -> i64`: the message of the last panic, if the module panicked.
    pub const LAST_PANIC: &str = "sp_last_panic";
}

/// Identifies a worker in the cluster.
pub type WorkerId = u32;
/// Identifies one push or pull request on a shard; unique per shard.
pub type RequestId = u64;
/// A policy-chosen timer identifier.
pub type TimerId = u64;

/// Describes a policy module: what `syncopate policy check` prints. Authors build it with
/// [`PolicyInfo::new`](crate::abi::PolicyInfo::new) in [`Policy::INFO`](crate::Policy::INFO); the
/// host decodes the same bytes as [`ModuleInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PolicyInfo {
    /// Short name, e.g. `"ssp"`.
    pub name: &'static str,
    /// The policy's own version (semver by convention).
    pub version: &'static str,
    /// One line saying what the policy does.
    pub description: &'static str,
    /// The configuration parameters the policy accepts.
    pub params: &'static [ParamSpec],
}

/// One configuration parameter of a policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ParamSpec {
    /// Parameter name as written in a configuration (`s` in `ssp:s=3`).
    pub name: &'static str,
    /// The type its value must parse as.
    pub kind: ParamKind,
    /// Default value, written as it would be in a configuration.
    pub default: &'static str,
    /// What the parameter means.
    pub doc: &'static str,
}

/// [`PolicyInfo`] as the host decodes it: the same wire layout, owned.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModuleInfo {
    /// Short name.
    pub name: String,
    /// The policy's own version.
    pub version: String,
    /// One line saying what the policy does.
    pub description: String,
    /// The configuration parameters the policy accepts.
    pub params: Vec<ParamInfo>,
}

/// [`ParamSpec`] as the host decodes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Parameter name.
    pub name: String,
    /// The type its value must parse as.
    pub kind: ParamKind,
    /// Default value.
    pub default: String,
    /// What the parameter means.
    pub doc: String,
}

/// The type of a configuration parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamKind {
    /// A non-negative integer (`u64`).
    Uint,
    /// A floating-point number (`f64`).
    Float,
    /// `true` or `false`.
    Bool,
    /// Free text.
    Text,
}

impl ParamKind {
    /// A lower-case name for the kind, as shown to users.
    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Uint => "uint",
            ParamKind::Float => "float",
            ParamKind::Bool => "bool",
            ParamKind::Text => "text",
        }
    }
}

/// What a policy instance is created with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InitArgs<'a> {
    /// The shard this instance serves.
    pub shard: u32,
    /// How many shards the model is split into.
    pub shards: u32,
    /// Host time at creation: 0 when the shard starts, later for a hot swap or a restart.
    pub now_ns: u64,
    /// Configuration as `(name, value)` pairs, validated against [`PolicyInfo::params`].
    #[serde(borrow)]
    pub config: Vec<(&'a str, &'a str)>,
}

/// What an incoming policy receives during a hot swap.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Handoff<'a> {
    /// Name of the outgoing policy.
    pub from_name: &'a str,
    /// Version of the outgoing policy.
    pub from_version: &'a str,
    /// The outgoing policy's exported state (opaque; meaningful to a policy of the same name).
    pub state: &'a [u8],
    /// The live workers and their clocks at the moment of the swap.
    pub workers: Vec<WorkerClock>,
}

/// A worker and its clock on this shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerClock {
    /// The worker.
    pub worker: WorkerId,
    /// Its clock: the number of iterations it has pushed to this shard.
    pub clock: u64,
}

/// The shard's clocks as the host sees them when it sends an event.
///
/// `clock[w]` is the number of iterations worker `w` has pushed to this shard (admitted or
/// dropped pushes; held pushes do not count until decided), counted from the clock it joined
/// with. At a hot swap the host rebases the clocks: every live worker's clock is raised to the
/// largest (on a cluster, the largest as of the swap's preparation, each worker by the same
/// amount on every shard), so the incoming policy starts with the workers level instead of making
/// the fast ones wait while a slow one replays the outgoing policy's drift. Only live workers
/// count towards the minimum and the maximum; with no live worker both are 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardView {
    /// The smallest clock among live workers.
    pub min_clock: u64,
    /// The largest clock among live workers.
    pub max_clock: u64,
    /// How many workers are live.
    pub workers: u32,
}

/// One event, as the host sends it to a policy.
///
/// Unlike every other ABI type, an envelope is not postcard: it is the per-event input, so it
/// travels as a fixed [`ENVELOPE_LEN`]-byte little-endian record ([`Envelope::to_bytes`]), which
/// encodes and decodes in a few nanoseconds instead of ~90 ns through serde. Layout (offsets in
/// bytes): `0` now_ns u64, `8` random u64, `16` min_clock u64, `24` max_clock u64, `32` workers
/// u32, `36` kind u8, `37` sub u8, `38` two zero bytes, `40` a u64, `48` b u32, `52` c u32, `56` d
/// u64, `64` e u64, `72` f u64, `80` g u64, with per kind: `0` WorkerJoined {b: worker, a: clock};
/// `1` WorkerLeft {b: worker, sub: reason}; `2` Push {a: id, b: worker, c: samples, d: iteration,
/// e: clock, f: staleness, g: version}; `3` Pull {a: id, b: worker, d: iteration, e: clock,
/// f: version}; `4` IterationFinished {b: worker,
/// c: samples, d: iteration, e: compute_ns}; `5` Timer {a: timer}; `6` ControlApplied {b: worker,
/// d: iteration, sub: control kind (0 Pause {e: for_ns}, 1 Resume, 2 SetBatchSize {c: samples},
/// 3 SetTaskShare {c: tasks}, 4 MoveTasks {a: from, c: first, e: count; its iteration is d})};
/// `7` Measured {a: query, d: the value's f64 bits} (ABI v3). ABI v3 appends 40 bytes: `88` loss
/// f32 (NaN: none), `92` norm f32 (NaN: none), `96` tokens u64, `104` step_ns u64 (the push's
/// [`Signals`]; zero for other events), `112` 16 reserved zero bytes. A v2 module receives the
/// first [`ENVELOPE_LEN_V2`] bytes. Unused fields are zero.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Envelope {
    /// Host time in nanoseconds since the shard started (virtual time in the simulator).
    pub now_ns: u64,
    /// A fresh value from the host's seeded random source; the only randomness a policy has.
    pub random: u64,
    /// The shard's clocks before the event takes effect.
    pub view: ShardView,
    /// What happened.
    pub event: Event,
}

/// Something that happened on the shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Event {
    /// A worker joined; its clock starts at `clock`.
    WorkerJoined {
        /// The worker.
        worker: WorkerId,
        /// Its starting clock (the shard's minimum clock when it joined late).
        clock: u64,
    },
    /// A worker left or was dropped.
    WorkerLeft {
        /// The worker.
        worker: WorkerId,
        /// Why.
        reason: LeaveReason,
    },
    /// A gradient arrived. The policy answers with exactly one push verdict.
    Push(Push),
    /// A worker asked for the parameters. The policy answers with exactly one pull verdict.
    Pull(Pull),
    /// A worker reported that it finished computing an iteration.
    IterationFinished(IterationReport),
    /// A timer the policy set has fired.
    Timer {
        /// The policy's identifier for the timer.
        timer: TimerId,
    },
    /// A worker acknowledged a control message this shard's policy sent: it took effect.
    ControlApplied(Applied),
    /// The answer to a [`Decision::Measure`] (ABI v3): the host sends it right after the event
    /// whose decisions asked, before any other event, one per measure in the order asked.
    Measured {
        /// The policy's number for the question.
        query: u64,
        /// The figure; NaN when a tensor named is not there (a push already decided, a group or
        /// round with nothing in it) or a cosine involves a zero tensor.
        value: f64,
    },
}

/// A worker's acknowledgement of a control message.
///
/// For [`Control::MoveTasks`] the acknowledgement comes when the tasks' owner has handed them
/// over, and `control` names the tasks that actually moved (those the owner had not started;
/// `count` may be 0). For the other controls `control` is the message as sent.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// The worker that applied it (for a move: the worker computing the moved tasks).
    pub worker: WorkerId,
    /// The control as it took effect.
    pub control: Control,
    /// The first iteration it applies to (for a move: the owner's iteration).
    pub iteration: u64,
}

/// Why a worker left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaveReason {
    /// The worker said goodbye.
    Finished,
    /// The worker stopped answering and was dropped after the host's timeout.
    TimedOut,
    /// The worker's connection failed.
    Failed,
}

/// A push: a gradient for one iteration.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Push {
    /// The request.
    pub id: RequestId,
    /// The worker that sent it.
    pub worker: WorkerId,
    /// The iteration the gradient belongs to.
    pub iteration: u64,
    /// The sending worker's clock before this push.
    pub clock: u64,
    /// How many training samples the gradient was computed on.
    pub samples: u32,
    /// Its staleness: the optimizer steps applied to this shard since the pull the gradient was
    /// computed from was served (0 when the worker did not say which version it computed on).
    /// Staleness-weighted rules weigh a push by it (`AdmitWeighted`).
    pub staleness: u64,
    /// The shard's version: the optimizer steps applied to it so far.
    pub version: u64,
    /// What the worker reported of the iteration and what the host measured of the push
    /// (ABI v3; a v2 module never sees them). Not part of the push's serialized form, which
    /// snapshots keep as it was: they carry the signals beside it.
    #[serde(skip)]
    pub signals: Signals,
}

/// What a push's worker reported of its iteration, and what the host measured of the push
/// (ABI v3). Everything a worker reports was validated by the host: a loss is finite, a step
/// time and a token count are bounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Signals {
    /// The worker's training loss on the iteration's batch (for local steps: the mean over
    /// them), if it reported one.
    pub loss: Option<f32>,
    /// The L2 norm of what the push brings to this shard (its gradient or pseudo-gradient,
    /// decoded to float32), measured by the host when the push arrived. `None` only for a push
    /// that waited in a snapshot taken before ABI v3.
    pub norm: Option<f32>,
    /// Tokens the iteration trained on (a language model's; 0: not reported).
    pub tokens: u64,
    /// The worker's compute time for the iteration in nanoseconds, waits excluded (0: not
    /// reported).
    pub step_ns: u64,
}

impl Signals {
    /// The longest step time a worker may report: a day.
    pub const MAX_STEP_NS: u64 = 86_400 * 1_000_000_000;
    /// The most tokens a worker may report for one iteration (2^40).
    pub const MAX_TOKENS: u64 = 1 << 40;

    /// Whether what a worker reported is within bounds: a finite loss, a step time of at most
    /// [`Self::MAX_STEP_NS`], at most [`Self::MAX_TOKENS`] tokens. The host refuses a push that
    /// reports otherwise; the error says what is wrong. (The norm is the host's, not checked.)
    pub fn check_reported(&self) -> Result<(), String> {
        if let Some(loss) = self.loss.filter(|l| !l.is_finite()) {
            return Err(format!("a loss of {loss}"));
        }
        if self.step_ns > Self::MAX_STEP_NS {
            return Err(format!("a step of {} ns (at most a day)", self.step_ns));
        }
        if self.tokens > Self::MAX_TOKENS {
            return Err(format!("{} tokens (at most 2^40)", self.tokens));
        }
        Ok(())
    }
}

/// A tensor of this shard that a policy can measure, named by handle: the host computes, and no
/// tensor is copied into the module (ABI v3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Tensor {
    /// The gradient (or pseudo-gradient) of a push that is still undecided: this event's own
    /// push, or a held one.
    Push(RequestId),
    /// The shard's current parameters.
    Params,
    /// The weighted mean of an open group ([`Decision::AdmitToGroup`]) so far.
    Group(u64),
    /// The weighted mean of an open aggregate round ([`UpdateMode::Aggregate`]) so far.
    Round(u64),
}

/// A figure the host computes on this shard's tensors for a policy (ABI v3), answered with
/// [`Event::Measured`]. Sums run in f64, in a fixed order: the same tensors give the same bits on
/// every host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Measure {
    /// The L2 norm of a tensor.
    Norm(Tensor),
    /// The dot product of two tensors.
    Dot(Tensor, Tensor),
    /// The cosine of the angle between two tensors (NaN when either is zero).
    Cosine(Tensor, Tensor),
}

/// A pull: a request for the current parameters before computing an iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pull {
    /// The request.
    pub id: RequestId,
    /// The worker asking.
    pub worker: WorkerId,
    /// The iteration the worker is about to compute.
    pub iteration: u64,
    /// The worker's clock (iterations it has pushed to this shard).
    pub clock: u64,
    /// The shard's version (optimizer steps applied so far): what the pull sees if served now.
    pub version: u64,
}

/// A worker's report of one finished iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IterationReport {
    /// The worker.
    pub worker: WorkerId,
    /// The iteration it finished.
    pub iteration: u64,
    /// Time spent computing, in nanoseconds (waits excluded).
    pub compute_ns: u64,
    /// Samples processed.
    pub samples: u32,
}

/// When the host releases a deferred pull by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Release {
    /// As soon as the shard's minimum clock reaches this value.
    MinClockAtLeast(u64),
    /// Only when the policy says so with [`Decision::ReleasePull`].
    Explicit,
}

/// How admitted gradients reach the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateMode {
    /// Each admitted push runs an optimizer step at once, scaled by its weight
    /// (default `1 / live workers`).
    OnArrival,
    /// Pushes of one round (the pushing worker's clock, [`Push::clock`]; the iteration, unless
    /// clocks were rebased at a swap) are summed with their weights; once every live worker's
    /// clock has passed the round, the sum runs one optimizer step. Needed for stateful
    /// optimizers under BSP semantics. [`Decision::CompleteAggregate`] applies a round early.
    Aggregate,
}

/// A message for a worker, delivered over the control channel.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Control {
    /// Stop computing for a while.
    Pause {
        /// How long, in nanoseconds.
        for_ns: u64,
    },
    /// Resume at once after a pause.
    Resume,
    /// Use this many samples per iteration from now on.
    SetBatchSize {
        /// Samples per iteration.
        samples: u32,
    },
    /// Split each mini-batch into this many tasks (equal sample shards) from the next iteration
    /// on: tasks are what [`Control::MoveTasks`] moves. 1 (the default) is a whole batch.
    SetTaskShare {
        /// Tasks per iteration (1 to 64).
        tasks: u32,
    },
    /// Sent to a worker that would otherwise wait: compute tasks `first..first + count` of worker
    /// `from`'s iteration `iteration` and push them counted towards that iteration.
    ///
    /// The host first asks `from` to hand the tasks over; only tasks `from` has not started move,
    /// so every task is computed exactly once. The host's task accounting completes `from`'s
    /// iteration when all its tasks have arrived, whoever computed them; the policy then sees one
    /// push for it. The outcome comes back as [`Event::ControlApplied`].
    MoveTasks {
        /// The worker whose tasks move.
        from: WorkerId,
        /// The iteration they belong to.
        iteration: u64,
        /// The first task moved.
        first: u32,
        /// How many tasks move.
        count: u32,
    },
    /// Abandon the iteration in progress (its gradient is never pushed) and continue from
    /// `iteration`, numbered as the worker's pushes to this shard number them (`Push::iteration`).
    /// The worker tells every shard, which raise its clock by the iterations skipped (the policy
    /// sees the new clocks); it acknowledges with [`Event::ControlApplied`] once it has. A worker
    /// already at or past `iteration` ignores it; one whose iteration has tasks out with other
    /// workers finishes that iteration first; one that joined after training started (its
    /// shards number its iterations differently) does not skip. Both acknowledge it as well.
    SkipTo {
        /// The iteration to continue from.
        iteration: u64,
    },
    /// Push to this shard in `codec` from the next iteration on: the worker encodes its part
    /// of the gradient (or pseudo-gradient), adding what its earlier pushes' codecs left out
    /// (error feedback), and the shard decodes it before anything else sees it, so the
    /// optimizer and the backups see float32. Acknowledged like the others
    /// ([`Event::ControlApplied`]); the setting stays with the worker across swaps, as batch
    /// sizes do. Added in ABI v2.
    SetPushCodec {
        /// The codec.
        codec: Codec,
    },
}

/// One thing a policy asks the host to do.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Decision<'a> {
    /// Answer a pull now with the current parameters.
    ServePull {
        /// The pull.
        pull: RequestId,
    },
    /// Park a pull until its release condition holds.
    DeferPull {
        /// The pull.
        pull: RequestId,
        /// When the host releases it.
        until: Release,
    },
    /// Answer a parked pull now.
    ReleasePull {
        /// The parked pull.
        pull: RequestId,
    },
    /// Admit a push (new or held) so that it reaches the parameters.
    AdmitPush {
        /// The push.
        push: RequestId,
        /// Its weight; `None` means the host's default for the update mode.
        weight: Option<f32>,
    },
    /// Hold a push (and its acknowledgement) until a later [`Decision::AdmitPush`].
    HoldPush {
        /// The push.
        push: RequestId,
    },
    /// Switch how admitted gradients are applied.
    SetUpdateMode(UpdateMode),
    /// Send a control message to a worker.
    Control {
        /// The worker.
        worker: WorkerId,
        /// The message.
        control: Control,
    },
    /// Fire [`Event::Timer`] after this much host time. Setting an existing timer re-arms it.
    SetTimer {
        /// The policy's identifier.
        timer: TimerId,
        /// Delay in nanoseconds.
        after_ns: u64,
    },
    /// Cancel a timer.
    CancelTimer {
        /// The policy's identifier.
        timer: TimerId,
    },
    /// Record a metric sample.
    Metric {
        /// Metric name.
        #[serde(borrow)]
        name: &'a str,
        /// Its value.
        value: f64,
    },
    /// Drop a push (this event's, or a held one): its gradient never reaches the parameters,
    /// no optimizer step runs, and it counts in neither the steps nor the staleness histogram.
    /// The worker's clock still advances (its iteration is over) and the worker is acknowledged
    /// and told the push was dropped. Added after ABI v1's first release; old modules never send it.
    DropPush {
        /// The push.
        push: RequestId,
    },
    /// In [`UpdateMode::Aggregate`]: apply the aggregate of round `clock` now, with the
    /// contributions that are in: one optimizer step on their weighted mean (`sum of w * g`
    /// divided by `sum of w`). A round is the clock a push had ([`Push::clock`]); pushes for a
    /// completed round that are admitted later form a new aggregate of the same round (drop them
    /// to discard late gradients). Nothing happens if the round has no contribution yet. Added
    /// after ABI v1's first release; old modules never send it.
    CompleteAggregate {
        /// The round.
        clock: u64,
    },
    /// Admit a push (this event's, or a held one) into group `group`, named by the policy,
    /// whatever the pushing worker's clock: its gradient, times `weight` (`None`: 1, so that the
    /// group's step is the plain mean), joins the group's sum, the push is acknowledged and its worker's clock
    /// advances. Nothing reaches the parameters until [`Decision::CompleteGroup`]. Groups are
    /// the shard's, in either update mode, kept across swaps and in snapshots (ABI v2).
    AdmitToGroup {
        /// The push.
        push: RequestId,
        /// The group.
        group: u64,
        /// Its weight.
        weight: Option<f32>,
    },
    /// Apply group `group` now as one optimizer step on its weighted mean (`sum of w * g`
    /// divided by `sum of w`), and forget it. Nothing happens for a group with no push in it.
    CompleteGroup {
        /// The group.
        group: u64,
    },
    /// From their next pull on, workers take `steps` local steps per iteration: they compute
    /// `steps` gradients, each applied at once to their own copy of the model by their inner
    /// optimizer, and push the **pseudo-gradient**, the parameters they pulled minus the ones
    /// they reached, which this shard applies with its outer optimizer
    /// ([`Decision::SetOuterOptimizer`]). 0 (the default) is ordinary training: one gradient
    /// per iteration, applied by the shard's optimizer. `worker`: that worker only; `None`:
    /// every worker, present and future, overriding any per-worker setting. A worker learns
    /// its setting with each pull, so an iteration uses what the pull that began it said; a
    /// hot swap sets every worker back to the cluster's default (ABI v2).
    SetLocalSteps {
        /// One worker, or every worker.
        worker: Option<WorkerId>,
        /// Local steps per iteration (0: push gradients).
        steps: u32,
    },
    /// The optimizer this shard applies to pseudo-gradients (pushes of local steps, see
    /// [`Decision::SetLocalSteps`]): SGD with learning rate `lr` and momentum `momentum`
    /// (Nesterov's when `nesterov`), on the round's weighted mean as for gradients. The default,
    /// `lr` 1 and no momentum, replaces the model by the mean of the workers' models (local
    /// SGD's averaging); DiLoCo's outer optimizer is `lr` 0.7, momentum 0.9, Nesterov. Its
    /// momentum is the shard's, kept across swaps and changes of these numbers, in checkpoints
    /// and on backups; a hot swap sets the numbers back to the default (ABI v2).
    SetOuterOptimizer {
        /// Learning rate.
        lr: f32,
        /// Momentum coefficient (0: none).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Answer this shard's pulls in `codec` from now on (not top-k: pulls carry parameters,
    /// not updates that error feedback could make up for). Kept across swaps and in
    /// checkpoints (ABI v2).
    SetPullCodec {
        /// The codec.
        codec: Codec,
    },
    /// Delay the outer optimizer's momentum (Delayed Nesterov; Liu et al. 2024, "Asynchronous
    /// Local-SGD Training for Language Modeling", Algorithm 3): of every `period` outer steps,
    /// `period - 1` apply their weighted pseudo-gradient `w·g` plainly (`θ -= lr·w·g`, the
    /// momentum untouched), and the `period`-th also folds the sum of the period's `w·g` into
    /// the momentum and applies it (`v = β·v + Σ w·g`, `θ -= lr·(w·g + β·v)`). With the default
    /// weight `1 / workers` and `period` = the number of workers, this is the paper's update;
    /// `period` 1 (the default) is the outer optimizer's ordinary step. Rounds (aggregate mode)
    /// count as one outer step each. A hot swap sets it back to 1 and drops the partial sum
    /// (ABI v2).
    SetOuterDelay {
        /// Outer steps per momentum step (1 to [`MAX_OUTER_DELAY`](crate::rules::MAX_OUTER_DELAY)).
        period: u32,
    },
    /// Ask the host for a figure of this shard's tensors (ABI v3): a norm, a dot product or a
    /// cosine of pushes, the parameters and open groups. The answer arrives as
    /// [`Event::Measured`] with `query`, right after this event. To weigh a push by it, hold the
    /// push ([`Decision::HoldPush`]) and admit, clip or drop it when the answer comes. The host
    /// charges the call that receives the answer fuel by the size of the tensors; at most
    /// [`MAX_MEASURES`](crate::rules::MAX_MEASURES) per event.
    Measure {
        /// The policy's number for the question, echoed in the answer.
        query: u64,
        /// What to compute.
        measure: Measure,
    },
}

/// Splits the `i64` a data-returning export gives back into `(ptr, len)`.
pub fn unpack_ptr_len(packed: i64) -> (u32, u32) {
    let bits = packed as u64;
    ((bits >> 32) as u32, bits as u32)
}

/// Packs `(ptr, len)` into the `i64` a data-returning export gives back.
pub fn pack_ptr_len(ptr: u32, len: u32) -> i64 {
    (((ptr as u64) << 32) | len as u64) as i64
}

/// Size of an encoded [`Envelope`] (ABI v3).
pub const ENVELOPE_LEN: usize = 128;

/// Size of an ABI v2 envelope: the first bytes of a v3 one, all a v2 module is sent.
pub const ENVELOPE_LEN_V2: usize = 88;

/// Bytes that are not a valid [`Envelope`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvelopeError(pub &'static str);

impl core::fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.0)
    }
}

fn put64(b: &mut [u8; ENVELOPE_LEN], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8; ENVELOPE_LEN], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn get64(b: &[u8], at: usize) -> u64 {
    let mut x = [0; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn get32(b: &[u8], at: usize) -> u32 {
    let mut x = [0; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

impl LeaveReason {
    fn code(self) -> u8 {
        match self {
            LeaveReason::Finished => 0,
            LeaveReason::TimedOut => 1,
            LeaveReason::Failed => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => LeaveReason::Finished,
            1 => LeaveReason::TimedOut,
            2 => LeaveReason::Failed,
            _ => return None,
        })
    }
}

impl Envelope {
    /// The fixed-layout encoding (see the type's docs).
    pub fn to_bytes(&self) -> [u8; ENVELOPE_LEN] {
        let mut b = [0u8; ENVELOPE_LEN];
        put64(&mut b, 0, self.now_ns);
        put64(&mut b, 8, self.random);
        put64(&mut b, 16, self.view.min_clock);
        put64(&mut b, 24, self.view.max_clock);
        put32(&mut b, 32, self.view.workers);
        let (f, g) = match self.event {
            Event::Push(p) => (p.staleness, p.version),
            Event::Pull(p) => (p.version, 0),
            _ => (0, 0),
        };
        put64(&mut b, 72, f);
        put64(&mut b, 80, g);
        let (kind, sub, a, wb, c, d, e) = match self.event {
            Event::WorkerJoined { worker, clock } => (0, 0, clock, worker, 0, 0, 0),
            Event::WorkerLeft { worker, reason } => (1, reason.code(), 0, worker, 0, 0, 0),
            Event::Push(p) => (2, 0, p.id, p.worker, p.samples, p.iteration, p.clock),
            Event::Pull(p) => (3, 0, p.id, p.worker, 0, p.iteration, p.clock),
            Event::IterationFinished(r) => (4, 0, 0, r.worker, r.samples, r.iteration, r.compute_ns),
            Event::Timer { timer } => (5, 0, timer, 0, 0, 0, 0),
            Event::Measured { query, value } => (7, 0, query, 0, 0, value.to_bits(), 0),
            Event::ControlApplied(Applied { worker, control, iteration }) => match control {
                Control::Pause { for_ns } => (6, 0, 0, worker, 0, iteration, for_ns),
                Control::Resume => (6, 1, 0, worker, 0, iteration, 0),
                Control::SetBatchSize { samples } => (6, 2, 0, worker, samples, iteration, 0),
                Control::SetTaskShare { tasks } => (6, 3, 0, worker, tasks, iteration, 0),
                Control::MoveTasks { from, first, count, .. } => {
                    (6, 4, u64::from(from), worker, first, iteration, u64::from(count))
                }
                Control::SkipTo { iteration: to } => (6, 5, 0, worker, 0, iteration, to),
                Control::SetPushCodec { codec } => {
                    let (code, param) = codec.code();
                    (6, 6, 0, worker, code, iteration, param)
                }
            },
        };
        b[36] = kind;
        b[37] = sub;
        put64(&mut b, 40, a);
        put32(&mut b, 48, wb);
        put32(&mut b, 52, c);
        put64(&mut b, 56, d);
        put64(&mut b, 64, e);
        if let Event::Push(Push { signals, .. }) = self.event {
            let none = f32::NAN.to_bits();
            put32(&mut b, 88, signals.loss.map_or(none, f32::to_bits));
            put32(&mut b, 92, signals.norm.map_or(none, f32::to_bits));
            put64(&mut b, 96, signals.tokens);
            put64(&mut b, 104, signals.step_ns);
        }
        b
    }

    /// Decodes the fixed-layout encoding: a v3 record, or a v2 one (from a recording made
    /// before v3), whose pushes have no [`Signals`].
    pub fn from_bytes(b: &[u8]) -> Result<Self, EnvelopeError> {
        if b.len() != ENVELOPE_LEN && b.len() != ENVELOPE_LEN_V2 {
            return Err(EnvelopeError("an envelope is exactly 128 bytes (88 before ABI v3)"));
        }
        let signals = if b.len() == ENVELOPE_LEN {
            let f = |at| Some(f32::from_bits(get32(b, at))).filter(|x| !x.is_nan());
            Signals { loss: f(88), norm: f(92), tokens: get64(b, 96), step_ns: get64(b, 104) }
        } else {
            Signals::default()
        };
        let (a, worker, c, d, e) = (get64(b, 40), get32(b, 48), get32(b, 52), get64(b, 56), get64(b, 64));
        let (f, g) = (get64(b, 72), get64(b, 80));
        let event = match b[36] {
            0 => Event::WorkerJoined { worker, clock: a },
            1 => Event::WorkerLeft {
                worker,
                reason: LeaveReason::from_code(b[37]).ok_or(EnvelopeError("unknown leave reason"))?,
            },
            2 => Event::Push(Push {
                id: a,
                worker,
                iteration: d,
                clock: e,
                samples: c,
                staleness: f,
                version: g,
                signals,
            }),
            3 => Event::Pull(Pull { id: a, worker, iteration: d, clock: e, version: f }),
            4 => {
                Event::IterationFinished(IterationReport { worker, iteration: d, compute_ns: e, samples: c })
            }
            5 => Event::Timer { timer: a },
            7 => Event::Measured { query: a, value: f64::from_bits(d) },
            6 => {
                let control = match b[37] {
                    0 => Control::Pause { for_ns: e },
                    1 => Control::Resume,
                    2 => Control::SetBatchSize { samples: c },
                    3 => Control::SetTaskShare { tasks: c },
                    4 => Control::MoveTasks {
                        from: u32::try_from(a).map_err(|_| EnvelopeError("worker id out of range"))?,
                        iteration: d,
                        first: c,
                        count: u32::try_from(e).map_err(|_| EnvelopeError("task count out of range"))?,
                    },
                    5 => Control::SkipTo { iteration: e },
                    6 => Control::SetPushCodec {
                        codec: Codec::from_code(c, e).ok_or(EnvelopeError("unknown codec"))?,
                    },
                    _ => return Err(EnvelopeError("unknown control kind")),
                };
                Event::ControlApplied(Applied { worker, control, iteration: d })
            }
            _ => return Err(EnvelopeError("unknown event kind")),
        };
        Ok(Envelope {
            now_ns: get64(b, 0),
            random: get64(b, 8),
            view: ShardView { min_clock: get64(b, 16), max_clock: get64(b, 24), workers: get32(b, 32) },
            event,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_kind_round_trips() {
        let view = ShardView { min_clock: 3, max_clock: u64::MAX, workers: 7 };
        let events = [
            Event::WorkerJoined { worker: 1, clock: 9 },
            Event::WorkerLeft { worker: u32::MAX, reason: LeaveReason::TimedOut },
            Event::Push(Push {
                id: 1,
                worker: 2,
                iteration: 3,
                clock: 4,
                samples: 5,
                staleness: 6,
                version: 7,
                signals: Signals::default(),
            }),
            Event::Push(Push {
                id: 8,
                worker: 9,
                iteration: 10,
                clock: 11,
                samples: 12,
                staleness: 13,
                version: 14,
                signals: Signals { loss: Some(2.5), norm: Some(0.125), tokens: 4096, step_ns: 18_000_000 },
            }),
            Event::Measured { query: 3, value: -0.25 },
            Event::Measured { query: u64::MAX, value: f64::NAN },
            Event::Pull(Pull { id: u64::MAX, worker: 2, iteration: 3, clock: 4, version: u64::MAX - 2 }),
            Event::IterationFinished(IterationReport { worker: 2, iteration: 3, compute_ns: 4, samples: 5 }),
            Event::Timer { timer: 77 },
            Event::ControlApplied(Applied {
                worker: 3,
                control: Control::MoveTasks { from: 1, iteration: 9, first: 4, count: 2 },
                iteration: 9,
            }),
            Event::ControlApplied(Applied {
                worker: 3,
                control: Control::SetBatchSize { samples: 48 },
                iteration: 12,
            }),
            Event::ControlApplied(Applied { worker: 0, control: Control::Pause { for_ns: 5 }, iteration: 1 }),
            Event::ControlApplied(Applied {
                worker: 1,
                control: Control::SkipTo { iteration: u64::MAX },
                iteration: 7,
            }),
            Event::ControlApplied(Applied {
                worker: 2,
                control: Control::SetPushCodec { codec: Codec::TopK { ppm: 10_000 } },
                iteration: 3,
            }),
            Event::ControlApplied(Applied {
                worker: 2,
                control: Control::SetPushCodec { codec: Codec::Int8 { block: 512 } },
                iteration: 3,
            }),
        ];
        for event in events {
            let env = Envelope { now_ns: 123, random: u64::MAX - 1, view, event };
            let back = Envelope::from_bytes(&env.to_bytes()).expect("decodes");
            match (back.event, event) {
                // NaN is not equal to itself: compare its bits.
                (Event::Measured { query: q, value: v }, Event::Measured { query, value }) => {
                    assert_eq!((q, v.to_bits()), (query, value.to_bits()))
                }
                _ => assert_eq!(back, env),
            }
        }
    }

    /// A v2 module is sent the first 88 bytes of a v3 envelope: they are the v2 record, field for
    /// field, and they decode (as a recording made before v3 does) with no signals.
    #[test]
    fn a_v2_envelope_is_the_first_88_bytes_of_a_v3_one() {
        let push = Push {
            id: 1,
            worker: 2,
            iteration: 3,
            clock: 4,
            samples: 5,
            staleness: 6,
            version: 7,
            signals: Signals { loss: Some(1.0), norm: Some(2.0), tokens: 3, step_ns: 4 },
        };
        let env = Envelope { now_ns: 9, random: 10, view: ShardView::default(), event: Event::Push(push) };
        let bytes = env.to_bytes();
        // The v2 layout, pinned: kind 2 at 36, id at 40, worker at 48, samples at 52.
        assert_eq!((bytes[36], bytes[40], bytes[48], bytes[52]), (2, 1, 2, 5));
        assert_eq!(&bytes[112..], &[0; 16]);
        let v2 = Envelope::from_bytes(&bytes[..ENVELOPE_LEN_V2]).expect("a v2 record decodes");
        assert_eq!(v2.event, Event::Push(Push { signals: Signals::default(), ..push }));
    }

    #[test]
    fn rejects_bad_records() {
        let mut b =
            Envelope { now_ns: 0, random: 0, view: ShardView::default(), event: Event::Timer { timer: 1 } }
                .to_bytes();
        assert!(Envelope::from_bytes(&b[..ENVELOPE_LEN - 1]).is_err());
        b[36] = 8;
        assert_eq!(Envelope::from_bytes(&b), Err(EnvelopeError("unknown event kind")));
        b[36] = 1;
        b[37] = 9;
        assert_eq!(Envelope::from_bytes(&b), Err(EnvelopeError("unknown leave reason")));
    }
}
