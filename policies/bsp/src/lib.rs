//! BSP, bulk synchronous parallel: every worker waits for all N pushes of iteration `c` before it
//! reads the model for iteration `c + 1`.
//!
//! Rule: serve a pull of worker `w` iff `min_clock >= clock[w]`; otherwise defer it until
//! `min_clock >= clock[w]` (SSP's rule with `s = 0`). Updates are aggregated: the N gradients of an
//! iteration are averaged and applied as one optimizer step, so stateful optimizers (momentum)
//! see exactly the sequence they would in synchronous SGD.

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// Bulk synchronous parallel.
#[derive(Debug)]
pub struct Bsp {
    codecs: CodecChoice,
}

impl Policy for Bsp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "bsp",
        env!("CARGO_PKG_VERSION"),
        "Bulk synchronous parallel: a barrier after every iteration; gradients averaged then applied.",
        &[CodecChoice::PUSH_PARAM, CodecChoice::PULL_PARAM],
    );

    fn new(init: &Init) -> Result<Self, String> {
        Ok(Bsp { codecs: CodecChoice::from_config(&init.config)? })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
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

syncopate_policy_sdk::export_policy!(Bsp);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn barrier_after_every_iteration() {
        let mut d = Driver::<Bsp>::new(&[]).unwrap();
        assert_eq!(d.update_mode(), Some(UpdateMode::Aggregate));
        for w in 0..3 {
            d.join(w);
            assert_eq!(d.pull(w).unwrap(), PullVerdict::Serve);
        }
        d.push(0).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(1).unwrap();
        assert!(d.take_released().is_empty());
        d.push(2).unwrap();
        assert_eq!(d.take_released().len(), 1);
        assert_eq!(d.pull(1).unwrap(), PullVerdict::Serve);
    }

    #[test]
    fn a_departed_worker_no_longer_holds_the_barrier() {
        let mut d = Driver::<Bsp>::new(&[]).unwrap();
        d.join(0);
        d.join(1);
        d.push(0).unwrap();
        assert!(matches!(d.pull(0).unwrap(), PullVerdict::Defer(_)));
        d.leave(1, LeaveReason::TimedOut);
        assert_eq!(d.take_released().len(), 1);
    }
}
