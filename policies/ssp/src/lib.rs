//! SSP, stale synchronous parallel (Ho et al., NIPS 2013), with staleness bound `s`.
//!
//! Rule: serve a pull of worker `w` iff `clock[w] - min_clock <= s`; otherwise defer it until
//! `min_clock >= clock[w] - s`. A worker at clock `c` therefore sees every update from clocks
//! `<= c - s - 1` plus its own. Pushes are applied on arrival. `s = 0` is BSP's rule (but BSP
//! aggregates; see the `bsp` policy); a very large `s` is ASP.
//!
//! This is the gating rule Petuum Bösen, FlexPS and Husky agree on.

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// Stale synchronous parallel.
#[derive(Debug)]
pub struct Ssp {
    s: u64,
    codecs: CodecChoice,
}

impl Ssp {
    /// The SSP verdict for a pull at `clock` with staleness bound `s`; shared with other policies
    /// that fall back to SSP's rule.
    pub fn verdict(s: u64, clock: u64, view: ShardView) -> PullVerdict {
        if clock <= view.min_clock.saturating_add(s) {
            PullVerdict::Serve
        } else {
            PullVerdict::Defer(Release::MinClockAtLeast(clock - s))
        }
    }
}

impl Policy for Ssp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "ssp",
        env!("CARGO_PKG_VERSION"),
        "Stale synchronous parallel: a worker may run at most s iterations ahead of the slowest.",
        &[
            ParamSpec::new(
                "s",
                ParamKind::Uint,
                "3",
                "staleness bound: iterations a worker may run ahead of the slowest",
            ),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        Ok(Ssp { s: init.config.get("s")?, codecs: CodecChoice::from_config(&init.config)? })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
        self.codecs.on_start(ctx);
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.codecs.forget(worker);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        Ssp::verdict(self.s, pull.clock, ctx.view())
    }
}

syncopate_policy_sdk::export_policy!(Ssp);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defers_beyond_bound_and_releases_when_slowest_catches_up() {
        let mut d = Driver::<Ssp>::new(&[("s", "2")]).unwrap();
        d.join(0);
        d.join(1);
        for _ in 0..2 {
            d.push(0).unwrap();
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve);
        }
        d.push(0).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        assert!(d.take_released().is_empty());
        d.push(1).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn rejects_a_mistyped_bound() {
        let err = Driver::<Ssp>::new(&[("s", "two")]).unwrap_err();
        assert!(err.contains("must be a uint"), "{err}");
    }
}
