//! # Syncopate workloads
//!
//! What a worker computes between a pull and a push. A [`Workload`] knows nothing of the
//! parameter server: it gets the parameters the worker pulled and fills in a gradient. The
//! worker loop in the `syncopate` host drives it, so the same workload runs on a local cluster,
//! a real one, or the simulator.
//!
//! - [`counter::Counter`]: pushes known values, so a test can check that every update was applied
//!   exactly once (the final parameters equal minus the sum of everything pushed).
//! - `fashion-softmax` and `fashion-mlp` ([`Fashion`]): softmax regression and an MLP on
//!   Fashion-MNIST ([`fashion`]), each worker training on its own partition of the 60,000 images;
//!   [`Evaluator`] scores a model on the 10,000 test images.

pub mod counter;
pub mod fashion;
pub mod model;

use std::path::PathBuf;
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use fashion::DataError;
pub use model::{Model, Score};

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

    /// Task support, for policies that move work between workers: computes into `grad` the
    /// mean gradient over the tasks `tasks` names ([`Tasks`]). The samples must be a function of
    /// those numbers only, so that any worker holding the data computes exactly the samples the
    /// part's owner would have. `None`: the workload cannot split its iterations (the default);
    /// its workers then keep their iterations whole.
    fn task_gradient(&mut self, _tasks: &Tasks, _params: &[f32], _grad: &mut [f32]) -> Option<StepStats> {
        None
    }
}

/// Some tasks of an iteration ([`Workload::task_gradient`]): tasks `tasks` of the `total` equal
/// tasks that the mini-batch of `batch` samples, drawn from data part `part` for `iteration`,
/// splits into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tasks {
    /// The data part the batch is drawn from (its owner's).
    pub part: u32,
    /// The iteration.
    pub iteration: u64,
    /// The whole mini-batch's samples.
    pub batch: u32,
    /// Which tasks.
    pub tasks: std::ops::Range<u32>,
    /// Of how many.
    pub total: u32,
}

/// The samples of tasks `tasks` (of `total`) of a batch of `batch`: their index range.
pub fn task_samples(batch: u32, tasks: &std::ops::Range<u32>, total: u32) -> std::ops::Range<usize> {
    let total = total.max(1) as usize;
    let at = |t: u32| batch as usize * (t as usize).min(total) / total;
    at(tasks.start)..at(tasks.end)
}

/// A workload that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// No such workload.
    #[error("unknown workload `{0}` (known: {known})", known = NAMES.join(", "))]
    Unknown(String),
    /// Its data cannot be loaded.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A bad option.
    #[error("{0}")]
    Option(String),
}

/// Options shared by the built-in workloads.
#[derive(Clone, Debug)]
pub struct WorkloadOptions {
    /// Parameters of the synthetic workloads.
    pub params: usize,
    /// Where the Fashion-MNIST files are.
    pub data_dir: PathBuf,
    /// Which part of the training set this worker trains on: `(index, parts)`.
    pub part: (u32, u32),
    /// Hidden units of the MLP.
    pub hidden: usize,
    /// Seed of the data order.
    pub seed: u64,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        WorkloadOptions {
            params: 1024,
            data_dir: PathBuf::from(fashion::DEFAULT_DIR),
            part: (0, 1),
            hidden: 128,
            seed: 1,
        }
    }
}

/// The names of the built-in workloads.
pub const NAMES: &[&str] = &["counter", "fashion-softmax", "fashion-mlp"];

fn model_for(name: &str, opts: &WorkloadOptions) -> Option<Model> {
    match name {
        "fashion-softmax" => Some(Model::softmax()),
        "fashion-mlp" => Some(Model::mlp(opts.hidden)),
        _ => None,
    }
}

/// A built-in workload by name.
pub fn by_name(name: &str, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, WorkloadError> {
    if name == "counter" {
        return Ok(Box::new(counter::Counter::new(opts.params)));
    }
    let model = model_for(name, opts).ok_or_else(|| WorkloadError::Unknown(name.to_string()))?;
    let (index, parts) = opts.part;
    if parts == 0 || index >= parts {
        return Err(WorkloadError::Option(format!("data part {index}/{parts} does not exist")));
    }
    let data = fashion::load(&opts.data_dir)?;
    let n = data.train.len();
    let (lo, hi) = (n * index as usize / parts as usize, n * (index as usize + 1) / parts as usize);
    let mut w =
        Fashion::new(name, model, Arc::new(data.train), (lo..hi).collect(), opts.seed ^ u64::from(index));
    w.parts = parts;
    w.task_seed = opts.seed;
    Ok(Box::new(w))
}

/// How many parameters workload `name` has, without loading any data.
pub fn param_len(name: &str, opts: &WorkloadOptions) -> Option<usize> {
    match name {
        "counter" => Some(opts.params),
        _ => model_for(name, opts).map(|m| m.len()),
    }
}

/// Workload `name` for each of `parts` data parts, sharing one copy of the data (the
/// simulator runs many workers in one process). `opts.part` is ignored.
pub fn for_parts(
    name: &str,
    opts: &WorkloadOptions,
    parts: u32,
) -> Result<Vec<Box<dyn Workload>>, WorkloadError> {
    if name == "counter" {
        return Ok((0..parts)
            .map(|_| Box::new(counter::Counter::new(opts.params)) as Box<dyn Workload>)
            .collect());
    }
    let model = model_for(name, opts).ok_or_else(|| WorkloadError::Unknown(name.to_string()))?;
    if parts == 0 {
        return Err(WorkloadError::Option("no data parts".into()));
    }
    let train = Arc::new(fashion::load(&opts.data_dir)?.train);
    let n = train.len();
    Ok((0..parts)
        .map(|index| {
            let (lo, hi) = (n * index as usize / parts as usize, n * (index as usize + 1) / parts as usize);
            let mut w = Fashion::new(
                name,
                model.clone(),
                train.clone(),
                (lo..hi).collect(),
                opts.seed ^ u64::from(index),
            );
            w.parts = parts;
            w.task_seed = opts.seed;
            Box::new(w) as Box<dyn Workload>
        })
        .collect())
}

/// Scores models on the test set.
#[derive(Debug)]
pub struct Evaluator {
    model: Model,
    test: fashion::Dataset,
}

impl Evaluator {
    /// The evaluator for workload `name`, or `None` for workloads without a test set.
    pub fn for_workload(name: &str, opts: &WorkloadOptions) -> Result<Option<Self>, WorkloadError> {
        match model_for(name, opts) {
            Some(model) => Ok(Some(Evaluator { model, test: fashion::load(&opts.data_dir)?.test })),
            None if NAMES.contains(&name) => Ok(None),
            None => Err(WorkloadError::Unknown(name.to_string())),
        }
    }

    /// Parameters the model has.
    pub fn param_len(&self) -> usize {
        self.model.len()
    }

    /// Loss and accuracy of `params` on the 10,000 test images.
    ///
    /// # Panics
    /// If `params` is not [`param_len`](Self::param_len) long.
    pub fn evaluate(&self, params: &[f32]) -> Score {
        assert_eq!(params.len(), self.model.len(), "parameters of another model");
        self.model.evaluate(params, &self.test.images, &self.test.labels)
    }
}

/// A Fashion-MNIST model trained on one partition of the training set, in shuffled mini-batches
/// (reshuffled every pass).
#[derive(Debug)]
pub struct Fashion {
    name: String,
    model: Model,
    data: Arc<fashion::Dataset>,
    part: Vec<usize>,
    cursor: usize,
    rng: ChaCha8Rng,
    batch_x: Vec<f32>,
    batch_y: Vec<u8>,
    idx: Vec<usize>,
    /// How many parts the training set is split into (for tasks of other parts).
    parts: u32,
    /// The seed shared by every worker, from which tasks' samples are drawn.
    task_seed: u64,
}

impl Fashion {
    /// `model` over the images `part` of `data`.
    pub fn new(name: &str, model: Model, data: Arc<fashion::Dataset>, part: Vec<usize>, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut part = part;
        part.shuffle(&mut rng);
        Fashion {
            name: name.into(),
            model,
            data,
            part,
            cursor: 0,
            rng,
            batch_x: Vec::new(),
            batch_y: Vec::new(),
            idx: Vec::new(),
            parts: 1,
            task_seed: seed,
        }
    }

    fn gradient_on_idx(&mut self, params: &[f32], grad: &mut [f32]) -> StepStats {
        let batch = self.idx.len();
        model::gather(&self.data.images, fashion::PIXELS, &self.idx, &mut self.batch_x);
        self.batch_y.clear();
        self.batch_y.extend(self.idx.iter().map(|&i| self.data.labels[i]));
        let x = ndarray::ArrayView2::from_shape((batch, fashion::PIXELS), &self.batch_x).expect("shape");
        let score = self.model.gradient(params, x, &self.batch_y, grad);
        StepStats { samples: batch as u32, loss: score.loss }
    }

    /// Images in this worker's partition.
    pub fn partition_len(&self) -> usize {
        self.part.len()
    }
}

impl Workload for Fashion {
    fn name(&self) -> &str {
        &self.name
    }

    fn param_len(&self) -> usize {
        self.model.len()
    }

    fn init_params(&self, seed: u64) -> Vec<f32> {
        self.model.init(seed)
    }

    fn gradient(
        &mut self,
        _worker: u32,
        _iteration: u64,
        batch: u32,
        params: &[f32],
        grad: &mut [f32],
    ) -> StepStats {
        let batch = (batch as usize).clamp(1, self.part.len().max(1));
        self.idx.clear();
        while self.idx.len() < batch {
            if self.cursor == self.part.len() {
                self.part.shuffle(&mut self.rng);
                self.cursor = 0;
            }
            self.idx.push(self.part[self.cursor]);
            self.cursor += 1;
        }
        self.gradient_on_idx(params, grad)
    }

    /// Tasks draw their batch with replacement from the part's images, from a generator seeded
    /// by (shared seed, part, iteration): any worker draws the same samples.
    fn task_gradient(&mut self, t: &Tasks, params: &[f32], grad: &mut [f32]) -> Option<StepStats> {
        let Tasks { part, iteration, batch, ref tasks, total } = *t;
        let n = self.data.len();
        let parts = self.parts.max(1) as usize;
        if part as usize >= parts || tasks.is_empty() || tasks.end > total {
            return None;
        }
        let (lo, hi) = (n * part as usize / parts, n * (part as usize + 1) / parts);
        let key = self.task_seed ^ (u64::from(part) << 48) ^ iteration.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = ChaCha8Rng::seed_from_u64(key);
        let range = task_samples(batch, tasks, total);
        self.idx.clear();
        for i in 0..range.end {
            let pick = lo + rng.random_range(0..(hi - lo).max(1));
            if i >= range.start {
                self.idx.push(pick);
            }
        }
        if self.idx.is_empty() {
            return None;
        }
        Some(self.gradient_on_idx(params, grad))
    }
}
