//! `clip`: asynchronous SGD (ASP's rule: pulls served at once, each push one step) that clips
//! each gradient to norm `c`, an example of asking the host for a measure (ABI v3's
//! [`Ctx::measure`]), as `docs/writing-a-policy.md` shows. It is not one of the paradigms.
//!
//! Each push is held, and the host is asked for its norm on this shard
//! ([`Measure::Norm`] of [`Tensor::Push`]); the answer arrives right after the push's event,
//! and the push is admitted with weight `min(1, c / norm) / n` (`n` live workers: ASP's mean
//! weight, scaled down for a long gradient). No tensor enters the module: the host computes
//! the norm in place and charges the fuel.
//!
//! (The same norm arrives with every push as `push.signals.norm`; asking is the general path,
//! which also gives dot products and cosines with the parameters and open groups.)

use syncopate_policy_sdk::prelude::*;

/// Asynchronous SGD with each gradient clipped to norm `c` (an example).
#[derive(Debug)]
pub struct Clip {
    c: f64,
}

impl Policy for Clip {
    const INFO: PolicyInfo = PolicyInfo::new(
        "clip",
        env!("CARGO_PKG_VERSION"),
        "Asynchronous SGD that clips each gradient to norm c, measured by the host on request (an example).",
        &[ParamSpec::new("c", ParamKind::Float, "1", "the largest gradient norm applied (> 0)")],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let c: f64 = init.config.get("c")?;
        if !(c > 0.0 && c.is_finite()) {
            return Err(format!("c: {c} (a positive norm)"));
        }
        Ok(Clip { c })
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
        PullVerdict::Serve
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        // The question is numbered by the push: the answer says which push to admit.
        ctx.measure(push.id, Measure::Norm(Tensor::Push(push.id)));
        PushVerdict::Hold
    }

    fn on_measured(&mut self, ctx: &mut Ctx<'_>, query: u64, norm: f64) {
        let n = f64::from(ctx.view().workers.max(1));
        let scale = if norm > self.c { self.c / norm } else { 1.0 };
        ctx.admit_push_weighted(query, (scale / n) as f32);
        ctx.metric("clip.norm", norm);
    }
}

syncopate_policy_sdk::export_policy!(Clip);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::optimizer::OptimizerConfig;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn a_long_gradient_is_clipped_to_norm_c_and_a_short_one_is_not() {
        let sgd = OptimizerConfig { lr: 1.0, momentum: 0.0, ..OptimizerConfig::default() };
        let mut d = Driver::<Clip>::new(&[("c", "1")]).unwrap().with_optimizer(sgd, vec![0.0; 2]);
        d.join(0);
        assert_eq!(d.push_gradient(0, 0, &[3.0, 4.0]).unwrap(), PushVerdict::Hold);
        assert!(d.log.contains(&Recorded::Measured(1, Measure::Norm(Tensor::Push(1)), 5.0)));
        // Clipped to norm 1: one step of (0.6, 0.8).
        assert!((d.params()[0] + 0.6).abs() < 1e-6 && (d.params()[1] + 0.8).abs() < 1e-6);
        d.push_gradient(0, 1, &[0.5, 0.0]).unwrap();
        assert!((d.params()[0] + 1.1).abs() < 1e-6);
        assert!(Driver::<Clip>::new(&[("c", "0")]).is_err());
    }
}
