//! Compression chosen by the policy (issue 38): pushes and pulls in fp16, int8 and top-k on
//! real clusters and in the simulator, counted with the `counter` workload; SparseLoCo's codec
//! (issue 53) in the simulator.
//!
//! The counter's values are small integers, which fp16 carries exactly: a cluster pushing and
//! pulling in fp16 ends at the exact sums. Top-k is lossy per push, but its error feedback loses
//! nothing: what a worker's codecs left out and it has not pushed yet (`codec_owed` in its
//! report) is exactly what the model lacks, summed over every parameter.

use std::time::Duration;

use syncopate::builtin::PolicySpec;
use syncopate::lab::report::RunReport;
use syncopate::lab::scenario::{RunSpec, Scenario};
use syncopate::lab::sim::{simulate, SimFaults, SimOptions, Simulated};

use crate::cluster::{assert_all, status, syncopate, LocalRun};

/// Minus the sum of every worker's value times its steps: where every parameter ends when no
/// push lost anything.
fn exact(report: &RunReport) -> f64 {
    -report.workers.iter().map(|w| f64::from(w.worker + 1) * w.steps as f64).sum::<f64>()
}

/// Error feedback loses nothing: the model's sum falls short of the exact sums by what the
/// workers still owe, exactly (every value involved is a small integer).
fn assert_conserved(model: &[f32], report: &RunReport, what: &str) {
    let sum: f64 = model.iter().map(|v| f64::from(*v)).sum();
    let owed: f64 = report.workers.iter().map(|w| w.codec_owed).sum();
    assert_eq!(sum, model.len() as f64 * exact(report) + owed, "{what}: owed {owed}");
}

fn sim(text: &str, policy: &str) -> Simulated {
    let scenario: Scenario = toml::from_str(text).expect("a scenario");
    scenario.check().expect("valid");
    let opts = SimOptions {
        run: RunSpec::new(scenario, policy.parse::<PolicySpec>().unwrap()),
        gradients: true,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    simulate(&opts, syncopate_suite::runtime()).expect("simulates")
}

const COUNTER: &str = "name = \"codecs\"\nworkers = 3\nservers = 2\nworkload = \"counter\"\nparams = 40000\n\
                       compute_ms = 5\niterations = 100\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n";

/// In the simulator: fp16 both ways is exact on the counter and moves about half the bytes per
/// step; top-k at 1% (chosen by the policy) moves a fiftieth of the push bytes and loses
/// nothing once what is owed is counted; int8 pulls make every pull about a quarter.
#[test]
fn the_simulator_charges_each_codecs_bytes_and_error_feedback_loses_nothing() {
    let plain = sim(COUNTER, "bsp");
    let fp16 = sim(&format!("{COUNTER}push_codec = \"fp16\"\npull_codec = \"fp16\"\n"), "bsp");
    let expected = exact(&plain.report) as f32;
    assert_eq!(plain.model, vec![expected; 40000]);
    assert_eq!(fp16.model, vec![expected; 40000], "small integers are exact in fp16");
    let sent = |s: &Simulated| s.report.workers.iter().map(|w| w.bytes_sent).sum::<u64>() as f64;
    let got = |s: &Simulated| s.report.workers.iter().map(|w| w.bytes_received).sum::<u64>() as f64;
    let (push_ratio, pull_ratio) = (sent(&fp16) / sent(&plain), got(&fp16) / got(&plain));
    assert!(push_ratio < 0.55 && pull_ratio < 0.55, "fp16: {push_ratio:.3} pushed, {pull_ratio:.3} pulled");

    let topk = sim(COUNTER, "bsp:push_codec=topk-0.01,pull_codec=int8");
    assert_conserved(&topk.model, &topk.report, "top-k");
    assert!(topk.report.workers.iter().all(|w| w.codec_owed > 0.0), "top-k left some behind");
    let (push_ratio, pull_ratio) = (sent(&topk) / sent(&plain), got(&topk) / got(&plain));
    assert!(
        push_ratio < 0.05 && pull_ratio < 0.3,
        "top-k, int8: {push_ratio:.3} pushed, {pull_ratio:.3} pulled"
    );

    // SparseLoCo (issue 53): 2% of each chunk in 2 bits a value; without decay (beta 1) its
    // error feedback loses nothing either (up to the rounding of its codes' means to f32: the
    // residual no longer holds small integers alone), and its pushes are a third of top-k's at 1%.
    let sloco = sim(COUNTER, "bsp:push_codec=sparseloco-0.02-1");
    let sum: f64 = sloco.model.iter().map(|v| f64::from(*v)).sum();
    let owed: f64 = sloco.report.workers.iter().map(|w| w.codec_owed).sum();
    let want = sloco.model.len() as f64 * exact(&sloco.report) + owed;
    assert!(owed != 0.0 && (sum - want).abs() < 1e-7 * want.abs(), "sparseloco: {sum} against {want}");
    let push_ratio = sent(&sloco) / sent(&plain);
    assert!(push_ratio < 0.025, "sparseloco: {push_ratio:.4} of float32's push bytes");
    assert!(sent(&sloco) < sent(&topk), "fewer bytes than top-k at 1%");
}

/// A real cluster pushes and pulls in fp16 from the start (`--push-codec`, `--pull-codec`),
/// then hot-swaps to BSP with top-k pushes and int8 pulls chosen by the policy (each worker
/// told at its next pull, and acknowledging): the fp16 phase is exact, the top-k phase owes
/// exactly what it left out, and the workers sent and received far fewer bytes than float32.
#[test]
fn a_cluster_pushes_in_the_codecs_its_policy_chooses_and_loses_nothing() {
    let params = 50_000;
    let mut run = LocalRun::start(
        "codecs",
        &[
            "--workers",
            "2",
            "--servers",
            "2",
            "--iterations",
            "150",
            "--delay-ms",
            "20",
            "--params",
            &params.to_string(),
            "--push-codec",
            "fp16",
            "--pull-codec",
            "fp16",
        ],
    );
    let cluster = run.cluster_file();
    std::thread::sleep(Duration::from_millis(600));
    let out = syncopate(
        &["policy", "swap", "bsp:push_codec=topk-0.01,pull_codec=int8", "--watch-s", "0.3"],
        &cluster,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st = status(&cluster);
    assert!(st.workers.iter().all(|w| w.connected && !w.finished), "run ended before the swap: {st:?}");
    let (status, run) = run.finish(Duration::from_secs(180));
    assert!(status.success(), "{}", run.output());
    let report = run.report();
    let model = run.model();
    assert_conserved(&model, &report, "fp16, then top-k");
    for w in &report.workers {
        assert_eq!(w.iterations, 150, "{w:?}");
        assert!(w.controls >= 2, "each shard's policy told it the push codec: {w:?}");
        // Float32 would be 150 pushes and 150 pulls of 50,000 values: 30 MB each way.
        let raw = 150.0 * params as f64 * 4.0;
        let (sent, got) = (w.bytes_sent as f64 / raw, w.bytes_received as f64 / raw);
        assert!(
            sent < 0.55 && got < 0.55,
            "worker {}: sent {sent:.3}, received {got:.3} of float32",
            w.worker
        );
    }
    assert!(report.workers.iter().all(|w| w.codec_owed > 0.0), "top-k ran and left some behind: {report:?}");
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!((s.stats.swaps, s.stats.pushes_admitted), (1, 300), "{s:?}");
    }
}

/// fp16 both ways, the whole run: exact, parameter by parameter.
#[test]
fn a_cluster_in_fp16_ends_at_the_exact_sums() {
    let run = LocalRun::start(
        "codecs-fp16",
        &[
            "--workers",
            "3",
            "--servers",
            "2",
            "--shards",
            "3",
            "--iterations",
            "30",
            "--params",
            "1000",
            "--push-codec",
            "fp16",
            "--pull-codec",
            "fp16",
        ],
    );
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    let report = run.report();
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 30.0, "fp16 both ways");
    assert!(report.workers.iter().all(|w| w.codec_owed == 0.0), "small integers leave nothing behind");
}
