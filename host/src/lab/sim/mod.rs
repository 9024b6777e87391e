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
//! With the scenario's `replicas = 1`, every shard call is an [`Op`], applied by the primary and carried over the
//! modelled links to a second [`Shard`] on the backup's server, with an [`AckGate`] holding each
//! push's acknowledgement until the backup confirms the op that admitted it: the pieces the
//! servers use. A failure (the scenario's `kill_server`, or [`SimOptions::failure`]) kills one
//! server before a given event or time: it stops at once, what is
//! sent to it is lost, and [`FAILOVER_MS`](crate::net::proto::FAILOVER_MS) later its shards'
//! backups are promoted, every worker rejoins them and sends again what they had not
//! acknowledged or answered. The model is the worst case: ops still on their way from the dead
//! primary and confirmations from a dead backup are lost too. Two things differ from a cluster:
//! a worker that had finished and whose goodbye went to the dead server leaves at the failover
//! (a cluster waits the rejoin grace for it), and one failure is all a run gets (nothing is
//! re-replicated).
//!
//! Events are ordered by virtual time, ties by the order they were scheduled: nothing depends on
//! the host's clock or on thread scheduling.

mod events;

use syncopate_engine::worker::{
    Action, Buffers, Device, Input, JobKind, PushJob, WorkerConfig, WorkerError, WorkerMachine,
};
use syncopate_policy_sdk::abi::{Applied, LeaveReason, RequestId, WorkerId};
use syncopate_workloads::{Evaluator, Workload};

use crate::lab::report::{RunReport, ServerRecord, StopRules, WatchPoint};
use crate::lab::scenario::RunSpec;
use crate::net::proto::{ControlMessage, ShardStatus, WorkerStatus};
use crate::runtime::{PolicyError, PolicyRuntime};
use crate::shard::{AckGate, Op, Outcome, PullReply, Shard, ShardConfig, ShardError, ShardSink, Stamped};
use crate::worker::WorkerReport;
use events::{Ev, Mailbox, Queue, ToShard};

/// How to simulate.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// The run: scenario (its seed makes the run reproducible) and policy.
    pub run: RunSpec,
    /// Compute real gradients and score the model (false: decisions only, for large clusters).
    pub gradients: bool,
    /// The Fashion-MNIST directory (default: where Debian's package puts it).
    pub data: Option<std::path::PathBuf>,
    /// A server killed during the run (needs the scenario's `replicas = 1`), instead of the
    /// scenario's `kill_server`: tests kill one at an event index.
    pub failure: Option<SimFailure>,
}

/// A server killed during a simulation. It stops at once; what reaches it is lost, and
/// [`FAILOVER_MS`](crate::net::proto::FAILOVER_MS) later, as on a cluster, its shards' backups
/// are promoted and the workers ask them again for every pull and push they had no answer to.
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
        match self.at {
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
}

/// A shard's answers during one call, collected for the simulator to schedule.
#[derive(Default)]
struct Sink {
    /// (worker, iteration, version, waited).
    served: Vec<(WorkerId, u64, u64, u64)>,
    /// (worker, iteration, dropped by the policy).
    acked: Vec<(WorkerId, u64, bool)>,
    controls: Vec<(WorkerId, ControlMessage)>,
    /// The values each served pull saw, when gradients are on (worker, shard values).
    values: Vec<(WorkerId, Vec<f32>)>,
    keep_values: bool,
}

impl Sink {
    /// Forgets what was said (a backup's sink: nobody hears it).
    fn clear(&mut self) {
        self.served.clear();
        self.acked.clear();
        self.controls.clear();
        self.values.clear();
    }
}

impl ShardSink for Sink {
    fn pull_served(&mut self, r: PullReply<'_>) {
        self.served.push((r.worker, r.iteration, r.version, r.waited_ns));
        if self.keep_values {
            self.values.push((r.worker, r.values.to_vec()));
        }
    }
    fn push_acked(&mut self, _id: RequestId, worker: WorkerId, iteration: u64) {
        self.acked.push((worker, iteration, false));
    }
    fn push_dropped(&mut self, _id: RequestId, worker: WorkerId, iteration: u64) {
        self.acked.push((worker, iteration, true));
    }
    fn control(&mut self, worker: WorkerId, msg: ControlMessage) {
        self.controls.push((worker, msg));
    }
}

/// One shard's acknowledgement of a push, held until that shard's backup has its op.
#[derive(Clone, Copy, Debug)]
struct Ack {
    worker: WorkerId,
    /// Of tasks moved to the worker.
    help: bool,
    /// A whole push's admission: its iteration, and whether the policy dropped it (`None`: a
    /// part, acknowledged when counted).
    whole: Option<(u64, bool)>,
}

/// A push on its way: the job and the shards that have acknowledged it.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    job: PushJob,
    acks: u32,
    refused: bool,
    /// Shards whose policy dropped it.
    dropped: u32,
}

/// One simulated worker: the machine and what its driver keeps (buffers, transfers in flight).
struct SimWorker {
    machine: WorkerMachine,
    bufs: Buffers,
    workload: Option<Box<dyn Workload>>,
    /// Pull replies sent for the current pull, and when the latest arrives.
    replies: u32,
    replies_at: u64,
    deferred: bool,
    deferred_ns: u64,
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
}

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
    shards: Vec<Shard>,
    ranges: Vec<(usize, usize)>,
    server_of: Vec<u32>,
    sink: Sink,
    workers: Vec<SimWorker>,
    evaluator: Option<Evaluator>,
    /// Uplink and downlink of each worker, then of each server.
    up: Vec<Link>,
    down: Vec<Link>,
    timer_at: Vec<Option<u64>>,
    controls: Mailbox<ControlMessage>,
    to_shard: Mailbox<ToShard>,
    /// Workers whose machine is done.
    done: usize,
    watch: Vec<WatchPoint>,
    stopping: bool,
    time_to_target: Option<f64>,
    bytes_per_ns: f64,
    latency_ns: u64,
    /// Per shard: its backup and the backup's server (with `replicas` 1).
    backups: Vec<Option<Shard>>,
    backup_of: Vec<Option<u32>>,
    /// Per shard: op numbering, and acknowledgements held until the backup has their op.
    gates: Vec<AckGate<Ack>>,
    /// Per shard: bumped when its primary or backup changes, so a stream from before is dropped.
    epoch: Vec<u32>,
    /// Ops on their way to backups: (epoch, op, gradient).
    replication: Mailbox<(u32, Stamped, Vec<f32>)>,
    /// What the backups say, which nobody hears.
    quiet: Sink,
    released: Vec<Ack>,
    /// Per server: killed.
    dead: Vec<bool>,
    /// Servers failed over, in order.
    lost: Vec<u32>,
    /// Requests that reached a dead server before its failover.
    limbo: Vec<Ev>,
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
}

/// Runs the scenario under the policy.
pub fn simulate(opts: &SimOptions, rt: &PolicyRuntime) -> Result<Simulated, SimError> {
    let (sc, policy) = (&opts.run.scenario, &opts.run.policy);
    if let Some(script) = sc.script.first() {
        return Err(SimError::Script(script.clone()));
    }
    let n = sc.workers;
    let shards_n = opts.run.shards();
    let module = policy.load(rt).map_err(|e| SimError::Policy(policy.to_string(), e))?;
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
    let mut sink = Sink { keep_values: opts.gradients, ..Sink::default() };
    let mut quiet = Sink::default();
    // The scenario's rules (replicas 0 or 1, and 1 only with two servers), then the failure's.
    sc.check().map_err(SimError::Options)?;
    let failure = opts.failure.or_else(|| SimFailure::of(sc));
    if let Some(f) = failure {
        if sc.replicas == 0 {
            return Err(SimError::Options("a server failure needs replicas 1".into()));
        }
        if f.server >= sc.servers {
            return Err(SimError::Options(format!("server {} does not exist", f.server)));
        }
    }
    let backup_of: Vec<Option<u32>> =
        (0..shards_n).map(|s| crate::net::proto::backup_server(s, sc.servers, sc.replicas)).collect();
    let mut backups = Vec::new();
    let mut shards = Vec::new();
    for (i, backed) in backup_of.iter().enumerate() {
        let (lo, hi) = held(i);
        let cfg = ShardConfig {
            shard: i as u32,
            shards: shards_n,
            seed: sc.seed,
            optimizer: sc.server_optimizer(),
            push_weight: sc.push_weight.unwrap_or_default(),
            max_workers: sc.workers.max(crate::shard::DEFAULT_MAX_WORKERS),
            ..ShardConfig::default()
        };
        let config = opts.run.shard_config(i as u32);
        if backed.is_some() {
            // Created as its primary is, from the same parameters: the ops keep the two equal.
            let backup = Shard::new(cfg.clone(), model[lo..hi].to_vec(), &module, &config, &mut quiet)
                .map_err(|e| SimError::Policy(policy.to_string(), e))?;
            backups.push(Some(backup));
        } else {
            backups.push(None);
        }
        let shard = Shard::new(cfg, model[lo..hi].to_vec(), &module, &config, &mut sink)
            .map_err(|e| SimError::Policy(policy.to_string(), e))?;
        shards.push(shard);
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
            machine,
            bufs,
            workload,
            replies: 0,
            replies_at: 0,
            deferred: false,
            deferred_ns: 0,
            based_on: vec![None; shards_n as usize],
            own: None,
            help: None,
            own_acked: vec![false; shards_n as usize],
            help_acked: vec![false; shards_n as usize],
            pulling: None,
            replied: vec![false; shards_n as usize],
            wake_at: None,
            done: false,
        });
    }
    let nodes = (n + sc.servers) as usize;
    let mbit = sc.bandwidth_mbit.unwrap_or(10_000.0);
    let mut sim = Sim {
        opts: opts.clone(),
        now: 0,
        queue: Queue::default(),
        server_of: (0..shards_n).map(|s| s % sc.servers).collect(),
        shards,
        ranges,
        sink,
        workers,
        evaluator,
        up: vec![Link::default(); nodes],
        down: vec![Link::default(); nodes],
        timer_at: vec![None; shards_n as usize],
        controls: Mailbox::default(),
        to_shard: Mailbox::default(),
        done: 0,
        watch: Vec::new(),
        stopping: false,
        time_to_target: None,
        bytes_per_ns: mbit * 1e6 / 8.0 / 1e9,
        latency_ns: sc.latency_us * 1000,
        gates: backup_of
            .iter()
            .map(|b| {
                let mut gate = AckGate::default();
                if b.is_some() {
                    gate.attach(0);
                }
                gate
            })
            .collect(),
        epoch: vec![0; shards_n as usize],
        backups,
        backup_of,
        replication: Mailbox::default(),
        quiet,
        released: Vec::new(),
        dead: vec![false; sc.servers as usize],
        lost: Vec::new(),
        limbo: Vec::new(),
    };
    for s in 0..shards_n {
        for w in 0..n {
            if let Outcome::Joined(Err(e)) = sim.op(s, Op::Join { worker: w }, Vec::new()) {
                return Err(SimError::Refused(s, e.to_string()));
            }
        }
    }
    for w in 0..n {
        sim.drive(w)?;
    }
    sim.at(sc.eval_every_ms * 1_000_000, Ev::Watch);
    let mut stopped_at = None;
    let mut handled = 0u64;
    let mut failure = failure;
    while let Some((t, ev)) = sim.queue.pop() {
        sim.now = t;
        if let Some(f) = failure.filter(|f| f.due(handled, t)) {
            sim.kill(f.server);
            failure = None;
        }
        handled += 1;
        sim.handle(ev)?;
        if sim.done == sim.workers.len() && sim.shards.iter().all(|s| s.view().workers == 0) {
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
    Ok(Simulated { report: sim.report(), model, events: handled })
}

impl Sim {
    fn at(&mut self, t: u64, ev: Ev) {
        self.queue.push(t, ev);
    }

    /// A transfer of `bytes` from node `from` to node `to` starting now; returns its arrival.
    fn transfer(&mut self, from: usize, to: usize, bytes: u64) -> u64 {
        let start = self.now.max(self.up[from].free_ns).max(self.down[to].free_ns);
        let end = start + (bytes as f64 / self.bytes_per_ns) as u64;
        self.up[from].free_ns = end;
        self.down[to].free_ns = end;
        self.up[from].bytes += bytes;
        self.down[to].bytes += bytes;
        end + self.latency_ns
    }

    fn server_node(&self, shard: u32) -> usize {
        self.workers.len() + self.server_of[shard as usize] as usize
    }

    fn shard_bytes(&self, shard: u32) -> u64 {
        let (lo, hi) = self.ranges[shard as usize];
        match &self.opts.run.scenario.modelled {
            // The modelled model's bytes, split over the shards as the workload's are.
            Some(m) => {
                let total = self.ranges.last().map_or(1, |r| r.1).max(1) as u64;
                m.bytes * (hi - lo) as u64 / total + 64
            }
            None => (hi - lo) as u64 * 4 + 64,
        }
    }

    /// Schedules what the last call into shard `s` produced.
    fn drain(&mut self, s: u32) {
        // The sink's vectors are taken and put back, so that their capacity is reused.
        let mut served = std::mem::take(&mut self.sink.served);
        let mut values = std::mem::take(&mut self.sink.values).into_iter();
        for (w, iteration, version, waited) in served.drain(..) {
            let v = values.next();
            let wk = &mut self.workers[w as usize];
            // The answer to a pull asked again after a failover, which the old primary had
            // answered already, changes nothing.
            if wk.pulling != Some(iteration) || std::mem::replace(&mut wk.replied[s as usize], true) {
                continue;
            }
            wk.based_on[s as usize] = Some(version);
            wk.deferred |= waited > 0;
            wk.deferred_ns = wk.deferred_ns.max(waited);
            if let Some((_, v)) = v {
                let (lo, hi) = self.ranges[s as usize];
                wk.bufs.params[lo..hi].copy_from_slice(&v);
            }
            let (from, bytes) = (self.server_node(s), self.shard_bytes(s));
            let t = self.transfer(from, w as usize, bytes);
            // The worker goes on when the last reply arrives: one event at that time, not one
            // per shard (a fifth of a large run's events).
            let wk = &mut self.workers[w as usize];
            wk.replies += 1;
            wk.replies_at = wk.replies_at.max(t);
            if wk.replies == self.shards.len() as u32 {
                let at = wk.replies_at;
                self.at(at, Ev::PullDone(w));
            }
        }
        self.sink.served = served;
        let mut acked = std::mem::take(&mut self.sink.acked);
        for (w, iteration, dropped) in acked.drain(..) {
            self.gate_ack(s, Ack { worker: w, help: false, whole: Some((iteration, dropped)) });
        }
        self.sink.acked = acked;
        let mut controls = std::mem::take(&mut self.sink.controls);
        for (w, msg) in controls.drain(..) {
            let i = self.controls.post(msg, 1);
            self.at(self.now + self.latency_ns, Ev::Control(w, i));
        }
        self.sink.controls = controls;
        self.arm_timer(s);
    }

    /// Schedules shard `s`'s next timer, unless an earlier one is scheduled.
    fn arm_timer(&mut self, s: u32) {
        if let Some(t) = self.shards[s as usize].next_timer_ns() {
            if self.timer_at[s as usize].is_none_or(|at| t < at) {
                self.timer_at[s as usize] = Some(t);
                self.at(t.max(self.now), Ev::Timer(s));
            }
        }
    }

    /// Shard `s` acknowledges a push: now, or once its backup has the op that admitted it.
    fn gate_ack(&mut self, s: u32, a: Ack) {
        if let Some(a) = self.gates[s as usize].ack(a) {
            self.release(s, a);
        }
    }

    /// The acknowledgements shard `s`'s gate lets go when `open` (a confirmation, a lost
    /// backup) acts on it go out.
    fn release_gated(&mut self, s: u32, open: impl FnOnce(&mut AckGate<Ack>, &mut Vec<Ack>)) {
        let mut released = std::mem::take(&mut self.released);
        open(&mut self.gates[s as usize], &mut released);
        for a in released.drain(..) {
            self.release(s, a);
        }
        self.released = released;
    }

    /// Shard `s`'s acknowledgement goes out.
    fn release(&mut self, s: u32, a: Ack) {
        match a.whole {
            // Only a whole push waits for its admission; parts are acknowledged when counted.
            Some((iteration, dropped)) => {
                let own = self.workers[a.worker as usize].own.as_ref();
                if own.is_some_and(|p| p.job.tasks.is_none() && p.job.iteration == iteration) {
                    self.ack(a.worker, s, false, dropped);
                }
            }
            None => self.ack(a.worker, s, a.help, false),
        }
    }

    /// Shard `s`'s acknowledgement of worker `w`'s push (`help`: of tasks moved to it) is on its
    /// way. Every acknowledgement takes the latency alone, so the last one sent is the last to
    /// arrive: only that one becomes an event.
    fn ack(&mut self, w: u32, s: u32, help: bool, dropped: bool) {
        let shards = self.shards.len() as u32;
        let wk = &mut self.workers[w as usize];
        let (slot, acked) =
            if help { (&mut wk.help, &mut wk.help_acked) } else { (&mut wk.own, &mut wk.own_acked) };
        let Some(p) = slot.as_mut() else { return };
        if std::mem::replace(&mut acked[s as usize], true) {
            return;
        }
        p.acks += 1;
        p.dropped += u32::from(dropped);
        if p.acks == shards {
            self.at(self.now + self.latency_ns, Ev::AckArrive(w, help));
        }
    }

    /// Shard `s`'s primary applies `op` now (with `grad`, a push's gradient), and schedules what
    /// it said; with a backup, the op goes to it over the servers' link first.
    fn op(&mut self, s: u32, op: Op, grad: Vec<f32>) -> Outcome {
        let su = s as usize;
        let seq = self.gates[su].stamp();
        if let Some(b) = self.backup_of[su] {
            let bytes = if matches!(op, Op::Push { .. }) { self.shard_bytes(s) } else { 64 };
            let (from, to) = (self.server_node(s), self.workers.len() + b as usize);
            let t = self.transfer(from, to, bytes);
            let stamped = Stamped { seq, now_ns: self.now, op: op.clone() };
            let i = self.replication.post((self.epoch[su], stamped, grad.clone()), 1);
            self.at(t, Ev::Replicate(s, i));
        }
        let mut sink = std::mem::take(&mut self.sink);
        let out = self.shards[su].apply_op(op, grad, self.now, |_| None, &mut sink);
        self.sink = sink;
        self.drain(s);
        out
    }

    /// Server `x` dies: from now on what reaches it is lost, and its lease lapses.
    fn kill(&mut self, x: u32) {
        tracing::debug!(server = x, t_ns = self.now, "server killed");
        self.dead[x as usize] = true;
        self.at(self.now + crate::net::proto::FAILOVER_MS * 1_000_000, Ev::FailOver(x));
    }

    /// The coordinator fails dead server `x` over, as on a cluster: its shards' backups become
    /// their primaries, the shards it backed up go on without a backup, and every worker asks
    /// the new primaries again for what it had no answer to (a push applied twice is a
    /// duplicate; a parked pull answers the retried one).
    fn fail_over(&mut self, x: u32) -> Result<(), SimError> {
        self.lost.push(x);
        let shards = self.shards.len() as u32;
        let mut moved = Vec::new();
        for s in 0..shards {
            let su = s as usize;
            if self.server_of[su] == x {
                let (Some(b), Some(backup)) = (self.backup_of[su], self.backups[su].take()) else {
                    return Err(SimError::Options(format!("shard {s} was lost with server {x}: no backup")));
                };
                self.shards[su] = backup;
                (self.server_of[su], self.backup_of[su]) = (b, None);
                self.epoch[su] += 1;
                self.gates[su].lose();
                self.timer_at[su] = None;
                moved.push(s);
            } else if self.backup_of[su] == Some(x) {
                (self.backups[su], self.backup_of[su]) = (None, None);
                self.epoch[su] += 1;
                self.release_gated(s, |gate, out| gate.detach(|a| out.push(a)));
            }
        }
        for &s in &moved {
            let node = self.server_node(s);
            for w in 0..self.workers.len() as u32 {
                let wk = &self.workers[w as usize];
                let member = self.shards[s as usize].is_member(w);
                if wk.machine.is_done() {
                    // Its goodbye went to the dead primary. The cluster waits the rejoin grace
                    // for a member that does not come back; the simulator lets it leave now.
                    if member {
                        self.op(s, Op::Leave { worker: w, reason: LeaveReason::TimedOut }, Vec::new());
                    }
                    continue;
                }
                if !member {
                    // Its join had not reached the backup: it joins again.
                    if let Outcome::Joined(Err(e)) = self.op(s, Op::Join { worker: w }, Vec::new()) {
                        return Err(SimError::Refused(s, e.to_string()));
                    }
                }
                let wk = &self.workers[w as usize];
                let (own, help) = (wk.own.is_some(), wk.help.is_some());
                let (own_acked, help_acked) = (wk.own_acked[s as usize], wk.help_acked[s as usize]);
                let pull = wk.pulling.filter(|_| !wk.replied[s as usize]);
                for (ask, help) in [(own && !own_acked, false), (help && !help_acked, true)] {
                    if ask {
                        let t = self.transfer(w as usize, node, self.shard_bytes(s));
                        self.at(t, Ev::PushArrive(w, s, help));
                    }
                }
                if let Some(iteration) = pull {
                    let t = self.transfer(w as usize, node, 64);
                    self.at(t, Ev::PullArrive(w, s, iteration));
                }
            }
            self.arm_timer(s);
        }
        // What reached the dead server meanwhile: pulls and pushes were asked again above; the
        // other messages go to the new primaries.
        for ev in std::mem::take(&mut self.limbo) {
            if let Ev::ToShard(..) = ev {
                self.at(self.now + self.latency_ns, ev);
            }
        }
        tracing::debug!(server = x, shards = moved.len(), "failed over");
        Ok(())
    }

    /// Whether shard `s`'s primary is on a dead server (not yet failed over).
    fn down(&self, s: u32) -> bool {
        self.dead[self.server_of[s as usize] as usize]
    }

    /// Feeds worker `w`'s machine an input, then carries out its actions.
    fn feed(&mut self, w: u32, input: Input) -> Result<(), SimError> {
        self.workers[w as usize].machine.handle(self.now, input).map_err(|e| SimError::Worker(w, e))?;
        self.drive(w)
    }

    /// Carries out every action worker `w`'s machine has, and sets its timer.
    fn drive(&mut self, w: u32) -> Result<(), SimError> {
        let shards = self.shards.len() as u32;
        while let Some(action) = self.workers[w as usize].machine.poll_action(self.now) {
            match action {
                Action::Pull { iteration } => {
                    let wk = &mut self.workers[w as usize];
                    (wk.replies, wk.replies_at, wk.deferred, wk.deferred_ns) = (0, 0, false, 0);
                    wk.pulling = Some(iteration);
                    wk.replied.fill(false);
                    for s in 0..shards {
                        let t = self.transfer(w as usize, self.server_node(s), 64);
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
                    *slot = Some(InFlight { job, acks: 0, refused: false, dropped: 0 });
                    acked.fill(false);
                    for s in 0..shards {
                        let bytes = self.shard_bytes(s);
                        let t = self.transfer(w as usize, self.server_node(s), bytes);
                        self.at(t, Ev::PushArrive(w, s, help));
                    }
                }
                Action::Handover { shard, handover } => {
                    self.send(w, shard..shard + 1, ToShard::Handover(handover));
                }
                Action::Applied { shard, control, iteration } => {
                    let msg = ToShard::Applied(Applied { worker: w, control, iteration });
                    self.send(w, shard..shard + 1, msg);
                }
                Action::Finished(report) => self.send(w, 0..shards, ToShard::Finished(report)),
                Action::Skip { to, .. } => self.send(w, 0..shards, ToShard::Skip(to)),
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

    /// A message without tensors from worker `w` to each of `shards`: the latency alone.
    fn send(&mut self, w: u32, shards: std::ops::Range<u32>, msg: ToShard) {
        let i = self.to_shard.post(msg, shards.len() as u32);
        for s in shards {
            self.at(self.now + self.latency_ns, Ev::ToShard(w, s, i));
        }
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        let shards = self.shards.len() as u32;
        match ev {
            Ev::Wake(w) => {
                self.workers[w as usize].wake_at = None;
                self.feed(w, Input::Timer)?;
            }
            Ev::PullArrive(_, s, _) | Ev::PushArrive(_, s, _) | Ev::ToShard(_, s, _) if self.down(s) => {
                self.limbo.push(ev);
            }
            Ev::PullArrive(w, s, iteration) => {
                if let Outcome::Done(Err(e)) = self.op(s, Op::Pull { worker: w, iteration }, Vec::new()) {
                    return Err(SimError::Refused(s, e.to_string()));
                }
            }
            Ev::PullDone(w) => {
                let wk = &mut self.workers[w as usize];
                wk.pulling = None;
                wk.bufs.pulled();
                let (deferred, deferred_ns) = (wk.deferred, wk.deferred_ns);
                self.feed(w, Input::Pulled { deferred, deferred_ns })?;
            }
            Ev::PushArrive(w, s, help) => {
                let wk = &self.workers[w as usize];
                let Some(InFlight { job, .. }) = (if help { wk.help } else { wk.own }) else {
                    return Ok(());
                };
                let (lo, hi) = self.ranges[s as usize];
                let grad = match (self.opts.gradients, help) {
                    (false, _) => vec![0.0],
                    (true, false) => wk.bufs.grad[lo..hi].to_vec(),
                    (true, true) => wk.bufs.help[lo..hi].to_vec(),
                };
                // A whole push is the owner's own; parts say whose tasks they are.
                debug_assert!(job.tasks.is_some() || job.owner == w);
                let op = Op::Push {
                    worker: w,
                    iteration: job.iteration,
                    samples: job.samples,
                    based_on: wk.based_on[s as usize],
                    tasks: job.tasks.map(|part| (job.owner, part)),
                };
                let Outcome::Pushed(r) = self.op(s, op, grad) else { unreachable!("a push's outcome") };
                let part = Ack { worker: w, help, whole: None };
                match (r, job.tasks) {
                    // Parts are acknowledged (or refused) as soon as they are counted.
                    (Ok(()), Some(_)) => self.gate_ack(s, part),
                    (Ok(()), None) => {}
                    // Asked again after a failover: the new primary had it. Held by the policy,
                    // it is acknowledged with the policy's decision.
                    (Err(ShardError::Duplicate { .. }), None)
                        if self.shards[s as usize].is_push_held(w, job.iteration) => {}
                    (Err(ShardError::Duplicate { .. }), None) => {
                        self.gate_ack(s, Ack { whole: Some((job.iteration, false)), ..part })
                    }
                    (Err(ShardError::Duplicate { .. }), Some(_)) => self.gate_ack(s, part),
                    (Err(e), _) if help => {
                        // The owner left meanwhile: its iteration is void, as on the cluster.
                        tracing::debug!("moved tasks refused: {e}");
                        if let Some(p) = self.workers[w as usize].help.as_mut() {
                            p.refused = true;
                        }
                        self.ack(w, s, help, false);
                    }
                    (Err(e), _) => return Err(SimError::Refused(s, e.to_string())),
                }
            }
            Ev::AckArrive(w, help) => {
                let wk = &mut self.workers[w as usize];
                let slot = if help { &mut wk.help } else { &mut wk.own };
                let Some(p) = slot.as_mut().filter(|p| p.acks == shards) else { return Ok(()) };
                let (kind, refused, dropped) = (p.job.kind, p.refused, p.dropped);
                *slot = None;
                let result = if refused { Err("refused by a shard".to_string()) } else { Ok(dropped) };
                self.feed(w, Input::Pushed { kind, result })?;
            }
            Ev::ToShard(w, s, i) => {
                // A worker that has left cannot be heard from: the shard says so, and that is
                // what the cluster's servers do too.
                let op = match self.to_shard.deliver(i) {
                    ToShard::Handover(handover) => Op::Yielded { handover },
                    ToShard::Applied(applied) => Op::Applied { applied },
                    ToShard::Finished(report) => Op::Finished { report },
                    ToShard::Skip(to) => Op::Skip { worker: w, to },
                    ToShard::Goodbye => Op::Goodbye { worker: w },
                };
                self.op(s, op, Vec::new());
            }
            Ev::Control(w, i) => {
                let msg = self.controls.deliver(i);
                if !self.workers[w as usize].machine.is_done() {
                    self.feed(w, Input::Control(msg))?;
                }
            }
            Ev::Timer(s) => {
                self.timer_at[s as usize] = None;
                if !self.down(s) {
                    self.op(s, Op::Advance, Vec::new());
                }
            }
            Ev::Replicate(s, i) => {
                let (epoch, stamped, grad) = self.replication.deliver(i);
                let su = s as usize;
                // The worst case for a death: an op still on its way from a primary that died
                // never arrives (it may still be in the dead process's buffers), and a dead
                // backup applies nothing.
                let on_live = self.backup_of[su].is_some_and(|b| !self.dead[b as usize]) && !self.down(s);
                let Some(backup) = self.backups[su].as_mut().filter(|_| on_live && epoch == self.epoch[su])
                else {
                    return Ok(());
                };
                let seq = stamped.seq;
                backup.apply_op(stamped.op, grad, stamped.now_ns, |_| None, &mut self.quiet);
                self.quiet.clear();
                self.at(self.now + self.latency_ns, Ev::Confirm(s, epoch, seq));
            }
            Ev::Confirm(s, epoch, seq) => {
                // Likewise a confirmation on its way from a backup that died.
                let backup_dead = self.backup_of[s as usize].is_none_or(|b| self.dead[b as usize]);
                if epoch != self.epoch[s as usize] || self.down(s) || backup_dead {
                    return Ok(());
                }
                self.release_gated(s, |gate, out| gate.confirm(seq, |a| out.push(a)));
            }
            Ev::FailOver(x) => self.fail_over(x)?,
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
        self.shards.iter().flat_map(|s| s.values().iter().copied()).collect()
    }

    fn observe(&mut self) {
        let t_s = self.now as f64 / 1e9;
        let score =
            self.evaluator.as_ref().filter(|_| self.opts.gradients).map(|e| e.evaluate(&self.model()));
        let status: Vec<ShardStatus> =
            self.shards.iter().enumerate().map(|(i, s)| ShardStatus::of(i as u32, s)).collect();
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
            self.shards.iter().enumerate().map(|(i, s)| ShardStatus::of(i as u32, s)).collect();
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
            model_version: self.shards.iter().map(Shard::version).min().unwrap_or(0),
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
