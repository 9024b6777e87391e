//! Issue 37: one implementation of the decision rules. A policy that holds its push in `on_push`
//! and admits it from `after_push` of the same event (the pattern `docs/writing-a-policy.md`
//! shows; `policies/example-firstk`) once passed `policy check` and then hung a cluster: the
//! shard took the admission for a second verdict on the event's push, found its verdict slot
//! empty, and left the push held forever, unacknowledged. The SDK's test driver went wrong
//! another way. Now `EventRules::check` says which decision is the event's verdict, and the
//! shard, the driver and the replayer all act on that.

use std::time::Duration;

use syncopate::shard::{OptimizerConfig, PushHeader, PushRequest, PushWeight, Shard, ShardConfig};
use syncopate_policy_example_firstk::FirstK;
use syncopate_policy_sdk::testing::Driver;
use syncopate_suite::{config, runtime, Recorder};

use crate::cluster::LocalRun;

const WORKERS: u32 = 3;

/// The same pushes, in the same seeded order, through the SDK's test driver (the policy built
/// natively) and a host shard (its wasm build), with momentum: after every push the same pushes
/// are acknowledged, and the parameters end the same, bit for bit.
#[test]
fn the_test_driver_and_a_shard_agree_on_a_policy_that_holds_and_admits_in_one_event() {
    let wasm = std::fs::read(env!("SYNCOPATE_FIRSTK_WASM")).expect("built by tests/build.rs");
    let module = runtime().compile("firstk.wasm", &wasm).unwrap();
    let optimizer = OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0, nesterov: false };
    for (seed, k) in [(1u64, "2"), (2, "2"), (3, "3"), (4, "1")] {
        let params = vec![0.5f32, -1.0];
        let mut driver =
            Driver::<FirstK>::new(&[("k", k)]).unwrap().with_optimizer(optimizer, params.clone());
        // Issue 50: without an optimizer the driver still counts the shard's steps (its version,
        // from which pushes' staleness comes).
        let mut plain = Driver::<FirstK>::new(&[("k", k)]).unwrap();
        // Pushes the policy does not weigh (a leaver's it leaves held) count 1 / live workers, as
        // in the driver.
        let cfg = ShardConfig { optimizer, push_weight: PushWeight::Mean, ..ShardConfig::default() };
        let mut rec = Recorder::default();
        let mut shard = Shard::new(cfg, params, &module, &config(&[("k", k)]), &mut rec).unwrap();
        for w in 0..WORKERS {
            driver.join(w);
            plain.join(w);
            shard.join(w, 0, &mut rec).unwrap();
        }
        // A worker whose push is not yet acknowledged waits: it pushes again only once it is.
        let mut next = [0u64; WORKERS as usize];
        let mut rng = seed;
        for step in 0..120u64 {
            let ready: Vec<u32> = (0..WORKERS)
                .filter(|&w| rec.acked.iter().filter(|a| a.1 == w).count() as u64 == next[w as usize])
                .collect();
            assert!(!ready.is_empty(), "seed {seed}, k {k}, step {step}: every worker waits on a held push");
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let w = ready[(rng >> 33) as usize % ready.len()];
            let grad = vec![(w + 1) as f32, step as f32 * 0.25];
            let iteration = next[w as usize];
            driver.push_gradient(w, iteration, &grad).unwrap();
            plain.push_iteration(w, iteration).unwrap();
            let req = PushRequest {
                worker: w,
                iteration,
                samples: 1,
                grad,
                based_on: None,
                tasks: None,
                local_steps: 0,
                signals: Default::default(),
            };
            shard.push(req, step, &mut rec).unwrap();
            next[w as usize] += 1;
            assert_eq!(plain.steps(), shard.version(), "seed {seed}, k {k}, step {step}: the version");
            for v in 0..WORKERS {
                let acked = rec.acked.iter().filter(|a| a.1 == v).count() as u64;
                assert_eq!(
                    driver.clock(v),
                    Some(acked),
                    "seed {seed}, k {k}, step {step}: worker {v}'s pushes"
                );
            }
        }
        // Issue 50: a worker whose push is held (k > 1) leaves; the policy hears it with the push
        // still held, and both apply what it leaves held.
        if k != "1" {
            let held = (0..WORKERS).find(|&w| shard.is_push_held(w, next[w as usize] - 1));
            let w = held.unwrap_or_else(|| {
                // The last group closed: one more push opens the next, and is held.
                let w = (0..WORKERS)
                    .find(|&w| rec.acked.iter().filter(|a| a.1 == w).count() as u64 == next[w as usize])
                    .expect("every push acknowledged");
                let (iteration, grad) = (next[w as usize], vec![1.0, 2.0]);
                driver.push_gradient(w, iteration, &grad).unwrap();
                let req = PushRequest {
                    worker: w,
                    iteration,
                    samples: 1,
                    grad,
                    based_on: None,
                    tasks: None,
                    local_steps: 0,
                    signals: Default::default(),
                };
                shard.push(req, 150, &mut rec).unwrap();
                next[w as usize] += 1;
                w
            });
            assert!(shard.is_push_held(w, next[w as usize] - 1), "seed {seed}, k {k}");
            driver.leave(w, syncopate_policy_sdk::abi::LeaveReason::TimedOut);
            shard.leave(w, syncopate_policy_sdk::abi::LeaveReason::TimedOut, 200, &mut rec).unwrap();
            assert!(!shard.is_push_held(w, next[w as usize] - 1));
        }
        assert!(rec.errors.is_empty(), "{:?}", rec.errors);
        let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(driver.params()), bits(shard.values()), "seed {seed}, k {k}");
        assert_eq!(driver.steps(), shard.version(), "seed {seed}, k {k}");
        assert!(driver.steps() > 0);
    }
}

/// On a real cluster (two servers, so each push goes to two shards): clocks advance, every
/// worker runs every iteration, and each group of three pushes (one per worker: each waits for
/// its group) is one optimizer step of their mean, with momentum 0.9, as computed by hand.
#[test]
fn a_policy_that_holds_and_admits_in_one_event_runs_on_a_real_cluster() {
    let policy = format!("{}:k=3", env!("SYNCOPATE_FIRSTK_WASM"));
    let args = [
        "--workload",
        "counter",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--push-weight",
        "sum",
        "--workers",
        "3",
        "--servers",
        "2",
        "--iterations",
        "30",
        "--delay-ms",
        "2",
        "--params",
        "8",
        "--policy",
        &policy,
    ];
    let run = LocalRun::start_plain("firstk", &args);
    let (code, run) = run.finish(Duration::from_secs(120));
    assert!(code.success(), "{}", run.output());
    let report = run.report();
    assert!(report.workers.iter().all(|w| w.iterations == 30), "{:?}", report.workers);
    for s in report.shards() {
        assert_eq!(s.stats.steps, 30, "shard {}: one step per group", s.shard);
    }
    // Worker w pushes w + 1 everywhere: every group's mean is 2. By hand, 30 steps of
    // v = 0.9 v + 2, p = p - 0.1 v.
    let (mut v, mut p) = (0.0f64, 0.0f64);
    for _ in 0..30 {
        v = 0.9 * v + 2.0;
        p -= 0.1 * v;
    }
    let model = run.model();
    assert!(model.iter().all(|x| (f64::from(*x) - p).abs() < 1e-3), "{model:?}, by hand {p}");
}

/// A rule that holds a push and never admits it hangs that push's worker: `policy status` names
/// the push and how long it has been held (and the server logs it once it passes a minute).
#[test]
fn policy_status_names_a_push_held_and_for_how_long() {
    let policy = format!("{}:mode=push:hold,after=6", env!("SYNCOPATE_HOSTILE_WASM"));
    let args = ["--workers", "2", "--servers", "1", "--iterations", "50", "--delay-ms", "2", "--params", "8"];
    let mut run =
        LocalRun::start("held-forever", &[&args[..], &["--policy", &policy, "--no-check"]].concat());
    let cluster = run.cluster_file();
    let t = std::time::Instant::now();
    loop {
        let st = crate::cluster::status(&cluster);
        let held: Vec<_> = st.servers.iter().flat_map(|s| &s.shards).filter_map(|s| s.held_longest).collect();
        if held.iter().any(|h| h.held_ns > 500_000_000) {
            let out = crate::cluster::syncopate(&["policy", "status"], &cluster);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("holds worker") && text.contains("its worker waits"), "{text}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no push reported held: {st:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    run.kill();
}

/// Groups are the shard's: with `wait=false` a push joins the open group at once, and a shard
/// snapshotted with a group open, restored, and its backup fed the primary's ops, all end at
/// the same parameters as a shard that ran straight through (momentum 0.9).
#[test]
fn an_open_group_survives_a_snapshot_and_is_replicated_to_the_backup() {
    use syncopate::shard::{NodeConfig, NodeOutput, Quiet, ShardNode, ShardSnapshot};
    let wasm = std::fs::read(env!("SYNCOPATE_FIRSTK_WASM")).expect("built by tests/build.rs");
    let module = runtime().compile("firstk.wasm", &wasm).unwrap();
    let optimizer = OptimizerConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0, nesterov: false };
    let cfg = ShardConfig { optimizer, push_weight: PushWeight::Sum, ..ShardConfig::default() };
    let conf = config(&[("k", "3"), ("wait", "false")]);
    let push = |worker, iteration| PushRequest {
        worker,
        iteration,
        samples: 1,
        grad: vec![(worker + 1) as f32 + iteration as f32, 1.0],
        based_on: None,
        tasks: None,
        local_steps: 0,
        signals: Default::default(),
    };
    // Straight through: nine pushes, three groups.
    let mut rec = Recorder::default();
    let mut straight = Shard::new(cfg.clone(), vec![0.5, -1.0], &module, &conf, &mut rec).unwrap();
    let order = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2), (2, 2)];
    for w in 0..3 {
        straight.join(w, 0, &mut rec).unwrap();
    }
    for &(w, i) in &order {
        straight.push(push(w, i), 1, &mut rec).unwrap();
    }
    assert_eq!(straight.stats().steps, 3, "three groups of three");
    // Snapshotted with a group open (after 4 pushes), restored, then the rest.
    let mut rec2 = Recorder::default();
    let mut first = Shard::new(cfg.clone(), vec![0.5, -1.0], &module, &conf, &mut rec2).unwrap();
    for w in 0..3 {
        first.join(w, 0, &mut rec2).unwrap();
    }
    for &(w, i) in &order[..4] {
        first.push(push(w, i), 1, &mut rec2).unwrap();
    }
    let snap = ShardSnapshot::decode(&first.snapshot(2).unwrap().encode()).unwrap();
    let mut restored = Shard::restore(cfg.clone(), snap, &module, &mut rec2).unwrap();
    for &(w, i) in &order[4..] {
        restored.push(push(w, i), 3, &mut rec2).unwrap();
    }
    let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(restored.values()), bits(straight.values()), "the open group came through the snapshot");
    // A primary streaming its ops to a backup: the backup's groups are the primary's.
    let node_cfg = NodeConfig { shard: cfg, rejoin_grace_ns: 1, quiet: true };
    let mut primary = ShardNode::new(node_cfg.clone(), module.clone(), conf.clone(), false);
    let mut backup = ShardNode::new(node_cfg, module, conf, true);
    primary.attach_backup(0, &mut Quiet).unwrap();
    let mut token = 0;
    let relay = |primary: &mut ShardNode, backup: &mut ShardNode| {
        while let Some(out) = primary.poll_output() {
            if let NodeOutput::Replicate { stamped, payload } = out {
                backup.replicated(stamped, payload, |_| None, &mut Quiet);
            }
        }
        while backup.poll_output().is_some() {}
    };
    for w in 0..3 {
        token += 1;
        primary.join(0, token, w, if w == 0 { vec![0.5, -1.0] } else { Vec::new() }, &mut Quiet);
        relay(&mut primary, &mut backup);
    }
    for &(w, i) in &order {
        token += 1;
        let p = push(w, i);
        primary.push(1, token, PushHeader::gradient(w, i, 1), p.grad, &mut Quiet);
        relay(&mut primary, &mut backup);
    }
    let (p, b) = (primary.shard().unwrap(), backup.shard().unwrap());
    assert_eq!(bits(p.values()), bits(straight.values()));
    assert_eq!(bits(b.values()), bits(p.values()), "the backup applied the same groups");
}
