//! `autopilot`: a cluster policy that picks the shard policy from the stragglers it sees.
//!
//! No paper fixes this rule; it is **our reading** of what the classic results say about when
//! each rule pays (`docs/paradigms.md`): BSP is the most sample-efficient and costs nothing when
//! workers are alike; SSP bounds the waiting a mildly slow worker causes at a bounded
//! staleness; with one or a few workers far slower than the rest, a deadline that stops
//! waiting for them (`adaptive-deadline`) keeps rounds synchronous for the others; when many
//! workers are slow or the spread is wide, ASP stops waiting at all.
//!
//! Every `cadence_ms` the coordinator hands it each worker's mean compute time per iteration
//! over the window (what the workers report with their pushes, so it does not depend on the
//! rule running: a straggler is as slow under BSP as under ASP). With `r` the slowest worker's
//! time over the median's:
//!
//! - `r < slow`: BSP;
//! - `slow <= r < severe`: SSP with staleness `ssp_s`;
//! - `r >= severe`: the adaptive deadline when at most a quarter of the workers are slower
//!   than `slow` times the median, ASP when more are.
//!
//! **Hysteresis.** A rule is left for a lower one (less asynchronous) only once `r` is under
//! the lower rule's threshold divided by `band`; the same choice must come `confirm` windows in
//! a row; and no swap follows another within `dwell_ms`. So a straggler that comes and goes
//! within a window, or a ratio that wavers around a threshold, does not make the cluster swap
//! back and forth (each swap levels the workers' clocks and restarts the rule's state).
//!
//! It manages only a cluster running one of its four rules: a cluster an operator swapped to
//! another (DiLoCo, say) is left alone until it runs one of them again. With fewer than two
//! workers reporting compute times it keeps what runs.

use syncopate_policy_sdk::cluster::{ClusterCtx, ClusterInit, ClusterPolicy, Figures};
use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::state;

/// The rules the autopilot picks among, from the least to the most asynchronous.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Rule {
    /// Bulk synchronous.
    Bsp,
    /// Stale synchronous.
    Ssp,
    /// Synchronous rounds with an adaptive deadline.
    Deadline,
    /// Asynchronous.
    Asp,
}

impl Rule {
    /// The built-in policy's name.
    pub fn policy(self) -> &'static str {
        match self {
            Rule::Bsp => "bsp",
            Rule::Ssp => "ssp",
            Rule::Deadline => "adaptive-deadline",
            Rule::Asp => "asp",
        }
    }

    fn of(policy: &str) -> Option<Rule> {
        [Rule::Bsp, Rule::Ssp, Rule::Deadline, Rule::Asp].into_iter().find(|r| r.policy() == policy)
    }
}

/// What survives a restart of the coordinator.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Saved {
    /// The choice the last windows agreed on, and how many in a row.
    streak: Option<(Rule, u32)>,
    /// When the last swap was asked for.
    last_swap_ns: Option<u64>,
}

/// The autopilot.
#[derive(Debug)]
pub struct Autopilot {
    cadence_ms: u32,
    ssp_s: u64,
    slow: f64,
    severe: f64,
    band: f64,
    confirm: u32,
    dwell_ns: u64,
    saved: Saved,
    /// A swap asked for and not yet done.
    swapping: bool,
}

impl Autopilot {
    /// The rule the figures call for, given the rule running (`None`: not enough figures).
    pub fn choose(&self, running: Rule, f: &Figures) -> Option<Rule> {
        let mut steps: Vec<u64> = f.workers.iter().map(|w| w.step_ns).filter(|&s| s > 0).collect();
        if steps.len() < 2 {
            return None;
        }
        steps.sort_unstable();
        let n = steps.len();
        let median =
            if n % 2 == 1 { steps[n / 2] as f64 } else { (steps[n / 2 - 1] + steps[n / 2]) as f64 / 2.0 };
        let ratio = steps[n - 1] as f64 / median;
        let slow_ones = steps.iter().filter(|&&s| s as f64 > self.slow * median).count();
        let severe = if 4 * slow_ones <= n { Rule::Deadline } else { Rule::Asp };
        // The threshold each rule is entered at; leaving it for a lower one takes a ratio under
        // the threshold divided by `band`.
        let needs = |rule: Rule| match rule {
            Rule::Bsp => 0.0,
            Rule::Ssp => self.slow,
            Rule::Deadline | Rule::Asp => self.severe,
        };
        let raw = if ratio >= self.severe {
            severe
        } else if ratio >= self.slow {
            Rule::Ssp
        } else {
            Rule::Bsp
        };
        if raw >= running {
            // Between the deadline and ASP the count of slow workers decides, not the ratio.
            return Some(raw);
        }
        // Going down: only as far as the ratio is clearly under each threshold.
        let mut to = running;
        while to > Rule::Bsp {
            let lower = match to {
                Rule::Asp | Rule::Deadline => Rule::Ssp,
                _ => Rule::Bsp,
            };
            if ratio < needs(to) / self.band {
                to = lower;
            } else {
                break;
            }
        }
        Some(if to >= Rule::Deadline { severe } else { to })
    }
}

impl ClusterPolicy for Autopilot {
    const INFO: PolicyInfo = PolicyInfo::new(
        "autopilot",
        env!("CARGO_PKG_VERSION"),
        "Picks BSP, SSP, the adaptive deadline or ASP for the whole cluster from its workers' compute times, with hysteresis.",
        &[
            ParamSpec::new("cadence_ms", ParamKind::Uint, "2000", "how often it looks at the cluster, in ms"),
            ParamSpec::new("ssp_s", ParamKind::Uint, "3", "SSP's staleness bound when it picks SSP"),
            ParamSpec::new("slow", ParamKind::Float, "1.5", "slowest over median compute time that leaves BSP"),
            ParamSpec::new("severe", ParamKind::Float, "3.0", "the ratio that picks the deadline or ASP"),
            ParamSpec::new("band", ParamKind::Float, "1.2", "a rule is left for a lower one under its threshold / band"),
            ParamSpec::new("confirm", ParamKind::Uint, "2", "windows in a row that must agree before a swap"),
            ParamSpec::new("dwell_ms", ParamKind::Uint, "10000", "least time between two swaps, in ms"),
        ],
    );

    fn new(init: &ClusterInit) -> Result<Self, String> {
        let c = &init.config;
        let get_u = |k: &str| c.get::<u64>(k).map_err(|e| e.0);
        let get_f = |k: &str| c.get::<f64>(k).map_err(|e| e.0);
        let (slow, severe, band) = (get_f("slow")?, get_f("severe")?, get_f("band")?);
        if !(slow > 1.0 && severe > slow && severe.is_finite()) {
            return Err(format!("need 1 < slow < severe (got slow {slow}, severe {severe})"));
        }
        if !(1.0..=4.0).contains(&band) {
            return Err(format!("band must lie in 1..=4 (got {band})"));
        }
        let ssp_s = get_u("ssp_s")?;
        if !(1..=1000).contains(&ssp_s) {
            return Err(format!("ssp_s must lie in 1..=1000 (got {ssp_s})"));
        }
        let confirm = get_u("confirm")?.clamp(1, 100) as u32;
        let cadence_ms = get_u("cadence_ms")?.min(u64::from(u32::MAX)) as u32;
        let dwell_ns = get_u("dwell_ms")?.saturating_mul(1_000_000);
        Ok(Autopilot {
            cadence_ms,
            ssp_s,
            slow,
            severe,
            band,
            confirm,
            dwell_ns,
            saved: Saved::default(),
            swapping: false,
        })
    }

    fn on_start(&mut self, ctx: &mut ClusterCtx<'_>) {
        ctx.set_cadence_ms(self.cadence_ms);
    }

    fn on_figures(&mut self, ctx: &mut ClusterCtx<'_>, f: &Figures) {
        let Some(running) = Rule::of(&f.policy) else {
            self.saved.streak = None;
            return;
        };
        if self.swapping {
            return;
        }
        let Some(want) = self.choose(running, f) else { return };
        ctx.metric("autopilot.rule", want as u8 as f64);
        if want == running {
            self.saved.streak = None;
            return;
        }
        let streak = match self.saved.streak {
            Some((rule, n)) if rule == want => n + 1,
            _ => 1,
        };
        self.saved.streak = Some((want, streak));
        let dwelt = self.saved.last_swap_ns.is_none_or(|t| ctx.now_ns().saturating_sub(t) >= self.dwell_ns);
        if streak >= self.confirm && dwelt {
            let s = self.ssp_s.to_string();
            let config: &[(&str, &str)] = if want == Rule::Ssp { &[("s", &s)] } else { &[] };
            let reason = format!("{} windows call for {} (was {})", streak, want.policy(), running.policy());
            ctx.swap(want.policy(), config, &reason);
            self.saved.streak = None;
            self.saved.last_swap_ns = Some(ctx.now_ns());
            self.swapping = true;
        }
    }

    fn on_swapped(&mut self, _ctx: &mut ClusterCtx<'_>, _policy: &str, _ok: bool, _detail: &str) {
        self.swapping = false;
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&self.saved)
    }

    fn import_state(init: &ClusterInit, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut a = Self::new(init)?;
        if let Some(saved) = state::load::<Saved>(handoff, "autopilot")? {
            a.saved = saved;
        }
        Ok(a)
    }
}

syncopate_policy_sdk::export_cluster_policy!(Autopilot);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::cluster::{ClusterDecision, ClusterDriver};

    fn figures(policy: &str, steps_ms: &[u64]) -> Figures {
        let mut f = Figures::example(steps_ms.len() as u32, policy);
        for (w, &ms) in f.workers.iter_mut().zip(steps_ms) {
            w.step_ns = ms * 1_000_000;
        }
        f.window_ns = 2_000_000_000;
        f
    }

    fn init(config: &[(&str, &str)]) -> ClusterInit {
        ClusterInit {
            shards: 1,
            config: syncopate_policy_sdk::Config::validate(Autopilot::INFO.params, config).unwrap(),
        }
    }

    fn swaps(out: &[ClusterDecision]) -> Vec<&str> {
        out.iter().filter_map(ClusterDecision::swap_target).collect()
    }

    #[test]
    fn a_straggler_moves_the_cluster_off_bsp_after_two_windows_and_back_when_it_is_gone() {
        let mut d = ClusterDriver::<Autopilot>::new(&[]).unwrap();
        let alike = figures("bsp", &[100, 105, 98, 102]);
        assert!(swaps(&d.figures(&alike)).is_empty());
        let straggler = figures("bsp", &[100, 105, 98, 500]);
        assert!(swaps(&d.figures(&straggler)).is_empty(), "one window is not enough");
        let out = d.figures(&straggler);
        assert_eq!(swaps(&out), ["adaptive-deadline"], "{out:?}");
        assert!(swaps(&d.figures(&straggler)).is_empty(), "nothing while the swap is under way");
        d.swapped("adaptive-deadline", true, "");
        let running = figures("adaptive-deadline", &[100, 105, 98, 500]);
        assert!(swaps(&d.figures(&running)).is_empty());
        // The straggler recovers: back to BSP, once two windows agree and the dwell has passed.
        let back = figures("adaptive-deadline", &[100, 105, 98, 101]);
        let mut out = Vec::new();
        for _ in 0..6 {
            out.extend(d.figures(&back));
        }
        assert_eq!(swaps(&out), ["bsp"], "{out:?}");
    }

    #[test]
    fn many_slow_workers_pick_asp_and_a_mild_spread_picks_ssp_with_its_bound() {
        let mut d = ClusterDriver::<Autopilot>::new(&[("confirm", "1"), ("ssp_s", "4")]).unwrap();
        let out = d.figures(&figures("bsp", &[100, 100, 100, 200]));
        assert!(
            matches!(&out[1], ClusterDecision::Swap { policy, config, .. }
            if policy == "ssp" && config == &vec![("s".to_string(), "4".to_string())]),
            "{out:?}"
        );
        let mut d = ClusterDriver::<Autopilot>::new(&[("confirm", "1")]).unwrap();
        assert_eq!(swaps(&d.figures(&figures("bsp", &[100, 100, 100, 400, 400]))), ["asp"]);
    }

    #[test]
    fn a_ratio_wavering_about_a_threshold_does_not_swap_back() {
        let pilot = Autopilot::new(&init(&[])).unwrap();
        // Running SSP (entered at 1.5): 1.4 is inside the band (1.5 / 1.2 = 1.25), so SSP stays.
        assert_eq!(pilot.choose(Rule::Ssp, &figures("ssp", &[100, 100, 100, 140])), Some(Rule::Ssp));
        assert_eq!(pilot.choose(Rule::Ssp, &figures("ssp", &[100, 100, 100, 120])), Some(Rule::Bsp));
        // From ASP a ratio of 2.8 (under 3, over 3 / 1.2) keeps the severe rule.
        assert_eq!(pilot.choose(Rule::Asp, &figures("asp", &[100, 100, 100, 280, 280])), Some(Rule::Asp));
        assert_eq!(pilot.choose(Rule::Asp, &figures("asp", &[100, 100, 100, 200, 200])), Some(Rule::Ssp));
        // One worker reporting is not enough to judge.
        assert_eq!(pilot.choose(Rule::Bsp, &figures("bsp", &[100])), None);
    }

    #[test]
    fn another_policy_running_is_left_alone_and_bad_settings_are_refused() {
        let mut d = ClusterDriver::<Autopilot>::new(&[("confirm", "1")]).unwrap();
        assert!(swaps(&d.figures(&figures("diloco", &[100, 100, 100, 900]))).is_empty());
        for bad in [("slow", "0.9"), ("severe", "1.2"), ("band", "0.5"), ("ssp_s", "0")] {
            assert!(ClusterDriver::<Autopilot>::new(&[bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn its_streak_and_last_swap_survive_a_restart() {
        let init = init(&[]);
        let mut a = Autopilot::new(&init).unwrap();
        a.saved = Saved { streak: Some((Rule::Asp, 1)), last_swap_ns: Some(7) };
        let bytes = a.export_state();
        let h = Handoff { from_name: "autopilot", from_version: "0", state: &bytes, workers: vec![] };
        assert_eq!(Autopilot::import_state(&init, &h).unwrap().saved, a.saved);
    }
}
