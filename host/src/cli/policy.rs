//! `syncopate policy ...`: check a module, list the built-in policies, swap the policy of a
//! running cluster, show what runs where.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use syncopate_policy_sdk::abi::{InitArgs, ModuleInfo, ABI_VERSION};

use super::args::{tokio, AccessArgs};
use crate::builtin::{self, PolicySpec};
use crate::net::proto::ClusterStatus;
use crate::operator::Operator;
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
    /// Swap the policy of a running cluster. Every server prepares the module first; if any
    /// cannot load it, none switches and this says why.
    Swap {
        /// The policy: a built-in name or a .wasm file, with its configuration (`ssp:s=3`).
        policy: PolicySpec,
        /// A per-shard configuration override, `SHARD:KEY=VALUE` (repeatable).
        #[arg(long = "shard-config", value_parser = super::args::parse_override)]
        overrides: Vec<(u32, String, String)>,
        #[command(flatten)]
        access: AccessArgs,
    },
    /// Show what policy runs on which shard of a running cluster, with workers and counters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        access: AccessArgs,
    },
}

/// Runs a policy subcommand.
pub fn run(cmd: PolicyCommand) -> anyhow::Result<()> {
    match cmd {
        PolicyCommand::Swap { policy, overrides, access } => {
            let source = super::roles::policy_source(&policy, overrides)?;
            let access = access.access()?;
            let (swap, shards) = tokio()?.block_on(async {
                let op = Operator::connect(&access).await?;
                op.swap(&source).await
            })?;
            println!("swap {swap}: {} now runs on all {shards} shards", source.label);
            return Ok(());
        }
        PolicyCommand::Status { json, access } => {
            let access = access.access()?;
            let status = tokio()?.block_on(async { Operator::connect(&access).await?.status().await })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(&status);
            }
            return Ok(());
        }
        _ => {}
    }
    let rt = PolicyRuntime::new()?;
    match cmd {
        PolicyCommand::Swap { .. } | PolicyCommand::Status { .. } => unreachable!("handled above"),
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

fn print_status(s: &ClusterStatus) {
    println!("policy: {} (sha256 {}), swaps: {}", s.policy, &s.sha256[..16], s.swaps);
    if !s.config.is_empty() {
        let cfg: Vec<String> = s.config.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("config: {}", cfg.join(","));
    }
    println!(
        "{:<6} {:<7} {:<22} {:<12} {:>8} {:>9} {:>9} {:>8} {:>7}",
        "server", "shard", "policy", "sha256", "workers", "pushes", "pulls", "deferred", "swaps"
    );
    for server in &s.servers {
        for sh in &server.shards {
            let policy =
                if sh.quarantined { format!("{} (QUARANTINED)", sh.policy) } else { sh.policy.clone() };
            println!(
                "{:<6} {:<7} {:<22} {:<12} {:>8} {:>9} {:>9} {:>8} {:>7}",
                server.server,
                sh.shard,
                policy,
                &sh.sha256[..12],
                sh.workers.len(),
                sh.stats.pushes_admitted,
                sh.stats.pulls_served,
                sh.stats.pulls_deferred,
                sh.stats.swaps
            );
        }
    }
    let live: Vec<String> = s.workers.iter().filter(|w| w.connected).map(|w| w.worker.to_string()).collect();
    let lost: Vec<String> =
        s.workers.iter().filter(|w| !w.connected && !w.finished).map(|w| w.worker.to_string()).collect();
    let done = s.workers.iter().filter(|w| w.finished).count();
    println!("workers: connected [{}], finished {}, lost [{}]", live.join(", "), done, lost.join(", "));
}
