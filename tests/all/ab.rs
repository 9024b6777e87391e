//! `syncopate ab`: one scenario under several policies, real clusters, one comparison report.

use std::process::Command;
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

use syncopate::lab::report::Comparison;

use crate::cli::syncopate_bin;
use crate::cluster::run_dir;

fn ab(name: &str, scenario: &str, policies: &str) -> (std::process::Output, std::path::PathBuf) {
    let dir = run_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("scenario.toml");
    std::fs::write(&file, scenario).unwrap();
    let out = Command::new(syncopate_bin())
        .args(["ab", "--scenario"])
        .arg(&file)
        .args(["--policies", policies, "--out"])
        .arg(dir.join("out"))
        .output_within(COMMAND_LIMIT)
        .expect("syncopate ab runs");
    (out, dir.join("out"))
}

#[test]
fn ab_compares_policies_side_by_side_with_a_table_and_plots() {
    let scenario =
        "name = \"tiny\"\ndescription = \"two workers, one slow\"\nworkload = \"fashion-softmax\"\n\
                    workers = 2\nservers = 1\niterations = 60\ntime_limit_s = 60\neval_every_ms = 300\n\
                    [[slow]]\nworker = 0\nfactor = 2.0\n";
    let (out, dir) = ab("ab-tiny", scenario, "bsp,ssp:s=2");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("[1/2] bsp") && stdout.contains("[2/2] ssp:s=2"), "progress: {stdout}");
    let c: Comparison = serde_json::from_slice(&std::fs::read(dir.join("comparison.json")).unwrap()).unwrap();
    let policies: Vec<&str> = c.rows.iter().map(|r| r.policy.as_str()).collect();
    assert_eq!(policies, ["bsp", "ssp:s=2"]);
    for r in &c.rows {
        assert!(r.iterations_per_s > 0.0 && r.bytes_moved > 0, "{r:?}");
        assert!(r.final_accuracy.is_some_and(|a| a > 0.5), "{r:?}");
        assert!(r.run_dir.join("report.json").exists());
    }
    // Each row summarizes its own run's report.
    for r in &c.rows {
        let run: syncopate::lab::report::RunReport =
            serde_json::from_slice(&std::fs::read(r.run_dir.join("report.json")).unwrap()).unwrap();
        assert_eq!(r.deferred_pulls, run.workers.iter().map(|w| w.deferred_pulls).sum::<u64>());
        assert_eq!(r.final_accuracy, run.final_accuracy);
        assert!(run.policy.contains(r.policy.split(':').next().unwrap()), "{}", run.policy);
    }
    let table = std::fs::read_to_string(dir.join("comparison.md")).unwrap();
    assert!(table.contains("| bsp |") && table.contains("| ssp:s=2 |"), "{table}");
    let accuracy = std::fs::read_to_string(dir.join("accuracy.svg")).unwrap();
    for label in ["test accuracy (%)", "wall-clock time", "bsp", "ssp:s=2"] {
        assert!(accuracy.contains(label), "accuracy.svg lacks `{label}`");
    }
    let waits = std::fs::read_to_string(dir.join("waits.svg")).unwrap();
    assert!(waits.contains("share of the run spent waiting"), "waits.svg has a labelled axis");
}

#[test]
fn ab_refuses_bad_scenarios_clearly() {
    let (out, _) = ab("ab-typo", "name = \"t\"\nworkers = 2\niterations = 5\nworkerz = 3\n", "bsp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("scenario.toml") && err.contains("unknown field `workerz`"), "{err}");
    let (out, _) = ab("ab-bw", "name = \"b\"\nworkers = 2\niterations = 5\nbandwidth_mbit = 100.0\n", "bsp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("docs/bandwidth.md"), "{err}");
    let (out, _) = ab("ab-policy", "name = \"p\"\nworkers = 2\niterations = 5\n", "bsp,nosuch");
    assert!(!out.status.success(), "an unknown policy fails the command");
}

/// A failure drill in a scenario (`replicas = 1`, `[kill_server]`): on real clusters the
/// launcher SIGKILLs the server at its time, in the simulator it dies then; either way every
/// policy's run fails over once and ends with exactly the sum of every push.
#[test]
fn ab_runs_a_scenarios_failure_drill_on_real_clusters_and_in_the_simulator() {
    let scenario = "name = \"drill\"\nworkload = \"counter\"\nparams = 16\nworkers = 3\nservers = 2\n\
                    shards = 3\niterations = 150\ncompute_ms = 10\ntime_limit_s = 120\n\
                    eval_every_ms = 200\nlr = 1.0\nmomentum = 0.0\npush_weight = \"sum\"\n\
                    replicas = 1\n[kill_server]\nserver = 0\nat_s = 0.6\n";
    for simulate in [false, true] {
        let dir = run_dir(if simulate { "ab-drill-sim" } else { "ab-drill" });
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("scenario.toml");
        std::fs::write(&file, scenario).unwrap();
        let mut cmd = Command::new(syncopate_bin());
        cmd.args(["ab", "--policies", "bsp,asp", "--scenario"]).arg(&file).arg("--out").arg(dir.join("out"));
        if simulate {
            cmd.arg("--simulate");
        }
        let out = cmd.output_within(COMMAND_LIMIT).expect("syncopate ab runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let c: Comparison =
            serde_json::from_slice(&std::fs::read(dir.join("out").join("comparison.json")).unwrap()).unwrap();
        assert_eq!(c.rows.len(), 2);
        for r in &c.rows {
            let what = format!("{} (simulated: {simulate})", r.policy);
            let run: syncopate::lab::report::RunReport =
                serde_json::from_slice(&std::fs::read(r.run_dir.join("report.json")).unwrap()).unwrap();
            assert_eq!(run.failovers.len(), 1, "{what}: {:?}", run.failovers);
            assert_eq!(run.failovers[0].server, 0, "{what}");
            assert!(run.workers.iter().all(|w| w.iterations == 150), "{what}: {:?}", run.workers);
            let model: Vec<f32> = std::fs::read(r.run_dir.join("model.bin"))
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            crate::cluster::assert_all(&model, -(1.0 + 2.0 + 3.0) * 150.0, &what);
        }
    }
}
