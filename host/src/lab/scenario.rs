//! Scenarios as data: a TOML file naming the workload, the cluster's size, each worker's speed
//! (slowdowns, jitter, stalls, or a real run's measured compute times), the emulated compute
//! time, the target (accuracy, loss or perplexity) and the budget.
//! `syncopate ab` runs one scenario under several policies; `scenarios/` ships the papers'
//! conditions. A scenario and a policy make a [`RunSpec`], the one typed description of a run
//! that the local launcher ([`crate::lab::local`]) and the simulator ([`crate::lab::sim`]) both
//! take; `syncopate local` builds one from its flags.
//!
//! ```toml
//! name = "straggler"
//! description = "One worker of four computes 3x slower."
//! workload = "fashion-mlp"
//! workers = 4
//! servers = 2
//! hidden = 128             # the MLP's hidden units (`params` sizes the counter workload)
//! compute_ms = 20          # emulated compute per iteration at the starting batch size
//! target_accuracy = 0.80  # or target_loss = 3.0, or target_perplexity = 20.0 (lower is better)
//! time_limit_s = 40
//! lr = 0.05                # the optimizer (these five keys are optional: local's defaults)
//! momentum = 0.9
//! weight_decay = 0.0
//! optimizer_on = "server"  # or "worker": momentum and decay on the workers, plain SGD on the
//!                          # servers (FluentPS's placement)
//! push_weight = "mean"     # or "sum"
//! local_steps = 0          # local SGD: gradients per push until a policy says (0: one)
//! outer_lr = 1.0           # the optimizer of pseudo-gradients (these three: averaging)
//! outer_momentum = 0.0
//! outer_nesterov = false
//! push_codec = "none"      # none, fp16, bf16, int8, int8-BLOCK, topk-FRACTION (policies may
//! pull_codec = "none"      # set others); pulls are never top-k
//! no_progress_s = 30       # every live worker waiting this long on a policy is its failure
//! trace = "traces/run.json"  # simulator only: replay a real run's compute times (its report.json)
//!
//! [[slow]]
//! worker = 0
//! factor = 3.0
//! from_s = 20.0            # optional: only from 20 s until 40 s after the worker started
//! until_s = 40.0           # (either alone: from then on, or until then)
//!
//! [[jitter]]               # FluentPS's injection: sleep N(mean, sd) ms after every iteration
//! worker = 1
//! mean_ms = 30.0
//! sd_ms = 10.0             # (from_s and until_s as for [[slow]])
//!
//! [modelled]               # simulator only: charge a larger model's bytes on the wire
//! name = "ResNet-110 (6.9 MB)"
//! bytes = 6_900_000
//! ```
//!
//! A failure drill: each shard backed up on another server, and server 0 killed 3 s in (a
//! SIGKILL on a real cluster; in the simulator it stops before its first event from then on):
//!
//! ```toml
//! replicas = 1
//! [kill_server]
//! server = 0
//! at_s = 3.0
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use syncopate_workloads::WorkloadOptions;

use crate::builtin::PolicySpec;
use crate::lab::report::{StopRules, Target};
use crate::shard::{Codec, LocalSgdConfig, OptimizerConfig, PushWeight};

/// A scenario file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name, used for output folders.
    pub name: String,
    /// What the scenario reproduces.
    #[serde(default)]
    pub description: String,
    /// The workload: `fashion-mlp`, `fashion-softmax` or `counter`.
    #[serde(default = "default_workload")]
    pub workload: String,
    /// Hidden units of the `fashion-mlp` workload.
    #[serde(default = "default_hidden")]
    pub hidden: usize,
    /// Parameters of the `counter` workload.
    #[serde(default = "default_params")]
    pub params: usize,
    /// Worker processes.
    pub workers: u32,
    /// Server processes.
    #[serde(default = "default_servers")]
    pub servers: u32,
    /// Shards (default: one per server).
    pub shards: Option<u32>,
    /// Mini-batch size per worker.
    #[serde(default = "default_batch")]
    pub batch: u32,
    /// Emulated compute per iteration at the starting batch size, in ms (0: the real compute
    /// only). Slow workers' compute is stretched by their factor.
    #[serde(default)]
    pub compute_ms: u64,
    /// Stop once test accuracy reaches this (0-1).
    pub target_accuracy: Option<f32>,
    /// Stop once the held-out loss is at most this (nats; lower is better).
    pub target_loss: Option<f32>,
    /// Stop once the held-out perplexity (the exponential of the loss) is at most this.
    pub target_perplexity: Option<f32>,
    /// Stop after this many seconds of training.
    pub time_limit_s: Option<f64>,
    /// Iterations per worker (default: unbounded; `time_limit_s` ends the run).
    pub iterations: Option<u64>,
    /// How often the watcher scores the model, in ms.
    #[serde(default = "default_eval")]
    pub eval_every_ms: u64,
    /// Seed of the initial parameters, the data order and the policies' random source.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// One-way latency of every message in the simulator, in microseconds (real clusters have
    /// their own). 250 µs is what a request costs on this project's loopback clusters.
    #[serde(default = "default_latency")]
    pub latency_us: u64,
    /// Link bandwidth per node, in Mbit/s. Loopback clusters cannot enforce it: `syncopate ab`
    /// refuses such a scenario and names the recipe (docs/bandwidth.md) that can.
    pub bandwidth_mbit: Option<f64>,
    /// The servers' SGD learning rate (default 0.05, as `syncopate local`'s).
    pub lr: Option<f32>,
    /// The servers' SGD momentum (default 0.9).
    pub momentum: Option<f32>,
    /// L2 weight decay (default 0).
    pub weight_decay: Option<f32>,
    /// Where momentum and weight decay run (default: on the servers).
    #[serde(default)]
    pub optimizer_on: Placement,
    /// How pushes are weighed when the policy does not say: `mean` (default) or `sum`.
    pub push_weight: Option<PushWeight>,
    /// Local steps per iteration until a policy sets others (default 0: push gradients).
    pub local_steps: Option<u32>,
    /// The outer optimizer's learning rate (default 1: with no momentum, model averaging).
    pub outer_lr: Option<f32>,
    /// The outer optimizer's momentum (default 0).
    pub outer_momentum: Option<f32>,
    /// Nesterov momentum for the outer optimizer (default false).
    pub outer_nesterov: Option<bool>,
    /// The codec workers push in until a policy sets another (default none).
    #[serde(default, with = "codec_text")]
    pub push_codec: Option<Codec>,
    /// The codec pulls are answered in until a policy sets another (default none; not top-k).
    #[serde(default, with = "codec_text")]
    pub pull_codec: Option<Codec>,
    /// The costs of a larger model than the workload's, modelled by the simulator: the real
    /// (small) workload still supplies the gradients and the accuracy, but every transfer moves
    /// this model's bytes. Set `compute_ms` to its compute time on the device you model. Every
    /// report of such a run says so.
    pub modelled: Option<Modelled>,
    /// A real run's `report.json` (of `syncopate local` or `ab`) whose workers' measured compute
    /// times the simulator replays, one per iteration in order: worker `w` replays the run's
    /// worker `w mod n`, so a cluster of 4 can stand for one of 400 with the same mix of
    /// devices. Replaces `compute_ms`; slowdowns, jitter and stalls still apply on top. A path
    /// relative to the scenario file. Simulator only.
    pub trace: Option<PathBuf>,
    /// Workers that compute slower.
    #[serde(default)]
    pub slow: Vec<Slow>,
    /// Workers that sleep a random time after every iteration.
    #[serde(default)]
    pub jitter: Vec<Jitter>,
    /// Workers that stall once.
    #[serde(default)]
    pub stall: Vec<Stall>,
    /// Links that slow down for a while (the simulator's network only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub link: Vec<LinkSlow>,
    /// Backups per shard, as `--replicas` (0 or 1; 1 needs two servers or more).
    #[serde(default)]
    pub replicas: u32,
    /// A server killed during the run (needs `replicas = 1`): its backups take over.
    pub kill_server: Option<KillServer>,
    /// Seconds every live worker may wait on a shard's policy before that is the rule's
    /// failure, as `--no-progress-s` (default 30; 0: never).
    #[serde(default)]
    pub no_progress_s: Option<f64>,
    /// A user's training script that every worker runs instead of a built-in workload: its path,
    /// then its arguments (`["examples/torch/train.py", "--epochs", "2"]`). A `.py` file runs
    /// under Python (`SYNCOPATE_PYTHON`, or `python3`); anything else is run as it is. The
    /// script joins through the `SYNCOPATE_*` environment (see `syncopate worker --help`); the
    /// devices' slowdowns, jitter and stalls, the budget and the batch size reach it there.
    /// Real clusters only: the simulator cannot run it.
    #[serde(default)]
    pub script: Vec<String>,
}

/// Where the optimizer's momentum and weight decay run.
///
/// On the servers (the default, and MXNet's and TensorFlow's parameter servers' default), every
/// admitted gradient goes through the shard's momentum: a stale gradient disturbs the velocity
/// every worker then shares. On the workers (FluentPS's authors' placement: their workers run
/// momentum and their server only sums scaled updates), each worker keeps its own velocity and
/// pushes its momentum direction, and the servers run plain SGD with the same learning rate. With
/// one worker the two are the same run, bit for bit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// The servers run momentum and decay.
    #[default]
    Server,
    /// Each worker runs momentum and decay on its own gradients; the servers, plain SGD.
    Worker,
}

/// A model whose wire costs the simulator charges instead of the workload's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Modelled {
    /// What is modelled, as reports print it: "ResNet-110 (6.9 MB) on a GTX 1080 Ti".
    pub name: String,
    /// Bytes of the whole model (a full push or pull moves this much, split over the shards).
    pub bytes: u64,
}

/// A worker `factor` times slower, always or for a while.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slow {
    /// The worker.
    pub worker: u32,
    /// How many times slower (at least 1).
    pub factor: f32,
    /// From this many seconds after the worker started (default: from the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_s: Option<f64>,
    /// Until this many seconds after the worker started (default: to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
}

/// A node's link (both directions) at `mbit` Mbit/s for a while: a worker's (`worker`) or a
/// server's (`server`), from `from_s` until `until_s` seconds after the run's start. The
/// simulator's network only: a loopback cluster cannot enforce bandwidth
/// (`docs/bandwidth.md` has a recipe that can, for a whole run).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkSlow {
    /// The worker whose link it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<u32>,
    /// The server whose link it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<u32>,
    /// Its bandwidth meanwhile, Mbit/s.
    pub mbit: f64,
    /// From (default: the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_s: Option<f64>,
    /// Until (default: the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
}

/// A window `from_s..until_s` in nanoseconds after a worker's start, for its device (`None`:
/// always); `Err` for one that ends before it starts or lies before 0.
pub fn window_ns(from_s: Option<f64>, until_s: Option<f64>) -> Result<Option<(u64, u64)>, String> {
    if from_s.is_none() && until_s.is_none() {
        return Ok(None);
    }
    let (from, until) = (from_s.unwrap_or(0.0), until_s.unwrap_or(f64::INFINITY));
    if !(from >= 0.0 && until > from && !until.is_nan()) {
        return Err(format!(
            "a window from {from} s until {until} s must start at 0 or later and end after it starts"
        ));
    }
    let ns = |s: f64| if s.is_finite() { (s * 1e9).min(u64::MAX as f64) as u64 } else { u64::MAX };
    Ok(Some((ns(from), ns(until))))
}

/// A worker that sleeps `N(mean_ms, sd_ms)` ms after every iteration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jitter {
    /// The worker.
    pub worker: u32,
    /// Mean delay, ms.
    pub mean_ms: f64,
    /// Standard deviation, ms.
    pub sd_ms: f64,
    /// From this many seconds after the worker started (default: from the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_s: Option<f64>,
    /// Until this many seconds after the worker started (default: to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
}

/// A worker that stalls once, `at_s` seconds in, for `for_s` seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stall {
    /// The worker.
    pub worker: u32,
    /// When, in seconds after the start.
    pub at_s: f64,
    /// How long, in seconds.
    pub for_s: f64,
}

/// A server killed `at_s` seconds into training.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillServer {
    /// The server.
    pub server: u32,
    /// When, in seconds after training starts.
    pub at_s: f64,
}

fn default_workload() -> String {
    "fashion-mlp".into()
}
fn default_hidden() -> usize {
    128
}
fn default_params() -> usize {
    1024
}
fn default_servers() -> u32 {
    2
}
fn default_batch() -> u32 {
    32
}
fn default_eval() -> u64 {
    1000
}
fn default_seed() -> u64 {
    1
}
fn default_latency() -> u64 {
    DEFAULT_LATENCY_US
}

/// The simulator's one-way message latency when a scenario names none, in microseconds: what a
/// request costs on this project's loopback clusters.
pub const DEFAULT_LATENCY_US: u64 = 250;

/// A scenario that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file cannot be read.
    #[error("cannot read scenario {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid scenario.
    #[error("scenario {path} is not valid: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong (TOML errors name the line).
        reason: String,
    },
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ScenarioError::Read { path: path.into(), source })?;
        let invalid = |reason: String| ScenarioError::Invalid { path: path.into(), reason };
        let mut s: Scenario = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        s.check().map_err(invalid)?;
        if let Some(trace) = s.trace.as_mut().filter(|t| t.is_relative()) {
            *trace = path.parent().unwrap_or(Path::new(".")).join(&trace);
        }
        Ok(s)
    }

    /// Checks the values make sense together.
    pub fn check(&self) -> Result<(), String> {
        if self.workers == 0 || self.servers == 0 || self.batch == 0 {
            return Err("workers, servers and batch must be at least 1".into());
        }
        if self.name.is_empty()
            || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!("name `{}` must be letters, digits, - and _", self.name));
        }
        let named = self.slow.iter().map(|s| s.worker).chain(self.jitter.iter().map(|j| j.worker));
        if let Some(w) = named.chain(self.stall.iter().map(|s| s.worker)).find(|w| *w >= self.workers) {
            return Err(format!("worker {w} does not exist (the scenario has {} workers)", self.workers));
        }
        if let Some(s) = self.slow.iter().find(|s| !(s.factor >= 1.0 && s.factor.is_finite())) {
            return Err(format!("worker {}'s slow factor {} must be at least 1", s.worker, s.factor));
        }
        if let Some(j) = self.jitter.iter().find(|j| !(j.mean_ms >= 0.0 && j.sd_ms >= 0.0)) {
            return Err(format!("worker {}'s jitter needs a non-negative mean and sd", j.worker));
        }
        for s in &self.slow {
            window_ns(s.from_s, s.until_s).map_err(|e| format!("worker {}'s slowdown: {e}", s.worker))?;
        }
        for j in &self.jitter {
            window_ns(j.from_s, j.until_s).map_err(|e| format!("worker {}'s jitter: {e}", j.worker))?;
        }
        for l in &self.link {
            let node = match (l.worker, l.server) {
                (Some(w), None) if w < self.workers => format!("worker {w}'s link"),
                (None, Some(x)) if x < self.servers => format!("server {x}'s link"),
                (Some(_), None) | (None, Some(_)) => {
                    return Err("a [[link]] names a node the scenario does not have".into())
                }
                _ => return Err("a [[link]] names one worker or one server".into()),
            };
            if !(l.mbit.is_finite() && l.mbit > 0.0) {
                return Err(format!("{node}: {} Mbit/s is not a positive bandwidth", l.mbit));
            }
            window_ns(l.from_s, l.until_s).map_err(|e| format!("{node}: {e}"))?;
        }
        let targets = [self.target_accuracy, self.target_loss, self.target_perplexity];
        if targets.iter().flatten().count() > 1 {
            return Err("give one of target_accuracy, target_loss and target_perplexity".into());
        }
        if let Some(l) = self.target_loss.filter(|l| !(l.is_finite() && *l > 0.0)) {
            return Err(format!("target_loss {l} is not a positive number"));
        }
        if let Some(p) = self.target_perplexity.filter(|p| !(p.is_finite() && *p > 1.0)) {
            return Err(format!("target_perplexity {p} is not above 1"));
        }
        if let Some(a) = self.target_accuracy.filter(|a| !(0.0..=1.0).contains(a)) {
            return Err(format!("target_accuracy {a} is not between 0 and 1"));
        }
        let o = self.optimizer();
        let sane = o.lr.is_finite() && o.lr > 0.0 && (0.0..1.0).contains(&o.momentum);
        if !(sane && o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(format!(
                "lr {} must be positive, momentum {} in [0, 1), weight_decay {} not negative",
                o.lr, o.momentum, o.weight_decay
            ));
        }
        let (push, pull) = self.codecs();
        push.check().map_err(|e| format!("push_codec: {e}"))?;
        pull.check().map_err(|e| format!("pull_codec: {e}"))?;
        if pull.is_sparse() {
            return Err(format!("pull_codec: pulls carry parameters; {pull} is for pushes"));
        }
        let l = self.local_sgd();
        syncopate_policy_sdk::rules::check_local_steps(l.local_steps)
            .map_err(|e| format!("local_steps: {e}"))?;
        syncopate_policy_sdk::rules::check_outer_optimizer(l.outer.lr, l.outer.momentum)
            .map_err(|e| format!("outer_lr, outer_momentum: {e}"))?;
        if self.modelled.as_ref().is_some_and(|m| m.bytes == 0 || m.name.is_empty()) {
            return Err("a modelled model needs a name and a positive size in bytes".into());
        }
        if self.replicas > 1 {
            return Err(format!("replicas {}: replicas is 0 or 1", self.replicas));
        }
        if self.replicas == 1 && self.servers < 2 {
            return Err(
                "replicas 1 needs at least two servers (a backup lives on another server than its shard)"
                    .into(),
            );
        }
        if let Some(k) = self.kill_server {
            if self.replicas == 0 {
                return Err("kill_server needs replicas = 1: without a backup the shards die with it".into());
            }
            if k.server >= self.servers || !(k.at_s.is_finite() && k.at_s >= 0.0) {
                return Err(format!(
                    "kill_server: server {} at {} s (the scenario has {} servers; the time must be 0 or more)",
                    k.server, k.at_s, self.servers
                ));
            }
        }
        if self.iterations.is_none() && self.time_limit_s.is_none() {
            return Err("give a budget, iterations or time_limit_s: a run must end".into());
        }
        if self.no_progress_s.is_some_and(|s| !(s.is_finite() && s >= 0.0)) {
            return Err("no_progress_s must be a number of seconds, 0 or more".into());
        }
        Ok(())
    }

    /// How the shards supervise their policies: the defaults, with the scenario's no-progress
    /// time.
    pub fn supervisor(&self) -> crate::shard::SupervisorConfig {
        let default = crate::shard::SupervisorConfig::default();
        let no_progress_ns = match self.no_progress_s {
            Some(s) => (s * 1e9) as u64,
            None => default.no_progress_ns,
        };
        crate::shard::SupervisorConfig { no_progress_ns, ..default }
    }

    /// The servers' optimizer: all of [`Scenario::optimizer`], or its plain SGD when the
    /// optimizer is on the workers.
    pub fn server_optimizer(&self) -> OptimizerConfig {
        match self.optimizer_on {
            Placement::Server => self.optimizer(),
            Placement::Worker => self.optimizer().plain(),
        }
    }

    /// The push and pull codecs workers and shards start with.
    pub fn codecs(&self) -> (Codec, Codec) {
        (self.push_codec.unwrap_or_default(), self.pull_codec.unwrap_or_default())
    }

    /// Local steps and the outer optimizer the shards start with.
    pub fn local_sgd(&self) -> LocalSgdConfig {
        let d = LocalSgdConfig::default();
        let outer = OptimizerConfig {
            lr: self.outer_lr.unwrap_or(d.outer.lr),
            momentum: self.outer_momentum.unwrap_or(d.outer.momentum),
            weight_decay: 0.0,
            nesterov: self.outer_nesterov.unwrap_or(d.outer.nesterov),
        };
        LocalSgdConfig { local_steps: self.local_steps.unwrap_or(d.local_steps), outer }
    }

    /// The workers' half of the optimizer, when it is placed on them.
    pub fn worker_optimizer(&self) -> Option<OptimizerConfig> {
        (self.optimizer_on == Placement::Worker).then(|| self.optimizer())
    }

    /// The optimizer: the scenario's settings over `syncopate local`'s defaults, wherever it runs.
    pub fn optimizer(&self) -> OptimizerConfig {
        let d = OptimizerConfig::default();
        OptimizerConfig {
            lr: self.lr.unwrap_or(d.lr),
            momentum: self.momentum.unwrap_or(d.momentum),
            weight_decay: self.weight_decay.unwrap_or(d.weight_decay),
            nesterov: false,
        }
    }

    /// What the run aims at, if anything.
    pub fn target(&self) -> Option<Target> {
        (self.target_accuracy.map(Target::Accuracy))
            .or(self.target_loss.map(Target::Loss))
            .or(self.target_perplexity.map(|p| Target::Loss(p.ln())))
    }

    /// When a run of this scenario stops.
    pub fn stop_rules(&self) -> StopRules {
        StopRules { target: self.target(), time_limit_s: self.time_limit_s }
    }

    /// The workload's options: its shape and seed from the scenario, the data from `data_dir`
    /// (`None`: the workload's default). Every worker's own options are these with its part of
    /// the training set.
    pub fn workload_options(&self, data_dir: Option<&Path>) -> WorkloadOptions {
        WorkloadOptions {
            params: self.params,
            data_dir: data_dir.map(Path::to_path_buf),
            part: (0, 1),
            hidden: self.hidden,
            seed: self.seed,
        }
    }

    /// The iterations each worker runs: the scenario's, or, when only a time limit ends the
    /// run, as many as it can reach.
    pub fn iterations_or_unbounded(&self) -> u64 {
        self.iterations.unwrap_or(u64::MAX / 4)
    }
}

/// One run, typed: the conditions and the policy. `syncopate local` builds one from its flags,
/// `syncopate ab` one per policy from a scenario file; the local launcher and the simulator
/// both take it, so a run means the same whichever runs it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    /// The conditions: cluster, workload, devices, training settings, budget.
    pub scenario: Scenario,
    /// The policy, with its configuration.
    pub policy: PolicySpec,
    /// Per-shard overrides of single configuration keys, `(shard, key, value)`.
    pub overrides: Vec<(u32, String, String)>,
    /// A cluster policy the coordinator runs beside it (the autopilot), if any.
    pub pilot: Option<PolicySpec>,
}

impl RunSpec {
    /// The scenario under `policy`, every shard configured alike. A cluster policy
    /// (`autopilot`) given as the policy runs as the pilot of a cluster that starts on BSP, so
    /// that `ab --policies bsp,asp,autopilot` compares it with the fixed rules.
    pub fn new(scenario: Scenario, policy: PolicySpec) -> Self {
        Self::with_pilot(scenario, policy, Vec::new(), None)
    }

    /// The scenario under `policy` with per-shard `overrides` and a cluster policy `pilot`.
    pub fn with_pilot(
        scenario: Scenario,
        policy: PolicySpec,
        overrides: Vec<(u32, String, String)>,
        pilot: Option<PolicySpec>,
    ) -> Self {
        if policy.is_cluster_builtin() && pilot.is_none() {
            let bsp = PolicySpec { source: "bsp".into(), config: Vec::new() };
            return RunSpec { scenario, policy: bsp, overrides, pilot: Some(policy) };
        }
        RunSpec { scenario, policy, overrides, pilot }
    }

    /// The shards this run has (one per server unless the scenario says).
    pub fn shards(&self) -> u32 {
        self.scenario.shards.unwrap_or(self.scenario.servers).max(1)
    }

    /// The policy configuration shard `shard` starts with.
    pub fn shard_config(&self, shard: u32) -> Vec<(String, String)> {
        crate::builtin::shard_config(&self.policy.config, &self.overrides, shard)
    }
}

/// Codecs in scenario files as their text forms (`"fp16"`, `"topk-0.01"`).
mod codec_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::shard::Codec;

    pub fn serialize<S: Serializer>(codec: &Option<Codec>, s: S) -> Result<S::Ok, S::Error> {
        match codec {
            Some(c) => s.serialize_some(&c.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Codec>, D::Error> {
        Option::<String>::deserialize(d)?.map(|t| t.parse().map_err(serde::de::Error::custom)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Scenario, String> {
        let s: Scenario = toml::from_str(text).map_err(|e| e.to_string())?;
        s.check()?;
        Ok(s)
    }

    /// A target is an accuracy to reach or a loss (or perplexity) to get down to, one at a time.
    #[test]
    fn a_target_is_an_accuracy_or_a_loss_or_a_perplexity() {
        use crate::lab::report::{Target, WatchPoint};
        let sc = |extra: &str| parse(&format!("name = \"x\"\nworkers = 2\niterations = 9\n{extra}"));
        assert_eq!(sc("target_accuracy = 0.8").unwrap().target(), Some(Target::Accuracy(0.8)));
        assert_eq!(sc("target_loss = 1.5").unwrap().target(), Some(Target::Loss(1.5)));
        let Some(Target::Loss(l)) = sc("target_perplexity = 20.0").unwrap().target() else { panic!() };
        assert!((l - 20f32.ln()).abs() < 1e-6);
        assert!(sc("target_loss = 1.5\ntarget_accuracy = 0.8").unwrap_err().contains("one of"));
        assert!(sc("target_perplexity = 0.5").unwrap_err().contains("above 1"));
        assert!(sc("target_loss = -1.0").unwrap_err().contains("positive"));
        // Lower is better for a loss, higher for an accuracy.
        let mut point = WatchPoint::of_shards(1.0, &[]);
        (point.accuracy, point.loss) = (Some(0.7), Some(1.4));
        assert!(Target::Loss(1.5).reached(&point) && !Target::Loss(1.3).reached(&point));
        assert!(Target::Accuracy(0.6).reached(&point) && !Target::Accuracy(0.8).reached(&point));
        assert_eq!(sc("").unwrap().stop_rules(), crate::lab::report::StopRules::default());
    }

    #[test]
    fn a_full_scenario_parses_and_unset_keys_take_locals_defaults() {
        let s = parse(
            "name = \"x\"\nworkers = 4\ncompute_ms = 20\ntime_limit_s = 10\nmomentum = 0.5\n\
             [[slow]]\nworker = 0\nfactor = 3.0\n[[jitter]]\nworker = 1\nmean_ms = 30.0\nsd_ms = 10.0\n",
        )
        .unwrap();
        assert_eq!((s.workers, s.servers, s.batch, s.compute_ms), (4, 2, 32, 20));
        assert_eq!(s.slow, [Slow { worker: 0, factor: 3.0, from_s: None, until_s: None }]);
        assert_eq!(s.jitter, [Jitter { worker: 1, mean_ms: 30.0, sd_ms: 10.0, from_s: None, until_s: None }]);
        let o = s.optimizer();
        assert_eq!((o.lr, o.momentum, o.weight_decay), (OptimizerConfig::default().lr, 0.5, 0.0));
        assert_eq!(s.iterations_or_unbounded(), u64::MAX / 4, "the time limit ends the run");
        let w = s.workload_options(Some(Path::new("/data")));
        assert_eq!((w.hidden, w.params, w.seed), (128, 1024, 1));
        assert_eq!(w.data_dir.as_deref(), Some(Path::new("/data")));
        let mut run = RunSpec::new(s, "ssp:s=3".parse().unwrap());
        run.overrides.push((1, "s".into(), "5".into()));
        assert_eq!(run.shards(), 2);
        assert_eq!(run.shard_config(0), [("s".to_string(), "3".to_string())]);
        assert_eq!(run.shard_config(1), [("s".to_string(), "5".to_string())]);
    }

    #[test]
    fn every_shipped_scenario_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue; // traces/: the runs the trace scenarios replay
            }
            let s = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
            if let Some(trace) = &s.trace {
                assert!(trace.is_file(), "{}: its trace {} is shipped", path.display(), trace.display());
            }
            assert_eq!(
                path.file_stem().unwrap().to_str(),
                Some(s.name.as_str()),
                "file name = scenario name"
            );
            n += 1;
        }
        assert!(n >= 9, "{n} scenarios in {}", dir.display());
    }

    #[test]
    fn mistakes_are_named() {
        let e = parse("name = \"x\"\nworkers = 2\niterations = 5\n[[slow]]\nworker = 2\nfactor = 3.0\n")
            .unwrap_err();
        assert!(e.contains("worker 2 does not exist"), "{e}");
        let e = parse("name = \"x\"\nworkers = 2\n").unwrap_err();
        assert!(e.contains("must end"), "{e}");
        let e = parse("name = \"x\"\nworkers = 2\niterations = 5\nspeed = 3\n").unwrap_err();
        assert!(e.contains("unknown field `speed`"), "{e}");
    }

    #[test]
    fn a_failure_drill_needs_a_backup_and_a_real_server() {
        let base = "name = \"d\"\nworkers = 2\nservers = 2\niterations = 5\n";
        assert!(parse(&format!("{base}replicas = 1\n[kill_server]\nserver = 1\nat_s = 2.0\n")).is_ok());
        let err = |extra: &str| parse(&format!("{base}{extra}")).unwrap_err();
        assert!(err("[kill_server]\nserver = 0\nat_s = 1.0\n").contains("needs replicas = 1"));
        assert!(err("replicas = 1\n[kill_server]\nserver = 2\nat_s = 1.0\n").contains("has 2 servers"));
        assert!(err("replicas = 1\n[kill_server]\nserver = 0\nat_s = -1.0\n").contains("0 or more"));
        assert!(err("replicas = 2\n").contains("replicas is 0 or 1"));
        let one = "name = \"d\"\nworkers = 2\nservers = 1\niterations = 5\nreplicas = 1\n";
        assert!(parse(one).unwrap_err().contains("replicas 1 needs at least two servers"));
    }
}
