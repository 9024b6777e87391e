//! A deterministic cluster of simulated workers around one real [`Shard`]: each worker pulls,
//! waits until its pull is served, "computes", and pushes a gradient of all ones. A seeded
//! scheduler picks which worker moves next, so the interleaving is random but reproducible.

use syncopate::runtime::PolicyModule;
use syncopate::shard::{OptimizerConfig, PullRequest, PushRequest, Shard, ShardConfig};
use syncopate_policy_sdk::abi::RequestId;
use syncopate_suite::{config, Recorder};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    Waiting(RequestId),
    Ready,
    Done,
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
    /// (step, worker, deferred?) for every pull, for comparing decisions across policies.
    pub pull_log: Vec<(u32, bool)>,
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
        }
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
        self.now += 1_000;
        let worker = w as u32;
        match self.state[w] {
            State::Done => false,
            State::Idle => {
                let iteration = self.iteration[w];
                let id = self
                    .shard
                    .pull(PullRequest { worker, iteration }, self.now, &mut self.rec)
                    .expect("pull");
                let served = self.rec.was_served(id);
                self.pull_log.push((worker, !served));
                self.state[w] = if served { State::Ready } else { State::Waiting(id) };
                true
            }
            State::Waiting(id) => {
                if self.rec.was_served(id) {
                    self.state[w] = State::Ready;
                    true
                } else {
                    false
                }
            }
            State::Ready => {
                let iteration = self.iteration[w];
                let grad = vec![1.0; self.shard.values().len()];
                self.shard
                    .push(
                        PushRequest { worker, iteration, samples: 1, grad, based_on: None },
                        self.now,
                        &mut self.rec,
                    )
                    .expect("push");
                self.pushes += 1;
                self.iteration[w] += 1;
                self.state[w] = if self.iteration[w] == self.iterations { State::Done } else { State::Idle };
                true
            }
        }
    }

    /// Moves a randomly chosen worker one step; panics if every unfinished worker is blocked.
    pub fn step_random(&mut self) {
        let n = self.state.len();
        let start = (self.next_rand() % n as u64) as usize;
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
