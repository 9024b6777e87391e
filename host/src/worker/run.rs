//! The training loop of `syncopate worker`: pull, compute, push, report, obey the policies'
//! control messages (acknowledging each), and leave cleanly.
//!
//! Control messages are handled between tasks, while a pull or a push waits, and after each
//! iteration, so a worker a policy holds back can still be given work: when a policy moves tasks of a slow
//! worker's iteration to this one, the slow worker hands over the tasks it has not started and
//! this worker computes them (on the model it last pulled) and pushes them counted towards the
//! slow worker's iteration. An iteration split into tasks is computed task by task in order, so
//! "not started" is exact and no task is computed twice.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_distr::Distribution;
use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Control, IterationReport, WorkerId};
use syncopate_workloads::Workload;
use tokio::sync::mpsc;

use super::client::WorkerClient;
use crate::net::proto::ControlMessage;
use crate::net::tls::ClusterAccess;
use crate::shard::TaskPart;
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
    /// Tasks of this worker's iterations that other workers computed.
    pub tasks_given: u64,
    /// Tasks of other workers' iterations this worker computed.
    pub tasks_helped: u64,
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

/// The iteration being worked on, as far as task moves are concerned.
#[derive(Clone, Copy, Debug, Default)]
struct Current {
    iteration: u64,
    /// Tasks it is split into.
    total: u32,
    batch: u32,
    /// The next task to start (`total`: all started or the iteration is pushed).
    next: u32,
    /// Tasks handed to other workers.
    given: u64,
}

/// Everything the loop needs besides the client: the workload, buffers and settings.
struct Worker {
    opts: WorkerOptions,
    workload: Box<dyn Workload>,
    id: WorkerId,
    report: WorkerReport,
    /// The model as last pulled: what moved tasks are computed on.
    model: Vec<f32>,
    help_grad: Vec<f32>,
    batch: u32,
    tasks: u32,
    cur: Current,
    can_split: bool,
    /// Emulated compute time owed (negative: overslept), in nanoseconds.
    debt_ns: i64,
}

impl Worker {
    /// The time to add to `compute` (spent on `samples` samples) so that it takes as long as this
    /// worker's emulated device would: the pacing delay is per iteration of the starting batch
    /// size, so its share is `samples / batch`; all of it is stretched by the slow factor.
    fn slowdown(&self, compute: Duration, samples: u32) -> Duration {
        let fraction = f64::from(samples) / f64::from(self.opts.batch.max(1));
        let paced = compute + self.opts.extra_delay.mul_f64(fraction);
        let stretch = if self.opts.slow_factor > 1.0 {
            paced.mul_f32(self.opts.slow_factor - 1.0)
        } else {
            Duration::ZERO
        };
        paced - compute + stretch
    }

    /// Spends `extra` emulated compute time. Timers have about a millisecond's resolution, so
    /// short waits (one per task) are owed and paid together, and an overslept wait is credited
    /// against the next: the total matches the emulated device however finely work is split.
    async fn pace(&mut self, extra: Duration) {
        self.debt_ns += extra.as_nanos() as i64;
        if self.debt_ns >= 2_000_000 {
            let t = Instant::now();
            tokio::time::sleep(Duration::from_nanos(self.debt_ns as u64)).await;
            self.debt_ns -= t.elapsed().as_nanos() as i64;
        }
    }

    /// Acts on one control message; `next` is the first iteration a setting can apply to.
    async fn handle(
        &mut self,
        client: &WorkerClient,
        msg: ControlMessage,
        next: u64,
    ) -> Result<(), NodeError> {
        self.report.controls += 1;
        let worker = self.id;
        match (msg.control, msg.yield_to, msg.moved) {
            (Control::MoveTasks { from, iteration, first, count }, Some(to), _) if from == worker => {
                let c = self.cur;
                let (lo, hi) = (first.max(c.next), first.saturating_add(count).min(c.total));
                let mut end = lo;
                while end < hi && c.given & (1 << end) == 0 {
                    end += 1;
                }
                let yielded =
                    if iteration == c.iteration && self.can_split && client.numbering_shared() && end > lo {
                        (lo, end - lo)
                    } else {
                        (first, 0)
                    };
                self.cur.given |= TaskPart::range(yielded.0, yielded.1, c.total.max(1)).mask;
                self.report.tasks_given += u64::from(yielded.1);
                tracing::debug!(worker, to, iteration, ?yielded, "tasks handed over");
                let total = c.total.max(1);
                if let Err(e) = client
                    .tasks_yielded(msg.shard, to, iteration, yielded, total, c.batch, self.opts.part)
                    .await
                {
                    // The tasks stay ours if the hand-over is refused: nothing is lost.
                    tracing::warn!(worker, "task hand-over refused: {e}");
                    self.cur.given &= !TaskPart::range(yielded.0, yielded.1, total).mask;
                    self.report.tasks_given -= u64::from(yielded.1);
                }
            }
            (Control::MoveTasks { from, iteration, first, count }, None, Some(moved)) => {
                let t = Instant::now();
                let tasks = first..first + count;
                let step = tokio::task::block_in_place(|| {
                    self.workload.task_gradient(
                        moved.part,
                        iteration,
                        moved.batch,
                        tasks,
                        moved.total,
                        &self.model,
                        &mut self.help_grad,
                    )
                });
                let Some(step) = step else {
                    return Err(NodeError::Protocol(format!(
                        "moved tasks of worker {from} arrived, but workload {} cannot split iterations",
                        self.workload.name()
                    )));
                };
                let slow = self.slowdown(t.elapsed(), step.samples);
                self.pace(slow).await;
                let mask = TaskPart::range(first, count, moved.total).mask;
                // The owner may have left meanwhile (its iteration is void): not this worker's error.
                let pushed =
                    client.push_tasks(from, iteration, mask, moved.total, &self.help_grad, step.samples);
                if let Err(e) = pushed.await {
                    tracing::warn!(worker, from, iteration, "moved tasks not taken: {e}");
                } else if from == worker {
                    // Our own tasks, returned because the worker that took them left.
                    self.report.tasks_given -= u64::from(count);
                } else {
                    self.report.tasks_helped += u64::from(count);
                }
                tracing::debug!(worker, from, iteration, first, count, "computed moved tasks");
            }
            (control, _, _) => {
                match control {
                    Control::Pause { for_ns } => {
                        tracing::debug!(worker, shard = msg.shard, for_ns, "paused by the policy");
                        tokio::time::sleep(Duration::from_nanos(for_ns)).await;
                    }
                    Control::SetBatchSize { samples } if samples > 0 => self.batch = samples,
                    Control::SetTaskShare { tasks } if (1..=64).contains(&tasks) => {
                        self.tasks = if self.can_split { tasks } else { 1 };
                    }
                    Control::Resume => {}
                    other => {
                        tracing::warn!(worker, shard = msg.shard, ?other, "control message not understood");
                        return Ok(());
                    }
                }
                client.control_applied(msg.shard, control, next).await?;
            }
        }
        Ok(())
    }

    /// Waits for `request` (a pull or a push, which a policy may hold back), handling control
    /// messages meanwhile: a waiting worker can still be given tasks.
    async fn meanwhile<T>(
        &mut self,
        client: &WorkerClient,
        controls: &mut mpsc::UnboundedReceiver<ControlMessage>,
        next: u64,
        request: impl std::future::Future<Output = Result<T, NodeError>>,
    ) -> Result<T, NodeError> {
        tokio::pin!(request);
        loop {
            tokio::select! {
                r = &mut request => return r,
                Some(msg) = controls.recv() => self.handle(client, msg, next).await?,
            }
        }
    }

    /// Handles every control message already waiting.
    async fn drain(
        &mut self,
        client: &WorkerClient,
        controls: &mut mpsc::UnboundedReceiver<ControlMessage>,
        next: u64,
    ) -> Result<(), NodeError> {
        while let Ok(msg) = controls.try_recv() {
            self.handle(client, msg, next).await?;
        }
        Ok(())
    }

    /// Computes this worker's share of `iteration` into `grad`: all of it, or the tasks it was
    /// not asked to hand over, handling control messages between tasks. Returns samples, loss
    /// and compute time, or `None` when every task went to other workers.
    async fn compute(
        &mut self,
        client: &WorkerClient,
        controls: &mut mpsc::UnboundedReceiver<ControlMessage>,
        iteration: u64,
        params: &[f32],
        grad: &mut [f32],
        task_grad: &mut [f32],
    ) -> Result<Option<(u32, f32, Duration)>, NodeError> {
        let worker = self.id;
        if self.cur.total <= 1 && self.cur.given == 0 {
            self.cur.next = 1;
            let t = Instant::now();
            let batch = self.cur.batch;
            let step = tokio::task::block_in_place(|| {
                self.workload.gradient(worker, iteration, batch, params, grad)
            });
            let compute = t.elapsed();
            let slow = self.slowdown(compute, step.samples);
            self.pace(slow).await;
            return Ok(Some((step.samples, step.loss, compute + slow)));
        }
        grad.fill(0.0);
        let (mut samples, mut loss, mut busy) = (0u32, 0f32, Duration::ZERO);
        for task in 0..self.cur.total {
            self.drain(client, controls, iteration + 1).await?;
            if self.cur.given & (1 << task) != 0 {
                continue;
            }
            self.cur.next = task + 1;
            let t = Instant::now();
            let (part, batch, total) = (self.opts.part, self.cur.batch, self.cur.total);
            let step = tokio::task::block_in_place(|| {
                self.workload.task_gradient(part, iteration, batch, task..task + 1, total, params, task_grad)
            });
            let Some(step) = step else { continue };
            let compute = t.elapsed();
            let slow = self.slowdown(compute, step.samples);
            self.pace(slow).await;
            busy += compute + slow;
            let w = step.samples as f32;
            for (g, x) in grad.iter_mut().zip(task_grad.iter()) {
                *g += w * x;
            }
            samples += step.samples;
            loss += w * step.loss;
        }
        self.cur.next = self.cur.total;
        if samples == 0 {
            return Ok(None);
        }
        // Division, not a reciprocal: (n * g) / n is exactly g, so a split iteration adds up to
        // what the whole one would have.
        let n = samples as f32;
        grad.iter_mut().for_each(|g| *g /= n);
        Ok(Some((samples, loss / n, busy)))
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
    let began = Instant::now();
    let mut params = vec![0f32; len];
    let mut grad = vec![0f32; len];
    let mut task_grad = vec![0f32; len];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed ^ (u64::from(id) << 40) ^ 0x5eed);
    let jitter = match opts.jitter_ms {
        Some((mean, sd)) => Some(
            rand_distr::Normal::new(mean, sd)
                .map_err(|e| NodeError::Protocol(format!("bad jitter N({mean}, {sd}): {e}")))?,
        ),
        None => None,
    };
    let mut stall = opts.stall;
    let report = {
        let mut w = workload;
        let ok = w.task_gradient(opts.part, 0, 2, 0..1, 2, &params, &mut task_grad).is_some();
        let (iterations, batch) = (opts.iterations, opts.batch);
        let mut me = Worker {
            opts,
            workload: w,
            id,
            report: WorkerReport { worker: id, start, ..WorkerReport::default() },
            model: vec![0f32; len],
            help_grad: vec![0f32; len],
            batch,
            tasks: 1,
            cur: Current::default(),
            can_split: ok,
            debt_ns: 0,
        };
        for iteration in start..iterations {
            if client.stop_requested() {
                me.report.stopped_early = true;
                break;
            }
            me.cur = Current { iteration, total: me.tasks, batch: me.batch, next: 0, given: 0 };
            let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let t = Instant::now();
            // Wait for the pull, handling control messages (task moves above all) meanwhile.
            let stats = me
                .meanwhile(&client, &mut controls, iteration + 1, client.pull(iteration, &mut params))
                .await?;
            if me.can_split {
                me.model.copy_from_slice(&params);
            }
            let waited = t.elapsed();
            me.report.wait_ns += waited.as_nanos() as u64;
            me.report.deferred_pulls += u64::from(stats.deferred_shards > 0);
            let busy = Instant::now();
            let done =
                me.compute(&client, &mut controls, iteration, &params, &mut grad, &mut task_grad).await?;
            let mut delay = Duration::ZERO;
            if let Some(n) = &jitter {
                delay += Duration::from_secs_f64(n.sample(&mut rng).max(0.0) / 1e3);
            }
            if let Some((at, length)) = stall {
                if began.elapsed() >= at {
                    tracing::info!(worker = id, ?length, "stalling, as asked");
                    delay += length;
                    stall = None;
                }
            }
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let c = me.cur;
            me.cur.next = c.total;
            if let Some((samples, loss, compute)) = done {
                // A policy may hold the push: meanwhile, this worker can be given tasks.
                let push = async {
                    if c.given == 0 {
                        client.push(iteration, &grad, samples).await
                    } else {
                        let mask = TaskPart::full_mask(c.total) & !c.given;
                        client.push_tasks(id, iteration, mask, c.total, &grad, samples).await
                    }
                };
                me.meanwhile(&client, &mut controls, iteration + 1, push).await?;
                me.report.compute_ns += compute.as_nanos() as u64;
                me.report.last_loss = loss;
                let report =
                    IterationReport { worker: id, iteration, compute_ns: compute.as_nanos() as u64, samples };
                client.finished(report).await?;
            }
            me.report.iterations += 1;
            me.report.timeline.push((unix.as_secs_f64(), waited.as_secs_f32(), busy.elapsed().as_secs_f32()));
            me.drain(&client, &mut controls, iteration + 1).await?;
            tracing::debug!(
                worker = id,
                iteration,
                waited_ms = stats.waited_ns / 1_000_000,
                "iteration done"
            );
        }
        me.report.elapsed_ns = began.elapsed().as_nanos() as u64;
        (me.report.bytes_sent, me.report.bytes_received) = client.bytes();
        // The report is written before leaving, so a failed goodbye loses no record of the work.
        if let Some(path) = &me.opts.report {
            let json = serde_json::to_vec_pretty(&me.report).expect("reports serialize");
            std::fs::write(path, json).map_err(|source| NodeError::Io {
                what: format!("cannot write {}", path.display()),
                source,
            })?;
        }
        me.report
    };
    client.leave().await?;
    Ok(report)
}
