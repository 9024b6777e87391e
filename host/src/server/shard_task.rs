//! One shard as a tokio task: it owns a [`Shard`] and takes commands from the connections
//! through a channel, so the shard engine stays single-threaded and sans-IO. This task is a
//! pure driver: replies go back on oneshot channels, control messages (a policy's, and the steps
//! of task hand-overs, which the engine's ledger runs: [`crate::tasks`]) go to the worker's
//! control stream, and the shard's timers become tokio sleeps.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::net::pool::TensorPool;
use crate::net::proto::{ControlMessage, ShardStatus};
use crate::recording::{self, PolicyStart};
use crate::runtime::{PolicyError, PolicyModule};
use crate::shard::{Handover, PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink, TaskPart};
use syncopate_policy_sdk::abi::Envelope;

/// What a served pull sends back.
#[derive(Debug)]
pub(crate) struct Served {
    pub clock: u64,
    pub version: u64,
    pub waited_ns: u64,
    /// The shard's parameters as they were when served, shared (no copy).
    pub values: Arc<Vec<f32>>,
}

type Reply<T> = oneshot::Sender<Result<T, String>>;

/// A command for a shard task.
#[derive(Debug)]
pub(crate) enum ShardCmd {
    Join {
        worker: WorkerId,
        init: Vec<f32>,
        controls: mpsc::UnboundedSender<ControlMessage>,
        reply: Reply<u64>,
    },
    Push {
        worker: WorkerId,
        iteration: u64,
        samples: u32,
        based_on: Option<u64>,
        grad: Vec<f32>,
        /// Some tasks only: the owner of the iteration and which of its tasks. Acknowledged as
        /// soon as they are counted.
        tasks: Option<(WorkerId, TaskPart)>,
        /// `true`: the policy dropped the push (acknowledged, gradient discarded).
        reply: Reply<bool>,
    },
    /// The owner of moved tasks handed them over.
    Yielded {
        handover: Handover,
    },
    /// A worker applied a control message.
    Applied {
        applied: Applied,
    },
    /// A worker skips to an iteration.
    Skip {
        worker: WorkerId,
        to: u64,
        reply: Reply<()>,
    },
    Pull {
        worker: WorkerId,
        iteration: u64,
        reply: Reply<Served>,
    },
    Finished {
        report: IterationReport,
    },
    Leave {
        worker: WorkerId,
        reason: LeaveReason,
        reply: Option<Reply<()>>,
    },
    Read {
        reply: Reply<(u64, Arc<Vec<f32>>)>,
    },
    Swap {
        module: PolicyModule,
        config: Vec<(String, String)>,
        reply: Reply<()>,
    },
    Status {
        reply: oneshot::Sender<Option<ShardStatus>>,
    },
}

/// Answers waiting for the shard, keyed by (worker, iteration): a worker has at most one pull
/// and one push per iteration in flight on a shard.
#[derive(Default)]
struct Waiting {
    shard: u32,
    pool: TensorPool,
    pulls: HashMap<(WorkerId, u64), Reply<Served>>,
    pushes: HashMap<(WorkerId, u64), Reply<bool>>,
    controls: HashMap<WorkerId, mpsc::UnboundedSender<ControlMessage>>,
    /// Goodbyes the shard has not completed yet (tasks of the worker's were still out).
    goodbyes: HashMap<WorkerId, Reply<()>>,
    /// Where the policy's events are recorded, if they are.
    recorder: Option<Recorder>,
}

type Recorder = recording::Writer<std::io::BufWriter<std::fs::File>>;

impl Waiting {
    fn record(&mut self, write: impl FnOnce(&mut Recorder) -> std::io::Result<()>) {
        if let Some(r) = self.recorder.as_mut() {
            if let Err(e) = write(r) {
                tracing::warn!(shard = self.shard, "recording stopped: {e}");
                self.recorder = None;
            }
        }
    }
}

impl ShardSink for Waiting {
    fn pull_served(&mut self, r: PullReply<'_>) {
        if let Some(tx) = self.pulls.remove(&(r.worker, r.iteration)) {
            let served = Served {
                clock: r.clock,
                version: r.version,
                waited_ns: r.waited_ns,
                values: Arc::clone(r.values),
            };
            let _ = tx.send(Ok(served));
        }
    }

    fn push_acked(&mut self, _id: u64, worker: WorkerId, iteration: u64) {
        if let Some(tx) = self.pushes.remove(&(worker, iteration)) {
            let _ = tx.send(Ok(false));
        }
    }

    fn push_dropped(&mut self, _id: u64, worker: WorkerId, iteration: u64) {
        if let Some(tx) = self.pushes.remove(&(worker, iteration)) {
            let _ = tx.send(Ok(true));
        }
    }

    fn control(&mut self, worker: WorkerId, msg: ControlMessage) {
        match self.controls.get(&worker) {
            Some(tx) => {
                let _ = tx.send(msg);
            }
            None => tracing::warn!(shard = self.shard, worker, ?msg, "control for a worker not connected"),
        }
    }

    fn left(&mut self, worker: WorkerId) {
        tracing::info!(shard = self.shard, worker, "worker left");
        self.controls.remove(&worker);
        self.pulls.retain(|(wk, _), _| *wk != worker);
        if let Some(reply) = self.goodbyes.remove(&worker) {
            let _ = reply.send(Ok(()));
        }
    }

    fn metric(&mut self, name: &str, value: f64) {
        tracing::debug!(shard = self.shard, name, value, "policy metric");
    }

    fn policy_failed(&mut self, error: &PolicyError) {
        tracing::warn!(shard = self.shard, "policy failed, shard recovered: {error}");
    }

    fn policy_started(&mut self, start: &PolicyStart<'_>) {
        self.record(|r| r.started(start));
    }

    fn policy_called(&mut self, env: &Envelope, answer: Result<&[u8], &PolicyError>) {
        match answer {
            Ok(bytes) => self.record(|r| r.called(env, Ok(bytes))),
            Err(e) => self.record(|r| r.called(env, Err(&e.to_string()))),
        }
    }

    fn recycle(&mut self, buffer: Vec<f32>) {
        self.pool.give(buffer);
    }

    fn buffer(&mut self, len: usize) -> Vec<f32> {
        self.pool.take(len)
    }
}

/// The task's state before and after the shard exists (it is created by the first join, which
/// carries the initial parameters).
pub(crate) struct ShardTask {
    pub cfg: ShardConfig,
    pub module: PolicyModule,
    pub config: Vec<(String, String)>,
    pub epoch: Instant,
    /// The server's tensor buffers: pull answers are taken from it, spent gradients go back.
    pub pool: TensorPool,
    /// The file to record the policy's events into, if any.
    pub record: Option<std::path::PathBuf>,
}

impl ShardTask {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<ShardCmd>) {
        let mut shard: Option<Shard> = None;
        let mut w = Waiting { shard: self.cfg.shard, pool: self.pool.clone(), ..Waiting::default() };
        if let Some(path) = &self.record {
            let file = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::File::create(path));
            match file.and_then(|f| recording::Writer::new(std::io::BufWriter::with_capacity(1 << 16, f))) {
                Ok(r) => w.recorder = Some(r),
                Err(e) => tracing::warn!(shard = self.cfg.shard, "cannot record to {}: {e}", path.display()),
            }
        }
        loop {
            let timer = shard.as_ref().and_then(|s| s.next_timer_ns());
            let cmd = match timer {
                Some(at) => {
                    let wait = std::time::Duration::from_nanos(at.saturating_sub(self.now()));
                    // Biased: a timer that is due fires before requests that arrive after it.
                    tokio::select! {
                        biased;
                        () = tokio::time::sleep(wait) => {
                            if let Some(s) = shard.as_mut() {
                                s.advance(self.now(), &mut w);
                            }
                            continue;
                        }
                        cmd = rx.recv() => cmd,
                    }
                }
                None => rx.recv().await,
            };
            let Some(cmd) = cmd else { break };
            self.handle(cmd, &mut shard, &mut w);
        }
        w.record(recording::Writer::flush);
    }

    fn handle(&mut self, cmd: ShardCmd, slot: &mut Option<Shard>, w: &mut Waiting) {
        let now = self.now();
        // Timers due by now fire before the request (the order a replay assumes).
        if let Some(s) = slot.as_mut() {
            s.advance(now, w);
        }
        let id = self.cfg.shard;
        let not_yet = || format!("shard {id} has no parameters yet (a worker must join with them first)");
        match cmd {
            ShardCmd::Join { worker, init, controls, reply } => {
                let model_len = init.len();
                if slot.is_none() {
                    if init.is_empty() {
                        let _ = reply.send(Err(not_yet()));
                        return;
                    }
                    match Shard::new(self.cfg.clone(), init, &self.module, &self.config, w) {
                        Ok(s) => {
                            tracing::info!(shard = id, len = s.values().len(), "shard created");
                            *slot = Some(s);
                        }
                        Err(e) => {
                            let _ = reply.send(Err(format!("shard {id} cannot start its policy: {e}")));
                            return;
                        }
                    }
                }
                let shard = slot.as_mut().expect("created above");
                if model_len != 0 && model_len != shard.values().len() {
                    let _ = reply.send(Err(format!(
                        "shard {id} holds {} parameters, the worker's slice has {model_len}",
                        shard.values().len(),
                    )));
                    return;
                }
                w.controls.insert(worker, controls);
                let _ = reply.send(shard.join(worker, now, w).map_err(|e| e.to_string()));
            }
            ShardCmd::Push {
                worker,
                iteration,
                samples,
                based_on,
                grad,
                tasks: Some((owner, part)),
                reply,
            } => {
                let Some(shard) = slot.as_mut() else {
                    let _ = reply.send(Err(not_yet()));
                    return;
                };
                let req =
                    PushRequest { worker: owner, iteration, samples, grad, based_on, tasks: Some(part) };
                let result = shard.push_by(worker, req, now, w).map(|_| false).map_err(|e| e.to_string());
                if owner != worker {
                    tracing::debug!(
                        shard = id,
                        worker,
                        owner,
                        iteration,
                        mask = part.mask,
                        "moved tasks pushed"
                    );
                }
                let _ = reply.send(result);
            }
            ShardCmd::Yielded { handover } => {
                if let Some(shard) = slot.as_mut() {
                    if let Err(e) = shard.tasks_yielded(handover, now, w) {
                        tracing::debug!(shard = id, "task hand-over not reported: {e}");
                    }
                }
            }
            ShardCmd::Applied { applied } => {
                if let Some(shard) = slot.as_mut() {
                    if let Err(e) = shard.control_applied(applied, now, w) {
                        tracing::debug!(shard = id, "control acknowledgement ignored: {e}");
                    }
                }
            }
            ShardCmd::Push { worker, iteration, samples, based_on, grad, tasks: None, reply } => {
                let Some(shard) = slot.as_mut() else {
                    let _ = reply.send(Err(not_yet()));
                    return;
                };
                w.pushes.insert((worker, iteration), reply);
                let req = PushRequest { worker, iteration, samples, grad, based_on, tasks: None };
                if let Err(e) = shard.push(req, now, w) {
                    if let Some(reply) = w.pushes.remove(&(worker, iteration)) {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            ShardCmd::Pull { worker, iteration, reply } => {
                let Some(shard) = slot.as_mut() else {
                    let _ = reply.send(Err(not_yet()));
                    return;
                };
                if w.pulls.contains_key(&(worker, iteration)) {
                    let _ = reply
                        .send(Err(format!("worker {worker} already has a pull for {iteration} waiting")));
                    return;
                }
                w.pulls.insert((worker, iteration), reply);
                if let Err(e) = shard.pull(PullRequest { worker, iteration }, now, w) {
                    if let Some(reply) = w.pulls.remove(&(worker, iteration)) {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            ShardCmd::Skip { worker, to, reply } => {
                let Some(shard) = slot.as_mut() else {
                    let _ = reply.send(Err(not_yet()));
                    return;
                };
                let _ = reply.send(shard.skip(worker, to, now, w).map_err(|e| e.to_string()));
            }
            ShardCmd::Finished { report } => {
                if let Some(shard) = slot.as_mut() {
                    if let Err(e) = shard.iteration_finished(report, now, w) {
                        tracing::debug!(shard = id, "iteration report ignored: {e}");
                    }
                }
            }
            ShardCmd::Leave { worker, reason, reply } => {
                let result = match slot.as_mut() {
                    // A goodbye waits for the worker's tasks still out (its last iterations are
                    // incomplete without them), so nothing it trained is lost.
                    Some(shard) if reason == LeaveReason::Finished => shard.goodbye(worker, now, w),
                    Some(shard) => shard.leave(worker, reason, now, w).map(|()| true),
                    None => Ok(true),
                };
                match (result, reply) {
                    (Ok(false), Some(reply)) => {
                        w.goodbyes.insert(worker, reply);
                    }
                    (Ok(_), Some(reply)) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Err(e), Some(reply)) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                    (_, None) => {}
                }
                if slot.is_none() {
                    w.left(worker);
                }
            }
            ShardCmd::Read { reply } => {
                let _ = reply.send(match slot.as_ref() {
                    Some(s) => Ok((s.version(), Arc::clone(s.shared_values()))),
                    None => Err(not_yet()),
                });
            }
            ShardCmd::Swap { module, config, reply } => {
                let result = match slot.as_mut() {
                    Some(shard) => shard.swap_policy(&module, &config, now, w).map_err(|e| e.to_string()),
                    None => Ok(()),
                };
                if result.is_ok() {
                    self.module = module;
                    self.config = config;
                }
                let _ = reply.send(result);
            }
            ShardCmd::Status { reply } => {
                let _ = reply.send(slot.as_ref().map(|s| ShardStatus::of(id, s)));
            }
        }
    }
}
