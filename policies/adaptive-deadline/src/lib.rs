//! `adaptive-deadline`: synchronous rounds that stop waiting when the arrivals say the rest are
//! late. Hivemind's users ask for deadlines that follow the arrival times (median + k·MAD)
//! instead of hand-tuned timeouts; this is that rule, **our reading** (no paper fixes it):
//!
//! - Rounds as BSP's: updates aggregate by round (a round is a worker's clock), and a pull
//!   before computing round `r` waits until round `r - 1` is complete.
//! - Round `r` opens when round `r - 1` completes. Every push's **arrival offset**, the time
//!   from its round's opening to its arrival, joins a window of the last `window` offsets
//!   (pushes that come too late included, so lateness raises the deadline).
//! - Once the window holds `warmup` offsets, each round gets a deadline when it opens: its
//!   opening plus `median + max(k · MAD, slack · median)` of the window (MAD unscaled: multiply
//!   `k` by 1.4826 to count in standard deviations of a normal spread; the `slack` floor keeps
//!   identical workers, whose MAD is 0, from being cut a hair late). Before that, rounds wait
//!   for everyone (BSP).
//! - A round completes when every live worker's gradient is in, or at its deadline with those
//!   that are (one optimizer step on their mean); a round with none in by then waits for its
//!   first and all others (the window learns the slower pace).
//! - A gradient for a completed round is dropped (its worker's clock moves on, its next pull
//!   is served on the newer model), as backup workers' are.
//!
//! Each shard's instance decides for itself from what it sees, as every policy does; a
//! worker's push that arrives at its deadline on one shard and just before it on another is
//! dropped on the first and kept on the second. A hot swap starts a fresh window.

use std::collections::VecDeque;

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// The timer of the open round's deadline.
const DEADLINE: TimerId = 1;

/// Rounds whose opening times are kept (late pushes are timed against theirs).
const OPENINGS: usize = 64;

/// Synchronous rounds cut at median + k·MAD of the arrivals.
#[derive(Debug)]
pub struct AdaptiveDeadline {
    k: f64,
    slack: f64,
    window: usize,
    warmup: usize,
    live: u32,
    /// Rounds below this are complete; this one is open.
    complete: u64,
    /// When recent rounds opened: (round, host ns).
    opened: VecDeque<(u64, u64)>,
    /// Gradients in per open round: (round, count).
    arrived: Vec<(u64, u32)>,
    /// The last arrival offsets, in ns.
    offsets: VecDeque<u64>,
    /// The round the deadline timer is set for.
    armed: Option<u64>,
    /// Pulls waiting for a round to complete: (pull, its worker, the round it waits for).
    waiting: Vec<(RequestId, WorkerId, u64)>,
    dropped: u64,
    early: u64,
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
    /// The deadline offset the window gives, once warm.
    fn deadline_ns(&self) -> Option<u64> {
        if self.offsets.len() < self.warmup.max(1) {
            return None;
        }
        let mut xs: Vec<u64> = self.offsets.iter().copied().collect();
        let med = median(&mut xs);
        let mut dev: Vec<u64> = xs.iter().map(|x| x.abs_diff(med)).collect();
        let mad = median(&mut dev);
        let spread = (self.k * mad as f64).max(self.slack * med as f64);
        Some(med.saturating_add(spread as u64))
    }

    fn opened_at(&self, round: u64) -> Option<u64> {
        self.opened.iter().find(|o| o.0 == round).map(|o| o.1)
    }

    fn record(&mut self, round: u64, now: u64) {
        if let Some(t) = self.opened_at(round) {
            if self.offsets.len() == self.window {
                self.offsets.pop_front();
            }
            self.offsets.push_back(now.saturating_sub(t));
        }
    }

    /// Round `round` opens now: its deadline is set if the window is warm.
    fn open(&mut self, ctx: &mut Ctx<'_>, round: u64) {
        if self.opened.len() == OPENINGS {
            self.opened.pop_front();
        }
        self.opened.push_back((round, ctx.now_ns()));
        match self.deadline_ns() {
            Some(d) => {
                ctx.set_timer(DEADLINE, d);
                ctx.metric("adaptive.deadline_ms", d as f64 / 1e6);
                self.armed = Some(round);
            }
            None => {
                if self.armed.take().is_some() {
                    ctx.cancel_timer(DEADLINE);
                }
            }
        }
    }

    /// Completes round `complete` (one step on the gradients in), releases the pulls that
    /// waited for it, and opens the next.
    fn finish_round(&mut self, ctx: &mut Ctx<'_>) {
        let round = self.complete;
        ctx.complete_aggregate(round);
        self.arrived.retain(|a| a.0 != round);
        self.complete = round + 1;
        let complete = self.complete;
        self.waiting.retain(|&(pull, _, wants)| {
            let ready = wants < complete;
            if ready {
                ctx.release_pull(pull);
            }
            !ready
        });
        self.open(ctx, complete);
    }

    fn complete_ready(&mut self, ctx: &mut Ctx<'_>) {
        loop {
            let have = self.arrived.iter().find(|a| a.0 == self.complete).map_or(0, |a| a.1);
            if have == 0 || have < self.live {
                return;
            }
            self.finish_round(ctx);
        }
    }
}

impl Policy for AdaptiveDeadline {
    const INFO: PolicyInfo = PolicyInfo::new(
        "adaptive-deadline",
        env!("CARGO_PKG_VERSION"),
        "Synchronous rounds cut at median + k·MAD of recent arrival times; late gradients dropped.",
        &[
            ParamSpec::new("k", ParamKind::Float, "3", "MADs beyond the median arrival a round waits"),
            ParamSpec::new(
                "slack",
                ParamKind::Float,
                "0.1",
                "least wait beyond the median, as a share of it",
            ),
            ParamSpec::new("window", ParamKind::Uint, "64", "arrivals the median and MAD are taken over"),
            ParamSpec::new(
                "warmup",
                ParamKind::Uint,
                "8",
                "arrivals before any round is cut (BSP until then)",
            ),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let k: f64 = init.config.get("k")?;
        let slack: f64 = init.config.get("slack")?;
        let window: usize = init.config.get("window")?;
        let warmup: usize = init.config.get("warmup")?;
        if !((0.0..=100.0).contains(&k) && (0.0..=10.0).contains(&slack)) {
            return Err(format!("k = {k}, slack = {slack}: k in [0, 100], slack in [0, 10]"));
        }
        if !(1..=10_000).contains(&window) || warmup > window {
            return Err(format!(
                "window = {window}, warmup = {warmup}: 1 to 10000 arrivals, warmup at most window"
            ));
        }
        Ok(AdaptiveDeadline {
            k,
            slack,
            window,
            warmup,
            live: 0,
            complete: 0,
            opened: VecDeque::new(),
            arrived: Vec::new(),
            offsets: VecDeque::new(),
            armed: None,
            waiting: Vec::new(),
            dropped: 0,
            early: 0,
            codecs: CodecChoice::from_config(&init.config)?,
        })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut me = Self::new(init)?;
        me.live = handoff.workers.len() as u32;
        // The host levelled the clocks and applied every open aggregate: rounds begin at the
        // common clock.
        me.complete = handoff.workers.iter().map(|w| w.clock).min().unwrap_or(0);
        Ok(me)
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        self.codecs.on_start(ctx);
        let round = self.complete;
        self.open(ctx, round);
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, _worker: WorkerId, _clock: u64) {
        self.live += 1;
        self.complete_ready(ctx);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.live = self.live.saturating_sub(1);
        self.codecs.forget(worker);
        self.waiting.retain(|w| w.1 != worker);
        self.complete_ready(ctx);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        if pull.clock <= self.complete {
            return PullVerdict::Serve;
        }
        self.waiting.push((pull.id, pull.worker, pull.clock - 1));
        PullVerdict::Defer(Release::Explicit)
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
        let have = self.arrived.iter().find(|a| a.0 == self.complete).map_or(0, |a| a.1);
        if have > 0 {
            self.early += 1;
            ctx.metric("adaptive.cut_rounds", self.early as f64);
            self.finish_round(ctx);
            self.complete_ready(ctx);
        }
    }
}

syncopate_policy_sdk::export_policy!(AdaptiveDeadline);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    const MS: u64 = 1_000_000;

    /// Three workers arrive 10 ms into each round for a while (BSP until the window is warm);
    /// then worker 2 is late: the round is cut at the median plus the slack, 11 ms, and its
    /// gradient, when it comes, is dropped.
    #[test]
    fn a_round_is_cut_at_median_plus_slack_once_warm_and_the_late_gradient_dropped() {
        let mut d = Driver::<AdaptiveDeadline>::new(&[("warmup", "6"), ("k", "3")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for round in 0..2 {
            d.advance_ns(10 * MS);
            for w in 0..3 {
                d.push(w).unwrap();
            }
            assert!(d.log.contains(&Recorded::AggregateCompleted(round)));
        }
        // Warm now (6 offsets of 10 ms, MAD 0): round 2 is cut at 10 ms + 10%.
        assert!(d.log.contains(&Recorded::Timer(DEADLINE, 11 * MS)), "{:?}", d.log);
        d.advance_ns(10 * MS);
        d.push(0).unwrap();
        d.push(1).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::Explicit));
        d.advance_ns(MS);
        d.fire_timer(DEADLINE).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(2)), "cut with two of three");
        assert_eq!(d.take_released().len(), 1, "the waiting pull goes on");
        d.advance_ns(20 * MS);
        assert_eq!(d.push(2).unwrap(), PushVerdict::Drop, "worker 2 was late");
        assert_eq!(d.pull(2).unwrap(), PullVerdict::Serve, "and goes on from the newer model");
    }

    /// The deadline follows the arrivals: a spread of offsets gives median + k·MAD.
    #[test]
    fn the_deadline_is_the_median_plus_k_mads_of_the_window() {
        let mut d = Driver::<AdaptiveDeadline>::new(&[("warmup", "4"), ("k", "2"), ("slack", "0")]).unwrap();
        for w in 0..2 {
            d.join(w);
        }
        // Offsets 10, 20 (round 0) and 30, 40 (round 1): median 25, MAD 10: 25 + 2 × 10 = 45 ms.
        for (a, b) in [(10, 10), (30, 10)] {
            d.advance_ns(a * MS);
            d.push(0).unwrap();
            d.advance_ns(b * MS);
            d.push(1).unwrap();
        }
        assert!(d.log.contains(&Recorded::Timer(DEADLINE, 45 * MS)), "{:?}", d.log);
    }

    #[test]
    fn with_no_gradient_by_the_deadline_a_round_waits_for_all() {
        let mut d = Driver::<AdaptiveDeadline>::new(&[("warmup", "2")]).unwrap();
        d.join(0);
        d.join(1);
        d.advance_ns(5 * MS);
        d.push(0).unwrap();
        d.push(1).unwrap();
        d.advance_ns(50 * MS);
        d.fire_timer(DEADLINE).unwrap();
        assert!(!d.log.contains(&Recorded::AggregateCompleted(1)));
        d.push(0).unwrap();
        d.push(1).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(1)));
        assert!(Driver::<AdaptiveDeadline>::new(&[("warmup", "100"), ("window", "10")]).is_err());
    }
}
