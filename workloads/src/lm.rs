//! A byte-level decoder-only transformer language model (GPT-2's block, pre-norm), forward and
//! backward by candle. By default: context 64 bytes, width 128, 4 heads, 2 layers, feed-forward
//! 512 wide with GELU, learned positions, an untied output layer over the 256 byte values;
//! 470,784 parameters.
//!
//! The flat parameters, in order: the byte embedding (`[256, d]`), the position embedding
//! (`[ctx, d]`); per layer: the first layer norm's gain and bias, the query-key-value
//! projection (`[d, 3d]`, queries first) and its bias, the attention's output projection
//! (`[d, d]`) and its bias, the second layer norm's gain and bias, the feed-forward layers
//! (`[d, ff]`, `[ff, d]`) and their biases; then the final layer norm's gain and bias and the
//! output layer (`[d, 256]`) and its bias. Weights start normal with standard deviation 0.02,
//! the projections into the residual stream 0.02 / sqrt(2 * layers), as GPT-2's.

use candle_core::{Device, Tensor, D};

use crate::model::Score;
use crate::net::{cross_entropy, Init, Layout, Param};

/// Byte values.
pub const VOCAB: usize = 256;
/// Windows scored at once by [`Lm::evaluate`].
const EVAL_CHUNK: usize = 32;
/// Layer norm's epsilon.
const EPS: f64 = 1e-5;

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmShape {
    /// Context: bytes the model sees at once.
    pub ctx: usize,
    /// Width of the residual stream.
    pub d: usize,
    /// Attention heads (`d` must be a multiple).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the feed-forward layer.
    pub ff: usize,
}

impl Default for LmShape {
    fn default() -> Self {
        LmShape { ctx: 64, d: 128, heads: 4, layers: 2, ff: 512 }
    }
}

/// The language model.
#[derive(Clone, Debug, PartialEq)]
pub struct Lm {
    /// Its shape.
    pub shape: LmShape,
    layout: Layout,
}

/// Tensors of one block, in layout order.
const PER_LAYER: usize = 12;

impl Lm {
    /// The model of this shape.
    ///
    /// # Panics
    /// If `heads` does not divide `d`.
    pub fn new(shape: LmShape) -> Self {
        let LmShape { ctx, d, heads, layers, ff } = shape;
        assert!(heads > 0 && d % heads == 0, "{heads} heads do not divide width {d}");
        let w = Init::Normal(0.02);
        let residual = Init::Normal(0.02 / (2.0 * layers as f32).sqrt());
        let mut params = vec![Param::new("wte", &[VOCAB, d], w), Param::new("wpe", &[ctx, d], w)];
        for _ in 0..layers {
            params.extend([
                Param::new("ln1.gain", &[d], Init::Ones),
                Param::new("ln1.bias", &[d], Init::Zeros),
                Param::new("attn.qkv", &[d, 3 * d], w),
                Param::new("attn.qkv.bias", &[3 * d], Init::Zeros),
                Param::new("attn.proj", &[d, d], residual),
                Param::new("attn.proj.bias", &[d], Init::Zeros),
                Param::new("ln2.gain", &[d], Init::Ones),
                Param::new("ln2.bias", &[d], Init::Zeros),
                Param::new("mlp.fc", &[d, ff], w),
                Param::new("mlp.fc.bias", &[ff], Init::Zeros),
                Param::new("mlp.proj", &[ff, d], residual),
                Param::new("mlp.proj.bias", &[d], Init::Zeros),
            ]);
        }
        params.extend([
            Param::new("ln_f.gain", &[d], Init::Ones),
            Param::new("ln_f.bias", &[d], Init::Zeros),
            Param::new("head", &[d, VOCAB], w),
            Param::new("head.bias", &[VOCAB], Init::Zeros),
        ]);
        Lm { shape, layout: Layout::new(params) }
    }

    /// Parameters in all.
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The initial parameters, from `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        self.layout.init(seed)
    }

    /// The logits (`[batch * t, 256]`) after each byte of `tokens` (`[batch, t]`, `t <= ctx`).
    fn logits(&self, p: &[Tensor], tokens: &Tensor) -> candle_core::Result<Tensor> {
        let LmShape { d, heads, layers, .. } = self.shape;
        let (b, t) = tokens.dims2()?;
        let hd = d / heads;
        let mut h = p[0].embedding(&tokens.flatten_all()?)?.reshape((b, t, d))?;
        h = h.broadcast_add(&p[1].narrow(0, 0, t)?)?;
        // -1e9 where a position would see a later one.
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for l in 0..layers {
            let q = &p[2 + l * PER_LAYER..2 + (l + 1) * PER_LAYER];
            let a = layer_norm(&h, &q[0], &q[1])?;
            let qkv = linear(&a.reshape((b * t, d))?, &q[2], &q[3])?;
            let qkv = qkv.reshape((b, t, 3, heads, hd))?.permute((2, 0, 3, 1, 4))?;
            let (qs, ks, vs) =
                (qkv.get(0)?.contiguous()?, qkv.get(1)?.contiguous()?, qkv.get(2)?.contiguous()?);
            let att = (qs.matmul(&ks.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = softmax(&att)?;
            let y = att.matmul(&vs)?.permute((0, 2, 1, 3))?.reshape((b * t, d))?;
            h = (h + linear(&y, &q[4], &q[5])?.reshape((b, t, d))?)?;
            let m = layer_norm(&h, &q[6], &q[7])?.reshape((b * t, d))?;
            let m = linear(&linear(&m, &q[8], &q[9])?.gelu()?, &q[10], &q[11])?;
            h = (h + m.reshape((b, t, d))?)?;
        }
        let f = &p[2 + layers * PER_LAYER..];
        let h = layer_norm(&h, &f[0], &f[1])?.reshape((b * t, d))?;
        linear(&h, &f[2], &f[3])
    }

    /// Inputs and next-byte targets of the windows `windows` (each `ctx + 1` bytes).
    fn batch(&self, windows: &[&[u8]]) -> candle_core::Result<(Tensor, Tensor)> {
        let t = self.shape.ctx;
        let mut x = Vec::with_capacity(windows.len() * t);
        let mut y = Vec::with_capacity(windows.len() * t);
        for w in windows {
            assert_eq!(w.len(), t + 1, "a window is the context and one byte more");
            x.extend(w[..t].iter().map(|&c| u32::from(c)));
            y.extend(w[1..].iter().map(|&c| u32::from(c)));
        }
        let b = windows.len();
        Ok((Tensor::from_vec(x, (b, t), &Device::Cpu)?, Tensor::from_vec(y, b * t, &Device::Cpu)?))
    }

    /// The mean next-byte cross-entropy gradient over `windows` (each `ctx + 1` bytes) into
    /// `grad`; returns the batch's loss (nats per byte) and next-byte accuracy at `params`.
    ///
    /// # Panics
    /// If the lengths do not fit the model.
    pub fn gradient(&self, params: &[f32], windows: &[&[u8]], grad: &mut [f32]) -> Score {
        let p = self.layout.tensors(params, true);
        let mut run = || -> candle_core::Result<Score> {
            let (x, y) = self.batch(windows)?;
            let (loss, right) = cross_entropy(&self.logits(&p, &x)?, &y)?;
            self.layout.gradient_into(&p, &loss.backward()?, grad);
            Ok(Score { loss: loss.to_scalar()?, accuracy: right as f32 / y.elem_count().max(1) as f32 })
        };
        run().expect("the model's shapes fit its parameters")
    }

    /// Mean loss (nats per byte) and next-byte accuracy of `params` over `windows`.
    pub fn evaluate(&self, params: &[f32], windows: &[&[u8]]) -> Score {
        let p = self.layout.tensors(params, false);
        let (mut loss, mut right, mut n) = (0.0f64, 0usize, 0usize);
        for chunk in windows.chunks(EVAL_CHUNK) {
            let run = || -> candle_core::Result<(f32, usize, usize)> {
                let (x, y) = self.batch(chunk)?;
                let (l, r) = cross_entropy(&self.logits(&p, &x)?, &y)?;
                Ok((l.to_scalar()?, r, y.elem_count()))
            };
            let (l, r, count) = run().expect("the model's shapes fit its parameters");
            loss += f64::from(l) * count as f64;
            right += r;
            n += count;
        }
        let n = n.max(1) as f64;
        Score { loss: (loss / n) as f32, accuracy: (right as f64 / n) as f32 }
    }
}

/// `x w + b` for `x` of `[n, in]`.
fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(w)?.broadcast_add(b)
}

/// Layer norm over the last dimension, with gain `g` and bias `b`.
fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + EPS)?.sqrt()?)?;
    normed.broadcast_mul(g)?.broadcast_add(b)
}

/// Softmax over the last dimension.
fn softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let e = x.broadcast_sub(&x.detach().max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::testing::check_gradient;

    fn windows(n: usize, len: usize) -> Vec<Vec<u8>> {
        let text = b"the quick brown fox jumps over the lazy dog; ".repeat(8);
        (0..n).map(|i| text[i * 3..i * 3 + len].to_vec()).collect()
    }

    #[test]
    fn the_default_model_has_the_documented_size() {
        assert_eq!(Lm::new(LmShape::default()).len(), 470_784);
    }

    /// The analytic gradient of a small model matches finite differences.
    #[test]
    fn gradient_matches_finite_differences() {
        let lm = Lm::new(LmShape { ctx: 6, d: 8, heads: 2, layers: 2, ff: 12 });
        let params = lm.init(3);
        let ws = windows(3, 7);
        let ws: Vec<&[u8]> = ws.iter().map(Vec::as_slice).collect();
        let mut grad = vec![0.0; lm.len()];
        lm.gradient(&params, &ws, &mut grad);
        let loss = |p: &[f32]| lm.evaluate(p, &ws).loss;
        check_gradient(&params, &grad, 5, loss, 2e-3, 0.05);
    }

    /// The same parameters and windows give the same gradient, bit for bit.
    #[test]
    fn the_gradient_is_deterministic() {
        let lm = Lm::new(LmShape { ctx: 16, d: 32, heads: 4, layers: 1, ff: 64 });
        let params = lm.init(1);
        let ws = windows(4, 17);
        let ws: Vec<&[u8]> = ws.iter().map(Vec::as_slice).collect();
        let (mut a, mut b) = (vec![0.0; lm.len()], vec![0.0; lm.len()]);
        let sa = lm.gradient(&params, &ws, &mut a);
        let sb = lm.gradient(&params, &ws, &mut b);
        assert_eq!((sa, a), (sb, b));
    }
}
