//! Support shared by the integration tests and the benchmarks: the real policy modules (built
//! from source by the build scripts), a recording [`ShardSink`], and small builders.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use syncopate::builtin;
use syncopate::runtime::{PolicyError, PolicyModule, PolicyRuntime, SandboxLimits};
use syncopate::shard::{PullReply, ShardSink};
use syncopate_policy_sdk::abi::{Control, RequestId, WorkerId};

/// The wasm bytes of the hostile test policy, built by `tests/build.rs`.
pub fn hostile_wasm() -> Vec<u8> {
    std::fs::read(env!("SYNCOPATE_HOSTILE_WASM"))
        .expect("the hostile policy module was built by tests/build.rs")
}

/// A runtime shared by the tests, with a small fuel budget and a small memory cap so hostile
/// modules are stopped quickly.
pub fn runtime() -> &'static PolicyRuntime {
    static RT: OnceLock<PolicyRuntime> = OnceLock::new();
    RT.get_or_init(|| {
        PolicyRuntime::with_limits(SandboxLimits { max_memory_bytes: 16 << 20, call_fuel: TEST_CALL_FUEL })
            .expect("wasm engine")
    })
}

/// The fuel budget of a call under [`runtime`]: a tenth of the default, still a thousand times
/// what a built-in policy's event burns.
pub const TEST_CALL_FUEL: u64 = 10_000_000;

/// A built-in policy module, compiled once per test process.
pub fn builtin_module(name: &str) -> PolicyModule {
    static CACHE: OnceLock<Mutex<HashMap<String, PolicyModule>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry(name.to_owned())
        .or_insert_with(|| {
            let wasm = builtin::wasm(name).unwrap_or_else(|| panic!("no built-in policy {name}"));
            runtime().compile(&format!("builtin:{name}"), wasm).expect("built-in policies compile")
        })
        .clone()
}

/// The hostile policy module, compiled once per test process.
pub fn hostile_module() -> PolicyModule {
    static MODULE: OnceLock<PolicyModule> = OnceLock::new();
    MODULE
        .get_or_init(|| runtime().compile("hostile.wasm", &hostile_wasm()).expect("hostile module compiles"))
        .clone()
}

/// The example `clip` policy module (`policies/example-clip`, built by `tests/build.rs`; it asks
/// the host for measures), compiled once per test process.
pub fn clip_module() -> PolicyModule {
    static MODULE: OnceLock<PolicyModule> = OnceLock::new();
    MODULE
        .get_or_init(|| {
            let wasm = std::fs::read(env!("SYNCOPATE_CLIP_WASM")).expect("the clip example was built");
            runtime().compile("clip", &wasm).expect("the clip example compiles")
        })
        .clone()
}

/// The example `backup` policy module (`policies/example-backup`, built by `tests/build.rs`),
/// compiled once per test process.
pub fn backup_module() -> PolicyModule {
    static MODULE: OnceLock<PolicyModule> = OnceLock::new();
    MODULE
        .get_or_init(|| {
            let wasm = std::fs::read(env!("SYNCOPATE_BACKUP_WASM")).expect("built by tests/build.rs");
            runtime().compile("backup.wasm", &wasm).expect("the backup module compiles")
        })
        .clone()
}

/// Turns `[("s", "3")]` into an owned configuration.
pub fn config(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// A served pull, as recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    /// The pull.
    pub id: RequestId,
    /// Who asked.
    pub worker: WorkerId,
    /// Its clock when served.
    pub clock: u64,
    /// The fewest iterations of any live worker included in the parameters.
    pub min_applied: u64,
    /// Time parked.
    pub waited_ns: u64,
    /// The first parameter value (tests use one-parameter shards or uniform gradients).
    pub first_value: f32,
    /// The shard version (optimizer steps) served.
    pub version: u64,
    /// The local steps the worker was told to take.
    pub local_steps: u32,
}

/// A [`ShardSink`] that records everything.
#[derive(Debug, Default)]
pub struct Recorder {
    /// Served pulls in order.
    pub served: Vec<Served>,
    /// Acknowledged pushes in order (dropped ones included).
    pub acked: Vec<(RequestId, WorkerId, u64)>,
    /// Pushes the policy dropped, in order.
    pub dropped: Vec<RequestId>,
    /// Control messages by recipient (a policy's task move goes to the tasks' owner first).
    pub controls: Vec<(WorkerId, Control)>,
    /// The same messages whole, for drivers that deliver them to worker machines.
    pub messages: Vec<(WorkerId, syncopate::tasks::ControlMessage)>,
    /// Metrics.
    pub metrics: Vec<(String, f64)>,
    /// Policy failures.
    pub errors: Vec<PolicyError>,
    /// When the policy was restarted after a failure (its driver time).
    pub restarts: Vec<u64>,
    /// Quarantines, by policy.
    pub quarantined: Vec<String>,
    /// Every event the policy was called with, as it received it.
    pub called: Vec<syncopate_policy_sdk::abi::Envelope>,
}

impl Recorder {
    /// Whether pull `id` has been served.
    pub fn was_served(&self, id: RequestId) -> bool {
        self.served(id).is_some()
    }

    /// The record of pull `id`, once served.
    pub fn served(&self, id: RequestId) -> Option<&Served> {
        self.served.iter().rev().find(|s| s.id == id)
    }

    /// Whether push `id` has been acknowledged.
    pub fn was_acked(&self, id: RequestId) -> bool {
        self.acked.iter().rev().any(|a| a.0 == id)
    }
}

impl ShardSink for Recorder {
    fn pull_served(&mut self, r: PullReply<'_>) {
        self.served.push(Served {
            id: r.id,
            worker: r.worker,
            clock: r.clock,
            min_applied: r.min_applied,
            waited_ns: r.waited_ns,
            first_value: r.values.first().copied().unwrap_or(0.0),
            version: r.version,
            local_steps: r.local_steps,
        });
    }
    fn push_acked(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
        self.acked.push((id, worker, iteration));
    }
    fn push_dropped(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
        self.dropped.push(id);
        self.acked.push((id, worker, iteration));
    }
    fn control(&mut self, worker: WorkerId, msg: syncopate::tasks::ControlMessage) {
        self.controls.push((worker, msg.control));
        self.messages.push((worker, msg));
    }
}

impl syncopate::shard::Observer for Recorder {
    fn policy_called(
        &mut self,
        env: &syncopate_policy_sdk::abi::Envelope,
        _answer: Result<&[u8], &PolicyError>,
    ) {
        self.called.push(*env);
    }

    fn metric(&mut self, name: &str, value: f64) {
        self.metrics.push((name.to_owned(), value));
    }
    fn policy_failed(&mut self, error: &PolicyError) {
        self.errors.push(error.clone());
    }
    fn policy_quarantined(&mut self, policy: &str) {
        self.quarantined.push(policy.to_owned());
    }
    fn policy_started(&mut self, start: &syncopate::recording::PolicyStart<'_>) {
        if start.kind == syncopate::recording::StartKind::Restart {
            self.restarts.push(start.now_ns);
        }
    }
}

/// What a [`ProcessCluster`] runs.
#[derive(Clone, Copy, Debug)]
pub struct ClusterSpec<'a> {
    /// Workers the coordinator waits for before training starts.
    pub workers: usize,
    /// Servers.
    pub servers: u32,
    /// Shards (ASP).
    pub shards: u32,
    /// The servers' learning rate (plain SGD).
    pub lr: f32,
    /// Flags added to the coordinator's.
    pub coordinator_args: &'a [&'a str],
    /// Flags added to each server's.
    pub server_args: &'a [&'a str],
}

/// A coordinator and one server run as `syncopate` processes on loopback, as in a deployment,
/// for clients in the calling process: `shards` ASP shards (no request waits on a policy), plain
/// SGD with learning rate `lr`, waiting for `workers` workers. Both processes are killed on drop.
///
/// With `SYNCOPATE_BENCH_NETNS` and `SYNCOPATE_BENCH_HOST` set (as `scripts/bench-link.sh`
/// sets them), the processes run in that network namespace instead, listening on that address,
/// so that clients in another namespace reach them over a veth link.
#[derive(Debug)]
pub struct ProcessCluster {
    /// How clients reach it.
    pub access: syncopate::net::tls::ClusterAccess,
    procs: Vec<std::process::Child>,
}

impl ProcessCluster {
    /// Starts the coordinator, waits for its address, then starts the server with
    /// `server_args` added. `bin` is the `syncopate` binary; `dir` holds the TLS files.
    pub fn start(
        bin: &std::path::Path,
        dir: &std::path::Path,
        workers: usize,
        shards: u32,
        lr: f32,
        server_args: &[&str],
    ) -> Self {
        let spec = ClusterSpec { workers, servers: 1, shards, lr, coordinator_args: &[], server_args };
        Self::start_spec(bin, dir, &spec)
    }

    /// [`start`](Self::start) with the whole [`ClusterSpec`]: several servers, and flags added
    /// to the coordinator's (`--replicas 1`, say).
    pub fn start_spec(bin: &std::path::Path, dir: &std::path::Path, spec: &ClusterSpec<'_>) -> Self {
        let ClusterSpec { workers, servers, shards, lr, coordinator_args, server_args } = *spec;
        use std::process::{Command, Stdio};
        use std::time::{Duration, Instant};
        use syncopate::net::tls::{ClusterAccess, TlsFiles, Token};
        let tls = TlsFiles::generate(dir).expect("TLS files");
        let token = Token::random();
        let ready = dir.join("coordinator-addr");
        let _ = std::fs::remove_file(&ready);
        // Across a real link (scripts/netns-link.sh): the nodes run in a network namespace of
        // their own and listen on its address; this process runs in the other.
        let netns = std::env::var("SYNCOPATE_BENCH_NETNS").ok().filter(|n| !n.is_empty());
        let host = std::env::var("SYNCOPATE_BENCH_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let listen = format!("{host}:0");
        let spawn = |args: &[&str]| {
            let mut cmd = match &netns {
                Some(ns) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", ns]).arg(bin);
                    c
                }
                None => Command::new(bin),
            };
            cmd.args(args)
                .arg("--tls-dir")
                .arg(dir)
                .env("SYNCOPATE_TOKEN", token.secret())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // Killed on drop, and by the kernel if this process dies first (a benchmark or
            // test killed mid-run leaves no nodes behind to skew the next).
            syncopate::lab::local::die_with_parent(&mut cmd);
            cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
        };
        let (workers, shards, lr) = (workers.to_string(), shards.to_string(), lr.to_string());
        let server_count = servers.to_string();
        let mut cluster = ProcessCluster {
            access: ClusterAccess { coordinator: ([127, 0, 0, 1], 0).into(), tls, token: token.clone() },
            procs: vec![spawn(
                &[
                    &[
                        "coordinator",
                        "--listen",
                        &listen,
                        "--servers",
                        &server_count,
                        "--workers",
                        &workers,
                        "--shards",
                        &shards,
                        "--policy",
                        "asp",
                        "--lr",
                        &lr,
                        "--momentum",
                        "0",
                        "--ready-file",
                        ready.to_str().expect("a UTF-8 path"),
                    ][..],
                    coordinator_args,
                ]
                .concat(),
            )],
        };
        let t = Instant::now();
        cluster.access.coordinator = loop {
            if let Some(addr) = std::fs::read_to_string(&ready).ok().and_then(|a| a.parse().ok()) {
                break addr;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "the coordinator did not start");
            std::thread::sleep(Duration::from_millis(5));
        };
        let coordinator = cluster.access.coordinator.to_string();
        for _ in 0..servers {
            let args =
                [&["server", "--coordinator", &coordinator, "--listen", &listen], server_args].concat();
            cluster.procs.push(spawn(&args));
        }
        cluster
    }
}

impl ProcessCluster {
    /// The nodes' process ids: the coordinator's, then the servers'.
    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(|p| p.id()).collect()
    }
}

/// User and system CPU seconds process `pid` has used (`/proc/PID/stat`), if it is there.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: fields are counted after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ').skip(11); // utime is field 14, the 12th after the name
    let (utime, stime): (f64, f64) = (fields.next()?.parse().ok()?, fields.next()?.parse().ok()?);
    // SAFETY: sysconf reads a constant and has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks)
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

/// How long a command a test runs to its end may take before the test kills it and fails: a
/// liveness limit, far above what any takes on a loaded 2-core machine.
pub const COMMAND_LIMIT: std::time::Duration = std::time::Duration::from_secs(900);

/// [`std::process::Command::output`] with a time limit: every wait in a test has one, so a
/// command that hangs fails the test instead of blocking the suite.
pub trait OutputWithin {
    /// Runs the command to its end (stdin closed, stdout and stderr captured), as `output` does;
    /// past `within`, kills it and panics with what it printed so far.
    fn output_within(&mut self, within: std::time::Duration) -> std::io::Result<std::process::Output>;
}

impl OutputWithin for std::process::Command {
    fn output_within(&mut self, within: std::time::Duration) -> std::io::Result<std::process::Output> {
        use std::io::Read;
        use std::process::Stdio;
        let mut child = self.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let pump = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = r.read_to_end(&mut buf);
                buf
            })
        };
        let out = pump(Box::new(child.stdout.take().expect("piped")));
        let err = pump(Box::new(child.stderr.take().expect("piped")));
        let t = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if t.elapsed() > within {
                let _ = child.kill();
                let _ = child.wait();
                let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
                panic!(
                    "{self:?} did not finish within {within:?}:\n{}\n{}",
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&err)
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
        Ok(std::process::Output { status, stdout, stderr })
    }
}
