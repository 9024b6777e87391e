//! `syncopate ab`: one scenario under several policies, one run after the other on this machine,
//! and one comparison report: a table (time to the target accuracy, final and best accuracy,
//! iterations per second, waiting, deferred pulls, bytes moved, staleness, moved tasks) as
//! Markdown and JSON, and two pictures with every policy on them (test accuracy against time,
//! and the share of time workers spent waiting).
//!
//! Each run is a real local cluster (processes over QUIC, started by [`crate::lab::local`] from
//! the scenario and the policy as one [`RunSpec`]) or, with `simulate`, the same `RunSpec` in the
//! simulator; each in its own folder under the output folder, with its full report and plots.

use std::path::{Path, PathBuf};

use crate::builtin::PolicySpec;
use crate::lab::local::LocalOptions;
use crate::lab::report::{AbRow, Comparison, RunReport};
use crate::lab::scenario::{RunSpec, Scenario};
use crate::NodeError;

/// How to run a comparison.
#[derive(Clone, Debug)]
pub struct AbOptions {
    /// The `syncopate` executable each cluster role runs.
    pub exe: PathBuf,
    /// The scenario.
    pub scenario: Scenario,
    /// The policies, in order.
    pub policies: Vec<PolicySpec>,
    /// Where the runs and the comparison go.
    pub out: PathBuf,
    /// The Fashion-MNIST directory, when not the default.
    pub data: Option<PathBuf>,
    /// Run each policy in the deterministic simulator instead of as a real local cluster.
    pub simulate: bool,
    /// With `simulate`: compute real gradients and score the model (false: decisions only).
    pub gradients: bool,
}

/// Parses a `--policies` list: specs separated by commas, where a `k=v` item without a colon
/// continues the previous policy's configuration (`dssp:s_lo=3,s_hi=15,bsp` is two policies).
pub fn parse_policies(list: &str) -> Result<Vec<PolicySpec>, String> {
    let mut specs: Vec<String> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match specs.last_mut() {
            Some(last) if item.contains('=') && !item.contains(':') => {
                last.push(',');
                last.push_str(item);
            }
            _ => specs.push(item.to_owned()),
        }
    }
    if specs.is_empty() {
        return Err("no policies given".into());
    }
    specs.iter().map(|s| s.parse::<PolicySpec>().map_err(|e| e.to_string())).collect()
}

/// A folder name for a policy spec.
fn slug(spec: &PolicySpec) -> String {
    spec.to_string().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

/// Runs the scenario under every policy and writes the comparison into `opts.out`.
pub fn run(opts: &AbOptions) -> Result<Comparison, NodeError> {
    let io = |what: String| move |source| NodeError::Io { what, source };
    std::fs::create_dir_all(&opts.out).map_err(io(format!("cannot create {}", opts.out.display())))?;
    // Real runs drive their clusters from this runtime; simulated ones need none.
    let rt = match opts.simulate {
        true => None,
        false => Some(
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(io("cannot start the async runtime".into()))?,
        ),
    };
    let mut rows = Vec::new();
    let mut reports = Vec::new();
    let total = opts.policies.len();
    for (i, spec) in opts.policies.iter().enumerate() {
        let dir = opts.out.join(slug(spec));
        let _ = std::fs::remove_dir_all(&dir);
        println!("[{}/{total}] {} — scenario `{}`", i + 1, spec, opts.scenario.name);
        let run = RunSpec::new(opts.scenario.clone(), spec.clone());
        if opts.simulate {
            let report = simulated(opts, run, &dir)?;
            rows.push(AbRow::from_report(spec.to_string(), &report, dir));
            reports.push(report);
            continue;
        }
        let mut local = LocalOptions::new(opts.exe.clone(), dir.clone(), run);
        if let Some(data) = &opts.data {
            local.data = data.clone();
        }
        let rt = rt.as_ref().expect("built for real runs");
        let report = rt.block_on(crate::lab::local::run(local)).map_err(|e| {
            NodeError::Protocol(format!(
                "the run under {spec} failed: {e}; its logs are in {}",
                dir.join("logs").display()
            ))
        })?;
        if !report.failed_workers.is_empty() {
            return Err(NodeError::Protocol(format!(
                "under {spec}, {} of {} workers did not finish; their logs are in {}",
                report.failed_workers.len(),
                opts.scenario.workers,
                dir.join("logs").display()
            )));
        }
        rows.push(AbRow::from_report(spec.to_string(), &report, dir));
        reports.push(report);
    }
    let mut files = Vec::new();
    let md = opts.out.join("comparison.md");
    std::fs::write(&md, table(&opts.scenario, &rows))
        .map_err(io(format!("cannot write {}", md.display())))?;
    files.push(md);
    match crate::lab::plots::comparison(&rows, &reports, &opts.scenario, &opts.out) {
        Ok(mut plots) => files.append(&mut plots),
        Err(e) => tracing::warn!("comparison plots not written: {e}"),
    }
    let comparison = Comparison { scenario: opts.scenario.clone(), rows, files };
    let json = opts.out.join("comparison.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&comparison).expect("serializes"))
        .map_err(io(format!("cannot write {}", json.display())))?;
    Ok(comparison)
}

/// One policy in the simulator; writes its report and plots into `dir` as a real run would.
fn simulated(opts: &AbOptions, run: RunSpec, dir: &Path) -> Result<RunReport, NodeError> {
    let rt = crate::runtime::PolicyRuntime::new().map_err(|e| NodeError::Protocol(e.to_string()))?;
    let sim = crate::lab::sim::SimOptions { run, gradients: opts.gradients, data: opts.data.clone() };
    let t = std::time::Instant::now();
    let crate::lab::sim::Simulated { mut report, model } =
        crate::lab::sim::simulate(&sim, &rt).map_err(|e| NodeError::Protocol(e.to_string()))?;
    std::fs::create_dir_all(dir)
        .map_err(|source| NodeError::Io { what: format!("cannot create {}", dir.display()), source })?;
    let model_file = dir.join("model.bin");
    std::fs::write(&model_file, crate::net::wire::f32_bytes(&model))
        .map_err(|source| NodeError::Io { what: format!("cannot write {}", model_file.display()), source })?;
    report.model_file = Some(model_file);
    report.plots = crate::lab::plots::write_all(&report, dir).unwrap_or_default();
    let path = dir.join("report.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report).expect("serializes"))
        .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    println!(
        "simulated {:.1} s of training in {:.1} s: final accuracy {}",
        report.elapsed_s,
        t.elapsed().as_secs_f64(),
        report.final_accuracy.map_or("-".into(), |a| format!("{:.1}%", a * 100.0))
    );
    Ok(report)
}

/// The comparison as a Markdown table, with the scenario above it.
pub fn table(scenario: &Scenario, rows: &[AbRow]) -> String {
    let mut t = format!("# Scenario `{}`\n\n{}\n\n", scenario.name, scenario.description);
    let target = scenario.target_accuracy.map_or("target".into(), |a| format!("{:.0}%", a * 100.0));
    t.push_str(&format!(
        "| policy | time to {target} | final acc | best acc | it/s per worker | wait (share) | deferred pulls (per 100 it) | MB moved | mean staleness | tasks moved |\n"
    ));
    t.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    let pct = |a: Option<f32>| a.map_or("-".into(), |a| format!("{:.1}%", a * 100.0));
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.2} s ({:.0}%) | {} ({:.0}) | {:.0} | {:.2} | {} |\n",
            r.policy,
            match (scenario.target_accuracy, r.time_to_target_s) {
                (None, _) => "-".into(),
                (Some(_), None) => "not reached".into(),
                (Some(_), Some(s)) => format!("{s:.1} s"),
            },
            pct(r.final_accuracy),
            pct(r.best_accuracy),
            r.iterations_per_s,
            r.wait_s,
            r.wait_share * 100.0,
            r.deferred_pulls,
            r.deferred_pulls as f64 * 100.0 / r.iterations.max(1) as f64,
            r.bytes_moved as f64 / 1e6,
            r.mean_staleness,
            r.tasks_moved,
        ));
    }
    t.push_str("\nStaleness counts optimizer steps between a gradient's pull and its admission (15 or more count as 15).\n");
    t
}

/// Where `ab` puts a comparison by default: `runs/ab-<scenario>-<time>`.
pub fn default_out(scenario: &Scenario) -> PathBuf {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Path::new("runs").join(format!("ab-{}-{secs}", scenario.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_lists_keep_each_policys_configuration() {
        let p = parse_policies("bsp, dssp:s_lo=3,s_hi=15,ssp:s=2,./my.wasm:k=1").unwrap();
        let shown: Vec<String> = p.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["bsp", "dssp:s_lo=3,s_hi=15", "ssp:s=2", "./my.wasm:k=1"]);
        assert!(parse_policies(" , ").is_err());
        assert_eq!(slug(&p[1]), "dssp-s_lo-3-s_hi-15".replace('_', "-"));
    }
}
