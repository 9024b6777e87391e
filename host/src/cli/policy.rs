//! `syncopate policy ...`: check a module, list the built-in policies.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use syncopate_policy_sdk::abi::{InitArgs, ModuleInfo, ABI_VERSION};

use crate::builtin::{self, PolicySpec};
use crate::runtime::{PolicyInstance, PolicyRuntime};

/// Policy subcommands.
#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy module and print its name, version, ABI version and parameters.
    Check {
        /// The module file.
        file: PathBuf,
        /// Configuration to try it with, as k=v pairs (defaults are used for the rest).
        #[arg(long = "config", value_name = "K=V", value_delimiter = ',')]
        config: Vec<String>,
    },
    /// List the built-in policies with their parameters.
    List,
}

/// Runs a policy subcommand.
pub fn run(cmd: PolicyCommand) -> anyhow::Result<()> {
    let rt = PolicyRuntime::new()?;
    match cmd {
        PolicyCommand::Check { file, config } => {
            let module = rt.load_file(&file)?;
            let spec: PolicySpec = format!("x:{}", config.join(",")).parse()?;
            let args = InitArgs {
                shard: 0,
                shards: 1,
                now_ns: 0,
                config: spec.config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
            };
            PolicyInstance::new(&module, &args).context("the module loads but does not start")?;
            println!("ok: {}", file.display());
            println!("  sha256:      {}", module.sha256_hex());
            print_info(module.info(), "  ");
        }
        PolicyCommand::List => {
            for name in builtin::names() {
                let spec: PolicySpec = name.parse()?;
                let module = spec.load(&rt)?;
                print_info(module.info(), "");
                println!();
            }
        }
    }
    Ok(())
}

fn print_info(info: &ModuleInfo, indent: &str) {
    println!("{indent}name:        {}", info.name);
    println!("{indent}version:     {}", info.version);
    println!("{indent}abi:         v{ABI_VERSION}");
    println!("{indent}description: {}", info.description);
    if info.params.is_empty() {
        println!("{indent}parameters:  none");
    } else {
        println!("{indent}parameters:");
        for p in &info.params {
            println!("{indent}  {:<10} {:<6} default {:<8} {}", p.name, p.kind.name(), p.default, p.doc);
        }
    }
}
