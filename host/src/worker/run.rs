//! `syncopate worker`: the tokio driver of the engine's [`WorkerMachine`]. The machine decides
//! everything a worker does (pull, compute, push, report, control messages, task hand-overs, the
//! emulated device); this loop carries its actions out over QUIC with a [`WorkerClient`], runs
//! the workload, keeps time, and feeds the outcomes back. The simulator drives the same machine
//! in virtual time, so both mean the same by every number in a [`WorkerReport`].
//!
//! Pulls and the worker's own pushes are in flight while the loop goes on, so control messages
//! are handled while they wait (a worker a policy holds back can still be given tasks); control
//! messages already waiting are handed to the machine before each step, so a hand-over sees
//! exactly the tasks not yet started.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::future::LocalBoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use syncopate_engine::worker::{
    Action, Buffers, Device, Input, JobKind, PushFailed, PushJob, WorkerConfig, WorkerMachine, WorkerReport,
};
use syncopate_policy_sdk::abi::WorkerId;
use syncopate_workloads::Workload;

use super::client::{PullStats, WorkerClient};
use super::clock::Clock;
use crate::net::tls::ClusterAccess;
use crate::net::NetError;
use crate::shard::OptimizerConfig;
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
    /// This worker's data partition (what moved tasks of its iterations are computed on).
    pub part: u32,
    /// Seed for the initial parameters.
    pub seed: u64,
    /// Extra compute time per iteration of `batch` samples (pacing; proportional to the samples
    /// actually computed, and stretched by `slow_factor`, as a slower device would be).
    pub extra_delay: Duration,
    /// Heterogeneity: this worker takes `slow_factor` times as long to compute, pacing included
    /// (1: normal).
    pub slow_factor: f32,
    /// When the slowdown applies (nanoseconds after the worker started; `None`: always).
    pub slow_during: Option<(u64, u64)>,
    /// Heterogeneity: a random delay after each iteration, normal with this mean and standard
    /// deviation in milliseconds (FluentPS's injection), drawn from a seeded source.
    pub jitter_ms: Option<(f64, f64)>,
    /// When the jitter applies (as `slow_during`).
    pub jitter_during: Option<(u64, u64)>,
    /// Heterogeneity: stall once, `at` after the start, `for` this long.
    pub stall: Option<(Duration, Duration)>,
    /// Where to write the report (JSON) when done.
    pub report: Option<PathBuf>,
    /// Momentum and weight decay to run here, on this worker's own gradients (the optimizer
    /// placed on the workers; the learning rate stays the servers'). `None`: push raw gradients.
    pub optimizer: Option<OptimizerConfig>,
}

/// A request in flight, with the buffer it borrowed.
enum Done {
    Pulled(Result<PullStats, NodeError>, Vec<f32>),
    /// The push, its result, and the gradient buffer when the push borrowed it (a part).
    Pushed(PushJob, Result<u32, NodeError>, Option<Vec<f32>>),
}

impl WorkerOptions {
    /// The machine's configuration for worker `id`, starting at iteration `start`.
    pub(crate) fn config(
        &self,
        id: WorkerId,
        start: u64,
        can_split: bool,
        numbering_shared: bool,
    ) -> WorkerConfig {
        WorkerConfig {
            id,
            start,
            iterations: self.iterations,
            batch: self.batch,
            part: self.part,
            can_split,
            numbering_shared,
            device: self.device(id),
            tokens_per_sample: 0,
        }
    }

    /// The emulated device these options describe, for worker `id`.
    fn device(&self, id: WorkerId) -> Device {
        Device {
            compute_ns: self.extra_delay.as_nanos() as u64,
            trace_ns: None,
            slow_factor: self.slow_factor,
            slow_during: self.slow_during,
            jitter_ms: self.jitter_ms,
            jitter_during: self.jitter_during,
            stall_ns: self.stall.map(|(at, length)| (at.as_nanos() as u64, length.as_nanos() as u64)),
            seed: self.seed ^ (u64::from(id) << 40) ^ 0x5eed,
            // Timers have about a millisecond's resolution: shorter waits are owed and paid
            // together, and an overslept wait is credited against the next.
            granularity_ns: 2_000_000,
        }
    }
}

/// Joins the cluster, trains `workload` for the configured iterations, and leaves.
pub async fn run(opts: WorkerOptions, workload: Box<dyn Workload>) -> Result<WorkerReport, NodeError> {
    let len = workload.param_len();
    let mut client = WorkerClient::connect(&opts.access, opts.id, len).await?;
    let start = client.join(&workload.init_params(opts.seed)).await?;
    client.ready().await?;
    let mut controls = client.take_controls();
    let id = client.id();
    let mut workload = workload;
    let (mut bufs, can_split) = Buffers::for_workload(Some(workload.as_mut()), opts.part);
    if let Some(o) = opts.optimizer {
        bufs.place_optimizer(o);
    }
    // Local steps take the cluster's whole optimizer: the servers' learning rate, with the
    // momentum and decay placed here if they run here.
    let server = client.server_optimizer();
    bufs.set_inner_optimizer(opts.optimizer.map_or(server, |o| OptimizerConfig { lr: server.lr, ..o }));
    let cfg = WorkerConfig {
        tokens_per_sample: workload.tokens_per_sample(),
        ..opts.config(id, start, can_split, client.numbering_shared())
    };
    let clock = Clock::new();
    let mut m = WorkerMachine::new(cfg, clock.now())?;
    let client_ref = &client;
    let mut inflight: FuturesUnordered<LocalBoxFuture<'_, Done>> = FuturesUnordered::new();
    let mut stop_seen = false;
    loop {
        if !stop_seen && client_ref.stop_requested() {
            stop_seen = true;
            m.handle(clock.now(), Input::Stop)?;
        }
        while let Ok(msg) = controls.try_recv() {
            m.handle(clock.now(), Input::Control(msg))?;
        }
        if let Some(action) = m.poll_action(clock.now()) {
            match action {
                Action::Pull { iteration } => {
                    let mut params = std::mem::take(&mut bufs.params);
                    inflight.push(Box::pin(async move {
                        let r = client_ref.pull(iteration, &mut params).await;
                        Done::Pulled(r, params)
                    }));
                }
                Action::Compute(job) => {
                    let t = Instant::now();
                    let step =
                        tokio::task::block_in_place(|| bufs.compute(id, &job, Some(workload.as_mut())));
                    let compute_ns = t.elapsed().as_nanos() as u64;
                    m.handle(clock.now(), Input::Computed { step, compute_ns })?;
                }
                Action::Push(job) if job.kind == JobKind::Own => {
                    // Makes a split iteration's sum its mean; the push then owns the buffer.
                    bufs.gradient(&job);
                    // A whole iteration's gradient goes to QUIC without a copy, and the next is
                    // computed into a buffer the client's pool hands back from an earlier push
                    // (every workload writes the whole gradient). A part is copied.
                    let grad = match job.tasks {
                        None => std::mem::replace(&mut bufs.grad, client_ref.gradient_buffer()),
                        Some(_) => std::mem::take(&mut bufs.grad),
                    };
                    inflight.push(Box::pin(async move {
                        let (iteration, samples) = (job.iteration, job.samples);
                        match job.tasks {
                            None => {
                                let r = client_ref
                                    .push_local(iteration, grad, samples, job.local_steps, job.signals)
                                    .await;
                                Done::Pushed(job, r, None)
                            }
                            Some(t) => {
                                let r = client_ref
                                    .push_tasks(job.owner, iteration, t.mask, t.total, &grad, samples)
                                    .await;
                                Done::Pushed(job, r, Some(grad))
                            }
                        }
                    }));
                }
                Action::Push(job) => {
                    let t = job.tasks.expect("moved tasks are pushed as tasks");
                    let grad = bufs.gradient(&job);
                    let r = client_ref
                        .push_tasks(job.owner, job.iteration, t.mask, t.total, grad, job.samples)
                        .await;
                    if r.is_ok() {
                        tracing::debug!(
                            worker = id,
                            from = job.owner,
                            job.iteration,
                            mask = t.mask,
                            "computed moved tasks"
                        );
                    }
                    m.handle(clock.now(), pushed(job.kind, r)?)?;
                }
                Action::Handover { shard, handover: h } => {
                    if let Err(e) = client_ref.tasks_yielded(shard, &h).await {
                        tracing::warn!(worker = id, "task hand-over refused: {e}");
                        m.handle(clock.now(), Input::HandoverRefused { handover: h })?;
                    }
                }
                Action::Applied { shard, control, iteration } => {
                    client_ref.control_applied(shard, control, iteration).await?;
                }
                Action::Finished(report) => client_ref.finished(report).await?,
                Action::Waiting { iteration, waiting } => client_ref.waiting(iteration, waiting).await,
                Action::Skip { to, .. } => client_ref.skip(to).await?,
                Action::Leave => break,
            }
            continue;
        }
        let wake = m.poll_timeout().map(|t| clock.instant(t));
        tokio::select! {
            Some(done) = inflight.next(), if !inflight.is_empty() => match done {
                Done::Pulled(r, params) => {
                    bufs.params = params;
                    let stats = r?;
                    bufs.pulled();
                    let deferred = stats.deferred_shards > 0;
                    let (deferred_ns, local_steps) = (stats.waited_ns, stats.local_steps);
                    m.handle(clock.now(), Input::Pulled { deferred, deferred_ns, local_steps })?;
                }
                Done::Pushed(job, r, grad) => {
                    if let Some(grad) = grad {
                        bufs.grad = grad;
                    }
                    m.handle(clock.now(), pushed(job.kind, r)?)?;
                }
            },
            Some(msg) = controls.recv() => m.handle(clock.now(), Input::Control(msg))?,
            // A stop wakes the loop: a request a policy keeps waiting is given up.
            () = client_ref.stopped(), if !stop_seen => {
                stop_seen = true;
                m.handle(clock.now(), Input::Stop)?;
            }
            () = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {
                m.handle(clock.now(), Input::Timer)?;
            }
        }
    }
    drop(inflight);
    let mut report = m.into_report();
    (report.bytes_sent, report.bytes_received) = client.bytes();
    report.codec_owed = client.codec_owed();
    // The report is written before leaving, so a failed goodbye loses no record of the work.
    if let Some(path) = &opts.report {
        let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
        crate::checkpoint::write_file(path, &json)
            .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    }
    client.leave().await?;
    Ok(report)
}

/// A push's result, for the machine: a shard's refusal is the machine's to judge (as is the
/// failure of moved tasks, whose owner may have left); any other failure of the worker's own
/// push ends the run with the client's error, which says what failed on the way.
fn pushed(kind: JobKind, r: Result<u32, NodeError>) -> Result<Input, NodeError> {
    let result = match r {
        Ok(dropped) => Ok(dropped),
        Err(NodeError::Net(NetError::RefusedByShard { error, .. })) => Err(PushFailed::Refused(error)),
        Err(e) if kind == JobKind::Own => return Err(e),
        Err(e) => {
            tracing::warn!(?kind, "moved tasks not delivered: {e}");
            Err(PushFailed::Undelivered)
        }
    };
    Ok(Input::Pushed { kind, result })
}
