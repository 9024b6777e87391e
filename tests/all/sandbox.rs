//! Hostile and broken modules: each gets a clear error naming the module and the event, and the
//! shard keeps serving and loses nothing.

use syncopate::runtime::PolicyError;
use syncopate_suite::{hostile_module, runtime, TEST_CALL_FUEL};

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
    assert_eq!(e.to_string(), "test.wasm: built for policy ABI v1, but this host speaks v2");
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
    use syncopate::shard::{PullRequest, PushRequest, Shard, ShardConfig, SupervisorConfig};
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
