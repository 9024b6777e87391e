//! The `syncopate` command line: argument parsing and the subcommands' implementations.

mod policy;

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
    /// Inspect and validate policy modules.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Policy(cmd) => policy::run(cmd),
    }
}
