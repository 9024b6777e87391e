//! Issue 50 on real clusters: no rule can stall a run, and the cluster's record of its policy is
//! always true. The modules that stalled or corrupted runs are rebuilt from the hostile test
//! policy (hold every push, park every pull, fail every 20th or 200th event, refuse the handed-
//! over state), and each is run on a `syncopate local` cluster of separate processes with the
//! `counter` workload, whose exact sums show any push lost or applied twice.

use std::path::Path;
use std::time::{Duration, Instant};

use syncopate::lab::report::RunReport;

use crate::cluster::{assert_all, status, syncopate, LocalRun};

/// The hostile module with `config`.
fn hostile(config: &str) -> String {
    format!("{}:{config}", env!("SYNCOPATE_HOSTILE_WASM"))
}

/// The cluster of these tests: three workers (pushing 1, 2 and 3), two servers, three shards,
/// 16 parameters, 20 ms iterations.
const CLUSTER: [&str; 10] =
    ["--workers", "3", "--servers", "2", "--shards", "3", "--params", "16", "--delay-ms", "20"];

/// [`CLUSTER`] under the hostile module with `config` (unchecked: the point is to run it), and
/// `extra`.
fn start(name: &str, config: &str, iterations: u64, extra: &[&str]) -> LocalRun {
    let (policy, iterations) = (hostile(config), iterations.to_string());
    let run = ["--iterations", &iterations, "--policy", &policy, "--no-check"];
    LocalRun::start(name, &[&CLUSTER[..], &run, extra].concat())
}

/// What the shards' counters say: per shard, (failures, quarantined).
fn shard_failures(report: &RunReport) -> Vec<(u64, bool)> {
    report.shards().map(|s| (s.stats.policy_failures, s.quarantined)).collect()
}

/// Minus what the workers' acknowledged pushes add up to (worker `w` pushes `w + 1`), plus the
/// push a worker gave up at a stop, which its shards applied when it left (the default).
fn expected(report: &RunReport) -> f32 {
    let sum: u64 = report
        .workers
        .iter()
        .map(|w| {
            let given_up = w.abandoned.iter().filter(|a| a.contains("its push")).count() as u64;
            (u64::from(w.worker) + 1) * (w.iterations + given_up)
        })
        .sum();
    -(sum as f32)
}

/// A rule that holds every push, or parks every pull, after a few events: the shards find every
/// worker waiting on it for the no-progress time (2 s here), resolve what it kept waiting by
/// the fallback rules, and quarantine it at the third stall. The run finishes, nothing lost.
#[test]
fn a_rule_that_never_decides_falls_back_within_the_no_progress_time() {
    for mode in ["push:hold", "pull:park"] {
        let t = Instant::now();
        let run = start(
            &format!("never-{}", &mode[..4]),
            &format!("mode={mode},after=30"),
            150,
            &["--no-progress-s", "2"],
        );
        let (st, run) = run.finish(Duration::from_secs(180));
        assert!(st.success(), "{mode}: {}", run.output());
        let report = run.report();
        assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 150.0, mode);
        for (shard, (failures, quarantined)) in shard_failures(&report).into_iter().enumerate() {
            assert!(
                quarantined && failures == 3,
                "{mode}: shard {shard}: {failures} failures, quarantined {quarantined}"
            );
        }
        let last = report.shards().filter_map(|s| s.last_failure.clone()).collect::<Vec<_>>();
        assert!(
            last.iter().all(|f| f.contains("made no progress") && f.contains("for 2.0 s")),
            "{mode}: {last:?}"
        );
        let logs = (0..2).map(|s| run.log(&format!("server-{s}"))).collect::<String>();
        assert!(logs.contains("made no progress"), "{mode}: the servers say so");
        // Three no-progress times and the run's own 150 x 20 ms, with room for a busy machine.
        assert!(t.elapsed() < Duration::from_secs(120), "{mode}: took {:?}", t.elapsed());
    }
}

/// A rule that keeps different workers waiting on different shards: shard `s` parks only
/// worker `s`'s pulls, so no shard has every worker's pull parked, and each sees the others'
/// pulls served. The workers tell the shards that their pulls wait (after a second), so each
/// shard finds every worker waiting: it resolves its parked pull by the fallback rule, and
/// quarantines the rule at its third stall. Before the workers told, this run never ended.
#[test]
fn a_rule_that_parks_different_workers_on_different_shards_falls_back_too() {
    let t = Instant::now();
    let run = start("never-skewed", "mode=pull:park,after=30,skew=1", 150, &["--no-progress-s", "2"]);
    let (st, run) = run.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", run.output());
    let report = run.report();
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 150.0, "skewed");
    for (shard, (failures, quarantined)) in shard_failures(&report).into_iter().enumerate() {
        assert!(
            quarantined && failures == 3,
            "shard {shard}: {failures} failures, quarantined {quarantined}"
        );
    }
    // On shard s, worker s's pull parks and the others' pulls are deferred by the module's BSP
    // behind worker s's missing push: all waited, each on a pull. Which of those pulls waited
    // longest is a race (after a fallback, another worker may reach the barrier before worker s
    // reaches its parked pull; CI saw worker 0's on shard 1), so any worker's pull may be named.
    for shard in report.shards() {
        let last = shard.last_failure.as_deref().unwrap_or_default();
        // The first two stalls restarted the rule from its checkpoint; the third quarantined it
        // (the metrics' `syncopate_policy_restarts_total`).
        assert_eq!(shard.policy_restarts, 2, "shard {}", shard.shard);
        assert!(shard.policy_usage.calls > 0 && shard.policy_usage.fuel > 0, "{:?}", shard.policy_usage);
        let longest_is_a_pull = (0..3).any(|w| last.contains(&format!("longest: worker {w}'s pull")));
        assert!(
            last.contains("all 3 live workers waited") && longest_is_a_pull,
            "shard {}: {last}",
            shard.shard
        );
    }
    assert!(t.elapsed() < Duration::from_secs(120), "took {:?}", t.elapsed());
}

/// `--time-limit-s` ends a run whatever its policy holds or parks, even with the no-progress
/// rule off: the workers give up the pull a policy keeps deferring at once, and their own push
/// 5 s after the stop; what was acknowledged is kept, what was stuck is reported, and a push
/// given up is applied as its worker leaves (the policy did not drop it).
#[test]
fn a_time_limit_ends_the_run_whatever_the_policy_holds() {
    for (mode, gave_up) in [("pull:park", "its pull for iteration"), ("push:hold", "its push of iteration")] {
        let t = Instant::now();
        let extra = ["--no-progress-s", "0", "--time-limit-s", "4"];
        let run = start(&format!("limit-{}", &mode[..4]), &format!("mode={mode},after=30"), 100_000, &extra);
        let (st, run) = run.finish(Duration::from_secs(120));
        assert!(st.success(), "{mode}: {}", run.output());
        assert!(t.elapsed() < Duration::from_secs(60), "{mode}: the limit ended it: {:?}", t.elapsed());
        let report = run.report();
        assert!(report.workers.iter().all(|w| w.stopped_early), "{mode}");
        let stuck: Vec<&String> = report.workers.iter().flat_map(|w| &w.abandoned).collect();
        // What the rule kept waiting (and, held pushes keeping the others' pulls behind BSP's
        // barrier, their pulls too).
        assert!(stuck.iter().any(|a| a.contains(gave_up)), "{mode}: {stuck:?}");
        let known = |a: &&String| a.contains("its pull for iteration") || a.contains("its push of iteration");
        assert!(stuck.iter().all(known), "{mode}: {stuck:?}");
        assert!(run.output().contains(&format!("gave up {gave_up}")), "{mode}: the summary says it");
        assert_all(&run.model(), expected(&report), &format!("{mode}: every acknowledged push, once"));
        assert!(shard_failures(&report).iter().all(|&(f, q)| f == 0 && !q), "{mode}: the rule is off");
    }
}

/// An operator's stop (`syncopate stop`) ends a run whatever its policy parks, as a limit does.
#[test]
fn an_operators_stop_ends_the_run_whatever_the_policy_holds() {
    let mut run = start("operator-stop", "mode=pull:park,after=30", 100_000, &["--no-progress-s", "0"]);
    let cluster = run.cluster_file();
    // Until the rule parks every pull (and training stops moving).
    let t = Instant::now();
    while status(&cluster).servers.iter().flat_map(|s| &s.shards).all(|s| s.parked == 0) {
        assert!(t.elapsed() < Duration::from_secs(60), "no pull parked:\n{}", run.output());
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = syncopate(&["stop"], &cluster);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (st, run) = run.finish(Duration::from_secs(60));
    assert!(st.success(), "{}", run.output());
    let report = run.report();
    assert!(report.workers.iter().any(|w| !w.abandoned.is_empty()), "{:?}", report.workers);
    assert_all(&run.model(), expected(&report), "after an operator's stop");
}

/// A module that panics on every 20th event (or every 200th), behaving in between, is
/// restarted, then backed off, and quarantined at its fifth failure within a minute: the count
/// survives its restarts. The run goes on under the fallback rules, nothing lost.
#[test]
fn a_crash_loop_is_quarantined_on_a_real_cluster() {
    for every in ["20", "200"] {
        let extra = ["--time-limit-s", "25"];
        let run =
            start(&format!("crash-loop-{every}"), &format!("mode=pull:panic,every={every}"), 100_000, &extra);
        let (st, run) = run.finish(Duration::from_secs(120));
        assert!(st.success(), "every {every}: {}", run.output());
        let report = run.report();
        for (shard, (failures, quarantined)) in shard_failures(&report).into_iter().enumerate() {
            assert!(quarantined && failures == 5, "every {every}: shard {shard}: {failures} failures");
        }
        assert_all(&run.model(), expected(&report), &format!("every {every}"));
    }
}

/// The swap watcher judges the new policy by its own record: right after a swap to a failing
/// module, swapping a built-in in exits 0; `--rollback` never returns to a module that failed.
#[test]
fn the_swap_watcher_judges_the_new_policy_alone_and_rollback_skips_failing_ones() {
    let mut run = LocalRun::start(
        "watcher",
        &["--workers", "2", "--servers", "1", "--iterations", "100000", "--delay-ms", "5", "--params", "8"],
    );
    let cluster = run.cluster_file();
    let swap = |args: &[&str]| {
        let out = syncopate(&[&["policy", "swap"][..], args].concat(), &cluster);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let bad = hostile("mode=push:panic");
    let (code, said) = swap(&[&bad, "--no-check", "--watch-s", "2"]);
    assert_eq!(code, Some(2), "swapped in, then failed: {said}");
    // At once: the failing module's failures are not the new policy's.
    let (code, said) = swap(&["asp", "--watch-s", "2"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("no failures"), "{said}");
    // The failing module again, then a rollback: to ASP (no failures), never to the failing one.
    let (code, said) = swap(&[&bad, "--no-check", "--watch-s", "2", "--rollback"]);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("rolled back") && said.contains("to builtin:asp"), "{said}");
    // A failing module swapped in after another failing one rolls back past both.
    let worse = hostile("mode=pull:panic");
    let (code, _) = swap(&[&bad, "--no-check", "--watch-s", "2"]);
    assert_eq!(code, Some(2));
    let (code, said) = swap(&[&worse, "--no-check", "--watch-s", "2", "--rollback"]);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("to builtin:asp"), "the last policy that ran without failures: {said}");
    let st = status(&cluster);
    assert_eq!(st.policy, "builtin:asp");
    assert!(st.servers[0].shards.iter().all(|s| s.policy == "asp 0.1.0" && !s.quarantined), "{st:?}");
    // A token given beside the cluster file is the one used: a wrong one is refused, plainly.
    let out = syncopate(&["policy", "status", "--token", "not-the-token"], &cluster);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("authentication failed"), "{err}");
    run.kill();
}

/// A module that refuses to take over the running policy's state is refused by every server at
/// the swap's preparation: nothing switches, and every record says so: `policy status`, the next
/// checkpoint's manifest, and a cluster resumed from it.
#[test]
fn a_refused_swap_leaves_every_record_on_the_old_policy() {
    let args =
        [&CLUSTER[..], &["--iterations", "400", "--policy", "ssp:s=2", "--checkpoint-every-s", "1"]].concat();
    let mut first = LocalRun::start("refused-1", &args);
    let cluster = first.cluster_file();
    let out = syncopate(&["policy", "swap", &hostile("mode=refuse-state"), "--no-check"], &cluster);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no server switched") && err.contains("cannot take over from `ssp`"), "{err}");
    let st = status(&cluster);
    assert_eq!((st.policy.as_str(), st.swaps), ("builtin:ssp", 0));
    assert!(st.servers.iter().flat_map(|s| &s.shards).all(|s| s.policy == "ssp 0.1.0" && s.stats.swaps == 0));
    // A round taken after the refusal names the old policy.
    let t = Instant::now();
    let manifest = loop {
        if let Some(m) = newest_manifest_after(&first.dir, t) {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no checkpoint round:\n{}", first.output());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(manifest["policy"], "builtin:ssp", "{manifest}");
    assert_eq!(manifest["swaps"], 0, "{manifest}");
    first.kill();
    let dir = first.dir.display().to_string();
    let resumed = LocalRun::start_plain("refused-2", &["--resume", &dir]);
    let (st, resumed) = resumed.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", resumed.output());
    assert_eq!(resumed.report().policy, "builtin:ssp");
    assert_all(&resumed.model(), -(1.0 + 2.0 + 3.0) * 400.0, "resumed on the old policy");
}

/// The manifest of the newest complete round in a run's checkpoints written after `since`.
fn newest_manifest_after(run: &Path, since: Instant) -> Option<serde_json::Value> {
    let age = since.elapsed();
    let mut rounds: Vec<_> =
        std::fs::read_dir(run.join("checkpoints")).ok()?.flatten().map(|e| e.path()).collect();
    rounds.sort();
    let newest = rounds.into_iter().rev().find(|r| r.join("manifest.json").exists())?;
    let written = std::fs::metadata(newest.join("manifest.json")).ok()?.modified().ok()?;
    (written.elapsed().ok()? < age)
        .then(|| serde_json::from_slice(&std::fs::read(newest.join("manifest.json")).ok()?).ok())?
}

/// `local --checkpoint-dir D`, killed, then `local --resume <run>` alone: the run finds its
/// checkpoints in D (its `command.json` says where), continues with the settings it was started
/// with, and its failure drills are not kept for the resumed run. Exact sums across the kill.
#[test]
fn resume_alone_finds_the_checkpoints_wherever_the_run_put_them() {
    let elsewhere = crate::cluster::run_dir("resume-elsewhere-ckpt");
    let d = elsewhere.display().to_string();
    let args = [
        &CLUSTER[..],
        &[
            "--iterations",
            "500",
            "--policy",
            "bsp",
            "--checkpoint-every-s",
            "1",
            "--checkpoint-dir",
            &d,
            "--kill-coordinator",
            "600",
        ],
    ]
    .concat();
    let mut first = LocalRun::start("resume-elsewhere-1", &args);
    first.cluster_file();
    let t = Instant::now();
    while std::fs::read_dir(&elsewhere)
        .map_or(0, |r| r.flatten().filter(|e| e.path().join("manifest.json").exists()).count())
        < 2
    {
        assert!(t.elapsed() < Duration::from_secs(60), "no rounds in {d}:\n{}", first.output());
        std::thread::sleep(Duration::from_millis(100));
    }
    first.kill();
    assert!(!first.dir.join("checkpoints").exists(), "the rounds went to --checkpoint-dir");
    let dir = first.dir.display().to_string();
    let resumed = LocalRun::start_plain("resume-elsewhere-2", &["--resume", &dir]);
    let (st, resumed) = resumed.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", resumed.output());
    assert_all(&resumed.model(), -(1.0 + 2.0 + 3.0) * 500.0, "resumed from --checkpoint-dir");
    let report = resumed.report();
    assert!(
        report.workers.iter().all(|w| w.start > 0 && w.start + w.iterations == 500),
        "{:?}",
        report.workers
    );
    let kept = std::fs::read_to_string(resumed.dir.join("command.json")).unwrap();
    assert!(!kept.contains("--kill-coordinator"), "a drill is not kept for the resumed run: {kept}");
    assert!(kept.contains(&d), "{kept}");
    // `--resume D` alone works too: D keeps how the run was started.
    assert!(elsewhere.join("local.json").exists());
    let _ = std::fs::remove_dir_all(&elsewhere);
}

/// A coordinator that stops answering (frozen: SIGSTOP) is killed and started again by
/// `syncopate local` after 15 s, as one that died is; the servers and workers rejoin it, and
/// the run finishes with every push once.
#[test]
fn a_frozen_coordinator_is_killed_and_started_again() {
    let args = [&CLUSTER[..], &["--iterations", "1500", "--policy", "ssp:s=2"]].concat();
    let mut run = LocalRun::start("frozen-coordinator", &args);
    run.cluster_file();
    let t = Instant::now();
    let pid = loop {
        if let Some(&pid) = crate::cluster::role_pids(&run.dir, "coordinator").first() {
            break pid;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no coordinator process");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: kill(2) on a process of this test's own run.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
    let (st, run) = run.finish(Duration::from_secs(240));
    assert!(st.success(), "{}", run.output());
    assert!(run.output().contains("the coordinator has not answered for"), "{}", run.output());
    assert!(!run.report().coordinator_restarts.is_empty());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 1500.0, "across a frozen coordinator");
}

/// `policy swap` whose watch outlives the run: the swap went through, so it exits 0 and says
/// the cluster stopped answering, rather than failing to connect.
#[test]
fn a_swap_watched_past_the_end_of_the_run_exits_0() {
    let args =
        ["--workers", "2", "--servers", "1", "--params", "8", "--delay-ms", "10", "--iterations", "150"];
    let mut run = LocalRun::start("watch-past-end", &args);
    let cluster = run.cluster_file();
    let out = syncopate(&["policy", "swap", "asp", "--watch-s", "60"], &cluster);
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("is in force") && said.contains("stopped answering"), "{said}");
    let (st, run) = run.finish(Duration::from_secs(120));
    assert!(st.success(), "{}", run.output());
    assert_eq!(run.report().policy, "builtin:asp");
}
