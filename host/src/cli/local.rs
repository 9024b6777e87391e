//! `syncopate local`: start a whole cluster on this machine and train.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::args::{tokio, FaultArgs, PlacementArg, PolicyArgs, SpinArgs, TrainArgs};
use super::resume;
use crate::lab::local::LocalOptions;
use crate::lab::scenario::{Jitter, KillServer, RunSpec, Scenario, Slow, Stall};

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
    /// The workload's data directory (default: where its Debian package installs it:
    /// /usr/share/datasets/fashion-mnist, or /usr/share/games/fortunes for fortunes-lm).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Record every shard's policy events into DIR (one file per shard), for
    /// `syncopate policy replay`.
    #[arg(long, value_name = "DIR")]
    pub record: Option<PathBuf>,
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
    #[arg(long, conflicts_with_all = ["target_loss", "target_perplexity"])]
    pub target_accuracy: Option<f32>,
    /// Stop once the held-out loss is at most this (nats; for fortunes-lm, per byte).
    #[arg(long, conflicts_with = "target_perplexity")]
    pub target_loss: Option<f32>,
    /// Stop once the held-out perplexity (the exponential of the loss) is at most this.
    #[arg(long)]
    pub target_perplexity: Option<f32>,
    /// Stop after this many seconds of training.
    #[arg(long)]
    pub time_limit_s: Option<f64>,
    /// Score the model on the test set this often, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub eval_every_ms: u64,
    /// Extra compute milliseconds per iteration on every worker (pacing; --slow stretches it).
    #[arg(long, default_value_t = 0)]
    pub delay_ms: u64,
    /// Make worker W compute F times slower: `W:F` (e.g. `0:3`), or only from FROM_S until
    /// UNTIL_S seconds after it started: `W:F:FROM_S:UNTIL_S` (repeatable).
    #[arg(long, value_parser = parse_slow)]
    pub slow: Vec<Slow>,
    /// Random delay after each of worker W's iterations, normal: `W:MEAN_MS:SD_MS`, or only
    /// for a while: `W:MEAN_MS:SD_MS:FROM_S:UNTIL_S` (repeatable).
    #[arg(long, value_parser = parse_jitter)]
    pub jitter: Vec<Jitter>,
    /// Worker W stalls once: `W:AT_S:FOR_S` (repeatable).
    #[arg(long, value_parser = parse_triple)]
    pub stall: Vec<(u32, f64, f64)>,
    /// A failure drill: SIGKILL server S `AT_S` seconds into training: `S:AT_S` (needs
    /// backups, so two servers or more and not `--replicas 0`; its backups take over).
    #[arg(long, value_parser = parse_kill)]
    pub kill_server: Option<(u32, f64)>,
    /// A failure drill: SIGKILL the coordinator AT_S seconds into training. The launcher starts
    /// it again at the same address (as it does a coordinator that dies on its own), and the
    /// servers and workers rejoin it.
    #[arg(long, value_name = "AT_S")]
    pub kill_coordinator: Option<f64>,
    /// Write TensorBoard event files of the run's figures (accuracy, loss, iterations per
    /// second, waiting share, deferred pulls, the policy's metrics) into DIR as it runs.
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Serve a live dashboard of the run in the browser (the coordinator's; by default on
    /// loopback at a free port, printed at start with the operator token in its fragment, and
    /// named in `cluster.json`). ADDR chooses the address.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
    pub dashboard: Option<std::net::SocketAddr>,
    /// Where the run's files go (default: runs/<time>-<policy>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Do not check a policy module file before the run (`policy check` in brief: a module
    /// that breaks a rule in a generated case is refused).
    #[arg(long)]
    pub no_check: bool,
    /// Where momentum and weight decay run: `server` (on every admitted gradient) or `worker`
    /// (each worker on its own gradients, the servers plain SGD: FluentPS's placement).
    #[arg(long, value_enum, default_value = "server")]
    pub optimizer_on: PlacementArg,
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub faults: FaultArgs,
    #[command(flatten)]
    pub spin: SpinArgs,
    /// Run this training script as every worker, instead of a built-in workload: its path,
    /// then its arguments. Must come last: everything after it is the script's. A `.py` file
    /// runs under `$SYNCOPATE_PYTHON` (default `python3`). Without --iterations, the script ends
    /// its own loop.
    #[arg(long, num_args = 1.., allow_hyphen_values = true, value_name = "SCRIPT [ARGS]...")]
    pub script: Vec<String>,
}

/// An optional `:FROM_S:UNTIL_S` window after a device's fields.
fn parse_window(rest: &[&str]) -> Result<(Option<f64>, Option<f64>), String> {
    let num = |x: &str| x.parse::<f64>().map_err(|_| format!("`{x}` is not a number of seconds"));
    match rest {
        [] => Ok((None, None)),
        [from, until] => {
            let (from, until) = (Some(num(from)?), Some(num(until)?));
            crate::lab::scenario::window_ns(from, until)?;
            Ok((from, until))
        }
        _ => Err("a window is FROM_S:UNTIL_S".into()),
    }
}

fn parse_slow(s: &str) -> Result<Slow, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [w, f, rest @ ..] = parts.as_slice() else {
        return Err("expected WORKER:FACTOR[:FROM_S:UNTIL_S]".into());
    };
    let factor: f32 = f.trim_end_matches('x').parse().map_err(|_| format!("`{f}` is not a factor"))?;
    if factor < 1.0 {
        return Err("a slowdown factor is at least 1".into());
    }
    let (from_s, until_s) = parse_window(rest)?;
    Ok(Slow { worker: w.parse().map_err(|_| "bad worker")?, factor, from_s, until_s })
}

fn parse_jitter(s: &str) -> Result<Jitter, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [w, mean, sd, rest @ ..] = parts.as_slice() else {
        return Err("expected WORKER:MEAN_MS:SD_MS[:FROM_S:UNTIL_S]".into());
    };
    let num = |x: &str| x.parse::<f64>().map_err(|_| format!("`{x}` is not a number"));
    let (from_s, until_s) = parse_window(rest)?;
    let worker = w.parse().map_err(|_| "bad worker")?;
    Ok(Jitter { worker, mean_ms: num(mean)?, sd_ms: num(sd)?, from_s, until_s })
}

fn parse_kill(s: &str) -> Result<(u32, f64), String> {
    let (server, at) = s.split_once(':').ok_or("expected SERVER:AT_S")?;
    let at_s = at.parse::<f64>().map_err(|_| format!("`{at}` is not a number of seconds"))?;
    Ok((server.parse().map_err(|_| format!("`{server}` is not a server"))?, at_s))
}

fn parse_triple(s: &str) -> Result<(u32, f64, f64), String> {
    let mut it = s.split(':');
    let (Some(w), Some(a), Some(b), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err("expected WORKER:A:B".into());
    };
    let num = |x: &str| x.parse::<f64>().map_err(|_| format!("`{x}` is not a number"));
    Ok((w.parse().map_err(|_| "bad worker")?, num(a)?, num(b)?))
}

/// The typed run these flags describe, and the launcher's settings.
fn options(a: &LocalArgs, exe: PathBuf) -> anyhow::Result<LocalOptions> {
    let run_dir = a.run_dir.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // A resumed run is named by the policy its checkpoint restores (a hot swap may have
        // changed it since the start).
        let restored = a.faults.resume.as_deref().and_then(|d| restored_policy(&resume_dir(d).ok()?));
        let name = restored.or_else(|| {
            std::path::Path::new(&a.policy.policy.source)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
        });
        PathBuf::from("runs").join(format!("{secs}-{}", name.unwrap_or_default()))
    });
    let iterations = match a.iterations {
        Some(i) => i,
        None if !a.script.is_empty() => u64::MAX / 4,
        None => {
            let wopts = syncopate_workloads::WorkloadOptions {
                data_dir: a.data.clone(),
                hidden: a.hidden,
                params: a.params,
                ..Default::default()
            };
            match syncopate_workloads::epoch_len(&a.workload, &wopts)? {
                Some(samples) => {
                    let part = samples as f64 / f64::from(a.workers.max(1));
                    (a.epochs * part / f64::from(a.batch.max(1))).ceil() as u64
                }
                None => 100,
            }
        }
    };
    let scenario = Scenario {
        name: "local".into(),
        description: String::new(),
        workload: if a.script.is_empty() { a.workload.clone() } else { "script".into() },
        hidden: a.hidden,
        params: a.params,
        workers: a.workers,
        servers: a.servers,
        shards: a.shards,
        batch: a.batch,
        compute_ms: a.delay_ms,
        target_accuracy: a.target_accuracy,
        target_loss: a.target_loss,
        target_perplexity: a.target_perplexity,
        time_limit_s: a.time_limit_s,
        iterations: Some(iterations),
        eval_every_ms: a.eval_every_ms,
        seed: a.train.seed,
        latency_us: crate::lab::scenario::DEFAULT_LATENCY_US,
        bandwidth_mbit: None,
        trace: None,
        lr: Some(a.train.lr),
        momentum: Some(a.train.momentum),
        weight_decay: Some(a.train.weight_decay),
        optimizer_on: a.optimizer_on.into(),
        push_weight: Some(a.train.push_weight()),
        local_steps: Some(a.train.local_steps),
        outer_lr: Some(a.train.outer_lr),
        outer_momentum: Some(a.train.outer_momentum),
        outer_nesterov: Some(a.train.outer_nesterov),
        push_codec: Some(a.train.push_codec),
        pull_codec: Some(a.train.pull_codec),
        modelled: None,
        slow: a.slow.clone(),
        jitter: a.jitter.clone(),
        stall: a.stall.iter().map(|&(worker, at_s, for_s)| Stall { worker, at_s, for_s }).collect(),
        link: Vec::new(),
        script: a.script.clone(),
        replicas: a.faults.replicas(a.servers),
        kill_server: a.kill_server.map(|(server, at_s)| KillServer { server, at_s }),
        no_progress_s: Some(a.train.no_progress_s),
    };
    scenario.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let run = RunSpec::with_pilot(
        scenario,
        a.policy.policy.clone(),
        a.policy.overrides.clone(),
        a.policy.pilot.clone(),
    );
    Ok(LocalOptions {
        data: a.data.clone(),
        spin_us: a.spin.spin_us,
        peer_timeout_ms: a.train.peer_timeout_ms,
        record: a.record.as_deref().map(std::path::absolute).transpose()?,
        checkpoint_dir: Some(std::path::absolute(
            a.faults.checkpoint_dir.clone().unwrap_or_else(|| run_dir.join("checkpoints")),
        )?),
        checkpoint_every_s: a.faults.checkpoint_every_s,
        resume: a.faults.resume.as_deref().map(resume_dir).transpose()?,
        kill_coordinator_s: a.kill_coordinator,
        tensorboard: a.tensorboard.clone(),
        dashboard: a.dashboard,
        ..LocalOptions::new(exe, run_dir, run)
    })
}

/// The checkpoint directory `--resume DIR` names: a run directory's checkpoints, wherever its
/// `--checkpoint-dir` put them (its `command.json` says), or its `checkpoints/` folder, so that
/// `--resume runs/<run>` continues that run; else DIR itself.
fn resume_dir(dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    if !dir.is_dir() {
        anyhow::bail!("--resume {}: no such directory", dir.display());
    }
    let inner = dir.join("checkpoints");
    let dir = match kept_checkpoint_dir(&dir.join("command.json")) {
        Some(elsewhere) => elsewhere,
        None if inner.is_dir() => inner,
        None => dir.to_path_buf(),
    };
    if !dir.is_dir() {
        anyhow::bail!("--resume: the run's checkpoint directory {} is gone", dir.display());
    }
    Ok(std::path::absolute(dir)?)
}

/// The `--checkpoint-dir` a run kept in `command` (its `command.json`) was started with, if any.
fn kept_checkpoint_dir(command: &std::path::Path) -> Option<PathBuf> {
    let args = resume::kept_args(command)?;
    let at = args.iter().position(|a| a == "--checkpoint-dir")?;
    args.get(at + 1).map(PathBuf::from)
}

/// What a run's `command.json` is called in its checkpoint directory, beside the checkpoints,
/// so that `--resume DIR` alone finds how the run was started there too.
const KEPT_IN_CHECKPOINTS: &str = "local.json";

/// The failure drills and injected stalls of a run: a resumed run does them again only if they
/// are given again.
const DRILLS: &[&str] = &["--kill-server", "--kill-coordinator", "--stall"];

/// Flags a resumed run may set anew: when to stop, what to watch and record, and where; not
/// what the run is (its cluster, workload, policy, budget, seeds and devices).
const CHANGEABLE: &[&str] = &[
    "--time-limit-s",
    "--target-accuracy",
    "--eval-every-ms",
    "--record",
    "--tensorboard",
    "--dashboard",
    "--checkpoint-every-s",
    "--checkpoint-dir",
    "--kill-server",
    "--kill-coordinator",
    "--stall",
    "--run-dir",
    "--resume",
    "--no-check",
];

/// The policy the newest checkpoint in `dir` holds (its manifest's), to name a resumed run by.
fn restored_policy(dir: &std::path::Path) -> Option<String> {
    let newest = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("ckpt-")))
        .max()?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(newest.join("manifest.json")).ok()?).ok()?;
    manifest["policy"].as_str().map(|p| p.strip_prefix("builtin:").unwrap_or(p).to_string())
}

/// Runs `syncopate local`.
pub fn run(a: LocalArgs) -> anyhow::Result<()> {
    let now = resume::given("local");
    // `--resume <run>` continues the run with the settings its `command.json` kept.
    let kept =
        a.faults.resume.as_deref().map(|d| {
            [d.join("command.json"), d.join(KEPT_IN_CHECKPOINTS), d.join("..").join("command.json")]
        });
    let resumed = kept.map(|files| resume::resumed(&files, &now, CHANGEABLE, DRILLS)).transpose()?.flatten();
    let (a, args) = match resumed {
        Some(merged) => match resume::parse("local", &merged)? {
            super::Command::Local(resumed) => (resumed, merged),
            _ => unreachable!("parsed as `local`"),
        },
        None => (a, now),
    };
    let exe = std::env::current_exe().context("cannot find the syncopate executable")?;
    // Fail here, not in a child process, if the policy cannot be found, or breaks a rule.
    a.policy.policy.bytes()?;
    if !a.no_check && !a.policy.policy.is_builtin() && a.faults.resume.is_none() {
        let rt = crate::runtime::PolicyRuntime::new()?;
        super::policy::quick_check(&rt, &a.policy.policy)
            .context("the policy was not started (--no-check starts it unchecked)")?;
    }
    if let Some(pilot) = a.policy.pilot.as_ref().filter(|p| !p.is_builtin() && !a.no_check) {
        let rt = crate::runtime::PolicyRuntime::new()?;
        super::policy::quick_check(&rt, pilot)
            .context("the cluster policy was not started (--no-check starts it unchecked)")?;
    }
    let opts = options(&a, exe)?;
    let run_dir = opts.run_dir.clone();
    let target = opts.run.scenario.target();
    eprintln!("run directory: {}", run_dir.display());
    // What this run was started with, for a later `--resume` (`--run-dir` and `--resume` are
    // the new run's own).
    let args = resume::absolute_paths(&args, &["--checkpoint-dir", "--record", "--data"]);
    resume::remember(&run_dir.join("command.json"), &args, &["--run-dir", "--resume"])?;
    if let Some(dir) = &a.faults.checkpoint_dir {
        resume::remember(&dir.join(KEPT_IN_CHECKPOINTS), &args, &["--run-dir", "--resume"])?;
    }
    let report = tokio()?.block_on(crate::lab::local::run(opts))?;
    println!("policy:     {} (swaps: {})", report.policy, report.swaps);
    println!("elapsed:    {:.2} s", report.elapsed_s);
    if report.phases.len() > 1 {
        for p in &report.phases {
            println!(
                "phase:      {:<14} {:>6.1}-{:<6.1} s  {:>8.1} it/s (all workers)  deferred pulls {:>5} ({:.2} s)",
                p.policy, p.from_s, p.to_s, p.iterations_per_s, p.deferred_pulls, p.deferred_s
            );
        }
    }
    for f in &report.failovers {
        println!("failover:   server {} lost at {:.1} s; its shards' backups took over", f.server, f.t_s);
    }
    // Per worker: how fast, how long computing, how long waiting (for pulls a policy deferred,
    // for pushes a policy held: both count), so a straggler and what the policy does about it
    // show.
    for w in &report.workers {
        let s = |ns: u64| ns as f64 / 1e9;
        println!(
            "worker {:<3} {:>6} iterations  {:>8.2} it/s  computing {:>7.2} s  waiting {:>7.2} s ({:>3.0}%: pulls {:.2} s, {} deferred; acks {:.2} s)",
            w.worker,
            w.iterations,
            w.iterations as f64 / s(w.elapsed_ns).max(1e-9),
            s(w.compute_ns),
            s(w.wait_ns + w.push_wait_ns),
            100.0 * (w.wait_ns + w.push_wait_ns) as f64 / w.elapsed_ns.max(1) as f64,
            s(w.wait_ns),
            w.deferred_pulls,
            s(w.push_wait_ns),
        );
    }
    // What a stop found stuck: pulls and pushes a policy never decided.
    for w in &report.workers {
        for what in &w.abandoned {
            println!("stopped:    worker {} gave up {what}", w.worker);
        }
    }
    println!(
        "model:      {} parameters, {} steps, saved to {}",
        report.model_len,
        report.model_version,
        report.model_file.as_deref().unwrap_or(std::path::Path::new("-")).display()
    );
    if !a.script.is_empty() {
        // The script scores its own model; the launcher only relays what it reported.
        if let Some(acc) = report.final_accuracy {
            println!("accuracy:   {:.2}% (the script's last reported score)", acc * 100.0);
        }
        if let Some(acc) = report.best_accuracy {
            println!("best:       {:.2}% reported while training", acc * 100.0);
        }
    } else if syncopate_workloads::is_language_model(&a.workload) {
        if let (Some(loss), Some(acc)) = (report.final_loss, report.final_accuracy) {
            println!(
                "loss:       {loss:.3} nats per byte (perplexity {:.2}), next byte right {:.1}%, on the held-out fortunes (final model)",
                loss.exp(),
                acc * 100.0
            );
        }
        if let Some(loss) = report.best_loss {
            println!("best:       {loss:.3} (perplexity {:.2}) seen while training", loss.exp());
        }
    } else {
        if let Some(acc) = report.final_accuracy {
            println!("accuracy:   {:.2}% on the 10,000 test images (final model)", acc * 100.0);
        }
        if let Some(acc) = report.best_accuracy {
            println!("best:       {:.2}% seen while training", acc * 100.0);
        }
    }
    if report.best_accuracy.is_some() && a.script.is_empty() {
        println!("best model: {}", run_dir.join("model-best.bin").display());
    }
    if let Some(target) = target {
        match report.time_to_target_s {
            Some(t) => println!("target:     {} reached after {t:.1} s", target.describe()),
            None => println!("target:     {} not reached", target.describe()),
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};
    use super::*;

    fn parse(args: &[&str]) -> Command {
        Cli::try_parse_from(std::iter::once("syncopate").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .command
    }

    /// `local`'s flags become one typed run, and the flags the launcher gives each role parse
    /// back, through the roles' own parsers, into the same settings.
    #[test]
    fn local_flags_become_a_run_spec_whose_role_flags_parse_back_into_it() {
        let Command::Local(a) = parse(&[
            "local",
            "--workers",
            "3",
            "--servers",
            "2",
            "--shards",
            "3",
            "--policy",
            "ssp:s=3",
            "--shard-config",
            "1:s=5",
            "--workload",
            "counter",
            "--params",
            "77",
            "--iterations",
            "9",
            "--lr",
            "0.5",
            "--momentum",
            "0.5",
            "--optimizer-on",
            "worker",
            "--push-weight",
            "sum",
            "--seed",
            "7",
            "--delay-ms",
            "4",
            "--slow",
            "1:2.5",
            "--slow",
            "0:3:10:20.5",
            "--jitter",
            "2:10:5",
            "--stall",
            "0:1.5:2",
            "--spin-us",
            "0",
            "--time-limit-s",
            "30",
            "--run-dir",
            "/tmp/x",
        ]) else {
            panic!("not local")
        };
        let o = options(&a, "syncopate".into()).unwrap();
        let sc = &o.run.scenario;
        assert_eq!(
            (sc.workers, sc.servers, o.run.shards(), sc.iterations, sc.compute_ms),
            (3, 2, 3, Some(9), 4)
        );
        assert_eq!(o.run.shard_config(1), [("s".to_string(), "5".to_string())]);
        assert_eq!(
            sc.slow,
            [
                Slow { worker: 1, factor: 2.5, from_s: None, until_s: None },
                Slow { worker: 0, factor: 3.0, from_s: Some(10.0), until_s: Some(20.5) }
            ]
        );

        let mut coord = vec!["coordinator", "--token", "t"];
        let args = o.coordinator_args();
        coord.extend(args.iter().map(String::as_str));
        let Command::Coordinator(c) = parse(&coord) else { panic!("not a coordinator") };
        assert_eq!(c.policy.policy.to_string(), "ssp:s=3");
        assert_eq!(c.policy.overrides, [(1, "s".to_string(), "5".to_string())]);
        // The optimizer on the workers: the servers run plain SGD, each worker momentum 0.5.
        assert_eq!((c.shards, c.train.lr, c.train.momentum, c.train.seed), (Some(3), 0.5, 0.0, 7));
        assert_eq!(c.train.push_weight(), crate::shard::PushWeight::Sum);

        let worker = |w: u32| {
            let args = o.worker_args(w);
            let mut all = vec!["worker", "--coordinator", "127.0.0.1:1", "--token", "t"];
            all.extend(args.iter().map(String::as_str));
            let Command::Worker(r) = parse(&all) else { panic!("not a worker") };
            r
        };
        let (w0, w1, w2) = (worker(0), worker(1), worker(2));
        assert_eq!((w1.workload.as_str(), w1.params, w1.iterations, w1.seed), ("counter", 77, Some(9), 7));
        assert_eq!((w1.part, w1.delay_ms, w1.slow_factor, w1.spin.spin_us), ((1, 3), 4, 2.5, 0));
        assert_eq!((w0.slow_factor, w0.stall, w0.jitter_ms), (3.0, Some((1.5, 2.0)), None));
        assert_eq!((w0.slow_during, w1.slow_during), (Some((10.0, 20.5)), None));
        assert_eq!((w2.jitter_ms, w2.stall), (Some((10.0, 5.0)), None));
        assert_eq!((w2.momentum, w2.weight_decay), (0.5, 0.0));

        // A device for a worker the cluster does not have is refused, not ignored.
        let Command::Local(bad) = parse(&["local", "--workers", "2", "--slow", "2:3"]) else { panic!() };
        let e = options(&bad, "syncopate".into()).unwrap_err().to_string();
        assert!(e.contains("worker 2 does not exist"), "{e}");
        for (flag, bad) in [("--slow", "0:3:20:10"), ("--slow", "0:3:5"), ("--jitter", "0:1:1:-1:2")] {
            let Err(e) = Cli::try_parse_from(["syncopate", "local", flag, bad]) else {
                panic!("{flag} {bad} was accepted")
            };
            assert!(e.to_string().contains("window"), "{bad}: {e}");
        }
    }
}
