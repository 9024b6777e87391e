//! Local steps and the outer optimizer (issue 38): DiLoCo and local SGD on real clusters of
//! processes and in the simulator, counted exactly with the `counter` workload.
//!
//! With the counter workload, plain SGD at learning rate 1 and summed pushes, worker `w`'s
//! gradient is always `w + 1`; `H` local steps move its model by `H (w + 1)`, which is the
//! pseudo-gradient it pushes, and an outer optimizer at learning rate 1 without momentum adds
//! it as it is. Every parameter then ends at minus the sum over workers of `(w + 1)` times the
//! steps of theirs the shards applied: a lost, doubled or misapplied push shows.

use std::time::Duration;

use syncopate::lab::report::RunReport;

use crate::cluster::{assert_all, status, syncopate, LocalRun};

/// Minus the sum of every worker's value times its steps: where the model must end.
fn exact(report: &RunReport) -> f32 {
    -report.workers.iter().map(|w| (w.worker + 1) as f32 * w.steps as f32).sum::<f32>()
}

/// A real cluster of 3 workers (150 iterations) that starts under BSP and hot-swaps to each
/// `(policy, label, pause before it)` in turn while it trains; its report, once every
/// parameter is checked to hold every worker's steps exactly once.
fn swap_chain(name: &str, chain: &[(&str, &str, u64)]) -> RunReport {
    let mut run = LocalRun::start(
        name,
        &["--workers", "3", "--servers", "2", "--iterations", "150", "--delay-ms", "20", "--params", "64"],
    );
    let cluster = run.cluster_file();
    for &(policy, label, pause_ms) in chain {
        std::thread::sleep(Duration::from_millis(pause_ms));
        let out = syncopate(&["policy", "swap", policy, "--watch-s", "0.3"], &cluster);
        assert!(out.status.success(), "swap to {policy}: {}", String::from_utf8_lossy(&out.stderr));
        let st = status(&cluster);
        assert!(st.servers.iter().flat_map(|s| &s.shards).all(|s| s.policy == label), "{st:?}");
        assert!(st.workers.iter().all(|w| w.connected && !w.finished), "run ended before the swap: {st:?}");
    }
    let (status, run) = run.finish(Duration::from_secs(180));
    assert!(status.success(), "{}", run.output());
    let report = run.report();
    assert_all(&run.model(), exact(&report), "gradients and pseudo-gradients, each once");
    report
}

/// A real cluster hot-swaps BSP → DiLoCo (4 local steps, outer SGD at lr 1) → BSP while it
/// trains: every gradient and pseudo-gradient is applied once, each by the optimizer it was
/// meant for, and the workers push gradients again after the swap back.
#[test]
fn hot_swap_bsp_to_diloco_to_bsp_applies_every_local_step_once() {
    let chain = [("diloco:h=4,outer_lr=1,outer_momentum=0", "diloco 0.1.0", 500), ("bsp", "bsp 0.1.0", 1200)];
    let report = swap_chain("local-sgd-swap", &chain);
    let local: u64 = report.workers.iter().map(|w| w.local_iterations).sum();
    for w in &report.workers {
        assert_eq!(w.iterations, 150, "{w:?}");
        assert!(w.local_iterations > 0 && w.local_iterations < w.iterations, "both kinds: {w:?}");
        assert_eq!(w.steps, w.iterations + 3 * w.local_iterations, "4 steps per local iteration: {w:?}");
    }
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!((s.stats.swaps, s.stats.pushes_admitted, s.stats.local_pushes), (2, 450, local), "{s:?}");
    }
}

/// The same with today's other rules: BSP → asynchronous local SGD (up to 4 local steps, each
/// worker's share set by its speed; the outer step at lr 1) → Sync-Switch (BSP's rounds
/// again, then ASP once a straggler shows): every push of each kind applied exactly once,
/// whatever steps DyLU gave each worker.
#[test]
fn hot_swap_to_async_local_sgd_and_syncswitch_applies_every_local_step_once() {
    let chain = [
        ("async-localsgd:h=4,outer_lr=1,outer_momentum=0", "async-localsgd 0.1.0", 500),
        ("syncswitch:switch_at=100000", "syncswitch 0.1.0", 1200),
    ];
    let report = swap_chain("async-local-sgd-swap", &chain);
    let local: u64 = report.workers.iter().map(|w| w.local_iterations).sum();
    for w in &report.workers {
        assert_eq!(w.iterations, 150, "{w:?}");
        assert!(w.local_iterations > 0 && w.local_iterations < w.iterations, "both kinds: {w:?}");
        let extra = w.steps - w.iterations;
        assert!(extra <= 3 * w.local_iterations, "at most 4 steps per local iteration: {w:?}");
    }
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!((s.stats.swaps, s.stats.pushes_admitted, s.stats.local_pushes), (2, 450, local), "{s:?}");
    }
}

/// The outer optimizer in the simulator, counted: 3 workers of the counter workload take 4
/// local steps per round at lr 1, so every round's summed pseudo-gradient is 4 × (1 + 2 + 3)
/// = 24 (integers: exact whatever the order), and DiLoCo's outer Nesterov step (lr 0.7,
/// momentum 0.9) on it, round after round, is what the shards end at, bit for bit. Local SGD
/// (averaging, lr 1) adds the rounds' sums as they are.
#[test]
fn the_simulator_steps_every_rounds_pseudo_gradients_with_the_outer_optimizer() {
    use syncopate::builtin::PolicySpec;
    use syncopate::lab::scenario::{RunSpec, Scenario};
    use syncopate::lab::sim::{simulate, SimFaults, SimOptions};
    use syncopate::shard::{Optimizer, OptimizerConfig};

    let text =
        "name = \"local\"\nworkers = 3\nservers = 2\nworkload = \"counter\"\nparams = 8\ncompute_ms = 5\n\
                iterations = 12\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
                [[slow]]\nworker = 1\nfactor = 3.0\n";
    let scenario: Scenario = toml::from_str(text).unwrap();
    let run = |policy: &str| {
        let opts = SimOptions {
            run: RunSpec::new(scenario.clone(), policy.parse::<PolicySpec>().unwrap()),
            gradients: true,
            data: None,
            failures: Vec::new(),
            faults: SimFaults::default(),
        };
        simulate(&opts, syncopate_suite::runtime()).expect("simulates")
    };
    let diloco = run("diloco:h=4");
    let outer = OptimizerConfig { lr: 0.7, momentum: 0.9, weight_decay: 0.0, nesterov: true };
    let (mut expected, mut o) = (vec![0.0f32; 8], Optimizer::new(outer, 8));
    for _ in 0..12 {
        o.step(&mut expected, &[24.0; 8], 1.0);
    }
    assert_eq!(diloco.model, expected, "12 outer Nesterov steps on 24");
    for w in &diloco.report.workers {
        assert_eq!((w.iterations, w.steps, w.local_iterations), (12, 48, 12), "{w:?}");
    }
    let local = run("localsgd:h=4");
    assert_eq!(local.model, vec![-24.0 * 12.0; 8]);
    // The straggler's rounds take 3x as long; synchronous rounds wait for it: no round is
    // applied before all three pseudo-gradients are in, or the Nesterov sequence would differ.
    assert!(local.report.workers.iter().all(|w| w.steps == 48));
}
