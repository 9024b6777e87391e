//! A worker's tensors and the one place gradients are computed and combined for the worker
//! machine's [`ComputeJob`]s, whoever drives it: a whole iteration, one task of a split
//! iteration (summed, samples-weighted, into the iteration's gradient), tasks moved from
//! another worker (computed on the model this worker last pulled), or an iteration of local
//! steps (each gradient applied by the inner optimizer, the pseudo-gradient left to push).

use syncopate_policy_sdk::abi::WorkerId;
use syncopate_policy_sdk::optimizer::{Optimizer, OptimizerConfig};
use syncopate_workloads::{StepStats, Tasks, Workload};

use super::{ComputeJob, JobKind, PushJob};

/// The tensors a worker needs. A driver may take one out (`std::mem::take`) while a transfer
/// uses it and put it back when the transfer is done.
#[derive(Debug, Default)]
pub struct Buffers {
    /// The parameters the current iteration computes on: what the last pull wrote.
    pub params: Vec<f32>,
    /// The model as last pulled, kept for moved tasks (a pull may be writing `params` while
    /// this worker helps another); empty when the workload cannot split iterations.
    pub model: Vec<f32>,
    /// The current iteration's gradient.
    pub grad: Vec<f32>,
    /// One task's gradient, before it is added to `grad`.
    pub task: Vec<f32>,
    /// The gradient of tasks computed for another worker.
    pub help: Vec<f32>,
    /// Momentum and weight decay run here when the optimizer is placed on the workers
    /// ([`Buffers::place_optimizer`]); `None`: the servers run the whole optimizer.
    optimizer: Option<Optimizer>,
    /// The optimizer of local steps ([`Buffers::set_inner_optimizer`]), its state kept from one
    /// iteration of local steps to the next; made at the first.
    inner: Option<Optimizer>,
    inner_cfg: OptimizerConfig,
    /// The parameters an iteration of local steps started from.
    start: Vec<f32>,
}

impl Buffers {
    /// Buffers for a model of `len` parameters (0: no tensors, for decision-only simulation).
    pub fn new(len: usize, keep_model: bool) -> Self {
        Buffers {
            params: vec![0.0; len],
            model: if keep_model { vec![0.0; len] } else { Vec::new() },
            grad: vec![0.0; len],
            task: vec![0.0; len],
            help: vec![0.0; len],
            optimizer: None,
            inner: None,
            inner_cfg: OptimizerConfig::default(),
            start: Vec::new(),
        }
    }

    /// The optimizer local steps take (the servers' optimizer is the natural choice: with one
    /// local step and the outer optimizer averaging, an iteration is then plain SGD). Its state
    /// (momentum) lives on this worker across iterations, as DiLoCo's inner optimizer's does.
    pub fn set_inner_optimizer(&mut self, cfg: OptimizerConfig) {
        self.inner_cfg = cfg;
        self.inner = None;
    }

    /// Places the optimizer's momentum and weight decay on this worker: every push of a whole
    /// iteration of its own carries [`Optimizer::direction`] of its gradient, and the servers
    /// must run plain SGD ([`OptimizerConfig::plain`]). The parts of an iteration split by task moves
    /// (EPSP) go as plain gradients, from the owner and the helpers alike: momentum applies to an
    /// iteration's whole gradient, which no single worker holds then.
    pub fn place_optimizer(&mut self, cfg: OptimizerConfig) {
        self.optimizer = Some(Optimizer::new(cfg, self.grad.len()));
    }

    /// Buffers for `workload`'s model, and whether the workload can split iterations into tasks
    /// (asked by computing one task of part `part`). With no workload (decision-only
    /// simulation), no tensors, and iterations split as every built-in workload's do.
    pub fn for_workload(workload: Option<&mut dyn Workload>, part: u32) -> (Self, bool) {
        let Some(workload) = workload else { return (Buffers::default(), true) };
        let mut bufs = Buffers::new(workload.param_len(), false);
        let probe = Tasks { part, iteration: 0, batch: 2, tasks: 0..1, total: 2 };
        let can_split = workload.task_gradient(&probe, &bufs.params, &mut bufs.task).is_some();
        if can_split {
            bufs.model = vec![0.0; bufs.params.len()];
        }
        (bufs, can_split)
    }

    /// A pull has completed: keeps a copy of the parameters for moved tasks.
    pub fn pulled(&mut self) {
        if self.model.len() == self.params.len() {
            self.model.copy_from_slice(&self.params);
        }
    }

    /// Runs `job` on `workload` (`None`: no arithmetic, only the sample count, for
    /// decision-only simulation). `None` back: the workload cannot split iterations.
    pub fn compute(
        &mut self,
        worker: WorkerId,
        job: &ComputeJob,
        workload: Option<&mut dyn Workload>,
    ) -> Option<StepStats> {
        let Some(workload) = workload else {
            let samples = if job.whole {
                job.work.batch.saturating_mul(job.local_steps.max(1))
            } else {
                let Tasks { batch, ref tasks, total, .. } = job.work;
                syncopate_workloads::task_samples(batch, tasks, total).len() as u32
            };
            return Some(StepStats { samples, loss: 0.0 });
        };
        match job.kind {
            JobKind::Own if job.whole && job.local_steps > 0 => Some(self.local_steps(worker, job, workload)),
            JobKind::Own if job.whole => {
                let step = workload.gradient(
                    worker,
                    job.work.iteration,
                    job.work.batch,
                    &self.params,
                    &mut self.grad,
                );
                // Here, while `params` still holds the parameters the gradient was computed at
                // (a driver may lend them to the next pull before the push goes out).
                if let Some(o) = self.optimizer.as_mut() {
                    o.direction(&self.params, &mut self.grad);
                }
                Some(step)
            }
            JobKind::Own => {
                if job.first_of_iteration {
                    self.grad.fill(0.0);
                }
                let step = workload.task_gradient(&job.work, &self.params, &mut self.task)?;
                let w = step.samples as f32;
                for (g, x) in self.grad.iter_mut().zip(&self.task) {
                    *g += w * x;
                }
                Some(step)
            }
            JobKind::Help { .. } => workload.task_gradient(&job.work, &self.model, &mut self.help),
        }
    }

    /// `job.local_steps` gradients, each applied to `params` by the inner optimizer; `grad` is
    /// left holding the pseudo-gradient, the parameters pulled minus the ones reached.
    fn local_steps(&mut self, worker: WorkerId, job: &ComputeJob, workload: &mut dyn Workload) -> StepStats {
        let len = self.params.len();
        let inner = self.inner.get_or_insert_with(|| Optimizer::new(self.inner_cfg, len));
        self.start.clear();
        self.start.extend_from_slice(&self.params);
        let (mut samples, mut loss) = (0u32, 0.0f32);
        for _ in 0..job.local_steps {
            let step =
                workload.gradient(worker, job.work.iteration, job.work.batch, &self.params, &mut self.grad);
            inner.step(&mut self.params, &self.grad, 1.0);
            samples = samples.saturating_add(step.samples);
            loss += step.samples as f32 * step.loss;
        }
        for ((g, s), p) in self.grad.iter_mut().zip(&self.start).zip(&self.params) {
            *g = s - p;
        }
        StepStats { samples, loss: loss / samples.max(1) as f32 }
    }

    /// The gradient `push` sends. A split iteration's sum becomes its mean here: division, not
    /// a reciprocal, since `(n * g) / n` is exactly `g`, so a split iteration adds up to what
    /// the whole one would have. Call once per push.
    pub fn gradient(&mut self, push: &PushJob) -> &[f32] {
        match push.kind {
            JobKind::Help { .. } => &self.help,
            JobKind::Own => {
                if let Some(n) = push.mean_over {
                    let n = n as f32;
                    self.grad.iter_mut().for_each(|g| *g /= n);
                }
                &self.grad
            }
        }
    }
}
