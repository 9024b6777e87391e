//! `firstk`: the first `k` gradients to arrive, from any workers, make one step; an example of
//! a policy that holds pushes and admits them from `after_push`, as `docs/writing-a-policy.md`
//! shows. It is not one of the seven paradigms.
//!
//! Rule:
//! - **Push admission.** Every push is held, unacknowledged (its worker waits), until `k`
//!   pushes are held; then, in `after_push` (so the push that completes the group is held by
//!   `on_push` and admitted by `after_push` of the same event), all `k` are admitted into one
//!   group (`ctx.admit_to_group`) and the group is applied as one optimizer step of their mean
//!   (`ctx.complete_group`), with momentum as with plain SGD.
//! - **Departures.** When a worker leaves, a group that can no longer fill (fewer live workers
//!   than pushes it lacks, counting one push per live worker not yet in it) is applied as it
//!   stands, so nobody waits for a push that cannot come.
//! - **`wait=false`.** A push is not held: it joins the open group at once (`PushVerdict::Group`)
//!   and its worker goes on; the k-th push to arrive applies the group. The open group is the
//!   shard's, so it survives a swap, a checkpoint and a failover; the policy keeps only its
//!   count, which it hands over (`state`).
//! - Pulls are always served.

use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::{state, Handoff};

/// What `wait=false` hands over across swaps and restarts: the open group and its size.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Saved {
    groups: u64,
    open: u32,
}

/// The first `k` gradients from any workers (an example).
#[derive(Debug)]
pub struct FirstK {
    k: u32,
    /// Pushes held for the group being filled: (worker, push).
    group: Vec<(WorkerId, RequestId)>,
    live: Vec<WorkerId>,
    /// Groups applied so far (the next group's name).
    groups: u64,
    /// Whether pushes wait (held) for their group's step.
    wait: bool,
    /// Pushes in the open group (`wait=false`).
    open: u32,
}

impl FirstK {
    /// Applies the group as it stands: one optimizer step of its pushes' mean.
    fn admit_group(&mut self, ctx: &mut Ctx<'_>) {
        for (_, push) in self.group.drain(..) {
            ctx.admit_to_group(push, self.groups);
        }
        ctx.complete_group(self.groups);
        self.groups += 1;
        ctx.metric("firstk.groups", self.groups as f64);
    }

    /// Whether the group can still fill: each live worker not in it may add one push.
    fn can_fill(&self) -> bool {
        let waiting = self.live.iter().filter(|w| !self.group.iter().any(|g| g.0 == **w)).count();
        self.group.len() + waiting >= self.k as usize
    }
}

impl Policy for FirstK {
    const INFO: PolicyInfo = PolicyInfo::new(
        "firstk",
        "0.1.0",
        "The first k gradients from any workers make one step (an example).",
        &[
            ParamSpec::new("k", ParamKind::Uint, "2", "gradients per step"),
            ParamSpec::new("wait", ParamKind::Bool, "true", "a push waits (held) for its group's step"),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let k: u32 = init.config.get("k")?;
        if k == 0 {
            return Err("k must be at least 1".into());
        }
        Ok(FirstK {
            k,
            group: Vec::new(),
            live: Vec::new(),
            groups: 0,
            wait: init.config.get("wait")?,
            open: 0,
        })
    }

    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _clock: u64) {
        if !self.live.contains(&worker) {
            self.live.push(worker);
        }
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.live.retain(|w| *w != worker);
        // The worker's push it still holds is decided here, as the host lets a policy: this one
        // leaves it to the host, which applies it (its gradient is valid) once this returns.
        self.group.retain(|g| g.0 != worker);
        if !self.group.is_empty() && !self.can_fill() {
            self.admit_group(ctx);
        }
    }

    fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if !self.wait {
            self.open += 1;
            return PushVerdict::Group(self.groups);
        }
        self.group.push((push.worker, push.id));
        PushVerdict::Hold
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {
        if !self.wait {
            if self.open >= self.k {
                ctx.complete_group(self.groups);
                (self.groups, self.open) = (self.groups + 1, 0);
            }
            return;
        }
        if self.group.len() >= self.k as usize || !self.can_fill() {
            self.admit_group(ctx);
        }
    }

    fn export_state(&self) -> Vec<u8> {
        state::save(&Saved { groups: self.groups, open: self.open })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut me = Self::new(init)?;
        let saved = state::load::<Saved>(handoff, Self::INFO.name)?.unwrap_or_default();
        (me.groups, me.open) = (saved.groups, saved.open);
        me.live = handoff.workers.iter().map(|w| w.worker).collect();
        Ok(me)
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
        PullVerdict::Serve
    }
}

syncopate_policy_sdk::export_policy!(FirstK);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::optimizer::OptimizerConfig;

    /// The guide's pattern (hold in `on_push`, admit in `after_push`) once left the push that
    /// completed a group held forever in the test driver's bookkeeping, and panicked with an
    /// optimizer; on a cluster, the shard never acknowledged it.
    #[test]
    fn the_kth_push_completes_the_group_and_every_push_is_applied_once() {
        let sgd = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let mut d = Driver::<FirstK>::new(&[("k", "3")]).unwrap().with_optimizer(sgd, vec![0.0; 2]);
        for w in 0..3 {
            d.join(w);
        }
        assert_eq!(d.push_gradient(0, 0, &[3.0, 0.0]).unwrap(), PushVerdict::Hold);
        assert_eq!(d.push_gradient(1, 0, &[6.0, 3.0]).unwrap(), PushVerdict::Hold);
        assert_eq!(d.steps(), 0);
        // The third push is held by on_push, then admitted with the others by after_push.
        assert_eq!(d.push_gradient(2, 0, &[0.0, 3.0]).unwrap(), PushVerdict::Hold);
        assert_eq!(d.steps(), 1, "one step for the group");
        assert_eq!(d.params(), &[-3.0, -2.0], "minus the group's mean");
        assert_eq!((d.clock(0), d.clock(1), d.clock(2)), (Some(1), Some(1), Some(1)), "each once");
    }

    #[test]
    fn groups_take_the_first_pushes_from_any_workers() {
        let sgd = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let mut d = Driver::<FirstK>::new(&[("k", "2")]).unwrap().with_optimizer(sgd, vec![0.0]);
        for w in 0..3 {
            d.join(w);
        }
        d.push_gradient(0, 0, &[2.0]).unwrap();
        d.push_gradient(1, 0, &[4.0]).unwrap();
        assert_eq!(d.params(), &[-3.0]);
        // Worker 0 again, before worker 2's first: the group is whoever comes first.
        d.push_gradient(0, 1, &[2.0]).unwrap();
        assert_eq!(d.steps(), 1, "half a group waits");
        d.push_gradient(2, 0, &[6.0]).unwrap();
        assert_eq!(d.params(), &[-7.0]);
        assert_eq!((d.clock(0), d.clock(1), d.clock(2)), (Some(2), Some(1), Some(1)));
    }

    /// With momentum 0.9, each group is one optimizer step on its mean: the velocity grows once
    /// per group, not once per push (k steps of weight 1/k would give another answer).
    #[test]
    fn with_momentum_each_group_is_one_step_of_its_mean() {
        let cfg = OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0, nesterov: false };
        let mut d = Driver::<FirstK>::new(&[("k", "3")]).unwrap().with_optimizer(cfg, vec![0.0]);
        for w in 0..3 {
            d.join(w);
        }
        // Two groups: means 2 and 4.
        for (w, g) in [(0, 1.0), (1, 2.0), (2, 3.0), (2, 5.0), (0, 3.0), (1, 4.0)] {
            let iteration = d.clock(w).unwrap();
            d.push_gradient(w, iteration, &[g]).unwrap();
        }
        assert_eq!(d.steps(), 2);
        // By hand: v1 = 2, p1 = -0.2; v2 = 0.9 * 2 + 4 = 5.8, p2 = -0.2 - 0.58 = -0.78.
        assert!((d.params()[0] - -0.78).abs() < 1e-6, "{:?}", d.params());
    }

    #[test]
    fn a_group_that_can_no_longer_fill_is_admitted_when_a_worker_leaves() {
        let mut d = Driver::<FirstK>::new(&[("k", "3")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        d.push(0).unwrap();
        d.push(1).unwrap();
        d.leave(2, LeaveReason::Finished);
        assert_eq!((d.clock(0), d.clock(1)), (Some(1), Some(1)), "admitted: nobody else can push");
    }
}
