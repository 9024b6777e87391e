//! `decoupled-diloco`: DiLoCo whose learners never wait for each other. **Our reading** of
//! Decoupled DiLoCo (arXiv 2604.21428) as the issue that asked for it summarises it (a syncer
//! aggregates once K learners report, waits a grace window derived from measured step times,
//! and merges weighted by tokens and staleness); the paper's text was not available to us, so
//! every choice below is ours and a parameter where it can be.
//!
//! - **Learners** (workers) take `h` local steps per outer step, as in DiLoCo, and push their
//!   pseudo-gradient. Their pulls are served at once: a learner starts its next outer step from
//!   the parameters as they are, whether or not its last pseudo-gradient was applied yet.
//! - **The syncer** (each shard) admits every pseudo-gradient into the open outer step (a
//!   group), weighted by the tokens it covers (the worker's reported tokens, else its samples)
//!   over `1 + staleness` (outer steps applied since the pull it started from). Once `k`
//!   distinct learners are in (`k = 0`: half the live learners, rounded up), it waits a
//!   **grace window** of `grace` times the median of the live learners' last reported outer-step
//!   compute times (at least `min_grace_ms`), for more to arrive; then, or as soon as every
//!   live learner is in, it applies the group as one outer step (SGD with Nesterov momentum,
//!   `outer_lr`, `outer_momentum`: DiLoCo's outer optimizer) on the weighted mean. Its metrics:
//!   `decoupled.learners` and `decoupled.tokens` of the last outer step, `decoupled.outer_steps`.
//! - An outer step never stays open for ever: from its first pseudo-gradient, it closes at the
//!   latest `patience` median outer-step times later, quorum or not (learners that stopped
//!   pushing but did not leave would otherwise keep what the others pushed from the model).
//! - A pseudo-gradient that arrives after its outer step was applied joins the next one (with
//!   its staleness counted), so no learner's work is lost, and a crashed learner holds nobody
//!   up: the quorum and the grace window close the step without it.
//!
//! Not done: the radial-directional averaging of per-learner norms (the host's weighted mean
//! sets the direction but not a separate magnitude), and a quorum the same on every shard (each
//! shard counts its own arrivals; a cluster policy could name it, see `docs/writing-a-policy.md`).

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::state;

/// What survives a swap to this policy again, or a restart: the open outer step's number.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Saved {
    group: u64,
}

/// Decoupled DiLoCo.
#[derive(Debug)]
pub struct DecoupledDiloco {
    h: u32,
    k: u32,
    grace: f64,
    min_grace_ns: u64,
    outer_lr: f32,
    outer_momentum: f32,
    codecs: CodecChoice,
    /// The open outer step.
    group: u64,
    /// How many live learners have a pseudo-gradient in it.
    members: usize,
    /// By worker id: a live learner's last reported outer-step compute time (ns; 0: none yet)
    /// and whether it is in the open step (ids are bounded by the host's worker limit).
    learners: Vec<Option<(u64, bool)>>,
    /// Live learners.
    live: usize,
    /// When the open step's timer fires (host ns), if armed: at its patience, or at its grace
    /// window once the quorum is in, whichever is sooner.
    armed: Option<u64>,
    patience: f64,
    /// Scratch for the median (kept, so a push allocates nothing once grown).
    times: Vec<u64>,
    /// Tokens (else samples) the open step's pseudo-gradients cover.
    tokens: u64,
}

impl DecoupledDiloco {
    fn quorum(&self) -> usize {
        let n = self.live;
        let k = if self.k == 0 { n.div_ceil(2) } else { self.k as usize };
        k.clamp(1, n.max(1))
    }

    /// `times` medians of the learners' last outer-step times (at least `min_grace_ms`).
    fn medians_ns(&mut self, times: f64) -> u64 {
        self.times.clear();
        self.times.extend(self.learners.iter().flatten().map(|l| l.0).filter(|&t| t > 0));
        if self.times.is_empty() {
            return self.min_grace_ns;
        }
        let mid = self.times.len() / 2;
        let median = *self.times.select_nth_unstable(mid).1;
        ((median as f64 * times) as u64).max(self.min_grace_ns)
    }

    /// Arms the open step's timer to fire `after` ns from now, unless it fires sooner already.
    fn arm(&mut self, ctx: &mut Ctx<'_>, after: u64) {
        let at = ctx.now_ns().saturating_add(after);
        match self.armed {
            Some(t) if t <= at => {}
            Some(_) => {
                ctx.cancel_timer(self.group);
                ctx.set_timer(self.group, after);
                self.armed = Some(at);
            }
            None => {
                ctx.set_timer(self.group, after);
                self.armed = Some(at);
            }
        }
    }

    /// A live learner, not in the open step yet.
    fn join(&mut self, worker: WorkerId) {
        let i = worker as usize;
        if self.learners.len() <= i {
            self.learners.resize(i + 1, None);
        }
        if self.learners[i].is_none() {
            self.learners[i] = Some((0, false));
            self.live += 1;
        }
    }

    /// Applies the open outer step and opens the next.
    fn step(&mut self, ctx: &mut Ctx<'_>) {
        if self.armed.take().is_some() {
            ctx.cancel_timer(self.group);
        }
        ctx.complete_group(self.group);
        ctx.metric("decoupled.learners", self.members as f64);
        ctx.metric("decoupled.tokens", self.tokens as f64);
        self.tokens = 0;
        self.members = 0;
        for l in self.learners.iter_mut().flatten() {
            l.1 = false;
        }
        self.group += 1;
        ctx.metric("decoupled.outer_steps", self.group as f64);
    }

    /// Closes the open step if every live learner is in, or arms its grace window once the
    /// quorum is.
    fn check(&mut self, ctx: &mut Ctx<'_>) {
        if self.members == 0 {
            return;
        }
        if self.members >= self.live {
            self.step(ctx);
            return;
        }
        let after = self.medians_ns(self.patience);
        self.arm(ctx, after);
        if self.members >= self.quorum() {
            let after = self.medians_ns(self.grace);
            self.arm(ctx, after);
        }
    }
}

impl Policy for DecoupledDiloco {
    const INFO: PolicyInfo = PolicyInfo::new(
        "decoupled-diloco",
        env!("CARGO_PKG_VERSION"),
        "Decoupled DiLoCo (our reading): learners never wait; an outer step closes once k learners are in and a grace window passed, merged by tokens and staleness.",
        &[
            ParamSpec::new("h", ParamKind::Uint, "500", "local (inner) steps per outer step (1 to 10000)"),
            ParamSpec::new("k", ParamKind::Uint, "0", "learners an outer step waits for before its grace window (0: half)"),
            ParamSpec::new("grace", ParamKind::Float, "0.5", "grace window, in learners' median outer-step times"),
            ParamSpec::new("min_grace_ms", ParamKind::Uint, "10", "least grace window, ms"),
            ParamSpec::new("patience", ParamKind::Float, "2.0", "an open outer step closes at the latest this many median outer-step times after its first push"),
            ParamSpec::new("outer_lr", ParamKind::Float, "0.7", "learning rate of the outer optimizer"),
            ParamSpec::new("outer_momentum", ParamKind::Float, "0.9", "Nesterov momentum of the outer optimizer"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let c = &init.config;
        let h = c.local_steps("h")?;
        let (outer_lr, outer_momentum) = c.outer_optimizer()?;
        let k: u32 = c.get("k").map_err(|e| e.0)?;
        let grace: f64 = c.get("grace").map_err(|e| e.0)?;
        if !(grace.is_finite() && (0.0..=100.0).contains(&grace)) {
            return Err(format!("grace must lie in 0..=100 (got {grace})"));
        }
        let min_grace_ms: u64 = c.get("min_grace_ms").map_err(|e| e.0)?;
        let patience: f64 = c.get("patience").map_err(|e| e.0)?;
        if !(patience.is_finite() && patience >= grace && patience <= 1000.0) {
            return Err(format!("patience must lie in grace..=1000 (got {patience}, grace {grace})"));
        }
        Ok(DecoupledDiloco {
            h,
            k,
            grace,
            min_grace_ns: min_grace_ms.min(3_600_000) * 1_000_000,
            outer_lr,
            outer_momentum,
            codecs: CodecChoice::from_config(c)?,
            group: 0,
            members: 0,
            learners: Vec::new(),
            live: 0,
            armed: None,
            patience,
            times: Vec::new(),
            tokens: 0,
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        ctx.set_local_steps(self.h);
        ctx.set_outer_optimizer(self.outer_lr, self.outer_momentum, true);
        self.codecs.on_start(ctx);
    }

    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _clock: u64) {
        self.join(worker);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        if let Some(l) = self.learners.get_mut(worker as usize).and_then(Option::take) {
            self.live -= 1;
            self.members -= usize::from(l.1);
        }
        self.codecs.forget(worker);
        self.check(ctx);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        PullVerdict::Serve
    }

    fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if let Some(Some(l)) = self.learners.get_mut(push.worker as usize) {
            if push.signals.step_ns > 0 {
                l.0 = push.signals.step_ns;
            }
        }
        PushVerdict::Hold
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, push: &Push, _verdict: PushVerdict) {
        let tokens =
            if push.signals.tokens > 0 { push.signals.tokens } else { u64::from(push.samples.max(1)) };
        let weight = tokens as f64 / (1.0 + push.staleness as f64);
        self.tokens = self.tokens.saturating_add(tokens);
        ctx.admit_to_group_weighted(push.id, self.group, weight as f32);
        if let Some(Some(l)) = self.learners.get_mut(push.worker as usize) {
            if !l.1 {
                l.1 = true;
                self.members += 1;
            }
        }
        self.check(ctx);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer == self.group && self.armed.take().is_some() {
            self.step(ctx);
        }
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&Saved { group: self.group })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut d = Self::new(init)?;
        if let Some(saved) = state::load::<Saved>(handoff, "decoupled-diloco")? {
            // The open step's pushes are the shard's (it keeps groups across swaps): go on
            // filling it; its members are unknown, so it closes by quorum and grace as usual.
            d.group = saved.group;
        }
        for w in &handoff.workers {
            d.join(w.worker);
        }
        Ok(d)
    }
}

syncopate_policy_sdk::export_policy!(DecoupledDiloco);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    fn signals(tokens: u64, step_ms: u64) -> Signals {
        Signals { loss: None, norm: None, tokens, step_ns: step_ms * 1_000_000 }
    }

    fn driver(config: &[(&str, &str)], workers: u32) -> Driver<DecoupledDiloco> {
        let mut d = Driver::<DecoupledDiloco>::new(config).unwrap().with_optimizer(
            syncopate_policy_sdk::optimizer::OptimizerConfig {
                lr: 1.0,
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
            vec![0.0; 2],
        );
        for w in 0..workers {
            d.join(w);
            assert_eq!(d.pull(w).unwrap(), PullVerdict::Serve, "learners never wait");
        }
        d
    }

    #[test]
    fn an_outer_step_closes_when_everyone_is_in_or_at_the_grace_window_after_the_quorum() {
        let mut d = driver(&[("h", "4"), ("k", "2"), ("grace", "0.5")], 3);
        assert!(d.log.contains(&Recorded::LocalSteps(None, 4)));
        assert!(d.log.contains(&Recorded::OuterOptimizer(0.7, 0.9, true)));
        d.push_signals(0, 0, &[1.0, 1.0], signals(64, 200)).unwrap();
        // One of k = 2: only its patience, two median step times (of the one that reported).
        assert!(d.log.contains(&Recorded::Timer(0, 400_000_000)), "{:?}", d.log);
        d.push_signals(1, 0, &[1.0, 1.0], signals(64, 400)).unwrap();
        // The quorum is in: a grace window of half the median step time (median of 200 and
        // 400 ms of the learners that reported: 400, the upper middle; half is 200 ms), sooner.
        assert!(d.log.contains(&Recorded::TimerCancelled(0)), "{:?}", d.log);
        assert!(d.log.contains(&Recorded::Timer(0, 200_000_000)), "{:?}", d.log);
        assert!(!d.log.contains(&Recorded::GroupCompleted(0)));
        d.fire_timer(0).unwrap();
        assert!(d.log.contains(&Recorded::GroupCompleted(0)), "closed at the grace window without learner 2");
        // Learner 2's late pseudo-gradient joins the next step; once everyone is in it closes.
        d.push_signals(2, 0, &[1.0, 1.0], signals(64, 900)).unwrap();
        d.pull(0).unwrap();
        d.push_signals(0, 1, &[1.0, 1.0], signals(64, 200)).unwrap();
        d.pull(1).unwrap();
        d.push_signals(1, 1, &[1.0, 1.0], signals(64, 200)).unwrap();
        assert!(d.log.contains(&Recorded::GroupCompleted(1)), "{:?}", d.log);
    }

    #[test]
    fn pseudo_gradients_weigh_by_tokens_over_one_plus_staleness() {
        let mut d = driver(&[("k", "3")], 3);
        d.push_signals(0, 0, &[1.0, 1.0], signals(100, 10)).unwrap();
        d.push_signals(1, 0, &[1.0, 1.0], signals(300, 10)).unwrap();
        d.push_signals(2, 0, &[1.0, 1.0], signals(0, 10)).unwrap(); // no tokens: its samples (1)
        let weights: Vec<Option<f32>> = d
            .log
            .iter()
            .filter_map(|r| match r {
                Recorded::AdmittedToGroup(_, 0, w) => Some(*w),
                _ => None,
            })
            .collect();
        assert_eq!(weights, [Some(100.0), Some(300.0), Some(1.0)], "no tokens: its one sample");
        // Learner 0 did not pull since: its next push is one outer step stale.
        d.push_signals(0, 1, &[1.0, 1.0], signals(100, 10)).unwrap();
        assert!(d.log.contains(&Recorded::AdmittedToGroup(7, 1, Some(50.0))), "{:?}", d.log);
    }

    #[test]
    fn an_outer_step_below_its_quorum_still_closes_at_its_patience() {
        let mut d = driver(&[("k", "3")], 3);
        d.push_signals(0, 0, &[1.0, 1.0], signals(1, 100)).unwrap();
        assert!(d.log.contains(&Recorded::Timer(0, 200_000_000)));
        d.fire_timer(0).unwrap();
        assert!(d.log.contains(&Recorded::GroupCompleted(0)), "{:?}", d.log);
        assert_eq!(d.steps(), 1);
    }

    #[test]
    fn a_learner_that_leaves_holds_nobody_up() {
        let mut d = driver(&[("k", "3")], 3);
        d.push_signals(0, 0, &[1.0, 1.0], signals(1, 10)).unwrap();
        d.push_signals(1, 0, &[1.0, 1.0], signals(1, 10)).unwrap();
        d.leave(2, LeaveReason::Failed);
        assert!(d.log.contains(&Recorded::GroupCompleted(0)), "everyone left is in: {:?}", d.log);
        assert_eq!(d.steps(), 1);
    }

    #[test]
    fn bad_settings_are_refused() {
        for bad in
            [("h", "0"), ("grace", "-1"), ("grace", "nan"), ("outer_momentum", "1.0"), ("patience", "0.1")]
        {
            assert!(Driver::<DecoupledDiloco>::new(&[bad]).is_err(), "{bad:?}");
        }
    }
}
