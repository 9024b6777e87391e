//! The `syncopate` command line: argument parsing and the subcommands' implementations.

mod args;
mod local;
mod policy;
mod roles;

use clap::{Parser, Subcommand};

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
    /// Stop a running cluster: every server, then the coordinator (operators only).
    Shutdown {
        #[command(flatten)]
        access: args::AccessArgs,
    },
    /// Inspect, validate, swap and list policy modules.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Local(a) => local::run(a),
        Command::Coordinator(a) => roles::coordinator(a),
        Command::Server(a) => roles::server(a),
        Command::Worker(a) => roles::worker(a),
        Command::Policy(cmd) => policy::run(cmd),
        Command::Shutdown { access } => {
            let access = access.access()?;
            args::tokio()?
                .block_on(async { crate::operator::Operator::connect(&access).await?.shutdown().await })?;
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
