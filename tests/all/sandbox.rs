//! Hostile and broken modules: each gets a clear error naming the module and the event, and the
//! shard keeps serving and loses nothing.

use syncopate::runtime::PolicyError;
use syncopate_suite::{builtin_module, hostile_module, runtime, TEST_CALL_FUEL};

use crate::harness::Cluster;

const N: u32 = 4;
const ITERATIONS: u64 = 12;

/// Runs a BSP-like cluster under the hostile policy and checks that nothing was lost.
fn run_hostile(mode: &str, after: &str) -> Cluster {
    let mut c = Cluster::new(&hostile_module(), &[("mode", mode), ("after", after)], N, ITERATIONS, 5);
    c.run_to_end();
    assert_eq!(c.pushes, u64::from(N) * ITERATIONS);
    assert_eq!(c.rec.acked.len() as u64, c.pushes, "{mode}: every push acknowledged exactly once");
    let mut ids: Vec<_> = c.rec.acked.iter().map(|a| a.0).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, c.pushes, "{mode}: no push acknowledged twice");
    assert_eq!(
        c.shard.values()[0],
        -(c.pushes as f32) / N as f32,
        "{mode}: every update applied exactly once"
    );
    assert_eq!(c.shard.parked_pulls(), 0, "{mode}: no pull left hanging");
    assert!(!c.rec.errors.is_empty(), "{mode}: the failure was reported");
    c
}

fn first_error(c: &Cluster) -> &PolicyError {
    &c.rec.errors[0]
}

fn assert_names_module_and_event(e: &PolicyError, event_kind: &str) {
    let msg = e.to_string();
    assert!(msg.contains("policy `hostile` 0.0.0"), "names the module: {msg}");
    assert!(msg.contains(event_kind), "names the event: {msg}");
}

#[test]
fn trap_is_reported_and_the_shard_recovers() {
    let c = run_hostile("pull:trap", "10");
    let e = first_error(&c);
    assert!(matches!(e, PolicyError::Trap { .. }), "{e}");
    assert_names_module_and_event(e, "pull #");
}

#[test]
fn infinite_loop_is_stopped_when_its_fuel_runs_out() {
    let c = run_hostile("push:loop", "0");
    let e = first_error(&c);
    assert!(matches!(e, PolicyError::OutOfFuel { fuel: TEST_CALL_FUEL, .. }), "{e}");
    assert_names_module_and_event(e, "push #");
    // It loops on every push: after three failures in a row it is quarantined.
    assert!(c.shard.is_quarantined());
}

/// Fuel, not time, stops a call, so the same events give the same failures and the same
/// state on every run (as on a primary and its backup), however loaded the machine is.
#[test]
fn a_looping_policy_fails_the_same_way_on_every_run() {
    let runs: Vec<Cluster> = (0..2).map(|_| run_hostile("pull:loop", "5")).collect();
    let errors = |c: &Cluster| c.rec.errors.iter().map(|e| e.to_string()).collect::<Vec<_>>();
    assert_eq!(errors(&runs[0]), errors(&runs[1]));
    assert_eq!(runs[0].shard.values(), runs[1].shard.values());
    assert_eq!(runs[0].rec.acked, runs[1].rec.acked);
}

#[test]
fn memory_bomb_hits_the_cap() {
    let c = run_hostile("pull:bomb", "3");
    let e = first_error(&c);
    match e {
        PolicyError::MemoryCap { cap, wanted, .. } => assert!(wanted > cap && *cap == 16 << 20),
        other => panic!("expected a memory-cap error, got {other}"),
    }
    assert_names_module_and_event(e, "pull #");
}

#[test]
fn panic_message_is_reported() {
    let c = run_hostile("push:panic", "0");
    let e = first_error(&c);
    match e {
        PolicyError::Panic { message, .. } => {
            assert!(message.contains("hostile policy panics on purpose"), "{message}")
        }
        other => panic!("expected a panic error, got {other}"),
    }
    assert!(c.shard.is_quarantined());
}

#[test]
fn nonsense_decisions_are_refused() {
    for (mode, says) in [
        ("pull:release-unknown", "which is not parked"),
        ("push:admit-unknown", "neither this event's push nor held"),
        ("pull:control-stranger", "worker 4242, which is not live"),
    ] {
        let c = run_hostile(mode, "2");
        let e = first_error(&c);
        assert!(matches!(e, PolicyError::BadDecision { .. }), "{mode}: {e}");
        assert!(e.to_string().contains(says), "{mode}: {e}");
    }
}

#[test]
fn a_failure_once_restarts_from_the_checkpoint_without_quarantine() {
    // The restarted instance resumes from its checkpoint and behaves again for a while: failures
    // that do not come in a row never quarantine the module.
    let c = run_hostile("pull:trap", "30");
    assert!(c.shard.stats().policy_failures >= 1);
    assert!(!c.shard.is_quarantined());
    assert_eq!(c.shard.values()[0], -(c.pushes as f32) / N as f32);
}

fn compile_wat(wat: &str) -> Result<syncopate::runtime::PolicyModule, PolicyError> {
    let wasm = wat::parse_str(wat).expect("valid wat");
    runtime().compile("test.wasm", &wasm)
}

const ABI_EXPORTS: &str = r#"
    (memory (export "memory") 1)
    (func (export "syncopate_abi_v2") (result i32) i32.const 2)
    (func (export "sp_buffer") (param i32) (result i32) i32.const 0)
    (func (export "sp_info") (result i64) i64.const 0)
    (func (export "sp_init") (param i32) (result i64) i64.const 0)
    (func (export "sp_import_state") (param i32) (result i64) i64.const 0)
    (func (export "sp_export_state") (result i64) i64.const 0)
    (func (export "sp_last_panic") (result i64) i64.const 0)
"#;

#[test]
fn forbidden_import_is_rejected() {
    let wat = format!(
        r#"(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32))) {ABI_EXPORTS}
            (func (export "sp_event") (param i32) (result i64) i64.const 0))"#
    );
    let e = compile_wat(&wat).unwrap_err();
    assert!(matches!(e, PolicyError::ForbiddenImport { .. }), "{e}");
    assert!(e.to_string().contains("imports `wasi_snapshot_preview1::fd_write`"), "{e}");
}

#[test]
fn wrong_abi_version_is_rejected() {
    // A module built with the SDK before pushes and pulls carried staleness and versions.
    let e = compile_wat(r#"(module (memory (export "memory") 1) (func (export "syncopate_abi_v1") (result i32) i32.const 1))"#)
        .unwrap_err();
    assert_eq!(e.to_string(), "test.wasm: built for policy ABI v1, but this host speaks v3 (and loads v2)");
}

#[test]
fn modules_that_are_not_policies_are_rejected() {
    let e = compile_wat("(module)").unwrap_err();
    assert!(matches!(e, PolicyError::NotAPolicy { .. }), "{e}");
    let e = compile_wat(&format!("(module {ABI_EXPORTS})")).unwrap_err();
    assert!(e.to_string().contains("export `sp_event` is missing"), "{e}");
    let e = compile_wat(&format!(
        r#"(module {ABI_EXPORTS} (func (export "sp_event") (result i64) i64.const 0))"#
    ))
    .unwrap_err();
    assert!(e.to_string().contains("export `sp_event` is missing or is not a function (i32) -> i64"), "{e}");
    let e = runtime().compile("junk.wasm", b"not wasm at all").unwrap_err();
    assert!(e.to_string().starts_with("junk.wasm: not a valid wasm module: not a WebAssembly module"), "{e}");
}

#[test]
fn oversized_initial_memory_is_rejected_at_load() {
    // 512 pages = 32 MiB initial memory, over the tests' 16 MiB cap.
    let wat = ABI_EXPORTS.replace(r#"(memory (export "memory") 1)"#, r#"(memory (export "memory") 512)"#);
    let e = compile_wat(&format!(
        r#"(module {wat} (func (export "sp_event") (param i32) (result i64) i64.const 0))"#
    ))
    .unwrap_err();
    assert!(e.to_string().contains("initial memory exceeds the 16777216 byte cap"), "{e}");
}

#[test]
fn garbage_info_is_rejected() {
    // sp_info points outside memory.
    let wat = ABI_EXPORTS.replace(
        r#"(func (export "sp_info") (result i64) i64.const 0)"#,
        r#"(func (export "sp_info") (result i64) i64.const -1)"#,
    );
    let e = compile_wat(&format!(
        r#"(module {wat} (func (export "sp_event") (param i32) (result i64) i64.const 0))"#
    ))
    .unwrap_err();
    assert!(e.to_string().contains("`sp_info` returned a buffer outside its memory"), "{e}");
}

/// A raw module that passes validation and starts, then answers every event with the `len` bytes
/// at `ptr` (the data segment at 48 holds `reply`).
fn raw_policy(reply: &str, ptr: u32, len: u32) -> syncopate::runtime::PolicyModule {
    let event = (u64::from(ptr) << 32) | u64::from(len);
    let wat = format!(
        r#"(module
            (memory (export "memory") 1)
            (data (i32.const 16) "\03raw\010\00\00")
            (data (i32.const 32) "\00")
            (data (i32.const 48) "{reply}")
            (func (export "syncopate_abi_v2") (result i32) i32.const 2)
            (func (export "sp_buffer") (param i32) (result i32) i32.const 1024)
            (func (export "sp_info") (result i64) i64.const 0x0000001000000008)
            (func (export "sp_init") (param i32) (result i64) i64.const 0x0000002000000001)
            (func (export "sp_import_state") (param i32) (result i64) i64.const 0x0000002000000001)
            (func (export "sp_export_state") (result i64) i64.const 0)
            (func (export "sp_last_panic") (result i64) i64.const 0)
            (func (export "sp_event") (param i32) (result i64) i64.const {event}))"#
    );
    compile_wat(&wat).expect("the raw module validates")
}

#[test]
fn garbage_replies_are_errors_and_requests_still_resolve() {
    for (reply, ptr, len, says) in [
        (r"\ff\ff\ff\ff\ff", 48, 5, "undecodable decision"),
        ("", 48, 0, "got no verdict"),
        ("", 0xFFFF_0000, 16, "outside its memory"),
    ] {
        let module = raw_policy(reply, ptr, len);
        assert_eq!(module.info().name, "raw");
        let mut c = Cluster::new(&module, &[], N, ITERATIONS, 1);
        c.run_to_end();
        let e = first_error(&c);
        assert!(e.to_string().contains(says), "{says}: {e}");
        assert!(e.to_string().contains("policy `raw` 0"), "{e}");
        // The module fails on every event: quarantined, and the fallback rules (BSP) carry the
        // run to the end with every push applied once.
        assert!(c.shard.is_quarantined());
        assert_eq!(c.rec.acked.len() as u64, c.pushes);
        assert_eq!(c.shard.values()[0], -(c.pushes as f32) / N as f32);
        for p in &c.rec.served {
            assert!(p.min_applied >= p.clock, "fallback keeps BSP's guarantee");
        }
    }
}

#[test]
fn quarantine_during_redelivery_keeps_every_queued_pull() {
    use syncopate::shard::{CrashLoop, PullRequest, PushRequest, Shard, ShardConfig, SupervisorConfig};
    use syncopate_suite::{config, Recorder};
    // Checkpoint after every event: a restarted instance resumes armed, so it traps again on the
    // pulls handed back to it, and the third failure in a row lands while pulls are still queued
    // for re-delivery. Those must be parked under the fallback rule, not dropped.
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
    let mut shard = Shard::new(
        cfg,
        vec![0.0],
        &hostile_module(),
        &config(&[("mode", "pull:trap"), ("after", "3")]),
        &mut rec,
    )
    .expect("starts");
    for w in 0..3 {
        shard.join(w, 0, &mut rec).expect("joins");
    }
    let push = |w| PushRequest {
        worker: w,
        iteration: 0,
        samples: 1,
        grad: vec![1.0],
        based_on: None,
        tasks: None,
        local_steps: 0,
        signals: Default::default(),
    };
    shard.push(push(0), 1, &mut rec).expect("push");
    shard.push(push(1), 2, &mut rec).expect("push");
    let p0 = shard.pull(PullRequest { worker: 0, iteration: 1 }, 3, &mut rec).expect("pull");
    let p1 = shard.pull(PullRequest { worker: 1, iteration: 1 }, 4, &mut rec).expect("pull");
    assert!(shard.is_quarantined(), "three traps in a row: {:?}", rec.errors);
    assert_eq!(rec.errors.len(), 3);
    assert_eq!(shard.parked_pulls(), 2, "both pulls wait for the slowest worker");
    shard.push(push(2), 5, &mut rec).expect("push");
    assert!(rec.was_served(p0) && rec.was_served(p1), "both released once worker 2 pushed");
}

/// Issue 50: rules that never decide. A module that parks every pull, or holds every push, for
/// ever, once every live worker has waited on it for the no-progress time (30 s of the shard's
/// time by default), is failed: the stuck requests are resolved by the fallback rules, the error
/// says what was stuck and for how long, and the third such stall quarantines it. The run ends
/// with every push applied exactly once.
#[test]
fn a_rule_that_never_decides_fails_for_no_progress_and_the_run_finishes() {
    for (mode, stuck) in
        [("pull:park", "4 pulls parked, 0 pushes held"), ("push:hold", "held; longest: worker")]
    {
        let c = run_hostile(mode, "8");
        let stalls: Vec<String> = c
            .rec
            .errors
            .iter()
            .filter(|e| matches!(e, PolicyError::NoProgress { .. }))
            .map(|e| e.to_string())
            .collect();
        assert_eq!(stalls.len(), 3, "{mode}: three stalls, then the quarantine: {:?}", c.rec.errors);
        assert_eq!(stalls.len(), c.rec.errors.len(), "{mode}: nothing else failed: {:?}", c.rec.errors);
        for e in &stalls {
            assert!(e.contains("policy `hostile` 0.0.0") && e.contains("made no progress"), "{mode}: {e}");
            assert!(e.contains("all 4 live workers waited on its decisions for 30.0 s"), "{mode}: {e}");
            assert!(e.contains(stuck), "{mode}: says what was stuck: {e}");
        }
        assert!(c.shard.is_quarantined(), "{mode}");
        assert!(matches!(&c.rec.quarantined[..], [q] if q.starts_with("policy `hostile` 0.0.0")), "{mode}");
        // Three no-progress times, then the fallback rules carry the run on at the harness's pace.
        assert!((90_000_000_000..95_000_000_000).contains(&c.now), "{mode}: ended at {} ns", c.now);
    }
}

/// A rule that waits on a timer it keeps setting is not making progress either.
#[test]
fn the_no_progress_time_is_the_shards_setting_and_zero_turns_it_off() {
    use syncopate::shard::{PullRequest, Shard, ShardConfig, SupervisorConfig};
    use syncopate_suite::{config, Recorder};
    let shard_with = |no_progress_ns: u64| {
        let cfg = ShardConfig {
            supervisor: SupervisorConfig { no_progress_ns, ..SupervisorConfig::default() },
            ..ShardConfig::default()
        };
        let mut rec = Recorder::default();
        let mut shard =
            Shard::new(cfg, vec![0.0], &hostile_module(), &config(&[("mode", "pull:park")]), &mut rec)
                .expect("starts");
        for w in 0..2 {
            shard.join(w, 0, &mut rec).expect("joins");
            shard.pull(PullRequest { worker: w, iteration: 0 }, 1_000, &mut rec).expect("pull");
        }
        (shard, rec)
    };
    // 2 s: the look is due 2 s after the first pull parked; both wait since 1 µs.
    let (mut shard, mut rec) = shard_with(2_000_000_000);
    assert_eq!(shard.next_timer_ns(), Some(2_000_001_000));
    shard.advance(2_000_000_999, &mut rec);
    assert!(rec.errors.is_empty() && rec.served.is_empty(), "not yet");
    shard.advance(2_000_001_000, &mut rec);
    assert!(matches!(rec.errors[..], [PolicyError::NoProgress { .. }]), "{:?}", rec.errors);
    assert_eq!(rec.served.len(), 2, "both pulls served by BSP's rule (both workers at clock 0)");
    assert_eq!(shard.module_failures(), 1);
    // Off: nothing ever looks.
    let (mut shard, mut rec) = shard_with(0);
    assert_eq!(shard.next_timer_ns(), None);
    shard.advance(u64::MAX / 2, &mut rec);
    assert!(rec.errors.is_empty() && shard.parked_pulls() == 2);
}

/// A rule that holds pushes on some shards and not others deadlocks the workers across shards:
/// here worker 1's push was admitted (and it waits for the other shards' acknowledgements, its
/// report not come), worker 0's is held. Both wait: after the no-progress time the rule fails.
#[test]
fn a_worker_acknowledged_here_and_waiting_on_other_shards_counts_as_waiting() {
    use syncopate::shard::{PullRequest, PushRequest, Shard, ShardConfig};
    use syncopate_policy_sdk::abi::IterationReport;
    use syncopate_suite::{config, Recorder};
    let mut rec = Recorder::default();
    // Two pulls and worker 1's push behave; worker 0's push, the fourth event, is held.
    let cfg = [("mode", "push:hold"), ("after", "3")];
    let mut shard = Shard::new(ShardConfig::default(), vec![0.0], &hostile_module(), &config(&cfg), &mut rec)
        .expect("starts");
    let push = |w| PushRequest {
        worker: w,
        iteration: 0,
        samples: 1,
        grad: vec![1.0],
        based_on: None,
        tasks: None,
        local_steps: 0,
        signals: Default::default(),
    };
    for w in 0..2 {
        shard.join(w, 0, &mut rec).expect("joins");
        shard.pull(PullRequest { worker: w, iteration: 0 }, 1_000, &mut rec).expect("pull");
    }
    shard.push(push(1), 2_000, &mut rec).expect("push");
    assert_eq!(rec.acked.len(), 1, "worker 1's push admitted");
    shard.push(push(0), 3_000, &mut rec).expect("push");
    assert_eq!(shard.held_pushes(), 1, "worker 0's push held");
    let stall_at = 3_000 + syncopate::shard::DEFAULT_NO_PROGRESS_NS;
    shard.advance(stall_at - 1, &mut rec);
    assert!(rec.errors.is_empty());
    shard.advance(stall_at, &mut rec);
    assert!(matches!(rec.errors[..], [PolicyError::NoProgress { .. }]), "{:?}", rec.errors);
    assert_eq!(rec.acked.len(), 2, "worker 0's push resolved by the fallback rule");
    // Had worker 1 reported (every shard acknowledged it), it would be computing: no stall.
    let mut rec = Recorder::default();
    let mut shard = Shard::new(ShardConfig::default(), vec![0.0], &hostile_module(), &config(&cfg), &mut rec)
        .expect("starts");
    for w in 0..2 {
        shard.join(w, 0, &mut rec).expect("joins");
        shard.pull(PullRequest { worker: w, iteration: 0 }, 1_000, &mut rec).expect("pull");
    }
    shard.push(push(1), 2_000, &mut rec).expect("push");
    let report = IterationReport { worker: 1, iteration: 0, compute_ns: 1, samples: 1 };
    shard.iteration_finished(report, 2_500, &mut rec).expect("report");
    shard.push(push(0), 3_000, &mut rec).expect("push");
    shard.advance(stall_at + 1_000_000_000, &mut rec);
    assert!(rec.errors.is_empty(), "{:?}", rec.errors);
}

/// A rule that parks pulls on some shards and not others deadlocks the workers across shards:
/// here worker 1's pull was served (it waits on another shard's answer, which it tells every
/// shard after a while), worker 0's is parked. Both wait: after the no-progress time from the
/// notice, the rule fails. A worker that says its pull was answered everywhere is computing,
/// and a notice that arrives after that is void.
#[test]
fn a_worker_served_here_that_says_it_waits_on_another_shard_counts_as_waiting() {
    use syncopate::shard::{PullRequest, Shard, ShardConfig, DEFAULT_NO_PROGRESS_NS};
    use syncopate_suite::{config, Recorder};
    // Worker 1's pull behaves; worker 0's, the second event, is parked for ever.
    let cfg = [("mode", "pull:park"), ("after", "1")];
    let start = || {
        let mut rec = Recorder::default();
        let mut shard =
            Shard::new(ShardConfig::default(), vec![0.0], &hostile_module(), &config(&cfg), &mut rec)
                .expect("starts");
        shard.join(0, 0, &mut rec).expect("joins");
        shard.join(1, 0, &mut rec).expect("joins");
        shard.pull(PullRequest { worker: 1, iteration: 0 }, 1_000, &mut rec).expect("pull");
        shard.pull(PullRequest { worker: 0, iteration: 0 }, 2_000, &mut rec).expect("pull");
        assert_eq!((rec.served.len(), shard.parked_pulls()), (1, 1));
        (shard, rec)
    };
    let told = 1_000_000_000;
    let (mut shard, mut rec) = start();
    shard.pull_waiting(1, 0, true, told).expect("notice");
    shard.advance(told + DEFAULT_NO_PROGRESS_NS - 1, &mut rec);
    assert!(rec.errors.is_empty(), "not yet: {:?}", rec.errors);
    shard.advance(told + DEFAULT_NO_PROGRESS_NS, &mut rec);
    assert!(matches!(rec.errors[..], [PolicyError::NoProgress { .. }]), "{:?}", rec.errors);
    assert_eq!(rec.served.len(), 2, "worker 0's pull served by the fallback rule");
    // Worker 1 computes: its pull was answered everywhere (the end overtook the notice here).
    let (mut shard, mut rec) = start();
    shard.pull_waiting(1, 0, false, told).expect("notice");
    shard.pull_waiting(1, 0, true, told + 1).expect("notice");
    shard.advance(told + 2 * DEFAULT_NO_PROGRESS_NS, &mut rec);
    assert!(rec.errors.is_empty() && shard.parked_pulls() == 1, "{:?}", rec.errors);
    // A stranger's notice is refused.
    assert!(shard.pull_waiting(7, 0, true, told).is_err());
}

/// A worker that computes (or waits on another shard) is not waiting on this one: while one
/// worker has no request here, others may wait as long as they must (a straggler under BSP).
#[test]
fn a_straggler_is_not_a_stall() {
    let mut c = Cluster::new(&builtin_module("bsp"), &[], N, 6, 3).with_speeds(&[1, 1, 1, 1]);
    // A 40 s step: longer than the no-progress time, every time a worker moves.
    c = c.with_step_ns(40_000_000_000);
    c.run_to_end();
    assert!(c.rec.errors.is_empty(), "{:?}", c.rec.errors);
    assert_eq!(c.shard.values()[0], -(c.pushes as f32) / N as f32);
}

/// Issue 50: a crash loop. A module that panics on every 20th (or 200th) pull or push, and
/// behaves in between, is restarted at once the first time, then kept out for a backoff that
/// doubles (1 s, 2 s, 4 s: the fallback rules run meanwhile), and quarantined at the fifth
/// failure within a minute, however many successes came between: the count survives restarts.
#[test]
fn a_crash_loop_backs_off_and_is_quarantined_across_restarts() {
    for every in ["20", "200"] {
        let cfg = [("mode", "pull:panic"), ("after", "0"), ("every", every)];
        let mut c = Cluster::new(&hostile_module(), &cfg, N, 1_000, 5).with_step_ns(2_000_000);
        c.run_to_end();
        assert_eq!(c.rec.errors.len(), 5, "every {every}: {:?}", c.rec.errors);
        assert!(c.rec.errors.iter().all(|e| matches!(e, PolicyError::Panic { .. })), "{:?}", c.rec.errors);
        assert!(c.shard.is_quarantined(), "every {every}");
        // Four restarts: the first at once, then 1, 2 and 4 s after the failure before them,
        // which comes within a second of the restart before that.
        let r = &c.rec.restarts;
        assert_eq!(r.len(), 4, "every {every}: restarts at {r:?}");
        for (k, backoff) in [(1, 1_000_000_000), (2, 2_000_000_000), (3, 4_000_000_000)] {
            let gap = r[k] - r[k - 1];
            assert!((backoff..backoff + 1_000_000_000).contains(&gap), "every {every}: restarts at {r:?}");
        }
        assert_eq!(c.shard.values()[0], -(c.pushes as f32) / N as f32, "every {every}: nothing lost");
        assert_eq!(c.rec.acked.len() as u64, c.pushes);
    }
}
