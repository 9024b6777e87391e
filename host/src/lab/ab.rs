//! `syncopate ab`: one scenario under several policies, one run after the other on this machine,
//! and one comparison report: a table (time to the target accuracy, final and best accuracy,
//! iterations per second, waiting, deferred pulls, bytes moved, staleness, moved tasks) as
//! Markdown and JSON, and pictures with every policy on them.
//!
//! Each run is a real local cluster (processes over QUIC, started by [`crate::lab::local`] from
//! the scenario and the policy as one [`RunSpec`]) or, with `simulate`, the same `RunSpec` in the
//! simulator; each in its own folder under the output folder, with its full report and plots.
//!
//! With `repeat` above 1, each policy runs that many times with seeds `seed`, `seed + 1`, ...
//! (the seed draws the initial model, the data order, the injected delays and the policies'
//! random source), in the interleaved order of [`schedule`]. Every figure ([`FIGURES`]) is then
//! reported as the median over the runs with a confidence interval, and every policy gets a
//! verdict against the baseline on each figure ([`crate::lab::stats`] says how both are computed).
//! A single run proves nothing about a difference: on this project's machines time to target
//! moves by 30-50% between identical runs.

use std::path::{Path, PathBuf};

use crate::builtin::PolicySpec;
use crate::lab::local::LocalOptions;
use crate::lab::report::{AbRow, Comparison, Figure, Outcome, PolicySummary, RunReport, Verdict, FIGURES};
use crate::lab::scenario::{RunSpec, Scenario};
use crate::lab::stats::{median_ci, rank_sum_test, ratio_interval, ALPHA};
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
    /// Runs per policy, seeds `scenario.seed`, `scenario.seed + 1`, ...
    pub repeat: u32,
    /// The policy the others are judged against (default: the first).
    pub baseline: Option<PolicySpec>,
    /// Write each run's TensorBoard event file under this directory, by policy (and seed), so
    /// TensorBoard overlays them.
    pub tensorboard: Option<PathBuf>,
}

impl AbOptions {
    /// A comparison of `policies` under `scenario`, one run each, real clusters, into `out`.
    pub fn new(exe: PathBuf, scenario: Scenario, policies: Vec<PolicySpec>, out: PathBuf) -> Self {
        AbOptions {
            exe,
            scenario,
            policies,
            out,
            data: None,
            simulate: false,
            gradients: true,
            repeat: 1,
            baseline: None,
            tensorboard: None,
        }
    }

    /// The baseline's index in `policies`, or why there is none.
    pub fn baseline_index(&self) -> Result<usize, String> {
        match &self.baseline {
            None => Ok(0),
            Some(b) => self.policies.iter().position(|p| p.to_string() == b.to_string()).ok_or_else(|| {
                format!("the baseline `{b}` is not among the policies compared ({})", list(&self.policies))
            }),
        }
    }
}

fn list(policies: &[PolicySpec]) -> String {
    policies.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// The figures that exist only where the scenario has a target, infinite for a run that never
/// reached it. A run stops at the watcher's look that first saw the target: steps and bytes
/// count until then, plus the iterations in flight (at most one per worker).
const TARGET_FIGURES: &[&str] = &["time_to_target_s", "steps_to_target", "mb_to_target"];

/// The figures a verdict table shows, when the runs have them.
const VERDICT_FIGURES: &[&str] = &[
    "time_to_target_s",
    "steps_to_target",
    "mb_to_target",
    "best_accuracy",
    "best_loss",
    "iterations_per_s",
    "steps_per_s",
    "wait_share",
    "deferred_per_100_iterations",
    "mb_moved",
    "kb_per_step",
    "kb_pushed_per_step",
];

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
    spec.label().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

/// What tables, plots and verdicts call each policy: its [`PolicySpec::label`] (a module file
/// by its file name, not its whole path), or the whole spec where two labels would be the same.
pub fn labels(policies: &[PolicySpec]) -> Vec<String> {
    let short: Vec<String> = policies.iter().map(PolicySpec::label).collect();
    let unique = |i: usize| short.iter().filter(|l| **l == short[i]).count() == 1;
    (0..policies.len()).map(|i| if unique(i) { short[i].clone() } else { policies[i].to_string() }).collect()
}

/// The order of a comparison's runs: repeat by repeat, every policy once per repeat, each
/// repeat starting one policy later than the one before, so drift on the machine (other load,
/// thermal state) falls on every policy alike and no policy always runs first.
/// Returns `(policy index, repeat index)` pairs.
pub fn schedule(policies: usize, repeat: u32) -> Vec<(usize, u32)> {
    (0..repeat).flat_map(|r| (0..policies).map(move |j| ((j + r as usize) % policies, r))).collect()
}

/// Runs the scenario under every policy, `opts.repeat` times each, and writes the comparison
/// into `opts.out`.
pub fn run(opts: &AbOptions) -> Result<Comparison, NodeError> {
    let io = |what: String| move |source| NodeError::Io { what, source };
    let baseline = opts.baseline_index().map_err(NodeError::Protocol)?;
    if opts.repeat == 0 {
        return Err(NodeError::Protocol("--repeat must be at least 1".into()));
    }
    std::fs::create_dir_all(&opts.out).map_err(io(format!("cannot create {}", opts.out.display())))?;
    // Simulated runs share one policy runtime (one wasm engine for the whole comparison); real
    // runs drive their clusters from an async runtime.
    let sim_rt = match opts.simulate {
        true => Some(crate::runtime::PolicyRuntime::new().map_err(|e| NodeError::Protocol(e.to_string()))?),
        false => None,
    };
    let rt = match opts.simulate {
        true => None,
        false => Some(
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(io("cannot start the async runtime".into()))?,
        ),
    };
    let order = schedule(opts.policies.len(), opts.repeat);
    let labels = labels(&opts.policies);
    let total = order.len();
    let mut runs: Vec<(usize, AbRow, RunReport)> = Vec::with_capacity(total);
    for (n, &(i, r)) in order.iter().enumerate() {
        let spec = &opts.policies[i];
        let seed = opts.scenario.seed.wrapping_add(u64::from(r));
        let dir = match opts.repeat {
            1 => opts.out.join(slug(spec)),
            _ => opts.out.join(slug(spec)).join(format!("seed-{seed}")),
        };
        let _ = std::fs::remove_dir_all(&dir);
        println!("[{}/{total}] {} — scenario `{}`, seed {seed}", n + 1, labels[i], opts.scenario.name);
        let mut scenario = opts.scenario.clone();
        scenario.seed = seed;
        let run = RunSpec::new(scenario, spec.clone());
        let report = match opts.simulate {
            true => simulated(opts, run, &dir, sim_rt.as_ref().expect("built for simulated runs"))?,
            false => real(opts, run, &dir, rt.as_ref().expect("built for real runs"))?,
        };
        if let Some(tb) = &opts.tensorboard {
            let at = tb.join(dir.strip_prefix(&opts.out).unwrap_or(&dir));
            if let Err(e) = crate::lab::tensorboard::write_run(&at, &report) {
                tracing::warn!("no TensorBoard file in {}: {e}", at.display());
            }
        }
        let row = AbRow { seed, ..AbRow::from_report(labels[i].clone(), &report, dir) };
        runs.push((i, row, report));
    }
    // Rows by policy, then seed: the order a reader looks for them.
    runs.sort_by_key(|(i, row, _)| (*i, row.seed));
    let (summaries, verdicts) = summarize(opts, baseline, &runs);
    let rows: Vec<AbRow> = runs.iter().map(|(_, row, _)| row.clone()).collect();
    let reports: Vec<RunReport> = runs.into_iter().map(|(_, _, report)| report).collect();
    let mut comparison = Comparison {
        scenario: opts.scenario.clone(),
        rows,
        repeat: opts.repeat,
        baseline: Some(labels[baseline].clone()),
        summaries,
        verdicts,
        files: Vec::new(),
    };
    let md = opts.out.join("comparison.md");
    std::fs::write(&md, markdown(&comparison)).map_err(io(format!("cannot write {}", md.display())))?;
    comparison.files.push(md);
    match crate::lab::plots::comparison(&comparison, &reports, &opts.out) {
        Ok(mut plots) => comparison.files.append(&mut plots),
        Err(e) => tracing::warn!("comparison plots not written: {e}"),
    }
    let json = opts.out.join("comparison.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&comparison).expect("serializes"))
        .map_err(io(format!("cannot write {}", json.display())))?;
    Ok(comparison)
}

/// One policy on a real local cluster; fails when any worker did not finish.
fn real(
    opts: &AbOptions,
    run: RunSpec,
    dir: &Path,
    rt: &tokio::runtime::Runtime,
) -> Result<RunReport, NodeError> {
    let spec = run.policy.clone();
    let mut local = LocalOptions::new(opts.exe.clone(), dir.to_path_buf(), run);
    if let Some(data) = &opts.data {
        local.data = Some(data.clone());
    }
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
    Ok(report)
}

/// The figures of the runs `runs` (policy index, row, report), per policy, and every policy
/// against the baseline.
fn summarize(
    opts: &AbOptions,
    baseline: usize,
    runs: &[(usize, AbRow, RunReport)],
) -> (Vec<PolicySummary>, Vec<Verdict>) {
    let samples = |i: usize, f: &Figure| -> Option<Vec<f64>> {
        runs.iter().filter(|(p, _, _)| *p == i).map(|(_, row, _)| (f.get)(row)).collect()
    };
    let has = |f: &Figure| !TARGET_FIGURES.contains(&f.key) || opts.scenario.target().is_some();
    let mut summaries = Vec::new();
    let labels = labels(&opts.policies);
    for (i, label) in labels.iter().enumerate() {
        let seeds = runs.iter().filter(|(p, _, _)| *p == i).map(|(_, row, _)| row.seed).collect();
        let figures = FIGURES
            .iter()
            .filter(|f| has(f))
            .filter_map(|f| samples(i, f).map(|xs| (f.key.to_string(), median_ci(&xs))))
            .collect();
        summaries.push(PolicySummary { policy: label.clone(), seeds, figures });
    }
    let mut verdicts = Vec::new();
    let base_name = labels[baseline].clone();
    for i in (0..opts.policies.len()).filter(|i| *i != baseline) {
        for f in FIGURES.iter().filter(|f| has(f)) {
            let (Some(a), Some(b)) = (samples(i, f), samples(baseline, f)) else { continue };
            verdicts.push(verdict(labels[i].clone(), base_name.clone(), f, &a, &b));
        }
    }
    (summaries, verdicts)
}

/// Policy runs `a` against baseline runs `b` on figure `f`.
pub fn verdict(policy: String, baseline: String, f: &Figure, a: &[f64], b: &[f64]) -> Verdict {
    let test = rank_sum_test(a, b);
    let (ma, mb) = (median_ci(a).median, median_ci(b).median);
    let ratio = match (ma, mb) {
        (Some(x), Some(y)) if y != 0.0 => Some(x / y),
        _ => None,
    };
    let significant = test.p < ALPHA;
    let outcome = match (significant, f.lower_is_better) {
        (false, _) => Outcome::Same,
        (true, None) => Outcome::Same,
        (true, Some(lower_better)) if test.first_lower == lower_better => Outcome::Better,
        (true, Some(_)) => Outcome::Worse,
    };
    let word = if test.first_lower { f.words.0 } else { f.words.1 };
    let text = match (significant, test.min_p >= ALPHA) {
        (true, _) if test.p < 0.001 => format!("{word} (p < 0.001)"),
        (true, _) => format!("{word} (p = {:.3})", test.p),
        (false, true) => format!("too few runs to tell (p ≥ {:.3} at best)", test.min_p),
        (false, false) => format!("no detectable difference (p = {:.2})", test.p),
    };
    let ratio_interval = ratio_interval(a, b);
    Verdict { policy, baseline, figure: f.key.to_string(), ratio, ratio_interval, test, outcome, text }
}

/// One policy in the simulator; writes its report and plots into `dir` as a real run would.
fn simulated(
    opts: &AbOptions,
    run: RunSpec,
    dir: &Path,
    rt: &crate::runtime::PolicyRuntime,
) -> Result<RunReport, NodeError> {
    let sim = crate::lab::sim::SimOptions {
        gradients: opts.gradients,
        data: opts.data.clone(),
        failures: Vec::new(),
        faults: crate::lab::sim::SimFaults::default(),
        run,
    };
    let t = std::time::Instant::now();
    let crate::lab::sim::Simulated { mut report, model, .. } =
        crate::lab::sim::simulate(&sim, rt).map_err(|e| NodeError::Protocol(e.to_string()))?;
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
        "simulated {:.1} s of training in {:.1} s: final accuracy {}, loss {}",
        report.elapsed_s,
        t.elapsed().as_secs_f64(),
        report.final_accuracy.map_or("-".into(), |a| format!("{:.1}%", a * 100.0)),
        report.final_loss.map_or("-".into(), |l| format!("{l:.3}"))
    );
    Ok(report)
}

/// The comparison in Markdown: the scenario, then with one run per policy a row per policy;
/// with `--repeat`, the medians with their intervals, the verdicts against the baseline, and
/// every run's row.
pub fn markdown(c: &Comparison) -> String {
    let scenario = &c.scenario;
    let mut t = format!("# Scenario `{}`\n\n", scenario.name);
    if !scenario.description.is_empty() {
        t.push_str(&format!("{}\n\n", scenario.description));
    }
    if let Some(m) = &scenario.modelled {
        t.push_str(&format!(
            "**Modelled costs:** every transfer moves the bytes of {} ({} bytes a full model), and \
             each iteration computes for {} ms; gradients and accuracy come from the `{}` workload.\n\n",
            m.name, m.bytes, scenario.compute_ms, scenario.workload
        ));
    }
    let target = scenario.target().map_or("target".into(), |t| t.label());
    let label = |f: &Figure| match f.key {
        "time_to_target_s" => format!("time to {target}"),
        "steps_to_target" => format!("steps to {target}"),
        "mb_to_target" => format!("MB to {target}"),
        _ => f.label.to_string(),
    };
    if c.repeat <= 1 {
        t.push_str(&table(scenario, &c.rows, false));
        return t;
    }
    let confidence =
        c.summaries.iter().flat_map(|s| s.figures.iter().map(|(_, e)| e.confidence)).fold(1.0, f64::min);
    t.push_str(&format!(
        "{} runs per policy (seeds {}), interleaved. Each cell is the median over the runs with its \
         distribution-free confidence interval [lo, hi] (coverage at least {:.1}%; 95% needs 6 or more \
         runs). Verdicts: two-sided exact Wilcoxon-Mann-Whitney rank-sum test at p < {ALPHA} against the \
         baseline, `{}`.\n\n",
        c.repeat,
        c.summaries.first().map_or(String::new(), |s| {
            s.seeds.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        }),
        confidence * 100.0,
        c.baseline.as_deref().unwrap_or("-"),
    ));
    let shown: Vec<&Figure> =
        FIGURES.iter().filter(|f| c.summaries.iter().any(|s| s.figure(f.key).is_some())).collect();
    t.push_str("| policy |");
    for f in &shown {
        t.push_str(&format!(" {} |", label(f)));
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(shown.len()));
    t.push('\n');
    for s in &c.summaries {
        t.push_str(&format!("| {} |", s.policy));
        for f in &shown {
            let cell = s.figure(f.key).map_or("-".into(), |e| {
                format!("{} [{}, {}]", f.unit.show(e.median), f.unit.show(e.lo), f.unit.show(e.hi))
            });
            t.push_str(&format!(" {cell} |"));
        }
        t.push('\n');
    }
    let judged: Vec<&Figure> = shown.iter().copied().filter(|f| VERDICT_FIGURES.contains(&f.key)).collect();
    if let Some(base) = &c.baseline {
        t.push_str(&format!(
            "\n## Against `{base}`\n\nRatio of medians with Bauer's distribution-free interval for the factor \
             between the two policies' runs (where every run is finite), then the verdict.\n\n| policy |"
        ));
        for f in &judged {
            t.push_str(&format!(" {} |", label(f)));
        }
        t.push_str("\n|---|");
        t.push_str(&"---|".repeat(judged.len()));
        t.push('\n');
        for s in c.summaries.iter().filter(|s| &s.policy != base) {
            t.push_str(&format!("| {} |", s.policy));
            for f in &judged {
                let v = c.verdicts.iter().find(|v| v.policy == s.policy && v.figure == f.key);
                let cell = v.map_or("-".into(), |v| {
                    let ratio = match (v.ratio, v.ratio_interval) {
                        (Some(r), Some(i)) => format!("{r:.2}x [{:.2}, {:.2}]", i.lo, i.hi),
                        (Some(r), None) => format!("{r:.2}x"),
                        (None, _) => "-".into(),
                    };
                    match v.outcome {
                        Outcome::Same => format!("{ratio}, {}", v.text),
                        _ => format!("{ratio}, **{}**", v.text),
                    }
                });
                t.push_str(&format!(" {cell} |"));
            }
            t.push('\n');
        }
    }
    t.push_str("\n## Every run\n\n");
    t.push_str(&table(scenario, &c.rows, true));
    t
}

/// The runs' rows as a Markdown table (with a seed column when `seeds`).
pub fn table(scenario: &Scenario, rows: &[AbRow], seeds: bool) -> String {
    let target = scenario.target().map_or("target".into(), |t| t.label());
    let mut t = format!(
        "| policy |{} time to {target} | final acc | best acc | final loss | best loss | it/s (steps/s) per worker | wait: pulls + acks (share) | deferred pulls (per 100 it) | MB moved | KB per step (pushed) | mean staleness | tasks moved |\n",
        if seeds { " seed |" } else { "" }
    );
    t.push_str(if seeds { "|---|---|" } else { "|---|" });
    t.push_str("---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let pct = |a: Option<f32>| a.map_or("-".into(), |a| format!("{:.1}%", a * 100.0));
    let loss = |l: Option<f32>| l.map_or("-".into(), |l| format!("{l:.3}"));
    for r in rows {
        t.push_str(&format!(
            "| {} |{} {} | {} | {} | {} | {} | {:.1} ({:.1}) | {:.2} + {:.2} s ({:.0}%) | {} ({:.0}) | {:.0} | {:.1} ({:.1}) | {:.2} | {} |\n",
            r.policy,
            if seeds { format!(" {} |", r.seed) } else { String::new() },
            match (scenario.target(), r.time_to_target_s) {
                (None, _) => "-".into(),
                (Some(_), None) => "not reached".into(),
                (Some(_), Some(s)) => format!("{s:.1} s"),
            },
            pct(r.final_accuracy),
            pct(r.best_accuracy),
            loss(r.final_loss),
            loss(r.best_loss),
            r.iterations_per_s,
            r.steps_per_s,
            r.wait_s - r.push_wait_s,
            r.push_wait_s,
            r.wait_share * 100.0,
            r.deferred_pulls,
            r.deferred_pulls as f64 * 100.0 / r.iterations.max(1) as f64,
            r.bytes_moved as f64 / 1e6,
            r.bytes_moved as f64 / 1e3 / r.steps.max(1) as f64,
            r.bytes_pushed as f64 / 1e3 / r.steps.max(1) as f64,
            r.mean_staleness,
            r.tasks_moved,
        ));
    }
    t.push_str("\nWait is per worker: in pulls (a policy deferring them, and the transfer) plus waiting for its pushes' acknowledgements (a policy holding them, and the transfer); the share is of the run.\n");
    t.push_str("Staleness counts optimizer steps between a gradient's pull and its admission (15 or more count as 15).\n");
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
    fn runs_interleave_and_each_repeat_starts_one_policy_later() {
        assert_eq!(schedule(3, 2), [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (0, 1)]);
        let order = schedule(4, 5);
        for p in 0..4 {
            assert_eq!(order.iter().filter(|(q, _)| *q == p).count(), 5, "every policy runs 5 times");
        }
        let firsts: Vec<usize> = order.chunks(4).map(|c| c[0].0).collect();
        assert_eq!(firsts, [0, 1, 2, 3, 0], "no policy always goes first");
    }

    #[test]
    fn verdicts_say_which_way_and_whether_the_runs_can_tell() {
        let time = FIGURES.iter().find(|f| f.key == "time_to_target_s").unwrap();
        let v = verdict(
            "epsp".into(),
            "bsp".into(),
            time,
            &[4.0, 5.0, 4.0, 6.0, 5.0],
            &[9.0, 12.0, 8.0, 10.0, 11.0],
        );
        assert_eq!(v.outcome, Outcome::Better);
        assert!(v.text.starts_with("sooner (p = 0.008"), "{}", v.text);
        assert!((v.ratio.unwrap() - 0.5).abs() < 1e-12);
        let i = v.ratio_interval.unwrap();
        assert!(i.lo < 0.5 && 0.5 < i.hi && i.hi < 0.8, "{i:?}");
        let acc = FIGURES.iter().find(|f| f.key == "best_accuracy").unwrap();
        let v = verdict(
            "asp".into(),
            "bsp".into(),
            acc,
            &[0.70, 0.71, 0.72, 0.69, 0.70],
            &[0.8, 0.81, 0.79, 0.8, 0.82],
        );
        assert_eq!(v.outcome, Outcome::Worse, "lower accuracy is worse: {}", v.text);
        let v = verdict("a".into(), "b".into(), time, &[5.0, 7.0, 6.0, 9.0], &[6.0, 8.0, 5.5, 7.5]);
        assert_eq!(v.outcome, Outcome::Same);
        assert!(v.text.starts_with("no detectable difference"), "{}", v.text);
        let v = verdict("a".into(), "b".into(), time, &[1.0, 2.0], &[8.0, 9.0]);
        assert!(v.text.contains("too few runs"), "2 against 2 can never be significant: {}", v.text);
        // A policy that never reaches the target is later than one that does.
        let v = verdict("a".into(), "b".into(), time, &[f64::INFINITY; 5], &[3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!((v.outcome, v.ratio, v.ratio_interval), (Outcome::Worse, None, None));
        // A comparison written before verdicts had intervals still reads.
        let mut old = serde_json::to_value(&v).unwrap();
        old.as_object_mut().unwrap().remove("ratio_interval");
        let back: Verdict = serde_json::from_value(old).unwrap();
        assert_eq!(back, v);
        // Ten runs a side apart: a p-value three decimals cannot show.
        let fast: Vec<f64> = (0..10).map(|i| 4.0 + f64::from(i) / 10.0).collect();
        let slow: Vec<f64> = (0..10).map(|i| 8.0 + f64::from(i) / 10.0).collect();
        let v = verdict("a".into(), "b".into(), time, &fast, &slow);
        assert_eq!(v.text, "sooner (p < 0.001)");
    }

    #[test]
    fn policy_lists_keep_each_policys_configuration() {
        let p = parse_policies("bsp, dssp:s_lo=3,s_hi=15,ssp:s=2,./my.wasm:k=1").unwrap();
        let shown: Vec<String> = p.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["bsp", "dssp:s_lo=3,s_hi=15", "ssp:s=2", "./my.wasm:k=1"]);
        assert!(parse_policies(" , ").is_err());
        assert_eq!(slug(&p[1]), "dssp-s_lo-3-s_hi-15".replace('_', "-"));
    }
}
