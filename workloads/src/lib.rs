//! # Syncopate workloads
//!
//! What a worker computes between a pull and a push. A [`Workload`] knows nothing of the
//! parameter server: it gets the parameters the worker pulled and fills in a gradient. The
//! worker loop in the `syncopate` host drives it, so the same workload runs on a local cluster,
//! a real one, or the simulator.
//!
//! - [`counter::Counter`]: pushes known values, so a test can check that every update was applied
//!   exactly once (the final parameters equal minus the sum of everything pushed).
//! - `fashion-softmax`, `fashion-mlp` and `fashion-cnn` ([`Fashion`]): softmax regression, an
//!   MLP ([`model`]) and a LeNet-style convolutional network ([`cnn`]) on Fashion-MNIST
//!   ([`fashion`]), each worker training on its own partition of the 60,000 images.
//! - `fortunes-lm` ([`Fortunes`]): a byte-level transformer language model ([`lm`]) on the
//!   English text of Debian's `fortunes` package ([`text`]), each worker training on its own
//!   part of the training text.
//!
//! [`Evaluator`] scores a model on the held-out data: the 10,000 test images, or the held-out
//! fortunes (loss in nats per byte, whose exponential is the perplexity, and next-byte
//! accuracy). The CNN and the language model run forward and backward with candle
//! (`docs/workloads.md` says why, measured).

pub mod cnn;
mod conv;
pub mod counter;
pub mod fashion;
pub mod lm;
pub mod model;
mod net;
pub mod text;

use std::path::PathBuf;
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use fashion::DataError;
pub use model::{Classifier, Model, Score};

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

    /// Tokens in one sample (a language model's sequence length), for the tokens a push
    /// reports to policies; 0 (the default) for a workload without tokens.
    fn tokens_per_sample(&self) -> u64 {
        0
    }

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
    /// Where the workload's data is (`None`: where its Debian package installs it,
    /// [`default_data_dir`]).
    pub data_dir: Option<PathBuf>,
    /// Which part of the training set this worker trains on: `(index, parts)`.
    pub part: (u32, u32),
    /// Hidden units of the MLP.
    pub hidden: usize,
    /// Seed of the data order.
    pub seed: u64,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        WorkloadOptions { params: 1024, data_dir: None, part: (0, 1), hidden: 128, seed: 1 }
    }
}

/// The names of the built-in workloads.
pub const NAMES: &[&str] = &["counter", "fashion-softmax", "fashion-mlp", "fashion-cnn", "fortunes-lm"];

/// The language model's name.
const LM: &str = "fortunes-lm";

/// Whether workload `name` is the language model (scored in nats per byte, perplexity and
/// next-byte accuracy on held-out text, not on test images).
pub fn is_language_model(name: &str) -> bool {
    name == LM
}

/// Where workload `name`'s data is unless told: where its Debian package installs it.
pub fn default_data_dir(name: &str) -> &'static str {
    if name == LM {
        text::DEFAULT_DIR
    } else {
        fashion::DEFAULT_DIR
    }
}

impl WorkloadOptions {
    fn data_dir(&self, name: &str) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| default_data_dir(name).into())
    }
}

fn classifier_for(name: &str, opts: &WorkloadOptions) -> Option<Classifier> {
    match name {
        "fashion-softmax" => Some(Classifier::Dense(Model::softmax())),
        "fashion-mlp" => Some(Classifier::Dense(Model::mlp(opts.hidden))),
        "fashion-cnn" => Some(Classifier::Conv(cnn::Cnn::lenet())),
        _ => None,
    }
}

fn check_parts(parts: u32) -> Result<(), WorkloadError> {
    match parts {
        0 => Err(WorkloadError::Option("no data parts".into())),
        _ => Ok(()),
    }
}

/// The contiguous range of `n` items that part `index` of `parts` holds.
fn part_range(n: usize, index: u32, parts: u32) -> std::ops::Range<usize> {
    n * index as usize / parts as usize..n * (index as usize + 1) / parts as usize
}

/// A built-in workload by name.
pub fn by_name(name: &str, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, WorkloadError> {
    let (index, parts) = opts.part;
    if name != "counter" && (parts == 0 || index >= parts) {
        return Err(WorkloadError::Option(format!("data part {index}/{parts} does not exist")));
    }
    let mut all = for_some_parts(name, opts, parts, index..index + 1)?;
    Ok(all.pop().expect("one part asked for"))
}

/// How many parameters workload `name` has, without loading any data.
pub fn param_len(name: &str, opts: &WorkloadOptions) -> Option<usize> {
    match name {
        "counter" => Some(opts.params),
        LM => Some(lm::Lm::new(lm::LmShape::default()).len()),
        _ => classifier_for(name, opts).map(|m| m.len()),
    }
}

/// How many samples one pass over the whole training set holds (images, or the language
/// model's windows of context), or `None` for workloads without a training set.
pub fn epoch_len(name: &str, opts: &WorkloadOptions) -> Result<Option<usize>, WorkloadError> {
    match name {
        LM => Ok(Some(text::load(&opts.data_dir(name))?.train.len() / lm::LmShape::default().ctx)),
        _ if classifier_for(name, opts).is_some() => Ok(Some(fashion::TRAIN_IMAGES)),
        _ if NAMES.contains(&name) => Ok(None),
        _ => Err(WorkloadError::Unknown(name.to_string())),
    }
}

/// Workload `name` for each of `parts` data parts, sharing one copy of the data (the
/// simulator runs many workers in one process). `opts.part` is ignored.
pub fn for_parts(
    name: &str,
    opts: &WorkloadOptions,
    parts: u32,
) -> Result<Vec<Box<dyn Workload>>, WorkloadError> {
    for_some_parts(name, opts, parts, 0..parts)
}

/// Workload `name` for parts `which` of `parts`, sharing one copy of the data.
fn for_some_parts(
    name: &str,
    opts: &WorkloadOptions,
    parts: u32,
    which: std::ops::Range<u32>,
) -> Result<Vec<Box<dyn Workload>>, WorkloadError> {
    if name == "counter" {
        return Ok(which
            .map(|_| Box::new(counter::Counter::new(opts.params)) as Box<dyn Workload>)
            .collect());
    }
    if name == LM {
        check_parts(parts)?;
        let train = Arc::new(text::load(&opts.data_dir(name))?.train);
        let model = Arc::new(lm::Lm::new(lm::LmShape::default()));
        return Ok(which
            .map(|index| {
                let range = part_range(train.len(), index, parts);
                let mut w = Fortunes::new(model.clone(), train.clone(), range, opts.seed ^ u64::from(index));
                w.parts = parts;
                w.task_seed = opts.seed;
                Box::new(w) as Box<dyn Workload>
            })
            .collect());
    }
    let model = classifier_for(name, opts).ok_or_else(|| WorkloadError::Unknown(name.to_string()))?;
    check_parts(parts)?;
    let train = Arc::new(fashion::load(&opts.data_dir(name))?.train);
    let n = train.len();
    Ok(which
        .map(|index| {
            let mut w = Fashion::new(
                name,
                model.clone(),
                train.clone(),
                part_range(n, index, parts).collect(),
                opts.seed ^ u64::from(index),
            );
            w.parts = parts;
            w.task_seed = opts.seed;
            Box::new(w) as Box<dyn Workload>
        })
        .collect())
}

/// Scores models on the held-out data.
#[derive(Debug)]
pub enum Evaluator {
    /// A classifier on the 10,000 test images.
    Images {
        /// The model.
        model: Classifier,
        /// The test set.
        test: fashion::Dataset,
    },
    /// The language model on windows of the held-out text.
    Text {
        /// The model.
        model: lm::Lm,
        /// The held-out windows, each `ctx + 1` bytes.
        windows: Vec<Vec<u8>>,
    },
}

/// Windows of held-out text the language model is scored on: 8,192 bytes predicted.
const VALID_WINDOWS: usize = 128;

impl Evaluator {
    /// The evaluator for workload `name`, or `None` for workloads without held-out data.
    pub fn for_workload(name: &str, opts: &WorkloadOptions) -> Result<Option<Self>, WorkloadError> {
        if name == LM {
            let model = lm::Lm::new(lm::LmShape::default());
            let valid = text::load(&opts.data_dir(name))?.valid;
            let len = model.shape.ctx + 1;
            // Evenly spaced windows over the whole held-out text.
            let count = VALID_WINDOWS.min(valid.len() / len);
            let windows = (0..count)
                .map(|i| {
                    let at = i * (valid.len() - len) / count.max(1);
                    valid[at..at + len].to_vec()
                })
                .collect();
            return Ok(Some(Evaluator::Text { model, windows }));
        }
        match classifier_for(name, opts) {
            Some(model) => {
                Ok(Some(Evaluator::Images { model, test: fashion::load(&opts.data_dir(name))?.test }))
            }
            None if NAMES.contains(&name) => Ok(None),
            None => Err(WorkloadError::Unknown(name.to_string())),
        }
    }

    /// Parameters the model has.
    pub fn param_len(&self) -> usize {
        match self {
            Evaluator::Images { model, .. } => model.len(),
            Evaluator::Text { model, .. } => model.len(),
        }
    }

    /// Loss and accuracy of `params` on the held-out data: for images, mean cross-entropy and
    /// the share classified right; for text, nats per byte and next-byte accuracy.
    ///
    /// # Panics
    /// If `params` is not [`param_len`](Self::param_len) long.
    pub fn evaluate(&self, params: &[f32]) -> Score {
        assert_eq!(params.len(), self.param_len(), "parameters of another model");
        match self {
            Evaluator::Images { model, test } => model.evaluate(params, &test.images, &test.labels),
            Evaluator::Text { model, windows } => {
                let ws: Vec<&[u8]> = windows.iter().map(Vec::as_slice).collect();
                model.evaluate(params, &ws)
            }
        }
    }
}

/// A Fashion-MNIST model trained on one partition of the training set, in shuffled mini-batches
/// (reshuffled every pass).
#[derive(Debug)]
pub struct Fashion {
    name: String,
    model: Classifier,
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
    pub fn new(
        name: &str,
        model: Classifier,
        data: Arc<fashion::Dataset>,
        part: Vec<usize>,
        seed: u64,
    ) -> Self {
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
        let score = self.model.gradient(params, &self.batch_x, &self.batch_y, grad);
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

/// The language model trained on one part of the training text: each iteration draws its
/// batch's windows (context and the byte after it) uniformly at random from the part.
#[derive(Debug)]
pub struct Fortunes {
    model: Arc<lm::Lm>,
    text: Arc<Vec<u8>>,
    part: std::ops::Range<usize>,
    rng: ChaCha8Rng,
    starts: Vec<usize>,
    /// How many parts the training text is split into (for tasks of other parts).
    parts: u32,
    /// The seed shared by every worker, from which tasks' windows are drawn.
    task_seed: u64,
}

impl Fortunes {
    /// `model` over bytes `part` of `text`, its windows drawn from `seed`.
    pub fn new(model: Arc<lm::Lm>, text: Arc<Vec<u8>>, part: std::ops::Range<usize>, seed: u64) -> Self {
        Fortunes {
            model,
            text,
            part,
            rng: ChaCha8Rng::seed_from_u64(seed),
            starts: Vec::new(),
            parts: 1,
            task_seed: seed,
        }
    }

    /// A window start drawn from `range` of a text `text_len` long: the window of `len` bytes
    /// lies inside the range (and inside the text, should the range be shorter than a window).
    fn draw(rng: &mut ChaCha8Rng, range: &std::ops::Range<usize>, len: usize, text_len: usize) -> usize {
        let start = range.start + rng.random_range(0..(range.len().saturating_sub(len) + 1).max(1));
        start.min(text_len - len)
    }

    fn gradient_on_starts(&self, params: &[f32], grad: &mut [f32]) -> StepStats {
        let len = self.model.shape.ctx + 1;
        let windows: Vec<&[u8]> = self.starts.iter().map(|&s| &self.text[s..s + len]).collect();
        let score = self.model.gradient(params, &windows, grad);
        StepStats { samples: windows.len() as u32, loss: score.loss }
    }
}

impl Workload for Fortunes {
    fn name(&self) -> &str {
        LM
    }

    fn param_len(&self) -> usize {
        self.model.len()
    }

    /// A sample is a window of `ctx + 1` bytes: `ctx` next-byte predictions.
    fn tokens_per_sample(&self) -> u64 {
        self.model.shape.ctx as u64
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
        let len = self.model.shape.ctx + 1;
        self.starts.clear();
        for _ in 0..batch.max(1) {
            let s = Self::draw(&mut self.rng, &self.part, len, self.text.len());
            self.starts.push(s);
        }
        self.gradient_on_starts(params, grad)
    }

    /// Tasks draw their windows from a generator seeded by (shared seed, part, iteration): any
    /// worker draws the same ones.
    fn task_gradient(&mut self, t: &Tasks, params: &[f32], grad: &mut [f32]) -> Option<StepStats> {
        let Tasks { part, iteration, batch, ref tasks, total } = *t;
        if part >= self.parts.max(1) || tasks.is_empty() || tasks.end > total {
            return None;
        }
        let len = self.model.shape.ctx + 1;
        let range = part_range(self.text.len(), part, self.parts.max(1));
        let key = self.task_seed ^ (u64::from(part) << 48) ^ iteration.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = ChaCha8Rng::seed_from_u64(key);
        let samples = task_samples(batch, tasks, total);
        self.starts.clear();
        for i in 0..samples.end {
            let s = Self::draw(&mut rng, &range, len, self.text.len());
            if i >= samples.start {
                self.starts.push(s);
            }
        }
        if self.starts.is_empty() {
            return None;
        }
        Some(self.gradient_on_starts(params, grad))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// `steps` of plain SGD on worker 0's part of `name`'s real data: the batch losses.
    fn loss_curve(name: &str, seed: u64, steps: u64, batch: u32, lr: f32) -> Vec<f32> {
        let opts = WorkloadOptions { seed, part: (0, 4), ..WorkloadOptions::default() };
        let mut w = by_name(name, &opts).expect("the data (scripts/setup.sh installs it)");
        let mut params = w.init_params(seed);
        let mut grad = vec![0.0; params.len()];
        (0..steps)
            .map(|i| {
                let stats = w.gradient(0, i, batch, &params, &mut grad);
                params.iter_mut().zip(&grad).for_each(|(p, g)| *p -= lr * g);
                stats.loss
            })
            .collect()
    }

    #[test]
    fn the_real_fortunes_load_with_a_tenth_held_out() {
        let c = text::load(Path::new(text::DEFAULT_DIR))
            .expect("Debian's fortunes (scripts/setup.sh installs it)");
        assert!(c.files >= 30 && c.train.len() > 2_000_000, "{} files, {} bytes", c.files, c.train.len());
        let share = c.valid.len() as f64 / (c.train.len() + c.valid.len()) as f64;
        assert!((0.08..0.12).contains(&share), "held out {share}");
    }

    /// Each new workload learns on its real data, and a seed gives the same loss curve twice;
    /// another seed another one.
    #[test]
    fn a_seed_gives_the_same_falling_loss_curve_twice() {
        for (name, steps, lr) in [("fashion-cnn", 12, 0.1), ("fortunes-lm", 12, 0.2)] {
            let a = loss_curve(name, 7, steps, 8, lr);
            assert_eq!(a, loss_curve(name, 7, steps, 8, lr), "{name}");
            assert_ne!(a, loss_curve(name, 8, steps, 8, lr), "{name}");
            let (first, last) = (a[..3].iter().sum::<f32>(), a[a.len() - 3..].iter().sum::<f32>());
            assert!(last < first * 0.9, "{name} does not learn: {a:?}");
        }
    }

    /// The evaluator scores the language model on held-out text: a fresh model is near
    /// uniform over the 256 bytes, a perplexity near 256.
    #[test]
    fn a_fresh_language_model_scores_near_uniform_on_held_out_text() {
        let opts = WorkloadOptions::default();
        let e = Evaluator::for_workload("fortunes-lm", &opts).unwrap().unwrap();
        let s = e.evaluate(&by_name("fortunes-lm", &opts).unwrap().init_params(1));
        let perplexity = s.loss.exp();
        assert!((200.0..320.0).contains(&perplexity), "perplexity {perplexity}");
        assert_eq!(param_len("fortunes-lm", &opts), Some(e.param_len()));
        assert_eq!(param_len("fashion-cnn", &opts), Some(281_034));
    }
}
