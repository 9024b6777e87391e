//! What runs report, real or simulated: the run report (`report.json`), the watcher's readings
//! and stop rules, and the rows of an A/B comparison. Both drivers of a run (the local cluster
//! and the simulator) fill these types with what they measured, and every reader (plots, `ab`,
//! tests) reads only these.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::lab::scenario::Scenario;
use crate::lab::stats::{Estimate, RankTest, RatioInterval};
use crate::net::proto::{ServerStatus, ShardStatus, WorkerStatus};
use crate::shard::STALENESS_BUCKETS;
use crate::worker::WorkerReport;

/// One look at the cluster during the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WatchPoint {
    /// Seconds since the workers started.
    pub t_s: f64,
    /// Test accuracy of the model read at that moment (workloads with a test set).
    pub accuracy: Option<f32>,
    /// Test loss.
    pub loss: Option<f32>,
    /// Slowest and fastest worker's clock on shard 0.
    pub min_clock: u64,
    /// The fastest worker's clock.
    pub max_clock: u64,
    /// Pulls deferred so far, all shards.
    pub pulls_deferred: u64,
    /// Time pulls spent deferred so far, all shards, in seconds.
    pub deferred_s: f64,
    /// Per live worker: seconds its pulls have spent deferred so far (the longest of any
    /// shard), the same quantity as [`WorkerReport::deferred_ns`].
    pub worker_waits_s: Vec<(u32, f64)>,
    /// The policy running on shard 0 (name and version): a change marks a hot swap.
    #[serde(default)]
    pub policy: String,
    /// Iterations the workers have pushed so far, as shard 0 counts them (admitted or dropped).
    #[serde(default)]
    pub iterations: u64,
    /// The policy's metrics: each name's last value, averaged over the shards that record it.
    #[serde(default)]
    pub metrics: Vec<(String, f64)>,
    /// Servers lost and failed over so far.
    #[serde(default)]
    pub lost_servers: Vec<u32>,
    /// Why the last checkpoint round was not taken (a full disk, say), if it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
    /// Pushes a policy held so far, all shards.
    #[serde(default)]
    pub pushes_held: u64,
    /// Pushes held now, all shards, and the longest any has been held, in seconds: a holding
    /// policy's waiting, as deferred pulls are a gating one's.
    #[serde(default)]
    pub held_now: u64,
    /// See [`held_now`](Self::held_now).
    #[serde(default)]
    pub held_longest_s: f64,
    /// Mean staleness of the pushes admitted so far, all shards ([`staleness_mean`]).
    #[serde(default)]
    pub staleness_mean: Option<f64>,
    /// Bytes the servers sent and received so far, all of them (a cluster's UDP payloads; the
    /// simulator's modelled traffic).
    #[serde(default)]
    pub server_bytes: u64,
}

/// The mean staleness of the pushes `shards` admitted so far (the last bucket counted at its
/// floor), if they admitted any.
pub fn staleness_mean<'a>(shards: impl IntoIterator<Item = &'a ShardStatus>) -> Option<f64> {
    let (mut n, mut sum) = (0u64, 0u64);
    for s in shards {
        for (k, c) in s.stats.staleness.iter().enumerate() {
            n += c;
            sum += c * k as u64;
        }
    }
    (n > 0).then(|| sum as f64 / n as f64)
}

/// A stretch of a run under one policy: between hot swaps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// The policy (name and version).
    pub policy: String,
    /// When it began (seconds; the first reading that showed it, so within one watch interval
    /// of the swap).
    pub from_s: f64,
    /// When it ended.
    pub to_s: f64,
    /// Iterations all workers pushed per second.
    pub iterations_per_s: f64,
    /// Pulls deferred during the phase.
    pub deferred_pulls: u64,
    /// Seconds pulls spent deferred during it, all shards.
    pub deferred_s: f64,
}

impl WatchPoint {
    /// What the shards' counters say at `t_s` (accuracy and loss not yet scored): the one
    /// reading of a cluster's progress, for real runs and simulated ones alike.
    pub fn of_shards(t_s: f64, shards: &[&ShardStatus]) -> Self {
        let clocks: Vec<u64> = shards
            .iter()
            .find(|s| s.shard == 0)
            .map(|s| s.workers.iter().map(|w| w.clock).collect())
            .unwrap_or_default();
        let mut waits = std::collections::BTreeMap::<u32, u64>::new();
        for (w, ns) in shards.iter().flat_map(|s| &s.waited_ns) {
            let e = waits.entry(*w).or_default();
            *e = (*e).max(*ns);
        }
        let first = shards.iter().find(|s| s.shard == 0);
        let mut metrics: Vec<(String, f64, u32)> = Vec::new();
        for m in shards.iter().flat_map(|s| &s.metrics) {
            match metrics.iter_mut().find(|x| x.0 == m.name) {
                Some(x) => (x.1, x.2) = (x.1 + m.last, x.2 + 1),
                None => metrics.push((m.name.clone(), m.last, 1)),
            }
        }
        WatchPoint {
            t_s,
            accuracy: None,
            loss: None,
            min_clock: clocks.iter().copied().min().unwrap_or(0),
            max_clock: clocks.iter().copied().max().unwrap_or(0),
            pulls_deferred: shards.iter().map(|s| s.stats.pulls_deferred).sum(),
            deferred_s: shards.iter().map(|s| s.stats.deferred_ns).sum::<u64>() as f64 / 1e9,
            worker_waits_s: waits.into_iter().map(|(w, ns)| (w, ns as f64 / 1e9)).collect(),
            policy: first.map(|s| s.policy.clone()).unwrap_or_default(),
            iterations: first.map_or(0, |s| s.stats.pushes_admitted + s.stats.pushes_dropped),
            metrics: metrics.into_iter().map(|(n, sum, k)| (n, sum / f64::from(k))).collect(),
            lost_servers: Vec::new(),
            checkpoint_error: None,
            pushes_held: shards.iter().map(|s| s.stats.pushes_held).sum(),
            held_now: shards.iter().map(|s| u64::from(s.held)).sum(),
            held_longest_s: shards.iter().filter_map(|s| s.held_longest).map(|h| h.held_ns).max().unwrap_or(0)
                as f64
                / 1e9,
            staleness_mean: staleness_mean(shards.iter().copied()),
            server_bytes: 0,
        }
    }
}

/// The rates between two readings ([`WatchPoint::rates_since`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Iterations all workers pushed per second.
    pub iterations_per_s: f64,
    /// The share of the live workers' time spent in deferred pulls.
    pub waiting_share: f64,
    /// Bytes the servers sent and received per second.
    pub server_bytes_per_s: f64,
}

impl WatchPoint {
    /// The rates between `prev` and this reading (`None` if no time passed).
    pub fn rates_since(&self, prev: &WatchPoint) -> Option<Rates> {
        let dt = self.t_s - prev.t_s;
        if dt <= 0.0 {
            return None;
        }
        let iterations = self.iterations.saturating_sub(prev.iterations) as f64;
        let waited: f64 = self.worker_waits_s.iter().map(|w| w.1).sum::<f64>()
            - prev.worker_waits_s.iter().map(|w| w.1).sum::<f64>();
        let workers = self.worker_waits_s.len().max(1) as f64;
        Some(Rates {
            iterations_per_s: iterations / dt,
            waiting_share: waited.max(0.0) / (dt * workers),
            server_bytes_per_s: self.server_bytes.saturating_sub(prev.server_bytes) as f64 / dt,
        })
    }
}

/// A server lost and failed over during a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failover {
    /// When the watcher first saw it failed over (seconds since the workers started).
    pub t_s: f64,
    /// The server.
    pub server: u32,
}

/// The failovers the watcher saw, each at its first reading that shows the server lost.
pub fn failovers(watch: &[WatchPoint]) -> Vec<Failover> {
    let mut out: Vec<Failover> = Vec::new();
    for p in watch {
        for &server in &p.lost_servers {
            if !out.iter().any(|f| f.server == server) {
                out.push(Failover { t_s: p.t_s, server });
            }
        }
    }
    out
}

/// The run's phases, one per policy between hot swaps, from the watcher's readings.
pub fn phases(watch: &[WatchPoint]) -> Vec<Phase> {
    // Readings taken before any shard existed name no policy.
    let watch: Vec<&WatchPoint> = watch.iter().filter(|p| !p.policy.is_empty()).collect();
    let mut out: Vec<Phase> = Vec::new();
    let mut start: Option<&WatchPoint> = None;
    for (i, p) in watch.iter().copied().enumerate() {
        let s = *start.get_or_insert(p);
        let last = i + 1 == watch.len();
        let next_differs = watch.get(i + 1).is_some_and(|n| n.policy != p.policy);
        if last || next_differs {
            // A phase ends where the next begins, so no iteration falls between two phases.
            let end = if next_differs { watch[i + 1] } else { p };
            let span = (end.t_s - s.t_s).max(1e-9);
            out.push(Phase {
                policy: p.policy.clone(),
                from_s: s.t_s,
                to_s: end.t_s,
                iterations_per_s: end.iterations.saturating_sub(s.iterations) as f64 / span,
                deferred_pulls: end.pulls_deferred.saturating_sub(s.pulls_deferred),
                deferred_s: (end.deferred_s - s.deferred_s).max(0.0),
            });
            start = if next_differs { Some(end) } else { None };
        }
    }
    out
}

/// What `report.json` holds: one run, on a real cluster or in the simulator. Every field means
/// the same in both, and neither fills in a value it does not have.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    /// Whether the run was simulated (times are then virtual).
    pub simulated: bool,
    /// The model whose wire costs the simulator charged instead of the workload's, if any
    /// (scenario key `modelled`): the gradients and accuracy are still the workload's.
    #[serde(default)]
    pub modelled: Option<String>,
    /// Seconds from start to the model being read (virtual seconds when simulated).
    pub elapsed_s: f64,
    /// Reports of the workers that finished.
    pub workers: Vec<WorkerReport>,
    /// Workers that did not finish, with how they ended.
    pub failed_workers: Vec<(u32, String)>,
    /// The policy running at the end (name and version).
    pub policy: String,
    /// SHA-256 of its module, hex.
    pub sha256: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Hot swaps during the run.
    pub swaps: u64,
    /// Each server's shards at the end (policy, clocks, counters) and its traffic.
    pub servers: Vec<ServerRecord>,
    /// Every worker the cluster knew, and how it ended (connected, finished cleanly).
    pub members: Vec<WorkerStatus>,
    /// Parameters in the model.
    pub model_len: usize,
    /// The fewest optimizer steps of any shard.
    pub model_version: u64,
    /// Where the final model was saved (little-endian `f32`), once it is.
    pub model_file: Option<PathBuf>,
    /// When the workers started (Unix seconds; 0 when simulated), the origin of every time in
    /// this report.
    pub started_unix_s: f64,
    /// What the watcher saw, in order.
    pub watch: Vec<WatchPoint>,
    /// Test accuracy of the final model.
    pub final_accuracy: Option<f32>,
    /// The best test accuracy the watcher saw; that model is saved as `model-best.bin` (unless
    /// the target is a loss: then the model of the lowest loss is).
    pub best_accuracy: Option<f32>,
    /// Held-out loss of the final model.
    #[serde(default)]
    pub final_loss: Option<f32>,
    /// The lowest held-out loss the watcher saw.
    #[serde(default)]
    pub best_loss: Option<f32>,
    /// Seconds until the model first scored at the target.
    pub time_to_target_s: Option<f64>,
    /// Admitted pushes by staleness (optimizer steps between the pull a gradient was computed
    /// from and its admission), summed over shards; the last bucket holds 15 or more.
    pub staleness: Vec<u64>,
    /// The plots written next to the report.
    pub plots: Vec<PathBuf>,
    /// The run's phases under each policy, between hot swaps (one phase without swaps).
    #[serde(default)]
    pub phases: Vec<Phase>,
    /// Servers lost and failed over, when the watcher saw it.
    #[serde(default)]
    pub failovers: Vec<Failover>,
    /// When the coordinator died and was started again (seconds from the start; `local` only).
    #[serde(default)]
    pub coordinator_restarts: Vec<f64>,
    /// The cluster policy at the end (the autopilot), with its log of swaps, if one ran.
    #[serde(default)]
    pub pilot: Option<syncopate_engine::pilot::PilotStatus>,
}

/// One server at the end of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerRecord {
    /// Its id.
    pub server: u32,
    /// Its shards.
    pub shards: Vec<ShardStatus>,
    /// Bytes it sent to workers (on a cluster: UDP payloads, QUIC and TLS included).
    pub bytes_sent: u64,
    /// Bytes it received.
    pub bytes_received: u64,
    /// Tensor payload bytes by codec family (real clusters; reports before them have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub payload_bytes: Vec<crate::net::proto::CodecBytes>,
}

impl RunReport {
    /// Every shard, in server order.
    pub fn shards(&self) -> impl Iterator<Item = &ShardStatus> {
        self.servers.iter().flat_map(|s| &s.shards)
    }

    /// Admitted pushes by staleness, summed over `shards`.
    pub fn staleness_of<'a>(shards: impl Iterator<Item = &'a ShardStatus> + Clone) -> Vec<u64> {
        (0..STALENESS_BUCKETS).map(|b| shards.clone().map(|s| s.stats.staleness[b]).sum()).collect()
    }
}

impl From<ServerStatus> for ServerRecord {
    fn from(s: ServerStatus) -> Self {
        ServerRecord {
            server: s.server,
            shards: s.shards,
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
            payload_bytes: s.payload_bytes,
        }
    }
}

/// What a run aims at: a test accuracy to reach (higher is better) or a validation loss to get
/// down to (lower is better; a perplexity target is the loss `ln(perplexity)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// Test accuracy (0-1) at least this.
    Accuracy(f32),
    /// Held-out loss (nats per sample or per byte) at most this.
    Loss(f32),
}

impl Target {
    /// Whether `point` scores at the target or better.
    pub fn reached(&self, point: &WatchPoint) -> bool {
        match *self {
            Target::Accuracy(t) => point.accuracy.is_some_and(|a| a >= t),
            Target::Loss(t) => point.loss.is_some_and(|l| l <= t),
        }
    }

    /// A short label for tables and plots: `80%` or `loss 1.50`.
    pub fn label(&self) -> String {
        match *self {
            Target::Accuracy(a) => format!("{:.0}%", a * 100.0),
            Target::Loss(l) => format!("loss {l:.2}"),
        }
    }

    /// In words: `test accuracy 80.0%`, `validation loss 1.500 (perplexity 4.48)`.
    pub fn describe(&self) -> String {
        match *self {
            Target::Accuracy(a) => format!("test accuracy {:.1}%", a * 100.0),
            Target::Loss(l) => format!("validation loss {l:.3} (perplexity {:.2})", l.exp()),
        }
    }
}

/// When a run stops: once the model scores at the target, or the time limit has passed. The
/// watcher of a real run and the simulator apply the same rules.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StopRules {
    /// Stop once the model scores at this.
    pub target: Option<Target>,
    /// Stop after this many seconds.
    pub time_limit_s: Option<f64>,
}

impl StopRules {
    /// Whether `point` reaches the target.
    pub fn reached(&self, point: &WatchPoint) -> bool {
        self.target.is_some_and(|t| t.reached(point))
    }

    /// Whether a run at `t_s` seconds, with the target reached or not, should stop.
    pub fn should_stop(&self, t_s: f64, target_reached: bool) -> bool {
        target_reached || self.time_limit_s.is_some_and(|l| t_s >= l)
    }
}

/// One run's row of the comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AbRow {
    /// The policy, as given.
    pub policy: String,
    /// The seed the run used (the scenario's seed plus the repeat's index).
    #[serde(default)]
    pub seed: u64,
    /// Wall-clock seconds of the run.
    pub elapsed_s: f64,
    /// Seconds until test accuracy first reached the target.
    pub time_to_target_s: Option<f64>,
    /// Test accuracy of the final model.
    pub final_accuracy: Option<f32>,
    /// The best test accuracy the watcher saw.
    pub best_accuracy: Option<f32>,
    /// Held-out loss of the final model.
    #[serde(default)]
    pub final_loss: Option<f32>,
    /// The lowest held-out loss the watcher saw.
    #[serde(default)]
    pub best_loss: Option<f32>,
    /// Iterations per second, mean over workers.
    pub iterations_per_s: f64,
    /// Gradients computed per second (an iteration of `H` local steps counts `H`), mean over
    /// workers.
    #[serde(default)]
    pub steps_per_s: f64,
    /// Seconds each worker spent waiting, mean over workers: for pulls (a gating policy's
    /// deferral, and the transfer) and for its pushes' acknowledgements (a holding policy's
    /// holds, and the transfer).
    pub wait_s: f64,
    /// Of that, the seconds waiting for acknowledgements.
    #[serde(default)]
    pub push_wait_s: f64,
    /// The share of the run workers spent waiting, pulls and acknowledgements, mean over
    /// workers (0-1).
    pub wait_share: f64,
    /// Pulls any shard deferred, all workers.
    pub deferred_pulls: u64,
    /// Iterations all workers completed (runs that stop at a target differ in length: compare
    /// deferred pulls per iteration).
    pub iterations: u64,
    /// Bytes the workers sent and received.
    pub bytes_moved: u64,
    /// Of those, the bytes the workers sent (their pushes, in the codecs they pushed in).
    #[serde(default)]
    pub bytes_pushed: u64,
    /// Gradients all workers computed (an iteration of `H` local steps counts `H`).
    #[serde(default)]
    pub steps: u64,
    /// Mean staleness of the applied gradients (optimizer steps between pull and admission).
    pub mean_staleness: f64,
    /// Tasks moved from one worker to another.
    pub tasks_moved: u64,
    /// Where the run's own report is.
    pub run_dir: PathBuf,
}

/// What `comparison.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Comparison {
    /// The scenario as run (its seed is the first run's).
    pub scenario: Scenario,
    /// One row per run, in the order run.
    pub rows: Vec<AbRow>,
    /// Runs per policy.
    #[serde(default = "one")]
    pub repeat: u32,
    /// The policy every other is judged against.
    #[serde(default)]
    pub baseline: Option<String>,
    /// Per policy, the median and confidence interval of every figure over its runs.
    #[serde(default)]
    pub summaries: Vec<PolicySummary>,
    /// Every other policy against the baseline, figure by figure.
    #[serde(default)]
    pub verdicts: Vec<Verdict>,
    /// The written files.
    pub files: Vec<PathBuf>,
}

fn one() -> u32 {
    1
}

/// One policy's figures over its runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicySummary {
    /// The policy, as given.
    pub policy: String,
    /// Its runs' seeds.
    pub seeds: Vec<u64>,
    /// `(figure, estimate)` for every figure the runs have ([`FIGURES`] keys).
    pub figures: Vec<(String, Estimate)>,
}

impl PolicySummary {
    /// The estimate of figure `key`, if the runs have it.
    pub fn figure(&self, key: &str) -> Option<&Estimate> {
        self.figures.iter().find(|(k, _)| k == key).map(|(_, e)| e)
    }
}

/// One policy against the baseline on one figure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The policy judged.
    pub policy: String,
    /// The baseline.
    pub baseline: String,
    /// The figure ([`FIGURES`] key).
    pub figure: String,
    /// The policy's median over the baseline's (`None` where either is infinite or zero).
    pub ratio: Option<f64>,
    /// The distribution-free interval for the factor between the policy's runs and the
    /// baseline's ([`crate::lab::stats::ratio_interval`]); `None` where a run is infinite or
    /// zero. Absent in comparisons written before 2026-11-28.
    #[serde(default)]
    pub ratio_interval: Option<RatioInterval>,
    /// The rank test of the policy's runs against the baseline's.
    pub test: RankTest,
    /// `better`, `worse` or `same` (no detectable difference at [`crate::lab::stats::ALPHA`]).
    pub outcome: Outcome,
    /// The outcome in words, with the p-value: `sooner (p = 0.008)`.
    pub text: String,
}

/// What a verdict found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Significantly better than the baseline.
    Better,
    /// Significantly worse.
    Worse,
    /// No detectable difference.
    Same,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be read.
    #[error("trace {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What happened.
        source: std::io::Error,
    },
    /// It is not a run's report.
    #[error("trace {path}: not a run's report.json: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl RunReport {
    /// Each worker's measured compute time per iteration, in nanoseconds, in worker order:
    /// of each iteration's busy time (compute, injected delays, the push), all but the time
    /// its push waited for acknowledgements. A device model for the simulator
    /// ([`Scenario::trace`](crate::lab::scenario::Scenario::trace)).
    pub fn compute_trace(&self) -> Vec<Vec<u64>> {
        let mut workers: Vec<&WorkerReport> = self.workers.iter().collect();
        workers.sort_by_key(|w| w.worker);
        workers
            .iter()
            .map(|w| {
                let acks = |i: usize| f64::from(w.timeline_acks.get(i).copied().unwrap_or(0.0));
                let busy = w.timeline.iter().enumerate().map(|(i, &(_, _, busy))| f64::from(busy) - acks(i));
                busy.map(|s| (s.max(0.0) * 1e9).round() as u64).collect()
            })
            .filter(|t: &Vec<u64>| !t.is_empty())
            .collect()
    }

    /// The compute traces of the report at `path` ([`compute_trace`](Self::compute_trace)).
    pub fn load_trace(path: &std::path::Path) -> Result<Vec<Vec<u64>>, TraceError> {
        let text = std::fs::read(path).map_err(|source| TraceError::Read { path: path.into(), source })?;
        let invalid = |reason: String| TraceError::Invalid { path: path.into(), reason };
        let report: RunReport = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        let trace = report.compute_trace();
        if trace.is_empty() {
            return Err(invalid("no worker has a timeline of iterations".into()));
        }
        Ok(trace)
    }
}

impl AbRow {
    /// The row summarizing run report `r`, whose files are in `run_dir`.
    pub fn from_report(policy: String, r: &RunReport, run_dir: PathBuf) -> Self {
        let n = r.workers.len().max(1) as f64;
        let mean = |f: &dyn Fn(&crate::worker::WorkerReport) -> f64| r.workers.iter().map(f).sum::<f64>() / n;
        let stale_n: u64 = r.staleness.iter().sum();
        let stale_sum: u64 = r.staleness.iter().enumerate().map(|(i, c)| i as u64 * c).sum();
        AbRow {
            policy,
            seed: 0,
            elapsed_s: r.elapsed_s,
            time_to_target_s: r.time_to_target_s,
            final_accuracy: r.final_accuracy,
            best_accuracy: r.best_accuracy,
            final_loss: r.final_loss,
            best_loss: r.best_loss,
            iterations_per_s: mean(&|w| w.iterations as f64 / (w.elapsed_ns.max(1) as f64 / 1e9)),
            steps_per_s: mean(&|w| w.steps as f64 / (w.elapsed_ns.max(1) as f64 / 1e9)),
            wait_s: mean(&|w| (w.wait_ns + w.push_wait_ns) as f64 / 1e9),
            push_wait_s: mean(&|w| w.push_wait_ns as f64 / 1e9),
            wait_share: mean(&|w| (w.wait_ns + w.push_wait_ns) as f64 / w.elapsed_ns.max(1) as f64),
            deferred_pulls: r.workers.iter().map(|w| w.deferred_pulls).sum(),
            iterations: r.workers.iter().map(|w| w.iterations).sum(),
            bytes_moved: r.workers.iter().map(|w| w.bytes_sent + w.bytes_received).sum(),
            bytes_pushed: r.workers.iter().map(|w| w.bytes_sent).sum(),
            steps: r.workers.iter().map(|w| w.steps).sum(),
            mean_staleness: if stale_n == 0 { 0.0 } else { stale_sum as f64 / stale_n as f64 },
            tasks_moved: r.workers.iter().map(|w| w.tasks_given).sum(),
            run_dir,
        }
    }
}

/// One figure of a comparison: how to read it from a run's row and which way is better.
#[derive(Clone, Copy, Debug)]
pub struct Figure {
    /// Its key in `comparison.json`.
    pub key: &'static str,
    /// Its column heading.
    pub label: &'static str,
    /// Whether lower values are better (`None`: neither is, e.g. bytes moved).
    pub lower_is_better: Option<bool>,
    /// Words for a significantly lower and a significantly higher value.
    pub words: (&'static str, &'static str),
    /// Its value in a run (`None`: the run does not have it; infinity: the target not reached).
    pub get: fn(&AbRow) -> Option<f64>,
    /// How to print a value.
    pub unit: Unit,
}

/// How a figure prints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unit {
    /// Seconds, one decimal.
    Seconds,
    /// A 0-1 share as a percentage, one decimal.
    Percent,
    /// A plain number with this many decimals.
    Plain(usize),
}

/// Every figure `ab` reports, in table order.
pub const FIGURES: &[Figure] = &[
    Figure {
        key: "time_to_target_s",
        label: "time to target",
        lower_is_better: Some(true),
        words: ("sooner", "later"),
        get: |r| Some(r.time_to_target_s.unwrap_or(f64::INFINITY)),
        unit: Unit::Seconds,
    },
    Figure {
        key: "steps_to_target",
        label: "steps to target",
        lower_is_better: Some(true),
        words: ("fewer steps to target", "more steps to target"),
        get: |r| Some(if r.time_to_target_s.is_some() { r.steps as f64 } else { f64::INFINITY }),
        unit: Unit::Plain(0),
    },
    Figure {
        key: "mb_to_target",
        label: "MB to target",
        lower_is_better: Some(true),
        words: ("fewer bytes to target", "more bytes to target"),
        get: |r| Some(if r.time_to_target_s.is_some() { r.bytes_moved as f64 / 1e6 } else { f64::INFINITY }),
        unit: Unit::Plain(0),
    },
    Figure {
        key: "best_accuracy",
        label: "best acc",
        lower_is_better: Some(false),
        words: ("less accurate", "more accurate"),
        get: |r| r.best_accuracy.map(f64::from),
        unit: Unit::Percent,
    },
    Figure {
        key: "final_accuracy",
        label: "final acc",
        lower_is_better: Some(false),
        words: ("less accurate", "more accurate"),
        get: |r| r.final_accuracy.map(f64::from),
        unit: Unit::Percent,
    },
    Figure {
        key: "best_loss",
        label: "best loss",
        lower_is_better: Some(true),
        words: ("lower loss", "higher loss"),
        get: |r| r.best_loss.map(f64::from),
        unit: Unit::Plain(3),
    },
    Figure {
        key: "final_loss",
        label: "final loss",
        lower_is_better: Some(true),
        words: ("lower loss", "higher loss"),
        get: |r| r.final_loss.map(f64::from),
        unit: Unit::Plain(3),
    },
    Figure {
        key: "iterations_per_s",
        label: "it/s per worker",
        lower_is_better: Some(false),
        words: ("slower iterations", "faster iterations"),
        get: |r| Some(r.iterations_per_s),
        unit: Unit::Plain(1),
    },
    Figure {
        key: "steps_per_s",
        label: "steps/s per worker",
        lower_is_better: Some(false),
        words: ("fewer steps", "more steps"),
        get: |r| Some(r.steps_per_s),
        unit: Unit::Plain(1),
    },
    Figure {
        key: "wait_share",
        label: "wait share",
        lower_is_better: Some(true),
        words: ("less waiting", "more waiting"),
        get: |r| Some(r.wait_share),
        unit: Unit::Percent,
    },
    Figure {
        key: "deferred_per_100_iterations",
        label: "deferred pulls per 100 it",
        lower_is_better: Some(true),
        words: ("fewer deferrals", "more deferrals"),
        get: |r| Some(r.deferred_pulls as f64 * 100.0 / r.iterations.max(1) as f64),
        unit: Unit::Plain(1),
    },
    Figure {
        key: "mb_moved",
        label: "MB moved",
        lower_is_better: None,
        words: ("fewer bytes", "more bytes"),
        get: |r| Some(r.bytes_moved as f64 / 1e6),
        unit: Unit::Plain(0),
    },
    Figure {
        key: "kb_per_step",
        label: "KB moved per step",
        lower_is_better: None,
        words: ("fewer bytes", "more bytes"),
        get: |r| (r.steps > 0).then(|| r.bytes_moved as f64 / 1e3 / r.steps as f64),
        unit: Unit::Plain(1),
    },
    Figure {
        key: "kb_pushed_per_step",
        label: "KB pushed per step",
        lower_is_better: None,
        words: ("fewer bytes", "more bytes"),
        get: |r| (r.steps > 0).then(|| r.bytes_pushed as f64 / 1e3 / r.steps as f64),
        unit: Unit::Plain(1),
    },
    Figure {
        key: "mean_staleness",
        label: "mean staleness",
        lower_is_better: None,
        words: ("less stale", "more stale"),
        get: |r| Some(r.mean_staleness),
        unit: Unit::Plain(2),
    },
    Figure {
        key: "tasks_moved",
        label: "tasks moved",
        lower_is_better: None,
        words: ("fewer moves", "more moves"),
        get: |r| Some(r.tasks_moved as f64),
        unit: Unit::Plain(0),
    },
];

impl Unit {
    /// A value as a table prints it (`None`: the run did not reach it).
    pub fn show(self, v: Option<f64>) -> String {
        match (self, v) {
            (_, None) => "not reached".into(),
            (Unit::Seconds, Some(v)) => format!("{v:.1} s"),
            (Unit::Percent, Some(v)) => format!("{:.1}%", v * 100.0),
            (Unit::Plain(d), Some(v)) => format!("{v:.d$}"),
        }
    }
}
