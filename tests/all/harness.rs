//! A deterministic cluster of simulated workers around one real [`Shard`]: each worker pulls,
//! waits until its pull is served, "computes", pushes a gradient of all ones, waits for the
//! push's acknowledgement (a policy may hold it), and reports the iteration. A seeded scheduler
//! picks which worker moves next, each with a chance proportional to its speed, so the
//! interleaving is random but reproducible. Policy timers fire as time advances, and batch-size
//! control messages are obeyed.

use syncopate::runtime::PolicyModule;
use syncopate::shard::{OptimizerConfig, PullRequest, PushRequest, Shard, ShardConfig};
use syncopate_policy_sdk::abi::{Control, IterationReport, RequestId, ShardView};
use syncopate_suite::{config, Recorder};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    Waiting(RequestId),
    Ready,
    Acking(RequestId),
    Done,
}

/// One pull as the policy saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullSeen {
    pub worker: u32,
    pub clock: u64,
    pub view: ShardView,
    pub deferred: bool,
}

/// Workers plus the shard they share.
pub struct Cluster {
    pub shard: Shard,
    pub rec: Recorder,
    pub now: u64,
    state: Vec<State>,
    iteration: Vec<u64>,
    iterations: u64,
    rng: u64,
    pub pushes: u64,
    /// (worker, deferred?) for every pull, for comparing decisions across policies.
    pub pull_log: Vec<(u32, bool)>,
    /// Every pull with the clocks it was decided on.
    pub pulls: Vec<PullSeen>,
    /// Relative speeds: a worker is picked with a chance proportional to its speed.
    speeds: Vec<u64>,
    /// Per worker: its batch size and its compute cost per sample (ns).
    pub batch: Vec<u32>,
    cost: Vec<u64>,
    based_on: Vec<Option<u64>>,
    controls_seen: usize,
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
        let mut rec = Recorder::default();
        let shard_cfg = ShardConfig { seed, optimizer: exact_sgd(), ..ShardConfig::default() };
        let mut shard =
            Shard::new(shard_cfg, vec![0.0; 4], module, &config(cfg), &mut rec).expect("policy starts");
        for w in 0..workers {
            shard.join(w, 0, &mut rec).expect("join");
        }
        Cluster {
            shard,
            rec,
            now: 0,
            state: vec![State::Idle; workers as usize],
            iteration: vec![0; workers as usize],
            iterations,
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            pushes: 0,
            pull_log: Vec::new(),
            pulls: Vec::new(),
            speeds: vec![1; workers as usize],
            batch: vec![32; workers as usize],
            cost: vec![1_000; workers as usize],
            based_on: vec![None; workers as usize],
            controls_seen: 0,
        }
    }

    /// Worker `w` is picked `speeds[w]` times as often, and its compute per sample costs
    /// proportionally less (as reported in its iteration reports).
    pub fn with_speeds(mut self, speeds: &[u64]) -> Self {
        assert_eq!(speeds.len(), self.state.len());
        self.speeds = speeds.to_vec();
        self.cost = speeds.iter().map(|s| 12_000 / s.max(&1)).collect();
        self
    }

    fn obey_controls(&mut self) {
        for (w, c) in &self.rec.controls[self.controls_seen..] {
            if let Control::SetBatchSize { samples } = c {
                self.batch[*w as usize] = *samples;
            }
        }
        self.controls_seen = self.rec.controls.len();
    }

    fn next_rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    pub fn done(&self) -> bool {
        self.state.iter().all(|s| *s == State::Done)
    }

    /// Moves worker `w` one step. Returns whether it made progress.
    pub fn step(&mut self, w: usize) -> bool {
        self.now += 100_000;
        self.shard.advance(self.now, &mut self.rec);
        self.obey_controls();
        let worker = w as u32;
        match self.state[w] {
            State::Done => false,
            State::Idle => {
                let iteration = self.iteration[w];
                let (view, clock) = (self.shard.view(), self.shard.workers()[w].clock);
                let id = self
                    .shard
                    .pull(PullRequest { worker, iteration }, self.now, &mut self.rec)
                    .expect("pull");
                let served = self.rec.served(id).map(|s| s.version);
                self.pull_log.push((worker, served.is_none()));
                self.pulls.push(PullSeen { worker, clock, view, deferred: served.is_none() });
                self.based_on[w] = served;
                self.state[w] = if served.is_some() { State::Ready } else { State::Waiting(id) };
                true
            }
            State::Waiting(id) => match self.rec.served(id) {
                Some(s) => {
                    self.based_on[w] = Some(s.version);
                    self.state[w] = State::Ready;
                    true
                }
                None => false,
            },
            State::Acking(id) => {
                if self.rec.was_acked(id) {
                    self.finish_iteration(w);
                    true
                } else {
                    false
                }
            }
            State::Ready => {
                let iteration = self.iteration[w];
                let grad = vec![1.0; self.shard.values().len()];
                let (samples, based_on) = (self.batch[w], self.based_on[w]);
                let id = self
                    .shard
                    .push(
                        PushRequest { worker, iteration, samples, grad, based_on, tasks: None },
                        self.now,
                        &mut self.rec,
                    )
                    .expect("push");
                self.pushes += 1;
                if self.rec.was_acked(id) {
                    self.finish_iteration(w);
                } else {
                    self.state[w] = State::Acking(id);
                }
                true
            }
        }
    }

    fn finish_iteration(&mut self, w: usize) {
        let (worker, iteration, samples) = (w as u32, self.iteration[w], self.batch[w]);
        let compute_ns = self.cost[w] * u64::from(samples);
        let report = IterationReport { worker, iteration, compute_ns, samples };
        self.shard.iteration_finished(report, self.now, &mut self.rec).expect("report");
        self.iteration[w] += 1;
        self.state[w] = if self.iteration[w] == self.iterations { State::Done } else { State::Idle };
    }

    /// Moves a randomly chosen worker one step; panics if every unfinished worker is blocked.
    pub fn step_random(&mut self) {
        let n = self.state.len();
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
        if !self.done() {
            panic!(
                "deadlock: every unfinished worker is blocked (states {:?}, view {:?}, parked {})",
                self.state,
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
