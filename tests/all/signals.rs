//! ABI v3 through real modules: what a push reports reaches the policy (the worker's loss,
//! tokens and step time, the host's norm of the gradient), the host answers a module's measures
//! (`policies/example-clip` clips by the norm it asks for), a report out of bounds is refused,
//! and a module built by the previous SDK (ABI v2, `tests/fixtures/abi-v2`) loads and decides
//! exactly as the same policy built for v3.

use syncopate::shard::{OptimizerConfig, PullRequest, PushRequest, Shard, ShardConfig, ShardError};
use syncopate_policy_sdk::abi::{Event, Signals};
use syncopate_suite::{builtin_module, clip_module, config, runtime, Recorder};

fn sgd() -> ShardConfig {
    ShardConfig {
        optimizer: OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false },
        ..ShardConfig::default()
    }
}

fn push(worker: u32, iteration: u64, grad: &[f32], signals: Signals) -> PushRequest {
    PushRequest {
        worker,
        iteration,
        samples: 8,
        grad: grad.to_vec(),
        based_on: None,
        tasks: None,
        local_steps: 0,
        signals,
    }
}

fn pushes_seen(rec: &Recorder) -> Vec<syncopate_policy_sdk::abi::Push> {
    rec.called.iter().filter_map(|e| if let Event::Push(p) = e.event { Some(p) } else { None }).collect()
}

#[test]
fn a_push_carries_its_workers_report_and_the_hosts_norm_to_the_policy() {
    let mut rec = Recorder::default();
    let mut shard = Shard::new(sgd(), vec![0.0; 4], &builtin_module("asp"), &[], &mut rec).expect("starts");
    shard.join(0, 0, &mut rec).expect("joins");
    let reported = Signals { loss: Some(2.25), norm: Some(99.0), tokens: 512, step_ns: 18_000_000 };
    shard.push(push(0, 0, &[3.0, 0.0, 4.0, 0.0], reported), 1, &mut rec).expect("push");
    let seen = pushes_seen(&rec);
    assert_eq!(seen.len(), 1);
    // The worker's figures as it sent them; the norm the host's own (the worker's is ignored).
    assert_eq!(seen[0].signals, Signals { norm: Some(5.0), ..reported });

    // Out of bounds: refused with the reason, and nothing changes.
    let version = shard.version();
    for (bad, why) in [
        (Signals { loss: Some(f32::NAN), ..Signals::default() }, "a loss of NaN"),
        (Signals { loss: Some(f32::INFINITY), ..Signals::default() }, "a loss of inf"),
        (Signals { step_ns: Signals::MAX_STEP_NS + 1, ..Signals::default() }, "at most a day"),
        (Signals { tokens: Signals::MAX_TOKENS + 1, ..Signals::default() }, "at most 2^40"),
    ] {
        match shard.push(push(0, 1, &[1.0; 4], bad), 2, &mut rec) {
            Err(e @ ShardError::BadSignals { .. }) => assert!(e.to_string().contains(why), "{e}"),
            other => panic!("{bad:?} was not refused as a bad report: {other:?}"),
        }
    }
    assert_eq!(shard.version(), version);
    shard.push(push(0, 1, &[1.0; 4], Signals::default()), 3, &mut rec).expect("a push without a report");
    assert_eq!(pushes_seen(&rec)[1].signals, Signals { norm: Some(2.0), ..Signals::default() });
}

#[test]
fn the_host_answers_a_modules_measure_and_the_module_weighs_the_push_by_it() {
    let mut rec = Recorder::default();
    let mut shard =
        Shard::new(sgd(), vec![0.0; 4], &clip_module(), &config(&[("c", "1")]), &mut rec).expect("starts");
    for w in 0..2 {
        shard.join(w, 0, &mut rec).expect("joins");
    }
    let id = shard.push(push(0, 0, &[3.0, 4.0, 0.0, 0.0], Signals::default()), 1, &mut rec).expect("push");
    // The answer came right after the push, with the push's norm, and the push was admitted
    // clipped to norm 1, at ASP's weight 1/2: one step of (0.3, 0.4).
    let answer = rec.called.iter().find_map(|e| match e.event {
        Event::Measured { query, value } => Some((query, value)),
        _ => None,
    });
    assert_eq!(answer, Some((id, 5.0)));
    assert!(rec.was_acked(id));
    let want = [-0.3f32, -0.4, 0.0, 0.0];
    assert!(shard.values().iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6), "{:?}", shard.values());
    assert!(rec.metrics.contains(&("clip.norm".to_string(), 5.0)));
    // A short gradient goes as it is.
    shard.push(push(1, 0, &[0.2, 0.0, 0.0, 0.0], Signals::default()), 2, &mut rec).expect("push");
    assert!((shard.values()[0] + 0.4).abs() < 1e-6);
    assert!(rec.errors.is_empty(), "{:?}", rec.errors);
}

/// The measure costs the answer's call fuel by the tensor's size: on a budget that the event
/// itself fits in, a measure of a large enough tensor runs the answer out of fuel, and the push
/// is still applied by the fallback rules.
#[test]
fn a_measure_is_charged_to_the_answers_fuel() {
    let limits = syncopate::runtime::SandboxLimits { call_fuel: 200_000, ..Default::default() };
    let rt = syncopate::runtime::PolicyRuntime::with_limits(limits).expect("runtime");
    let wasm = std::fs::read(env!("SYNCOPATE_CLIP_WASM")).expect("built");
    let module = rt.compile("clip", &wasm).expect("compiles");
    // A small tensor's measure fits the budget.
    let mut rec = Recorder::default();
    let mut shard = Shard::new(sgd(), vec![0.0; 4], &module, &[], &mut rec).expect("starts");
    shard.join(0, 0, &mut rec).expect("joins");
    shard.push(push(0, 0, &[1.0; 4], Signals::default()), 1, &mut rec).expect("push");
    assert!(rec.errors.is_empty(), "{:?}", rec.errors);
    // One of twice the budget's worth of values does not.
    let mut rec = Recorder::default();
    let len = 8 * 200_000 * 2;
    let mut shard = Shard::new(sgd(), vec![0.0; len], &module, &[], &mut rec).expect("starts");
    shard.join(0, 0, &mut rec).expect("joins");
    let id = shard.push(push(0, 0, &vec![1e-3; len], Signals::default()), 1, &mut rec).expect("push");
    assert!(
        rec.errors.iter().any(|e| e.to_string().contains("fuel")),
        "the answer ran out of fuel: {:?}",
        rec.errors
    );
    assert!(rec.was_acked(id), "the push was applied by the fallback rules");
}

/// `tests/fixtures/abi-v2/{ssp,diloco}.wasm` were built by the SDK of ABI v2 (commit 2f24bf1,
/// `policies/ssp` and `policies/diloco` as they were). They load as v2 modules and decide, event
/// for event, what the same policies built for v3 decide.
#[test]
fn a_module_built_for_abi_v2_loads_and_decides_as_the_same_policy_built_for_v3() {
    for (name, cfg) in [("ssp", vec![("s", "1")]), ("diloco", vec![("h", "2")])] {
        let path = format!("{}/tests/fixtures/abi-v2/{name}.wasm", env!("CARGO_MANIFEST_DIR"));
        let old =
            runtime().compile(&path, &std::fs::read(&path).expect("fixture")).expect("a v2 module loads");
        let new = builtin_module(name);
        assert_eq!((old.abi(), new.abi()), (2, 3), "{name}");
        assert_eq!(old.info().name, new.info().name);
        let run = |module| {
            let mut rec = Recorder::default();
            let mut shard =
                Shard::new(sgd(), vec![0.5; 3], &module, &config(&cfg), &mut rec).expect("starts");
            let mut t = 0;
            for w in 0..3 {
                shard.join(w, 0, &mut rec).expect("joins");
            }
            // Worker 2 is slow: it pushes every third turn; the others run ahead to the bound.
            let mut next = [0u64; 3];
            for turn in 0..24u64 {
                for w in 0..3u32 {
                    if w == 2 && turn % 3 != 0 {
                        continue;
                    }
                    t += 1_000;
                    let i = next[w as usize];
                    let _ = shard.pull(PullRequest { worker: w, iteration: i }, t, &mut rec);
                    t += 1_000;
                    let grad = [0.1 * (w + 1) as f32, -0.05, turn as f32 / 100.0];
                    if shard.push(push(w, i, &grad, Signals::default()), t, &mut rec).is_ok() {
                        next[w as usize] += 1;
                    }
                }
            }
            let decisions: Vec<String> = rec.called.iter().map(|e| format!("{:?}", e.event)).collect();
            (
                shard.values().to_vec(),
                shard.stats(),
                rec.served.len(),
                rec.acked.clone(),
                decisions,
                rec.errors,
            )
        };
        let (a, b) = (run(old), run(new));
        assert!(b.1.pulls_deferred > 0 && b.1.pushes_admitted > 0, "{name}: the run exercised the rule");
        assert!(a.5.is_empty() && b.5.is_empty(), "{name}: {:?} {:?}", a.5, b.5);
        // The v3 pushes carry a norm, the v2 ones none: compare the events without it.
        let strip = |d: &[String]| -> Vec<String> {
            d.iter().map(|s| s.split(", signals").next().unwrap_or(s).to_string()).collect()
        };
        assert_eq!(strip(&a.4), strip(&b.4), "{name}: the same events");
        assert_eq!(
            (a.0, a.2, a.3),
            (b.0, b.2, b.3),
            "{name}: the same parameters, pulls served, pushes acknowledged"
        );
        assert_eq!(format!("{:?}", a.1), format!("{:?}", b.1), "{name}: the same counters");
    }
}

/// `robust` on a real module: of four gradients, the one far outside the others' spread is
/// dropped and the round steps on the mean of the rest; with `action=clip` it is scaled down to
/// the threshold instead.
#[test]
fn the_robust_merge_drops_or_clips_the_outlier_by_the_hosts_norms() {
    for (action, want) in [("drop", -2.0f32), ("clip", -(1.0 + 2.0 + 3.0 + 5.5) / 4.0)] {
        let mut rec = Recorder::default();
        let module = builtin_module("robust");
        let mut shard = Shard::new(sgd(), vec![0.0; 1], &module, &config(&[("action", action)]), &mut rec)
            .expect("starts");
        for w in 0..4 {
            shard.join(w, 0, &mut rec).expect("joins");
        }
        for (w, g) in [1.0f32, 2.0, 3.0, 400.0].iter().enumerate() {
            shard.push(push(w as u32, 0, &[*g], Signals::default()), w as u64 + 1, &mut rec).expect("push");
        }
        assert!((shard.values()[0] - want).abs() < 1e-5, "{action}: {:?}", shard.values());
        assert_eq!(shard.version(), 1, "{action}: one step for the round");
        assert_eq!(rec.acked.len(), 4, "{action}: every push acknowledged");
        assert_eq!(shard.stats().pushes_dropped, u64::from(action == "drop"), "{action}");
        assert!(rec.errors.is_empty(), "{action}: {:?}", rec.errors);
    }
}
