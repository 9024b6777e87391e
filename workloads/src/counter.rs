//! The `counter` workload: every worker pushes a known value, so the final parameters count the
//! updates. Worker `w` pushes `w + 1` in every coordinate at every iteration; with plain SGD at
//! learning rate 1 and pushes summed (not averaged), each parameter ends at exactly
//! `-(sum over workers of (w + 1) * pushes applied)`. Integers this small are exact in `f32`.

use crate::{StepStats, Workload};

/// Pushes `worker + 1` everywhere; the parameters start at zero.
#[derive(Clone, Debug)]
pub struct Counter {
    len: usize,
}

impl Counter {
    /// A model of `len` parameters.
    pub fn new(len: usize) -> Self {
        Counter { len }
    }

    /// The value worker `worker` pushes.
    pub fn value(worker: u32) -> f32 {
        (worker + 1) as f32
    }
}

impl Workload for Counter {
    fn name(&self) -> &str {
        "counter"
    }

    fn param_len(&self) -> usize {
        self.len
    }

    fn init_params(&self, _seed: u64) -> Vec<f32> {
        vec![0.0; self.len]
    }

    fn gradient(
        &mut self,
        worker: u32,
        _iteration: u64,
        batch: u32,
        params: &[f32],
        grad: &mut [f32],
    ) -> StepStats {
        debug_assert_eq!(params.len(), grad.len());
        grad.fill(Self::value(worker));
        StepStats { samples: batch, loss: 0.0 }
    }

    /// The tasks of part `part` push part `part`'s value, whoever computes them: a moved task
    /// counts exactly as its owner's would.
    fn task_gradient(&mut self, t: &crate::Tasks, _params: &[f32], grad: &mut [f32]) -> Option<StepStats> {
        grad.fill(Self::value(t.part));
        Some(StepStats { samples: crate::task_samples(t.batch, &t.tasks, t.total).len() as u32, loss: 0.0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_its_worker_value() {
        let mut c = Counter::new(3);
        let mut g = vec![0.0; 3];
        c.gradient(2, 0, 8, &[0.0; 3], &mut g);
        assert_eq!(g, vec![3.0; 3]);
        assert_eq!(c.init_params(1), vec![0.0; 3]);
    }
}
