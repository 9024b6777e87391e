//! ASP, asynchronous parallel: every pull is served at once and every push is applied on arrival.
//! No worker ever waits; staleness is unbounded. (SSP with an infinite bound.)

use syncopate_policy_sdk::prelude::*;

/// Asynchronous parallel.
#[derive(Debug)]
pub struct Asp;

impl Policy for Asp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "asp",
        env!("CARGO_PKG_VERSION"),
        "Asynchronous parallel: serve every pull at once, apply every push on arrival.",
        &[],
    );

    fn new(_init: &Init) -> Result<Self, String> {
        Ok(Asp)
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
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
