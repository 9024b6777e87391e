//! Sync-Switch: BSP first, then ASP (Li, Mangoubi, Xu and Guo, "Sync-Switch: Hybrid Parameter
//! Synchronization for Distributed Deep Learning", ICDCS 2021; the authors' code and data at
//! github.com/cake-lab/Sync-Switch).
//!
//! The paper's policies, as this rule takes them:
//! - **Protocol policy**: start with BSP and switch to ASP once, never back: BSP's exact steps
//!   early in training, when the model changes fastest, and ASP's throughput for the rest. (The
//!   authors' runs of ASP first, `a25-b75` and the like, did worse.)
//! - **Timing policy** (offline, for recurring jobs): the switch point is found ahead of time
//!   by a search over previous runs (a binary search for the earliest switch that keeps BSP's
//!   converged accuracy). Here it is the parameter `switch_at`, the iteration at which every
//!   shard switches: the search is the user's, for example with `syncopate ab` over several
//!   values (`docs/results.md` shows one).
//! - **Configuration policy**: after the switch, each update comes from one worker's batch
//!   instead of all `n` workers', and the authors scale the learning rate down accordingly
//!   (their notes: 0.8 to 0.1 for 8 workers). On Syncopate this holds without a setting: BSP
//!   steps the mean of a round's `n` gradients, and ASP steps each push weighted `1 / n`.
//! - **Online policy** (`online`, for transient stragglers): during the BSP phase, a worker
//!   that is a straggler makes the cluster switch to ASP at once instead of waiting for it at
//!   every barrier.
//!
//! Our reading, where the paper was not available to us or is silent:
//! - a straggler is a worker whose iteration, as the servers see it (pull served to push, so
//!   slow compute and slow links alike), took at least `straggler` times the median of the
//!   live workers' latest iterations, three iterations in a row;
//! - the online switch is one-way, as the offline one: the paper's second online policy, which
//!   returns to BSP once the straggler is gone, is not implemented, because after a stretch of
//!   ASP the workers' clocks are apart and BSP's barrier would hold the fast ones until the
//!   slow one had caught up on every iteration it missed;
//! - the optimizer's momentum is kept across the switch (the authors also tried resetting and
//!   scaling it; the shard's optimizer is the cluster's, not the policy's);
//! - pulls parked at the last BSP barrier are served when that barrier is reached, at most one
//!   iteration of the slowest worker after the switch.

use std::collections::BTreeMap;

use syncopate_policy_sdk::codec::CodecChoice;
use syncopate_policy_sdk::prelude::*;

/// Iterations in a row a worker must be slow to count as a straggler.
const CONFIRM: u32 = 3;

/// A worker as the online policy sees it.
#[derive(Clone, Copy, Debug, Default)]
struct Worker {
    /// Its clock as this instance last saw it.
    clock: u64,
    /// The minimum clock its parked pull waits for, if one is parked at the barrier.
    gate: Option<u64>,
    /// When its last pull was served (0: not yet).
    served_ns: u64,
    /// Its latest iteration time, pull served to push (0: none yet).
    last_ns: u64,
    /// Its slow iterations in a row.
    slow: u32,
}

/// Sync-Switch: BSP, then ASP.
#[derive(Debug)]
pub struct SyncSwitch {
    switch_at: u64,
    online: bool,
    straggler: f64,
    codecs: CodecChoice,
    /// Whether this shard has switched to ASP.
    switched: bool,
    workers: BTreeMap<WorkerId, Worker>,
    /// The live workers' latest iteration times, sorted for the median (kept from push to push,
    /// so the check allocates nothing once warm).
    times: Vec<u64>,
}

impl SyncSwitch {
    fn switch(&mut self, ctx: &mut Ctx<'_>, why: f64) {
        if !self.switched {
            self.switched = true;
            ctx.set_update_mode(UpdateMode::OnArrival);
            // 0: at `switch_at`; 1: for a straggler.
            ctx.metric("syncswitch.switched", why);
        }
    }

    /// Whether `worker`'s latest iteration makes it a straggler.
    fn straggles(&mut self, worker: WorkerId) -> bool {
        let times = &mut self.times;
        times.clear();
        times.extend(self.workers.values().map(|w| w.last_ns).filter(|&t| t > 0));
        if times.len() < 2 {
            return false;
        }
        times.sort_unstable();
        let median = times[times.len() / 2] as f64;
        let last = self.workers.get(&worker).map_or(0, |w| w.last_ns) as f64;
        median > 0.0 && last >= self.straggler * median
    }
}

impl Policy for SyncSwitch {
    const INFO: PolicyInfo = PolicyInfo::new(
        "syncswitch",
        env!("CARGO_PKG_VERSION"),
        "Sync-Switch (ICDCS 2021): BSP until iteration switch_at (or, online, until a straggler shows), then ASP.",
        &[
            ParamSpec::new("switch_at", ParamKind::Uint, "50", "the iteration from which the cluster runs ASP (the offline timing policy)"),
            ParamSpec::new("online", ParamKind::Bool, "true", "switch to ASP early when a straggler shows during BSP"),
            ParamSpec::new("straggler", ParamKind::Float, "2.0", "a straggler's iteration time, as a multiple of the median (above 1)"),
            CodecChoice::PUSH_PARAM,
            CodecChoice::PULL_PARAM,
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let straggler: f64 = init.config.get("straggler")?;
        if !(straggler.is_finite() && straggler > 1.0) {
            return Err(format!("straggler: {straggler} is not a multiple above 1 of the median"));
        }
        Ok(SyncSwitch {
            switch_at: init.config.get("switch_at")?,
            online: init.config.get("online")?,
            straggler,
            codecs: CodecChoice::from_config(&init.config)?,
            switched: false,
            workers: BTreeMap::new(),
            times: Vec::new(),
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        self.codecs.on_start(ctx);
        if ctx.view().min_clock >= self.switch_at {
            self.switch(ctx, 0.0);
        } else {
            ctx.set_update_mode(UpdateMode::Aggregate);
        }
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.codecs.forget(worker);
        self.workers.remove(&worker);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.codecs.on_pull(ctx, pull.worker);
        if !self.switched && ctx.view().min_clock >= self.switch_at {
            self.switch(ctx, 0.0);
        }
        let verdict = match self.switched {
            true => PullVerdict::Serve,
            false => PullVerdict::at_barrier(pull.clock, ctx.view()),
        };
        let w = self.workers.entry(pull.worker).or_default();
        w.clock = pull.clock;
        match verdict {
            PullVerdict::Serve => w.served_ns = ctx.now_ns(),
            PullVerdict::Defer(_) => w.gate = Some(pull.clock),
        }
        verdict
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if self.switched || !self.online {
            return PushVerdict::Admit;
        }
        let now = ctx.now_ns();
        let w = self.workers.entry(push.worker).or_default();
        w.clock = push.clock + 1;
        if w.served_ns > 0 {
            w.last_ns = now.saturating_sub(w.served_ns).max(1);
        }
        // The barrier this push completes opens for the pulls parked at it (the host serves
        // them now): their iterations start now.
        let min = self.workers.values().map(|w| w.clock).min().unwrap_or(0);
        for w in self.workers.values_mut().filter(|w| w.gate.is_some_and(|g| g <= min)) {
            w.gate = None;
            w.served_ns = now;
        }
        let slow = self.straggles(push.worker);
        let w = self.workers.entry(push.worker).or_default();
        w.slow = if slow { w.slow + 1 } else { 0 };
        if w.slow >= CONFIRM {
            self.switch(ctx, 1.0);
        }
        PushVerdict::Admit
    }
}

syncopate_policy_sdk::export_policy!(SyncSwitch);

#[cfg(test)]
mod tests {
    use super::*;

    /// BSP's barrier and aggregate rounds until every worker has reached `switch_at`, then
    /// ASP: pulls served at once however far ahead, pushes applied on arrival.
    #[test]
    fn runs_bsp_until_the_switch_iteration_then_asp() {
        let mut d = Driver::<SyncSwitch>::new(&[("switch_at", "2"), ("online", "false")]).unwrap();
        assert_eq!(d.update_mode(), Some(UpdateMode::Aggregate));
        d.join(0);
        d.join(1);
        for _ in 0..2 {
            d.push(0).unwrap();
            assert!(matches!(d.pull(0).unwrap(), PullVerdict::Defer(_)), "BSP: wait for worker 1");
            d.push(1).unwrap();
            assert_eq!(d.take_released().len(), 1);
            assert_eq!(d.pull(1).unwrap(), PullVerdict::Serve);
        }
        assert_eq!(d.update_mode(), Some(UpdateMode::OnArrival));
        for _ in 0..5 {
            d.push(0).unwrap();
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve, "ASP: no barrier");
        }
    }

    /// Online: a worker three times the median three iterations in a row switches to ASP
    /// before `switch_at`; one slow iteration does not. The fast workers' iterations are timed
    /// from the barrier that released their pulls, not from the pulls.
    #[test]
    fn a_straggler_switches_to_asp_early() {
        let mut d = Driver::<SyncSwitch>::new(&[("switch_at", "1000")]).unwrap();
        for w in 0..3 {
            d.join(w);
            assert_eq!(d.pull(w).unwrap(), PullVerdict::Serve);
        }
        let round = |d: &mut Driver<SyncSwitch>, slow_ms: u64| {
            d.advance_ns(10_000_000);
            for w in [1, 2] {
                d.push(w).unwrap();
                assert!(matches!(d.pull(w).unwrap(), PullVerdict::Defer(_)));
            }
            d.advance_ns((slow_ms - 10) * 1_000_000);
            d.push(0).unwrap();
            assert_eq!(d.take_released().len(), 2);
            assert_eq!(d.pull(0).unwrap(), PullVerdict::Serve);
        };
        round(&mut d, 30);
        round(&mut d, 10);
        assert_eq!(d.update_mode(), Some(UpdateMode::Aggregate), "one slow iteration is not a straggler");
        for _ in 0..CONFIRM {
            round(&mut d, 30);
        }
        assert_eq!(d.update_mode(), Some(UpdateMode::OnArrival));
    }

    #[test]
    fn refuses_a_straggler_factor_of_one_or_less() {
        for bad in ["1", "0.5", "nan"] {
            assert!(Driver::<SyncSwitch>::new(&[("straggler", bad)]).is_err(), "{bad}");
        }
    }
}
