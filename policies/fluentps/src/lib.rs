//! FluentPS (Yao, Wu, Wang; IEEE Cluster 2019): per-shard synchronization with a probabilistic
//! pause of the fastest worker and lazy execution of the paused pulls, **in the authors' terms**
//! (github XinYao1994/FluentPS-paper, `ps/FluentPS/python/fps/wrapper/server.cc`).
//!
//! A worker pulls right after pushing the iteration it just finished; the authors call that
//! iteration `current` and the shard's slowest unfinished iteration `slowest`, and measure the
//! gap as `k = current - slowest`. In our clock terms (a worker's clock counts the iterations it
//! has pushed to this shard) that is **`k = clock - min_clock - 1`**. Rule, on a pull of worker
//! `w` at clock `c >= 1`: defer it only if all three hold (the authors' `SPSSP_con_stream`):
//! 1. `w` is this shard's fastest worker (`c == max_clock`);
//! 2. `k >= s`;
//! 3. a draw from the host's seeded random source succeeds with probability `P`: the constant
//!    `p` (`mode = constant`, the authors' code, whose scripts sweep 1.0, 0.8, 0.5, 0.3, 0.1,
//!    0.01 and 0) or the sigmoid `1 / (1 + e^(s - k))` (`mode = sigmoid`, **our reading** of the
//!    paper: the public code has only the constant).
//!
//! The first pull (clock 0, nothing pushed yet) is always served.
//!
//! The authors' raw SSP(s) defers a pull when `k >= s` whoever pulls, which is our `ssp:s` pull
//! for pull; and under SSP no worker gets more than `s + 1` ahead, so every pull SSP defers is
//! already at the maximum clock: **FluentPS(s, p = 1) is exactly SSP(s)** (an oracle test in
//! `tests/all/oracles.rs` checks it decision for decision). FluentPS's savings come from `p < 1`.
//!
//! Release (`release`), both from the authors' code:
//! - `next` (default; the packaged server's *stream* variant): the paused pull waits for the
//!   next advance of the shard's minimum clock and is then answered from the parameters as they
//!   are (lazy execution);
//! - `own` (the *block* variant, commented out there): it waits until every worker has finished
//!   the paused worker's own iteration (`min_clock >= c`), and while such a pause is outstanding,
//!   every later pull at the same clock queues behind it (the authors' `num_pass_workers != 0`).
//!
//! Pushes are acknowledged at once and applied on arrival. The authors' workers run the optimizer
//! (momentum on the worker, the server only sums scaled updates); that lies outside the policy:
//! run it so with `optimizer_on = "worker"` in a scenario (`scenarios/fluentps-64.toml` does) or
//! `syncopate local --optimizer-on worker`. By default momentum runs on the servers.
//!
//! **Changed on 2026-11-23:** `s` used to count the gap as `clock - min_clock`, so an older
//! `fluentps:s=S` is the authors' (and today's) `fluentps:s=S-1`.
//!
//! Each shard runs its own instance with its own `s`, `p` and `release` (per-shard configuration:
//! `syncopate policy swap --shard`), so one shard may serve a pull that another defers: there is
//! no global barrier. With `p = 0` the policy never defers (ASP).

use syncopate_policy_sdk::prelude::*;

/// How the pause probability is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Constant(f64),
    Sigmoid,
}

/// When a paused pull is released.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ReleaseAt {
    /// At the next advance of the minimum clock (the authors' stream variant).
    Next,
    /// Once every worker finished the paused worker's own iteration (their block variant).
    Own,
}

/// FluentPS.
#[derive(Debug)]
pub struct FluentPs {
    s: u64,
    mode: Mode,
    release: ReleaseAt,
    /// With `release = own`: the clocks at which a pause is outstanding (released once the
    /// minimum clock reaches them). Bounded by the workers' spread.
    blocked: Vec<u64>,
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
            ParamSpec::new(
                "s",
                ParamKind::Uint,
                "3",
                "gap k = current - slowest (the authors' terms) at which the fastest may pause",
            ),
            ParamSpec::new("p", ParamKind::Float, "1.0", "pause probability (mode = constant)"),
            ParamSpec::new(
                "mode",
                ParamKind::Text,
                "constant",
                "`constant` (p) or `sigmoid` (1/(1+e^(s-k)))",
            ),
            ParamSpec::new(
                "release",
                ParamKind::Text,
                "next",
                "`next` min-clock advance (stream) or the paused worker's `own` iteration (block)",
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
        let release = match init.config.text("release").unwrap_or("next") {
            "next" => ReleaseAt::Next,
            "own" => ReleaseAt::Own,
            other => return Err(format!("release `{other}` is neither `next` nor `own`")),
        };
        Ok(FluentPs { s, mode, release, blocked: Vec::new() })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        let view = ctx.view();
        let c = pull.clock;
        if self.release == ReleaseAt::Own {
            self.blocked.retain(|b| *b > view.min_clock);
            if self.blocked.contains(&c) {
                return PullVerdict::Defer(Release::MinClockAtLeast(c));
            }
        }
        // The authors' gap: the iteration just pushed (c - 1) minus the slowest unfinished one.
        let Some(k) = c.checked_sub(view.min_clock + 1) else { return PullVerdict::Serve };
        // The draw is taken only for candidate pulls, as the authors' short-circuit does.
        if c == view.max_clock && k >= self.s && ctx.random_f64() < self.probability(k) {
            match self.release {
                ReleaseAt::Next => PullVerdict::Defer(Release::MinClockAtLeast(view.min_clock + 1)),
                ReleaseAt::Own => {
                    self.blocked.push(c);
                    PullVerdict::Defer(Release::MinClockAtLeast(c))
                }
            }
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
    fn pauses_only_the_fastest_at_the_authors_gap_and_releases_at_the_next_min_clock() {
        let mut d = Driver::<FluentPs>::new(&[("s", "2"), ("p", "1")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for _ in 0..2 {
            d.push(0).unwrap();
            d.push(1).unwrap();
        }
        // Worker 0 pushed iterations 0-2 (current = 2) while worker 2 has none (slowest = 0): k = 2.
        d.push(0).unwrap();
        assert_eq!(d.pull(1).unwrap(), PullVerdict::Serve, "k = 1 and not the fastest");
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(2).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn at_s_zero_the_fastest_waits_for_its_own_iteration_never_for_itself() {
        let mut d = Driver::<FluentPs>::new(&[("s", "0"), ("p", "1")]).unwrap();
        d.join(0);
        d.join(1);
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve, "nothing pushed yet");
        d.push(0).unwrap();
        // current = 0, slowest = 0: k = 0 >= s, so it waits for worker 1's iteration 0.
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
        d.push(1).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn the_block_variant_waits_for_the_own_iteration_and_queues_later_pulls_there() {
        let mut d = Driver::<FluentPs>::new(&[("s", "1"), ("p", "1"), ("release", "own")]).unwrap();
        for w in 0..4 {
            d.join(w);
        }
        for _ in 0..3 {
            d.push(0).unwrap();
        }
        // current = 2, slowest = 0: k = 2, and it waits until everyone finished its iteration.
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(3)));
        for _ in 0..4 {
            d.push(1).unwrap();
        }
        for _ in 0..3 {
            d.push(2).unwrap();
        }
        // Worker 2 at clock 3 is not the fastest (worker 1 is at 4): the rule alone would serve
        // it, but a pause at clock 3 is outstanding, so it queues behind it.
        assert_eq!(d.pull(2).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(3)));
        for _ in 0..3 {
            d.push(3).unwrap();
        }
        assert_eq!(d.take_released().len(), 2, "both released once every worker finished iteration 2");
        assert_eq!(d.pull(3).unwrap(), PullVerdict::Serve, "the pause at clock 3 is over");
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
        let f = FluentPs { s: 3, mode: Mode::Sigmoid, release: ReleaseAt::Next, blocked: Vec::new() };
        assert!((f.probability(3) - 0.5).abs() < 1e-12);
        assert!(f.probability(6) > 0.95 && f.probability(1) < 0.15);
        assert!(Driver::<FluentPs>::new(&[("p", "1.5")]).unwrap_err().contains("probability"));
        assert!(Driver::<FluentPs>::new(&[("mode", "cubic")]).unwrap_err().contains("cubic"));
        assert!(Driver::<FluentPs>::new(&[("release", "later")]).unwrap_err().contains("later"));
    }
}
