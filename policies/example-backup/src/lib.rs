//! `backup`: synchronous SGD with backup workers (Chen, Pan, Monga, Bengio and Jozefowicz,
//! "Revisiting Distributed Synchronous SGD", 2016), an example of a policy a user writes against
//! `syncopate-policy-sdk` alone, with the vocabulary for rules that finish a round without
//! everyone: completing an aggregate early and dropping a gradient. It is not one of the seven
//! paradigms; `docs/writing-a-policy.md` walks through it.
//!
//! Rule (our reading of the paper's Algorithm 1, per shard):
//! - Updates aggregate by round (a round is a worker's clock, so round `r` holds each worker's
//!   `r`-th gradient). Round `r` is **complete** once `N - b` of its gradients are in, `N` the
//!   live workers and `b` the backups: the policy completes its aggregate at once, one optimizer
//!   step on the mean of those gradients.
//! - A gradient for a round that is already complete is **dropped**: it never reaches the
//!   parameters (the paper's workers that lose the race), but its worker's clock moves on.
//! - A pull before computing round `r` waits until round `r - 1` is complete (every worker
//!   computes on the parameters of the last complete round, as in the paper); it is released the
//!   moment that round completes.
//! - `late = zero-weight` admits late gradients with weight 0 instead of dropping them, which the
//!   host treats exactly as a drop (it is kept to show that the two are one thing).
//! - `catch_up = true` (ours, not the paper's): a worker whose dropped gradient was two or more
//!   rounds late is told to skip to the open round ([`Control::SkipTo`]), so a straggler stops
//!   computing gradients that can only be dropped. Shard 0's instance sends it (one instruction
//!   per worker, not one per shard).
//!
//! With `b = 0` this is BSP. At a hot swap the host levels the workers' clocks, so rounds start
//! again at the common clock; the count of dropped gradients (a metric) is handed over with the
//! SDK's serde helper ([`state`]), so swapping `backup:b=1` for `backup:b=2` keeps counting.

use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::rounds::RoundGate;
use syncopate_policy_sdk::state;

/// The state carried across swaps and restarts.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Saved {
    /// Rounds below this are complete.
    complete: u64,
    /// Gradients dropped so far.
    dropped: u64,
}

/// Synchronous SGD with `b` backup workers.
#[derive(Debug)]
pub struct Backup {
    b: u32,
    zero_weight: bool,
    catch_up: bool,
    lead: bool,
    live: u32,
    /// Rounds below this are complete.
    complete: u64,
    /// Gradients in per open round: (round, count).
    arrived: Vec<(u64, u32)>,
    /// Pulls waiting for a round to complete.
    waiting: RoundGate,
    dropped: u64,
}

impl Backup {
    fn needed(&self) -> u32 {
        self.live.saturating_sub(self.b).max(1)
    }

    /// Completes every open round that has enough gradients, in order, and releases the pulls
    /// that waited for them.
    fn complete_ready(&mut self, ctx: &mut Ctx<'_>) {
        loop {
            let round = self.complete;
            let have = self.arrived.iter().find(|a| a.0 == round).map_or(0, |a| a.1);
            if have < self.needed() {
                return;
            }
            ctx.complete_aggregate(round);
            ctx.metric("backup.round_gradients", f64::from(have));
            self.arrived.retain(|a| a.0 != round);
            self.complete = round + 1;
            self.waiting.completed(ctx, self.complete);
        }
    }
}

impl Policy for Backup {
    const INFO: PolicyInfo = PolicyInfo::new(
        "backup",
        env!("CARGO_PKG_VERSION"),
        "Example: synchronous SGD with b backup workers; late gradients are dropped.",
        &[
            ParamSpec::new(
                "b",
                ParamKind::Uint,
                "1",
                "backup workers: a round completes with N - b gradients",
            ),
            ParamSpec::new(
                "late",
                ParamKind::Text,
                "drop",
                "late gradients: drop, or zero-weight (the same)",
            ),
            ParamSpec::new(
                "catch_up",
                ParamKind::Bool,
                "false",
                "tell a worker two or more rounds late to skip to the open round",
            ),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let late: String = init.config.get("late")?;
        if late != "drop" && late != "zero-weight" {
            return Err(format!("late = {late}: drop or zero-weight"));
        }
        Ok(Backup {
            b: init.config.get("b")?,
            zero_weight: late == "zero-weight",
            catch_up: init.config.get("catch_up")?,
            lead: init.shard == 0,
            live: 0,
            complete: 0,
            arrived: Vec::new(),
            waiting: RoundGate::default(),
            dropped: 0,
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&Saved { complete: self.complete, dropped: self.dropped })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut me = Self::new(init)?;
        me.live = handoff.workers.len() as u32;
        // The host has levelled the clocks (and applied every open aggregate): rounds begin at
        // the common clock, whoever ran before. A restart from a checkpoint keeps its rounds.
        let level = handoff.workers.iter().map(|w| w.clock).min().unwrap_or(0);
        let saved = state::load::<Saved>(handoff, Self::INFO.name)?.unwrap_or_default();
        me.complete = saved.complete.max(level);
        me.dropped = saved.dropped;
        Ok(me)
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, _worker: WorkerId, _clock: u64) {
        self.live += 1;
        self.complete_ready(ctx);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.live = self.live.saturating_sub(1);
        // The host drops a leaving worker's parked pulls: there is nothing left to release.
        self.waiting.forget(worker);
        self.complete_ready(ctx);
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.waiting.pull(pull, self.complete)
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if push.clock < self.complete {
            self.dropped += 1;
            ctx.metric("backup.dropped", self.dropped as f64);
            // After this push the worker's clock is push.clock + 1; the open round is `complete`.
            let behind = self.complete - push.clock - 1;
            if self.catch_up && self.lead && behind >= 1 {
                ctx.control(push.worker, Control::SkipTo { iteration: push.iteration + 1 + behind });
            }
            return if self.zero_weight { PushVerdict::AdmitWeighted(0.0) } else { PushVerdict::Drop };
        }
        match self.arrived.iter_mut().find(|a| a.0 == push.clock) {
            Some(a) => a.1 += 1,
            None => self.arrived.push((push.clock, 1)),
        }
        PushVerdict::Admit
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {
        // After the verdict, so the aggregate the verdict added to is the one completed.
        self.complete_ready(ctx);
    }
}

syncopate_policy_sdk::export_policy!(Backup);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn a_round_completes_with_n_minus_b_gradients_and_the_late_one_is_dropped() {
        let mut d = Driver::<Backup>::new(&[("b", "1")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::Explicit), "round 0 is open");
        assert_eq!(d.push(1).unwrap(), PushVerdict::Admit);
        assert!(d.log.contains(&Recorded::AggregateCompleted(0)), "2 of 3 complete round 0");
        assert_eq!(d.take_released().len(), 1, "the waiting pull is released");
        assert_eq!(d.push(2).unwrap(), PushVerdict::Drop, "worker 2 lost the race");
        assert_eq!(d.clock(2), Some(1), "its clock moved on all the same");
        assert_eq!(d.pull(2).unwrap(), PullVerdict::Serve);
    }

    /// With momentum 0.9 and weight decay on, as on a cluster: a round is one optimizer step on
    /// the mean of the gradients present, and the late gradient moves nothing.
    #[test]
    fn with_momentum_and_weight_decay_a_round_is_one_step_and_a_drop_moves_nothing() {
        use syncopate_policy_sdk::optimizer::{Optimizer, OptimizerConfig};
        let cfg = OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov: false };
        let start = vec![1.0f32, -2.0];
        let mut d = Driver::<Backup>::new(&[("b", "1")]).unwrap().with_optimizer(cfg, start.clone());
        for w in 0..3 {
            d.join(w);
        }
        d.push_gradient(0, 0, &[1.0, 1.0]).unwrap();
        d.push_gradient(1, 0, &[3.0, -1.0]).unwrap();
        // One step on the mean of the two present, by the same optimizer the shards run.
        let mut want = start;
        Optimizer::new(cfg, 2).step(&mut want, &[2.0, 0.0], 1.0);
        assert_eq!((d.params(), d.steps()), (&want[..], 1));
        assert_eq!(d.push_gradient(2, 0, &[100.0, 100.0]).unwrap(), PushVerdict::Drop);
        assert_eq!((d.params(), d.steps()), (&want[..], 1), "the dropped gradient moved nothing");
    }

    #[test]
    fn with_catch_up_a_worker_two_rounds_late_is_told_to_skip_to_the_open_round() {
        let mut d = Driver::<Backup>::new(&[("b", "1"), ("catch_up", "true")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        for _ in 0..3 {
            d.push(0).unwrap();
            d.push(1).unwrap();
        }
        // Rounds 0..3 are complete without worker 2; its round-0 gradient is dropped, and it is
        // told to go on from round 3 rather than compute rounds 1 and 2 only to lose them too.
        assert_eq!(d.push(2).unwrap(), PushVerdict::Drop);
        assert!(d.log.contains(&Recorded::Control(2, Control::SkipTo { iteration: 3 })), "{:?}", d.log);
        d.skip_to(2, 3).unwrap();
        assert_eq!(d.clock(2), Some(3));
        assert_eq!(d.pull(2).unwrap(), PullVerdict::Serve, "round 2 is complete: it computes round 3");
        assert_eq!(d.push(2).unwrap(), PushVerdict::Admit, "and its gradient counts again");
    }

    #[test]
    fn a_leaving_workers_waiting_pull_is_forgotten_not_released() {
        let mut d = Driver::<Backup>::new(&[("b", "1")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        d.push(0).unwrap();
        d.push(1).unwrap();
        d.push(1).unwrap();
        assert_eq!(d.pull(1).unwrap(), PullVerdict::Defer(Release::Explicit), "round 1 is open");
        // Worker 1 leaves with its pull parked (the host drops the pull); round 1 then completes
        // with worker 0's gradient alone, and the policy must not release the dropped pull.
        d.leave(1, LeaveReason::Finished);
        d.push(0).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(1)));
        assert!(d.parked().is_empty());
    }

    #[test]
    fn zero_weight_spells_the_drop_as_an_admission() {
        let mut d = Driver::<Backup>::new(&[("b", "1"), ("late", "zero-weight")]).unwrap();
        d.join(0);
        d.join(1);
        d.push(0).unwrap();
        assert_eq!(d.push(1).unwrap(), PushVerdict::AdmitWeighted(0.0));
    }

    #[test]
    fn a_swap_levels_the_rounds_and_keeps_the_drop_count() {
        let mut d = Driver::<Backup>::new(&[("b", "1")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        d.push(0).unwrap();
        d.push(1).unwrap();
        assert_eq!(d.push(2).unwrap(), PushVerdict::Drop);
        d.push(0).unwrap();
        assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::Explicit), "round 1 is open");
        // Worker 0 is a round ahead; after the swap all three are level at clock 2, and the
        // waiting pull is handed to the new instance, which serves it.
        let mut d = d.swap::<Backup>(&[("b", "0")]).unwrap();
        assert_eq!(d.clock(2), Some(2));
        assert_eq!(d.take_released().len(), 0);
        assert!(d.log.contains(&Recorded::Served(5)), "the pull re-delivered and served: {:?}", d.log);
        for w in 0..2 {
            assert_eq!(d.push(w).unwrap(), PushVerdict::Admit);
        }
        assert!(!d.log.contains(&Recorded::AggregateCompleted(2)), "b = 0: all three are needed");
        d.push(2).unwrap();
        assert!(d.log.contains(&Recorded::AggregateCompleted(2)));
        d.restart().unwrap();
        assert!(d
            .log
            .iter()
            .any(|r| matches!(r, Recorded::Metric(m, v) if m == "backup.dropped" && *v == 1.0)));
    }
}
