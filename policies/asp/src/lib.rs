//! ASP, asynchronous parallel: every pull is served at once and every push is applied on arrival.
//! No worker ever waits; staleness is unbounded. (SSP with an infinite bound.)

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// Asynchronous parallel.
#[derive(Debug)]
pub struct Asp {
    codecs: CodecChoice,
}

impl Policy for Asp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "asp",
        env!("CARGO_PKG_VERSION"),
        "Asynchronous parallel: serve every pull at once, apply every push on arrival.",
        &[CodecChoice::PUSH_PARAM, CodecChoice::PULL_PARAM],
    );

    fn new(init: &Init) -> Result<Self, String> {
        Ok(Asp { codecs: CodecChoice::from_config(&init.config)? })
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
        PullVerdict::Serve
    }
}

syncopate_policy_sdk::export_policy!(Asp);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_defers_even_far_ahead() {
        let mut d = Driver::<Asp>::new(&[]).unwrap();
        d.join(0);
        d.join(1);
        for _ in 0..100 {
            assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve);
        }
        assert_eq!(d.update_mode(), Some(UpdateMode::OnArrival));
    }
}
