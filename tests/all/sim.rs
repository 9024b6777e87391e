//! The deterministic simulator: the same seed gives the same report, bit for bit; on a small
//! scenario it agrees with a real cluster (processes over QUIC) on how the policies rank and,
//! worker by worker, on iterations, deferred pulls and time deferred, since both run the same
//! worker machine; and it runs EPSP's task moves through the same exactly-once ledger as the
//! servers.

use syncopate::builtin::PolicySpec;
use syncopate::lab::report::RunReport;
use syncopate::lab::scenario::{Placement, RunSpec, Scenario};
use syncopate::lab::sim::{simulate, FailAt, SimFailure, SimFaults, SimOptions, Simulated};
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

use crate::cli::syncopate_bin;
use crate::cluster::run_dir;

/// Four workers: three with random delays after computing, one computing 2x slower.
const SCENARIO: &str = "name = \"agree\"\nworkers = 4\nservers = 2\nworkload = \"counter\"\ncompute_ms = 10\n\
    iterations = 60\n\
    [[jitter]]\nworker = 0\nmean_ms = 10.0\nsd_ms = 8.0\n[[jitter]]\nworker = 1\nmean_ms = 10.0\nsd_ms = 8.0\n\
    [[jitter]]\nworker = 2\nmean_ms = 10.0\nsd_ms = 8.0\n[[slow]]\nworker = 3\nfactor = 2.0\n";

fn scenario(text: &str) -> Scenario {
    let s: Scenario = toml::from_str(text).expect("scenario parses");
    s.check().expect("scenario is valid");
    s
}

fn sim(scenario: &Scenario, policy: &str, gradients: bool) -> RunReport {
    let opts = SimOptions {
        run: RunSpec::new(scenario.clone(), policy.parse::<PolicySpec>().unwrap()),
        gradients,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    simulate(&opts, syncopate_suite::runtime()).expect("simulates").report
}

/// The whole simulated run, gradients computed: its model and its report.
fn simulated(scenario: &Scenario, policy: &str) -> Simulated {
    let opts = SimOptions {
        run: RunSpec::new(scenario.clone(), policy.parse::<PolicySpec>().unwrap()),
        gradients: true,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    simulate(&opts, syncopate_suite::runtime()).expect("simulates")
}

/// The final model's bits and the run's final accuracy.
fn sim_model(scenario: &Scenario, policy: &str) -> (Vec<u32>, Option<f32>) {
    let out = simulated(scenario, policy);
    (out.model.iter().map(|x| x.to_bits()).collect(), out.report.final_accuracy)
}

/// A stop while a pull is still on the wire: the worker gives it up and says goodbye, and the
/// goodbye (latency alone) overtakes the pull (queued behind the other workers' pushes on the
/// server's link), which the shard then refuses as a stranger's. Nobody waits for that answer;
/// the run ends as any stopped run does. Found on `scenarios/lm-diloco.toml`, seed 2, where it
/// failed `ab`; these limits put the stop in that window (1.16 s and 1.28 s did before the fix,
/// and their neighbours only give the pull up).
#[test]
fn a_pull_given_up_at_a_stop_and_overtaken_by_its_goodbye_is_not_an_error() {
    let base = "name = \"overtaken\"\nworkload = \"fashion-mlp\"\nhidden = 2048\nworkers = 4\nservers = 2\n\
                compute_ms = 100\neval_every_ms = 10\n";
    let mut late = 0;
    for limit in ["1.14", "1.16", "1.18", "1.28"] {
        let s = scenario(&format!("{base}time_limit_s = {limit}\n"));
        let opts = SimOptions {
            run: RunSpec::new(s, "bsp".parse::<PolicySpec>().unwrap()),
            gradients: false,
            data: None,
            failures: Vec::new(),
            faults: SimFaults::default(),
        };
        let out = simulate(&opts, syncopate_suite::runtime()).expect("a stop is not an error");
        assert!(out.report.workers.iter().all(|w| w.stopped_early), "{limit}: stopped by the limit");
        late += out.late_refusals;
    }
    // The case itself happened (the timings above put it there), not only stops without it.
    assert!(late > 0, "no goodbye overtook a request given up");
}

fn deferred(r: &RunReport) -> u64 {
    r.workers.iter().map(|w| w.deferred_pulls).sum()
}

#[test]
fn the_same_seed_gives_the_same_report_bit_for_bit() {
    let s = scenario(SCENARIO);
    for policy in ["ssp:s=2", "fluentps:s=2,mode=sigmoid", "r2sp:global_batch=128,retune_ms=100"] {
        let (a, b) = (sim(&s, policy, true), sim(&s, policy, true));
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap(), "{policy}");
        assert!(a.workers.iter().all(|w| w.iterations == 60), "{policy}: every worker ran its iterations");
    }
    // A real model: gradients on the parameters each worker pulled, scored on the test set.
    let fashion = scenario(
        &SCENARIO.replace("\"counter\"", "\"fashion-softmax\"").replace("iterations = 60", "iterations = 40"),
    );
    let (a, b) = (sim(&fashion, "ssp:s=3", true), sim(&fashion, "ssp:s=3", true));
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    assert!(
        a.final_accuracy.is_some_and(|acc| acc > 0.5),
        "it learns (chance is 0.1): {:?}",
        a.final_accuracy
    );
    // Another seed, another run.
    let c = sim(&Scenario { seed: 2, ..s.clone() }, "ssp:s=2", true);
    assert_ne!(serde_json::to_string(&c).unwrap(), serde_json::to_string(&sim(&s, "ssp:s=2", true)).unwrap());
}

/// Momentum and weight decay on the workers, plain SGD on the servers: with one worker that is
/// the whole optimizer on the servers, bit for bit (the same arithmetic, split in two); with four,
/// each worker keeps its own velocity, a different run that still learns.
#[test]
fn the_optimizer_on_the_workers_is_the_servers_with_one_worker_and_its_own_with_four() {
    let one = scenario(
        "name = \"one\"\nworkers = 1\nservers = 2\nworkload = \"fashion-softmax\"\ncompute_ms = 10\n\
         iterations = 30\nweight_decay = 0.001\n",
    );
    let on_workers = |s: &Scenario| Scenario { optimizer_on: Placement::Worker, ..s.clone() };
    for policy in ["bsp", "asp"] {
        let (server, worker) = (sim_model(&one, policy), sim_model(&on_workers(&one), policy));
        assert_eq!(server, worker, "{policy}: one worker, either placement");
    }
    let four = scenario(
        &SCENARIO.replace("\"counter\"", "\"fashion-softmax\"").replace("iterations = 60", "iterations = 40"),
    );
    let (server, worker) = (sim_model(&four, "ssp:s=3"), sim_model(&on_workers(&four), "ssp:s=3"));
    assert_ne!(server.0, worker.0, "four velocities are not the servers' one");
    assert!(worker.1.is_some_and(|acc| acc > 0.5), "it learns (chance is 0.1): {:?}", worker.1);
}

#[test]
fn the_simulator_ranks_policies_as_the_real_cluster_does() {
    let s = scenario(SCENARIO);
    let dir = run_dir("sim-agree");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("agree.toml");
    std::fs::write(&file, SCENARIO).unwrap();
    let out = std::process::Command::new(syncopate_bin())
        .args(["ab", "--policies", "bsp,ssp:s=3,asp", "--scenario"])
        .arg(&file)
        .arg("--out")
        .arg(dir.join("real"))
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let real: Vec<RunReport> = ["bsp", "ssp-s-3", "asp"]
        .iter()
        .map(|p| {
            serde_json::from_slice(&std::fs::read(dir.join("real").join(p).join("report.json")).unwrap())
                .unwrap()
        })
        .collect();
    let simulated: Vec<RunReport> = ["bsp", "ssp:s=3", "asp"].iter().map(|p| sim(&s, p, true)).collect();
    let (r, m): (Vec<u64>, Vec<u64>) =
        (real.iter().map(deferred).collect(), simulated.iter().map(deferred).collect());
    // The ranking by deferred pulls: BSP far above SSP, ASP never defers.
    for (name, d) in [("real", &r), ("simulated", &m)] {
        assert!(d[0] > 3 * d[1], "{name}: BSP {} against SSP {}", d[0], d[1]);
        assert_eq!(d[2], 0, "{name}: ASP deferred pulls");
    }
    // Worker by worker, under BSP: the same iterations, and the deferred pulls and the time
    // they spent deferred (the wait metric, which means the same in both: per pull, the longest
    // any shard held it back) roughly alike (bounds below). A quiet release build agrees
    // within 5-20% per worker (27/33, 34/40, 45/46, 48/49 pulls; 0.26/0.29 to 0.45/0.50 s).
    let (rb, sb) = (&real[0], &simulated[0]);
    assert_eq!(rb.workers.len(), sb.workers.len());
    for (r, m) in rb.workers.iter().zip(&sb.workers) {
        let who = format!("worker {}: real {r:?}\nsimulated {m:?}", r.worker);
        assert_eq!((r.worker, r.iterations), (m.worker, m.iterations), "{who}");
        // Within a factor of two of each other (plus 3 pulls, plus 50 ms): under the parallel
        // suite on a loaded 2-core machine, a real worker 0 was deferred 18 times where the
        // simulator said 33, and another 19 times for 0.133 s where it said 33 for 0.291 s.
        let (rd, md) = (r.deferred_pulls as f64, m.deferred_pulls as f64);
        assert!((md - rd).abs() <= rd.max(md) / 2.0 + 3.0, "deferred pulls, {who}");
        let (rt, mt) = (r.deferred_ns as f64 / 1e9, m.deferred_ns as f64 / 1e9);
        let bound = rt.max(mt) / 2.0 + 0.05;
        assert!((mt - rt).abs() <= bound, "deferred time {rt:.3} s against {mt:.3} s, {who}");
        for w in [r, m] {
            assert!(w.deferred_ns <= w.wait_ns, "deferral is part of the time in pulls: {w:?}");
        }
    }
    // And BSP's count, the one that dominates, within half of the real one (a release build on
    // a quiet machine agrees within a few percent: 171 against 165; the suite runs its tests in
    // parallel on a busy debug build).
    let (real_bsp, sim_bsp) = (r[0] as f64, m[0] as f64);
    assert!(
        (sim_bsp - real_bsp).abs() <= real_bsp / 2.0,
        "BSP deferred pulls: real {real_bsp}, simulated {sim_bsp}"
    );
}

/// Counter pushes of exactly known values, straggler at 3x: the cluster test's EPSP set-up.
const EPSP: &str =
    "name = \"epsp-sim\"\nworkers = 4\nservers = 2\nshards = 3\nworkload = \"counter\"\nparams = 64\n\
    compute_ms = 20\niterations = 30\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
    [[slow]]\nworker = 0\nfactor = 3.0\n";

#[test]
fn epsp_in_the_simulator_moves_a_stragglers_tasks_and_every_iteration_counts_exactly_once() {
    let s = scenario(EPSP);
    let opts = SimOptions {
        run: RunSpec::new(s, "epsp:elastic=false,tasks=8".parse::<PolicySpec>().unwrap()),
        gradients: true,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    let out = simulate(&opts, syncopate_suite::runtime()).expect("simulates");
    // Worker w's iterations push w + 1 whoever computed their tasks: each of the 30 iterations
    // of each worker reaches the model exactly once, whole.
    let expected = -(1.0 + 2.0 + 3.0 + 4.0) * 30.0;
    assert!(out.model.iter().all(|v| *v == expected), "model {:?}, expected {expected}", &out.model[..4]);
    let r = &out.report;
    assert!(r.workers.iter().all(|w| w.iterations == 30), "every iteration counted once");
    let given: u64 = r.workers.iter().map(|w| w.tasks_given).sum();
    let helped: u64 = r.workers.iter().map(|w| w.tasks_helped).sum();
    let straggler = r.workers.iter().find(|w| w.worker == 0).expect("worker 0");
    assert!(straggler.tasks_given > 0, "the 3x slower worker was helped: {:?}", straggler);
    assert_eq!(given, straggler.tasks_given, "only the straggler gave tasks away");
    assert_eq!(helped, given, "every moved task was computed exactly once");
    for s in r.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!(s.stats.pushes_admitted, 120, "shard {}: one push per worker iteration", s.shard);
        assert_eq!(s.stats.policy_failures, 0);
    }
    // Moving tasks makes the straggler's iterations shorter than computing them all would.
    let bsp = sim(&scenario(EPSP), "bsp", true);
    let time = |r: &RunReport| r.workers.iter().map(|w| w.elapsed_ns).max().unwrap_or(0);
    assert!(time(r) < time(&bsp), "EPSP {} ns against BSP {} ns", time(r), time(&bsp));
}

/// Issue 38: EPSP sees a worker slowed between iterations (the jitter injection) as slow, since
/// its speed is the iteration time the servers observe, and gives it a smaller batch, so the
/// barrier waits less for it and the run ends sooner; from reported compute alone the worker
/// looks as fast as the others. (No task moves for it either way: its delay comes after its
/// computing, when no task is left to hand over.)
#[test]
fn epsp_shares_work_by_the_iteration_times_the_servers_observe() {
    let text = EPSP.replace(
        "[[slow]]\nworker = 0\nfactor = 3.0\n",
        "[[jitter]]\nworker = 0\nmean_ms = 30.0\nsd_ms = 3.0\n",
    );
    assert_ne!(text, EPSP, "the straggler is jittered instead");
    let run = |policy: &str| {
        let opts = SimOptions {
            run: RunSpec::new(scenario(&text), policy.parse::<PolicySpec>().unwrap()),
            gradients: true,
            data: None,
            failures: Vec::new(),
            faults: SimFaults::default(),
        };
        simulate(&opts, syncopate_suite::runtime()).expect("simulates")
    };
    let (observed, reported) = (run("epsp:share_ms=200"), run("epsp:share_ms=200,speed=reported"));
    let time =
        |s: &syncopate::lab::sim::Simulated| s.report.workers.iter().map(|w| w.elapsed_ns).max().unwrap_or(0);
    assert!(
        time(&observed) < time(&reported),
        "observed {} ns, reported {} ns",
        time(&observed),
        time(&reported)
    );
    assert!(observed.report.workers.iter().all(|w| w.iterations == 30));
}

#[test]
fn ab_simulate_reports_the_tasks_epsp_moved() {
    let dir = run_dir("sim-ab-epsp");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("epsp.toml");
    std::fs::write(&file, EPSP).unwrap();
    let out = std::process::Command::new(syncopate_bin())
        .args(["ab", "--simulate", "--policies", "bsp,epsp", "--scenario"])
        .arg(&file)
        .arg("--out")
        .arg(dir.join("out"))
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let c: syncopate::lab::report::Comparison =
        serde_json::from_slice(&std::fs::read(dir.join("out").join("comparison.json")).unwrap()).unwrap();
    let moved: Vec<u64> = c.rows.iter().map(|r| r.tasks_moved).collect();
    assert_eq!(moved[0], 0, "BSP moves nothing");
    assert!(moved[1] > 0, "EPSP moved the straggler's tasks: {stdout}");
    let table = std::fs::read_to_string(dir.join("out").join("comparison.md")).unwrap();
    assert!(table.contains(&format!(" {} |", moved[1])), "the table shows the moved tasks:\n{table}");
    // The simulated run keeps its model, as a real run does.
    let model = std::fs::read(dir.join("out").join("epsp").join("model.bin")).unwrap();
    assert_eq!(model.len(), 64 * 4, "the scenario's 64 parameters, 4 bytes each");
}

#[test]
fn the_simulator_carries_a_skip_ahead_to_every_shard_as_the_cluster_does() {
    let text = "name = \"skip\"\nworkers = 3\nservers = 2\nworkload = \"counter\"\ncompute_ms = 5\n\
        iterations = 60\n[[slow]]\nworker = 2\nfactor = 6.0\n";
    let policy = format!("{}:b=1,catch_up=true", env!("SYNCOPATE_BACKUP_WASM"));
    let r = sim(&scenario(text), &policy, false);
    let straggler = r.workers.iter().find(|w| w.worker == 2).expect("worker 2");
    assert!(straggler.iterations_skipped > 0, "the straggler skipped ahead: {straggler:?}");
    assert!(r.workers.iter().all(|w| w.iterations + w.iterations_skipped == 60), "{:?}", r.workers);
    let pushed: u64 = r.workers.iter().map(|w| w.iterations).sum();
    let skipped: u64 = r.workers.iter().map(|w| w.iterations_skipped).sum();
    for s in r.shards() {
        assert_eq!(s.stats.pushes_admitted + s.stats.pushes_dropped, pushed, "shard {}", s.shard);
        assert_eq!((s.stats.iterations_skipped, s.stats.policy_failures), (skipped, 0), "shard {}", s.shard);
    }
}

/// `syncopate ab --simulate --repeat 4` into `out`.
fn ab_repeat(dir: &std::path::Path, out: &str, extra: &[&str]) -> syncopate::lab::report::Comparison {
    let file = dir.join("agree.toml");
    std::fs::write(&file, SCENARIO).unwrap();
    let out = dir.join(out);
    let run = std::process::Command::new(syncopate_bin())
        .args(["ab", "--simulate", "--repeat", "4", "--policies", "bsp,ssp:s=2,asp", "--scenario"])
        .arg(&file)
        .args(extra)
        .arg("--out")
        .arg(&out)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    serde_json::from_slice(&std::fs::read(out.join("comparison.json")).unwrap()).unwrap()
}

#[test]
fn ab_repeat_gives_the_same_intervals_and_verdicts_from_the_same_seeds() {
    let dir = run_dir("sim-ab-repeat");
    std::fs::create_dir_all(&dir).unwrap();
    let a = ab_repeat(&dir, "a", &["--baseline", "ssp:s=2"]);
    let b = ab_repeat(&dir, "b", &["--baseline", "ssp:s=2"]);
    assert_eq!(a.repeat, 4);
    assert_eq!(a.baseline.as_deref(), Some("ssp:s=2"));
    assert_eq!(a.rows.len(), 12, "3 policies x 4 seeds");
    for s in &a.summaries {
        assert_eq!(s.seeds, [1, 2, 3, 4], "{}", s.policy);
    }
    assert_eq!(serde_json::to_string(&a.summaries).unwrap(), serde_json::to_string(&b.summaries).unwrap());
    assert_eq!(serde_json::to_string(&a.verdicts).unwrap(), serde_json::to_string(&b.verdicts).unwrap());
    // `--seed` starts a fresh batch: other seeds, other runs.
    let c = ab_repeat(&dir, "c", &["--baseline", "ssp:s=2", "--seed", "11"]);
    assert!(c.summaries.iter().all(|s| s.seeds == [11, 12, 13, 14]), "{:?}", c.summaries[0].seeds);
    assert_ne!(serde_json::to_string(&a.rows).unwrap(), serde_json::to_string(&c.rows).unwrap());
    // The seeds draw different delays: the runs of one policy differ.
    let bsp: Vec<u64> = a.rows.iter().filter(|r| r.policy == "bsp").map(|r| r.deferred_pulls).collect();
    assert!(bsp.windows(2).any(|w| w[0] != w[1]), "four seeds, four runs: {bsp:?}");
    // Each summary is its runs' median, inside its interval.
    let ssp = a.summaries.iter().find(|s| s.policy == "ssp:s=2").unwrap();
    let e = ssp.figure("deferred_per_100_iterations").unwrap();
    let mut runs: Vec<f64> = a
        .rows
        .iter()
        .filter(|r| r.policy == "ssp:s=2")
        .map(|r| r.deferred_pulls as f64 * 100.0 / r.iterations as f64)
        .collect();
    runs.sort_by(f64::total_cmp);
    assert_eq!(e.median, Some((runs[1] + runs[2]) / 2.0));
    assert_eq!((e.lo, e.hi, e.n), (Some(runs[0]), Some(runs[3]), 4));
    // Against SSP(2), BSP defers more and ASP defers nothing: both detectably so, with 4 runs each.
    let deferrals = |p: &str| {
        a.verdicts
            .iter()
            .find(|v| v.policy == p && v.figure == "deferred_per_100_iterations")
            .unwrap()
            .clone()
    };
    assert_eq!(deferrals("bsp").outcome, syncopate::lab::report::Outcome::Worse, "{:?}", deferrals("bsp"));
    assert_eq!(deferrals("asp").outcome, syncopate::lab::report::Outcome::Better, "{:?}", deferrals("asp"));
    assert!(a.verdicts.iter().all(|v| v.policy != "ssp:s=2"), "the baseline is not judged against itself");
    let md = std::fs::read_to_string(dir.join("a").join("comparison.md")).unwrap();
    assert!(md.contains("## Against `ssp:s=2`") && md.contains("## Every run"), "{md}");
    assert!(
        dir.join("a").join("bsp").join("seed-3").join("report.json").exists(),
        "each run keeps its folder"
    );
    let waits = std::fs::read_to_string(dir.join("a").join("waits.svg")).unwrap();
    assert!(waits.contains("<circle"), "every run is a dot on the waits plot");
}

#[test]
fn a_scenario_can_charge_a_larger_models_bytes_and_every_report_says_so() {
    let small = scenario(&format!("bandwidth_mbit = 100.0\n{SCENARIO}"));
    let big = scenario(&format!(
        "bandwidth_mbit = 100.0\n{SCENARIO}[modelled]\nname = \"ResNet-110 (1.7 MB)\"\nbytes = 1700000\n"
    ));
    let (a, b) = (sim(&small, "bsp", true), sim(&big, "bsp", true));
    let moved = |r: &RunReport| r.workers.iter().map(|w| w.bytes_sent + w.bytes_received).sum::<u64>();
    // 1,024 parameters are 4 KB; the modelled model is 415x that.
    assert!(moved(&b) > 300 * moved(&a), "{} against {} bytes", moved(&b), moved(&a));
    assert!(b.elapsed_s > 10.0 * a.elapsed_s, "a 1.7 MB sync over 100 Mbit/s takes time: {} s", b.elapsed_s);
    assert_eq!((a.modelled.as_deref(), b.modelled.as_deref()), (None, Some("ResNet-110 (1.7 MB)")));
    assert_eq!(
        a.workers.iter().map(|w| w.iterations).sum::<u64>(),
        b.workers.iter().map(|w| w.iterations).sum::<u64>()
    );
    // A real cluster cannot charge them: `ab` says to simulate.
    let dir = run_dir("sim-modelled");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("big.toml");
    std::fs::write(&file, format!("{SCENARIO}[modelled]\nname = \"ResNet-110 (1.7 MB)\"\nbytes = 1700000\n"))
        .unwrap();
    let out = std::process::Command::new(syncopate_bin())
        .args(["ab", "--policies", "bsp", "--scenario"])
        .arg(&file)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--simulate") && err.contains("ResNet-110"), "{err}");
}

/// Three workers (one jittery, one 2x slower) on two servers, three shards, each with a backup
/// on the next server; the counter workload at lr 1 with summed pushes, so the final model is
/// exactly minus the sum of every push whatever order they were applied in.
const REPLICATED: &str =
    "name = \"replicated\"\nworkers = 3\nservers = 2\nshards = 3\nworkload = \"counter\"\n\
    params = 6\ncompute_ms = 5\niterations = 8\ntime_limit_s = 20\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
    [[jitter]]\nworker = 1\nmean_ms = 4.0\nsd_ms = 3.0\n[[slow]]\nworker = 2\nfactor = 2.0\n";

/// `s` with a backup per shard (`replicas = 1`) under `policy`, with `failures` and `faults`.
fn replicated_opts(s: &Scenario, policy: &str, failures: Vec<SimFailure>, faults: SimFaults) -> SimOptions {
    SimOptions {
        run: RunSpec::new(Scenario { replicas: 1, ..s.clone() }, policy.parse::<PolicySpec>().unwrap()),
        gradients: true,
        data: None,
        failures,
        faults,
    }
}

/// `s` with a backup per shard (`replicas = 1`), and `failure`.
fn replicated(s: &Scenario, policy: &str, failure: Option<SimFailure>) -> syncopate::lab::sim::Simulated {
    let opts = replicated_opts(s, policy, failure.into_iter().collect(), SimFaults::default());
    simulate(&opts, syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}, {failure:?}: {e}"))
}

/// A server killed before every event of a small replicated run, in turn (the first server,
/// then the second, alternately), under BSP, SSP and ASP: the failover promotes the backups,
/// the workers ask again for what was not answered, and every run ends with the parameters of
/// the run without a failure, bit for bit, every worker having run every iteration. The
/// simulator runs the servers' own protocol machine (`ShardNode`: replication, held
/// acknowledgements, duplicates, promotion) and the workers' own machine, so this is the
/// cluster's guarantee checked at every point of a run.
#[test]
fn a_server_killed_at_any_event_of_a_simulated_run_loses_no_acknowledged_push() {
    let s = scenario(REPLICATED);
    let expected = -(1.0 + 2.0 + 3.0) * 8.0;
    for policy in ["bsp", "ssp:s=2", "asp"] {
        let clean = replicated(&s, policy, None);
        assert!(clean.model.iter().all(|v| *v == expected), "{policy}: {:?}", clean.model);
        assert!(clean.report.failovers.is_empty());
        let bits: Vec<u32> = clean.model.iter().map(|v| v.to_bits()).collect();
        let mut failed_over = 0;
        for at_event in 0..clean.events {
            let failure = SimFailure { server: (at_event % 2) as u32, at: FailAt::Event(at_event) };
            let out = replicated(&s, policy, Some(failure));
            let after: Vec<u32> = out.model.iter().map(|v| v.to_bits()).collect();
            assert_eq!(after, bits, "{policy}: server {} killed before event {at_event}", failure.server);
            let r = &out.report;
            assert!(r.workers.iter().all(|w| w.iterations == 8), "{policy}, {failure:?}: {:?}", r.workers);
            failed_over += usize::from(r.failovers.len() == 1);
        }
        // A death in the last events is not failed over before the run ends; the others are.
        assert!(
            failed_over as u64 > clean.events / 2,
            "{policy}: {failed_over} of {} failed over",
            clean.events
        );
    }
}

/// Two servers of three die, one after the other: after the first failover every shard left
/// without a backup gets a new one from its primary's snapshot (the coordinator's own
/// decisions, `placement.rs`), so the second death loses nothing either, and the run ends bit
/// for bit where the undisturbed one does.
#[test]
fn a_second_server_death_after_re_replication_loses_nothing() {
    let s = scenario(
        &REPLICATED.replace("servers = 2", "servers = 3").replace("iterations = 8", "iterations = 16"),
    );
    let expected = -(1.0 + 2.0 + 3.0) * 16.0;
    for policy in ["bsp", "asp"] {
        let clean = replicated(&s, policy, None);
        assert!(clean.model.iter().all(|v| *v == expected), "{policy}: {:?}", clean.model);
        let failures = vec![
            SimFailure { server: 0, at: FailAt::Event(clean.events / 4) },
            SimFailure { server: 1, at: FailAt::Event(clean.events * 3 / 4) },
        ];
        let opts = SimOptions {
            run: RunSpec::new(Scenario { replicas: 1, ..s.clone() }, policy.parse::<PolicySpec>().unwrap()),
            gradients: true,
            data: None,
            failures,
            faults: SimFaults::default(),
        };
        let out = simulate(&opts, syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert_eq!(out.report.failovers.len(), 2, "{policy}: {:?}", out.report.failovers);
        assert_eq!(
            out.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            clean.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{policy}"
        );
        assert!(out.report.workers.iter().all(|w| w.iterations == 16), "{policy}");
        // Killed before any new backup existed, the second death would have lost shards.
        let early = SimOptions {
            failures: vec![
                SimFailure { server: 0, at: FailAt::Event(clean.events / 4) },
                SimFailure { server: 1, at: FailAt::Event(clean.events / 4) },
            ],
            ..opts
        };
        let lost =
            simulate(&early, syncopate_suite::runtime()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(lost.contains("was lost with server"), "{policy}: {lost}");
    }
}

/// Issue 36: the coordinator crashes and restarts in the simulator as on a cluster. Alone, the
/// restarted one rebuilds the same map and nothing moves; with a server killed while it was
/// down, it waits for that server, then promotes its shards' backups
/// (`CoordinatorMachine::rebuild`). Either way every worker runs every iteration and the model
/// ends bit for bit where the undisturbed run's does.
#[test]
fn a_crashed_coordinator_rebuilds_the_cluster_from_its_servers_in_the_simulator() {
    // Iterations long enough that the servers' leases lapse during the outage.
    let s = scenario(
        &REPLICATED
            .replace("servers = 2", "servers = 3")
            .replace("iterations = 8", "iterations = 16")
            .replace("compute_ms = 5", "compute_ms = 200")
            .replace("time_limit_s = 20", "time_limit_s = 120"),
    );
    for policy in ["bsp", "asp"] {
        let clean = replicated(&s, policy, None);
        let crash = Some((FailAt::Event(clean.events / 3), 3_000_000_000));
        let run = |failures: Vec<SimFailure>| {
            let opts = SimOptions {
                run: RunSpec::new(
                    Scenario { replicas: 1, ..s.clone() },
                    policy.parse::<PolicySpec>().unwrap(),
                ),
                gradients: true,
                data: None,
                failures,
                faults: SimFaults { coordinator_crash: crash, ..SimFaults::default() },
            };
            simulate(&opts, syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}: {e}"))
        };
        let alone = run(Vec::new());
        // Server 1 dies just after the crash, long before the restart.
        let with_death = run(vec![SimFailure { server: 1, at: FailAt::Event(clean.events / 3 + 1) }]);
        for (out, promoted) in [(&alone, 0), (&with_death, 1)] {
            assert_eq!(out.rebuild.rebuilds, 1, "{policy}: {:?}", out.rebuild);
            assert_eq!(out.rebuild.promoted, promoted, "{policy}: {:?}", out.rebuild);
            assert_eq!(
                out.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                clean.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{policy}"
            );
            assert!(out.report.workers.iter().all(|w| w.iterations == 16), "{policy}");
            // The outage less the lease the servers still hold is waited out (and, for a server
            // that does not rejoin, the 10 s wait for it): training resumes after it.
            let stall = out.report.elapsed_s - clean.report.elapsed_s;
            assert!(stall > 3.0 - 1.0, "{policy}: {stall} s");
        }
        assert!(with_death.report.elapsed_s > alone.report.elapsed_s + 9.0, "{policy}");
    }
}

/// Replication costs time (every op crosses a second link and a push waits for the backup),
/// never results: with replicas the same run ends with the same parameters, later or as soon.
#[test]
fn replicas_change_when_a_simulated_run_ends_not_what_it_computes() {
    let s = scenario(REPLICATED);
    for policy in ["bsp", "asp"] {
        let plain = sim_model(&s, policy).0;
        let with = replicated(&s, policy, None);
        assert_eq!(with.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain, "{policy}");
        assert!(with.report.elapsed_s >= sim(&s, policy, true).elapsed_s, "{policy}");
    }
}

#[test]
fn a_failure_without_replicas_or_on_a_missing_server_is_refused() {
    let s = scenario(REPLICATED);
    let run = |replicas, server| {
        let opts = SimOptions {
            run: RunSpec::new(Scenario { replicas, ..s.clone() }, "bsp".parse::<PolicySpec>().unwrap()),
            gradients: false,
            data: None,
            failures: vec![SimFailure { server, at: FailAt::Event(10) }],
            faults: SimFaults::default(),
        };
        simulate(&opts, syncopate_suite::runtime()).err().map(|e| e.to_string())
    };
    assert_eq!(run(0, 0).as_deref(), Some("a server failure needs replicas 1"));
    assert_eq!(run(1, 2).as_deref(), Some("server 2 does not exist"));
}

/// Issue 36's fault search: seeds each drawing a replicated cluster and a policy, run
/// undisturbed and with a server killed at a drawn event (`syncopate simtest`'s checks: every
/// iteration run, exact sums, the failover's model equal to the undisturbed one bit for bit).
/// 100 seeds here; `scripts/test.sh` runs `syncopate simtest --seeds 1000` after the parallel
/// tests, so that its CPU does not crowd the timing-sensitive ones.
#[test]
fn simtest_finds_no_lost_or_doubled_update_in_100_seeds() {
    use syncopate::lab::simtest::search;
    let found = search(syncopate_suite::runtime(), 0, 100, &[], |_, _| {});
    assert_eq!(found.failed, None, "replay with `syncopate simtest --seed N`");
    assert_eq!(found.passed, 100);
    assert_eq!(found.exercised.runs, 200 + found.exercised.swaps);
    // Nearly every drawn death lands before the run's end and is failed over.
    assert!(found.exercised.failovers > 90, "{:?}", found.exercised);
    // A quarter of the seeds crash the coordinator; most crashes come before the run's end.
    assert!(found.exercised.rebuild.rebuilds > 10, "{:?}", found.exercised);
    // Half the seeds take checkpoint rounds (1-3); some meet a death and are abandoned.
    let c = found.exercised.checkpoints;
    assert!(c.taken > 20 && c.abandoned > 0, "{c:?}");
}

/// A seed is the whole input: drawn twice, a case is the same, and checked twice it exercises
/// the same events; the command line replays one seed and says what it ran.
#[test]
fn a_simtest_seed_replays_bit_for_bit() {
    use syncopate::lab::simtest::Case;
    let (a, b) = (Case::draw(17), Case::draw(17));
    assert_eq!(a.describe(), b.describe());
    let rt = syncopate_suite::runtime();
    assert_eq!(a.check(rt).unwrap(), b.check(rt).unwrap());
    assert_ne!(Case::draw(18).scenario, a.scenario);
    let out = std::process::Command::new(crate::cli::syncopate_bin())
        .args(["simtest", "--seed", "17"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains(&format!("seed 17: {}", a.describe())) && text.contains("1 of 1 seeds passed"),
        "{text}"
    );
}

/// Issue 51: a seed is the whole input in any process, not only in the one that drew it. Two
/// processes check the same seeds (with failovers, each of which re-sends the requests its dead
/// primary had not answered) and print the same trace: a hash of every event every run
/// delivered, in order, with its time. A map iterated in the process's hash order would show
/// here once its order reached an event (the `HashMap` of requests this replaced never did in
/// these seeds, nor in 1,000 others: two processes printed the same trace with it).
#[test]
fn simtest_runs_the_same_events_in_two_processes() {
    let run = || {
        std::thread::spawn(|| {
            std::process::Command::new(crate::cli::syncopate_bin())
                .args(["simtest", "--seeds", "60", "--start", "3000"])
                .output_within(COMMAND_LIMIT)
                .unwrap()
        })
    };
    let (a, b) = (run(), run());
    let trace = |out: std::process::Output| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("60 of 60 seeds passed"), "{text}");
        let line = text.lines().find(|l| l.starts_with("simtest: trace ")).map(str::to_owned);
        line.unwrap_or_else(|| panic!("no trace in {text}"))
    };
    let (a, b) = (trace(a.join().unwrap()), trace(b.join().unwrap()));
    assert_eq!(a, b, "the same seeds ran different events in two processes");
}

/// Issue 36: a cut link (both ways, shorter than the peer timeout) holds up what crosses it
/// until it heals, as a connection's retransmissions carry it then, in order. A worker cut off
/// from a server waits for it; two servers cut off from each other hold up every push whose
/// backup is across the cut (acknowledged only once the backup has it). Other links are
/// untouched, and nothing is lost or applied twice.
#[test]
fn a_cut_link_holds_up_what_crosses_it_and_loses_nothing() {
    use syncopate::lab::sim::{Node, SimLinkCut};
    let s = scenario(
        &REPLICATED
            .replace("iterations = 8", "iterations = 16")
            .replace("time_limit_s = 20", "time_limit_s = 60"),
    );
    for policy in ["bsp", "asp"] {
        let clean = replicated(&s, policy, None);
        let at = FailAt::Event(clean.events / 3);
        let cut = SimLinkCut { a: Node::Worker(1), b: Node::Server(0), at, heal_after_ns: 3_000_000_000 };
        let between_servers = SimLinkCut { a: Node::Server(1), b: Node::Server(0), ..cut };
        let opts = |cut| {
            replicated_opts(
                &s,
                policy,
                Vec::new(),
                SimFaults { link_cuts: vec![cut], ..SimFaults::default() },
            )
        };
        let elapsed =
            |r: &Simulated, w: u32| r.report.workers.iter().find(|x| x.worker == w).unwrap().elapsed_ns;
        for (cut, held_up) in [(cut, vec![1]), (between_servers, vec![0, 1, 2])] {
            let out =
                simulate(&opts(cut), syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}: {e}"));
            assert_eq!(
                out.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                clean.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{policy}, {cut:?}"
            );
            assert!(out.report.workers.iter().all(|w| w.iterations == 16), "{policy}, {cut:?}");
            for w in held_up {
                let waited = elapsed(&out, w) as i64 - elapsed(&clean, w) as i64;
                assert!(waited > 2_500_000_000, "{policy}, {cut:?}: worker {w} waited {waited} ns");
            }
        }
        let opts = opts(cut);
        // A cut that outlasts the peer timeout is not this fault (the connection would end).
        let long = SimLinkCut { heal_after_ns: 10_000_000_000, ..cut };
        let opts = SimOptions { faults: SimFaults { link_cuts: vec![long], ..SimFaults::default() }, ..opts };
        let err =
            simulate(&opts, syncopate_suite::runtime()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("peer timeout"), "{policy}: {err}");
        let workers = SimLinkCut { a: Node::Worker(0), b: Node::Worker(1), ..cut };
        let opts =
            SimOptions { faults: SimFaults { link_cuts: vec![workers], ..SimFaults::default() }, ..opts };
        let err =
            simulate(&opts, syncopate_suite::runtime()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("no link between"), "{policy}: {err}");
    }
}

/// Issue 36: checkpoint rounds are the coordinator machine's, and the simulator runs them. A
/// round taken holds every shard's snapshot, from its primary, under the policy the round
/// began with (the simulator checks each: `SimError::Checkpoint`); a round whose commands meet a
/// dead server is abandoned, and one the machine will not begin then (another round or the
/// failover under way) is skipped. Taking a
/// snapshot changes nothing: a run with rounds ends where the same run without them does, bit
/// for bit.
#[test]
fn checkpoint_rounds_are_whole_or_abandoned_and_change_nothing() {
    let s = scenario(&REPLICATED.replace("iterations = 8", "iterations = 12"));
    for policy in ["bsp", "ssp", "asp"] {
        let clean = replicated(&s, policy, None);
        let rounds: Vec<FailAt> = (1..=5).map(|k| FailAt::Event(clean.events * k / 6)).collect();
        let opts = |failures: Vec<SimFailure>, checkpoints: Vec<FailAt>| {
            replicated_opts(&s, policy, failures, SimFaults { checkpoints, ..SimFaults::default() })
        };
        let bits = |r: &Simulated| r.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let run = |o| simulate(&o, syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}: {e}"));
        let with = run(opts(Vec::new(), rounds.clone()));
        assert_eq!(with.checkpoints.taken, 5, "{policy}: {:?}", with.checkpoints);
        assert_eq!(bits(&with), bits(&clean), "{policy}: a checkpoint changed the run");
        assert!(with.replicas_differ.is_none(), "{policy}: {:?}", with.replicas_differ);
        // Server 1 dies just before two rounds: the first's command to it fails, and the round
        // is abandoned; the second is abandoned too or, begun while the first is under way, not
        // begun. Once the failover is done, a round goes to the new primaries and is taken.
        let die = clean.events / 3;
        let failure = SimFailure { server: 1, at: FailAt::Event(die) };
        let dead = replicated(&s, policy, Some(failure));
        let around: Vec<FailAt> =
            [die + 1, die + 2, dead.events - 5].into_iter().map(FailAt::Event).collect();
        let out = run(opts(vec![failure], around));
        let c = out.checkpoints;
        assert!(c.abandoned >= 1 && c.abandoned + c.refused == 2 && c.taken == 1, "{policy}: {c:?}");
        assert_eq!(bits(&out), bits(&dead), "{policy}: a checkpoint changed the failed-over run");
    }
}

/// Issue 36: a dead server started again (a new, empty process under its id) takes its id
/// back once the old one is failed over and a peer timeout has passed, and gets a backup of
/// every shard left without one. So a two-server cluster survives the other server's death
/// afterwards, on the restarted server's new backups: every iteration runs and the model ends
/// where the undisturbed run's does, bit for bit. The same two deaths without the restart
/// lose a shard, as they would on a cluster.
#[test]
fn a_restarted_server_takes_its_id_back_and_its_backups_survive_the_other_servers_death() {
    use syncopate::lab::sim::SimError;
    use syncopate::lab::sim::SimRestart;
    // Iterations of 2 s, so that the run outlasts the peer timeout the restart waits for.
    let s = scenario(
        &REPLICATED
            .replace("compute_ms = 5", "compute_ms = 2000")
            .replace("time_limit_s = 20", "time_limit_s = 600"),
    );
    for policy in ["bsp", "asp"] {
        let clean = replicated(&s, policy, None);
        let death = SimFailure { server: 1, at: FailAt::Event(clean.events / 5) };
        let restart = SimRestart { server: 1, after_ns: 500_000_000, then_kill: Some((0, 2_000_000_000)) };
        let opts = |restarts: Vec<SimRestart>, failures: Vec<SimFailure>| {
            replicated_opts(
                &s,
                policy,
                failures,
                SimFaults { server_restarts: restarts, ..SimFaults::default() },
            )
        };
        let out = simulate(&opts(vec![restart], vec![death]), syncopate_suite::runtime())
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert_eq!((out.restarts, out.killed_after_restart), (1, 1), "{policy}");
        assert_eq!(out.report.failovers.len(), 2, "{policy}: {:?}", out.report.failovers);
        assert!(out.report.workers.iter().all(|w| w.iterations == 8), "{policy}");
        assert!(out.replicas_differ.is_none(), "{policy}: {:?}", out.replicas_differ);
        assert_eq!(
            out.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            clean.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{policy}: after a restart and the other server's death"
        );
        // Without the restart, the same second death (as late) finds no backup anywhere.
        let late = FailAt::Event(out.events * 3 / 5);
        let both = vec![death, SimFailure { server: 0, at: late }];
        let lost = simulate(&opts(Vec::new(), both), syncopate_suite::runtime());
        assert!(matches!(lost, Err(SimError::ShardLost { .. })), "{policy}: {:?}", lost.map(|r| r.events));
    }
}

/// Issue 36's stale terms: a primary cut off from the coordinator is failed over while its
/// link to its backup is cut too, so the ops it had streamed reach that backup only after the
/// backup was promoted. The promoted node ignores them (`ShardNode::replicated`); one applied
/// or confirmed would end the run as a bad request accepted. Nothing is lost or applied twice.
#[test]
fn ops_from_a_deposed_primary_are_ignored_by_its_promoted_backup() {
    use syncopate::lab::sim::{Cut, Node, SimLinkCut, SimPartition};
    let s = scenario(&REPLICATED.replace("iterations = 8", "iterations = 40"));
    for policy in ["asp", "bsp"] {
        let clean = replicated(&s, policy, None);
        let at = clean.events / 4;
        let faults = SimFaults {
            partitions: vec![SimPartition {
                server: 1,
                at: FailAt::Event(at),
                heal_after_ns: 2_000_000_000,
                cut: Cut::ToCoordinator,
            }],
            link_cuts: vec![SimLinkCut {
                a: Node::Server(0),
                b: Node::Server(1),
                at: FailAt::Event(at),
                heal_after_ns: 1_700_000_000,
            }],
            ..SimFaults::default()
        };
        let opts = replicated_opts(&s, policy, Vec::new(), faults);
        let out = simulate(&opts, syncopate_suite::runtime()).unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert!(out.stale_ops > 0, "{policy}: no op reached the promoted backup late");
        assert!(out.report.workers.iter().all(|w| w.iterations == 40), "{policy}");
        assert_eq!(
            out.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            clean.model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{policy}"
        );
    }
}

/// A failing seed is shrunk by dropping its faults one at a time while it still fails
/// (`simtest::shrink`). Each fault can be dropped by name, on the command line too, and the
/// rest of the case stays as drawn.
#[test]
fn a_simtest_case_goes_without_a_fault_by_name_and_keeps_the_rest() {
    use syncopate::lab::simtest::{Case, Fault};
    let (seed, case) = (0..)
        .map(|s| (s, Case::draw(s)))
        .find(|(_, c)| c.swap.is_some() && c.coordinator_crash.is_some())
        .unwrap();
    let crash: Fault = "coordinator-crash".parse().unwrap();
    let smaller = case.without(crash).unwrap();
    assert!(smaller.coordinator_crash.is_none());
    assert_eq!(smaller.scenario, case.scenario);
    assert!(!smaller.describe().contains("coordinator crashes"), "{}", smaller.describe());
    assert!(case.describe().contains("coordinator crashes"), "{}", case.describe());
    assert!(smaller.without(crash).is_none(), "nothing to drop twice");
    let err = "crash".parse::<Fault>().unwrap_err();
    assert!(err.contains("coordinator-crash"), "{err}");
    let out = std::process::Command::new(crate::cli::syncopate_bin())
        .args(["simtest", "--seed", &seed.to_string(), "--without", "coordinator-crash,swap,death"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let drawn = case.without_all(&[crash, Fault::Swap, Fault::Death]).describe();
    assert!(text.contains(&format!("seed {seed}: {drawn}")), "{text}");
    let dies = format!("server {} dies", case.server.unwrap());
    assert!(!drawn.contains("crashes") && !drawn.contains("hot swap") && !drawn.contains(&dies), "{drawn}");
}

/// Issue 37: the simulator drives the shard's decision rules, so a policy that holds its pushes
/// and admits them from `after_push` (`policies/example-firstk`) runs there as on a cluster
/// (`rules::a_policy_that_holds_and_admits_in_one_event_runs_on_a_real_cluster`): every worker
/// runs every iteration, and every push is applied once at 1/k.
#[test]
fn the_simulator_runs_a_policy_that_holds_and_admits_in_one_event() {
    let text = "name = \"firstk\"\nworkers = 3\nservers = 2\nworkload = \"counter\"\nparams = 8\n\
        compute_ms = 5\niterations = 30\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
        [[slow]]\nworker = 1\nfactor = 3.0\n";
    let policy = format!("{}:k=3", env!("SYNCOPATE_FIRSTK_WASM"));
    let opts = SimOptions {
        run: RunSpec::new(scenario(text), policy.parse::<PolicySpec>().unwrap()),
        gradients: true,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    let out = simulate(&opts, syncopate_suite::runtime()).expect("simulates");
    assert!(out.report.workers.iter().all(|w| w.iterations == 30), "{:?}", out.report.workers);
    let expected = -(1.0 + 2.0 + 3.0) * 30.0 / 3.0;
    assert!(out.model.iter().all(|v| *v == expected), "{:?}, not all {expected}", out.model);
}

/// Sync-Switch's online rule where a straggler is slow in time: with one worker of three 3x
/// slower, the cluster switches to ASP within its first iterations instead of deferring the
/// fast workers' pulls at every barrier (as it does with `online=false` until `switch_at`),
/// and every push counts once either way (summed pushes at lr 1: the model is minus the sum
/// of every worker's `w + 1` per iteration).
#[test]
fn syncswitch_switches_to_asp_at_once_for_a_straggler_and_counts_every_push_once() {
    let s = scenario(
        "name = \"switch\"\nworkers = 3\nservers = 1\nworkload = \"counter\"\nparams = 4\n\
         compute_ms = 5\niterations = 40\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
         [[slow]]\nworker = 0\nfactor = 3.0\n",
    );
    let online = simulated(&s, "syncswitch:switch_at=1000");
    let offline = simulated(&s, "syncswitch:switch_at=1000,online=false");
    let exact = -((1 + 2 + 3) as f32) * 40.0;
    for out in [&online, &offline] {
        assert!(out.model.iter().all(|&v| v == exact), "{:?}", out.model);
    }
    let (on, off) = (deferred(&online.report), deferred(&offline.report));
    assert!(off >= 60, "BSP throughout: the fast workers wait at (nearly) every barrier ({off})");
    assert!(on <= 10, "switched within the first iterations: {on} pulls deferred");
}

/// A scenario built from a real run's trace (`scenarios/trace-mixed-4.toml`, shipped with the
/// run it came from) reproduces that run's per-worker iteration rates within 10%, and the same
/// four devices stand for 40 workers, each at its device's rate.
#[test]
fn a_real_runs_trace_reproduces_its_workers_iteration_rates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let traced = RunReport::load_trace(&dir.join("traces/mixed-4-asp.json")).expect("the shipped trace");
    assert_eq!(traced.len(), 4);
    let real: RunReport =
        serde_json::from_slice(&std::fs::read(dir.join("traces/mixed-4-asp.json")).unwrap()).unwrap();
    let rate = |w: &syncopate::worker::WorkerReport| w.iterations as f64 / (w.elapsed_ns as f64 / 1e9);
    let mut s = Scenario::load(&dir.join("trace-mixed-4.toml")).expect("the shipped scenario");
    let simulated = sim(&s, "asp", false);
    for (r, m) in real.workers.iter().zip(&simulated.workers) {
        let ratio = rate(m) / rate(r);
        assert!(
            (0.9..1.1).contains(&ratio),
            "worker {}: real {:.2} it/s, simulated {:.2}",
            r.worker,
            rate(r),
            rate(m)
        );
    }
    // Ten simulated workers per real device: worker w replays device w mod 4's compute times
    // (150 iterations, as many as the trace holds: each time once).
    s.workers = 40;
    let many = sim(&s, "asp", false);
    for w in [0, 3, 4, 39] {
        let want: u64 = traced[w % 4].iter().sum();
        let got = many.workers[w].compute_ns;
        assert!(got.abs_diff(want) <= 1_000, "worker {w}: computed {got} ns, its device's trace {want} ns");
    }
    // A missing trace is a clear error, not a run without one.
    s.trace = Some(dir.join("traces/none.json"));
    let opts = SimOptions {
        run: RunSpec::new(s, "asp".parse::<PolicySpec>().unwrap()),
        gradients: false,
        data: None,
        failures: Vec::new(),
        faults: SimFaults::default(),
    };
    let err = simulate(&opts, syncopate_suite::runtime()).expect_err("no trace, no run").to_string();
    assert!(err.contains("traces/none.json"), "{err}");
}

/// Conditions that change: a worker 4x slower only from 2 s until 4 s (and one jittered only
/// after 4 s) computes at its own pace before and after, and 4x slower inside the window, in the
/// simulator as the device model says; the same device model paces real workers.
#[test]
fn a_slowdown_with_a_window_slows_its_worker_only_inside_it() {
    let s = scenario(
        "name = \"window\"\nworkers = 2\nservers = 1\nworkload = \"counter\"\ncompute_ms = 20\n\
         time_limit_s = 6\n[[slow]]\nworker = 0\nfactor = 4.0\nfrom_s = 2.0\nuntil_s = 4.0\n\
         [[jitter]]\nworker = 1\nmean_ms = 30.0\nsd_ms = 0.0\nfrom_s = 4.0\n",
    );
    let r = sim(&s, "asp", false);
    let w0 = r.workers.iter().find(|w| w.worker == 0).expect("worker 0");
    let t0 = w0.timeline.first().expect("iterations").0;
    let busy = |lo: f64, hi: f64| -> Vec<f32> {
        w0.timeline.iter().filter(|(t, ..)| (lo..hi).contains(&(t - t0))).map(|(_, _, b)| *b).collect()
    };
    let (before, inside, after) = (busy(0.2, 1.8), busy(2.2, 3.8), busy(4.2, 5.8));
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
    assert!(!before.is_empty() && !inside.is_empty() && !after.is_empty());
    let ratio = mean(&inside) / mean(&before);
    assert!((3.5..4.5).contains(&ratio), "4x inside the window: {ratio} ({before:?} / {inside:?})");
    assert!((mean(&after) / mean(&before) - 1.0).abs() < 0.1, "{after:?} vs {before:?}");
    // Worker 1's jitter starts at 4 s: its iterations take 30 ms longer from then on.
    let w1 = r.workers.iter().find(|w| w.worker == 1).expect("worker 1");
    let span = |lo: f64, hi: f64| {
        let v: Vec<f32> =
            w1.timeline.iter().filter(|(t, ..)| (lo..hi).contains(&(t - t0))).map(|(_, _, b)| *b).collect();
        v.iter().sum::<f32>() / v.len().max(1) as f32
    };
    assert!(span(4.2, 5.8) - span(0.2, 3.8) > 0.025, "{} vs {}", span(4.2, 5.8), span(0.2, 3.8));
}

/// Issue 53: the autopilot, a cluster policy run by the simulated coordinator, moves the
/// cluster off BSP when a straggler appears and back when it is gone, by the same two-phase
/// swap an operator makes; the report shows its log and the phases under each rule.
#[test]
fn the_autopilot_swaps_away_from_bsp_while_a_straggler_lasts_and_back_after() {
    let s = scenario(
        "name = \"autopilot\"\nworkers = 4\nservers = 2\nworkload = \"counter\"\ncompute_ms = 20\n\
         time_limit_s = 12\n[[slow]]\nworker = 0\nfactor = 4.0\nfrom_s = 3.0\nuntil_s = 7.0\n",
    );
    let r = sim(&s, "autopilot:cadence_ms=500,dwell_ms=1000", false);
    let pilot = r.pilot.as_ref().expect("the report has the cluster policy");
    let swaps: Vec<(f64, &str)> = pilot
        .log
        .iter()
        .filter(|e| e.what.ends_with(" done"))
        .map(|e| (e.at_ns as f64 / 1e9, e.what.as_str()))
        .collect();
    assert_eq!(pilot.swaps, 2, "{:?}", pilot.log);
    assert!(!pilot.quarantined);
    let (t_off, off) = swaps[0];
    assert_eq!(off, "swap to adaptive-deadline done", "one slow worker of four: the deadline");
    assert!((3.0..5.0).contains(&t_off), "soon after the straggler appeared: {t_off}");
    let (t_back, back) = swaps[1];
    assert_eq!(back, "swap to bsp done");
    assert!((7.0..9.5).contains(&t_back), "soon after it recovered: {t_back}");
    assert_eq!(r.swaps, 2);
    let policies: Vec<&str> = r.phases.iter().map(|p| p.policy.as_str()).collect();
    assert!(policies.iter().any(|p| p.starts_with("adaptive-deadline")), "{policies:?}");
    assert_eq!(r.policy.split(' ').next(), Some("bsp"), "back on BSP at the end");
}

/// Issue 53: a link that slows for a while (`[[link]]`): worker 0's link runs at 20 Mbit/s
/// from 2 s to 4 s; its 400 KB pulls and pushes then take about 0.16 s each way, so it finishes
/// far fewer iterations inside the window than before or after it, and the other worker's pace
/// (ASP: nobody waits) does not change.
#[test]
fn a_link_that_slows_for_a_while_slows_only_its_transfers_only_then() {
    let s = scenario(
        "name = \"link\"\nworkers = 2\nservers = 1\nworkload = \"counter\"\nparams = 100000\ncompute_ms = 20\n\
         bandwidth_mbit = 1000.0\ntime_limit_s = 6\n[[link]]\nworker = 0\nmbit = 20.0\nfrom_s = 2.0\nuntil_s = 4.0\n",
    );
    let r = sim(&s, "asp", false);
    let count = |w: u32, lo: f64, hi: f64| {
        let rep = r.workers.iter().find(|x| x.worker == w).expect("worker finished");
        rep.timeline.iter().filter(|(t, ..)| (lo..hi).contains(t)).count()
    };
    let (before, inside, after) = (count(0, 0.5, 1.5), count(0, 2.5, 3.5), count(0, 4.5, 5.5));
    assert!(
        inside * 4 < before && inside * 4 < after,
        "worker 0: {before} / {inside} / {after} iterations a second"
    );
    let (b1, i1) = (count(1, 0.5, 1.5), count(1, 2.5, 3.5));
    assert!(i1 * 10 >= b1 * 9, "worker 1 unaffected: {b1} / {i1}");
    // A link of a node the scenario lacks, or of no bandwidth, is refused with the reason.
    let check = |extra: &str| {
        let s: Scenario =
            toml::from_str(&format!("name = \"x\"\nworkers = 2\niterations = 3\n[[link]]\n{extra}"))
                .expect("parses");
        s.check().unwrap_err()
    };
    assert!(check("worker = 5\nmbit = 1.0\n").contains("does not have"));
    assert!(check("worker = 0\nmbit = 0.0\n").contains("not a positive bandwidth"));
    assert!(check("worker = 0\nserver = 0\nmbit = 1.0\n").contains("one worker or one server"));
}
