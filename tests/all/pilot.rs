//! Cluster policies on a real cluster (issue 53): the coordinator process runs the autopilot on
//! the figures its servers report over QUIC, and swaps the shard policy by itself when a worker
//! process turns into a straggler, and back when it recovers.

use std::time::Duration;

use crate::cluster::LocalRun;

/// Four worker processes at 20 ms per iteration; worker 0 turns 4x slower from 3 s to 8 s.
/// The autopilot (every 500 ms, two windows to agree) moves the cluster from BSP to the
/// adaptive deadline (one straggler of four) while it lasts, and back to BSP after; the report
/// has its log, the swaps and the phases, and `policy status` shows them while it runs.
#[test]
fn the_autopilot_swaps_by_itself_when_a_worker_straggles_and_back_when_it_recovers() {
    let mut run = LocalRun::start_plain(
        "autopilot",
        &[
            "--workload",
            "counter",
            "--workers",
            "4",
            "--servers",
            "2",
            "--params",
            "64",
            "--delay-ms",
            "20",
            "--slow",
            "0:4:3:8",
            "--iterations",
            "100000",
            "--time-limit-s",
            "13",
            "--policy",
            "bsp",
            "--pilot",
            "autopilot:cadence_ms=500,dwell_ms=1000",
        ],
    );
    // While it runs, `policy status` shows the cluster policy and the swap it made.
    let cluster = run.cluster_file();
    let t = std::time::Instant::now();
    loop {
        let st = crate::cluster::status(&cluster);
        if st.pilot.as_ref().is_some_and(|p| p.swaps > 0) {
            let out = crate::cluster::syncopate(&["policy", "status"], &cluster);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("cluster policy `autopilot` 0.1.0"), "{text}");
            assert!(text.contains("swap to adaptive-deadline"), "{text}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no swap by the cluster policy: {:?}", st.pilot);
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, run) = run.finish(Duration::from_secs(300));
    assert!(status.success(), "{}", run.output());
    let report = run.report();
    let pilot = report.pilot.as_ref().expect("the report has the cluster policy's status");
    let done: Vec<(f64, &str)> = pilot
        .log
        .iter()
        .filter(|e| e.what.ends_with(" done"))
        .map(|e| (e.at_ns as f64 / 1e9, e.what.as_str()))
        .collect();
    assert!(!pilot.quarantined, "{:?}", pilot.log);
    assert!(
        done.first().is_some_and(|d| d.1 == "swap to adaptive-deadline done"),
        "off BSP while worker 0 straggles: {:?}",
        pilot.log
    );
    assert!(
        done.iter().skip(1).any(|d| d.1 == "swap to bsp done"),
        "back to BSP once it recovers: {:?}",
        pilot.log
    );
    assert!(report.swaps >= 2, "{}", report.swaps);
    assert!(report.phases.iter().any(|p| p.policy.starts_with("adaptive-deadline")), "{:?}", report.phases);
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!(s.stats.policy_failures, 0, "shard {}", s.shard);
    }
}
