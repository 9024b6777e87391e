//! The host's measures of a shard's tensors ([`Decision::Measure`](crate::abi::Decision::Measure)):
//! the one implementation, run by the host's shards and by the native
//! [`Driver`](crate::testing::Driver), so a policy sees the same bits in its native tests as on a
//! cluster.
//!
//! Sums run in f64 over eight interleaved lanes, added in a fixed order at the end: the result
//! depends only on the values (not on the machine or the compiler's choices), and the loop
//! vectorizes, so a measure runs at about memory speed.

use crate::abi::{Measure, Tensor};

/// A tensor as a measure reads it: `scale * values` (a group's or round's mean is its weighted
/// sum scaled by the inverse of its weight, read in place).
#[derive(Clone, Copy, Debug)]
pub struct Scaled<'a> {
    /// The values.
    pub values: &'a [f32],
    /// What each value is multiplied by.
    pub scale: f64,
}

impl<'a> Scaled<'a> {
    /// `values` as they are.
    pub fn plain(values: &'a [f32]) -> Self {
        Scaled { values, scale: 1.0 }
    }

    /// The mean of a weighted sum (`sum` of `w·g` over a total weight of `weight`), read in
    /// place; `None` for one with no weight in it yet (an empty group or round is not there).
    pub fn mean(sum: &'a [f32], weight: f32) -> Option<Self> {
        (weight > 0.0).then(|| Scaled { values: sum, scale: 1.0 / f64::from(weight) })
    }
}

const LANES: usize = 8;

/// The sum of `a[i] * b[i]` in f64, in a fixed order.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f64; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += f64::from(x[l]) * f64::from(y[l]);
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += f64::from(*x) * f64::from(*y);
    }
    acc.iter().sum()
}

/// What a measure came to, and how many values it read (the host charges fuel by them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// The figure; NaN when a tensor is missing, or for a cosine with a zero tensor.
    pub value: f64,
    /// Values read.
    pub read: usize,
}

/// Computes `measure`, finding each tensor with `get` (`None`: it is not there).
pub fn evaluate<'a>(measure: Measure, mut get: impl FnMut(Tensor) -> Option<Scaled<'a>>) -> Measured {
    let missing = Measured { value: f64::NAN, read: 0 };
    match measure {
        Measure::Norm(t) => match get(t) {
            Some(x) => {
                Measured { value: dot(x.values, x.values).sqrt() * x.scale.abs(), read: x.values.len() }
            }
            None => missing,
        },
        Measure::Dot(a, b) | Measure::Cosine(a, b) => {
            let (Some(x), Some(y)) = (get(a), get(b)) else { return missing };
            let read = x.values.len() + y.values.len();
            let d = dot(x.values, y.values) * x.scale * y.scale;
            let value = if matches!(measure, Measure::Dot(..)) {
                d
            } else {
                let nx = dot(x.values, x.values).sqrt() * x.scale.abs();
                let ny = dot(y.values, y.values).sqrt() * y.scale.abs();
                if nx == 0.0 || ny == 0.0 {
                    f64::NAN
                } else {
                    (d / (nx * ny)).clamp(-1.0, 1.0)
                }
            };
            Measured { value, read: if matches!(measure, Measure::Dot(..)) { read } else { 2 * read } }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec::Vec;

    #[test]
    fn measures_agree_with_their_definitions() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 - 7.5).collect();
        let b: Vec<f32> = (0..19).map(|i| (i * i) as f32 / 10.0).collect();
        let naive: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-9);
        let get = |t: Tensor| match t {
            Tensor::Params => Some(Scaled::plain(&a)),
            Tensor::Group(_) => Some(Scaled { values: &b, scale: 0.5 }),
            _ => None,
        };
        let norm = evaluate(Measure::Norm(Tensor::Params), get);
        assert!((norm.value - dot(&a, &a).sqrt()).abs() < 1e-12);
        assert_eq!(norm.read, 19);
        let d = evaluate(Measure::Dot(Tensor::Params, Tensor::Group(1)), get).value;
        assert!((d - naive * 0.5).abs() < 1e-9);
        let c = evaluate(Measure::Cosine(Tensor::Params, Tensor::Group(1)), get).value;
        assert!((c - naive / (dot(&a, &a).sqrt() * dot(&b, &b).sqrt())).abs() < 1e-12);
        assert!(evaluate(Measure::Norm(Tensor::Push(3)), get).value.is_nan());
        let zero = [0.0f32; 4];
        let z = |_| Some(Scaled::plain(&zero));
        assert!(evaluate(Measure::Cosine(Tensor::Params, Tensor::Params), z).value.is_nan());
    }
}
