//! AdaComm: local SGD whose communication period shrinks as the training loss falls (Jianyu
//! Wang and Gauri Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
//! Trade-off in Local-Update SGD", SysML 2019, Section 4, eq. 14).
//!
//! The paper's rule: wall-clock time is cut into intervals of `T0`; at the start of interval `l`
//! the period becomes `τ_l = ceil(sqrt(F(x_l) / F(x_0)) · τ_0)`, where `F(x_l)` is the training
//! loss at that moment and `F(x_0)` the loss at the start. Its variant with a decaying learning
//! rate (eq. 15) also scales by `sqrt(η_0 / η_l)`; the servers' learning rate here is fixed, so
//! that factor is 1.
//!
//! On Syncopate (our reading): rounds are local SGD's (as `localsgd`: aggregate mode, the outer
//! optimizer averaging, pulls at BSP's barrier). The loss is what the workers report with their
//! pushes (ABI v3's signals: the mean training loss over the iteration's local steps): `F(x_0)`
//! is the mean over the first round's pushes that report one, `F(x_l)` the mean over the pushes
//! of the last interval (the paper evaluates the loss at one point; the mean over an interval is
//! what the workers measure without an extra pass). The new period applies from each worker's
//! next pull. `τ` never rises above `τ_0` (the paper's period only falls with the loss) and never
//! below 1. With no loss reported, the period stays `τ_0`, which is local SGD. Each shard decides
//! alone, from the same reports, so the shards agree up to when their timers fire; a worker takes
//! the most local steps any shard asks for.

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::state;

/// The timer that ends an interval.
const INTERVAL: TimerId = 1;

/// What a swap or a restart hands over: the loss at the start, and the period.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Saved {
    f0: Option<f64>,
    tau: u32,
}

/// AdaComm: local SGD with a period that follows the training loss.
#[derive(Debug)]
pub struct AdaComm {
    tau0: u32,
    interval_ns: u64,
    tau: u32,
    /// The loss at the start, once the first round's reports are in.
    f0: Option<f64>,
    /// Sum and count of the losses reported this interval.
    sum: f64,
    count: u32,
    codecs: CodecChoice,
}

impl AdaComm {
    /// The period for a loss of `f` (eq. 14), within 1 and `τ_0`.
    pub fn period(tau0: u32, f0: f64, f: f64) -> u32 {
        if !(f0 > 0.0 && f.is_finite() && f >= 0.0) {
            return tau0;
        }
        let tau = ((f / f0).sqrt() * f64::from(tau0)).ceil();
        (tau as u32).clamp(1, tau0)
    }
}

impl Policy for AdaComm {
    const INFO: PolicyInfo = PolicyInfo::new(
        "adacomm",
        env!("CARGO_PKG_VERSION"),
        "AdaComm: local SGD whose period shrinks with the square root of the training loss (Wang and Joshi 2019).",
        &[
            ParamSpec::new("tau", ParamKind::Uint, "16", "the first period τ_0: local steps per round (1 to 10000)"),
            ParamSpec::new("interval_ms", ParamKind::Uint, "5000", "T_0: how often the period is recomputed, in ms"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let tau0 = init.config.local_steps("tau")?;
        let interval_ms: u64 = init.config.get("interval_ms")?;
        if interval_ms == 0 || interval_ms > 86_400_000 {
            return Err(format!("interval_ms: {interval_ms} ms (1 ms to a day)"));
        }
        Ok(AdaComm {
            tau0,
            interval_ns: interval_ms * 1_000_000,
            tau: tau0,
            f0: None,
            sum: 0.0,
            count: 0,
            codecs: CodecChoice::from_config(&init.config)?,
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        ctx.set_local_steps(self.tau);
        ctx.set_outer_optimizer(1.0, 0.0, false);
        ctx.set_timer(INTERVAL, self.interval_ns);
        self.codecs.on_start(ctx);
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.codecs.forget(worker);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        PullVerdict::at_barrier(pull.clock, ctx.view())
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if let Some(loss) = push.signals.loss {
            self.sum += f64::from(loss);
            self.count += 1;
            // F(x_0): the first round's reports, once every live worker's is in.
            if self.f0.is_none() && push.clock == 0 && self.count >= ctx.view().workers {
                self.f0 = Some(self.sum / f64::from(self.count));
                ctx.metric("adacomm.f0", self.sum / f64::from(self.count));
            }
        }
        PushVerdict::Admit
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer != INTERVAL {
            return;
        }
        ctx.set_timer(INTERVAL, self.interval_ns);
        let (Some(f0), true) = (self.f0, self.count > 0) else { return };
        let f = self.sum / f64::from(self.count);
        (self.sum, self.count) = (0.0, 0);
        let tau = Self::period(self.tau0, f0, f);
        ctx.metric("adacomm.loss", f);
        ctx.metric("adacomm.tau", f64::from(tau));
        if tau != self.tau {
            self.tau = tau;
            ctx.set_local_steps(tau);
        }
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&Saved { f0: self.f0, tau: self.tau })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut p = Self::new(init)?;
        if let Some(saved) = state::load::<Saved>(handoff, Self::INFO.name)? {
            p.f0 = saved.f0;
            p.tau = saved.tau.clamp(1, p.tau0);
        }
        Ok(p)
    }
}

syncopate_policy_sdk::export_policy!(AdaComm);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    fn loss(l: f32) -> Signals {
        Signals { loss: Some(l), ..Signals::default() }
    }

    #[test]
    fn the_period_follows_the_square_root_of_the_loss_ratio() {
        assert_eq!(AdaComm::period(16, 4.0, 4.0), 16);
        assert_eq!(AdaComm::period(16, 4.0, 1.0), 8);
        assert_eq!(AdaComm::period(16, 4.0, 0.25), 4);
        // Never above τ_0, never below 1, and τ_0 without a usable loss.
        assert_eq!(AdaComm::period(16, 4.0, 9.0), 16);
        assert_eq!(AdaComm::period(16, 4.0, 0.0), 1);
        assert_eq!(AdaComm::period(16, 0.0, 1.0), 16);
        assert_eq!(AdaComm::period(16, 4.0, f64::NAN), 16);
    }

    #[test]
    fn shrinks_the_period_as_the_reported_loss_falls() {
        let mut d = Driver::<AdaComm>::new(&[("tau", "16"), ("interval_ms", "1000")]).unwrap();
        assert!(d.log.contains(&Recorded::LocalSteps(None, 16)));
        d.join(0);
        d.join(1);
        // The first round reports a loss of 4: F(x_0).
        d.push_signals(0, 0, &[], loss(4.0)).unwrap();
        d.push_signals(1, 0, &[], loss(4.0)).unwrap();
        // The next interval's reports average 1: the period halves.
        d.push_signals(0, 1, &[], loss(0.5)).unwrap();
        d.push_signals(1, 1, &[], loss(1.5)).unwrap();
        d.advance_ns(1_000_000_000);
        d.fire_timer(INTERVAL).unwrap();
        // The first interval's mean includes the first round's reports: (4 + 4 + 0.5 + 1.5) / 4.
        assert_eq!(d.local_steps(0), AdaComm::period(16, 4.0, 2.5));
        d.push_signals(0, 2, &[], loss(1.0)).unwrap();
        d.push_signals(1, 2, &[], loss(1.0)).unwrap();
        d.fire_timer(INTERVAL).unwrap();
        assert_eq!((d.local_steps(0), d.local_steps(1)), (8, 8));
        assert!(d.log.contains(&Recorded::Metric("adacomm.tau".into(), 8.0)));
        // Pushes without a loss change nothing: the period stays.
        d.push(0).unwrap();
        d.fire_timer(INTERVAL).unwrap();
        assert_eq!(d.local_steps(0), 8);
        // A restart keeps F(x_0) and the period.
        d.restart().unwrap();
        d.push_signals(1, 3, &[], loss(0.25)).unwrap();
        d.fire_timer(INTERVAL).unwrap();
        assert_eq!(d.local_steps(1), 4);
    }
}
