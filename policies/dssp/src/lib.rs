//! DSSP, dynamic stale synchronous parallel (Zhao, An, Liu, Chen; ICDCS 2019, arXiv 1908.11848;
//! full text: the first author's site, `DSSP_ICDCS_2019.pdf`).
//!
//! The user gives a staleness range `[s_lo, s_hi]` instead of one bound; a controller picks, each
//! time the fastest worker would wait at the low bound, how many extra iterations `r*` (at most
//! `r_max = s_hi - s_lo`) it may run ahead, so that it does not wait for a slow worker whose next
//! push is far away.
//!
//! Rule, per shard, on a pull of worker `p` at clock `t_p` (the slowest live clock is `t_s`),
//! the paper's Algorithm 1 (`mode = paper`, the default):
//! 1. if `p` holds granted extensions (`r_p > 0`): `r_p -= 1` and serve;
//! 2. else if `t_p - t_s <= s_lo`: serve;
//! 3. else if `p` is the fastest worker (`t_p == max_clock`): compute `r*`; if `r* > 0`, set
//!    `r_p = r*` **and** serve, so the worker runs `r* + 1` iterations beyond `s_lo`;
//! 4. otherwise defer until `t_p - t_s <= s_lo`.
//!
//! There is no hard cap at `s_hi` in the paper: once the credits are spent, the fastest worker can
//! be granted again, so its lead can grow beyond `s_hi` while the controller keeps finding that
//! waiting would be wasted.
//!
//! `mode = capped` is our earlier, more conservative reading, kept as an option: step 3 sets
//! `r_p = r* - 1` (at most `s_hi - s_lo` iterations beyond `s_lo` in all), and whatever the
//! credits say, a pull is never served with a gap above `s_hi`. With a persistent straggler it
//! behaves like SSP(`s_hi`).
//!
//! Controller (the paper's Algorithm 2): with `A_w` and `A'_w` the times of worker `w`'s last
//! two pushes, `I_f = A_f - A'_f` and `I_s = A_s - A'_s` the last intervals of the fastest and
//! the slowest worker, `r* = argmin_{r in 0..=r_max} min_{k in 1..=r_max+1} |(A_f + r I_f) -
//! (A_s + k I_s)|`: the extension after which the fastest worker's next push lands closest to one
//! of the slowest worker's next `r_max + 1`. With fewer than two pushes from either worker there is
//! no interval yet and `r* = 0`.
//!
//! Our reading where the paper leaves room: the rule runs on pulls (our host blocks a worker by
//! holding its pull reply, where the paper's server withholds the OK to a push; the worker's next
//! pull follows its push at once), ties for the slowest worker go to the one whose last push is
//! oldest, and ties in the argmin go to the smallest `r`. Updates are applied on arrival, as in
//! SSP. With `s_lo == s_hi` the policy decides exactly as SSP(`s_lo`) in both modes.

use syncopate_policy_sdk::prelude::*;

/// Per-worker state: clock, last two push times, granted extensions.
#[derive(Clone, Copy, Debug, Default)]
struct Worker {
    live: bool,
    clock: u64,
    last_push: Option<u64>,
    prev_push: Option<u64>,
    credits: u64,
}

impl Worker {
    fn interval(&self) -> Option<(u64, u64)> {
        let (a, b) = (self.last_push?, self.prev_push?);
        Some((a, a.saturating_sub(b)))
    }
}

/// Dynamic stale synchronous parallel.
#[derive(Debug)]
pub struct Dssp {
    s_lo: u64,
    s_hi: u64,
    /// `mode = capped`: never beyond `s_hi`, `r*` iterations in all per grant.
    capped: bool,
    workers: Vec<Worker>,
}

impl Dssp {
    /// The controller: the extension `r` in `0..=max_r` after which a worker last pushing at
    /// `fast.0` every `fast.1` ns lands closest to one of the next `max_r + 1` pushes of one
    /// pushing at `slow.0` every `slow.1` ns.
    pub fn extension(fast: (u64, u64), slow: (u64, u64), max_r: u64) -> u64 {
        let (a_f, i_f) = (fast.0 as f64, fast.1 as f64);
        let (a_s, i_s) = (slow.0 as f64, slow.1 as f64);
        if i_s <= 0.0 {
            return 0;
        }
        let mut best = (f64::INFINITY, 0);
        for r in 0..=max_r {
            let x = a_f + r as f64 * i_f;
            let k = ((x - a_s) / i_s).round().clamp(1.0, max_r as f64 + 1.0);
            let dist = (x - (a_s + k * i_s)).abs();
            if dist < best.0 {
                best = (dist, r);
            }
        }
        best.1
    }

    fn worker(&mut self, w: WorkerId) -> &mut Worker {
        let i = w as usize;
        if self.workers.len() <= i {
            self.workers.resize(i + 1, Worker::default());
        }
        &mut self.workers[i]
    }

    /// The live worker with the smallest clock (the oldest last push breaks ties).
    fn slowest(&self) -> Option<&Worker> {
        self.workers.iter().filter(|w| w.live).min_by_key(|w| (w.clock, w.last_push.unwrap_or(0)))
    }
}

impl Policy for Dssp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "dssp",
        env!("CARGO_PKG_VERSION"),
        "Dynamic SSP: a staleness bound chosen in [s_lo, s_hi] from the workers' iteration times.",
        &[
            ParamSpec::new("s_lo", ParamKind::Uint, "3", "low staleness bound: always allowed"),
            ParamSpec::new(
                "s_hi",
                ParamKind::Uint,
                "15",
                "high staleness bound: one grant is at most s_hi - s_lo extensions",
            ),
            ParamSpec::new(
                "mode",
                ParamKind::Text,
                "paper",
                "`paper` (Algorithm 1: r*+1 beyond s_lo, no cap) or `capped` (never beyond s_hi)",
            ),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let (s_lo, s_hi): (u64, u64) = (init.config.get("s_lo")?, init.config.get("s_hi")?);
        if s_lo > s_hi {
            return Err(format!("s_lo = {s_lo} exceeds s_hi = {s_hi}"));
        }
        let capped = match init.config.text("mode").unwrap_or("paper") {
            "paper" => false,
            "capped" => true,
            other => return Err(format!("mode `{other}` is neither `paper` nor `capped`")),
        };
        Ok(Dssp { s_lo, s_hi, capped, workers: Vec::new() })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut d = Self::new(init)?;
        for w in &handoff.workers {
            let s = d.worker(w.worker);
            s.live = true;
            s.clock = w.clock;
        }
        Ok(d)
    }

    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, clock: u64) {
        *self.worker(worker) = Worker { live: true, clock, ..Worker::default() };
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.worker(worker).live = false;
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        let now = ctx.now_ns();
        let w = self.worker(push.worker);
        w.live = true;
        w.clock = push.clock + 1;
        w.prev_push = w.last_push;
        w.last_push = Some(now);
        PushVerdict::Admit
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        let view = ctx.view();
        let gap = pull.clock.saturating_sub(view.min_clock);
        let defer = PullVerdict::Defer(Release::MinClockAtLeast(pull.clock.saturating_sub(self.s_lo)));
        if self.capped && gap > self.s_hi {
            return PullVerdict::Defer(Release::MinClockAtLeast(pull.clock - self.s_hi));
        }
        let (s_lo, s_hi, capped) = (self.s_lo, self.s_hi, self.capped);
        let slow = self.slowest().and_then(Worker::interval);
        let me = self.worker(pull.worker);
        me.clock = pull.clock;
        if me.credits > 0 {
            me.credits -= 1;
            return PullVerdict::Serve;
        }
        if gap <= s_lo {
            return PullVerdict::Serve;
        }
        if pull.clock < view.max_clock {
            return defer;
        }
        let r = match (me.interval(), slow) {
            (Some(fast), Some(slow)) => Dssp::extension(fast, slow, s_hi - s_lo),
            _ => 0,
        };
        if r == 0 {
            return defer;
        }
        me.credits = if capped { r - 1 } else { r };
        ctx.metric("dssp.extension", r as f64);
        PullVerdict::Serve
    }
}

syncopate_policy_sdk::export_policy!(Dssp);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_controller_lands_the_fast_push_next_to_a_slow_one() {
        // Fast pushes every 10 (last at 100), slow every 35 (last at 90): slow pushes at 125, 160.
        // r = 2 lands at 120 (5 from 125), r = 6 at 160 (exact).
        assert_eq!(Dssp::extension((100, 10), (90, 35), 3), 2);
        assert_eq!(Dssp::extension((100, 10), (90, 35), 6), 6);
        assert_eq!(Dssp::extension((100, 10), (90, 0), 6), 0);
    }

    #[test]
    fn rejects_an_inverted_range_and_an_unknown_mode() {
        let err = Driver::<Dssp>::new(&[("s_lo", "4"), ("s_hi", "2")]).unwrap_err();
        assert!(err.contains("exceeds"), "{err}");
        let err = Driver::<Dssp>::new(&[("mode", "loose")]).unwrap_err();
        assert!(err.contains("loose"), "{err}");
    }

    #[test]
    fn the_controller_looks_only_at_the_slow_workers_next_r_max_plus_one_pushes() {
        // Slow pushes at 45 and 90 (k <= 2): r = 0 lands at 100 (10 from 90), r = 1 at 135 (45
        // from 90). An unbounded k would have matched 135 exactly and chosen r = 1.
        assert_eq!(Dssp::extension((100, 35), (0, 45), 1), 0);
    }

    /// Algorithm 1 on a hand-checked sequence. s_lo = 1, s_hi = 3 (r_max = 2). Both workers push
    /// at 0 and 30; then worker 1 keeps pushing every 30 (next at 60, 90, 120) and worker 0 every
    /// 10, pulling after each push.
    fn script(mode: &str) -> Vec<(u64, u64, PullVerdict)> {
        let mut d = Driver::<Dssp>::new(&[("s_lo", "1"), ("s_hi", "3"), ("mode", mode)]).unwrap();
        d.join(0);
        d.join(1);
        let mut seen = Vec::new();
        for t in (0..=80u64).step_by(10) {
            if t % 30 == 0 {
                d.push(1).unwrap();
            }
            if t == 0 || t >= 30 {
                d.push(0).unwrap();
                if t >= 40 {
                    let v = d.pull(0).unwrap();
                    seen.push((t, d.clock(0).unwrap() - d.view().min_clock, v));
                    if v != PullVerdict::Serve {
                        break;
                    }
                }
            }
            d.advance_ns(10);
        }
        seen
    }

    #[test]
    fn the_paper_mode_follows_algorithm_1_on_a_hand_checked_sequence() {
        let serve = PullVerdict::Serve;
        assert_eq!(
            script("paper"),
            [
                // t=40: gap 1 <= s_lo.
                (40, 1, serve),
                // t=50: gap 2, fastest; slow's next pushes 60, 90, 120; r = 1 lands on 60: r* = 1,
                // r_p = 1 and OK.
                (50, 2, serve),
                // t=60: the credit (worker 1 pushed at 60: the gap stays 2).
                (60, 2, serve),
                // t=70: gap 3, no credit; from 70 every 10, 90 is reached at r = 2: r* = 2, OK.
                (70, 3, serve),
                // t=80: a credit, at gap 4, beyond s_hi = 3: the paper has no cap.
                (80, 4, serve),
            ]
        );
    }

    #[test]
    fn the_capped_mode_grants_one_less_and_never_passes_s_hi() {
        let serve = PullVerdict::Serve;
        assert_eq!(
            script("capped"),
            [
                (40, 1, serve),
                // r* = 1 as above, but r_p = r* - 1 = 0.
                (50, 2, serve),
                // t=60: gap 2, no credit; worker 1 just pushed (next at 90, 120, 150), and from 60
                // every 10, 90 is reached at r = 2: r* = 2, r_p = 1.
                (60, 2, serve),
                // t=70: the credit.
                (70, 3, serve),
                // t=80: gap 4 > s_hi: deferred until the gap is back at s_hi.
                (80, 4, PullVerdict::Defer(Release::MinClockAtLeast(4))),
            ]
        );
    }

    #[test]
    fn grants_an_extension_to_the_fastest_worker_and_keeps_below_s_hi_when_capped() {
        let mut d = Driver::<Dssp>::new(&[("s_lo", "2"), ("s_hi", "6"), ("mode", "capped")]).unwrap();
        d.join(0);
        d.join(1);
        // The slow worker 1 pushes every 40 ns, the fast worker 0 every 10 ns.
        let (mut max_gap, mut deferred) = (0, false);
        for t in 0..20u64 {
            if t % 4 == 0 {
                d.push(1).unwrap();
            }
            if t > 0 {
                d.push(0).unwrap();
                if d.pull(0).unwrap() != PullVerdict::Serve {
                    deferred = true;
                    break;
                }
                max_gap = max_gap.max(d.clock(0).unwrap() - d.view().min_clock);
            }
            d.advance_ns(10);
        }
        assert!(max_gap > 2, "an extension beyond s_lo was granted (gap {max_gap})");
        assert_eq!(max_gap, 6, "the gap reaches s_hi and stops there");
        assert!(deferred, "the worker is stopped at s_hi");
    }
}
