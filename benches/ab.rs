//! The end-to-end A/B group: the same short scenario on a real local cluster (processes over
//! QUIC) under each built-in policy, timed by criterion, so `cargo bench --bench ab` compares the
//! policies with criterion's statistics and HTML reports (`target/criterion/ab-straggler/`).
//!
//! Scenario: 4 workers, 2 servers without backups, the `counter` workload (no data to load), 40 iterations each,
//! 10 ms of emulated compute per iteration, worker 0 three times slower. One sample is one whole
//! run, start-up and shutdown included (about 0.5 s of each sample); the measured time is the
//! run's wall-clock. Build the binary first: `cargo build --release --bins`.
//!
//! A second group, `sim-1000-workers`, times the simulator deciding for 1,000 workers on 4 shards
//! (50 iterations each, no gradients) under each policy: the scale a policy-only study needs.
//! A third, `sim-10000-workers`, times `scenarios/scale-10k.toml` (10,000 workers on 256 shards,
//! 10 iterations each, no gradients) under SSP and ASP; each sample is a whole simulation.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use syncopate::builtin::PolicySpec;
use syncopate::lab::scenario::{RunSpec, Scenario};
use syncopate::lab::sim::{simulate, SimOptions};
use syncopate::runtime::PolicyRuntime;

const POLICIES: &[&str] = &["bsp", "ssp:s=3", "dssp:s_lo=3,s_hi=15", "fluentps:s=3", "r2sp", "epsp", "asp"];

/// The `syncopate` binary, which cargo builds before this target and names here.
fn syncopate_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_syncopate"))
}

fn run(policy: &str, dir: &std::path::Path) -> Duration {
    let _ = std::fs::remove_dir_all(dir);
    let t = Instant::now();
    let status = Command::new(syncopate_bin())
        .args(["local", "--workload", "counter", "--params", "4096", "--workers", "4", "--servers", "2"])
        .args(["--replicas", "0"])
        .args(["--iterations", "40", "--delay-ms", "10", "--slow", "0:3", "--eval-every-ms", "60000"])
        .args(["--policy", policy, "--run-dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("syncopate local starts");
    assert!(status.success(), "{policy}: the run failed; see {}", dir.display());
    t.elapsed()
}

fn ab(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("syncopate-bench-ab-{}", std::process::id()));
    let mut g = c.benchmark_group("ab-straggler");
    g.sample_size(10).warm_up_time(Duration::from_millis(100)).measurement_time(Duration::from_secs(20));
    for policy in POLICIES {
        g.bench_with_input(BenchmarkId::from_parameter(policy), policy, |b, p| {
            b.iter_custom(|iters| (0..iters).map(|_| run(p, &dir)).sum());
        });
    }
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Times the simulator deciding `scenario` (no gradients) under each of `policies`, one group.
fn sim_group(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    scenario: &Scenario,
    policies: &[&str],
) {
    let rt = PolicyRuntime::new().expect("wasm engine");
    for policy in policies {
        let opts = SimOptions {
            run: RunSpec::new(scenario.clone(), policy.parse::<PolicySpec>().expect("policy")),
            gradients: false,
            data: None,
            failures: Vec::new(),
            faults: Default::default(),
        };
        g.bench_with_input(BenchmarkId::from_parameter(policy), &opts, |b, o| {
            b.iter(|| simulate(o, &rt).expect("simulates"));
        });
    }
}

fn sim_scale(c: &mut Criterion) {
    let scenario: Scenario = toml::from_str(
        "name = \"scale\"\nworkers = 1000\nservers = 4\ncompute_ms = 20\niterations = 50\n\
         [[slow]]\nworker = 0\nfactor = 3.0\n[[jitter]]\nworker = 1\nmean_ms = 10.0\nsd_ms = 5.0\n",
    )
    .expect("scenario");
    let mut g = c.benchmark_group("sim-1000-workers");
    g.sample_size(10);
    sim_group(&mut g, &scenario, POLICIES);
    g.finish();
}

fn sim_10k(c: &mut Criterion) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/scale-10k.toml");
    let scenario = Scenario::load(&path).expect("scenario");
    let mut g = c.benchmark_group("sim-10000-workers");
    g.sample_size(10).warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(60));
    sim_group(&mut g, &scenario, &["ssp:s=3", "asp"]);
    g.finish();
}

criterion_group!(benches, ab, sim_scale, sim_10k);
criterion_main!(benches);
