//! A native test driver: feed a policy event sequences and check its decisions with plain
//! `cargo test`, through the same encode/decode path the wasm module uses.

use alloc::collections::{BTreeMap, VecDeque};
use alloc::string::String;
use alloc::vec::Vec;

use crate::abi::{
    Applied, Control, Decision, Envelope, Event, Handoff, InitArgs, IterationReport, LeaveReason, Pull, Push,
    Release, RequestId, ShardView, Signals, Tensor, TimerId, UpdateMode, WorkerClock, WorkerId,
};
use crate::clocks::Clocks;
use crate::guest::{encode, Guest};
use crate::measure::Scaled;
use crate::optimizer::{Optimizer, OptimizerConfig};
use crate::rules::{DecisionState, EventRules};
use crate::{Policy, PullVerdict, PushVerdict};

/// A decision, owned, as recorded by the [`Driver`].
#[derive(Clone, Debug, PartialEq)]
pub enum Recorded {
    /// A pull was served (at once or on release).
    Served(RequestId),
    /// A pull was deferred.
    Deferred(RequestId, Release),
    /// A push was admitted, with its weight if not default.
    Admitted(RequestId, Option<f32>),
    /// A push was held.
    Held(RequestId),
    /// A push was dropped (its gradient discarded).
    Dropped(RequestId),
    /// A round's aggregate was completed early.
    AggregateCompleted(u64),
    /// A push was admitted into a group (with its weight if not 1).
    AdmittedToGroup(RequestId, u64, Option<f32>),
    /// A group was applied as one step.
    GroupCompleted(u64),
    /// The update mode was set.
    UpdateMode(UpdateMode),
    /// A control message was sent.
    Control(WorkerId, Control),
    /// A timer was set.
    Timer(TimerId, u64),
    /// A timer was cancelled.
    TimerCancelled(TimerId),
    /// A metric was recorded.
    Metric(String, f64),
    /// Local steps were set, for one worker or (`None`) every worker.
    LocalSteps(Option<WorkerId>, u32),
    /// The outer optimizer was set: learning rate, momentum, Nesterov.
    OuterOptimizer(f32, f32, bool),
    /// The pull codec was set.
    PullCodec(crate::abi::Codec),
    /// The outer momentum's delay was set.
    OuterDelay(u32),
    /// A measure was asked for, and what the driver answered (as the host would: see
    /// [`crate::measure`]).
    Measured(u64, crate::abi::Measure, f64),
}

/// Drives one policy instance natively, playing the host's part in miniature: it keeps the
/// shard's clocks and its version (the optimizer steps: an admitted push on arrival, a round's
/// or a group's aggregate), so pushes carry their staleness and pulls the version they see as on
/// a cluster; it parks deferred pulls and releases them when their condition holds, and holds
/// pushes until the policy admits them. A worker that leaves while its push is held is handled
/// as the host does: the policy hears [`Event::WorkerLeft`] with the push still held and may
/// admit or drop it; if it does neither, the push is applied (its gradient is valid). Every decision is checked against the same rules the
/// host's shards enforce ([`crate::rules`]): a decision that breaks one is an `Err` here, as it
/// is a policy failure on a cluster.
///
/// Each push/pull helper returns the policy's verdict; every decision is also recorded in
/// [`Driver::log`].
#[derive(Debug)]
pub struct Driver<P> {
    guest: Guest<P>,
    clocks: Clocks,
    now_ns: u64,
    rng: u64,
    next_id: RequestId,
    parked: Vec<(RequestId, WorkerId, Release)>,
    /// Held pushes: id, worker, gradient and signals (for their redelivery).
    held: Vec<(RequestId, WorkerId, Vec<f32>, Signals)>,
    timers: Vec<TimerId>,
    /// Every decision the policy made, in order.
    pub log: Vec<Recorded>,
    released: VecDeque<RequestId>,
    mode: Option<UpdateMode>,
    config: Vec<(String, String)>,
    /// The modelled parameters and optimizer: none (zero parameters) until
    /// [`Driver::with_optimizer`], which still counts the steps.
    model: Option<Model>,
    /// The worker whose departure the policy is hearing of.
    leaving: Option<WorkerId>,
    /// The gradient of the push being decided.
    incoming: Vec<f32>,
    /// Per worker: the version (steps) its last served pull saw, for its pushes' staleness.
    served_at: BTreeMap<WorkerId, u64>,
    /// Local steps for every worker, and per worker where set since.
    local_steps: (u32, BTreeMap<WorkerId, u32>),
    /// Answers to measures, to be sent once the event that asked is decided.
    answers: VecDeque<(u64, f64)>,
}

/// The host's optimizer over a parameter vector, as [`Driver::with_optimizer`] sets it up.
#[derive(Debug)]
struct Model {
    optimizer: Optimizer,
    params: Vec<f32>,
    steps: u64,
    /// Open aggregates by round: the weighted sum, the sum of weights and the contributors.
    rounds: BTreeMap<u64, (Vec<f32>, f32, Vec<WorkerId>)>,
    /// Open groups by name: the weighted sum and the sum of weights.
    groups: BTreeMap<u64, (Vec<f32>, f32)>,
}

impl<P: Policy> Driver<P> {
    /// Creates the policy for shard 0 of 1 with the given configuration.
    pub fn new(config: &[(&str, &str)]) -> Result<Self, String> {
        let mut guest = Guest::new();
        let args = InitArgs { shard: 0, shards: 1, now_ns: 0, config: config.to_vec() };
        let bytes = encode(&args);
        write(&mut guest, &bytes);
        let out = guest.init(bytes.len()).to_vec();
        let rest = started(&out)?;
        let mut d = Driver {
            guest,
            clocks: Clocks::new(),
            now_ns: 0,
            rng: 0x5EED,
            next_id: 0,
            parked: Vec::new(),
            served_at: BTreeMap::new(),
            local_steps: (0, BTreeMap::new()),
            held: Vec::new(),
            timers: Vec::new(),
            log: Vec::new(),
            released: VecDeque::new(),
            mode: None,
            config: config.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
            model: Some(Model {
                optimizer: Optimizer::new(OptimizerConfig::default(), 0),
                params: Vec::new(),
                steps: 0,
                rounds: BTreeMap::new(),
                groups: BTreeMap::new(),
            }),
            leaving: None,
            incoming: Vec::new(),
            answers: VecDeque::new(),
        };
        d.apply(rest, None, None)?;
        Ok(d)
    }

    /// Models the host's optimizer over `params`, as a shard applies pushes: each admitted push
    /// is one step with the policy's weight (default `1 / live workers`, the host's default) in
    /// on-arrival mode, or joins its round's aggregate (the pushing worker's clock), applied as
    /// one step once every live worker has passed the round or the policy completes it early
    /// (then on the weighted mean). A dropped push reaches nothing. Pushes carry the gradient
    /// given to [`Driver::push_gradient`] (zeros for [`Driver::push`]), so a test sees what
    /// momentum and weight decay make of each decision.
    pub fn with_optimizer(mut self, optimizer: OptimizerConfig, params: Vec<f32>) -> Self {
        self.model = Some(Model {
            optimizer: Optimizer::new(optimizer, params.len()),
            params,
            steps: 0,
            rounds: BTreeMap::new(),
            groups: BTreeMap::new(),
        });
        self
    }

    /// The modelled parameters (empty without [`Driver::with_optimizer`]).
    pub fn params(&self) -> &[f32] {
        self.model.as_ref().map_or(&[], |m| &m.params)
    }

    /// Optimizer steps taken (the shard's version), on the modelled parameters if any.
    pub fn steps(&self) -> u64 {
        self.model.as_ref().map_or(0, |m| m.steps)
    }

    /// Hot-swaps to policy `Q` with `config`, as the host does: the clocks are rebased (every
    /// live worker raised to the largest clock, see [`ShardView`]), `Q` is created from this
    /// policy's exported state with [`Policy::import_state`], timers are cleared, and every
    /// parked pull and held push is handed to `Q` again as a fresh event. `Err` if `Q` refuses
    /// (on a cluster the old policy would keep running).
    pub fn swap<Q: Policy>(mut self, config: &[(&str, &str)]) -> Result<Driver<Q>, String> {
        let state = self.guest.export().to_vec();
        self.clocks.rebase_to_max();
        let (guest, start) = self.import::<Q>(P::INFO.name, P::INFO.version, &state, config)?;
        let mut d = Driver {
            guest,
            clocks: self.clocks,
            now_ns: self.now_ns,
            rng: self.rng,
            next_id: self.next_id,
            parked: Vec::new(),
            served_at: BTreeMap::new(),
            local_steps: (0, BTreeMap::new()),
            held: Vec::new(),
            timers: Vec::new(),
            log: self.log,
            released: self.released,
            mode: self.mode,
            config: config.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
            model: self.model,
            leaving: None,
            incoming: Vec::new(),
            answers: VecDeque::new(),
        };
        d.complete_rounds();
        d.apply(&start, None, None)?;
        d.redeliver(self.parked, self.held)?;
        Ok(d)
    }

    /// Restarts the policy from its own exported state, as the host does after a failure (from
    /// its last checkpoint): timers survive, pending requests are handed to it again.
    pub fn restart(&mut self) -> Result<(), String> {
        let state = self.guest.export().to_vec();
        let config: Vec<(String, String)> = self.config.clone();
        let pairs: Vec<(&str, &str)> = config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        // The start-up decisions were applied when the policy first started.
        (self.guest, _) = self.import::<P>(P::INFO.name, P::INFO.version, &state, &pairs)?;
        let (parked, held) = (core::mem::take(&mut self.parked), core::mem::take(&mut self.held));
        self.redeliver(parked, held)
    }

    /// A new instance of `Q` created from `state`, its start-up decisions left in its output.
    fn import<Q: Policy>(
        &self,
        from_name: &str,
        from_version: &str,
        state: &[u8],
        config: &[(&str, &str)],
    ) -> Result<(Guest<Q>, Vec<u8>), String> {
        let workers: Vec<WorkerClock> = self.clocks.workers().collect();
        let handoff = Handoff { from_name, from_version, state, workers };
        let args = InitArgs { shard: 0, shards: 1, now_ns: self.now_ns, config: config.to_vec() };
        let mut bytes = encode(&args);
        bytes.extend_from_slice(&encode(&handoff));
        let mut guest = Guest::<Q>::new();
        write(&mut guest, &bytes);
        let out = guest.import(bytes.len()).to_vec();
        let start = started(&out)?.to_vec();
        Ok((guest, start))
    }

    /// Hands pending requests to the policy again as fresh events (pulls first, then pushes).
    fn redeliver(
        &mut self,
        parked: Vec<(RequestId, WorkerId, Release)>,
        held: Vec<(RequestId, WorkerId, Vec<f32>, Signals)>,
    ) -> Result<(), String> {
        for (id, worker, _) in parked {
            let clock = self.clocks.get(worker).unwrap_or(0);
            let pull = Pull { id, worker, iteration: clock, clock, version: self.steps() };
            self.send(self.clocks.view(), Event::Pull(pull), Some(id))?;
        }
        for (id, worker, grad, signals) in held {
            let clock = self.clocks.get(worker).unwrap_or(0);
            let (staleness, version) = (self.staleness(worker), self.steps());
            let push = Push { id, worker, iteration: clock, clock, samples: 1, staleness, version, signals };
            self.incoming = grad;
            self.send(self.clocks.view(), Event::Push(push), Some(id))?;
        }
        Ok(())
    }

    /// Advances host time.
    pub fn advance_ns(&mut self, ns: u64) {
        self.now_ns += ns;
    }

    /// The shard's clocks as the driver keeps them.
    pub fn view(&self) -> ShardView {
        self.clocks.view()
    }

    /// `worker`'s clock, if live.
    pub fn clock(&self, worker: WorkerId) -> Option<u64> {
        self.clocks.get(worker)
    }

    /// The local steps per iteration `worker` would be told with its next pull (0: it pushes
    /// gradients); a swap sets them back to 0, as the host does when the cluster has no
    /// default of its own.
    pub fn local_steps(&self, worker: WorkerId) -> u32 {
        self.local_steps.1.get(&worker).copied().unwrap_or(self.local_steps.0)
    }

    /// The update mode the policy last chose.
    pub fn update_mode(&self) -> Option<UpdateMode> {
        self.mode
    }

    /// Pulls that were parked and have since been released, oldest first.
    pub fn take_released(&mut self) -> Vec<RequestId> {
        self.released.drain(..).collect()
    }

    /// Pulls still parked.
    pub fn parked(&self) -> Vec<RequestId> {
        self.parked.iter().map(|p| p.0).collect()
    }

    /// A worker joins at the current minimum clock.
    pub fn join(&mut self, worker: WorkerId) {
        let clock = self.clocks.view().min_clock;
        let view = self.clocks.view();
        self.clocks.join(worker, clock);
        self.send(view, Event::WorkerJoined { worker, clock }, None).unwrap_or_else(|e| panic!("{e}"));
    }

    /// A worker leaves, as on a cluster: the policy hears it with the worker's held pushes still
    /// held and may admit or drop them; those it leaves held are applied (the host's default:
    /// their gradients are valid); its parked pulls are dropped, and the rounds and pulls it
    /// held up go on. Panics if the policy breaks a rule (use [`Driver::try_leave`] to see it).
    pub fn leave(&mut self, worker: WorkerId, reason: LeaveReason) {
        self.try_leave(worker, reason).unwrap_or_else(|e| panic!("{e}"));
    }

    /// [`Driver::leave`], returning the policy's broken rule instead of panicking.
    pub fn try_leave(&mut self, worker: WorkerId, reason: LeaveReason) -> Result<(), String> {
        let view = self.clocks.view();
        self.leaving = Some(worker);
        let heard = self.send(view, Event::WorkerLeft { worker, reason }, None);
        self.leaving = None;
        while let Some(pos) = self.held.iter().position(|h| h.1 == worker) {
            let (_, _, grad, _) = self.held.remove(pos);
            self.admitted(worker, None, grad);
        }
        self.parked.retain(|p| p.1 != worker);
        self.clocks.leave(worker);
        self.complete_rounds();
        self.release_ready();
        heard.map(|_| ())
    }

    /// `worker` pushes its next iteration. Returns the verdict.
    pub fn push(&mut self, worker: WorkerId) -> Result<PushVerdict, String> {
        let clock = self.clocks.get(worker).ok_or("push from a worker that is not live")?;
        self.push_iteration(worker, clock)
    }

    /// `worker` pushes a gradient numbered `iteration` (workers number their own iterations; a
    /// late joiner's or a rebased worker's numbers differ from its clock). Returns the verdict.
    pub fn push_iteration(&mut self, worker: WorkerId, iteration: u64) -> Result<PushVerdict, String> {
        let zeros = alloc::vec![0.0; self.params().len()];
        self.push_gradient(worker, iteration, &zeros)
    }

    /// `worker` pushes `grad` for `iteration` (see [`Driver::with_optimizer`]; without a model
    /// the gradient is ignored). Returns the verdict.
    pub fn push_gradient(
        &mut self,
        worker: WorkerId,
        iteration: u64,
        grad: &[f32],
    ) -> Result<PushVerdict, String> {
        self.push_signals(worker, iteration, grad, Signals::default())
    }

    /// `worker` pushes `grad` for `iteration` with what it reports of the iteration (ABI v3:
    /// `reported`'s loss, tokens and step time; the norm is measured here, as the host
    /// measures it, whatever `reported` says). Returns the verdict.
    pub fn push_signals(
        &mut self,
        worker: WorkerId,
        iteration: u64,
        grad: &[f32],
        reported: Signals,
    ) -> Result<PushVerdict, String> {
        let clock = self.clocks.get(worker).ok_or("push from a worker that is not live")?;
        if grad.len() != self.params().len() {
            return Err(alloc::format!(
                "a gradient of {} values for {} parameters",
                grad.len(),
                self.params().len()
            ));
        }
        self.incoming.clear();
        self.incoming.extend_from_slice(grad);
        let id = self.id();
        let view = self.clocks.view();
        let (staleness, version) = (self.staleness(worker), self.steps());
        let norm = Some(crate::measure::dot(grad, grad).sqrt() as f32);
        let signals = Signals { norm, ..reported };
        let push = Push { id, worker, iteration, clock, samples: 1, staleness, version, signals };
        let verdict = self.send(view, Event::Push(push), Some(id))?;
        verdict.push.ok_or_else(|| alloc::format!("push {id} got no verdict"))
    }

    /// `worker` carries out a [`Control::SkipTo`] to clock `clock` (the Driver numbers iterations
    /// by clock), as the host sees it: its clock rises to `clock` (if that is ahead), the rounds
    /// it held up complete and the pulls waiting on it are released. No event reaches the policy;
    /// send [`Driver::control_applied`] for the worker's acknowledgement.
    pub fn skip_to(&mut self, worker: WorkerId, clock: u64) -> Result<(), String> {
        let now = self.clocks.get(worker).ok_or("skip of a worker that is not live")?;
        self.clocks.advance(worker, clock.saturating_sub(now));
        self.complete_rounds();
        self.release_ready();
        Ok(())
    }

    /// `worker` pulls before computing its next iteration. Returns the verdict.
    pub fn pull(&mut self, worker: WorkerId) -> Result<PullVerdict, String> {
        let clock = self.clocks.get(worker).ok_or("pull from a worker that is not live")?;
        let id = self.id();
        let view = self.clocks.view();
        let pull = Pull { id, worker, iteration: clock, clock, version: self.steps() };
        let verdict = self.send(view, Event::Pull(pull), Some(id))?;
        if verdict.pull == Some(PullVerdict::Serve) {
            self.served_at.insert(worker, self.steps());
        }
        verdict.pull.ok_or_else(|| alloc::format!("pull {id} got no verdict"))
    }

    /// `worker` reports a finished iteration that took `compute_ns`.
    pub fn iteration_finished(&mut self, worker: WorkerId, compute_ns: u64) -> Result<(), String> {
        let iteration = self.clocks.get(worker).ok_or("report from a worker that is not live")?;
        self.report(IterationReport { worker, iteration, compute_ns, samples: 1 })
    }

    /// A worker reports a finished iteration, as given (samples and all).
    pub fn report(&mut self, report: IterationReport) -> Result<(), String> {
        self.clocks.get(report.worker).ok_or("report from a worker that is not live")?;
        let view = self.clocks.view();
        self.send(view, Event::IterationFinished(report), None).map(|_| ())
    }

    /// A worker acknowledges a control message (see [`Applied`]).
    pub fn control_applied(
        &mut self,
        worker: WorkerId,
        control: Control,
        iteration: u64,
    ) -> Result<(), String> {
        let view = self.clocks.view();
        self.send(view, Event::ControlApplied(Applied { worker, control, iteration }), None).map(|_| ())
    }

    /// Fires a timer (as the host does when it is due: it is no longer set).
    pub fn fire_timer(&mut self, timer: TimerId) -> Result<(), String> {
        self.timers.retain(|t| *t != timer);
        let view = self.clocks.view();
        self.send(view, Event::Timer { timer }, None).map(|_| ())
    }

    fn id(&mut self) -> RequestId {
        self.next_id += 1;
        self.next_id
    }

    fn send(
        &mut self,
        view: ShardView,
        event: Event,
        request: Option<RequestId>,
    ) -> Result<Verdicts, String> {
        self.rng = self.rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let env = Envelope { now_ns: self.now_ns, random: self.rng, view, event };
        let bytes = env.to_bytes();
        write(&mut self.guest, &bytes);
        let out = self.guest.event(bytes.len()).to_vec();
        let verdicts = self.apply(&out, request.map(|id| (id, event)), Some(&event))?;
        self.release_ready();
        // As the host does: the answers to the event's measures, in order, before anything else.
        while let Some((query, value)) = self.answers.pop_front() {
            self.send(self.clocks.view(), Event::Measured { query, value }, None)?;
        }
        Ok(verdicts)
    }

    /// Applies the decisions answering `request` (or none), each checked first by the decision
    /// rules the host's shards use ([`crate::rules`]).
    fn apply(
        &mut self,
        mut bytes: &[u8],
        request: Option<(RequestId, Event)>,
        event: Option<&Event>,
    ) -> Result<Verdicts, String> {
        let mut v = Verdicts::default();
        // `None`: a start-up's decisions.
        let mut rules = event.map_or_else(EventRules::without_event, EventRules::new);
        while !bytes.is_empty() {
            let (d, rest) = postcard::take_from_bytes::<Decision<'_>>(bytes)
                .map_err(|e| alloc::format!("undecodable decision: {e}"))?;
            bytes = rest;
            let mine = rules.check(&d, &*self)?;
            match d {
                Decision::ServePull { pull } => {
                    v.pull = Some(PullVerdict::Serve);
                    self.log.push(Recorded::Served(pull));
                }
                Decision::DeferPull { pull, until } => {
                    v.pull = Some(PullVerdict::Defer(until));
                    self.log.push(Recorded::Deferred(pull, until));
                    if let Some((_, Event::Pull(p))) = request {
                        self.parked.push((pull, p.worker, until));
                    }
                }
                Decision::ReleasePull { pull } => {
                    if let Some(p) = self.parked.iter().find(|p| p.0 == pull) {
                        self.served_at.insert(p.1, self.model.as_ref().map_or(0, |m| m.steps));
                    }
                    self.parked.retain(|p| p.0 != pull);
                    self.released.push_back(pull);
                    self.log.push(Recorded::Served(pull));
                }
                Decision::AdmitPush { push, weight } => {
                    if mine {
                        v.push = Some(weight.map_or(PushVerdict::Admit, PushVerdict::AdmitWeighted));
                        if let Some((_, Event::Push(p))) = request {
                            let grad = core::mem::take(&mut self.incoming);
                            self.admitted(p.worker, weight, grad);
                        }
                    } else if let Some(pos) = self.held.iter().position(|h| h.0 == push) {
                        let (_, worker, grad, _) = self.held.remove(pos);
                        self.admitted(worker, weight, grad);
                    }
                    self.log.push(Recorded::Admitted(push, weight));
                }
                Decision::DropPush { push } => {
                    if mine {
                        v.push = Some(PushVerdict::Drop);
                        if let Some((_, Event::Push(p))) = request {
                            self.clocks.tick(p.worker);
                        }
                    } else if let Some(pos) = self.held.iter().position(|h| h.0 == push) {
                        let (_, worker, ..) = self.held.remove(pos);
                        self.clocks.tick(worker);
                    }
                    self.complete_rounds();
                    self.log.push(Recorded::Dropped(push));
                }
                Decision::AdmitToGroup { push, group, weight } => {
                    let taken = match (mine, request) {
                        (true, Some((_, Event::Push(p)))) => {
                            v.push = Some(PushVerdict::Group(group));
                            Some((p.worker, core::mem::take(&mut self.incoming)))
                        }
                        _ => self.held.iter().position(|h| h.0 == push).map(|pos| {
                            let (_, worker, grad, _) = self.held.remove(pos);
                            (worker, grad)
                        }),
                    };
                    if let Some((worker, grad)) = taken {
                        self.clocks.tick(worker);
                        if let Some(m) = self.model.as_mut() {
                            let w = weight.unwrap_or(1.0);
                            let len = m.params.len();
                            let (sum, total) =
                                m.groups.entry(group).or_insert_with(|| (alloc::vec![0.0; len], 0.0));
                            for (s, g) in sum.iter_mut().zip(&grad) {
                                *s += w * g;
                            }
                            *total += w;
                        }
                        self.complete_rounds();
                    }
                    self.log.push(Recorded::AdmittedToGroup(push, group, weight));
                }
                Decision::CompleteGroup { group } => {
                    if let Some(m) = self.model.as_mut() {
                        if let Some((sum, weight)) = m.groups.remove(&group) {
                            m.optimizer.step(&mut m.params, &sum, 1.0 / weight.max(f32::MIN_POSITIVE));
                            m.steps += 1;
                        }
                    }
                    self.log.push(Recorded::GroupCompleted(group));
                }
                Decision::CompleteAggregate { clock } => {
                    if let Some(m) = self.model.as_mut() {
                        if let Some((sum, weight, _)) = m.rounds.remove(&clock) {
                            m.optimizer.step(&mut m.params, &sum, 1.0 / weight.max(f32::MIN_POSITIVE));
                            m.steps += 1;
                        }
                    }
                    self.log.push(Recorded::AggregateCompleted(clock));
                }
                Decision::HoldPush { push } => {
                    v.push = Some(PushVerdict::Hold);
                    if let Some((_, Event::Push(p))) = request {
                        self.held.push((push, p.worker, core::mem::take(&mut self.incoming), p.signals));
                    }
                    self.log.push(Recorded::Held(push));
                }
                Decision::SetUpdateMode(mode) => {
                    self.mode = Some(mode);
                    if mode == UpdateMode::OnArrival {
                        // As the host does: partial aggregates are applied as they stand.
                        if let Some(m) = self.model.as_mut() {
                            for (_, (sum, ..)) in core::mem::take(&mut m.rounds) {
                                m.optimizer.step(&mut m.params, &sum, 1.0);
                                m.steps += 1;
                            }
                        }
                    }
                    self.log.push(Recorded::UpdateMode(mode));
                }
                Decision::Control { worker, control } => self.log.push(Recorded::Control(worker, control)),
                Decision::SetTimer { timer, after_ns } => {
                    if !self.timers.contains(&timer) {
                        self.timers.push(timer);
                    }
                    self.log.push(Recorded::Timer(timer, after_ns));
                }
                Decision::CancelTimer { timer } => {
                    self.timers.retain(|t| *t != timer);
                    self.log.push(Recorded::TimerCancelled(timer));
                }
                Decision::Metric { name, value } => self.log.push(Recorded::Metric(name.into(), value)),
                Decision::SetLocalSteps { worker, steps } => {
                    match worker {
                        Some(w) => {
                            self.local_steps.1.insert(w, steps);
                        }
                        None => self.local_steps = (steps, BTreeMap::new()),
                    }
                    self.log.push(Recorded::LocalSteps(worker, steps));
                }
                Decision::SetOuterOptimizer { lr, momentum, nesterov } => {
                    self.log.push(Recorded::OuterOptimizer(lr, momentum, nesterov))
                }
                Decision::SetPullCodec { codec } => self.log.push(Recorded::PullCodec(codec)),
                Decision::SetOuterDelay { period } => self.log.push(Recorded::OuterDelay(period)),
                Decision::Measure { query, measure } => {
                    let own = match request {
                        Some((_, Event::Push(p))) if v.push.is_none() => Some(p.id),
                        _ => None,
                    };
                    let m = self.model.as_ref();
                    let (held, incoming) = (&self.held, &self.incoming);
                    let answer = crate::measure::evaluate(measure, |t| match t {
                        Tensor::Push(id) if own == Some(id) => Some(Scaled::plain(incoming)),
                        Tensor::Push(id) => held.iter().find(|h| h.0 == id).map(|h| Scaled::plain(&h.2)),
                        Tensor::Params => m.map(|m| Scaled::plain(&m.params)),
                        Tensor::Group(g) => {
                            m.and_then(|m| m.groups.get(&g)).and_then(|(sum, w)| Scaled::mean(sum, *w))
                        }
                        Tensor::Round(r) => {
                            m.and_then(|m| m.rounds.get(&r)).and_then(|(sum, w, _)| Scaled::mean(sum, *w))
                        }
                    });
                    self.answers.push_back((query, answer.value));
                    self.log.push(Recorded::Measured(query, measure, answer.value));
                }
            }
        }
        rules.finish()?;
        Ok(v)
    }

    /// A push admitted with `weight` (default `1 / live workers`): the worker's clock advances
    /// and the modelled optimizer steps on `grad`, now or with its round's aggregate.
    fn admitted(&mut self, worker: WorkerId, weight: Option<f32>, grad: Vec<f32>) {
        let round = self.clocks.get(worker).unwrap_or(0);
        let aggregate = self.mode == Some(UpdateMode::Aggregate);
        // As the host does: a mean push counts the live workers and, in aggregate mode, the
        // round's contributors that have left since.
        let gone = match (aggregate, self.model.as_ref().and_then(|m| m.rounds.get(&round))) {
            (true, Some((.., who))) => who.iter().filter(|w| !self.clocks.is_live(**w)).count() as u32,
            _ => 0,
        };
        let weight = weight.unwrap_or(1.0 / (self.clocks.view().workers + gone).max(1) as f32);
        self.clocks.tick(worker);
        if let Some(m) = self.model.as_mut() {
            if weight == 0.0 {
                // Weight 0 is a drop: nothing reaches the parameters.
            } else if aggregate {
                let len = m.params.len();
                let (sum, total, who) =
                    m.rounds.entry(round).or_insert_with(|| (alloc::vec![0.0; len], 0.0, Vec::new()));
                for (s, g) in sum.iter_mut().zip(&grad) {
                    *s += weight * g;
                }
                *total += weight;
                who.push(worker);
            } else {
                m.optimizer.step(&mut m.params, &grad, weight);
                m.steps += 1;
            }
        }
        self.complete_rounds();
    }

    /// Applies, in order, every round all live workers have passed.
    fn complete_rounds(&mut self) {
        let min_clock = self.clocks.view().min_clock;
        if let Some(m) = self.model.as_mut() {
            while let Some(entry) = m.rounds.first_entry() {
                if *entry.key() >= min_clock {
                    break;
                }
                let (sum, ..) = entry.remove();
                m.optimizer.step(&mut m.params, &sum, 1.0);
                m.steps += 1;
            }
        }
    }

    fn release_ready(&mut self) {
        let view = self.clocks.view();
        let steps = self.steps();
        let (released, served_at) = (&mut self.released, &mut self.served_at);
        self.parked.retain(|(id, worker, until)| {
            let met = until.is_met(view);
            if met {
                released.push_back(*id);
                served_at.insert(*worker, steps);
            }
            !met
        });
    }

    /// The staleness of `worker`'s push now: the steps since its last served pull (0 if it
    /// pulled nothing yet), as the host counts it.
    fn staleness(&self, worker: WorkerId) -> u64 {
        self.served_at.get(&worker).map_or(0, |&at| self.steps().saturating_sub(at))
    }
}

impl<P> DecisionState for Driver<P> {
    fn is_live(&self, worker: WorkerId) -> bool {
        self.clocks.is_live(worker) && self.leaving != Some(worker)
    }
    fn is_parked(&self, pull: RequestId) -> bool {
        self.parked.iter().any(|p| p.0 == pull)
    }
    fn is_held(&self, push: RequestId) -> bool {
        self.held.iter().any(|h| h.0 == push)
    }
    fn has_timer(&self, timer: TimerId) -> bool {
        self.timers.contains(&timer)
    }
    fn timers(&self) -> usize {
        self.timers.len()
    }
}

#[derive(Default)]
struct Verdicts {
    pull: Option<PullVerdict>,
    push: Option<PushVerdict>,
}

/// Checks a creation reply (`Result<(), String>` then decisions); returns the decisions.
fn started(out: &[u8]) -> Result<&[u8], String> {
    let (res, rest) = postcard::take_from_bytes::<Result<(), String>>(out)
        .map_err(|e| alloc::format!("bad init reply: {e}"))?;
    res?;
    Ok(rest)
}

fn write<P: Policy>(guest: &mut Guest<P>, bytes: &[u8]) {
    let ptr = guest.buffer(bytes.len());
    // SAFETY: `buffer` returned a pointer to at least `bytes.len()` initialised bytes owned by
    // `guest`, which nothing else borrows here.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{ParamKind, ParamSpec, PolicyInfo};
    use crate::{Ctx, Init};

    /// Admits every push on arrival and serves every pull; records the staleness it is shown.
    struct Records {
        staleness: Vec<u64>,
    }

    impl Policy for Records {
        const INFO: PolicyInfo = PolicyInfo::new("records", "0", "test", &[]);
        fn new(_init: &Init) -> Result<Self, String> {
            Ok(Records { staleness: Vec::new() })
        }
        fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
            PullVerdict::Serve
        }
        fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
            self.staleness.push(push.staleness);
            ctx.metric("staleness", push.staleness as f64);
            PushVerdict::Admit
        }
    }

    /// Holds every push; on a worker's departure drops its held push if `drop` is set, else
    /// leaves it to the host.
    struct Holds {
        drop: bool,
        held: Vec<(WorkerId, RequestId)>,
    }

    impl Policy for Holds {
        const INFO: PolicyInfo = PolicyInfo::new(
            "holds",
            "0",
            "test",
            &[ParamSpec::new("drop", ParamKind::Bool, "false", "drop a leaver's held push")],
        );
        fn new(init: &Init) -> Result<Self, String> {
            Ok(Holds { drop: init.config.get("drop")?, held: Vec::new() })
        }
        fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
            PullVerdict::Serve
        }
        fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
            self.held.push((push.worker, push.id));
            PushVerdict::Hold
        }
        fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
            for (w, id) in core::mem::take(&mut self.held) {
                match w == worker && self.drop {
                    true => ctx.drop_push(id),
                    false => self.held.push((w, id)),
                }
            }
            self.held.retain(|h| h.0 != worker);
        }
    }

    /// Issue 50: the Driver counted no steps without `with_optimizer`, so every push showed
    /// staleness 0 and a staleness test passed without testing anything. It counts the steps a
    /// shard would, as a shard does.
    #[test]
    fn pushes_carry_their_staleness_without_an_optimizer() {
        let mut d = Driver::<Records>::new(&[]).unwrap();
        d.join(0);
        d.join(1);
        d.pull(0).unwrap();
        d.pull(1).unwrap();
        d.push(0).unwrap();
        d.push(0).unwrap();
        // Worker 1 pulled before worker 0's two steps.
        d.push(1).unwrap();
        assert_eq!(d.steps(), 3);
        let shown: Vec<f64> = d
            .log
            .iter()
            .filter_map(|r| match r {
                Recorded::Metric(n, v) if n == "staleness" => Some(*v),
                _ => None,
            })
            .collect();
        assert_eq!(shown, [0.0, 1.0, 2.0]);
    }

    /// Issue 50: a worker that leaves while its push is held. The policy hears it with the push
    /// still held and decides; what it leaves held is applied, as a shard does.
    #[test]
    fn a_leavers_held_push_is_the_policys_to_drop_and_else_applied() {
        let sgd = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        for (drop, applied) in [("false", -1.0), ("true", 0.0)] {
            let mut d = Driver::<Holds>::new(&[("drop", drop)]).unwrap().with_optimizer(sgd, vec![0.0]);
            d.join(0);
            d.join(1);
            assert_eq!(d.push_gradient(0, 0, &[2.0]).unwrap(), PushVerdict::Hold);
            d.leave(0, LeaveReason::TimedOut);
            assert_eq!(d.params(), &[applied], "drop={drop}");
            assert_eq!(d.clock(0), None);
            let dropped = d.log.iter().any(|r| matches!(r, Recorded::Dropped(_)));
            assert_eq!(dropped, drop == "true");
        }
    }
}
