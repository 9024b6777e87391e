//! What the live dashboard costs per reading of the cluster, at the sizes it must stay usable
//! at (issue 54: 1,000 workers): folding one status into the board (`Board::observe`) and
//! encoding the view sent to every open page, at 10, 100 and 1,000 workers on 8 servers and 32
//! shards. The reading itself (the servers' status) is the path `policy status` and the
//! metrics scrape share, measured in `docs/performance.md`. Run with
//! `cargo bench --bench dashboard`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use syncopate::dashboard::board::made_up::{cluster, W};
use syncopate::dashboard::board::Board;

fn workers(n: u32, t: u64) -> Vec<W> {
    (0..n).map(|w| (w, t * (1 + u64::from(w % 50)), t * u64::from(w) * 1_000_000, 1.0)).collect()
}

fn dashboard(c: &mut Criterion) {
    let mut group = c.benchmark_group("dashboard");
    for n in [10u32, 100, 1000] {
        let readings: Vec<_> = (1..=2).map(|t| cluster(8, 32, "ssp", 0, &workers(n, t))).collect();
        group.bench_with_input(BenchmarkId::new("observe", n), &readings, |b, readings| {
            let mut board = Board::new(0);
            let mut t = 0.0;
            b.iter(|| {
                t += 1.0;
                board.observe(t, &readings[(t as usize) % 2]);
            })
        });
        let mut board = Board::new(0);
        board.observe(1.0, &readings[0]);
        board.observe(2.0, &readings[1]);
        let view = board.view().expect("a view").clone();
        eprintln!(
            "dashboard/{n} workers: a view is {} bytes of JSON",
            serde_json::to_string(&view).unwrap().len()
        );
        group.bench_with_input(BenchmarkId::new("view_json", n), &view, |b, view| {
            b.iter(|| serde_json::to_string(view).unwrap().len())
        });
    }
    group.finish();
}

criterion_group!(benches, dashboard);
criterion_main!(benches);
