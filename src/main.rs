//! The `syncopate` binary: parses the command line and reports errors on one line.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("SYNCOPATE_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        // Colours on a terminal only: the nodes `local` starts log to files.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = syncopate::cli::Cli::parse();
    match syncopate::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
