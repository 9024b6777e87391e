//! Push and pull throughput over the real stack: a coordinator and one server (an ASP shard, so
//! no request waits on a policy) run as `syncopate` processes, as in a deployment; the workers
//! are `WorkerClient`s in this process, talking QUIC with TLS on loopback. Build the binary
//! first: `cargo build --release --bins`. Sizes 1 KiB, 64 KiB, 1 MiB and 16 MiB; synchronous
//! (one request at a time) and with 8 requests in flight (8 workers, each synchronous). A push
//! hands its gradient buffer to QUIC (`push_buffer`; `push-borrowed` measures `push(&grad)`,
//! which QUIC copies) and includes the server's SGD step; a pull sends the shard's parameters
//! (shared, not copied). Compare with ps-lite's figures in the README.
//!
//! Environment: `SYNCOPATE_BENCH_SPIN_US` sets how long clients and server spin before they
//! sleep (default: the nodes' default, [`syncopate::net::spin::DEFAULT_SPIN`]; 0 turns it off);
//! `SYNCOPATE_BENCH_SERVER_THREADS` the server's runtime threads (default 0, one thread).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use syncopate::worker::WorkerClient;
use syncopate_suite::ProcessCluster;

const SIZES: &[(&str, usize)] =
    &[("1KiB", 1 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)];
const IN_FLIGHT: usize = 8;

struct Cluster {
    workers: Vec<WorkerClient>,
    iteration: Vec<u64>,
    /// This process's id and the nodes', whose CPU time each cell reports.
    pids: Vec<u32>,
    _procs: ProcessCluster,
}

/// User and system CPU seconds the processes have used so far.
fn cpu_seconds(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&p| syncopate_suite::cpu_seconds(p)).sum()
}

/// The `syncopate` binary, which cargo builds before this target and names here.
fn syncopate_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_syncopate"))
}

/// A coordinator and one server (with `threads` runtime threads, spinning up to `spin_us`), as
/// processes, and 8 workers in this process.
async fn cluster(dir: &Path, floats: usize, threads: usize, spin_us: u64) -> Cluster {
    let (threads, spin_us) = (threads.to_string(), spin_us.to_string());
    let server_args = ["--threads", &threads, "--spin-us", &spin_us];
    let procs = ProcessCluster::start(&syncopate_bin(), dir, IN_FLIGHT, 1, 0.000001, &server_args);
    let access = procs.access.clone();
    let joins = (0..IN_FLIGHT).map(|_| {
        let access = access.clone();
        async move {
            let mut w = WorkerClient::connect(&access, None, floats).await.unwrap();
            w.join(&vec![0.0; floats]).await.unwrap();
            w.ready().await.unwrap();
            w
        }
    });
    let workers = futures::future::join_all(joins).await;
    let pids = [std::process::id()].into_iter().chain(procs.pids()).collect();
    Cluster { iteration: vec![0; workers.len()], workers, pids, _procs: procs }
}

fn transport(c: &mut Criterion) {
    // Clients and server spin as `syncopate` nodes do by default (`net::spin`), or as this says.
    let spin_us: u64 = std::env::var("SYNCOPATE_BENCH_SPIN_US")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(syncopate::net::spin::DEFAULT_SPIN.as_micros() as u64);
    let rt = syncopate::net::spin::runtime_builder(0, Duration::from_micros(spin_us)).build().unwrap();
    let threads: usize =
        std::env::var("SYNCOPATE_BENCH_SERVER_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("syncopate-bench-{}", std::process::id()));
    for &(label, bytes) in SIZES {
        let floats = bytes / 4;
        let mut cl = rt.block_on(cluster(&dir, floats, threads, spin_us));
        let grad = vec![1.0f32; floats];
        let mut group = c.benchmark_group(format!("transport/{label}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 1 << 20 {
            group.sample_size(10).measurement_time(Duration::from_secs(4));
        }
        // Pushes hand QUIC the gradient buffer (`push_buffer`), as a workload that cares about
        // speed does; its contents are whatever the reused buffer holds (the server checks
        // them only for being finite). `push-borrowed` is `push(&grad)`, one copy more.
        let pids = cl.pids.clone();
        let mut cell = |name: &str, mode: &str, run: &mut dyn FnMut(u64) -> Duration| {
            let (cpu, mut requests) = (cpu_seconds(&pids), 0);
            group.bench_function(BenchmarkId::new(name, mode), |b| {
                b.iter_custom(|n| {
                    requests += n;
                    run(n)
                })
            });
            if requests == 0 {
                return; // filtered out
            }
            let per_gb = (cpu_seconds(&pids) - cpu) / (requests as f64 * bytes as f64 / 1e9);
            eprintln!("transport/{label}/{name}/{mode}: {per_gb:.3} CPU s per GB (client and server)");
        };
        let (rt, cl, grad) = (&rt, &mut cl, &grad);
        cell("push", "sync", &mut |n| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..n {
                    let w = &cl.workers[0];
                    w.push_buffer(cl.iteration[0], w.gradient_buffer(), 1).await.unwrap();
                    cl.iteration[0] += 1;
                }
                t.elapsed()
            })
        });
        cell("push-borrowed", "sync", &mut |n| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..n {
                    cl.workers[0].push(cl.iteration[0], grad, 1).await.unwrap();
                    cl.iteration[0] += 1;
                }
                t.elapsed()
            })
        });
        let mut out = vec![0.0f32; floats];
        cell("pull", "sync", &mut |n| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..n {
                    cl.workers[0].pull(cl.iteration[0], &mut out).await.unwrap();
                }
                t.elapsed()
            })
        });
        cell("push", "8-in-flight", &mut |n| {
            rt.block_on(async {
                let per = n.div_ceil(IN_FLIGHT as u64);
                let t = Instant::now();
                let all = cl.workers.iter().zip(cl.iteration.iter_mut()).map(|(w, it)| async move {
                    for _ in 0..per {
                        w.push_buffer(*it, w.gradient_buffer(), 1).await.unwrap();
                        *it += 1;
                    }
                });
                futures::future::join_all(all).await;
                t.elapsed().mul_f64(n as f64 / (per * IN_FLIGHT as u64) as f64)
            })
        });
        let mut outs = vec![vec![0.0f32; floats]; IN_FLIGHT];
        cell("pull", "8-in-flight", &mut |n| {
            rt.block_on(async {
                let per = n.div_ceil(IN_FLIGHT as u64);
                let t = Instant::now();
                let all = cl.workers.iter().zip(outs.iter_mut()).zip(&cl.iteration).map(
                    |((w, out), it)| async move {
                        for _ in 0..per {
                            w.pull(*it, out).await.unwrap();
                        }
                    },
                );
                futures::future::join_all(all).await;
                t.elapsed().mul_f64(n as f64 / (per * IN_FLIGHT as u64) as f64)
            })
        });
        group.finish();
        // What QUIC saw on worker 0's connection: a low MTU or many losses explain a slow row.
        for (addr, st) in cl.workers[0].connection_stats() {
            eprintln!(
                "transport/{label}: {addr}: path MTU {} B, RTT {:?}, lost {} of {} packets, {} congestion events, cwnd {}",
                st.path.current_mtu, st.path.rtt, st.path.lost_packets, st.path.sent_packets, st.path.congestion_events, st.path.cwnd
            );
            // Packets per send batch (segmentation offload) and ACK frames each way: how many
            // per-packet costs a byte pays. quinn counts a receive per packet, so only the
            // datagrams are printed for that direction.
            eprintln!(
                "transport/{label}: {addr}: sent {} datagrams in {} batches, received {}; ACK frames sent {}, received {}",
                st.udp_tx.datagrams, st.udp_tx.ios, st.udp_rx.datagrams, st.frame_tx.acks, st.frame_rx.acks
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, transport);
criterion_main!(benches);
