//! `syncopate local`: a whole cluster on this machine, each role a separate process on
//! loopback, started in order (coordinator, servers, workers) and stopped cleanly.
//!
//! Everything the run produces goes in its run directory: the generated TLS certificate,
//! `cluster.json` (address, CA, token and process ids, for `syncopate policy swap|status`),
//! one log per process under `logs/`, each worker's report under `workers/`, the final model
//! (`model.bin`, little-endian `f32`) and `report.json`, and the processes' last Prometheus
//! scrape under `metrics/` (each serves `/metrics` on loopback while it runs; `cluster.json`
//! names the addresses). Children are killed if this process stops early, so a run never
//! leaves processes behind.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::process::{Child, Command};

use syncopate_workloads::Evaluator;

use crate::lab::report::{RunReport, StopRules, Target, WatchPoint};
use crate::lab::scenario::RunSpec;
use crate::net::proto::{ModelScore, ShardStatus};
use crate::net::tls::{ClusterFile, TlsFiles, Token};
use crate::operator::Operator;
use crate::shard::PushWeight;
use crate::worker::WorkerReport;
use crate::NodeError;

/// How to run a local cluster: the run, typed, and what only a real cluster on this machine
/// needs besides (where the executable and the data are, the transport's settings).
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// The `syncopate` executable each role runs.
    pub exe: PathBuf,
    /// Where the run's files go.
    pub run_dir: PathBuf,
    /// The run: scenario and policy.
    pub run: RunSpec,
    /// The workload's data directory (`None`: its default).
    pub data: Option<PathBuf>,
    /// Microseconds an idle server or worker polls its sockets before it sleeps.
    pub spin_us: u64,
    /// The coordinator and servers drop a peer silent this long, in milliseconds.
    pub peer_timeout_ms: u64,
    /// Record every shard's policy events into this directory (`syncopate policy replay`).
    pub record: Option<PathBuf>,
    /// Write checkpoint rounds into this directory (`--checkpoint-dir`), every
    /// `checkpoint_every_s` seconds (0: only at shutdown). `None`: no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Seconds between checkpoint rounds.
    pub checkpoint_every_s: u64,
    /// Resume from the newest intact round in this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// A failure drill: SIGKILL the coordinator this many seconds into training. The launcher
    /// starts it again at the same address, as it does a coordinator that dies on its own (up
    /// to [`COORDINATOR_RESTARTS`] times), and the servers and workers rejoin it.
    pub kill_coordinator_s: Option<f64>,
    /// Write TensorBoard event files of every look at the cluster into this directory.
    pub tensorboard: Option<PathBuf>,
    /// Serve the coordinator's live dashboard at this address (port 0: any free one).
    pub dashboard: Option<SocketAddr>,
}

/// How many times `local` starts a coordinator again that died during a run.
pub const COORDINATOR_RESTARTS: usize = 3;

impl LocalOptions {
    /// A run with this machine's defaults: the default data directory, spinning and peer
    /// timeout.
    pub fn new(exe: PathBuf, run_dir: PathBuf, run: RunSpec) -> Self {
        LocalOptions {
            exe,
            run_dir,
            run,
            data: None,
            spin_us: crate::net::spin::DEFAULT_SPIN.as_micros() as u64,
            peer_timeout_ms: 10_000,
            record: None,
            checkpoint_dir: None,
            checkpoint_every_s: 0,
            resume: None,
            kill_coordinator_s: None,
            tensorboard: None,
            dashboard: None,
        }
    }

    /// The coordinator's flags (besides its address, TLS and ready file): the policy, the
    /// shards and the servers' training settings.
    pub fn coordinator_args(&self) -> Vec<String> {
        let (sc, run) = (&self.run.scenario, &self.run);
        let mut a = vec!["--policy".to_string(), run.policy.to_string(), "--shards".into()];
        a.push(run.shards().to_string());
        for (shard, k, v) in &run.overrides {
            a.extend(["--shard-config".into(), format!("{shard}:{k}={v}")]);
        }
        if let Some(pilot) = &run.pilot {
            a.extend(["--pilot".into(), pilot.to_string()]);
        }
        let (o, local) = (sc.server_optimizer(), sc.local_sgd());
        let weight = match sc.push_weight.unwrap_or_default() {
            PushWeight::Mean => "mean",
            PushWeight::Sum => "sum",
        };
        let pairs = [
            ("--lr", o.lr.to_string()),
            ("--momentum", o.momentum.to_string()),
            ("--weight-decay", o.weight_decay.to_string()),
            ("--push-weight", weight.to_string()),
            ("--local-steps", local.local_steps.to_string()),
            ("--outer-lr", local.outer.lr.to_string()),
            ("--outer-momentum", local.outer.momentum.to_string()),
            ("--push-codec", sc.codecs().0.to_string()),
            ("--pull-codec", sc.codecs().1.to_string()),
            ("--seed", sc.seed.to_string()),
            ("--peer-timeout-ms", self.peer_timeout_ms.to_string()),
            ("--no-progress-s", (sc.supervisor().no_progress_ns as f64 / 1e9).to_string()),
            ("--checkpoint-every-s", self.checkpoint_every_s.to_string()),
            ("--replicas", sc.replicas.to_string()),
            ("--max-workers", sc.workers.max(crate::net::proto::DEFAULT_MAX_WORKERS).to_string()),
        ];
        a.extend(pairs.into_iter().flat_map(|(k, v)| [k.to_string(), v]));
        if local.outer.nesterov {
            a.push("--outer-nesterov".into());
        }
        if let Some(dir) = &self.checkpoint_dir {
            a.extend(["--checkpoint-dir".into(), dir.display().to_string()]);
        }
        if let Some(dir) = &self.resume {
            a.extend(["--resume".into(), dir.display().to_string()]);
        }
        a
    }

    /// Every server's flags (besides the coordinator and TLS).
    pub fn server_args(&self) -> Vec<String> {
        let mut a = vec!["--spin-us".into(), self.spin_us.to_string()];
        if let Some(dir) = &self.record {
            a.extend(["--record".into(), dir.display().to_string()]);
        }
        a
    }

    /// Worker `w`'s flags (besides the coordinator, id, CA and report): the workload, its part
    /// of the data, the budget and its device (slowdown, jitter, stall).
    pub fn worker_args(&self, w: u32) -> Vec<String> {
        let sc = &self.run.scenario;
        let pairs = [
            ("--workload", sc.workload.clone()),
            ("--params", sc.params.to_string()),
            ("--hidden", sc.hidden.to_string()),
            ("--iterations", sc.iterations_or_unbounded().to_string()),
            ("--batch", sc.batch.to_string()),
            ("--seed", sc.seed.to_string()),
            ("--delay-ms", sc.compute_ms.to_string()),
            ("--spin-us", self.spin_us.to_string()),
            ("--part", format!("{w}/{}", sc.workers)),
        ];
        let mut a: Vec<String> = pairs.into_iter().flat_map(|(k, v)| [k.to_string(), v]).collect();
        if let Some(data) = &self.data {
            a.extend(["--data".into(), data.display().to_string()]);
        }
        let window = |from: Option<f64>, until: Option<f64>| {
            format!("{}:{}", from.unwrap_or(0.0), until.map_or("inf".to_string(), |u| u.to_string()))
        };
        if let Some(s) = sc.slow.iter().find(|s| s.worker == w) {
            a.extend(["--slow-factor".into(), s.factor.to_string()]);
            if s.from_s.is_some() || s.until_s.is_some() {
                a.extend(["--slow-during".into(), window(s.from_s, s.until_s)]);
            }
        }
        if let Some(j) = sc.jitter.iter().find(|j| j.worker == w) {
            a.extend(["--jitter-ms".into(), format!("{}:{}", j.mean_ms, j.sd_ms)]);
            if j.from_s.is_some() || j.until_s.is_some() {
                a.extend(["--jitter-during".into(), window(j.from_s, j.until_s)]);
            }
        }
        if let Some(s) = sc.stall.iter().find(|s| s.worker == w) {
            a.extend(["--stall".into(), format!("{}:{}", s.at_s, s.for_s)]);
        }
        if let Some(o) = sc.worker_optimizer() {
            a.extend(["--momentum".into(), o.momentum.to_string()]);
            a.extend(["--weight-decay".into(), o.weight_decay.to_string()]);
        }
        a
    }

    /// What the launcher scores, how often, and when it stops the run.
    fn stop_rules(&self) -> StopRules {
        self.run.scenario.stop_rules()
    }
}

struct Proc {
    name: String,
    child: Child,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let what = what.into();
    move |source| NodeError::Io { what, source }
}

/// Makes the process `cmd` starts receive SIGKILL when the process that started it dies, however
/// it dies (Linux; elsewhere nothing). For node processes a launcher owns: `local`, tests and
/// benchmarks, so that none outlives them. The kernel ties this to the thread that spawns the
/// child: spawn from a thread that lives as long as the child should.
pub fn die_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs between fork and exec and calls only prctl, which is
    // async-signal-safe; it touches no memory of the parent.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

impl Proc {
    fn spawn(exe: &Path, dir: &Path, name: &str, args: &[String], token: &Token) -> Result<Self, NodeError> {
        let mut cmd = Command::new(exe);
        cmd.args(args);
        Self::start(cmd, dir, name, token)
    }

    /// Starts `cmd` as the node `name`: its output to `logs/<name>.log`, the token in its
    /// environment, and no `SYNCOPATE_*` setting of ours leaking into it but those `cmd` sets
    /// and `SYNCOPATE_LOG` (default `info`: the log files say what each node did).
    fn start(mut cmd: Command, dir: &Path, name: &str, token: &Token) -> Result<Self, NodeError> {
        let log = dir.join("logs").join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(io(format!("cannot create {}", log.display())))?;
        let err = out.try_clone().map_err(io("log file"))?;
        let set: Vec<std::ffi::OsString> = cmd.as_std().get_envs().map(|(k, _)| k.to_os_string()).collect();
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("SYNCOPATE_") && k != "SYNCOPATE_PYTHON" && !set.contains(&k) {
                cmd.env_remove(&k);
            }
        }
        if !set.iter().any(|k| k == "SYNCOPATE_LOG") {
            // The node's own log file: what it did (registrations, checkpoints, restores,
            // failures), at the level the user asked for, `info` by default.
            cmd.env("SYNCOPATE_LOG", std::env::var("SYNCOPATE_LOG").unwrap_or_else(|_| "info".into()));
        }
        cmd.env("SYNCOPATE_TOKEN", token.secret())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true);
        // kill_on_drop covers every way out of this process but SIGKILL; for that one the
        // kernel ends the children, so no half cluster outlives `local`.
        die_with_parent(cmd.as_std_mut());
        let program = cmd.as_std().get_program().to_string_lossy().into_owned();
        let child = cmd.spawn().map_err(io(format!("cannot start {program} for {name}")))?;
        Ok(Proc { name: name.to_string(), child })
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }
}

/// The command that runs a user's training script (`script[0]`, with the arguments after it)
/// as a worker with the flags `args`, passed as the environment `syncopate worker` also reads:
/// `--slow-factor 3` becomes `SYNCOPATE_SLOW_FACTOR=3`.
///
/// Unless the user set `OMP_NUM_THREADS`, it is set to the machine's cores shared out among
/// `workers` scripts (at least one each), as torchrun does: torch and BLAS otherwise start a
/// thread per core in every worker, and 4 workers on 2 cores then spend their time contending
/// (the PyTorch example, 4 workers on 2 cores: 0.88 s per iteration that way, 0.14 s with 1
/// thread each).
pub fn script_command(script: &[String], args: &[String], workers: u32) -> Command {
    let path = &script[0];
    let mut cmd = if path.ends_with(".py") {
        let python = std::env::var_os("SYNCOPATE_PYTHON").unwrap_or_else(|| "python3".into());
        let mut c = Command::new(python);
        c.arg(path);
        c
    } else {
        Command::new(path)
    };
    cmd.args(&script[1..]);
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cmd.env("OMP_NUM_THREADS", (cores / workers.max(1) as usize).max(1).to_string());
    }
    for (k, v) in flags_as_env(args) {
        cmd.env(k, v);
    }
    cmd
}

/// `--flag value` pairs as `SYNCOPATE_FLAG=value` variables.
pub fn flags_as_env(args: &[String]) -> Vec<(String, String)> {
    args.chunks(2)
        .filter_map(|pair| match pair {
            [flag, value] => {
                let name = flag.trim_start_matches("--").replace('-', "_").to_uppercase();
                Some((format!("SYNCOPATE_{name}"), value.clone()))
            }
            _ => None,
        })
        .collect()
}

/// The flags that make process `name` serve Prometheus metrics on loopback, on a free port it
/// writes to `logs/NAME.metrics`.
fn metrics_args(dir: &Path, name: &str) -> [String; 4] {
    let file = dir.join("logs").join(format!("{name}.metrics"));
    ["--metrics-listen".into(), "127.0.0.1:0".into(), "--metrics-file".into(), file.display().to_string()]
}

/// Where the processes `names` serve their metrics, as they wrote it (each binds before it
/// does anything else; one that has not within 30 s is left out, with a warning).
async fn metrics_addrs<'a>(dir: &Path, names: impl Iterator<Item = &'a str>) -> Vec<(String, SocketAddr)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    for name in names {
        let file = dir.join("logs").join(format!("{name}.metrics"));
        loop {
            if let Some(addr) = crate::metrics::read_addr(&file) {
                out.push((name.to_string(), addr));
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!("{name} has not said where it serves metrics; cluster.json leaves it out");
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    out
}

/// Scrapes every process's metrics once and writes each exposition to `metrics/NAME.prom`:
/// the cluster's last figures, beside the report (a process that does not answer is left out,
/// with a warning).
async fn save_metrics(dir: &Path, addrs: &[(String, SocketAddr)]) {
    let folder = dir.join("metrics");
    if let Err(e) = std::fs::create_dir_all(&folder) {
        tracing::warn!("metrics not saved: cannot create {}: {e}", folder.display());
        return;
    }
    for (name, addr) in addrs {
        match tokio::time::timeout(Duration::from_secs(10), crate::metrics::scrape(*addr)).await {
            Ok(Ok(text)) => {
                let path = folder.join(format!("{name}.prom"));
                if let Err(e) = crate::checkpoint::write_file(&path, text.as_bytes()) {
                    tracing::warn!("{} not written: {e}", path.display());
                }
            }
            Ok(Err(e)) => tracing::warn!("{name}'s metrics at {addr} not scraped: {e}"),
            Err(_) => tracing::warn!("{name}'s metrics at {addr} not scraped within 10 s"),
        }
    }
}

/// The last lines of a process's log, for error messages.
pub fn log_tail(run_dir: &Path, name: &str, lines: usize) -> String {
    let text = std::fs::read_to_string(run_dir.join("logs").join(format!("{name}.log"))).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "ended".into(),
    }
}

/// Runs a local cluster to the end: every worker finishes (or fails), the model is read and
/// saved, the cluster shuts down. Progress goes to stderr.
pub async fn run(opts: LocalOptions) -> Result<RunReport, NodeError> {
    let began = Instant::now();
    let dir = &opts.run_dir;
    for sub in ["logs", "workers", "tls"] {
        std::fs::create_dir_all(dir.join(sub))
            .map_err(io(format!("cannot create {}", dir.join(sub).display())))?;
    }
    let tls = TlsFiles::generate(&dir.join("tls"))?;
    let token = Token::random();
    let tls_dir = dir.join("tls").display().to_string();
    let ready = dir.join("coordinator.addr");
    let _ = std::fs::remove_file(&ready);
    let mut args = vec!["coordinator".into(), "--listen".into(), "127.0.0.1:0".into(), "--servers".into()];
    let sc = &opts.run.scenario;
    args.extend([sc.servers.to_string(), "--workers".into(), sc.workers.to_string()]);
    args.extend(["--ready-file".into(), ready.display().to_string()]);
    args.extend(["--tls-dir".into(), tls_dir.clone()]);
    args.extend(metrics_args(dir, "coordinator"));
    let dashboard_file = dir.join("logs").join("coordinator.dashboard");
    if let Some(d) = opts.dashboard {
        let _ = std::fs::remove_file(&dashboard_file);
        args.extend(["--dashboard".into(), d.to_string(), "--dashboard-file".into()]);
        args.push(dashboard_file.display().to_string());
    }
    args.extend(opts.coordinator_args());
    let mut coordinator = Proc::spawn(&opts.exe, dir, "coordinator", &args, &token)?;
    let coordinator_args = args;
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text.trim().to_string();
        }
        if let Ok(Some(status)) = coordinator.child.try_wait() {
            return Err(NodeError::Lost(format!(
                "the coordinator {} at start-up:\n{}",
                describe(status),
                log_tail(dir, "coordinator", 10)
            )));
        }
        if began.elapsed() > Duration::from_secs(60) {
            return Err(NodeError::Lost("the coordinator did not start within 60 s".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut servers = Vec::new();
    for s in 0..sc.servers {
        let mut args: Vec<String> =
            vec!["server".into(), "--coordinator".into(), addr.clone(), "--tls-dir".into(), tls_dir.clone()];
        args.extend(opts.server_args());
        let id_file = dir.join("logs").join(format!("server-{s}.id"));
        args.extend(["--id-file".into(), id_file.display().to_string()]);
        args.extend(metrics_args(dir, &format!("server-{s}")));
        servers.push(Proc::spawn(&opts.exe, dir, &format!("server-{s}"), &args, &token)?);
    }
    let mut workers = Vec::new();
    for w in 0..sc.workers {
        let report = dir.join("workers").join(format!("worker-{w}.json"));
        let mut args: Vec<String> = vec!["--coordinator".into(), addr.clone(), "--id".into()];
        args.extend([w.to_string(), "--ca".into(), tls.ca.display().to_string()]);
        args.extend(["--report".into(), report.display().to_string()]);
        args.extend(opts.worker_args(w));
        let name = format!("worker-{w}");
        let proc = if sc.script.is_empty() {
            Proc::spawn(&opts.exe, dir, &name, &[vec!["worker".to_string()], args].concat(), &token)?
        } else {
            Proc::start(script_command(&sc.script, &args, sc.workers), dir, &name, &token)?
        };
        workers.push(proc);
    }
    let cluster = ClusterFile {
        coordinator: addr
            .parse()
            .map_err(|_| NodeError::Protocol(format!("bad coordinator address `{addr}`")))?,
        token: token.secret().to_string(),
        ca: tls.ca.clone(),
        server_name: tls.server_name.clone(),
        pids: std::iter::once(&coordinator)
            .chain(&servers)
            .chain(&workers)
            .map(|p| (p.name.clone(), p.pid()))
            .collect(),
        metrics: metrics_addrs(dir, std::iter::once(&coordinator).chain(&servers).map(|p| p.name.as_str()))
            .await,
        dashboard: match opts.dashboard {
            // The coordinator binds it before it listens for the cluster, so it is there by now.
            Some(_) => crate::http::read_addr(&dashboard_file),
            None => None,
        },
    };
    if let Some(d) = cluster.dashboard {
        // The token rides in the fragment, which the browser keeps to itself.
        eprintln!("dashboard: http://{d}/#token={}", token.secret());
    } else if opts.dashboard.is_some() {
        tracing::warn!("the coordinator did not say where it serves the dashboard; see its log");
    }
    let cluster_path = dir.join("cluster.json");
    write_private_json(&cluster_path, &cluster)?;
    eprintln!(
        "cluster up: coordinator {addr}, {} servers, {} workers (logs in {})",
        sc.servers,
        sc.workers,
        dir.join("logs").display()
    );

    // One origin for every time in the report: the moment the workers were started.
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let t0 = Instant::now();
    let operator = Operator::connect(&cluster.access()).await?;
    // A script's model is the script's: the launcher has no evaluator for it, and takes the
    // scores the script reports (`Worker.score` in Python) instead.
    let evaluator = if !sc.script.is_empty() {
        None
    } else {
        let (w, o) = (sc.workload.clone(), sc.workload_options(opts.data.as_deref()));
        let e = tokio::task::spawn_blocking(move || Evaluator::for_workload(&w, &o));
        e.await
            .map_err(|e| NodeError::Protocol(e.to_string()))?
            .map_err(|e| NodeError::Protocol(e.to_string()))?
    }
    .map(std::sync::Arc::new);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let worker_names: Vec<String> = workers.iter().map(|p| p.name.clone()).collect();
    let worker_pids: Vec<u32> = workers.iter().map(Proc::pid).collect();
    for (w, p) in workers.into_iter().enumerate() {
        let mut child = p.child;
        let tx = done_tx.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = tx.send((w, status));
        });
    }
    drop(done_tx);
    let progress = indicatif::ProgressBar::new(0);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} iterations  {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut points: Vec<WatchPoint> = Vec::new();
    // A writer that fails (a full disk) stops writing, with a warning; the run goes on.
    let mut tensorboard = match &opts.tensorboard {
        Some(tb) => match crate::lab::tensorboard::EventWriter::create(tb, started.as_secs_f64()) {
            Ok(w) => {
                eprintln!("tensorboard: {}", w.path().display());
                Some(w)
            }
            Err(e) => {
                tracing::warn!("no TensorBoard file in {}: {e}", tb.display());
                None
            }
        },
        None => None,
    };
    let mut time_to_target = None;
    let mut stop_sent = false;
    let mut best: Option<(f32, Option<Vec<f32>>)> = None;
    let mut ended = Vec::new();
    let stop = opts.stop_rules();
    let every = Duration::from_millis(sc.eval_every_ms.max(50));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The scenario's failure drill: a server SIGKILLed at its time, counted from when training
    // starts (the first push a shard counts), as the scenario says and the simulator does: on a
    // busy machine the cluster's start-up alone can take longer than `at_s`.
    let mut kill = sc.kill_server;
    let mut kill_armed = false;
    let kill_at = tokio::time::sleep_until(t0.into());
    tokio::pin!(kill_at);
    // The coordinator's: SIGKILLed at its time, then started again like one that died.
    let mut kill_coordinator = opts.kill_coordinator_s;
    let kill_coordinator_at =
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(kill_coordinator.unwrap_or(0.0))).into());
    tokio::pin!(kill_coordinator_at);
    let mut coordinator_restarts: Vec<f64> = Vec::new();
    // When the run was to stop (its target or time limit reached): workers still running
    // STOP_BACKSTOP later are killed.
    let mut stop_due: Option<Instant> = None;
    let backstop = tokio::time::sleep_until(t0.into());
    tokio::pin!(backstop);
    let mut killed_at_stop: Vec<u32> = Vec::new();
    // The last time the coordinator answered a look: one silent for COORDINATOR_SILENT (frozen,
    // or wedged) is killed, and started again as one that died.
    let mut answered = Instant::now();
    let mut checkpoint_error: Option<String> = None;
    while ended.len() < worker_names.len() {
        // Biased: a coordinator's death is seen before the next look at the cluster, which it
        // would never answer.
        tokio::select! {
            biased;
            Some((w, status)) = done_rx.recv() => ended.push((w, status.map_err(io("waiting for a worker"))?)),
            () = &mut kill_coordinator_at, if kill_coordinator.is_some() => {
                kill_coordinator = None;
                eprintln!("[{:>6.1} s] failure drill: killing the coordinator", t0.elapsed().as_secs_f64());
                if let Err(e) = coordinator.child.start_kill() {
                    tracing::warn!("cannot kill the coordinator: {e}");
                }
            }
            status = coordinator.child.wait() => {
                let how = status.map(describe).unwrap_or_else(|e| e.to_string());
                if coordinator_restarts.len() >= COORDINATOR_RESTARTS {
                    return Err(NodeError::Lost(format!(
                        "the coordinator {how}, and it was started again {COORDINATOR_RESTARTS} times already:\n{}",
                        log_tail(dir, &coordinator.name, 10)
                    )));
                }
                let t = t0.elapsed().as_secs_f64();
                coordinator_restarts.push(t);
                let name = format!("coordinator-{}", coordinator_restarts.len() + 1);
                eprintln!("[{t:>6.1} s] the coordinator {how}; starting it again at {addr} (log: logs/{name}.log)");
                let mut pins = vec![("--listen", addr.clone())];
                if let Some(m) = cluster.metrics.iter().find(|m| m.0 == "coordinator") {
                    pins.push(("--metrics-listen", m.1.to_string()));
                }
                if let Some(d) = cluster.dashboard {
                    pins.push(("--dashboard", d.to_string()));
                }
                let args = restart_args(&coordinator_args, &pins);
                coordinator = Proc::spawn(&opts.exe, dir, &name, &args, &token)?;
                operator.reconnect();
                answered = Instant::now();
            }
            () = &mut backstop, if stop_due.is_some() && killed_at_stop.is_empty() => {
                let running: Vec<usize> =
                    (0..worker_names.len()).filter(|w| !ended.iter().any(|(e, _)| e == w)).collect();
                eprintln!(
                    "[{:>6.1} s] the run was to stop {} s ago; killing the workers still running ({running:?}): \
                     what they pushed and had acknowledged is kept",
                    t0.elapsed().as_secs_f64(),
                    STOP_BACKSTOP.as_secs()
                );
                for w in running {
                    killed_at_stop.push(w as u32);
                    // SAFETY: kill(2) on a child's pid, which it keeps until we reap it.
                    unsafe {
                        libc::kill(worker_pids[w] as libc::pid_t, libc::SIGKILL);
                    }
                }
            }
            () = &mut kill_at, if kill.is_some() && kill_armed => {
                let k = kill.take().expect("guarded");
                // Ids follow the order of registration, not of the processes: each wrote its own.
                let id_of = |i: usize| std::fs::read_to_string(dir.join("logs").join(format!("server-{i}.id")));
                let found = (0..servers.len()).find(|&i| id_of(i).is_ok_and(|t| t.trim() == k.server.to_string()));
                match found {
                    Some(i) => {
                        eprintln!("[{:>6.1} s] failure drill: killing server {}", t0.elapsed().as_secs_f64(), k.server);
                        if let Err(e) = servers[i].child.start_kill() {
                            tracing::warn!(server = k.server, "cannot kill the server: {e}");
                        }
                    }
                    // Not registered yet (a slow start): look again shortly.
                    None => {
                        kill = Some(k);
                        kill_at.as_mut().reset((Instant::now() + Duration::from_millis(100)).into());
                    }
                }
            }
            _ = tick.tick() => {
                let point = watch(&operator, evaluator.as_deref(), t0.elapsed().as_secs_f64());
                // A coordinator that dies meanwhile never answers: the look ends with it, and the
                // loop starts it again at once (on a busy machine, waiting out the limit twice
                // kept it away 20 s, past the servers' leases). `wait` keeps the status for that.
                let looked = tokio::select! {
                    looked = tokio::time::timeout(WATCH_LIMIT, point) => looked,
                    _ = coordinator.child.wait() => continue,
                };
                let Ok(Ok((point, scored))) = looked else {
                    if answered.elapsed() >= COORDINATOR_SILENT {
                        eprintln!(
                            "[{:>6.1} s] the coordinator has not answered for {} s; killing it to start it again",
                            t0.elapsed().as_secs_f64(),
                            answered.elapsed().as_secs()
                        );
                        if let Err(e) = coordinator.child.start_kill() {
                            tracing::warn!("cannot kill the coordinator: {e}");
                        }
                    }
                    if stop_due.is_none() && stop.should_stop(t0.elapsed().as_secs_f64(), time_to_target.is_some()) {
                        stop_due = Some(Instant::now());
                        backstop.as_mut().reset((Instant::now() + STOP_BACKSTOP).into());
                    }
                    continue;
                };
                answered = Instant::now();
                // A checkpoint round that fails (a full disk) is said here, not only in the
                // coordinator's log.
                if point.checkpoint_error != checkpoint_error {
                    checkpoint_error = point.checkpoint_error.clone();
                    match &checkpoint_error {
                        Some(e) => eprintln!("[{:>6.1} s] checkpoint round not taken: {e}", point.t_s),
                        None => eprintln!("[{:>6.1} s] checkpoint rounds are taken again", point.t_s),
                    }
                }
                if let Some(k) = kill.filter(|_| !kill_armed && point.iterations > 0) {
                    kill_armed = true;
                    kill_at.as_mut().reset((Instant::now() + Duration::from_secs_f64(k.at_s)).into());
                }
                // The best model by the target's measure: the lowest loss for a loss target, the
                // highest accuracy otherwise.
                let measure = match stop.target {
                    Some(Target::Loss(_)) => point.loss.map(|l| -l),
                    _ => point.accuracy,
                };
                if let Some(m) = measure {
                    if best.as_ref().is_none_or(|(b, _)| m > *b) {
                        best = Some((m, scored));
                    }
                }
                progress.set_length(sc.iterations_or_unbounded().saturating_mul(worker_names.len() as u64));
                progress.set_position(point.min_clock * worker_names.len() as u64);
                let msg = describe_point(&point, matches!(evaluator.as_deref(), Some(Evaluator::Text { .. })));
                if interactive {
                    progress.set_message(msg);
                } else {
                    eprintln!("[{:>6.1} s] clocks {}-{}  {msg}", point.t_s, point.min_clock, point.max_clock);
                }
                if time_to_target.is_none() && stop.reached(&point) {
                    time_to_target = Some(point.t_s);
                    let target = stop.target.map(|t| t.describe()).unwrap_or_default();
                    let msg = format!("target {target} reached after {:.1} s", point.t_s);
                    if interactive {
                        progress.println(msg);
                    } else {
                        eprintln!("{msg}");
                    }
                }
                if !stop_sent && stop.should_stop(t0.elapsed().as_secs_f64(), time_to_target.is_some()) {
                    if stop_due.is_none() {
                        stop_due = Some(Instant::now());
                        backstop.as_mut().reset((Instant::now() + STOP_BACKSTOP).into());
                    }
                    // Asked again at the next look if the coordinator does not answer now.
                    match tokio::time::timeout(WATCH_LIMIT, operator.stop_training()).await {
                        Ok(Ok(())) => stop_sent = true,
                        Ok(Err(e)) => tracing::warn!("could not ask the workers to stop: {e}"),
                        Err(_) => tracing::warn!("could not ask the workers to stop: no answer within {WATCH_LIMIT:?}"),
                    }
                }
                if let Some(w) = tensorboard.as_mut() {
                    if let Err(e) = w.point(&point).and_then(|()| w.flush()) {
                        tracing::warn!("TensorBoard file not written further: {e}");
                        tensorboard = None;
                    }
                }
                points.push(point);
            }
            _ = tokio::signal::ctrl_c() => return Err(NodeError::Lost("interrupted; the cluster was stopped".into())),
        }
    }
    progress.finish_and_clear();
    ended.sort_by_key(|(w, _)| *w);
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for (w, status) in ended {
        let file = dir.join("workers").join(format!("worker-{w}.json"));
        let report = std::fs::read(&file).ok().and_then(|b| serde_json::from_slice::<WorkerReport>(&b).ok());
        match (status.success(), report) {
            (true, Some(r)) => {
                eprintln!(
                    "worker {w} finished: {} iterations, {:.2} s in pulls",
                    r.iterations,
                    r.wait_ns as f64 / 1e9
                );
                reports.push(r);
            }
            _ if killed_at_stop.contains(&(w as u32)) => {
                let how = format!("was killed {} s after the run was to stop", STOP_BACKSTOP.as_secs());
                eprintln!("worker {w} {how}; last log lines:\n{}", log_tail(dir, &worker_names[w], 5));
                failed.push((w as u32, how));
            }
            _ => {
                let how = describe(status);
                eprintln!("worker {w} {how}; last log lines:\n{}", log_tail(dir, &worker_names[w], 5));
                failed.push((w as u32, how));
            }
        }
    }
    for s in &mut servers {
        if let Ok(Some(status)) = s.child.try_wait() {
            let what = format!("{} {}:\n{}", s.name, describe(status), log_tail(dir, &s.name, 10));
            if sc.replicas == 0 {
                return Err(NodeError::Lost(what));
            }
            // With backups its shards moved to other servers (the coordinator's log says when).
            eprintln!("lost during the run, its shards taken over by their backups: {what}");
        }
    }

    let (model, model_version) = operator.read_model().await?;
    // The last scrape, then the status the report is made of: the counters stand still once
    // the workers are gone, so the two agree (but for the status request's own bytes).
    save_metrics(dir, &cluster.metrics).await;
    let status = operator.status().await?;
    let final_score = match &evaluator {
        Some(e) if e.param_len() == model.len() => {
            let (e, m) = (e.clone(), model.clone());
            tokio::task::spawn_blocking(move || e.evaluate(&m)).await.ok().map(|s| (s.accuracy, Some(s.loss)))
        }
        // A script's last score is the final model's, as near as the launcher can know.
        _ => status.score.map(|r| (r.score.accuracy, r.score.loss)),
    };
    let model_file = dir.join("model.bin");
    crate::checkpoint::write_file(&model_file, crate::net::wire::f32_bytes(&model))
        .map_err(io(format!("cannot write {}", model_file.display())))?;
    if let Some((_, Some(params))) = &best {
        let path = dir.join("model-best.bin");
        crate::checkpoint::write_file(&path, crate::net::wire::f32_bytes(params))
            .map_err(io(format!("cannot write {}", path.display())))?;
    }
    let elapsed_s = began.elapsed().as_secs_f64();
    operator.shutdown().await?;
    for p in std::iter::once(&mut coordinator).chain(servers.iter_mut()) {
        match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
            Ok(Ok(s)) if s.success() => {}
            Ok(Ok(s)) => tracing::warn!("{} {} at shutdown", p.name, describe(s)),
            _ => {
                tracing::warn!("{} did not stop within 10 s; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
    let staleness = RunReport::staleness_of(status.servers.iter().flat_map(|s| &s.shards));
    let mut report = RunReport {
        modelled: None,
        simulated: false,
        elapsed_s,
        workers: reports,
        failed_workers: failed,
        pilot: status.pilot,
        policy: status.policy,
        sha256: status.sha256,
        config: status.config,
        swaps: status.swaps,
        servers: status.servers.into_iter().map(Into::into).collect(),
        members: status.workers,
        model_len: model.len(),
        model_version,
        model_file: Some(model_file),
        started_unix_s: started.as_secs_f64(),
        watch: points.clone(),
        final_accuracy: final_score.map(|s| s.0),
        best_accuracy: points.iter().filter_map(|p| p.accuracy).reduce(f32::max),
        final_loss: final_score.and_then(|s| s.1),
        best_loss: points.iter().filter_map(|p| p.loss).reduce(f32::min),
        time_to_target_s: time_to_target,
        staleness,
        plots: Vec::new(),
        phases: crate::lab::report::phases(&points),
        failovers: crate::lab::report::failovers(&points),
        coordinator_restarts,
    };
    match crate::lab::plots::write_all(&report, dir) {
        Ok(files) => report.plots = files,
        Err(e) => tracing::warn!("plots not written: {e}"),
    }
    let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
    let path = dir.join("report.json");
    crate::checkpoint::write_file(&path, &json).map_err(io(format!("cannot write {}", path.display())))?;
    Ok(report)
}

/// The live line's account of a look; `text`: the model is the language model, scored on
/// held-out text (loss per byte, perplexity, next-byte accuracy).
fn describe_point(p: &WatchPoint, text: bool) -> String {
    let acc = match (p.accuracy, p.loss) {
        (Some(a), Some(l)) if text => {
            format!("validation loss {l:.3}  perplexity {:.1}  next byte {:.1}%  ", l.exp(), a * 100.0)
        }
        (Some(a), Some(l)) => format!("test accuracy {:.1}%  loss {l:.3}  ", a * 100.0),
        _ => String::new(),
    };
    let waits: Vec<String> = p.worker_waits_s.iter().map(|(w, s)| format!("w{w} {s:.1}s")).collect();
    // A policy that holds pushes makes their workers wait too: shown beside deferral.
    let held = match p.pushes_held {
        0 => String::new(),
        n => format!("  held pushes {n} (now {}, longest {:.1}s)", p.held_now, p.held_longest_s),
    };
    format!(
        "{}  {acc}deferred pulls {}  deferred wait: {}{held}",
        p.policy,
        p.pulls_deferred,
        waits.join(" ")
    )
}

/// The longest a reading of the cluster may take before the watcher skips it.
const WATCH_LIMIT: Duration = Duration::from_secs(10);

/// How long after the run was to stop (its target or time limit reached) workers still running
/// are killed: a stopped worker gives up what a policy keeps waiting within
/// [`syncopate_engine::worker::STOP_GRACE_NS`] and leaves, so only a wedged one is still there.
pub const STOP_BACKSTOP: Duration = Duration::from_secs(30);

/// How long the coordinator may go without answering the watcher before the launcher kills it
/// and starts it again (as it does one that died): a frozen coordinator stops the servers'
/// leases, and with them training.
pub const COORDINATOR_SILENT: Duration = Duration::from_secs(15);

/// The arguments a coordinator that died is started again with: the first one's, with each
/// flag of `pins` at the value given (`--listen` at the address it had, so that servers and
/// workers find it; metrics and the dashboard where they were, so `cluster.json` stays true),
/// and never resuming from a checkpoint, since the servers that ran on hold newer state.
fn restart_args(first: &[String], pins: &[(&str, String)]) -> Vec<String> {
    let mut out = Vec::with_capacity(first.len());
    let mut it = first.iter();
    while let Some(a) = it.next() {
        if a == "--resume" {
            it.next();
        } else if let Some((flag, value)) = pins.iter().find(|p| p.0 == a) {
            it.next();
            out.extend([flag.to_string(), value.clone()]);
        } else {
            out.push(a.clone());
        }
    }
    out
}

/// The longest the watcher waits for the model's parameters before it skips a reading.
const WATCH_READ_LIMIT: Duration = Duration::from_secs(5);

/// Reads the cluster's counters and, with an evaluator, scores the model; returns the point and
/// the model it scored.
async fn watch(
    op: &Operator,
    evaluator: Option<&Evaluator>,
    t_s: f64,
) -> Result<(WatchPoint, Option<Vec<f32>>), NodeError> {
    let status = op.status().await?;
    let shards: Vec<&ShardStatus> = status.servers.iter().flat_map(|s| &s.shards).collect();
    let mut point = WatchPoint::of_shards(t_s, &shards);
    point.lost_servers = status.lost_servers.clone();
    point.checkpoint_error = status.checkpoint_error.clone();
    point.server_bytes = status.servers.iter().map(|s| s.bytes_sent + s.bytes_received).sum();
    // A script scores its own model and reports it; the latest report stands for the model now.
    if let Some(r) = status.score {
        point.accuracy = Some(r.score.accuracy);
        point.loss = r.score.loss;
    }
    if let Some(e) = evaluator {
        // A server that dies mid-read would hold the watcher until its connection times out
        // (the peer timeout): a read that takes longer than this is skipped instead.
        let Ok(read) = tokio::time::timeout(WATCH_READ_LIMIT, op.read_model()).await else {
            return Ok((point, None));
        };
        let (model, _) = read?;
        if model.len() != e.param_len() {
            // Not every shard exists yet (workers are still joining).
            return Ok((point, None));
        }
        let score = tokio::task::block_in_place(|| e.evaluate(&model));
        point.accuracy = Some(score.accuracy);
        point.loss = Some(score.loss);
        // The coordinator keeps it for `policy status` and the dashboard; a refusal (a score
        // out of range) or a lost coordinator costs the watcher nothing.
        let reported =
            ModelScore { iteration: point.iterations, accuracy: score.accuracy, loss: Some(score.loss) };
        if let Ok(Err(e)) = tokio::time::timeout(WATCH_READ_LIMIT, op.report_evaluation(reported)).await {
            tracing::debug!("the evaluation was not reported to the coordinator: {e}");
        }
        return Ok((point, Some(model)));
    }
    Ok((point, None))
}

fn write_private_json<T: Serialize>(path: &Path, value: &T) -> Result<(), NodeError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let json = serde_json::to_vec_pretty(value).expect("serializes");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&json))
        .map_err(io(format!("cannot write {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::{flags_as_env, restart_args};

    #[test]
    fn a_restarted_coordinator_keeps_its_addresses_and_does_not_resume() {
        let first: Vec<String> = [
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--dashboard",
            "127.0.0.1:0",
            "--resume",
            "ckpt",
            "--policy",
            "bsp",
        ]
        .map(String::from)
        .to_vec();
        let pins = [
            ("--listen", "127.0.0.1:7000".to_string()),
            ("--metrics-listen", "127.0.0.1:9090".to_string()),
            ("--dashboard", "127.0.0.1:8080".to_string()),
        ];
        assert_eq!(
            restart_args(&first, &pins),
            [
                "coordinator",
                "--listen",
                "127.0.0.1:7000",
                "--metrics-listen",
                "127.0.0.1:9090",
                "--dashboard",
                "127.0.0.1:8080",
                "--policy",
                "bsp",
            ]
        );
        // A flag not pinned keeps its value.
        assert_eq!(restart_args(&first, &pins[..1])[3..5], ["--metrics-listen", "127.0.0.1:0"]);
    }

    #[test]
    fn worker_flags_become_the_environment_syncopate_worker_reads() {
        let args: Vec<String> = ["--coordinator", "127.0.0.1:9", "--slow-factor", "3", "--jitter-ms", "5:1"]
            .map(String::from)
            .into();
        let env = flags_as_env(&args);
        let want = [
            ("SYNCOPATE_COORDINATOR", "127.0.0.1:9"),
            ("SYNCOPATE_SLOW_FACTOR", "3"),
            ("SYNCOPATE_JITTER_MS", "5:1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(env, want);
    }
}
