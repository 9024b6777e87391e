//! `syncopate local`: start a whole cluster on this machine and train.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::args::{parse_override, tokio, TrainArgs};
use crate::builtin::PolicySpec;
use crate::local::LocalOptions;

/// `syncopate local`.
#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Workers (each a process).
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Servers (each a process).
    #[arg(long, default_value_t = 2)]
    pub servers: u32,
    /// Shards (default: one per server).
    #[arg(long)]
    pub shards: Option<u32>,
    /// The policy: a built-in name or a .wasm file, with its configuration (`ssp:s=3`).
    #[arg(long, default_value = "bsp")]
    pub policy: PolicySpec,
    /// A per-shard configuration override, `SHARD:KEY=VALUE` (repeatable).
    #[arg(long = "shard-config", value_parser = parse_override)]
    pub overrides: Vec<(u32, String, String)>,
    /// The workload.
    #[arg(long, default_value = "counter")]
    pub workload: String,
    /// Parameters of synthetic workloads (`counter`).
    #[arg(long, default_value_t = 1024)]
    pub params: usize,
    /// Iterations per worker.
    #[arg(long, default_value_t = 100)]
    pub iterations: u64,
    /// Mini-batch size.
    #[arg(long, default_value_t = 32)]
    pub batch: u32,
    /// Extra milliseconds per iteration on every worker (pacing).
    #[arg(long, default_value_t = 0)]
    pub delay_ms: u64,
    /// Make worker W slower: `W:MS` adds MS milliseconds per iteration to it (repeatable).
    #[arg(long = "slow-ms", value_parser = parse_slow)]
    pub slow: Vec<(u32, u64)>,
    /// Where the run's files go (default: runs/<time>-<policy>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    #[command(flatten)]
    pub train: TrainArgs,
}

fn parse_slow(s: &str) -> Result<(u32, u64), String> {
    let (w, ms) = s.split_once(':').ok_or("expected WORKER:MS")?;
    Ok((
        w.parse().map_err(|_| "bad worker")?,
        ms.trim_end_matches("ms").parse().map_err(|_| "bad milliseconds")?,
    ))
}

/// Runs `syncopate local`.
pub fn run(a: LocalArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the syncopate executable")?;
    let policy_text = std::iter::once(a.policy.source.clone())
        .chain(a.policy.config.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>();
    let spec = match policy_text.split_first() {
        Some((name, cfg)) if !cfg.is_empty() => format!("{name}:{}", cfg.join(",")),
        _ => a.policy.source.clone(),
    };
    // Fail here, not in a child process, if the policy cannot be found.
    a.policy.bytes()?;
    let run_dir = a.run_dir.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let name =
            std::path::Path::new(&a.policy.source).file_stem().map(|s| s.to_string_lossy().into_owned());
        PathBuf::from("runs").join(format!("{secs}-{}", name.unwrap_or_default()))
    });
    let mut coordinator_args = vec!["--policy".to_string(), spec.clone()];
    if let Some(shards) = a.shards {
        coordinator_args.extend(["--shards".into(), shards.to_string()]);
    }
    for (shard, k, v) in &a.overrides {
        coordinator_args.extend(["--shard-config".into(), format!("{shard}:{k}={v}")]);
    }
    coordinator_args.extend(a.train.to_args());
    let worker_args = [
        ("--workload", a.workload.clone()),
        ("--params", a.params.to_string()),
        ("--iterations", a.iterations.to_string()),
        ("--batch", a.batch.to_string()),
        ("--seed", a.train.seed.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let per_worker_args = (0..a.workers)
        .map(|w| {
            let slow: u64 = a.slow.iter().filter(|(s, _)| *s == w).map(|(_, ms)| ms).sum();
            (w, vec!["--delay-ms".to_string(), (a.delay_ms + slow).to_string()])
        })
        .collect();
    let opts = LocalOptions {
        exe,
        run_dir: run_dir.clone(),
        servers: a.servers,
        workers: a.workers,
        coordinator_args,
        worker_args,
        per_worker_args,
    };
    eprintln!("run directory: {}", run_dir.display());
    let report = tokio()?.block_on(crate::local::run(opts))?;
    println!("policy:     {} (swaps: {})", report.status.policy, report.status.swaps);
    println!("elapsed:    {:.2} s", report.elapsed_s);
    for w in &report.workers {
        println!(
            "worker {:<3} {:>6} iterations  {:>8.2} it/s  waited {:>7.2} s  deferred pulls {:>5}",
            w.worker,
            w.iterations,
            w.iterations as f64 / (w.elapsed_ns as f64 / 1e9).max(1e-9),
            w.wait_ns as f64 / 1e9,
            w.deferred_pulls
        );
    }
    println!(
        "model:      {} parameters, {} steps, saved to {}",
        report.model_len,
        report.model_version,
        report.model_file.display()
    );
    println!("report:     {}", run_dir.join("report.json").display());
    if !report.failed_workers.is_empty() {
        anyhow::bail!(
            "{} of {} workers did not finish: {}",
            report.failed_workers.len(),
            a.workers,
            report
                .failed_workers
                .iter()
                .map(|(w, how)| format!("worker {w} {how}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
