//! `syncopate simtest`: a seeded search for lost or doubled updates, two primaries, diverging
//! backups and stalls, in the deterministic simulator ([`crate::lab::sim`]), which runs the
//! servers' protocol machine (`ShardNode`, with real wasm policies) for every primary and
//! backup, the workers' own state machine, and the coordinator's machine with the lease rule,
//! in virtual time.
//!
//! Each seed draws a replicated cluster (2 to 5 workers, 2 or 3 servers, a shard or more per
//! server, 3 to 10 iterations of 1 to 400 ms, stragglers and jitter, link latency), a policy
//! and faults: a server killed at an event drawn from the undisturbed run's, a second one later
//! (half the three-server seeds), a server cut off from the coordinator one way or both for a
//! while, the coordinator's notices of moves reaching the workers late, a worker killed, the
//! workers' messages to shards delayed so that they overtake each other, a hot swap (perhaps to
//! a module that traps, spins or panics, one that refuses the running policy's state, or a rule
//! that parks every pull or holds every push after a while: [`HOSTILE`]), a worker that hears
//! of moves 10-15 s later still, as one stalled in a long iteration, messages and ops delivered
//! twice, bad requests from a buggy or hostile peer, one or two late joiners, and the coordinator crashed
//! and restarted (rebuilding the cluster from its servers as a cluster's does; some crashes
//! between two servers' commits of a swap), and a link cut for a while (a worker's to a
//! server, or between two servers) (each in some of the seeds). It runs the seed on the counter workload (worker `w` pushes `w + 1`; lr 1, no
//! momentum, summed pushes) undisturbed, and with the faults, and checks:
//! - every live worker ran every iteration (a late joiner from its start), in both runs;
//! - where the policy admits every push at weight 1 (all but R²SP), each parameter is exactly
//!   minus the sum of every push (`w + 1` per iteration worker `w` ran), and the run with faults
//!   ends at the undisturbed model bit for bit (with a dead worker or a late joiner, at that sum
//!   over what each ran, perhaps plus a dead worker's last push, which it had not heard back
//!   about);
//! - no shard accepted a bad request;
//! - every live primary runs the policy its coordinator records (a refused swap left every shard
//!   on the old one; a committed one reached every shard, promoted backups and a restarted
//!   coordinator's rebuild included);
//! - no server accepted a push for a shard another server had been promoted to, at any step;
//! - every backup equalled its primary whenever it had applied every op its primary had, and at
//!   the end their whole snapshots are the same bytes;
//! - liveness: the live workers finish within a bound of the undisturbed run's
//!   (twice `FAILOVER_MS` per fault, plus the notices' delays, partitions, a coordinator's
//!   outage with the 10 s it may wait for its servers, and a dead worker's peer timeouts
//!   aside, a late joiner's extra iterations, and three no-progress times for a rule that
//!   never decides).
//!
//! A second fault that comes before the first failover's new backups hold their shards can take
//! a shard's last copy: a cluster loses that shard too, so such a run is counted as lost, not
//! failed. So is a run whose restarted coordinator found only older copies of a shard than its
//! newest (their servers died before the restart): [`SimError::Outdated`] when a surviving
//! server had heard of the newer term (the cluster says the shard is lost),
//! [`SimError::StaleCopy`] when none had (a cluster would serve the stale copy). A rebuild that
//! chose a copy older than one it had word of ([`SimError::OlderCopy`]) is never excused.
//!
//! A seed is the whole input: `syncopate simtest --seed S` replays seed `S` bit for bit, and a
//! failure prints that command, then shrinks the case ([`shrink`]). Not drawn yet: server
//! restarts, a link cut past the peer timeout, checkpoint rounds (see
//! `docs/fault-tolerance.md`).

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::builtin::PolicySpec;
use crate::lab::scenario::{RunSpec, Scenario};
use crate::lab::sim::{
    simulate, CheckpointCounts, Cut, FailAt, Node, RebuildCounts, SimError, SimFailure, SimFaults,
    SimLinkCut, SimOptions, SimPartition, SimRestart, Simulated, HOSTILE,
};
use crate::runtime::PolicyRuntime;
use syncopate_engine::coordinator::REJOIN_WAIT_MS;

/// What one seed runs: the scenario, the policy and the failure.
#[derive(Clone, Debug)]
pub struct Case {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The cluster, workload and budget.
    pub scenario: Scenario,
    /// The policy.
    pub policy: PolicySpec,
    /// The server that dies in the second run (the event is drawn once the first run has
    /// counted its events); `None` only in a shrunk case.
    pub server: Option<u32>,
    /// A second server that dies later in the same run, if any.
    pub second: Option<u32>,
    /// A server cut off from the coordinator in the same run, if any: which way, and for how
    /// many milliseconds (from an event drawn like the deaths').
    pub partition: Option<(u32, Cut, u64)>,
    /// How much later than the latency a worker may hear that a shard moved, in milliseconds.
    pub notice_delay_ms: u64,
    /// A worker that dies in the same run, if any (only under policies whose sums are exact).
    pub worker_death: Option<u32>,
    /// How much later than the link says a worker's message may reach a shard, in
    /// microseconds (in both runs: the undisturbed one too).
    pub reorder_us: u64,
    /// A policy hot-swapped to during both runs, at a time drawn from the undisturbed run's
    /// length (only between policies whose sums are exact).
    pub swap: Option<PolicySpec>,
    /// A worker that hears of moves this many milliseconds later still, in the disturbed run
    /// (10-15 s: longer than the grace promoted shards used to give, shorter than the client's move
    /// wait, after which a worker that still addresses a lost server gives up, as a cluster's
    /// does).
    pub late_worker: Option<(u32, u64)>,
    /// The chance that a message a shard took (from a worker, or a backup from its primary)
    /// reaches it again (in both runs).
    pub duplicate: f64,
    /// The chance that a bad request reaches a shard just before a worker's (in both runs).
    pub bad_inputs: f64,
    /// Workers that join this many milliseconds after the start, not with the others (in
    /// both runs; each runs the iterations from the clock it joins at to the end).
    pub late_join: Vec<(u32, u64)>,
    /// The coordinator crashes in the disturbed run (at an event drawn like the deaths') and
    /// restarts this many milliseconds later.
    pub coordinator_crash: Option<u64>,
    /// A worker cut off from a server, both ways, for this many milliseconds (under the peer
    /// timeout), from an event drawn like the deaths', in the disturbed run.
    pub link_cut: Option<(u32, u32, u64)>,
    /// Two servers cut off from each other (a primary's link to its backups), likewise.
    pub server_link_cut: Option<(u32, u32, u64)>,
    /// Whether the crashed coordinator's successor finds the terms it recorded (as on disk).
    pub crash_keeps_terms: bool,
    /// Checkpoint rounds in the disturbed run (0-3), each at an event drawn like the deaths'; in
    /// half the seeds with a swap one comes within two latencies of it, and in half those with a
    /// death one comes a few events after it.
    pub checkpoints: u32,
    /// The first server to die is started again (a new, empty process under its id) this many
    /// milliseconds after its death (it is admitted once a peer timeout has passed since it
    /// was lost); in a two-server cluster, perhaps the other server dies this many milliseconds
    /// after the restarted one took its id back, which only the restarted server's new backups
    /// can survive. Seeds with a restart run slower iterations (1.5-3 s), so that the run
    /// outlasts the peer timeout.
    pub restart: Option<(u64, Option<u64>)>,
}

/// What a passing seed exercised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exercised {
    /// Simulated runs (two per seed, three with a swap).
    pub runs: u64,
    /// Events handled over all runs.
    pub events: u64,
    /// The runs' traces ([`Simulated::trace`](crate::lab::sim::Simulated::trace)) summed: the
    /// same for the same seeds in any process and any order.
    pub trace: u64,
    /// Server deaths failed over (a death in a run's last events may come after its end).
    pub failovers: u64,
    /// Runs with two server deaths.
    pub double_failures: u64,
    /// Runs in which a shard lost its last copy (both its servers dead before a new backup
    /// held it), as a cluster would: not checked further.
    pub lost: u64,
    /// Of those, runs whose restarted coordinator found only older copies of a shard than a
    /// server had heard of, and said the shard was lost.
    pub outdated: u64,
    /// Of those, runs whose restarted coordinator found only a stale copy of a shard and no
    /// server had heard of a newer one (the rebuild's limit: a cluster would serve it).
    pub stale: u64,
    /// Runs with a server cut off from the coordinator.
    pub partitions: u64,
    /// Runs with a worker that died.
    pub worker_deaths: u64,
    /// Seeds with a hot swap (each runs a third time: the undisturbed run, with the swap).
    pub swaps: u64,
    /// Of those, swaps to a module that traps, spins or panics.
    pub hostile: u64,
    /// Of those, swaps to a module that refuses to take over the running policy's state: each
    /// refused by every server at its preparation (no shard switched, the record unchanged).
    pub refusing: u64,
    /// Of those, swaps to a rule that never decides (parks every pull or holds every push): the
    /// shards fail it after the no-progress time, resolve what it kept waiting, and quarantine it.
    pub undecided: u64,
    /// Swap preparations servers refused (a shard's state refused by the module).
    pub swaps_refused: u64,
    /// Runs whose shards found a rule stalled (every live worker waiting on it for the
    /// no-progress time).
    pub stalled: u64,
    /// Promoted primaries that switched to the policy their server records (their old primary
    /// died before it streamed a swap's commit).
    pub conformed: u64,
    /// Messages that reached a shard's primary or backup twice.
    pub duplicates: u64,
    /// Bad requests the shards refused.
    pub bad_inputs: u64,
    /// Runs whose coordinator crashed and was restarted (and rebuilt the cluster from its
    /// servers).
    pub coordinator_crashes: u64,
    /// What those rebuilds did.
    pub rebuild: RebuildCounts,
    /// What became of the checkpoint rounds (each taken one checked).
    pub checkpoints: CheckpointCounts,
    /// Servers restarted that took their id back (and kept new backups).
    pub restarts: u64,
    /// Two-server runs whose other server died after the restart, and lost nothing: the
    /// restarted server's new backups took over.
    pub saved_by_restart: u64,
    /// Ops from a deposed primary (a stale term) that reached its old backup after that backup
    /// was promoted, each ignored.
    pub stale_ops: u64,
    /// Runs with a link cut for a while (a worker's to a server, or between two servers).
    pub link_cuts: u64,
    /// The longest a disturbed run took beyond its undisturbed one, in milliseconds of virtual
    /// time, less its partition's length and a dead worker's peer timeout.
    pub max_delay_ms: u64,
}

impl std::ops::AddAssign for Exercised {
    fn add_assign(&mut self, o: Self) {
        self.runs += o.runs;
        self.events += o.events;
        self.trace = self.trace.wrapping_add(o.trace);
        self.failovers += o.failovers;
        self.double_failures += o.double_failures;
        self.lost += o.lost;
        self.stale += o.stale;
        self.outdated += o.outdated;
        self.partitions += o.partitions;
        self.worker_deaths += o.worker_deaths;
        self.swaps += o.swaps;
        self.refusing += o.refusing;
        self.undecided += o.undecided;
        self.swaps_refused += o.swaps_refused;
        self.stalled += o.stalled;
        self.conformed += o.conformed;
        self.duplicates += o.duplicates;
        self.bad_inputs += o.bad_inputs;
        self.hostile += o.hostile;
        self.coordinator_crashes += o.coordinator_crashes;
        self.rebuild += o.rebuild;
        self.checkpoints += o.checkpoints;
        self.restarts += o.restarts;
        self.saved_by_restart += o.saved_by_restart;
        self.stale_ops += o.stale_ops;
        self.link_cuts += o.link_cuts;
        self.max_delay_ms = self.max_delay_ms.max(o.max_delay_ms);
    }
}

/// The policies a seed draws from. R²SP weighs pushes by their samples (its sums are not the
/// plain counts); EPSP is left out because which worker computes a moved task depends on
/// timing, so a failover may rightly change its sums (its exactly-once accounting is tested in
/// `tests/all/sim.rs`).
const POLICIES: &[&str] = &["bsp", "asp", "ssp:s=1", "ssp:s=3", "dssp", "fluentps", "r2sp"];

/// The policies a seed hot-swaps to: every one whose sums are exact. A swap to a policy that
/// holds pulls back by the clocks (BSP, SSP, DSSP, FluentPS) once deadlocked a cluster of several
/// servers, when each shard levelled its clocks to its own largest at its own commit (seed 504
/// found it); the levelling is now one raise per worker that every shard applies alike
/// (`syncopate_engine::shard::Frontier`). Local SGD and DiLoCo (its outer optimizer at
/// learning rate 1 without momentum, so that sums stay exact) make workers push
/// pseudo-gradients of 2 or 3 steps after the swap: each shard must step them with its outer
/// optimizer, and the workers' gradients in flight across the swap with its own.
///
/// Asynchronous local SGD (the same outer step, steps not scaled by speed, so that a dead
/// worker's last push is known) applies pseudo-gradients on arrival; Sync-Switch goes from
/// BSP's aggregate rounds to ASP mid-run, applying the partial rounds as they stand.
const SWAP_TARGETS: &[&str] = &[
    "asp",
    "bsp",
    "ssp:s=1",
    "dssp",
    "fluentps",
    "localsgd:h=2",
    "diloco:h=3,outer_lr=1,outer_momentum=0",
    "async-localsgd:h=2,outer_lr=1,outer_momentum=0,dylu=false",
    "syncswitch:switch_at=2",
];

/// The local steps a swap target sets (0: none).
fn local_steps(policy: &PolicySpec) -> u64 {
    let h = policy.config.iter().find(|(k, _)| k == "h").and_then(|(_, v)| v.parse().ok());
    match policy.source.as_str() {
        "localsgd" | "diloco" | "async-localsgd" => h.unwrap_or(0),
        _ => 0,
    }
}

/// Whether a policy admits every push at weight 1, so that the counter's sums are exact.
fn unit_weights(policy: &PolicySpec) -> bool {
    policy.source != "r2sp"
}

/// A fault a case can be shrunk without ([`Case::without`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The server death every case draws.
    Death,
    /// The second server death.
    SecondDeath,
    /// The server cut off from the coordinator.
    Partition,
    /// The workers hearing of moves late.
    NoticeDelay,
    /// The worker death.
    WorkerDeath,
    /// Messages to shards delayed, so that they overtake each other.
    Reorder,
    /// The hot swap (to a hostile module or not).
    Swap,
    /// The worker that hears of moves 10-15 s later still.
    LateWorker,
    /// Messages and ops delivered twice.
    Duplicates,
    /// Bad requests.
    BadInputs,
    /// Late joiners.
    LateJoin,
    /// The coordinator's crash and restart.
    CoordinatorCrash,
    /// The worker cut off from a server.
    LinkCut,
    /// The two servers cut off from each other.
    ServerLinkCut,
    /// The checkpoint rounds.
    Checkpoints,
    /// The dead server's restart (and the death it lets a two-server cluster survive).
    Restart,
}

impl Fault {
    /// Every fault, in the order a shrink tries to remove them.
    pub const ALL: [Fault; 16] = [
        Fault::Checkpoints,
        Fault::BadInputs,
        Fault::Duplicates,
        Fault::Reorder,
        Fault::NoticeDelay,
        Fault::LateJoin,
        Fault::LateWorker,
        Fault::Swap,
        Fault::WorkerDeath,
        Fault::LinkCut,
        Fault::ServerLinkCut,
        Fault::Partition,
        Fault::CoordinatorCrash,
        Fault::Restart,
        Fault::SecondDeath,
        Fault::Death,
    ];

    /// Its name on the command line (`--without`).
    pub fn name(self) -> &'static str {
        match self {
            Fault::Death => "death",
            Fault::SecondDeath => "second-death",
            Fault::Partition => "partition",
            Fault::NoticeDelay => "notice-delay",
            Fault::WorkerDeath => "worker-death",
            Fault::Reorder => "reorder",
            Fault::Swap => "swap",
            Fault::LateWorker => "late-worker",
            Fault::Duplicates => "duplicates",
            Fault::BadInputs => "bad-inputs",
            Fault::LateJoin => "late-join",
            Fault::CoordinatorCrash => "coordinator-crash",
            Fault::LinkCut => "link-cut",
            Fault::ServerLinkCut => "server-link-cut",
            Fault::Checkpoints => "checkpoints",
            Fault::Restart => "restart",
        }
    }
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Fault::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
            format!("no fault called `{s}`: one of {}", names.join(", "))
        })
    }
}

/// A failing case with fewer faults that still fails ([`shrink`]).
#[derive(Clone, Debug)]
pub struct Shrunk {
    /// The faults it goes without.
    pub without: Vec<Fault>,
    /// The case.
    pub case: Case,
    /// Why it fails.
    pub why: String,
}

impl Shrunk {
    /// The command that replays it.
    pub fn replay(&self) -> String {
        let names: Vec<&str> = self.without.iter().map(|f| f.name()).collect();
        match names.is_empty() {
            true => format!("syncopate simtest --seed {}", self.case.seed),
            false => format!("syncopate simtest --seed {} --without {}", self.case.seed, names.join(",")),
        }
    }
}

/// Shrinks a failing case: drops each fault in turn ([`Fault::ALL`]'s order) for as long as the
/// case still fails without it (any failure counts: a simpler schedule that breaks anything is
/// what a reader wants first). The times of the faults kept are drawn as before, but on the
/// undisturbed run of the smaller case, so they may land elsewhere.
pub fn shrink(rt: &PolicyRuntime, case: &Case, why: String) -> Shrunk {
    let mut out = Shrunk { without: Vec::new(), case: case.clone(), why };
    for f in Fault::ALL {
        let Some(smaller) = out.case.without(f) else { continue };
        if let Err(why) = smaller.check(rt) {
            out.without.push(f);
            out.case = smaller;
            out.why = why;
        }
    }
    out
}

impl Case {
    /// The case without fault `f`, or `None` if it has none. Every other draw stays as it was.
    pub fn without(&self, f: Fault) -> Option<Case> {
        let mut c = self.clone();
        let had = match f {
            Fault::Death => c.server.take().is_some(),
            Fault::SecondDeath => c.second.take().is_some(),
            Fault::Partition => c.partition.take().is_some(),
            Fault::NoticeDelay => std::mem::take(&mut c.notice_delay_ms) > 0,
            Fault::WorkerDeath => c.worker_death.take().is_some(),
            Fault::Reorder => std::mem::take(&mut c.reorder_us) > 0,
            Fault::Swap => c.swap.take().is_some(),
            Fault::LateWorker => c.late_worker.take().is_some(),
            Fault::Duplicates => std::mem::take(&mut c.duplicate) > 0.0,
            Fault::BadInputs => std::mem::take(&mut c.bad_inputs) > 0.0,
            Fault::LateJoin => !std::mem::take(&mut c.late_join).is_empty(),
            Fault::CoordinatorCrash => c.coordinator_crash.take().is_some(),
            Fault::LinkCut => c.link_cut.take().is_some(),
            Fault::ServerLinkCut => c.server_link_cut.take().is_some(),
            Fault::Checkpoints => std::mem::take(&mut c.checkpoints) > 0,
            Fault::Restart => c.restart.take().is_some(),
        };
        had.then_some(c)
    }

    /// The case without any of `faults` (those it has).
    pub fn without_all(&self, faults: &[Fault]) -> Case {
        faults.iter().fold(self.clone(), |c, &f| c.without(f).unwrap_or(c))
    }

    /// The case seed `seed` draws.
    pub fn draw(seed: u64) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_7e57_0000_0036);
        let workers: u32 = rng.random_range(2..=5);
        let servers: u32 = rng.random_range(2..=3);
        let shards: u32 = rng.random_range(servers..=servers + 2);
        let params = shards as usize * rng.random_range(1..=3);
        let iterations: u64 = rng.random_range(3..=10);
        let compute_ms: u64 = rng.random_range(1..=400);
        let mut text = format!(
            "name = \"simtest-{seed}\"\nworkers = {workers}\nservers = {servers}\nshards = {shards}\n\
             workload = \"counter\"\nparams = {params}\ncompute_ms = {compute_ms}\niterations = {iterations}\n\
             time_limit_s = 600\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\nreplicas = 1\n\
             latency_us = {}\nseed = {seed}\n",
            rng.random_range(10..=3000u64)
        );
        for w in 0..workers {
            if rng.random_bool(0.4) {
                let mean = rng.random_range(0.0..8.0f64);
                let sd = rng.random_range(0.0..4.0f64);
                text += &format!("[[jitter]]\nworker = {w}\nmean_ms = {mean:.3}\nsd_ms = {sd:.3}\n");
            }
        }
        if rng.random_bool(0.5) {
            let w = rng.random_range(0..workers);
            let factor = rng.random_range(1.5..4.0f64);
            text += &format!("[[slow]]\nworker = {w}\nfactor = {factor:.3}\n");
        }
        let scenario: Scenario = toml::from_str(&text).expect("a drawn scenario parses");
        let policy = POLICIES[rng.random_range(0..POLICIES.len())].parse().expect("a built-in policy");
        let server = rng.random_range(0..servers);
        let second =
            (servers >= 3 && rng.random_bool(0.5)).then(|| (server + rng.random_range(1..servers)) % servers);
        let partition = rng.random_bool(0.5).then(|| {
            let cut = [Cut::Both, Cut::ToCoordinator, Cut::FromCoordinator][rng.random_range(0..3)];
            (rng.random_range(0..servers), cut, rng.random_range(100..=4000))
        });
        let notice_delay_ms = if rng.random_bool(0.5) { rng.random_range(0..=1000) } else { 0 };
        let worker_death =
            (unit_weights(&policy) && rng.random_bool(0.3)).then(|| rng.random_range(0..workers));
        let reorder_us = if rng.random_bool(0.5) { rng.random_range(0..=5000) } else { 0 };
        let swap: Option<PolicySpec> = (unit_weights(&policy) && rng.random_bool(0.3)).then(|| {
            SWAP_TARGETS[rng.random_range(0..SWAP_TARGETS.len())].parse().expect("a built-in policy")
        });
        // Drawn last, so that the draws above are what they were before it.
        let late_worker =
            rng.random_bool(0.2).then(|| (rng.random_range(0..workers), rng.random_range(10_000..=15_000)));
        let duplicate = if rng.random_bool(0.3) { rng.random_range(0.01..0.25) } else { 0.0 };
        // In some seeds the swap is to a module that traps, spins or panics on every pull or
        // every push after a while: the shards restart it, then quarantine it and go on under
        // the fallback rules (a push admitted, a pull served by BSP's rule), alike on every
        // primary and backup (fuel, not time, stops a spin).
        let hostile = swap.is_some() && rng.random_bool(0.3);
        let bad_inputs = if rng.random_bool(0.3) { rng.random_range(0.01..0.2) } else { 0.0 };
        // One late joiner in a fifth of the seeds, and in half of those a second one.
        let mut late_join = Vec::new();
        if rng.random_bool(0.2) {
            let first = rng.random_range(0..workers);
            late_join.push((first, rng.random_range(0..=iterations * compute_ms)));
            if workers >= 3 && rng.random_bool(0.5) {
                let second = (first + rng.random_range(1..workers)) % workers;
                late_join.push((second, rng.random_range(0..=iterations * compute_ms)));
            }
        }
        // The coordinator crashes in a quarter of the seeds, for 0.1-5 s.
        let coordinator_crash = rng.random_bool(0.25).then(|| rng.random_range(100..=5000));
        // A worker cut off from a server in a quarter of the seeds, for 0.1-8 s.
        let link_cut = rng.random_bool(0.25).then(|| {
            (rng.random_range(0..workers), rng.random_range(0..servers), rng.random_range(100..=8000))
        });
        // Two servers cut off from each other in a quarter of the seeds, for 0.1-8 s.
        let server_link_cut = rng.random_bool(0.25).then(|| {
            let x = rng.random_range(0..servers);
            (x, (x + rng.random_range(1..servers)) % servers, rng.random_range(100..=8000))
        });
        let crash_keeps_terms = rng.random_bool(0.5);
        // Checkpoint rounds in half the seeds, one to three.
        let checkpoints = if rng.random_bool(0.5) { rng.random_range(1..=3) } else { 0 };
        // The dead server restarted in a fifth of the seeds, 0.5-8 s after its death; then, in
        // half of those, the other server of a two-server cluster dies 0.1-4 s after the
        // restart. Their iterations take 1.5-3 s, so that the run lasts past the restart.
        let restart = rng.random_bool(0.2).then(|| {
            let then = rng.random_bool(0.5).then(|| rng.random_range(100..=4000));
            (rng.random_range(500..=8000), then.filter(|_| servers == 2))
        });
        let mut scenario = scenario;
        let slow_ms = rng.random_range(1500..=3000u64);
        if restart.is_some() {
            scenario.compute_ms = slow_ms;
        }
        let swap = match hostile {
            true => {
                let on = ["pull", "push"][rng.random_range(0..2)];
                let how = ["trap", "loop", "panic"][rng.random_range(0..3)];
                let after = rng.random_range(0..=60);
                let spec = format!("{HOSTILE}:mode={on}:{how},after={after}");
                Some(spec.parse().expect("the hostile module's spec parses"))
            }
            false => swap,
        };
        // Drawn after every other draw, so that those are what they were before it. In some
        // seeds with a swap, the swap is to a module that refuses the running policy's state
        // (refused by every server at its preparation: nothing switches, the coordinator's
        // record stays the old policy), or to a rule that never decides after a while (parks
        // every pull, or holds every push: the shards find it stalled after the no-progress
        // time, 0.5-2 s here, and resolve what it kept waiting by the fallback rules).
        let rule = rng.random_range(0..10u32);
        let after = rng.random_range(0..=60u32);
        let no_progress_ms = rng.random_range(500..=2000u64);
        let swap = match (swap, rule) {
            (Some(_), 0..=1) => Some(format!("{HOSTILE}:mode=refuse-state")),
            (Some(_), 2) => Some(format!("{HOSTILE}:mode=pull:park,after={after}")),
            (Some(_), 3) => Some(format!("{HOSTILE}:mode=push:hold,after={after}")),
            (swap, _) => swap.map(|s| s.to_string()),
        }
        .map(|s| s.parse().expect("the swap's spec parses"));
        if swap.as_ref().is_some_and(never_decides) {
            scenario.no_progress_s = Some(no_progress_ms as f64 / 1e3);
        }
        Case {
            seed,
            scenario,
            policy,
            server: Some(server),
            second,
            partition,
            notice_delay_ms,
            worker_death,
            reorder_us,
            swap,
            late_worker,
            duplicate,
            bad_inputs,
            late_join,
            coordinator_crash,
            link_cut,
            server_link_cut,
            crash_keeps_terms,
            checkpoints,
            restart,
        }
    }

    /// How much longer late joiners may rightly take in the disturbed run: a fault that
    /// slowed the others means one joins at a lower clock and has more iterations to run, and
    /// a clock-gated policy holds the others back for it. Twice its time per iteration there,
    /// per extra iteration.
    fn late_joiner_extra_ns(&self, clean: &Simulated, failed: &Simulated) -> u64 {
        let ran = |run: &Simulated, w: u32| {
            run.report.workers.iter().find(|r| r.worker == w).cloned().unwrap_or_default()
        };
        let extra_ns = |&(w, _): &(u32, u64)| {
            let (before, after) = (ran(clean, w), ran(failed, w));
            let extra = after.iterations.saturating_sub(before.iterations);
            extra * 2 * (after.elapsed_ns / after.iterations.max(1))
        };
        self.late_join.iter().map(extra_ns).sum()
    }

    fn late_join(&self) -> Vec<(u32, FailAt)> {
        self.late_join.iter().map(|&(w, ms)| (w, FailAt::Time(ms * 1_000_000))).collect()
    }

    fn run(
        &self,
        rt: &PolicyRuntime,
        failures: Vec<SimFailure>,
        faults: SimFaults,
    ) -> Result<Simulated, SimError> {
        let opts = SimOptions {
            run: RunSpec::new(self.scenario.clone(), self.policy.clone()),
            gradients: true,
            data: None,
            failures,
            faults,
        };
        simulate(&opts, rt)
    }

    /// Runs the case and checks its invariants (the module's doc). `Err` says what broke.
    pub fn check(&self, rt: &PolicyRuntime) -> Result<Exercised, String> {
        self.scenario.check()?;
        let iterations = self.scenario.iterations.expect("drawn with iterations");
        let quiet = SimFaults {
            reorder_ns: self.reorder_us * 1000,
            duplicate: self.duplicate,
            bad_inputs: self.bad_inputs,
            late_join: self.late_join(),
            ..SimFaults::default()
        };
        let mut clean =
            self.run(rt, Vec::new(), quiet.clone()).map_err(|e| format!("undisturbed run: {e}"))?;
        // Every time is drawn whether its fault is in the case or not, so that a case shrunk
        // without a fault ([`Case::without`]) keeps the others' draws.
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0xe7e7_0000_0036);
        // The swap's time is drawn from the run without it, and both runs swap then.
        let end = (clean.report.elapsed_s * 1e9) as u64;
        let swap_at = FailAt::Time(rng.random_range(0..end.max(1)));
        let swaps: Vec<(FailAt, PolicySpec)> =
            self.swap.clone().map(|spec| (swap_at, spec)).into_iter().collect();
        let swapped = swaps.len() as u64;
        let hostile = u64::from(
            self.swap.as_ref().is_some_and(|p| p.source == HOSTILE && !refuses(p) && !never_decides(p)),
        );
        let refusing = u64::from(self.swap.as_ref().is_some_and(refuses));
        let undecided = u64::from(self.swap.as_ref().is_some_and(never_decides));
        if !swaps.is_empty() {
            let with = SimFaults { swaps: swaps.clone(), ..quiet };
            clean = self.run(rt, Vec::new(), with).map_err(|e| format!("undisturbed run: {e}"))?;
        }
        every_iteration(&clean, iterations, "undisturbed run")?;
        if let Some(d) = &clean.replicas_differ {
            return Err(format!("undisturbed run: {d}"));
        }
        if let Some(d) = &clean.policy_differs {
            return Err(format!("undisturbed run: one record of the policy: {d}"));
        }
        // (A swap drawn near the run's end may not have ended before it: no verdict then.)
        if refusing > 0 && clean.swaps_ended > 0 && clean.swaps_refused == 0 {
            return Err("undisturbed run: the swap to a module that refuses the state was not refused".into());
        }
        if unit_weights(&self.policy) {
            exact(&clean, None, 0, "undisturbed run")?;
        }
        let n = clean.events.max(1);
        let at = rng.random_range(0..n);
        let later = rng.random_range(at..clean.events.max(at + 1));
        let partition_at = FailAt::Event(rng.random_range(0..n));
        let death_at = FailAt::Event(rng.random_range(0..n));
        let crash_event = FailAt::Event(rng.random_range(0..n));
        let crash_in_swap = rng.random_bool(0.5);
        let crash_offset_ns = rng.random_range(0..=4 * self.scenario.latency_us * 1000);
        let link_cut_at = FailAt::Event(rng.random_range(0..n));
        let server_link_cut_at = FailAt::Event(rng.random_range(0..n));
        // Checkpoint rounds: in half the seeds with a death, one a few events after it (its
        // commands meet the dead server, or the failover); in half those with a swap, one
        // within a few latencies of it (a round and a swap must not overlap).
        let round_events: Vec<u64> = (0..3).map(|_| rng.random_range(0..n)).collect();
        let (round_at_death, after_death) = (rng.random_bool(0.5), rng.random_range(0..=50u64));
        let round_in_swap = rng.random_bool(0.5);
        let round_offset_ns = rng.random_range(0..=4 * self.scenario.latency_us * 1000);
        let mut near: Vec<FailAt> = Vec::new();
        if let Some(FailAt::Time(t)) = swaps.first().map(|s| s.0).filter(|_| round_in_swap) {
            near.push(FailAt::Time(
                (t + round_offset_ns).saturating_sub(2 * self.scenario.latency_us * 1000),
            ));
        }
        if round_at_death && self.server.is_some() {
            near.push(FailAt::Event(at + after_death));
        }
        let checkpoints: Vec<FailAt> = (0..self.checkpoints as usize)
            .map(|i| near.get(i).copied().unwrap_or(FailAt::Event(round_events[i.min(2)])))
            .collect();
        let cut = |a, b, at, ms: u64| SimLinkCut { a, b, at, heal_after_ns: ms * 1_000_000 };
        let link_cuts: Vec<SimLinkCut> = self
            .link_cut
            .map(|(w, x, ms)| cut(Node::Worker(w), Node::Server(x), link_cut_at, ms))
            .into_iter()
            .chain(
                self.server_link_cut
                    .map(|(x, y, ms)| cut(Node::Server(x), Node::Server(y), server_link_cut_at, ms)),
            )
            .collect();
        let mut failures: Vec<SimFailure> =
            self.server.map(|server| SimFailure { server, at: FailAt::Event(at) }).into_iter().collect();
        if let Some(second) = self.second {
            failures.push(SimFailure { server: second, at: FailAt::Event(later) });
        }
        // A restart, and in a two-server cluster perhaps the other server's death after it.
        let server_restarts: Vec<SimRestart> = self
            .server
            .zip(self.restart)
            .map(|(x, (ms, then))| SimRestart {
                server: x,
                after_ns: ms * 1_000_000,
                then_kill: then.map(|t| (1 - x, t * 1_000_000)),
            })
            .into_iter()
            .collect();
        let partitions: Vec<SimPartition> = self
            .partition
            .map(|(server, cut, ms)| SimPartition {
                server,
                at: partition_at,
                heal_after_ns: ms * 1_000_000,
                cut,
            })
            .into_iter()
            .collect();
        let worker_deaths: Vec<(u32, FailAt)> =
            self.worker_death.map(|w| (w, death_at)).into_iter().collect();
        // Half the crashes in seeds with a swap come while it is under way (its prepare or
        // commit in flight, within a few latencies of its start), so that a restarted
        // coordinator finds some servers committed and others not.
        let crash: Option<(FailAt, u64)> = self.coordinator_crash.map(|ms| {
            let at = match swaps.first() {
                Some((FailAt::Time(t), _)) if crash_in_swap => FailAt::Time(t + crash_offset_ns),
                _ => crash_event,
            };
            (at, ms * 1_000_000)
        });
        let what = failures
            .iter()
            .map(|f| format!("server {} killed before {}", f.server, when(f.at)))
            .chain(partitions.iter().map(|p| {
                let ms = p.heal_after_ns / 1_000_000;
                format!("server {} cut off ({:?}) for {ms} ms from {}", p.server, p.cut, when(p.at))
            }))
            .chain(worker_deaths.iter().map(|(w, at)| format!("worker {w} killed before {}", when(*at))))
            .chain(swaps.iter().map(|(at, spec)| format!("swap to {spec} at {}", when(*at))))
            .chain(
                crash.iter().map(|(at, ns)| {
                    format!("coordinator crashed for {} ms from {}", ns / 1_000_000, when(*at))
                }),
            )
            .chain(link_cuts.iter().map(|c| {
                let ms = c.heal_after_ns / 1_000_000;
                format!("{:?} cut off from {:?} for {ms} ms from {}", c.a, c.b, when(c.at))
            }))
            .chain(checkpoints.iter().map(|at| format!("checkpoint round at {}", when(*at))))
            .chain(server_restarts.iter().map(|r| {
                let then = r.then_kill.map(|(y, ns)| {
                    format!(", then server {y} killed {} ms after it took its id back", ns / 1_000_000)
                });
                let ms = r.after_ns / 1_000_000;
                format!("server {} restarted {ms} ms after its death{}", r.server, then.unwrap_or_default())
            }))
            .collect::<Vec<_>>()
            .join(", ");
        let dead_worker = worker_deaths.first().map(|d| d.0);
        let then_kills = server_restarts.iter().filter(|r| r.then_kill.is_some()).count();
        let double = u64::from(failures.len() + then_kills > 1);
        let server_faults = failures.len() + partitions.len() + then_kills;
        let faults = server_faults + worker_deaths.len() + crash.iter().count() + server_restarts.len();
        // A restarted coordinator waits up to `REJOIN_WAIT_MS` for a server that does not
        // rejoin (dead, or cut off) before it rebuilds without it; meanwhile nothing serves.
        let crash_ns = crash.map_or(0, |c| c.1 + REJOIN_WAIT_MS * 1_000_000);
        let partitioned = partitions.len() as u64;
        // A cut link holds a worker up as long as it lasts.
        let partition_ns = partitions.iter().map(|p| p.heal_after_ns).sum::<u64>()
            + link_cuts.iter().map(|c| c.heal_after_ns).sum::<u64>();
        let link_cut = u64::from(!link_cuts.is_empty());
        let failed = match self.run(
            rt,
            failures,
            SimFaults {
                partitions,
                worker_deaths,
                notice_delay_ns: self.notice_delay_ms * 1_000_000,
                reorder_ns: self.reorder_us * 1000,
                swaps: swaps.clone(),
                late_worker: self.late_worker.map(|(w, ms)| (w, ms * 1_000_000)),
                duplicate: self.duplicate,
                bad_inputs: self.bad_inputs,
                late_join: self.late_join(),
                coordinator_crash: crash,
                crash_keeps_terms: self.crash_keeps_terms,
                link_cuts,
                checkpoints,
                server_restarts,
            },
        ) {
            Ok(f) => f,
            // Both copies of a shard dead (or cut off) before a new backup held it: a cluster
            // loses it too. (A worker's death takes no copy.)
            Err(
                e @ (SimError::ShardLost { .. } | SimError::StaleCopy { .. } | SimError::Outdated { .. }),
            ) if server_faults > 1 => {
                let lost = Exercised {
                    runs: 2 + swapped,
                    swaps: swapped,
                    hostile,
                    duplicates: clean.duplicates,
                    bad_inputs: clean.bad_inputs,
                    events: clean.events,
                    trace: clean.trace,
                    double_failures: double,
                    lost: 1,
                    stale: u64::from(matches!(e, SimError::StaleCopy { .. })),
                    outdated: u64::from(matches!(e, SimError::Outdated { .. })),
                    partitions: partitioned,
                    worker_deaths: u64::from(dead_worker.is_some()),
                    coordinator_crashes: u64::from(crash.is_some()),
                    link_cuts: link_cut,
                    ..Exercised::default()
                };
                return Ok(lost);
            }
            Err(e) => return Err(format!("{what}: {e}")),
        };
        for (run, name) in [(&clean, "undisturbed run"), (&failed, what.as_str())] {
            if let Some(two) = &run.two_primaries {
                return Err(format!("{name}: two primaries: {two}"));
            }
        }
        every_iteration_but(&failed, iterations, &what, dead_worker)?;
        if let Some(d) = &failed.replicas_differ {
            return Err(format!("{what}: {d}"));
        }
        if let Some(d) = &failed.policy_differs {
            return Err(format!("{what}: one record of the policy: {d}"));
        }
        // A stall is a rule's failure to decide: only a rule that never decides may be found
        // stalled (a worker computing, or one whose pull was answered everywhere, waits on
        // nothing, whatever the faults). One limit: a worker whose pull waits on a shard it
        // cannot reach has told the shards that it waits, and counts as waiting: if that lasts
        // about the no-progress time, the rule that keeps the others waiting for it is found
        // stalled. So a stall of a rule that decides is accepted only where the run's faults
        // could keep a worker away that long: its requests' waits on dead primaries until it
        // heard of the moves (measured by the simulator, from each request's loss), the cut
        // links and partitions, a coordinator's crash and a failover per fault (seed 408: a
        // worker heard of a move 29.8 s late; 9859: 21.6 s late, two servers dead; 34448: 20.4 s
        // on dead primaries, a 7.5 s cut link and a 3.9 s coordinator crash; all under SSP). A
        // dead worker counts as live, and as waiting on the shards that had not acknowledged
        // its last push, until the shards drop it: a peer timeout after its death, and on a
        // shard promoted meanwhile, the promoted shard's backstop (60 s; seed 5587).
        let no_progress_ns = self.scenario.supervisor().no_progress_ns;
        let faults_ns = partition_ns + crash_ns + LIVENESS_NS_PER_FAULT * faults as u64;
        let disturbed = [
            (&clean, "undisturbed run", 0, false),
            (&failed, what.as_str(), faults_ns, dead_worker.is_some()),
        ];
        for (run, name, faults_ns, dead) in disturbed {
            let unreachable = dead || run.unreachable_ns + faults_ns >= no_progress_ns;
            if undecided == 0 && !unreachable && stalled(run) {
                return Err(format!(
                    "{name}: a shard found a rule that decides stalled (the most a worker's requests \
                     waited on shards it could not reach: {:.1} s; the faults' time: {:.1} s)",
                    run.unreachable_ns as f64 / 1e9,
                    faults_ns as f64 / 1e9
                ));
            }
        }
        // Liveness: once the faults are over, the run finishes within a bound.
        // Liveness is the live workers': a run goes on after they are done while the servers
        // wait out a dead worker's timeouts.
        let delay_ns = finished_at(&failed, dead_worker).saturating_sub(finished_at(&clean, None));
        // A dead worker is made to leave a peer timeout after its death, and synchronous rules
        // wait for it until then; a backup promoted before then waits for it as long.
        let waits = 1 + u64::from(faults > 1);
        let peer_timeout_ns = dead_worker.map_or(0, |_| waits * crate::lab::sim::PEER_TIMEOUT_NS);
        let delay_ns = delay_ns.saturating_sub(partition_ns + peer_timeout_ns + crash_ns);
        let late_ns = self.late_worker.map_or(0, |l| l.1 * 1_000_000);
        // After a swap to local steps, an iteration computes that many steps: a fault that
        // left more iterations after the swap than the undisturbed run had makes the run
        // longer by their extra steps (the slowest device is at most 4x slower).
        let h = self.swap.as_ref().map_or(0, local_steps);
        let local_ns = h.saturating_sub(1) * iterations * self.scenario.compute_ms * 4 * 1_000_000;
        // A rule that never decides stalls the run three times before it is quarantined, at
        // times the faults shift, so that the disturbed run may meet stalls the undisturbed
        // one ended before. A stall lasts until the last worker reaches the rule (it finishes
        // its iteration: at most the slowest device's, 4x the scenario's compute time), then a
        // no-progress time; a shard that sees a worker waiting on another shard's pull only
        // once it says so counts from its notice, a second into its wait (seed 2018 of a soak
        // met a third stall of 12 s that its undisturbed run never had).
        let stall_ns = self.scenario.compute_ms * 4 * 1_000_000
            + self.scenario.supervisor().no_progress_ns
            + syncopate_engine::worker::WAIT_NOTICE_NS;
        let undecided_ns = undecided * 3 * stall_ns;
        let bound_ns = (LIVENESS_NS_PER_FAULT + self.notice_delay_ms * 1_000_000 + late_ns) * faults as u64
            + self.late_joiner_extra_ns(&clean, &failed)
            + local_ns
            + undecided_ns;
        if delay_ns > bound_ns {
            return Err(format!(
                "{what}: the live workers finished {:.3} s after the undisturbed run's did (at {:.3} s), \
                 partitions and peer timeouts aside (the bound is {:.1} s): not live",
                delay_ns as f64 / 1e9,
                finished_at(&clean, None) as f64 / 1e9,
                bound_ns as f64 / 1e9
            ));
        }
        if dead_worker.is_some() || !self.late_join.is_empty() || h > 0 {
            // Not the undisturbed model: a dead worker pushed less, a late joiner starts where
            // the shards' clocks are when it joins, and after a swap to local steps a fault
            // changes how many iterations take them. Still, every push exactly once.
            if unit_weights(&self.policy) {
                exact(&failed, dead_worker, h, &what)?;
            }
        } else if bits(&clean) != bits(&failed) {
            let i = (0..clean.model.len()).find(|&i| clean.model[i].to_bits() != failed.model[i].to_bits());
            let i = i.unwrap_or(0);
            return Err(format!(
                "{what}: parameter {i} ends at {}, the undisturbed run's at {}: \
                 an acknowledged update was lost or applied twice",
                failed.model.get(i).copied().unwrap_or(f32::NAN),
                clean.model.get(i).copied().unwrap_or(f32::NAN),
            ));
        }
        Ok(Exercised {
            runs: 2 + swapped,
            swaps: swapped,
            events: clean.events + failed.events,
            trace: clean.trace.rotate_left(17) ^ failed.trace,
            failovers: failed.report.failovers.len() as u64,
            double_failures: double,
            lost: 0,
            stale: 0,
            outdated: 0,
            partitions: partitioned,
            worker_deaths: u64::from(dead_worker.is_some()),
            duplicates: clean.duplicates + failed.duplicates,
            bad_inputs: clean.bad_inputs + failed.bad_inputs,
            hostile,
            refusing,
            undecided,
            swaps_refused: clean.swaps_refused + failed.swaps_refused,
            stalled: u64::from(stalled(&clean)) + u64::from(stalled(&failed)),
            conformed: failed.conformed,
            coordinator_crashes: u64::from(crash.is_some()),
            rebuild: failed.rebuild,
            checkpoints: failed.checkpoints,
            restarts: failed.restarts,
            saved_by_restart: failed.killed_after_restart,
            stale_ops: failed.stale_ops,
            link_cuts: link_cut,
            max_delay_ms: delay_ns / 1_000_000,
        })
    }

    /// One line that says what the case is.
    pub fn describe(&self) -> String {
        let s = &self.scenario;
        format!(
            "{} workers, {} servers, {} shards, {} iterations, policy {}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}",
            s.workers,
            s.servers,
            s.shards.unwrap_or(s.servers),
            s.iterations.unwrap_or(0),
            self.policy,
            self.server.map(|x| format!(", server {x} dies")).unwrap_or_default(),
            self.second.map(|s| format!(", then server {s}")).unwrap_or_default(),
            self.partition
                .map(|(x, cut, ms)| format!(
                    ", server {x} cut off from the coordinator ({cut:?}) for {ms} ms"
                ))
                .unwrap_or_default(),
            match self.notice_delay_ms {
                0 => String::new(),
                ms => format!(", workers hear of moves up to {ms} ms late"),
            },
            self.worker_death.map(|w| format!(", worker {w} dies")).unwrap_or_default(),
            match self.reorder_us {
                0 => String::new(),
                us => format!(", messages to shards up to {us} µs late (reordered)"),
            },
            self.swap.as_ref().map(|p| format!(", hot swap to {p}")).unwrap_or_default(),
            self.late_worker
                .map(|(w, ms)| format!(", worker {w} hears of moves {ms} ms later still"))
                .unwrap_or_default(),
            match self.duplicate {
                0.0 => String::new(),
                p => format!(", {:.0}% of the messages shards take arrive twice", p * 100.0),
            },
            match self.bad_inputs {
                0.0 => String::new(),
                p => format!(", a bad request before {:.0}% of the requests", p * 100.0),
            },
            self.late_join
                .iter()
                .map(|(w, ms)| format!(", worker {w} joins {ms} ms late"))
                .collect::<String>(),
            self.coordinator_crash
                .map(|ms| {
                    let kept = if self.crash_keeps_terms { "" } else { ", its recorded terms lost" };
                    format!(", the coordinator crashes for {ms} ms{kept}")
                })
                .unwrap_or_default(),
            self.link_cut
                .map(|(w, x, ms)| format!(", worker {w} cut off from server {x} for {ms} ms"))
                .unwrap_or_default(),
            self.server_link_cut
                .map(|(x, y, ms)| format!(", servers {x} and {y} cut off from each other for {ms} ms"))
                .unwrap_or_default(),
            match self.checkpoints {
                0 => String::new(),
                n => format!(", {n} checkpoint round{}", if n > 1 { "s" } else { "" }),
            },
            match (self.restart, self.server) {
                (Some((ms, then)), Some(x)) => {
                    let other = then.map(|t| format!(", then server {} dies {t} ms after that", 1 - x));
                    format!(", server {x} restarts {ms} ms after its death{}", other.unwrap_or_default())
                }
                _ => String::new(),
            }
        )
    }
}

/// How much longer than the undisturbed run a disturbed one may take, per fault, besides its
/// partition's length and the notices' drawn delay: twice
/// [`FAILOVER_MS`](crate::lease::FAILOVER_MS). A failover comes
/// `FAILOVER_MS` after the dead server's last renewal, which was at most a heartbeat before
/// its death; then come the commands, the workers' notices and their retries (a few
/// latencies, and a heartbeat's pause for a request a server without a lease refused). The
/// largest delay in the first 1,000 seeds was 4.1 s, and in the 100,000-seed soak 9.3 s, both
/// within their seeds' bounds.
/// Whether `spec` is the hostile module refusing every other policy's state.
fn refuses(spec: &PolicySpec) -> bool {
    spec.source == HOSTILE && spec.config.iter().any(|(k, v)| k == "mode" && v == "refuse-state")
}

/// Whether `spec` is the hostile module that parks every pull or holds every push after a while.
fn never_decides(spec: &PolicySpec) -> bool {
    let mode = |m: &str| spec.config.iter().any(|(k, v)| k == "mode" && v == m);
    spec.source == HOSTILE && (mode("pull:park") || mode("push:hold"))
}

/// Whether a run's shards found a rule stalled.
fn stalled(run: &Simulated) -> bool {
    run.report
        .servers
        .iter()
        .flat_map(|s| &s.shards)
        .any(|sh| sh.last_failure.as_deref().is_some_and(|f| f.contains("made no progress")))
}

const LIVENESS_NS_PER_FAULT: u64 = 2 * crate::lease::FAILOVER_MS * 1_000_000;

fn when(at: FailAt) -> String {
    match at {
        FailAt::Event(e) => format!("event {e}"),
        FailAt::Time(t) => format!("{t} ns"),
    }
}

/// When the last worker but `dead` was done (or the run ended, for one that never was), in
/// nanoseconds of virtual time.
fn finished_at(run: &Simulated, dead: Option<u32>) -> u64 {
    run.report.workers.iter().filter(|w| Some(w.worker) != dead).map(|w| w.elapsed_ns).max().unwrap_or(0)
}

fn bits(s: &Simulated) -> Vec<u32> {
    s.model.iter().map(|v| v.to_bits()).collect()
}

/// Under a policy that admits every push at weight 1, with lr 1 and summed pushes, every
/// parameter ends at minus the sum of every push: worker `w` pushes `w + 1` per step it took
/// (one per iteration, `H` per iteration of `H` local steps; a late joiner from the clock it
/// joined at). A `dead` worker's last push may be in it though the worker never heard it
/// was: a gradient, or a pseudo-gradient of `h` steps.
fn exact(run: &Simulated, dead: Option<u32>, h: u64, what: &str) -> Result<(), String> {
    let base = -run.report.workers.iter().map(|w| (w.worker + 1) as f32 * w.steps as f32).sum::<f32>();
    let own = dead.map_or(0.0, |d| (d + 1) as f32);
    let allowed = [base, base - own, base - own * h as f32];
    match run.model.iter().enumerate().find(|(_, v)| !allowed.contains(v)) {
        Some((i, v)) => Err(format!(
            "{what}: parameter {i} ends at {v}, not {base}{}: an acknowledged update was lost or applied twice",
            match dead {
                Some(_) => format!(" (or {}, with the dead worker's last push)", base - own),
                None => String::new(),
            }
        )),
        None => Ok(()),
    }
}

fn every_iteration(run: &Simulated, iterations: u64, what: &str) -> Result<(), String> {
    every_iteration_but(run, iterations, what, None)
}

/// Every worker but `dead` ran every iteration (and `dead` no more than that).
fn every_iteration_but(
    run: &Simulated,
    iterations: u64,
    what: &str,
    dead: Option<u32>,
) -> Result<(), String> {
    // A late joiner runs from the clock it joined at.
    let short = |w: &crate::worker::WorkerReport| match Some(w.worker) == dead {
        true => w.iterations > iterations - w.start.min(iterations),
        false => w.iterations != iterations - w.start.min(iterations),
    };
    match run.report.workers.iter().find(|w| short(w)) {
        Some(w) => Err(format!(
            "{what}: worker {} ran {} of {} iterations",
            w.worker,
            w.iterations,
            iterations - w.start.min(iterations)
        )),
        None => Ok(()),
    }
}

/// The outcome of a search.
#[derive(Clone, Debug)]
pub struct Search {
    /// Seeds that passed.
    pub passed: u64,
    /// What they exercised.
    pub exercised: Exercised,
    /// The first seed that failed, and why.
    pub failed: Option<(u64, String)>,
    /// That seed's case shrunk ([`shrink`]).
    pub shrunk: Option<Shrunk>,
    /// Seconds the search took.
    pub seconds: f64,
}

/// Checks seeds `first..first + count` in order, each case without `without`, stopping at the
/// first failure, which it shrinks. `progress` is called after each seed with the seeds done
/// so far.
pub fn search(
    rt: &PolicyRuntime,
    first: u64,
    count: u64,
    without: &[Fault],
    mut progress: impl FnMut(u64, &Exercised),
) -> Search {
    let t = Instant::now();
    let mut out =
        Search { passed: 0, exercised: Exercised::default(), failed: None, shrunk: None, seconds: 0.0 };
    for seed in first..first.saturating_add(count) {
        let case = Case::draw(seed).without_all(without);
        match case.check(rt) {
            Ok(e) => {
                out.passed += 1;
                out.exercised += e;
            }
            Err(why) => {
                out.failed = Some((seed, format!("{} ({})", why, case.describe())));
                let mut shrunk = shrink(rt, &case, why);
                // Its replay also goes without what the search left out.
                shrunk.without.splice(0..0, without.iter().copied());
                out.shrunk = Some(shrunk);
                break;
            }
        }
        progress(out.passed, &out.exercised);
    }
    out.seconds = t.elapsed().as_secs_f64();
    out
}
