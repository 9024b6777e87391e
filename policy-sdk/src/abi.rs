//! Policy ABI v1: every type that crosses the boundary between the host and a policy module.
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
//! | `sp_event` | `(len: i32) -> i64` | [`Envelope`] | a run of [`Decision`]s |
//! | `sp_export_state` | `() -> i64` | - | opaque state bytes |
//! | `sp_last_panic` | `() -> i64` | - | UTF-8 panic message, empty if none |
//!
//! # Obligations the host checks
//! Every [`Event::Pull`] gets exactly one verdict ([`Decision::ServePull`] or
//! [`Decision::DeferPull`]) and every [`Event::Push`] exactly one ([`Decision::AdmitPush`] or
//! [`Decision::HoldPush`]); releases and admissions name requests that are actually parked or held;
//! workers named in decisions are live. A module that breaks these rules is treated like one that
//! traps: the host reports it and falls back (see the host's `shard` module).

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// The ABI version this crate speaks.
pub const ABI_VERSION: u32 = 1;

/// Name of the exported marker function that declares ABI v1. Modules built for another version
/// export `syncopate_abi_v<N>` instead; the host names the version it found in its error.
pub const ABI_MARKER: &str = "syncopate_abi_v1";

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
/// `clock[w]` is the number of iterations worker `w` has pushed to this shard (admitted pushes;
/// held pushes do not count until admitted). Only live workers count towards the minimum and the
/// maximum; with no live worker both are 0.
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
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Host time in nanoseconds since the shard started (virtual time in the simulator).
    pub now_ns: u64,
    /// A fresh value from the host's seeded random source; the only randomness a policy has.
    /// Encoded as 8 fixed little-endian bytes (a uniform value would take a 10-byte varint).
    #[serde(with = "postcard::fixint::le")]
    pub random: u64,
    /// The shard's clocks before the event takes effect.
    pub view: ShardView,
    /// What happened.
    pub event: Event,
}

/// Something that happened on the shard.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Pushes of one iteration are summed; when every live worker has contributed, their weighted
    /// mean runs one optimizer step. Needed for stateful optimizers under BSP semantics.
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
    /// Compute this many of the iteration's tasks (sample shards) from now on.
    SetTaskShare {
        /// Tasks per iteration.
        tasks: u32,
    },
    /// Compute tasks `first..first + count` of worker `from`'s iteration `iteration` and push
    /// them counted towards that iteration.
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
