//! The image classifiers ([`Classifier`]), and the dense ones: softmax regression and a
//! one-hidden-layer MLP with ReLU, forward and backward with ndarray (matrixmultiply
//! underneath). Parameters are one flat `f32` vector: each weight
//! matrix row-major (`inputs x outputs`), then its bias.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cnn::Cnn;

/// An image classifier over flat parameters: dense ([`Model`], with ndarray) or convolutional
/// ([`Cnn`], with candle).
#[derive(Clone, Debug, PartialEq)]
pub enum Classifier {
    /// Softmax regression or an MLP.
    Dense(Model),
    /// The convolutional network.
    Conv(Cnn),
}

impl Classifier {
    /// Parameters in all.
    pub fn len(&self) -> usize {
        match self {
            Classifier::Dense(m) => m.len(),
            Classifier::Conv(m) => m.len(),
        }
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The initial parameters, from `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        match self {
            Classifier::Dense(m) => m.init(seed),
            Classifier::Conv(m) => m.init(seed),
        }
    }

    /// The mean cross-entropy gradient over images `x` (`labels.len() * 784` pixels) into
    /// `grad`; returns the batch's score before the update.
    pub fn gradient(&self, params: &[f32], x: &[f32], labels: &[u8], grad: &mut [f32]) -> Score {
        match self {
            Classifier::Dense(m) => {
                let x = ArrayView2::from_shape((labels.len(), m.layers[0]), x).expect("one image per label");
                m.gradient(params, x, labels, grad)
            }
            Classifier::Conv(m) => m.gradient(params, x, labels, grad),
        }
    }

    /// Loss and accuracy of `params` on a whole set.
    pub fn evaluate(&self, params: &[f32], images: &[f32], labels: &[u8]) -> Score {
        match self {
            Classifier::Dense(m) => m.evaluate(params, images, labels),
            Classifier::Conv(m) => m.evaluate(params, images, labels),
        }
    }
}

/// A dense classifier over flat parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    /// Layer sizes, input first: `[784, 10]` is softmax regression, `[784, 128, 10]` an MLP.
    pub layers: Vec<usize>,
}

/// Loss and accuracy over a batch or a set.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Score {
    /// Mean cross-entropy.
    pub loss: f32,
    /// Fraction classified right.
    pub accuracy: f32,
}

impl Model {
    /// Softmax regression, 784 -> 10.
    pub fn softmax() -> Self {
        Model { layers: vec![crate::fashion::PIXELS, crate::fashion::CLASSES] }
    }

    /// An MLP 784 -> `hidden` -> 10 with ReLU.
    pub fn mlp(hidden: usize) -> Self {
        Model { layers: vec![crate::fashion::PIXELS, hidden, crate::fashion::CLASSES] }
    }

    /// Parameters in all.
    pub fn len(&self) -> usize {
        self.layers.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// He-initialized weights and zero biases, from `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut p = Vec::with_capacity(self.len());
        for w in self.layers.windows(2) {
            let scale = (2.0 / w[0] as f32).sqrt();
            // Uniform with the He variance: U(-a, a) has variance a^2 / 3.
            let a = scale * 3f32.sqrt();
            p.extend((0..w[0] * w[1]).map(|_| rng.random_range(-a..a)));
            p.extend(std::iter::repeat_n(0.0, w[1]));
        }
        p
    }

    fn split<'a>(&self, params: &'a [f32]) -> Vec<(ArrayView2<'a, f32>, ArrayView1<'a, f32>)> {
        let mut rest = params;
        self.layers
            .windows(2)
            .map(|w| {
                let (wm, tail) = rest.split_at(w[0] * w[1]);
                let (b, tail) = tail.split_at(w[1]);
                rest = tail;
                (ArrayView2::from_shape((w[0], w[1]), wm).expect("shape"), ArrayView1::from(b))
            })
            .collect()
    }

    fn split_mut<'a>(&self, grad: &'a mut [f32]) -> Vec<(ArrayViewMut2<'a, f32>, ArrayViewMut1<'a, f32>)> {
        let mut rest = grad;
        self.layers
            .windows(2)
            .map(|w| {
                let (wm, tail) = std::mem::take(&mut rest).split_at_mut(w[0] * w[1]);
                let (b, tail) = tail.split_at_mut(w[1]);
                rest = tail;
                (ArrayViewMut2::from_shape((w[0], w[1]), wm).expect("shape"), ArrayViewMut1::from(b))
            })
            .collect()
    }

    /// Forward pass; returns every layer's activation (input first, softmax probabilities last).
    fn forward(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<Array2<f32>> {
        let layers = self.split(params);
        let mut acts = vec![x.to_owned()];
        for (i, (w, b)) in layers.iter().enumerate() {
            let mut z = acts[i].dot(w);
            z += b;
            if i + 1 < layers.len() {
                z.mapv_inplace(|v| v.max(0.0));
            } else {
                for mut row in z.rows_mut() {
                    let m = row.fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    row.mapv_inplace(|v| (v - m).exp());
                    let sum = row.sum();
                    row /= sum;
                }
            }
            acts.push(z);
        }
        acts
    }

    fn score(probs: &Array2<f32>, labels: &[u8]) -> Score {
        let mut loss = 0.0;
        let mut right = 0;
        for (row, &y) in probs.rows().into_iter().zip(labels) {
            loss -= row[y as usize].max(1e-12).ln();
            let best =
                row.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
            right += usize::from(best == y as usize);
        }
        let n = labels.len().max(1) as f32;
        Score { loss: loss / n, accuracy: right as f32 / n }
    }

    /// The mean cross-entropy gradient over the batch `x` (`batch x 784`) with `labels`, into
    /// `grad`. Returns the batch's score before the update.
    pub fn gradient(&self, params: &[f32], x: ArrayView2<'_, f32>, labels: &[u8], grad: &mut [f32]) -> Score {
        let acts = self.forward(params, x);
        let score = Self::score(acts.last().expect("output"), labels);
        let n = labels.len() as f32;
        let mut delta = acts.last().expect("output").clone();
        for (mut row, &y) in delta.rows_mut().into_iter().zip(labels) {
            row[y as usize] -= 1.0;
        }
        delta /= n;
        let layers = self.split(params);
        let mut grads = self.split_mut(grad);
        for i in (0..layers.len()).rev() {
            let (gw, gb) = &mut grads[i];
            general_mat_mul(1.0, &acts[i].t(), &delta, 0.0, gw);
            gb.assign(&delta.sum_axis(Axis(0)));
            if i > 0 {
                let mut back = delta.dot(&layers[i].0.t());
                back.zip_mut_with(&acts[i], |d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
                delta = back;
            }
        }
        score
    }

    /// Loss and accuracy of `params` on a whole set, in chunks.
    pub fn evaluate(&self, params: &[f32], images: &[f32], labels: &[u8]) -> Score {
        let d = self.layers[0];
        let (mut loss, mut right) = (0.0f64, 0.0f64);
        for (chunk, ls) in images.chunks(1000 * d).zip(labels.chunks(1000)) {
            let x = ArrayView2::from_shape((ls.len(), d), chunk).expect("shape");
            let s = Self::score(self.forward(params, x).last().expect("output"), ls);
            loss += f64::from(s.loss) * ls.len() as f64;
            right += f64::from(s.accuracy) * ls.len() as f64;
        }
        let n = labels.len().max(1) as f64;
        Score { loss: (loss / n) as f32, accuracy: (right / n) as f32 }
    }
}

/// Rows `idx` of `images`, copied into `out` (reused between batches).
pub fn gather(images: &[f32], d: usize, idx: &[usize], out: &mut Vec<f32>) {
    out.clear();
    for &i in idx {
        out.extend_from_slice(&images[i * d..(i + 1) * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradient matches finite differences on a small MLP.
    #[test]
    fn gradient_matches_finite_differences() {
        let model = Model { layers: vec![5, 4, 3] };
        let params = model.init(3);
        let x = Array2::from_shape_fn((6, 5), |(i, j)| ((i * 7 + j * 3) % 11) as f32 / 11.0);
        let labels = [0u8, 1, 2, 1, 0, 2];
        let mut grad = vec![0.0; model.len()];
        model.gradient(&params, x.view(), &labels, &mut grad);
        let loss = |p: &[f32]| {
            let acts = model.forward(p, x.view());
            Model::score(acts.last().unwrap(), &labels).loss
        };
        for i in (0..model.len()).step_by(3) {
            let (mut up, mut down) = (params.clone(), params.clone());
            up[i] += 1e-2;
            down[i] -= 1e-2;
            let numeric = (loss(&up) - loss(&down)) / 2e-2;
            assert!((numeric - grad[i]).abs() < 2e-3, "param {i}: numeric {numeric}, analytic {}", grad[i]);
        }
    }
}
