//! `firstk`: the first `k` gradients to arrive, from any workers, make one step; an example of
//! a policy that holds pushes and admits them from `after_push`, as `docs/writing-a-policy.md`
//! shows. It is not one of the seven paradigms.
//!
//! Rule:
//! - **Push admission.** Every push is held, unacknowledged (its worker waits), until `k`
//!   pushes are held; then all `k` are admitted, each at weight `1 / k`, in `after_push` (so
//!   the push that completes the group is held by `on_push` and admitted by `after_push` of the
//!   same event). With plain SGD the `k` steps of weight `1 / k` are one step of their mean;
//!   with momentum they are not quite (each step adds to the velocity).
//! - **Departures.** When a worker leaves, a group that can no longer fill (fewer live workers
//!   than pushes it lacks, counting one push per live worker not yet in it) is admitted as it
//!   stands, each push at `1 / k`, so nobody waits for a push that cannot come.
//! - Pulls are always served.

use syncopate_policy_sdk::prelude::*;

/// The first `k` gradients from any workers (an example).
#[derive(Debug)]
pub struct FirstK {
    k: u32,
    /// Pushes held for the group being filled: (worker, push).
    group: Vec<(WorkerId, RequestId)>,
    live: Vec<WorkerId>,
}

impl FirstK {
    /// Admits the group as it stands, each push at `1 / k`.
    fn admit_group(&mut self, ctx: &mut Ctx<'_>) {
        let weight = 1.0 / self.k as f32;
        for (_, push) in self.group.drain(..) {
            ctx.admit_push_weighted(push, weight);
        }
        ctx.metric("firstk.groups", 1.0);
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
        &[ParamSpec::new("k", ParamKind::Uint, "2", "gradients per step")],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let k: u32 = init.config.get("k")?;
        if k == 0 {
            return Err("k must be at least 1".into());
        }
        Ok(FirstK { k, group: Vec::new(), live: Vec::new() })
    }

    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _clock: u64) {
        if !self.live.contains(&worker) {
            self.live.push(worker);
        }
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.live.retain(|w| *w != worker);
        // The host drops what the policy held for a worker that left.
        self.group.retain(|g| g.0 != worker);
        if !self.group.is_empty() && !self.can_fill() {
            self.admit_group(ctx);
        }
    }

    fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        self.group.push((push.worker, push.id));
        PushVerdict::Hold
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {
        if self.group.len() >= self.k as usize || !self.can_fill() {
            self.admit_group(ctx);
        }
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
        assert_eq!(d.steps(), 3, "one step of weight 1/3 per push");
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
        assert_eq!(d.steps(), 2, "half a group waits");
        d.push_gradient(2, 0, &[6.0]).unwrap();
        assert_eq!(d.params(), &[-7.0]);
        assert_eq!((d.clock(0), d.clock(1), d.clock(2)), (Some(2), Some(1), Some(1)));
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
