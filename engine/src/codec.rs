//! The codecs tensors cross the wire in, and the error feedback of the workers' pushes: one
//! implementation, which the Rust worker, the Python client (through the same client), the
//! servers and the simulator all call. What a codec is and its bounds are the SDK's
//! ([`Codec`]); how one encodes is here.
//!
//! # The encoded form
//! A tensor in any codec but [`Codec::None`] is a little-endian record: the number of values
//! `n` (u32), then
//! - `fp16`, `bf16`: `n` 16-bit values;
//! - `int8` (blocks of `B`): per block, its scale (f32: the block's largest magnitude over 127)
//!   then its values as i8 (`value = q × scale`);
//! - `topk` (fraction `f`): `k = max(1, round(n × f))` (u32), then `k` strictly increasing
//!   indices (u32) and their `k` values (f32); every other value is 0.
//! - `sparseloco` (fraction `f`): per chunk of [`SPARSELOCO_CHUNK`] values (the last may be
//!   shorter, `L` values), `k = max(1, round(L × f))` (not sent: both ends compute it), then
//!   the chunk's lookup of four f32 values, its `k` strictly increasing indices within the
//!   chunk (u16), and their `k` 2-bit codes, four to a byte, the first in the low bits; a kept
//!   value decodes to `lookup[code]`, every other to 0. Code 0: negative and below the chunk's
//!   median kept magnitude, 1: negative and at or above it, 2 and 3 likewise for the rest; a
//!   code's lookup value is the mean of the kept values with that code (0 for none), so each
//!   code's values keep their sum (our reading of SparseLoCo's 2-bit quantizer, whose exact
//!   form its paper leaves to its code).
//!
//! padded with zeros to a multiple of 4 bytes (so a transport of f32 words carries it).
//! [`Codec::None`] is the raw f32 values, with no header: the zero-copy path. [`decode`]
//! checks every count, index and length against the bytes and against the most values the
//! receiver accepts before it sizes anything by them.
//!
//! # Error feedback
//! A worker pushes with a [`PushEncoder`]: per shard, it adds the residual that the last push's
//! codec left out to the new values, encodes the sum, and keeps what this encoding leaves out
//! for the next push. Nothing is lost, only delayed: the shard's sum of decoded pushes is the
//! sum of the gradients minus the last residual. The residual stays through codec changes (a
//! change to `none` pushes it whole) and policy swaps. SparseLoCo's alone decays the residual
//! by its `beta` before adding a push to it, as its authors' error feedback does (which then
//! stands in for DiLoCo's outer momentum): what the decay takes is dropped on purpose.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use syncopate_policy_sdk::abi::WorkerId;

pub use syncopate_policy_sdk::codec::{Codec, SPARSELOCO_CHUNK};

/// A tensor that does not decode (on the wire inside a server's refusal of a push: add variants
/// only at the end).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
pub enum CodecError {
    /// Shorter or longer than its header says.
    #[error("a {codec} tensor of {n} values is {expected} bytes, not {got}")]
    Length {
        /// The codec.
        codec: Codec,
        /// The values its header claims.
        n: usize,
        /// The bytes that many take.
        expected: usize,
        /// The bytes there are.
        got: usize,
    },
    /// More values than the receiver takes.
    #[error("a tensor of {n} values, more than the {max} this receiver takes")]
    TooLong {
        /// The values claimed.
        n: usize,
        /// The most accepted.
        max: usize,
    },
    /// A top-k index out of range or out of order.
    #[error("top-k index {index} at position {at}: indices must increase and stay below {n}")]
    Index {
        /// The index.
        index: u32,
        /// Its position.
        at: usize,
        /// The tensor's length.
        n: usize,
    },
    /// A top-k record keeping more values than the tensor has.
    #[error("top-k keeps {k} of {n} values")]
    Kept {
        /// Values kept.
        k: usize,
        /// The tensor's length.
        n: usize,
    },
}

/// Rounds a byte count up to whole 4-byte words.
fn words(bytes: usize) -> usize {
    bytes.div_ceil(4) * 4
}

/// The values top-k keeps of `n`.
pub fn kept(ppm: u32, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let k = (n as u128 * u128::from(ppm) + 500_000) / 1_000_000;
    (k as usize).clamp(1, n)
}

/// Bytes `n` values take in `codec` on the wire (padding included).
pub fn wire_len(codec: Codec, n: usize) -> usize {
    match codec {
        Codec::None => 4 * n,
        Codec::Fp16 | Codec::Bf16 => words(4 + 2 * n),
        Codec::Int8 { block } => words(4 + 4 * n.div_ceil(block.max(1) as usize) + n),
        Codec::TopK { ppm } => 8 + 8 * kept(ppm, n),
        Codec::SparseLoCo { ppm, .. } => {
            let chunk = |len: usize| {
                let k = kept(ppm, len);
                16 + 2 * k + k.div_ceil(4)
            };
            let (full, rest) = (n / SPARSELOCO_CHUNK, n % SPARSELOCO_CHUNK);
            words(4 + full * chunk(SPARSELOCO_CHUNK) + if rest > 0 { chunk(rest) } else { 0 })
        }
    }
}

/// Scratch space an encoder reuses from push to push, so that encoding allocates nothing
/// once warm.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    order: Vec<u32>,
    sample: Vec<u32>,
    sum: Vec<f32>,
    codes: Vec<u8>,
}

/// Encodes `values` in `codec` into `out` (cleared first), and writes what the encoding leaves
/// out (`values` minus what decodes) into `left` (as long as `values`) when given: pushes keep
/// it for error feedback, pulls do not. [`Codec::None`] writes the raw values.
pub fn encode(
    codec: Codec,
    values: &[f32],
    mut left: Option<&mut [f32]>,
    scratch: &mut Scratch,
    out: &mut Vec<u8>,
) {
    debug_assert!(left.as_ref().is_none_or(|l| l.len() == values.len()));
    out.clear();
    let n = values.len();
    out.reserve(wire_len(codec, n));
    out.extend_from_slice(&(n as u32).to_le_bytes());
    match codec {
        Codec::None => {
            out.clear();
            out.extend_from_slice(bytemuck::cast_slice(values));
            if let Some(l) = left {
                l.fill(0.0);
            }
        }
        Codec::Fp16 => half_encode::<f16>(values, left, out),
        Codec::Bf16 => bf16_encode(values, left, out),
        Codec::Int8 { block } => {
            let block = block.max(1) as usize;
            for (b, chunk) in values.chunks(block).enumerate() {
                let max = abs_max(chunk);
                let scale = if max > 0.0 && max.is_finite() { max / 127.0 } else { 0.0 };
                out.extend_from_slice(&scale.to_le_bytes());
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                let at = out.len();
                out.resize(at + chunk.len(), 0);
                int8_block(
                    chunk,
                    inv,
                    scale,
                    &mut out[at..],
                    left.as_deref_mut().map(|l| &mut l[b * block..][..chunk.len()]),
                );
            }
        }
        Codec::TopK { ppm } => {
            let k = kept(ppm, n);
            out.extend_from_slice(&(k as u32).to_le_bytes());
            top_k(values, k, &mut scratch.order, &mut scratch.sample);
            let top = &scratch.order[..];
            for &i in top.iter() {
                out.extend_from_slice(&i.to_le_bytes());
            }
            for &i in top.iter() {
                out.extend_from_slice(&values[i as usize].to_le_bytes());
            }
            if let Some(l) = left {
                l.copy_from_slice(values);
                for &i in top.iter() {
                    l[i as usize] = 0.0;
                }
            }
        }
        Codec::SparseLoCo { ppm, .. } => {
            for (c, chunk) in values.chunks(SPARSELOCO_CHUNK).enumerate() {
                let left = left.as_deref_mut().map(|l| &mut l[c * SPARSELOCO_CHUNK..][..chunk.len()]);
                sparseloco_chunk(chunk, kept(ppm, chunk.len()), scratch, left, out);
            }
        }
    }
    out.resize(words(out.len()), 0);
}

/// One SparseLoCo chunk (see the module docs): its lookup, indices and codes into `out`; what
/// it leaves out (the values not kept, and each kept value's quantization error) into `left`.
fn sparseloco_chunk(
    chunk: &[f32],
    k: usize,
    scratch: &mut Scratch,
    left: Option<&mut [f32]>,
    out: &mut Vec<u8>,
) {
    top_k(chunk, k, &mut scratch.order, &mut scratch.sample);
    // The median kept magnitude splits each sign's values in two.
    scratch.sample.clear();
    scratch.sample.extend(scratch.order.iter().map(|&i| magnitude(chunk[i as usize])));
    let mid = scratch.sample.len() / 2;
    let threshold = match scratch.sample.is_empty() {
        true => 0,
        false => *scratch.sample.select_nth_unstable(mid).1,
    };
    let code = |v: f32| u8::from(v.is_sign_positive()) * 2 + u8::from(magnitude(v) >= threshold);
    let (mut sums, mut counts) = ([0f64; 4], [0u32; 4]);
    scratch.codes.clear();
    for &i in &scratch.order {
        let v = chunk[i as usize];
        let q = code(v);
        sums[q as usize] += f64::from(v);
        counts[q as usize] += 1;
        scratch.codes.push(q);
    }
    let lookup: [f32; 4] =
        std::array::from_fn(|q| if counts[q] > 0 { (sums[q] / f64::from(counts[q])) as f32 } else { 0.0 });
    for v in lookup {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for &i in &scratch.order {
        out.extend_from_slice(&(i as u16).to_le_bytes());
    }
    for four in scratch.codes.chunks(4) {
        out.push(four.iter().enumerate().fold(0u8, |b, (j, &q)| b | (q << (2 * j))));
    }
    if let Some(l) = left {
        l.copy_from_slice(chunk);
        for (&i, &q) in scratch.order.iter().zip(&scratch.codes) {
            l[i as usize] -= lookup[q as usize];
        }
    }
}

/// The largest magnitude in `values` (0 for none). Eight independent running maxima, so that
/// the loop becomes the vector units' maximum (one running `f32::max` is a serial chain the
/// compiler may not reorder); `if a > m` rather than `f32::max`, whose NaN rule also keeps it
/// scalar (a NaN in a push is refused by the shard anyway).
fn abs_max(values: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut lanes = [0.0f32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let tail = chunks.remainder().iter().map(|v| v.abs());
    lanes.into_iter().chain(tail).fold(0.0, |m, a| if a > m { a } else { m })
}

/// One int8 block: each value times `inv`, clamped to ±127 and rounded to nearest (ties to
/// even) by adding 1.5 × 2^23, after which the float's low mantissa bits are the integer in
/// two's complement: its low byte is the code, with no float-to-integer conversion, so the
/// loop is a straight run of vector instructions on the baseline target. `left` gets the
/// value minus what decodes (`code × scale`).
fn int8_block(values: &[f32], inv: f32, scale: f32, out: &mut [u8], left: Option<&mut [f32]>) {
    const MAGIC: f32 = 12_582_912.0;
    let shifted = |v: f32| (v * inv).clamp(-127.0, 127.0) + MAGIC;
    match left {
        Some(left) => {
            for ((o, v), r) in out.iter_mut().zip(values).zip(left.iter_mut()) {
                let t = shifted(*v);
                *o = t.to_bits() as u8;
                *r = v - (t - MAGIC) * scale;
            }
        }
        None => {
            for (o, v) in out.iter_mut().zip(values) {
                *o = shifted(*v).to_bits() as u8;
            }
        }
    }
}

/// A magnitude as bits that order as the magnitudes do (NaN above infinity).
fn magnitude(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// Leaves in `order` the indices of the `k` values of largest magnitude, in increasing order
/// (ties broken towards the lower index). A sample of the values sets a threshold that about
/// twice `k` values pass; the exact selection runs on those alone, and on all values only when
/// the sample misjudged. One pass over the values, then work on a few times `k` of them.
fn top_k(values: &[f32], k: usize, order: &mut Vec<u32>, sample: &mut Vec<u32>) {
    let n = values.len();
    order.clear();
    if k >= n {
        order.extend(0..n as u32);
        return;
    }
    // About 4,096 sampled values for a large tensor; 512 at least for a SparseLoCo chunk of
    // 4,096 (a sample as large as the chunk cost as much as the selection it saves).
    let stride = (n / 4096).max(n.min(4096) / 512).max(1);
    sample.clear();
    sample.extend(values.iter().step_by(stride).map(|v| magnitude(*v)));
    let m = sample.len();
    // The sample's value with about 2k/n of the sample above it.
    let above = ((2 * k * m).div_ceil(n) + 1).min(m);
    let (_, &mut threshold, _) = sample.select_nth_unstable(m - above);
    order.extend((0..n as u32).filter(|&i| magnitude(values[i as usize]) >= threshold));
    if order.len() < k {
        order.clear();
        order.extend(0..n as u32);
    }
    if order.len() > k {
        let key = |i: &u32| (std::cmp::Reverse(magnitude(values[*i as usize])), *i);
        order.select_nth_unstable_by_key(k, key);
        order.truncate(k);
    }
    order.sort_unstable();
}

trait Half: Copy + Default + bytemuck::Pod {
    fn convert_from(dst: &mut [Self], src: &[f32]);
    fn convert_to(src: &[Self], dst: &mut [f32]);
}

impl Half for f16 {
    fn convert_from(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
    fn convert_to(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl Half for bf16 {
    fn convert_from(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
    fn convert_to(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

/// Values per conversion batch: small enough for the stack, large enough for the vector units.
const BATCH: usize = 256;

/// `v` in bfloat16, rounded to nearest (ties to even), NaN kept a (quiet) NaN: what
/// `half::bf16::from_f32` gives, in integer operations and one select that the vector units
/// take whole (the crate's conversion branches per value).
fn bf16_of(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) as u16) | 0x0040;
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

fn bf16_encode(values: &[f32], left: Option<&mut [f32]>, out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + 2 * values.len(), 0);
    let bytes = out[at..].chunks_exact_mut(2);
    match left {
        Some(left) => {
            for ((o, v), r) in bytes.zip(values).zip(left.iter_mut()) {
                let b = bf16_of(*v);
                o.copy_from_slice(&b.to_le_bytes());
                *r = v - f32::from_bits(u32::from(b) << 16);
            }
        }
        None => {
            for (o, v) in bytes.zip(values) {
                o.copy_from_slice(&bf16_of(*v).to_le_bytes());
            }
        }
    }
}

fn half_encode<H: Half>(values: &[f32], mut left: Option<&mut [f32]>, out: &mut Vec<u8>) {
    let mut halves = [H::default(); BATCH];
    let mut back = [0.0f32; BATCH];
    for (c, chunk) in values.chunks(BATCH).enumerate() {
        let (h, b) = (&mut halves[..chunk.len()], &mut back[..chunk.len()]);
        H::convert_from(h, chunk);
        out.extend_from_slice(bytemuck::cast_slice(h));
        if let Some(l) = left.as_deref_mut() {
            H::convert_to(h, b);
            for ((r, v), d) in l[c * BATCH..].iter_mut().zip(chunk).zip(b.iter()) {
                *r = v - d;
            }
        }
    }
}

fn half_decode<H: Half>(bytes: &[u8], out: &mut [f32]) {
    let mut halves = [H::default(); BATCH];
    for (chunk, dst) in bytes.chunks(2 * BATCH).zip(out.chunks_mut(BATCH)) {
        let h = &mut halves[..dst.len()];
        bytemuck::cast_slice_mut::<H, u8>(h).copy_from_slice(chunk);
        H::convert_to(h, dst);
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// The number of values an encoded tensor claims (the first word), if it has one.
fn claimed_len(bytes: &[u8]) -> Option<usize> {
    (bytes.len() >= 4).then(|| u32_at(bytes, 0) as usize)
}

/// Decodes `bytes` (in `codec`, not [`Codec::None`]) into `out`, resized to the values the
/// record holds, refusing more than `max` values, and every malformed record.
pub fn decode(codec: Codec, bytes: &[u8], max: usize, out: &mut Vec<f32>) -> Result<(), CodecError> {
    let n = claimed_len(bytes).ok_or(CodecError::Length { codec, n: 0, expected: 4, got: bytes.len() })?;
    if n > max {
        return Err(CodecError::TooLong { n, max });
    }
    let expected = match codec {
        Codec::TopK { .. } => {
            let k = if bytes.len() >= 8 { u32_at(bytes, 4) as usize } else { 0 };
            if k > n {
                return Err(CodecError::Kept { k, n });
            }
            8 + 8 * k
        }
        other => wire_len(other, n),
    };
    if bytes.len() != expected {
        return Err(CodecError::Length { codec, n, expected, got: bytes.len() });
    }
    out.clear();
    out.resize(n, 0.0);
    match codec {
        Codec::None => out.copy_from_slice(bytemuck::cast_slice(&bytes[..4 * n])),
        Codec::Fp16 => half_decode::<f16>(&bytes[4..4 + 2 * n], out),
        Codec::Bf16 => half_decode::<bf16>(&bytes[4..4 + 2 * n], out),
        Codec::Int8 { block } => {
            let block = block.max(1) as usize;
            let mut at = 4;
            for dst in out.chunks_mut(block) {
                let scale = f32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
                at += 4;
                let len = dst.len();
                for (d, &q) in dst.iter_mut().zip(&bytes[at..at + len]) {
                    *d = f32::from(q as i8) * scale;
                }
                at += len;
            }
        }
        Codec::SparseLoCo { ppm, .. } => {
            let mut at = 4;
            for (c, dst) in out.chunks_mut(SPARSELOCO_CHUNK).enumerate() {
                let (len, k) = (dst.len(), kept(ppm, dst.len()));
                let lookup: [f32; 4] = std::array::from_fn(|q| {
                    f32::from_le_bytes(bytes[at + 4 * q..at + 4 * q + 4].try_into().expect("4 bytes"))
                });
                let idx = &bytes[at + 16..at + 16 + 2 * k];
                let codes = &bytes[at + 16 + 2 * k..at + 16 + 2 * k + k.div_ceil(4)];
                let mut last: Option<u16> = None;
                for (j, i) in idx.chunks_exact(2).enumerate() {
                    let i = u16::from_le_bytes([i[0], i[1]]);
                    if usize::from(i) >= len || last.is_some_and(|l| i <= l) {
                        let index = (c * SPARSELOCO_CHUNK) as u32 + u32::from(i);
                        return Err(CodecError::Index { index, at: c * SPARSELOCO_CHUNK + j, n });
                    }
                    last = Some(i);
                    let q = (codes[j / 4] >> (2 * (j % 4))) & 3;
                    dst[usize::from(i)] = lookup[usize::from(q)];
                }
                at += 16 + 2 * k + k.div_ceil(4);
            }
        }
        Codec::TopK { .. } => {
            let k = u32_at(bytes, 4) as usize;
            let (idx, vals) = bytes[8..].split_at(4 * k);
            let mut last: Option<u32> = None;
            for (at, (i, v)) in idx.chunks_exact(4).zip(vals.chunks_exact(4)).enumerate() {
                let i = u32::from_le_bytes(i.try_into().expect("4 bytes"));
                if i as usize >= n || last.is_some_and(|l| i <= l) {
                    return Err(CodecError::Index { index: i, at, n });
                }
                last = Some(i);
                out[i as usize] = f32::from_le_bytes(v.try_into().expect("4 bytes"));
            }
        }
    }
    Ok(())
}

/// How one push goes to one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoded {
    /// The values as they are, float32 (nothing left over from earlier pushes).
    Raw,
    /// The bytes [`PushEncoder::encode`] wrote, in this codec.
    Bytes(Codec),
}

/// One shard's push codec and residual.
#[derive(Debug, Clone, Default)]
struct ShardState {
    codec: Codec,
    /// A codec set by a policy, and the first iteration it applies to.
    next: Option<(Codec, u64)>,
    residual: Vec<f32>,
    /// Whether `residual` holds anything but zeros.
    owed: bool,
}

/// A worker's push codecs and error-feedback residuals, one per shard it pushes to; see the
/// module docs.
#[derive(Debug, Clone)]
pub struct PushEncoder {
    worker: WorkerId,
    shards: Vec<ShardState>,
    scratch: Scratch,
}

impl PushEncoder {
    /// For `shards` shards, each pushed to in `codec` until a policy sets another.
    pub fn new(worker: WorkerId, shards: usize, codec: Codec) -> Self {
        let state = ShardState { codec, ..ShardState::default() };
        PushEncoder { worker, shards: vec![state; shards], scratch: Scratch::default() }
    }

    /// A policy's [`Control::SetPushCodec`](syncopate_policy_sdk::abi::Control::SetPushCodec)
    /// for the shard at `index`, applied from `iteration` on (as acknowledged).
    pub fn set(&mut self, index: usize, codec: Codec, iteration: u64) {
        if let Some(s) = self.shards.get_mut(index) {
            s.next = Some((codec, iteration));
        }
    }

    /// The codec pushes of `iteration` to the shard at `index` go in.
    pub fn codec(&mut self, index: usize, iteration: u64) -> Codec {
        let Some(s) = self.shards.get_mut(index) else { return Codec::None };
        if let Some((codec, from)) = s.next {
            if iteration >= from {
                (s.codec, s.next) = (codec, None);
            }
        }
        s.codec
    }

    /// Encodes `values`, the part of iteration `iteration`'s push for the shard at `index`,
    /// with that shard's residual added, into `out`, and keeps the new residual. [`Encoded::Raw`]:
    /// send `values` themselves (the codec is `none` and nothing was owed), `out` untouched.
    pub fn encode(&mut self, index: usize, iteration: u64, values: &[f32], out: &mut Vec<u8>) -> Encoded {
        let codec = self.codec(index, iteration);
        let worker = self.worker;
        let (Some(s), scratch) = (self.shards.get_mut(index), &mut self.scratch) else { return Encoded::Raw };
        if codec == Codec::None && !s.owed {
            return Encoded::Raw;
        }
        if s.residual.len() != values.len() {
            if s.owed {
                tracing::warn!(
                    worker,
                    shard = index,
                    "the shard's size changed: the codec's residual is dropped"
                );
            }
            s.residual = vec![0.0; values.len()];
            s.owed = false;
        }
        scratch.sum.clear();
        match codec {
            Codec::SparseLoCo { beta_milli, .. } => {
                let beta = beta_milli as f32 / 1000.0;
                scratch.sum.extend(values.iter().zip(&s.residual).map(|(v, r)| v + beta * r));
            }
            _ => scratch.sum.extend(values.iter().zip(&s.residual).map(|(v, r)| v + r)),
        }
        let sum = std::mem::take(&mut scratch.sum);
        encode(codec, &sum, Some(&mut s.residual), scratch, out);
        scratch.sum = sum;
        s.owed = codec != Codec::None;
        Encoded::Bytes(codec)
    }

    /// The sum of the values still owed to the shards, over every value of every shard: what
    /// the codecs left out and no push has carried yet (0 when pushes go uncompressed).
    pub fn owed(&self) -> f64 {
        self.shards.iter().flat_map(|s| &s.residual).map(|r| f64::from(*r)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(codec: Codec, values: &[f32]) -> (Vec<f32>, Vec<f32>, usize) {
        let (mut out, mut left, mut back) = (Vec::new(), vec![0.0; values.len()], Vec::new());
        encode(codec, values, Some(&mut left), &mut Scratch::default(), &mut out);
        assert_eq!(out.len(), wire_len(codec, values.len()), "{codec}");
        decode(codec, &out, values.len(), &mut back).unwrap();
        (back, left, out.len())
    }

    /// The vectorized bfloat16 rounding is the `half` crate's, bit for bit: ties to even,
    /// subnormals, infinities, the largest finite values and NaNs.
    #[test]
    fn bf16_rounding_is_the_half_crates() {
        let mut specials =
            vec![0.0f32, -0.0, 1.0, -1.5, f32::MAX, f32::MIN, f32::MIN_POSITIVE, f32::INFINITY];
        specials.extend([
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFFC0_0000),
        ]);
        specials.extend([
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x0000_8001),
        ]);
        let mut x = 0x9e37_79b9u32;
        let spread = (0..100_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in specials.into_iter().chain(spread) {
            let ours = bf16_of(v);
            let theirs = bf16::from_f32(v).to_bits();
            assert!(
                ours == theirs || (v.is_nan() && bf16::from_bits(ours).is_nan()),
                "{v:e}: {ours:#x} against {theirs:#x}"
            );
        }
    }

    #[test]
    fn each_codec_decodes_to_what_it_encoded_less_what_it_says_it_left_out() {
        let values: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        for codec in ["fp16", "bf16", "int8", "int8-16", "topk-0.01", "topk-1", "sparseloco-0.02"] {
            let codec: Codec = codec.parse().unwrap();
            let (back, left, bytes) = roundtrip(codec, &values);
            for ((v, b), l) in values.iter().zip(&back).zip(&left) {
                assert_eq!(v - b, *l, "{codec}: left out is exactly the difference");
            }
            let worst = values.iter().zip(&back).map(|(v, b)| (v - b).abs()).fold(0.0f32, f32::max);
            match codec {
                Codec::Fp16 => assert!(worst < 4e-3 && bytes == 2004),
                Codec::Bf16 => assert!(worst < 3e-2 && bytes == 2004),
                Codec::Int8 { block: 256 } => assert!(worst < 0.03 && bytes == 4 + 4 * 4 + 1000),
                Codec::TopK { ppm: 10_000 } => {
                    assert_eq!(back.iter().filter(|b| **b != 0.0).count(), 10);
                    assert_eq!(bytes, 8 + 80);
                    // The ten kept are the largest magnitudes.
                    let least_kept = back.iter().filter(|b| **b != 0.0).fold(f32::MAX, |m, b| m.min(b.abs()));
                    assert!(left.iter().all(|l| l.abs() <= least_kept));
                }
                Codec::TopK { ppm: 1_000_000 } => assert_eq!(back, values),
                Codec::SparseLoCo { .. } => {
                    // 2% of one (short) chunk: 20 values, in 16 + 40 + 5 bytes after the length.
                    assert_eq!(back.iter().filter(|b| **b != 0.0).count(), 20);
                    assert_eq!(bytes, 4 + 16 + 40 + 8);
                }
                _ => {}
            }
        }
    }

    /// SparseLoCo keeps the top values of each chunk of 4,096 (not of the whole tensor), sends
    /// each in 2 bits that decode to its code's mean, so every code's kept values keep their
    /// sum, and takes about 2.3 bytes a value kept.
    #[test]
    fn sparseloco_keeps_each_chunks_top_values_in_two_bits_that_keep_their_sums() {
        let n = 3 * SPARSELOCO_CHUNK + 1000;
        let mut x = 11u64;
        let values: Vec<f32> = (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Chunk 1 is 100x larger: a global top-k would keep nothing else.
                let scale = if i / SPARSELOCO_CHUNK == 1 { 100.0 } else { 1.0 };
                ((x % 2001) as f32 - 1000.0) / 1000.0 * scale
            })
            .collect();
        let codec: Codec = "sparseloco-0.02".parse().unwrap();
        let (back, left, bytes) = roundtrip(codec, &values);
        let k = kept(20_000, SPARSELOCO_CHUNK);
        assert_eq!(k, 82);
        assert_eq!(bytes, words(4 + 3 * (16 + 2 * 82 + 21) + (16 + 2 * 20 + 5)));
        assert!(bytes * 40 < 4 * n, "about 1.2% of float32's bytes: {bytes} of {}", 4 * n);
        let (mut order, mut sample) = (Vec::new(), Vec::new());
        for (c, (chunk, got)) in
            values.chunks(SPARSELOCO_CHUNK).zip(back.chunks(SPARSELOCO_CHUNK)).enumerate()
        {
            top_k(chunk, kept(20_000, chunk.len()), &mut order, &mut sample);
            let kept_here: Vec<u32> = (0..chunk.len() as u32).filter(|&i| got[i as usize] != 0.0).collect();
            assert_eq!(kept_here, order, "chunk {c}: exactly its own top values");
            let distinct: std::collections::BTreeSet<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert!(distinct.len() <= 5, "chunk {c}: four levels and zero");
            let (sent, orig): (f64, f64) = order
                .iter()
                .map(|&i| (f64::from(got[i as usize]), f64::from(chunk[i as usize])))
                .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
            assert!((sent - orig).abs() < 1e-3 * orig.abs().max(1.0), "chunk {c}: {sent} vs {orig}");
        }
        for ((v, b), l) in values.iter().zip(&back).zip(&left) {
            assert!((v - b - l).abs() <= 1e-6 * v.abs().max(1.0), "left out is the difference");
        }
        // A kept index past its chunk, or out of order, is refused.
        let mut out = Vec::new();
        encode(codec, &values[..100], None, &mut Scratch::default(), &mut out);
        let mut bad = out.clone();
        bad[4 + 16..4 + 18].copy_from_slice(&100u16.to_le_bytes());
        let mut scratch_back = Vec::new();
        assert!(matches!(
            decode(codec, &bad, 100, &mut scratch_back),
            Err(CodecError::Index { index: 100, .. })
        ));
        let mut bad = out.clone();
        let first = [bad[4 + 16], bad[4 + 17]];
        bad[4 + 18..4 + 20].copy_from_slice(&first);
        assert!(matches!(decode(codec, &bad, 100, &mut scratch_back), Err(CodecError::Index { .. })));
        assert!(matches!(
            decode(codec, &out[..out.len() - 4], 100, &mut scratch_back),
            Err(CodecError::Length { .. })
        ));
    }

    /// SparseLoCo's error feedback decays: what was left out is added back times beta, so a
    /// value never kept fades instead of piling up (beta 0: plain top-k of each push alone).
    #[test]
    fn sparseloco_decays_what_it_left_out() {
        let codec = Codec::SparseLoCo { ppm: 1, beta_milli: 500 };
        let mut enc = PushEncoder::new(0, 1, codec);
        let mut out = Vec::new();
        // Value 1 is never the largest: each push leaves it out and the residual converges to
        // 1 / (1 - 0.5) = 2, not to a growing sum.
        for it in 0..30 {
            let g = [10.0f32, 1.0];
            assert!(matches!(enc.encode(0, it, &g, &mut out), Encoded::Bytes(_)));
        }
        assert!((enc.owed() - 2.0).abs() < 1e-3, "owed {}", enc.owed());
    }

    #[test]
    fn malformed_records_are_refused_before_anything_is_sized_by_them() {
        let (mut out, mut left) = (Vec::new(), vec![0.0; 10]);
        let topk = Codec::TopK { ppm: 300_000 };
        let values = [1.0, -5.0, 2.0, 0.0, 3.0, 9.0, 0.5, 0.1, 4.0, -8.0];
        encode(topk, &values, Some(&mut left), &mut Scratch::default(), &mut out);
        let mut back = Vec::new();
        decode(topk, &out, 10, &mut back).unwrap();
        assert_eq!(back, [0.0, -5.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, -8.0]);
        assert_eq!(decode(topk, &out, 9, &mut back), Err(CodecError::TooLong { n: 10, max: 9 }));
        let mut swapped = out.clone();
        swapped[8..12].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(
            decode(topk, &swapped, 10, &mut back),
            Err(CodecError::Index { index: 5, at: 1, .. })
        ));
        let mut far = out.clone();
        far[16..20].copy_from_slice(&10u32.to_le_bytes());
        assert!(matches!(decode(topk, &far, 10, &mut back), Err(CodecError::Index { index: 10, .. })));
        let mut many = out.clone();
        many[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(topk, &many, 10, &mut back), Err(CodecError::Kept { .. })));
        assert!(matches!(decode(topk, &out[..out.len() - 4], 10, &mut back), Err(CodecError::Length { .. })));
        let mut huge = vec![0u8; 8];
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(Codec::Fp16, &huge, 1 << 20, &mut back), Err(CodecError::TooLong { .. })));
        assert!(matches!(
            decode(Codec::Int8 { block: 256 }, &[1, 0], 10, &mut back),
            Err(CodecError::Length { .. })
        ));
    }

    /// The sampled selection keeps exactly the k largest magnitudes, ties to the lower index,
    /// whatever k and however the values are spread (runs of equal values included).
    #[test]
    fn top_k_is_exactly_the_largest_magnitudes() {
        let mut x = 7u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut order, mut sample) = (Vec::new(), Vec::new());
        for n in [1usize, 2, 5, 1000, 4096, 10_000, 50_000] {
            for spread in 0..3 {
                let values: Vec<f32> = (0..n)
                    .map(|i| match spread {
                        0 => (next() % 1000) as f32 - 500.0,
                        1 => (next() % 3) as f32,
                        _ => {
                            if i % 1000 == 0 {
                                1e6
                            } else {
                                (next() % 7) as f32 * 1e-3
                            }
                        }
                    })
                    .collect();
                for k in [1, 2, n / 100, n / 3, n / 2, n.saturating_sub(1), n] {
                    let k = k.clamp(1, n);
                    top_k(&values, k, &mut order, &mut sample);
                    let mut reference: Vec<u32> = (0..n as u32).collect();
                    reference.sort_by_key(|&i| (std::cmp::Reverse(magnitude(values[i as usize])), i));
                    reference.truncate(k);
                    reference.sort_unstable();
                    assert_eq!(order, reference, "n {n}, spread {spread}, k {k}");
                }
            }
        }
    }

    /// Error feedback: over many pushes, the decoded sums fall short of the pushed ones by
    /// exactly the residual still owed, whatever the codecs along the way; a change to `none`
    /// pushes what was owed.
    #[test]
    fn what_a_codec_leaves_out_comes_with_later_pushes() {
        let mut enc = PushEncoder::new(0, 1, Codec::TopK { ppm: 100_000 });
        let (mut pushed, mut got) = (vec![0.0f64; 50], vec![0.0f64; 50]);
        let (mut out, mut back) = (Vec::new(), Vec::new());
        for it in 0..40u64 {
            if it == 10 {
                enc.set(0, Codec::Int8 { block: 16 }, 12);
            }
            if it == 30 {
                enc.set(0, Codec::None, 30);
            }
            let g: Vec<f32> = (0..50).map(|i| ((i as u64 * 7 + it * 13) % 17) as f32 / 16.0 - 0.5).collect();
            for (p, v) in pushed.iter_mut().zip(&g) {
                *p += f64::from(*v);
            }
            match enc.encode(0, it, &g, &mut out) {
                Encoded::Raw => back.clone_from(&g),
                Encoded::Bytes(Codec::None) => back = bytemuck::cast_slice(&out).to_vec(),
                Encoded::Bytes(c) => decode(c, &out, 50, &mut back).unwrap(),
            }
            assert_eq!(
                enc.codec(0, it),
                [Codec::TopK { ppm: 100_000 }, Codec::Int8 { block: 16 }, Codec::None]
                    [usize::from(it >= 12) + usize::from(it >= 30)]
            );
            for (s, v) in got.iter_mut().zip(&back) {
                *s += f64::from(*v);
            }
            if it >= 31 {
                assert!(
                    matches!(enc.encode(0, it, &[0.0; 50], &mut Vec::new()), Encoded::Raw),
                    "nothing owed"
                );
            }
        }
        let short: f64 = pushed.iter().zip(&got).map(|(p, g)| p - g).map(f64::abs).sum();
        assert!(short < 1e-3, "everything arrived once the codec was none: short by {short}");
        assert_eq!(enc.owed(), 0.0);
    }
}
