//! `syncopate local`: start a whole cluster on this machine and train.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::args::{tokio, PolicyArgs, SpinArgs, TrainArgs};
use crate::lab::local::{LocalOptions, Watch};
use std::time::Duration;
use syncopate_workloads::WorkloadOptions;

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
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// The workload: fashion-mlp, fashion-softmax, or counter (known values, for checking).
    #[arg(long, default_value = "fashion-mlp")]
    pub workload: String,
    /// Directory with the Fashion-MNIST IDX files.
    #[arg(long, default_value = syncopate_workloads::fashion::DEFAULT_DIR)]
    pub data: PathBuf,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    /// Parameters of the `counter` workload.
    #[arg(long, default_value_t = 1024)]
    pub params: usize,
    /// Passes over each worker's part of the training set (sets the iterations).
    #[arg(long, default_value_t = 2.0, conflicts_with = "iterations")]
    pub epochs: f64,
    /// Iterations per worker (instead of --epochs).
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Mini-batch size.
    #[arg(long, default_value_t = 32)]
    pub batch: u32,
    /// Stop once test accuracy reaches this (0-1).
    #[arg(long)]
    pub target_accuracy: Option<f32>,
    /// Stop after this many seconds of training.
    #[arg(long)]
    pub time_limit_s: Option<f64>,
    /// Score the model on the test set this often, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub eval_every_ms: u64,
    /// Extra compute milliseconds per iteration on every worker (pacing; --slow stretches it).
    #[arg(long, default_value_t = 0)]
    pub delay_ms: u64,
    /// Make worker W compute F times slower: `W:F` (e.g. `0:3`; repeatable).
    #[arg(long, value_parser = parse_slow)]
    pub slow: Vec<(u32, f32)>,
    /// Random delay after each of worker W's iterations, normal: `W:MEAN_MS:SD_MS` (repeatable).
    #[arg(long, value_parser = parse_triple)]
    pub jitter: Vec<(u32, f64, f64)>,
    /// Worker W stalls once: `W:AT_S:FOR_S` (repeatable).
    #[arg(long, value_parser = parse_triple)]
    pub stall: Vec<(u32, f64, f64)>,
    /// Where the run's files go (default: runs/<time>-<policy>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub spin: SpinArgs,
}

fn parse_slow(s: &str) -> Result<(u32, f32), String> {
    let (w, f) = s.split_once(':').ok_or("expected WORKER:FACTOR")?;
    let f: f32 = f.trim_end_matches('x').parse().map_err(|_| format!("`{f}` is not a factor"))?;
    if f < 1.0 {
        return Err("a slowdown factor is at least 1".into());
    }
    Ok((w.parse().map_err(|_| "bad worker")?, f))
}

fn parse_triple(s: &str) -> Result<(u32, f64, f64), String> {
    let mut it = s.split(':');
    let (Some(w), Some(a), Some(b), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err("expected WORKER:A:B".into());
    };
    let num = |x: &str| x.parse::<f64>().map_err(|_| format!("`{x}` is not a number"));
    Ok((w.parse().map_err(|_| "bad worker")?, num(a)?, num(b)?))
}

/// Runs `syncopate local`.
pub fn run(a: LocalArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the syncopate executable")?;
    let spec = a.policy.policy.to_string();
    // Fail here, not in a child process, if the policy cannot be found.
    a.policy.policy.bytes()?;
    let run_dir = a.run_dir.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let name = std::path::Path::new(&a.policy.policy.source)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned());
        PathBuf::from("runs").join(format!("{secs}-{}", name.unwrap_or_default()))
    });
    let mut coordinator_args = vec!["--policy".to_string(), spec.clone()];
    if let Some(shards) = a.shards {
        coordinator_args.extend(["--shards".into(), shards.to_string()]);
    }
    for (shard, k, v) in &a.policy.overrides {
        coordinator_args.extend(["--shard-config".into(), format!("{shard}:{k}={v}")]);
    }
    coordinator_args.extend(a.train.to_args());
    let iterations = match a.iterations {
        Some(i) => i,
        None if a.workload.starts_with("fashion") => {
            let part = 60_000.0 / f64::from(a.workers.max(1));
            (a.epochs * part / f64::from(a.batch.max(1))).ceil() as u64
        }
        None => 100,
    };
    let worker_args = [
        ("--workload", a.workload.clone()),
        ("--params", a.params.to_string()),
        ("--data", a.data.display().to_string()),
        ("--hidden", a.hidden.to_string()),
        ("--iterations", iterations.to_string()),
        ("--batch", a.batch.to_string()),
        ("--seed", a.train.seed.to_string()),
        ("--delay-ms", a.delay_ms.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .chain(a.spin.to_args())
    .collect();
    let per_worker_args = (0..a.workers)
        .map(|w| {
            let mut args = vec!["--part".to_string(), format!("{w}/{}", a.workers)];
            if let Some((_, f)) = a.slow.iter().find(|(s, _)| *s == w) {
                args.extend(["--slow-factor".into(), f.to_string()]);
            }
            if let Some((_, m, sd)) = a.jitter.iter().find(|(s, ..)| *s == w) {
                args.extend(["--jitter-ms".into(), format!("{m}:{sd}")]);
            }
            if let Some((_, at, len)) = a.stall.iter().find(|(s, ..)| *s == w) {
                args.extend(["--stall".into(), format!("{at}:{len}")]);
            }
            (w, args)
        })
        .collect();
    let watch = Watch {
        workload: a.workload.clone(),
        options: WorkloadOptions {
            params: a.params,
            data_dir: a.data.clone(),
            part: (0, 1),
            hidden: a.hidden,
            seed: a.train.seed,
        },
        every: Duration::from_millis(a.eval_every_ms.max(50)),
        stop: crate::lab::report::StopRules {
            target_accuracy: a.target_accuracy,
            time_limit_s: a.time_limit_s,
        },
        iterations,
    };
    let opts = LocalOptions {
        exe,
        run_dir: run_dir.clone(),
        servers: a.servers,
        workers: a.workers,
        coordinator_args,
        server_args: a.spin.to_args().to_vec(),
        worker_args,
        per_worker_args,
        watch,
    };
    eprintln!("run directory: {}", run_dir.display());
    let report = tokio()?.block_on(crate::lab::local::run(opts))?;
    println!("policy:     {} (swaps: {})", report.policy, report.swaps);
    println!("elapsed:    {:.2} s", report.elapsed_s);
    for w in &report.workers {
        println!(
            "worker {:<3} {:>6} iterations  {:>8.2} it/s  in pulls {:>7.2} s  deferred pulls {:>5}",
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
        report.model_file.as_deref().unwrap_or(std::path::Path::new("-")).display()
    );
    if let Some(acc) = report.final_accuracy {
        println!("accuracy:   {:.2}% on the 10,000 test images (final model)", acc * 100.0);
    }
    if let Some(acc) = report.best_accuracy {
        println!(
            "best:       {:.2}% seen while training; that model is {}",
            acc * 100.0,
            run_dir.join("model-best.bin").display()
        );
    }
    if let Some(target) = a.target_accuracy {
        match report.time_to_target_s {
            Some(t) => println!("target:     {:.1}% reached after {t:.1} s", target * 100.0),
            None => println!("target:     {:.1}% not reached", target * 100.0),
        }
    }
    for p in &report.plots {
        println!("plot:       {}", p.display());
    }
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
