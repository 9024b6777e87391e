//! `adaptive-deadline`: synchronous rounds that stop waiting when the arrivals say the rest are
//! late. Hivemind's users ask for deadlines that follow the arrival times (median + k·MAD)
//! instead of hand-tuned timeouts; this is that rule, **our reading** (no paper fixes it):
//!
//! - Rounds as BSP's: updates aggregate by round (a round is a worker's clock), and a pull
//!   before computing round `r` waits until round `r - 1` is complete.
//! - Every push but a round's first has an **arrival delay**: the time from the round's first
//!   push here to it. The last `window` delays are kept (pushes that come too late included, so
//!   lateness raises the deadline).
//! - Once `warmup` delays are in, a round's first push sets its deadline: that push's arrival
//!   plus `median + max(k · MAD, min_ms)` of the window (MAD unscaled: multiply `k` by 1.4826
//!   to count in standard deviations of a normal spread; the `min_ms` floor keeps workers whose
//!   arrivals hardly differ, MAD about 0, from being cut by the transport's jitter). Before that,
//!   rounds wait for everyone (BSP).
//! - A round completes when every live worker's gradient is in, or at its deadline with those
//!   that are (one optimizer step on their mean).
//! - A gradient for a completed round is dropped (its worker's clock moves on, its next pull
//!   is served on the newer model), as backup workers' are.
//!
//! Timing from the round's first arrival, not from its opening, keeps the shards in step: every
//! shard sees the same pushes at nearly the same times, whereas a round's opening is each
//! shard's own and the workers start a round only once every shard has opened it. (Timed from
//! the openings, the shards' deadlines drifted apart and the cuts alternated between them: no
//! gain over BSP with a straggler.) Each shard still decides alone, so a push that arrives at
//! its deadline on one shard and just before it on another is dropped on the first and kept on
//! the second. The policy's state (rounds, arrivals, the window) is handed over with the SDK's
//! serde helper, so a restart from a checkpoint, or a swap to `adaptive-deadline` with other
//! numbers, goes on where it was; a swap from another policy starts a fresh window.

use std::collections::VecDeque;

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::rounds::RoundGate;
use syncopate_policy_sdk::state;

/// What survives a restart or a swap to this policy.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Saved {
    complete: u64,
    firsts: Vec<(u64, u64)>,
    arrived: Vec<(u64, u32)>,
    delays: Vec<u64>,
    armed: Option<u64>,
    dropped: u64,
    cut: u64,
}

/// The timer of the open round's deadline.
const DEADLINE: TimerId = 1;

/// Rounds whose first arrival times are kept (late pushes are timed against theirs).
const ROUNDS: usize = 64;

/// Synchronous rounds cut at median + k·MAD of the arrivals.
#[derive(Debug)]
pub struct AdaptiveDeadline {
    k: f64,
    min_ns: u64,
    window: usize,
    warmup: usize,
    live: u32,
    /// Rounds below this are complete; this one is open.
    complete: u64,
    /// When recent rounds' first pushes arrived: (round, host ns).
    firsts: VecDeque<(u64, u64)>,
    /// Gradients in per open round: (round, count).
    arrived: Vec<(u64, u32)>,
    /// The last arrival delays, in ns.
    delays: VecDeque<u64>,
    /// The round the deadline timer is set for.
    armed: Option<u64>,
    /// Pulls waiting for a round to complete.
    waiting: RoundGate,
    dropped: u64,
    cut: u64,
    codecs: CodecChoice,
}

/// The median of `xs` (sorted in place).
fn median(xs: &mut [u64]) -> u64 {
    xs.sort_unstable();
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        xs[n / 2 - 1] / 2 + xs[n / 2] / 2
    }
}

impl AdaptiveDeadline {
    /// How long after a round's first arrival it is cut, once the window is warm.
    fn deadline_ns(&self) -> Option<u64> {
        if self.delays.len() < self.warmup.max(1) {
            return None;
        }
        let mut xs: Vec<u64> = self.delays.iter().copied().collect();
        let med = median(&mut xs);
        let mut dev: Vec<u64> = xs.iter().map(|x| x.abs_diff(med)).collect();
        let mad = median(&mut dev);
        let spread = ((self.k * mad as f64) as u64).max(self.min_ns);
        Some(med.saturating_add(spread))
    }

    /// A push of `round` arrived now: its delay joins the window. Returns whether it is the
    /// round's first.
    fn record(&mut self, round: u64, now: u64) -> bool {
        match self.firsts.iter().find(|f| f.0 == round) {
            Some(&(_, first)) => {
                if self.delays.len() == self.window {
                    self.delays.pop_front();
                }
                self.delays.push_back(now.saturating_sub(first));
                false
            }
            None => {
                if self.firsts.len() == ROUNDS {
                    self.firsts.pop_front();
                }
                self.firsts.push_back((round, now));
                true
            }
        }
    }

    /// Completes round `complete` (one step on the gradients in) and releases the pulls that
    /// waited for it.
    fn finish_round(&mut self, ctx: &mut Ctx<'_>) {
        let round = self.complete;
        ctx.complete_aggregate(round);
        self.arrived.retain(|a| a.0 != round);
        self.complete = round + 1;
        if self.armed.take().is_some() {
            ctx.cancel_timer(DEADLINE);
        }
        self.waiting.completed(ctx, self.complete);
    }

    /// Completes every open round that has every live worker's gradient, in order; arms the
    /// deadline of the round then open if its first push is in.
    fn complete_ready(&mut self, ctx: &mut Ctx<'_>) {
        loop {
            let have = self.arrived.iter().find(|a| a.0 == self.complete).map_or(0, |a| a.1);
            if have == 0 {
                return;
            }
            if have < self.live {
                self.arm(ctx);
                return;
            }
            self.finish_round(ctx);
        }
    }

    /// Sets the open round's deadline (from its first arrival), once, if the window is warm.
    fn arm(&mut self, ctx: &mut Ctx<'_>) {
        let round = self.complete;
        if self.armed == Some(round) {
            return;
        }
        let first = self.firsts.iter().find(|f| f.0 == round).map(|f| f.1);
        if let (Some(first), Some(d)) = (first, self.deadline_ns()) {
            let after = (first + d).saturating_sub(ctx.now_ns());
            ctx.set_timer(DEADLINE, after);
            ctx.metric("adaptive.deadline_ms", d as f64 / 1e6);
            self.armed = Some(round);
        }
    }
}

impl Policy for AdaptiveDeadline {
    const INFO: PolicyInfo = PolicyInfo::new(
        "adaptive-deadline",
        env!("CARGO_PKG_VERSION"),
        "Synchronous rounds cut at median + k·MAD of recent arrival delays; late gradients dropped.",
        &[
            ParamSpec::new("k", ParamKind::Float, "3", "MADs beyond the median arrival delay a round waits"),
            ParamSpec::new("min_ms", ParamKind::Float, "2", "least wait beyond the median delay, in ms"),
            ParamSpec::new(
                "window",
                ParamKind::Uint,
                "64",
                "arrival delays the median and MAD are taken over",
            ),
            ParamSpec::new(
                "warmup",
                ParamKind::Uint,
                "8",
                "arrival delays before any round is cut (BSP until then)",
            ),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let k: f64 = init.config.get("k")?;
        let min_ms: f64 = init.config.get("min_ms")?;
        let window: usize = init.config.get("window")?;
        let warmup: usize = init.config.get("warmup")?;
        if !((0.0..=100.0).contains(&k) && (0.0..=60_000.0).contains(&min_ms)) {
            return Err(format!("k = {k}, min_ms = {min_ms}: k in [0, 100], min_ms in [0, 60000]"));
        }
        if !(1..=10_000).contains(&window) || warmup > window {
            return Err(format!(
                "window = {window}, warmup = {warmup}: 1 to 10000 delays, warmup at most window"
            ));
        }
        Ok(AdaptiveDeadline {
            k,
            min_ns: (min_ms * 1e6) as u64,
            window,
            warmup,
            live: 0,
            complete: 0,
            firsts: VecDeque::new(),
            arrived: Vec::new(),
            delays: VecDeque::new(),
            armed: None,
            waiting: RoundGate::default(),
            dropped: 0,
            cut: 0,
            codecs: CodecChoice::from_config(&init.config)?,
        })
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&Saved {
            complete: self.complete,
            firsts: self.firsts.iter().copied().collect(),
            arrived: self.arrived.clone(),
            delays: self.delays.iter().copied().collect(),
            armed: self.armed,
            dropped: self.dropped,
            cut: self.cut,
        })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut me = Self::new(init)?;
        me.live = handoff.workers.len() as u32;
        // After a swap the host has levelled the clocks and applied every aggregate below the
        // common clock: rounds begin there. A restart keeps its rounds and their arrivals.
        let level = handoff.workers.iter().map(|w| w.clock).min().unwrap_or(0);
        let saved = state::load::<Saved>(handoff, Self::INFO.name)?.unwrap_or_default();
        me.complete = saved.complete.max(level);
        me.arrived = saved.arrived.into_iter().filter(|a| a.0 >= me.complete).collect();
        me.firsts = saved.firsts.into_iter().rev().take(ROUNDS).rev().collect();
        me.delays = saved.delays.into_iter().rev().take(me.window).rev().collect();
        me.armed = saved.armed.filter(|r| *r == me.complete);
        (me.dropped, me.cut) = (saved.dropped, saved.cut);
        Ok(me)
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        self.codecs.on_start(ctx);
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, _worker: WorkerId, _clock: u64) {
        self.live += 1;
        self.complete_ready(ctx);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.live = self.live.saturating_sub(1);
        self.codecs.forget(worker);
        self.waiting.forget(worker);
        self.complete_ready(ctx);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        self.waiting.pull(pull, self.complete)
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        self.record(push.clock, ctx.now_ns());
        if push.clock < self.complete {
            self.dropped += 1;
            ctx.metric("adaptive.dropped", self.dropped as f64);
            return PushVerdict::Drop;
        }
        match self.arrived.iter_mut().find(|a| a.0 == push.clock) {
            Some(a) => a.1 += 1,
            None => self.arrived.push((push.clock, 1)),
        }
        PushVerdict::Admit
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {
        self.complete_ready(ctx);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer != DEADLINE || self.armed.take() != Some(self.complete) {
            return;
        }
        self.cut += 1;
        ctx.metric("adaptive.cut_rounds", self.cut as f64);
        self.finish_round(ctx);
        self.complete_ready(ctx);
    }
}

syncopate_policy_sdk::export_policy!(AdaptiveDeadline);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    const MS: u64 = 1_000_000;

    /// Three workers whose pushes come 1 and 2 ms after each round's first (BSP until the
    /// window is warm); then worker 2 is late: the round is cut 3.5 ms after its first push
    /// (median 1.5 ms, plus the 2 ms floor over 3 × MAD = 1.5 ms), and worker 2's gradient,
    /// when it comes, is dropped.
    #[test]
    fn a_round_is_cut_at_median_plus_the_floor_once_warm_and_the_late_gradient_dropped() {
        let mut d = Driver::<AdaptiveDeadline>::new(&[("warmup", "4"), ("k", "3")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for round in 0..2 {
            d.advance_ns(20 * MS);
            for w in 0..3 {
                d.push(w).unwrap();
                d.advance_ns(MS);
            }
            assert!(d.log.contains(&Recorded::AggregateCompleted(round)));
        }
        d.advance_ns(20 * MS);
        d.push(0).unwrap();
        assert!(d.log.contains(&Recorded::Timer(DEADLINE, 3_500_000)), "{:?}", d.log);
        d.advance_ns(MS);
        d.push(1).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::Explicit));
        d.advance_ns(3 * MS);
        d.fire_timer(DEADLINE).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(2)), "cut with two of three");
        assert_eq!(d.take_released().len(), 1, "the waiting pull goes on");
        d.advance_ns(20 * MS);
        assert_eq!(d.push(2).unwrap(), PushVerdict::Drop, "worker 2 was late");
        assert_eq!(d.pull(2).unwrap(), PullVerdict::Serve, "and goes on from the newer model");
    }

    /// The deadline follows the arrivals: delays 10, 30, 20 and 40 ms give median 25 and MAD
    /// 10: a round is cut 25 + 2 × 10 = 45 ms after its first push.
    #[test]
    fn the_deadline_is_the_median_plus_k_mads_of_the_window() {
        let mut d = Driver::<AdaptiveDeadline>::new(&[("warmup", "4"), ("k", "2"), ("min_ms", "0")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for (a, b) in [(10, 20), (20, 20)] {
            d.push(0).unwrap();
            d.advance_ns(a * MS);
            d.push(1).unwrap();
            d.advance_ns(b * MS);
            d.push(2).unwrap();
        }
        d.push(0).unwrap();
        assert!(d.log.contains(&Recorded::Timer(DEADLINE, 45 * MS)), "{:?}", d.log);
        // Everyone in before the deadline: the round completes and the timer goes.
        d.push(1).unwrap();
        d.push(2).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(2)));
        assert!(d.log.contains(&Recorded::TimerCancelled(DEADLINE)));
        assert!(Driver::<AdaptiveDeadline>::new(&[("warmup", "100"), ("window", "10")]).is_err());
    }
}
