//! What Prometheus metrics cost a push (issue 54: under 1%): synchronous 1 MiB push latency
//! against a server serving `/metrics` and scraped every second (fifteen times Prometheus's
//! default interval) beside the same against a server without metrics, side by side: two
//! clusters of `syncopate` processes on loopback (build them first: `cargo build --release
//! --bins`), one worker client each in this process, in alternating rounds (the order flips
//! each round, so a drift of the machine's load falls on both alike). Each cluster: a
//! coordinator and one server, one ASP shard, so no push waits on a policy.
//!
//! Prints each side's median time per push with its 95% interval, the ratio of on to off with
//! its interval (Bauer's, over the rounds), and the scrapes taken. `SYNCOPATE_BENCH_ROUNDS`
//! (default 60), `SYNCOPATE_BENCH_PUSHES` (per round, default 40) and
//! `SYNCOPATE_BENCH_SCRAPE_MS` (default 1000) change the run. Run with
//! `cargo bench --bench metrics_cost`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use syncopate::lab::stats::{median_ci, ratio_interval};
use syncopate::worker::WorkerClient;
use syncopate_suite::{ClusterSpec, ProcessCluster};

const BYTES: usize = 1 << 20;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; a filter or `--list` asks for nothing this harness does.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let (rounds, per_round, scrape_ms) = (
        env("SYNCOPATE_BENCH_ROUNDS", 60),
        env("SYNCOPATE_BENCH_PUSHES", 40),
        env("SYNCOPATE_BENCH_SCRAPE_MS", 1000),
    );
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_syncopate"));
    let rt = syncopate::net::spin::runtime_builder(0, syncopate::net::spin::DEFAULT_SPIN).build().unwrap();
    let floats = BYTES / 4;
    let base = std::env::temp_dir().join(format!("syncopate-bench-metrics-{}", std::process::id()));
    let metrics_file = base.join("server.metrics");
    let file_arg = metrics_file.display().to_string();
    let sides: Vec<(&str, Vec<&str>)> =
        vec![("on", vec!["--metrics-listen", "127.0.0.1:0", "--metrics-file", &file_arg]), ("off", vec![])];
    let mut clusters = Vec::new();
    let mut workers = Vec::new();
    for (name, server_args) in &sides {
        let spec = ClusterSpec {
            workers: 1,
            servers: 1,
            shards: 1,
            lr: 0.000001,
            coordinator_args: &[],
            server_args,
        };
        let cluster = ProcessCluster::start_spec(&bin, &base.join(name), &spec);
        let access = cluster.access.clone();
        workers.push(rt.block_on(async {
            let mut w = WorkerClient::connect(&access, None, floats).await.unwrap();
            w.join(&vec![0.0; floats]).await.unwrap();
            w.ready().await.unwrap();
            w
        }));
        clusters.push(cluster);
    }
    let addr = syncopate::http::read_addr(&metrics_file).expect("the server with metrics wrote its address");

    // The scraper: a GET /metrics every `scrape_ms`, as Prometheus would, on its own thread.
    let (stop, scrapes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let scraper = {
        let (stop, scrapes) = (stop.clone(), scrapes.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            while !stop.load(Ordering::Relaxed) {
                if rt.block_on(syncopate::metrics::scrape(addr)).is_ok() {
                    scrapes.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(scrape_ms));
            }
        })
    };

    // Warm-up, then the rounds: seconds per push, by side.
    let mut iterations = [0u64; 2];
    let mut round = |side: usize, n: u64| -> f64 {
        let w = &workers[side];
        let it = &mut iterations[side];
        rt.block_on(async {
            let t = Instant::now();
            for _ in 0..n {
                w.push_buffer(*it, w.gradient_buffer(), 1).await.unwrap();
                *it += 1;
            }
            t.elapsed().as_secs_f64() / n as f64
        })
    };
    round(0, per_round);
    round(1, per_round);
    let mut times = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let t = round(side, per_round);
            times[side].push(t);
        }
    }
    stop.store(true, Ordering::Relaxed);
    scraper.join().unwrap();
    for (side, (name, _)) in sides.iter().enumerate() {
        let e = median_ci(&times[side]);
        let ms = |x: Option<f64>| x.map_or(f64::NAN, |x| x * 1e3);
        println!(
            "metrics {name:>3}: {:.3} ms per 1 MiB push (95% interval {:.3}-{:.3}, {} rounds of {per_round})",
            ms(e.median),
            ms(e.lo),
            ms(e.hi),
            e.n
        );
    }
    match ratio_interval(&times[0], &times[1]) {
        Some(r) => {
            let median = median_ci(&times[0]).median.unwrap_or(f64::NAN)
                / median_ci(&times[1]).median.unwrap_or(f64::NAN);
            println!(
                "on / off: {median:.4} (medians); {:.1}% interval for the factor {:.4}-{:.4}; {} scrapes, one every {scrape_ms} ms",
                r.confidence * 100.0,
                r.lo,
                r.hi,
                scrapes.load(Ordering::Relaxed)
            );
        }
        None => println!("on / off: no interval (a round took no time?)"),
    }
    drop(workers);
    drop(clusters);
    let _ = std::fs::remove_dir_all(&base);
}
