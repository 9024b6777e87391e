//! Model layout and partitioning: named dense f32 tensors laid out in one flat vector, split into
//! contiguous, near-equal ranges, one per shard.
//!
//! The optimizer is element-wise, so a shard needs no tensor boundaries: an even split balances
//! bytes and work exactly, and a large layer spreads over every server (BytePS splits into 4 MB
//! partitions for the same reason).

use std::ops::Range;

/// One named tensor of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's key, e.g. `"fc1.weight"`.
    pub name: String,
    /// Number of f32 elements.
    pub len: usize,
}

/// The tensors of a model, in order, and where each lives in the flat parameter vector.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelLayout {
    tensors: Vec<(TensorSpec, usize)>,
    total: usize,
}

impl ModelLayout {
    /// Lays out `tensors` one after another.
    pub fn new(tensors: impl IntoIterator<Item = TensorSpec>) -> Self {
        let mut layout = ModelLayout::default();
        for t in tensors {
            let offset = layout.total;
            layout.total += t.len;
            layout.tensors.push((t, offset));
        }
        layout
    }

    /// Total number of parameters.
    pub fn len(&self) -> usize {
        self.total
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The flat range of tensor `name`.
    pub fn range(&self, name: &str) -> Option<Range<usize>> {
        self.tensors.iter().find(|(t, _)| t.name == name).map(|(t, off)| *off..off + t.len)
    }

    /// The tensors in order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().map(|(t, _)| t)
    }
}

/// Contiguous ranges of the flat parameter vector, one per shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    bounds: Vec<usize>,
}

impl Partition {
    /// Splits `total` parameters into `shards` near-equal contiguous ranges (sizes differ by at
    /// most one). `shards` must be at least 1.
    pub fn even(total: usize, shards: u32) -> Self {
        let s = shards.max(1) as usize;
        Partition { bounds: (0..=s).map(|i| i * total / s).collect() }
    }

    /// Number of shards.
    pub fn shards(&self) -> u32 {
        (self.bounds.len() - 1) as u32
    }

    /// Shard `i`'s range of the flat vector.
    pub fn range(&self, shard: u32) -> Range<usize> {
        let i = shard as usize;
        self.bounds[i]..self.bounds[i + 1]
    }

    /// Shard `i`'s part of a flat vector.
    pub fn slice<'a, T>(&self, flat: &'a [T], shard: u32) -> &'a [T] {
        &flat[self.range(shard)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_covers_everything_once() {
        for total in [0, 1, 7, 101_770] {
            for shards in 1..6 {
                let p = Partition::even(total, shards);
                let mut next = 0;
                for s in 0..shards {
                    let r = p.range(s);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= total / shards as usize + 1);
                    next = r.end;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn layout_offsets() {
        let l = ModelLayout::new([
            TensorSpec { name: "w".into(), len: 6 },
            TensorSpec { name: "b".into(), len: 2 },
        ]);
        assert_eq!(l.len(), 8);
        assert_eq!(l.range("b"), Some(6..8));
        assert_eq!(l.range("x"), None);
    }
}
