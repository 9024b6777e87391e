//! Local SGD on a shard: how many local steps each worker takes per iteration (what its pulls
//! tell it), and the outer optimizer the shard applies to the pseudo-gradients those workers
//! push.
//!
//! A worker that takes `H` local steps computes `H` gradients, applies each to its own copy of
//! the model with its inner optimizer, and pushes the parameters it pulled minus the ones it
//! reached. The shard sums these pseudo-gradients as it sums gradients (per round in aggregate
//! mode, per group, or one by one on arrival), but steps them with [`LocalSgd::step`], an
//! optimizer of its own: plain averaging by default (local SGD), Nesterov momentum for DiLoCo,
//! and, for asynchronous local SGD, Delayed Nesterov: the momentum folded in and applied only
//! every `period`-th outer step ([`Decision::SetOuterDelay`]).
//! Pushes say which they are, so a round in which a swap changed the setting still applies each
//! push with the optimizer it was meant for.
//!
//! Policies set them ([`Decision::SetLocalSteps`], [`Decision::SetOuterOptimizer`],
//! [`Decision::SetOuterDelay`]); a hot swap sets them back to the cluster's defaults (no delay),
//! so the incoming policy starts from what the cluster was configured with whatever the
//! outgoing one did, while the outer momentum itself is kept (a swap back to DiLoCo resumes it)
//! and a delay's partial sum is dropped. Everything here is in snapshots; backups get it by
//! replaying the same decisions.
//!
//! [`Decision::SetLocalSteps`]: syncopate_policy_sdk::abi::Decision::SetLocalSteps
//! [`Decision::SetOuterOptimizer`]: syncopate_policy_sdk::abi::Decision::SetOuterOptimizer
//! [`Decision::SetOuterDelay`]: syncopate_policy_sdk::abi::Decision::SetOuterDelay

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::WorkerId;

use super::{Optimizer, OptimizerConfig};

/// A cluster's local-SGD defaults: what every shard starts with and returns to at each swap.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalSgdConfig {
    /// Local steps per iteration (0: workers push gradients).
    pub local_steps: u32,
    /// The optimizer of pseudo-gradients.
    pub outer: OptimizerConfig,
}

impl Default for LocalSgdConfig {
    fn default() -> Self {
        LocalSgdConfig { local_steps: 0, outer: OptimizerConfig::AVERAGING }
    }
}

/// A shard's local-SGD settings and outer optimizer (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalSgd {
    /// The cluster's defaults, restored at every swap.
    default_steps: u32,
    default_outer: OptimizerConfig,
    /// Local steps of every worker without a setting of its own.
    steps: u32,
    /// Per-worker settings (live workers only when set, by the decision rules).
    per_worker: BTreeMap<WorkerId, u32>,
    /// The outer optimizer, its momentum over this shard's parameters.
    outer: Optimizer,
    /// Outer steps per momentum step (1: every step, the default).
    delay: u32,
    /// Outer steps taken in the current delay period, and the sum of their scaled
    /// pseudo-gradients (empty until a delay is set).
    delayed: u32,
    period_sum: Vec<f32>,
}

impl LocalSgd {
    /// The settings a shard of `len` parameters starts with.
    pub fn new(cfg: LocalSgdConfig, len: usize) -> Self {
        LocalSgd {
            default_steps: cfg.local_steps,
            default_outer: cfg.outer,
            steps: cfg.local_steps,
            per_worker: BTreeMap::new(),
            outer: Optimizer::new(cfg.outer, len),
            delay: 1,
            delayed: 0,
            period_sum: Vec::new(),
        }
    }

    /// The local steps `worker`'s next iteration takes (0: it pushes a gradient).
    pub fn steps_of(&self, worker: WorkerId) -> u32 {
        if self.per_worker.is_empty() {
            return self.steps;
        }
        self.per_worker.get(&worker).copied().unwrap_or(self.steps)
    }

    /// A policy's [`Decision::SetLocalSteps`](syncopate_policy_sdk::abi::Decision::SetLocalSteps).
    pub fn set_steps(&mut self, worker: Option<WorkerId>, steps: u32) {
        match worker {
            Some(w) => {
                self.per_worker.insert(w, steps);
            }
            None => {
                self.steps = steps;
                self.per_worker.clear();
            }
        }
    }

    /// A worker left: its own setting goes (a worker joining again under its id starts from the
    /// shard's).
    pub fn forget(&mut self, worker: WorkerId) {
        self.per_worker.remove(&worker);
    }

    /// A policy's [`Decision::SetOuterOptimizer`](syncopate_policy_sdk::abi::Decision::SetOuterOptimizer).
    pub fn set_outer(&mut self, lr: f32, momentum: f32, nesterov: bool, len: usize) {
        let cfg = OptimizerConfig { lr, momentum, nesterov, weight_decay: 0.0 };
        self.outer.reconfigure(cfg, len);
    }

    /// A policy's [`Decision::SetOuterDelay`](syncopate_policy_sdk::abi::Decision::SetOuterDelay):
    /// a new period starts.
    pub fn set_delay(&mut self, period: u32, len: usize) {
        self.delay = period.max(1);
        self.delayed = 0;
        if self.delay > 1 && self.period_sum.len() != len {
            self.period_sum = vec![0.0; len];
        }
        self.period_sum.fill(0.0);
    }

    /// A hot swap: the cluster's defaults again, the outer momentum kept, no delay.
    pub fn reset(&mut self, len: usize) {
        self.steps = self.default_steps;
        self.per_worker.clear();
        self.outer.reconfigure(self.default_outer, len);
        self.set_delay(1, len);
    }

    /// One outer step on `scale * grad`: the outer optimizer's, or with a delay, Delayed
    /// Nesterov's (plain until the period's last step, which steps the momentum on the
    /// period's sum).
    pub fn step(&mut self, params: &mut [f32], grad: &[f32], scale: f32) {
        if self.delay <= 1 {
            self.outer.step(params, grad, scale);
            return;
        }
        for (s, g) in self.period_sum.iter_mut().zip(grad) {
            *s += scale * g;
        }
        self.delayed += 1;
        if self.delayed < self.delay {
            self.outer.step_delayed(params, grad, scale, None);
            return;
        }
        self.outer.step_delayed(params, grad, scale, Some(&self.period_sum));
        self.period_sum.fill(0.0);
        self.delayed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::shard::{Observer, PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink};

    /// The local steps each served pull told its worker, and the parameters it served.
    #[derive(Default)]
    struct Told(Vec<(WorkerId, u32, Vec<f32>)>);

    impl ShardSink for Told {
        fn pull_served(&mut self, r: PullReply<'_>) {
            self.0.push((r.worker, r.local_steps, r.values.to_vec()));
        }
    }

    impl Observer for Told {}

    fn push(worker: WorkerId, iteration: u64, grad: f32, local_steps: u32) -> PushRequest {
        PushRequest {
            worker,
            iteration,
            samples: 1,
            grad: vec![grad; 2],
            based_on: None,
            tasks: None,
            local_steps,
            signals: Default::default(),
        }
    }

    /// DiLoCo on a shard: pulls tell workers `h`; a round's pseudo-gradients are averaged and
    /// stepped by the outer Nesterov optimizer, a gradient in the same round by the shard's own;
    /// a swap to BSP tells workers 0 again and averages, and a swap back resumes the momentum,
    /// which a snapshot keeps.
    #[test]
    fn pseudo_gradients_take_the_outer_optimizer_and_gradients_the_shards_own() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let module = |n: &str| rt.compile(n, crate::builtin::wasm(n).unwrap()).unwrap();
        let (diloco, bsp) = (module("diloco"), module("bsp"));
        let conf = [("h".to_string(), "4".to_string())];
        let optimizer = OptimizerConfig { lr: 0.5, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let cfg = ShardConfig { optimizer, ..ShardConfig::default() };
        let mut told = Told::default();
        let mut shard = Shard::new(cfg.clone(), vec![1.0; 2], &diloco, &conf, &mut told).unwrap();
        for w in 0..2 {
            shard.join(w, 0, &mut told).unwrap();
            shard.pull(PullRequest { worker: w, iteration: 0 }, 0, &mut told).unwrap();
        }
        assert_eq!(told.0.iter().map(|t| (t.0, t.1)).collect::<Vec<_>>(), [(0, 4), (1, 4)]);
        // Round 0: pseudo-gradients 1 and 3, mean 2: v = 2, Nesterov step 2 + 0.9 * 2 = 3.8.
        shard.push(push(0, 0, 1.0, 4), 1, &mut told).unwrap();
        shard.push(push(1, 0, 3.0, 4), 1, &mut told).unwrap();
        let after = 1.0 - 0.7 * 3.8f32;
        assert_eq!(shard.values(), [after; 2]);
        // Round 1 mixes a pseudo-gradient (mean share 0.5 * 2 = 1) and a gradient (0.5 * 4 = 2,
        // stepped at lr 0.5): v = 0.9 * 2 + 1 = 2.8, Nesterov 1 + 0.9 * 2.8.
        shard.push(push(0, 1, 2.0, 4), 2, &mut told).unwrap();
        shard.push(push(1, 1, 4.0, 0), 2, &mut told).unwrap();
        let after = after - 0.5 * 2.0 - 0.7 * (1.0 + 0.9 * 2.8f32);
        assert_eq!(shard.values(), [after; 2]);
        assert_eq!(shard.stats().local_pushes, 3);
        // BSP: gradients again, and pseudo-gradients still in flight are averaged.
        shard.swap_policy(&bsp, &[], &[], 3, &mut told).unwrap();
        told.0.clear();
        shard.pull(PullRequest { worker: 0, iteration: 2 }, 3, &mut told).unwrap();
        assert_eq!(told.0[0].1, 0, "a swap sets workers back to gradients");
        shard.push(push(0, 2, 2.0, 4), 4, &mut told).unwrap();
        shard.push(push(1, 2, 2.0, 4), 4, &mut told).unwrap();
        let after = after - 2.0;
        assert_eq!(shard.values(), [after; 2]);
        // The momentum (2.8) survived: a snapshot keeps it, and DiLoCo again resumes it.
        let snap = shard.snapshot(5).unwrap();
        let mut restored = Shard::restore(cfg, snap, &bsp, &mut told).unwrap();
        for s in [&mut shard, &mut restored] {
            s.swap_policy(&diloco, &conf, &[], 6, &mut told).unwrap();
            s.push(push(0, 3, 0.0, 4), 7, &mut told).unwrap();
            s.push(push(1, 3, 0.0, 4), 7, &mut told).unwrap();
        }
        // v = 0.9 * 2.8, Nesterov 0 + 0.9 * v.
        let after = after - 0.7 * (0.9 * (0.9 * 2.8f32));
        assert_eq!(shard.values(), [after; 2]);
        assert_eq!(restored.values(), shard.values());
    }

    #[test]
    fn per_worker_settings_override_the_shards_until_it_sets_all_again_or_a_swap_resets() {
        let mut l = LocalSgd::new(LocalSgdConfig::default(), 2);
        assert_eq!(l.steps_of(3), 0);
        l.set_steps(None, 8);
        l.set_steps(Some(3), 2);
        assert_eq!((l.steps_of(3), l.steps_of(4)), (2, 8));
        l.forget(3);
        assert_eq!(l.steps_of(3), 8);
        l.set_steps(Some(1), 4);
        l.set_steps(None, 16);
        assert_eq!(l.steps_of(1), 16);
        l.set_outer(0.7, 0.9, true, 2);
        l.step(&mut [0.0, 0.0], &[1.0, 1.0], 1.0);
        l.set_delay(3, 2);
        l.reset(2);
        assert_eq!((l.steps_of(1), l.outer.config(), l.delay), (0, OptimizerConfig::AVERAGING, 1));
        // The momentum survives: DiLoCo again resumes it.
        l.set_outer(1.0, 0.5, false, 2);
        let mut p = [0.0f32, 0.0];
        l.step(&mut p, &[0.0, 0.0], 1.0);
        assert_eq!(p, [-0.5, -0.5]);
    }

    /// Delayed Nesterov over a period of three: two plain steps, then the momentum of the three
    /// scaled pseudo-gradients' sum; the next period starts from an empty sum.
    #[test]
    fn a_delay_steps_the_momentum_once_per_period_on_its_sum() {
        let mut l = LocalSgd::new(LocalSgdConfig::default(), 1);
        l.set_outer(0.5, 0.5, true, 1);
        l.set_delay(3, 1);
        let mut p = [0.0f32];
        l.step(&mut p, &[2.0], 0.5);
        l.step(&mut p, &[4.0], 0.5);
        assert_eq!(p, [-0.5 * 1.0 - 0.5 * 2.0]);
        l.step(&mut p, &[6.0], 0.5);
        // v = 1 + 2 + 3 = 6; p -= 0.5 * (3 + 0.5 * 6)
        assert_eq!(p, [-1.5 - 0.5 * 6.0]);
        l.step(&mut p, &[2.0], 0.5);
        assert_eq!(p, [-4.5 - 0.5]);
    }
}
