//! The `syncopate` binary, run as a real process.

use std::path::PathBuf;
use std::process::Command;
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

/// The `syncopate` binary, which cargo builds before this target and names here.
pub fn syncopate_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_syncopate"))
}

fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("syncopate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn policy_check_describes_a_good_module() {
    let path = write_temp("ssp.wasm", syncopate::builtin::wasm("ssp").unwrap());
    let out = Command::new(syncopate_bin())
        .args(["policy", "check"])
        .arg(&path)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for needle in [
        "name:        ssp",
        "abi:         v3",
        "version:     0.1.0",
        "s          uint   default 3",
        "sha256:",
    ] {
        assert!(stdout.contains(needle), "missing `{needle}` in:\n{stdout}");
    }
}

#[test]
fn policy_check_rejects_bad_modules_with_one_line_and_status_1() {
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("junk.wasm", b"\x00\x01garbage".to_vec(), "not a WebAssembly module"),
        (
            "wasi.wasm",
            wat::parse_str(r#"(module (import "wasi_snapshot_preview1" "proc_exit" (func (param i32))))"#)
                .unwrap(),
            "imports `wasi_snapshot_preview1::proc_exit`",
        ),
        ("hostile-config.wasm", syncopate_suite::hostile_wasm(), "parameter `after` must be a uint"),
    ];
    for (name, bytes, says) in cases {
        let path = write_temp(name, &bytes);
        let mut cmd = Command::new(syncopate_bin());
        cmd.args(["policy", "check"]).arg(&path);
        if name == "hostile-config.wasm" {
            cmd.args(["--config", "after=soon"]);
        }
        let out = cmd.output_within(COMMAND_LIMIT).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{name}: one line: {stderr}");
        assert!(stderr.contains(says), "{name}: {stderr}");
    }
    let out = Command::new(syncopate_bin())
        .args(["policy", "check", "/nonexistent/p.wasm"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the file"));
}

/// A module built by the SDK of ABI v2 is checked as it is, and says so.
#[test]
fn policy_check_passes_a_module_built_for_abi_v2() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/abi-v2/diloco.wasm");
    let out = Command::new(syncopate_bin())
        .args(["policy", "check"])
        .arg(&path)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("abi:         v2 (built by an earlier SDK: loaded as it was)"), "{stdout}");
    assert!(stdout.contains("exercised:   68 generated cases"), "{stdout}");
}

#[test]
fn policy_check_runs_events_through_the_module() {
    // Every built-in and three examples get through the short run: joins, pulls, pushes, reports,
    // timers, a hand-over to themselves and leaves.
    let mut modules: Vec<(String, std::path::PathBuf)> = syncopate::builtin::names()
        .map(|n| (n.to_string(), write_temp(&format!("{n}.wasm"), syncopate::builtin::wasm(n).unwrap())))
        .collect();
    assert_eq!(modules.len(), 15, "every built-in");
    modules.push(("backup".into(), env!("SYNCOPATE_BACKUP_WASM").into()));
    modules.push(("clip".into(), env!("SYNCOPATE_CLIP_WASM").into()));
    modules.push(("deadline".into(), env!("SYNCOPATE_EXAMPLE_WASM").into()));
    for (name, path) in &modules {
        let out = Command::new(syncopate_bin())
            .args(["policy", "check"])
            .arg(path)
            .output_within(COMMAND_LIMIT)
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("exercised:   68 generated cases (4 long)"), "{name}: {stdout}");
    }
    // A module that loads and starts but panics on its first push fails the check, by name.
    let out = Command::new(syncopate_bin())
        .args(["policy", "check", env!("SYNCOPATE_HOSTILE_WASM"), "--config", "mode=push:panic"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("breaks a rule") && stderr.contains("panics on purpose"), "{stderr}");
}

/// Issue 37: `policy check` explores generated event sequences and reports the first that
/// breaks a rule, shrunk, with its events: a push held forever, a pull parked forever. A module
/// given as `FILE:k=v` is checked with that configuration. Issue 50: the five modules that
/// stalled or crash-looped clusters are each caught, with a shrunk case: a rule that holds every
/// push or parks every pull (failed for no progress), one that panics on every 20th or 200th
/// event (the second only in a long case: thousands of events on one instance), and one that
/// refuses every other policy's state (it could never be swapped in).
#[test]
fn policy_check_reports_a_request_never_answered_with_the_shrunk_sequence() {
    for (config, says, events) in [
        ("mode=push:hold", "worker 0's push of iteration 0 held 30.0 s", "(x30)"),
        ("mode=pull:park", "worker 0's pull for iteration 0 parked 30.0 s", "(x30)"),
        ("mode=pull:panic,every=20", "panics on purpose", "pulls for iteration"),
        ("mode=push:panic,every=200", "panics on purpose", "pushes iteration"),
        ("mode=refuse-state", "refused the handed-over state: cannot take over from `", "hot swap to"),
    ] {
        let spec = format!("{}:{config}", env!("SYNCOPATE_HOSTILE_WASM"));
        let out = Command::new(syncopate_bin())
            .args(["policy", "check", &spec])
            .output_within(COMMAND_LIMIT)
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{config}: {stderr}");
        assert!(stderr.contains("breaks a rule in a generated case"), "{config}: {stderr}");
        assert!(stderr.contains(says), "{config}: {stderr}");
        assert!(stderr.contains(events), "{config}, the events: {stderr}");
        if config.starts_with("mode=pu") && !config.contains("every") {
            // Shrunk to the smallest case that shows it.
            assert!(stderr.contains("(1 workers, 1 iterations each)"), "{config}, shrunk: {stderr}");
            assert!(stderr.contains("made no progress"), "{config}: {stderr}");
        }
        if config.contains("every=200") {
            assert!(stderr.contains("long case"), "{config}: only a long case reaches it: {stderr}");
        }
    }
    // The example that holds its pushes and admits them from after_push passes, k from the spec.
    let spec = format!("{}:k=3", env!("SYNCOPATE_FIRSTK_WASM"));
    let out = Command::new(syncopate_bin())
        .args(["policy", "check", &spec, "--cases", "100"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("exercised:   104 generated cases (4 long)") && !stdout.contains(" 0 pushes held"),
        "{stdout}"
    );
}

/// Issue 53: `policy check` runs a cluster policy through generated clusters (workers join and
/// leave, stragglers come and go, swaps fail) on the coordinator's own machine, and finds the
/// bug planted in the example: a worker looked up by its id as an index, which panics once a
/// worker with a lower id has left.
#[test]
fn policy_check_explores_a_cluster_policy_and_finds_a_planted_bug() {
    let wasm = env!("SYNCOPATE_PILOT_WASM");
    let out =
        Command::new(syncopate_bin()).args(["policy", "check", wasm]).output_within(COMMAND_LIMIT).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("abi:         cluster v1"), "{stdout}");
    assert!(stdout.contains("exercised:   64 generated clusters"), "{stdout}");
    let buggy = format!("{wasm}:planted_bug=true");
    let out =
        Command::new(syncopate_bin()).args(["policy", "check", &buggy]).output_within(COMMAND_LIMIT).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("breaks a rule in a generated cluster"), "{stderr}");
    assert!(stderr.contains("panicked") && stderr.contains("index out of bounds"), "{stderr}");
    // The built-in autopilot passes, and a shard policy is not taken for one (nor the reverse).
    let out = Command::new(syncopate_bin())
        .args(["policy", "check", "autopilot"])
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tls = crate::cluster::run_dir("pilot-as-policy").join("tls");
    let out = Command::new(syncopate_bin()).arg("certs").arg(&tls).output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success());
    let out = Command::new(syncopate_bin())
        .args([
            "coordinator",
            "--policy",
            "autopilot",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "t",
            "--tls-dir",
        ])
        .arg(&tls)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("is a cluster policy: run it with --pilot"), "{stderr}");
}

#[test]
fn policy_list_shows_the_builtins() {
    let out = Command::new(syncopate_bin()).args(["policy", "list"]).output_within(COMMAND_LIMIT).unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let builtins = [
        "asp",
        "bsp",
        "ssp",
        "dssp",
        "r2sp",
        "epsp",
        "fluentps",
        "localsgd",
        "diloco",
        "adaptive-deadline",
        "async-localsgd",
        "syncswitch",
        "adacomm",
        "robust",
        "decoupled-diloco",
        "autopilot",
    ];
    for name in builtins {
        assert!(stdout.contains(&format!("name:        {name}")), "{stdout}");
    }
    assert!(stdout.contains("abi:         cluster v1 (a cluster policy: --pilot autopilot)"), "{stdout}");
    // Each with a one-line description and its parameters, defaults and meaning.
    assert!(stdout.contains("s_hi       uint   default 15"), "{stdout}");
    assert!(stdout.contains("text   default enforced"), "{stdout}");
    assert_eq!(stdout.matches("description: ").count(), builtins.len(), "{stdout}");
    // Within a module, the columns line up however long its parameters' names are.
    for block in stdout.split("\n\n") {
        let at: Vec<usize> =
            block.lines().filter(|l| l.starts_with("  ")).filter_map(|l| l.find(" default ")).collect();
        assert!(at.windows(2).all(|w| w[0] == w[1]), "misaligned:\n{block}");
    }
}

/// Issue 37: a coordinator keeps the command line it was started with beside its checkpoints
/// (`coordinator.json`, tokens left out), and `--resume DIR` continues with it: a flag that
/// would change the cluster is refused before anything starts, with the value it had.
#[test]
fn a_resumed_coordinator_refuses_flags_that_would_change_the_cluster() {
    let dir = crate::cluster::run_dir("coordinator-resume");
    std::fs::create_dir_all(&dir).unwrap();
    let kept = serde_json::json!({ "args": ["--servers", "2", "--shards", "3", "--policy", "ssp:s=3"] });
    std::fs::write(dir.join("coordinator.json"), kept.to_string()).unwrap();
    let out = Command::new(syncopate_bin())
        .args(["coordinator", "--resume"])
        .arg(&dir)
        .args(["--servers", "5", "--listen", "127.0.0.1:0"])
        .env("SYNCOPATE_TOKEN", "t")
        .output_within(COMMAND_LIMIT)
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--servers 5 would change it (it had --servers 2)"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
