//! What a simulation is asked to do: the run, the faults to inject, and what can go wrong
//! ([`SimOptions`], [`SimFaults`], [`SimError`]).

use syncopate_engine::worker::WorkerError;
use syncopate_policy_sdk::abi::WorkerId;

use crate::lab::scenario::RunSpec;
use crate::runtime::PolicyError;

/// How to simulate.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// The run: scenario (its seed makes the run reproducible) and policy.
    pub run: RunSpec,
    /// Compute real gradients and score the model (false: decisions only, for large clusters).
    pub gradients: bool,
    /// The Fashion-MNIST directory (default: where Debian's package puts it).
    pub data: Option<std::path::PathBuf>,
    /// Servers killed during the run (needs the scenario's `replicas = 1`), instead of the
    /// scenario's `kill_server`: tests kill them at event indices.
    pub failures: Vec<SimFailure>,
    /// Faults besides server deaths (they need `replicas = 1`).
    pub faults: SimFaults,
}

/// Faults a simulation injects besides server deaths.
#[derive(Clone, Debug, Default)]
pub struct SimFaults {
    /// Servers cut off from the coordinator for a while.
    pub partitions: Vec<SimPartition>,
    /// Workers that die (their process stops): what they sent is still delivered, nothing
    /// reaches them any more, and each server makes a dead worker leave its shards a peer
    /// timeout (10 s) after its death, as a cluster's servers do when its connection times out.
    pub worker_deaths: Vec<(WorkerId, FailAt)>,
    /// Hot swaps, begun at each time by the coordinator's machine as an operator's `policy
    /// swap` is: two-phase, so a swap that a server not yet failed over cannot prepare (dead)
    /// switches nobody; once all have prepared, each switches its primaries as its commit
    /// arrives, and the backups follow by their op streams.
    pub swaps: Vec<(FailAt, crate::builtin::PolicySpec)>,
    /// Each message from a worker to a shard (pull, push, report, hand-over, goodbye) takes up
    /// to this much longer than the link says, in nanoseconds, drawn per message: a cluster
    /// sends each request on a stream of its own, and streams overtake each other.
    pub reorder_ns: u64,
    /// Each notice from the coordinator to a worker (a shard moved) takes up to this much
    /// longer than the latency, in nanoseconds, drawn per notice from the scenario's seed: a
    /// worker may go on addressing a shard's old primary for that long.
    pub notice_delay_ns: u64,
    /// One worker that hears of every move this much later still, in nanoseconds: a worker in
    /// a long iteration, or paused, while its shards fail over (longer than the 10 s grace
    /// promoted shards used to give).
    pub late_worker: Option<(WorkerId, u64)>,
    /// The chance that a message a shard's primary took from a worker (pull, push, report,
    /// hand-over, goodbye), or an op a backup took from its primary, reaches it a second time,
    /// up to [`DUPLICATE_WITHIN_NS`] later: a request asked again, an op sent again. The copy's
    /// answer goes to nobody; a copy that finds the shard moved is lost.
    pub duplicate: f64,
    /// The chance that a bad request from a buggy or hostile peer reaches a shard's primary
    /// just before a worker's pull or push does: a push from an id past `max_workers`, one of
    /// the wrong length, with a NaN, or skipping iterations (numbered as the worker's own); a
    /// pull from an id that never joined; a join with a slice of the wrong length; a skip from
    /// an impossible id. Each must be refused and change nothing: one that a shard accepts
    /// ends the run ([`SimError::AcceptedBad`]).
    pub bad_inputs: f64,
    /// Workers that join late, each at its time, rather than with the others: as a cluster's
    /// `WorkerClient::join` does, each joins every shard and levels its clocks before it starts
    /// (it asks every shard where it stands, skips those where its clock is behind up to the
    /// largest, and asks again).
    pub late_join: Vec<(WorkerId, FailAt)>,
    /// The coordinator crashes at a time, and restarts this many nanoseconds later: the
    /// commands and answers on their way are lost, leases lapse, the servers rejoin the new
    /// one, which rebuilds the cluster from what they hold as a cluster's does
    /// ([`CoordinatorMachine::rebuild`](syncopate_engine::coordinator::CoordinatorMachine::rebuild)), and the workers then get its map.
    pub coordinator_crash: Option<(FailAt, u64)>,
    /// Whether the crashed coordinator had recorded the shards' terms where its successor finds
    /// them (a checkpoint directory, as `syncopate local` gives it), or only its servers' word
    /// is left.
    pub crash_keeps_terms: bool,
    /// Links between a worker and a server, or between two servers, cut for a while, both
    /// ways ([`SimLinkCut`]).
    pub link_cuts: Vec<SimLinkCut>,
    /// Checkpoint rounds, each begun at its time by the coordinator's machine, as a cluster's
    /// periodic checkpoint is: each shard's primary takes its snapshot when the command reaches
    /// it. A round the machine will not begin then (a swap, a failover or a rebuild under way,
    /// the coordinator down) is counted and skipped. A round taken is checked when it ends: it
    /// holds every shard's snapshot, each decodes, runs the policy its shard ran when the round
    /// began, and has applied at least what every copy of the shard had then; otherwise the
    /// run ends ([`SimError::Checkpoint`]). A snapshot changes nothing in its shard, so a run
    /// with rounds ends where the same run without them does.
    pub checkpoints: Vec<FailAt>,
    /// Servers started again after they die ([`SimRestart`]).
    pub server_restarts: Vec<SimRestart>,
}

/// A dead server started again: a new process under the same id and address, holding nothing.
/// Until the coordinator's machine admits it ([`CoordinatorMachine::replace_server_at`](syncopate_engine::coordinator::CoordinatorMachine::replace_server_at): the old
/// one failed over, and a peer timeout since) it is refused and asks again a heartbeat later,
/// as `syncopate server` does; then it takes its id back, and every shard without a backup
/// gets one, on it first. A server is restarted once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimRestart {
    /// The server.
    pub server: u32,
    /// How long after its death it starts again, in nanoseconds.
    pub after_ns: u64,
    /// Another server that dies this many nanoseconds after the restarted one took its id back
    /// (with two servers, only the restarted one's new backups can save its shards).
    pub then_kill: Option<(u32, u64)>,
}

/// One end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// A worker.
    Worker(WorkerId),
    /// A server.
    Server(u32),
}

/// A link cut for a while, both ways: between a worker and a server, or between two servers (a
/// primary and its backup's server). What either end sends the other (requests, replies,
/// acknowledgements, control messages; ops, snapshots and confirmations) waits until the link
/// heals, then goes in the order it was sent, as a connection's retransmissions carry it.
/// Shorter than the peer timeout, so neither end gives the connection up. Every other link is
/// untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimLinkCut {
    /// One end.
    pub a: Node,
    /// The other.
    pub b: Node,
    /// When the link is cut.
    pub at: FailAt,
    /// How long it stays cut, in nanoseconds (under [`PEER_TIMEOUT_NS`](super::PEER_TIMEOUT_NS)).
    pub heal_after_ns: u64,
}

/// How much later than the original a duplicate arrives, at most (50 ms).
pub const DUPLICATE_WITHIN_NS: u64 = 50_000_000;

/// A server cut off from the coordinator for a while: the workers and the other servers still
/// reach it, but its lease renewals, or the coordinator's answers, or both, are lost, as are
/// the coordinator's commands to it. Its lease lapses, so it refuses requests (the workers ask
/// again after a pause); if the coordinator's lease on it lapses too, it is failed over, and it
/// stops once the partition heals and it hears so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimPartition {
    /// The server.
    pub server: u32,
    /// When the partition begins.
    pub at: FailAt,
    /// How long it lasts, in nanoseconds.
    pub heal_after_ns: u64,
    /// Which way messages are lost.
    pub cut: Cut,
}

/// Which messages between a server and the coordinator a partition loses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Both ways.
    Both,
    /// The server's to the coordinator (the coordinator hears no renewal).
    ToCoordinator,
    /// The coordinator's to the server (renewals arrive, the answers do not).
    FromCoordinator,
}

/// A server killed during a simulation. It stops at once and renews its lease no more; what
/// reaches it is lost. When its lease lapses in the coordinator's machine
/// ([`FAILOVER_MS`](crate::net::proto::FAILOVER_MS) after its last renewal), as on a cluster,
/// its shards' backups are promoted and the workers, once they hear, ask them again for every
/// pull and push that was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimFailure {
    /// The server.
    pub server: u32,
    /// When it dies.
    pub at: FailAt,
}

/// When a simulated server dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailAt {
    /// Before this event: 0, 1, 2... in the order the simulator handles them (tests kill a
    /// server at every event of a run in turn).
    Event(u64),
    /// Before the first event at or after this virtual time, in nanoseconds from the start
    /// (a scenario's `kill_server`).
    Time(u64),
}

impl SimFailure {
    /// The scenario's failure drill, if it has one.
    pub fn of(scenario: &crate::lab::scenario::Scenario) -> Option<Self> {
        scenario.kill_server.map(|k| SimFailure { server: k.server, at: FailAt::Time((k.at_s * 1e9) as u64) })
    }

    pub(super) fn due(&self, event: u64, now_ns: u64) -> bool {
        self.at.due(event, now_ns)
    }
}

impl FailAt {
    pub(super) fn due(&self, event: u64, now_ns: u64) -> bool {
        match *self {
            FailAt::Event(e) => e == event,
            FailAt::Time(t) => now_ns >= t,
        }
    }
}

/// A simulation that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The policy does not load or start.
    #[error("policy `{0}`: {1}")]
    Policy(String, PolicyError),
    /// The scenario runs a user's script, which only a real cluster can.
    #[error("the simulator cannot run a training script ({0}); run it on a real cluster (`syncopate ab` without --simulate)")]
    Script(String),
    /// The workload cannot be built.
    #[error(transparent)]
    Workload(#[from] syncopate_workloads::WorkloadError),
    /// The scenario's trace cannot be read.
    #[error(transparent)]
    Trace(#[from] crate::lab::report::TraceError),
    /// A shard refused a request the simulated worker made (a simulator bug).
    #[error("shard {0} refused a request: {1}")]
    Refused(u32, String),
    /// A simulated worker could not go on.
    #[error("worker {0}: {1}")]
    Worker(WorkerId, WorkerError),
    /// A worker's client machine gave up on a shard whose server was lost: it did not move,
    /// nor did its server serve again, within the move wait (with the coordinator there).
    #[error("worker {worker} gave up on shard {shard}: its server was lost and it did not move within the move wait")]
    GaveUp {
        /// The worker.
        worker: WorkerId,
        /// The shard.
        shard: u32,
    },
    /// The options do not go together.
    #[error("{0}")]
    Options(String),
    /// A shard accepted a bad request ([`SimFaults::bad_inputs`]).
    #[error("shard {0} accepted a bad request: {1}")]
    AcceptedBad(u32, &'static str),
    /// A shard died with its server, its backup dead too or never made: the run cannot go on
    /// (as a cluster's cannot).
    #[error("shard {shard} was lost with server {server}: it had no live backup")]
    ShardLost {
        /// The shard.
        shard: u32,
        /// The server that died.
        server: u32,
    },
    /// A restarted coordinator found only older copies of a shard than a server had heard of
    /// (its newest copies died before the restart): the shard is lost, and said so, as a cluster
    /// says so.
    #[error("shard {shard} lost: its newest copies (term {newest}) died before the coordinator restarted, and only older ones (term {held}) came back")]
    Outdated {
        /// The shard.
        shard: u32,
        /// The newest term a server heard of.
        newest: u64,
        /// The newest term a copy that came back holds.
        held: u64,
    },
    /// A checkpoint round the coordinator's machine reported taken is not whole or not right
    /// ([`SimFaults::checkpoints`]).
    #[error("checkpoint round {round} was taken, but {why}")]
    Checkpoint {
        /// The round.
        round: u64,
        /// What is wrong with it.
        why: String,
    },
    /// A restarted coordinator resolved a shard to a stale copy: every server holding its
    /// newest term died before it could rejoin, and a server failed over earlier claims an
    /// older one. The shard's last current copy is lost (a cluster would go on from the stale
    /// copy: the coordinator keeps no term of its own).
    #[error("shard {shard}'s newest copies died before the coordinator restarted; it resolved to server {server}'s older one")]
    StaleCopy {
        /// The shard.
        shard: u32,
        /// The server whose stale copy it resolved to.
        server: u32,
    },
    /// A restarted coordinator's rebuild chose a copy of a shard older than one it had: a copy
    /// that came back, or a term a rejoined server heard of (a bug of the rebuild, never
    /// excused).
    #[error("shard {shard}: the rebuild chose its copy of term {chosen}, though it knew of term {newest}")]
    OlderCopy {
        /// The shard.
        shard: u32,
        /// The term of the copy it chose.
        chosen: u64,
        /// The newest term it had word of.
        newest: u64,
    },
}
