//! What each codec costs per MiB of float32, encoding and decoding, beside `memcpy` of the same
//! buffer (the least any path that touches the tensor pays), in one run.
//!
//! `codec_encode/<codec>`: a worker's push to one shard, as `PushEncoder::encode` does it: the
//! error-feedback residual added, the tensor encoded, the new residual kept (top-k: the
//! selection of the largest magnitudes, and the indices sorted). `codec_decode/<codec>`: a
//! server's decoding of that push into float32. The tensor is 1 MiB of values spread like a
//! gradient's (most small, a few large). `docs/performance.md` puts the figures beside a 1 MiB
//! push's time on loopback.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use syncopate::codec::{self, Codec, Encoded, PushEncoder};

const BYTES: usize = 1 << 20;

/// A gradient-like tensor: a deterministic mix of small values and a few larger ones.
fn tensor() -> Vec<f32> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..BYTES / 4)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 0 {
                u * 10.0
            } else {
                u * 0.01
            }
        })
        .collect()
}

const CODECS: &[&str] = &["fp16", "bf16", "int8", "topk-0.01", "sparseloco-0.02"];

fn codecs(c: &mut Criterion) {
    let values = tensor();
    let mut group = c.benchmark_group("codec_encode");
    group.throughput(Throughput::Bytes(BYTES as u64));
    let mut copy = vec![0.0f32; values.len()];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            copy.copy_from_slice(black_box(&values));
            black_box(&copy);
        })
    });
    for name in CODECS {
        let codec: Codec = name.parse().unwrap();
        let mut enc = PushEncoder::new(0, 1, codec);
        let mut out = Vec::new();
        group.bench_with_input(BenchmarkId::from_parameter(name), &values, |b, v| {
            b.iter(|| {
                let e = enc.encode(0, 0, black_box(v), &mut out);
                assert_eq!(e, Encoded::Bytes(codec));
                black_box(&out);
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("codec_decode");
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            copy.copy_from_slice(black_box(&values));
            black_box(&copy);
        })
    });
    for name in CODECS {
        let codec: Codec = name.parse().unwrap();
        let (mut bytes, mut back) = (Vec::new(), Vec::new());
        codec::encode(codec, &values, None, &mut codec::Scratch::default(), &mut bytes);
        group.bench_with_input(BenchmarkId::from_parameter(name), &bytes, |b, bytes| {
            b.iter(|| {
                codec::decode(codec, black_box(bytes), values.len(), &mut back).unwrap();
                black_box(&back);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, codecs);
criterion_main!(benches);
