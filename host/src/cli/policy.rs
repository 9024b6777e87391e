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
use crate::runtime::{ModuleKind, PolicyInstance, PolicyRuntime};

/// How many generated event sequences `policy check` drives a module through.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct CasesArgs {
    /// Generated cases to run (each a few workers and iterations; 64 take a few seconds).
    #[arg(long, default_value_t = crate::lab::explore::DEFAULT_CASES)]
    pub cases: u32,
    /// Long generated cases to run after those (each thousands of events: one instance
    /// throughout, or its state handed to a fresh instance every few dozen events).
    #[arg(long, default_value_t = crate::lab::explore::DEFAULT_LONG_CASES)]
    pub long_cases: u32,
    /// The first case's seed (a failure names its case: `--seed N --cases 1` runs it again).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Policy subcommands.
#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy module, print its name, version, ABI version and parameters, and drive
    /// it on a real shard through generated event sequences (joins, late joins, pulls, pushes,
    /// reports, timers, leaves, hot swaps to itself, ASP and BSP; then long cases of thousands
    /// of events): a failure, a push acknowledged twice, a refused hand-over, or a request never
    /// answered fails the check, with the events that led there, shrunk.
    Check {
        /// The module file (or a built-in's name), optionally with its configuration
        /// (`my_policy.wasm:k=3`).
        file: String,
        /// Configuration to try it with, as k=v pairs (defaults are used for the rest).
        #[arg(long = "config", value_name = "K=V", value_delimiter = ',')]
        config: Vec<String>,
        #[command(flatten)]
        cases: CasesArgs,
        /// Also replay a recorded run (`syncopate local --record DIR`: a directory of
        /// shard-N.rec files, or one) through the module: it must not fail on any event.
        #[arg(long, value_name = "DIR")]
        recording: Option<PathBuf>,
    },
    /// Write a new policy crate to start from: a workspace of its own with the SDK of this
    /// `syncopate` vendored and its dependencies pinned, a working policy (SSP) and a native test.
    New {
        /// The policy's name (also the crate's): lowercase letters, digits, `-` and `_`.
        name: String,
        /// Where to write the crate (default: ./NAME). It must not exist or must be empty.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Build a policy crate to a wasm module (release profile, wasm32 target, installed with
    /// rustup if missing), then check the module as `policy check` does.
    Build {
        /// The crate's directory.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Configuration to check it with, as k=v pairs (defaults are used for the rest).
        #[arg(long = "config", value_name = "K=V", value_delimiter = ',')]
        config: Vec<String>,
        #[command(flatten)]
        cases: CasesArgs,
    },
    /// Feed a recorded run (`syncopate local --record DIR`, or a server's `--record`) to a
    /// policy module, deterministically, and set its decisions beside the recorded ones: pulls
    /// served or deferred and how long they would have waited, pushes held or dropped, and the
    /// first events where the two differ. Test a new rule offline against a real run. Without
    /// `--policy`, it replays through the recorded modules, following the run's hot swaps, and
    /// its decisions are the recorded ones exactly.
    Replay {
        /// The recording: a directory of shard-N.rec files, or one such file.
        recording: PathBuf,
        /// The policy to replay the whole recording through, with its configuration (default:
        /// the recorded ones, swaps followed).
        #[arg(long)]
        policy: Option<PolicySpec>,
        /// Only this shard.
        #[arg(long)]
        shard: Option<u32>,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// List the built-in policies with their parameters.
    List,
    /// Swap the policy of a running cluster. A module file is checked first, as `policy check`
    /// does in brief (--no-check skips it). Every server then prepares the module and tries it
    /// on each of its shards' state; if any cannot, none switches and this says why. Then the
    /// new policy is watched for a few seconds, by its own record on every shard (failures since
    /// it started there, backoff, quarantine). Exit status: 0, the swap is in force and its
    /// policy did not fail while watched (or the run ended during the watch, which is said);
    /// 1, nothing was swapped; 2, the swap went through but its policy failed while watched, or
    /// some shards could not switch (with --rollback, the last policy that ran without failures
    /// is swapped back in, and this says which).
    Swap {
        /// The policy: a built-in name or a .wasm file, with its configuration (`ssp:s=3`).
        policy: PolicySpec,
        /// A per-shard configuration override, `SHARD:KEY=VALUE` (repeatable).
        #[arg(long = "shard-config", value_parser = super::args::parse_override)]
        overrides: Vec<(u32, String, String)>,
        /// Seconds to watch the new policy's first events after the swap (0: do not watch).
        #[arg(long, default_value_t = 3.0)]
        watch_s: f64,
        /// If the new policy fails while watched, swap back in the last policy that ran without
        /// failing.
        #[arg(long)]
        rollback: bool,
        /// Do not check a module file before swapping it in.
        #[arg(long)]
        no_check: bool,
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
        PolicyCommand::Swap { policy, overrides, watch_s, rollback, no_check, access } => {
            if !no_check && !policy.is_builtin() {
                let rt = PolicyRuntime::new()?;
                quick_check(&rt, &policy).context("not swapped in (--no-check swaps it in unchecked)")?;
            }
            let source = super::roles::policy_source(&policy, overrides)?;
            let access = access.access()?;
            return tokio()?.block_on(swap_and_watch(&access, &source, watch_s, rollback));
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
        PolicyCommand::Check { file, config, cases, recording } => {
            check(&rt, &file, &config, cases)?;
            if let Some(dir) = recording {
                check_recording(&rt, &file, &config, &dir)?;
            }
        }
        PolicyCommand::Replay { recording, policy, shard, json } => {
            let reports = replay(&rt, &recording, policy.as_ref(), shard)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else {
                for r in &reports {
                    print_replay(r);
                }
            }
        }
        PolicyCommand::New { name, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            crate::authoring::new_policy(&dir, &name)?;
            println!("wrote the policy crate `{name}` to {}", dir.display());
            println!("  cd {} && cargo test             # the native tests", dir.display());
            println!("  syncopate policy build {}        # the wasm module, checked", dir.display());
        }
        PolicyCommand::Build { dir, config, cases } => {
            let module = crate::authoring::build_policy(&dir)?;
            check(&rt, &module.display().to_string(), &config, cases)?;
            let size = std::fs::metadata(&module).map(|m| m.len()).unwrap_or(0);
            println!("  size:        {:.1} KB", size as f64 / 1024.0);
            println!("load it with: syncopate policy swap {}", module.display());
        }
        PolicyCommand::List => {
            for name in builtin::names() {
                let spec: PolicySpec = name.parse()?;
                let module = spec.load(&rt)?;
                print_info(module.info(), Some(module.abi()), "");
                println!();
            }
            for name in builtin::cluster_names() {
                let spec: PolicySpec = name.parse()?;
                let module = spec.load(&rt)?;
                print_info(module.info(), None, "");
                println!("abi:         cluster v{} (a cluster policy: --pilot {name})", module.abi());
                println!();
            }
        }
    }
    Ok(())
}

/// Replays every recording in `path` (a shard's file or a directory of them) through `policy`,
/// or through the recorded policy where none is given.
fn replay(
    rt: &PolicyRuntime,
    path: &std::path::Path,
    policy: Option<&PolicySpec>,
    shard: Option<u32>,
) -> anyhow::Result<Vec<crate::replay::Report>> {
    use crate::recording::{self, Entry};
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
            let file = entry?.path();
            if file.extension().is_some_and(|e| e == "rec") {
                files.push(file);
            }
        }
        files.sort_by_key(|f| {
            let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            (stem.trim_start_matches("shard-").parse::<u32>().unwrap_or(u32::MAX), f.clone())
        });
        anyhow::ensure!(!files.is_empty(), "{} holds no recordings (shard-N.rec files)", path.display());
    } else {
        files.push(path.to_path_buf());
    }
    let mut reports = Vec::new();
    for file in files {
        let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
        let entries = recording::read(&bytes).with_context(|| file.display().to_string())?;
        let Some(Entry::Started { shard: recorded, source, config, .. }) = entries.first() else {
            anyhow::bail!("{}: the recording is empty", file.display());
        };
        if shard.is_some_and(|s| s != *recorded) {
            continue;
        }
        let spec = match policy {
            Some(p) => p.clone(),
            None => PolicySpec {
                source: source.strip_prefix("builtin:").unwrap_or(source).to_string(),
                config: config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            },
        };
        let module = spec
            .load(rt)
            .with_context(|| format!("loading the policy to replay through ({})", spec.source))?;
        // Without --policy, the replay follows the recording's swaps through the recorded
        // modules (each checked by its SHA-256), and is exact.
        let resolve = |source: &str, sha256: &[u8; 32]| -> Result<crate::runtime::PolicyModule, String> {
            let spec = PolicySpec {
                source: source.strip_prefix("builtin:").unwrap_or(source).to_string(),
                config: Vec::new(),
            };
            let module = spec.load(rt).map_err(|e| e.to_string())?;
            match module.sha256() == *sha256 {
                true => Ok(module),
                false => {
                    Err(format!("{} is no longer the module recorded (its SHA-256 differs)", spec.source))
                }
            }
        };
        let follow: Option<crate::replay::Resolve<'_>> = policy.is_none().then_some(&resolve);
        let report = crate::replay::replay(&entries, &module, &spec.config, follow)
            .with_context(|| format!("replaying {}", file.display()))?;
        reports.push(report);
    }
    anyhow::ensure!(
        !reports.is_empty(),
        "no recording of shard {} in {}",
        shard.unwrap_or(0),
        path.display()
    );
    Ok(reports)
}

fn print_replay(r: &crate::replay::Report) {
    let ms = |ns: u64| format!("{:.1}", ns as f64 / 1e6);
    println!("shard {}: {} events recorded under {}", r.shard, r.events, r.recorded_policies.join(", then "));
    println!("replayed through {}", r.replayed_policy);
    let (a, b) = (&r.recorded, &r.replayed);
    println!("  {:<26} {:>10} {:>10}", "", "recorded", "replayed");
    let rows: [(&str, String, String); 12] = [
        ("pulls served at once", a.pulls_served_at_once.to_string(), b.pulls_served_at_once.to_string()),
        ("pulls deferred", a.pulls_deferred.to_string(), b.pulls_deferred.to_string()),
        ("  mean wait (ms)", ms(a.mean_wait_ns()), ms(b.mean_wait_ns())),
        ("  longest wait (ms)", ms(a.pull_wait_max_ns), ms(b.pull_wait_max_ns)),
        ("  never served", a.pulls_never_served.to_string(), b.pulls_never_served.to_string()),
        ("pushes admitted", a.pushes_admitted.to_string(), b.pushes_admitted.to_string()),
        ("pushes held", a.pushes_held.to_string(), b.pushes_held.to_string()),
        ("pushes dropped", a.pushes_dropped.to_string(), b.pushes_dropped.to_string()),
        ("rounds completed early", a.aggregates_completed.to_string(), b.aggregates_completed.to_string()),
        ("control messages", a.controls.to_string(), b.controls.to_string()),
        ("metric values", a.metrics.to_string(), b.metrics.to_string()),
        ("policy failures", a.failures.to_string(), b.failures.to_string()),
    ];
    for (name, x, y) in rows {
        println!("  {name:<26} {x:>10} {y:>10}");
    }
    let pct = 100.0 * r.identical as f64 / r.compared.max(1) as f64;
    println!("  identical decisions on {} of {} events answered ({pct:.1}%)", r.identical, r.compared);
    if let Some(why) = &r.stopped {
        println!("  the replayed module failed and the replay stopped {why}");
    }
    if r.differing == 0 {
        println!("  every push and pull answered alike");
    } else {
        println!(
            "  {} pushes and pulls answered differently; the first {}:",
            r.differing,
            r.differences.len()
        );
        for d in &r.differences {
            println!(
                "    at {:.3} s, {}: recorded {}, replayed {}",
                d.now_ns as f64 / 1e9,
                d.event,
                d.recorded,
                d.replayed
            );
        }
    }
    println!();
}

/// `policy check`: validates the module, starts it, explores it
/// ([`crate::lab::explore`]), and prints what it is. `file` is a module file or a built-in's
/// name, perhaps with a configuration (`FILE:k=v,...`), which `config` adds to.
fn check(rt: &PolicyRuntime, file: &str, config: &[String], cases: CasesArgs) -> anyhow::Result<()> {
    let spec = with_config(file, config)?;
    let (label, wasm) = spec.bytes()?;
    if rt.compile(&label, &wasm)?.kind() == ModuleKind::Cluster {
        let (module, explored) = explore_cluster(rt, &label, &wasm, &spec.config, cases)?;
        println!("ok: {}", spec.source);
        println!("  sha256:      {}", module.sha256_hex());
        print_info(module.info(), None, "  ");
        println!("  abi:         cluster v{} (run by the coordinator: --pilot)", module.abi());
        println!(
            "  exercised:   {} generated clusters, {} windows, {} swaps asked",
            explored.cases, explored.windows, explored.swaps
        );
        return Ok(());
    }
    let (module, explored) = explore(rt, &label, &wasm, &spec.config, cases)?;
    println!("ok: {}", spec.source);
    println!("  sha256:      {}", module.sha256_hex());
    print_info(module.info(), Some(module.abi()), "  ");
    println!(
        "  exercised:   {} generated cases ({} long), {} events: {} pulls deferred, {} pushes held, {} dropped, {} state hand-overs",
        explored.cases,
        cases.long_cases.min(explored.cases),
        explored.events,
        explored.deferred,
        explored.held,
        explored.dropped,
        explored.handovers
    );
    Ok(())
}

/// `file` (a module or a built-in, perhaps with a configuration) with `config` added.
fn with_config(file: &str, config: &[String]) -> anyhow::Result<PolicySpec> {
    let mut spec: PolicySpec = file.parse()?;
    let extra: PolicySpec = format!("x:{}", config.join(",")).parse()?;
    spec.config.extend(extra.config);
    Ok(spec)
}

/// Validates the module `wasm` (with `config`), starts it, and drives it through `cases`
/// generated cases, then the long ones: the first broken case, shrunk, is the error.
fn explore(
    rt: &PolicyRuntime,
    label: &str,
    wasm: &[u8],
    config: &[(String, String)],
    cases: CasesArgs,
) -> anyhow::Result<(crate::runtime::PolicyModule, crate::lab::explore::Explored)> {
    let module = rt.compile(label, wasm)?;
    let args = InitArgs {
        shard: 0,
        shards: 1,
        now_ns: 0,
        config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
    };
    PolicyInstance::new(&module, &args).context("the module loads but does not start")?;
    // Swapped out to and back from two built-ins that differ in kind: one that defers nothing
    // and one that defers every pull to a barrier.
    let others: Vec<_> = ["asp", "bsp"]
        .iter()
        .map(|n| rt.compile(n, builtin::wasm(n).expect("built in")))
        .collect::<Result<_, _>>()?;
    let broken = |b: Box<crate::lab::explore::Broken>| {
        anyhow::anyhow!("the module breaks a rule in a generated case: {b}")
    };
    let mut explored =
        crate::lab::explore::explore(&module, config, &others, cases.seed, cases.cases).map_err(broken)?;
    let long =
        crate::lab::explore::explore_long(&module, config, cases.seed, cases.long_cases).map_err(broken)?;
    explored.cases += long.cases;
    explored.events += long.events;
    explored.deferred += long.deferred;
    explored.held += long.held;
    explored.dropped += long.dropped;
    explored.handovers += long.handovers;
    Ok((module, explored))
}

/// Validates the cluster policy module `wasm` (with `config`), starts it, and runs it through
/// `cases.cases` generated clusters ([`crate::lab::explore_cluster`]): the first that breaks a
/// rule is the error.
fn explore_cluster(
    rt: &PolicyRuntime,
    label: &str,
    wasm: &[u8],
    config: &[(String, String)],
    cases: CasesArgs,
) -> anyhow::Result<(crate::runtime::PolicyModule, crate::lab::explore_cluster::ClusterExplored)> {
    let module = rt.compile(label, wasm)?;
    syncopate_engine::pilot::Pilot::start(&module, config, 1, 0)
        .context("the module loads but does not start")?;
    let explored = crate::lab::explore_cluster::explore_cluster(&module, config, cases.seed, cases.cases)
        .map_err(|b| anyhow::anyhow!("the cluster policy breaks a rule in a generated cluster: {b}"))?;
    Ok((module, explored))
}

/// The check a module gets where it enters a cluster (`local`, `policy swap`): `policy check`
/// in brief (a quarter of its cases, one long case). Built-ins are checked by the test suite.
pub(super) fn quick_check(rt: &PolicyRuntime, spec: &PolicySpec) -> anyhow::Result<()> {
    let (label, wasm) = spec.bytes()?;
    quick_check_module(rt, &label, &wasm, &spec.config)
}

/// [`quick_check`] of a module's bytes (one uploaded to the dashboard).
pub(crate) fn quick_check_module(
    rt: &PolicyRuntime,
    label: &str,
    wasm: &[u8],
    config: &[(String, String)],
) -> anyhow::Result<()> {
    let cases = CasesArgs { cases: crate::lab::explore::DEFAULT_CASES / 4, long_cases: 1, seed: 0 };
    if rt.compile(label, wasm)?.kind() == ModuleKind::Cluster {
        return explore_cluster(rt, label, wasm, config, cases).map(|_| ());
    }
    explore(rt, label, wasm, config, cases).map(|_| ())
}

/// `policy check --recording`: replays a recorded run through the module; any failure fails the
/// check, with the event it failed on.
fn check_recording(
    rt: &PolicyRuntime,
    file: &str,
    config: &[String],
    recording: &std::path::Path,
) -> anyhow::Result<()> {
    let spec = with_config(file, config)?;
    let reports = replay(rt, recording, Some(&spec), None)?;
    let mut failed = Vec::new();
    for r in &reports {
        let differ = match r.differing {
            0 => "every push and pull answered alike".to_string(),
            n => format!("{n} pushes and pulls answered differently"),
        };
        println!(
            "  recording:   shard {}, {} events recorded under {}: {} of {} decisions identical, {differ}",
            r.shard,
            r.events,
            r.recorded_policies.join(", then "),
            r.identical,
            r.compared
        );
        if let Some(why) = &r.stopped {
            failed.push(format!("shard {}: the module failed {why}", r.shard));
        } else if r.replayed.failures > 0 {
            failed.push(format!("shard {}: the module failed on {} events", r.shard, r.replayed.failures));
        }
    }
    match failed.is_empty() {
        true => Ok(()),
        false => anyhow::bail!("the module fails on the recorded run: {}", failed.join("; ")),
    }
}

/// Swaps `source` in, then watches it for `watch_s` seconds (module docs of `Swap`).
async fn swap_and_watch(
    access: &crate::net::tls::ClusterAccess,
    source: &crate::coordinator::PolicySource,
    watch_s: f64,
    rollback: bool,
) -> anyhow::Result<()> {
    use crate::operator::Swapped;
    let op = Operator::connect(access).await?;
    let before = op.status().await?;
    let swap = match op.swap(source).await? {
        Swapped::Whole { swap, shards } => {
            println!("swap {swap}: {} now runs on all {shards} shards", source.label);
            swap
        }
        Swapped::Partly { swap, failed } => {
            return Err(super::Exit::with(
                2,
                format!("swap {swap}: {} was committed, but not on every shard: {failed}", source.label),
            ))
        }
    };
    if watch_s <= 0.0 {
        return Ok(());
    }
    let sha = source.blob().sha256.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let (started, step) = (std::time::Instant::now(), std::time::Duration::from_millis(250));
    let mut events = 0;
    let failure = loop {
        let elapsed = started.elapsed().as_secs_f64();
        if elapsed >= watch_s {
            break None;
        }
        tokio::time::sleep(step.min(std::time::Duration::from_secs_f64(watch_s - elapsed))).await;
        let after = match op.status().await {
            Ok(s) => s,
            Err(e) => {
                // The swap is in force; the cluster went away (a run that ended, say).
                println!(
                    "swap {swap} is in force; the cluster stopped answering {:.1} s into the watch \
                     (the run ended?): {e}; no failure of the new policy seen in {events} events before",
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
        };
        let verdict = watched(&before, &after, &sha);
        events = verdict.events;
        if verdict.failure.is_some() {
            break verdict.failure;
        }
    };
    let Some(failure) = failure else {
        println!("watched {watch_s} s: no failures in {events} events on the new policy");
        return Ok(());
    };
    if !rollback {
        return Err(super::Exit::with(
            2,
            format!(
                "{failure}; the shards run on the fallback rules while it backs off or is quarantined: \
                 swap another policy in, or rerun with --rollback"
            ),
        ));
    }
    match op.rollback().await {
        Ok(back) => {
            let now = op.status().await.map(|s| s.policy).unwrap_or_else(|_| "the policy before".into());
            let partly = match &back {
                Swapped::Whole { .. } => String::new(),
                Swapped::Partly { failed, .. } => format!(" (not on every shard: {failed})"),
            };
            Err(super::Exit::with(
                2,
                format!("{failure}; rolled back (swap {}) to {now}{partly}", back.swap()),
            ))
        }
        Err(e) => Err(super::Exit::with(2, format!("{failure}; the rollback failed: {e}"))),
    }
}

/// What watching a swapped-in policy found.
struct Watched {
    /// Pushes and pulls the shards handled while watched.
    events: u64,
    /// What went wrong, if anything.
    failure: Option<String>,
}

/// Judges the policy whose module's SHA-256 is `sha` (hex) by its own record on every shard
/// now (failures since it started there, a backoff, a quarantine); a shard that does not run it
/// is a failure of the swap. The events are counted against `before`.
fn watched(before: &ClusterStatus, after: &ClusterStatus, sha: &str) -> Watched {
    let shards = |s: &ClusterStatus| -> Vec<crate::net::proto::ShardStatus> {
        s.servers.iter().flat_map(|sv| sv.shards.iter().cloned()).collect()
    };
    let (old, new) = (shards(before), shards(after));
    let mut events = 0;
    let mut failed = Vec::new();
    let mut quarantined = Vec::new();
    for sh in &new {
        let was = old.iter().find(|o| o.shard == sh.shard);
        let base = |f: fn(&crate::shard::ShardStats) -> u64| was.map_or(0, |o| f(&o.stats));
        events += (sh.stats.pushes_admitted + sh.stats.pushes_dropped + sh.stats.pulls_served)
            .saturating_sub(base(|s| s.pushes_admitted + s.pushes_dropped + s.pulls_served));
        if sh.sha256 != sha {
            failed.push(format!("shard {} runs {}, not the new policy", sh.shard, sh.policy));
            continue;
        }
        if sh.policy_failures_now > 0 {
            let why = sh.last_failure.as_deref().unwrap_or("no message");
            let backoff = sh.backoff_ms.map(|ms| format!(", backing off {:.1} s", ms as f64 / 1e3));
            failed.push(format!(
                "shard {}: {} failures{}, the last: {why}",
                sh.shard,
                sh.policy_failures_now,
                backoff.unwrap_or_default()
            ));
        }
        if sh.quarantined {
            quarantined.push(sh.shard.to_string());
        }
    }
    let failure = (!failed.is_empty() || !quarantined.is_empty()).then(|| {
        let q = if quarantined.is_empty() {
            String::new()
        } else {
            format!(" (quarantined on shards {})", quarantined.join(", "))
        };
        format!("the new policy failed after the swap{q}: {}", failed.join("; "))
    });
    Watched { events, failure }
}

/// Prints what a module declares; `abi` is the ABI version it was built for.
/// `abi`: the shard policy ABI the module was built for (`None`: a cluster policy, whose ABI
/// the caller prints).
fn print_info(info: &ModuleInfo, abi: Option<u32>, indent: &str) {
    println!("{indent}name:        {}", info.name);
    println!("{indent}version:     {}", info.version);
    if let Some(abi) = abi {
        let note = if abi < ABI_VERSION { " (built by an earlier SDK: loaded as it was)" } else { "" };
        println!("{indent}abi:         v{abi}{note}");
    }
    println!("{indent}description: {}", info.description);
    if info.params.is_empty() {
        println!("{indent}parameters:  none");
    } else {
        println!("{indent}parameters:");
        // Columns as wide as their longest entry, so long names line up too.
        let name = info.params.iter().map(|p| p.name.len()).max().unwrap_or(0).max(10);
        let kind = info.params.iter().map(|p| p.kind.name().len()).max().unwrap_or(0).max(6);
        let default = info.params.iter().map(|p| p.default.len()).max().unwrap_or(0).max(8);
        for p in &info.params {
            println!(
                "{indent}  {:<name$} {:<kind$} default {:<default$} {}",
                p.name,
                p.kind.name(),
                p.default,
                p.doc
            );
        }
    }
}

fn print_status(s: &ClusterStatus) {
    println!("policy: {} (sha256 {}), swaps: {}", s.policy, &s.sha256[..16], s.swaps);
    if !s.config.is_empty() {
        let cfg: Vec<String> = s.config.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("config: {}", cfg.join(","));
    }
    if let Some(p) = &s.pilot {
        let state = if p.quarantined { "QUARANTINED (the cluster keeps its policy)" } else { "running" };
        println!("{}: every {} ms, {} swaps asked, {state}", p.policy, p.cadence_ms, p.swaps);
        if !p.metrics.is_empty() {
            let m: Vec<String> = p.metrics.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            println!("cluster policy metrics: {}", m.join(", "));
        }
        for e in p.log.iter().rev().take(5).rev() {
            println!("cluster policy at {:.1} s: {}", e.at_ns as f64 / 1e9, e.what);
        }
    }
    println!(
        "{:<6} {:<7} {:<22} {:<12} {:>8} {:>9} {:>8} {:>11} {:>9} {:>8} {:>12} {:>7} {:>11} {:<11}",
        "server",
        "shard",
        "policy",
        "sha256",
        "workers",
        "pushes",
        "dropped",
        "held (now)",
        "pulls",
        "deferred",
        "parked (now)",
        "swaps",
        "fails (now)",
        "state"
    );
    for server in &s.servers {
        for sh in &server.shards {
            let state = match (sh.quarantined, sh.backoff_ms) {
                (true, _) => "QUARANTINED".to_string(),
                (false, Some(ms)) => format!("backoff {:.1}s", ms as f64 / 1e3),
                (false, None) => "running".to_string(),
            };
            println!(
                "{:<6} {:<7} {:<22} {:<12} {:>8} {:>9} {:>8} {:>11} {:>9} {:>8} {:>12} {:>7} {:>11} {:<11}",
                server.server,
                sh.shard,
                sh.policy,
                &sh.sha256[..12],
                sh.workers.len(),
                sh.stats.pushes_admitted,
                sh.stats.pushes_dropped,
                format!("{} ({})", sh.stats.pushes_held, sh.held),
                sh.stats.pulls_served,
                sh.stats.pulls_deferred,
                sh.parked,
                sh.stats.swaps,
                format!("{} ({})", sh.stats.policy_failures, sh.policy_failures_now),
                state
            );
        }
    }
    for server in &s.servers {
        for sh in &server.shards {
            if let Some(p) = sh.parked_longest {
                println!(
                    "shard {} parks worker {}'s pull for iteration {}: parked for {:.1} s (its worker waits)",
                    sh.shard,
                    p.worker,
                    p.iteration,
                    p.parked_ns as f64 / 1e9
                );
            }
            if let Some(h) = sh.held_longest {
                println!(
                    "shard {} holds worker {}'s push for iteration {}: held for {:.1} s (its worker waits)",
                    sh.shard,
                    h.worker,
                    h.iteration,
                    h.held_ns as f64 / 1e9
                );
            }
            if let Some(e) = &sh.last_failure {
                println!("shard {} last failure: {e}", sh.shard);
            }
            if !sh.metrics.is_empty() {
                let m: Vec<String> = sh
                    .metrics
                    .iter()
                    .map(|m| {
                        format!("{} = {} (mean {:.3} of {})", m.name, m.last, m.sum / m.count as f64, m.count)
                    })
                    .collect();
                println!("shard {} metrics: {}", sh.shard, m.join(", "));
            }
        }
    }
    let replicated = s.placement.iter().any(|p| p.2.is_some()) || !s.lost_servers.is_empty();
    if replicated {
        for &(shard, primary, backup) in &s.placement {
            let lag = s
                .servers
                .iter()
                .flat_map(|sv| &sv.shards)
                .find(|sh| sh.shard == shard)
                .and_then(|sh| sh.replication)
                .and_then(|r| r.confirmed.map(|c| r.applied.saturating_sub(c)));
            match (backup, lag) {
                (Some(b), Some(lag)) => {
                    println!(
                        "shard {shard}: primary on server {primary}, backup on server {b}, {lag} ops behind"
                    )
                }
                (Some(b), None) => {
                    println!("shard {shard}: primary on server {primary}, backup on server {b}")
                }
                (None, _) => println!("shard {shard}: primary on server {primary}, no backup"),
            }
        }
        if !s.lost_servers.is_empty() {
            let lost: Vec<String> = s.lost_servers.iter().map(u32::to_string).collect();
            println!("servers lost and failed over: {}", lost.join(", "));
        }
    }
    let live: Vec<String> = s.workers.iter().filter(|w| w.connected).map(|w| w.worker.to_string()).collect();
    let lost: Vec<String> =
        s.workers.iter().filter(|w| !w.connected && !w.finished).map(|w| w.worker.to_string()).collect();
    let done = s.workers.iter().filter(|w| w.finished).count();
    println!("workers: connected [{}], finished {}, lost [{}]", live.join(", "), done, lost.join(", "));
    if let Some(r) = &s.score {
        let loss = r.score.loss.map(|l| format!(", loss {l:.4}")).unwrap_or_default();
        println!(
            "model score: test accuracy {:.2}%{loss} (worker {}, iteration {}; {} scores reported)",
            r.score.accuracy * 100.0,
            r.worker,
            r.score.iteration,
            r.count
        );
    }
    if let Some(e) = &s.evaluated {
        let loss = e.loss.map(|l| format!(", loss {l:.4}")).unwrap_or_default();
        println!(
            "evaluated: test accuracy {:.2}%{loss} (the launcher's evaluation, {} iterations in)",
            e.accuracy * 100.0,
            e.iteration
        );
    }
}
