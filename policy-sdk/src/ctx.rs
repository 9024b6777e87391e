//! The context a policy handler receives: host time, the seeded random source, the shard's
//! clocks, and the methods that emit decisions.

use crate::guest::Encoder;

use crate::abi::{Control, Decision, RequestId, ShardView, TimerId, UpdateMode, WorkerId};

/// What a handler can read and do while it handles one event.
///
/// Decisions emitted through a `Ctx` are written straight into the reply to the host, in order.
#[derive(Debug)]
pub struct Ctx<'a> {
    now_ns: u64,
    random: u64,
    view: ShardView,
    out: &'a mut Encoder,
}

/// SplitMix64: expands the host's per-event value into as many draws as a handler needs (shard
/// and cluster policies alike).
pub(crate) fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(now_ns: u64, random: u64, view: ShardView, out: &'a mut Encoder) -> Self {
        Ctx { now_ns, random, view, out }
    }

    /// Host time in nanoseconds (virtual time in the simulator). The only clock a policy has.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// The shard's clocks when the event arrived.
    pub fn view(&self) -> ShardView {
        self.view
    }

    /// The next value from the host-seeded random source. Deterministic given the event stream:
    /// replaying the same events gives the same values.
    pub fn random_u64(&mut self) -> u64 {
        splitmix(&mut self.random)
    }

    /// A uniform draw from `[0, 1)`.
    pub fn random_f64(&mut self) -> f64 {
        (self.random_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Answer a pull that this policy deferred with [`Release::Explicit`](crate::abi::Release).
    pub fn release_pull(&mut self, pull: RequestId) {
        self.emit(&Decision::ReleasePull { pull });
    }

    /// Admit a push that this policy held, with the host's default weight.
    pub fn admit_push(&mut self, push: RequestId) {
        self.emit(&Decision::AdmitPush { push, weight: None });
    }

    /// Admit a held push with an explicit weight.
    pub fn admit_push_weighted(&mut self, push: RequestId, weight: f32) {
        self.emit(&Decision::AdmitPush { push, weight: Some(weight) });
    }

    /// Drop a push that this policy held: its gradient never reaches the parameters (see
    /// [`PushVerdict::Drop`](crate::PushVerdict::Drop)).
    pub fn drop_push(&mut self, push: RequestId) {
        self.emit(&Decision::DropPush { push });
    }

    /// In aggregate mode, apply round `clock`'s aggregate now with the contributions that are in
    /// (one optimizer step on their weighted mean); see
    /// [`Decision::CompleteAggregate`](crate::abi::Decision::CompleteAggregate).
    pub fn complete_aggregate(&mut self, clock: u64) {
        self.emit(&Decision::CompleteAggregate { clock });
    }

    /// Admit a push (held, or the event's own from `after_push` once `on_push` held it) into
    /// group `group`, at weight 1: it is acknowledged, and its gradient waits
    /// in the group for [`complete_group`](Self::complete_group), whatever its worker's clock
    /// (see [`Decision::AdmitToGroup`](crate::abi::Decision::AdmitToGroup)).
    pub fn admit_to_group(&mut self, push: RequestId, group: u64) {
        self.emit(&Decision::AdmitToGroup { push, group, weight: None });
    }

    /// [`admit_to_group`](Self::admit_to_group) with an explicit weight.
    pub fn admit_to_group_weighted(&mut self, push: RequestId, group: u64, weight: f32) {
        self.emit(&Decision::AdmitToGroup { push, group, weight: Some(weight) });
    }

    /// Apply group `group` as one optimizer step on the weighted mean of its gradients (see
    /// [`Decision::CompleteGroup`](crate::abi::Decision::CompleteGroup)).
    pub fn complete_group(&mut self, group: u64) {
        self.emit(&Decision::CompleteGroup { group });
    }

    /// Choose how admitted gradients are applied from now on.
    pub fn set_update_mode(&mut self, mode: UpdateMode) {
        self.emit(&Decision::SetUpdateMode(mode));
    }

    /// Every worker, present and future, takes `steps` local steps per iteration from its next
    /// pull on and pushes pseudo-gradients (0: gradients, the default); see
    /// [`Decision::SetLocalSteps`](crate::abi::Decision::SetLocalSteps).
    pub fn set_local_steps(&mut self, steps: u32) {
        self.emit(&Decision::SetLocalSteps { worker: None, steps });
    }

    /// [`set_local_steps`](Self::set_local_steps) for one worker.
    pub fn set_local_steps_of(&mut self, worker: WorkerId, steps: u32) {
        self.emit(&Decision::SetLocalSteps { worker: Some(worker), steps });
    }

    /// The optimizer this shard applies to pseudo-gradients; see
    /// [`Decision::SetOuterOptimizer`](crate::abi::Decision::SetOuterOptimizer).
    pub fn set_outer_optimizer(&mut self, lr: f32, momentum: f32, nesterov: bool) {
        self.emit(&Decision::SetOuterOptimizer { lr, momentum, nesterov });
    }

    /// Step the outer momentum once every `period` outer steps (Delayed Nesterov); see
    /// [`Decision::SetOuterDelay`](crate::abi::Decision::SetOuterDelay).
    pub fn set_outer_delay(&mut self, period: u32) {
        self.emit(&Decision::SetOuterDelay { period });
    }

    /// Answer this shard's pulls in `codec` from now on; see
    /// [`Decision::SetPullCodec`](crate::abi::Decision::SetPullCodec). Push codecs are set per
    /// worker with [`control`](Self::control) and
    /// [`Control::SetPushCodec`](crate::abi::Control::SetPushCodec).
    pub fn set_pull_codec(&mut self, codec: crate::abi::Codec) {
        self.emit(&Decision::SetPullCodec { codec });
    }

    /// Send a control message to a worker.
    pub fn control(&mut self, worker: WorkerId, control: Control) {
        self.emit(&Decision::Control { worker, control });
    }

    /// Fire a timer event after `after_ns` of host time (re-arms an existing timer).
    pub fn set_timer(&mut self, timer: TimerId, after_ns: u64) {
        self.emit(&Decision::SetTimer { timer, after_ns });
    }

    /// Cancel a timer.
    pub fn cancel_timer(&mut self, timer: TimerId) {
        self.emit(&Decision::CancelTimer { timer });
    }

    /// Ask the host for a norm, dot product or cosine of this shard's tensors (a push, the
    /// parameters, an open group or round), by handle: the host computes it in place and
    /// answers with [`Policy::on_measured`](crate::Policy::on_measured) and the same `query`,
    /// right after this event. To weigh a push by its measure, hold it
    /// ([`PushVerdict::Hold`](crate::PushVerdict::Hold)) and admit it when the answer comes.
    /// At most [`MAX_MEASURES`](crate::rules::MAX_MEASURES) per event (ABI v3).
    pub fn measure(&mut self, query: u64, measure: crate::abi::Measure) {
        self.emit(&Decision::Measure { query, measure });
    }

    /// Record a metric sample; the host aggregates samples by name.
    pub fn metric(&mut self, name: &str, value: f64) {
        self.emit(&Decision::Metric { name, value });
    }

    pub(crate) fn emit(&mut self, decision: &Decision<'_>) {
        self.out.push(decision);
    }
}
