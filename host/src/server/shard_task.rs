//! One shard as a tokio task: it owns a [`Shard`] and takes commands from the connections
//! through a channel, so the shard engine stays single-threaded and sans-IO. This task is a
//! pure driver: replies go back on oneshot channels, control messages (a policy's, and the steps
//! of task hand-overs, which the engine's ledger runs: [`crate::tasks`]) go to the worker's
//! control stream, and the shard's timers become tokio sleeps.
//!
//! A shard restored from a checkpoint (`--resume`) starts with its members of the time; each
//! rejoins when its worker reconnects, and those that have not come back within the peer
//! timeout of the first one (or of a minute, if none comes) are made to leave, so a barrier does
//! not wait for a worker that is gone for good. A push the shard already has (a retry, or an
//! iteration redone after a restore) is acknowledged as a duplicate, not applied again; if it is
//! held by the policy, the acknowledgement waits for the policy's decision.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::net::pool::TensorPool;
use crate::net::proto::{ControlMessage, ShardStatus};
use crate::recording::{self, PolicyStart};
use crate::runtime::{PolicyError, PolicyModule};
use crate::shard::{
    Handover, PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardError, ShardSink, ShardSnapshot,
    TaskPart,
};
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

/// What became of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PushOutcome {
    /// Admitted: applied, or counted in its aggregate or its iteration's tasks.
    Applied,
    /// Acknowledged, but the policy dropped it.
    Dropped,
    /// The shard already had it: acknowledged, not applied again.
    Duplicate,
}

/// How a worker joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Joined {
    /// A new member, starting at this clock.
    Fresh(u64),
    /// A member of a restored shard, back: the next iteration the shard expects from it.
    Rejoined(u64),
}

/// A command for a shard task.
#[derive(Debug)]
pub(crate) enum ShardCmd {
    Join {
        worker: WorkerId,
        init: Vec<f32>,
        controls: mpsc::UnboundedSender<ControlMessage>,
        reply: Reply<Joined>,
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
        reply: Reply<PushOutcome>,
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
    /// The shard's snapshot, encoded ([`ShardSnapshot::encode`]).
    Snapshot {
        reply: Reply<Vec<u8>>,
    },
}

/// Answers waiting for the shard, keyed by (worker, iteration): a worker has at most one pull
/// and one push per iteration in flight on a shard.
#[derive(Default)]
struct Waiting {
    shard: u32,
    pool: TensorPool,
    pulls: HashMap<(WorkerId, u64), Reply<Served>>,
    pushes: HashMap<(WorkerId, u64), Reply<PushOutcome>>,
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
            let _ = tx.send(Ok(PushOutcome::Applied));
        }
    }

    fn push_dropped(&mut self, _id: u64, worker: WorkerId, iteration: u64) {
        if let Some(tx) = self.pushes.remove(&(worker, iteration)) {
            let _ = tx.send(Ok(PushOutcome::Dropped));
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
    /// A snapshot to start from (`--resume`) instead of waiting for a worker's parameters.
    pub restored: Option<ShardSnapshot>,
    /// How long the members of a restored shard have to come back once the first has.
    pub rejoin_grace: Duration,
}

/// Members of a restored shard that have not reconnected yet, and until when they may.
struct Awaiting {
    workers: BTreeSet<WorkerId>,
    deadline: Instant,
}

impl ShardTask {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<ShardCmd>) {
        let mut shard: Option<Shard> = None;
        let mut w = Waiting { shard: self.cfg.shard, pool: self.pool.clone(), ..Waiting::default() };
        let mut awaiting = None;
        if let Some(snap) = self.restored.take() {
            // The clock goes on from the snapshot's, so parked pulls and timers keep their times.
            let at = Duration::from_nanos(snap.now_ns());
            self.epoch = Instant::now().checked_sub(at).unwrap_or(self.epoch);
            let members: BTreeSet<WorkerId> = snap.workers().iter().map(|c| c.worker).collect();
            let (version, id) = (snap.version(), self.cfg.shard);
            match Shard::restore(self.cfg.clone(), snap, &self.module, &mut w) {
                Ok(s) => {
                    tracing::info!(
                        shard = id,
                        version,
                        members = members.len(),
                        "shard restored from its checkpoint"
                    );
                    shard = Some(s);
                    let deadline = Instant::now() + self.rejoin_grace.max(Duration::from_secs(60));
                    awaiting = Some(Awaiting { workers: members, deadline });
                }
                // The server checked every file before starting its shards; this is a module
                // that refuses its own state.
                Err(e) => tracing::error!(shard = id, "cannot restore the shard: {e}"),
            }
        }
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
            let gone = awaiting.as_ref().map(|a: &Awaiting| a.deadline);
            let wake = match (timer, gone) {
                (None, None) => None,
                (t, g) => {
                    let t = t.map(|at| Duration::from_nanos(at.saturating_sub(self.now())));
                    let g = g.map(|d| d.saturating_duration_since(Instant::now()));
                    t.into_iter().chain(g).min()
                }
            };
            let cmd = match wake {
                Some(wait) => {
                    // Biased: a timer that is due fires before requests that arrive after it.
                    tokio::select! {
                        biased;
                        () = tokio::time::sleep(wait) => {
                            if let Some(s) = shard.as_mut() {
                                s.advance(self.now(), &mut w);
                                if let Some(a) = awaiting.take_if(|a| a.deadline <= Instant::now()) {
                                    self.drop_absent(s, a.workers, &mut w);
                                }
                            }
                            continue;
                        }
                        cmd = rx.recv() => cmd,
                    }
                }
                None => rx.recv().await,
            };
            let Some(cmd) = cmd else { break };
            self.handle(cmd, &mut shard, &mut w, &mut awaiting);
        }
        w.record(recording::Writer::flush);
    }

    /// Members of a restored shard that did not come back leave, as workers whose connection
    /// timed out do.
    fn drop_absent(&self, shard: &mut Shard, absent: BTreeSet<WorkerId>, w: &mut Waiting) {
        for worker in absent {
            tracing::warn!(
                shard = self.cfg.shard,
                worker,
                "worker did not come back after the restore; it leaves"
            );
            let _ = shard.leave(worker, LeaveReason::TimedOut, self.now(), w);
        }
    }

    fn handle(
        &mut self,
        cmd: ShardCmd,
        slot: &mut Option<Shard>,
        w: &mut Waiting,
        awaiting: &mut Option<Awaiting>,
    ) {
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
                if let Some(a) = awaiting.as_mut().filter(|a| a.workers.contains(&worker)) {
                    a.workers.remove(&worker);
                    if a.workers.is_empty() {
                        *awaiting = None;
                    } else {
                        a.deadline = a.deadline.min(Instant::now() + self.rejoin_grace);
                    }
                    w.controls.insert(worker, controls);
                    let next = shard.rejoin(worker).map_err(|e| e.to_string());
                    if let Ok(next) = next {
                        tracing::info!(shard = id, worker, next, "worker rejoined the restored shard");
                    }
                    let _ = reply.send(next.map(Joined::Rejoined));
                    return;
                }
                w.controls.insert(worker, controls);
                let _ = reply.send(shard.join(worker, now, w).map(Joined::Fresh).map_err(|e| e.to_string()));
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
                let result = match shard.push_by(worker, req, now, w) {
                    Ok(_) => Ok(PushOutcome::Applied),
                    Err(ShardError::Duplicate { .. }) => Ok(PushOutcome::Duplicate),
                    Err(e) => Err(e.to_string()),
                };
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
                if w.pushes.contains_key(&(worker, iteration)) {
                    let _ = reply
                        .send(Err(format!("worker {worker} already has a push for {iteration} waiting")));
                    return;
                }
                w.pushes.insert((worker, iteration), reply);
                let req = PushRequest { worker, iteration, samples, grad, based_on, tasks: None };
                match shard.push(req, now, w) {
                    Ok(_) => {}
                    // Held by the policy: the acknowledgement waits for its decision.
                    Err(ShardError::Duplicate { .. }) if shard.is_push_held(worker, iteration) => {}
                    Err(ShardError::Duplicate { .. }) => {
                        tracing::debug!(
                            shard = id,
                            worker,
                            iteration,
                            "duplicate push acknowledged, not applied"
                        );
                        if let Some(reply) = w.pushes.remove(&(worker, iteration)) {
                            let _ = reply.send(Ok(PushOutcome::Duplicate));
                        }
                    }
                    Err(e) => {
                        if let Some(reply) = w.pushes.remove(&(worker, iteration)) {
                            let _ = reply.send(Err(e.to_string()));
                        }
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
            ShardCmd::Snapshot { reply } => {
                let result = match slot.as_mut() {
                    Some(s) => s.snapshot(now).map(|snap| snap.encode()).map_err(|e| e.to_string()),
                    None => Err(not_yet()),
                };
                let _ = reply.send(result);
            }
        }
    }
}
