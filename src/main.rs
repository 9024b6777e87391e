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
    // Commands that only print (`policy replay ... | head`) end quietly when their reader goes,
    // as Unix tools do, rather than panicking on the closed pipe. Not those that run nodes,
    // which must stop their children on the way out.
    #[cfg(unix)]
    if matches!(cli.command, syncopate::cli::Command::Policy(_)) {
        // SAFETY: resetting a signal's disposition to its default before any other thread
        // exists (the tokio runtime starts inside `run`) races with nothing.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match syncopate::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            match e.downcast_ref::<syncopate::cli::Exit>() {
                Some(exit) => ExitCode::from(exit.code),
                None => ExitCode::FAILURE,
            }
        }
    }
}
