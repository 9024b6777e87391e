//! The `syncopate` command line: argument parsing and the subcommands' implementations.

mod args;
mod local;
mod policy;
pub(crate) use policy::quick_check_module;
mod resume;
pub use roles::{policy_source, WorkerArgs};
mod roles;

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

/// An error that ends the command with its own exit status (other errors exit 1): `policy
/// swap`'s 2, a swap that went through and then failed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    /// The exit status.
    pub code: u8,
    /// What to print.
    pub message: String,
}

impl Exit {
    /// Ends the command with status `code`, printing `message`.
    pub fn with(code: u8, message: impl Into<String>) -> anyhow::Error {
        Exit { code, message: message.into() }.into()
    }
}

/// Syncopate: a parameter server whose synchronization policies are hot-swappable wasm modules.
#[derive(Debug, Parser)]
#[command(name = "syncopate", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a whole cluster on this machine (separate processes on loopback) and train.
    Local(local::LocalArgs),
    /// Run one scenario (a TOML file) under several policies and compare them: a table and
    /// plots with every policy.
    Ab(AbArgs),
    /// Run the coordinator: membership, the cluster's policy, hot swaps, shutdown.
    Coordinator(roles::CoordinatorArgs),
    /// Run a server: hosts shards and their policies, serves pushes and pulls.
    Server(roles::ServerArgs),
    /// Run a worker: trains a workload through the cluster.
    Worker(roles::WorkerArgs),
    /// Generate a self-signed certificate (cert.pem, key.pem) for a cluster, into DIR: use it
    /// with --tls-dir DIR on every node.
    Certs {
        /// Where to write the files.
        dir: std::path::PathBuf,
    },
    /// End training: every worker finishes the computation in progress, pushes it, and leaves,
    /// giving up what a policy keeps waiting (a pull at once, its own push 5 s on), as at a
    /// time limit; `syncopate local` then saves the model and stops the cluster (operators only).
    Stop {
        #[command(flatten)]
        access: args::AccessArgs,
    },
    /// Stop a running cluster: every server, then the coordinator (operators only).
    Shutdown {
        #[command(flatten)]
        access: args::AccessArgs,
        /// First read the whole model from the servers and write it to FILE (little-endian
        /// f32, as `syncopate local` writes `model.bin`).
        #[arg(long, value_name = "FILE")]
        save_model: Option<std::path::PathBuf>,
    },
    /// Inspect, validate, swap and list policy modules.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Search seeds for lost or doubled updates: each seed draws a replicated cluster and a
    /// policy and runs it in the simulator undisturbed and with a server killed at a random
    /// event; the sums must be exact and the two models equal. A failing seed prints the
    /// command that replays it.
    Simtest(SimtestArgs),
}

/// `syncopate simtest`.
#[derive(Debug, clap::Args)]
pub struct SimtestArgs {
    /// How many seeds to check.
    #[arg(long, default_value_t = 1000)]
    pub seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    pub start: u64,
    /// Check this one seed only, and say what it ran (a replay).
    #[arg(long, conflicts_with_all = ["seeds", "start"])]
    pub seed: Option<u64>,
    /// Check each case without these faults (comma-separated: death, second-death, partition,
    /// notice-delay, worker-death, reorder, swap, late-worker, duplicates, bad-inputs,
    /// late-join, coordinator-crash, link-cut, server-link-cut), as a shrunk failure's replay does.
    #[arg(long, value_delimiter = ',')]
    pub without: Vec<crate::lab::simtest::Fault>,
}

fn simtest(a: SimtestArgs) -> anyhow::Result<()> {
    use crate::lab::simtest::{search, Case, Shrunk};
    let rt = crate::runtime::PolicyRuntime::new()?;
    let (first, count) = match a.seed {
        Some(s) => {
            println!("seed {s}: {}", Case::draw(s).without_all(&a.without).describe());
            (s, 1)
        }
        None => (a.start, a.seeds),
    };
    let mut last = Instant::now();
    let found = search(&rt, first, count, &a.without, |done, e| {
        if last.elapsed() >= Duration::from_secs(10) {
            last = Instant::now();
            eprintln!(
                "simtest: {done}/{count} seeds passed ({} runs, {} server deaths failed over)",
                e.runs, e.failovers
            );
        }
    });
    let e = found.exercised;
    println!(
        "simtest: {} of {count} seeds passed in {:.1} s ({:.1} seeds/s): {} simulated runs, {} events, \
         {} failovers, {} runs with two server deaths, {} with a server cut off from the coordinator, {} \
         with a worker death, {} with a hot swap ({} to a module that traps, spins or panics, {} to one that refuses the \
         running policy's state ({} preparations refused, the record kept), {} to a rule that never decides; {} runs \
         found a rule stalled; {} promoted backups switched to the recorded policy), {} messages \
         delivered twice, {} bad requests refused, {} ops from a deposed primary ignored by its promoted backup, {} with the coordinator crashed and restarted ({} rebuilds: {} \
         backups promoted, {} servers refused, {} swaps finished), {} with a link cut (a worker's to a server, or between servers), {} checkpoint rounds taken and checked ({} abandoned, {} not begun), {} dead servers restarted that took their id back ({} two-server runs then survived the other server's death on their backups), {} losing a shard's last copy (as a cluster \
         would; {} of them found lost by a restarted coordinator that knew a newer term, {} found as a stale copy it \
         could not tell from a current one); the longest a disturbed run took beyond its undisturbed one, partitions and peer timeouts aside: {:.3} s\n\
         simtest: trace {:016x} (a hash of every event every run delivered: the same for the same seeds in any process)",
        found.passed,
        found.seconds,
        found.passed as f64 / found.seconds.max(1e-9),
        e.runs,
        e.events,
        e.failovers,
        e.double_failures,
        e.partitions,
        e.worker_deaths,
        e.swaps,
        e.hostile,
        e.refusing,
        e.swaps_refused,
        e.undecided,
        e.stalled,
        e.conformed,
        e.duplicates,
        e.bad_inputs,
        e.stale_ops,
        e.coordinator_crashes,
        e.rebuild.rebuilds,
        e.rebuild.promoted,
        e.rebuild.refused,
        e.rebuild.swaps_finished,
        e.link_cuts,
        e.checkpoints.taken,
        e.checkpoints.abandoned,
        e.checkpoints.refused,
        e.restarts,
        e.saved_by_restart,
        e.lost,
        e.outdated,
        e.stale,
        e.max_delay_ms as f64 / 1e3,
        e.trace
    );
    if let Some((seed, why)) = found.failed {
        let given = Shrunk { without: a.without.clone(), case: Case::draw(seed), why: String::new() };
        let mut msg = format!("seed {seed} failed: {why}\nreplay it with: {}", given.replay());
        if let Some(sh) = found.shrunk.filter(|sh| sh.without.len() > a.without.len()) {
            let dropped: Vec<&str> = sh.without[a.without.len()..].iter().map(|f| f.name()).collect();
            msg += &format!(
                "\nshrunk: without {} it still fails: {} ({})\nreplay that with: {}",
                dropped.join(", "),
                sh.why,
                sh.case.describe(),
                sh.replay()
            );
        }
        anyhow::bail!(msg);
    }
    Ok(())
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Local(a) => local::run(a),
        Command::Ab(a) => ab(a),
        Command::Coordinator(a) => roles::coordinator(a),
        Command::Server(a) => roles::server(a),
        Command::Worker(a) => roles::worker(a),
        Command::Policy(cmd) => policy::run(cmd),
        Command::Simtest(a) => simtest(a),
        Command::Stop { access } => {
            let access = access.access()?;
            args::tokio()?.block_on(async {
                crate::operator::Operator::connect(&access).await?.stop_training().await?;
                anyhow::Ok(())
            })?;
            println!("asked the workers of the cluster at {} to stop", access.coordinator);
            Ok(())
        }
        Command::Shutdown { access, save_model } => {
            use anyhow::Context;
            let access = access.access()?;
            args::tokio()?.block_on(async {
                let operator = crate::operator::Operator::connect(&access).await?;
                if let Some(path) = &save_model {
                    let (model, version) = operator.read_model().await?;
                    crate::checkpoint::write_file(path, crate::net::wire::f32_bytes(&model))
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    println!("wrote {} ({} parameters, version {version})", path.display(), model.len());
                }
                operator.shutdown().await?;
                anyhow::Ok(())
            })?;
            println!("cluster at {} shut down", access.coordinator);
            Ok(())
        }
        Command::Certs { dir } => {
            let files = crate::net::tls::TlsFiles::generate(&dir)?;
            println!(
                "wrote {} and {} (valid for the name `syncopate`)",
                files.cert.display(),
                files.key.display()
            );
            Ok(())
        }
    }
}

/// `syncopate ab`.
#[derive(Debug, clap::Args)]
pub struct AbArgs {
    /// The scenario file (see `scenarios/`).
    #[arg(long)]
    pub scenario: std::path::PathBuf,
    /// The policies, comma-separated; a `k=v` item without a colon continues the previous
    /// policy's configuration: `bsp,ssp:s=3,dssp:s_lo=3,s_hi=15,epsp`.
    #[arg(long, value_parser = crate::lab::ab::parse_policies)]
    pub policies: std::vec::Vec<crate::builtin::PolicySpec>,
    /// Where the runs and the comparison go (default: `runs/ab-<scenario>-<time>`).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// The workload's data directory (default: where its Debian package installs it).
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    /// Run in the deterministic simulator (virtual time, the real shard engine and policies)
    /// instead of as real local clusters: for clusters larger than this machine holds.
    #[arg(long)]
    pub simulate: bool,
    /// With --simulate: decisions only, no gradients or accuracy (for thousands of workers).
    #[arg(long, requires = "simulate")]
    pub no_gradients: bool,
    /// Runs per policy, with seeds the scenario's, +1, +2, ...; runs interleave across policies.
    /// With 2 or more, every figure is reported as a median with a confidence interval, and every
    /// policy gets a verdict against the baseline (6 or more runs give 95% intervals).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// The policy every other is judged against (default: the first in --policies).
    #[arg(long)]
    pub baseline: Option<crate::builtin::PolicySpec>,
    /// The first run's seed (default: the scenario's): a fresh, independent batch of runs, to
    /// replicate a comparison without reusing its seeds.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Write each run's TensorBoard event file into `DIR/<policy>[/seed-N]`, so TensorBoard
    /// overlays the policies and seeds.
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<std::path::PathBuf>,
}

fn ab(a: AbArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut scenario = crate::lab::scenario::Scenario::load(&a.scenario)?;
    scenario.seed = a.seed.unwrap_or(scenario.seed);
    if let (Some(mbit), false) = (scenario.bandwidth_mbit, a.simulate) {
        anyhow::bail!(
            "scenario `{}` limits bandwidth to {mbit} Mbit/s, which a loopback cluster cannot enforce; \
             run it with --simulate (which models link bandwidth), or by hand with the \
             network-namespace recipe in docs/bandwidth.md",
            scenario.name
        );
    }
    if let (false, false) = (scenario.link.is_empty(), a.simulate) {
        anyhow::bail!(
            "scenario `{}` slows links for a while ([[link]]), which only the simulator's network models; run it with --simulate",
            scenario.name
        );
    }
    if let (Some(trace), false) = (&scenario.trace, a.simulate) {
        anyhow::bail!(
            "scenario `{}` replays the compute times of {}, a device model only the simulator runs; run it with --simulate",
            scenario.name,
            trace.display()
        );
    }
    if let (Some(m), false) = (&scenario.modelled, a.simulate) {
        anyhow::bail!(
            "scenario `{}` models the wire costs of {}, which only the simulator can charge; run it with --simulate",
            scenario.name,
            m.name
        );
    }
    // Every policy must load and accept its configuration before the first run starts.
    let rt = crate::runtime::PolicyRuntime::new()?;
    for spec in &a.policies {
        let module = spec.load(&rt).with_context(|| format!("policy `{spec}`"))?;
        let args = syncopate_policy_sdk::abi::InitArgs {
            shard: 0,
            shards: 1,
            now_ns: 0,
            config: spec.config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
        };
        // A cluster policy runs as the pilot of a cluster that starts on BSP (`RunSpec::new`).
        if module.kind() == crate::runtime::ModuleKind::Cluster {
            anyhow::ensure!(
                spec.is_cluster_builtin(),
                "`{spec}` is a cluster policy from a file: `ab` compares the built-in ones (autopilot); \
                 run a file with `syncopate local --pilot FILE`"
            );
            syncopate_engine::pilot::Pilot::start(&module, &spec.config, 1, 0)
                .with_context(|| format!("cluster policy `{spec}` does not start"))?;
            continue;
        }
        crate::runtime::PolicyInstance::new(&module, &args)
            .with_context(|| format!("policy `{spec}` does not start"))?;
    }
    let out = a.out.unwrap_or_else(|| crate::lab::ab::default_out(&scenario));
    let exe = std::env::current_exe().context("cannot find the syncopate executable")?;
    let opts = crate::lab::ab::AbOptions {
        data: a.data,
        simulate: a.simulate,
        gradients: !a.no_gradients,
        repeat: a.repeat,
        baseline: a.baseline,
        tensorboard: a.tensorboard,
        ..crate::lab::ab::AbOptions::new(exe, scenario, a.policies, out.clone())
    };
    opts.baseline_index().map_err(anyhow::Error::msg)?;
    let comparison = crate::lab::ab::run(&opts).context("ab")?;
    println!();
    print!("{}", crate::lab::ab::markdown(&comparison));
    for f in &comparison.files {
        println!("wrote:      {}", f.display());
    }
    println!("wrote:      {}", out.join("comparison.json").display());
    Ok(())
}
