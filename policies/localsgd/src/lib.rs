//! Local SGD with periodic model averaging: every worker takes `h` local steps from the shared
//! model, then the workers' models are averaged, synchronously, and every worker goes on from
//! the average (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin et
//! al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020). This is torchft's
//! `LocalSGD(sync_every=h)` and PyTorch's `PeriodicModelAverager`.
//!
//! On Syncopate: one round is one iteration. The policy sets every worker's local steps to `h`
//! and the outer optimizer to averaging (learning rate 1, no momentum): the shard applies the
//! mean pseudo-gradient, θ − mean(θ − θᵢ), which is mean(θᵢ). The rule for pulls is BSP's.
//! `h` has no canonical default; 8 is ours.

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// Local SGD: `h` local steps, then the workers' models averaged.
#[derive(Debug)]
pub struct LocalSgd {
    h: u32,
    codecs: CodecChoice,
}

impl Policy for LocalSgd {
    const INFO: PolicyInfo = PolicyInfo::new(
        "localsgd",
        env!("CARGO_PKG_VERSION"),
        "Local SGD: h local steps per round, then the workers' models averaged (synchronous).",
        &[
            ParamSpec::new("h", ParamKind::Uint, "8", "local steps per round (1 to 10000)"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let h = init.config.local_steps("h")?;
        Ok(LocalSgd { h, codecs: CodecChoice::from_config(&init.config)? })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        ctx.set_local_steps(self.h);
        ctx.set_outer_optimizer(1.0, 0.0, false);
        self.codecs.on_start(ctx);
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.codecs.forget(worker);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        PullVerdict::at_barrier(pull.clock, ctx.view())
    }
}

syncopate_policy_sdk::export_policy!(LocalSgd);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn averages_models_after_h_local_steps_in_synchronous_rounds() {
        let mut d = Driver::<LocalSgd>::new(&[("h", "4")]).unwrap();
        assert!(d.log.contains(&Recorded::LocalSteps(None, 4)));
        assert!(d.log.contains(&Recorded::OuterOptimizer(1.0, 0.0, false)));
        d.join(0);
        d.join(1);
        assert_eq!((d.local_steps(0), d.local_steps(1)), (4, 4));
        d.push(0).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(1).unwrap();
        assert_eq!(d.take_released().len(), 1);
        assert!(Driver::<LocalSgd>::new(&[("h", "0")]).is_err());
    }
}
