//! Checkpoints and resume on a real cluster: `syncopate local` writes checkpoint rounds while it
//! trains, the whole cluster is killed outright (SIGKILL, no handler runs), and `--resume`
//! finishes the run. With the `counter` workload every parameter must end at exactly minus the
//! sum of every push of the whole run: an iteration lost in the crash, or applied both before
//! it and again after the resume, shows as a wrong number.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cluster::{assert_all, status, syncopate, LocalRun};

/// Workers 0, 1, 2 push 1, 2, 3 for this many iterations each.
const ITERATIONS: u64 = 600;

fn args<'a>(policy: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--workers",
        "3",
        "--servers",
        "2",
        "--shards",
        "3",
        "--iterations",
        "600",
        "--params",
        "64",
        "--delay-ms",
        "20",
        "--checkpoint-every-s",
        "1",
        "--policy",
        policy,
    ];
    a.extend_from_slice(extra);
    a
}

/// The complete rounds in a run's checkpoint directory, newest first.
fn complete_rounds(run: &Path) -> Vec<PathBuf> {
    let mut rounds: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").exists())
        .collect();
    rounds.sort();
    rounds.reverse();
    rounds
}

/// Waits until `n` rounds are complete, so the kill lands mid-run with checkpoints on disk.
fn wait_for_rounds(run: &mut LocalRun, n: usize) {
    let t = Instant::now();
    while complete_rounds(&run.dir).len() < n {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no {n} checkpoint rounds after 60 s:\n{}",
            run.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the first run once it has checkpointed, resumes it, and checks the sum. Returns the
/// resumed run.
fn kill_and_resume(name: &str, policy: &str, before_kill: impl FnOnce(&mut LocalRun)) -> LocalRun {
    let mut first = LocalRun::start(&format!("{name}-1"), &args(policy, &[]));
    first.cluster_file();
    before_kill(&mut first);
    wait_for_rounds(&mut first, 2);
    first.kill();
    assert!(!first.dir.join("model.bin").exists(), "the first run was killed before it finished");
    let dir = first.dir.display().to_string();
    let resumed = LocalRun::start(&format!("{name}-2"), &args(policy, &["--resume", &dir]));
    let (st, resumed) = resumed.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", resumed.output());
    assert_all(&resumed.model(), -(1.0 + 2.0 + 3.0) * ITERATIONS as f32, &format!("{name}: resumed"));
    let report = resumed.report();
    assert!(report.failed_workers.is_empty(), "{:?}", report.failed_workers);
    for w in &report.workers {
        assert!(w.start > 0 && w.start < ITERATIONS, "worker {} resumed mid-run, at {}", w.worker, w.start);
        assert_eq!(w.start + w.iterations, ITERATIONS, "worker {} finished the run", w.worker);
    }
    resumed
}

#[test]
fn a_killed_bsp_cluster_resumes_from_its_checkpoint_and_every_push_counts_once() {
    kill_and_resume("resume-bsp", "bsp", |_| {});
}

#[test]
fn a_killed_ssp_cluster_resumes_from_its_checkpoint_and_every_push_counts_once() {
    kill_and_resume("resume-ssp", "ssp:s=3", |_| {});
}

/// A swap to ASP during the first run: the checkpoint keeps the policy that ran (the resumed
/// cluster runs ASP, whatever `--policy` says), and nothing is lost across swap and crash.
#[test]
fn a_cluster_killed_after_a_hot_swap_resumes_with_the_swapped_policy() {
    let resumed = kill_and_resume("resume-swap", "bsp", |run| {
        let cluster = run.cluster_file();
        std::thread::sleep(Duration::from_millis(1500));
        let out = syncopate(&["policy", "swap", "asp", "--watch-s", "0"], &cluster);
        assert!(out.status.success(), "swap: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(status(&cluster).policy, "builtin:asp");
        // The next rounds are taken under ASP (only the two newest are kept, so wait for a
        // round newer than the newest now).
        let newest = complete_rounds(&run.dir).first().cloned();
        let t = Instant::now();
        while complete_rounds(&run.dir).first() <= newest.as_ref() {
            assert!(t.elapsed() < Duration::from_secs(60), "no round after the swap:\n{}", run.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let report = resumed.report();
    assert_eq!(report.policy, "builtin:asp", "the resumed cluster runs the policy swapped in");
}

/// A torn newest round (a shard file cut short, as a crash mid-write would leave it without
/// the rename) is reported by name and the round before it is used.
#[test]
fn a_torn_checkpoint_is_reported_and_the_previous_round_used() {
    let mut first = LocalRun::start("resume-torn-1", &args("asp", &[]));
    first.cluster_file();
    wait_for_rounds(&mut first, 2);
    first.kill();
    let rounds = complete_rounds(&first.dir);
    let torn = rounds[0].join("shard-1.snap");
    let bytes = std::fs::read(&torn).unwrap();
    std::fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
    let dir = first.dir.display().to_string();
    let resumed = LocalRun::start("resume-torn-2", &args("asp", &["--resume", &dir]));
    let (st, resumed) = resumed.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", resumed.output());
    let log = resumed.log("coordinator");
    let name = rounds[0].file_name().unwrap().to_string_lossy().into_owned();
    let round: u64 = name.trim_start_matches("ckpt-").parse().unwrap();
    assert!(
        log.contains(&format!("checkpoint round {round} cannot be used")) && log.contains("torn snapshot"),
        "the torn round is named with the reason:\n{log}"
    );
    assert!(
        log.contains(&format!("round={}", round - 1)) || log.contains(&format!("round {}", round - 1)),
        "{log}"
    );
    assert_all(&resumed.model(), -(1.0 + 2.0 + 3.0) * ITERATIONS as f32, "resumed from the older round");
}

/// Nothing to resume from: a clear error, before any process starts.
#[test]
fn resume_from_a_directory_without_checkpoints_says_so() {
    let empty = crate::cluster::run_dir("resume-empty");
    std::fs::create_dir_all(&empty).unwrap();
    let dir = empty.display().to_string();
    let run = LocalRun::start("resume-empty-run", &args("bsp", &["--resume", &dir]));
    let (st, run) = run.finish(Duration::from_secs(60));
    assert!(!st.success());
    assert!(run.output().contains("no usable checkpoint"), "{}", run.output());
}

/// Issue 37: `--resume <run>` alone continues the run as it was started (the `command.json` it
/// wrote): its workers, policy, workload, budget and seeds. A flag that would change the run is
/// refused before anything starts; one a run may change (its time limit) is taken.
#[test]
fn resume_alone_continues_the_run_as_it_was_started() {
    let mut first = LocalRun::start("resume-alone-1", &args("ssp:s=3", &[]));
    first.cluster_file();
    wait_for_rounds(&mut first, 2);
    first.kill();
    let dir = first.dir.display().to_string();
    let bad = LocalRun::start_plain("resume-alone-bad", &["--resume", &dir, "--workers", "4"]);
    let (st, bad) = bad.finish(Duration::from_secs(60));
    assert!(!st.success());
    assert!(bad.output().contains("--workers 4 would change it (it had --workers 3)"), "{}", bad.output());
    let resumed = LocalRun::start_plain("resume-alone-2", &["--resume", &dir, "--time-limit-s", "300"]);
    let (st, resumed) = resumed.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", resumed.output());
    assert_all(
        &resumed.model(),
        -(1.0 + 2.0 + 3.0) * ITERATIONS as f32,
        "resumed with the run's own settings",
    );
    let report = resumed.report();
    assert_eq!(report.workers.len(), 3, "the run's three workers, not the default four");
    assert_eq!(report.policy, "builtin:ssp");
    for w in &report.workers {
        assert!(
            w.start > 0 && w.start + w.iterations == ITERATIONS,
            "worker {}: the run's budget: {w:?}",
            w.worker
        );
    }
    // The resumed run keeps what it was started with, for a resume of its own.
    let kept = std::fs::read_to_string(resumed.dir.join("command.json")).unwrap();
    assert!(
        kept.contains("\"--workers\"") && kept.contains("\"300\"") && !kept.contains("--resume"),
        "{kept}"
    );
}
