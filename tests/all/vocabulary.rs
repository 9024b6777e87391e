//! The policy vocabulary beyond admit and hold, through a real module (`policies/example-backup`,
//! synchronous SGD with backup workers) with momentum 0.9 and weight decay on: a dropped push
//! (or one admitted with weight 0) never reaches the parameters, the step count or the
//! staleness histogram; a round completed early is one optimizer step on the mean of the
//! gradients present; every push is still accounted for exactly once. And the quarantine
//! counts failures by kind of event, so successes on pulls cannot keep alive a module that
//! fails on every push.

use syncopate::shard::{
    CrashLoop, Optimizer, OptimizerConfig, PullRequest, PushRequest, Shard, ShardConfig, SupervisorConfig,
};
use syncopate_suite::{backup_module, config, hostile_module, Recorder};

use crate::harness::Cluster;

/// The servers' default optimizer with weight decay added: a step with a zero gradient would
/// still move these parameters.
fn momentum_and_decay() -> OptimizerConfig {
    OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov: false }
}

fn push(worker: u32, iteration: u64, grad: &[f32]) -> PushRequest {
    PushRequest {
        worker,
        iteration,
        samples: 1,
        grad: grad.to_vec(),
        based_on: Some(0),
        tasks: None,
        local_steps: 0,
        signals: Default::default(),
    }
}

#[test]
fn a_late_gradient_is_dropped_and_an_early_round_is_one_step_of_the_mean() {
    for late in ["drop", "zero-weight"] {
        let mut rec = Recorder::default();
        let cfg = ShardConfig { optimizer: momentum_and_decay(), ..ShardConfig::default() };
        let start = vec![1.0f32, -2.0];
        let mut shard = Shard::new(
            cfg,
            start.clone(),
            &backup_module(),
            &config(&[("b", "1"), ("late", late)]),
            &mut rec,
        )
        .expect("starts");
        for w in 0..3 {
            shard.join(w, 0, &mut rec).expect("joins");
        }
        // Round 0: two of three gradients complete it.
        let (g0, g1) = ([0.5f32, 1.0], [1.5f32, -3.0]);
        shard.push(push(0, 0, &g0), 1, &mut rec).expect("push");
        assert_eq!(shard.version(), 0, "{late}: one gradient of three is not a round");
        shard.push(push(1, 0, &g1), 2, &mut rec).expect("push");
        let mut expected = start.clone();
        let mean: Vec<f32> = g0.iter().zip(&g1).map(|(a, b)| (a + b) / 2.0).collect();
        Optimizer::new(momentum_and_decay(), 2).step(&mut expected, &mean, 1.0);
        assert_eq!(shard.version(), 1, "{late}: one optimizer step for the round");
        for (got, want) in shard.values().iter().zip(&expected) {
            assert!(
                (got - want).abs() < 1e-6,
                "{late}: {:?} is one step of the mean, {expected:?}",
                shard.values()
            );
        }
        assert_eq!(shard.stats().aggregates_completed_early, 1);

        // The third gradient of round 0 arrives late: dropped, whatever the momentum.
        let (values, stats) = (shard.values().to_vec(), shard.stats());
        let late_id = shard.push(push(2, 0, &[100.0, 100.0]), 3, &mut rec).expect("push");
        assert_eq!(shard.values(), &values[..], "{late}: the parameters did not move at all");
        let now = shard.stats();
        assert_eq!(
            (now.steps, now.staleness),
            (stats.steps, stats.staleness),
            "{late}: no step, no staleness"
        );
        assert_eq!((now.pushes_dropped, now.pushes_admitted), (1, 2), "{late}");
        assert_eq!(rec.dropped, [late_id], "{late}: the worker is told its push was dropped");
        assert!(rec.was_acked(late_id), "{late}: and acknowledged");
        assert_eq!(shard.view().min_clock, 1, "{late}: its clock moved on");
        // Worker 2's next pull is served at once: round 0 is complete.
        let pull = shard.pull(PullRequest { worker: 2, iteration: 1 }, 4, &mut rec).expect("pull");
        assert!(rec.was_served(pull), "{late}");
    }
}

#[test]
fn under_backup_workers_every_push_is_accounted_for_exactly_once() {
    for seed in [3u64, 17] {
        // Plain SGD at lr 1 and gradients of ones: every completed round moves the parameter by
        // exactly -1 (the mean of ones), every dropped push by nothing.
        let mut c = Cluster::new(&backup_module(), &[("b", "1")], 4, 30, seed).with_speeds(&[1, 2, 3, 4]);
        c.run_to_end();
        let s = c.shard.stats();
        assert_eq!(c.rec.acked.len() as u64, c.pushes, "seed {seed}: every push acknowledged once");
        assert_eq!(s.pushes_admitted + s.pushes_dropped, c.pushes, "seed {seed}: admitted or dropped, once");
        assert!(s.pushes_dropped > 0, "seed {seed}: the slowest worker lost some races");
        assert_eq!(s.steps, 30, "seed {seed}: one step per round");
        assert_eq!(s.aggregates_completed_early, 30, "seed {seed}");
        assert_eq!(c.shard.values()[0], -30.0, "seed {seed}: each round applied once, as one mean");
        assert_eq!(s.policy_failures, 0);
    }
}

#[test]
fn a_module_failing_on_every_push_is_quarantined_whatever_its_pulls_do() {
    let cfg = ShardConfig {
        optimizer: crate::harness::exact_sgd(),
        supervisor: SupervisorConfig {
            checkpoint_every: 1,
            checkpoint_scales: false,
            max_consecutive_failures: 3,
            // The rule under test alone: no crash-loop backoff or quarantine.
            crash_loop: CrashLoop { failures: u32::MAX, backoff_ns: 0, ..CrashLoop::default() },
            ..SupervisorConfig::default()
        },
        ..ShardConfig::default()
    };
    let mut rec = Recorder::default();
    let mut shard =
        Shard::new(cfg, vec![0.0], &hostile_module(), &config(&[("mode", "push:panic")]), &mut rec)
            .expect("starts");
    shard.join(0, 0, &mut rec).expect("joins");
    shard.join(1, 0, &mut rec).expect("joins");
    // Pull, push, pull, push...: every pull succeeds between the failing pushes.
    let mut events = 2;
    for i in 0..10u64 {
        let w = (i % 2) as u32;
        let it = i / 2;
        shard.pull(PullRequest { worker: w, iteration: it }, 2 * i, &mut rec).expect("pull");
        shard.push(push(w, it, &[1.0]), 2 * i + 1, &mut rec).expect("push");
        events += 2;
        if shard.is_quarantined() {
            break;
        }
    }
    assert!(shard.is_quarantined(), "never quarantined: {} failures", rec.errors.len());
    assert!(events <= 10, "quarantined after {events} events");
    assert_eq!(shard.stats().policy_failures, 3);
    assert!(
        shard.last_failure().is_some_and(|e| e.contains("panics on purpose")),
        "{:?}",
        shard.last_failure()
    );
    assert_eq!(shard.stats().pushes_admitted, 3, "each failing push was admitted by the fallback rule");
}

#[test]
fn a_straggler_told_to_skip_ahead_catches_up_and_every_push_still_counts_once() {
    for seed in [5u64, 23] {
        // Worker 3 runs 8 times slower: its gradients arrive rounds late and are dropped,
        // so `catch_up` tells it to skip to the open round.
        let cfg = [("b", "1"), ("catch_up", "true")];
        let mut c = Cluster::new(&backup_module(), &cfg, 4, 30, seed).with_speeds(&[8, 8, 8, 1]);
        c.run_to_end();
        let s = c.shard.stats();
        let reports = c.reports();
        let skipped: u64 = reports.iter().map(|r| r.iterations_skipped).sum();
        assert!(
            reports[3].iterations_skipped > 0,
            "seed {seed}: the straggler skipped ahead: {:?}",
            reports[3]
        );
        for r in &reports {
            assert_eq!(
                r.iterations + r.iterations_skipped,
                30,
                "seed {seed}: each iteration done or skipped: {r:?}"
            );
        }
        assert_eq!(
            s.iterations_skipped, skipped,
            "seed {seed}: the shard moved the clock past each skip once"
        );
        assert_eq!(c.rec.acked.len() as u64, c.pushes, "seed {seed}: every push acknowledged once");
        assert_eq!(s.pushes_admitted + s.pushes_dropped, c.pushes, "seed {seed}: admitted or dropped, once");
        assert_eq!(
            c.pushes,
            reports.iter().map(|r| r.iterations).sum::<u64>(),
            "seed {seed}: skipped ones never pushed"
        );
        assert_eq!((s.steps, c.shard.values()[0]), (30, -30.0), "seed {seed}: each round applied once");
        let acks = c.rec.errors.len();
        assert_eq!((s.policy_failures, acks), (0, 0), "seed {seed}: {:?}", c.rec.errors);
        // A skip no real run could ask for is refused, and changes nothing.
        let clock = c.shard.view().max_clock;
        let refused = c.shard.skip(0, u64::MAX, 0, &mut c.rec);
        assert!(matches!(refused, Err(syncopate::shard::ShardError::SkipTooFar { .. })), "{refused:?}");
        assert_eq!((c.shard.view().max_clock, c.shard.stats().iterations_skipped), (clock, skipped));
    }
}
