//! What the CNN ([`crate::cnn`]) and the language model ([`crate::lm`]) share: their flat
//! parameters as candle tensors (one flat `f32` vector on the wire, named tensors inside), their
//! initialization from a seed, and the cross-entropy loss. candle computes the forward pass and,
//! by its autograd, the backward pass.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// How a parameter tensor starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (layer-norm gains).
    Ones,
    /// Uniform in `(-a, a)`.
    Uniform(f32),
    /// Normal with this standard deviation.
    Normal(f32),
}

/// One named parameter tensor of a model.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Param {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl Param {
    pub fn new(name: &'static str, shape: &[usize], init: Init) -> Self {
        Param { name, shape: shape.to_vec(), init }
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A model's parameter tensors, in the order they lie in the flat vector.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Layout {
    params: Vec<Param>,
}

impl Layout {
    pub fn new(params: Vec<Param>) -> Self {
        Layout { params }
    }

    /// Parameters in all.
    pub fn len(&self) -> usize {
        self.params.iter().map(Param::len).sum()
    }

    /// The initial flat vector, from `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = Vec::with_capacity(self.len());
        for p in &self.params {
            let n = p.len();
            match p.init {
                Init::Zeros => out.extend(std::iter::repeat_n(0.0, n)),
                Init::Ones => out.extend(std::iter::repeat_n(1.0, n)),
                Init::Uniform(a) => out.extend((0..n).map(|_| rng.random_range(-a..a))),
                Init::Normal(sd) => {
                    let normal = Normal::new(0.0, sd).expect("a finite standard deviation");
                    out.extend((0..n).map(|_| normal.sample(&mut rng)));
                }
            }
        }
        out
    }

    /// The tensors of `flat`, as variables that gradients flow to (`track`) or as constants.
    ///
    /// # Panics
    /// If `flat` is not [`len`](Self::len) long.
    pub fn tensors(&self, flat: &[f32], track: bool) -> Vec<Tensor> {
        assert_eq!(flat.len(), self.len(), "parameters of another model");
        let mut rest = flat;
        self.params
            .iter()
            .map(|p| {
                let (this, tail) = rest.split_at(p.len());
                rest = tail;
                let shape = p.shape.as_slice();
                let made = if track {
                    Var::from_slice(this, shape, &Device::Cpu).map(|v| v.as_tensor().clone())
                } else {
                    Tensor::from_slice(this, shape, &Device::Cpu)
                };
                made.unwrap_or_else(|e| panic!("parameter {}: {e}", p.name))
            })
            .collect()
    }

    /// Copies each tensor's gradient from `grads` into `out` (zeros where none flowed).
    pub fn gradient_into(&self, tensors: &[Tensor], grads: &GradStore, out: &mut [f32]) {
        assert_eq!(out.len(), self.len(), "gradient of another model");
        let mut rest = out;
        for (p, t) in self.params.iter().zip(tensors) {
            let (this, tail) = std::mem::take(&mut rest).split_at_mut(p.len());
            rest = tail;
            match grads.get(t) {
                Some(g) => {
                    let v = g.flatten_all().and_then(|g| g.to_vec1::<f32>()).expect("an f32 gradient");
                    this.copy_from_slice(&v);
                }
                None => this.fill(0.0),
            }
        }
    }
}

/// Mean cross-entropy of `logits` (`n x classes`) against `targets` (`n`), and how many rows'
/// largest logit is the target's.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<(Tensor, usize)> {
    let max = logits.detach().max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let log_norm = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let log_p = shifted.broadcast_sub(&log_norm)?;
    let picked = log_p.gather(&targets.unsqueeze(1)?, 1)?;
    let loss = picked.neg()?.mean_all()?;
    let right =
        logits.detach().argmax(D::Minus1)?.eq(targets)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()?
            as usize;
    Ok((loss, right))
}

#[cfg(test)]
pub(crate) mod testing {
    //! Finite differences against the analytic gradient, for the models' unit tests.

    /// Checks `grad` against central differences of `loss` at every `step`-th parameter:
    /// each must agree within `abs + rel * |numeric|`.
    pub fn check_gradient(
        params: &[f32],
        grad: &[f32],
        step: usize,
        loss: impl Fn(&[f32]) -> f32,
        abs: f32,
        rel: f32,
    ) {
        let eps = 1e-3;
        let mut checked = 0;
        let mut nonzero = 0;
        for i in (0..params.len()).step_by(step) {
            let (mut up, mut down) = (params.to_vec(), params.to_vec());
            up[i] += eps;
            down[i] -= eps;
            let numeric = (loss(&up) - loss(&down)) / (2.0 * eps);
            assert!(
                (numeric - grad[i]).abs() <= abs + rel * numeric.abs(),
                "parameter {i}: finite differences {numeric}, gradient {}",
                grad[i]
            );
            checked += 1;
            nonzero += usize::from(grad[i].abs() > 1e-5);
        }
        assert!(
            checked > 10 && nonzero * 4 > checked,
            "{nonzero} of {checked} gradients checked are not zero"
        );
    }
}
