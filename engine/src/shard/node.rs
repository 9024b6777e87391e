//! One shard's server-side protocol as a sans-IO machine: what a server does with a shard's
//! requests, replication and failover, with no channels, sockets, tasks or clock.
//!
//! A [`ShardNode`] wraps a [`Shard`] (created by the first join, restored from a snapshot, or,
//! on a backup, created by its primary's [`Op::Create`]) and adds what a replicated server
//! needs around it:
//! - **replies by token.** Each request carries a [`Token`] of its driver's choosing, and is
//!   answered by a [`NodeOutput::Reply`] with that token, now or later (a parked pull, a held
//!   push). Errors stay typed ([`RequestError`]) until the driver writes them on the wire.
//!   A worker has at most one pull and one push per iteration waiting.
//! - **duplicates.** A push the shard already has (a retry after a failover, an iteration
//!   redone after a restore) is acknowledged as [`PushOutcome::Duplicate`], not applied again;
//!   if the policy holds it, the acknowledgement waits for the policy's decision.
//! - **replication.** A primary with a backup stamps every change as an [`Op`] and hands it out
//!   ([`NodeOutput::Replicate`]) before applying it; a push's acknowledgement is held by the
//!   [`AckGate`] until the backup has confirmed the op that admitted it ([`confirmed`]), and a
//!   join's answer until the backup has every op so far (the join included), so that a worker
//!   that goes on is known to a promoted backup. A
//!   backup applies its primary's ops ([`replicated`]) at the primary's times, answers nobody,
//!   and confirms each ([`NodeOutput::Confirm`]). A backup attached mid-run starts from a
//!   snapshot that the primary restarts itself from ([`attach_backup`]).
//! - **promotion and returning members.** A shard restored from a checkpoint waits for its
//!   members to rejoin: a minute for the first (or the rejoin grace, if longer), then the grace
//!   for the rest. A promoted backup waits for each member until the driver says its connection
//!   ended ([`ShardNode::lost`]), or a minute. Those that do not come back are made to leave;
//!   one that comes back later joins afresh, renumbered ([`Joined::Fresh`]).
//! - **time.** Every input carries the driver's time in nanoseconds; [`poll_timeout`] says
//!   when the node wants [`handle_timeout`] (a policy timer, on a primary; a rejoin deadline).
//!
//! The tokio server (`host/src/server/shard_task.rs`) and the simulator (`host/src/lab/sim`)
//! both drive this machine, so a simulated failover is the cluster's own.
//!
//! [`confirmed`]: ShardNode::confirmed
//! [`replicated`]: ShardNode::replicated
//! [`attach_backup`]: ShardNode::attach_backup
//! [`poll_timeout`]: ShardNode::poll_timeout
//! [`handle_timeout`]: ShardNode::handle_timeout

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use syncopate_policy_sdk::abi::{Applied, Envelope, IterationReport, LeaveReason, RequestId, WorkerId};

use super::{
    AckGate, ClockRaise, ControlMessage, Handover, Observer, Op, Outcome, PullReply, PushHeader, Shard,
    ShardConfig, ShardError, ShardSink, ShardSnapshot, Stamped,
};
use crate::recording::PolicyStart;
use crate::runtime::{PolicyError, PolicyModule};

/// A driver's name for a request, returned with its reply.
pub type Token = u64;

/// What a served pull sends back.
#[derive(Clone, Debug)]
pub struct Served {
    /// The worker's clock at the shard.
    pub clock: u64,
    /// The shard's version (optimizer steps) of these parameters.
    pub version: u64,
    /// How long the pull waited at the shard.
    pub waited_ns: u64,
    /// The local steps the worker takes in this iteration (0: it pushes a gradient).
    pub local_steps: u32,
    /// The codec to send the parameters in.
    pub codec: crate::codec::Codec,
    /// The parameters as they were when served, shared (no copy).
    pub values: Arc<Vec<f32>>,
}

/// What became of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Admitted: applied, or counted in its aggregate or its iteration's tasks.
    Applied,
    /// Acknowledged, but the policy dropped it.
    Dropped,
    /// The shard already had it: acknowledged, not applied again.
    Duplicate,
}

/// How a worker joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Joined {
    /// A new member, starting at clock `clock`. A worker this shard had as a member before (one
    /// a promoted shard dropped when it did not come back within the rejoin grace, say) was
    /// expected to push iteration `next` next, in the numbering it had here (0 if it never was
    /// a member): its iterations from `next` on are now numbered from `clock`, and those below
    /// `next` were all applied. A worker joining again after losing its primary renumbers so
    /// (see `WorkerClient`); a worker starting out just starts at `clock`.
    Fresh {
        /// The clock it starts at.
        clock: u64,
        /// The iteration it was expected to push next when it last was a member.
        next: u64,
    },
    /// A member, back (to a restored or promoted shard, or asking where it stands): the next
    /// iteration the shard expects from it, and its clock there. The two differ by the raises
    /// of hot swaps' levellings since it joined.
    Rejoined {
        /// The next iteration the shard expects from it.
        next: u64,
        /// Its clock.
        clock: u64,
    },
}

/// Why a request was refused. It crosses the wire as it is (a `DataResponse::Refused`), so a
/// worker can tell one refusal from another (an iteration out of order from a gradient with a
/// NaN).
#[derive(Clone, Debug, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum RequestError {
    /// The shard has no parameters yet.
    #[error("shard {0} has no parameters yet (a worker must join with them first)")]
    NoShardYet(u32),
    /// The first join's parameters did not start the policy.
    #[error("shard {shard} cannot start its policy: {reason}")]
    CannotStart {
        /// The shard.
        shard: u32,
        /// Why.
        reason: String,
    },
    /// The shard's policy could not export its state for a snapshot.
    #[error("shard {shard} cannot snapshot its policy: {reason}")]
    Snapshot {
        /// The shard.
        shard: u32,
        /// Why.
        reason: String,
    },
    /// A joining worker's slice of the model has another length than the shard.
    #[error("shard {shard} holds {holds} parameters, the worker's slice has {got}")]
    WrongSlice {
        /// The shard.
        shard: u32,
        /// Its parameters.
        holds: usize,
        /// The worker's.
        got: usize,
    },
    /// The worker already has such a request waiting for this iteration.
    #[error("worker {worker} already has a {what} for {iteration} waiting")]
    AlreadyWaiting {
        /// The worker.
        worker: WorkerId,
        /// The iteration.
        iteration: u64,
        /// Which request.
        what: Waiting,
    },
    /// The shard refused it.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A swap failed (the new policy refused, or its module is missing).
    #[error("{0}")]
    Swap(String),
    /// A backup takes no requests but its primary's ops.
    #[error("shard {0} is a backup here")]
    Backup(u32),
    /// The worker left (or was dropped) while its request waited.
    #[error("worker {0} left shard {1} while its request waited")]
    Left(WorkerId, u32),
    /// The shard stopped (its server is shutting down, or the shard moved away) before it
    /// answered.
    #[error("shard {0} stopped before it answered")]
    Stopped(u32),
}

/// Which request of a worker's is waiting ([`RequestError::AlreadyWaiting`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Waiting {
    /// A pull.
    Pull,
    /// A push.
    Push,
}

impl std::fmt::Display for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Waiting::Pull => "pull",
            Waiting::Push => "push",
        })
    }
}

/// The answer to a request.
#[derive(Debug)]
pub enum Reply {
    /// To a join.
    Joined(Result<Joined, RequestError>),
    /// To a push.
    Pushed(Result<PushOutcome, RequestError>),
    /// To a pull.
    Pulled(Result<Served, RequestError>),
    /// To anything else.
    Done(Result<(), RequestError>),
}

/// What the node asks its driver to do.
#[derive(Debug)]
pub enum NodeOutput {
    /// Answer request `token`.
    Reply {
        /// The request.
        token: Token,
        /// The answer.
        reply: Reply,
    },
    /// Send this op to the backup (a primary with one), in order; `payload` is a push's
    /// gradient or a creation's parameters, in a buffer from the [`Observer`].
    Replicate {
        /// The op.
        stamped: Stamped,
        /// Its tensor.
        payload: Vec<f32>,
    },
    /// Tell the primary this backup holds every op up to `seq`.
    Confirm {
        /// The op.
        seq: u64,
    },
    /// A control message for a worker (a primary's only).
    Control {
        /// The worker.
        worker: WorkerId,
        /// The message.
        msg: ControlMessage,
    },
    /// A worker left the shard: nothing more goes to it.
    Left {
        /// The worker.
        worker: WorkerId,
    },
}

/// An observer that keeps nothing.
#[derive(Debug, Default)]
pub struct Quiet;

impl Observer for Quiet {}

/// How a node runs, besides its shard's configuration.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The shard's configuration.
    pub shard: ShardConfig,
    /// How long the members of a restored shard have to come back once the first has, in
    /// nanoseconds. A promoted shard gives its members no such grace: they are its backup's,
    /// alive and connected to this server until [`ShardNode::lost`] says otherwise, and may be
    /// in the middle of a long iteration.
    pub rejoin_grace_ns: u64,
    /// Log the node's events (creation, rejoins, promotion, departures, backups attached and
    /// dropped) at debug level, not info and warn: for the simulator, whose nodes' events are
    /// the simulated run's subject, not news for whoever runs it.
    pub quiet: bool,
}

/// Logs a node's event at `$level`, or at debug level if the node is quiet.
macro_rules! event {
    ($node:expr, $level:ident, $($arg:tt)+) => {
        if $node.cfg.quiet {
            tracing::debug!($($arg)+)
        } else {
            tracing::$level!($($arg)+)
        }
    };
}

/// How long a restored shard waits for its first member to come back, at least, and a promoted
/// one for each member connected to its server (a backstop: a member whose connection ends
/// leaves at once, see [`ShardNode::lost`]; one away longer is dropped, and taken back afresh,
/// renumbered, when it returns: see [`Joined::Fresh`]).
const FIRST_REJOIN_NS: u64 = 60_000_000_000;

/// Members of a restored or promoted shard that have not rejoined yet, each with the time by
/// which it may.
#[derive(Debug)]
struct Awaiting {
    workers: BTreeMap<WorkerId, u64>,
    /// Whether every deadline shortens to the rejoin grace once a member is back (a restored
    /// shard's; a promoted one waits for its members' connections to end instead).
    shortens: bool,
}

/// Requests waiting for the shard, and what the shard said.
#[derive(Debug, Default)]
struct Pending {
    shard: u32,
    backup: bool,
    pulls: BTreeMap<(WorkerId, u64), Token>,
    pushes: BTreeMap<(WorkerId, u64), Token>,
    /// Goodbyes the shard has not completed yet (tasks of the worker's were still out).
    goodbyes: BTreeMap<WorkerId, Token>,
    /// Op numbering, and the replies held until the backup has the op they follow: push
    /// acknowledgements and joins.
    gate: AckGate<(Token, Reply)>,
    out: VecDeque<NodeOutput>,
}

impl Pending {
    /// Acknowledges a push now, or once the backup has the op that admitted it.
    fn ack(&mut self, token: Token, outcome: PushOutcome) {
        self.gated(token, Reply::Pushed(Ok(outcome)));
    }

    /// Sends a reply now, or once the backup has every op so far.
    fn gated(&mut self, token: Token, reply: Reply) {
        if let Some((token, reply)) = self.gate.ack((token, reply)) {
            self.reply(token, reply);
        }
    }

    fn reply(&mut self, token: Token, reply: Reply) {
        self.out.push_back(NodeOutput::Reply { token, reply });
    }

    fn release(&mut self, open: impl FnOnce(&mut AckGate<(Token, Reply)>, &mut Vec<(Token, Reply)>)) {
        let mut released = Vec::new();
        open(&mut self.gate, &mut released);
        for (token, reply) in released {
            self.reply(token, reply);
        }
    }
}

/// The shard's sink while the node calls it: protocol to the node's bookkeeping, the rest to
/// the driver's observer.
struct Tap<'a> {
    pending: &'a mut Pending,
    obs: &'a mut dyn Observer,
}

impl ShardSink for Tap<'_> {
    fn pull_served(&mut self, r: PullReply<'_>) {
        if let Some(token) = self.pending.pulls.remove(&(r.worker, r.iteration)) {
            let served = Served {
                clock: r.clock,
                version: r.version,
                waited_ns: r.waited_ns,
                local_steps: r.local_steps,
                codec: r.codec,
                values: Arc::clone(r.values),
            };
            self.pending.reply(token, Reply::Pulled(Ok(served)));
        }
    }

    fn push_acked(&mut self, _id: RequestId, worker: WorkerId, iteration: u64) {
        if let Some(token) = self.pending.pushes.remove(&(worker, iteration)) {
            self.pending.ack(token, PushOutcome::Applied);
        }
    }

    fn push_dropped(&mut self, _id: RequestId, worker: WorkerId, iteration: u64) {
        if let Some(token) = self.pending.pushes.remove(&(worker, iteration)) {
            self.pending.ack(token, PushOutcome::Dropped);
        }
    }

    fn control(&mut self, worker: WorkerId, msg: ControlMessage) {
        if !self.pending.backup {
            self.pending.out.push_back(NodeOutput::Control { worker, msg });
        }
    }

    fn left(&mut self, worker: WorkerId) {
        let p = &mut *self.pending;
        let shard = p.shard;
        let waiting: Vec<(WorkerId, u64)> =
            p.pulls.range((worker, 0)..=(worker, u64::MAX)).map(|(k, _)| *k).collect();
        for key in waiting {
            if let Some(token) = p.pulls.remove(&key) {
                p.reply(token, Reply::Pulled(Err(RequestError::Left(worker, shard))));
            }
        }
        if let Some(token) = p.goodbyes.remove(&worker) {
            p.reply(token, Reply::Done(Ok(())));
        }
        p.out.push_back(NodeOutput::Left { worker });
    }
}

impl Observer for Tap<'_> {
    fn metric(&mut self, name: &str, value: f64) {
        self.obs.metric(name, value);
    }

    fn policy_failed(&mut self, error: &PolicyError) {
        self.obs.policy_failed(error);
    }

    fn policy_quarantined(&mut self, policy: &str) {
        self.obs.policy_quarantined(policy);
    }

    fn policy_started(&mut self, start: &PolicyStart<'_>) {
        self.obs.policy_started(start);
    }

    fn policy_called(&mut self, env: &Envelope, answer: Result<&[u8], &PolicyError>) {
        self.obs.policy_called(env, answer);
    }

    fn recycle(&mut self, buffer: Vec<f32>) {
        self.obs.recycle(buffer);
    }

    fn buffer(&mut self, len: usize) -> Vec<f32> {
        self.obs.buffer(len)
    }

    fn send_now(&mut self, out: NodeOutput) -> Option<NodeOutput> {
        self.obs.send_now(out)
    }
}

/// A committed swap as one shard takes it ([`ShardNode::swap`], [`ShardNode::conform`]).
#[derive(Clone, Debug)]
pub struct SwapTo {
    /// The module.
    pub module: PolicyModule,
    /// Its configuration on this shard.
    pub config: Vec<(String, String)>,
    /// How far it raises each worker's clock: the levelling the cluster agreed on (see
    /// [`Frontier`](super::Frontier)).
    pub raise: Vec<ClockRaise>,
    /// The swap's number.
    pub swap: u64,
}

/// One shard on a server, primary or backup: the module's doc.
#[derive(Debug)]
pub struct ShardNode {
    cfg: NodeConfig,
    module: PolicyModule,
    config: Vec<(String, String)>,
    shard: Option<Shard>,
    pending: Pending,
    awaiting: Option<Awaiting>,
    /// A primary streaming its ops to a backup.
    replicating: bool,
    /// The time of the last op applied (a backup's: its primary's).
    last_now: u64,
    /// Whether a backup attached before the first op may start as this node started, without
    /// a snapshot: its shard not created yet, or created or restored (a checkpoint) from what
    /// its backups start from too. Used by the first attachment; a promoted backup never has
    /// it (its state came from a primary's stream or snapshot, which a new backup lacks).
    shared_start: bool,
}

impl ShardNode {
    /// A node whose shard the first join (or, on a backup, its primary's first op) creates.
    pub fn new(cfg: NodeConfig, module: PolicyModule, config: Vec<(String, String)>, backup: bool) -> Self {
        let pending = Pending { shard: cfg.shard.shard, backup, ..Pending::default() };
        ShardNode {
            cfg,
            module,
            config,
            shard: None,
            pending,
            awaiting: None,
            replicating: false,
            last_now: 0,
            shared_start: true,
        }
    }

    /// A node whose shard is restored from `snap` (a checkpoint). A primary then waits for the
    /// snapshot's members to rejoin. Its time goes on from the snapshot's (`now_ns`).
    pub fn restore(
        cfg: NodeConfig,
        module: PolicyModule,
        config: Vec<(String, String)>,
        backup: bool,
        snap: ShardSnapshot,
        obs: &mut dyn Observer,
    ) -> Result<Self, crate::shard::SnapshotError> {
        let mut node = ShardNode::new(cfg, module, config, backup);
        let now = snap.now_ns();
        let until = now + node.cfg.rejoin_grace_ns.max(FIRST_REJOIN_NS);
        let members: BTreeMap<WorkerId, u64> = snap.workers().iter().map(|c| (c.worker, until)).collect();
        let mut tap = Tap { pending: &mut node.pending, obs };
        node.shard = Some(Shard::restore(node.cfg.shard.clone(), snap, &node.module, &mut tap)?);
        node.last_now = now;
        if !backup {
            node.await_members(members, true);
        }
        Ok(node)
    }

    /// The shard, once it exists.
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// The shard's number.
    pub fn id(&self) -> u32 {
        self.cfg.shard.shard
    }

    /// Whether this node mirrors a primary.
    pub fn is_backup(&self) -> bool {
        self.pending.backup
    }

    /// Whether this primary streams its ops to a backup.
    pub fn is_replicating(&self) -> bool {
        self.replicating
    }

    /// The last op numbered, and the last one the backup confirmed (`None`: no backup).
    pub fn replication(&self) -> (u64, Option<u64>) {
        (self.pending.gate.seq(), self.pending.gate.confirmed())
    }

    /// The time of the last op applied: a promoted backup's driver continues its clock from it.
    pub fn last_now(&self) -> u64 {
        self.last_now
    }

    /// The policy module the shard runs (or will start with).
    pub fn module(&self) -> &PolicyModule {
        &self.module
    }

    /// The next thing the driver must do, if any.
    pub fn poll_output(&mut self) -> Option<NodeOutput> {
        self.pending.out.pop_front()
    }

    /// When the node wants [`handle_timeout`](Self::handle_timeout): a policy timer (a
    /// primary's; a backup's timers fire on its primary's ops) or a rejoin deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        let timer = self.shard.as_ref().and_then(Shard::next_timer_ns).filter(|_| !self.pending.backup);
        let gone = self.awaiting.as_ref().and_then(|a| a.workers.values().min().copied());
        timer.into_iter().chain(gone).min()
    }

    /// Fires what is due at `now`: policy timers, then members that did not come back in time.
    pub fn handle_timeout(&mut self, now: u64, obs: &mut dyn Observer) {
        if self.shard.as_ref().and_then(Shard::next_timer_ns).is_some_and(|t| t <= now)
            && !self.pending.backup
        {
            self.step(Op::Advance, Vec::new(), now, obs);
        }
        if let Some(a) = self.awaiting.as_mut() {
            let due: Vec<WorkerId> = a.workers.iter().filter(|(_, d)| **d <= now).map(|(w, _)| *w).collect();
            a.workers.retain(|_, d| *d > now);
            if a.workers.is_empty() {
                self.awaiting = None;
            }
            for worker in due {
                event!(self, warn, shard = self.id(), worker, "worker did not come back; it leaves");
                self.step(Op::Leave { worker, reason: LeaveReason::TimedOut }, Vec::new(), now, obs);
            }
        }
    }

    /// Awaits `members`, each until the time given.
    fn await_members(&mut self, members: BTreeMap<WorkerId, u64>, shortens: bool) {
        self.awaiting = (!members.is_empty()).then_some(Awaiting { workers: members, shortens });
    }

    /// The driver lost its connection to `worker` (it died, or it finished and closed it): a
    /// member this node still awaits after a promotion or restore, which it would never hear
    /// from again, leaves now. Others leave by the connection they joined through.
    pub fn lost(&mut self, now: u64, worker: WorkerId, reason: LeaveReason, obs: &mut dyn Observer) {
        if self.awaiting.as_ref().is_some_and(|a| a.workers.contains_key(&worker)) {
            event!(self, warn, shard = self.id(), worker, ?reason, "an awaited member is gone; it leaves");
            self.leave(now, None, worker, reason, obs);
        }
    }

    /// Applies an op (handing it to the backup first, if there is one).
    fn step(&mut self, op: Op, grad: Vec<f32>, now: u64, obs: &mut dyn Observer) -> Option<Outcome> {
        if self.shard.is_none() && op != Op::Create {
            return None;
        }
        let seq = self.pending.gate.stamp();
        if self.replicating {
            let payload = match op {
                Op::Push(_) | Op::Create => {
                    let mut copy = obs.buffer(grad.len());
                    copy.copy_from_slice(&grad);
                    copy
                }
                _ => Vec::new(),
            };
            let stamped = Stamped { seq, now_ns: now, op: op.clone() };
            if let Some(out) = obs.send_now(NodeOutput::Replicate { stamped, payload }) {
                self.pending.out.push_back(out);
            }
        }
        self.apply(op, grad, now, |_| None, obs)
    }

    /// What an op does to the shard ([`Shard::apply_op`], shared by primary and backup).
    fn apply(
        &mut self,
        op: Op,
        grad: Vec<f32>,
        now: u64,
        find: impl FnOnce(&[u8; 32]) -> Option<PolicyModule>,
        obs: &mut dyn Observer,
    ) -> Option<Outcome> {
        self.last_now = now;
        let (id, backup) = (self.id(), self.pending.backup);
        let mut tap = Tap { pending: &mut self.pending, obs };
        if let Op::Create = op {
            let created = Shard::new(self.cfg.shard.clone(), grad, &self.module, &self.config, &mut tap);
            return Some(Outcome::Created(match created {
                Ok(s) => {
                    event!(self, info, shard = id, len = s.values().len(), backup, "shard created");
                    self.shard = Some(s);
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            }));
        }
        let s = self.shard.as_mut()?;
        let swap = match &op {
            Op::Swap { sha256, config, .. } => Some((*sha256, config.clone())),
            _ => None,
        };
        let mut chosen = None;
        let own = self.module.clone();
        let outcome = s.apply_op(
            op,
            grad,
            now,
            |sha| {
                chosen = if own.sha256() == *sha { Some(own) } else { find(sha) };
                chosen.clone()
            },
            &mut tap,
        );
        if let (Outcome::Swapped(Ok(())), Some((_, config)), Some(module)) = (&outcome, swap, chosen) {
            self.module = module;
            self.config = config;
        }
        Some(outcome)
    }

    /// A worker joins with its slice of the model (`init`; empty when it has none), which
    /// creates the shard if it does not exist. A member coming back (after a restore, a
    /// failover, or a retry) rejoins, and its policy hears nothing.
    pub fn join(&mut self, now: u64, token: Token, worker: WorkerId, init: Vec<f32>, obs: &mut dyn Observer) {
        let id = self.id();
        let reply = self.join_inner(now, worker, init, obs).map_err(|e| {
            if !matches!(e, RequestError::NoShardYet(_)) {
                tracing::debug!(shard = id, worker, "join refused: {e}");
            }
            e
        });
        // Answered once the backup has the join (and the shard's creation): a worker that goes
        // on is a member of the backup too, so a promoted backup knows it. Answered at once, a
        // worker whose join died with its primary would join the promoted backup afresh at
        // the other workers' clock, and its pushes below it would be acknowledged as
        // duplicates, not applied.
        self.pending.gated(token, Reply::Joined(reply));
    }

    fn join_inner(
        &mut self,
        now: u64,
        worker: WorkerId,
        init: Vec<f32>,
        obs: &mut dyn Observer,
    ) -> Result<Joined, RequestError> {
        let id = self.id();
        if self.pending.backup {
            return Err(RequestError::Backup(id));
        }
        let model_len = init.len();
        if self.shard.is_none() {
            if init.is_empty() {
                return Err(RequestError::NoShardYet(id));
            }
            if let Some(Outcome::Created(Err(reason))) = self.step(Op::Create, init, now, obs) {
                return Err(RequestError::CannotStart { shard: id, reason });
            }
        }
        let shard = self.shard.as_ref().ok_or(RequestError::NoShardYet(id))?;
        if model_len != 0 && model_len != shard.values().len() {
            return Err(RequestError::WrongSlice { shard: id, holds: shard.values().len(), got: model_len });
        }
        if shard.is_member(worker) {
            if let Some(a) = self.awaiting.as_mut() {
                a.workers.remove(&worker);
                if a.workers.is_empty() {
                    self.awaiting = None;
                } else if a.shortens {
                    let by = now + self.cfg.rejoin_grace_ns;
                    a.workers.values_mut().for_each(|d| *d = (*d).min(by));
                }
            }
            let next = shard.rejoin(worker)?;
            let clock = shard.workers().iter().find(|c| c.worker == worker).map_or(next, |c| c.clock);
            event!(self, info, shard = id, worker, next, clock, "worker rejoined");
            return Ok(Joined::Rejoined { next, clock });
        }
        let next = shard.resumes_at(worker);
        match self.step(Op::Join { worker }, Vec::new(), now, obs) {
            Some(Outcome::Joined(r)) => Ok(Joined::Fresh { clock: r?, next }),
            _ => Err(RequestError::NoShardYet(id)),
        }
    }

    /// A worker's push of `grad` (with [`PushHeader::tasks`]: some tasks of an iteration, with
    /// their owner, acknowledged as soon as they are counted).
    pub fn push(&mut self, now: u64, token: Token, push: PushHeader, grad: Vec<f32>, obs: &mut dyn Observer) {
        let id = self.id();
        if self.pending.backup {
            return self.pending.reply(token, Reply::Pushed(Err(RequestError::Backup(id))));
        }
        if self.shard.is_none() {
            return self.pending.reply(token, Reply::Pushed(Err(RequestError::NoShardYet(id))));
        }
        let (op, worker, iteration) = (Op::Push(push), push.worker, push.iteration);
        if push.tasks.is_some() {
            match self.step(op, grad, now, obs) {
                Some(Outcome::Pushed(Ok(()))) => self.pending.ack(token, PushOutcome::Applied),
                Some(Outcome::Pushed(Err(ShardError::Duplicate { .. }))) => {
                    self.pending.ack(token, PushOutcome::Duplicate)
                }
                Some(Outcome::Pushed(Err(e))) => self.pending.reply(token, Reply::Pushed(Err(e.into()))),
                _ => self.pending.reply(token, Reply::Pushed(Err(RequestError::NoShardYet(id)))),
            }
            return;
        }
        if self.pending.pushes.contains_key(&(worker, iteration)) {
            let e = RequestError::AlreadyWaiting { worker, iteration, what: Waiting::Push };
            return self.pending.reply(token, Reply::Pushed(Err(e)));
        }
        self.pending.pushes.insert((worker, iteration), token);
        match self.step(op, grad, now, obs) {
            Some(Outcome::Pushed(Ok(()))) => {}
            // Held by the policy: the acknowledgement waits for its decision.
            Some(Outcome::Pushed(Err(ShardError::Duplicate { .. })))
                if self.shard.as_ref().is_some_and(|s| s.is_push_held(worker, iteration)) => {}
            Some(Outcome::Pushed(Err(ShardError::Duplicate { .. }))) => {
                tracing::debug!(shard = id, worker, iteration, "duplicate push acknowledged, not applied");
                if let Some(token) = self.pending.pushes.remove(&(worker, iteration)) {
                    self.pending.ack(token, PushOutcome::Duplicate);
                }
            }
            Some(Outcome::Pushed(Err(e))) => {
                if let Some(token) = self.pending.pushes.remove(&(worker, iteration)) {
                    self.pending.reply(token, Reply::Pushed(Err(e.into())));
                }
            }
            _ => {}
        }
    }

    /// A worker's pull before computing `iteration`: answered when the policy releases it.
    pub fn pull(&mut self, now: u64, token: Token, worker: WorkerId, iteration: u64, obs: &mut dyn Observer) {
        let id = self.id();
        if self.pending.backup {
            return self.pending.reply(token, Reply::Pulled(Err(RequestError::Backup(id))));
        }
        if self.shard.is_none() {
            return self.pending.reply(token, Reply::Pulled(Err(RequestError::NoShardYet(id))));
        }
        if self.pending.pulls.contains_key(&(worker, iteration)) {
            let e = RequestError::AlreadyWaiting { worker, iteration, what: Waiting::Pull };
            return self.pending.reply(token, Reply::Pulled(Err(e)));
        }
        self.pending.pulls.insert((worker, iteration), token);
        if let Some(Outcome::Done(Err(e))) = self.step(Op::Pull { worker, iteration }, Vec::new(), now, obs) {
            if let Some(token) = self.pending.pulls.remove(&(worker, iteration)) {
                self.pending.reply(token, Reply::Pulled(Err(e.into())));
            }
        }
    }

    /// A worker skips ahead to iteration `to`. Answered once the backup has the skip, as a
    /// join is: a worker that goes on pushes `to` next, which a promoted backup without the
    /// skip would refuse as out of order.
    pub fn skip(&mut self, now: u64, token: Token, worker: WorkerId, to: u64, obs: &mut dyn Observer) {
        let r = match self.step(Op::Skip { worker, to }, Vec::new(), now, obs) {
            Some(Outcome::Done(r)) => r.map_err(RequestError::from),
            _ => Err(RequestError::NoShardYet(self.id())),
        };
        self.pending.gated(token, Reply::Done(r));
    }

    /// The owner of moved tasks handed them over.
    pub fn yielded(&mut self, now: u64, handover: Handover, obs: &mut dyn Observer) {
        if let Some(Outcome::Done(Err(e))) = self.step(Op::Yielded { handover }, Vec::new(), now, obs) {
            tracing::debug!(shard = self.id(), "task hand-over not reported: {e}");
        }
    }

    /// A worker applied a control message.
    pub fn applied(&mut self, now: u64, applied: Applied, obs: &mut dyn Observer) {
        if let Some(Outcome::Done(Err(e))) = self.step(Op::Applied { applied }, Vec::new(), now, obs) {
            tracing::debug!(shard = self.id(), "control acknowledgement ignored: {e}");
        }
    }

    /// A worker's report of an iteration.
    pub fn finished(&mut self, now: u64, report: IterationReport, obs: &mut dyn Observer) {
        if let Some(Outcome::Done(Err(e))) = self.step(Op::Finished { report }, Vec::new(), now, obs) {
            tracing::debug!(shard = self.id(), "iteration report ignored: {e}");
        }
    }

    /// A worker says its pull of `iteration` waits on another shard (`waiting`), or that every
    /// shard answered it ([`Shard::pull_waiting`]). Nothing answers it.
    pub fn waiting(
        &mut self,
        now: u64,
        worker: WorkerId,
        iteration: u64,
        waiting: bool,
        obs: &mut dyn Observer,
    ) {
        let op = Op::Waiting { worker, iteration, waiting };
        if let Some(Outcome::Done(Err(e))) = self.step(op, Vec::new(), now, obs) {
            tracing::debug!(shard = self.id(), "wait notice ignored: {e}");
        }
    }

    /// A worker leaves: `Finished` is a goodbye, which waits for the worker's tasks still out
    /// (so nothing it trained is lost) before the reply; any other reason drops it now.
    /// `token`: where to answer, if anyone waits.
    pub fn leave(
        &mut self,
        now: u64,
        token: Option<Token>,
        worker: WorkerId,
        reason: LeaveReason,
        obs: &mut dyn Observer,
    ) {
        if let Some(a) = self.awaiting.as_mut() {
            a.workers.remove(&worker);
        }
        if self.shard.is_none() {
            self.pending.out.push_back(NodeOutput::Left { worker });
            if let Some(token) = token {
                self.pending.reply(token, Reply::Done(Ok(())));
            }
            return;
        }
        let result = match reason {
            LeaveReason::Finished => match self.step(Op::Goodbye { worker }, Vec::new(), now, obs) {
                Some(Outcome::Left(r)) => r,
                _ => Ok(true),
            },
            _ => match self.step(Op::Leave { worker, reason }, Vec::new(), now, obs) {
                Some(Outcome::Done(r)) => r.map(|()| true),
                _ => Ok(true),
            },
        };
        match (result, token) {
            (Ok(false), Some(token)) => {
                self.pending.goodbyes.insert(worker, token);
            }
            (Ok(_), Some(token)) => self.pending.reply(token, Reply::Done(Ok(()))),
            (Err(e), Some(token)) => self.pending.reply(token, Reply::Done(Err(e.into()))),
            (_, None) => {}
        }
    }

    /// Whether this primary's shard would take `module` with `config` in a swap now: the
    /// hand-over tried and thrown away ([`Shard::check_swap`]); a shard not created yet, or a
    /// backup, only checks that it starts. A swap's preparation asks it of every primary, so a
    /// module that refuses to take over is refused before any shard switches.
    pub fn check_swap(
        &mut self,
        now: u64,
        module: &PolicyModule,
        config: &[(String, String)],
    ) -> Result<(), PolicyError> {
        match self.shard.as_mut().filter(|_| !self.pending.backup) {
            Some(shard) => shard.check_swap(module, config, &[], now.max(self.last_now)),
            None => {
                let shards = self.cfg.shard.shards;
                let init = syncopate_policy_sdk::abi::InitArgs {
                    shard: self.id(),
                    shards,
                    now_ns: now,
                    config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
                };
                crate::runtime::PolicyInstance::new(module, &init).map(|_| ())
            }
        }
    }

    /// The cluster commits a swap ([`SwapTo`]). A backup swaps when its primary's op says (the
    /// reply is `Ok` at once); a shard not created yet starts with the new module. A module
    /// that refuses the hand-over starts afresh ([`Shard::commit_swap`]).
    pub fn swap(&mut self, now: u64, token: Token, to: SwapTo, obs: &mut dyn Observer) {
        if self.pending.backup {
            return self.pending.reply(token, Reply::Done(Ok(())));
        }
        let r = self.switch(now, to, obs);
        self.pending.reply(token, Reply::Done(r));
    }

    /// Switches to swap `to`, unless the shard runs that swap or a newer one already (a
    /// promoted backup that took it from its old primary's ops before its server's commit
    /// came: its clocks were raised then, and are not raised twice).
    fn switch(&mut self, now: u64, to: SwapTo, obs: &mut dyn Observer) -> Result<(), RequestError> {
        let SwapTo { module, config, raise, swap } = to;
        let Some(shard) = self.shard.as_ref() else {
            (self.module, self.config) = (module, config);
            return Ok(());
        };
        if swap > 0 && shard.swap().0 >= swap {
            return Ok(());
        }
        let sha256 = module.sha256();
        let previous = std::mem::replace(&mut self.module, module);
        let r = match self.step(Op::Swap { sha256, config, raise, swap }, Vec::new(), now, obs) {
            Some(Outcome::Swapped(r)) => r.map_err(RequestError::Swap),
            _ => Err(RequestError::NoShardYet(self.id())),
        };
        if r.is_err() {
            self.module = previous;
        }
        r
    }

    /// A primary just promoted takes the policy its server records (its last committed swap,
    /// `to`) unless it runs that swap or a newer one, taken from its old primary's ops (which
    /// its server will commit too). A backup whose primary died before streaming a swap's
    /// commit would otherwise run the old policy while the cluster records the new one.
    /// Returns whether it switched.
    pub fn conform(&mut self, now: u64, to: SwapTo, obs: &mut dyn Observer) -> bool {
        let (module, swap) = (&to.module, to.swap);
        let behind = self.shard.as_ref().is_some_and(|s| s.swap().0 < swap);
        if self.pending.backup || !behind {
            return false;
        }
        event!(
            self,
            warn,
            shard = self.id(),
            policy = module.display_name(),
            swap,
            "promoted without its old primary's last swap: switching to the policy the cluster records"
        );
        self.switch(now, to, obs).is_ok()
    }

    /// A backup receives its primary's op (`grad`: a push's gradient, a creation's
    /// parameters), applies it at the primary's time and confirms it. `find` gives a swap's
    /// module by SHA-256. A node that is no longer a backup (promoted) ignores the old
    /// primary's late ops, and confirms none. The ops' numbers come from a peer and are
    /// checked: an op the backup holds already is confirmed again, not applied twice, and one
    /// past a gap in the numbering is refused.
    pub fn replicated(
        &mut self,
        stamped: Stamped,
        grad: Vec<f32>,
        find: impl FnOnce(&[u8; 32]) -> Option<PolicyModule>,
        obs: &mut dyn Observer,
    ) {
        let id = self.id();
        if !self.pending.backup {
            event!(
                self,
                warn,
                shard = id,
                seq = stamped.seq,
                "an op from the old primary after the promotion; ignored"
            );
            return;
        }
        let (seq, have) = (stamped.seq, self.pending.gate.seq());
        // The stream is numbered 1, 2, 3... A backup that has taken no op yet (one started
        // from a snapshot) takes its place in it from the first; after that an op it holds is
        // confirmed again and not applied twice, and one past a gap is refused: applying it
        // would make the backup differ from its primary.
        if have != 0 && seq != have + 1 {
            if seq <= have {
                tracing::debug!(shard = id, seq, have, "an op the backup holds already; not applied again");
                if let Some(out) = obs.send_now(NodeOutput::Confirm { seq: have }) {
                    self.pending.out.push_back(out);
                }
            } else {
                tracing::error!(shard = id, seq, have, "an op past a gap in the replication stream; refused");
            }
            return;
        }
        if let Some(out) = obs.send_now(NodeOutput::Confirm { seq }) {
            self.pending.out.push_back(out);
        }
        self.pending.gate.follow(seq);
        if self.apply(stamped.op, grad, stamped.now_ns, find, obs).is_none() {
            tracing::error!(shard = id, seq, "an op arrived before the shard was created");
        }
    }

    /// The backup holds every op up to `seq`: the pushes they admitted are acknowledged.
    pub fn confirmed(&mut self, seq: u64) {
        self.pending.release(|gate, out| gate.confirm(seq, |a| out.push(a)));
    }

    /// Streams every op to a backup from now on. Before the shard's first op, the backup
    /// starts as the shard will (`Ok(None)`). Later (a re-replication after a failover) the
    /// shard restarts itself from its own snapshot, since the backup cannot replay the ops it
    /// missed and a policy instance cannot be copied, and the backup must start from the same
    /// snapshot, which is returned with its place in the stream: `Ok(Some((seq, snapshot)))`.
    pub fn attach_backup(
        &mut self,
        now: u64,
        obs: &mut dyn Observer,
    ) -> Result<Option<(u64, Vec<u8>)>, RequestError> {
        let id = self.id();
        if self.pending.backup {
            return Err(RequestError::Backup(id));
        }
        // Before the first op, a backup starts as this node did, unless this node's state came
        // from elsewhere (a promoted backup that has stamped no op yet): then, as after ops, it
        // starts from a snapshot. Search found it: a backup restored from a snapshot, promoted
        // before any op, handed its next backup nothing, and that backup never held the shard.
        let shared = self.shard.is_none() || std::mem::take(&mut self.shared_start);
        if self.pending.gate.seq() == 0 && shared {
            self.pending.gate.attach(0);
            self.replicating = true;
            return Ok(None);
        }
        let Some(s) = self.shard.as_mut() else { return Err(RequestError::NoShardYet(id)) };
        let snapshot = s
            .snapshot(now)
            .map_err(|e| RequestError::Snapshot { shard: id, reason: e.to_string() })?
            .encode();
        let snap = ShardSnapshot::decode(&snapshot).expect("just encoded");
        // Requests the restart hands the policy again are acknowledged only once the backup
        // holds the snapshot: it is op `seq` of the stream.
        let seq = self.pending.gate.stamp();
        self.pending.gate.attach(seq - 1);
        let mut tap = Tap { pending: &mut self.pending, obs };
        match Shard::restore(self.cfg.shard.clone(), snap, &self.module, &mut tap) {
            Ok(restarted) => self.shard = Some(restarted),
            Err(e) => {
                self.drop_backup();
                return Err(RequestError::CannotStart {
                    shard: id,
                    reason: format!("cannot restart from its snapshot: {e}"),
                });
            }
        }
        self.replicating = true;
        event!(self, warn, shard = id, seq, "new backup attached from a snapshot");
        Ok(Some((seq, snapshot)))
    }

    /// The backup is gone for good: nothing waits for it any more.
    pub fn drop_backup(&mut self) {
        if std::mem::take(&mut self.replicating) {
            event!(self, warn, shard = self.id(), "the backup is gone; the shard runs without one");
        }
        self.pending.release(|gate, out| gate.detach(|a| out.push(a)));
    }

    /// This backup becomes the shard's primary; its driver's clock goes on from
    /// [`last_now`](Self::last_now). Its members are given time to rejoin: those `connected` to
    /// its server, until the backstop (their connection's end, [`lost`](Self::lost), says if
    /// they died); the others, the rejoin grace only. A member not connected to the server may
    /// be alive and about to connect, once it hears of the move (and, dropped for being late,
    /// it is taken back afresh), or dead and never to connect: its death was seen only by
    /// servers that held its connections (a server restarted since it died never did), and no
    /// connection's end will tell this one.
    pub fn promote(&mut self, connected: &BTreeSet<WorkerId>) {
        if !self.pending.backup {
            return;
        }
        self.pending.backup = false;
        self.shared_start = false;
        let now = self.last_now;
        let (backstop, grace) =
            (now + self.cfg.rejoin_grace_ns.max(FIRST_REJOIN_NS), now + self.cfg.rejoin_grace_ns);
        let members: BTreeMap<WorkerId, u64> = self
            .shard
            .as_ref()
            .map(|s| {
                let until = |w| if connected.contains(&w) { backstop } else { grace };
                s.workers().iter().map(|c| (c.worker, until(c.worker))).collect()
            })
            .unwrap_or_default();
        event!(self, warn, shard = self.id(), members = members.len(), "promoted to primary");
        self.await_members(members, false);
    }

    /// The shard's snapshot at `now` (checkpoints, re-replication).
    pub fn snapshot(&mut self, now: u64) -> Result<ShardSnapshot, RequestError> {
        let id = self.id();
        let s = self.shard.as_mut().ok_or(RequestError::NoShardYet(id))?;
        s.snapshot(now).map_err(|e| RequestError::Snapshot { shard: id, reason: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{OptimizerConfig, PushWeight};

    fn cfg() -> NodeConfig {
        let optimizer = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let shard = ShardConfig { optimizer, push_weight: PushWeight::Sum, ..ShardConfig::default() };
        NodeConfig { shard, rejoin_grace_ns: 1_000, quiet: false }
    }

    fn node(name: &str, backup: bool) -> ShardNode {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let module = rt.compile(name, crate::builtin::wasm(name).unwrap()).unwrap();
        ShardNode::new(cfg(), module, Vec::new(), backup)
    }

    fn drain(n: &mut ShardNode) -> Vec<NodeOutput> {
        std::iter::from_fn(|| n.poll_output()).collect()
    }

    fn replies(out: &[NodeOutput]) -> Vec<Token> {
        out.iter()
            .filter_map(|o| match o {
                NodeOutput::Reply { token, .. } => Some(*token),
                _ => None,
            })
            .collect()
    }

    /// Hands a primary's ops to its backup; returns the last sequence number it confirmed.
    fn deliver(out: Vec<NodeOutput>, backup: &mut ShardNode) -> Option<u64> {
        for o in out {
            if let NodeOutput::Replicate { stamped, payload } = o {
                backup.replicated(stamped, payload, |_| None, &mut Quiet);
            }
        }
        drain(backup)
            .iter()
            .filter_map(|o| if let NodeOutput::Confirm { seq } = o { Some(*seq) } else { None })
            .next_back()
    }

    #[test]
    fn a_join_and_a_push_are_answered_once_the_backup_holds_them_and_a_retry_after_promotion_is_a_duplicate()
    {
        let (mut primary, mut backup) = (node("asp", false), node("asp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(1, 1, 0, vec![0.0; 4], &mut Quiet);
        let out = drain(&mut primary);
        assert!(replies(&out).is_empty(), "a join is answered once the backup has it");
        let seq = deliver(out, &mut backup).unwrap();
        primary.confirmed(seq);
        assert_eq!(replies(&drain(&mut primary)), vec![1]);

        primary.push(2, 2, PushHeader::gradient(0, 0, 1), vec![1.0; 4], &mut Quiet);
        let out = drain(&mut primary);
        assert!(replies(&out).is_empty(), "held until the backup has the op");
        let seq = deliver(out, &mut backup).unwrap();
        primary.confirmed(seq);
        let out = drain(&mut primary);
        assert!(matches!(
            out[..],
            [NodeOutput::Reply { token: 2, reply: Reply::Pushed(Ok(PushOutcome::Applied)) }]
        ));

        // The primary dies; the backup takes over and the worker asks again: it is a
        // duplicate, acknowledged and not applied twice.
        backup.promote(&BTreeSet::from([0]));
        assert!(!backup.is_backup() && backup.poll_timeout().is_some(), "its member is awaited");
        backup.join(3, 3, 0, Vec::new(), &mut Quiet);
        assert!(matches!(
            drain(&mut backup)[..],
            [NodeOutput::Reply { reply: Reply::Joined(Ok(Joined::Rejoined { next: 1, clock: 1 })), .. }]
        ));
        assert_eq!(backup.poll_timeout(), None, "nobody is awaited any more");
        backup.push(4, 4, PushHeader::gradient(0, 0, 1), vec![1.0; 4], &mut Quiet);
        let out = drain(&mut backup);
        assert!(matches!(
            out[..],
            [NodeOutput::Reply { token: 4, reply: Reply::Pushed(Ok(PushOutcome::Duplicate)) }]
        ));
        assert_eq!(backup.shard().unwrap().values(), &[-1.0; 4][..]);
        assert_eq!(primary.shard().unwrap().values(), backup.shard().unwrap().values());
    }

    #[test]
    fn a_backup_applies_a_repeated_op_once_and_refuses_one_past_a_gap() {
        let (mut primary, mut backup) = (node("asp", false), node("asp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(1, 1, 0, vec![0.0; 2], &mut Quiet);
        let ops = |out: Vec<NodeOutput>| -> Vec<(Stamped, Vec<f32>)> {
            out.into_iter()
                .filter_map(|o| match o {
                    NodeOutput::Replicate { stamped, payload } => Some((stamped, payload)),
                    _ => None,
                })
                .collect()
        };
        let mut stream = ops(drain(&mut primary));
        primary.push(2, 2, PushHeader::gradient(0, 0, 1), vec![1.0; 2], &mut Quiet);
        stream.extend(ops(drain(&mut primary)));
        primary.push(3, 3, PushHeader::gradient(0, 1, 1), vec![1.0; 2], &mut Quiet);
        let last = ops(drain(&mut primary));
        let confirms = |b: &mut ShardNode| -> Vec<u64> {
            drain(b)
                .iter()
                .filter_map(|o| if let NodeOutput::Confirm { seq } = o { Some(*seq) } else { None })
                .collect()
        };
        for (stamped, payload) in stream.iter().chain(stream.iter()) {
            backup.replicated(stamped.clone(), payload.clone(), |_| None, &mut Quiet);
        }
        let have = stream.last().unwrap().0.seq;
        assert!(confirms(&mut backup).iter().all(|&c| c <= have), "repeats confirm what it holds");
        assert_eq!(backup.replication().0, have);
        assert_eq!(backup.shard().unwrap().values(), &[-1.0; 2][..], "the repeated push is applied once");

        // An op numbered past the next one is refused; the next one is then taken.
        let (mut skipped, payload) = last[0].clone();
        skipped.seq += 1;
        backup.replicated(skipped, payload.clone(), |_| None, &mut Quiet);
        assert!(confirms(&mut backup).is_empty(), "nothing past a gap is confirmed");
        assert_eq!(backup.replication().0, have);
        backup.replicated(last[0].0.clone(), payload, |_| None, &mut Quiet);
        assert_eq!(confirms(&mut backup), vec![have + 1]);
        assert_eq!(backup.shard().unwrap().values(), primary.shard().unwrap().values());
    }

    /// Found by the fault search (a dead server restarted, then another death): a backup
    /// started from its primary's snapshot and promoted before any op came has stamped no op
    /// of its own, yet holds state its next backup lacks, so that backup must start from a
    /// snapshot too, not empty.
    #[test]
    fn a_backup_promoted_before_any_op_hands_its_next_backup_a_snapshot() {
        let (mut primary, mut backup) = (node("asp", false), node("asp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(1, 1, 0, vec![0.0; 2], &mut Quiet);
        primary.push(2, 2, PushHeader::gradient(0, 0, 1), vec![1.0; 2], &mut Quiet);
        let seq = deliver(drain(&mut primary), &mut backup).unwrap();
        primary.confirmed(seq);
        drain(&mut primary);
        // Re-replication: a third node starts from the (promoted) backup's snapshot and is
        // promoted in turn before any op reaches it.
        backup.promote(&BTreeSet::from([0]));
        let (_, snapshot) = backup.attach_backup(10, &mut Quiet).unwrap().expect("after ops, a snapshot");
        let snap = ShardSnapshot::decode(&snapshot).unwrap();
        let mut third =
            ShardNode::restore(cfg(), backup.module().clone(), Vec::new(), true, snap, &mut Quiet)
                .expect("restores");
        third.promote(&BTreeSet::from([0]));
        assert_eq!(third.replication().0, 0, "no op of its own yet");
        let Some((_, next)) = third.attach_backup(20, &mut Quiet).unwrap() else {
            panic!("a promoted backup with state hands its next backup a snapshot, not nothing")
        };
        let next = ShardSnapshot::decode(&next).unwrap();
        assert_eq!(next.params(), &[-1.0; 2][..]);
        assert_eq!(next.version(), primary.shard().unwrap().version());
        // A fresh primary's first attachment still starts its backup as it started.
        let mut fresh = node("asp", false);
        assert!(fresh.attach_backup(0, &mut Quiet).unwrap().is_none());
    }

    /// Found by the fault search once the simulator ran the servers' own state: a worker died
    /// before its second server restarted, and its first server died before the worker's
    /// connection there timed out. No connection's end would ever tell the shards promoted on
    /// the restarted server, which then awaited the dead member until the 60-second backstop.
    /// A member not connected to the promoting server is awaited the rejoin grace only.
    #[test]
    fn a_promoted_backup_awaits_a_member_not_connected_to_its_server_only_the_rejoin_grace() {
        let (mut primary, mut backup) = (node("asp", false), node("asp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(1, 1, 0, vec![0.0; 2], &mut Quiet);
        primary.join(1, 2, 1, Vec::new(), &mut Quiet);
        let seq = deliver(drain(&mut primary), &mut backup).unwrap();
        primary.confirmed(seq);
        // Worker 0 is connected to the backup's server, worker 1 is not.
        backup.promote(&BTreeSet::from([0]));
        let t0 = backup.last_now();
        let grace = t0 + cfg().rejoin_grace_ns;
        assert_eq!(backup.poll_timeout(), Some(grace));
        backup.handle_timeout(grace, &mut Quiet);
        let view = backup.shard().unwrap().workers().iter().map(|c| c.worker).collect::<Vec<_>>();
        assert_eq!(view, vec![0], "the member not connected left; the connected one is still awaited");
        assert_eq!(backup.poll_timeout(), Some(t0 + FIRST_REJOIN_NS));
        // The connected one's connection ends: it leaves at once.
        backup.lost(grace + 1, 0, LeaveReason::TimedOut, &mut Quiet);
        assert_eq!(backup.poll_timeout(), None);
    }

    #[test]
    fn a_skip_is_answered_once_the_backup_has_it() {
        let (mut primary, mut backup) = (node("bsp", false), node("bsp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(1, 1, 0, vec![0.0; 2], &mut Quiet);
        let seq = deliver(drain(&mut primary), &mut backup).unwrap();
        primary.confirmed(seq);
        drain(&mut primary);
        primary.skip(2, 2, 0, 5, &mut Quiet);
        let out = drain(&mut primary);
        assert!(replies(&out).is_empty(), "a skip the backup lacks would be lost with the primary");
        let seq = deliver(out, &mut backup).unwrap();
        primary.confirmed(seq);
        assert!(matches!(
            drain(&mut primary)[..],
            [NodeOutput::Reply { token: 2, reply: Reply::Done(Ok(())) }]
        ));
        backup.promote(&BTreeSet::from([0]));
        backup.join(3, 3, 0, Vec::new(), &mut Quiet);
        assert!(matches!(
            drain(&mut backup)[..],
            [NodeOutput::Reply { reply: Reply::Joined(Ok(Joined::Rejoined { next: 5, clock: 5 })), .. }]
        ));
    }

    #[test]
    fn requests_are_refused_with_typed_errors() {
        let mut n = node("bsp", false);
        n.push(0, 1, PushHeader::gradient(0, 0, 1), vec![1.0; 2], &mut Quiet);
        n.pull(0, 2, 0, 0, &mut Quiet);
        n.join(0, 3, 0, Vec::new(), &mut Quiet);
        let out = drain(&mut n);
        assert!(matches!(
            out[0],
            NodeOutput::Reply { reply: Reply::Pushed(Err(RequestError::NoShardYet(0))), .. }
        ));
        assert!(matches!(
            out[1],
            NodeOutput::Reply { reply: Reply::Pulled(Err(RequestError::NoShardYet(0))), .. }
        ));
        assert!(matches!(
            out[2],
            NodeOutput::Reply { reply: Reply::Joined(Err(RequestError::NoShardYet(0))), .. }
        ));
        n.join(0, 4, 0, vec![0.0; 2], &mut Quiet);
        n.join(0, 5, 1, vec![0.0; 3], &mut Quiet);
        n.push(0, 6, PushHeader::gradient(0, 0, 1), vec![f32::NAN; 2], &mut Quiet);
        n.push(0, 7, PushHeader::gradient(0, 5, 1), vec![0.0; 2], &mut Quiet);
        n.push(0, 8, PushHeader::gradient(9, 0, 1), vec![0.0; 2], &mut Quiet);
        let out = drain(&mut n);
        let errs: Vec<&RequestError> = out
            .iter()
            .filter_map(|o| match o {
                NodeOutput::Reply { reply: Reply::Pushed(Err(e)) | Reply::Joined(Err(e)), .. } => Some(e),
                _ => None,
            })
            .collect();
        assert!(matches!(errs[0], RequestError::WrongSlice { holds: 2, got: 3, .. }), "{errs:?}");
        assert!(matches!(errs[1], RequestError::Shard(ShardError::NonFinite(0, 0))), "{errs:?}");
        assert!(matches!(errs[2], RequestError::Shard(ShardError::OutOfOrder { .. })), "{errs:?}");
        assert!(matches!(errs[3], RequestError::Shard(ShardError::UnknownWorker(9, 0))), "{errs:?}");
        // Under BSP with two members a pull of iteration 1 waits; the same pull again is refused.
        n.join(0, 9, 1, Vec::new(), &mut Quiet);
        n.push(0, 10, PushHeader::gradient(0, 0, 1), vec![0.0; 2], &mut Quiet);
        n.pull(0, 11, 0, 1, &mut Quiet);
        n.pull(0, 12, 0, 1, &mut Quiet);
        let out = drain(&mut n);
        assert!(out.iter().any(|o| matches!(
            o,
            NodeOutput::Reply {
                token: 12,
                reply: Reply::Pulled(Err(RequestError::AlreadyWaiting { what: Waiting::Pull, .. }))
            }
        )));
        assert!(!replies(&out).contains(&11), "parked");
        // Its worker is dropped: the parked pull is answered with why.
        n.leave(1, None, 0, LeaveReason::Failed, &mut Quiet);
        let out = drain(&mut n);
        assert!(out.iter().any(|o| matches!(
            o,
            NodeOutput::Reply { token: 11, reply: Reply::Pulled(Err(RequestError::Left(0, 0))) }
        )));
        assert!(out.iter().any(|o| matches!(o, NodeOutput::Left { worker: 0 })));
        let mut b = node("bsp", true);
        b.pull(0, 1, 0, 0, &mut Quiet);
        assert!(matches!(
            drain(&mut b)[..],
            [NodeOutput::Reply { reply: Reply::Pulled(Err(RequestError::Backup(0))), .. }]
        ));
    }

    /// A promoted backup waits for each member until its connection ends (or the backstop),
    /// not a short grace after the first comes back: a worker in a long iteration is no loss.
    /// One dropped after all is taken back afresh and told where its old numbering stopped.
    #[test]
    fn members_of_a_promoted_backup_leave_when_their_connection_ends_and_a_dropped_one_is_renumbered() {
        let (mut primary, mut backup) = (node("asp", false), node("asp", true));
        primary.attach_backup(0, &mut Quiet).unwrap();
        primary.join(5, 1, 0, vec![0.0; 2], &mut Quiet);
        primary.join(5, 2, 1, Vec::new(), &mut Quiet);
        primary.join(5, 3, 2, Vec::new(), &mut Quiet);
        primary.push(6, 4, PushHeader::gradient(0, 0, 1), vec![1.0; 2], &mut Quiet);
        primary.push(6, 5, PushHeader::gradient(0, 1, 1), vec![1.0; 2], &mut Quiet);
        deliver(drain(&mut primary), &mut backup);
        backup.promote(&BTreeSet::from([0, 1, 2]));
        assert_eq!(backup.poll_timeout(), Some(6 + FIRST_REJOIN_NS), "members awaited");
        backup.join(10, 6, 1, Vec::new(), &mut Quiet);
        assert_eq!(backup.poll_timeout(), Some(6 + FIRST_REJOIN_NS), "no shorter grace once one is back");
        // Worker 2's connection ends: it leaves at once. Worker 0 is still computing.
        backup.lost(11, 2, LeaveReason::TimedOut, &mut Quiet);
        let out = drain(&mut backup);
        assert!(out.iter().any(|o| matches!(o, NodeOutput::Left { worker: 2 })), "{out:?}");
        backup.lost(11, 1, LeaveReason::TimedOut, &mut Quiet);
        assert!(backup.shard().unwrap().is_member(1), "a member back is not the awaited one");
        // Worker 0 stays away past the backstop: dropped.
        backup.handle_timeout(6 + FIRST_REJOIN_NS, &mut Quiet);
        let out = drain(&mut backup);
        assert!(out.iter().any(|o| matches!(o, NodeOutput::Left { worker: 0 })), "{out:?}");
        // Worker 1 pushes on; worker 0 returns: a new member at the shard's clock, told that its
        // iterations from 2 on (its pushes 0 and 1 were applied) are now numbered from there.
        backup.push(20, 7, PushHeader::gradient(1, 0, 1), vec![1.0; 2], &mut Quiet);
        backup.join(21, 8, 0, Vec::new(), &mut Quiet);
        let out = drain(&mut backup);
        assert!(
            out.iter().any(|o| matches!(
                o,
                NodeOutput::Reply { token: 8, reply: Reply::Joined(Ok(Joined::Fresh { clock: 1, next: 2 })) }
            )),
            "{out:?}"
        );
    }
}
