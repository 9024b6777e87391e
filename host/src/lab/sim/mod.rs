//! The deterministic cluster simulator behind `syncopate ab --simulate`: clusters larger than
//! one machine holds, in virtual time, bit for bit reproducible from the scenario's seed.
//!
//! What is real: the engine, run exactly as the cluster runs it. Each shard is a [`Shard`] with
//! its wasm policy module and its task ledger, called as the servers call them; each worker is a
//! [`WorkerMachine`], the state machine `syncopate worker` drives (pulls, pushes, reports,
//! control messages, task hand-overs in both directions, the emulated device); and, unless
//! `gradients` is off, the workload's gradients, computed on the parameters each worker actually
//! pulled (so staleness costs accuracy as it really would), and the test-set evaluation. What is
//! modelled:
//! - time: arithmetic takes no virtual time; each worker's device takes the scenario's
//!   `compute_ms` per iteration of the starting batch (proportional to the samples it computes),
//!   times its slow factor, plus its jitter and stall, as the worker machine's [`Device`] says;
//! - the network: every node (worker or server) has one link of the scenario's bandwidth
//!   (`bandwidth_mbit`, default 10 Gbit/s) each way, and every message the scenario's latency
//!   (`latency_us`). A transfer holds the
//!   sender's uplink and the receiver's downlink for `bytes / bandwidth`, so concurrent transfers
//!   through one link queue behind each other: at a server that many workers push to at once,
//!   the syncs contend, as they do on a real link;
//! - messages without tensors (control messages, acknowledgements, hand-overs, iteration
//!   reports) take the latency alone.
//!
//! Each shard, primary or backup, is the servers' own protocol machine, a [`ShardNode`]: the
//! simulator hands it requests with tokens and carries out what it outputs (replies, ops to
//! the backup, confirmations, control messages), as the servers' shard tasks do. With the
//! scenario's `replicas = 1`, every shard call is an [`Op`], applied by the primary and carried
//! over the modelled links to the backup's node, whose confirmations release the primary's held
//! acknowledgements. Failures (the scenario's `kill_server`, or [`SimOptions::failures`], any
//! number) kill a server before a given event or time: it stops at once and renews its lease no
//! more, and what is sent to it is lost. The control plane (`control.rs`) is the cluster's own:
//! leases renewed over the modelled network and the coordinator's machine
//! ([`CoordinatorMachine`]), which fails the server over when its lease lapses: its shards'
//! backups are promoted, every worker, once it hears, rejoins them and sends again what was
//! lost, and every shard left without a backup gets a new one on a live server, started from
//! its primary's snapshot. A shard whose primary and backup are both dead is lost
//! ([`SimError::ShardLost`]). The model is the worst case: ops still on their way from the dead
//! primary and confirmations from a dead backup are lost too. One thing differs from a
//! cluster: a worker that had finished and whose goodbye went to the dead server leaves when it
//! hears of the move (a cluster's server, when it closes its connection there).
//!
//! Events are ordered by virtual time, ties by the order they were scheduled: nothing depends on
//! the host's clock or on thread scheduling.

mod control;
mod events;
mod faults;

use std::collections::BTreeMap;

use rand::Rng as _;
use syncopate_engine::worker::{
    Action, Buffers, Device, Input, JobKind, PushFailed, PushJob, WorkerConfig, WorkerError, WorkerMachine,
};

use syncopate_policy_sdk::abi::{Applied, Control, IterationReport, LeaveReason, WorkerClock, WorkerId};
use syncopate_workloads::{Evaluator, Workload};

use crate::codec::{self, Codec, Encoded, PushEncoder};
use crate::lab::report::{RunReport, ServerRecord, StopRules, WatchPoint};
use crate::lab::scenario::RunSpec;
use crate::lease::ServerLease;
use crate::net::proto::{ControlMessage, ShardStatus, WorkerStatus};
use crate::runtime::{PolicyError, PolicyModule, PolicyRuntime};
use crate::shard::{
    ClockRaise, Joined, NodeConfig, NodeOutput, Op, PushHeader, PushOutcome, Quiet, Reply, RequestError,
    Served, Shard, ShardConfig, ShardNode, Stamped, Token,
};
use crate::worker::WorkerReport;
use control::Arrival;
use events::{Copied, Ev, Mailbox, Queue, ToShard};
use faults::Joining;
use syncopate_engine::coordinator::{Answer, CoordOutput, CoordinatorConfig, CoordinatorMachine};

/// The cluster's default peer timeout (10 s): how long a promoted backup waits for members to
/// rejoin (the simulator's live workers rejoin once they hear of the move, so it runs out only
/// for a dead one), and how long after a worker's death the servers make it leave.
pub const PEER_TIMEOUT_NS: u64 = 10_000_000_000;
const REJOIN_GRACE_NS: u64 = PEER_TIMEOUT_NS;

/// A run in which nothing happens for this long but lease renewals and observations has
/// stalled, and ends (10 minutes of virtual time).
const STALL_NS: u64 = 600_000_000_000;

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
    /// ([`CoordinatorMachine::rebuild`]), and the workers then get its map.
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
/// Until the coordinator's machine admits it ([`CoordinatorMachine::replace_server`]: the old
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
    /// How long it stays cut, in nanoseconds (under [`PEER_TIMEOUT_NS`]).
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

    fn due(&self, event: u64, now_ns: u64) -> bool {
        self.at.due(event, now_ns)
    }
}

impl FailAt {
    fn due(&self, event: u64, now_ns: u64) -> bool {
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
    /// A shard refused a request the simulated worker made (a simulator bug).
    #[error("shard {0} refused a request: {1}")]
    Refused(u32, String),
    /// A simulated worker could not go on.
    #[error("worker {0}: {1}")]
    Worker(WorkerId, WorkerError),
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
}

/// What a request to a shard was, for its reply.
#[derive(Clone, Copy, Debug)]
enum Req {
    /// A worker's pull.
    Pull { w: WorkerId, s: u32, iteration: u64 },
    /// A worker's push (`help`: of tasks moved to it; `whole`: its own whole iteration).
    Push { w: WorkerId, s: u32, help: bool, iteration: u64, whole: bool },
    /// Worker `w`'s join: it starts once every shard has answered its first.
    /// A worker's join (`again`: after it heard the shard moved).
    Join { w: WorkerId, s: u32, again: bool },
    /// A reply nobody acts on (a skip).
    Ignore { s: u32 },
    /// A bad request ([`SimFaults::bad_inputs`]), which must be refused.
    Bad { s: u32, what: &'static str },
    /// A late joiner's skip up to its start ([`SimFaults::late_join`]).
    LateSkip { w: WorkerId, s: u32 },
}

impl Req {
    fn shard(&self) -> u32 {
        match *self {
            Req::Pull { s, .. }
            | Req::Push { s, .. }
            | Req::Join { s, .. }
            | Req::Ignore { s }
            | Req::Bad { s, .. }
            | Req::LateSkip { s, .. } => s,
        }
    }
}

/// A push on its way: the job and the shards that have acknowledged it.
#[derive(Clone, Debug)]
struct InFlight {
    job: PushJob,
    acks: u32,
    /// When the latest acknowledgement sent so far arrives.
    acks_at: u64,
    /// A shard's refusal (of moved tasks whose owner left meanwhile).
    refused: Option<RequestError>,
    /// Shards whose policy dropped it.
    dropped: u32,
}

/// One simulated worker: the machine and what its driver keeps (buffers, transfers in flight).
struct SimWorker {
    cfg: WorkerConfig,
    /// Not joined yet: a late joiner before its time.
    absent: bool,
    /// A late joiner joining.
    joining: Option<Joining>,
    machine: WorkerMachine,
    bufs: Buffers,
    workload: Option<Box<dyn Workload>>,
    /// Pull replies sent for the current pull, and when the latest arrives.
    replies: u32,
    replies_at: u64,
    deferred: bool,
    deferred_ns: u64,
    /// The most local steps any shard's reply to the current pull said.
    local_steps: u32,
    /// Its push codecs and error-feedback residuals, as a cluster worker's client keeps them.
    encoder: PushEncoder,
    /// Per shard, the own push in flight as that shard decodes it (when its codec is not
    /// `none`; `None`: the values as they are).
    encoded: Vec<Option<Vec<f32>>>,
    based_on: Vec<Option<u64>>,
    own: Option<InFlight>,
    help: Option<InFlight>,
    /// Per shard: whether it acknowledged the push in flight (own, help): a retried push that
    /// is acknowledged twice counts once.
    own_acked: Vec<bool>,
    help_acked: Vec<bool>,
    /// The iteration of the pull in flight, and which shards have answered it.
    pulling: Option<u64>,
    replied: Vec<bool>,
    wake_at: Option<u64>,
    /// Counted in [`Sim::done`].
    done: bool,
    /// Its process died.
    dead: bool,
    /// The servers' connections to it have timed out (a peer timeout after its death).
    gone: bool,
}

/// A hot swap under way: its number, module and configuration.
type Swapping = (u64, PolicyModule, Vec<(String, String)>);

/// One link direction: busy until `free_ns`.
#[derive(Clone, Copy, Default)]
struct Link {
    free_ns: u64,
    bytes: u64,
}

struct Sim {
    opts: SimOptions,
    now: u64,
    queue: Queue,
    /// Per shard: its primary.
    nodes: Vec<ShardNode>,
    /// Per shard: how its nodes run (for new backups).
    node_cfgs: Vec<NodeConfig>,
    ranges: Vec<(usize, usize)>,
    server_of: Vec<u32>,
    /// Requests waiting for a shard's reply, by token, in order: those lost with a dead primary
    /// are sent again in token order, the same in every process.
    requests: BTreeMap<Token, Req>,
    next_token: Token,
    workers: Vec<SimWorker>,
    evaluator: Option<Evaluator>,
    /// Uplink and downlink of each worker, then of each server.
    up: Vec<Link>,
    down: Vec<Link>,
    timer_at: Vec<Option<u64>>,
    controls: Mailbox<ControlMessage>,
    to_shard: Mailbox<ToShard>,
    /// Duplicates on their way to a shard's primary, with the shard's term when the original
    /// arrived ([`SimFaults::duplicate`]).
    copies: Mailbox<(u32, Copied)>,
    /// Copies that reached a primary or backup.
    duplicates: u64,
    /// Bad requests shards refused.
    bad_inputs: u64,
    /// Workers whose machine is done.
    done: usize,
    watch: Vec<WatchPoint>,
    stopping: bool,
    time_to_target: Option<f64>,
    bytes_per_ns: f64,
    latency_ns: u64,
    /// Per shard: its backup and the backup's server (with `replicas` 1).
    backups: Vec<Option<ShardNode>>,
    backup_of: Vec<Option<u32>>,
    /// Per shard: bumped when its primary or backup changes, so a stream from before is dropped.
    epoch: Vec<u32>,
    /// Ops on their way to backups: (epoch, op, gradient).
    replication: Mailbox<(u32, Stamped, Vec<f32>)>,
    /// Per server: killed.
    dead: Vec<bool>,
    /// Servers failed over, in order.
    lost: Vec<u32>,
    /// Requests that reached a dead server before its failover, and since when they wait.
    limbo: Vec<(Ev, u64)>,
    /// Per worker: how long its pulls and pushes waited in limbo (on a shard it could not
    /// reach), added up.
    unreachable_ns: Vec<u64>,
    /// The coordinator's decisions (`control.rs`).
    coord: CoordinatorMachine,
    /// Per worker: the shards that answered its first join; it starts once all have.
    joins: Vec<u32>,
    /// Per worker: started.
    started: Vec<bool>,
    /// Setting up: workers start once every join has been asked.
    starting: bool,
    /// Per shard: how many times it moved (its promotions).
    term: Vec<u32>,
    /// Per worker, per shard: the moves it has heard of (it addresses the primary of that term).
    known: Vec<Vec<u32>>,
    /// Per worker, per shard: what the shard's numbering of the worker's iterations adds to the
    /// worker's own, changed when a new primary that had dropped the worker takes it back (as
    /// `WorkerClient` renumbers, see [`Joined::Fresh`](crate::shard::Joined::Fresh)).
    renumbered: Vec<Vec<i64>>,
    /// The hot swap under way: its number, module and configuration.
    swapping: Option<Swapping>,
    /// Each swap's module and configuration (by its number; 0: the first policy), as a
    /// coordinator knows them: the policy it records is the one its machine's swap count names.
    swap_modules: BTreeMap<u64, (PolicyModule, Vec<(String, String)>)>,
    /// The clocks servers prepared a swap with, by the preparation's command, until the answer
    /// reaches the coordinator.
    prepared: BTreeMap<u64, Vec<WorkerClock>>,
    /// The policy modules the run may use (the first and those swapped to).
    modules: Vec<PolicyModule>,
    /// Draws the delays of the coordinator's notices ([`SimFaults::notice_delay_ns`]).
    rng: rand_chacha::ChaCha8Rng,
    /// When the coordinator's next lease check is scheduled.
    coord_timer_at: Option<u64>,
    /// Per server: its own view of its lease.
    leases: Vec<ServerLease>,
    /// Per server: whether its messages to the coordinator, and the coordinator's to it, are
    /// lost (a partition).
    cut_to: Vec<bool>,
    cut_from: Vec<bool>,
    /// Per server: commands and answers a partition holds up until it heals.
    held: Vec<Vec<Ev>>,
    /// Per shard: the server of the primary it was promoted from, while that one lives.
    zombie_of: Vec<Option<u32>>,
    /// Per server: the shards it was primary of when they were promoted away from it, with
    /// their term then (what it would claim to a restarted coordinator).
    claims: Vec<BTreeMap<u32, u64>>,
    /// Per server: the swaps it committed, and what the last raised the clocks by.
    committed: Vec<(u64, Vec<ClockRaise>)>,
    /// Per server: the shards' terms its last lease answer on the way says, and the newest
    /// each answer that reached it said (what it tells a restarted coordinator).
    answer_terms: Vec<Vec<u64>>,
    known_terms: Vec<Vec<u64>>,
    /// Whether the coordinator runs, is down, or is rebuilding after a restart.
    coord_phase: control::Phase,
    /// The coordinator's incarnation: bumped when it crashes, so its old commands' answers are
    /// dropped.
    incarnation: u32,
    /// What its rebuilds did.
    rebuild: RebuildCounts,
    /// The shards' terms the crashed coordinator recorded ([`SimFaults::crash_keeps_terms`]).
    recorded_terms: Vec<u64>,
    /// Per pair of nodes (the lower index first): until when the link is cut ([`SimLinkCut`]).
    cut_links: BTreeMap<(usize, usize), u64>,
    /// Per direction of a link that was cut: when what was sent on it last leaves, so that
    /// what waited for the heal goes in order.
    pipes: BTreeMap<(usize, usize), u64>,
    /// The first time a server accepted a push for a shard another server had been promoted to.
    two_primaries: Option<String>,
    /// The first time a backup that had applied every op of its primary's differed from it.
    drift: Option<String>,
    /// Checkpoint rounds begun, by number ([`SimFaults::checkpoints`]).
    rounds: BTreeMap<u64, control::SimRound>,
    /// What became of the rounds.
    checkpoints: CheckpointCounts,
    /// Servers restarted that took their id back ([`SimFaults::server_restarts`]).
    restarted: u64,
    /// The restarts to come ([`SimFaults::server_restarts`]), each marked once its server has
    /// died (under way); one leaves once its server took its id back.
    restarts: Vec<(SimRestart, bool)>,
    /// Servers killed after another's restart ([`SimRestart::then_kill`]).
    killed_after_restart: u64,
    /// Per shard: the epoch of the stream its primary took as a backup, if it was promoted
    /// (what its old primary sent on that stream still reaches it).
    promoted_epoch: Vec<Option<u32>>,
    /// Ops from a deposed primary that reached the backup it had, promoted since.
    stale_ops: u64,
    /// Swaps a server refused at their preparation (a shard's policy state refused).
    swaps_refused: u64,
    /// Hot swaps that ended (committed, refused or partly committed) before the run did.
    swaps_ended: u64,
    /// Promoted primaries that switched to the policy their server records
    /// ([`ShardNode::conform`]).
    conformed: u64,
}

/// A finished simulation.
#[derive(Debug)]
pub struct Simulated {
    /// The same report a real run writes (its `model_file` is empty until the model is saved).
    pub report: RunReport,
    /// The final parameters, every shard's in order (one value per shard without gradients).
    pub model: Vec<f32>,
    /// Events handled: a [`SimFailure`] can name any of them.
    pub events: u64,
    /// A hash of every event the run's queue delivered, in order, with its time: the same for
    /// every run of the same case, in any process (the determinism test compares it).
    pub trace: u64,
    /// Where a backup differed from its primary: at any point where it had applied every op its
    /// primary had (parameters, version or the clocks' view), or, at the end, once the ops on their way
    /// have reached it (their whole snapshots); `None` when every backup always equalled its
    /// primary.
    pub replicas_differ: Option<String>,
    /// The first time a server accepted a push for a shard after another server had been
    /// promoted to it (two primaries in one term); `None` when that never happened.
    pub two_primaries: Option<String>,
    /// Messages that reached a shard's primary or backup a second time
    /// ([`SimFaults::duplicate`]).
    pub duplicates: u64,
    /// Bad requests the shards refused ([`SimFaults::bad_inputs`]).
    pub bad_inputs: u64,
    /// What a restarted coordinator's rebuild did ([`SimFaults::coordinator_crash`]).
    pub rebuild: RebuildCounts,
    /// What became of the checkpoint rounds ([`SimFaults::checkpoints`]).
    pub checkpoints: CheckpointCounts,
    /// Servers restarted that took their id back ([`SimFaults::server_restarts`]).
    pub restarts: u64,
    /// Servers killed after another's restart ([`SimRestart::then_kill`]) while the run went on.
    pub killed_after_restart: u64,
    /// Ops from a deposed primary (a stale term) that reached its old backup after that backup
    /// was promoted, each ignored.
    pub stale_ops: u64,
    /// Where, at the end, a live primary ran another policy than the one its coordinator records
    /// (the module of its last committed swap); `None` when every one ran the recorded policy.
    pub policy_differs: Option<String>,
    /// Preparations of a swap a server refused because a shard's state was refused.
    pub swaps_refused: u64,
    /// Hot swaps that ended before the run did (one drawn near its end may not have).
    pub swaps_ended: u64,
    /// The most time a worker's pulls and pushes waited on shards it could not reach (sent to
    /// a dead primary, or lost with it, until the worker heard of the move), added up.
    pub unreachable_ns: u64,
    /// Promoted primaries that switched to the policy their server records (their old primary
    /// died before it streamed a swap's commit).
    pub conformed: u64,
}

/// What became of a run's checkpoint rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointCounts {
    /// Rounds taken (and checked).
    pub taken: u64,
    /// Rounds abandoned: a shard's snapshot could not be written (its primary died, or had
    /// moved, when the command arrived).
    pub abandoned: u64,
    /// Rounds the coordinator would not begin then (a swap, a failover or a rebuild under way,
    /// or it was down).
    pub refused: u64,
}

impl std::ops::AddAssign for CheckpointCounts {
    fn add_assign(&mut self, o: Self) {
        self.taken += o.taken;
        self.abandoned += o.abandoned;
        self.refused += o.refused;
    }
}

/// What restarted coordinators' rebuilds did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebuildCounts {
    /// Rebuilds.
    pub rebuilds: u64,
    /// Backups promoted because their primary did not rejoin.
    pub promoted: u64,
    /// Servers refused: stale (failed over before the crash) or too late to rejoin.
    pub refused: u64,
    /// Servers told to commit a swap that others had committed before the crash.
    pub swaps_finished: u64,
}

impl std::ops::AddAssign for RebuildCounts {
    fn add_assign(&mut self, o: Self) {
        self.rebuilds += o.rebuilds;
        self.promoted += o.promoted;
        self.refused += o.refused;
        self.swaps_finished += o.swaps_finished;
    }
}

include!(concat!(env!("OUT_DIR"), "/hostile_policy.rs"));

/// The name by which a [`PolicySpec`](crate::builtin::PolicySpec) given to the simulator
/// names the fault search's misbehaving module (`tests/hostile-policy`, built into the binary):
/// `simtest:hostile:mode=push:trap,after=40` behaves as BSP for 40 events, then traps on every
/// push. Its modes: `pull:` or `push:`, then `trap`, `loop` (burns its fuel) or `panic`. It is
/// no policy anyone runs, so only `syncopate simtest` names it.
pub const HOSTILE: &str = "simtest:hostile";

/// Compiles the module `spec` names: a built-in, a file, or [`HOSTILE`].
fn load(spec: &crate::builtin::PolicySpec, rt: &PolicyRuntime) -> Result<PolicyModule, SimError> {
    let module = match spec.source == HOSTILE {
        true => rt.compile(HOSTILE, HOSTILE_WASM),
        false => spec.load(rt),
    };
    module.map_err(|e| SimError::Policy(spec.to_string(), e))
}

/// Runs the scenario under the policy.
pub fn simulate(opts: &SimOptions, rt: &PolicyRuntime) -> Result<Simulated, SimError> {
    let (sc, policy) = (&opts.run.scenario, &opts.run.policy);
    if let Some(script) = sc.script.first() {
        return Err(SimError::Script(script.clone()));
    }
    let n = sc.workers;
    let shards_n = opts.run.shards();
    let module = load(policy, rt)?;
    let mut swaps = Vec::new();
    for (at, spec) in &opts.faults.swaps {
        swaps.push((*at, load(spec, rt)?, spec.config.clone()));
    }
    let modules: Vec<PolicyModule> =
        std::iter::once(module.clone()).chain(swaps.iter().map(|s| s.1.clone())).collect();
    let data = opts.data.clone().unwrap_or_else(|| syncopate_workloads::fashion::DEFAULT_DIR.into());
    let wopts = sc.workload_options(&data);
    let (workloads, evaluator) = if opts.gradients {
        let w = syncopate_workloads::for_parts(&sc.workload, &wopts, n)?;
        (w, Evaluator::for_workload(&sc.workload, &wopts)?)
    } else {
        (Vec::new(), None)
    };
    // Without gradients the shards hold one value each, but transfers keep the model's size.
    let len = syncopate_workloads::param_len(&sc.workload, &wopts)
        .ok_or_else(|| syncopate_workloads::WorkloadError::Unknown(sc.workload.clone()))?;
    let model: Vec<f32> = match workloads.first() {
        Some(w) => w.init_params(sc.seed),
        None => vec![0.0; shards_n as usize],
    };
    let ranges: Vec<(usize, usize)> = (0..shards_n as usize)
        .map(|i| (len * i / shards_n as usize, len * (i + 1) / shards_n as usize))
        .collect();
    let held = |i: usize| if opts.gradients { ranges[i] } else { (i, i + 1) };
    let mut quiet = Quiet;
    // The scenario's rules (replicas 0 or 1, and 1 only with two servers), then the failure's.
    sc.check().map_err(SimError::Options)?;
    let failures: Vec<SimFailure> = match &opts.failures[..] {
        [] => SimFailure::of(sc).into_iter().collect(),
        given => given.to_vec(),
    };
    if let Some((w, _)) = opts.faults.worker_deaths.iter().find(|(w, _)| *w >= n) {
        return Err(SimError::Options(format!("worker {w} does not exist")));
    }
    for c in &opts.faults.link_cuts {
        let exists = |e: Node| match e {
            Node::Worker(w) => w < n,
            Node::Server(x) => x < sc.servers,
        };
        let workers = matches!((c.a, c.b), (Node::Worker(_), Node::Worker(_)));
        if !exists(c.a) || !exists(c.b) || workers || c.a == c.b {
            return Err(SimError::Options(format!("no link between {:?} and {:?}", c.a, c.b)));
        }
        if c.heal_after_ns >= PEER_TIMEOUT_NS {
            return Err(SimError::Options("a cut link heals within the peer timeout (10 s)".into()));
        }
    }
    let struck = failures.iter().map(|f| f.server).chain(opts.faults.partitions.iter().map(|p| p.server));
    let restarts = opts.faults.server_restarts.iter();
    let struck =
        struck.chain(restarts.flat_map(|r| std::iter::once(r.server).chain(r.then_kill.map(|k| k.0))));
    for server in struck {
        if sc.replicas == 0 {
            return Err(SimError::Options("a server failure needs replicas 1".into()));
        }
        if server >= sc.servers {
            return Err(SimError::Options(format!("server {server} does not exist")));
        }
    }
    let backup_of: Vec<Option<u32>> =
        (0..shards_n).map(|s| crate::net::proto::backup_server(s, sc.servers, sc.replicas)).collect();
    let mut backups = Vec::new();
    let mut shards = Vec::new();
    let mut node_cfgs = Vec::new();
    for (i, backed) in backup_of.iter().enumerate() {
        let (lo, hi) = held(i);
        let cfg = ShardConfig {
            shard: i as u32,
            shards: shards_n,
            seed: sc.seed,
            optimizer: sc.server_optimizer(),
            local_sgd: sc.local_sgd(),
            pull_codec: sc.codecs().1,
            push_weight: sc.push_weight.unwrap_or_default(),
            max_workers: sc.workers.max(crate::shard::DEFAULT_MAX_WORKERS),
            supervisor: sc.supervisor(),
        };
        let config = opts.run.shard_config(i as u32);
        let node_cfg = NodeConfig { shard: cfg, rejoin_grace_ns: REJOIN_GRACE_NS, quiet: true };
        node_cfgs.push(node_cfg.clone());
        let start = |backup: bool, quiet: &mut Quiet| {
            // Each created as its shard is, from the same parameters: the ops keep them equal.
            let mut node = ShardNode::new(node_cfg.clone(), module.clone(), config.clone(), backup);
            node.create(model[lo..hi].to_vec(), quiet)
                .map_err(|e| SimError::Policy(policy.to_string(), e))?;
            Ok::<_, SimError>(node)
        };
        let mut primary = start(false, &mut quiet)?;
        if backed.is_some() {
            backups.push(Some(start(true, &mut quiet)?));
            // Attached before the first op: the backup starts as the primary did.
            primary.attach_backup(0, &mut quiet).map_err(|e| SimError::Options(e.to_string()))?;
        } else {
            backups.push(None);
        }
        shards.push(primary);
    }
    let mut workloads = workloads.into_iter();
    let mut workers = Vec::new();
    for w in 0..n {
        let mut workload = workloads.next();
        let (mut bufs, can_split) =
            Buffers::for_workload(workload.as_deref_mut().map(|x| x as &mut dyn Workload), w);
        if let Some(o) = sc.worker_optimizer() {
            bufs.place_optimizer(o);
        }
        bufs.set_inner_optimizer(sc.optimizer());
        let device = Device {
            compute_ns: sc.compute_ms.max(1) * 1_000_000,
            slow_factor: sc.slow.iter().find(|s| s.worker == w).map_or(1.0, |s| s.factor),
            jitter_ms: sc.jitter.iter().find(|j| j.worker == w).map(|j| (j.mean_ms, j.sd_ms)),
            stall_ns: sc
                .stall
                .iter()
                .find(|s| s.worker == w)
                .map(|s| ((s.at_s * 1e9) as u64, (s.for_s * 1e9) as u64)),
            seed: sc.seed ^ (u64::from(w) << 40) ^ 0x5eed,
            granularity_ns: 0,
        };
        let cfg = WorkerConfig {
            id: w,
            start: 0,
            iterations: sc.iterations_or_unbounded(),
            batch: sc.batch,
            part: w,
            can_split,
            numbering_shared: true,
            device,
        };
        let machine = WorkerMachine::new(cfg, 0).map_err(|e| SimError::Worker(w, e))?;
        workers.push(SimWorker {
            cfg,
            absent: opts.faults.late_join.iter().any(|l| l.0 == w),
            joining: None,
            machine,
            bufs,
            workload,
            replies: 0,
            replies_at: 0,
            deferred: false,
            deferred_ns: 0,
            local_steps: 0,
            encoder: PushEncoder::new(w, shards_n as usize, sc.codecs().0),
            encoded: vec![None; shards_n as usize],
            based_on: vec![None; shards_n as usize],
            own: None,
            help: None,
            own_acked: vec![false; shards_n as usize],
            help_acked: vec![false; shards_n as usize],
            pulling: None,
            replied: vec![false; shards_n as usize],
            wake_at: None,
            done: false,
            dead: false,
            gone: false,
        });
    }
    // The coordinator: every server registers and is answered, and the backups made above are
    // the ones it has attached.
    let mut coord = CoordinatorMachine::new(CoordinatorConfig {
        servers: sc.servers,
        shards: shards_n,
        replicas: sc.replicas,
        max_workers: n.max(crate::shard::DEFAULT_MAX_WORKERS),
        peer_timeout_ms: PEER_TIMEOUT_NS / 1_000_000,
    });
    for _ in 0..sc.servers {
        coord.register_server(0).map_err(|e| SimError::Options(e.to_string()))?;
        coord.server_answered();
    }
    while let Some(out) = coord.poll_output() {
        if let CoordOutput::Command { id, .. } = out {
            coord.command_done(id, Ok(Answer::Done));
        }
    }
    let places: Vec<Option<u32>> = coord.places().iter().map(|p| p.backup).collect();
    assert_eq!(places, backup_of, "the simulator's backups are where the coordinator puts them");
    // The simulated servers are ready at once: their first renewals are in at time 0 (a cluster's
    // come once each has compiled the policy).
    for x in 0..sc.servers {
        coord.renew(0, x).map_err(|e| SimError::Options(e.to_string()))?;
    }
    for w in 0..n {
        coord.admit_worker(Some(w), len as u64).map_err(|e| SimError::Options(e.to_string()))?;
    }
    let nodes = (n + sc.servers) as usize;
    let mbit = sc.bandwidth_mbit.unwrap_or(10_000.0);
    let n_workers = workers.len();
    let mut sim = Sim {
        opts: opts.clone(),
        now: 0,
        queue: Queue::default(),
        server_of: (0..shards_n).map(|s| s % sc.servers).collect(),
        nodes: shards,
        node_cfgs,
        ranges,
        requests: BTreeMap::new(),
        next_token: 0,
        workers,
        evaluator,
        up: vec![Link::default(); nodes],
        down: vec![Link::default(); nodes],
        timer_at: vec![None; shards_n as usize],
        controls: Mailbox::default(),
        to_shard: Mailbox::default(),
        copies: Mailbox::default(),
        duplicates: 0,
        bad_inputs: 0,
        done: 0,
        watch: Vec::new(),
        stopping: false,
        time_to_target: None,
        bytes_per_ns: mbit * 1e6 / 8.0 / 1e9,
        latency_ns: sc.latency_us * 1000,
        epoch: vec![0; shards_n as usize],
        backups,
        backup_of,
        replication: Mailbox::default(),
        dead: vec![false; sc.servers as usize],
        lost: Vec::new(),
        limbo: Vec::new(),
        unreachable_ns: vec![0; n_workers],
        coord,
        coord_timer_at: None,
        joins: vec![0; n as usize],
        started: vec![false; n as usize],
        starting: true,
        term: vec![0; shards_n as usize],
        known: vec![vec![0; shards_n as usize]; n as usize],
        renumbered: vec![vec![0; shards_n as usize]; n as usize],
        rng: rand::SeedableRng::seed_from_u64(sc.seed ^ 0x0071_ce00_0036),
        swapping: None,
        swap_modules: BTreeMap::from([(0, (module.clone(), policy.config.clone()))]),
        prepared: BTreeMap::new(),
        modules,
        leases: vec![ServerLease::new(0); sc.servers as usize],
        cut_to: vec![false; sc.servers as usize],
        cut_from: vec![false; sc.servers as usize],
        held: vec![Vec::new(); sc.servers as usize],
        zombie_of: vec![None; shards_n as usize],
        claims: vec![BTreeMap::new(); sc.servers as usize],
        committed: vec![(0, Vec::new()); sc.servers as usize],
        answer_terms: vec![Vec::new(); sc.servers as usize],
        known_terms: vec![Vec::new(); sc.servers as usize],
        coord_phase: control::Phase::Up,
        incarnation: 0,
        rebuild: RebuildCounts::default(),
        recorded_terms: Vec::new(),
        cut_links: BTreeMap::new(),
        pipes: BTreeMap::new(),
        two_primaries: None,
        drift: None,
        rounds: BTreeMap::new(),
        checkpoints: CheckpointCounts::default(),
        restarted: 0,
        restarts: opts.faults.server_restarts.iter().map(|&r| (r, false)).collect(),
        killed_after_restart: 0,
        promoted_epoch: vec![None; shards_n as usize],
        stale_ops: 0,
        swaps_refused: 0,
        swaps_ended: 0,
        conformed: 0,
    };
    sim.start_control();
    // Each worker joins every shard, and starts once all have answered (with backups, once
    // its join is on the backup too).
    for s in 0..shards_n {
        for w in 0..n {
            if sim.workers[w as usize].absent {
                continue;
            }
            let token = sim.token(Req::Join { w, s, again: false });
            sim.nodes[s as usize].join(0, token, w, Vec::new(), &mut Quiet);
            sim.drain(s)?;
        }
    }
    sim.starting = false;
    for w in 0..n {
        if sim.joins[w as usize] == shards_n {
            sim.start(w)?;
        }
    }
    // Training starts once every worker has joined: what it takes (with backups, the joins'
    // way to the backups and back) comes before the first event a failure can name, as a
    // cluster's workers start only once they are in (a death while they join fails their join).
    while sim.started.iter().zip(&sim.workers).any(|(s, w)| !s && !w.absent) {
        let Some((t, ev)) = sim.queue.pop() else { break };
        sim.now = t;
        sim.handle(ev)?;
    }
    sim.at(sc.eval_every_ms * 1_000_000, Ev::Watch);
    let mut stopped_at = None;
    let mut handled = 0u64;
    let mut failures = failures;
    let mut partitions = opts.faults.partitions.clone();
    let mut worker_deaths = opts.faults.worker_deaths.clone();
    let mut swaps = swaps;
    let mut late_join = opts.faults.late_join.clone();
    let mut crash = opts.faults.coordinator_crash;
    let mut link_cuts = opts.faults.link_cuts.clone();
    let mut checkpoints = opts.faults.checkpoints.clone();
    // A fault at a time comes at that time, not at the next event after it: a tick marks it (so
    // a crash drawn a few latencies after a swap lands inside its two phases).
    let times = failures.iter().map(|f| f.at).chain(partitions.iter().map(|p| p.at));
    let times = times.chain(worker_deaths.iter().map(|d| d.1)).chain(swaps.iter().map(|s| s.0));
    let times = times.chain(late_join.iter().map(|l| l.1)).chain(crash.map(|c| c.0));
    let times = times.chain(checkpoints.iter().copied());
    for at in times.chain(link_cuts.iter().map(|c| c.at)) {
        if let FailAt::Time(t) = at {
            sim.at(t.max(sim.now), Ev::Tick);
        }
    }
    let mut progress_at = 0;
    while let Some((t, ev)) = sim.queue.pop() {
        sim.now = t;
        while let Some(k) = failures.iter().position(|f| f.due(handled, t)) {
            sim.kill(failures.remove(k).server);
        }
        while let Some(k) = partitions.iter().position(|p| p.at.due(handled, t)) {
            sim.cut(partitions.remove(k));
        }
        while let Some(k) = worker_deaths.iter().position(|d| d.1.due(handled, t)) {
            sim.kill_worker(worker_deaths.remove(k).0);
        }
        while let Some(k) = swaps.iter().position(|d| d.0.due(handled, t)) {
            let (_, module, config) = swaps.remove(k);
            sim.swap(module, config)?;
        }
        while let Some(k) = late_join.iter().position(|l| l.1.due(handled, t)) {
            sim.late_join(late_join.remove(k).0)?;
        }
        while let Some(k) = link_cuts.iter().position(|c| c.at.due(handled, t)) {
            let c = link_cuts.remove(k);
            tracing::debug!(a = ?c.a, b = ?c.b, t_ns = t, "link cut");
            let (a, b) = (sim.node_index(c.a), sim.node_index(c.b));
            let until = sim.cut_links.entry((a.min(b), a.max(b))).or_default();
            *until = (*until).max(t + c.heal_after_ns);
        }
        while let Some(k) = checkpoints.iter().position(|c| c.due(handled, t)) {
            checkpoints.remove(k);
            sim.checkpoint()?;
        }
        if let Some((_, down_ns)) = crash.filter(|c| c.0.due(handled, t)) {
            crash = None;
            sim.crash_coordinator(down_ns);
        }
        handled += 1;
        if !ev.is_clockwork() {
            progress_at = t;
        } else if t - progress_at > STALL_NS {
            tracing::warn!(
                "simulation ended: nothing but lease renewals and observations for {} s of virtual time",
                STALL_NS / 1_000_000_000
            );
            break;
        }
        sim.handle(ev)?;
        if sim.done == sim.workers.len() && sim.nodes.iter().all(|s| sim_shard(s).view().workers == 0) {
            break;
        }
        // A policy that never answers a worker would keep the run going: after the budget, give
        // the stragglers a minute of virtual time to finish, then end the run as it stands.
        if sim.stopping {
            let since = *stopped_at.get_or_insert(t);
            if t.saturating_sub(since) > 60_000_000_000 {
                tracing::warn!("simulation ended a minute after its budget with workers still waiting");
                break;
            }
        }
    }
    let model = sim.model();
    let (policy_differs, swaps_refused, conformed) = (sim.policy_differs(), sim.swaps_refused, sim.conformed);
    let swaps_ended = sim.swaps_ended;
    let unreachable_ns = sim.unreachable_ns.iter().copied().max().unwrap_or(0);
    let replicas_differ = match sim.drift.take() {
        Some(drift) => Some(drift),
        None => sim.replicas_differ()?,
    };
    let (two_primaries, duplicates, bad_inputs) = (sim.two_primaries.take(), sim.duplicates, sim.bad_inputs);
    let (rebuild, checkpoints, restarts) = (sim.rebuild, sim.checkpoints, sim.restarted);
    let (killed_after_restart, stale_ops, trace) =
        (sim.killed_after_restart, sim.stale_ops, sim.queue.trace());
    Ok(Simulated {
        report: sim.report(),
        model,
        events: handled,
        trace,
        replicas_differ,
        two_primaries,
        duplicates,
        bad_inputs,
        rebuild,
        checkpoints,
        restarts,
        killed_after_restart,
        stale_ops,
        policy_differs,
        swaps_refused,
        swaps_ended,
        unreachable_ns,
        conformed,
    })
}

impl Sim {
    fn at(&mut self, t: u64, ev: Ev) {
        self.queue.push(t, ev);
    }

    /// A transfer of `bytes` from node `from` to node `to` starting now; returns its arrival
    /// (held until a cut link heals: [`SimLinkCut`], which holds up no other link).
    fn transfer(&mut self, from: usize, to: usize, bytes: u64) -> u64 {
        let start = self.now.max(self.up[from].free_ns).max(self.down[to].free_ns);
        let takes = (bytes as f64 / self.bytes_per_ns) as u64;
        let end = start + takes;
        self.up[from].free_ns = end;
        self.down[to].free_ns = end;
        self.up[from].bytes += bytes;
        self.down[to].bytes += bytes;
        self.through_cut(from, to, end, takes) + self.latency_ns
    }

    /// When a message that would leave node `from` for node `to` at `end` (taking `takes` on the
    /// wire) leaves it, if their link was ever cut ([`SimLinkCut`]): not before the link heals,
    /// and after what was sent on it before.
    fn through_cut(&mut self, from: usize, to: usize, end: u64, takes: u64) -> u64 {
        if self.cut_links.is_empty() {
            return end;
        }
        let Some(&until) = self.cut_links.get(&(from.min(to), from.max(to))) else { return end };
        let pipe = self.pipes.entry((from, to)).or_default();
        let out = end.max(until + takes).max(*pipe + takes);
        *pipe = out;
        out
    }

    /// When a message without tensors sent now from node `from` reaches node `to`.
    fn after_latency(&mut self, from: usize, to: usize) -> u64 {
        self.through_cut(from, to, self.now, 0) + self.latency_ns
    }

    /// A node's index: the workers first, then the servers.
    fn node_index(&self, n: Node) -> usize {
        match n {
            Node::Worker(w) => w as usize,
            Node::Server(x) => self.workers.len() + x as usize,
        }
    }

    fn server_node(&self, shard: u32) -> usize {
        self.workers.len() + self.server_of[shard as usize] as usize
    }

    fn shard_bytes(&self, shard: u32) -> u64 {
        self.coded_bytes(shard, Codec::None)
    }

    /// What shard `shard`'s tensor costs on the wire in `codec`, a message's 64 bytes of
    /// headers included (a modelled model's bytes scaled as the codec scales the workload's).
    fn coded_bytes(&self, shard: u32, codec: Codec) -> u64 {
        let (lo, hi) = self.ranges[shard as usize];
        let n = hi - lo;
        match &self.opts.run.scenario.modelled {
            // The modelled model's bytes, split over the shards as the workload's are.
            Some(m) => {
                let total = self.ranges.last().map_or(1, |r| r.1).max(1) as u64;
                let ratio = codec::wire_len(codec, n) as f64 / (4 * n.max(1)) as f64;
                (m.bytes as f64 * n as f64 / total as f64 * ratio) as u64 + 64
            }
            None => codec::wire_len(codec, n) as u64 + 64,
        }
    }

    /// Encodes worker `w`'s own push `job` for shard `s` as its client would (with error
    /// feedback), keeps what the shard will decode, and returns the bytes on the wire.
    fn encode_push(&mut self, w: u32, s: u32, job: &PushJob) -> u64 {
        let (lo, hi) = self.ranges[s as usize];
        let wk = &mut self.workers[w as usize];
        wk.encoded[s as usize] = None;
        if !self.opts.gradients {
            let codec = wk.encoder.codec(s as usize, job.iteration);
            return self.coded_bytes(s, codec);
        }
        let mut out = Vec::new();
        match wk.encoder.encode(s as usize, job.iteration, &wk.bufs.grad[lo..hi], &mut out) {
            Encoded::Raw => self.shard_bytes(s),
            Encoded::Bytes(Codec::None) => {
                wk.encoded[s as usize] = Some(bytemuck::cast_slice(&out).to_vec());
                self.shard_bytes(s)
            }
            Encoded::Bytes(c) => {
                let mut decoded = Vec::new();
                codec::decode(c, &out, hi - lo, &mut decoded).expect("our own encoding decodes");
                wk.encoded[s as usize] = Some(decoded);
                self.coded_bytes(s, c)
            }
        }
    }

    /// Where a live primary runs another policy than the coordinator records (the module of the
    /// swap its machine counts last, or of the swap whose commit is under way, for a run that
    /// ended during it), once the coordinator is up.
    fn policy_differs(&self) -> Option<String> {
        if self.coord_phase != control::Phase::Up {
            return None;
        }
        let (recorded, _) = self.swap_modules.get(&self.coord.swaps())?;
        // A run that ended during a swap's commit: a shard may have taken it already.
        let committing = self.coord.committing().and_then(|n| self.swap_modules.get(&n));
        for (k, node) in self.nodes.iter().enumerate() {
            if self.dead[self.server_of[k] as usize] {
                continue;
            }
            let sha = node.module().sha256();
            if sha != recorded.sha256() && committing.is_none_or(|(m, _)| sha != m.sha256()) {
                return Some(format!(
                    "shard {k} runs {}, but the coordinator records {} (swap {})",
                    node.module().display_name(),
                    recorded.display_name(),
                    self.coord.swaps()
                ));
            }
        }
        None
    }

    /// Lets the ops still on their way reach the live backups (nothing else happens), then says
    /// where a live backup differs from its primary. The run's time is left where it ended.
    fn replicas_differ(&mut self) -> Result<Option<String>, SimError> {
        let end = self.now;
        while let Some((t, ev)) = self.queue.pop() {
            if let Ev::Replicate(..) = ev {
                self.now = t;
                self.handle(ev)?;
            }
        }
        self.now = end;
        for (k, backup) in self.backups.iter_mut().enumerate() {
            let (Some(backup), Some(b)) = (backup.as_mut(), self.backup_of[k]) else { continue };
            if self.dead[b as usize] || self.dead[self.server_of[k] as usize] {
                continue;
            }
            // The whole state, policy included: both snapshots taken at the same time.
            let snap = |n: &mut ShardNode| n.snapshot(end).map(|s| s.encode()).map_err(|e| e.to_string());
            let (ps, qs) = (snap(&mut self.nodes[k]), snap(backup));
            let (p, q) = (sim_shard(&self.nodes[k]), sim_shard(backup));
            if ps != qs && bits_equal(p, q) && p.version() == q.version() && p.workers() == q.workers() {
                return Ok(Some(format!(
                    "shard {k}: its backup on server {b} has the primary's parameters, version and members, \
                     but not its whole state (policy, pending requests or counters)"
                )));
            }
            if !bits_equal(p, q) || p.version() != q.version() || p.workers() != q.workers() {
                return Ok(Some(format!(
                    "shard {k}: its backup on server {b} is at version {} with members {:?}, its primary at {} with {:?}{}",
                    q.version(),
                    q.workers(),
                    p.version(),
                    p.workers(),
                    if bits_equal(p, q) { "" } else { ", and their parameters differ" }
                )));
            }
        }
        Ok(None)
    }

    /// A token for a request to a shard.
    /// How shard `s` numbers worker `w`'s iteration `iteration`.
    fn numbered(&self, w: WorkerId, s: u32, iteration: u64) -> u64 {
        iteration.saturating_add_signed(self.renumbered[w as usize][s as usize])
    }

    fn token(&mut self, req: Req) -> Token {
        self.next_token += 1;
        self.requests.insert(self.next_token, req);
        self.next_token
    }

    /// Carries out what shard `s`'s primary said.
    fn drain(&mut self, s: u32) -> Result<(), SimError> {
        while let Some(out) = self.nodes[s as usize].poll_output() {
            match out {
                NodeOutput::Reply { token, reply } => {
                    let Some(req) = self.requests.remove(&token) else { continue };
                    match (req, reply) {
                        (Req::Ignore { .. }, _) => {}
                        (Req::Bad { s, what }, reply) => {
                            let accepted = match reply {
                                Reply::Joined(r) => r.is_ok(),
                                // A push the shard already has is acknowledged as the
                                // duplicate it is, whatever it holds: nothing is applied.
                                Reply::Pushed(r) => r.is_ok_and(|o| o != PushOutcome::Duplicate),
                                Reply::Pulled(r) => r.is_ok(),
                                Reply::Done(r) => r.is_ok(),
                            };
                            if accepted {
                                return Err(SimError::AcceptedBad(s, what));
                            }
                        }
                        (Req::Pull { w, iteration, .. }, Reply::Pulled(Ok(served))) => {
                            self.served(s, w, iteration, served)
                        }
                        (Req::Join { w, .. }, Reply::Joined(Ok(joined)))
                            if self.workers[w as usize].joining.is_some() =>
                        {
                            let at = match joined {
                                Joined::Fresh { clock, .. } => (clock, clock),
                                Joined::Rejoined { next, clock } => (next, clock),
                            };
                            self.joined_late(w, s, at)?;
                        }
                        (Req::LateSkip { .. }, Reply::Done(Err(e))) => {
                            return Err(SimError::Refused(s, e.to_string()))
                        }
                        (Req::LateSkip { w, s }, Reply::Done(Ok(()))) => self.skipped_late(w, s)?,
                        (Req::Join { w, again, .. }, Reply::Joined(Ok(joined))) => {
                            if let (true, Joined::Fresh { clock, next }) = (again, joined) {
                                // A new primary that had dropped it: its numbering there moves.
                                self.renumbered[w as usize][s as usize] += clock as i64 - next as i64;
                                tracing::debug!(worker = w, shard = s, next, clock, "taken back afresh");
                            }
                            self.joins[w as usize] += 1;
                            if !self.starting && self.joins[w as usize] == self.nodes.len() as u32 {
                                self.start(w)?;
                            }
                        }
                        // The worker left while its pull waited: nobody is left to answer.
                        (Req::Pull { .. }, Reply::Pulled(Err(RequestError::Left(..)))) => {}
                        (Req::Push { w, help, iteration, whole, .. }, Reply::Pushed(r)) => {
                            self.pushed(s, w, help, iteration, whole, r)?
                        }
                        (_, Reply::Pulled(Err(e)) | Reply::Joined(Err(e))) => {
                            return Err(SimError::Refused(s, e.to_string()))
                        }
                        _ => {}
                    }
                }
                NodeOutput::Replicate { stamped, payload } => self.replicate(s, stamped, payload),
                NodeOutput::Control { worker, msg } => {
                    let i = self.controls.post(msg, 1);
                    let t = self.after_latency(self.server_node(s), worker as usize);
                    self.at(t, Ev::Control(worker, i));
                }
                NodeOutput::Confirm { .. } | NodeOutput::Left { .. } => {}
            }
        }
        self.arm_timer(s);
        Ok(())
    }

    /// Shard `s` answers worker `w`'s pull for `iteration`.
    fn served(&mut self, s: u32, w: WorkerId, iteration: u64, served: Served) {
        let wk = &mut self.workers[w as usize];
        // The answer to a pull asked again after a failover, which the old primary had
        // answered already, changes nothing.
        if wk.pulling != Some(iteration) || std::mem::replace(&mut wk.replied[s as usize], true) {
            return;
        }
        wk.based_on[s as usize] = Some(served.version);
        wk.deferred |= served.waited_ns > 0;
        wk.deferred_ns = wk.deferred_ns.max(served.waited_ns);
        wk.local_steps = wk.local_steps.max(served.local_steps);
        if self.opts.gradients {
            let (lo, hi) = self.ranges[s as usize];
            let params = &mut wk.bufs.params[lo..hi];
            if served.codec == Codec::None {
                params.copy_from_slice(&served.values);
            } else {
                // What the worker's client decodes from the encoded reply.
                let (mut bytes, mut decoded) = (Vec::new(), Vec::new());
                codec::encode(served.codec, &served.values, None, &mut codec::Scratch::default(), &mut bytes);
                codec::decode(served.codec, &bytes, params.len(), &mut decoded)
                    .expect("our own encoding decodes");
                params.copy_from_slice(&decoded);
            }
        }
        let (from, bytes) = (self.server_node(s), self.coded_bytes(s, served.codec));
        let t = self.transfer(from, w as usize, bytes);
        // The worker goes on when the last reply arrives: one event at that time, not one
        // per shard (a fifth of a large run's events).
        let wk = &mut self.workers[w as usize];
        wk.replies += 1;
        wk.replies_at = wk.replies_at.max(t);
        if wk.replies == self.nodes.len() as u32 {
            let at = wk.replies_at;
            self.at(at, Ev::PullDone(w));
        }
    }

    /// Shard `s` answers worker `w`'s push (of moved tasks if `help`; of its own whole
    /// iteration if `whole`).
    fn pushed(
        &mut self,
        s: u32,
        w: WorkerId,
        help: bool,
        iteration: u64,
        whole: bool,
        r: Result<PushOutcome, RequestError>,
    ) -> Result<(), SimError> {
        match r {
            // A whole push's acknowledgement counts for the push still in flight (not one
            // answered before a failover).
            Ok(outcome) if whole => {
                let own = self.workers[w as usize].own.as_ref();
                if own.is_some_and(|p| p.job.tasks.is_none() && p.job.iteration == iteration) {
                    self.ack(w, s, false, outcome == PushOutcome::Dropped);
                }
            }
            Ok(_) => self.ack(w, s, help, false),
            Err(e) if help => {
                // The owner left meanwhile: its iteration is void, as on the cluster.
                tracing::debug!("moved tasks refused: {e}");
                if let Some(p) = self.workers[w as usize].help.as_mut() {
                    p.refused = Some(e);
                }
                self.ack(w, s, help, false);
            }
            Err(e) => return Err(SimError::Refused(s, e.to_string())),
        }
        Ok(())
    }

    /// Schedules shard `s`'s next timer, unless an earlier one is scheduled.
    fn arm_timer(&mut self, s: u32) {
        if let Some(t) = self.nodes[s as usize].poll_timeout() {
            if self.timer_at[s as usize].is_none_or(|at| t < at) {
                self.timer_at[s as usize] = Some(t);
                self.at(t.max(self.now), Ev::Timer(s));
            }
        }
    }

    /// Shard `s`'s acknowledgement of worker `w`'s push (`help`: of tasks moved to it) is on its
    /// way. Every acknowledgement takes the latency alone (after a cut link heals): the last to
    /// arrive becomes an event once all are sent.
    fn ack(&mut self, w: u32, s: u32, help: bool, dropped: bool) {
        let shards = self.nodes.len() as u32;
        let at = self.after_latency(self.server_node(s), w as usize);
        let wk = &mut self.workers[w as usize];
        let (slot, acked) =
            if help { (&mut wk.help, &mut wk.help_acked) } else { (&mut wk.own, &mut wk.own_acked) };
        let Some(p) = slot.as_mut() else { return };
        if std::mem::replace(&mut acked[s as usize], true) {
            return;
        }
        p.acks += 1;
        p.acks_at = p.acks_at.max(at);
        p.dropped += u32::from(dropped);
        if p.acks == shards {
            let at = p.acks_at;
            self.at(at, Ev::AckArrive(w, help));
        }
    }

    /// Shard `s`'s primary hands its backup an op: it crosses the servers' link.
    fn replicate(&mut self, s: u32, stamped: Stamped, payload: Vec<f32>) {
        let su = s as usize;
        let Some(b) = self.backup_of[su] else { return };
        let bytes = if matches!(stamped.op, Op::Push(_)) { self.shard_bytes(s) } else { 64 };
        let (from, to) = (self.server_node(s), self.workers.len() + b as usize);
        let t = self.transfer(from, to, bytes);
        let i = self.replication.post((self.epoch[su], stamped, payload), 1);
        self.at(t, Ev::Replicate(s, i));
    }

    /// An op from shard `s`'s deposed primary reaches the node it streamed to, now the shard's
    /// primary: it must change nothing and confirm nothing ([`SimError::AcceptedBad`] else).
    fn stale_op(&mut self, s: u32, stamped: Stamped, grad: Vec<f32>) -> Result<(), SimError> {
        // (Nothing is pending: every call is drained; this makes sure of it.)
        self.drain(s)?;
        let node = &mut self.nodes[s as usize];
        let (before, version) = (node.replication(), sim_shard(node).version());
        node.replicated(stamped, grad, |_| None, &mut Quiet);
        let answered = std::iter::from_fn(|| node.poll_output()).count();
        if answered > 0 || node.replication() != before || sim_shard(node).version() != version {
            return Err(SimError::AcceptedBad(s, "an op from its deposed primary (a stale term)"));
        }
        self.stale_ops += 1;
        Ok(())
    }

    /// Whether shard `s`'s primary is on a dead server (not yet failed over).
    fn down(&self, s: u32) -> bool {
        self.dead[self.server_of[s as usize] as usize]
    }

    /// Worker `w`'s process dies: nothing reaches it any more, and the run no longer waits for
    /// it; a peer timeout later, the servers make it leave their shards.
    fn kill_worker(&mut self, w: u32) {
        let wk = &mut self.workers[w as usize];
        if std::mem::replace(&mut wk.dead, true) {
            return;
        }
        tracing::debug!(worker = w, t_ns = self.now, "worker killed");
        if !wk.done {
            wk.done = true;
            self.done += 1;
        }
        self.at(self.now + PEER_TIMEOUT_NS, Ev::WorkerLost(w));
    }

    /// The servers' connections to dead worker `w` time out: it leaves every shard it is a
    /// member of.
    fn worker_lost(&mut self, w: u32) -> Result<(), SimError> {
        self.workers[w as usize].gone = true;
        for s in 0..self.nodes.len() as u32 {
            if !self.down(s) && sim_shard(&self.nodes[s as usize]).is_member(w) {
                self.nodes[s as usize].leave(self.now, None, w, LeaveReason::TimedOut, &mut Quiet);
                self.drain(s)?;
            }
        }
        Ok(())
    }

    /// Worker `w` has joined every shard: it starts (once).
    fn start(&mut self, w: u32) -> Result<(), SimError> {
        if std::mem::replace(&mut self.started[w as usize], true) || self.workers[w as usize].dead {
            return Ok(());
        }
        self.drive(w)
    }

    /// Feeds worker `w`'s machine an input, then carries out its actions.
    fn feed(&mut self, w: u32, input: Input) -> Result<(), SimError> {
        self.workers[w as usize].machine.handle(self.now, input).map_err(|e| SimError::Worker(w, e))?;
        self.drive(w)
    }

    /// Carries out every action worker `w`'s machine has, and sets its timer.
    fn drive(&mut self, w: u32) -> Result<(), SimError> {
        let shards = self.nodes.len() as u32;
        while let Some(action) = self.workers[w as usize].machine.poll_action(self.now) {
            match action {
                Action::Pull { iteration } => {
                    let wk = &mut self.workers[w as usize];
                    (wk.replies, wk.replies_at, wk.deferred, wk.deferred_ns) = (0, 0, false, 0);
                    wk.local_steps = 0;
                    wk.pulling = Some(iteration);
                    wk.replied.fill(false);
                    for s in 0..shards {
                        let t = self.transfer(w as usize, self.server_node(s), 64);
                        let t = self.reorder(t);
                        self.at(t, Ev::PullArrive(w, s, iteration));
                    }
                }
                Action::Compute(job) => {
                    let wk = &mut self.workers[w as usize];
                    let workload = wk.workload.as_deref_mut().map(|x| x as &mut dyn Workload);
                    let step = wk.bufs.compute(w, &job, workload);
                    wk.machine
                        .handle(self.now, Input::Computed { step, compute_ns: 0 })
                        .map_err(|e| SimError::Worker(w, e))?;
                }
                Action::Push(job) => {
                    let wk = &mut self.workers[w as usize];
                    if self.opts.gradients {
                        wk.bufs.gradient(&job);
                    }
                    let help = job.kind != JobKind::Own;
                    let (slot, acked) = if help {
                        (&mut wk.help, &mut wk.help_acked)
                    } else {
                        (&mut wk.own, &mut wk.own_acked)
                    };
                    *slot = Some(InFlight { job, acks: 0, acks_at: 0, refused: None, dropped: 0 });
                    acked.fill(false);
                    for s in 0..shards {
                        let bytes = if help { self.shard_bytes(s) } else { self.encode_push(w, s, &job) };
                        let t = self.transfer(w as usize, self.server_node(s), bytes);
                        let t = self.reorder(t);
                        self.at(t, Ev::PushArrive(w, s, help));
                    }
                }
                Action::Handover { shard, handover } => {
                    self.send(w, shard..shard + 1, ToShard::Handover(handover));
                }
                Action::Applied { shard, control, iteration } => {
                    if let Control::SetPushCodec { codec } = control {
                        self.workers[w as usize].encoder.set(shard as usize, codec, iteration);
                    }
                    let msg = ToShard::Applied(Applied { worker: w, control, iteration });
                    self.send(w, shard..shard + 1, msg);
                }
                Action::Finished(report) => self.send(w, 0..shards, ToShard::Finished(report)),
                Action::Skip { to, .. } => self.send(w, 0..shards, ToShard::Skip(to)),
                Action::Waiting { iteration, waiting } => {
                    self.send(w, 0..shards, ToShard::Waiting(iteration, waiting));
                }
                Action::Leave => self.send(w, 0..shards, ToShard::Goodbye),
            }
        }
        let wk = &mut self.workers[w as usize];
        if !wk.done && wk.machine.is_done() {
            wk.done = true;
            self.done += 1;
        }
        if let Some(t) = wk.machine.poll_timeout() {
            if wk.wake_at.is_none_or(|at| t < at) {
                wk.wake_at = Some(t);
                self.at(t.max(self.now), Ev::Wake(w));
            }
        }
        Ok(())
    }

    /// When a worker's message due at `t` arrives: later by a drawn delay, with
    /// [`SimFaults::reorder_ns`], so that its requests, each on a stream of its own in a
    /// cluster, may overtake each other.
    fn reorder(&mut self, t: u64) -> u64 {
        match self.opts.faults.reorder_ns {
            0 => t,
            most => t + rand::Rng::random_range(&mut self.rng, 0..=most),
        }
    }

    /// A message without tensors from worker `w` to each of `shards`: the latency alone.
    fn send(&mut self, w: u32, shards: std::ops::Range<u32>, msg: ToShard) {
        let i = self.to_shard.post(msg, shards.len() as u32);
        for s in shards {
            let t = self.after_latency(w as usize, self.server_node(s));
            let t = self.reorder(t);
            self.at(t, Ev::ToShard(w, s, i));
        }
    }

    /// A message without tensors from worker `w` reaches shard `s`'s primary, numbered as the
    /// shard numbers the worker's iterations. A worker that has left cannot be heard from: the
    /// shard says so, and that is what the cluster's servers do too.
    fn note(&mut self, w: u32, s: u32, msg: ToShard) -> Result<(), SimError> {
        let (now, node) = (self.now, &mut self.nodes[s as usize]);
        match msg {
            ToShard::Handover(handover) => node.yielded(now, handover, &mut Quiet),
            ToShard::Applied(applied) => node.applied(now, applied, &mut Quiet),
            ToShard::Finished(report) => node.finished(now, report, &mut Quiet),
            ToShard::Skip(to) => {
                self.next_token += 1;
                self.requests.insert(self.next_token, Req::Ignore { s });
                node.skip(now, self.next_token, w, to, &mut Quiet)
            }
            ToShard::Goodbye => node.leave(now, None, w, LeaveReason::Finished, &mut Quiet),
            ToShard::Waiting(iteration, waiting) => node.waiting(now, w, iteration, waiting, &mut Quiet),
        }
        self.drain(s)
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        let shards = self.nodes.len() as u32;
        if let Ev::Wake(w) | Ev::PullDone(w) | Ev::AckArrive(w, _) | Ev::Control(w, _) | Ev::Moved(w, _) = ev
        {
            if self.workers[w as usize].dead {
                if let Ev::Control(_, i) = ev {
                    self.controls.deliver(i);
                }
                return Ok(());
            }
        }
        if let Ev::PullArrive(w, s, _) | Ev::PushArrive(w, s, _) | Ev::ToShard(w, s, _) = ev {
            match self.arrival(w, s, matches!(ev, Ev::PushArrive(..))) {
                Arrival::Primary => {}
                Arrival::Lost => {
                    self.limbo.push((ev, self.now));
                    return Ok(());
                }
                // Refused for want of a lease: the worker asks again after a pause (a dead one
                // asks nothing again).
                Arrival::Refused if self.workers[w as usize].dead => return Ok(()),
                Arrival::Refused => {
                    let pause = crate::lease::HEARTBEAT_MS * 1_000_000;
                    self.at(self.now + 2 * self.latency_ns + pause, ev);
                    return Ok(());
                }
            }
        }
        match ev {
            Ev::Wake(w) => {
                self.workers[w as usize].wake_at = None;
                self.feed(w, Input::Timer)?;
            }
            Ev::PullArrive(w, s, iteration) => {
                let token = self.token(Req::Pull { w, s, iteration });
                let numbered = self.numbered(w, s, iteration);
                self.duplicate(w, s, || Copied::Pull { iteration: numbered });
                self.stranger(w, s, numbered)?;
                self.nodes[s as usize].pull(self.now, token, w, numbered, &mut Quiet);
                self.drain(s)?;
            }
            Ev::PullDone(w) => {
                let wk = &mut self.workers[w as usize];
                wk.pulling = None;
                wk.bufs.pulled();
                let (deferred, deferred_ns, local_steps) = (wk.deferred, wk.deferred_ns, wk.local_steps);
                self.feed(w, Input::Pulled { deferred, deferred_ns, local_steps })?;
            }
            Ev::PushArrive(w, s, help) => {
                let wk = &self.workers[w as usize];
                let Some(&InFlight { job, .. }) = (if help { wk.help.as_ref() } else { wk.own.as_ref() })
                else {
                    return Ok(());
                };
                let (lo, hi) = self.ranges[s as usize];
                let grad = match (self.opts.gradients, help) {
                    (false, _) => vec![0.0],
                    (true, false) => match &wk.encoded[s as usize] {
                        Some(decoded) => decoded.clone(),
                        None => wk.bufs.grad[lo..hi].to_vec(),
                    },
                    (true, true) => wk.bufs.help[lo..hi].to_vec(),
                };
                // A whole push is the owner's own; parts say whose tasks they are.
                debug_assert!(job.tasks.is_some() || job.owner == w);
                let (samples, based_on) = (job.samples, wk.based_on[s as usize]);
                let (iteration, whole, local_steps) = (job.iteration, job.tasks.is_none(), job.local_steps);
                let token = self.token(Req::Push { w, s, help, iteration, whole });
                let tasks = job.tasks.map(|part| (job.owner, part));
                // Another worker's tasks are numbered as their owner numbers them.
                let numbered = if job.owner == w { self.numbered(w, s, iteration) } else { iteration };
                self.stranger(w, s, numbered)?;
                let push =
                    PushHeader { worker: w, iteration: numbered, samples, based_on, tasks, local_steps };
                self.duplicate(w, s, || Copied::Push { push, grad: grad.clone() });
                self.nodes[s as usize].push(self.now, token, push, grad, &mut Quiet);
                self.drain(s)?;
            }
            Ev::AckArrive(w, help) => {
                let wk = &mut self.workers[w as usize];
                let slot = if help { &mut wk.help } else { &mut wk.own };
                let Some(p) = slot.as_mut().filter(|p| p.acks == shards) else { return Ok(()) };
                let (kind, refused, dropped) = (p.job.kind, p.refused.take(), p.dropped);
                *slot = None;
                let result = refused.map_or(Ok(dropped), |e| Err(PushFailed::Refused(e)));
                self.feed(w, Input::Pushed { kind, result })?;
            }
            Ev::ToShard(w, s, i) => {
                // The shard numbers the worker's iterations its own way (after a renumbering).
                let by = self.renumbered[w as usize][s as usize];
                let msg = match self.to_shard.deliver(i) {
                    ToShard::Applied(a) => {
                        ToShard::Applied(Applied { iteration: a.iteration.saturating_add_signed(by), ..a })
                    }
                    ToShard::Finished(r) => ToShard::Finished(IterationReport {
                        iteration: r.iteration.saturating_add_signed(by),
                        ..r
                    }),
                    ToShard::Skip(to) => ToShard::Skip(to.saturating_add_signed(by)),
                    ToShard::Waiting(i, waiting) => ToShard::Waiting(i.saturating_add_signed(by), waiting),
                    msg @ (ToShard::Handover(_) | ToShard::Goodbye) => msg,
                };
                self.duplicate(w, s, || Copied::Note(msg));
                self.note(w, s, msg)?;
            }
            Ev::Again(w, s, i) => {
                let (term, copy) = self.copies.deliver(i);
                let x = self.server_of[s as usize] as usize;
                let leased = !self.controlled() || self.leases[x].valid(self.now);
                if term != self.term[s as usize] || self.down(s) || !leased {
                    return Ok(());
                }
                self.duplicates += 1;
                let (now, token) = (self.now, self.token(Req::Ignore { s }));
                let node = &mut self.nodes[s as usize];
                match copy {
                    Copied::Pull { iteration } => node.pull(now, token, w, iteration, &mut Quiet),
                    Copied::Push { push, grad } => node.push(now, token, push, grad, &mut Quiet),
                    Copied::Note(msg) => return self.note(w, s, msg),
                }
                self.drain(s)?;
            }
            Ev::WorkerLost(w) => self.worker_lost(w)?,
            Ev::Control(w, i) => {
                let msg = self.controls.deliver(i);
                if !self.workers[w as usize].machine.is_done() {
                    self.feed(w, Input::Control(msg))?;
                }
            }
            Ev::Timer(s) => {
                self.timer_at[s as usize] = None;
                if !self.down(s) {
                    self.nodes[s as usize].handle_timeout(self.now, &mut Quiet);
                    self.drain(s)?;
                }
            }
            Ev::Replicate(s, i) => {
                let (epoch, stamped, grad) = self.replication.deliver(i);
                let su = s as usize;
                // The worst case for a death: an op still on its way from a primary that died
                // never arrives (it may still be in the dead process's buffers), and a dead
                // backup applies nothing.
                let on_live = self.backup_of[su].is_some_and(|b| !self.dead[b as usize]) && !self.down(s);
                // An op from a primary that was deposed while it lived (a stale term) still
                // reaches the backup it streamed to, promoted since, which must ignore it.
                let deposed_alive = self.zombie_of[su].is_some_and(|x| !self.dead[x as usize]);
                if deposed_alive && self.promoted_epoch[su] == Some(epoch) && !self.down(s) {
                    return self.stale_op(s, stamped, grad);
                }
                if self.backups[su].is_none() || !on_live || epoch != self.epoch[su] {
                    return Ok(());
                }
                let p = self.opts.faults.duplicate;
                if p > 0.0 && self.rng.random_bool(p) {
                    let again = self.now + self.rng.random_range(0..=DUPLICATE_WITHIN_NS);
                    let i = self.replication.post((epoch, stamped.clone(), grad.clone()), 1);
                    self.at(again, Ev::Replicate(s, i));
                }
                let Some(backup) = self.backups[su].as_mut() else { return Ok(()) };
                self.duplicates += u64::from(stamped.seq <= backup.replication().0);
                let modules = &self.modules;
                let find = |sha: &[u8; 32]| modules.iter().find(|m| m.sha256() == *sha).cloned();
                backup.replicated(stamped, grad, find, &mut Quiet);
                // Every time the backup has applied every op its primary has, the two must be
                // equal (the end of the run compares their whole snapshots). Cheap, allocating
                // nothing: version, clocks' view and parameters.
                let primary = &self.nodes[su];
                if self.drift.is_none() && backup.replication().0 == primary.replication().0 {
                    let (p, q) = (sim_shard(primary), sim_shard(backup));
                    if p.version() != q.version() || p.view() != q.view() || !bits_equal(p, q) {
                        self.drift = Some(format!(
                            "shard {s}: at {} ns, after op {}, its backup is at version {} with members {:?}, its \
                             primary at {} with {:?}{}",
                            self.now,
                            primary.replication().0,
                            q.version(),
                            q.workers(),
                            p.version(),
                            p.workers(),
                            if bits_equal(p, q) { "" } else { ", and their parameters differ" }
                        ));
                    }
                }
                let mut confirmed = None;
                while let Some(out) = backup.poll_output() {
                    if let NodeOutput::Confirm { seq } = out {
                        confirmed = Some(seq);
                    }
                }
                if let Some(seq) = confirmed {
                    let (b, primary) = (self.backup_of[s as usize], self.server_node(s));
                    let t = match b {
                        Some(b) => self.after_latency(self.node_index(Node::Server(b)), primary),
                        None => self.now + self.latency_ns,
                    };
                    self.at(t, Ev::Confirm(s, epoch, seq));
                }
            }
            Ev::Confirm(s, epoch, seq) => {
                // Likewise a confirmation on its way from a backup that died.
                let backup_dead = self.backup_of[s as usize].is_none_or(|b| self.dead[b as usize]);
                if epoch != self.epoch[s as usize] || self.down(s) || backup_dead {
                    return Ok(());
                }
                self.nodes[s as usize].confirmed(seq);
                self.drain(s)?;
            }
            Ev::Heartbeat(_)
            | Ev::Renew(..)
            | Ev::Renewed(..)
            | Ev::Stop(_)
            | Ev::Heal(_)
            | Ev::CoordTimer
            | Ev::Command(..)
            | Ev::CommandDone(..)
            | Ev::CoordRestart
            | Ev::Rejoin(_)
            | Ev::ServerRestart(_)
            | Ev::ServerKill(_)
            | Ev::RebuildDue(_)
            | Ev::Tick
            | Ev::Moved(..) => self.control(ev)?,
            Ev::Watch => {
                self.observe();
                let every = self.opts.run.scenario.eval_every_ms;
                let stop =
                    self.stop_rules().should_stop(self.now as f64 / 1e9, self.time_to_target.is_some());
                if stop && !self.stopping {
                    self.stopping = true;
                    for w in 0..self.workers.len() as u32 {
                        if !self.workers[w as usize].machine.is_done() {
                            self.feed(w, Input::Stop)?;
                        }
                    }
                }
                if self.done < self.workers.len() {
                    self.at(self.now + every.max(1) * 1_000_000, Ev::Watch);
                }
            }
        }
        Ok(())
    }

    fn stop_rules(&self) -> StopRules {
        let sc = &self.opts.run.scenario;
        StopRules { target_accuracy: sc.target_accuracy, time_limit_s: sc.time_limit_s }
    }

    fn model(&self) -> Vec<f32> {
        self.nodes.iter().flat_map(|s| sim_shard(s).values().iter().copied()).collect()
    }

    fn observe(&mut self) {
        let t_s = self.now as f64 / 1e9;
        let score =
            self.evaluator.as_ref().filter(|_| self.opts.gradients).map(|e| e.evaluate(&self.model()));
        let status: Vec<ShardStatus> =
            self.nodes.iter().enumerate().map(|(i, s)| ShardStatus::of(i as u32, sim_shard(s))).collect();
        let mut point = WatchPoint::of_shards(t_s, &status.iter().collect::<Vec<_>>());
        point.accuracy = score.map(|s| s.accuracy);
        point.loss = score.map(|s| s.loss);
        point.lost_servers.clone_from(&self.lost);
        if self.time_to_target.is_none() && self.stop_rules().reached(&point) {
            self.time_to_target = Some(t_s);
        }
        self.watch.push(point);
    }

    fn report(mut self) -> RunReport {
        self.observe();
        let n = self.workers.len();
        let shards: Vec<ShardStatus> =
            self.nodes.iter().enumerate().map(|(i, s)| ShardStatus::of(i as u32, sim_shard(s))).collect();
        let staleness = RunReport::staleness_of(shards.iter());
        let servers = (0..self.opts.run.scenario.servers)
            .map(|id| {
                let node = n + id as usize;
                let mine =
                    shards.iter().filter(|s| self.server_of[s.shard as usize] == id).cloned().collect();
                ServerRecord {
                    server: id,
                    shards: mine,
                    bytes_sent: self.up[node].bytes,
                    bytes_received: self.down[node].bytes,
                }
            })
            .collect();
        let model = self.model();
        let final_score = self.evaluator.as_ref().filter(|_| self.opts.gradients).map(|e| e.evaluate(&model));
        let best = self
            .watch
            .iter()
            .filter_map(|p| p.accuracy)
            .fold(None, |b: Option<f32>, a| Some(b.map_or(a, |b| b.max(a))));
        let members = self
            .workers
            .iter()
            .map(|w| WorkerStatus {
                worker: w.machine.config().id,
                connected: false,
                finished: w.machine.is_done(),
            })
            .collect();
        let workers: Vec<WorkerReport> = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut r = w.machine.report().clone();
                if !w.machine.is_done() {
                    // Still waiting when the run was ended: it ran until then.
                    r.elapsed_ns = self.now;
                }
                (r.bytes_sent, r.bytes_received) = (self.up[i].bytes, self.down[i].bytes);
                r.codec_owed = w.encoder.owed();
                r
            })
            .collect();
        let phases = crate::lab::report::phases(&self.watch);
        let failovers = crate::lab::report::failovers(&self.watch);
        RunReport {
            simulated: true,
            modelled: self.opts.run.scenario.modelled.as_ref().map(|m| m.name.clone()),
            elapsed_s: self.now as f64 / 1e9,
            workers,
            failed_workers: Vec::new(),
            policy: self.opts.run.policy.to_string(),
            sha256: shards.first().map(|s| s.sha256.clone()).unwrap_or_default(),
            config: self.opts.run.policy.config.clone(),
            swaps: 0,
            servers,
            members,
            model_len: model.len(),
            model_version: self.nodes.iter().map(|s| sim_shard(s).version()).min().unwrap_or(0),
            model_file: None,
            started_unix_s: 0.0,
            watch: self.watch,
            final_accuracy: final_score.map(|s| s.accuracy),
            best_accuracy: best,
            time_to_target_s: self.time_to_target,
            staleness,
            plots: Vec::new(),
            phases,
            failovers,
            coordinator_restarts: Vec::new(),
        }
    }
}

/// A simulated shard: the simulator creates every one before the run starts.
fn sim_shard(node: &ShardNode) -> &Shard {
    node.shard().expect("the simulator creates every shard at the start")
}

/// Whether two shards hold the same parameters, bit for bit.
fn bits_equal(p: &Shard, q: &Shard) -> bool {
    p.values().iter().map(|v| v.to_bits()).eq(q.values().iter().map(|v| v.to_bits()))
}
