//! The cluster policy's machine with real wasm: the built-in autopilot, and hand-written
//! modules that misbehave.

use super::*;
use crate::runtime::{ModuleKind, PolicyRuntime};

fn autopilot(rt: &PolicyRuntime) -> PolicyModule {
    rt.compile("builtin:autopilot", crate::builtin::cluster_wasm("autopilot").unwrap()).unwrap()
}

/// One shard's sample with `clock` iterations done by each worker, each reporting `steps_ms`.
fn sample(policy: &str, clock: u64, steps_ms: &[u64]) -> ShardSample {
    ShardSample {
        shard: 0,
        policy: policy.into(),
        work: steps_ms
            .iter()
            .enumerate()
            .map(|(w, &ms)| WorkerWork {
                worker: w as u32,
                clock,
                step_ns: ms * 1_000_000 * clock,
                pushes: clock,
                loss: Some(1.0),
                waited_ns: 0,
            })
            .collect(),
        ..ShardSample::default()
    }
}

const S: u64 = 1_000_000_000;

#[test]
fn the_autopilot_asks_for_a_swap_when_a_straggler_shows_and_hears_how_it_went() {
    let rt = PolicyRuntime::new().unwrap();
    let cfg = vec![("cadence_ms".to_string(), "500".to_string())];
    let mut p = Pilot::start(&autopilot(&rt), &cfg, 1, 0).unwrap();
    assert_eq!(p.due(), Some(S / 2), "its cadence");
    let alike = [100, 100, 100, 100];
    assert!(p.observe(S / 2, vec![sample("bsp", 10, &alike)]).is_empty());
    // Worker 3 turns five times slower: its mean over the next windows is far above the rest.
    let slow = [100, 100, 100, 1000];
    assert!(p.observe(S, vec![sample("bsp", 20, &slow)]).is_empty(), "one window is not enough");
    let actions = p.observe(3 * S / 2, vec![sample("bsp", 30, &slow)]);
    assert!(
        matches!(&actions[..], [PilotAction::Swap { policy, .. }] if policy == "adaptive-deadline"),
        "{actions:?}"
    );
    assert_eq!(p.due(), None, "nothing more while the swap is under way");
    assert!(p.swapped(2 * S, "adaptive-deadline", Ok(())).is_empty());
    assert!(p.due().is_some());
    let st = p.status();
    assert_eq!((st.swaps, st.quarantined, st.cadence_ms), (1, false, 500));
    assert!(st.log.iter().any(|e| e.what.contains("swap to adaptive-deadline done")), "{st:?}");
    assert!(st.metrics.iter().any(|m| m.0 == "autopilot.rule"), "{st:?}");
}

#[test]
fn a_module_of_the_wrong_kind_is_refused_both_ways() {
    let rt = PolicyRuntime::new().unwrap();
    let bsp = rt.compile("builtin:bsp", crate::builtin::wasm("bsp").unwrap()).unwrap();
    assert_eq!(bsp.kind(), ModuleKind::Shard);
    let e = Pilot::start(&bsp, &[], 1, 0).unwrap_err();
    assert!(matches!(e, PolicyError::WrongKind { .. }), "{e}");
    assert!(e.to_string().contains("is a shard policy, but a cluster policy was expected"), "{e}");
    let pilot = autopilot(&rt);
    assert_eq!(pilot.kind(), ModuleKind::Cluster);
    let init = InitArgs { shard: 0, shards: 1, now_ns: 0, config: vec![] };
    let e = PolicyInstance::new(&pilot, &init).unwrap_err();
    assert!(e.to_string().contains("is a cluster policy, but a shard policy was expected"), "{e}");
}

/// A cluster policy module written by hand whose event export answers `reply` (bytes) or traps
/// when `reply` is `None`.
fn hand_written(rt: &PolicyRuntime, reply: Option<&[u8]>) -> PolicyModule {
    // PolicyInfo { name: "odd", version: "1", description: "x", params: [] } in postcard, then
    // `Ok(())`, then the reply.
    let info: &[u8] = b"\x03odd\x011\x01x\x00";
    let esc = |b: &[u8]| b.iter().map(|x| format!("\\{x:02x}")).collect::<String>();
    let event = match reply {
        Some(r) => format!("(i64.or (i64.const {}) (i64.shl (i64.const 2048) (i64.const 32)))", r.len()),
        None => "unreachable".into(),
    };
    let wat = format!(
        r#"(module
            (memory (export "memory") 1)
            (data (i32.const 1024) "{info}")
            (data (i32.const 1536) "\00")
            (data (i32.const 2048) "{reply}")
            (func (export "syncopate_cluster_v1") (result i32) i32.const 1)
            (func (export "sp_buffer") (param i32) (result i32) i32.const 4096)
            (func (export "sp_info") (result i64) (i64.or (i64.const {ilen}) (i64.shl (i64.const 1024) (i64.const 32))))
            (func (export "sp_init") (param i32) (result i64) (i64.or (i64.const 1) (i64.shl (i64.const 1536) (i64.const 32))))
            (func (export "sp_import_state") (param i32) (result i64) (i64.or (i64.const 1) (i64.shl (i64.const 1536) (i64.const 32))))
            (func (export "sp_event") (param i32) (result i64) {event})
            (func (export "sp_export_state") (result i64) i64.const 0)
            (func (export "sp_last_panic") (result i64) i64.const 0))"#,
        info = esc(info),
        ilen = info.len(),
        reply = esc(reply.unwrap_or_default()),
    );
    rt.compile("odd.wasm", &wat::parse_str(wat).unwrap()).unwrap()
}

#[test]
fn a_cluster_policy_that_keeps_failing_is_quarantined_and_decides_nothing() {
    let rt = PolicyRuntime::new().unwrap();
    // A trap, and a swap to a policy that is not built in (`Swap { "nope", [], "" }`).
    for module in [hand_written(&rt, None), hand_written(&rt, Some(b"\x01\x04nope\x00\x00"))] {
        let mut p = Pilot::start(&module, &[], 1, 0).unwrap();
        for k in 1..=QUARANTINE_AFTER {
            assert_eq!(p.due(), Some(u64::from(k) * S), "a failure decides nothing; the cadence goes on");
            assert!(p.observe(u64::from(k) * S, vec![sample("bsp", k.into(), &[100, 900])]).is_empty());
        }
        let st = p.status();
        assert!(st.quarantined, "{st:?}");
        assert_eq!(p.due(), None);
        assert_eq!(st.swaps, 0);
        assert!(st.log.iter().any(|e| e.what.contains("quarantined")), "{st:?}");
    }
    // A well-formed reply is not a failure: a metric.
    let mut p =
        Pilot::start(&hand_written(&rt, Some(b"\x02\x01m\x00\x00\x00\x00\x00\x00\xf0\x3f")), &[], 1, 0)
            .unwrap();
    for k in 1..=QUARANTINE_AFTER + 1 {
        p.observe(u64::from(k) * S, vec![]);
    }
    assert!(!p.status().quarantined);
    assert_eq!(p.status().metrics, vec![("m".to_string(), 1.0)]);
}

#[test]
fn a_restored_autopilot_goes_on_where_its_state_was() {
    let rt = PolicyRuntime::new().unwrap();
    let m = autopilot(&rt);
    let slow = [100, 100, 100, 1000];
    let mut p = Pilot::start(&m, &[], 1, 0).unwrap();
    assert!(p.observe(2 * S, vec![sample("bsp", 10, &slow)]).is_empty(), "one window of two");
    let state = p.export_state().unwrap();
    // Restored (a coordinator resumed from a checkpoint), the streak goes on: the next window
    // that agrees is the second, and it swaps; started afresh, it would need two more.
    let mut again = Pilot::restore(&m, &[], 1, 10 * S, &state).unwrap();
    assert!(again.status().log[0].what.starts_with("resumed"), "{:?}", again.status().log);
    let actions = again.observe(12 * S, vec![sample("bsp", 20, &slow)]);
    assert_eq!(actions.len(), 1, "{actions:?}");
    let mut fresh = Pilot::start(&m, &[], 1, 10 * S).unwrap();
    assert!(fresh.observe(12 * S, vec![sample("bsp", 20, &slow)]).is_empty());
}

/// A reply of more decisions than a call may make is refused whole; the bound itself is taken.
#[test]
fn a_flood_of_decisions_is_refused_at_the_bound() {
    let rt = PolicyRuntime::new().unwrap();
    let mut p = Pilot::start(&autopilot(&rt), &[], 1, 0).unwrap();
    let reply = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|_| postcard::to_allocvec(&ClusterDecision::SetCadence { ms: 1000 }).unwrap())
            .collect()
    };
    assert!(p.decided(0, &reply(MAX_CLUSTER_DECISIONS), "a test").is_ok());
    let err = p.decided(0, &reply(MAX_CLUSTER_DECISIONS + 1), "a test").unwrap_err().to_string();
    assert!(err.contains("more than 16 decisions"), "{err}");
    let err = p.decided(0, &[0xff, 0xff], "a test").unwrap_err().to_string();
    assert!(err.contains("undecodable"), "{err}");
}
