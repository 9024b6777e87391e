//! Asynchronous local SGD with Delayed Nesterov (DN) and Dynamic Local Updates (DyLU): Liu,
//! Chhaparia, Douillard, Kale, Rusu, Shen, Szlam and Ranzato, "Asynchronous Local-SGD Training
//! for Language Modeling" (2024, arXiv:2401.09135), the method the paper proposes ("DN + DyLU").
//!
//! Each worker takes local steps from the parameters it pulled and pushes its pseudo-gradient
//! (pulled minus reached) when it is done; the server applies every pseudo-gradient on
//! arrival, with no barrier, and the worker pulls again at once. Two remedies make this match
//! synchronous local SGD:
//! - **Delayed Nesterov** (Algorithm 3): the outer Nesterov momentum is stepped only every `N`
//!   server updates, on the mean of the `N` pseudo-gradients since the last one; in between,
//!   each pseudo-gradient is applied plainly at `lr / N`. `N` defaults to the number of
//!   workers, as in the paper.
//! - **Dynamic Local Updates** (Eq. 6): a worker of speed `v(w)` takes
//!   `floor(v(w) / max_w v(w) · H)` local steps (at least one), so that slow workers finish
//!   their rounds in about the time fast ones do and their pseudo-gradients are not stale.
//!
//! On Syncopate: the policy serves every pull and admits every push on arrival (each weighted
//! `1 / workers`, which is the paper's `1 / N` when `N` is the number of workers), sets the
//! shard's outer optimizer (SGD, Nesterov momentum) and its delay
//! ([`Decision::SetOuterDelay`](syncopate_policy_sdk::abi::Decision::SetOuterDelay)), and sets
//! each worker's local steps.
//!
//! Our reading, where we could not check the paper's text or it is silent:
//! - the update rule is Algorithm 3 as implemented by torchft-style async DiLoCo servers and
//!   summarised by secondary sources (plain `lr·g/N` between momentum steps, `lr·(g/N + β·m)`
//!   at the `N`-th with `m = β·m + Σg/N`); the paper's own text was not available to us;
//! - a worker's speed is the samples per second of compute it reports for its iterations
//!   (all local steps included), smoothed as an exponential moving average (weight 1/2 on the
//!   newest); until a worker has reported, it takes `h` steps;
//! - `h` defaults to 8, our local SGD's, and the outer optimizer to DiLoCo's (lr 0.7, momentum
//!   0.9); the paper's language models used H = 50 and tuned the outer learning rate;
//! - when workers join or leave, `N` follows their number and the momentum's partial sum starts
//!   over.

use std::collections::BTreeMap;

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::rules;

/// Asynchronous local SGD, DN + DyLU.
#[derive(Debug)]
pub struct AsyncLocalSgd {
    h: u32,
    outer_lr: f32,
    outer_momentum: f32,
    /// The delay set (0: the number of workers).
    delay: u32,
    dylu: bool,
    codecs: CodecChoice,
    /// The delay last sent to the shard.
    delay_now: u32,
    /// Live workers: their smoothed speed in samples per second (0 until they report) and the
    /// local steps this instance last gave them.
    workers: BTreeMap<WorkerId, (f64, u32)>,
}

impl AsyncLocalSgd {
    /// Sends the delay if the number of workers changed it: the view's, which a join or
    /// leave event shows as it was before, plus `change`.
    fn follow_workers(&mut self, ctx: &mut Ctx<'_>, change: i64) {
        let workers = (i64::from(ctx.view().workers) + change).max(1) as u32;
        let period = match self.delay {
            0 => workers.min(rules::MAX_OUTER_DELAY),
            n => n,
        };
        if period != self.delay_now {
            ctx.set_outer_delay(period);
            self.delay_now = period;
        }
    }

    /// Dynamic local updates: every worker that has reported takes its share of `h`.
    fn rebalance(&mut self, ctx: &mut Ctx<'_>) {
        let fastest = self.workers.values().map(|w| w.0).fold(0.0, f64::max);
        if fastest <= 0.0 {
            return;
        }
        for (&worker, (speed, steps)) in self.workers.iter_mut() {
            if *speed <= 0.0 {
                continue;
            }
            let share = ((*speed / fastest) * f64::from(self.h)).floor() as u32;
            let share = share.clamp(1, self.h);
            if share != *steps {
                ctx.set_local_steps_of(worker, share);
                *steps = share;
            }
        }
    }
}

impl Policy for AsyncLocalSgd {
    const INFO: PolicyInfo = PolicyInfo::new(
        "async-localsgd",
        env!("CARGO_PKG_VERSION"),
        "Asynchronous local SGD (Liu et al. 2024): pseudo-gradients applied on arrival with Delayed Nesterov, local steps scaled by each worker's speed (DyLU).",
        &[
            ParamSpec::new("h", ParamKind::Uint, "8", "local steps of the fastest worker (1 to 10000)"),
            ParamSpec::new("outer_lr", ParamKind::Float, "0.7", "learning rate of the outer optimizer"),
            ParamSpec::new("outer_momentum", ParamKind::Float, "0.9", "Nesterov momentum of the outer optimizer"),
            ParamSpec::new("delay", ParamKind::Uint, "0", "server updates per momentum step (0: the number of workers; 1: plain Nesterov)"),
            ParamSpec::new("dylu", ParamKind::Bool, "true", "scale each worker's local steps by its speed"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let h = init.config.local_steps("h")?;
        let (outer_lr, outer_momentum) = init.config.outer_optimizer()?;
        let delay: u32 = init.config.get("delay")?;
        if delay != 0 {
            rules::check_outer_delay(delay).map_err(|e| format!("delay: {e}"))?;
        }
        Ok(AsyncLocalSgd {
            h,
            outer_lr,
            outer_momentum,
            delay,
            dylu: init.config.get("dylu")?,
            codecs: CodecChoice::from_config(&init.config)?,
            delay_now: 1,
            workers: BTreeMap::new(),
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
        ctx.set_local_steps(self.h);
        ctx.set_outer_optimizer(self.outer_lr, self.outer_momentum, true);
        self.follow_workers(ctx, 0);
        self.codecs.on_start(ctx);
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _clock: u64) {
        self.workers.insert(worker, (0.0, self.h));
        self.follow_workers(ctx, 1);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.workers.remove(&worker);
        self.codecs.forget(worker);
        self.follow_workers(ctx, -1);
        if self.dylu {
            self.rebalance(ctx);
        }
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        // A worker this instance has not seen join (it joined before a swap) is live: the
        // host passes on pulls of live workers only.
        self.workers.entry(pull.worker).or_insert((0.0, self.h));
        self.codecs.on_pull(ctx, pull.worker);
        PullVerdict::Serve
    }

    fn on_iteration_finished(&mut self, ctx: &mut Ctx<'_>, report: &IterationReport) {
        if !self.dylu || report.compute_ns == 0 || report.samples == 0 {
            return;
        }
        let Some(w) = self.workers.get_mut(&report.worker) else {
            return;
        };
        let speed = f64::from(report.samples) / (report.compute_ns as f64 / 1e9);
        w.0 = if w.0 > 0.0 { 0.5 * w.0 + 0.5 * speed } else { speed };
        self.rebalance(ctx);
    }
}

syncopate_policy_sdk::export_policy!(AsyncLocalSgd);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    fn report(worker: WorkerId, samples: u32, compute_ms: u64) -> IterationReport {
        IterationReport { worker, iteration: 0, compute_ns: compute_ms * 1_000_000, samples }
    }

    #[test]
    fn serves_at_once_applies_on_arrival_and_delays_the_momentum_by_the_number_of_workers() {
        let mut d = Driver::<AsyncLocalSgd>::new(&[("h", "8")]).unwrap();
        assert_eq!(d.update_mode(), Some(UpdateMode::OnArrival));
        assert!(d.log.contains(&Recorded::OuterOptimizer(0.7, 0.9, true)));
        for w in 0..3 {
            d.join(w);
        }
        assert_eq!(d.log.last(), Some(&Recorded::OuterDelay(3)));
        for _ in 0..5 {
            d.push(0).unwrap();
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve, "no barrier");
        }
        d.leave(2, LeaveReason::Finished);
        assert_eq!(d.log.last(), Some(&Recorded::OuterDelay(2)));
        let fixed = Driver::<AsyncLocalSgd>::new(&[("delay", "1")]).unwrap();
        assert!(!fixed.log.iter().any(|r| matches!(r, Recorded::OuterDelay(_))));
    }

    /// DyLU: a worker half as fast takes half the steps, a quarter as fast a quarter; the
    /// fastest keeps `h`; with `dylu=false` every worker keeps `h`.
    #[test]
    fn local_steps_follow_each_workers_speed() {
        let mut d = Driver::<AsyncLocalSgd>::new(&[("h", "8")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        d.report(report(0, 256, 100)).unwrap();
        d.report(report(1, 128, 100)).unwrap();
        d.report(report(2, 64, 100)).unwrap();
        assert_eq!((d.local_steps(0), d.local_steps(1), d.local_steps(2)), (8, 4, 2));
        // Worker 2 speeds up to the others' pace, smoothed: (640 + 2560) / 2 = 1600 of 2560.
        d.report(report(2, 256, 100)).unwrap();
        assert_eq!(d.local_steps(2), 5);
        let mut fixed = Driver::<AsyncLocalSgd>::new(&[("h", "8"), ("dylu", "false")]).unwrap();
        fixed.join(0);
        fixed.join(1);
        fixed.report(report(0, 256, 100)).unwrap();
        fixed.report(report(1, 16, 100)).unwrap();
        assert_eq!((fixed.local_steps(0), fixed.local_steps(1)), (8, 8));
    }

    #[test]
    fn refuses_settings_outside_the_bounds() {
        for bad in [("h", "0"), ("h", "10001"), ("outer_lr", "0"), ("outer_momentum", "1"), ("delay", "5000")]
        {
            assert!(Driver::<AsyncLocalSgd>::new(&[bad]).is_err(), "{bad:?}");
        }
    }
}
