//! What a worker did: the report every driver of the worker machine produces, real or simulated.

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::WorkerId;

/// What a worker did, written as JSON when it finishes. Every time is measured on the driver's
/// clock: wall-clock time on a cluster, virtual time in the simulator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Its id.
    pub worker: WorkerId,
    /// The iteration it started at (late joiners start later).
    pub start: u64,
    /// Iterations it completed (each pushed and admitted, or all its tasks handed to others).
    pub iterations: u64,
    /// Time spent in pulls, in nanoseconds: from asking for the parameters until every shard's
    /// answer has arrived (deferral and transfer).
    pub wait_ns: u64,
    /// Time spent waiting for its own pushes' acknowledgements, in nanoseconds: from sending an
    /// iteration's push until every shard acknowledged it (the transfer, and as long as a
    /// policy held it: a holding policy's waiting, as deferral is a gating one's).
    #[serde(default)]
    pub push_wait_ns: u64,
    /// Of that, the time policies held its pulls back: per pull, the longest any shard
    /// deferred it, summed. The same quantity as the shards' deferral counters.
    #[serde(default)]
    pub deferred_ns: u64,
    /// Pulls that at least one shard deferred.
    pub deferred_pulls: u64,
    /// Time spent computing its own iterations (emulated device time included), in nanoseconds.
    pub compute_ns: u64,
    /// Time from start to leaving, in nanoseconds.
    pub elapsed_ns: u64,
    /// Own iterations whose push at least one shard's policy dropped (the gradient was
    /// discarded there; the iteration still counts as done).
    #[serde(default)]
    pub pushes_dropped: u64,
    /// Iterations it skipped on a policy's [`SkipTo`](syncopate_policy_sdk::abi::Control::SkipTo)
    /// (an iteration it abandoned included): never pushed, never counted in `iterations`.
    #[serde(default)]
    pub iterations_skipped: u64,
    /// Gradients it computed for its own iterations that reached the shards: one per iteration
    /// pushed as a gradient, `H` per iteration of `H` local steps pushed as a pseudo-gradient.
    #[serde(default)]
    pub steps: u64,
    /// Of its iterations, those of local steps (pushed as pseudo-gradients).
    #[serde(default)]
    pub local_iterations: u64,
    /// The sum of what push codecs left out of this worker's pushes and no later push carried
    /// (error feedback still owed, over every value): 0 without lossy push codecs.
    #[serde(default)]
    pub codec_owed: f64,
    /// Control messages received.
    pub controls: u64,
    /// Tasks of this worker's iterations that other workers computed.
    pub tasks_given: u64,
    /// Tasks of other workers' iterations this worker computed.
    pub tasks_helped: u64,
    /// The last mini-batch's loss.
    pub last_loss: f32,
    /// Bytes sent (on a cluster: UDP payloads, QUIC and TLS included).
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Whether it stopped early because it was asked to (target or budget reached).
    pub stopped_early: bool,
    /// What it gave up waiting for when it was asked to stop: a pull a policy still deferred
    /// (given up at once; it changed nothing), or its own push a policy had not acknowledged
    /// [`STOP_GRACE_NS`](super::STOP_GRACE_NS) after the stop (its fate is the policy's when the
    /// worker leaves the shard: applied unless the policy drops it). Empty when nothing was stuck.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub abandoned: Vec<String>,
    /// Per iteration: start (seconds on the driver's clock: Unix time on a cluster), time in the
    /// pull, time busy (compute, injected delays, push) in seconds.
    pub timeline: Vec<(f64, f32, f32)>,
    /// Per iteration, as `timeline`: of its busy time, the seconds its push waited for its
    /// acknowledgements (as long as a policy held it, and the transfer).
    #[serde(default)]
    pub timeline_acks: Vec<f32>,
    /// Per iteration, as `timeline` (shorter when the last iterations had none): of the time
    /// its push waited, the seconds the worker still computed, its push overlapped with the
    /// backward pass (a Python worker's `overlap=True`); the rest of the wait was idle.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline_overlap: Vec<f32>,
}
