//! `syncopate ab`: one scenario under several policies, real clusters, one comparison report.

use std::process::Command;

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
        .output()
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
