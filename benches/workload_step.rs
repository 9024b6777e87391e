//! What one gradient step of each built-in model costs on this machine: the MLP (ndarray), the
//! CNN and the transformer language model (candle), on their real data, at batch 32 (the LM's
//! batch is 32 windows of 64 bytes), and what scoring a model on its held-out data costs (the
//! watcher's look). `docs/workloads.md` records the figures; the simulator's virtual compute
//! time stays the scenario's whatever these are.
//!
//! `workload_step/<workload>`: `Workload::gradient` on worker 0's part of four.
//! `workload_eval/<workload>`: `Evaluator::evaluate` (10,000 test images, or 128 windows of
//! held-out text).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use syncopate_workloads::{by_name, Evaluator, WorkloadOptions};

const WORKLOADS: &[&str] = &["fashion-mlp", "fashion-cnn", "fortunes-lm"];

fn steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("workload_step");
    group.sample_size(10);
    for name in WORKLOADS {
        let opts = WorkloadOptions { part: (0, 4), ..WorkloadOptions::default() };
        let mut w = by_name(name, &opts).expect("the data (scripts/setup.sh installs it)");
        let params = w.init_params(1);
        let mut grad = vec![0.0; params.len()];
        let mut i = 0;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                i += 1;
                w.gradient(0, i, 32, &params, &mut grad)
            })
        });
    }
    group.finish();
    let mut group = c.benchmark_group("workload_eval");
    group.sample_size(10);
    for name in WORKLOADS {
        let opts = WorkloadOptions::default();
        let e = Evaluator::for_workload(name, &opts).unwrap().expect("a held-out set");
        let params = by_name(name, &opts).unwrap().init_params(1);
        group.bench_function(BenchmarkId::from_parameter(name), |b| b.iter(|| e.evaluate(&params)));
    }
    group.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);
