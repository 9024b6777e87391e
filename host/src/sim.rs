//! The deterministic cluster simulator behind `syncopate ab --simulate`: clusters larger than
//! one machine holds, in virtual time, bit for bit reproducible from the scenario's seed.
//!
//! What is real: the shard engine ([`Shard`]) and the wasm policy modules, called exactly as the
//! servers call them; and, unless `gradients` is off, the workload's gradients, computed on the
//! parameters each worker actually pulled (so staleness costs accuracy as it really would), and
//! the test-set evaluation. What is modelled:
//! - time: each worker's compute per iteration is the scenario's `compute_ms` (for its starting
//!   batch; proportional to the batch it is told to use), times its slow factor, plus its jitter
//!   and stall, drawn from a generator seeded by the scenario;
//! - the network: every node (worker or server) has one link of the scenario's bandwidth
//!   (`bandwidth_mbit`, default 10 Gbit/s) each way, and every message the scenario's latency
//!   (`latency_us`). A transfer holds the
//!   sender's uplink and the receiver's downlink for `bytes / bandwidth`, so concurrent transfers
//!   through one link queue behind each other: at a server that many workers push to at once,
//!   the syncs contend, as they do on a real link;
//! - workers: pull every shard, compute, push every shard, wait for the acknowledgements, report
//!   the iteration; control messages (batch sizes, pauses) take effect and are acknowledged as
//!   on the cluster. Iterations are not split into tasks here, so a task move is answered with
//!   "nothing moved" (EPSP's moves need the real cluster).
//!
//! Events are ordered by virtual time, ties by the order they were scheduled: nothing depends on
//! the host's clock or on thread scheduling.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{Ipv4Addr, SocketAddr};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::Distribution;
use syncopate_policy_sdk::abi::{Applied, Control, IterationReport, LeaveReason, RequestId, WorkerId};
use syncopate_workloads::{Evaluator, Workload, WorkloadOptions};

use crate::builtin::PolicySpec;
use crate::local::{LocalReport, WatchPoint};
use crate::net::proto::{ClusterStatus, ServerStatus, ShardStatus, WorkerStatus};
use crate::runtime::{PolicyError, PolicyRuntime};
use crate::scenario::Scenario;
use crate::shard::{PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink, STALENESS_BUCKETS};
use crate::worker::WorkerReport;

/// How to simulate.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// The scenario (its seed makes the run reproducible).
    pub scenario: Scenario,
    /// The policy.
    pub policy: PolicySpec,
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
    /// The workload cannot be built.
    #[error(transparent)]
    Workload(#[from] syncopate_workloads::WorkloadError),
    /// A shard refused a request the simulated worker made (a simulator bug).
    #[error("shard {0} refused a request: {1}")]
    Refused(u32, String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Start(u32),
    PullArrive(u32, u32),
    PullDone(u32, u32),
    ComputeDone(u32),
    PushArrive(u32, u32),
    AckArrive(u32, u32),
    Report(u32, u32),
    Control(u32, u32, usize),
    Applied(u32, u32, usize),
    Timer(u32),
    Watch,
}

/// A shard's answers during one call, collected for the simulator to schedule.
#[derive(Default)]
struct Sink {
    served: Vec<(WorkerId, u64, u64)>,
    acked: Vec<WorkerId>,
    controls: Vec<(WorkerId, Control)>,
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
    fn push_acked(&mut self, _id: RequestId, worker: WorkerId, _iteration: u64) {
        self.acked.push(worker);
    }
    fn control(&mut self, worker: WorkerId, control: Control) {
        self.controls.push((worker, control));
    }
}

struct SimWorker {
    iteration: u64,
    batch: u32,
    slow: f32,
    jitter: Option<rand_distr::Normal<f64>>,
    stall: Option<(u64, u64)>,
    pause_ns: u64,
    replies: u32,
    acks: u32,
    deferred: bool,
    started_ns: u64,
    pulled_ns: u64,
    based_on: Vec<Option<u64>>,
    params: Vec<f32>,
    grad: Vec<f32>,
    report: WorkerReport,
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
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    shards: Vec<Shard>,
    ranges: Vec<(usize, usize)>,
    server_of: Vec<u32>,
    sink: Sink,
    workers: Vec<SimWorker>,
    workloads: Vec<Box<dyn Workload>>,
    evaluator: Option<Evaluator>,
    /// Uplink and downlink of each worker, then of each server.
    up: Vec<Link>,
    down: Vec<Link>,
    timer_at: Vec<Option<u64>>,
    controls: Vec<(WorkerId, Control)>,
    rng: ChaCha8Rng,
    watch: Vec<WatchPoint>,
    stopping: bool,
    time_to_target: Option<f64>,
    bytes_per_ns: f64,
    latency_ns: u64,
}

/// Runs the scenario under the policy; returns the same report a real run writes.
pub fn simulate(opts: &SimOptions, rt: &PolicyRuntime) -> Result<LocalReport, SimError> {
    let sc = &opts.scenario;
    let n = sc.workers;
    let shards_n = sc.shards.unwrap_or(sc.servers).max(1);
    let module = opts.policy.load(rt).map_err(|e| SimError::Policy(opts.policy.to_string(), e))?;
    let wopts = WorkloadOptions {
        params: 64,
        data_dir: opts.data.clone().unwrap_or_else(|| syncopate_workloads::fashion::DEFAULT_DIR.into()),
        part: (0, 1),
        hidden: 128,
        seed: sc.seed,
    };
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
    let config: Vec<(String, String)> = opts.policy.config.clone();
    let mut shards = Vec::new();
    for i in 0..ranges.len() {
        let (lo, hi) = held(i);
        let cfg = ShardConfig { shard: i as u32, shards: shards_n, seed: sc.seed, ..ShardConfig::default() };
        let shard = Shard::new(cfg, model[lo..hi].to_vec(), &module, &config, &mut sink)
            .map_err(|e| SimError::Policy(opts.policy.to_string(), e))?;
        shards.push(shard);
    }
    let workers = (0..n)
        .map(|w| SimWorker {
            iteration: 0,
            batch: sc.batch,
            slow: sc.slow.iter().find(|s| s.worker == w).map_or(1.0, |s| s.factor),
            jitter: sc
                .jitter
                .iter()
                .find(|j| j.worker == w)
                .and_then(|j| rand_distr::Normal::new(j.mean_ms * 1e6, j.sd_ms * 1e6).ok()),
            stall: sc
                .stall
                .iter()
                .find(|s| s.worker == w)
                .map(|s| ((s.at_s * 1e9) as u64, (s.for_s * 1e9) as u64)),
            pause_ns: 0,
            replies: 0,
            acks: 0,
            deferred: false,
            started_ns: 0,
            pulled_ns: 0,
            based_on: vec![None; shards_n as usize],
            params: if opts.gradients { model.clone() } else { Vec::new() },
            grad: if opts.gradients { vec![0.0; len] } else { Vec::new() },
            report: WorkerReport { worker: w, ..WorkerReport::default() },
            done: false,
        })
        .collect();
    let nodes = (n + sc.servers) as usize;
    let mbit = sc.bandwidth_mbit.unwrap_or(10_000.0);
    let mut sim = Sim {
        opts: opts.clone(),
        now: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        server_of: (0..shards_n).map(|s| s % sc.servers).collect(),
        shards,
        ranges,
        sink,
        workers,
        workloads,
        evaluator,
        up: vec![Link::default(); nodes],
        down: vec![Link::default(); nodes],
        timer_at: vec![None; shards_n as usize],
        controls: Vec::new(),
        rng: ChaCha8Rng::seed_from_u64(sc.seed ^ 0xA11CE),
        watch: Vec::new(),
        stopping: false,
        time_to_target: None,
        bytes_per_ns: mbit * 1e6 / 8.0 / 1e9,
        latency_ns: sc.latency_us * 1000,
    };
    for s in 0..shards_n {
        for w in 0..n {
            let mut sink = std::mem::take(&mut sim.sink);
            sim.shards[s as usize].join(w, 0, &mut sink).map_err(|e| SimError::Refused(s, e.to_string()))?;
            sim.sink = sink;
            sim.drain(s)?;
        }
    }
    for w in 0..n {
        sim.at(0, Ev::Start(w));
    }
    sim.at(sc.eval_every_ms * 1_000_000, Ev::Watch);
    let mut stopped_at = None;
    while let Some(Reverse((t, _, ev))) = sim.queue.pop() {
        sim.now = t;
        sim.handle(ev)?;
        if sim.workers.iter().all(|w| w.done) {
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
    Ok(sim.report())
}

impl Sim {
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, ev)));
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
        (hi - lo) as u64 * 4 + 64
    }

    /// Schedules what the last call into shard `s` produced.
    fn drain(&mut self, s: u32) -> Result<(), SimError> {
        let served = std::mem::take(&mut self.sink.served);
        let mut values = std::mem::take(&mut self.sink.values).into_iter();
        for (w, version, waited) in served {
            let wk = &mut self.workers[w as usize];
            wk.based_on[s as usize] = Some(version);
            wk.deferred |= waited > 0;
            if let Some((_, v)) = values.next() {
                let (lo, hi) = self.ranges[s as usize];
                wk.params[lo..hi].copy_from_slice(&v);
            }
            let (from, bytes) = (self.server_node(s), self.shard_bytes(s));
            let t = self.transfer(from, w as usize, bytes);
            self.at(t, Ev::PullDone(w, s));
        }
        for w in std::mem::take(&mut self.sink.acked) {
            let t = self.now + self.latency_ns;
            self.at(t, Ev::AckArrive(w, s));
        }
        for c in std::mem::take(&mut self.sink.controls) {
            self.controls.push(c);
            let t = self.now + self.latency_ns;
            self.at(t, Ev::Control(c.0, s, self.controls.len() - 1));
        }
        if let Some(t) = self.shards[s as usize].next_timer_ns() {
            if self.timer_at[s as usize].is_none_or(|at| t < at) {
                self.timer_at[s as usize] = Some(t);
                self.at(t.max(self.now), Ev::Timer(s));
            }
        }
        Ok(())
    }

    fn call<T>(
        &mut self,
        s: u32,
        f: impl FnOnce(&mut Shard, u64, &mut Sink) -> Result<T, crate::shard::ShardError>,
    ) -> Result<T, SimError> {
        let mut sink = std::mem::take(&mut self.sink);
        let r = f(&mut self.shards[s as usize], self.now, &mut sink);
        self.sink = sink;
        let r = r.map_err(|e| SimError::Refused(s, e.to_string()))?;
        self.drain(s)?;
        Ok(r)
    }

    fn compute_ns(&self, w: u32) -> u64 {
        let sc = &self.opts.scenario;
        let wk = &self.workers[w as usize];
        let base = sc.compute_ms.max(1) as f64 * 1e6 * f64::from(wk.batch) / f64::from(sc.batch.max(1));
        (base * f64::from(wk.slow)) as u64
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        let shards = self.shards.len() as u32;
        match ev {
            Ev::Start(w) => {
                let wk = &mut self.workers[w as usize];
                let limit = self.opts.scenario.iterations.unwrap_or(u64::MAX);
                if self.stopping || wk.iteration >= limit {
                    wk.done = true;
                    wk.report.stopped_early = self.stopping;
                    wk.report.elapsed_ns = self.now;
                    // It leaves, as a real worker does: no one waits on it any more.
                    for s in 0..shards {
                        self.call(s, |sh, now, sink| sh.leave(w, LeaveReason::Finished, now, sink))?;
                    }
                    return Ok(());
                }
                wk.replies = 0;
                wk.deferred = false;
                wk.started_ns = self.now;
                for s in 0..shards {
                    let t = self.transfer(w as usize, self.server_node(s), 64);
                    self.at(t, Ev::PullArrive(w, s));
                }
            }
            Ev::PullArrive(w, s) => {
                let iteration = self.workers[w as usize].iteration;
                self.call(s, |sh, now, sink| sh.pull(PullRequest { worker: w, iteration }, now, sink))?;
            }
            Ev::PullDone(w, _) => {
                let wk = &mut self.workers[w as usize];
                wk.replies += 1;
                if wk.replies == shards {
                    wk.pulled_ns = self.now;
                    wk.report.wait_ns += self.now - wk.started_ns;
                    wk.report.deferred_pulls += u64::from(wk.deferred);
                    let mut dur = self.compute_ns(w);
                    let wk = &mut self.workers[w as usize];
                    if let Some((at, len)) = wk.stall {
                        if self.now >= at {
                            dur += len;
                            wk.stall = None;
                        }
                    }
                    wk.report.compute_ns += dur;
                    if let (Some(workload), true) = (self.workloads.get_mut(w as usize), self.opts.gradients)
                    {
                        let step = workload.gradient(w, wk.iteration, wk.batch, &wk.params, &mut wk.grad);
                        wk.report.last_loss = step.loss;
                    }
                    // As on the cluster, injected delays come after computing, before pushing.
                    if let Some(n) = wk.jitter {
                        dur += n.sample(&mut self.rng).max(0.0) as u64;
                    }
                    self.at(self.now + dur, Ev::ComputeDone(w));
                }
            }
            Ev::ComputeDone(w) => {
                self.workers[w as usize].acks = 0;
                for s in 0..shards {
                    let bytes = self.shard_bytes(s);
                    let t = self.transfer(w as usize, self.server_node(s), bytes);
                    self.at(t, Ev::PushArrive(w, s));
                }
            }
            Ev::PushArrive(w, s) => {
                let wk = &self.workers[w as usize];
                let (lo, hi) = self.ranges[s as usize];
                let grad = if self.opts.gradients { wk.grad[lo..hi].to_vec() } else { vec![0.0] };
                let req = PushRequest {
                    worker: w,
                    iteration: wk.iteration,
                    samples: wk.batch,
                    grad,
                    based_on: wk.based_on[s as usize],
                    tasks: None,
                };
                self.call(s, |sh, now, sink| sh.push(req, now, sink))?;
            }
            Ev::AckArrive(w, _) => {
                let wk = &mut self.workers[w as usize];
                wk.acks += 1;
                if wk.acks < shards {
                    return Ok(());
                }
                let (started, busy) = (wk.started_ns, self.now - wk.pulled_ns);
                wk.report.timeline.push((
                    started as f64 / 1e9,
                    (wk.pulled_ns - started) as f32 / 1e9,
                    busy as f32 / 1e9,
                ));
                wk.iteration += 1;
                wk.report.iterations += 1;
                let gap = std::mem::take(&mut wk.pause_ns);
                for s in 0..shards {
                    self.at(self.now + self.latency_ns, Ev::Report(w, s));
                }
                self.at(self.now + gap, Ev::Start(w));
            }
            Ev::Report(w, s) => {
                let wk = &self.workers[w as usize];
                if wk.done {
                    // It stopped and left before its last report arrived.
                    return Ok(());
                }
                let (iteration, samples) = (wk.iteration.saturating_sub(1), wk.batch);
                let report =
                    IterationReport { worker: w, iteration, compute_ns: self.compute_ns(w), samples };
                self.call(s, |sh, now, sink| sh.iteration_finished(report, now, sink))?;
            }
            Ev::Control(w, s, i) => {
                let (_, control) = self.controls[i];
                let wk = &mut self.workers[w as usize];
                let applied = match control {
                    Control::SetBatchSize { samples } if samples > 0 => {
                        wk.batch = samples;
                        control
                    }
                    Control::Pause { for_ns } => {
                        wk.pause_ns += for_ns;
                        control
                    }
                    // No task granularity here: nothing moves.
                    Control::MoveTasks { from, iteration, first, .. } => {
                        Control::MoveTasks { from, iteration, first, count: 0 }
                    }
                    other => other,
                };
                self.controls[i].1 = applied;
                self.at(self.now + self.latency_ns, Ev::Applied(w, s, i));
            }
            Ev::Applied(w, s, i) => {
                let (_, control) = self.controls[i];
                let iteration = self.workers[w as usize].iteration + 1;
                let worker = match control {
                    Control::MoveTasks { .. } => self.controls[i].0,
                    _ => w,
                };
                let applied = Applied { worker, control, iteration };
                // A worker that has left cannot acknowledge; the shard says so and it is dropped.
                let mut sink = std::mem::take(&mut self.sink);
                let _ = self.shards[s as usize].control_applied(applied, self.now, &mut sink);
                self.sink = sink;
                self.drain(s)?;
            }
            Ev::Timer(s) => {
                self.timer_at[s as usize] = None;
                let mut sink = std::mem::take(&mut self.sink);
                self.shards[s as usize].advance(self.now, &mut sink);
                self.sink = sink;
                self.drain(s)?;
            }
            Ev::Watch => {
                self.observe();
                let sc = &self.opts.scenario;
                let over = sc.time_limit_s.is_some_and(|l| self.now as f64 / 1e9 >= l);
                let reached = self.time_to_target.is_some();
                if over || reached {
                    self.stopping = true;
                }
                if !self.workers.iter().all(|w| w.done) {
                    let every = sc.eval_every_ms.max(1) * 1_000_000;
                    self.at(self.now + every, Ev::Watch);
                }
            }
        }
        Ok(())
    }

    fn model(&self) -> Vec<f32> {
        self.shards.iter().flat_map(|s| s.values().iter().copied()).collect()
    }

    fn observe(&mut self) {
        let t_s = self.now as f64 / 1e9;
        let score =
            self.evaluator.as_ref().filter(|_| self.opts.gradients).map(|e| e.evaluate(&self.model()));
        let view = self.shards[0].view();
        let stats: Vec<_> = self.shards.iter().map(Shard::stats).collect();
        if let (Some(sc), Some(target), None) =
            (score, self.opts.scenario.target_accuracy, self.time_to_target)
        {
            if sc.accuracy >= target {
                self.time_to_target = Some(t_s);
            }
        }
        self.watch.push(WatchPoint {
            t_s,
            accuracy: score.map(|s| s.accuracy),
            loss: score.map(|s| s.loss),
            min_clock: view.min_clock,
            max_clock: view.max_clock,
            pulls_deferred: stats.iter().map(|s| s.pulls_deferred).sum(),
            deferred_s: stats.iter().map(|s| s.deferred_ns).sum::<u64>() as f64 / 1e9,
            worker_waits_s: self
                .workers
                .iter()
                .map(|w| (w.report.worker, w.report.wait_ns as f64 / 1e9))
                .collect(),
        });
    }

    fn report(mut self) -> LocalReport {
        self.observe();
        let n = self.workers.len();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let policy = format!("{} (simulated)", self.opts.policy);
        let mut staleness = vec![0u64; STALENESS_BUCKETS];
        let shards: Vec<ShardStatus> = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                for (b, c) in staleness.iter_mut().zip(s.stats().staleness) {
                    *b += c;
                }
                ShardStatus::of(i as u32, s)
            })
            .collect();
        let servers = (0..self.opts.scenario.servers)
            .map(|id| {
                let node = n + id as usize;
                ServerStatus {
                    server: id,
                    addr,
                    shards: shards
                        .iter()
                        .filter(|s| self.server_of[s.shard as usize] == id)
                        .cloned()
                        .collect(),
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
        let workers: Vec<WorkerReport> = self
            .workers
            .iter_mut()
            .enumerate()
            .map(|(i, w)| {
                let mut r = std::mem::take(&mut w.report);
                if r.elapsed_ns == 0 {
                    r.elapsed_ns = self.now;
                }
                (r.bytes_sent, r.bytes_received) = (self.up[i].bytes, self.down[i].bytes);
                r
            })
            .collect();
        LocalReport {
            elapsed_s: self.now as f64 / 1e9,
            workers,
            failed_workers: Vec::new(),
            status: ClusterStatus {
                policy,
                sha256: shards.first().map(|s| s.sha256.clone()).unwrap_or_default(),
                config: self.opts.policy.config.clone(),
                swaps: 0,
                servers,
                workers: (0..n as u32)
                    .map(|worker| WorkerStatus { worker, connected: false, finished: true })
                    .collect(),
            },
            model_len: model.len(),
            model_version: self.shards.iter().map(Shard::version).min().unwrap_or(0),
            model_file: std::path::PathBuf::new(),
            started_unix_s: 0.0,
            watch: self.watch,
            final_accuracy: final_score.map(|s| s.accuracy),
            best_accuracy: best,
            time_to_target_s: self.time_to_target,
            staleness,
            plots: Vec::new(),
        }
    }
}
