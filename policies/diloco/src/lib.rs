//! DiLoCo, distributed low-communication training (Douillard et al., 2023, "DiLoCo:
//! Distributed Low-Communication Training of Language Models", Algorithm 1).
//!
//! Each outer step, every worker starts from the shared parameters θ, takes `h` inner
//! optimizer steps on its own data, and sends its outer gradient, θ minus its parameters. The
//! outer gradients are averaged and applied to θ by the outer optimizer: SGD with Nesterov
//! momentum, learning rate 0.7, momentum 0.9 (the paper's choice, and OpenDiLoCo's and
//! torchft's default usage). Rounds are synchronous: a worker reads θ for its next outer step
//! only once every worker's outer gradient of this one is in.
//!
//! On Syncopate: one outer step is one iteration. The policy sets every worker's local steps
//! to `h` and the shard's outer optimizer; the workers run the inner optimizer (the cluster's
//! optimizer, SGD with momentum for the built-in workloads; the paper's is AdamW) and push
//! pseudo-gradients; the shard averages a round's (aggregate mode, each push weighted
//! `1 / workers`) and steps them with the outer optimizer. The rule for pulls is BSP's.
//!
//! Our reading, where the paper is silent: `h` defaults to the paper's 500; the outer
//! momentum lives on the shards, kept across hot swaps (a swap back to DiLoCo resumes it) and
//! in checkpoints; a worker that joins late starts its first outer step from θ as it is then.

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// DiLoCo: `h` local steps, then an outer Nesterov step on the mean pseudo-gradient.
#[derive(Debug)]
pub struct Diloco {
    h: u32,
    outer_lr: f32,
    outer_momentum: f32,
    codecs: CodecChoice,
}

impl Policy for Diloco {
    const INFO: PolicyInfo = PolicyInfo::new(
        "diloco",
        env!("CARGO_PKG_VERSION"),
        "DiLoCo: h local steps per round, then an outer SGD step with Nesterov momentum on the mean pseudo-gradient.",
        &[
            ParamSpec::new("h", ParamKind::Uint, "500", "local (inner) steps per round (1 to 10000)"),
            ParamSpec::new("outer_lr", ParamKind::Float, "0.7", "learning rate of the outer optimizer"),
            ParamSpec::new("outer_momentum", ParamKind::Float, "0.9", "Nesterov momentum of the outer optimizer"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let h = init.config.local_steps("h")?;
        let (outer_lr, outer_momentum) = init.config.outer_optimizer()?;
        Ok(Diloco { h, outer_lr, outer_momentum, codecs: CodecChoice::from_config(&init.config)? })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        ctx.set_local_steps(self.h);
        ctx.set_outer_optimizer(self.outer_lr, self.outer_momentum, true);
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

syncopate_policy_sdk::export_policy!(Diloco);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn sets_local_steps_and_a_nesterov_outer_optimizer_and_keeps_rounds_synchronous() {
        let mut d = Driver::<Diloco>::new(&[("h", "8")]).unwrap();
        assert_eq!(d.update_mode(), Some(UpdateMode::Aggregate));
        assert!(d.log.contains(&Recorded::LocalSteps(None, 8)));
        assert!(d.log.contains(&Recorded::OuterOptimizer(0.7, 0.9, true)));
        for w in 0..2 {
            d.join(w);
            assert_eq!(d.local_steps(w), 8);
            assert_eq!(d.pull(w).unwrap(), PullVerdict::Serve);
        }
        d.push(0).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(1).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn a_swap_away_sets_the_workers_back_to_gradients() {
        let mut d = Driver::<Diloco>::new(&[("h", "4")]).unwrap();
        d.join(0);
        assert_eq!(d.local_steps(0), 4);
        let d = d.swap::<Diloco>(&[("h", "2")]).unwrap();
        assert_eq!(d.local_steps(0), 2);
    }

    #[test]
    fn refuses_settings_outside_the_bounds() {
        for bad in [("h", "0"), ("h", "10001"), ("outer_lr", "0"), ("outer_momentum", "1.0")] {
            assert!(Driver::<Diloco>::new(&[bad]).is_err(), "{bad:?}");
        }
    }
}
