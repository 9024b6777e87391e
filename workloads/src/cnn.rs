//! A LeNet-style convolutional network for Fashion-MNIST, forward and backward by candle:
//! two 5x5 convolutions (16 and 32 channels by default), each followed by ReLU and 2x2 max
//! pooling, then a ReLU layer of 512 units and the 10 classes: 281,034 parameters, 1.3 million
//! multiply-adds per image forward (LeNet-5 has 6 and 16 channels and 120 units; the classic
//! TensorFlow MNIST tutorial's network 32 and 64 channels and 1,024 units, 3.2 million
//! parameters and 10 million multiply-adds, too slow to score 10,000 test images every second
//! on two cores: `docs/workloads.md`).
//!
//! The flat parameters, in order: `conv1` (`[25 * 1, c1]`, the im2col layout of `conv.rs`) and its
//! bias, `conv2` (`[25 * c1, c2]`) and its bias, `fc1` (`[16 * c2, hidden]`, inputs in
//! channel-major order) and its bias, `fc2` (`[hidden, 10]`) and its bias.

use candle_core::{Device, Tensor};

use crate::conv::{conv2d, max_pool2};
use crate::fashion::{CLASSES, PIXELS};
use crate::model::Score;
use crate::net::{cross_entropy, Init, Layout, Param};

/// Kernel side of both convolutions.
const K: usize = 5;
/// Image side.
const SIDE: usize = 28;
/// Images scored at once by [`Cnn::evaluate`].
const EVAL_CHUNK: usize = 250;

/// The network's widths.
#[derive(Clone, Debug, PartialEq)]
pub struct Cnn {
    /// Channels of the first convolution.
    pub c1: usize,
    /// Channels of the second.
    pub c2: usize,
    /// Units of the dense hidden layer.
    pub hidden: usize,
    layout: Layout,
}

impl Cnn {
    /// The network with these widths.
    pub fn new(c1: usize, c2: usize, hidden: usize) -> Self {
        let he = |fan_in: usize| Init::Uniform((6.0 / fan_in as f32).sqrt());
        // After two valid 5x5 convolutions and two 2x2 poolings, 28 -> 24 -> 12 -> 8 -> 4.
        let flat = 4 * 4 * c2;
        let layout = Layout::new(vec![
            Param::new("conv1", &[K * K, c1], he(K * K)),
            Param::new("conv1.bias", &[c1], Init::Zeros),
            Param::new("conv2", &[K * K * c1, c2], he(K * K * c1)),
            Param::new("conv2.bias", &[c2], Init::Zeros),
            Param::new("fc1", &[flat, hidden], he(flat)),
            Param::new("fc1.bias", &[hidden], Init::Zeros),
            Param::new("fc2", &[hidden, CLASSES], he(hidden)),
            Param::new("fc2.bias", &[CLASSES], Init::Zeros),
        ]);
        Cnn { c1, c2, hidden, layout }
    }

    /// The default network: 16 and 32 channels, 512 hidden units.
    pub fn lenet() -> Self {
        Cnn::new(16, 32, 512)
    }

    /// Parameters in all.
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    /// Whether the network has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// He-uniform weights and zero biases, from `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        self.layout.init(seed)
    }

    /// The logits of images `x` (`batch * 784` pixels) under parameters `p`.
    fn logits(&self, p: &[Tensor], x: &[f32]) -> candle_core::Result<Tensor> {
        let batch = x.len() / PIXELS;
        let x = Tensor::from_slice(x, (batch, 1, SIDE, SIDE), &Device::Cpu)?;
        let h = max_pool2(&conv2d(&x, &p[0], &p[1], K, 0)?.relu()?)?;
        let h = max_pool2(&conv2d(&h, &p[2], &p[3], K, 0)?.relu()?)?;
        let h = h.flatten_from(1)?.matmul(&p[4])?.broadcast_add(&p[5])?.relu()?;
        h.matmul(&p[6])?.broadcast_add(&p[7])
    }

    fn targets(labels: &[u8]) -> candle_core::Result<Tensor> {
        let y: Vec<u32> = labels.iter().map(|&l| u32::from(l)).collect();
        Tensor::from_vec(y, labels.len(), &Device::Cpu)
    }

    /// The mean cross-entropy gradient over images `x` (`labels.len() * 784` pixels) into
    /// `grad`; returns the batch's score at `params`.
    ///
    /// # Panics
    /// If the lengths do not fit the network or each other.
    pub fn gradient(&self, params: &[f32], x: &[f32], labels: &[u8], grad: &mut [f32]) -> Score {
        assert_eq!(x.len(), labels.len() * PIXELS, "one image per label");
        let p = self.layout.tensors(params, true);
        let mut run = || -> candle_core::Result<Score> {
            let (loss, right) = cross_entropy(&self.logits(&p, x)?, &Self::targets(labels)?)?;
            self.layout.gradient_into(&p, &loss.backward()?, grad);
            Ok(Score { loss: loss.to_scalar()?, accuracy: right as f32 / labels.len().max(1) as f32 })
        };
        run().expect("the network's shapes fit its parameters")
    }

    /// Loss and accuracy of `params` on a whole set, in chunks.
    pub fn evaluate(&self, params: &[f32], images: &[f32], labels: &[u8]) -> Score {
        let p = self.layout.tensors(params, false);
        let (mut loss, mut right) = (0.0f64, 0usize);
        for (x, ls) in images.chunks(EVAL_CHUNK * PIXELS).zip(labels.chunks(EVAL_CHUNK)) {
            let run = || -> candle_core::Result<(f32, usize)> {
                let (l, r) = cross_entropy(&self.logits(&p, x)?, &Self::targets(ls)?)?;
                Ok((l.to_scalar()?, r))
            };
            let (l, r) = run().expect("the network's shapes fit its parameters");
            loss += f64::from(l) * ls.len() as f64;
            right += r;
        }
        let n = labels.len().max(1) as f64;
        Score { loss: (loss / n) as f32, accuracy: (right as f64 / n) as f32 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::testing::check_gradient;

    fn images(n: usize) -> (Vec<f32>, Vec<u8>) {
        let x = (0..n * PIXELS).map(|i| ((i * 7919) % 251) as f32 / 251.0).collect();
        let y = (0..n).map(|i| (i * 3 % CLASSES) as u8).collect();
        (x, y)
    }

    #[test]
    fn the_default_network_has_the_documented_size() {
        assert_eq!(Cnn::lenet().len(), 281_034);
    }

    /// The analytic gradient of a narrow network matches finite differences.
    #[test]
    fn gradient_matches_finite_differences() {
        let cnn = Cnn::new(2, 3, 6);
        let params = cnn.init(5);
        let (x, y) = images(4);
        let mut grad = vec![0.0; cnn.len()];
        cnn.gradient(&params, &x, &y, &mut grad);
        let loss = |p: &[f32]| cnn.evaluate(p, &x, &y).loss;
        check_gradient(&params, &grad, 7, loss, 2e-3, 0.05);
    }

    /// The same parameters and images give the same gradient, bit for bit.
    #[test]
    fn the_gradient_is_deterministic() {
        let cnn = Cnn::new(4, 8, 16);
        let params = cnn.init(1);
        let (x, y) = images(8);
        let (mut a, mut b) = (vec![0.0; cnn.len()], vec![0.0; cnn.len()]);
        let sa = cnn.gradient(&params, &x, &y, &mut a);
        let sb = cnn.gradient(&params, &x, &y, &mut b);
        assert_eq!((sa, a), (sb, b));
    }
}
