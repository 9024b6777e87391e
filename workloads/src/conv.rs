//! The CNN's own layers for candle: a 2-D convolution (stride 1, square kernel, zero padding)
//! as im2col and one matrix product, so that candle's autograd runs it backward through its
//! matrix product and [`Col2Im`]; and 2x2 max pooling with a correct backward pass.
//!
//! candle's own `conv2d` runs backward through `conv_transpose2d`, a direct loop on the CPU: a
//! training step of a 317,066-parameter CNN at batch 32 took a median 98.1 ms with it against
//! 55.6 ms with this one (36 steps each, side by side, `docs/workloads.md`). candle 0.9.2's `max_pool2d` backward multiplies
//! the gradient by the share of each window's maxima where it must divide by their count, so
//! every gradient below a pooling layer came out 4 times too small (the CNN's finite-difference
//! test found it: 16 times for the first convolution, below two poolings).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// Unfolds `[batch, channels, h, w]` into `[batch, oh * ow, channels * k * k]`: one row per
/// output position, holding the input patch it sees.
#[derive(Clone, Copy, Debug)]
struct Im2Col {
    k: usize,
    pad: usize,
}

/// The adjoint of [`Im2Col`]: sums each row's patch back into the positions it came from.
#[derive(Clone, Copy, Debug)]
struct Col2Im(Geometry);

/// One image's convolution: `c` channels of `h x w`, a `k`-wide kernel, `pad` zeros each side.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    pad: usize,
}

impl Geometry {
    /// Output rows and columns.
    fn out(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad + 1).saturating_sub(self.k),
            (self.w + 2 * self.pad + 1).saturating_sub(self.k),
        )
    }

    /// Calls `f(input index, patch column)` for every input pixel that output position
    /// `(oy, ox)`'s patch reads (padding skipped).
    #[inline]
    fn patch(&self, oy: usize, ox: usize, mut f: impl FnMut(usize, usize)) {
        let Geometry { c, h, w, k, pad } = *self;
        for ci in 0..c {
            for ky in 0..k {
                let Some(iy) = (oy + ky).checked_sub(pad).filter(|&y| y < h) else { continue };
                for kx in 0..k {
                    let Some(ix) = (ox + kx).checked_sub(pad).filter(|&x| x < w) else { continue };
                    f((ci * h + iy) * w + ix, (ci * k + ky) * k + kx);
                }
            }
        }
    }
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::F32(_), None) => candle_core::bail!("{op}: the input is not contiguous"),
        _ => candle_core::bail!("{op}: f32 only"),
    }
}

impl CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "im2col"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "im2col")?;
        let (b, c, h, w) = l.shape().dims4()?;
        let geometry = Geometry { c, h, w, k: self.k, pad: self.pad };
        let (oh, ow) = geometry.out();
        let ck = c * self.k * self.k;
        let mut out = vec![0f32; b * oh * ow * ck];
        for (bi, image) in x.chunks_exact(c * h * w).enumerate() {
            for oy in 0..oh {
                for ox in 0..ow {
                    let row = &mut out[((bi * oh + oy) * ow + ox) * ck..][..ck];
                    geometry.patch(oy, ox, |i, col| row[col] = image[i]);
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, oh * ow, ck))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (_, c, h, w) = arg.dims4()?;
        let op = Col2Im(Geometry { c, h, w, k: self.k, pad: self.pad });
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

impl CustomOp1 for Col2Im {
    fn name(&self) -> &'static str {
        "col2im"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32s(s, l, "col2im")?;
        let (b, positions, ck) = l.shape().dims3()?;
        let geometry = self.0;
        let Geometry { c, h, w, k, .. } = geometry;
        let (oh, ow) = geometry.out();
        if positions != oh * ow || ck != c * k * k {
            candle_core::bail!(
                "col2im: [{b}, {positions}, {ck}] is not the unfolding of [{b}, {c}, {h}, {w}]"
            );
        }
        let mut out = vec![0f32; b * c * h * w];
        for (bi, image) in out.chunks_exact_mut(c * h * w).enumerate() {
            for oy in 0..oh {
                for ox in 0..ow {
                    let row = &g[((bi * oh + oy) * ow + ox) * ck..][..ck];
                    geometry.patch(oy, ox, |i, col| image[i] += row[col]);
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, c, h, w))))
    }
}

/// 2x2 max pooling with stride 2 over `[batch, channels, h, w]` (an odd last row or column
/// is dropped, as candle's and PyTorch's do).
#[derive(Clone, Copy, Debug)]
struct MaxPool2;

/// The gradient of [`MaxPool2`]: each window's gradient goes to its first maximum (as
/// PyTorch's), the rest of the window gets none.
#[derive(Clone, Copy, Debug)]
struct MaxPool2Back;

/// Calls `f(output index, input index of the window's first maximum)` for every window.
fn windows(x: &[f32], (b, c, h, w): (usize, usize, usize, usize), mut f: impl FnMut(usize, usize)) {
    let (oh, ow) = (h / 2, w / 2);
    for plane in 0..b * c {
        let base = plane * h * w;
        for oy in 0..oh {
            for ox in 0..ow {
                let at = |dy: usize, dx: usize| base + (2 * oy + dy) * w + 2 * ox + dx;
                let mut best = at(0, 0);
                for i in [at(0, 1), at(1, 0), at(1, 1)] {
                    if x[i] > x[best] {
                        best = i;
                    }
                }
                f((plane * oh + oy) * ow + ox, best);
            }
        }
    }
}

impl CustomOp1 for MaxPool2 {
    fn name(&self) -> &'static str {
        "max-pool-2"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "max-pool-2")?;
        let (b, c, h, w) = l.shape().dims4()?;
        let mut out = vec![0f32; b * c * (h / 2) * (w / 2)];
        windows(x, (b, c, h, w), |o, i| out[o] = x[i]);
        Ok((CpuStorage::F32(out), Shape::from((b, c, h / 2, w / 2))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(&grad.contiguous()?, &MaxPool2Back)?))
    }
}

impl CustomOp2 for MaxPool2Back {
    fn name(&self) -> &'static str {
        "max-pool-2-back"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (f32s(s1, l1, "max-pool-2-back")?, f32s(s2, l2, "max-pool-2-back")?);
        let (b, c, h, w) = l1.shape().dims4()?;
        if l2.shape().dims4()? != (b, c, h / 2, w / 2) {
            candle_core::bail!("max-pool-2-back: gradient {:?} for input {:?}", l2.shape(), l1.shape());
        }
        let mut out = vec![0f32; b * c * h * w];
        windows(x, (b, c, h, w), |o, i| out[i] += g[o]);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// 2x2 max pooling, stride 2, of `x` (`[batch, channels, h, w]`).
pub(crate) fn max_pool2(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(MaxPool2)
}

/// Convolves `x` (`[batch, in, h, w]`) with `weight` (`[in * k * k, out]`, each column one
/// output channel's kernel, row-major over input channel, then kernel row, then column) and
/// adds `bias` (`[out]`): `[batch, out, oh, ow]`.
pub(crate) fn conv2d(x: &Tensor, weight: &Tensor, bias: &Tensor, k: usize, pad: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (oh, ow) = Geometry { c, h, w, k, pad }.out();
    let out = weight.dim(1)?;
    let cols = x.contiguous()?.apply_op1(Im2Col { k, pad })?;
    let y = cols.reshape((b * oh * ow, ()))?.matmul(weight)?.broadcast_add(bias)?;
    y.reshape((b, oh, ow, out))?.permute((0, 3, 1, 2))?.contiguous()
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// The convolution agrees with candle's own `conv2d` forward, and its input gradient with
    /// candle's backward, padding included.
    #[test]
    fn im2col_convolution_agrees_with_candles_conv2d_forward_and_backward() {
        let dev = Device::Cpu;
        let (b, c, h, w, k, out) = (2, 3, 7, 6, 3, 4);
        let xs: Vec<f32> = (0..b * c * h * w).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let ks: Vec<f32> = (0..out * c * k * k).map(|i| ((i * 53 % 89) as f32 - 44.0) / 44.0).collect();
        for pad in [0, 1] {
            let x = Var::from_slice(&xs, (b, c, h, w), &dev).unwrap();
            // candle's kernel is [out, in, k, k]; ours its transpose, flattened per output.
            let kernel = Tensor::from_slice(&ks, (out, c, k, k), &dev).unwrap();
            let ours_w = kernel.reshape((out, c * k * k)).unwrap().t().unwrap().contiguous().unwrap();
            let bias = Tensor::zeros(out, candle_core::DType::F32, &dev).unwrap();
            let theirs = x.conv2d(&kernel, pad, 1, 1, 1).unwrap();
            let ours = conv2d(&x, &ours_w, &bias, k, pad).unwrap();
            let diff =
                (&theirs - &ours).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4, "pad {pad}: forward differs by {diff}");
            let ws: Vec<f32> =
                (0..theirs.elem_count()).map(|i| ((i * 29 % 31) as f32 - 15.0) / 15.0).collect();
            let weights = Tensor::from_vec(ws, theirs.shape(), &dev).unwrap();
            let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
            let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
            let (a, o) = (g_theirs.get(&x).unwrap(), g_ours.get(&x).unwrap());
            let diff = (a - o).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4, "pad {pad}: input gradient differs by {diff}");
        }
    }

    /// Max pooling picks each window's maximum, and its gradient goes there and nowhere else.
    #[test]
    fn max_pooling_routes_each_windows_gradient_to_its_maximum() {
        let dev = Device::Cpu;
        // One 4x5 plane: the odd last column is dropped.
        let xs: [f32; 20] = [1., 5., 2., 0., 9., 3., 4., 8., 8., 9., 7., 0., 1., 2., 9., 6., 6., 3., 1., 9.];
        let x = Var::from_slice(&xs, (1, 1, 4, 5), &dev).unwrap();
        let y = max_pool2(&x).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [5., 8., 7., 3.]);
        let g = (&y * Tensor::from_slice(&[1f32, 2., 3., 4.], (1, 1, 2, 2), &dev).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gx = g.get(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = [0f32; 20];
        (want[1], want[7], want[10], want[17]) = (1., 2., 3., 4.);
        assert_eq!(gx, want);
    }
}
