//! FluentPS (Yao, Wu, Wang; IEEE Cluster 2019): per-shard synchronization with a probabilistic
//! pause of the fastest worker and lazy execution of the paused pulls.
//!
//! Rule, on a pull of worker `w` at clock `c` (gap `k = c - min_clock`): defer it only if all
//! three hold:
//! 1. `w` is this shard's fastest worker (`c == max_clock`);
//! 2. `k >= s` and `k >= 1` (at `k = 0` every worker is level, and pausing one would wait for
//!    itself);
//! 3. a draw from the host's seeded random source succeeds with probability `P`, where `P` is
//!    the constant `p` (`mode = constant`) or the sigmoid `1 / (1 + e^(s - k))`
//!    (`mode = sigmoid`).
//!
//! A worker that is `s` ahead but not the fastest is never blocked: that is why raw SSP defers
//! far more pulls. A deferred pull is executed lazily: it waits for the next advance of the
//! shard's minimum clock (every worker has completed the iteration the pull was queued at) and
//! is then answered from the parameters as they are. Pushes are acknowledged at once and applied
//! on arrival.
//!
//! Each shard runs its own instance with its own `s` and `p` (per-shard configuration: `syncopate
//! policy swap --shard`), so one shard may serve a pull that another defers: there is no global
//! barrier. With `p = 0` the policy never defers (ASP); with `p = 1` it defers exactly the
//! fastest worker whenever `k >= s`. The rule is the one in the authors' public code.

use syncopate_policy_sdk::prelude::*;

/// How the pause probability is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Constant(f64),
    Sigmoid,
}

/// FluentPS.
#[derive(Debug)]
pub struct FluentPs {
    s: u64,
    mode: Mode,
}

impl FluentPs {
    /// The pause probability at gap `k`.
    fn probability(&self, k: u64) -> f64 {
        match self.mode {
            Mode::Constant(p) => p,
            Mode::Sigmoid => 1.0 / (1.0 + (self.s as f64 - k as f64).exp()),
        }
    }
}

impl Policy for FluentPs {
    const INFO: PolicyInfo = PolicyInfo::new(
        "fluentps",
        env!("CARGO_PKG_VERSION"),
        "FluentPS: per-shard probabilistic pause of the fastest worker, lazily released.",
        &[
            ParamSpec::new("s", ParamKind::Uint, "3", "gap from the slowest at which the fastest may pause"),
            ParamSpec::new("p", ParamKind::Float, "1.0", "pause probability (mode = constant)"),
            ParamSpec::new(
                "mode",
                ParamKind::Text,
                "constant",
                "`constant` (p) or `sigmoid` (1/(1+e^(s-k)))",
            ),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let s = init.config.get("s")?;
        let p: f64 = init.config.get("p")?;
        let mode = match init.config.text("mode").unwrap_or("constant") {
            "constant" if (0.0..=1.0).contains(&p) => Mode::Constant(p),
            "constant" => return Err(format!("p = {p} is not a probability in [0, 1]")),
            "sigmoid" => Mode::Sigmoid,
            other => return Err(format!("mode `{other}` is neither `constant` nor `sigmoid`")),
        };
        Ok(FluentPs { s, mode })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        let view = ctx.view();
        let k = pull.clock.saturating_sub(view.min_clock);
        // The draw is taken on every candidate pull, so `p = 1` never consumes randomness it
        // does not need and `p = 0` never defers.
        if pull.clock == view.max_clock && k >= self.s && k > 0 && ctx.random_f64() < self.probability(k) {
            PullVerdict::Defer(Release::MinClockAtLeast(view.min_clock + 1))
        } else {
            PullVerdict::Serve
        }
    }
}

syncopate_policy_sdk::export_policy!(FluentPs);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_only_the_fastest_and_releases_at_the_next_min_clock() {
        let mut d = Driver::<FluentPs>::new(&[("s", "2"), ("p", "1")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for _ in 0..2 {
            d.push(0).unwrap();
            d.push(1).unwrap();
        }
        // Worker 0 is 3 ahead and the fastest; worker 1 is 2 ahead but not the fastest.
        d.push(0).unwrap();
        assert_eq!(d.pull(1).unwrap(), PullVerdict::Serve, "2 ahead but not the fastest");
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(2).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn never_defers_with_p_zero() {
        let mut d = Driver::<FluentPs>::new(&[("s", "0"), ("p", "0")]).unwrap();
        d.join(0);
        d.join(1);
        for _ in 0..20 {
            d.push(0).unwrap();
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve);
        }
    }

    #[test]
    fn sigmoid_grows_with_the_gap_and_bad_settings_are_refused() {
        let f = FluentPs { s: 3, mode: Mode::Sigmoid };
        assert!((f.probability(3) - 0.5).abs() < 1e-12);
        assert!(f.probability(6) > 0.95 && f.probability(1) < 0.15);
        assert!(Driver::<FluentPs>::new(&[("p", "1.5")]).unwrap_err().contains("probability"));
        assert!(Driver::<FluentPs>::new(&[("mode", "cubic")]).unwrap_err().contains("cubic"));
    }
}
