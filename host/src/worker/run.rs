//! The training loop of `syncopate worker`: pull, compute, push, report, obey the policies'
//! control messages, and leave cleanly.

use std::path::PathBuf;
use std::time::{Duration, Instant};

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
    /// Extra time spent per iteration after computing (pacing, or a simulated slow worker).
    pub extra_delay: Duration,
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
    for iteration in start..opts.iterations {
        let t = Instant::now();
        let stats = client.pull(iteration, &mut params).await?;
        report.wait_ns += t.elapsed().as_nanos() as u64;
        report.deferred_pulls += u64::from(stats.deferred_shards > 0);
        let t = Instant::now();
        let step =
            tokio::task::block_in_place(|| workload.gradient(worker, iteration, batch, &params, &mut grad));
        let compute_ns = t.elapsed().as_nanos() as u64;
        report.compute_ns += compute_ns;
        report.last_loss = step.loss;
        if !opts.extra_delay.is_zero() {
            tokio::time::sleep(opts.extra_delay).await;
        }
        client.push(iteration, &grad, step.samples).await?;
        report.iterations += 1;
        client.finished(IterationReport { worker, iteration, compute_ns, samples: step.samples }).await?;
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
    client.leave().await?;
    if let Some(path) = &opts.report {
        let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
        std::fs::write(path, json)
            .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    }
    Ok(report)
}
