//! The optimizer: SGD with momentum (optionally Nesterov) and weight decay, applied element-wise
//! to a shard's parameters; or, with the optimizer placed on the workers, momentum and decay on a
//! worker ([`Optimizer::direction`]) and plain SGD on the servers, as FluentPS's authors ran it.
//!
//! It lives in the SDK, as the clock and decision rules do, so that the host's shards and the
//! test [`Driver`](crate::Driver) step parameters with the same code: a policy's native test sees
//! what its decisions do to a model with momentum and weight decay.

use alloc::vec;
use alloc::vec::Vec;

use serde::{Deserialize, Serialize};

/// Optimizer hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum coefficient (0 for plain SGD).
    pub momentum: f32,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
    /// Use Nesterov momentum.
    pub nesterov: bool,
}

impl OptimizerConfig {
    /// The same learning rate without momentum or weight decay: the servers' half of an
    /// optimizer placed on the workers (see [`Optimizer::direction`]).
    pub fn plain(self) -> OptimizerConfig {
        OptimizerConfig { momentum: 0.0, weight_decay: 0.0, nesterov: false, ..self }
    }
}

impl OptimizerConfig {
    /// Learning rate 1, no momentum, no decay: applied to the mean of the workers'
    /// pseudo-gradients, it replaces the model by the mean of their models (local SGD's
    /// averaging). The default outer optimizer.
    pub const AVERAGING: OptimizerConfig =
        OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig { lr: 0.05, momentum: 0.9, weight_decay: 0.0, nesterov: false }
    }
}

/// SGD with momentum over one shard's parameters. Serializable, so that a shard's checkpoint
/// keeps its velocity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Optimizer {
    cfg: OptimizerConfig,
    velocity: Vec<f32>,
}

impl Optimizer {
    /// An optimizer for `len` parameters.
    pub fn new(cfg: OptimizerConfig, len: usize) -> Self {
        let velocity = if cfg.momentum != 0.0 { vec![0.0; len] } else { Vec::new() };
        Optimizer { cfg, velocity }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> OptimizerConfig {
        self.cfg
    }

    /// Takes new hyper-parameters for `len` parameters and keeps the velocity: a momentum
    /// switched off and on again resumes where it was.
    pub fn reconfigure(&mut self, cfg: OptimizerConfig, len: usize) {
        if cfg.momentum != 0.0 && self.velocity.len() != len {
            self.velocity = vec![0.0; len];
        }
        self.cfg = cfg;
    }

    /// Turns `grad`, computed at `params`, into the step direction momentum and weight decay give
    /// (`g + wd * p`, then the velocity, or its Nesterov look-ahead), keeping the velocity. The
    /// learning rate is not applied. This is the worker's half of the optimizer placed on the
    /// workers: the servers then run plain SGD (no momentum, no decay) on what the workers push,
    /// so that one worker's run is bit for bit the run with the whole optimizer on the server.
    pub fn direction(&mut self, params: &[f32], grad: &mut [f32]) {
        debug_assert_eq!(params.len(), grad.len());
        let OptimizerConfig { momentum, weight_decay, nesterov, .. } = self.cfg;
        if momentum == 0.0 {
            for (g, p) in grad.iter_mut().zip(params) {
                *g += weight_decay * *p;
            }
            return;
        }
        for ((g, p), v) in grad.iter_mut().zip(params).zip(self.velocity.iter_mut()) {
            let d = *g + weight_decay * *p;
            *v = momentum * *v + d;
            *g = if nesterov { d + momentum * *v } else { *v };
        }
    }

    /// One step with gradient `scale * grad`.
    pub fn step(&mut self, params: &mut [f32], grad: &[f32], scale: f32) {
        debug_assert_eq!(params.len(), grad.len());
        let OptimizerConfig { lr, momentum, weight_decay, nesterov } = self.cfg;
        if momentum == 0.0 {
            for (p, g) in params.iter_mut().zip(grad) {
                let g = scale * g + weight_decay * *p;
                *p -= lr * g;
            }
            return;
        }
        for ((p, g), v) in params.iter_mut().zip(grad).zip(self.velocity.iter_mut()) {
            let g = scale * g + weight_decay * *p;
            *v = momentum * *v + g;
            let d = if nesterov { g + momentum * *v } else { *v };
            *p -= lr * d;
        }
    }

    /// One step of Delayed Nesterov (Liu et al. 2024, Algorithm 3) with gradient
    /// `scale * grad`: without `period_sum`, a plain step that leaves the velocity alone
    /// (`p -= lr * scale * g`); with it, the period's last step, which folds the period's sum
    /// of scaled gradients into the velocity and applies the look-ahead
    /// (`v = momentum * v + sum`, `p -= lr * (scale * g + momentum * v)`). Weight decay is
    /// added to the gradient as in [`step`](Self::step). With a period of one step
    /// (`period_sum` = `scale * grad` every time) this is `step` with Nesterov momentum.
    pub fn step_delayed(&mut self, params: &mut [f32], grad: &[f32], scale: f32, period_sum: Option<&[f32]>) {
        debug_assert_eq!(params.len(), grad.len());
        let OptimizerConfig { lr, momentum, weight_decay, .. } = self.cfg;
        let Some(sum) = period_sum.filter(|_| momentum != 0.0) else {
            for (p, g) in params.iter_mut().zip(grad) {
                *p -= lr * (scale * g + weight_decay * *p);
            }
            return;
        };
        debug_assert_eq!(sum.len(), grad.len());
        for (((p, g), s), v) in params.iter_mut().zip(grad).zip(sum).zip(self.velocity.iter_mut()) {
            *v = momentum * *v + s;
            *p -= lr * (scale * g + weight_decay * *p + momentum * *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use alloc::vec;

    #[test]
    fn plain_sgd_and_momentum() {
        let mut p = vec![1.0f32, 2.0];
        let mut o =
            Optimizer::new(OptimizerConfig { lr: 0.5, momentum: 0.0, weight_decay: 0.0, nesterov: false }, 2);
        o.step(&mut p, &[1.0, -2.0], 1.0);
        assert_eq!(p, vec![0.5, 3.0]);
        let mut p = vec![0.0f32];
        let mut o =
            Optimizer::new(OptimizerConfig { lr: 1.0, momentum: 0.5, weight_decay: 0.0, nesterov: false }, 1);
        o.step(&mut p, &[1.0], 1.0);
        o.step(&mut p, &[1.0], 1.0);
        assert_eq!(p, vec![-2.5]); // v = 1, then 1.5
    }

    /// Delayed Nesterov with a period of one step is Nesterov; with a longer period, the
    /// parameters move by the plain steps between momentum steps and by the momentum of the
    /// period's sum at its end, as Algorithm 3 of Liu et al. (2024) writes it.
    #[test]
    fn delayed_nesterov_is_nesterov_at_period_one_and_delays_the_momentum_otherwise() {
        let cfg = OptimizerConfig { lr: 0.7, momentum: 0.9, weight_decay: 0.0, nesterov: true };
        let (mut a, mut b) = (Optimizer::new(cfg, 2), Optimizer::new(cfg, 2));
        let (mut p, mut q) = (vec![1.0f32, -1.0], vec![1.0f32, -1.0]);
        for step in 0..20 {
            let g = [step as f32 / 10.0 - 1.0, 0.5];
            a.step(&mut p, &g, 0.25);
            let scaled = [0.25 * g[0], 0.25 * g[1]];
            b.step_delayed(&mut q, &g, 0.25, Some(&scaled));
            assert_eq!(p, q, "step {step}");
        }
        // A period of two: g1 plainly, then g2 with the momentum of g1 + g2.
        let mut d = Optimizer::new(cfg, 1);
        let mut p = vec![0.0f32];
        d.step_delayed(&mut p, &[1.0], 0.5, None);
        assert_eq!(p, vec![-0.35]);
        d.step_delayed(&mut p, &[3.0], 0.5, Some(&[2.0]));
        // v = 2; p -= 0.7 * (1.5 + 0.9 * 2)
        assert!((p[0] - (-0.35 - 0.7 * 3.3)).abs() < 1e-6, "{p:?}");
    }

    /// Momentum and decay on the worker, plain SGD on the server: for one worker, the same
    /// parameters bit for bit as the whole optimizer on the server, Nesterov or not.
    #[test]
    fn the_optimizer_split_between_worker_and_server_is_the_whole_optimizer() {
        for nesterov in [false, true] {
            let cfg = OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov };
            let (mut whole, mut worker) = (Optimizer::new(cfg, 3), Optimizer::new(cfg, 3));
            let mut server = Optimizer::new(cfg.plain(), 3);
            let (mut a, mut b) = (vec![0.5f32, -1.0, 2.0], vec![0.5f32, -1.0, 2.0]);
            for step in 0..50 {
                let grad: Vec<f32> = (0..3).map(|i| ((step * 7 + i * 3) % 11) as f32 / 5.0 - 1.0).collect();
                whole.step(&mut a, &grad, 1.0);
                let mut pushed = grad.clone();
                worker.direction(&b, &mut pushed);
                server.step(&mut b, &pushed, 1.0);
                assert_eq!(a, b, "step {step}, nesterov {nesterov}");
            }
        }
    }
}
