//! Command-line arguments shared by the cluster's commands: TLS files, tokens, cluster access,
//! training settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};

use crate::builtin::PolicySpec;
use crate::lab::scenario::Placement;
use crate::net::tls::{ClusterAccess, ClusterFile, TlsFiles, Token, DEFAULT_SERVER_NAME};
use crate::shard::{Codec, LocalSgdConfig, OptimizerConfig, PushWeight};

/// Where a node finds its certificates.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Directory with `cert.pem` and `key.pem` (as `syncopate local` writes them); the
    /// certificate is also the CA.
    #[arg(long, value_name = "DIR", env = "SYNCOPATE_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// This node's certificate chain (PEM); overrides --tls-dir.
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// This node's private key (PEM); overrides --tls-dir.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// The CA certificate (PEM) servers' certificates chain to; overrides --tls-dir.
    #[arg(long, value_name = "FILE", env = "SYNCOPATE_CA")]
    pub ca: Option<PathBuf>,
    /// The name servers' certificates are issued for.
    #[arg(long, env = "SYNCOPATE_SERVER_NAME", default_value = DEFAULT_SERVER_NAME)]
    pub server_name: String,
}

impl TlsArgs {
    /// The files, checked to be named.
    pub fn files(&self) -> anyhow::Result<TlsFiles> {
        let base = self.tls_dir.as_ref().map(|d| TlsFiles::in_dir(d));
        let pick = |given: &Option<PathBuf>, from: Option<PathBuf>, what: &str| {
            given.clone().or(from).with_context(|| format!("no {what}: give --tls-dir or --{what}"))
        };
        Ok(TlsFiles {
            cert: pick(&self.cert, base.as_ref().map(|b| b.cert.clone()), "cert")?,
            key: pick(&self.key, base.as_ref().map(|b| b.key.clone()), "key")?,
            ca: pick(&self.ca, base.as_ref().map(|b| b.ca.clone()), "ca")?,
            server_name: self.server_name.clone(),
        })
    }

    /// The files a client needs (the CA).
    pub fn client_files(&self) -> anyhow::Result<TlsFiles> {
        let ca = self
            .ca
            .clone()
            .or_else(|| self.tls_dir.as_ref().map(|d| TlsFiles::in_dir(d).ca))
            .context("no CA certificate: give --ca or --tls-dir")?;
        Ok(TlsFiles { cert: ca.clone(), key: PathBuf::new(), ca, server_name: self.server_name.clone() })
    }
}

/// The cluster token.
#[derive(Debug, Clone, Args)]
pub struct TokenArgs {
    /// The cluster token every node presents (better given in the environment).
    #[arg(long, env = "SYNCOPATE_TOKEN", hide_env_values = true)]
    pub token: String,
}

/// How an operator reaches a cluster: a cluster file, or an address with a CA and a token.
#[derive(Debug, Clone, Args)]
pub struct AccessArgs {
    /// A `cluster.json` written by `syncopate local` (address, CA and token).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["coordinator"])]
    pub cluster: Option<PathBuf>,
    /// The coordinator's address (`host:port`: an IP address or a name, as a Kubernetes
    /// service's, resolved at start).
    #[arg(long, value_parser = parse_addr)]
    pub coordinator: Option<SocketAddr>,
    /// The operator token (the cluster token unless the coordinator has a separate one).
    #[arg(long, env = "SYNCOPATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Certificates.
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl AccessArgs {
    /// The access these arguments describe.
    pub fn access(&self) -> anyhow::Result<ClusterAccess> {
        if let Some(path) = &self.cluster {
            // `syncopate local` writes the report when the run ends: nobody listens any more.
            let report = path.with_file_name("report.json");
            let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            if let (Some(done), Some(started)) = (modified(&report), modified(path)) {
                if done >= started {
                    anyhow::bail!(
                        "the run of {} has finished (its report is {}): there is no cluster to reach",
                        path.display(),
                        report.display()
                    );
                }
            }
            let mut access = ClusterFile::read(path)?.access();
            if let Some(t) = &self.token {
                access.token = Token::new(t.clone());
            }
            return Ok(access);
        }
        let coordinator =
            self.coordinator.context("give --cluster FILE, or --coordinator ADDR with --ca and a token")?;
        let token = self.token.clone().context("no token: give --token or set SYNCOPATE_TOKEN")?;
        Ok(ClusterAccess { coordinator, tls: self.tls.client_files()?, token: Token::new(token) })
    }
}

/// How pushes without a policy-given weight are weighed.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum WeightArg {
    /// Each step moves by the gradient divided by the live workers.
    Mean,
    /// Gradients are summed.
    Sum,
}

/// Where the optimizer's momentum and weight decay run ([`Placement`]).
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PlacementArg {
    /// On the servers, on every admitted gradient.
    Server,
    /// On each worker, on its own gradients; the servers run plain SGD (FluentPS's placement).
    Worker,
}

impl From<PlacementArg> for Placement {
    fn from(p: PlacementArg) -> Self {
        match p {
            PlacementArg::Server => Placement::Server,
            PlacementArg::Worker => Placement::Worker,
        }
    }
}

/// Where a coordinator or server serves Prometheus metrics (docs/observability.md).
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks a free one). Off unless
    /// given: the endpoint has no authentication, so keep it on loopback or a private network.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Write the metrics address bound into FILE (launchers use it with port 0).
    #[arg(long, value_name = "FILE", requires = "metrics_listen")]
    pub metrics_file: Option<PathBuf>,
}

/// Where the coordinator serves its live dashboard (docs/observability.md, "The dashboard").
#[derive(Debug, Clone, Args)]
pub struct DashboardArgs {
    /// Serve the live dashboard at http://ADDR/ (port 0 picks a free one). Off unless given.
    /// Anyone who reaches it sees the cluster; swapping a policy from it needs the operator
    /// token. Keep it on loopback or a private network.
    #[arg(long, value_name = "ADDR")]
    pub dashboard: Option<SocketAddr>,
    /// Write the dashboard's address bound into FILE (launchers use it with port 0).
    #[arg(long, value_name = "FILE", requires = "dashboard")]
    pub dashboard_file: Option<PathBuf>,
    /// Seconds between the dashboard's readings of the cluster.
    #[arg(long, value_name = "S", default_value_t = 1.0, value_parser = parse_every)]
    pub dashboard_every_s: f64,
}

fn parse_every(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.05..=3600.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a number of seconds from 0.05 to 3600")),
    }
}

impl DashboardArgs {
    /// The dashboard's options, if it is served.
    pub fn options(&self) -> Option<crate::dashboard::DashboardOptions> {
        Some(crate::dashboard::DashboardOptions {
            listen: self.dashboard?,
            addr_file: self.dashboard_file.clone(),
            every: std::time::Duration::from_secs_f64(self.dashboard_every_s),
        })
    }
}

impl MetricsArgs {
    /// The node's metrics options, if it serves metrics.
    pub fn options(&self) -> Option<crate::metrics::MetricsOptions> {
        let listen = self.metrics_listen?;
        Some(crate::metrics::MetricsOptions { listen, addr_file: self.metrics_file.clone() })
    }
}

/// How long an idle node polls its sockets before it sleeps (servers and workers).
#[derive(Debug, Clone, Copy, Args)]
pub struct SpinArgs {
    /// Microseconds an idle node keeps polling its sockets before its threads sleep, at most
    /// (the budget adapts: it shrinks to nothing while the node waits long). Saves waking a
    /// sleeping core per message, most of a small request's round trip on virtual machines;
    /// costs at most that much CPU each time the node goes idle. 0: never spin.
    #[arg(long, env = "SYNCOPATE_SPIN_US", default_value_t = crate::net::spin::DEFAULT_SPIN.as_micros() as u64)]
    pub spin_us: u64,
}

impl SpinArgs {
    /// The most a thread spins.
    pub fn max(self) -> Duration {
        Duration::from_micros(self.spin_us)
    }
}

/// Training settings the servers apply.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Learning rate of the servers' SGD.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// Momentum of the SGD (run by the servers, or by the workers with `local --optimizer-on
    /// worker`).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// L2 weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    /// Local steps per iteration: each worker computes this many gradients, applying each to
    /// its own copy of the model with the optimizer above, then pushes the pseudo-gradient
    /// (pulled minus reached parameters), which the servers apply with the outer optimizer.
    /// 0: push every gradient. Policies may set another (`diloco`, `localsgd`); every hot
    /// swap comes back to this.
    #[arg(long, default_value_t = 0)]
    pub local_steps: u32,
    /// Learning rate of the outer optimizer (pseudo-gradients; 1 with no momentum: the mean of
    /// the workers' models, local SGD's averaging).
    #[arg(long, default_value_t = 1.0)]
    pub outer_lr: f32,
    /// Momentum of the outer optimizer (DiLoCo: 0.9 with --outer-nesterov, lr 0.7).
    #[arg(long, default_value_t = 0.0)]
    pub outer_momentum: f32,
    /// Nesterov momentum for the outer optimizer.
    #[arg(long)]
    pub outer_nesterov: bool,
    /// The codec workers push in until a policy sets another: none, fp16, bf16, int8,
    /// int8-BLOCK or topk-FRACTION (top-k with error feedback on the workers).
    #[arg(long, default_value = "none")]
    pub push_codec: Codec,
    /// The codec servers answer pulls in until a policy sets another: none, fp16, bf16, int8
    /// or int8-BLOCK.
    #[arg(long, default_value = "none")]
    pub pull_codec: Codec,
    /// How pushes are weighed when the policy does not say.
    #[arg(long, value_enum, default_value = "mean")]
    pub push_weight: WeightArg,
    /// Seed of the policies' random sources and the initial parameters.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Drop a peer silent for this many milliseconds (a dead worker stops blocking others).
    #[arg(long, default_value_t = 10_000)]
    pub peer_timeout_ms: u64,
    /// Seconds every live worker may wait on a shard's policy (a pull parked, a push held)
    /// before that is the rule's failure: the stuck requests are resolved by the fallback rules
    /// and the policy restarts (three such stalls quarantine it). 0: never.
    #[arg(long, default_value_t = 30.0, value_parser = parse_seconds)]
    pub no_progress_s: f64,
}

/// A number of seconds, finite and not negative.
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a number of seconds (0 or more)")),
    }
}

impl TrainArgs {
    /// The optimizer.
    pub fn optimizer(&self) -> OptimizerConfig {
        OptimizerConfig {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: false,
        }
    }

    /// Local steps and the outer optimizer, within the bounds policies are held to.
    pub fn local_sgd(&self) -> anyhow::Result<LocalSgdConfig> {
        use syncopate_policy_sdk::rules::{check_local_steps, check_outer_optimizer};
        let (lr, momentum) = (self.outer_lr, self.outer_momentum);
        check_local_steps(self.local_steps).map_err(|e| anyhow::anyhow!("--local-steps: {e}"))?;
        check_outer_optimizer(lr, momentum)
            .map_err(|e| anyhow::anyhow!("--outer-lr, --outer-momentum: {e}"))?;
        let outer = OptimizerConfig { lr, momentum, weight_decay: 0.0, nesterov: self.outer_nesterov };
        Ok(LocalSgdConfig { local_steps: self.local_steps, outer })
    }

    /// The push and pull codecs (a pull is never top-k).
    pub fn codecs(&self) -> anyhow::Result<(Codec, Codec)> {
        if self.pull_codec.is_sparse() {
            anyhow::bail!("--pull-codec {}: pulls carry parameters; it is for pushes", self.pull_codec);
        }
        Ok((self.push_codec, self.pull_codec))
    }

    /// The push weight.
    pub fn push_weight(&self) -> PushWeight {
        match self.push_weight {
            WeightArg::Mean => PushWeight::Mean,
            WeightArg::Sum => PushWeight::Sum,
        }
    }

    /// The peer timeout.
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_millis(self.peer_timeout_ms.max(100))
    }

    /// The no-progress time (zero: the rule is off).
    pub fn no_progress(&self) -> Duration {
        Duration::from_secs_f64(self.no_progress_s)
    }
}

/// The cluster's policy, as the coordinator and `local` take it.
#[derive(Debug, Clone, Args)]
pub struct PolicyArgs {
    /// The policy: a built-in name or a .wasm file, with its configuration (`ssp:s=3`).
    #[arg(long, default_value = "bsp")]
    pub policy: PolicySpec,
    /// A per-shard configuration override, `SHARD:KEY=VALUE` (repeatable).
    #[arg(long = "shard-config", value_parser = parse_override)]
    pub overrides: Vec<(u32, String, String)>,
    /// A cluster policy for the coordinator to run beside the shard policy: `autopilot`
    /// (picks BSP, SSP, the adaptive deadline or ASP as stragglers come and go), with its
    /// configuration (`autopilot:cadence_ms=1000`), or a .wasm file built with
    /// `export_cluster_policy!`.
    #[arg(long)]
    pub pilot: Option<PolicySpec>,
}

/// Parses `SHARD:k=v` per-shard overrides.
pub fn parse_override(s: &str) -> Result<(u32, String, String), String> {
    let (shard, kv) = s.split_once(':').ok_or("expected SHARD:KEY=VALUE")?;
    let shard = shard.parse().map_err(|_| format!("`{shard}` is not a shard number"))?;
    let (k, v) = kv.split_once('=').ok_or("expected SHARD:KEY=VALUE")?;
    Ok((shard, k.trim().to_string(), v.trim().to_string()))
}

/// An address given as `ip:port` or `name:port` (resolved now, IPv4 first: a Kubernetes
/// service's name, say).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(s)
        .map_err(|e| format!("`{s}` is not an address (HOST:PORT): {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

/// A tokio runtime for a networked command.
pub fn tokio() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")
}

/// A tokio runtime with `threads` worker threads (0 runs everything on the calling thread)
/// whose threads spin as `spin` says before they sleep.
pub fn tokio_threads(threads: usize, spin: SpinArgs) -> anyhow::Result<tokio::runtime::Runtime> {
    crate::net::spin::runtime_builder(threads, spin.max()).build().context("cannot start the async runtime")
}

/// Replication, checkpoints and resume, as the coordinator and `local` take them.
#[derive(Debug, Clone, Args)]
pub struct FaultArgs {
    /// Backups per shard: 1 keeps each shard's backup on the next server, which takes over if
    /// the shard's server dies (needs at least two servers); 0 runs without. Default: 1 with
    /// two servers or more, 0 with one.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1))]
    pub replicas: Option<u32>,
    /// Write checkpoint rounds (every shard's parameters, optimizer, clocks, pending requests and
    /// policy state) into DIR, periodically and at shutdown; the last two complete rounds are
    /// kept. Every server writes its own shards there, so on several machines DIR must be a
    /// shared file system.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Seconds between checkpoint rounds (0: only at shutdown).
    #[arg(long, default_value_t = 30)]
    pub checkpoint_every_s: u64,
    /// Resume from the newest intact checkpoint round in DIR (a torn or corrupt round is
    /// reported and the one before it used): every shard is restored, with the policy that ran
    /// then, and workers continue where the shards left them.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

impl FaultArgs {
    /// Backups per shard with `servers` servers: as `--replicas` says, else 1 wherever a backup
    /// has another server to live on. A shard without one dies with its server, and the run
    /// with it; a backup costs a large push about twice its latency on a 2-core machine
    /// (docs/performance.md, "Replication"), which `--replicas 0` gives back.
    pub fn replicas(&self, servers: u32) -> u32 {
        self.replicas.unwrap_or(u32::from(servers >= 2))
    }

    /// The interval, `None` for only at shutdown.
    pub fn every(&self) -> Option<Duration> {
        (self.checkpoint_every_s > 0).then(|| Duration::from_secs(self.checkpoint_every_s))
    }
}
