//! `syncopate coordinator | server | worker`: one cluster role per process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use syncopate_workloads::WorkloadOptions;

use super::args::{
    tokio, tokio_threads, DashboardArgs, FaultArgs, MetricsArgs, PolicyArgs, SpinArgs, TlsArgs, TokenArgs,
    TrainArgs,
};
use crate::builtin::PolicySpec;
use crate::coordinator::{CoordinatorOptions, PolicySource};
use crate::net::tls::{ClusterAccess, ClusterFile, Token};
use crate::net::wire::Limits;
use crate::server::ServerOptions;
use crate::shard::OptimizerConfig;
use crate::worker::WorkerOptions;

/// `syncopate coordinator`.
#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Servers the cluster has; workers wait until all have registered.
    #[arg(long, default_value_t = 1)]
    pub servers: u32,
    /// Workers to wait for before training starts, so they all start together (0: none).
    #[arg(long, default_value_t = 0)]
    pub workers: u32,
    /// Shards the model is split into (default: one per server).
    #[arg(long)]
    pub shards: Option<u32>,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// How many workers the cluster admits: worker ids are 0..N, and a worker asking for
    /// another id is refused (so is one more once all are taken). Each admitted id costs a
    /// server a few dozen bytes per shard (docs/fault-tolerance.md).
    #[arg(long, default_value_t = crate::net::proto::DEFAULT_MAX_WORKERS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::net::proto::MAX_WORKERS_LIMIT)))]
    pub max_workers: u32,
    /// How long workers wait for all servers to register, and training for all `--workers` to
    /// be ready (counted from the first), in seconds.
    #[arg(long, default_value_t = crate::coordinator::DEFAULT_STARTUP_TIMEOUT_S)]
    pub startup_timeout_s: u64,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// A separate token operators need to swap policies or shut down.
    #[arg(long, env = "SYNCOPATE_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<String>,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub dashboard: DashboardArgs,
    #[command(flatten)]
    pub faults: FaultArgs,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `syncopate server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// The coordinator's address (`host:port`: an IP address or a name, resolved at start).
    #[arg(long, value_parser = super::args::parse_addr)]
    pub coordinator: SocketAddr,
    /// Address to listen on for workers (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The address to give workers, if not the one listened on.
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// Largest tensor accepted in one message, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub max_tensor_mib: usize,
    /// Runtime threads (0: everything on one thread, which has the lowest latency when the
    /// machine has few cores; more help a server holding several shards on a large machine).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Record each shard's policy events into DIR/shard-N.rec, for `syncopate policy replay`.
    #[arg(long, value_name = "DIR")]
    pub record: Option<std::path::PathBuf>,
    /// Once registered, write the id the coordinator gave this server into FILE (launchers use
    /// it to tell their server processes apart).
    #[arg(long, value_name = "FILE")]
    pub id_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub spin: SpinArgs,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// `syncopate worker`. Every setting can also come from the environment, as
/// `SYNCOPATE_<FLAG>` (`--slow-factor 3` is `SYNCOPATE_SLOW_FACTOR=3`): that is the contract a
/// user's own training script joins by (`syncopate.init()` in Python reads the same variables,
/// and `syncopate local --script` sets them). A flag given on the command line wins.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// The coordinator's address (`host:port`: an IP address or a name, resolved at start).
    #[arg(long, env = "SYNCOPATE_COORDINATOR", required_unless_present = "cluster", value_parser = super::args::parse_addr)]
    pub coordinator: Option<SocketAddr>,
    /// A `cluster.json` written by `syncopate local` (the coordinator's address, the CA and the
    /// token), instead of --coordinator, --ca and the token.
    #[arg(long, value_name = "FILE", env = "SYNCOPATE_CLUSTER", conflicts_with = "coordinator")]
    pub cluster: Option<PathBuf>,
    /// The worker id to ask for (default: the lowest free one).
    #[arg(long, env = "SYNCOPATE_ID")]
    pub id: Option<u32>,
    /// The workload to train (built-in workers only).
    #[arg(long, env = "SYNCOPATE_WORKLOAD", default_value = "counter")]
    pub workload: String,
    /// Parameters of synthetic workloads (`counter`).
    #[arg(long, env = "SYNCOPATE_PARAMS", default_value_t = 1024)]
    pub params: usize,
    /// The workload's data directory (default: where its Debian package installs it:
    /// /usr/share/datasets/fashion-mnist, or /usr/share/games/fortunes for fortunes-lm).
    #[arg(long, env = "SYNCOPATE_DATA")]
    pub data: Option<PathBuf>,
    /// This worker's part of the training set, `I/N` (default: all of it).
    #[arg(long, env = "SYNCOPATE_PART", value_parser = parse_part, default_value = "0/1")]
    pub part: (u32, u32),
    /// Hidden units of the MLP.
    #[arg(long, env = "SYNCOPATE_HIDDEN", default_value_t = 128)]
    pub hidden: usize,
    /// Train until this iteration (default: 100 for a built-in workload; no limit for a user's
    /// own training loop, which ends itself).
    #[arg(long, env = "SYNCOPATE_ITERATIONS")]
    pub iterations: Option<u64>,
    /// Mini-batch size (until a policy sets another).
    #[arg(long, env = "SYNCOPATE_BATCH", default_value_t = 32)]
    pub batch: u32,
    /// Seed of the initial parameters.
    #[arg(long, env = "SYNCOPATE_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Extra compute milliseconds per iteration (pacing; stretched by --slow-factor).
    #[arg(long, env = "SYNCOPATE_DELAY_MS", default_value_t = 0)]
    pub delay_ms: u64,
    /// Make this worker F times slower to compute (it sleeps F-1 times its compute time).
    #[arg(long, env = "SYNCOPATE_SLOW_FACTOR", default_value_t = 1.0)]
    pub slow_factor: f32,
    /// The slowdown only from FROM_S until UNTIL_S seconds after the worker started:
    /// `FROM_S:UNTIL_S` (`inf`: to the end).
    #[arg(long, env = "SYNCOPATE_SLOW_DURING", value_parser = parse_pair_f64)]
    pub slow_during: Option<(f64, f64)>,
    /// A random delay after each iteration, normal: `MEAN_MS:SD_MS`.
    #[arg(long, env = "SYNCOPATE_JITTER_MS", value_parser = parse_pair_f64)]
    pub jitter_ms: Option<(f64, f64)>,
    /// The jitter only from FROM_S until UNTIL_S seconds after the worker started.
    #[arg(long, env = "SYNCOPATE_JITTER_DURING", value_parser = parse_pair_f64)]
    pub jitter_during: Option<(f64, f64)>,
    /// Stall once: `AT_S:FOR_S` seconds after the start, for that many seconds.
    #[arg(long, env = "SYNCOPATE_STALL", value_parser = parse_pair_f64)]
    pub stall: Option<(f64, f64)>,
    /// Write a JSON report here when done.
    #[arg(long, env = "SYNCOPATE_REPORT")]
    pub report: Option<PathBuf>,
    /// Momentum this worker applies to its own gradients before pushing them (the optimizer
    /// placed on the workers: run the servers without momentum then). 0: push raw gradients.
    #[arg(long, env = "SYNCOPATE_MOMENTUM", default_value_t = 0.0)]
    pub momentum: f32,
    /// L2 weight decay this worker adds to its own gradients (with the optimizer on the workers).
    #[arg(long, env = "SYNCOPATE_WEIGHT_DECAY", default_value_t = 0.0)]
    pub weight_decay: f32,
    #[command(flatten)]
    pub spin: SpinArgs,
    /// The cluster token (better given in the environment; a cluster file carries its own).
    #[arg(long, env = "SYNCOPATE_TOKEN", hide_env_values = true, required_unless_present = "cluster")]
    pub token: Option<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// [`WorkerArgs`] alone, for reading them from the environment.
#[derive(Debug, clap::Parser)]
#[command(name = "SYNCOPATE_* environment", no_binary_name = true)]
struct WorkerEnv {
    #[command(flatten)]
    worker: WorkerArgs,
}

impl WorkerArgs {
    /// The settings the environment gives (`SYNCOPATE_*`, see the type's docs), each flag's
    /// default where it gives none.
    pub fn from_env() -> anyhow::Result<WorkerArgs> {
        Self::from_env_and(Vec::new())
    }

    /// [`from_env`](Self::from_env), with `flags` (`--name value`, as `syncopate worker` takes
    /// them) over the environment's settings.
    pub fn from_env_and(flags: Vec<String>) -> anyhow::Result<WorkerArgs> {
        use clap::Parser;
        WorkerEnv::try_parse_from(flags)
            .map(|e| e.worker)
            .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))
    }

    /// How to reach the cluster: the cluster file, or the address, CA and token.
    pub fn access(&self) -> anyhow::Result<ClusterAccess> {
        if let Some(path) = &self.cluster {
            return Ok(ClusterFile::read(path)?.access());
        }
        Ok(ClusterAccess {
            coordinator: self.coordinator.context("no coordinator: give --coordinator or --cluster")?,
            tls: self.tls.client_files()?,
            token: Token::new(self.token.clone().context("no cluster token: set SYNCOPATE_TOKEN")?),
        })
    }

    /// The worker's options.
    pub fn options(&self) -> anyhow::Result<WorkerOptions> {
        Ok(WorkerOptions {
            access: self.access()?,
            id: self.id,
            iterations: self.iterations.unwrap_or(100),
            batch: self.batch,
            part: self.part.0,
            seed: self.seed,
            extra_delay: Duration::from_millis(self.delay_ms),
            slow_factor: self.slow_factor,
            slow_during: window(self.slow_during)?,
            jitter_ms: self.jitter_ms,
            jitter_during: window(self.jitter_during)?,
            stall: self
                .stall
                .map(|(at, length)| (Duration::from_secs_f64(at), Duration::from_secs_f64(length))),
            report: self.report.clone(),
            optimizer: (self.momentum != 0.0 || self.weight_decay != 0.0).then_some(OptimizerConfig {
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                ..OptimizerConfig::default()
            }),
        })
    }
}

/// Parses `A:B` as two numbers.
pub fn parse_pair_f64(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s.split_once(':').ok_or("expected A:B")?;
    let num = |x: &str| x.trim().parse::<f64>().map_err(|_| format!("`{x}` is not a number"));
    Ok((num(a)?, num(b)?))
}

/// Parses `I/N`.
pub fn parse_part(s: &str) -> Result<(u32, u32), String> {
    let (i, n) = s.split_once('/').ok_or("expected I/N")?;
    let (i, n) = (i.parse().map_err(|_| "bad I")?, n.parse().map_err(|_| "bad N")?);
    if n == 0 || i >= n {
        return Err(format!("part {i} of {n} does not exist"));
    }
    Ok((i, n))
}

/// Reads the module a spec names, with its overrides.
pub fn policy_source(
    spec: &PolicySpec,
    overrides: Vec<(u32, String, String)>,
) -> anyhow::Result<PolicySource> {
    let (label, wasm) = spec.bytes()?;
    Ok(PolicySource { label, wasm, config: spec.config.clone(), overrides })
}

/// Flags a resumed coordinator may set anew: where it listens (for metrics too) and with which
/// certificates and tokens, where it checkpoints, how long it waits; not what the cluster is.
const COORDINATOR_CHANGEABLE: &[&str] = &[
    "--listen",
    "--ready-file",
    "--metrics-listen",
    "--metrics-file",
    "--dashboard",
    "--dashboard-file",
    "--dashboard-every-s",
    "--startup-timeout-s",
    "--token",
    "--operator-token",
    "--tls-dir",
    "--cert",
    "--key",
    "--ca",
    "--server-name",
    "--checkpoint-dir",
    "--checkpoint-every-s",
    "--resume",
];

/// Runs `syncopate coordinator`.
pub fn coordinator(a: CoordinatorArgs) -> anyhow::Result<()> {
    // `--resume DIR` continues with the settings the coordinator that checkpointed into DIR kept
    // there (`coordinator.json`; tokens are not kept).
    let now = super::resume::given("coordinator");
    let kept = a.faults.resume.as_deref().map(|d| [d.join("coordinator.json")]);
    let (a, args) = match kept
        .map(|f| super::resume::resumed(&f, &now, COORDINATOR_CHANGEABLE, &[]))
        .transpose()?
        .flatten()
    {
        Some(merged) => match super::resume::parse("coordinator", &merged)? {
            super::Command::Coordinator(resumed) => (resumed, merged),
            _ => unreachable!("parsed as `coordinator`"),
        },
        None => (a, now),
    };
    if let Some(dir) = &a.faults.checkpoint_dir {
        super::resume::remember(
            &dir.join("coordinator.json"),
            &args,
            &["--resume", "--token", "--operator-token"],
        )?;
    }
    let replicas = a.faults.replicas(a.servers);
    let opts = CoordinatorOptions {
        listen: a.listen,
        tls: a.tls.files()?,
        token: Token::new(a.token.token),
        operator_token: a.operator_token.map(Token::new),
        servers: a.servers,
        workers: a.workers,
        shards: a.shards.unwrap_or(a.servers),
        policy: policy_source(&a.policy.policy, a.policy.overrides)?,
        optimizer: a.train.optimizer(),
        local_sgd: a.train.local_sgd()?,
        codecs: a.train.codecs()?,
        push_weight: a.train.push_weight(),
        seed: a.train.seed,
        peer_timeout: a.train.peer_timeout(),
        no_progress: a.train.no_progress(),
        startup_timeout: Duration::from_secs(a.startup_timeout_s),
        max_workers: a.max_workers,
        ready_file: a.ready_file,
        checkpoint_every: a.faults.every(),
        checkpoint_dir: a.faults.checkpoint_dir,
        resume: a.faults.resume,
        replicas,
        pilot: a.policy.pilot.as_ref().map(|p| policy_source(p, Vec::new())).transpose()?,
        metrics: a.metrics.options(),
        dashboard: a.dashboard.options(),
    };
    tokio()?.block_on(crate::coordinator::run(opts)).context("coordinator")
}

/// Runs `syncopate server`.
pub fn server(a: ServerArgs) -> anyhow::Result<()> {
    let opts = ServerOptions {
        coordinator: a.coordinator,
        listen: a.listen,
        advertise: a.advertise,
        tls: a.tls.files()?,
        token: Token::new(a.token.token),
        limits: Limits { max_header: 1 << 16, max_payload: a.max_tensor_mib << 20 },
        record: a.record,
        id_file: a.id_file,
        metrics: a.metrics.options(),
    };
    tokio_threads(a.threads, a.spin)?.block_on(crate::server::run(opts)).context("server")
}

/// Runs `syncopate worker`.
pub fn worker(a: WorkerArgs) -> anyhow::Result<()> {
    let workload = syncopate_workloads::by_name(
        &a.workload,
        &WorkloadOptions {
            params: a.params,
            data_dir: a.data.clone(),
            part: a.part,
            hidden: a.hidden,
            seed: a.seed,
        },
    )?;
    let opts = a.options()?;
    // A multi-thread runtime (compute steps leave it through block_in_place, which needs one)
    // with a thread per core, tokio's default.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let report =
        tokio_threads(threads, a.spin)?.block_on(crate::worker::run(opts, workload)).context("worker")?;
    tracing::info!(worker = report.worker, iterations = report.iterations, "worker done");
    Ok(())
}

/// A device's window from the command line, in nanoseconds after the worker's start.
fn window(w: Option<(f64, f64)>) -> anyhow::Result<Option<(u64, u64)>> {
    let (from, until) = (w.map(|w| w.0), w.map(|w| w.1));
    crate::lab::scenario::window_ns(from, until).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::WorkerEnv;

    /// `syncopate local --script` passes every worker flag `--name` as `SYNCOPATE_NAME`: each
    /// flag of `syncopate worker` must read exactly that variable.
    #[test]
    fn every_worker_flag_reads_its_syncopate_variable() {
        let cmd = WorkerEnv::command();
        let mut checked = 0;
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "help" {
                continue;
            }
            let want = format!("SYNCOPATE_{}", long.replace('-', "_").to_uppercase());
            let got = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            if ["cert", "key"].contains(&long) {
                assert_eq!(got, None, "--{long} is not for workers");
                continue;
            }
            assert_eq!(got.as_deref(), Some(want.as_str()), "--{long}");
            checked += 1;
        }
        assert!(checked >= 20, "only {checked} flags");
    }
}
