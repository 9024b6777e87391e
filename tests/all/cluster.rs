//! A real cluster: `syncopate local` starts a coordinator, servers and workers as separate
//! processes talking QUIC on loopback. The `counter` workload pushes known values (worker `w`
//! pushes `w + 1` everywhere); with SGD at learning rate 1, no momentum and summed pushes, every
//! parameter ends at exactly minus the sum of everything applied, so a lost or doubled update
//! shows as a wrong number.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

use syncopate::lab::report::RunReport;
use syncopate::net::proto::ClusterStatus;
use syncopate::net::tls::ClusterFile;

use crate::cli::syncopate_bin;

/// Exact counting: lr 1, no momentum, pushes summed.
const EXACT: &[&str] = &["--workload", "counter", "--lr", "1", "--momentum", "0", "--push-weight", "sum"];

pub struct LocalRun {
    pub dir: PathBuf,
    child: Child,
}

pub fn run_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("syncopate-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

impl LocalRun {
    /// `syncopate local` with exact counting (the `counter` workload, lr 1, summed pushes).
    pub fn start(name: &str, args: &[&str]) -> Self {
        Self::start_plain(name, &[EXACT, args].concat())
    }

    /// `syncopate local` with `args` only.
    pub fn start_plain(name: &str, args: &[&str]) -> Self {
        let dir = run_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::fs::File::create(dir.join("local.out")).unwrap();
        let child = Command::new(syncopate_bin())
            .arg("local")
            .arg("--run-dir")
            .arg(&dir)
            .args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("syncopate local starts");
        LocalRun { dir, child }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(self.dir.join("local.out")).unwrap_or_default()
    }

    /// Waits for `cluster.json`, which appears once every process is started.
    pub fn cluster_file(&mut self) -> PathBuf {
        let path = self.dir.join("cluster.json");
        let t = Instant::now();
        while ClusterFile::read(&path).is_err() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("local ended before the cluster was up ({status}):\n{}", self.output());
            }
            assert!(t.elapsed() < Duration::from_secs(60), "no cluster.json after 60 s:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
        path
    }

    /// Waits for the run to end by itself: a hang fails the test instead of blocking it.
    pub fn finish(mut self, within: Duration) -> (ExitStatus, Self) {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self);
            }
            if t.elapsed() > within {
                let _ = self.child.kill();
                panic!("the cluster did not finish within {within:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: no handler runs; the cluster's processes die with it (see
    /// `a_killed_local_takes_its_whole_cluster_with_it`).
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn model(&self) -> Vec<f32> {
        let bytes = std::fs::read(self.dir.join("model.bin")).expect("model.bin written");
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    pub fn report(&self) -> RunReport {
        serde_json::from_slice(&std::fs::read(self.dir.join("report.json")).expect("report.json written"))
            .unwrap()
    }

    /// `policy status` on this run; a failure shows what the run printed and its logs.
    pub fn status(&mut self) -> ClusterStatus {
        let cluster = self.cluster_file();
        let out = syncopate(&["policy", "status", "--json"], &cluster);
        if !out.status.success() {
            let ended = self.child.try_wait().unwrap();
            let logs: Vec<String> = std::fs::read_dir(self.dir.join("logs"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| {
                    format!(
                        "== {}\n{}",
                        e.path().display(),
                        std::fs::read_to_string(e.path()).unwrap_or_default()
                    )
                })
                .collect();
            panic!(
                "status failed: {}\nlocal: {ended:?}\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.output(),
                logs.join("\n")
            );
        }
        serde_json::from_slice(&out.stdout).expect("status JSON")
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("logs").join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for LocalRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn syncopate(args: &[&str], cluster: &Path) -> std::process::Output {
    Command::new(syncopate_bin())
        .args(args)
        .arg("--cluster")
        .arg(cluster)
        .stdin(Stdio::null())
        .output_within(COMMAND_LIMIT)
        .expect("syncopate runs")
}

pub fn status(cluster: &Path) -> ClusterStatus {
    let out = syncopate(&["policy", "status", "--json"], cluster);
    assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("status JSON")
}

/// `syncopate local` with exact counting on 3 workers (pushing 1, 2 and 3), 2 servers and 3
/// shards, 64 parameters, 20 ms per iteration: the failure drills' cluster, with `extra` flags.
pub fn counter_drill(name: &str, policy: &str, iterations: u64, extra: &[&str]) -> LocalRun {
    let iterations = iterations.to_string();
    let base = ["--workers", "3", "--servers", "2", "--shards", "3", "--params", "64", "--delay-ms", "20"];
    let run = ["--iterations", &iterations, "--policy", policy];
    LocalRun::start(name, &[&base[..], &run, extra].concat())
}

/// The pids of a `local` run's processes of `role` (`server`, `coordinator`), found by their
/// command lines, in pid order.
pub fn role_pids(dir: &std::path::Path, role: &str) -> Vec<u32> {
    let tls = dir.join("tls").display().to_string();
    let role = format!(" {role} ");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmd =
            std::fs::read_to_string(entry.path().join("cmdline")).unwrap_or_default().replace('\0', " ");
        if cmd.contains(&role) && cmd.contains(&tls) {
            pids.push(pid);
        }
    }
    pids.sort_unstable();
    pids
}

/// Waits for a process to write `path` (a ready or id file) and returns what it holds, trimmed.
/// Not there within `within` fails the test, with `context()` (a log, say).
pub fn wait_file(path: &Path, within: Duration, context: impl Fn() -> String) -> String {
    let t = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) if !text.trim().is_empty() => return text.trim().to_string(),
            _ => {}
        }
        assert!(t.elapsed() < within, "no {} within {within:?}: {}", path.display(), context());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit and returns how. Still running after `within` fails the test, with
/// `context()`.
pub fn wait_exit(child: &mut Child, within: Duration, context: impl Fn() -> String) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(t.elapsed() < within, "still running after {within:?}: {}", context());
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn assert_all(model: &[f32], expected: f32, what: &str) {
    assert!(!model.is_empty());
    for (i, v) in model.iter().enumerate() {
        assert_eq!(*v, expected, "{what}: parameter {i} is {v}, expected {expected}");
    }
}

/// The optimizer on the workers, on a real cluster: each worker pushes its velocity, the servers
/// run plain SGD, and every parameter ends where the arithmetic says, exactly.
#[test]
fn with_the_optimizer_on_the_workers_each_pushes_its_velocity_and_the_servers_add_them() {
    let run = LocalRun::start_plain(
        "momentum-on-workers",
        &[
            "--workload",
            "counter",
            "--lr",
            "1",
            "--push-weight",
            "sum",
            "--momentum",
            "0.5",
            "--optimizer-on",
            "worker",
            "--workers",
            "2",
            "--servers",
            "2",
            "--iterations",
            "10",
            "--params",
            "10",
            "--policy",
            "ssp:s=1",
        ],
    );
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    // Worker w's gradient is always w + 1, so at iteration k its velocity is (w + 1)(2 - 2^-k):
    // over 10 iterations (w + 1)(18 + 2^-9), both workers 3 (18 + 2^-9). Dyadic: exact in f32.
    // With momentum on the servers instead, every shard would fold both workers' gradients into
    // one velocity, and the same pushes would sum to something else whenever they interleave.
    assert_all(&run.model(), -3.0 * (18.0 + 1.0 / 512.0), "velocities summed");
}

#[test]
fn bsp_then_ssp_clusters_apply_every_push_exactly_once() {
    for (name, policy) in [("bsp", "bsp"), ("ssp", "ssp:s=2")] {
        let run = LocalRun::start(
            &format!("exact-{name}"),
            &[
                "--workers",
                "3",
                "--servers",
                "2",
                "--shards",
                "3",
                "--iterations",
                "30",
                "--params",
                "100",
                "--policy",
                policy,
            ],
        );
        let (status, run) = run.finish(Duration::from_secs(120));
        assert!(status.success(), "{name}: {}", run.output());
        // Workers 0, 1, 2 push 1, 2, 3 for 30 iterations each.
        assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 30.0, name);
        let report = run.report();
        assert!(report.failed_workers.is_empty());
        assert_eq!(report.workers.len(), 3);
        assert!(report.workers.iter().all(|w| w.start == 0 && w.iterations == 30), "all start together");
        let shards: Vec<_> = report.servers.iter().flat_map(|s| &s.shards).collect();
        assert_eq!(shards.len(), 3, "3 shards over 2 servers");
        for s in shards {
            assert_eq!(s.stats.pushes_admitted, 90, "{name}: shard {}", s.shard);
            assert_eq!(s.stats.pulls_served, 90);
            assert_eq!(s.policy, format!("{} 0.1.0", &policy[..3]));
        }
        // The report's shard split covers the model exactly once.
        assert_eq!(report.model_len, 100);
    }
}

#[test]
fn epsp_moves_a_stragglers_tasks_and_every_iteration_counts_exactly_once() {
    let run = LocalRun::start(
        "epsp-moves",
        &[
            "--workers",
            "4",
            "--servers",
            "2",
            "--shards",
            "3",
            "--iterations",
            "30",
            "--params",
            "100",
            "--delay-ms",
            "20",
            "--slow",
            "0:3",
            "--policy",
            "epsp:elastic=false,tasks=8",
        ],
    );
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    // Worker w's iterations push w + 1 whoever computed their tasks: each of the 30 iterations
    // of each worker reaches the model exactly once, whole.
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0 + 4.0) * 30.0, "epsp");
    let report = run.report();
    let given: u64 = report.workers.iter().map(|w| w.tasks_given).sum();
    let helped: u64 = report.workers.iter().map(|w| w.tasks_helped).sum();
    let straggler = report.workers.iter().find(|w| w.worker == 0).expect("worker 0 finished");
    assert!(straggler.tasks_given > 0, "the 3x slower worker was helped: {report:?}");
    // EPSP helps whichever worker is slowest at the moment: on a loaded machine a fast worker
    // is now and then, and gives a few tasks too. Most moved tasks are the straggler's.
    assert!(
        straggler.tasks_given * 4 >= given * 3,
        "the straggler gave most: {given} moved in all, {straggler:?}"
    );
    assert_eq!(helped, given, "every moved task was computed exactly once");
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!(s.stats.pushes_admitted, 120, "shard {}: one push per worker iteration", s.shard);
        assert_eq!(s.stats.policy_failures, 0);
    }
}

#[test]
fn a_users_policy_module_uses_every_host_mechanism() {
    // `policies/example-deadline`, built to wasm by tests/build.rs and loaded from its file.
    let policy = format!("{}:s=3,deadline_ms=10,tasks=8", env!("SYNCOPATE_EXAMPLE_WASM"));
    let recording = run_dir("example-deadline-recording");
    let run = LocalRun::start(
        "example-deadline",
        &[
            "--workers",
            "4",
            "--servers",
            "2",
            "--shards",
            "2",
            "--iterations",
            "30",
            "--params",
            "64",
            "--delay-ms",
            "20",
            "--slow",
            "0:3",
            "--policy",
            &policy,
            "--shard-config",
            "0:s=0",
            "--record",
            recording.to_str().expect("a UTF-8 path"),
        ],
    );
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0 + 4.0) * 30.0, "deadline");
    let report = run.report();
    let shard = |i| report.servers.iter().flat_map(|s| &s.shards).find(|s| s.shard == i).expect("shard");
    let (strict, loose) = (shard(0), shard(1));
    for s in [strict, loose] {
        assert_eq!(s.policy, "deadline 0.1.0");
        assert_eq!(s.stats.policy_failures, 0);
    }
    // Per-shard configuration: shard 0 bounds staleness at 0, shard 1 at 3.
    assert!(strict.config.contains(&("s".into(), "0".into())), "{:?}", strict.config);
    assert!(loose.config.contains(&("s".into(), "3".into())), "{:?}", loose.config);
    assert!(strict.stats.pushes_held > loose.stats.pushes_held, "push admission holds more at s = 0");
    assert!(strict.held_ns > 0, "the holds took time (the metrics' held seconds)");
    let given: u64 = report.workers.iter().map(|w| w.tasks_given).sum();
    let helped: u64 = report.workers.iter().map(|w| w.tasks_helped).sum();
    assert!(given > 0, "the deadline timer moved the straggler's tasks");
    assert_eq!(helped, given, "each moved task computed exactly once");
    let straggler = report.workers.iter().find(|w| w.worker == 0).expect("worker 0");
    // Its task split, batch-size changes and hand-overs all came over the control channel.
    assert!(straggler.controls >= 3, "controls received: {}", straggler.controls);
    replays_exactly_and_reports_another_policys_differences(&recording);
    let _ = std::fs::remove_dir_all(&recording);
}

/// The run's recording (every shard's policy events), replayed offline through the module that
/// made it, gives back exactly its decisions (timers, holds, controls and per-shard
/// configuration included); through ASP, the differences.
fn replays_exactly_and_reports_another_policys_differences(recording: &Path) {
    let replay = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = Command::new(syncopate_bin())
            .args(["policy", "replay", "--json"])
            .arg(recording)
            .args(args)
            .output_within(COMMAND_LIMIT)
            .expect("syncopate runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let same = replay(&[]);
    assert_eq!(same.len(), 2, "one recording per shard");
    for r in &same {
        assert!(r["events"].as_u64().unwrap() > 100, "{r}");
        assert_eq!(r["compared"], r["events"], "every event answered, timers included: {r}");
        assert_eq!(r["identical"], r["compared"], "the same decisions, byte for byte: {r}");
        assert_eq!(r["differing"], 0, "{r}");
        assert_eq!(r["recorded"], r["replayed"], "{r}");
        assert!(r["stopped"].is_null(), "{r}");
    }
    let strict = &same[0]["recorded"];
    assert!(
        strict["pushes_held"].as_u64().unwrap() > 0 && strict["controls"].as_u64().unwrap() > 0,
        "{strict}"
    );
    assert!(same[0]["recorded_policies"][0].as_str().unwrap().contains("s=0"), "shard 0's own configuration");

    let asp = replay(&["--policy", "asp", "--shard", "0"]);
    assert_eq!(asp.len(), 1);
    let r = &asp[0];
    assert!(r["differing"].as_u64().unwrap() > 0 && r["differences"].as_array().unwrap().len() <= 20, "{r}");
    assert_eq!(r["replayed"]["pulls_deferred"], 0, "ASP defers nothing: {r}");
    assert_eq!(r["replayed"]["pushes_held"], 0, "{r}");
    assert_eq!(
        r["recorded"], same[0]["recorded"],
        "the recorded side does not depend on the replayed module"
    );
    assert!(r["identical"].as_u64().unwrap() < r["compared"].as_u64().unwrap(), "{r}");

    // Issue 50: `policy check --recording` runs a module through the recorded run too; ASP takes
    // every event, a module that panics on its 40th fails the check, naming it.
    let check = |spec: &str| {
        Command::new(syncopate_bin())
            .args(["policy", "check", spec, "--cases", "4", "--long-cases", "0", "--recording"])
            .arg(recording)
            .output_within(COMMAND_LIMIT)
            .expect("syncopate runs")
    };
    let out = check("asp");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("recording:   shard 0") && said.contains("recording:   shard 1"), "{said}");
    let out = check(&format!("{}:mode=push:panic,after=40", env!("SYNCOPATE_HOSTILE_WASM")));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("fails on the recorded run") && err.contains("panics on purpose"), "{err}");
}

#[test]
fn hot_swap_bsp_to_ssp_to_asp_during_a_run_loses_nothing() {
    let recording = run_dir("swap-recording");
    let mut run = LocalRun::start(
        "swap",
        &[
            "--workers",
            "3",
            "--servers",
            "2",
            "--iterations",
            "200",
            "--delay-ms",
            "25",
            "--params",
            "64",
            "--record",
            recording.to_str().expect("a UTF-8 path"),
        ],
    );
    let cluster = run.cluster_file();
    // SSP with s=2 everywhere but shard 1, which gets s=4; then ASP.
    for (args, label) in
        [(&["ssp:s=2", "--shard-config", "1:s=4"][..], "ssp 0.1.0"), (&["asp"][..], "asp 0.1.0")]
    {
        std::thread::sleep(Duration::from_millis(500));
        let out = syncopate(&[&["policy", "swap", "--watch-s", "0.3"][..], args].concat(), &cluster);
        assert!(out.status.success(), "swap to {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("no failures"), "the swap was watched: {said}");
        let st = status(&cluster);
        assert!(st.servers.iter().flat_map(|s| &s.shards).all(|s| s.policy == label), "{st:?}");
        if label.starts_with("ssp") {
            for s in st.servers.iter().flat_map(|s| &s.shards) {
                let want = if s.shard == 1 { "4" } else { "2" };
                assert_eq!(s.config, vec![("s".to_string(), want.to_string())], "shard {}", s.shard);
            }
        }
        // The swap happened while training: nobody had finished yet.
        assert!(st.workers.iter().all(|w| w.connected && !w.finished), "run ended before the swap: {st:?}");
    }
    // A module no server can start is refused everywhere, and the cluster keeps its policy.
    let out = syncopate(&["policy", "swap", "ssp:no_such_param=1"], &cluster);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no server switched") && err.contains("no_such_param"), "{err}");
    assert_eq!(status(&cluster).policy, "builtin:asp");

    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 200.0, "after two swaps");
    // Issue 37: the replay follows the recording's swaps through the recorded modules, each
    // policy taking over the last one's state as on the cluster, and is exact.
    let out = Command::new(syncopate_bin())
        .args(["policy", "replay", "--json"])
        .arg(&recording)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("replay JSON");
    assert_eq!(reports.len(), 2, "one recording per shard");
    for r in &reports {
        assert_eq!(r["recorded_policies"].as_array().map(Vec::len), Some(3), "bsp, then ssp, then asp: {r}");
        assert!(r["replayed_policy"].as_str().unwrap().contains(", then policy `asp`"), "{r}");
        assert_eq!(r["identical"], r["compared"], "the same decisions, byte for byte, across the swaps: {r}");
        assert!(r["stopped"].is_null(), "{r}");
    }
    let _ = std::fs::remove_dir_all(&recording);
    let report = run.report();
    assert_eq!(report.swaps, 2);
    for s in report.servers.iter().flat_map(|s| &s.shards) {
        assert_eq!(s.stats.swaps, 2);
        assert_eq!(s.stats.pushes_admitted, 600);
    }
}

#[test]
fn a_swap_to_a_module_failing_on_every_push_exits_non_zero_and_rolls_back_on_request() {
    let mut run = LocalRun::start(
        "swap-bad",
        &["--workers", "2", "--servers", "1", "--iterations", "300", "--delay-ms", "10", "--params", "16"],
    );
    let cluster = run.cluster_file();
    std::thread::sleep(Duration::from_millis(300));
    let bad = format!("{}:mode=push:panic", env!("SYNCOPATE_HOSTILE_WASM"));
    // Checked first, the module is refused before it reaches the cluster.
    let out = syncopate(&["policy", "swap", &bad, "--watch-s", "1"], &cluster);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "nothing was swapped: {err}");
    assert!(err.contains("not swapped in") && err.contains("panics on purpose"), "{err}");
    assert_eq!(status(&cluster).policy, "builtin:bsp");
    let out = syncopate(&["policy", "swap", &bad, "--watch-s", "1", "--no-check"], &cluster);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "swapped in, then failed: {err}");
    assert!(err.contains("panics on purpose") && err.contains("quarantined on shards 0"), "{err}");
    assert!(status(&cluster).servers[0].shards[0].quarantined);
    let out = syncopate(&["policy", "swap", "ssp:s=2", "--watch-s", "0"], &cluster);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = syncopate(&["policy", "swap", &bad, "--watch-s", "1", "--rollback", "--no-check"], &cluster);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rolled back") && err.contains("builtin:ssp"), "{err}");
    let st = status(&cluster);
    assert_eq!(st.policy, "builtin:ssp");
    assert!(st.servers[0].shards.iter().all(|s| !s.quarantined && s.policy == "ssp 0.1.0"), "{st:?}");
    assert!(st.workers.iter().all(|w| !w.finished), "all of it happened during training: {st:?}");
    // The failing pushes were admitted by the fallback rule: nothing was lost or doubled.
    let (code, run) = run.finish(Duration::from_secs(120));
    assert!(code.success(), "{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0) * 300.0, "after a quarantine and a rollback");
}

#[test]
fn a_swap_from_asp_to_bsp_after_drift_levels_the_clocks_and_nobody_waits_for_a_replay() {
    let mut run = LocalRun::start(
        "swap-drift",
        &[
            "--workers",
            "3",
            "--servers",
            "1",
            "--policy",
            "asp",
            "--slow",
            "0:4",
            "--delay-ms",
            "10",
            "--iterations",
            "300",
            "--params",
            "16",
            "--eval-every-ms",
            "100",
        ],
    );
    let cluster = run.cluster_file();
    // Until ASP has let the clocks drift apart (on a busy machine the start takes a while).
    let t = Instant::now();
    let clocks: Vec<u64> = loop {
        let before = status(&cluster);
        let shard = before.servers.first().and_then(|s| s.shards.first());
        let clocks: Vec<u64> = shard.map(|s| s.workers.iter().map(|w| w.clock).collect()).unwrap_or_default();
        let spread = clocks.iter().max().unwrap_or(&0) - clocks.iter().min().unwrap_or(&0);
        if clocks.len() == 3 && spread >= 20 {
            break clocks;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "ASP let the clocks drift apart: {clocks:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = syncopate(&["policy", "swap", "bsp", "--watch-s", "0"], &cluster);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (code, run) = run.finish(Duration::from_secs(120));
    assert!(code.success(), "{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 300.0, "across the swap");
    let report = run.report();
    let drift = clocks.iter().max().unwrap() - clocks.iter().min().unwrap();
    assert!(drift >= 20, "ASP let the clocks drift apart before the swap: {clocks:?}");
    let policies: Vec<&str> = report.phases.iter().map(|p| p.policy.as_str()).collect();
    assert_eq!(policies, ["asp 0.1.0", "bsp 0.1.0"], "{:?}", report.phases);
    assert!(report.shards().all(|s| s.stats.clocks_rebased >= 1), "the laggard's clock was raised");
    // No fast worker ever waits in a pull for longer than a few of the slow worker's 40 ms
    // iterations, the swap included; replaying the drift would take drift x 40 ms.
    let swap_s = report.phases[1].from_s;
    for w in report.workers.iter().filter(|w| w.worker != 0) {
        let after: Vec<f32> = w
            .timeline
            .iter()
            .filter(|(s, wait, _)| s - report.started_unix_s + f64::from(*wait) > swap_s)
            .map(|(_, wait, _)| *wait)
            .collect();
        assert!(after.len() >= 10, "worker {} ran under BSP: {after:?}", w.worker);
        let longest = after.iter().copied().fold(0.0f32, f32::max);
        assert!(
            longest < 0.6,
            "worker {}: a pull waited {longest:.2} s under BSP (a replay of {drift} iterations would be {:.1} s)",
            w.worker,
            drift as f64 * 0.04
        );
    }
    let deferred = std::fs::read_to_string(run.dir.join("deferred.svg")).unwrap();
    assert!(deferred.contains("swap to bsp"), "the swap is marked on the plot");
    assert!(run.output().contains("phase:"), "the summary lists the phases:\n{}", run.output());
}

#[test]
fn a_killed_worker_is_dropped_and_bsp_goes_on() {
    let mut run = LocalRun::start(
        "kill",
        &[
            "--workers",
            "3",
            "--servers",
            "2",
            "--iterations",
            "60",
            "--delay-ms",
            "20",
            "--params",
            "32",
            "--peer-timeout-ms",
            "1500",
        ],
    );
    let cluster = run.cluster_file();
    let file = ClusterFile::read(&cluster).unwrap();
    let pid = file.pids.iter().find(|(name, _)| name == "worker-2").expect("worker-2 pid").1;
    let t = Instant::now();
    loop {
        let st = status(&cluster);
        let min_clock =
            st.servers.iter().flat_map(|s| &s.shards).flat_map(|s| &s.workers).map(|w| w.clock).min();
        if min_clock.is_some_and(|c| c >= 5) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no progress: {st:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(killed.success());
    // A worker joins late (as id 3, pushing 4s): it starts with the slowest live worker.
    let late_report = run.dir.join("late-worker.json");
    let late = Command::new(syncopate_bin())
        .args(["worker", "--coordinator", &file.coordinator.to_string(), "--id", "3", "--ca"])
        .arg(&file.ca)
        // It stops at 40, before the others, so it is done before the model is read.
        .args(["--params", "32", "--iterations", "40", "--delay-ms", "20", "--report"])
        .arg(&late_report)
        .env("SYNCOPATE_TOKEN", &file.token)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(late.status.success(), "late worker: {}", String::from_utf8_lossy(&late.stderr));
    let late: syncopate::worker::WorkerReport =
        serde_json::from_slice(&std::fs::read(&late_report).unwrap()).unwrap();
    assert!(late.start >= 5 && late.start + late.iterations == 40, "late joiner: {late:?}");

    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(!status.success(), "local reports the lost worker");
    assert!(run.output().contains("worker 2 killed by signal 9"), "{}", run.output());
    let report = run.report();
    assert_eq!(report.failed_workers.len(), 1);
    assert_eq!(report.workers.len(), 2);
    assert!(report.workers.iter().all(|w| w.iterations == 60), "the survivors finish under BSP");
    let lost = report.members.iter().find(|w| w.worker == 2).unwrap();
    assert!(!lost.connected && !lost.finished);
    // Survivors' pushes all count; the dead worker's count for the iterations it completed.
    let model = run.model();
    let survivors = (1.0 + 2.0) * 60.0 + 4.0 * late.iterations as f32;
    let dead = -model[0] - survivors;
    assert!((3.0 * 5.0..=3.0 * 60.0).contains(&dead) && dead % 3.0 == 0.0, "worker 2 contributed {dead}");
    assert_all(&model, model[0], "every shard agrees");
    let servers = run.log("server-0") + &run.log("server-1");
    assert!(servers.contains("worker lost"), "the servers noticed: {servers}");
}

/// Issue 36: one worker asking for an absurd id (a typo in `--id` or `SYNCOPATE_ID`) once made
/// both replicas of every shard abort on a 64 GB allocation. Now the coordinator refuses it
/// with the reason, nothing else changes, and the replicated run finishes with every push
/// applied once and no server failed over.
#[test]
fn a_worker_asking_for_an_impossible_id_is_refused_and_the_run_goes_on() {
    let mut run = LocalRun::start(
        "bad-id",
        &["--workers", "2", "--servers", "2", "--iterations", "40", "--delay-ms", "20", "--params", "32"],
    );
    let cluster = run.cluster_file();
    let file = ClusterFile::read(&cluster).unwrap();
    let t = Instant::now();
    while run.status().servers.iter().flat_map(|s| &s.shards).flat_map(|s| &s.workers).count() < 2 {
        assert!(t.elapsed() < Duration::from_secs(60), "the workers did not join:\n{}", run.output());
        std::thread::sleep(Duration::from_millis(50));
    }
    for id in ["4000000000", "4096"] {
        let bad = Command::new(syncopate_bin())
            .args(["worker", "--coordinator", &file.coordinator.to_string(), "--id", id, "--ca"])
            .arg(&file.ca)
            .args(["--params", "32", "--iterations", "5"])
            .env("SYNCOPATE_TOKEN", &file.token)
            .output_within(COMMAND_LIMIT)
            .unwrap();
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success(), "worker --id {id} was admitted: {err}");
        assert!(
            err.contains(&format!("worker id {id} is out of range")) && err.contains("--max-workers"),
            "worker --id {id} got a clear error: {err}"
        );
    }
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "the run went on and finished:\n{}", run.output());
    let report = run.report();
    assert!(report.failovers.is_empty(), "no server was failed over: {:?}", report.failovers);
    assert!(report.workers.iter().all(|w| w.iterations == 40));
    assert_all(&run.model(), -(1.0 + 2.0) * 40.0, "every push applied once");
    let servers = run.log("server-0") + &run.log("server-1");
    assert!(!servers.contains("panicked") && !servers.contains("memory allocation"), "{servers}");
}

/// Shuts the cluster at `coordinator` down (token `t0ken`, CA `ca`) and waits for its
/// processes to stop.
fn shut_down(coordinator: &str, ca: &Path, children: [&mut Child; 2]) {
    let out = Command::new(syncopate_bin())
        .args(["shutdown", "--coordinator", coordinator, "--ca", ca.to_str().unwrap()])
        .env("SYNCOPATE_TOKEN", "t0ken")
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for child in children {
        wait_exit(child, Duration::from_secs(15), || "a process did not stop after shutdown".into());
    }
}

/// Start-up never hangs silently: a worker of a cluster whose servers do not all come up is
/// told so after the start-up timeout, and the half-started cluster still shuts down cleanly.
#[test]
fn a_missing_server_gives_workers_a_clear_error() {
    let dir = run_dir("missing-server");
    let tls = dir.join("tls");
    let out = Command::new(syncopate_bin()).arg("certs").arg(&tls).output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success());
    let ready = dir.join("addr");
    let spawn = |args: &[&str]| {
        Command::new(syncopate_bin())
            .args(args)
            .env("SYNCOPATE_TOKEN", "t0ken")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let tls_dir = tls.to_str().unwrap();
    let mut coordinator = spawn(&[
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--servers",
        "2",
        "--startup-timeout-s",
        "1",
        "--tls-dir",
        tls_dir,
        "--ready-file",
        ready.to_str().unwrap(),
    ]);
    let addr = wait_file(&ready, Duration::from_secs(30), || "the coordinator did not start".into());
    // The coordinator by name, as a Kubernetes service is reached: resolved at start.
    let by_name = addr.replace("127.0.0.1", "localhost");
    let mut server = spawn(&["server", "--coordinator", &by_name, "--tls-dir", tls_dir]);
    let ca = tls.join("cert.pem");
    let worker = Command::new(syncopate_bin())
        .args(["worker", "--coordinator", &by_name, "--workload", "counter", "--ca", ca.to_str().unwrap()])
        .env("SYNCOPATE_TOKEN", "t0ken")
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let err = String::from_utf8_lossy(&worker.stderr);
    assert!(!worker.status.success());
    assert!(err.contains("only 1 of 2 servers registered within 1000 ms"), "{err}");
    shut_down(&by_name, &ca, [&mut coordinator, &mut server]);
}

/// The start barrier waits for `--workers`, but not for ever: with one of two workers ready,
/// training starts once the start-up timeout has passed since it was (the coordinator
/// machine's timer), the coordinator says how many it started with, and the worker trains to
/// its end.
#[test]
fn the_start_barrier_starts_without_a_missing_worker_after_the_startup_timeout() {
    let dir = run_dir("start-barrier");
    let tls = dir.join("tls");
    let out = Command::new(syncopate_bin()).arg("certs").arg(&tls).output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success());
    let ready = dir.join("addr");
    let log = dir.join("coordinator.log");
    let tls_dir = tls.to_str().unwrap();
    let spawn = |args: &[&str], err: Stdio| {
        Command::new(syncopate_bin())
            .args(args)
            .env("SYNCOPATE_TOKEN", "t0ken")
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .unwrap()
    };
    let mut coordinator = spawn(
        &[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--servers",
            "1",
            "--workers",
            "2",
            "--startup-timeout-s",
            "2",
            "--tls-dir",
            tls_dir,
            "--ready-file",
            ready.to_str().unwrap(),
        ],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let addr = wait_file(&ready, Duration::from_secs(30), || "the coordinator did not start".into());
    let mut server = spawn(&["server", "--coordinator", &addr, "--tls-dir", tls_dir], Stdio::null());
    let ca = tls.join("cert.pem");
    let t = std::time::Instant::now();
    let worker = Command::new(syncopate_bin())
        .args([
            "worker",
            "--coordinator",
            &addr,
            "--ca",
            ca.to_str().unwrap(),
            "--iterations",
            "5",
            "--params",
            "8",
        ])
        .env("SYNCOPATE_TOKEN", "t0ken")
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(worker.status.success(), "{}", String::from_utf8_lossy(&worker.stderr));
    assert!(t.elapsed() >= Duration::from_secs(2), "it waited for the other worker: {:?}", t.elapsed());
    shut_down(&addr, &ca, [&mut coordinator, &mut server]);
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("only 1 of 2 workers joined within 2s; starting anyway"), "{said}");
}

/// The processes whose parent is `pid` and that have not exited (zombies count as gone).
#[cfg(target_os = "linux")]
fn live_children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // After the command's closing parenthesis: state, then the parent's pid.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
        let mut fields = rest.split_whitespace();
        let (state, ppid) = (fields.next(), fields.next().and_then(|p| p.parse::<u32>().ok()));
        if ppid == Some(pid) && state != Some("Z") && state != Some("X") {
            out.push(child);
        }
    }
    out
}

/// `syncopate local` killed outright (SIGKILL: no handler runs, nothing is dropped) takes its
/// coordinator, servers and workers with it, instead of leaving a half cluster running.
#[cfg(target_os = "linux")]
#[test]
fn a_killed_local_takes_its_whole_cluster_with_it() {
    let mut run =
        LocalRun::start("killed-local", &["--workers", "2", "--iterations", "100000", "--delay-ms", "20"]);
    run.cluster_file();
    let local = run.child.id();
    let children = live_children(local);
    let roles: Vec<String> = children
        .iter()
        .map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " "))
        .collect();
    for role in [" coordinator ", " server ", " worker "] {
        assert!(roles.iter().any(|r| r.contains(role)), "no{role}process among {roles:?}");
    }
    run.child.kill().unwrap();
    run.child.wait().unwrap();
    let t = Instant::now();
    let alive = |pid: &u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !matches!(s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X"))
            })
            .unwrap_or(false)
    };
    while children.iter().any(alive) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "still running after local was killed: {:?}",
            children.iter().filter(|p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What a policy author does first, from a directory outside this repository: `policy new`
/// writes a crate whose native test passes with its pinned lockfile, `policy build` makes a
/// small module and checks it, and `policy swap` hot-loads it into a running cluster.
#[test]
fn a_new_policy_crate_builds_outside_the_repository_and_hot_loads_into_a_cluster() {
    let home = run_dir("policy-new");
    std::fs::create_dir_all(&home).unwrap();
    assert!(!home.starts_with(env!("CARGO_MANIFEST_DIR")), "{} is outside the repository", home.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // As in a user's shell: none of this test run's build settings.
    let clean = |cmd: &mut Command| {
        for var in ["CARGO_TARGET_DIR", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_TARGET"] {
            cmd.env_remove(var);
        }
        cmd.current_dir(&home);
    };
    let mut new = Command::new(syncopate_bin());
    new.args(["policy", "new", "late-ssp"]);
    clean(&mut new);
    let out = new.output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let krate = home.join("late-ssp");
    let lock = std::fs::read_to_string(krate.join("Cargo.lock")).unwrap();
    let mut test = Command::new(&cargo);
    test.args(["test", "--locked", "--quiet", "--manifest-path"]).arg(krate.join("Cargo.toml"));
    clean(&mut test);
    let out = test.output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success(), "the template's native test: {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let mut build = Command::new(syncopate_bin());
    build.args(["policy", "build", "late-ssp", "--config", "s=1"]);
    clean(&mut build);
    let out = build.output_within(COMMAND_LIMIT).unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("name:        late-ssp") && said.contains("exercised:"), "{said}");
    let module =
        said.lines().find_map(|l| l.strip_prefix("load it with: syncopate policy swap ")).expect(&said);
    let size = std::fs::metadata(module).unwrap().len();
    assert!(size <= 64_000, "the template's module is {size} bytes");
    assert_eq!(
        std::fs::read_to_string(krate.join("Cargo.lock")).unwrap(),
        lock,
        "the lockfile pinned everything"
    );

    let mut run = LocalRun::start(
        "policy-new-swap",
        &["--workers", "3", "--servers", "1", "--iterations", "200", "--delay-ms", "10", "--params", "16"],
    );
    let cluster = run.cluster_file();
    std::thread::sleep(Duration::from_millis(300));
    let out = syncopate(&["policy", "swap", &format!("{module}:s=1"), "--watch-s", "0.5"], &cluster);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st = status(&cluster);
    assert!(st.servers[0].shards.iter().all(|s| s.policy == "late-ssp 0.1.0" && !s.quarantined), "{st:?}");
    assert!(st.workers.iter().all(|w| !w.finished), "swapped during training: {st:?}");
    let (code, run) = run.finish(Duration::from_secs(120));
    assert!(code.success(), "{}", run.output());
    assert_all(&run.model(), -(1.0 + 2.0 + 3.0) * 200.0, "under the new policy");
    let _ = std::fs::remove_dir_all(&home);
}

/// A policy's `SkipTo` over the real transport: `backup` with `catch_up` tells the straggler to
/// skip to the open round; it tells every shard (on two servers), and every iteration is pushed
/// once or skipped once, on every shard.
#[test]
fn a_straggler_skips_ahead_on_a_real_cluster_and_every_iteration_counts_once() {
    let policy = format!("{}:b=1,catch_up=true", env!("SYNCOPATE_BACKUP_WASM"));
    let run = LocalRun::start(
        "skip-ahead",
        &[
            "--workers",
            "3",
            "--servers",
            "2",
            "--iterations",
            "60",
            "--delay-ms",
            "5",
            "--slow",
            "2:6",
            "--params",
            "16",
            "--policy",
            &policy,
        ],
    );
    let (code, run) = run.finish(Duration::from_secs(120));
    assert!(code.success(), "{}", run.output());
    let report = run.report();
    let straggler = report.workers.iter().find(|w| w.worker == 2).expect("worker 2");
    assert!(straggler.iterations_skipped > 0, "the straggler skipped ahead: {straggler:?}");
    for w in &report.workers {
        assert_eq!(w.iterations + w.iterations_skipped, 60, "done or skipped, once: {w:?}");
    }
    let pushed: u64 = report.workers.iter().map(|w| w.iterations).sum();
    let skipped: u64 = report.workers.iter().map(|w| w.iterations_skipped).sum();
    for s in report.shards() {
        assert_eq!(s.stats.pushes_admitted + s.stats.pushes_dropped, pushed, "shard {}", s.shard);
        assert_eq!(s.stats.iterations_skipped, skipped, "shard {} moved the clock past each skip", s.shard);
        assert_eq!(s.stats.policy_failures, 0);
    }
}
