//! One shard as a tokio task: it owns a [`Shard`] and takes commands from the connections
//! through a channel, so the shard engine stays single-threaded and sans-IO. Replies go back on
//! oneshot channels; policy control messages go to the worker's control stream.
//!
//! Task moves are a handshake the task runs for any policy: a [`Control::MoveTasks`] for worker
//! `to` first goes to the tasks' owner as a request; the owner answers with the tasks it had not
//! started ([`ShardCmd::Yielded`]); only those are forwarded to `to`, and the policy hears the
//! outcome as an `Event::ControlApplied`. So no task is computed twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use syncopate_policy_sdk::abi::{Applied, Control, IterationReport, LeaveReason, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::net::pool::TensorPool;
use crate::net::proto::{ControlMessage, MovedTasks, ShardStatus};
use crate::runtime::{PolicyError, PolicyModule};
use crate::shard::{PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink, TaskPart};

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
        reply: Reply<()>,
    },
    /// The owner of moved tasks handed them over.
    Yielded {
        owner: WorkerId,
        to: WorkerId,
        iteration: u64,
        first: u32,
        count: u32,
        moved: MovedTasks,
    },
    /// A worker applied a control message.
    Applied {
        applied: Applied,
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
    pushes: HashMap<(WorkerId, u64), Reply<()>>,
    controls: HashMap<WorkerId, mpsc::UnboundedSender<ControlMessage>>,
    /// Tasks handed over and not yet pushed by the worker that took them.
    moved: Vec<Moved>,
    /// Workers that said goodbye while tasks of theirs were still being computed elsewhere.
    leaving: Vec<(WorkerId, Option<Reply<()>>)>,
}

/// Tasks `first..first + count` of `owner`'s `iteration`, handed to worker `to`.
#[derive(Debug, Clone, Copy)]
struct Moved {
    owner: WorkerId,
    to: WorkerId,
    iteration: u64,
    first: u32,
    count: u32,
    split: MovedTasks,
}

impl Moved {
    /// The tasks, as a message for whoever computes them.
    fn message(&self, shard: u32) -> ControlMessage {
        let control = Control::MoveTasks {
            from: self.owner,
            iteration: self.iteration,
            first: self.first,
            count: self.count,
        };
        ControlMessage { moved: Some(self.split), ..ControlMessage::plain(shard, control) }
    }
}

impl Waiting {
    /// Worker `gone` left: tasks it took and never pushed go back to their owners, who compute
    /// them themselves, so no iteration is left incomplete.
    fn return_tasks(&mut self, gone: WorkerId) {
        let (back, keep): (Vec<Moved>, Vec<Moved>) =
            self.moved.drain(..).filter(|m| m.owner != gone).partition(|m| m.to == gone);
        self.moved = keep;
        for m in back {
            tracing::warn!(
                shard = self.shard,
                owner = m.owner,
                helper = gone,
                "moved tasks returned to their owner"
            );
            self.send_control(m.owner, m.message(self.shard));
        }
    }

    fn send_control(&self, worker: WorkerId, msg: ControlMessage) {
        match self.controls.get(&worker) {
            Some(tx) => {
                let _ = tx.send(msg);
            }
            None => tracing::warn!(shard = self.shard, worker, ?msg, "control for a worker not connected"),
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
            let _ = tx.send(Ok(()));
        }
    }

    fn control(&mut self, worker: WorkerId, control: Control) {
        // A move goes to the tasks' owner first; it hands over what it has not started.
        let (to, msg) = match control {
            Control::MoveTasks { from, .. } => (
                from,
                ControlMessage { yield_to: Some(worker), ..ControlMessage::plain(self.shard, control) },
            ),
            _ => (worker, ControlMessage::plain(self.shard, control)),
        };
        self.send_control(to, msg);
    }

    fn metric(&mut self, name: &str, value: f64) {
        tracing::debug!(shard = self.shard, name, value, "policy metric");
    }

    fn policy_failed(&mut self, error: &PolicyError) {
        tracing::warn!(shard = self.shard, "policy failed, shard recovered: {error}");
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
}

impl ShardTask {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<ShardCmd>) {
        let mut shard: Option<Shard> = None;
        let mut w = Waiting { shard: self.cfg.shard, pool: self.pool.clone(), ..Waiting::default() };
        loop {
            let timer = shard.as_ref().and_then(|s| s.next_timer_ns());
            let cmd = match timer {
                Some(at) => {
                    let wait = std::time::Duration::from_nanos(at.saturating_sub(self.now()));
                    tokio::select! {
                        cmd = rx.recv() => cmd,
                        () = tokio::time::sleep(wait) => {
                            if let Some(s) = shard.as_mut() {
                                s.advance(self.now(), &mut w);
                            }
                            continue;
                        }
                    }
                }
                None => rx.recv().await,
            };
            let Some(cmd) = cmd else { break };
            self.handle(cmd, &mut shard, &mut w);
        }
    }

    fn handle(&mut self, cmd: ShardCmd, slot: &mut Option<Shard>, w: &mut Waiting) {
        let now = self.now();
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
                w.moved.retain(|m| {
                    let mask = TaskPart::range(m.first, m.count, 64).mask;
                    !(m.owner == owner
                        && m.to == worker
                        && m.iteration == iteration
                        && mask & !part.mask == 0)
                });
                let done =
                    w.leaving.iter().any(|(o, _)| *o == owner) && !w.moved.iter().any(|m| m.owner == owner);
                let req =
                    PushRequest { worker: owner, iteration, samples, grad, based_on, tasks: Some(part) };
                let result = shard.push(req, now, w).map(|_| ()).map_err(|e| e.to_string());
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
                if done {
                    finish_leaves(slot, w, now);
                }
            }
            ShardCmd::Yielded { owner, to, iteration, first, count, moved } => {
                let m = Moved { owner, to, iteration, first, count, split: moved };
                // If the helper has gone meanwhile, the owner keeps its tasks (and computes them).
                let count = if count > 0 && w.controls.contains_key(&to) {
                    w.send_control(to, m.message(id));
                    w.moved.push(m);
                    count
                } else {
                    if count > 0 {
                        w.send_control(owner, m.message(id));
                    }
                    0
                };
                let control = Control::MoveTasks { from: owner, iteration, first, count };
                if let Some(shard) = slot.as_mut() {
                    let applied = Applied { worker: to, control, iteration };
                    if let Err(e) = shard.control_applied(applied, now, w) {
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
            ShardCmd::Finished { report } => {
                if let Some(shard) = slot.as_mut() {
                    if let Err(e) = shard.iteration_finished(report, now, w) {
                        tracing::debug!(shard = id, "iteration report ignored: {e}");
                    }
                }
            }
            ShardCmd::Leave { worker, reason, reply } => {
                if reason == LeaveReason::Finished && w.moved.iter().any(|m| m.owner == worker) {
                    // Its last iterations wait for tasks other workers are computing: it leaves
                    // when they are in, so nothing it trained is lost.
                    w.leaving.push((worker, reply));
                    return;
                }
                leave(slot, w, worker, reason, reply, now);
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

/// Removes `worker` from the shard and from every table of pending answers.
fn leave(
    slot: &mut Option<Shard>,
    w: &mut Waiting,
    worker: WorkerId,
    reason: LeaveReason,
    reply: Option<Reply<()>>,
    now: u64,
) {
    let result = match slot.as_mut() {
        Some(shard) => shard.leave(worker, reason, now, w).map_err(|e| e.to_string()),
        None => Ok(()),
    };
    if result.is_ok() {
        tracing::info!(shard = w.shard, worker, ?reason, "worker left");
    }
    w.controls.remove(&worker);
    w.pulls.retain(|(wk, _), _| *wk != worker);
    w.return_tasks(worker);
    if let Some(reply) = reply {
        let _ = reply.send(result);
    }
    finish_leaves(slot, w, now);
}

/// Completes the goodbyes of workers none of whose tasks are still out (pushed, or returned to
/// a worker that is itself leaving and so dropped).
fn finish_leaves(slot: &mut Option<Shard>, w: &mut Waiting, now: u64) {
    while let Some(pos) = w.leaving.iter().position(|(o, _)| !w.moved.iter().any(|m| m.owner == *o)) {
        let (worker, reply) = w.leaving.swap_remove(pos);
        leave(slot, w, worker, LeaveReason::Finished, reply, now);
    }
}
