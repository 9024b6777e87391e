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
//!
//! **Replication.** A primary with a backup (a [`ReplicaLink`]) streams every change it applies
//! to the backup as an [`Op`], stamped with its sequence number and the time it was applied;
//! the backup's task (started with `backup` set) applies the same ops at the same times to its
//! own `Shard`, which the engine's determinism keeps equal to the primary's. A push
//! is acknowledged to its worker only once the backup has confirmed every op up to the one that
//! admitted it, so an acknowledged push survives the primary. Promoted, a backup becomes a
//! primary whose members rejoin as after a restore.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use syncopate_policy_sdk::abi::{Applied, IterationReport, LeaveReason, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::net::pool::TensorPool;
use crate::net::proto::{ControlMessage, ShardStatus};
use crate::recording::{self, PolicyStart};
use crate::runtime::{PolicyError, PolicyModule};
pub(crate) use crate::shard::Stamped;
use crate::shard::{
    AckGate, Handover, Op, Outcome, PullReply, Shard, ShardConfig, ShardError, ShardSink, ShardSnapshot,
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
    /// This backup becomes the shard's primary.
    Promote {
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
    /// Op numbering, and push acknowledgements held until the backup has their op.
    gate: AckGate<(Reply<PushOutcome>, PushOutcome)>,
    /// This task mirrors a primary: nothing goes back to anyone, and its time is the primary's.
    backup: bool,
}

type Recorder = recording::Writer<std::io::BufWriter<std::fs::File>>;

impl Waiting {
    /// Acknowledges a push now, or once the backup has the op that admitted it.
    fn ack(&mut self, reply: Reply<PushOutcome>, outcome: PushOutcome) {
        if let Some((reply, outcome)) = self.gate.ack((reply, outcome)) {
            let _ = reply.send(Ok(outcome));
        }
    }

    /// The backup has every op up to `seq`.
    fn confirm(&mut self, seq: u64) {
        self.gate.confirm(seq, |(reply, outcome)| {
            let _ = reply.send(Ok(outcome));
        });
    }

    /// The backup is gone: nothing waits for it any more.
    fn detach(&mut self) {
        self.gate.detach(|(reply, outcome)| {
            let _ = reply.send(Ok(outcome));
        });
    }

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
            self.ack(tx, PushOutcome::Applied);
        }
    }

    fn push_dropped(&mut self, _id: u64, worker: WorkerId, iteration: u64) {
        if let Some(tx) = self.pushes.remove(&(worker, iteration)) {
            self.ack(tx, PushOutcome::Dropped);
        }
    }

    fn control(&mut self, worker: WorkerId, msg: ControlMessage) {
        if self.backup {
            return;
        }
        match self.controls.get(&worker) {
            Some(tx) => {
                let _ = tx.send(msg);
            }
            None => tracing::warn!(shard = self.shard, worker, ?msg, "control for a worker not connected"),
        }
    }

    fn left(&mut self, worker: WorkerId) {
        if !self.backup {
            tracing::info!(shard = self.shard, worker, "worker left");
        }
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

/// Modules by SHA-256 on one server: where a backup finds the module of a swap its primary made.
pub(crate) type Modules = Arc<std::sync::Mutex<HashMap<[u8; 32], PolicyModule>>>;

/// The task's settings. The shard itself is created by the first join (which carries the
/// initial parameters), restored from a snapshot, or, on a backup, created by its primary's
/// [`Op::Create`].
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
    /// How long the members of a restored (or promoted) shard have to come back once the first
    /// has.
    pub rejoin_grace: Duration,
    /// Modules this server has, for a backup's swaps.
    pub modules: Modules,
    /// Whether the task starts as a backup.
    pub backup: bool,
}

/// Members of a restored or promoted shard that have not reconnected yet, and until when they
/// may.
struct Awaiting {
    workers: BTreeSet<WorkerId>,
    deadline: Instant,
}

/// The task's moving parts.
struct State {
    shard: Option<Shard>,
    w: Waiting,
    awaiting: Option<Awaiting>,
    link: Option<ReplicaLink>,
    /// A backup's last op time (a promoted backup's clock goes on from it).
    last_now: u64,
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

    /// The members a restored or promoted shard waits for: a minute for the first to come back
    /// (or the rejoin grace, if longer), then the grace for the rest.
    fn awaiting(&self, members: BTreeSet<WorkerId>) -> Option<Awaiting> {
        let deadline = Instant::now() + self.rejoin_grace.max(Duration::from_secs(60));
        (!members.is_empty()).then_some(Awaiting { workers: members, deadline })
    }

    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<ShardCmd>) {
        let backup = self.backup;
        let w = Waiting { shard: self.cfg.shard, pool: self.pool.clone(), backup, ..Waiting::default() };
        let mut st = State { shard: None, w, awaiting: None, link: None, last_now: 0 };
        if let Some(snap) = self.restored.take() {
            // The clock goes on from the snapshot's, so parked pulls and timers keep their times.
            self.continue_clock_from(snap.now_ns());
            st.last_now = snap.now_ns();
            let members: BTreeSet<WorkerId> = snap.workers().iter().map(|c| c.worker).collect();
            let (version, id) = (snap.version(), self.cfg.shard);
            match Shard::restore(self.cfg.clone(), snap, &self.module, &mut st.w) {
                Ok(s) => {
                    tracing::info!(
                        shard = id,
                        version,
                        members = members.len(),
                        backup = self.backup,
                        "shard restored from its checkpoint"
                    );
                    st.shard = Some(s);
                    if !self.backup {
                        st.awaiting = self.awaiting(members);
                    }
                }
                // The server checked every file before starting its shards; this is a module
                // that refuses its own state.
                Err(e) => tracing::error!(shard = id, "cannot restore the shard: {e}"),
            }
        }
        if let (Some(path), false) = (&self.record, self.backup) {
            let file = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::File::create(path));
            match file.and_then(|f| recording::Writer::new(std::io::BufWriter::with_capacity(1 << 16, f))) {
                Ok(r) => st.w.recorder = Some(r),
                Err(e) => tracing::warn!(shard = self.cfg.shard, "cannot record to {}: {e}", path.display()),
            }
        }
        loop {
            // A backup's time is its primary's: its timers fire on the primary's ops.
            let timer = st.shard.as_ref().and_then(|s| s.next_timer_ns()).filter(|_| !st.w.backup);
            let gone = st.awaiting.as_ref().map(|a| a.deadline);
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
                            let now = self.now();
                            if st.shard.as_ref().and_then(Shard::next_timer_ns).is_some_and(|t| t <= now) {
                                self.step(&mut st, Op::Advance, Vec::new(), now);
                            }
                            if let Some(a) = st.awaiting.take_if(|a| a.deadline <= Instant::now()) {
                                for worker in a.workers {
                                    tracing::warn!(shard = self.cfg.shard, worker, "worker did not come back; it leaves");
                                    let op = Op::Leave { worker, reason: LeaveReason::TimedOut };
                                    self.step(&mut st, op, Vec::new(), self.now());
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
            self.handle(cmd, &mut st);
        }
        st.w.record(recording::Writer::flush);
    }

    /// Applies an op (streaming it to the backup first, if there is one).
    fn step(&mut self, st: &mut State, op: Op, grad: Vec<f32>, now: u64) -> Option<Outcome> {
        if st.shard.is_none() && op != Op::Create {
            return None;
        }
        let seq = st.w.gate.stamp();
        if let Some(link) = &st.link {
            let payload = match op {
                // The shard consumes its gradient, so the stream gets a copy, in a buffer from the
                // pool (the writer gives it back once QUIC has it).
                Op::Push { .. } | Op::Create => {
                    let mut copy = self.pool.take(grad.len());
                    copy.copy_from_slice(&grad);
                    copy
                }
                _ => Vec::new(),
            };
            let stamped = Stamped { seq, now_ns: now, op: op.clone() };
            if link.tx.send(Replicate::Op(stamped, payload)).is_err() {
                // The writer is gone; acknowledgements wait until the coordinator drops the
                // backup (it may not promote it while we still answer it).
                tracing::warn!(shard = self.cfg.shard, "the replication stream is closed");
            }
        }
        self.apply(st, op, grad, now)
    }

    /// What an op does to the task's shard (the engine's [`Shard::apply_op`], shared by primary
    /// and backup); `None` when there is no shard yet.
    fn apply(&mut self, st: &mut State, op: Op, grad: Vec<f32>, now: u64) -> Option<Outcome> {
        let w = &mut st.w;
        if let Op::Create = op {
            let created = Shard::new(self.cfg.clone(), grad, &self.module, &self.config, w).map(|s| {
                tracing::info!(
                    shard = self.cfg.shard,
                    len = s.values().len(),
                    backup = st.w.backup,
                    "shard created"
                );
                st.shard = Some(s);
            });
            return Some(Outcome::Created(created.map_err(|e| e.to_string())));
        }
        let s = st.shard.as_mut()?;
        let modules = &self.modules;
        let swap = match &op {
            Op::Swap { config, .. } => Some(config.clone()),
            _ => None,
        };
        let mut chosen = None;
        let outcome = s.apply_op(
            op,
            grad,
            now,
            |sha| {
                chosen = modules.lock().expect("not poisoned").get(sha).cloned();
                chosen.clone()
            },
            w,
        );
        if let (Outcome::Swapped(Ok(())), Some(config), Some(module)) = (&outcome, swap, chosen) {
            self.module = module;
            self.config = config;
        }
        Some(outcome)
    }

    fn handle(&mut self, cmd: ShardCmd, st: &mut State) {
        let now = self.now();
        let id = self.cfg.shard;
        let not_yet = || format!("shard {id} has no parameters yet (a worker must join with them first)");
        match cmd {
            ShardCmd::Join { worker, init, controls, reply } => {
                let model_len = init.len();
                if st.shard.is_none() {
                    if init.is_empty() {
                        let _ = reply.send(Err(not_yet()));
                        return;
                    }
                    if let Some(Outcome::Created(Err(e))) = self.step(st, Op::Create, init, now) {
                        let _ = reply.send(Err(format!("shard {id} cannot start its policy: {e}")));
                        return;
                    }
                }
                let shard = st.shard.as_mut().expect("created above");
                if model_len != 0 && model_len != shard.values().len() {
                    let _ = reply.send(Err(format!(
                        "shard {id} holds {} parameters, the worker's slice has {model_len}",
                        shard.values().len(),
                    )));
                    return;
                }
                // A member coming back (after a restore or a failover, or a retry) rejoins:
                // its policy hears nothing.
                st.w.controls.insert(worker, controls);
                if shard.is_member(worker) {
                    if let Some(a) = st.awaiting.as_mut() {
                        a.workers.remove(&worker);
                        if a.workers.is_empty() {
                            st.awaiting = None;
                        } else {
                            a.deadline = a.deadline.min(Instant::now() + self.rejoin_grace);
                        }
                    }
                    let next = shard.rejoin(worker).map_err(|e| e.to_string());
                    if let Ok(next) = next {
                        tracing::info!(shard = id, worker, next, "worker rejoined");
                    }
                    let _ = reply.send(next.map(Joined::Rejoined));
                    return;
                }
                let joined = match self.step(st, Op::Join { worker }, Vec::new(), now) {
                    Some(Outcome::Joined(r)) => r.map(Joined::Fresh).map_err(|e| e.to_string()),
                    _ => Err(not_yet()),
                };
                let _ = reply.send(joined);
            }
            ShardCmd::Push { worker, iteration, samples, based_on, grad, tasks: Some(tasks), reply } => {
                if st.shard.is_none() {
                    let _ = reply.send(Err(not_yet()));
                    return;
                }
                let op = Op::Push { worker, iteration, samples, based_on, tasks: Some(tasks) };
                match self.step(st, op, grad, now) {
                    Some(Outcome::Pushed(Ok(()))) => st.w.ack(reply, PushOutcome::Applied),
                    Some(Outcome::Pushed(Err(ShardError::Duplicate { .. }))) => {
                        st.w.ack(reply, PushOutcome::Duplicate)
                    }
                    Some(Outcome::Pushed(Err(e))) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                    _ => {
                        let _ = reply.send(Err(not_yet()));
                    }
                }
                if tasks.0 != worker {
                    tracing::debug!(shard = id, worker, owner = tasks.0, iteration, "moved tasks pushed");
                }
            }
            ShardCmd::Push { worker, iteration, samples, based_on, grad, tasks: None, reply } => {
                if st.shard.is_none() {
                    let _ = reply.send(Err(not_yet()));
                    return;
                }
                if st.w.pushes.contains_key(&(worker, iteration)) {
                    let _ = reply
                        .send(Err(format!("worker {worker} already has a push for {iteration} waiting")));
                    return;
                }
                st.w.pushes.insert((worker, iteration), reply);
                let op = Op::Push { worker, iteration, samples, based_on, tasks: None };
                match self.step(st, op, grad, now) {
                    Some(Outcome::Pushed(Ok(()))) => {}
                    // Held by the policy: the acknowledgement waits for its decision.
                    Some(Outcome::Pushed(Err(ShardError::Duplicate { .. })))
                        if st.shard.as_ref().is_some_and(|s| s.is_push_held(worker, iteration)) => {}
                    Some(Outcome::Pushed(Err(ShardError::Duplicate { .. }))) => {
                        tracing::debug!(
                            shard = id,
                            worker,
                            iteration,
                            "duplicate push acknowledged, not applied"
                        );
                        if let Some(reply) = st.w.pushes.remove(&(worker, iteration)) {
                            st.w.ack(reply, PushOutcome::Duplicate);
                        }
                    }
                    Some(Outcome::Pushed(Err(e))) => {
                        if let Some(reply) = st.w.pushes.remove(&(worker, iteration)) {
                            let _ = reply.send(Err(e.to_string()));
                        }
                    }
                    _ => {}
                }
            }
            ShardCmd::Yielded { handover } => {
                if let Some(Outcome::Done(Err(e))) = self.step(st, Op::Yielded { handover }, Vec::new(), now)
                {
                    tracing::debug!(shard = id, "task hand-over not reported: {e}");
                }
            }
            ShardCmd::Applied { applied } => {
                if let Some(Outcome::Done(Err(e))) = self.step(st, Op::Applied { applied }, Vec::new(), now) {
                    tracing::debug!(shard = id, "control acknowledgement ignored: {e}");
                }
            }
            ShardCmd::Pull { worker, iteration, reply } => {
                if st.shard.is_none() {
                    let _ = reply.send(Err(not_yet()));
                    return;
                }
                if st.w.pulls.contains_key(&(worker, iteration)) {
                    let _ = reply
                        .send(Err(format!("worker {worker} already has a pull for {iteration} waiting")));
                    return;
                }
                st.w.pulls.insert((worker, iteration), reply);
                if let Some(Outcome::Done(Err(e))) =
                    self.step(st, Op::Pull { worker, iteration }, Vec::new(), now)
                {
                    if let Some(reply) = st.w.pulls.remove(&(worker, iteration)) {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            ShardCmd::Skip { worker, to, reply } => {
                let r = match self.step(st, Op::Skip { worker, to }, Vec::new(), now) {
                    Some(Outcome::Done(r)) => r.map_err(|e| e.to_string()),
                    _ => Err(not_yet()),
                };
                let _ = reply.send(r);
            }
            ShardCmd::Finished { report } => {
                if let Some(Outcome::Done(Err(e))) = self.step(st, Op::Finished { report }, Vec::new(), now) {
                    tracing::debug!(shard = id, "iteration report ignored: {e}");
                }
            }
            ShardCmd::Leave { worker, reason, reply } => {
                if st.shard.is_none() {
                    st.w.left(worker);
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(()));
                    }
                    return;
                }
                // A goodbye waits for the worker's tasks still out (its last iterations are
                // incomplete without them), so nothing it trained is lost.
                let result = match reason {
                    LeaveReason::Finished => match self.step(st, Op::Goodbye { worker }, Vec::new(), now) {
                        Some(Outcome::Left(r)) => r,
                        _ => Ok(true),
                    },
                    _ => match self.step(st, Op::Leave { worker, reason }, Vec::new(), now) {
                        Some(Outcome::Done(r)) => r.map(|()| true),
                        _ => Ok(true),
                    },
                };
                match (result, reply) {
                    (Ok(false), Some(reply)) => {
                        st.w.goodbyes.insert(worker, reply);
                    }
                    (Ok(_), Some(reply)) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Err(e), Some(reply)) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                    (_, None) => {}
                }
            }
            ShardCmd::Read { reply } => {
                let _ = reply.send(match st.shard.as_ref() {
                    Some(s) => Ok((s.version(), Arc::clone(s.shared_values()))),
                    None => Err(not_yet()),
                });
            }
            ShardCmd::Swap { module, config, reply } => {
                if st.w.backup {
                    // A backup swaps when its primary's op says, not when its server commits.
                    let _ = reply.send(Ok(()));
                    return;
                }
                if st.shard.is_none() {
                    self.module = module;
                    self.config = config;
                    let _ = reply.send(Ok(()));
                    return;
                }
                // The prepare registered the module in `modules`, where `apply` finds it by hash.
                let r = match self.step(st, Op::Swap { sha256: module.sha256(), config }, Vec::new(), now) {
                    Some(Outcome::Swapped(r)) => r,
                    _ => Err(not_yet()),
                };
                let _ = reply.send(r);
            }
            ShardCmd::Status { reply } => {
                let replicated = st.w.backup || st.link.is_some();
                let replication = replicated.then_some(crate::net::proto::Replication {
                    backup: st.w.backup,
                    applied: st.w.gate.seq(),
                    confirmed: st.w.gate.confirmed(),
                });
                let _ = reply
                    .send(st.shard.as_ref().map(|s| ShardStatus { replication, ..ShardStatus::of(id, s) }));
            }
            ShardCmd::Snapshot { reply } => {
                let result = match st.shard.as_mut() {
                    Some(s) => s.snapshot(now).map(|snap| snap.encode()).map_err(|e| e.to_string()),
                    None => Err(not_yet()),
                };
                let _ = reply.send(result);
            }
            ShardCmd::Replicated { stamped, grad, ack } => {
                if !st.w.backup {
                    // Promoted: the old primary's late ops are not ours, and are not confirmed,
                    // so it acknowledges none of them.
                    tracing::warn!(
                        shard = id,
                        seq = stamped.seq,
                        "an op from the old primary after the promotion; ignored"
                    );
                    return;
                }
                let _ = ack.send(stamped.seq);
                st.w.gate.follow(stamped.seq);
                st.last_now = stamped.now_ns;
                if self.apply(st, stamped.op, grad, stamped.now_ns).is_none() {
                    tracing::error!(
                        shard = id,
                        seq = stamped.seq,
                        "an op arrived before the shard was created"
                    );
                }
            }
            ShardCmd::ReplicaAcked { seq } => st.w.confirm(seq),
            ShardCmd::AttachBackup { link, reply } => {
                if st.w.backup {
                    let _ = reply.send(Err(format!("shard {id} is a backup here")));
                    return;
                }
                if st.w.gate.seq() > 0 {
                    // Mid-run: the backup cannot replay the ops it missed, and a policy's
                    // instance cannot be copied. So this shard restarts itself from its own
                    // snapshot, as after a policy failure, and the backup starts from the same
                    // snapshot: the two are equal again, and the ops keep them so.
                    let Some(s) = st.shard.as_mut() else {
                        let _ = reply.send(Err(not_yet()));
                        return;
                    };
                    let snapshot = match s.snapshot(now) {
                        Ok(snap) => snap.encode(),
                        Err(e) => {
                            let _ = reply.send(Err(format!("shard {id} cannot snapshot its policy: {e}")));
                            return;
                        }
                    };
                    let snap = ShardSnapshot::decode(&snapshot).expect("just encoded");
                    // Requests the restart hands the policy again are acknowledged only once
                    // the backup holds the snapshot: it is op `seq` of the stream.
                    let seq = st.w.gate.stamp();
                    st.w.gate.attach(seq - 1);
                    match Shard::restore(self.cfg.clone(), snap, &self.module, &mut st.w) {
                        Ok(restarted) => st.shard = Some(restarted),
                        Err(e) => {
                            st.w.detach();
                            let _ =
                                reply.send(Err(format!("shard {id} cannot restart from its snapshot: {e}")));
                            return;
                        }
                    }
                    let _ = link.tx.send(Replicate::Init { seq, snapshot });
                    tracing::warn!(shard = id, seq, "new backup attached from a snapshot");
                } else {
                    st.w.gate.attach(st.w.gate.seq());
                }
                st.link = Some(link);
                let _ = reply.send(Ok(()));
            }
            ShardCmd::DropBackup => {
                if st.link.take().is_some() {
                    tracing::warn!(shard = id, "the backup is gone; the shard runs without one");
                }
                st.w.detach();
            }
            ShardCmd::Promote { reply } => {
                if !st.w.backup {
                    let _ = reply.send(Ok(()));
                    return;
                }
                // The clock goes on from the last op's time, so timers and waits keep theirs.
                self.continue_clock_from(st.last_now);
                st.w.backup = false;
                let members: BTreeSet<WorkerId> = st
                    .shard
                    .as_ref()
                    .map(|s| s.workers().iter().map(|c| c.worker).collect())
                    .unwrap_or_default();
                tracing::warn!(shard = id, members = members.len(), "promoted to primary");
                st.awaiting = self.awaiting(members);
                let _ = reply.send(Ok(()));
            }
        }
    }
}
