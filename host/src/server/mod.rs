//! The server role (`syncopate server`): hosts shards, runs their policy instances, and serves
//! pushes and pulls over QUIC.
//!
//! It registers with the coordinator, which gives it an id, the cluster's settings and the
//! policy module; shard `k` lives on server `k % servers`. Each shard is a task
//! (`shard_task.rs`); each connection is a task that authenticates the peer, then serves one
//! request per stream. A worker whose connection fails or goes silent for the peer timeout is
//! made to leave its shards, so its policy is told and a barrier it held opens. Commands from
//! the coordinator (prepare / commit a swap, status, checkpoint, shutdown) arrive on the
//! registration connection.
//!
//! On `--resume` the coordinator names a checkpoint round; the server restores each of its
//! shards from the round's files before it serves anyone, and refuses to start, saying which
//! file and why, if one cannot be read.
//!
//! If the coordinator goes away, the server keeps its shards and rejoins it when it is back at
//! the same address (`rejoin.rs`).

mod rejoin;
mod shard_task;

use crate::net::pool::TensorPool;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use syncopate_policy_sdk::abi::{Applied, InitArgs, LeaveReason, Signals, WorkerId};
use tokio::sync::{mpsc, oneshot, watch};

use crate::lease::ServerLease;
use crate::net::proto::{
    ClusterSettings, ControlMessage, DataError, DataRequest, DataResponse, Hello, MovedTasks, NotServing,
    PeerKind, PolicyBlob, Role, ServerCommand, ServerError, ServerReply, ServerStatus, ShardFailure, Ticket,
    Unwelcome, Welcome, PROTOCOL_VERSION,
};
use crate::net::tls::{TlsFiles, Token};
use crate::net::wire::{self, Limits, Payload, WireError};
use crate::net::{self, close, NetError};
use crate::runtime::{PolicyInstance, PolicyModule, PolicyRuntime};
use crate::shard::{
    ClockRaise, Codec, Frontier, Handover, PushHeader, RequestError, ShardConfig, SupervisorConfig, SwapTo,
    TaskPart,
};
use crate::NodeError;
use shard_task::{Joined, Modules, PushOutcome, ReplicaFrame, ReplicaLink, Replicate, ShardCmd, ShardTask};
use syncopate_engine::server::ServerState;

/// How to run a server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The coordinator's address.
    pub coordinator: SocketAddr,
    /// Where to listen for workers.
    pub listen: SocketAddr,
    /// The address workers should use, when `listen` is a wildcard.
    pub advertise: Option<SocketAddr>,
    /// Certificates.
    pub tls: TlsFiles,
    /// The cluster token.
    pub token: Token,
    /// Largest frame parts accepted.
    pub limits: Limits,
    /// Record each shard's policy events into this directory.
    pub record: Option<std::path::PathBuf>,
    /// Where to write the id the coordinator gave this server, once registered.
    pub id_file: Option<std::path::PathBuf>,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<crate::metrics::MetricsOptions>,
}

struct Shared {
    /// The server's own state (its primaries and backups and their terms, the terms the
    /// coordinator told, workers gone, the connection behind each worker's memberships), with
    /// one owner: each change to it happens whole ([`ServerState`]).
    state: Mutex<ServerState<mpsc::Sender<ShardCmd>>>,
    /// Modules by SHA-256, for backups' swaps.
    modules: Modules,
    /// Connections to other servers, for replication streams, by address and incarnation (a
    /// server restarted at the same address is a new peer).
    peers: tokio::sync::Mutex<HashMap<(SocketAddr, u32), quinn::Connection>>,
    endpoint: quinn::Endpoint,
    server_name: String,
    /// With backups: until when this server may accept pushes (its lease from the coordinator),
    /// on the clock of `epoch`.
    lease: Option<Mutex<ServerLease>>,
    /// The server's clock starts here (its shards' and its lease's).
    epoch: Instant,
    runtime: PolicyRuntime,
    settings: ClusterSettings,
    id: u32,
    addr: SocketAddr,
    /// Prepared swaps, by number.
    prepared: Mutex<HashMap<u64, Prepared>>,
    /// The policy the shards run, with its bytes, and the swaps committed here so far.
    policy: Mutex<(u64, PolicyBlob, Arc<Vec<u8>>)>,
    /// What the last swap committed here raised the workers' clocks by: a restarted coordinator
    /// finishes an interrupted swap with it on the servers that had not committed.
    levelled: Mutex<Vec<ClockRaise>>,
    /// Where pulls are encoded before they are copied into a pooled buffer: spares kept from
    /// pull to pull (at most [`SPARE_SCRATCHES`]), so that compressed pulls allocate nothing
    /// once warm and concurrent ones do not wait for each other.
    pull_scratch: Mutex<Vec<(Vec<u8>, crate::codec::Scratch)>>,
    /// Tensor payload bytes by codec family ([`CODEC_FAMILIES`]): received in pushes, sent in
    /// pulls.
    payload: [[AtomicU64; CODEC_FAMILIES.len()]; 2],
    /// The coordinator's address, to rejoin it at.
    coordinator: SocketAddr,
    limits: Limits,
    token: Token,
    shutdown: watch::Sender<bool>,
    /// Live data connections, and the bytes of those already closed.
    traffic: Mutex<(Vec<quinn::Connection>, u64, u64)>,
    /// Tensor buffers for payloads in and answers out.
    pool: TensorPool,
    /// The connections that send bulk data here (workers, primaries replicating), which share
    /// the socket's receive buffer.
    windows: Arc<net::window::WindowShare>,
}

/// A swap prepared here: the module, its description and its bytes.
type Prepared = (PolicyModule, PolicyBlob, Arc<Vec<u8>>);

impl Shared {
    /// The server's own state, for one change or one read (never held across a wait).
    fn state(&self) -> std::sync::MutexGuard<'_, ServerState<mpsc::Sender<ShardCmd>>> {
        self.state.lock().expect("not poisoned")
    }

    /// The channel of the shard this server is primary for.
    fn shard(&self, shard: u32) -> Option<mpsc::Sender<ShardCmd>> {
        self.state().primary(shard).cloned()
    }

    /// The term this server knows for `shard`.
    fn term(&self, shard: u32) -> u64 {
        self.state().term(shard)
    }

    /// Every primary shard's channel, by shard.
    fn primaries(&self) -> Vec<(u32, mpsc::Sender<ShardCmd>)> {
        self.state().primaries()
    }

    /// Every backup's channel, by shard.
    fn backups(&self) -> Vec<(u32, mpsc::Sender<ShardCmd>)> {
        self.state().backups()
    }

    fn bytes(&self) -> (u64, u64) {
        let t = self.traffic.lock().expect("not poisoned");
        t.0.iter().fold((t.1, t.2), |(tx, rx), c| {
            let s = c.stats();
            (tx + s.udp_tx.bytes, rx + s.udp_rx.bytes)
        })
    }
}

/// Runs a server until the coordinator tells it to stop (or is lost).
pub async fn run(opts: ServerOptions) -> Result<(), NodeError> {
    let bootstrap = Duration::from_secs(30);
    // Bound first, so its address is known at once; served once the shards exist.
    let metrics = match &opts.metrics {
        Some(m) => Some(crate::metrics::bind(m).await?),
        None => None,
    };
    // Listen before registering, so the advertised address is the one bound; the transport is
    // re-configured once the coordinator has said what the peer timeout is.
    let endpoint = crate::net::tls::listen(
        opts.listen,
        // Workers may connect as soon as the coordinator knows this server: their connections
        // start at the floor window, since a window once granted cannot be taken back.
        opts.tls.server_config(bootstrap, net::window::MIN_WINDOW)?,
        opts.tls.client_config(bootstrap)?,
    )?;
    let bound =
        endpoint.local_addr().map_err(|source| NodeError::Io { what: "local address".into(), source })?;
    let advertise = opts.advertise.unwrap_or_else(|| {
        if bound.ip().is_unspecified() {
            SocketAddr::new([127, 0, 0, 1].into(), bound.port())
        } else {
            bound
        }
    });
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        token: opts.token.secret().to_string(),
        role: Role::Server { data_addr: advertise, rejoin: None },
    };
    let (coord, welcome) = register(&endpoint, &opts, &hello).await?;
    let (Welcome::Server { server: id, settings, policy, swaps, replacing }, wasm) = welcome else {
        return Err(NodeError::Protocol("the coordinator did not welcome us as a server".into()));
    };
    match replacing {
        false => {
            tracing::info!(server = id, %advertise, shards = settings.shards, "registered with the coordinator")
        }
        true => tracing::warn!(
            server = id,
            %advertise,
            "registered in the place of lost server {id}: starting with no shards; backups come from the primaries"
        ),
    }
    if let Some(path) = &opts.id_file {
        std::fs::write(path, format!("{id}\n"))
            .map_err(|source| NodeError::Io { what: format!("cannot write {}", path.display()), source })?;
    }
    let runtime = PolicyRuntime::new()?;
    let module = prepare(&runtime, &policy, &wasm, &settings, id).await.map_err(NodeError::Protocol)?;
    let timeout = Duration::from_millis(settings.peer_timeout_ms);
    // Data connections start at the floor window and get their share as they join.
    endpoint.set_server_config(Some(opts.tls.server_config(timeout, net::window::MIN_WINDOW)?));
    let epoch = Instant::now();
    let pool = TensorPool::default();
    let mut state = ServerState::new(settings.shards);
    let modules: Modules = Default::default();
    modules.lock().expect("not poisoned").insert(module.sha256(), module.clone());
    // A server restarted in a lost one's place holds nothing: its shards moved at the failover.
    let fresh = !replacing;
    let mine: Vec<u32> = (0..settings.shards).filter(|s| fresh && s % settings.servers == id).collect();
    let backed: Vec<u32> =
        (0..settings.shards).filter(|s| fresh && settings.backup_of(*s) == Some(id)).collect();
    let all: Vec<u32> = mine.iter().chain(&backed).copied().collect();
    let mut restored = restore_shards(settings.restore.as_deref(), &all).await?;
    for shard in all {
        let backup = !mine.contains(&shard);
        let (tx, rx) = mpsc::channel(1024);
        let task = ShardTask {
            cfg: shard_config(&settings, shard),
            module: module.clone(),
            config: policy.config_for(shard),
            epoch,
            pool: pool.clone(),
            record: opts.record.as_ref().map(|dir| dir.join(format!("shard-{shard}.rec"))),
            restored: restored.remove(&shard),
            rejoin_grace: timeout,
            modules: modules.clone(),
            backup,
        };
        tokio::spawn(task.run(rx));
        match backup {
            true => state.hold_backup(shard, tx),
            false => state.hold_primary(shard, tx),
        };
    }
    if !backed.is_empty() {
        tracing::info!(server = id, shards = ?backed, "keeping backups");
    }
    let (shutdown, mut stop) = watch::channel(false);
    let shared = Arc::new(Shared {
        state: Mutex::new(state),
        modules,
        peers: Default::default(),
        endpoint: endpoint.clone(),
        server_name: opts.tls.server_name.clone(),
        lease: settings.replicated().then(|| Mutex::new(ServerLease::new(ns_since(epoch)))),
        epoch,
        runtime,
        settings,
        id,
        addr: advertise,
        prepared: Mutex::new(HashMap::new()),
        policy: Mutex::new((swaps, policy, Arc::new(wasm))),
        levelled: Mutex::new(Vec::new()),
        pull_scratch: Mutex::new(Vec::new()),
        payload: Default::default(),
        coordinator: opts.coordinator,
        limits: opts.limits,
        token: opts.token.clone(),
        shutdown,
        traffic: Mutex::new((Vec::new(), 0, 0)),
        windows: Arc::default(),
        pool,
    });
    let accept = tokio::spawn(accept_loop(endpoint.clone(), shared.clone()));
    let metrics = metrics.map(|m| {
        let shared = shared.clone();
        crate::metrics::serve(
            m,
            Arc::new(move || {
                let shared = shared.clone();
                Box::pin(async move { crate::metrics::exposition::server(&status(&shared).await) })
            }),
        )
    });
    let mut coord = coord;
    let mut commands = tokio::spawn(coordinator_loop(coord.clone(), shared.clone()));
    let result = loop {
        let leases = shared.lease.is_some().then(|| tokio::spawn(renew_lease(coord.clone(), shared.clone())));
        let lost = tokio::select! {
            _ = stop.wait_for(|s| *s) => None,
            reason = coord.closed() => match reason {
                quinn::ConnectionError::ApplicationClosed(c) if c.error_code == close::DONE.into() => None,
                reason => Some(reason),
            },
        };
        commands.abort();
        if let Some(l) = leases {
            l.abort();
        }
        let Some(reason) = lost else { break Ok(()) };
        // Its lease lapses meanwhile, so with backups its shards serve nothing until it is
        // back; without, they go on serving.
        tracing::warn!(
            server = id,
            "the coordinator went away ({reason}); rejoining it when it is back, for up to {} s",
            crate::net::proto::COORDINATOR_WAIT_MS / 1000
        );
        let rejoined = tokio::select! {
            _ = stop.wait_for(|s| *s) => break Ok(()),
            r = rejoin::rejoin(&shared) => r,
        };
        match rejoined {
            Ok((c, cmds)) => (coord, commands) = (c, cmds),
            Err(e) => break Err(e),
        }
    };
    accept.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    endpoint.close(close::SHUTDOWN.into(), b"server shutting down");
    coord.close(close::DONE.into(), b"bye");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
    tracing::info!(server = id, "server stopped");
    result
}

/// Nanoseconds since `epoch`: the server's clock for its lease.
fn ns_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

/// This server's status: its shards', its backups', its traffic.
async fn status(shared: &Shared) -> ServerStatus {
    let shards = statuses(shared.primaries()).await;
    let backups = statuses(shared.backups()).await;
    let (bytes_sent, bytes_received) = shared.bytes();
    let payload_bytes = CODEC_FAMILIES
        .iter()
        .enumerate()
        .map(|(k, codec)| crate::net::proto::CodecBytes {
            codec: codec.to_string(),
            pushed: shared.payload[0][k].load(Ordering::Relaxed),
            pulled: shared.payload[1][k].load(Ordering::Relaxed),
        })
        .filter(|c| c.pushed > 0 || c.pulled > 0)
        .collect();
    ServerStatus {
        server: shared.id,
        addr: shared.addr,
        shards,
        backups,
        bytes_sent,
        bytes_received,
        payload_bytes,
    }
}

/// The codec families a server counts payload bytes by.
pub const CODEC_FAMILIES: [&str; 6] = ["none", "fp16", "bf16", "int8", "topk", "sparseloco"];

/// `codec`'s family: its index in [`CODEC_FAMILIES`].
fn family(codec: Codec) -> usize {
    match codec {
        Codec::None => 0,
        Codec::Fp16 => 1,
        Codec::Bf16 => 2,
        Codec::Int8 { .. } => 3,
        Codec::TopK { .. } => 4,
        Codec::SparseLoCo { .. } => 5,
    }
}

impl Shared {
    /// Counts `words` f32 words of tensor payload in `codec`, received in a push or sent in a
    /// pull.
    fn count_payload(&self, pull: bool, codec: Codec, words: usize) {
        self.payload[usize::from(pull)][family(codec)].fetch_add(words as u64 * 4, Ordering::Relaxed);
    }
}

/// The status of each shard task that has a shard.
async fn statuses(tasks: Vec<(u32, mpsc::Sender<ShardCmd>)>) -> Vec<crate::net::proto::ShardStatus> {
    let mut out = Vec::new();
    for (_, tx) in tasks {
        let (reply, rx) = oneshot::channel();
        if tx.send(ShardCmd::Status { reply }).await.is_ok() {
            if let Ok(Some(s)) = rx.await {
                out.push(s);
            }
        }
    }
    out
}

/// Renews this server's lease every [`HEARTBEAT_MS`](crate::net::proto::HEARTBEAT_MS). A lease
/// runs from when its renewal was sent, so the coordinator, which counts from when it answered,
/// never thinks it over before this server does. Told it was failed over, the server stops: its
/// shards have other primaries now.
async fn renew_lease(coord: quinn::Connection, shared: Arc<Shared>) {
    use crate::net::proto::{CoordRequest, CoordResponse, HEARTBEAT_MS, LEASE_MS};
    let limits = Limits { max_header: 4096, max_payload: 0 };
    let req = CoordRequest::Heartbeat { server: shared.id };
    let mut renewed = Instant::now();
    loop {
        let sent = Instant::now();
        let asked = net::request::<_, CoordResponse>(&coord, &req, Payload::EMPTY, &limits);
        let answer = match tokio::time::timeout(Duration::from_millis(LEASE_MS), asked).await {
            Ok(Ok((answer, _))) => Ok(answer),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no answer within a lease".to_owned()),
        };
        match Renewal::of(answer) {
            Renewal::Renewed(terms) => {
                renewed = sent;
                shared.state().renewed(&terms);
                if let Some(lease) = &shared.lease {
                    lease
                        .lock()
                        .expect("not poisoned")
                        .renewed(sent.saturating_duration_since(shared.epoch).as_nanos() as u64);
                }
            }
            Renewal::Ended(why) => {
                tracing::error!("the coordinator ended our lease ({why}); stopping");
                let _ = shared.shutdown.send(true);
                return;
            }
            Renewal::NotRenewed(why) => {
                tracing::warn!("lease not renewed: {why}");
                // A whole lease without an answer: the coordinator may have died (a restarted
                // one is reached only on a new connection, and this one would take the peer
                // timeout to fail). Give it up, and rejoin (`run`). A live coordinator takes the
                // server back unless it failed it over meanwhile.
                if renewed.elapsed() >= Duration::from_millis(LEASE_MS) {
                    coord.close(close::SILENT.into(), b"lease renewals unanswered");
                    return;
                }
            }
        }
        tokio::time::sleep_until((sent + Duration::from_millis(HEARTBEAT_MS)).into()).await;
    }
}

/// What a server makes of its coordinator's answer to a lease renewal: only a lease's end
/// ([`crate::net::proto::CoordResponse::LeaseEnded`]) stops it. An error it does not
/// understand, or an answer that is not a renewal's, counts as no answer: it goes on renewing,
/// and gives the lease up (to rejoin) only once a whole lease has passed unrenewed.
#[derive(Debug, PartialEq)]
enum Renewal {
    /// Renewed; every shard's term.
    Renewed(Vec<u64>),
    /// Failed over: stop.
    Ended(crate::net::proto::LeaseEnd),
    /// Not renewed this time, and why.
    NotRenewed(String),
}

impl Renewal {
    fn of(answer: Result<crate::net::proto::CoordResponse, String>) -> Self {
        use crate::net::proto::CoordResponse;
        match answer {
            Ok(CoordResponse::Renewed { terms }) => Self::Renewed(terms),
            Ok(CoordResponse::LeaseEnded(why)) => Self::Ended(why),
            Ok(CoordResponse::Error(e)) => Self::NotRenewed(format!("the coordinator refused it: {e}")),
            Ok(other) => Self::NotRenewed(format!("an answer that is not a renewal's: {other:?}")),
            Err(e) => Self::NotRenewed(e),
        }
    }
}

/// Reads this server's shards from a checkpoint round's folder, off the reactor.
async fn restore_shards(
    dir: Option<&str>,
    mine: &[u32],
) -> Result<HashMap<u32, crate::shard::ShardSnapshot>, NodeError> {
    let Some(dir) = dir else { return Ok(HashMap::new()) };
    let (dir, mine) = (std::path::PathBuf::from(dir), mine.to_vec());
    tokio::task::spawn_blocking(move || {
        mine.into_iter()
            .map(|shard| {
                let path = crate::checkpoint::shard_file(&dir, shard);
                crate::checkpoint::read_snapshot(&path).map(|snap| (shard, snap)).map_err(|e| {
                    NodeError::Protocol(format!("cannot restore shard {shard} from {}: {e}", path.display()))
                })
            })
            .collect()
    })
    .await
    .map_err(|e| NodeError::Protocol(format!("restore task failed: {e}")))?
}

/// Writes the snapshot of `shard`, a primary here, into `dir`: taken by its shard task (between
/// two events), then written crash-safely off the reactor.
async fn checkpoint(shared: &Shared, dir: &str, shard: u32) -> Result<(), String> {
    let tx = shared.shard(shard).ok_or_else(|| format!("shard {shard} has no primary on this server"))?;
    let bytes = ask(shard, &tx, |reply| ShardCmd::Snapshot { reply })
        .await
        .map_err(|e| format!("shard {shard}: {e}"))?;
    let path = crate::checkpoint::shard_file(std::path::Path::new(dir), shard);
    let len = bytes.len();
    tokio::task::spawn_blocking(move || crate::checkpoint::write_atomic(&path, &bytes))
        .await
        .map_err(|e| format!("write task failed: {e}"))?
        .map_err(|e| format!("shard {shard}: {e}"))?;
    tracing::debug!(shard, bytes = len, dir, "shard checkpointed");
    Ok(())
}

/// Starts streaming `shard`'s ops to its backup at `addr`: one stream on the connection to that
/// server (its process `incarnation`: a connection to an earlier one at the same address is not
/// used), a writer task sending the ops in order, a reader task passing the backup's
/// confirmations back to the shard.
async fn attach_backup(
    shared: &Arc<Shared>,
    shard: u32,
    addr: SocketAddr,
    incarnation: u32,
) -> Result<(), String> {
    let tx = shared.shard(shard).ok_or_else(|| format!("shard {shard} is not on this server"))?;
    let conn = {
        let mut peers = shared.peers.lock().await;
        match peers.get(&(addr, incarnation)).filter(|c| c.close_reason().is_none()) {
            Some(c) => c.clone(),
            None => {
                let hello = Hello {
                    protocol: PROTOCOL_VERSION,
                    token: shared.token.secret().to_string(),
                    role: Role::Replica { server: shared.id },
                };
                let (c, _) = net::connect(&shared.endpoint, addr, &shared.server_name, &hello)
                    .await
                    .map_err(|e| e.to_string())?;
                // A restarted peer's old connection goes (it leads nowhere).
                peers.retain(|k, _| k.0 != addr);
                peers.insert((addr, incarnation), c.clone());
                c
            }
        }
    };
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let mut scratch = Vec::new();
    wire::write_frame_open(
        &mut send,
        &crate::net::proto::ReplicaOpen { shard, term: shared.term(shard) },
        Payload::EMPTY,
        &mut scratch,
    )
    .await
    .map_err(|e| e.to_string())?;
    let (ops, mut rx) = mpsc::unbounded_channel::<Replicate>();
    let pool = shared.pool.clone();
    tokio::spawn(async move {
        let mut scratch = Vec::new();
        while let Some(msg) = rx.recv().await {
            let written = match msg {
                Replicate::Init { seq, snapshot } => {
                    let payload = Payload::Borrowed(&snapshot);
                    wire::write_frame_open(&mut send, &ReplicaFrame::Init { seq }, payload, &mut scratch)
                        .await
                }
                Replicate::Op(stamped, grad) => {
                    // Lent to QUIC without a copy; the buffer returns to the pool once sent.
                    let payload = match grad.is_empty() {
                        true => Payload::EMPTY,
                        false => Payload::Shared(pool.send_shared(Arc::new(grad))),
                    };
                    wire::write_frame_open(&mut send, &ReplicaFrame::Op(stamped), payload, &mut scratch).await
                }
            };
            if let Err(e) = written {
                tracing::warn!(shard, "replication stream to {addr} broken: {e}");
                return;
            }
        }
    });
    ask(shard, &tx, |reply| ShardCmd::AttachBackup { link: ReplicaLink { tx: ops }, reply })
        .await
        .map_err(|e| e.to_string())?;
    let limits = shared.limits;
    tokio::spawn(async move {
        let mut scratch = Vec::new();
        loop {
            match wire::read_head::<u64>(&mut recv, &limits, &mut scratch).await {
                Ok(head) => {
                    if tx.send(ShardCmd::ReplicaAcked { seq: head.header }).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(shard, "replication confirmations from {addr} ended: {e}");
                    return;
                }
            }
        }
    });
    tracing::info!(shard, backup = %addr, "replicating");
    Ok(())
}

/// A replication connection from another server: each stream carries one shard's ops, which
/// go to the backup task in order; each is confirmed once it is queued there.
async fn serve_replicas(conn: quinn::Connection, shared: Arc<Shared>) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(serve_replica_stream(send, recv, shared.clone()));
    }
}

async fn serve_replica_stream(mut send: quinn::SendStream, mut recv: quinn::RecvStream, shared: Arc<Shared>) {
    let mut scratch = Vec::new();
    // A snapshot holds the parameters, the velocity and more: a few times the largest tensor.
    let limits = Limits { max_payload: shared.limits.max_payload.saturating_mul(4), ..shared.limits };
    let Ok(open) = wire::read_head::<crate::net::proto::ReplicaOpen>(&mut recv, &limits, &mut scratch).await
    else {
        return;
    };
    let shard = open.header.shard;
    // A backup follows its primary's term (a stale primary is never told to attach a backup).
    let mut tx = shared.state().stream_opened(shard, open.header.term);
    // The backup task confirms each op as it takes it, in order, and only while it is a backup:
    // once promoted it confirms nothing more, so its old primary acknowledges nothing more.
    let (acks, mut confirmed) = mpsc::unbounded_channel::<u64>();
    let writer = tokio::spawn(async move {
        let mut scratch = Vec::new();
        while let Some(seq) = confirmed.recv().await {
            if wire::write_frame_open(&mut send, &seq, Payload::EMPTY, &mut scratch).await.is_err() {
                return;
            }
        }
    });
    loop {
        let head = match wire::read_head::<ReplicaFrame>(&mut recv, &limits, &mut scratch).await {
            Ok(h) => h,
            Err(e) => {
                tracing::info!(shard, "replication stream ended: {e}");
                break;
            }
        };
        let stamped = match head.header {
            ReplicaFrame::Init { seq } => {
                let bytes = match wire::read_payload_bytes(&mut recv, head.payload_len).await {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(shard, "replication stream broken: {e}");
                        break;
                    }
                };
                match start_backup(&shared, shard, Some(&bytes)) {
                    Ok(t) => {
                        tx = Some(t);
                        let _ = acks.send(seq);
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(shard, "cannot start a backup from the primary's snapshot: {e}");
                        break;
                    }
                }
            }
            ReplicaFrame::Op(stamped) => stamped,
        };
        if tx.is_none() && stamped.op == crate::shard::Op::Create {
            match start_backup(&shared, shard, None) {
                Ok(t) => tx = Some(t),
                Err(e) => {
                    tracing::error!(shard, "cannot start a backup: {e}");
                    break;
                }
            }
        }
        let Some(tx) = tx.as_ref() else {
            tracing::error!(shard, "a primary streams ops of a shard this server keeps no backup of");
            break;
        };
        let grad = match wire::f32_count(head.payload_len) {
            Ok(n) => {
                let mut grad = shared.pool.take(n);
                if let Err(e) = wire::read_payload_into(&mut recv, head.payload_len, &mut grad).await {
                    tracing::warn!(shard, "replication stream broken: {e}");
                    break;
                }
                grad
            }
            Err(e) => {
                tracing::warn!(shard, "bad replication frame: {e}");
                break;
            }
        };
        let cmd = ShardCmd::Replicated { stamped, grad, ack: acks.clone() };
        if tx.send(cmd).await.is_err() {
            break;
        }
    }
    drop(acks);
    let _ = writer.await;
}

/// The parameters a pull serves, in `codec`, as the f32 words the transport sends.
fn encode_pull(shared: &Shared, codec: Codec, values: &[f32]) -> Vec<f32> {
    let spare = shared.pull_scratch.lock().expect("not poisoned").pop();
    let (mut bytes, mut scratch) = spare.unwrap_or_default();
    crate::codec::encode(codec, values, None, &mut scratch, &mut bytes);
    let mut words = shared.pool.take(bytes.len() / 4);
    bytemuck::cast_slice_mut::<f32, u8>(&mut words).copy_from_slice(&bytes);
    let mut spares = shared.pull_scratch.lock().expect("not poisoned");
    if spares.len() < SPARE_SCRATCHES {
        spares.push((bytes, scratch));
    }
    words
}

/// Encoding scratches a server keeps for compressed pulls (more are made while more pulls
/// encode at once, and dropped after).
const SPARE_SCRATCHES: usize = 8;

/// How shard `shard` runs in a cluster with these settings.
fn shard_config(settings: &ClusterSettings, shard: u32) -> ShardConfig {
    ShardConfig {
        shard,
        shards: settings.shards,
        seed: settings.seed,
        optimizer: settings.optimizer,
        local_sgd: settings.local_sgd,
        pull_codec: settings.pull_codec,
        supervisor: SupervisorConfig {
            no_progress_ns: settings.no_progress_ms.saturating_mul(1_000_000),
            ..SupervisorConfig::default()
        },
        push_weight: settings.push_weight,
        max_workers: settings.max_workers,
    }
}

/// A new backup of `shard` on this server, restored from its primary's snapshot (a
/// re-replication after a failover), or, without one, created by the primary's first op (a
/// shard not created yet, re-replicated onto a server that kept no backup of it: a server
/// restarted in a lost one's place), replacing any older one.
fn start_backup(
    shared: &Shared,
    shard: u32,
    snapshot: Option<&[u8]>,
) -> Result<mpsc::Sender<ShardCmd>, String> {
    let snap = snapshot.map(crate::shard::ShardSnapshot::decode).transpose().map_err(|e| e.to_string())?;
    let sha = match &snap {
        Some(snap) => snap.policy_sha256(),
        None => shared.policy.lock().expect("not poisoned").1.sha256,
    };
    let module = shared
        .modules
        .lock()
        .expect("not poisoned")
        .get(&sha)
        .cloned()
        .ok_or("the snapshot's policy module is not on this server")?;
    let from_snapshot = snap.is_some();
    let settings = &shared.settings;
    let (tx, rx) = mpsc::channel(1024);
    let task = ShardTask {
        cfg: shard_config(settings, shard),
        module,
        config: Vec::new(),
        epoch: Instant::now(),
        pool: shared.pool.clone(),
        record: None,
        restored: snap,
        rejoin_grace: Duration::from_millis(settings.peer_timeout_ms),
        modules: shared.modules.clone(),
        backup: true,
    };
    tokio::spawn(task.run(rx));
    shared.state().hold_backup(shard, tx.clone());
    match from_snapshot {
        true => tracing::warn!(shard, "keeping a new backup, from its primary's snapshot"),
        false => tracing::warn!(shard, "keeping a new backup, created by its primary's first op"),
    }
    Ok(tx)
}

/// How long a server restarted in a lost one's place asks again to be admitted (the
/// coordinator admits it once the old one is failed over and a peer timeout has passed).
const REGISTER_WAIT: Duration = Duration::from_secs(120);

/// Registers with the coordinator. A server restarted in a lost server's place may be told to
/// ask again ([`Welcome::NotYet`]): it does, every heartbeat, for up to [`REGISTER_WAIT`].
async fn register(
    endpoint: &quinn::Endpoint,
    opts: &ServerOptions,
    hello: &Hello,
) -> Result<(quinn::Connection, (Welcome, Vec<u8>)), NodeError> {
    let began = Instant::now();
    let mut said = false;
    loop {
        let (conn, welcome) =
            connect_with_payload(endpoint, opts.coordinator, &opts.tls.server_name, hello).await?;
        let Welcome::NotYet(reason) = &welcome.0 else { return Ok((conn, welcome)) };
        if began.elapsed() > REGISTER_WAIT {
            return Err(NodeError::Protocol(format!(
                "the coordinator did not admit this server within {REGISTER_WAIT:?}: {reason}"
            )));
        }
        if !std::mem::replace(&mut said, true) {
            tracing::warn!(
                "the coordinator cannot admit this server yet ({reason}); asking again every heartbeat"
            );
        }
        conn.close(close::DONE.into(), b"asking again");
        tokio::time::sleep(Duration::from_millis(crate::net::proto::HEARTBEAT_MS)).await;
    }
}

/// `connect`, keeping the welcome's payload (the policy module).
async fn connect_with_payload(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    hello: &Hello,
) -> Result<(quinn::Connection, (Welcome, Vec<u8>)), NetError> {
    let conn = net::dial(endpoint, addr, server_name, None).await?;
    let limits = Limits { max_header: 1 << 20, max_payload: 64 << 20 };
    let welcome = net::greet(&conn, hello, &limits).await?;
    Ok((conn, welcome))
}

/// Checks a distributed module: its hash, that it compiles, and that it starts on each of this
/// server's shards with their configuration. Runs off the reactor.
async fn prepare(
    runtime: &PolicyRuntime,
    blob: &PolicyBlob,
    wasm: &[u8],
    settings: &ClusterSettings,
    server: u32,
) -> Result<PolicyModule, String> {
    let digest: [u8; 32] = Sha256::digest(wasm).into();
    if digest != blob.sha256 {
        return Err(format!(
            "{}: the module's bytes do not match its sha256 (damaged in transit?)",
            blob.label
        ));
    }
    let module =
        crate::node::compile(runtime, blob.label.clone(), wasm.to_vec()).await.map_err(|e| e.to_string())?;
    let (m, b, shards) = (module.clone(), blob.clone(), settings.shards);
    let mine: Vec<u32> = (0..shards).filter(|s| s % settings.servers == server).collect();
    tokio::task::spawn_blocking(move || {
        for shard in mine {
            let config = b.config_for(shard);
            let init = InitArgs {
                shard,
                shards,
                now_ns: 0,
                config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
            };
            PolicyInstance::new(&m, &init).map_err(|e| format!("shard {shard}: {e}"))?;
        }
        Ok::<_, String>(())
    })
    .await
    .map_err(|e| format!("check task failed: {e}"))??;
    Ok(module)
}

/// Whether every primary here would take `module` in a swap now (each tries the hand-over of its
/// policy's state and throws it away: [`crate::shard::ShardNode::check_swap`]), so that a module
/// that refuses to take over is refused before any shard switches.
async fn check_swap(shared: &Shared, module: &PolicyModule, policy: &PolicyBlob) -> Result<(), String> {
    let mut refused = Vec::new();
    for (shard, tx) in shared.primaries() {
        let (reply, rx) = oneshot::channel();
        let config = policy.config_for(shard);
        let cmd = ShardCmd::CheckSwap { module: module.clone(), config, reply };
        let checked = match tx.send(cmd).await {
            Ok(()) => rx.await.unwrap_or(Err(RequestError::Stopped(shard))),
            Err(_) => Err(RequestError::Stopped(shard)),
        };
        if let Err(e) = checked {
            refused.push(format!("shard {shard}: {e}"));
        }
    }
    match refused.is_empty() {
        true => Ok(()),
        false => Err(refused.join("; ")),
    }
}

async fn coordinator_loop(conn: quinn::Connection, shared: Arc<Shared>) {
    let limits = Limits { max_header: 1 << 20, max_payload: 64 << 20 };
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let (cmd, payload) = match wire::read_message::<ServerCommand>(&mut recv, &limits).await {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("bad command from the coordinator: {e}");
                continue;
            }
        };
        let stop = cmd == ServerCommand::Shutdown;
        let reply = handle_command(&shared, cmd, payload).await;
        // The module of the policy a holding names: the one committed here, or a swap prepared
        // here that a copy runs already.
        let module = match &reply {
            ServerReply::Holdings(h) => {
                let (_, committed, wasm) = shared.policy.lock().expect("not poisoned").clone();
                let prepared = shared.prepared.lock().expect("not poisoned");
                match prepared
                    .values()
                    .find(|p| p.1.sha256 == h.policy.sha256 && committed.sha256 != h.policy.sha256)
                {
                    Some(p) => p.2.clone(),
                    None => wasm,
                }
            }
            _ => Arc::default(),
        };
        if let Err(e) = net::answer(&mut send, &reply, &module).await {
            tracing::warn!("cannot answer the coordinator: {e}");
        }
        if stop {
            // Stop once the coordinator has read the answer.
            let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
            let _ = shared.shutdown.send(true);
            return;
        }
    }
}

async fn handle_command(shared: &Arc<Shared>, cmd: ServerCommand, payload: Vec<u8>) -> ServerReply {
    match cmd {
        ServerCommand::Prepare { swap, policy } => {
            let prepared =
                match prepare(&shared.runtime, &policy, &payload, &shared.settings, shared.id).await {
                    Ok(module) => check_swap(shared, &module, &policy).await.map(|()| module),
                    Err(e) => Err(e),
                };
            match prepared {
                Ok(module) => {
                    tracing::info!(swap, policy = module.display_name(), "swap prepared");
                    // Backups here find it by its hash: a primary elsewhere may commit, and
                    // stream the swap, before this server has heard the commit.
                    shared.modules.lock().expect("not poisoned").insert(module.sha256(), module.clone());
                    shared
                        .prepared
                        .lock()
                        .expect("not poisoned")
                        .insert(swap, (module, policy, Arc::new(payload)));
                    // Each worker's largest clock here, for the levelling the commit brings.
                    let mut frontier = Frontier::default();
                    for status in statuses(shared.primaries()).await {
                        frontier.merge(status.workers);
                    }
                    ServerReply::Clocks(frontier.clocks().collect())
                }
                Err(e) => ServerReply::Error(ServerError::Prepare(e)),
            }
        }
        ServerCommand::Commit { swap, raise } => {
            let Some((module, policy, wasm)) = shared.prepared.lock().expect("not poisoned").remove(&swap)
            else {
                return ServerReply::Error(ServerError::Unprepared(swap));
            };
            *shared.policy.lock().expect("not poisoned") = (swap, policy.clone(), wasm);
            *shared.levelled.lock().expect("not poisoned") = raise.clone();
            let mut failed = Vec::new();
            for (shard, tx) in shared.primaries() {
                let (reply, rx) = oneshot::channel();
                let config = policy.config_for(shard);
                let to = SwapTo { module: module.clone(), config, raise: raise.clone(), swap };
                let cmd = ShardCmd::Swap { to, reply };
                let result = match tx.send(cmd).await {
                    Ok(()) => rx.await.unwrap_or(Err(RequestError::Stopped(shard))),
                    Err(_) => Err(RequestError::Stopped(shard)),
                };
                if let Err(error) = result {
                    failed.push(ShardFailure { shard, error });
                }
            }
            if failed.is_empty() {
                tracing::info!(swap, policy = module.display_name(), "swap committed");
                ServerReply::Ok
            } else {
                ServerReply::Error(ServerError::Commit(failed))
            }
        }
        ServerCommand::Abort { swap } => {
            shared.prepared.lock().expect("not poisoned").remove(&swap);
            ServerReply::Ok
        }
        ServerCommand::Status => ServerReply::Status(status(shared).await),
        ServerCommand::AttachBackup { shard, addr, incarnation } => {
            match attach_backup(shared, shard, addr, incarnation).await {
                Ok(()) => ServerReply::Ok,
                Err(reason) => ServerReply::Error(ServerError::Attach { shard, addr, reason }),
            }
        }
        ServerCommand::Promote { shard } => {
            let Some(tx) = shared.state().take_backup(shard) else {
                return ServerReply::Error(ServerError::NoBackup { shard, server: shared.id });
            };
            // Members not connected here are awaited only the rejoin grace: one that died before
            // this process started (a server restarted since) has no connection here to end.
            let connected = shared.state().connected_workers();
            match ask(shard, &tx, |reply| ShardCmd::Promote { connected, reply }).await {
                Ok(()) => {
                    // It runs the policy this server records (its last committed swap's), unless
                    // it took that swap or a newer one from its old primary.
                    let (swap, blob, raise) = {
                        let (swap, blob, _) = shared.policy.lock().expect("not poisoned").clone();
                        (swap, blob, shared.levelled.lock().expect("not poisoned").clone())
                    };
                    let module = shared.modules.lock().expect("not poisoned").get(&blob.sha256).cloned();
                    if let Some(module) = module {
                        let config = blob.config_for(shard);
                        let _ = tx.send(ShardCmd::Conform(SwapTo { module, config, raise, swap })).await;
                    }
                    // Members whose connection here has ended will not come back: the shard
                    // becomes a primary and learns of them in one step of the server's state, so
                    // a connection that ends meanwhile tells it instead (it is then among the
                    // primaries); a worker told twice leaves once.
                    let gone = shared.state().promoted(shard, tx.clone());
                    for worker in gone {
                        let _ = tx.send(ShardCmd::Lost { worker, reason: LeaveReason::TimedOut }).await;
                    }
                    ServerReply::Ok
                }
                Err(e) => ServerReply::Error(ServerError::Promote(e)),
            }
        }
        ServerCommand::DropBackup { shard } => {
            if let Some(tx) = shared.shard(shard) {
                let _ = tx.send(ShardCmd::DropBackup).await;
            }
            ServerReply::Ok
        }
        ServerCommand::Checkpoint { dir, shard } => match checkpoint(shared, &dir, shard).await {
            Ok(()) => ServerReply::Ok,
            Err(e) => ServerReply::Error(ServerError::Checkpoint(e)),
        },
        ServerCommand::Shutdown => {
            tracing::info!("shutdown requested by the coordinator");
            ServerReply::Ok
        }
        // Answered by `coordinator_loop`, with the module as the payload.
        ServerCommand::Holdings => ServerReply::Holdings(Box::new(rejoin::holdings(shared).await)),
    }
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let addr = incoming.remote_address();
            match incoming.await {
                Ok(conn) => serve_connection(conn, shared).await,
                Err(e) => tracing::debug!(%addr, "handshake failed: {e}"),
            }
        });
    }
}

/// Whether a worker may use this server's shards as `worker`: only with an id below the
/// cluster's `max_workers` and the ticket the coordinator issued for it.
fn admit(settings: &ClusterSettings, worker: WorkerId, ticket: Option<Ticket>) -> Result<(), Unwelcome> {
    if worker >= settings.max_workers {
        return Err(Unwelcome::IdOutOfRange { worker, max: settings.max_workers });
    }
    match ticket {
        Some(t) if t.admits(&settings.admission_key.0, worker) => Ok(()),
        Some(_) => Err(Unwelcome::ForeignTicket(worker)),
        None => Err(Unwelcome::NoTicket(worker)),
    }
}

/// What a connection's streams share.
struct Peer {
    worker: Option<WorkerId>,
    /// The connection's `stable_id`.
    conn: usize,
    /// The most values a tensor from it may decode to: its model's length (from its hello),
    /// within the payload limit.
    max_values: usize,
    controls: mpsc::UnboundedSender<ControlMessage>,
}

async fn serve_connection(conn: quinn::Connection, shared: Arc<Shared>) {
    let addr = conn.remote_address();
    let Some((hello, mut send)) = net::accept_hello(&conn, &shared.token, None).await else { return };
    let max_values = match hello.role {
        Role::Worker { model_len, .. } => {
            usize::try_from(model_len).unwrap_or(usize::MAX).min(shared.limits.max_payload / 4)
        }
        _ => 0,
    };
    let worker = match hello.role {
        Role::Worker { worker: Some(w), ticket, .. } => match admit(&shared.settings, w, ticket) {
            Ok(()) => Some(w),
            Err(reason) => {
                tracing::warn!(%addr, worker = w, "refused a worker: {reason}");
                let text = reason.to_string();
                net::refuse(&mut send, reason).await;
                conn.close(close::PROTOCOL.into(), text.as_bytes());
                return;
            }
        },
        Role::Operator => None,
        Role::Replica { server } => {
            if net::answer(&mut send, &Welcome::Accepted, &[]).await.is_ok() {
                tracing::debug!(%addr, server, "replication connection");
                let _sharing = shared.windows.join(&conn);
                serve_replicas(conn, shared).await;
            }
            return;
        }
        other => {
            let reason = match other {
                Role::Worker { .. } => Unwelcome::NoId,
                _ => Unwelcome::WrongPlace(PeerKind::Server),
            };
            let text = reason.to_string();
            net::refuse(&mut send, reason).await;
            conn.close(close::PROTOCOL.into(), text.as_bytes());
            return;
        }
    };
    if net::answer(&mut send, &Welcome::Accepted, &[]).await.is_err() {
        return;
    }
    tracing::debug!(%addr, ?worker, "peer connected");
    if let Some(w) = worker {
        shared.state().connected(w, conn.stable_id());
    }
    shared.traffic.lock().expect("not poisoned").0.push(conn.clone());
    let _sharing = shared.windows.join(&conn);
    let (controls, control_rx) = mpsc::unbounded_channel();
    let peer = Arc::new(Peer { worker, conn: conn.stable_id(), max_values, controls });
    let writer = tokio::spawn(write_controls(conn.clone(), control_rx));
    loop {
        match conn.accept_bi().await {
            Ok((send, recv)) => {
                tokio::spawn(serve_stream(conn.clone(), send, recv, shared.clone(), peer.clone()));
            }
            Err(e) => {
                let reason = match &e {
                    quinn::ConnectionError::TimedOut => LeaveReason::TimedOut,
                    quinn::ConnectionError::ApplicationClosed(c) if c.error_code == close::DONE.into() => {
                        LeaveReason::Finished
                    }
                    _ => LeaveReason::Failed,
                };
                if let Some(w) = worker {
                    // Only what this connection still owns: a newer one of the same worker may
                    // have joined since (a restarted process), and keeps its memberships.
                    let ended = shared.state().connection_ended(w, peer.conn);
                    if !ended.leave.is_empty() {
                        let left: Vec<u32> = ended.leave.iter().map(|(s, _)| *s).collect();
                        tracing::warn!(%addr, worker = w, ?reason, "worker lost ({e}); it leaves shards {left:?}");
                    }
                    for (_, tx) in ended.leave {
                        let _ = tx.send(ShardCmd::Leave { worker: w, reason, reply: None }).await;
                    }
                    // Shards promoted here may await it still: it joined them on their old primary.
                    for (_, tx) in ended.lost {
                        let _ = tx.send(ShardCmd::Lost { worker: w, reason }).await;
                    }
                }
                break;
            }
        }
    }
    writer.abort();
    let mut t = shared.traffic.lock().expect("not poisoned");
    t.0.retain(|c| c.stable_id() != conn.stable_id());
    let s = conn.stats();
    t.1 += s.udp_tx.bytes;
    t.2 += s.udp_rx.bytes;
}

async fn write_controls(conn: quinn::Connection, mut rx: mpsc::UnboundedReceiver<ControlMessage>) {
    let mut scratch = Vec::new();
    while let Some(msg) = rx.recv().await {
        let Ok(mut send) = conn.open_uni().await else { return };
        if let Err(e) = wire::write_frame(&mut send, &msg, Payload::EMPTY, &mut scratch).await {
            tracing::debug!("control message not delivered: {e}");
        }
    }
}

fn malformed(conn: &quinn::Connection, e: &WireError) {
    tracing::warn!(addr = %conn.remote_address(), "closing a connection that sent a bad frame: {e}");
    conn.close(close::MALFORMED.into(), format!("malformed message: {e}").as_bytes());
}

async fn serve_stream(
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    shared: Arc<Shared>,
    peer: Arc<Peer>,
) {
    let mut scratch = Vec::new();
    let head = match wire::read_head::<DataRequest>(&mut recv, &shared.limits, &mut scratch).await {
        Ok(h) => h,
        Err(e) => return malformed(&conn, &e),
    };
    let payload = match wire::f32_count(head.payload_len) {
        Ok(n) => {
            let mut payload = shared.pool.take(n);
            match wire::read_payload_into(&mut recv, head.payload_len, &mut payload).await {
                Ok(()) => payload,
                Err(e) => return malformed(&conn, &e),
            }
        }
        Err(e) => return malformed(&conn, &e),
    };
    if let Err(e) = wire::expect_end(&mut recv).await {
        return malformed(&conn, &e);
    }
    let pulled = match &head.header {
        DataRequest::Pull { shard, .. } => Some(*shard),
        _ => None,
    };
    let (answer, values) = handle_request(&shared, &peer, head.header, payload).await;
    if let (Some(shard), Some(_)) = (pulled, &values) {
        // A model's first layers are its first shards' keys: their pulls go first when several
        // answers share this connection, so that the worker's next forward pass can start
        // while the last layers still travel (ByteScheduler's order).
        let _ = send.set_priority(-i32::try_from(shard).unwrap_or(i32::MAX));
    }
    let result = match values {
        Some(v) => {
            wire::write_frame(&mut send, &answer, shared.pool.send_shared(v).into(), &mut scratch).await
        }
        None => wire::write_frame(&mut send, &answer, Payload::EMPTY, &mut scratch).await,
    };
    if let Err(e) = result {
        tracing::debug!("answer not delivered: {e}");
    }
}

/// Asks shard `shard`'s task and waits for its answer, refusals typed as the shard made them.
async fn ask<T>(
    shard: u32,
    tx: &mpsc::Sender<ShardCmd>,
    make: impl FnOnce(oneshot::Sender<Result<T, RequestError>>) -> ShardCmd,
) -> Result<T, RequestError> {
    let (reply, rx) = oneshot::channel();
    tx.send(make(reply)).await.map_err(|_| RequestError::Stopped(shard))?;
    rx.await.map_err(|_| RequestError::Stopped(shard))?
}

async fn handle_request(
    shared: &Shared,
    peer: &Peer,
    req: DataRequest,
    payload: Vec<f32>,
) -> (DataResponse, Option<Arc<Vec<f32>>>) {
    let shard = match &req {
        DataRequest::Join { shard }
        | DataRequest::Push { shard, .. }
        | DataRequest::Pull { shard, .. }
        | DataRequest::Finished { shard, .. }
        | DataRequest::Leave { shard }
        | DataRequest::Read { shard }
        | DataRequest::PushTasks { shard, .. }
        | DataRequest::TasksYielded { shard, .. }
        | DataRequest::ControlApplied { shard, .. }
        | DataRequest::Skip { shard, .. }
        | DataRequest::Waiting { shard, .. } => *shard,
    };
    let Some(tx) = shared.shard(shard) else {
        let server = shared.id;
        if shared.lease.is_some() {
            return (DataResponse::Unavailable(NotServing::NotPrimary { shard, server }), None);
        }
        return (DataResponse::Error(DataError::NotHere { shard, server }), None);
    };
    let tx = &tx;
    if let Some(lease) = &shared.lease {
        if !lease.lock().expect("not poisoned").valid(ns_since(shared.epoch))
            && !matches!(req, DataRequest::Read { .. })
        {
            // Cut off from the coordinator: its backup may be taking over, so no more.
            return (DataResponse::Unavailable(NotServing::LeaseLost { server: shared.id }), None);
        }
    }
    let worker = match (&req, peer.worker) {
        (DataRequest::Read { .. }, _) => 0,
        (_, Some(w)) => w,
        (_, None) => return (DataResponse::Error(DataError::ReadOnly), None),
    };
    let err = |e: DataError| (DataResponse::Error(e), None);
    // The shard's own refusals, typed as it made them.
    let refused = |e: RequestError| (DataResponse::Refused(e), None);
    match req {
        DataRequest::Join { .. } => {
            let controls = peer.controls.clone();
            match ask(shard, tx, |reply| ShardCmd::Join { worker, init: payload, controls, reply }).await {
                Ok(joined) => {
                    // Its connection may have ended while the join waited (for the backup):
                    // then nobody would end the membership, and the worker leaves now.
                    let orphaned = shared.state().joined(worker, shard, peer.conn);
                    if let Some(tx) = orphaned {
                        tracing::warn!(
                            worker,
                            shard,
                            "a join answered after the worker's connection ended; it leaves"
                        );
                        let _ = tx
                            .send(ShardCmd::Leave { worker, reason: LeaveReason::Failed, reply: None })
                            .await;
                    }
                    match joined {
                        Joined::Fresh { clock, next } => (DataResponse::Joined { clock, next }, None),
                        Joined::Rejoined { next, clock } => (DataResponse::Rejoined { next, clock }, None),
                    }
                }
                Err(e) => refused(e),
            }
        }
        DataRequest::Push { iteration, samples, based_on, .. }
        | DataRequest::PushTasks { iteration, samples, based_on, .. } => {
            let (tasks, local_steps, codec, signals) = match req {
                DataRequest::PushTasks { owner, mask, total, .. } => {
                    (Some((owner, TaskPart { mask, total })), 0, Codec::None, Signals::default())
                }
                DataRequest::Push { local_steps, codec, signals, .. } => (None, local_steps, codec, signals),
                _ => (None, 0, Codec::None, Signals::default()),
            };
            // Decoded here, on the connection's task, before the shard or its backup sees it.
            shared.count_payload(false, codec, payload.len());
            let grad = if codec == Codec::None {
                payload
            } else {
                let mut grad = shared.pool.take(0);
                let decoded =
                    crate::codec::decode(codec, bytemuck::cast_slice(&payload), peer.max_values, &mut grad);
                shared.pool.give(payload);
                if let Err(e) = decoded {
                    return err(DataError::Undecodable(e));
                }
                grad
            };
            let push = PushHeader { worker, iteration, samples, based_on, tasks, local_steps, signals };
            let push = |reply| ShardCmd::Push { push, grad, reply };
            match ask(shard, tx, push).await {
                Ok(PushOutcome::Applied) => (DataResponse::PushAcked, None),
                Ok(PushOutcome::Dropped) => (DataResponse::PushDropped, None),
                Ok(PushOutcome::Duplicate) => (DataResponse::PushDuplicate, None),
                Err(e) => refused(e),
            }
        }
        DataRequest::TasksYielded { to, iteration, first, count, total, batch, part, .. } => {
            let split = MovedTasks { total, batch, part };
            let handover = Handover { owner: worker, to, iteration, first, count, split };
            if !handover.is_valid() {
                return err(DataError::NoSuchTasks { first, count, total });
            }
            let _ = tx.send(ShardCmd::Yielded { handover }).await;
            (DataResponse::Ok, None)
        }
        DataRequest::ControlApplied { control, iteration, .. } => {
            let applied = Applied { worker, control, iteration };
            let _ = tx.send(ShardCmd::Applied { applied }).await;
            (DataResponse::Ok, None)
        }
        DataRequest::Skip { to, .. } => {
            match ask(shard, tx, |reply| ShardCmd::Skip { worker, to, reply }).await {
                Ok(()) => (DataResponse::Ok, None),
                Err(e) => refused(e),
            }
        }
        DataRequest::Pull { iteration, .. } => {
            match ask(shard, tx, |reply| ShardCmd::Pull { worker, iteration, reply }).await {
                Ok(s) => {
                    let (local_steps, codec) = (s.local_steps, s.codec);
                    let values = match codec {
                        Codec::None => s.values,
                        _ => Arc::new(encode_pull(shared, codec, &s.values)),
                    };
                    shared.count_payload(true, codec, values.len());
                    let (clock, version, waited_ns) = (s.clock, s.version, s.waited_ns);
                    (DataResponse::Pulled { clock, version, waited_ns, local_steps, codec }, Some(values))
                }
                Err(e) => refused(e),
            }
        }
        DataRequest::Finished { report, .. } => {
            if report.worker != worker {
                return err(DataError::ReportForOther { worker, named: report.worker });
            }
            let _ = tx.send(ShardCmd::Finished { report }).await;
            (DataResponse::Ok, None)
        }
        DataRequest::Waiting { iteration, waiting, .. } => {
            let _ = tx.send(ShardCmd::Waiting { worker, iteration, waiting }).await;
            (DataResponse::Ok, None)
        }
        DataRequest::Leave { .. } => {
            shared.state().left(worker, shard, peer.conn);
            match ask(shard, tx, |reply| ShardCmd::Leave {
                worker,
                reason: LeaveReason::Finished,
                reply: Some(reply),
            })
            .await
            {
                Ok(()) => (DataResponse::Ok, None),
                Err(e) => refused(e),
            }
        }
        DataRequest::Read { .. } => match ask(shard, tx, |reply| ShardCmd::Read { reply }).await {
            Ok((version, values)) => (DataResponse::Values { version }, Some(values)),
            Err(e) => refused(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{admit, Renewal};
    use crate::net::proto::{
        AdmissionKey, Asker, ClusterSettings, CoordError, CoordResponse, LeaseEnd, Ticket, Unwelcome,
    };
    use crate::shard::{OptimizerConfig, PushWeight};

    /// Only a lease's end stops a server: an error it does not understand (a newer
    /// coordinator's, a refusal of a message it should not have sent) leaves it renewing.
    #[test]
    fn only_a_lease_end_stops_a_server_and_an_error_it_does_not_understand_does_not() {
        let renewed = CoordResponse::Renewed { terms: vec![2, 0] };
        assert_eq!(Renewal::of(Ok(renewed)), Renewal::Renewed(vec![2, 0]));
        for end in [LeaseEnd::FailedOver, LeaseEnd::Replaced, LeaseEnd::Unknown(3)] {
            assert_eq!(Renewal::of(Ok(CoordResponse::LeaseEnded(end))), Renewal::Ended(end));
        }
        let refused = Renewal::of(Ok(CoordResponse::Error(CoordError::NotForRole(Asker::Server))));
        assert!(matches!(&refused, Renewal::NotRenewed(why) if why.contains("may not send")), "{refused:?}");
        assert!(matches!(Renewal::of(Ok(CoordResponse::Ok)), Renewal::NotRenewed(_)));
        assert!(matches!(Renewal::of(Err("timed out".into())), Renewal::NotRenewed(_)));
    }

    fn settings(key: u8) -> ClusterSettings {
        ClusterSettings {
            shards: 2,
            servers: 2,
            optimizer: OptimizerConfig::default(),
            local_sgd: crate::shard::LocalSgdConfig::default(),
            pull_codec: crate::shard::Codec::None,
            push_weight: PushWeight::default(),
            seed: 0,
            peer_timeout_ms: 1000,
            restore: None,
            replicas: 1,
            max_workers: 8,
            admission_key: AdmissionKey([key; 32]),
            no_progress_ms: 30_000,
        }
    }

    #[test]
    fn only_admitted_ids_in_range_reach_the_shards() {
        let s = settings(1);
        let ticket = |w| Some(Ticket::issue(&s.admission_key.0, w));
        assert_eq!(admit(&s, 3, ticket(3)), Ok(()));
        assert_eq!(admit(&s, 7, ticket(7)), Ok(()));
        assert_eq!(admit(&s, 8, ticket(8)), Err(Unwelcome::IdOutOfRange { worker: 8, max: 8 }));
        let far = 4_000_000_000;
        assert_eq!(admit(&s, far, ticket(far)), Err(Unwelcome::IdOutOfRange { worker: far, max: 8 }));
        assert_eq!(admit(&s, 3, None), Err(Unwelcome::NoTicket(3)));
        assert_eq!(admit(&s, 3, ticket(4)), Err(Unwelcome::ForeignTicket(3)));
        let other = settings(2);
        assert_eq!(admit(&other, 3, ticket(3)), Err(Unwelcome::ForeignTicket(3)));
        assert!(admit(&s, 3, None).unwrap_err().to_string().contains("without a ticket"));
    }
}
