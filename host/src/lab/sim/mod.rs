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
//! Events are ordered by virtual time, ties by the order they were scheduled: nothing depends on
//! the host's clock or on thread scheduling.

mod events;

use syncopate_engine::worker::{
    Action, Buffers, Device, Input, JobKind, PushJob, WorkerConfig, WorkerError, WorkerMachine,
};
use syncopate_policy_sdk::abi::{Applied, RequestId, WorkerId};
use syncopate_workloads::{Evaluator, Workload};

use crate::lab::report::{RunReport, ServerRecord, StopRules, WatchPoint};
use crate::lab::scenario::RunSpec;
use crate::net::proto::{ControlMessage, ShardStatus, WorkerStatus};
use crate::runtime::{PolicyError, PolicyRuntime};
use crate::shard::{PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink};
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
}

/// A shard's answers during one call, collected for the simulator to schedule.
#[derive(Default)]
struct Sink {
    served: Vec<(WorkerId, u64, u64)>,
    /// (worker, iteration, dropped by the policy).
    acked: Vec<(WorkerId, u64, bool)>,
    controls: Vec<(WorkerId, ControlMessage)>,
    /// The values each served pull saw, when gradients are on (worker, shard values).
    values: Vec<(WorkerId, Vec<f32>)>,
    keep_values: bool,
}

impl ShardSink for Sink {
    fn pull_served(&mut self, r: PullReply<'_>) {
        self.served.push((r.worker, r.version, r.waited_ns));
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
}

/// A finished simulation.
#[derive(Debug)]
pub struct Simulated {
    /// The same report a real run writes (its `model_file` is empty until the model is saved).
    pub report: RunReport,
    /// The final parameters, every shard's in order (one value per shard without gradients).
    pub model: Vec<f32>,
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
    let mut shards = Vec::new();
    for i in 0..ranges.len() {
        let (lo, hi) = held(i);
        let cfg = ShardConfig {
            shard: i as u32,
            shards: shards_n,
            seed: sc.seed,
            optimizer: sc.server_optimizer(),
            push_weight: sc.push_weight.unwrap_or_default(),
            ..ShardConfig::default()
        };
        let config = opts.run.shard_config(i as u32);
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
    };
    for s in 0..shards_n {
        for w in 0..n {
            sim.call(s, |sh, now, sink| sh.join(w, now, sink))?;
        }
    }
    for w in 0..n {
        sim.drive(w)?;
    }
    sim.at(sc.eval_every_ms * 1_000_000, Ev::Watch);
    let mut stopped_at = None;
    while let Some((t, ev)) = sim.queue.pop() {
        sim.now = t;
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
    Ok(Simulated { report: sim.report(), model })
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
        for (w, version, waited) in served.drain(..) {
            let wk = &mut self.workers[w as usize];
            wk.based_on[s as usize] = Some(version);
            wk.deferred |= waited > 0;
            wk.deferred_ns = wk.deferred_ns.max(waited);
            if let Some((_, v)) = values.next() {
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
            // Only a whole push waits for its admission; parts are acknowledged when counted.
            let own = self.workers[w as usize].own.as_mut();
            let waiting = own.filter(|p| p.job.tasks.is_none() && p.job.iteration == iteration);
            if let Some(p) = waiting {
                p.dropped += u32::from(dropped);
                self.ack(w, false);
            }
        }
        self.sink.acked = acked;
        let mut controls = std::mem::take(&mut self.sink.controls);
        for (w, msg) in controls.drain(..) {
            let i = self.controls.post(msg, 1);
            self.at(self.now + self.latency_ns, Ev::Control(w, i));
        }
        self.sink.controls = controls;
        if let Some(t) = self.shards[s as usize].next_timer_ns() {
            if self.timer_at[s as usize].is_none_or(|at| t < at) {
                self.timer_at[s as usize] = Some(t);
                self.at(t.max(self.now), Ev::Timer(s));
            }
        }
    }

    /// One shard's acknowledgement of worker `w`'s push (`help`: of tasks moved to it) is on its
    /// way. Every acknowledgement takes the latency alone, so the last one sent is the last to
    /// arrive: only that one becomes an event.
    fn ack(&mut self, w: u32, help: bool) {
        let shards = self.shards.len() as u32;
        let wk = &mut self.workers[w as usize];
        let Some(p) = (if help { wk.help.as_mut() } else { wk.own.as_mut() }) else { return };
        p.acks += 1;
        if p.acks == shards {
            self.at(self.now + self.latency_ns, Ev::AckArrive(w, help));
        }
    }

    fn call<T>(
        &mut self,
        s: u32,
        f: impl FnOnce(&mut Shard, u64, &mut Sink) -> Result<T, crate::shard::ShardError>,
    ) -> Result<T, SimError> {
        let mut sink = std::mem::take(&mut self.sink);
        let r = f(&mut self.shards[s as usize], self.now, &mut sink);
        self.sink = sink;
        self.drain(s);
        r.map_err(|e| SimError::Refused(s, e.to_string()))
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
                    let slot = if help { &mut wk.help } else { &mut wk.own };
                    *slot = Some(InFlight { job, acks: 0, refused: false, dropped: 0 });
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
            Ev::PullArrive(w, s, iteration) => {
                self.call(s, |sh, now, sink| sh.pull(PullRequest { worker: w, iteration }, now, sink))?;
            }
            Ev::PullDone(w) => {
                let wk = &mut self.workers[w as usize];
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
                let req = PushRequest {
                    worker: job.owner,
                    iteration: job.iteration,
                    samples: job.samples,
                    grad,
                    based_on: wk.based_on[s as usize],
                    tasks: job.tasks,
                };
                let r = self.call(s, |sh, now, sink| sh.push_by(w, req, now, sink));
                match (r, job.tasks) {
                    // Parts are acknowledged (or refused) as soon as they are counted.
                    (Ok(_), Some(_)) => self.ack(w, help),
                    (Ok(_), None) => {}
                    (Err(e), _) if help => {
                        // The owner left meanwhile: its iteration is void, as on the cluster.
                        tracing::debug!("moved tasks refused: {e}");
                        if let Some(p) = self.workers[w as usize].help.as_mut() {
                            p.refused = true;
                        }
                        self.ack(w, help);
                    }
                    (Err(e), _) => return Err(e),
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
                let _ = match self.to_shard.deliver(i) {
                    ToShard::Handover(h) => self.call(s, |sh, now, sink| sh.tasks_yielded(h, now, sink)),
                    ToShard::Applied(a) => self.call(s, |sh, now, sink| sh.control_applied(a, now, sink)),
                    ToShard::Finished(r) => self.call(s, |sh, now, sink| sh.iteration_finished(r, now, sink)),
                    ToShard::Skip(to) => self.call(s, |sh, now, sink| sh.skip(w, to, now, sink)),
                    ToShard::Goodbye => self.call(s, |sh, now, sink| sh.goodbye(w, now, sink).map(|_| ())),
                };
            }
            Ev::Control(w, i) => {
                let msg = self.controls.deliver(i);
                if !self.workers[w as usize].machine.is_done() {
                    self.feed(w, Input::Control(msg))?;
                }
            }
            Ev::Timer(s) => {
                self.timer_at[s as usize] = None;
                let mut sink = std::mem::take(&mut self.sink);
                self.shards[s as usize].advance(self.now, &mut sink);
                self.sink = sink;
                self.drain(s);
            }
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
        }
    }
}
