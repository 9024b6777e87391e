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
//!
//! Where things are: this file runs a run and dispatches its events ([`simulate`]); `setup.rs`
//! sets one up; `options.rs` says what a run is asked to do, `outcome.rs` what it reports;
//! `events.rs` is the event queue and the messages in flight; `network.rs` the links;
//! `shards.rs` the shards' drivers (each node's outputs, ops to backups); `workers.rs` the
//! workers' drivers (each worker's machine and client machine, and what a worker does when a
//! request is lost or it hears a shard moved); `control.rs` the control plane (leases, the coordinator's machine,
//! failovers, each server's own state); `rebuild.rs` a coordinator's crash and rebuild;
//! `checkpoints.rs` checkpoint rounds; `faults.rs` late joins, duplicates and bad requests;
//! `invariants.rs` what is checked as the run goes. The run's state is grouped likewise: the
//! shards (`SimShards`: each one's primary and backup nodes, servers, terms), the workers
//! (`SimWorker`, one each: its machines, buffers, what it has in flight), the server processes
//! (`SimServers`: alive, leases, links to the coordinator, each one's own state), the
//! coordinator's side (`SimCoordinator`: its machine, whether it runs, its swaps and rounds
//! under way), the messages on their way (`SimMail`), the model's score (`SimScore`), and what
//! the run found beside its sums (`Found`).

mod checkpoints;
mod control;
mod events;
mod faults;
mod invariants;
mod network;
mod options;
mod outcome;
mod rebuild;
mod setup;
mod shards;
mod workers;

pub use options::{
    Cut, FailAt, Node, SimError, SimFailure, SimFaults, SimLinkCut, SimOptions, SimPartition, SimRestart,
    DUPLICATE_WITHIN_NS,
};
pub use outcome::{CheckpointCounts, RebuildCounts, Simulated};

use std::collections::BTreeMap;

use rand::Rng as _;
use syncopate_engine::worker::client::{ClientMachine, Loss};
use syncopate_engine::worker::join::JoinAnswer;
use syncopate_engine::worker::{Buffers, Device, Input, WorkerConfig, WorkerMachine};

use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, WorkerId};
use syncopate_workloads::{Evaluator, Workload};

use crate::codec::{self, Codec, PushEncoder};
use crate::lab::report::WatchPoint;
use crate::lease::ServerLease;
use crate::net::proto::ControlMessage;
use crate::runtime::{PolicyModule, PolicyRuntime};
use crate::shard::{
    ClockRaise, Joined, NodeConfig, NodeOutput, Op, PushHeader, PushOutcome, Quiet, Reply, RequestError,
    Shard, ShardConfig, ShardNode, Stamped, Token,
};
use control::Arrival;
use events::{Copied, Ev, Mailbox, Queue, ToShard};
use invariants::bits_equal;
use network::Network;
use syncopate_engine::coordinator::{
    Answer, CommandError, CoordOutput, CoordinatorConfig, CoordinatorMachine, Record,
};
use syncopate_engine::server::ServerState;
use workers::{InFlight, SimWorker};

/// The cluster's default peer timeout (10 s): how long a promoted backup waits for members to
/// rejoin (the simulator's live workers rejoin once they hear of the move, so it runs out only
/// for a dead one), and how long after a worker's death the servers make it leave.
pub const PEER_TIMEOUT_NS: u64 = 10_000_000_000;
const REJOIN_GRACE_NS: u64 = PEER_TIMEOUT_NS;
/// How long the start barrier waits for the workers there at the start: a cluster's default
/// (`--startup-timeout-s`).
const START_WAIT_MS: u64 = crate::coordinator::DEFAULT_STARTUP_TIMEOUT_S * 1000;

/// A run in which nothing happens for this long but lease renewals and observations has
/// stalled, and ends (10 minutes of virtual time).
const STALL_NS: u64 = 600_000_000_000;

/// What a request to a shard was, for its reply.
#[derive(Clone, Copy, Debug)]
enum Req {
    /// A worker's pull.
    Pull { w: WorkerId, s: u32, iteration: u64 },
    /// A worker's push (`help`: of tasks moved to it; `whole`: its own whole iteration).
    Push { w: WorkerId, s: u32, help: bool, iteration: u64, whole: bool },
    /// Worker `w`'s join: it starts once every shard has answered its first. `again`: after it
    /// heard the shard moved, with its client machine's ticket.
    Join { w: WorkerId, s: u32, again: Option<u64> },
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

/// What a run found and counted beside its sums, as it went: the fault search's record, which
/// no node of the cluster keeps.
#[derive(Debug, Default)]
struct Found {
    /// Copies that reached a primary or backup.
    pub(super) duplicates: u64,
    /// Bad requests shards refused.
    pub(super) bad_inputs: u64,
    /// What its rebuilds did.
    pub(super) rebuild: RebuildCounts,
    /// What became of the rounds.
    pub(super) checkpoints: CheckpointCounts,
    /// Servers restarted that took their id back ([`SimFaults::server_restarts`]).
    pub(super) restarted: u64,
    /// Servers killed after another's restart ([`SimRestart::then_kill`]).
    pub(super) killed_after_restart: u64,
    /// Ops from a deposed primary that reached the backup it had, promoted since.
    pub(super) stale_ops: u64,
    /// Requests a worker gave up at its stop that its goodbye overtook, refused as a stranger's.
    pub(super) late_refusals: u64,
    /// Swaps a server refused at their preparation (a shard's policy state refused).
    pub(super) swaps_refused: u64,
    /// Hot swaps that ended (committed, refused or partly committed) before the run did.
    pub(super) swaps_ended: u64,
    /// Promoted primaries that switched to the policy their server records
    /// ([`ShardNode::conform`]).
    pub(super) conformed: u64,
    /// The first time a server accepted a push for a shard another server had been promoted to.
    pub(super) two_primaries: Option<String>,
    /// The first time a backup that had applied every op of its primary's differed from it.
    pub(super) drift: Option<String>,
}

/// The server processes as the simulator runs them: alive or not, their leases and links to
/// the coordinator, and each one's own state.
#[derive(Debug)]
struct SimServers {
    /// Per server: killed.
    pub(super) dead: Vec<bool>,
    /// Servers failed over, in order.
    pub(super) lost: Vec<u32>,
    /// Per server: its own view of its lease.
    pub(super) leases: Vec<ServerLease>,
    /// Per server: whether its messages to the coordinator, and the coordinator's to it, are
    /// lost (a partition).
    pub(super) cut_to: Vec<bool>,
    pub(super) cut_from: Vec<bool>,
    /// Per server: commands and answers a partition holds up until it heals.
    pub(super) held: Vec<Vec<Ev>>,
    /// Per server: its own state, as the cluster's servers keep it ([`ServerState`]): the
    /// shards it holds (a primary promoted away from it too, at the term it had: what it would
    /// claim to a restarted coordinator) and their terms, the newest terms its lease answers
    /// told, and the workers whose connection to it ended.
    pub(super) state: Vec<ServerState<()>>,
    /// Per server: the swaps it committed, and what the last raised the clocks by.
    pub(super) committed: Vec<(u64, Vec<ClockRaise>)>,
    /// Per server: the shards' terms its last lease answer on the way says.
    pub(super) answer_terms: Vec<Vec<u64>>,
    /// The restarts to come ([`SimFaults::server_restarts`]), each marked once its server has
    /// died (under way); one leaves once its server took its id back.
    pub(super) restarts: Vec<(SimRestart, bool)>,
}

/// The coordinator's process as the simulator runs it: its machine (the cluster's own), whether
/// it runs, and what a coordinator's driver keeps beside the machine (the swaps' modules and
/// preparations, the checkpoint rounds, its record for a successor).
#[derive(Debug)]
struct SimCoordinator {
    /// The coordinator's decisions (`control.rs`).
    pub(super) machine: CoordinatorMachine,
    /// The hot swap under way: its number, module and configuration.
    pub(super) swapping: Option<Swapping>,
    /// Each swap's module and configuration (by its number; 0: the first policy), as a
    /// coordinator knows them: the policy it records is the one its machine's swap count names.
    pub(super) swap_modules: BTreeMap<u64, (PolicyModule, Vec<(String, String)>)>,
    /// What each command came to at its server (a preparation's answer carries the clocks it
    /// prepared with), by the coordinator's incarnation and command, until the answer reaches
    /// the coordinator.
    pub(super) answers: BTreeMap<(u32, u64), Result<Answer, CommandError>>,
    /// When the coordinator's next lease check is scheduled.
    pub(super) timer_at: Option<u64>,
    /// Whether the coordinator runs, is down, or is rebuilding after a restart.
    pub(super) phase: control::Phase,
    /// The coordinator's incarnation: bumped when it crashes, so its old commands' answers are
    /// dropped.
    pub(super) incarnation: u32,
    /// What the crashed coordinator recorded, terms and servers' addresses
    /// ([`SimFaults::crash_keeps_terms`]).
    pub(super) recorded: Record,
    /// Checkpoint rounds begun, by number ([`SimFaults::checkpoints`]).
    pub(super) rounds: BTreeMap<u64, checkpoints::SimRound>,
    /// The cluster policy, if the run has one, and the runtime its swaps' modules compile in.
    pub(super) pilot: Option<(syncopate_engine::pilot::Pilot, PolicyRuntime)>,
}

/// The shards, each a primary node and perhaps a backup node, by shard.
struct SimShards {
    /// Its primary.
    nodes: Vec<ShardNode>,
    /// How its nodes run (for new backups).
    node_cfgs: Vec<NodeConfig>,
    /// The model's parameters it holds.
    ranges: Vec<(usize, usize)>,
    /// The server of its primary.
    server_of: Vec<u32>,
    /// When its node's timer is due.
    timer_at: Vec<Option<u64>>,
    /// Its backup (with `replicas` 1).
    backups: Vec<Option<ShardNode>>,
    /// The backup's server.
    backup_of: Vec<Option<u32>>,
    /// Bumped when its primary or backup changes, so a stream from before is dropped.
    epoch: Vec<u32>,
    /// The parameters its first join carries (and creates it with), until then.
    inits: Vec<Vec<f32>>,
    /// How many times it moved (its promotions).
    term: Vec<u32>,
    /// The server of the primary it was promoted from, while that one lives.
    zombie_of: Vec<Option<u32>>,
    /// The epoch of the stream its primary took as a backup, if it was promoted (what its old
    /// primary sent on that stream still reaches it).
    promoted_epoch: Vec<Option<u32>>,
}

/// Messages on their way (their bodies, by the index their delivery event names), and those a
/// dead server lost, waiting for the worker to send them again.
#[derive(Default)]
struct SimMail {
    /// To workers.
    controls: Mailbox<ControlMessage>,
    /// From workers to shards, beside pulls and pushes.
    to_shard: Mailbox<ToShard>,
    /// Duplicates on their way to a shard's primary, with the shard's term when the original
    /// arrived ([`SimFaults::duplicate`]).
    copies: Mailbox<(u32, Copied)>,
    /// Ops on their way to backups: (epoch, op, gradient).
    replication: Mailbox<(u32, Stamped, Vec<f32>)>,
    /// Requests that reached a dead server before its failover, and since when they wait.
    limbo: Vec<(Ev, u64)>,
}

/// The model's score as the run goes.
struct SimScore {
    /// Scores the model (`None`: the workload has no test set).
    evaluator: Option<Evaluator>,
    /// Each look at the model.
    watch: Vec<WatchPoint>,
    /// When the model first reached the scenario's target, in seconds.
    time_to_target: Option<f64>,
}

/// A hot swap under way: its number, module and configuration.
type Swapping = (u64, PolicyModule, Vec<(String, String)>);

struct Sim {
    opts: SimOptions,
    /// What the run found and counted beside its sums (the checks' record, not the cluster's).
    found: Found,
    /// The server processes.
    servers: SimServers,
    /// The coordinator's side: its machine, whether it runs, its swaps and rounds under way.
    coord: SimCoordinator,
    /// The shards: their nodes, where they are, how they moved.
    shards: SimShards,
    now: u64,
    queue: Queue,
    /// Requests waiting for a shard's reply, by token, in order: those lost with a dead primary
    /// are sent again in token order, the same in every process.
    requests: BTreeMap<Token, Req>,
    next_token: Token,
    workers: Vec<SimWorker>,
    /// The links between the workers and the servers.
    net: Network,
    /// Messages on their way, and those lost on the way to a dead server.
    mail: SimMail,
    /// How the model scores as the run goes.
    score: SimScore,
    /// Workers whose machine is done.
    done: usize,
    stopping: bool,
    /// Workers ready whom the start barrier holds back.
    at_barrier: Vec<u32>,
    /// Setting up: workers start once every join has been asked.
    starting: bool,
    /// The policy modules the run may use (the first and those swapped to).
    modules: Vec<PolicyModule>,
    /// Draws the delays of the coordinator's notices ([`SimFaults::notice_delay_ns`]).
    rng: rand_chacha::ChaCha8Rng,
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
    let (mut sim, failures, swaps) = setup::build(opts, rt)?;
    let (sc, n, shards_n) = (&opts.run.scenario, opts.run.scenario.workers, opts.run.shards());
    // Each worker joins every shard, and starts once all have answered (with backups, once
    // its join is on the backup too).
    for s in 0..shards_n {
        for w in 0..n {
            if sim.workers[w as usize].absent {
                continue;
            }
            let token = sim.token(Req::Join { w, s, again: None });
            let init = std::mem::take(&mut sim.shards.inits[s as usize]);
            sim.shards.nodes[s as usize].join(0, token, w, init, &mut Quiet);
            sim.drain(s)?;
        }
    }
    sim.starting = false;
    for w in 0..n {
        if sim.workers[w as usize].joins == shards_n {
            sim.ready(w)?;
        }
    }
    // Training starts once every worker has joined: what it takes (with backups, the joins'
    // way to the backups and back) comes before the first event a failure can name, as a
    // cluster's workers start only once they are in (a death while they join fails their join).
    while sim.workers.iter().any(|w| !w.started && !w.absent) {
        let Some((t, ev)) = sim.queue.pop() else { break };
        sim.now = t;
        sim.handle(ev)?;
    }
    sim.at(sc.eval_every_ms * 1_000_000, Ev::Watch);
    sim.pilot_next();
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
            sim.net.cut(a, b, t + c.heal_after_ns);
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
        if sim.done == sim.workers.len() && sim.shards.nodes.iter().all(|s| sim_shard(s).view().workers == 0)
        {
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
    let (policy_differs, swaps_refused, conformed) =
        (sim.policy_differs(), sim.found.swaps_refused, sim.found.conformed);
    let swaps_ended = sim.found.swaps_ended;
    let unreachable_ns = sim.workers.iter().map(|w| w.unreachable_ns).max().unwrap_or(0);
    let replicas_differ = match sim.found.drift.take() {
        Some(drift) => Some(drift),
        None => sim.replicas_differ()?,
    };
    let (two_primaries, duplicates, bad_inputs) =
        (sim.found.two_primaries.take(), sim.found.duplicates, sim.found.bad_inputs);
    let (rebuild, checkpoints, restarts) = (sim.found.rebuild, sim.found.checkpoints, sim.found.restarted);
    let (killed_after_restart, stale_ops, trace) =
        (sim.found.killed_after_restart, sim.found.stale_ops, sim.queue.trace());
    let late_refusals = sim.found.late_refusals;
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
        late_refusals,
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

    /// A node's index: the workers first, then the servers.
    fn node_index(&self, n: Node) -> usize {
        match n {
            Node::Worker(w) => w as usize,
            Node::Server(x) => self.workers.len() + x as usize,
        }
    }

    fn server_node(&self, shard: u32) -> usize {
        self.workers.len() + self.shards.server_of[shard as usize] as usize
    }

    fn shard_bytes(&self, shard: u32) -> u64 {
        self.coded_bytes(shard, Codec::None)
    }

    /// What shard `shard`'s tensor costs on the wire in `codec`, a message's 64 bytes of
    /// headers included (a modelled model's bytes scaled as the codec scales the workload's).
    fn coded_bytes(&self, shard: u32, codec: Codec) -> u64 {
        let (lo, hi) = self.shards.ranges[shard as usize];
        let n = hi - lo;
        match &self.opts.run.scenario.modelled {
            // The modelled model's bytes, split over the shards as the workload's are.
            Some(m) => {
                let total = self.shards.ranges.last().map_or(1, |r| r.1).max(1) as u64;
                let ratio = codec::wire_len(codec, n) as f64 / (4 * n.max(1)) as f64;
                (m.bytes as f64 * n as f64 / total as f64 * ratio) as u64 + 64
            }
            None => codec::wire_len(codec, n) as u64 + 64,
        }
    }

    /// A token for a request to a shard.
    /// How shard `s` numbers worker `w`'s iteration `iteration`.
    fn numbered(&self, w: WorkerId, s: u32, iteration: u64) -> u64 {
        self.workers[w as usize].client.numbered(s as usize, iteration)
    }

    fn token(&mut self, req: Req) -> Token {
        self.next_token += 1;
        self.requests.insert(self.next_token, req);
        self.next_token
    }

    /// Whether shard `s`'s primary is on a dead server (not yet failed over).
    fn down(&self, s: u32) -> bool {
        self.servers.dead[self.shards.server_of[s as usize] as usize]
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
        let i = self.mail.to_shard.post(msg, shards.len() as u32);
        for s in shards {
            let t = self.net.after_latency(self.now, w as usize, self.server_node(s));
            let t = self.reorder(t);
            self.at(t, Ev::ToShard(w, s, i));
        }
    }

    /// A message without tensors from worker `w` reaches shard `s`'s primary, numbered as the
    /// shard numbers the worker's iterations. A worker that has left cannot be heard from: the
    /// shard says so, and that is what the cluster's servers do too.
    fn note(&mut self, w: u32, s: u32, msg: ToShard) -> Result<(), SimError> {
        let (now, node) = (self.now, &mut self.shards.nodes[s as usize]);
        match msg {
            ToShard::Handover(handover) => node.yielded(now, handover, &mut Quiet),
            ToShard::Applied(applied) => node.applied(now, applied, &mut Quiet),
            ToShard::Finished(report) => node.finished(now, report, &mut Quiet),
            ToShard::Skip(to) => {
                self.next_token += 1;
                self.requests.insert(self.next_token, Req::Ignore { s });
                node.skip(now, self.next_token, w, to, &mut Quiet)
            }
            ToShard::Goodbye => {
                let x = self.shards.server_of[s as usize] as usize;
                self.servers.state[x].left(w, s, w as usize);
                self.shards.nodes[s as usize].leave(now, None, w, LeaveReason::Finished, &mut Quiet)
            }
            ToShard::Waiting(iteration, waiting) => node.waiting(now, w, iteration, waiting, &mut Quiet),
        }
        self.drain(s)
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        if let Ev::Wake(w)
        | Ev::PullDone(w)
        | Ev::AckArrive(w, _)
        | Ev::Control(w, _)
        | Ev::Moved(w, _)
        | Ev::WaitOver(w, _) = ev
        {
            if self.workers[w as usize].dead {
                if let Ev::Control(_, i) = ev {
                    self.mail.controls.deliver(i);
                }
                return Ok(());
            }
        }
        if let Ev::PullArrive(w, s, _) | Ev::PushArrive(w, s, _) | Ev::ToShard(w, s, _) = ev {
            let loss = match self.arrival(w, s, matches!(ev, Ev::PushArrive(..))) {
                Arrival::Primary => {
                    self.workers[w as usize].client.reached(s as usize);
                    None
                }
                // A dead worker asks nothing again.
                _ if self.workers[w as usize].dead => return Ok(()),
                Arrival::Lost => Some(Loss::Lost),
                Arrival::Refused => Some(Loss::Unleased),
            };
            if let Some(loss) = loss {
                return self.lost(w, s, ev, loss);
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
                self.shards.nodes[s as usize].pull(self.now, token, w, numbered, &mut Quiet);
                self.drain(s)?;
            }
            Ev::PullDone(w) => {
                let wk = &mut self.workers[w as usize];
                wk.bufs.pulled();
                let Some(stats) = wk.pulled.take() else { return Ok(()) };
                let (deferred, deferred_ns) = (stats.deferred_shards > 0, stats.waited_ns);
                self.feed(w, Input::Pulled { deferred, deferred_ns, local_steps: stats.local_steps })?;
            }
            Ev::PushArrive(w, s, help) => {
                let wk = &self.workers[w as usize];
                let Some(&InFlight { job, .. }) = (if help { wk.help.as_ref() } else { wk.own.as_ref() })
                else {
                    return Ok(());
                };
                let (lo, hi) = self.shards.ranges[s as usize];
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
                let (samples, based_on) = (job.samples, wk.client.based_on(s as usize));
                let (iteration, whole, local_steps) = (job.iteration, job.tasks.is_none(), job.local_steps);
                let token = self.token(Req::Push { w, s, help, iteration, whole });
                let tasks = job.tasks.map(|part| (job.owner, part));
                // Another worker's tasks are numbered as their owner numbers them.
                let numbered = if job.owner == w { self.numbered(w, s, iteration) } else { iteration };
                self.stranger(w, s, numbered)?;
                let signals = job.signals;
                let push = PushHeader {
                    worker: w,
                    iteration: numbered,
                    samples,
                    based_on,
                    tasks,
                    local_steps,
                    signals,
                };
                self.duplicate(w, s, || Copied::Push { push, grad: grad.clone() });
                self.shards.nodes[s as usize].push(self.now, token, push, grad, &mut Quiet);
                self.drain(s)?;
            }
            Ev::AckArrive(w, help) => {
                let wk = &mut self.workers[w as usize];
                let slot = if help { &mut wk.help } else { &mut wk.own };
                let Some(result) = slot.as_mut().and_then(|p| p.result.take()) else { return Ok(()) };
                let kind = slot.take().map(|p| p.job.kind).expect("a push answered");
                self.feed(w, Input::Pushed { kind, result })?;
            }
            Ev::ToShard(w, s, i) => {
                // The shard numbers the worker's iterations its own way (after a renumbering).
                let msg = self.mail.to_shard.deliver(i);
                let numbered = |it| self.numbered(w, s, it);
                let msg = match msg {
                    ToShard::Applied(a) => {
                        ToShard::Applied(Applied { iteration: numbered(a.iteration), ..a })
                    }
                    ToShard::Finished(r) => {
                        ToShard::Finished(IterationReport { iteration: numbered(r.iteration), ..r })
                    }
                    ToShard::Skip(to) => ToShard::Skip(numbered(to)),
                    ToShard::Waiting(i, waiting) => ToShard::Waiting(numbered(i), waiting),
                    msg @ (ToShard::Handover(_) | ToShard::Goodbye) => msg,
                };
                self.duplicate(w, s, || Copied::Note(msg));
                self.note(w, s, msg)?;
            }
            Ev::Again(w, s, i) => {
                let (term, copy) = self.mail.copies.deliver(i);
                let x = self.shards.server_of[s as usize] as usize;
                let leased = !self.controlled() || self.servers.leases[x].valid(self.now);
                if term != self.shards.term[s as usize] || self.down(s) || !leased {
                    return Ok(());
                }
                self.found.duplicates += 1;
                let (now, token) = (self.now, self.token(Req::Ignore { s }));
                let node = &mut self.shards.nodes[s as usize];
                match copy {
                    Copied::Pull { iteration } => node.pull(now, token, w, iteration, &mut Quiet),
                    Copied::Push { push, grad } => node.push(now, token, push, grad, &mut Quiet),
                    Copied::Note(msg) => return self.note(w, s, msg),
                }
                self.drain(s)?;
            }
            Ev::WorkerLost(w) => self.worker_lost(w)?,
            Ev::Control(w, i) => {
                let msg = self.mail.controls.deliver(i);
                if !self.workers[w as usize].machine.is_done() {
                    self.feed(w, Input::Control(msg))?;
                }
            }
            Ev::Timer(s) => {
                self.shards.timer_at[s as usize] = None;
                if !self.down(s) {
                    self.shards.nodes[s as usize].handle_timeout(self.now, &mut Quiet);
                    self.drain(s)?;
                }
            }
            Ev::Replicate(s, i) => self.op_arrives(s, i)?,
            Ev::Confirm(s, epoch, seq) => {
                // Likewise a confirmation on its way from a backup that died.
                let backup_dead =
                    self.shards.backup_of[s as usize].is_none_or(|b| self.servers.dead[b as usize]);
                if epoch != self.shards.epoch[s as usize] || self.down(s) || backup_dead {
                    return Ok(());
                }
                self.shards.nodes[s as usize].confirmed(seq);
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
            Ev::WaitOver(w, s) => self.wait_over(w, s),
            Ev::CoordinatorAway => self.coordinator_away(),
            Ev::Pilot => self.pilot()?,
            Ev::Watch => {
                self.observe();
                let every = self.opts.run.scenario.eval_every_ms;
                let stop =
                    self.stop_rules().should_stop(self.now as f64 / 1e9, self.score.time_to_target.is_some());
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
}

/// Server `x`'s state at the start: the primaries of the shards placed on it (`server_of`) and
/// the backups placed on it (`backup_of`), each at term 0, and every one of the `workers`
/// connected (a worker's connection is named by its id).
fn server_state(x: u32, server_of: &[u32], backup_of: &[Option<u32>], workers: u32) -> ServerState<()> {
    let mut state = ServerState::new(backup_of.len() as u32);
    for ((s, p), b) in (0..).zip(server_of).zip(backup_of) {
        if *p == x {
            state.hold_primary(s, ());
        }
        if *b == Some(x) {
            state.hold_backup(s, ());
        }
    }
    for w in 0..workers {
        state.connected(w, w as usize);
    }
    state
}

/// Server `x`'s data address in the simulator: only the coordinator's machine reads it (a
/// process restarted in a lost server's place takes back the id at its address).
fn server_addr(x: u32) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + x as u16))
}

/// A simulated shard: every one is created by the first join, before the run starts.
fn sim_shard(node: &ShardNode) -> &Shard {
    node.shard().expect("the first join creates every shard before the run starts")
}
