//! A coordinator that dies mid-run: `syncopate local` starts it again at the same address, the
//! servers (which kept their shards) and the workers rejoin it, and it rebuilds the cluster
//! from what the servers hold. With the `counter` workload every parameter must end at exactly
//! minus the sum of every push: a push lost or applied twice across the restart shows.

use std::time::Duration;
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

use crate::cluster::{assert_all, counter_drill, role_pids, wait_exit, wait_file, LocalRun};

/// Workers 0, 1, 2 push 1, 2, 3 for this many iterations each.
const ITERATIONS: u64 = 300;

fn start(name: &str, policy: &str, extra: &[&str]) -> LocalRun {
    counter_drill(name, policy, ITERATIONS, extra)
}

/// Runs to the end and checks the sums, the iterations and that the launcher restarted the
/// coordinator once.
fn finish_exact(run: LocalRun, name: &str) -> LocalRun {
    let (st, run) = run.finish(Duration::from_secs(150));
    assert!(st.success(), "{name}: training goes on after the coordinator's restart:\n{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * ITERATIONS as f32, name);
    let report = run.report();
    assert!(report.failed_workers.is_empty(), "{:?}", report.failed_workers);
    for w in &report.workers {
        assert_eq!(w.iterations, ITERATIONS, "{name}: worker {} ran every iteration", w.worker);
    }
    assert_eq!(report.coordinator_restarts.len(), 1, "{name}: {:?}", report.coordinator_restarts);
    run
}

/// Server `s` (by its log's name) rejoined the restarted coordinator while the workers still
/// trained: before any of them left its shards.
fn rejoined_mid_run(run: &LocalRun, s: u32) {
    let log = run.log(&format!("server-{s}"));
    let rejoined = log.find("rejoined the coordinator");
    let left = log.find("worker left");
    assert!(rejoined.is_some_and(|r| left.is_none_or(|l| r < l)), "server {s} rejoins mid-run:\n{log}");
}

fn killed_coordinator_rebuilds_from_both_servers(name: &str, policy: &str) {
    let run = finish_exact(start(name, policy, &["--kill-coordinator", "2"]), name);
    assert!(run.output().contains("failure drill: killing the coordinator"), "{}", run.output());
    let log = run.log("coordinator-2");
    assert!(
        log.contains("cluster rebuilt from the servers' holdings") && log.contains("rejoined=2"),
        "{log}"
    );
    for s in 0..2 {
        rejoined_mid_run(&run, s);
    }
    // The rebuilt map is the one the cluster started with (shard k on server k % 2), and every
    // primary still streams to its backup.
    let report = run.report();
    let held: Vec<(u32, Vec<u32>)> =
        report.servers.iter().map(|s| (s.server, s.shards.iter().map(|sh| sh.shard).collect())).collect();
    assert_eq!(held, vec![(0, vec![0, 2]), (1, vec![1])], "the rebuilt map");
    for shard in report.shards() {
        let r = shard.replication.expect("a replicated primary says so");
        assert!(!r.backup && r.confirmed.is_some(), "shard {} has its backup: {r:?}", shard.shard);
    }
    assert!(log.contains("promoted=0"), "nothing to promote: every primary came back\n{log}");
    let plot = std::fs::read_to_string(run.dir.join("timeline.svg")).expect("timeline.svg");
    assert!(plot.contains("coordinator restarted"), "the timeline marks the restart");
}

#[test]
fn a_coordinator_killed_under_bsp_is_restarted_and_rebuilt_from_its_servers_with_nothing_lost() {
    killed_coordinator_rebuilds_from_both_servers("restart-bsp", "bsp");
}

#[test]
fn a_coordinator_killed_under_asp_is_restarted_and_rebuilt_from_its_servers_with_nothing_lost() {
    killed_coordinator_rebuilds_from_both_servers("restart-asp", "asp");
}

#[test]
fn without_backups_the_servers_serve_on_while_the_coordinator_restarts() {
    // No leases: the servers notice the coordinator's death only by their connection's peer
    // timeout, and go on serving meanwhile.
    let name = "restart-no-backups";
    let run = finish_exact(
        start(name, "ssp:s=2", &["--replicas", "0", "--peer-timeout-ms", "3000", "--kill-coordinator", "2"]),
        name,
    );
    let log = run.log("coordinator-2");
    assert!(
        log.contains("cluster rebuilt from the servers' holdings") && log.contains("rejoined=2"),
        "{log}"
    );
}

#[test]
fn a_coordinator_killed_after_a_failover_rebuilds_without_the_lost_server() {
    // Server 0 dies first and its shards fail over to server 1; then the coordinator dies. The
    // new one waits for server 0, which never comes, then rebuilds from server 1 alone.
    let name = "restart-after-failover";
    let run = finish_exact(start(name, "bsp", &["--kill-server", "0:1.5", "--kill-coordinator", "4"]), name);
    let log = run.log("coordinator-2");
    assert!(
        log.contains("cluster rebuilt from the servers' holdings") && log.contains("rejoined=1"),
        "{log}"
    );
    assert!(log.contains("server did not rejoin"), "{log}");
    // Ids follow registration, not the process's name: the survivor is whichever rejoined.
    let survivor = (0..2).find(|s| run.log(&format!("server-{s}")).contains("rejoined the coordinator"));
    rejoined_mid_run(&run, survivor.expect("the live server rejoined"));
    let report = run.report();
    let held: usize = report.servers.iter().map(|s| s.shards.len()).sum();
    assert_eq!(held, 3, "every shard on the live server: {:?}", report.servers);
    // The coordinators recorded each promotion's term in the checkpoint directory, for a
    // successor to know a term no surviving server heard of; the dead server's two shards were
    // promoted once each.
    let text =
        std::fs::read_to_string(run.dir.join("checkpoints").join("terms.json")).expect("terms recorded");
    let recorded: serde_json::Value = serde_json::from_str(&text).unwrap();
    let terms: Vec<u64> =
        recorded["terms"].as_array().expect("terms").iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(terms.len(), 3, "{text}");
    assert_eq!(terms.iter().sum::<u64>(), 2, "{text}");
    assert!(!text.contains("admission"), "the admission key stays secret: {text}");
}

#[test]
fn the_policy_and_swap_count_survive_a_coordinator_restart() {
    // The coordinator keeps the policy only in memory; the rebuilt one reads it back from the
    // servers (which hold the module), with the swap count.
    // Killed once the swap is done (not at a set time, which a slow swap could straddle);
    // `local` starts it again as it does any coordinator that dies.
    let name = "restart-swap";
    let mut run = start(name, "bsp", &[]);
    let cluster = run.cluster_file();
    let out = crate::cluster::syncopate(&["policy", "swap", "ssp:s=3", "--watch-s", "0"], &cluster);
    assert!(out.status.success(), "swap: {}", String::from_utf8_lossy(&out.stderr));
    let coordinator = role_pids(&run.dir, "coordinator");
    assert_eq!(coordinator.len(), 1, "one coordinator: {coordinator:?}");
    let coordinator = coordinator[0];
    let killed = std::process::Command::new("kill").args(["-9", &coordinator.to_string()]).status().unwrap();
    assert!(killed.success());
    let run = finish_exact(run, name);
    assert!(
        run.output().contains("the coordinator killed by signal 9; starting it again"),
        "{}",
        run.output()
    );
    let report = run.report();
    assert_eq!(report.swaps, 1, "{report:?}");
    assert!(report.policy.contains("ssp"), "{}", report.policy);
    let shards: Vec<_> = report.servers.iter().flat_map(|s| &s.shards).collect();
    assert!(shards.len() == 3 && shards.iter().all(|s| s.policy == "ssp 0.1.0"), "{shards:?}");
    // The restarted coordinator serves its metrics where the first did (`cluster.json`'s
    // address, which the launcher's last scrape used), with the swap it read back.
    let scraped =
        std::fs::read_to_string(run.dir.join("metrics").join("coordinator.prom")).unwrap_or_default();
    assert!(scraped.lines().any(|l| l == "syncopate_swaps_total 1"), "{scraped}\n{}", run.output());
}

/// A coordinator started again with other settings than the servers were welcomed with is not
/// one they can rejoin: each is refused with what differs and what to do, and stops.
#[test]
fn a_coordinator_restarted_with_other_flags_is_refused_by_the_servers_with_the_reason() {
    use std::process::{Command, Stdio};
    let dir = crate::cluster::run_dir("restart-other-flags");
    std::fs::create_dir_all(&dir).unwrap();
    let bin = crate::cli::syncopate_bin();
    let tls = dir.join("tls");
    assert!(Command::new(&bin).arg("certs").arg(&tls).output_within(COMMAND_LIMIT).unwrap().status.success());
    let token = "restart-other-flags-token";
    let spawn = |name: &str, args: &[&str]| {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        Command::new(&bin)
            .args(args)
            .arg("--tls-dir")
            .arg(&tls)
            .env("SYNCOPATE_TOKEN", token)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap()
    };
    let ready = dir.join("addr");
    let coordinator = |listen: &str, shards: &str| {
        let r = ready.display().to_string();
        spawn(
            "coordinator",
            &["coordinator", "--listen", listen, "--servers", "2", "--shards", shards, "--ready-file", &r],
        )
    };
    let wait_for = |path: &std::path::Path| wait_file(path, Duration::from_secs(60), String::new);
    let mut first = coordinator("127.0.0.1:0", "3");
    let addr = wait_for(&ready);
    let mut servers: Vec<_> = (0..2)
        .map(|s| {
            let id = dir.join(format!("server-{s}.id")).display().to_string();
            spawn(&format!("server-{s}"), &["server", "--coordinator", &addr, "--id-file", &id])
        })
        .collect();
    for s in 0..2 {
        wait_for(&dir.join(format!("server-{s}.id")));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    std::fs::remove_file(&ready).unwrap();
    let mut second = coordinator(&addr, "4");
    for (s, server) in servers.iter_mut().enumerate() {
        let status = wait_exit(server, Duration::from_secs(90), || format!("server {s} did not stop"));
        let log = std::fs::read_to_string(dir.join(format!("server-{s}.log"))).unwrap();
        assert!(!status.success(), "server {s} stops with an error:\n{log}");
        assert!(
            log.contains(
                "would not take this server back: it was started with --shards 3, this coordinator with 4"
            ),
            "server {s} says why:\n{log}"
        );
    }
    // Refusing them left the new coordinator as it was: it did not begin a rebuild.
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap();
    assert!(log.contains("a rejoining server refused") && !log.contains("rebuilding it"), "{log}");
    let _ = second.kill();
    let _ = second.wait();
}
