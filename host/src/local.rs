//! `syncopate local`: a whole cluster on this machine, each role a separate process on
//! loopback, started in order (coordinator, servers, workers) and stopped cleanly.
//!
//! Everything the run produces goes in its run directory: the generated TLS certificate,
//! `cluster.json` (address, CA, token and process ids, for `syncopate policy swap|status`),
//! one log per process under `logs/`, each worker's report under `workers/`, the final model
//! (`model.bin`, little-endian `f32`) and `report.json`. Children are killed if this process
//! stops early, so a run never leaves processes behind.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use crate::net::proto::ClusterStatus;
use crate::net::tls::{ClusterFile, TlsFiles, Token};
use crate::operator::Operator;
use crate::worker::WorkerReport;
use crate::NodeError;

/// How to run a local cluster. Role arguments are passed through to the child processes.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// The `syncopate` executable.
    pub exe: PathBuf,
    /// Where the run's files go.
    pub run_dir: PathBuf,
    /// Servers.
    pub servers: u32,
    /// Workers.
    pub workers: u32,
    /// Arguments for the coordinator (policy, shards, training settings).
    pub coordinator_args: Vec<String>,
    /// Arguments every worker gets (workload, iterations...).
    pub worker_args: Vec<String>,
    /// Extra arguments for particular workers (a slow one, say).
    pub per_worker_args: Vec<(u32, Vec<String>)>,
}

/// What `report.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LocalReport {
    /// Wall-clock seconds from start to the model being read.
    pub elapsed_s: f64,
    /// Reports of the workers that finished.
    pub workers: Vec<WorkerReport>,
    /// Workers that did not finish, with how they ended.
    pub failed_workers: Vec<(u32, String)>,
    /// The cluster's state at the end (policy, shards, counters).
    pub status: ClusterStatus,
    /// Parameters in the model.
    pub model_len: usize,
    /// The fewest optimizer steps of any shard.
    pub model_version: u64,
    /// Where the model was saved.
    pub model_file: PathBuf,
}

struct Proc {
    name: String,
    child: Child,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let what = what.into();
    move |source| NodeError::Io { what, source }
}

impl Proc {
    fn spawn(exe: &Path, dir: &Path, name: &str, args: &[String], token: &Token) -> Result<Self, NodeError> {
        let log = dir.join("logs").join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(io(format!("cannot create {}", log.display())))?;
        let err = out.try_clone().map_err(io("log file"))?;
        let child = Command::new(exe)
            .args(args)
            .env("SYNCOPATE_TOKEN", token.secret())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("cannot start {} {name}", exe.display())))?;
        Ok(Proc { name: name.to_string(), child })
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
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
pub async fn run(opts: LocalOptions) -> Result<LocalReport, NodeError> {
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
    args.extend([opts.servers.to_string(), "--workers".into(), opts.workers.to_string()]);
    args.extend(["--ready-file".into(), ready.display().to_string()]);
    args.extend(["--tls-dir".into(), tls_dir.clone()]);
    args.extend(opts.coordinator_args.iter().cloned());
    let mut coordinator = Proc::spawn(&opts.exe, dir, "coordinator", &args, &token)?;
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
    for s in 0..opts.servers {
        let args: Vec<String> =
            vec!["server".into(), "--coordinator".into(), addr.clone(), "--tls-dir".into(), tls_dir.clone()];
        servers.push(Proc::spawn(&opts.exe, dir, &format!("server-{s}"), &args, &token)?);
    }
    let mut workers = Vec::new();
    for w in 0..opts.workers {
        let report = dir.join("workers").join(format!("worker-{w}.json"));
        let mut args: Vec<String> =
            vec!["worker".into(), "--coordinator".into(), addr.clone(), "--id".into()];
        args.extend([w.to_string(), "--ca".into(), tls.ca.display().to_string()]);
        args.extend(["--report".into(), report.display().to_string()]);
        args.extend(opts.worker_args.iter().cloned());
        for (_, extra) in opts.per_worker_args.iter().filter(|(i, _)| *i == w) {
            args.extend(extra.iter().cloned());
        }
        workers.push(Proc::spawn(&opts.exe, dir, &format!("worker-{w}"), &args, &token)?);
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
    };
    let cluster_path = dir.join("cluster.json");
    write_private_json(&cluster_path, &cluster)?;
    eprintln!(
        "cluster up: coordinator {addr}, {} servers, {} workers (logs in {})",
        opts.servers,
        opts.workers,
        dir.join("logs").display()
    );

    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for (w, p) in workers.iter_mut().enumerate() {
        let status = tokio::select! {
            s = p.child.wait() => s.map_err(io("waiting for a worker"))?,
            _ = tokio::signal::ctrl_c() => return Err(NodeError::Lost("interrupted; the cluster was stopped".into())),
        };
        let file = dir.join("workers").join(format!("worker-{w}.json"));
        let report = std::fs::read(&file).ok().and_then(|b| serde_json::from_slice::<WorkerReport>(&b).ok());
        match (status.success(), report) {
            (true, Some(r)) => {
                eprintln!(
                    "worker {w} finished: {} iterations, waited {:.2} s",
                    r.iterations,
                    r.wait_ns as f64 / 1e9
                );
                reports.push(r);
            }
            _ => {
                let how = describe(status);
                eprintln!("worker {w} {how}; last log lines:\n{}", log_tail(dir, &p.name, 5));
                failed.push((w as u32, how));
            }
        }
    }
    for s in &mut servers {
        if let Ok(Some(status)) = s.child.try_wait() {
            return Err(NodeError::Lost(format!(
                "{} {}:\n{}",
                s.name,
                describe(status),
                log_tail(dir, &s.name, 10)
            )));
        }
    }

    let operator = Operator::connect(&cluster.access()).await?;
    let (model, model_version) = operator.read_model().await?;
    let status = operator.status().await?;
    let model_file = dir.join("model.bin");
    std::fs::write(&model_file, crate::net::wire::f32_bytes(&model))
        .map_err(io(format!("cannot write {}", model_file.display())))?;
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
    let report = LocalReport {
        elapsed_s,
        workers: reports,
        failed_workers: failed,
        status,
        model_len: model.len(),
        model_version,
        model_file,
    };
    let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
    let path = dir.join("report.json");
    std::fs::write(&path, json).map_err(io(format!("cannot write {}", path.display())))?;
    Ok(report)
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
