//! The training loop of `syncopate worker`: pull, compute, push, report, obey the policies'
//! control messages, and leave cleanly.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_distr::Distribution;
use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Control, IterationReport, WorkerId};
use syncopate_workloads::Workload;

use super::client::WorkerClient;
use crate::net::tls::ClusterAccess;
use crate::NodeError;

/// How to run a worker.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// The cluster.
    pub access: ClusterAccess,
    /// The id to ask for (the coordinator assigns one when `None`).
    pub id: Option<WorkerId>,
    /// Train until this iteration (exclusive).
    pub iterations: u64,
    /// Mini-batch size until a policy sets another.
    pub batch: u32,
    /// Seed for the initial parameters.
    pub seed: u64,
    /// Extra time spent per iteration after computing (pacing).
    pub extra_delay: Duration,
    /// Heterogeneity: this worker takes `slow_factor` times as long to compute (1: normal).
    pub slow_factor: f32,
    /// Heterogeneity: a random delay after each iteration, normal with this mean and standard
    /// deviation in milliseconds (FluentPS's injection), drawn from a seeded source.
    pub jitter_ms: Option<(f64, f64)>,
    /// Heterogeneity: stall once, `at` after the start, `for` this long.
    pub stall: Option<(Duration, Duration)>,
    /// Where to write the report (JSON) when done.
    pub report: Option<PathBuf>,
}

/// What a worker did, written as JSON when it finishes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Its id.
    pub worker: WorkerId,
    /// The iteration it started at (late joiners start later).
    pub start: u64,
    /// Iterations it completed (each pushed and admitted).
    pub iterations: u64,
    /// Time spent waiting for pulls, in nanoseconds.
    pub wait_ns: u64,
    /// Pulls that at least one shard deferred.
    pub deferred_pulls: u64,
    /// Time spent computing, in nanoseconds.
    pub compute_ns: u64,
    /// Wall-clock time, in nanoseconds.
    pub elapsed_ns: u64,
    /// Control messages received.
    pub controls: u64,
    /// The last mini-batch's loss.
    pub last_loss: f32,
    /// Bytes sent and received (UDP payloads: QUIC and TLS included).
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Whether it stopped early because the coordinator asked (target or budget reached).
    pub stopped_early: bool,
    /// Per iteration: start (Unix seconds), time waiting on the pull, time busy (compute,
    /// injected delays, push) in seconds.
    pub timeline: Vec<(f64, f32, f32)>,
}

/// Joins the cluster, trains `workload` for the configured iterations, and leaves.
pub async fn run(opts: WorkerOptions, mut workload: Box<dyn Workload>) -> Result<WorkerReport, NodeError> {
    let len = workload.param_len();
    let mut client = WorkerClient::connect(&opts.access, opts.id, len).await?;
    let start = client.join(&workload.init_params(opts.seed)).await?;
    client.ready().await?;
    let worker = client.id();
    let began = Instant::now();
    let mut report = WorkerReport { worker, start, ..WorkerReport::default() };
    let mut params = vec![0f32; len];
    let mut grad = vec![0f32; len];
    let mut batch = opts.batch;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed ^ (u64::from(worker) << 40) ^ 0x5eed);
    let jitter = match opts.jitter_ms {
        Some((mean, sd)) => Some(
            rand_distr::Normal::new(mean, sd)
                .map_err(|e| NodeError::Protocol(format!("bad jitter N({mean}, {sd}): {e}")))?,
        ),
        None => None,
    };
    let mut stall = opts.stall;
    for iteration in start..opts.iterations {
        if client.stop_requested() {
            report.stopped_early = true;
            break;
        }
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let t = Instant::now();
        let stats = client.pull(iteration, &mut params).await?;
        let waited = t.elapsed();
        report.wait_ns += waited.as_nanos() as u64;
        let busy = Instant::now();
        report.deferred_pulls += u64::from(stats.deferred_shards > 0);
        let t = Instant::now();
        let step =
            tokio::task::block_in_place(|| workload.gradient(worker, iteration, batch, &params, &mut grad));
        let compute_ns = t.elapsed().as_nanos() as u64;
        report.compute_ns += compute_ns;
        report.last_loss = step.loss;
        let mut delay = opts.extra_delay;
        if opts.slow_factor > 1.0 {
            delay += Duration::from_nanos(compute_ns).mul_f32(opts.slow_factor - 1.0);
        }
        if let Some(n) = &jitter {
            delay += Duration::from_secs_f64(n.sample(&mut rng).max(0.0) / 1e3);
        }
        if let Some((at, length)) = stall {
            if began.elapsed() >= at {
                tracing::info!(worker, ?length, "stalling, as asked");
                delay += length;
                stall = None;
            }
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        client.push(iteration, &grad, step.samples).await?;
        report.iterations += 1;
        client.finished(IterationReport { worker, iteration, compute_ns, samples: step.samples }).await?;
        report.timeline.push((unix.as_secs_f64(), waited.as_secs_f32(), busy.elapsed().as_secs_f32()));
        while let Some(msg) = client.try_control() {
            report.controls += 1;
            match msg.control {
                Control::Pause { for_ns } => {
                    tracing::debug!(worker, shard = msg.shard, for_ns, "paused by the policy");
                    tokio::time::sleep(Duration::from_nanos(for_ns)).await;
                }
                Control::Resume => {}
                Control::SetBatchSize { samples } if samples > 0 => batch = samples,
                other => tracing::debug!(
                    worker,
                    shard = msg.shard,
                    ?other,
                    "control not acted on by this workload"
                ),
            }
        }
        tracing::debug!(worker, iteration, waited_ms = stats.waited_ns / 1_000_000, "iteration done");
    }
    report.elapsed_ns = began.elapsed().as_nanos() as u64;
    (report.bytes_sent, report.bytes_received) = client.bytes();
    // The report is written before leaving, so a failed goodbye loses no record of the work.
    if let Some(path) = &opts.report {
        let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
        std::fs::write(path, json)
            .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    }
    client.leave().await?;
    Ok(report)
}
