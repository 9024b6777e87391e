//! A deterministic cluster of worker machines around one real [`Shard`]: the test harness is the
//! third driver of the engine's [`WorkerMachine`] (with `syncopate worker` and the simulator),
//! so its workers pull, compute, push, report and obey control messages exactly as real ones
//! do. Each worker's gradient is all ones. A seeded scheduler picks which worker moves next,
//! each with a chance proportional to its speed, so the interleaving is random but
//! reproducible; one step is one request to the shard (a pull, or a push and its report), or
//! noticing that a waiting request was answered. Policy timers fire as time advances.
//!
//! Workers stay members of the shard after their last iteration (as in a run whose workers all
//! stop together), so the oracles see every interleaving up to the end under the policy's rules;
//! [`Cluster::leaving`] makes them say goodbye instead, as real workers do.

use syncopate::runtime::PolicyModule;
use syncopate::shard::{OptimizerConfig, PullRequest, PushRequest, PushWeight, Shard, ShardConfig};
use syncopate::worker::WorkerReport;
use syncopate_engine::worker::{Action, Buffers, Device, Input, JobKind, WorkerConfig, WorkerMachine};
use syncopate_policy_sdk::abi::{Applied, RequestId, ShardView};
use syncopate_suite::{config, Recorder};
use syncopate_workloads::{StepStats, Workload};

/// One pull as the policy saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullSeen {
    pub worker: u32,
    pub clock: u64,
    pub view: ShardView,
    pub deferred: bool,
}

/// A gradient of ones, whatever the parameters: every applied push moves each parameter by the
/// same known amount. Its loss falls as `4 / (1 + iteration)`, for rules that read it.
struct Ones;

impl Workload for Ones {
    fn name(&self) -> &str {
        "ones"
    }
    fn param_len(&self) -> usize {
        4
    }
    fn init_params(&self, _seed: u64) -> Vec<f32> {
        vec![0.0; 4]
    }
    fn gradient(&mut self, _w: u32, i: u64, batch: u32, _p: &[f32], grad: &mut [f32]) -> StepStats {
        grad.fill(1.0);
        StepStats { samples: batch, loss: 4.0 / (1 + i) as f32 }
    }
}

/// What a worker's driver is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Nothing,
    Pull(RequestId),
    Push(RequestId),
}

struct Worker {
    machine: WorkerMachine,
    bufs: Buffers,
    wait: Wait,
    /// An action polled but not yet carried out (the step ended before it).
    next: Option<Action>,
    based_on: Option<u64>,
}

/// Workers plus the shard they share.
pub struct Cluster {
    pub shard: Shard,
    pub rec: Recorder,
    pub now: u64,
    workers: Vec<Worker>,
    rng: u64,
    pub pushes: u64,
    /// (worker, deferred?) for every pull, for comparing decisions across policies.
    pub pull_log: Vec<(u32, bool)>,
    /// Every pull with the clocks it was decided on.
    pub pulls: Vec<PullSeen>,
    /// Relative speeds: a worker is picked with a chance proportional to its speed.
    speeds: Vec<u64>,
    /// Per worker: its batch size (as its machine last set it) and compute cost per sample (ns).
    pub batch: Vec<u32>,
    cost: Vec<u64>,
    messages_seen: usize,
    /// Workers say goodbye after their last iteration.
    leave: bool,
    /// Driver time per step.
    step_ns: u64,
}

/// SGD with learning rate 1 and no momentum: every push of ones at weight 1/N moves the parameter
/// by exactly -1/N, so with N a power of two the final value counts the applied pushes exactly.
pub fn exact_sgd() -> OptimizerConfig {
    OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false }
}

impl Cluster {
    pub fn new(
        module: &PolicyModule,
        cfg: &[(&str, &str)],
        workers: u32,
        iterations: u64,
        seed: u64,
    ) -> Self {
        Self::build(module, cfg, workers, iterations, seed, false, PushWeight::Mean)
    }

    /// Workers leave the shard after their last iteration, as real workers do. With
    /// [`PushWeight::Sum`] each push moves the parameter by exactly -1 however many workers are
    /// live, so it counts applied pushes; with [`PushWeight::Mean`] every aggregated round moves
    /// it by exactly -1 (the mean of the round's ones), the last rounds too, when the faster
    /// workers have already left.
    pub fn leaving(
        module: &PolicyModule,
        cfg: &[(&str, &str)],
        workers: u32,
        iterations: u64,
        seed: u64,
        weight: PushWeight,
    ) -> Self {
        Self::build(module, cfg, workers, iterations, seed, true, weight)
    }

    fn build(
        module: &PolicyModule,
        cfg: &[(&str, &str)],
        workers: u32,
        iterations: u64,
        seed: u64,
        leave: bool,
        push_weight: PushWeight,
    ) -> Self {
        let mut rec = Recorder::default();
        let shard_cfg = ShardConfig { seed, optimizer: exact_sgd(), push_weight, ..ShardConfig::default() };
        let mut shard =
            Shard::new(shard_cfg, vec![0.0; 4], module, &config(cfg), &mut rec).expect("policy starts");
        let workers: Vec<Worker> = (0..workers)
            .map(|w| {
                let start = shard.join(w, 0, &mut rec).expect("join");
                let cfg = WorkerConfig {
                    id: w,
                    start,
                    iterations,
                    batch: 32,
                    part: w,
                    can_split: false,
                    numbering_shared: true,
                    device: Device::default(),
                    tokens_per_sample: 0,
                };
                let machine = WorkerMachine::new(cfg, 0).expect("worker starts");
                let mut bufs = Buffers::new(4, false);
                // Local steps take the shard's plain SGD: a pseudo-gradient of H ones is H.
                bufs.set_inner_optimizer(exact_sgd());
                Worker { machine, bufs, wait: Wait::Nothing, next: None, based_on: None }
            })
            .collect();
        let n = workers.len();
        Cluster {
            shard,
            rec,
            now: 0,
            workers,
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            pushes: 0,
            pull_log: Vec::new(),
            pulls: Vec::new(),
            speeds: vec![1; n],
            batch: vec![32; n],
            cost: vec![1_000; n],
            messages_seen: 0,
            leave,
            step_ns: 100_000,
        }
    }

    /// Each step takes `ns` of driver time (100 µs by default).
    pub fn with_step_ns(mut self, ns: u64) -> Self {
        self.step_ns = ns;
        self
    }

    /// Worker `w` is picked `speeds[w]` times as often, and its compute per sample costs
    /// proportionally less (as reported in its iteration reports).
    pub fn with_speeds(mut self, speeds: &[u64]) -> Self {
        assert_eq!(speeds.len(), self.workers.len());
        self.speeds = speeds.to_vec();
        self.cost = speeds.iter().map(|s| 12_000 / s.max(&1)).collect();
        self
    }

    /// Hands every control message the shard sent to its worker's machine.
    fn deliver_controls(&mut self) {
        while self.messages_seen < self.rec.messages.len() {
            let (w, msg) = self.rec.messages[self.messages_seen].clone();
            self.messages_seen += 1;
            let wk = &mut self.workers[w as usize];
            if !wk.machine.is_done() {
                wk.machine.handle(self.now, Input::Control(msg)).expect("control");
                self.batch[w as usize] = wk.machine.batch();
            }
        }
    }

    fn next_rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    pub fn done(&self) -> bool {
        self.workers.iter().all(|w| w.machine.is_done())
    }

    /// The workers' reports.
    pub fn reports(&self) -> Vec<WorkerReport> {
        self.workers.iter().map(|w| w.machine.report().clone()).collect()
    }

    /// Moves worker `w` one step. Returns whether it made progress.
    pub fn step(&mut self, w: usize) -> bool {
        self.now += self.step_ns;
        self.shard.advance(self.now, &mut self.rec);
        self.deliver_controls();
        match self.workers[w].wait {
            Wait::Pull(id) => {
                let Some(s) = self.rec.served(id) else { return false };
                let (version, waited, local_steps) = (s.version, s.waited_ns, s.local_steps);
                let wk = &mut self.workers[w];
                (wk.based_on, wk.wait) = (Some(version), Wait::Nothing);
                wk.machine
                    .handle(self.now, Input::Pulled { deferred: true, deferred_ns: waited, local_steps })
                    .expect("pulled");
                // The end of a wait it told the shard of goes out at once, as a driver sends it.
                match wk.machine.poll_action(self.now) {
                    Some(Action::Waiting { iteration, waiting }) => {
                        self.shard.pull_waiting(w as u32, iteration, waiting, self.now).expect("notice");
                    }
                    next => wk.next = next,
                }
                true
            }
            Wait::Push(id) => {
                if !self.rec.was_acked(id) {
                    return false;
                }
                self.workers[w].wait = Wait::Nothing;
                let pushed = Input::Pushed { kind: JobKind::Own, result: Ok(0) };
                self.workers[w].machine.handle(self.now, pushed).expect("pushed");
                self.run_actions(w, false);
                true
            }
            Wait::Nothing => self.run_actions(w, true),
        }
    }

    /// Carries out worker `w`'s actions up to its next request to the shard, and (when `request`)
    /// that request. Returns whether it made one.
    fn run_actions(&mut self, w: usize, mut request: bool) -> bool {
        let worker = w as u32;
        let mut made = false;
        loop {
            let now = self.now;
            let wk = &mut self.workers[w];
            let Some(action) = wk.next.take().or_else(|| wk.machine.poll_action(now)) else { return made };
            match action {
                Action::Compute(job) => {
                    let step = wk.bufs.compute(worker, &job, Some(&mut Ones));
                    let compute_ns = self.cost[w] * u64::from(step.map_or(0, |s| s.samples));
                    wk.machine.handle(now, Input::Computed { step, compute_ns }).expect("computed");
                }
                Action::Finished(report) => {
                    self.shard.iteration_finished(report, now, &mut self.rec).expect("report");
                }
                Action::Skip { to, .. } => self.shard.skip(worker, to, now, &mut self.rec).expect("skip"),
                Action::Waiting { iteration, waiting } => {
                    self.shard.pull_waiting(worker, iteration, waiting, now).expect("notice");
                }
                Action::Applied { control, iteration, .. } => {
                    let applied = Applied { worker, control, iteration };
                    self.shard.control_applied(applied, now, &mut self.rec).expect("acknowledged");
                }
                Action::Handover { handover, .. } => {
                    self.shard.tasks_yielded(handover, now, &mut self.rec).expect("handed over");
                }
                Action::Leave => {
                    if self.leave {
                        self.shard.goodbye(worker, now, &mut self.rec).expect("goodbye");
                    }
                    return made;
                }
                a @ (Action::Pull { .. } | Action::Push(_)) if !request => {
                    wk.next = Some(a);
                    return made;
                }
                Action::Pull { iteration } => {
                    let view = self.shard.view();
                    let clock = self.shard.workers().iter().find(|c| c.worker == worker).expect("live").clock;
                    let id =
                        self.shard.pull(PullRequest { worker, iteration }, now, &mut self.rec).expect("pull");
                    let served = self.rec.served(id).map(|s| (s.version, s.local_steps));
                    self.pull_log.push((worker, served.is_none()));
                    self.pulls.push(PullSeen { worker, clock, view, deferred: served.is_none() });
                    let wk = &mut self.workers[w];
                    match served {
                        Some((version, local_steps)) => {
                            wk.based_on = Some(version);
                            let pulled = Input::Pulled { deferred: false, deferred_ns: 0, local_steps };
                            wk.machine.handle(now, pulled).expect("pulled");
                        }
                        None => wk.wait = Wait::Pull(id),
                    }
                    return true;
                }
                Action::Push(job) => {
                    let grad = wk.bufs.gradient(&job).to_vec();
                    let req = PushRequest {
                        worker: job.owner,
                        iteration: job.iteration,
                        samples: job.samples,
                        grad,
                        based_on: wk.based_on,
                        tasks: job.tasks,
                        local_steps: job.local_steps,
                        signals: job.signals,
                    };
                    let id = self.shard.push_by(worker, req, now, &mut self.rec).expect("push");
                    self.pushes += 1;
                    (request, made) = (false, true);
                    if self.rec.was_acked(id) {
                        let pushed = Input::Pushed { kind: job.kind, result: Ok(0) };
                        self.workers[w].machine.handle(now, pushed).expect("pushed");
                    } else {
                        self.workers[w].wait = Wait::Push(id);
                        return made;
                    }
                }
            }
        }
    }

    /// Moves a randomly chosen worker one step; panics if every unfinished worker is blocked.
    pub fn step_random(&mut self) {
        let n = self.workers.len();
        let total: u64 = self.speeds.iter().sum();
        let mut pick = self.next_rand() % total;
        let mut start = 0;
        while pick >= self.speeds[start] {
            pick -= self.speeds[start];
            start += 1;
        }
        for k in 0..n {
            if self.step((start + k) % n) {
                return;
            }
        }
        // Everyone is blocked: a policy timer may be what they wait for. Jump to it.
        if let Some(due) = self.shard.next_timer_ns().filter(|_| !self.done()) {
            self.now = self.now.max(due);
            return;
        }
        if !self.done() {
            let waits: Vec<Wait> = self.workers.iter().map(|w| w.wait).collect();
            panic!(
                "deadlock: every unfinished worker is blocked (waiting {waits:?}, view {:?}, parked {})",
                self.shard.view(),
                self.shard.parked_pulls()
            );
        }
    }

    /// Runs until every worker has pushed all its iterations.
    pub fn run_to_end(&mut self) {
        let mut guard = 0u64;
        while !self.done() {
            self.step_random();
            guard += 1;
            assert!(guard < 10_000_000, "run did not finish");
        }
    }
}
