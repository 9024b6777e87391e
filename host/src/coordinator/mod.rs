//! The coordinator role (`syncopate coordinator`): membership, the cluster's policy, hot swaps
//! and shutdown.
//!
//! Servers register and get ids, the cluster settings and the policy module; workers register
//! once every expected server is in and get an id and the map of shards to servers. A worker is
//! told apart from a lost one by its `Leaving` message: a lost worker (its connection failed or
//! went silent for the peer timeout) is logged and shown in the status; the servers make it
//! leave their shards themselves, so no barrier waits for it.
//!
//! A hot swap is two-phase: every server prepares the module off the hot path (checks its
//! sha256, compiles it, starts it on each of its shards' configurations); only if all succeed
//! does every server commit, each switching its shards when the commit arrives (the agreed
//! point). If any server cannot load it, all abort and the operator is told which and why.
//!
//! The coordinator keeps no state that the servers do not hold too: restarted at the same
//! address while they run on, it rebuilds the cluster from what they tell it (`rebuild.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use syncopate_policy_sdk::abi::WorkerId;
use tokio::sync::watch;

use crate::net::proto::{
    AdmissionKey, Asker, ClusterSettings, ClusterStatus, CoordError, CoordRequest, CoordResponse, Hello,
    LeaseEnd, PeerKind, PolicyBlob, ReportedScore, Role, ServerCommand, ServerFailure, ServerReply,
    ShardPlace, Ticket, Unwelcome, Welcome, WorkerNotice, WorkerStatus,
};
use crate::net::tls::{TlsFiles, Token};
use crate::net::wire::{self, Limits};
use crate::net::{self, close};
use crate::runtime::PolicyRuntime;
use crate::shard::{OptimizerConfig, Partition, PushWeight};
use crate::NodeError;
use syncopate_engine::coordinator::{
    Answer, CheckpointOutcome, Command, CommandError, CoordOutput, CoordinatorConfig, CoordinatorMachine,
    Record, Refusal, Replacement, SwapOutcome,
};

mod rebuild;

/// A policy module with its configuration, as the cluster runs it.
#[derive(Clone, Debug)]
pub struct PolicySource {
    /// A label (file name or `builtin:NAME`).
    pub label: String,
    /// The module's bytes.
    pub wasm: Vec<u8>,
    /// Configuration for every shard.
    pub config: Vec<(String, String)>,
    /// Per-shard overrides `(shard, key, value)`.
    pub overrides: Vec<(u32, String, String)>,
}

impl PolicySource {
    /// The blob that describes it on the wire.
    pub fn blob(&self) -> PolicyBlob {
        PolicyBlob {
            label: self.label.clone(),
            sha256: Sha256::digest(&self.wasm).into(),
            config: self.config.clone(),
            overrides: self.overrides.clone(),
        }
    }

    /// The policy a blob describes, with its module's bytes (checked against the blob's
    /// sha256 by the caller).
    pub fn from_blob(blob: &PolicyBlob, wasm: Vec<u8>) -> Self {
        PolicySource {
            label: blob.label.clone(),
            wasm,
            config: blob.config.clone(),
            overrides: blob.overrides.clone(),
        }
    }
}

/// How to run a coordinator.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Certificates.
    pub tls: TlsFiles,
    /// The cluster token.
    pub token: Token,
    /// The token operators need (the cluster token when `None`).
    pub operator_token: Option<Token>,
    /// Servers to wait for before workers may register.
    pub servers: u32,
    /// Workers to wait for before training starts (0: no start barrier). Later workers join
    /// a running cluster.
    pub workers: u32,
    /// Shards the model is split into.
    pub shards: u32,
    /// The policy to start with.
    pub policy: PolicySource,
    /// The servers' optimizer.
    pub optimizer: OptimizerConfig,
    /// Local steps and the outer optimizer the shards start with.
    pub local_sgd: crate::shard::LocalSgdConfig,
    /// The codecs workers push in and shards answer pulls in, until policies set others.
    pub codecs: (crate::shard::Codec, crate::shard::Codec),
    /// Weight of pushes the policy does not weigh.
    pub push_weight: PushWeight,
    /// Seed of the policies' random sources.
    pub seed: u64,
    /// A silent peer is dropped after this long.
    pub peer_timeout: Duration,
    /// How long every live worker may wait on a shard's policy before that is the rule's
    /// failure (zero: never; see [`crate::shard::SupervisorConfig::no_progress_ns`]).
    pub no_progress: Duration,
    /// How long workers wait for all servers to register, and the start barrier for all
    /// `workers` after the first ([`DEFAULT_STARTUP_TIMEOUT_S`] by default).
    pub startup_timeout: Duration,
    /// Worker ids are `0..max_workers` ([`crate::net::proto::DEFAULT_MAX_WORKERS`] by default).
    pub max_workers: u32,
    /// Where to write the bound address once listening (for scripts and `local`).
    pub ready_file: Option<PathBuf>,
    /// Where to write checkpoint rounds ([`crate::checkpoint`]): every `checkpoint_every` and at
    /// shutdown. `None`: no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Time between checkpoint rounds (`None`: only at shutdown).
    pub checkpoint_every: Option<Duration>,
    /// A checkpoint directory to resume from: the newest intact round there restores every
    /// shard, and its policy (as swapped at the time) replaces `policy`.
    pub resume: Option<PathBuf>,
    /// Backups per shard (0 or 1; 1 needs at least two servers).
    pub replicas: u32,
    /// A cluster policy to run (the autopilot, say): its label, module bytes and
    /// configuration.
    pub pilot: Option<PolicySource>,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<crate::metrics::MetricsOptions>,
    /// Where to serve the live dashboard, if anywhere.
    pub dashboard: Option<crate::dashboard::DashboardOptions>,
}

/// The default of [`CoordinatorOptions::startup_timeout`], in seconds.
pub const DEFAULT_STARTUP_TIMEOUT_S: u64 = 60;

struct State {
    /// By server id: the connection it registered on (`None` for a server a restarted
    /// coordinator never heard from again, or refused). Its address is the machine's.
    conns: Vec<Option<quinn::Connection>>,
    worker_conns: BTreeMap<WorkerId, quinn::Connection>,
    /// The decisions: server ids and leases, the shard map, failover, worker ids.
    machine: CoordinatorMachine,
    policy: PolicySource,
    /// The policies that ran before, oldest first, each with whether it failed while it ran
    /// (a rollback returns only to one that did not).
    history: Vec<(PolicySource, bool)>,
    /// The hot swap under way: its module, which its `Prepare` commands carry.
    preparing: Option<Preparing>,
    /// Who waits for the hot swap under way to end.
    swap_waiter: Option<(u64, tokio::sync::oneshot::Sender<SwapOutcome>)>,
    /// The latest score a worker reported.
    score: Option<ReportedScore>,
    /// The latest score the launcher's evaluator reported ([`CoordRequest::Evaluated`]).
    evaluated: Option<crate::net::proto::ModelScore>,
    /// Per server id: how many times a restarted process has taken it (0 if never).
    incarnations: BTreeMap<u32, u32>,
    /// Who waits for the checkpoint round under way to end.
    checkpoint_waiter: Option<(u64, tokio::sync::oneshot::Sender<CheckpointOutcome>)>,
    /// The round the shards were restored from.
    restore: Option<PathBuf>,
    /// After a restart: the servers rejoining, until the cluster is rebuilt from them.
    rebuild: Option<rebuild::Rebuild>,
    /// The key workers' tickets are issued under: drawn at start, or taken back from the
    /// servers after a restart.
    admission_key: AdmissionKey,
    /// The shards' terms and the servers' addresses last recorded in the checkpoint directory
    /// ([`rebuild::TERMS_FILE`]).
    recorded: Record,
    /// Why the last checkpoint round was not taken, until one is.
    checkpoint_error: Option<String>,
    /// The cluster policy, if one runs.
    pilot: Option<syncopate_engine::pilot::Pilot>,
    /// Servers failed over since this process started.
    failovers: u64,
}

/// A hot swap's module, while the swap is under way.
#[derive(Clone)]
struct Preparing {
    swap: u64,
    blob: PolicyBlob,
    wasm: Vec<u8>,
    /// Whether the policy it replaces failed while it ran.
    outgoing_failed: bool,
}

struct Coordinator {
    opts: CoordinatorOptions,
    state: Mutex<State>,
    registered: watch::Sender<u32>,
    /// Set once a restarted coordinator has rebuilt the cluster from the rejoining servers.
    rebuilt: watch::Sender<bool>,
    /// Whether training has started: the machine's start barrier opened
    /// ([`CoordinatorMachine::worker_ready`]).
    started: watch::Sender<bool>,
    /// Every backup is attached (workers are welcomed only then, so a backup sees its shard's
    /// every op from the creation on).
    replicated: watch::Sender<bool>,
    swap_lock: tokio::sync::Mutex<()>,
    shutdown: watch::Sender<bool>,
    /// Set when a shutdown starts, so departures after it are not reported as losses.
    stopping: std::sync::atomic::AtomicBool,
    runtime: PolicyRuntime,
    /// The machine's clock starts here.
    epoch: std::time::Instant,
}

const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);
const CONTROL_LIMITS: Limits = Limits { max_header: 1 << 20, max_payload: 64 << 20 };

/// Runs a coordinator until an operator shuts the cluster down.
pub async fn run(opts: CoordinatorOptions) -> Result<(), NodeError> {
    if opts.servers == 0 || opts.shards == 0 {
        return Err(NodeError::Protocol("a cluster needs at least one server and one shard".into()));
    }
    if opts.replicas > 0 && opts.servers < 2 {
        return Err(NodeError::Protocol(format!(
            "--replicas {} needs at least two servers (a backup lives on another server than its shard)",
            opts.replicas
        )));
    }
    let mut opts = opts;
    let resumed = match opts.resume.clone() {
        Some(dir) => Some(resume_from(&dir, &mut opts)?),
        None => None,
    };
    let runtime = PolicyRuntime::new()?;
    // Refuse to start with a module the servers would refuse.
    let module = crate::node::compile(&runtime, opts.policy.label.clone(), opts.policy.wasm.clone()).await?;
    if module.kind() != syncopate_engine::runtime::ModuleKind::Shard {
        return Err(NodeError::Protocol(format!(
            "{} is {}: run it with --pilot, and give --policy a shard policy",
            module.display_name(),
            module.kind()
        )));
    }
    let pilot = match &opts.pilot {
        Some(p) => {
            let module = crate::node::compile(&runtime, p.label.clone(), p.wasm.clone()).await?;
            let kept =
                resumed.as_ref().and_then(|r| crate::checkpoint::read_pilot(&r.dir, &module.sha256_hex()));
            let pilot = match kept {
                Some(state) => {
                    syncopate_engine::pilot::Pilot::restore(&module, &p.config, opts.shards, 0, &state)?
                }
                None => syncopate_engine::pilot::Pilot::start(&module, &p.config, opts.shards, 0)?,
            };
            tracing::info!(pilot = module.display_name(), "cluster policy running");
            Some(pilot)
        }
        None => None,
    };
    let metrics = match &opts.metrics {
        Some(m) => Some(crate::metrics::bind(m).await?),
        None => None,
    };
    let dashboard = match &opts.dashboard {
        Some(d) => Some((crate::dashboard::bind(d).await?, d.every)),
        None => None,
    };
    let endpoint = net::tls::listen(
        opts.listen,
        opts.tls.server_config(opts.peer_timeout, net::window::receive_budget())?,
        opts.tls.client_config(opts.peer_timeout)?,
    )?;
    let bound =
        endpoint.local_addr().map_err(|source| NodeError::Io { what: "local address".into(), source })?;
    tracing::info!(%bound, servers = opts.servers, shards = opts.shards, policy = %opts.policy.label, "coordinator listening");
    if let Some(path) = &opts.ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bound.to_string())
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    }
    let (shutdown, mut stop) = watch::channel(false);
    let coord = Arc::new(Coordinator {
        state: Mutex::new(State {
            conns: Vec::new(),
            worker_conns: BTreeMap::new(),
            machine: {
                let mut m = CoordinatorMachine::new(CoordinatorConfig {
                    servers: opts.servers,
                    shards: opts.shards,
                    replicas: opts.replicas,
                    max_workers: opts.max_workers,
                    peer_timeout_ms: opts.peer_timeout.as_millis() as u64,
                    start: (opts.workers, opts.startup_timeout.as_millis() as u64),
                });
                m.set_model_len(resumed.as_ref().map(|r| r.manifest.model_len));
                m.set_swaps(resumed.as_ref().map_or(0, |r| r.manifest.swaps));
                m.set_next_round(resumed.as_ref().map_or(1, |r| r.manifest.round + 1));
                m
            },
            policy: opts.policy.clone(),
            history: Vec::new(),
            preparing: None,
            swap_waiter: None,
            score: None,
            evaluated: None,
            checkpoint_waiter: None,
            incarnations: BTreeMap::new(),
            restore: resumed.map(|r| r.dir),
            rebuild: None,
            admission_key: AdmissionKey(rand::random()),
            recorded: Record::default(),
            checkpoint_error: None,
            pilot,
            failovers: 0,
        }),
        registered: watch::channel(0).0,
        rebuilt: watch::channel(false).0,
        started: watch::channel(false).0,
        replicated: watch::channel(false).0,
        swap_lock: tokio::sync::Mutex::new(()),
        shutdown,
        stopping: Default::default(),
        runtime,
        epoch: std::time::Instant::now(),
        opts,
    });
    let accept = {
        let (endpoint, coord) = (endpoint.clone(), coord.clone());
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let coord = coord.clone();
                tokio::spawn(async move {
                    if let Ok(conn) = incoming.await {
                        coord.serve(conn).await;
                    }
                });
            }
        })
    };
    let periodic = coord.opts.checkpoint_every.filter(|_| coord.opts.checkpoint_dir.is_some()).map(|every| {
        let coord = coord.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if coord.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                let taken = coord.checkpoint().await;
                if let Err(e) = &taken {
                    tracing::warn!("checkpoint not taken: {e}");
                }
                // Before training starts there is nothing to take: not a failure.
                coord.lock().checkpoint_error = taken.err().filter(|e| !e.contains("has not started yet"));
            }
        })
    });
    let monitor = coord.monitors_leases().then(|| tokio::spawn(coord.clone().monitor()));
    let piloting = coord.lock().pilot.is_some().then(|| tokio::spawn(coord.clone().fly()));
    let metrics = metrics.map(|m| {
        let coord = coord.clone();
        crate::metrics::serve(
            m,
            Arc::new(move || {
                let (status, failovers) = (coord.own_status(), coord.lock().failovers);
                let figures = crate::metrics::exposition::CoordinatorFigures { failovers };
                Box::pin(std::future::ready(crate::metrics::exposition::coordinator(&status, figures)))
            }),
        )
    });
    let dashboard = dashboard.map(|(listener, every)| {
        crate::dashboard::serve(listener, Arc::new(DashboardControl(coord.clone())), every)
    });
    let _ = stop.wait_for(|s| *s).await;
    if let Some(d) = dashboard {
        d.abort();
    }
    if let Some(m) = metrics {
        m.abort();
    }
    if let Some(p) = piloting {
        p.abort();
    }
    if let Some(p) = periodic {
        p.abort();
    }
    if let Some(m) = monitor {
        m.abort();
    }
    accept.abort();
    endpoint.close(close::DONE.into(), b"cluster shut down");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
    tracing::info!("coordinator stopped");
    Ok(())
}

/// Reads the newest intact round of `dir` and makes `opts` run it: its policy, as swapped at
/// the time. The shard count must be the round's.
fn resume_from(
    dir: &std::path::Path,
    opts: &mut CoordinatorOptions,
) -> Result<crate::checkpoint::Round, NodeError> {
    let round =
        crate::checkpoint::latest(dir).map_err(|e| NodeError::Protocol(format!("cannot resume: {e}")))?;
    let m = &round.manifest;
    if m.shards != opts.shards {
        return Err(NodeError::Protocol(format!(
            "cannot resume: checkpoint round {} in {} has {} shards, this cluster is set up for {} (pass --shards {})",
            m.round,
            dir.display(),
            m.shards,
            opts.shards,
            m.shards
        )));
    }
    tracing::info!(
        round = m.round,
        dir = %round.dir.display(),
        policy = %m.policy,
        model_len = m.model_len,
        "resuming from a checkpoint (its policy replaces --policy)"
    );
    opts.policy = PolicySource {
        label: m.policy.clone(),
        wasm: round.wasm.clone(),
        config: m.config.clone(),
        overrides: m.overrides.clone(),
    };
    Ok(round)
}

/// A server that takes commands: its id, data address and connection.
type LiveServer = (u32, SocketAddr, quinn::Connection);

impl State {
    /// By server id: its data address and its connection, if it has one.
    fn servers(&self) -> Vec<(SocketAddr, Option<quinn::Connection>)> {
        self.machine.server_addrs().iter().copied().zip(self.conns.iter().cloned()).collect()
    }

    /// Server `server`'s connection, if it has one.
    fn conn(&self, server: u32) -> Option<&quinn::Connection> {
        self.conns.get(server as usize).and_then(Option::as_ref)
    }

    /// The servers not lost (failed over servers take no more commands).
    fn live_servers(&self) -> Vec<LiveServer> {
        let live = self.machine.live();
        self.servers()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| live.get(*i).copied().unwrap_or(true))
            .filter_map(|(i, (addr, conn))| Some((i as u32, addr, conn?)))
            .collect()
    }
}

/// Sends `cmd` (with `payload`) to server `i`, an error if it has no connection.
async fn command_server(
    servers: &[(SocketAddr, Option<quinn::Connection>)],
    i: u32,
    cmd: &ServerCommand,
    payload: &[u8],
) -> Result<Answer, CommandError> {
    match servers.get(i as usize) {
        Some((_, Some(c))) => command(c, cmd, payload).await,
        _ => Err(CommandError::NotConnected(i)),
    }
}

impl Coordinator {
    /// Takes a checkpoint round, as the machine runs it ([`syncopate_engine::coordinator::checkpoint`]):
    /// the round's folder and module are written first, then each shard's primary writes its
    /// snapshot there, then, only if every shard's was written, the manifest, last, and old
    /// rounds are pruned. No swap runs meanwhile (the machine refuses one; waiting here for a
    /// swap under way lets a round at shutdown follow it), so every shard of a round runs the
    /// policy the manifest names. Returns the round.
    async fn checkpoint(&self) -> Result<u64, String> {
        let Some(dir) = self.opts.checkpoint_dir.clone() else {
            return Err("no checkpoint directory is set".into());
        };
        // Held for the whole round: one round at a time, and none during a swap.
        let _no_swap = self.swap_lock.lock().await;
        let started = *self.started.borrow();
        let round = {
            let st = self.lock();
            if !started && st.restore.is_none() {
                return Err("training has not started yet".into());
            }
            st.machine.next_round()
        };
        let t = std::time::Instant::now();
        let folder = crate::checkpoint::round_dir(&dir, round);
        let wasm = self.lock().policy.wasm.clone();
        // The cluster policy's state, as it is now (a failure to export it is its failure, and
        // the round goes on without it: a resumed coordinator then starts it afresh).
        let pilot = self.lock().pilot.as_mut().and_then(|p| match p.export_state() {
            Ok(state) => Some((p.module().sha256_hex(), state)),
            Err(e) => {
                tracing::warn!("the cluster policy's state is not in round {round}: {e}");
                None
            }
        });
        let prepare = {
            let folder = folder.clone();
            tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&folder)
                    .map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
                crate::checkpoint::write_atomic(&folder.join("policy.wasm"), &wasm)
                    .map_err(|e| e.to_string())?;
                match pilot {
                    Some((sha, state)) => {
                        crate::checkpoint::write_pilot(&folder, &sha, &state).map_err(|e| e.to_string())
                    }
                    None => Ok(()),
                }
            })
        };
        prepare.await.map_err(|e| e.to_string())??;
        let begun = {
            let mut st = self.lock();
            match st.machine.begin_checkpoint() {
                Ok(begun) => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    st.checkpoint_waiter = Some((begun, tx));
                    let blob = st.policy.blob();
                    let manifest = crate::checkpoint::Manifest {
                        format: crate::checkpoint::MANIFEST_FORMAT,
                        round: begun,
                        taken_unix_ms: crate::checkpoint::unix_ms(),
                        policy: blob.label,
                        policy_sha256: blob.sha256.iter().map(|b| format!("{b:02x}")).collect(),
                        config: blob.config,
                        overrides: blob.overrides,
                        swaps: st.machine.swaps(),
                        shards: self.opts.shards,
                        model_len: st.machine.model_len().unwrap_or(0),
                    };
                    Ok((begun, manifest, rx))
                }
                Err(e) => Err(e.to_string()),
            }
        };
        let (begun, manifest, done) = match begun {
            // The swap lock keeps any other round from taking this one's number.
            Ok(b) if b.0 == round => b,
            Ok((other, ..)) => return Err(format!("round {other} began where round {round} was prepared")),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&folder);
                return Err(e);
            }
        };
        self.drive().await;
        let outcome = done.await.map_err(|_| format!("round {begun} was abandoned with the coordinator"))?;
        if let CheckpointOutcome::Abandoned(failed) = outcome {
            let _ = std::fs::remove_dir_all(&folder);
            let why: Vec<String> = failed.iter().map(|(shard, e)| format!("shard {shard}: {e}")).collect();
            return Err(format!("round {round} abandoned: {}", why.join("; ")));
        }
        let finish = {
            let (folder, dir) = (folder.clone(), dir.clone());
            tokio::task::spawn_blocking(move || {
                let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
                crate::checkpoint::write_atomic(&folder.join("manifest.json"), &json)
                    .map_err(|e| e.to_string())?;
                crate::checkpoint::prune(&dir);
                Ok::<_, String>(())
            })
        };
        finish.await.map_err(|e| e.to_string())??;
        tracing::info!(round, dir = %folder.display(), ms = t.elapsed().as_millis() as u64, "checkpoint taken");
        Ok(round)
    }

    /// The settings servers get; `st` is the state, locked by the caller.
    fn settings(&self, st: &State) -> ClusterSettings {
        ClusterSettings {
            shards: self.opts.shards,
            servers: self.opts.servers,
            optimizer: self.opts.optimizer,
            local_sgd: self.opts.local_sgd,
            pull_codec: self.opts.codecs.1,
            push_weight: self.opts.push_weight,
            seed: self.opts.seed,
            peer_timeout_ms: self.opts.peer_timeout.as_millis() as u64,
            restore: st.restore.as_ref().map(|p| p.display().to_string()),
            replicas: self.opts.replicas,
            max_workers: self.opts.max_workers,
            admission_key: st.admission_key,
            no_progress_ms: self.opts.no_progress.as_millis() as u64,
        }
    }

    /// What server `id` is welcomed with, and the policy module that goes with it; `st` is the
    /// state, locked by the caller.
    fn server_welcome(&self, st: &State, id: u32, replacing: bool) -> (Welcome, Vec<u8>) {
        let welcome = Welcome::Server {
            server: id,
            settings: self.settings(st),
            policy: st.policy.blob(),
            swaps: st.machine.swaps(),
            replacing,
        };
        (welcome, st.policy.wasm.clone())
    }

    /// A server registering with a full cluster: a process restarted in the place of a lost
    /// server, at that server's address, takes its id back
    /// ([`CoordinatorMachine::replace_server_at`]), holding nothing; its backups follow. Too soon
    /// (the old one not failed over yet, or a peer timeout not passed since), it is told to ask
    /// again ([`Welcome::NotYet`]). A server at another address is refused: workers reach a
    /// server at the address they were given.
    fn replacement(&self, st: &mut State, conn: &quinn::Connection, addr: SocketAddr) -> (Welcome, Vec<u8>) {
        match st.machine.replace_server_at(self.now_ns(), addr) {
            Ok(id) => {
                st.conns[id as usize] = Some(conn.clone());
                *st.incarnations.entry(id).or_default() += 1;
                tracing::warn!(server = id, %addr, "a restarted server takes its id back, holding nothing; it gets new backups");
                self.server_welcome(st, id, true)
            }
            Err(Replacement::NotAtLostAddress { lost }) => {
                let refused = Unwelcome::NotAtLostAddress { servers: self.opts.servers, lost };
                (Welcome::Refused(refused), Vec::new())
            }
            Err(Replacement::Refused(e @ Refusal::NotYet { .. })) => (Welcome::NotYet(e), Vec::new()),
            Err(Replacement::Refused(e)) => (Welcome::Refused(Unwelcome::Refused(e)), Vec::new()),
        }
    }

    /// The machine's clock: nanoseconds since this coordinator started.
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Carries out what the machine decided, until it has nothing more: the commands of each
    /// decision go to their servers together (their results go back to it), notices to the
    /// workers.
    async fn drive(&self) {
        loop {
            let outputs: Vec<CoordOutput> = {
                let mut st = self.lock();
                std::iter::from_fn(|| st.machine.poll_output()).collect()
            };
            if outputs.is_empty() {
                return;
            }
            // The commands decided together go out together; their results go back in order.
            let mut commands = Vec::new();
            for out in outputs {
                match out {
                    CoordOutput::Command { id, server, command } => commands.push((id, server, command)),
                    other => self.happened(other).await,
                }
            }
            let results =
                futures::future::join_all(commands.iter().map(|&(_, server, c)| self.carry_out(server, c)))
                    .await;
            let record = {
                let mut st = self.lock();
                for ((id, ..), result) in commands.into_iter().zip(results) {
                    st.machine.command_done(id, result);
                }
                let record = st.machine.record();
                let recording = self.opts.checkpoint_dir.is_some();
                (recording && record != st.recorded).then(|| (record, st.admission_key))
            };
            // A promotion's term is recorded before the workers hear of the move.
            if let Some((record, key)) = record {
                self.record(record, key).await;
            }
        }
    }

    /// Sends server `server` a command of the machine's, and logs what came of it.
    async fn carry_out(&self, server: u32, what: Command) -> Result<Answer, CommandError> {
        let (servers, preparing, raise, incarnation) = {
            let st = self.lock();
            let incarnation = match what {
                Command::AttachBackup { backup, .. } => st.incarnations.get(&backup).copied().unwrap_or(0),
                _ => 0,
            };
            // Only a preparation carries the module, and only a commit the levelling.
            let preparing = matches!(what, Command::Prepare { .. }).then(|| st.preparing.clone()).flatten();
            let raise = match what {
                Command::Commit { swap } => st.machine.levelling(swap).to_vec(),
                _ => Vec::new(),
            };
            (st.servers(), preparing, raise, incarnation)
        };
        let (cmd, payload) = match what {
            Command::Promote { shard } => (ServerCommand::Promote { shard }, Vec::new()),
            Command::DropBackup { shard } => (ServerCommand::DropBackup { shard }, Vec::new()),
            Command::AttachBackup { shard, backup } => match servers.get(backup as usize) {
                Some((addr, _)) => {
                    (ServerCommand::AttachBackup { shard, addr: *addr, incarnation }, Vec::new())
                }
                None => return Err(CommandError::NotRegistered(backup)),
            },
            Command::Prepare { swap } => match preparing {
                Some(p) if p.swap == swap => (ServerCommand::Prepare { swap, policy: p.blob }, p.wasm),
                _ => return Err(CommandError::NoModule(swap)),
            },
            Command::Commit { swap } => (ServerCommand::Commit { swap, raise }, Vec::new()),
            Command::Abort { swap } => (ServerCommand::Abort { swap }, Vec::new()),
            Command::Snapshot { round, shard } => match &self.opts.checkpoint_dir {
                Some(dir) => {
                    let dir = crate::checkpoint::round_dir(dir, round).display().to_string();
                    (ServerCommand::Checkpoint { dir, shard }, Vec::new())
                }
                None => return Err(CommandError::NoCheckpointDirectory),
            },
        };
        let result = command_server(&servers, server, &cmd, &payload).await;
        match (&result, what) {
            (Ok(_), Command::Promote { shard }) => {
                tracing::warn!(shard, to = server, "failover: backup promoted to primary")
            }
            (Err(e), Command::Promote { shard }) => {
                tracing::error!(shard, "the backup on server {server} could not take over: {e}")
            }
            (Ok(_), Command::DropBackup { shard }) => {
                tracing::warn!(shard, "its backup was on the lost server; it runs without one")
            }
            (Err(e), Command::AttachBackup { shard, backup }) => {
                tracing::error!(shard, "no backup on server {backup}: {e}")
            }
            (Err(e), Command::Prepare { swap } | Command::Commit { swap }) => {
                tracing::warn!(swap, server, "swap not carried out: {e}")
            }
            (Err(e), Command::Snapshot { round, shard }) => {
                tracing::warn!(round, shard, server, "snapshot not written: {e}")
            }
            _ => {}
        }
        result
    }

    /// What the machine says happened: logged, and passed on to whom it concerns.
    async fn happened(&self, out: CoordOutput) {
        match out {
            CoordOutput::Command { .. } => unreachable!("commands are carried out by `drive`"),
            CoordOutput::Moved { shard, server } => {
                self.notify_workers(WorkerNotice::Moved { shard, server }).await
            }
            CoordOutput::Started { ready, want } => {
                if ready < want {
                    tracing::warn!(
                        "only {ready} of {want} workers joined within {:?}; starting anyway",
                        self.opts.startup_timeout
                    );
                }
                self.started.send_replace(true);
            }
            CoordOutput::Replicated => {
                tracing::info!(shards = self.opts.shards, "backups attached");
                self.replicated.send_replace(true);
            }
            CoordOutput::Rebuilt => self.rebuilt_out(),
            CoordOutput::ServerLost { server } => {
                let addr = {
                    let mut st = self.lock();
                    st.failovers += 1;
                    st.machine.server_addrs().get(server as usize).copied()
                };
                tracing::error!(server, addr = ?addr, "server lost (its lease lapsed); failing over");
            }
            CoordOutput::ShardLost { shard, server } => {
                tracing::error!(shard, server, "shard lost with its server: no backup could take over")
            }
            CoordOutput::NewBackup { shard, primary, backup } => {
                tracing::warn!(shard, primary, backup, "re-replicated: a new backup")
            }
            CoordOutput::NoBackupPlace { shard } => {
                tracing::warn!(shard, "no live server to keep a new backup on; the shard runs without one")
            }
            CoordOutput::FailoverDone { server } => tracing::warn!(server, "failover done"),
            CoordOutput::SwapDone { swap, outcome } => {
                let mut st = self.lock();
                let preparing = st.preparing.take_if(|p| p.swap == swap);
                if let (Some(p), SwapOutcome::Committed | SwapOutcome::Partial(_)) = (preparing, &outcome) {
                    let new = PolicySource::from_blob(&p.blob, p.wasm);
                    let old = std::mem::replace(&mut st.policy, new);
                    st.history.push((old, p.outgoing_failed));
                    // Only the last few are kept: a rollback goes back one or two.
                    if st.history.len() > 8 {
                        st.history.remove(0);
                    }
                }
                if let Some((_, waiter)) = st.swap_waiter.take_if(|w| w.0 == swap) {
                    let _ = waiter.send(outcome);
                }
            }
            CoordOutput::CheckpointDone { round, outcome } => {
                if let Some((_, waiter)) = self.lock().checkpoint_waiter.take_if(|w| w.0 == round) {
                    let _ = waiter.send(outcome);
                }
            }
        }
    }

    /// Whether the lease monitor runs (with backups: without, a lost server has nothing to fail
    /// over to). It drives the machine's timers then.
    fn monitors_leases(&self) -> bool {
        self.opts.replicas > 0
    }

    /// Checks the servers' leases every 100 ms: the machine fails over those that lapsed.
    async fn monitor(self: Arc<Self>) {
        let tick = Duration::from_millis(100);
        let mut last = std::time::Instant::now();
        loop {
            tokio::time::sleep(tick).await;
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let now = std::time::Instant::now();
            // Time this process did not run (a starved or paused coordinator) is not counted
            // against the servers (`LeaseTable::credit`).
            let stalled = now.duration_since(last).saturating_sub(2 * tick);
            last = now;
            {
                let now_ns = self.now_ns();
                let mut st = self.lock();
                if !stalled.is_zero() {
                    // A starved or paused process delays every failover by as long: a second
                    // or more is worth a line in the log.
                    let ms = stalled.as_millis() as u64;
                    match ms >= 1000 {
                        true => tracing::warn!(ms, "the lease monitor did not run; lease clocks credited"),
                        false => tracing::debug!(ms, "monitor stalled; lease clocks credited"),
                    }
                    st.machine.credit_stall(now_ns, stalled.as_nanos() as u64);
                }
                st.machine.handle_timeout(now_ns);
            }
            self.drive().await;
        }
    }

    /// Sends every connected worker a notice.
    /// Runs the cluster policy: at its cadence, gathers every primary shard's sample (with the
    /// status), hands them to it, and carries out the swap it asks for as an operator's swap
    /// would be, telling it how that went. Ends when it is quarantined.
    async fn fly(self: Arc<Self>) {
        use syncopate_engine::pilot::PilotAction;
        loop {
            let due = match self.lock().pilot.as_ref().map(|p| (p.due(), p.is_quarantined())) {
                Some((_, true)) | None => return,
                Some((due, false)) => due,
            };
            let Some(due) = due else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            tokio::time::sleep(Duration::from_nanos(due.saturating_sub(self.now_ns()))).await;
            if !*self.started.borrow() {
                // Nothing to look at before training starts: the first figures come after it.
                let now = self.now_ns();
                if let Some(p) = self.lock().pilot.as_mut() {
                    p.observe(now, Vec::new());
                }
                continue;
            }
            let samples = match self.status().await {
                Ok(s) => s.servers.into_iter().flat_map(|sv| sv.shards).map(|sh| sh.sample).collect(),
                Err(e) => {
                    // A server that does not answer now: try again a cadence later, not at once
                    // (the machine's next look is still the one due).
                    tracing::warn!("the cluster policy's figures could not be gathered: {e}");
                    let cadence = self.lock().pilot.as_ref().map_or(1000, |p| p.cadence_ms());
                    tokio::time::sleep(Duration::from_millis(u64::from(cadence))).await;
                    continue;
                }
            };
            let now = self.now_ns();
            let actions = match self.lock().pilot.as_mut() {
                Some(p) => p.observe(now, samples),
                None => return,
            };
            for action in actions {
                let PilotAction::Swap { policy, config, reason } = action;
                tracing::warn!(policy, %reason, "the cluster policy swaps the shard policy");
                let outcome = match syncopate_engine::builtin::wasm(&policy) {
                    Some(wasm) => {
                        let source = PolicySource {
                            label: format!("builtin:{policy}"),
                            wasm: wasm.to_vec(),
                            config,
                            overrides: Vec::new(),
                        };
                        match self.swap(source.blob(), source.wasm).await {
                            CoordResponse::Swapped { .. } => Ok(()),
                            CoordResponse::SwappedPartly { failed, .. } => {
                                Err(format!("not everywhere: {}", crate::net::proto::listed(&failed)))
                            }
                            CoordResponse::Error(e) => Err(e.to_string()),
                            other => Err(format!("unexpected answer {other:?}")),
                        }
                    }
                    None => Err(format!("no built-in policy `{policy}`")),
                };
                let now = self.now_ns();
                if let Some(p) = self.lock().pilot.as_mut() {
                    p.swapped(now, &policy, outcome);
                }
            }
        }
    }

    async fn notify_workers(&self, notice: WorkerNotice) {
        let conns: Vec<_> = self.lock().worker_conns.values().cloned().collect();
        let notices = conns.iter().map(|c| {
            let notice = notice.clone();
            async move {
                let mut send = c.open_uni().await.ok()?;
                net::answer(&mut send, &notice, &[]).await.ok()
            }
        });
        futures::future::join_all(notices).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("coordinator state not poisoned")
    }

    async fn serve(self: Arc<Self>, conn: quinn::Connection) {
        let addr = conn.remote_address();
        let Some((hello, mut send)) =
            net::accept_hello(&conn, &self.opts.token, self.opts.operator_token.as_ref()).await
        else {
            return;
        };
        let Hello { role, .. } = hello;
        match role {
            Role::Server { data_addr, rejoin: Some(id) } => {
                let welcome = match self.clone().rejoin_server(id, data_addr, &conn).await {
                    Ok(()) => self.server_welcome(&self.lock(), id, false),
                    Err(reason) => {
                        tracing::warn!(server = id, %data_addr, "a rejoining server refused: {reason}");
                        return net::refuse(&mut send, Unwelcome::Rejoin(reason)).await;
                    }
                };
                if net::answer(&mut send, &welcome.0, &welcome.1).await.is_err() {
                    return;
                }
                self.serve_server(&conn, id, data_addr).await;
            }
            Role::Server { data_addr, rejoin: None } => {
                let (welcome, wasm) = {
                    let mut st = self.lock();
                    // Until a restarted coordinator has rebuilt the cluster, its machine knows
                    // no server; after, a server restarted in a lost one's place is its to take.
                    if st.rebuild.is_some() && !*self.rebuilt.borrow() {
                        (Welcome::Refused(Unwelcome::Rebuilding), Vec::new())
                    } else {
                        // Its lease starts with its first heartbeat (see FIRST_HEARTBEAT_MS).
                        match st.machine.register_server(self.now_ns(), data_addr) {
                            Ok(id) => {
                                st.conns.push(Some(conn.clone()));
                                tracing::info!(server = id, %data_addr, "server registered");
                                self.server_welcome(&st, id, false)
                            }
                            // A full cluster: a restart in a lost server's place, at its address.
                            Err(Refusal::ServersFull(_)) => self.replacement(&mut st, &conn, data_addr),
                            Err(refusal) => (Welcome::Refused(Unwelcome::Refused(refusal)), Vec::new()),
                        }
                    }
                };
                // The id this server was given: two servers registering at once must not
                // read each other's from the count.
                let server = match welcome {
                    Welcome::Server { server, .. } => server,
                    _ => u32::MAX,
                };
                let replacing = matches!(welcome, Welcome::Server { replacing: true, .. });
                if let Welcome::Refused(reason) = welcome {
                    return net::refuse(&mut send, reason).await;
                }
                if net::answer(&mut send, &welcome, &wasm).await.is_err() {
                    return;
                }
                if matches!(welcome, Welcome::NotYet(_)) {
                    // Until it has read the answer (it closes the connection then).
                    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
                    return;
                }
                if replacing {
                    // Its new backups (the machine planned them when it took the id back).
                    self.drive().await;
                } else {
                    // Once the last server is answered, the machine has the backups attached.
                    let answered = self.lock().machine.server_answered();
                    self.drive().await;
                    self.registered.send_modify(|n| *n = (*n).max(answered));
                }
                self.serve_server(&conn, server, data_addr).await;
            }
            Role::Worker { worker, model_len, .. } => {
                let welcome = self.welcome_worker(worker, model_len).await;
                let id = match &welcome {
                    Welcome::Worker { worker, .. } => Some(*worker),
                    _ => None,
                };
                if let Welcome::Refused(reason) = welcome {
                    return net::refuse(&mut send, reason).await;
                }
                if net::answer(&mut send, &welcome, &[]).await.is_err() {
                    return;
                }
                let Some(id) = id else { return };
                self.lock().worker_conns.insert(id, conn.clone());
                self.worker_loop(&conn, id).await;
                let mut st = self.lock();
                st.worker_conns.remove(&id);
                if st.machine.worker_disconnected(id)
                    && !self.stopping.load(std::sync::atomic::Ordering::SeqCst)
                {
                    tracing::warn!(worker = id, %addr, "worker lost: {}", conn.close_reason().map(|r| r.to_string()).unwrap_or_default());
                }
            }
            Role::Replica { .. } => net::refuse(&mut send, Unwelcome::WrongPlace(PeerKind::Replica)).await,
            Role::Operator => {
                if net::answer(&mut send, &Welcome::Accepted, &[]).await.is_err() {
                    return;
                }
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let (req, payload) = match wire::read_message::<CoordRequest>(&mut recv, &CONTROL_LIMITS)
                        .await
                    {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(%addr, "closing an operator connection that sent a bad frame: {e}");
                            conn.close(close::MALFORMED.into(), format!("malformed message: {e}").as_bytes());
                            return;
                        }
                    };
                    let stop = req == CoordRequest::Shutdown;
                    let answer = self.clone().operate(req, payload).await;
                    let _ = net::answer(&mut send, &answer, &[]).await;
                    if stop {
                        // Let the operator read the answer before the endpoint closes.
                        let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
                        let _ = self.shutdown.send(true);
                        return;
                    }
                }
            }
        }
    }

    /// A registered server's connection: its lease renewals, until it closes.
    async fn serve_server(&self, conn: &quinn::Connection, server: u32, data_addr: SocketAddr) {
        let heartbeats = async {
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                let limits = Limits { max_header: 4096, max_payload: 0 };
                let answer = match wire::read_message::<CoordRequest>(&mut recv, &limits).await {
                    Ok((CoordRequest::Heartbeat { server: s }, _)) if s == server => {
                        let now_ns = self.now_ns();
                        let mut st = self.lock();
                        // A process restarted under this id has taken it: this connection's
                        // process was failed over, and stays so.
                        let replaced = st.conn(server).is_some_and(|c| c.stable_id() != conn.stable_id());
                        match st.machine.renew(now_ns, s) {
                            _ if replaced => CoordResponse::LeaseEnded(LeaseEnd::Replaced),
                            Ok(()) => CoordResponse::Renewed { terms: st.machine.terms().to_vec() },
                            // Failed over: its shards have other primaries now.
                            Err(e) => CoordResponse::LeaseEnded(e.into()),
                        }
                    }
                    Ok(_) => CoordResponse::Error(CoordError::NotForRole(Asker::Server)),
                    Err(_) => continue,
                };
                let _ = net::answer(&mut send, &answer, &[]).await;
            }
        };
        let reason = tokio::select! {
            reason = conn.closed() => reason,
            () = heartbeats => conn.closed().await,
        };
        // A server that reconnected has a new connection: the old one's end is no loss.
        let current = self.lock().conn(server).is_some_and(|c| c.stable_id() == conn.stable_id());
        if current && !self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            tracing::error!(%data_addr, "server lost: {reason}; its shards are unavailable");
        }
    }

    async fn welcome_worker(&self, asked: Option<WorkerId>, model_len: u64) -> Welcome {
        let mut ready = self.registered.subscribe();
        let want = self.opts.servers;
        if tokio::time::timeout(self.opts.startup_timeout, ready.wait_for(|n| *n >= want)).await.is_err() {
            let have = *ready.borrow();
            let waited_ms = self.opts.startup_timeout.as_millis() as u64;
            return Welcome::Refused(Unwelcome::ServersMissing { have, want, waited_ms });
        }
        let _ = self.replicated.subscribe().wait_for(|r| *r).await;
        let mut st = self.lock();
        let id = match st.machine.admit_worker(asked, model_len) {
            Ok(id) => id,
            Err(refusal) => return Welcome::Refused(Unwelcome::Refused(refusal)),
        };
        let partition = Partition::even(model_len as usize, self.opts.shards);
        let shards = (0..self.opts.shards)
            .map(|s| {
                let r = partition.range(s);
                ShardPlace {
                    shard: s,
                    start: r.start as u64,
                    end: r.end as u64,
                    server: st.machine.places()[s as usize].primary,
                }
            })
            .collect();
        tracing::info!(worker = id, "worker registered");
        Welcome::Worker {
            worker: id,
            shards,
            servers: st.machine.server_addrs().to_vec(),
            peer_timeout_ms: self.opts.peer_timeout.as_millis() as u64,
            workers: self.opts.workers,
            optimizer: self.opts.optimizer,
            push_codec: self.opts.codecs.0,
            replicated: st.machine.places().iter().any(|p| p.backup.is_some()),
            ticket: Ticket::issue(&st.admission_key.0, id),
        }
    }

    async fn worker_loop(&self, conn: &quinn::Connection, id: WorkerId) {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let answer = match wire::read_message::<CoordRequest>(
                &mut recv,
                &Limits { max_header: 4096, max_payload: 0 },
            )
            .await
            {
                Ok((CoordRequest::Leaving { worker }, _)) if worker == id => {
                    self.lock().machine.worker_finished(id);
                    tracing::info!(worker = id, "worker finished");
                    CoordResponse::Ok
                }
                Ok((CoordRequest::Ready { worker }, _)) if worker == id => self.start_barrier(id).await,
                Ok((CoordRequest::Score { worker, score }, _)) if worker == id => {
                    if !(0.0..=1.0).contains(&score.accuracy) || score.loss.is_some_and(|l| !l.is_finite()) {
                        CoordResponse::Error(CoordError::BadScore)
                    } else {
                        let mut st = self.lock();
                        let count = st.score.map_or(0, |s| s.count) + 1;
                        st.score = Some(ReportedScore { worker: id, score, count });
                        tracing::info!(
                            worker = id,
                            iteration = score.iteration,
                            accuracy = score.accuracy,
                            "model scored"
                        );
                        CoordResponse::Ok
                    }
                }
                Ok(_) => CoordResponse::Error(CoordError::NotForRole(Asker::Worker)),
                Err(e) => {
                    tracing::warn!(worker = id, "closing a worker connection that sent a bad frame: {e}");
                    conn.close(close::MALFORMED.into(), format!("malformed message: {e}").as_bytes());
                    return;
                }
            };
            let _ = net::answer(&mut send, &answer, &[]).await;
        }
    }

    /// Worker `id` is ready: answered once the machine's start barrier opens (at once if it
    /// has). The machine decides when; this waits until its timer or another worker's ready.
    async fn start_barrier(&self, id: WorkerId) -> CoordResponse {
        let mut rx = self.started.subscribe();
        let open = {
            let now_ns = self.now_ns();
            self.lock().machine.worker_ready(now_ns, id)
        };
        self.drive().await;
        // With backups, the lease monitor drives the machine's timers every 100 ms (crediting a
        // stalled process first, so no lease lapses for the coordinator's own stall); without,
        // nothing else does, and the machine's only timer is the barrier's.
        let drives_timers = !self.monitors_leases();
        while !open && !*rx.borrow_and_update() {
            let due = drives_timers.then(|| self.lock().machine.poll_timeout()).flatten();
            match due.map(|t| Duration::from_nanos(t.saturating_sub(self.now_ns()))) {
                Some(wait) => {
                    let _ = tokio::time::timeout(wait, rx.changed()).await;
                }
                None => {
                    let _ = rx.changed().await;
                }
            }
            if drives_timers {
                let now_ns = self.now_ns();
                self.lock().machine.handle_timeout(now_ns);
                self.drive().await;
            }
        }
        CoordResponse::Ok
    }

    async fn operate(self: Arc<Self>, req: CoordRequest, payload: Vec<u8>) -> CoordResponse {
        match req {
            CoordRequest::Swap(blob) => self.swap(blob, payload).await,
            CoordRequest::Status => match self.status().await {
                Ok(s) => CoordResponse::Status(Box::new(s)),
                Err(e) => CoordResponse::Error(e),
            },
            CoordRequest::Shutdown => {
                tracing::info!("shutdown requested");
                if self.opts.checkpoint_dir.is_some() {
                    if let Err(e) = self.checkpoint().await {
                        tracing::warn!("no checkpoint at shutdown: {e}");
                    }
                }
                let servers: Vec<_> = self.lock().live_servers().into_iter().map(|(_, _, c)| c).collect();
                self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
                let stops = servers.iter().map(|c| command(c, &ServerCommand::Shutdown, &[]));
                for r in futures::future::join_all(stops).await {
                    if let Err(e) = r {
                        tracing::warn!("server did not confirm shutdown: {e}");
                    }
                }
                CoordResponse::Ok
            }
            CoordRequest::StopTraining => {
                tracing::info!(workers = self.lock().worker_conns.len(), "asking the workers to stop");
                self.notify_workers(WorkerNotice::Stop).await;
                CoordResponse::Ok
            }
            CoordRequest::Rollback => {
                let (target, tried) = {
                    let st = self.lock();
                    let current = st.policy.blob().sha256;
                    let target = st
                        .history
                        .iter()
                        .rev()
                        .find(|(p, failed)| !failed && p.blob().sha256 != current)
                        .map(|(p, _)| p.clone());
                    (target, st.history.len())
                };
                let Some(previous) = target else {
                    return CoordResponse::Error(match tried {
                        0 => CoordError::NoSwapYet,
                        _ => CoordError::NoGoodPolicy,
                    });
                };
                tracing::warn!(policy = %previous.label, "rolling back to the last policy that ran without failures");
                self.swap(previous.blob(), previous.wasm).await
            }
            CoordRequest::Leaving { .. }
            | CoordRequest::Ready { .. }
            | CoordRequest::Score { .. }
            | CoordRequest::Heartbeat { .. } => CoordResponse::Error(CoordError::NotForRole(Asker::Operator)),
            CoordRequest::Evaluated { score } => {
                if !(0.0..=1.0).contains(&score.accuracy) || score.loss.is_some_and(|l| !l.is_finite()) {
                    CoordResponse::Error(CoordError::BadScore)
                } else {
                    self.lock().evaluated = Some(score);
                    CoordResponse::Ok
                }
            }
        }
    }

    /// A hot swap to `blob`'s module (`wasm`): [`CoordResponse::Swapped`] when every shard
    /// switched, [`CoordResponse::SwappedPartly`] when the swap was committed but some shard
    /// could not switch, an error when none did.
    async fn swap(&self, blob: PolicyBlob, wasm: Vec<u8>) -> CoordResponse {
        match self.swap_to(blob, wasm).await {
            Ok(Ok((swap, shards))) => CoordResponse::Swapped { swap, shards },
            Ok(Err((swap, failed))) => CoordResponse::SwappedPartly { swap, failed },
            Err(e) => CoordResponse::Error(e),
        }
    }

    /// Whether the policy running now has failed since it started on any shard (failures,
    /// a backoff, a quarantine): such a policy is never rolled back to.
    async fn current_failed(&self) -> bool {
        let sha = self.lock().policy.blob().sha256;
        let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
        match self.status().await {
            Ok(s) => s.servers.iter().flat_map(|sv| &sv.shards).any(|sh| {
                sh.sha256 == hex && (sh.quarantined || sh.backoff_ms.is_some() || sh.policy_failures_now > 0)
            }),
            // Unknown: assume the worst, so a rollback never returns to it.
            Err(_) => true,
        }
    }

    #[allow(clippy::type_complexity)]
    async fn swap_to(
        &self,
        blob: PolicyBlob,
        wasm: Vec<u8>,
    ) -> Result<Result<(u64, u32), (u64, Vec<ServerFailure>)>, CoordError> {
        let _one_at_a_time = self.swap_lock.lock().await;
        let digest: [u8; 32] = Sha256::digest(&wasm).into();
        if digest != blob.sha256 {
            return Err(CoordError::Digest);
        }
        crate::node::compile(&self.runtime, blob.label.clone(), wasm.clone())
            .await
            .map_err(|e| CoordError::Module(e.to_string()))?;
        let outgoing_failed = self.current_failed().await;
        let (swap, done) = {
            let mut st = self.lock();
            let swap = st.machine.begin_swap()?;
            st.preparing = Some(Preparing { swap, blob: blob.clone(), wasm, outgoing_failed });
            let (tx, rx) = tokio::sync::oneshot::channel();
            st.swap_waiter = Some((swap, tx));
            (swap, rx)
        };
        self.drive().await;
        let outcome = done.await.map_err(|_| CoordError::Abandoned(swap))?;
        let named = |failed: Vec<(u32, CommandError)>| {
            let addrs = self.lock().machine.server_addrs().to_vec();
            failed
                .into_iter()
                .map(|(server, reason)| ServerFailure {
                    server,
                    addr: addrs.get(server as usize).copied(),
                    reason: reason.to_string(),
                })
                .collect::<Vec<_>>()
        };
        match outcome {
            SwapOutcome::Committed => {
                tracing::info!(swap, policy = %blob.label, "swap done on every server");
                Ok(Ok((swap, self.opts.shards)))
            }
            SwapOutcome::Refused(failed) => {
                let refused = CoordError::NoneSwitched(named(failed));
                tracing::warn!(swap, "swap to {} refused: {refused}", blob.label);
                Err(refused)
            }
            // Every server prepared it, each primary took the hand-over on trial, and a shard
            // that refuses it at the commit starts the module afresh: only a server that did not
            // answer (dead or cut off, its shards failed over to backups that follow the
            // record), or a module that cannot start at all, gets here.
            SwapOutcome::Partial(failed) => {
                let failed = named(failed);
                tracing::error!(
                    swap,
                    policy = %blob.label,
                    "swap committed, but not everywhere: {}",
                    crate::net::proto::listed(&failed)
                );
                Ok(Err((swap, failed)))
            }
        }
    }

    /// The cluster's status as this process knows it, without asking the servers (their part
    /// is left empty).
    fn own_status(&self) -> ClusterStatus {
        let st = self.lock();
        let blob = st.policy.blob();
        ClusterStatus {
            policy: blob.label,
            sha256: blob.sha256.iter().map(|b| format!("{b:02x}")).collect(),
            config: blob.config,
            swaps: st.machine.swaps(),
            servers: Vec::new(),
            workers: st
                .machine
                .workers()
                .iter()
                .map(|(&worker, w)| WorkerStatus { worker, connected: w.connected, finished: w.finished })
                .collect(),
            score: st.score,
            evaluated: st.evaluated,
            placement: st
                .machine
                .places()
                .iter()
                .enumerate()
                .map(|(k, p)| (k as u32, p.primary, p.backup))
                .collect(),
            lost_servers: st
                .machine
                .live()
                .iter()
                .enumerate()
                .filter(|(_, live)| !**live)
                .map(|(i, _)| i as u32)
                .collect(),
            checkpoint_error: st.checkpoint_error.clone(),
            pilot: st.pilot.as_ref().map(|p| p.status()),
        }
    }

    async fn status(&self) -> Result<ClusterStatus, CoordError> {
        let mut status = self.own_status();
        let servers = self.lock().servers();
        let lost: Vec<bool> = self.lock().machine.live().iter().map(|l| !l).collect();
        for (i, (addr, conn)) in servers.iter().enumerate() {
            let Some(conn) = conn.as_ref().filter(|_| !lost.get(i).copied().unwrap_or(false)) else {
                continue;
            };
            // With backups, a server that does not answer soon may be dead and about to be
            // failed over: the status goes on without it rather than waiting for its timeout.
            let asked = command_status(conn);
            let answer = match self.opts.replicas {
                0 => asked.await,
                _ => tokio::time::timeout(Duration::from_millis(crate::net::proto::LEASE_MS), asked)
                    .await
                    .unwrap_or(Err(CommandError::Unanswered(crate::net::proto::LEASE_MS))),
            };
            match answer {
                Ok(s) => status.servers.push(s),
                Err(e) if self.opts.replicas > 0 => tracing::warn!(server = i, %addr, "no status: {e}"),
                Err(e) => {
                    return Err(CoordError::NoStatus { server: i as u32, addr: *addr, reason: e.to_string() })
                }
            }
        }
        Ok(status)
    }
}

async fn command(
    conn: &quinn::Connection,
    cmd: &ServerCommand,
    payload: &[u8],
) -> Result<Answer, CommandError> {
    match command_reply(conn, cmd, payload).await?.0 {
        ServerReply::Ok => Ok(Answer::Done),
        ServerReply::Clocks(clocks) => Ok(Answer::Clocks(clocks)),
        ServerReply::Error(e) => Err(CommandError::Refused(e)),
        other => Err(CommandError::Unexpected(format!("{other:?}"))),
    }
}

async fn command_status(conn: &quinn::Connection) -> Result<crate::net::proto::ServerStatus, CommandError> {
    match command_reply(conn, &ServerCommand::Status, &[]).await?.0 {
        ServerReply::Status(s) => Ok(s),
        ServerReply::Error(e) => Err(CommandError::Refused(e)),
        other => Err(CommandError::Unexpected(format!("{other:?}"))),
    }
}

async fn command_reply(
    conn: &quinn::Connection,
    cmd: &ServerCommand,
    payload: &[u8],
) -> Result<(ServerReply, Vec<u8>), CommandError> {
    let req = net::request::<_, ServerReply>(conn, cmd, payload.into(), &CONTROL_LIMITS);
    match tokio::time::timeout(COMMAND_TIMEOUT, req).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(CommandError::Transport(e.to_string())),
        Err(_) => Err(CommandError::Unanswered(COMMAND_TIMEOUT.as_millis() as u64)),
    }
}

/// The coordinator as the dashboard sees it: its status, its swaps, its operator token.
struct DashboardControl(Arc<Coordinator>);

impl crate::dashboard::Control for DashboardControl {
    fn status(&self) -> crate::dashboard::BoxFuture<'_, Result<ClusterStatus, String>> {
        Box::pin(async move { self.0.status().await.map_err(|e| e.to_string()) })
    }

    fn swap(&self, source: PolicySource) -> crate::dashboard::BoxFuture<'_, crate::dashboard::SwapAnswer> {
        use crate::dashboard::SwapAnswer;
        Box::pin(async move {
            let label = source.label.clone();
            match self.0.swap_to(source.blob(), source.wasm).await {
                Ok(Ok((swap, shards))) => SwapAnswer::Done { swap, shards, policy: label },
                Ok(Err((swap, failed))) => {
                    SwapAnswer::Partly { swap, policy: label, failed: crate::net::proto::listed(&failed) }
                }
                Err(e) => SwapAnswer::Refused { reason: e.to_string() },
            }
        })
    }

    fn authorized(&self, presented: &str) -> bool {
        self.0.opts.operator_token.as_ref().unwrap_or(&self.0.opts.token).matches(presented)
    }
}
