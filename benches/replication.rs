//! What a backup costs a push: synchronous push latency with `--replicas 1` (the shard's
//! primary streams each op to its backup on a second server and acknowledges the push once the
//! backup holds it) against `--replicas 0` (same two servers, no backup), side by side in one
//! run, at 1 KiB, 1 MiB and 16 MiB. The coordinator and both servers are `syncopate` processes
//! (build them first: `cargo build --release --bins`); the worker is a `WorkerClient` in this
//! process, on loopback. One shard (primary on server 0, its backup on server 1), ASP, so no
//! push waits on a policy. The goal (issue 18): at most 1.3x the unreplicated latency at 1 MiB.
//!
//! Each cell also prints the CPU time per push of every process (this one is the worker). The
//! nodes spin as they do by default; `SYNCOPATE_BENCH_SPIN_US=0` turns spinning off, so that
//! CPU time counts work only.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use syncopate::worker::WorkerClient;
use syncopate_suite::{ClusterSpec, ProcessCluster};

const SIZES: &[(&str, usize)] = &[("1KiB", 1 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)];

fn syncopate_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_syncopate"))
}

fn replication(c: &mut Criterion) {
    // The worker and the servers spin as nodes do by default, or as `SYNCOPATE_BENCH_SPIN_US`
    // says (0: no spinning, so that CPU time is work only).
    let spin_us: u64 = std::env::var("SYNCOPATE_BENCH_SPIN_US")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(syncopate::net::spin::DEFAULT_SPIN.as_micros() as u64);
    let rt = syncopate::net::spin::runtime_builder(0, Duration::from_micros(spin_us)).build().unwrap();
    let spin = spin_us.to_string();
    for &(label, bytes) in SIZES {
        let floats = bytes / 4;
        let mut group = c.benchmark_group(format!("replication/{label}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 1 << 20 {
            group.sample_size(20).measurement_time(Duration::from_secs(5));
        }
        for replicas in ["0", "1"] {
            let dir =
                std::env::temp_dir().join(format!("syncopate-bench-repl-{}-{replicas}", std::process::id()));
            let spec = ClusterSpec {
                workers: 1,
                servers: 2,
                shards: 1,
                lr: 0.000001,
                coordinator_args: &["--replicas", replicas],
                server_args: &["--spin-us", &spin],
            };
            let _procs = ProcessCluster::start_spec(&syncopate_bin(), &dir, &spec);
            let access = _procs.access.clone();
            let worker = rt.block_on(async {
                let mut w = WorkerClient::connect(&access, None, floats).await.unwrap();
                w.join(&vec![0.0; floats]).await.unwrap();
                w.ready().await.unwrap();
                w
            });
            // CPU time per push, by process: this one (the worker), the coordinator and the
            // two servers (in the order they started, which need not be their ids'); where the cost
            // goes, and what two cores allow.
            let pids: Vec<u32> = [std::process::id()].into_iter().chain(_procs.pids()).collect();
            let cpu = |pids: &[u32]| -> Vec<f64> {
                pids.iter().map(|&p| syncopate_suite::cpu_seconds(p).unwrap_or(0.0)).collect()
            };
            let before = cpu(&pids);
            let (mut iteration, mut pushes) = (0u64, 0u64);
            group.bench_function(BenchmarkId::new("push", format!("replicas-{replicas}")), |b| {
                b.iter_custom(|n| {
                    pushes += n;
                    rt.block_on(async {
                        let t = Instant::now();
                        for _ in 0..n {
                            worker.push_buffer(iteration, worker.gradient_buffer(), 1).await.unwrap();
                            iteration += 1;
                        }
                        t.elapsed()
                    })
                })
            });
            if pushes > 0 {
                let used: Vec<f64> =
                    cpu(&pids).iter().zip(&before).map(|(a, b)| (a - b) * 1e6 / pushes as f64).collect();
                eprintln!(
                    "replication/{label}/replicas-{replicas}: {:.1} CPU µs per push (worker {:.1}, \
                     coordinator {:.1}, the servers {:.1} and {:.1})",
                    used.iter().sum::<f64>(),
                    used[0],
                    used[1],
                    used[2],
                    used[3]
                );
            }
            drop(worker);
            let _ = std::fs::remove_dir_all(&dir);
        }
        group.finish();
    }
}

criterion_group!(benches, replication);
criterion_main!(benches);
