//! One shard as a tokio task: the driver of the engine's [`ShardNode`], which holds the
//! protocol (replies by token, duplicates, acknowledgements held for the backup, replication,
//! promotion, members awaited after a restore or a promotion; see its docs). This task only
//! plumbs: commands come from the connections through a channel, a reply token maps to the
//! oneshot channel its connection waits on, control messages (a policy's, and the steps of task
//! hand-overs: [`crate::tasks`]) go to the worker's control stream, ops go to the replication
//! stream's writer ([`ReplicaLink`]), confirmations to the primary, and the node's timeouts
//! become tokio sleeps on the task's clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use syncopate_policy_sdk::abi::{Applied, Envelope, IterationReport, LeaveReason, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::net::pool::TensorPool;
use crate::net::proto::{ControlMessage, ShardStatus};
use crate::recording::{self, PolicyStart};
use crate::runtime::{PolicyError, PolicyModule};
use crate::shard::{
    ClockRaise, Handover, NodeConfig, NodeOutput, Observer, PushHeader, Reply as NodeReply, ShardConfig,
    ShardNode, ShardSnapshot, SwapTo, Token,
};
pub(crate) use crate::shard::{Joined, PushOutcome, Served, Stamped};

type Reply<T> = oneshot::Sender<Result<T, crate::shard::RequestError>>;

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
        /// What the push says (with `tasks`, some tasks of their owner's iteration,
        /// acknowledged as soon as they are counted).
        push: PushHeader,
        grad: Vec<f32>,
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
    Waiting {
        worker: WorkerId,
        iteration: u64,
        waiting: bool,
    },
    Leave {
        worker: WorkerId,
        reason: LeaveReason,
        reply: Option<Reply<()>>,
    },
    Read {
        reply: Reply<(u64, Arc<Vec<f32>>)>,
    },
    /// The server's connection to a worker ended: a member the shard awaits since a promotion
    /// leaves ([`ShardNode::lost`]).
    Lost {
        worker: WorkerId,
        reason: LeaveReason,
    },
    Swap {
        to: SwapTo,
        reply: Reply<()>,
    },
    /// A primary just promoted takes the policy this server records (its last committed
    /// swap), unless it runs that swap or a newer one ([`ShardNode::conform`]).
    Conform(SwapTo),
    /// The swap the shard's policy came in by, and its raise ([`crate::shard::Shard::swap`]).
    Swapped {
        reply: oneshot::Sender<Option<(u64, Vec<ClockRaise>)>>,
    },
    /// Whether the shard would take this module in a swap now ([`ShardNode::check_swap`]).
    CheckSwap {
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
    /// A backup's op from its primary (see the module docs); `grad` is a push's gradient.
    Replicated {
        stamped: Stamped,
        grad: Vec<f32>,
        /// Where the backup confirms it holds the op.
        ack: mpsc::UnboundedSender<u64>,
    },
    /// The backup has every op up to `seq`: the pushes they admitted may be acknowledged.
    ReplicaAcked {
        seq: u64,
    },
    /// Stream every op to this backup from now on. Sent before the shard's first op, the
    /// backup starts as the shard did; later (a re-replication after a failover), the shard
    /// restarts itself from a snapshot and the backup starts from the same one.
    AttachBackup {
        link: ReplicaLink,
        reply: Reply<()>,
    },
    /// The backup is gone for good (its server died): stop waiting for it.
    DropBackup,
    /// This backup becomes the shard's primary; `connected`: the workers connected to this
    /// server ([`ShardNode::promote`](crate::shard::ShardNode::promote)).
    Promote {
        connected: std::collections::BTreeSet<syncopate_policy_sdk::abi::WorkerId>,
        reply: Reply<()>,
    },
}

/// What a primary streams to its backup.
#[derive(Debug)]
pub(crate) enum Replicate {
    /// A backup attached mid-run starts from this snapshot (encoded), which the primary has
    /// just restarted itself from; `seq` is its place in the stream.
    Init { seq: u64, snapshot: Vec<u8> },
    /// An op and its payload (a push's gradient, a creation's parameters).
    Op(Stamped, Vec<f32>),
}

/// A replication stream's frames after its [`ReplicaOpen`](crate::net::proto::ReplicaOpen):
/// their payloads are the snapshot's bytes and the ops' tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) enum ReplicaFrame {
    /// A snapshot to start the backup from.
    Init { seq: u64 },
    /// An op.
    Op(Stamped),
}

/// Where a primary's ops go: the writer task that streams them to the backup.
#[derive(Debug)]
pub(crate) struct ReplicaLink {
    pub tx: mpsc::UnboundedSender<Replicate>,
}

/// Modules by SHA-256 on one server: where a backup finds the module of a swap its primary made.
pub(crate) type Modules = Arc<std::sync::Mutex<HashMap<[u8; 32], PolicyModule>>>;

/// The task's settings. The shard itself is created by the first join (which carries the
/// initial parameters), restored from a snapshot, or, on a backup, created by its primary's
/// first op.
pub(crate) struct ShardTask {
    pub cfg: ShardConfig,
    pub module: PolicyModule,
    pub config: Vec<(String, String)>,
    pub epoch: Instant,
    /// The server's tensor buffers: pull answers are taken from it, spent gradients go back.
    pub pool: TensorPool,
    /// The file to record the policy's events into, if any.
    pub record: Option<std::path::PathBuf>,
    /// A snapshot to start from (`--resume`, or a backup's primary's) instead of waiting for a
    /// worker's parameters.
    pub restored: Option<ShardSnapshot>,
    /// How long the members of a restored (or promoted) shard have to come back once the first
    /// has.
    pub rejoin_grace: Duration,
    /// Modules this server has, for a backup's swaps.
    pub modules: Modules,
    /// Whether the task starts as a backup.
    pub backup: bool,
}

/// Who waits for a request's reply.
enum Waiter {
    Joined(Reply<Joined>),
    Pushed(Reply<PushOutcome>),
    Pulled(Reply<Served>),
    Done(Reply<()>),
}

/// The buffers, recording, logs and replication stream the node reports to.
struct Obs {
    shard: u32,
    pool: TensorPool,
    recorder: Option<Recorder>,
    /// A primary's replication stream: each op goes out as soon as the node stamps it, before
    /// the primary applies it, so the transfer overlaps the apply.
    link: Option<ReplicaLink>,
    /// A backup's confirmations to its primary: each goes out before the backup applies the op.
    confirm: Option<mpsc::UnboundedSender<u64>>,
}

type Recorder = recording::Writer<std::io::BufWriter<std::fs::File>>;

impl Obs {
    fn record(&mut self, write: impl FnOnce(&mut Recorder) -> std::io::Result<()>) {
        if let Some(r) = self.recorder.as_mut() {
            if let Err(e) = write(r) {
                tracing::warn!(shard = self.shard, "recording stopped: {e}");
                self.recorder = None;
            }
        }
    }
}

impl Observer for Obs {
    fn metric(&mut self, name: &str, value: f64) {
        tracing::debug!(shard = self.shard, name, value, "policy metric");
    }

    fn policy_failed(&mut self, error: &PolicyError) {
        tracing::warn!(shard = self.shard, "policy failed, shard recovered: {error}");
    }

    fn policy_quarantined(&mut self, policy: &str) {
        tracing::error!(
            shard = self.shard,
            policy,
            "policy quarantined; fallback rules in force until a swap"
        );
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

    fn send_now(&mut self, out: NodeOutput) -> Option<NodeOutput> {
        match out {
            NodeOutput::Replicate { stamped, payload } => match &self.link {
                Some(link) => {
                    if link.tx.send(Replicate::Op(stamped, payload)).is_err() {
                        // The writer is gone; acknowledgements wait until the coordinator drops
                        // the backup (it may not promote it while we still answer).
                        tracing::warn!(shard = self.shard, "the replication stream is closed");
                    }
                }
                None => self.pool.give(payload),
            },
            NodeOutput::Confirm { seq } => {
                if let Some(ack) = &self.confirm {
                    let _ = ack.send(seq);
                }
            }
            other => return Some(other),
        }
        None
    }
}

/// The task's moving parts around the node: who waits for what, and where outputs go.
struct Plumbing {
    node: ShardNode,
    obs: Obs,
    waiters: HashMap<Token, Waiter>,
    next_token: Token,
    controls: HashMap<WorkerId, mpsc::UnboundedSender<ControlMessage>>,
}

impl Plumbing {
    fn wait(&mut self, waiter: Waiter) -> Token {
        self.next_token += 1;
        self.waiters.insert(self.next_token, waiter);
        self.next_token
    }

    /// Carries out everything the node asked for.
    fn drain(&mut self) {
        let id = self.node.id();
        while let Some(out) = self.node.poll_output() {
            match out {
                NodeOutput::Reply { token, reply } => match (self.waiters.remove(&token), reply) {
                    (Some(Waiter::Joined(tx)), NodeReply::Joined(r)) => send(tx, r),
                    (Some(Waiter::Pushed(tx)), NodeReply::Pushed(r)) => send(tx, r),
                    (Some(Waiter::Pulled(tx)), NodeReply::Pulled(r)) => send(tx, r),
                    (Some(Waiter::Done(tx)), NodeReply::Done(r)) => send(tx, r),
                    (_, reply) => tracing::error!(shard = id, token, ?reply, "a reply nobody waits for"),
                },
                // `Obs::send_now` takes these as the node makes them; none is left for here.
                out @ (NodeOutput::Replicate { .. } | NodeOutput::Confirm { .. }) => {
                    if self.obs.send_now(out).is_some() {
                        tracing::error!(shard = id, "an op or a confirmation with nowhere to go");
                    }
                }
                NodeOutput::Control { worker, msg } => match self.controls.get(&worker) {
                    Some(tx) => {
                        let _ = tx.send(msg);
                    }
                    None => tracing::warn!(shard = id, worker, ?msg, "control for a worker not connected"),
                },
                NodeOutput::Left { worker } => {
                    if !self.node.is_backup() {
                        tracing::info!(shard = id, worker, "worker left");
                    }
                    self.controls.remove(&worker);
                }
            }
        }
    }
}

/// How often a shard task looks for a push its policy has held, or a pull it has parked, too
/// long.
const HELD_CHECK: Duration = Duration::from_secs(5);

/// How long a policy may hold a push or park a pull before the server reports it (a minute: a
/// synchronous rule keeps a worker waiting for a straggler's iteration, never for this long on
/// a healthy cluster). While some workers still make progress the no-progress rule does not
/// act (it needs every live worker waiting), so a rule that keeps one worker waiting for ever
/// is reported here.
const HELD_TOO_LONG_NS: u64 = 60_000_000_000;

/// The requests already reported by [`report_waiting`]: the push and the pull, each by worker
/// and iteration.
#[derive(Default)]
struct Reported {
    push: Option<(WorkerId, u64)>,
    pull: Option<(WorkerId, u64)>,
}

/// Reports, once per request, the push the node's policy has held longest and the pull it has
/// parked longest, if either has waited more than [`HELD_TOO_LONG_NS`]: its worker waits, and a
/// rule that never decides it hangs that worker silently otherwise.
fn report_waiting(node: &ShardNode, now: u64, reported: &mut Reported) {
    let Some(shard) = node.shard().filter(|_| !node.is_backup()) else { return };
    let policy = shard.policy().display_name();
    if let Some((worker, iteration, since)) = shard.oldest_held() {
        let held_ns = now.saturating_sub(since);
        if held_ns >= HELD_TOO_LONG_NS && reported.push != Some((worker, iteration)) {
            reported.push = Some((worker, iteration));
            tracing::warn!(
                shard = node.id(),
                policy,
                worker,
                iteration,
                held_s = held_ns / 1_000_000_000,
                "the policy has held this push for over a minute; its worker waits for the acknowledgement \
                 (a rule that never admits a push hangs its worker: `syncopate policy check` finds such rules)"
            );
        }
    }
    if let Some((worker, iteration, since)) = shard.oldest_parked() {
        let parked_ns = now.saturating_sub(since);
        if parked_ns >= HELD_TOO_LONG_NS && reported.pull != Some((worker, iteration)) {
            reported.pull = Some((worker, iteration));
            tracing::warn!(
                shard = node.id(),
                policy,
                worker,
                iteration,
                parked_s = parked_ns / 1_000_000_000,
                "the policy has parked this pull for over a minute; its worker waits for the parameters \
                 (a rule that never releases a pull hangs its worker: `syncopate policy check` finds such rules)"
            );
        }
    }
}

fn send<T>(tx: Reply<T>, r: Result<T, crate::shard::RequestError>) {
    let _ = tx.send(r);
}

impl ShardTask {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Sets the task's clock so that it reads `now_ns` now (a restored or promoted shard goes on
    /// from its snapshot's or its primary's time).
    fn continue_clock_from(&mut self, now_ns: u64) {
        self.epoch = Instant::now().checked_sub(Duration::from_nanos(now_ns)).unwrap_or(self.epoch);
    }

    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<ShardCmd>) {
        let id = self.cfg.shard;
        let cfg = NodeConfig {
            shard: self.cfg.clone(),
            rejoin_grace_ns: self.rejoin_grace.as_nanos() as u64,
            quiet: false,
        };
        let mut obs = Obs { shard: id, pool: self.pool.clone(), recorder: None, link: None, confirm: None };
        let (module, config) = (self.module.clone(), self.config.clone());
        let node = match self.restored.take() {
            Some(snap) => {
                // The clock goes on from the snapshot's, so parked pulls and timers keep their times.
                self.continue_clock_from(snap.now_ns());
                let (version, members) = (snap.version(), snap.workers().len());
                match ShardNode::restore(
                    cfg.clone(),
                    module.clone(),
                    config.clone(),
                    self.backup,
                    snap,
                    &mut obs,
                ) {
                    Ok(node) => {
                        tracing::info!(
                            shard = id,
                            version,
                            members,
                            backup = self.backup,
                            "shard restored from its checkpoint"
                        );
                        node
                    }
                    // The server checked every file before starting its shards; this is a
                    // module that refuses its own state.
                    Err(e) => {
                        tracing::error!(shard = id, "cannot restore the shard: {e}");
                        ShardNode::new(cfg, module, config, self.backup)
                    }
                }
            }
            None => ShardNode::new(cfg, module, config, self.backup),
        };
        if let (Some(path), false) = (&self.record, self.backup) {
            let file = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::File::create(path));
            match file.and_then(|f| recording::Writer::new(std::io::BufWriter::with_capacity(1 << 16, f))) {
                Ok(r) => obs.recorder = Some(r),
                Err(e) => tracing::warn!(shard = id, "cannot record to {}: {e}", path.display()),
            }
        }
        let mut p = Plumbing { node, obs, waiters: HashMap::new(), next_token: 0, controls: HashMap::new() };
        p.drain();
        // Every few seconds: a push the policy has held too long is reported, by name.
        let mut held_check = tokio::time::interval(HELD_CHECK);
        held_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut reported = Reported::default();
        loop {
            let timer = p.node.poll_timeout().map(|at| Duration::from_nanos(at.saturating_sub(self.now())));
            // Biased: a timer that is due fires before requests that arrive after it.
            let cmd = tokio::select! {
                biased;
                () = tokio::time::sleep(timer.unwrap_or(HELD_CHECK)), if timer.is_some() => {
                    p.node.handle_timeout(self.now(), &mut p.obs);
                    p.drain();
                    continue;
                }
                _ = held_check.tick() => {
                    report_waiting(&p.node, self.now(), &mut reported);
                    continue;
                }
                cmd = rx.recv() => cmd,
            };
            let Some(cmd) = cmd else { break };
            self.handle(cmd, &mut p);
            p.drain();
        }
        p.obs.record(recording::Writer::flush);
    }

    fn handle(&mut self, cmd: ShardCmd, p: &mut Plumbing) {
        let now = self.now();
        let id = self.cfg.shard;
        let obs = &mut p.obs;
        match cmd {
            ShardCmd::Join { worker, init, controls, reply } => {
                p.controls.insert(worker, controls);
                let token = p.wait(Waiter::Joined(reply));
                p.node.join(now, token, worker, init, &mut p.obs);
            }
            ShardCmd::Push { push, grad, reply } => {
                if let Some((owner, _)) = push.tasks.filter(|t| t.0 != push.worker) {
                    let (worker, iteration) = (push.worker, push.iteration);
                    tracing::debug!(shard = id, worker, owner, iteration, "moved tasks pushed");
                }
                let token = p.wait(Waiter::Pushed(reply));
                p.node.push(now, token, push, grad, &mut p.obs);
            }
            ShardCmd::Yielded { handover } => p.node.yielded(now, handover, obs),
            ShardCmd::Applied { applied } => p.node.applied(now, applied, obs),
            ShardCmd::Skip { worker, to, reply } => {
                let token = p.wait(Waiter::Done(reply));
                p.node.skip(now, token, worker, to, &mut p.obs);
            }
            ShardCmd::Pull { worker, iteration, reply } => {
                let token = p.wait(Waiter::Pulled(reply));
                p.node.pull(now, token, worker, iteration, &mut p.obs);
            }
            ShardCmd::Finished { report } => p.node.finished(now, report, obs),
            ShardCmd::Waiting { worker, iteration, waiting } => {
                p.node.waiting(now, worker, iteration, waiting, obs)
            }
            ShardCmd::Leave { worker, reason, reply } => {
                let token = reply.map(|r| p.wait(Waiter::Done(r)));
                p.node.leave(now, token, worker, reason, &mut p.obs);
            }
            ShardCmd::Lost { worker, reason } => p.node.lost(now, worker, reason, &mut p.obs),
            ShardCmd::Read { reply } => {
                let _ = reply.send(match p.node.shard() {
                    Some(s) => Ok((s.version(), Arc::clone(s.shared_values()))),
                    None => Err(crate::shard::RequestError::NoShardYet(id)),
                });
            }
            ShardCmd::Swap { to, reply } => {
                let token = p.wait(Waiter::Done(reply));
                p.node.swap(now, token, to, &mut p.obs);
            }
            ShardCmd::Conform(to) => {
                p.node.conform(now, to, &mut p.obs);
            }
            ShardCmd::Swapped { reply } => {
                let _ = reply.send(p.node.shard().map(|s| (s.swap().0, s.swap().1.to_vec())));
            }
            ShardCmd::CheckSwap { module, config, reply } => {
                let checked = p.node.check_swap(now, &module, &config);
                send(reply, checked.map_err(|e| crate::shard::RequestError::Swap(e.to_string())));
            }
            ShardCmd::Status { reply } => {
                let (applied, confirmed) = p.node.replication();
                let replicated = p.node.is_backup() || p.node.is_replicating();
                let replication = replicated.then_some(crate::net::proto::Replication {
                    backup: p.node.is_backup(),
                    applied,
                    confirmed,
                });
                let held_longest =
                    p.node.shard().and_then(|s| s.oldest_held()).map(|(worker, iteration, since)| {
                        crate::net::proto::HeldPush { worker, iteration, held_ns: now.saturating_sub(since) }
                    });
                let parked_longest =
                    p.node.shard().and_then(|s| s.oldest_parked()).map(|(worker, iteration, since)| {
                        crate::net::proto::ParkedPull {
                            worker,
                            iteration,
                            parked_ns: now.saturating_sub(since),
                        }
                    });
                let backoff_ms = p
                    .node
                    .shard()
                    .and_then(|s| s.backoff_until())
                    .map(|until| until.saturating_sub(now) / 1_000_000);
                let _ = reply.send(p.node.shard().map(|s| ShardStatus {
                    replication,
                    held_longest,
                    parked_longest,
                    backoff_ms,
                    ..ShardStatus::of(id, s)
                }));
            }
            ShardCmd::Snapshot { reply } => {
                let _ = reply.send(p.node.snapshot(now).map(|s| s.encode()));
            }
            ShardCmd::Replicated { stamped, grad, ack } => {
                p.obs.confirm = Some(ack);
                let modules = &self.modules;
                let find = |sha: &[u8; 32]| modules.lock().expect("not poisoned").get(sha).cloned();
                p.node.replicated(stamped, grad, find, &mut p.obs);
            }
            ShardCmd::ReplicaAcked { seq } => p.node.confirmed(seq),
            ShardCmd::AttachBackup { link, reply } => {
                let r = match p.node.attach_backup(now, &mut p.obs) {
                    Ok(None) => Ok(()),
                    Ok(Some((seq, snapshot))) => {
                        let _ = link.tx.send(Replicate::Init { seq, snapshot });
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                if r.is_ok() {
                    p.obs.link = Some(link);
                }
                let _ = reply.send(r);
            }
            ShardCmd::DropBackup => {
                p.obs.link = None;
                p.node.drop_backup();
            }
            ShardCmd::Promote { connected, reply } => {
                if p.node.is_backup() {
                    p.node.promote(&connected);
                    // The clock goes on from the last op's time, so timers and waits keep theirs.
                    self.continue_clock_from(p.node.last_now());
                }
                let _ = reply.send(Ok(()));
            }
        }
    }
}
