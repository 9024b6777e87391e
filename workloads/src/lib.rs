//! # Syncopate workloads
//!
//! What a worker computes between a pull and a push. A [`Workload`] knows nothing of the
//! parameter server: it gets the parameters the worker pulled and fills in a gradient. The
//! worker loop in the `syncopate` host drives it, so the same workload runs on a local cluster,
//! a real one, or the simulator.
//!
//! - [`counter::Counter`]: pushes known values, so a test can check that every update was applied
//!   exactly once (the final parameters equal minus the sum of everything pushed).

pub mod counter;

/// What one gradient computation reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Samples the gradient was computed on.
    pub samples: u32,
    /// Mean training loss over those samples (0 when the workload has none).
    pub loss: f32,
}

/// A model trained through the parameter server: flat `f32` parameters in, a gradient out.
pub trait Workload: Send {
    /// A short name, as given on the command line.
    fn name(&self) -> &str;

    /// How many parameters the model has.
    fn param_len(&self) -> usize;

    /// The initial parameters. Every worker computes the same ones from the same `seed`; the
    /// first to reach a shard creates it, later ones are ignored.
    fn init_params(&self, seed: u64) -> Vec<f32>;

    /// Computes the gradient of iteration `iteration` for worker `worker` on `params` into
    /// `grad` (as long as `params`). `batch` is the mini-batch size the policy asked for.
    fn gradient(
        &mut self,
        worker: u32,
        iteration: u64,
        batch: u32,
        params: &[f32],
        grad: &mut [f32],
    ) -> StepStats;
}

/// A workload name that is not known.
#[derive(Debug, thiserror::Error)]
#[error("unknown workload `{0}` (known: {known})", known = NAMES.join(", "))]
pub struct UnknownWorkload(pub String);

/// Options shared by the built-in workloads.
#[derive(Clone, Debug)]
pub struct WorkloadOptions {
    /// Parameters of the synthetic workloads.
    pub params: usize,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        WorkloadOptions { params: 1024 }
    }
}

/// The names of the built-in workloads.
pub const NAMES: &[&str] = &["counter"];

/// A built-in workload by name.
pub fn by_name(name: &str, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, UnknownWorkload> {
    match name {
        "counter" => Ok(Box::new(counter::Counter::new(opts.params))),
        other => Err(UnknownWorkload(other.to_string())),
    }
}
