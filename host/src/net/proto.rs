//! The messages nodes exchange, one place for all of them. Headers are postcard; tensors and
//! module bytes travel as the frame's payload (see [`super::wire`]).
//!
//! Every connection starts with a [`Hello`] on its first stream, carrying the cluster token; a
//! node answers a bad token by closing the connection, and nothing else. postcard is positional:
//! never reorder fields or variants; add variants only at the end, and bump
//! [`PROTOCOL_VERSION`] for anything else.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Control, IterationReport, Signals, WorkerClock, WorkerId};

use crate::shard::{ClockRaise, Codec, LocalSgdConfig, OptimizerConfig, PushWeight, ShardStats};
pub use syncopate_engine::coordinator::Held;

/// The protocol version a [`Hello`] carries.
pub const PROTOCOL_VERSION: u32 = 20;

/// Who is connecting.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Role {
    /// A server registering with the coordinator; its data plane listens at `data_addr`.
    Server {
        /// Where workers reach it.
        data_addr: SocketAddr,
        /// The id of a server registered before, coming back to a coordinator that restarted
        /// (or lost its connection): the coordinator then asks for its [`Holdings`]. `None`: a
        /// new server.
        rejoin: Option<u32>,
    },
    /// A worker: to the coordinator, with the length of its model; to a server, with its id
    /// and the ticket the coordinator admitted it with.
    Worker {
        /// Its id: required by a server; asked for from the coordinator (which assigns the
        /// lowest free id when this is `None`, and refuses one at or past `--max-workers`).
        worker: Option<WorkerId>,
        /// How many parameters its model has.
        model_len: u64,
        /// To a server: the [`Ticket`] from the coordinator's [`Welcome::Worker`]. A server
        /// refuses a worker without a valid one, so only ids the coordinator admitted reach a
        /// shard.
        ticket: Option<Ticket>,
    },
    /// An operator (swap, status, shutdown) or a reader of the parameters (evaluator, `local`).
    Operator,
    /// Another server, streaming the ops of shards it is primary for to their backups here.
    Replica {
        /// Its id.
        server: u32,
    },
}

/// Proof that the coordinator admitted a worker id: a SHA-256 over the cluster's admission key
/// (which only the coordinator and the servers hold) and the id. It guards against ids nobody
/// admitted (a typo, a stale script, a worker of another run), not against a peer that holds
/// the cluster token and means harm: such a peer can ask the coordinator for an id anyway.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ticket(pub [u8; 32]);

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket(..)")
    }
}

impl Ticket {
    /// The ticket of `worker` under `key`.
    pub fn issue(key: &[u8; 32], worker: WorkerId) -> Ticket {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"syncopate worker ticket v1");
        h.update(key);
        h.update(worker.to_le_bytes());
        Ticket(h.finalize().into())
    }

    /// Whether this is `worker`'s ticket under `key` (compared in constant time).
    pub fn admits(&self, key: &[u8; 32], worker: WorkerId) -> bool {
        let want = Ticket::issue(key, worker);
        self.0.iter().zip(want.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// The most workers a cluster admits unless told otherwise (`--max-workers`). Worker ids are
/// `0..max_workers`; each costs a server a few dozen bytes per shard it holds, plus what the
/// policy keeps per worker inside its capped memory (`docs/fault-tolerance.md`).
pub use crate::shard::DEFAULT_MAX_WORKERS;

/// The largest `--max-workers` a cluster may be started with.
pub const MAX_WORKERS_LIMIT: u32 = 1 << 20;

/// The first message on every connection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The cluster token (operators may need the operator token).
    pub token: String,
    /// Who is connecting.
    pub role: Role,
}

/// How the cluster trains: given to every server at registration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterSettings {
    /// Shards the model is split into.
    pub shards: u32,
    /// Servers in the cluster.
    pub servers: u32,
    /// The optimizer every shard runs.
    pub optimizer: OptimizerConfig,
    /// Local steps and the outer optimizer every shard starts with (protocol 8).
    pub local_sgd: LocalSgdConfig,
    /// The codec shards answer pulls in until a policy sets another (protocol 8).
    pub pull_codec: Codec,
    /// The weight of a push the policy does not weigh itself.
    pub push_weight: PushWeight,
    /// Seed of the policies' random sources.
    pub seed: u64,
    /// A silent peer is dropped after this many milliseconds.
    pub peer_timeout_ms: u64,
    /// A checkpoint round's folder to restore every shard from (`--resume`), instead of
    /// creating shards from the first worker's parameters.
    pub restore: Option<String>,
    /// Backups per shard: 0, or 1 (shard `k`'s backup on server `(k + 1) % servers`).
    pub replicas: u32,
    /// Worker ids are `0..max_workers`: a server refuses any other, and each shard bounds
    /// its per-worker state by it.
    pub max_workers: u32,
    /// The key the coordinator issues workers' [`Ticket`]s under. A coordinator draws it at
    /// start; one restarted while the servers ran on takes it back from them.
    pub admission_key: AdmissionKey,
    /// How long every live worker may wait on a shard's policy before that is the rule's
    /// failure, in milliseconds; 0: never ([`crate::shard::SupervisorConfig::no_progress_ns`];
    /// protocol 13).
    pub no_progress_ms: u64,
}

/// The key of worker [`Ticket`]s (never printed).
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionKey(pub [u8; 32]);

impl std::fmt::Debug for AdmissionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdmissionKey(..)")
    }
}

impl ClusterSettings {
    /// Whether shards have backups.
    pub fn replicated(&self) -> bool {
        self.replicas > 0 && self.servers > 1
    }

    /// The server holding shard `shard`'s backup at start, if it has one.
    pub fn backup_of(&self, shard: u32) -> Option<u32> {
        backup_server(shard, self.servers, self.replicas)
    }
}

pub use crate::placement::backup_server;

/// The first frame of a replication stream: which shard's ops follow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaOpen {
    /// The shard.
    pub shard: u32,
    /// The primary's term for it (see [`Holdings`]).
    pub term: u64,
}

/// What a server holds, as it tells a coordinator that restarted while the server ran on: from
/// every server's holdings the new coordinator rebuilds the map of shards to servers, the
/// policy and the swap count, which the old one kept only in memory.
///
/// A shard's *term* counts its promotions: 0 where the cluster started it, one more each time
/// a backup takes over. A backup follows its primary's term. Two servers can both claim to be a
/// shard's primary only when the old coordinator promoted a backup and died before the old
/// primary heard it was failed over; the higher term is the live one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Holdings {
    /// The settings it was welcomed with.
    pub settings: ClusterSettings,
    /// The policy its shards run (the module is the reply's payload).
    pub policy: PolicyBlob,
    /// Its id, shards with their terms, swaps, and the terms it heard of: what the coordinator's
    /// machine rebuilds the cluster from ([`CoordinatorMachine::rebuild`]).
    ///
    /// [`CoordinatorMachine::rebuild`]: syncopate_engine::coordinator::CoordinatorMachine::rebuild
    pub held: Held,
}

/// A policy module as distributed: its bytes travel as the payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyBlob {
    /// A label for logs (file name or built-in name).
    pub label: String,
    /// SHA-256 of the module bytes, checked by every receiver.
    pub sha256: [u8; 32],
    /// Configuration for every shard.
    pub config: Vec<(String, String)>,
    /// Per-shard overrides of single keys: `(shard, key, value)`.
    pub overrides: Vec<(u32, String, String)>,
}

impl PolicyBlob {
    /// The configuration shard `shard` runs with.
    pub fn config_for(&self, shard: u32) -> Vec<(String, String)> {
        crate::builtin::shard_config(&self.config, &self.overrides, shard)
    }
}

/// Where a shard lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPlace {
    /// The shard.
    pub shard: u32,
    /// Its first parameter (flat index).
    pub start: u64,
    /// One past its last parameter.
    pub end: u64,
    /// The server holding it.
    pub server: u32,
}

/// The coordinator's answer to a [`Hello`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Welcome {
    /// To a server (the module's bytes are the payload).
    Server {
        /// Its id.
        server: u32,
        /// How the cluster trains.
        settings: ClusterSettings,
        /// The policy in force.
        policy: PolicyBlob,
        /// Swaps committed so far (the policy's number).
        swaps: u64,
        /// It was restarted in the place of a lost server (under that server's id and at its
        /// address): it starts holding nothing, and gets backups from the primaries as the
        /// coordinator attaches them (protocol 12).
        #[serde(default)]
        replacing: bool,
    },
    /// To a worker.
    Worker {
        /// Its id.
        worker: WorkerId,
        /// Where each shard lives.
        shards: Vec<ShardPlace>,
        /// Data addresses of the servers, by server id.
        servers: Vec<SocketAddr>,
        /// A silent peer is dropped after this many milliseconds.
        peer_timeout_ms: u64,
        /// Workers the cluster expects (its start barrier; 0: none).
        workers: u32,
        /// The servers' optimizer (what a push of a weight change must be scaled by).
        optimizer: OptimizerConfig,
        /// The codec it pushes in until a policy sets another (protocol 8).
        push_codec: Codec,
        /// Whether shards have backups: a worker then waits for a lost shard to move (a
        /// [`WorkerNotice::Moved`]) and retries there, instead of failing.
        replicated: bool,
        /// What the worker shows the servers to prove the coordinator admitted its id.
        ticket: Ticket,
    },
    /// To an operator, or to a worker or reader on a server's data plane.
    Accepted,
    /// The hello was understood but cannot be served (wrong model length, cluster full...;
    /// protocol 17: a code, not a string).
    Refused(Unwelcome),
    /// Not now: a server restarted in a lost server's place before the coordinator can give
    /// it the id back (the old one not failed over yet, or a peer timeout not passed since).
    /// It asks again a heartbeat later (protocol 12; protocol 17: the machine's
    /// [`Refusal::NotYet`](syncopate_engine::coordinator::Refusal::NotYet), not a string).
    NotYet(syncopate_engine::coordinator::Refusal),
}

/// Why a hello is refused ([`Welcome::Refused`]), by the coordinator or a server; the index of
/// each variant is its code (protocol 17).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Unwelcome {
    /// The coordinator's machine refused it: a worker's id or model, a full cluster, a server
    /// id it does not have.
    #[error("{0}")]
    Refused(syncopate_engine::coordinator::Refusal),
    /// A server registering with a full cluster, not at the address of a lost server: workers
    /// reach a server at the address they were given. `lost`: the lost servers, by id and
    /// address.
    #[error("the cluster already has its {servers} servers{}", lost_hint(lost))]
    NotAtLostAddress {
        /// The servers the cluster has.
        servers: u32,
        /// The lost servers, by id and address.
        lost: Vec<(u32, SocketAddr)>,
    },
    /// The coordinator rebuilds its cluster after a restart: no new server may join.
    #[error(
        "this coordinator is rebuilding its cluster from the servers that ran on while it restarted; a new \
         server cannot join it"
    )]
    Rebuilding,
    /// Not every server registered within the start-up time: no worker is admitted.
    #[error("only {have} of {want} servers registered within {waited_ms} ms")]
    ServersMissing {
        /// Servers registered.
        have: u32,
        /// Servers the cluster has.
        want: u32,
        /// How long the coordinator waited.
        waited_ms: u64,
    },
    /// A server coming back to the coordinator is refused.
    #[error("{0}")]
    Rejoin(RejoinRefused),
    /// A connection of a role this listener does not serve (replication goes between servers;
    /// a server's data plane takes workers and readers).
    #[error("this listener does not serve {0}s")]
    WrongPlace(PeerKind),
    /// A worker id at or past the cluster's `--max-workers`, on a server's data plane.
    #[error("worker id {worker} is out of range: this cluster admits ids below {max} (--max-workers)")]
    IdOutOfRange {
        /// The id.
        worker: WorkerId,
        /// The cluster's `max_workers`.
        max: u32,
    },
    /// A worker whose ticket this cluster's coordinator did not issue.
    #[error("worker {0}'s ticket was not issued by this cluster's coordinator")]
    ForeignTicket(WorkerId),
    /// A worker without a ticket, on a server's data plane.
    #[error("worker {0} came without a ticket: join through the coordinator")]
    NoTicket(WorkerId),
    /// A worker without an id, on a server's data plane.
    #[error("a worker on a server's data plane gives the id the coordinator admitted: join through the coordinator")]
    NoId,
}

/// What a refused peer is ([`Unwelcome::WrongPlace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerKind {
    /// A server registering.
    Server,
    /// A server streaming a replica.
    Replica,
}

impl std::fmt::Display for PeerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerKind::Server => "server registration",
            PeerKind::Replica => "replication stream",
        })
    }
}

/// The hint of [`Unwelcome::NotAtLostAddress`].
fn lost_hint(lost: &[(u32, SocketAddr)]) -> String {
    if lost.is_empty() {
        return String::new();
    }
    let unknown = syncopate_engine::coordinator::UNKNOWN_ADDR;
    let lost: Vec<String> = lost
        .iter()
        .map(|(id, addr)| match *addr == unknown {
            // A coordinator restarted without a record (--checkpoint-dir) that it did not rejoin.
            true => format!("server {id}, whose address this coordinator lost at its restart"),
            false => format!("server {id} at {addr}"),
        })
        .collect();
    format!("; a server restarted in a lost one's place must listen at its address ({})", lost.join(", "))
}

/// Why a server coming back to the coordinator is refused ([`Unwelcome::Rejoin`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RejoinRefused {
    /// Not one of the cluster's server ids.
    #[error("server id {server} is not one of this cluster's {servers} servers")]
    NoSuchServer {
        /// The id it gave.
        server: u32,
        /// Servers the cluster has.
        servers: u32,
    },
    /// It did not say what it holds: the coordinator's account of the exchange (a peer's
    /// answer outside the protocol, or none).
    #[error("it did not say what it holds: {0}")]
    NoHoldings(String),
    /// It gave one id and holds another server's shards.
    #[error("it says it is server {said}, but holds server {holds}'s shards")]
    HoldsAnother {
        /// The id it gave.
        said: u32,
        /// The id its holdings name.
        holds: u32,
    },
    /// It was started with other settings than this coordinator.
    #[error("it was started with {setting} {theirs}, this coordinator with {ours}: restart the coordinator with the flags it had")]
    OtherSettings {
        /// Which.
        setting: Setting,
        /// This coordinator's, as shown.
        ours: String,
        /// The server's, as shown.
        theirs: String,
    },
    /// This coordinator ran all along and has no such server at that address.
    #[error("server {server} at {addr} is not registered here")]
    NotRegistered {
        /// The id it gave.
        server: u32,
        /// Its data address.
        addr: SocketAddr,
    },
    /// Its lease is refused.
    #[error("{0}")]
    Lease(crate::lease::LeaseError),
    /// Another coordinator admitted it than the servers that rejoined first.
    #[error(
        "server {0} was admitted by another coordinator than the servers that rejoined first (its admission \
         key differs): it belongs to another cluster"
    )]
    OtherCluster(u32),
    /// The rebuild's gathering refused it.
    #[error("{0}")]
    Gather(syncopate_engine::coordinator::GatherError),
    /// It was failed over before the coordinator restarted: `shard` has a newer primary. It
    /// stops.
    #[error(
        "this server was failed over before the coordinator restarted (shard {shard} has a newer primary)"
    )]
    FailedOver {
        /// A shard it claims at a stale term.
        shard: u32,
    },
}

/// A cluster setting a server and a restarted coordinator must share
/// ([`RejoinRefused::OtherSettings`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Setting {
    /// `--shards`.
    Shards,
    /// `--servers`.
    Servers,
    /// `--replicas`.
    Replicas,
    /// `--max-workers`.
    MaxWorkers,
    /// The optimizer, the push weighting and the seed.
    Training,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Setting::Shards => "--shards",
            Setting::Servers => "--servers",
            Setting::Replicas => "--replicas",
            Setting::MaxWorkers => "--max-workers",
            Setting::Training => "the training settings",
        })
    }
}

/// Requests to the coordinator, after the hello.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordRequest {
    /// A worker is leaving cleanly.
    Leaving {
        /// The worker.
        worker: WorkerId,
    },
    /// Swap the cluster's policy (operators only); the module's bytes are the payload.
    Swap(PolicyBlob),
    /// What runs where (operators only).
    Status,
    /// Stop every server and the coordinator (operators only).
    Shutdown,
    /// A worker has joined its shards; answered when training may start (once the cluster's
    /// expected workers have all joined, so they all start at iteration 0).
    Ready {
        /// The worker.
        worker: WorkerId,
    },
    /// Ask every worker to finish its current iteration and leave (operators only): the
    /// target accuracy or the time budget was reached.
    StopTraining,
    /// Swap back to the policy that ran before the last swap (operators only).
    Rollback,
    /// A worker scored the model it computes on (a training script's own evaluation): the
    /// launcher's watcher reads the latest from the status, for its target and plots.
    Score {
        /// The worker.
        worker: WorkerId,
        /// The score.
        score: ModelScore,
    },
    /// A server renews its lease (sent every [`HEARTBEAT_MS`]): answered `Ok`, the server may
    /// accept pushes for [`LEASE_MS`] from when it sent this.
    Heartbeat {
        /// The server.
        server: u32,
    },
    /// The launcher scored the model it read from the servers with its own evaluator (operators
    /// only): kept as [`ClusterStatus::evaluated`] for `policy status` and the dashboard
    /// (protocol 20).
    Evaluated {
        /// The score; `iteration` is the iterations pushed when the model was read.
        score: ModelScore,
    },
}

/// The lease rule's timings ([`crate::lease`]), where the messages that carry it live.
pub use crate::lease::{FAILOVER_MS, FIRST_HEARTBEAT_MS, HEARTBEAT_MS, LEASE_MS};

/// How long a server or worker waits for a lost coordinator to come back (restarted at the same
/// address) before it gives up. Meanwhile servers with backups serve nothing (their leases
/// lapse) and workers wait for them; servers without backups go on serving.
pub const COORDINATOR_WAIT_MS: u64 = 60_000;

/// How long a restarted coordinator waits for every server to rejoin before it rebuilds the
/// cluster from those that did: the others are failed over, as if their leases had lapsed.
pub use syncopate_engine::coordinator::REJOIN_WAIT_MS;

/// A model's score on held-out data, as a worker measured it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelScore {
    /// The worker's iteration when it scored (the model it last pulled).
    pub iteration: u64,
    /// Share of the test set classified right, 0 to 1.
    pub accuracy: f32,
    /// Mean test loss, where the worker measured it.
    pub loss: Option<f32>,
}

/// The latest [`ModelScore`] the coordinator received.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReportedScore {
    /// Who sent it.
    pub worker: WorkerId,
    /// What it measured.
    pub score: ModelScore,
    /// Scores received so far (a new one changes this).
    pub count: u64,
}

/// What the coordinator tells a worker, on a unidirectional stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum WorkerNotice {
    /// Finish the current iteration and leave.
    Stop,
    /// A shard has a new primary (its server died and its backup took over): send its requests
    /// to server `server` from now on, rejoining it first.
    Moved {
        /// The shard.
        shard: u32,
        /// The server (index in the welcome's list) now holding it.
        server: u32,
    },
}

/// The coordinator's answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordResponse {
    /// Done.
    Ok,
    /// The swap took effect on every shard.
    Swapped {
        /// The swap's sequence number.
        swap: u64,
        /// Shards switched.
        shards: u32,
    },
    /// The cluster's state.
    Status(Box<ClusterStatus>),
    /// The request failed; nothing changed (protocol 16: a code, not a string).
    Error(CoordError),
    /// A server's lease is renewed; every shard's term, by shard (how many times it was
    /// promoted), for the server to tell a restarted coordinator
    /// ([`Held::known`]).
    Renewed {
        /// Per shard, its term.
        terms: Vec<u64>,
    },
    /// The swap was committed, but some shards could not switch, with why (protocol 13): a
    /// server that did not answer the commit (dead, or cut off: its shards are failed over),
    /// or a shard on which the module could not even start.
    SwappedPartly {
        /// The swap's sequence number.
        swap: u64,
        /// The servers whose shards did not all switch, each with its account (protocol 16).
        failed: Vec<ServerFailure>,
    },
    /// A server's lease renewal is refused for good (protocol 15): it must stop, its shards
    /// have other primaries. The only answer to a renewal that stops a server; an
    /// [`Error`](Self::Error) it does not understand leaves it renewing.
    LeaseEnded(LeaseEnd),
}

/// Who asked the coordinator something it does not answer for them
/// ([`CoordError::NotForRole`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Asker {
    /// A server, on its registration connection.
    Server,
    /// A worker.
    Worker,
    /// An operator.
    Operator,
}

impl std::fmt::Display for Asker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Asker::Server => "a server",
            Asker::Worker => "a worker",
            Asker::Operator => "an operator",
        })
    }
}

/// One server's part in a failed swap: its id, its address if the coordinator knows it, and
/// its account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerFailure {
    /// The server.
    pub server: u32,
    /// Where it listens, if it registered.
    pub addr: Option<SocketAddr>,
    /// What it said, or why it said nothing.
    pub reason: String,
}

impl std::fmt::Display for ServerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            Some(addr) => write!(f, "server {} ({addr}): {}", self.server, self.reason),
            None => write!(f, "server {}: {}", self.server, self.reason),
        }
    }
}

pub use syncopate_engine::coordinator::listed;

/// Why the coordinator refuses a request ([`CoordResponse::Error`]). The variant is the code a
/// program acts on; where the account of a failure comes from outside this protocol (a module
/// that does not compile, a policy that refuses the state handed over, a server that did not
/// answer) the variant carries it as text, for people. The wire carries the variant's index
/// (pinned by a test): add variants only at the end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CoordError {
    /// The request is not one this connection's role makes.
    #[error("{0} may not send that request")]
    NotForRole(Asker),
    /// A score out of range.
    #[error("a score's accuracy must be within 0..=1 and its loss finite")]
    BadScore,
    /// A server did not report its status (a cluster without backups, where the status
    /// cannot go on without it).
    #[error("server {server} ({addr}) did not report: {reason}")]
    NoStatus {
        /// The server.
        server: u32,
        /// Where it listens.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A rollback, but no swap has happened.
    #[error("no swap to roll back")]
    NoSwapYet,
    /// A rollback, but no earlier policy ran without failures.
    #[error("no earlier policy ran without failures: nothing to roll back to (swap one in)")]
    NoGoodPolicy,
    /// A swap whose module's bytes do not match its sha256.
    #[error("the module's bytes do not match its sha256")]
    Digest,
    /// A swap to a module that does not compile or is not a policy (the host's account).
    #[error("{0}")]
    Module(String),
    /// A swap that cannot begin now.
    #[error(transparent)]
    Busy(#[from] syncopate_engine::coordinator::SwapError),
    /// A swap the coordinator gave up (it lost its round).
    #[error("swap {0} was abandoned")]
    Abandoned(u64),
    /// A swap that no server switched to, with each server's account.
    #[error("no server switched: {}", listed(.0))]
    NoneSwitched(Vec<ServerFailure>),
}

pub use syncopate_engine::coordinator::{ServerError, ShardFailure};

/// Why the coordinator ended a server's lease ([`CoordResponse::LeaseEnded`]). The wire carries
/// the variant's index (pinned by a test): add variants only at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum LeaseEnd {
    /// Its lease lapsed and it was failed over.
    #[error("this server was failed over")]
    FailedOver,
    /// It was failed over, and a process restarted under its id has taken the id.
    #[error("this server was failed over, and a restarted one has taken its id")]
    Replaced,
    /// The coordinator knows no server of this id (one that restarted and lost its records,
    /// say).
    #[error("server {0} is not registered here")]
    Unknown(u32),
}

impl From<syncopate_engine::lease::LeaseError> for LeaseEnd {
    fn from(e: syncopate_engine::lease::LeaseError) -> Self {
        use syncopate_engine::lease::LeaseError;
        match e {
            LeaseError::FailedOver => Self::FailedOver,
            LeaseError::Unknown(server) => Self::Unknown(server),
        }
    }
}

/// Commands from the coordinator to a server, on the server's registration connection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServerCommand {
    /// Compile and check a module off the hot path (the bytes are the payload); answered with
    /// [`ServerReply::Clocks`].
    Prepare {
        /// The swap.
        swap: u64,
        /// The module.
        policy: PolicyBlob,
    },
    /// Switch every shard to the prepared module.
    Commit {
        /// The swap.
        swap: u64,
        /// How far each worker's clock is raised on every shard (the levelling the coordinator
        /// chose from the servers' clocks, see [`crate::shard::Frontier`]).
        raise: Vec<ClockRaise>,
    },
    /// Forget a prepared module.
    Abort {
        /// The swap.
        swap: u64,
    },
    /// Report the shards' state.
    Status,
    /// Write the snapshot of shard `shard`, which this server is primary for, into a checkpoint
    /// round's folder ([`crate::checkpoint::shard_file`]); refused if it is not its primary.
    Checkpoint {
        /// The round's folder (a path every server reaches: on one machine, or a shared file
        /// system).
        dir: String,
        /// The shard.
        shard: u32,
    },
    /// Stream shard `shard`'s ops to its backup on the server at `addr` (sent once every server
    /// has registered, before workers are welcomed).
    AttachBackup {
        /// The shard.
        shard: u32,
        /// The backup's server.
        addr: SocketAddr,
        /// How many times a restarted process has taken that server's id: a connection made to
        /// an earlier process at the same address is not used (it may not have timed out yet;
        /// protocol 12).
        #[serde(default)]
        incarnation: u32,
    },
    /// This server's backup of `shard` becomes its primary (its primary's server died).
    Promote {
        /// The shard.
        shard: u32,
    },
    /// `shard`'s backup is gone (its server died): stop waiting for it.
    DropBackup {
        /// The shard.
        shard: u32,
    },
    /// Stop.
    Shutdown,
    /// What do you hold? Asked of a server rejoining a restarted coordinator; answered with
    /// [`ServerReply::Holdings`].
    Holdings,
}

/// A server's answers to [`ServerCommand`]s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServerReply {
    /// Done.
    Ok,
    /// The shards' state.
    Status(ServerStatus),
    /// The command failed (protocol 16: a code, not a string).
    Error(ServerError),
    /// What it holds (the module its shards run is the payload).
    Holdings(Box<Holdings>),
    /// Prepared: the clocks of the workers on its primaries (each worker's largest).
    Clocks(Vec<WorkerClock>),
}

/// Requests on a server's data plane.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum DataRequest {
    /// Join a shard. A non-empty payload holds the shard's initial parameters, used only if the
    /// shard does not exist yet.
    Join {
        /// The shard.
        shard: u32,
    },
    /// Push a gradient (the payload).
    Push {
        /// The shard.
        shard: u32,
        /// The iteration it was computed for.
        iteration: u64,
        /// Samples it was computed on.
        samples: u32,
        /// The shard version of the parameters it was computed from (for staleness).
        based_on: Option<u64>,
        /// The local steps it covers: 0, a gradient; more, a pseudo-gradient (protocol 8).
        local_steps: u32,
        /// The codec of the payload ([`crate::codec`]; protocol 8).
        codec: Codec,
        /// What the worker reports of the iteration to the shard's policy: loss, tokens, step
        /// time (protocol 18; the norm is the server's to measure and is ignored).
        signals: Signals,
    },
    /// Pull the parameters before computing `iteration`.
    Pull {
        /// The shard.
        shard: u32,
        /// The iteration.
        iteration: u64,
    },
    /// An iteration is finished.
    Finished {
        /// The shard.
        shard: u32,
        /// The report.
        report: IterationReport,
    },
    /// Leave a shard cleanly.
    Leave {
        /// The shard.
        shard: u32,
    },
    /// Read the parameters without taking part (evaluators, operators): no policy is consulted.
    Read {
        /// The shard.
        shard: u32,
    },
    /// Push some of the tasks of worker `owner`'s iteration (the payload: their gradient, the
    /// mean over their samples): the pusher's own tasks, or tasks a policy moved to it.
    /// Acknowledged as soon as the shard has counted them.
    PushTasks {
        /// The shard.
        shard: u32,
        /// The worker whose iteration the tasks belong to.
        owner: WorkerId,
        /// That worker's iteration (its own numbering on this shard).
        iteration: u64,
        /// Samples the tasks covered.
        samples: u32,
        /// The shard version of the parameters the gradient was computed from.
        based_on: Option<u64>,
        /// Which tasks: bit `t` is task `t` of `total`.
        mask: u64,
        /// Tasks in the iteration.
        total: u32,
    },
    /// The answer to a move request: this worker hands tasks `first..first + count` of its
    /// iteration over to worker `to` (`count` 0: it had started them all).
    TasksYielded {
        /// The shard whose policy asked.
        shard: u32,
        /// The worker that gets the tasks.
        to: WorkerId,
        /// The iteration.
        iteration: u64,
        /// First task handed over.
        first: u32,
        /// How many.
        count: u32,
        /// Tasks in the iteration.
        total: u32,
        /// The iteration's batch size (all tasks together).
        batch: u32,
        /// The data partition the iteration's samples come from.
        part: u32,
    },
    /// A control message from this shard's policy took effect at `iteration`.
    ControlApplied {
        /// The shard whose policy sent it.
        shard: u32,
        /// The control, as applied.
        control: Control,
        /// The first iteration it applies to.
        iteration: u64,
    },
    /// The worker skips to iteration `to` (a policy's `SkipTo`): the iterations before it that
    /// it has not pushed will never come. Answered once the shard has taken it.
    Skip {
        /// The shard.
        shard: u32,
        /// The iteration it continues from.
        to: u64,
    },
    /// The worker's pull of `iteration` has waited a while on some shard (`waiting`), or, after
    /// such a notice, every shard has answered it: a shard that answered it counts it as
    /// waiting meanwhile (the stall rule, `Shard::check_progress`). Protocol 14.
    Waiting {
        /// The shard.
        shard: u32,
        /// The iteration pulled, numbered as the shard numbers this worker's iterations.
        iteration: u64,
        /// Whether it still waits.
        waiting: bool,
    },
}

/// Answers on the data plane.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum DataResponse {
    /// Joined as a new member; the worker starts at this iteration.
    Joined {
        /// Its clock.
        clock: u64,
        /// The iteration the shard expected from it next when it last was a member, in the
        /// numbering it had then (0 if it never was): a worker joining again after losing its
        /// primary numbers its iterations from `next` on from `clock` now
        /// ([`crate::shard::Joined::Fresh`]).
        next: u64,
    },
    /// The push was admitted.
    PushAcked,
    /// The parameters (payload) as served to a pull.
    Pulled {
        /// The worker's clock when served.
        clock: u64,
        /// Optimizer steps applied so far.
        version: u64,
        /// How long the pull was deferred, in nanoseconds.
        waited_ns: u64,
        /// The local steps to take in this iteration (0: push a gradient; protocol 8).
        local_steps: u32,
        /// The codec of the payload ([`crate::codec`]; protocol 8).
        codec: Codec,
    },
    /// Done.
    Ok,
    /// The parameters (payload) for a read.
    Values {
        /// Optimizer steps applied so far.
        version: u64,
    },
    /// The server itself refused the request, before any shard saw it (protocol 16: a code,
    /// not a string); the connection stays open.
    Error(DataError),
    /// The push was acknowledged, but its policy dropped it: the gradient was discarded.
    PushDropped,
    /// The shard already has this iteration from this worker (a retry, or a worker that came
    /// back after a restore): acknowledged, and not applied a second time.
    PushDuplicate,
    /// This server does not hold the shard as its primary now (it lost its lease, or the shard
    /// moved): the worker asks where it is and tries there (protocol 16: a code, not a string).
    Unavailable(NotServing),
    /// Joined again a shard that already counted the worker as a member (it was restored from
    /// a checkpoint, or promoted, or the worker asks where it stands): the next iteration the
    /// shard expects from it, and its clock there.
    Rejoined {
        /// That iteration; earlier ones it pushes are acknowledged as duplicates.
        next: u64,
        /// Its clock (ahead of `next` by the raises of the hot swaps since it joined).
        clock: u64,
    },
    /// The shard refused the request, for this reason, typed as the shard made it (a worker
    /// can tell an iteration out of order from a gradient with a NaN); the connection stays
    /// open. `Error` carries what the server itself refuses (a shard it does not hold).
    Refused(crate::shard::RequestError),
}

/// Why a server refuses a data request itself, before any shard sees it
/// ([`DataResponse::Error`]). The wire carries the variant's index (pinned by a test): add
/// variants only at the end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum DataError {
    /// It does not hold the shard, and the cluster keeps no backups to move it to.
    #[error("shard {shard} is not on server {server}")]
    NotHere {
        /// The shard asked for.
        shard: u32,
        /// This server.
        server: u32,
    },
    /// A connection without a worker id (an operator's, an evaluator's) may only read.
    #[error("readers may only read")]
    ReadOnly,
    /// A push whose payload does not decode in the codec it names.
    #[error("a push that does not decode: {0}")]
    Undecodable(crate::codec::CodecError),
    /// Moved tasks that are not tasks of the iteration: `first + count` past `total`.
    #[error("tasks {first}..{} of {total} do not exist", .first.saturating_add(*.count))]
    NoSuchTasks {
        /// The first task handed over.
        first: u32,
        /// How many.
        count: u32,
        /// The iteration's tasks.
        total: u32,
    },
    /// A worker sent a report in another worker's name.
    #[error("worker {worker} reported for worker {named}")]
    ReportForOther {
        /// The worker on the connection.
        worker: WorkerId,
        /// The worker the report names.
        named: WorkerId,
    },
}

/// Why a server cannot serve a shard now ([`DataResponse::Unavailable`]): the worker asks where
/// the shard is and tries there. The wire carries the variant's index (pinned by a test): add
/// variants only at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum NotServing {
    /// It does not hold the shard as its primary (the shard moved, or never was here).
    #[error("shard {shard} is not on server {server}")]
    NotPrimary {
        /// The shard asked for.
        shard: u32,
        /// This server.
        server: u32,
    },
    /// It is cut off from the coordinator: its lease lapsed, and its backups may be taking
    /// over, so it serves nothing until it renews it.
    #[error("server {server} lost its lease from the coordinator")]
    LeaseLost {
        /// This server.
        server: u32,
    },
}

/// A control message from a shard's policy, sent on a unidirectional stream to the worker
/// (defined with the task hand-over it carries, in the engine).
pub use crate::tasks::{ControlMessage, MovedTasks};

/// One shard's state, as `syncopate policy status` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardStatus {
    /// The shard.
    pub shard: u32,
    /// The policy's name and version.
    pub policy: String,
    /// SHA-256 of its module, hex.
    pub sha256: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Whether it is quarantined (the shard runs on fallback rules).
    pub quarantined: bool,
    /// Live workers and their clocks.
    pub workers: Vec<WorkerClock>,
    /// Parameters.
    pub len: u64,
    /// Counters.
    pub stats: ShardStats,
    /// Pulls parked now.
    pub parked: u32,
    /// Pushes held now.
    pub held: u32,
    /// Per live worker: nanoseconds its pulls have spent deferred here.
    pub waited_ns: Vec<(WorkerId, u64)>,
    /// The metrics the policy has recorded (`ctx.metric`).
    #[serde(default)]
    pub metrics: Vec<crate::shard::Metric>,
    /// The last policy failure on this shard.
    #[serde(default)]
    pub last_failure: Option<String>,
    /// Its replication, where it has a backup or is one.
    #[serde(default)]
    pub replication: Option<Replication>,
    /// The push its policy has held longest, if it holds one: a rule that never admits it hangs
    /// that push's worker.
    #[serde(default)]
    pub held_longest: Option<HeldPush>,
    /// The pull its policy has parked longest, if it parks one (protocol 13).
    #[serde(default)]
    pub parked_longest: Option<ParkedPull>,
    /// Failures of the policy running now since it started on this shard (its swap): what a
    /// swap's watcher judges it by; `stats.policy_failures` counts every policy's (protocol 13).
    #[serde(default)]
    pub policy_failures_now: u64,
    /// A crash loop keeps the policy out (the fallback rules run) for this many more
    /// milliseconds, then it restarts (protocol 13).
    #[serde(default)]
    pub backoff_ms: Option<u64>,
    /// What the cluster policy's figures are made of (protocol 19).
    #[serde(default)]
    pub sample: syncopate_engine::pilot::ShardSample,
    /// When pushes arrived against the first push of their iteration, since the shard started
    /// in this process (protocol 20).
    #[serde(default)]
    pub arrivals: crate::shard::ArrivalCounts,
    /// The policy's event calls and the fuel they burned, since the shard started in this
    /// process (protocol 20).
    #[serde(default)]
    pub policy_usage: crate::runtime::PolicyUsage,
    /// Restarts of the policy after failures, since the shard started in this process
    /// (protocol 20).
    #[serde(default)]
    pub policy_restarts: u64,
    /// Nanoseconds pushes were held by the policy, summed over the holds that ended, since the
    /// shard started in this process (protocol 20).
    #[serde(default)]
    pub held_ns: u64,
}

/// A pull a policy parks, and for how long so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedPull {
    /// Its worker.
    pub worker: WorkerId,
    /// The iteration it is for (as the shard numbers the worker's).
    pub iteration: u64,
    /// How long it has been parked, in nanoseconds.
    pub parked_ns: u64,
}

/// A push a policy holds, and for how long so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPush {
    /// Its worker.
    pub worker: WorkerId,
    /// Its iteration (as the shard numbers the worker's).
    pub iteration: u64,
    /// How long it has been held, in nanoseconds.
    pub held_ns: u64,
}

/// A shard's replication as its task sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replication {
    /// A backup (mirroring its primary) or a primary.
    pub backup: bool,
    /// Ops applied so far (a primary's, streamed; a backup's, received).
    pub applied: u64,
    /// A primary's: the last op its backup confirmed (`None`: it has no backup now). The lag is
    /// `applied - confirmed` ops; pushes admitted by the unconfirmed ones wait to be
    /// acknowledged.
    pub confirmed: Option<u64>,
}

impl ShardStatus {
    /// The state of `shard`, which serves shard number `id`.
    pub fn of(id: u32, shard: &crate::shard::Shard) -> Self {
        let info = shard.policy().info();
        ShardStatus {
            shard: id,
            policy: format!("{} {}", info.name, info.version),
            sha256: shard.policy().sha256_hex(),
            config: shard.policy_config().to_vec(),
            quarantined: shard.is_quarantined(),
            workers: shard.workers(),
            len: shard.values().len() as u64,
            stats: shard.stats(),
            parked: shard.parked_pulls() as u32,
            held: shard.held_pushes() as u32,
            waited_ns: shard.worker_waits(),
            metrics: shard.metrics().to_vec(),
            last_failure: shard.last_failure().map(str::to_owned),
            replication: None,
            held_longest: None,
            parked_longest: None,
            policy_failures_now: shard.module_failures(),
            backoff_ms: None,
            sample: syncopate_engine::pilot::ShardSample::of(id, shard),
            arrivals: shard.arrival_offsets(),
            policy_usage: shard.policy_usage(),
            policy_restarts: shard.policy_restarts(),
            held_ns: shard.held_ns(),
        }
    }
}

/// One server's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerStatus {
    /// Its id.
    pub server: u32,
    /// Its data address.
    pub addr: SocketAddr,
    /// Its shards (those created so far).
    pub shards: Vec<ShardStatus>,
    /// The backups it keeps.
    #[serde(default)]
    pub backups: Vec<ShardStatus>,
    /// Bytes it sent on its data connections (UDP payloads: QUIC and TLS included).
    pub bytes_sent: u64,
    /// Bytes it received on them.
    pub bytes_received: u64,
    /// Tensor payload bytes by codec family (`none`, `fp16`, `bf16`, `int8`, `topk`,
    /// `sparseloco`): received in pushes and sent in pulls, as encoded on the wire; families
    /// not seen are left out (protocol 20).
    #[serde(default)]
    pub payload_bytes: Vec<CodecBytes>,
}

/// A server's tensor payload bytes in one codec family.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodecBytes {
    /// The family (`int8`, not `int8-256`).
    pub codec: String,
    /// Bytes received in pushes.
    pub pushed: u64,
    /// Bytes sent in pulls.
    pub pulled: u64,
}

/// A worker as the coordinator knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Its id.
    pub worker: WorkerId,
    /// Connected now.
    pub connected: bool,
    /// Left cleanly.
    pub finished: bool,
}

/// The whole cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The cluster policy's label.
    pub policy: String,
    /// SHA-256 of its module, hex.
    pub sha256: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Swaps done.
    pub swaps: u64,
    /// Servers.
    pub servers: Vec<ServerStatus>,
    /// Workers.
    pub workers: Vec<WorkerStatus>,
    /// The latest score a worker reported, if any did.
    pub score: Option<ReportedScore>,
    /// Per shard: the server holding it and the one holding its backup.
    #[serde(default)]
    pub placement: Vec<(u32, u32, Option<u32>)>,
    /// Servers lost and failed over.
    #[serde(default)]
    pub lost_servers: Vec<u32>,
    /// Why the last checkpoint round was not taken (a full disk, say), until one is (protocol
    /// 13).
    #[serde(default)]
    pub checkpoint_error: Option<String>,
    /// The cluster policy, if one runs (protocol 19).
    #[serde(default)]
    pub pilot: Option<syncopate_engine::pilot::PilotStatus>,
    /// The latest score the launcher's evaluator gave the model it read from the servers, if
    /// an operator reported one (`syncopate local` does; protocol 20).
    #[serde(default)]
    pub evaluated: Option<ModelScore>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire is positional (postcard): these bytes are what a peer of this protocol sends,
    /// and a change to them is a change of [`PROTOCOL_VERSION`].
    #[test]
    fn requests_encode_as_protocol_20_pins_them() {
        assert_eq!(PROTOCOL_VERSION, 20);
        let bytes = |r: &DataRequest| postcard::to_allocvec(r).expect("encodes");
        assert_eq!(bytes(&DataRequest::Pull { shard: 1, iteration: 5 }), [2, 1, 5]);
        let notice = DataRequest::Waiting { shard: 2, iteration: 300, waiting: true };
        assert_eq!(bytes(&notice), [10, 2, 0xac, 0x02, 1], "variant 10, varints, a bool");
        let back: DataRequest = postcard::from_bytes(&[10, 0, 7, 0]).expect("decodes");
        assert_eq!(back, DataRequest::Waiting { shard: 0, iteration: 7, waiting: false });
        // Protocol 18 appended a push's signals: loss Some(1.0f32), norm None, tokens 3, step 4.
        let push = DataRequest::Push {
            shard: 1,
            iteration: 2,
            samples: 8,
            based_on: None,
            local_steps: 0,
            codec: crate::codec::Codec::None,
            signals: Signals { loss: Some(1.0), norm: None, tokens: 3, step_ns: 4 },
        };
        let encoded = bytes(&push);
        assert_eq!(encoded[encoded.len() - 8..], [1, 0, 0, 0x80, 0x3f, 0, 3, 4]);
        assert_eq!(postcard::from_bytes::<DataRequest>(&encoded).expect("decodes"), push);
        // Protocol 20 added the launcher's evaluation, after the heartbeat (variant 8): variant
        // 9, the iteration, accuracy 0.5f32, loss Some(2.0f32).
        let evaluated =
            CoordRequest::Evaluated { score: ModelScore { iteration: 3, accuracy: 0.5, loss: Some(2.0) } };
        let encoded = postcard::to_allocvec(&evaluated).expect("encodes");
        assert_eq!(encoded, [9, 3, 0, 0, 0, 0x3f, 1, 0, 0, 0, 0x40]);
    }

    /// A shard's refusals cross the wire as engine enums (`RequestError`, `ShardError`) by
    /// variant index: these bytes pin every variant's code, so reordering or inserting one in
    /// the engine fails here instead of changing the protocol without a word.
    #[test]
    fn every_refusal_a_shard_sends_encodes_as_its_code_in_protocol_16() {
        use crate::shard::{RequestError as R, ShardError as S, Waiting};
        let bytes = |e: R| postcard::to_allocvec(&DataResponse::Refused(e)).expect("encodes");
        let why = || "x".to_owned();
        let cases: Vec<(R, Vec<u8>)> = vec![
            (R::NoShardYet(1), vec![10, 0, 1]),
            (R::CannotStart { shard: 1, reason: why() }, vec![10, 1, 1, 1, b'x']),
            (R::Snapshot { shard: 1, reason: why() }, vec![10, 2, 1, 1, b'x']),
            (R::WrongSlice { shard: 1, holds: 2, got: 3 }, vec![10, 3, 1, 2, 3]),
            (R::AlreadyWaiting { worker: 1, iteration: 2, what: Waiting::Push }, vec![10, 4, 1, 2, 1]),
            (R::Shard(S::UnknownWorker(1, 2)), vec![10, 5, 0, 1, 2]),
            (R::Shard(S::AlreadyJoined(1, 2)), vec![10, 5, 1, 1, 2]),
            (R::Shard(S::WorkerOutOfRange { worker: 1, shard: 2, max: 3 }), vec![10, 5, 2, 1, 2, 3]),
            (R::Shard(S::WrongLength { shard: 1, expected: 2, got: 3 }), vec![10, 5, 3, 1, 2, 3]),
            (R::Shard(S::NonFinite(1, 2)), vec![10, 5, 4, 1, 2]),
            (R::Shard(S::Duplicate { worker: 1, iteration: 2, expected: 3 }), vec![10, 5, 5, 1, 2, 3]),
            (
                R::Shard(S::BadTasks { worker: 1, iteration: 2, mask: 3, reason: why() }),
                vec![10, 5, 6, 1, 2, 3, 1, b'x'],
            ),
            (R::Shard(S::OutOfOrder { worker: 1, iteration: 2, expected: 3 }), vec![10, 5, 7, 1, 2, 3]),
            (R::Shard(S::SkipTooFar { worker: 1, from: 2, to: 3 }), vec![10, 5, 8, 1, 2, 3]),
            (
                R::Shard(S::BadSignals { worker: 1, iteration: 2, reason: why() }),
                vec![10, 5, 9, 1, 2, 1, b'x'],
            ),
            (R::Swap(why()), vec![10, 6, 1, b'x']),
            (R::Backup(1), vec![10, 7, 1]),
            (R::Left(1, 2), vec![10, 8, 1, 2]),
            (R::Stopped(1), vec![10, 9, 1]),
        ];
        for (error, want) in cases {
            let got = bytes(error.clone());
            assert_eq!(got, want, "{error:?}");
            let back: DataResponse = postcard::from_bytes(&got).expect("decodes");
            assert_eq!(back, DataResponse::Refused(error));
        }
    }

    /// What a server refuses itself, and why it cannot serve a shard now, are codes (protocol
    /// 16): these bytes pin every variant's, so a worker can act on them (ask where the shard
    /// moved, give up) without reading a sentence.
    #[test]
    fn every_refusal_a_server_sends_encodes_as_its_code_in_protocol_16() {
        use crate::codec::{Codec, CodecError as C};
        let cases: Vec<(DataResponse, Vec<u8>)> = vec![
            (DataResponse::Error(DataError::NotHere { shard: 1, server: 2 }), vec![5, 0, 1, 2]),
            (DataResponse::Error(DataError::ReadOnly), vec![5, 1]),
            (
                DataResponse::Error(DataError::Undecodable(C::Length {
                    codec: Codec::Bf16,
                    n: 1,
                    expected: 2,
                    got: 3,
                })),
                vec![5, 2, 0, 2, 1, 2, 3],
            ),
            (DataResponse::Error(DataError::Undecodable(C::TooLong { n: 1, max: 2 })), vec![5, 2, 1, 1, 2]),
            (
                DataResponse::Error(DataError::Undecodable(C::Index { index: 1, at: 2, n: 3 })),
                vec![5, 2, 2, 1, 2, 3],
            ),
            (DataResponse::Error(DataError::Undecodable(C::Kept { k: 1, n: 2 })), vec![5, 2, 3, 1, 2]),
            (
                DataResponse::Error(DataError::NoSuchTasks { first: 1, count: 2, total: 3 }),
                vec![5, 3, 1, 2, 3],
            ),
            (DataResponse::Error(DataError::ReportForOther { worker: 1, named: 2 }), vec![5, 4, 1, 2]),
            (DataResponse::Unavailable(NotServing::NotPrimary { shard: 1, server: 2 }), vec![8, 0, 1, 2]),
            (DataResponse::Unavailable(NotServing::LeaseLost { server: 300 }), vec![8, 1, 0xac, 0x02]),
        ];
        for (response, want) in cases {
            let got = postcard::to_allocvec(&response).expect("encodes");
            assert_eq!(got, want, "{response:?}");
            let back: DataResponse = postcard::from_bytes(&got).expect("decodes");
            assert_eq!(back, response);
        }
        assert!(postcard::from_bytes::<DataResponse>(&[5, 5]).is_err(), "an unknown code is refused");
        let tasks = DataError::NoSuchTasks { first: 3, count: 4, total: 5 };
        assert_eq!(tasks.to_string(), "tasks 3..7 of 5 do not exist");
    }

    /// A refused hello says why in codes too (protocol 17): the coordinator's and a server's
    /// refusals, and a restarted server's "not yet".
    #[test]
    fn every_refusal_of_a_hello_encodes_as_its_code_in_protocol_17() {
        use syncopate_engine::coordinator::{GatherError, NotYet, Refusal};
        let addr: SocketAddr = ([127, 0, 0, 1], 300).into();
        let a = [0, 127, 0, 0, 1, 0xac, 0x02];
        let x = || "x".to_owned();
        let with = |head: &[u8], tail: &[u8]| [head, tail].concat();
        let refusals: Vec<(Unwelcome, Vec<u8>)> = vec![
            (Unwelcome::Refused(Refusal::ServersFull(2)), vec![3, 0, 0, 2]),
            (Unwelcome::Refused(Refusal::NoSuchServer { server: 3, servers: 2 }), vec![3, 0, 1, 3, 2]),
            (
                Unwelcome::Refused(Refusal::NotYet { server: 1, why: NotYet::PeerTimeout }),
                vec![3, 0, 2, 1, 2],
            ),
            (Unwelcome::Refused(Refusal::IdOutOfRange { id: 9, max: 8 }), vec![3, 0, 3, 9, 8]),
            (Unwelcome::Refused(Refusal::IdTaken(1)), vec![3, 0, 4, 1]),
            (Unwelcome::Refused(Refusal::WorkersFull(8)), vec![3, 0, 5, 8]),
            (Unwelcome::Refused(Refusal::EmptyModel), vec![3, 0, 6]),
            (Unwelcome::Refused(Refusal::ModelLength { cluster: 2, worker: 3 }), vec![3, 0, 7, 2, 3]),
            (Unwelcome::NotAtLostAddress { servers: 2, lost: vec![(1, addr)] }, with(&[3, 1, 2, 1, 1], &a)),
            (Unwelcome::Rebuilding, vec![3, 2]),
            (Unwelcome::ServersMissing { have: 1, want: 2, waited_ms: 3 }, vec![3, 3, 1, 2, 3]),
            (Unwelcome::Rejoin(RejoinRefused::NoSuchServer { server: 3, servers: 2 }), vec![3, 4, 0, 3, 2]),
            (Unwelcome::Rejoin(RejoinRefused::NoHoldings(x())), vec![3, 4, 1, 1, b'x']),
            (Unwelcome::Rejoin(RejoinRefused::HoldsAnother { said: 1, holds: 0 }), vec![3, 4, 2, 1, 0]),
            (
                Unwelcome::Rejoin(RejoinRefused::OtherSettings {
                    setting: Setting::MaxWorkers,
                    ours: x(),
                    theirs: x(),
                }),
                vec![3, 4, 3, 3, 1, b'x', 1, b'x'],
            ),
            (Unwelcome::Rejoin(RejoinRefused::NotRegistered { server: 1, addr }), with(&[3, 4, 4, 1], &a)),
            (Unwelcome::Rejoin(RejoinRefused::Lease(crate::lease::LeaseError::FailedOver)), vec![3, 4, 5, 0]),
            (
                Unwelcome::Rejoin(RejoinRefused::Lease(crate::lease::LeaseError::Unknown(4))),
                vec![3, 4, 5, 1, 4],
            ),
            (Unwelcome::Rejoin(RejoinRefused::OtherCluster(1)), vec![3, 4, 6, 1]),
            (Unwelcome::Rejoin(RejoinRefused::Gather(GatherError::TooLate)), vec![3, 4, 7, 0]),
            (Unwelcome::Rejoin(RejoinRefused::Gather(GatherError::Again(1))), vec![3, 4, 7, 1, 1]),
            (
                Unwelcome::Rejoin(RejoinRefused::Gather(GatherError::NoSuchServer { server: 3, servers: 2 })),
                vec![3, 4, 7, 2, 3, 2],
            ),
            (Unwelcome::Rejoin(RejoinRefused::FailedOver { shard: 5 }), vec![3, 4, 8, 5]),
            (Unwelcome::WrongPlace(PeerKind::Server), vec![3, 5, 0]),
            (Unwelcome::WrongPlace(PeerKind::Replica), vec![3, 5, 1]),
            (Unwelcome::IdOutOfRange { worker: 9, max: 8 }, vec![3, 6, 9, 8]),
            (Unwelcome::ForeignTicket(3), vec![3, 7, 3]),
            (Unwelcome::NoTicket(3), vec![3, 8, 3]),
            (Unwelcome::NoId, vec![3, 9]),
        ];
        for (refusal, want) in refusals {
            let welcome = Welcome::Refused(refusal);
            let got = postcard::to_allocvec(&welcome).expect("encodes");
            assert_eq!(got, want, "{welcome:?}");
            assert_eq!(postcard::from_bytes::<Welcome>(&got).expect("decodes"), welcome);
        }
        let whys = [
            NotYet::StillLive,
            NotYet::FailingOver,
            NotYet::PeerTimeout,
            NotYet::Rebuilding,
            NotYet::Swapping,
            NotYet::AttachingBackups,
        ];
        for (code, why) in whys.into_iter().enumerate() {
            let welcome = Welcome::NotYet(Refusal::NotYet { server: 1, why });
            let got = postcard::to_allocvec(&welcome).expect("encodes");
            assert_eq!(got, [4, 2, 1, code as u8], "{welcome:?}");
            assert_eq!(postcard::from_bytes::<Welcome>(&got).expect("decodes"), welcome);
        }
        // What people read is what they read before the codes.
        let lost = Unwelcome::NotAtLostAddress { servers: 2, lost: vec![(1, addr)] };
        assert_eq!(
            lost.to_string(),
            "the cluster already has its 2 servers; a server restarted in a lost one's place must listen at its \
             address (server 1 at 127.0.0.1:300)"
        );
        let unknown = syncopate_engine::coordinator::UNKNOWN_ADDR;
        let lost = Unwelcome::NotAtLostAddress { servers: 2, lost: vec![(1, unknown)] };
        assert!(
            lost.to_string().ends_with("(server 1, whose address this coordinator lost at its restart)"),
            "{lost}"
        );
    }

    /// The control plane's refusals are codes too (protocol 16): the coordinator's to workers,
    /// servers and operators, and a server's to the coordinator's commands. Text is only the
    /// account of what lies outside the protocol (a module's words, the disk's, a peer's).
    #[test]
    fn every_refusal_of_the_control_plane_encodes_as_its_code_in_protocol_16() {
        use crate::shard::{RequestError, ShardError};
        use syncopate_engine::coordinator::SwapError;
        let addr: SocketAddr = ([127, 0, 0, 1], 300).into();
        let x = || "x".to_owned();
        let coord: Vec<(CoordError, Vec<u8>)> = vec![
            (CoordError::NotForRole(Asker::Server), vec![3, 0, 0]),
            (CoordError::NotForRole(Asker::Worker), vec![3, 0, 1]),
            (CoordError::NotForRole(Asker::Operator), vec![3, 0, 2]),
            (CoordError::BadScore, vec![3, 1]),
            (
                CoordError::NoStatus { server: 1, addr, reason: x() },
                vec![3, 2, 1, 0, 127, 0, 0, 1, 0xac, 0x02, 1, b'x'],
            ),
            (CoordError::NoSwapYet, vec![3, 3]),
            (CoordError::NoGoodPolicy, vec![3, 4]),
            (CoordError::Digest, vec![3, 5]),
            (CoordError::Module(x()), vec![3, 6, 1, b'x']),
            (CoordError::Busy(SwapError::Busy(1)), vec![3, 7, 0, 1]),
            (CoordError::Busy(SwapError::Registering { registered: 1, servers: 2 }), vec![3, 7, 1, 1, 2]),
            (CoordError::Busy(SwapError::Checkpointing(1)), vec![3, 7, 2, 1]),
            (CoordError::Abandoned(1), vec![3, 8, 1]),
            (
                CoordError::NoneSwitched(vec![ServerFailure { server: 1, addr: None, reason: x() }]),
                vec![3, 9, 1, 1, 0, 1, b'x'],
            ),
        ];
        for (error, want) in coord {
            let response = CoordResponse::Error(error);
            let got = postcard::to_allocvec(&response).expect("encodes");
            assert_eq!(got, want, "{response:?}");
            assert_eq!(postcard::from_bytes::<CoordResponse>(&got).expect("decodes"), response);
        }
        let partly = CoordResponse::SwappedPartly {
            swap: 2,
            failed: vec![ServerFailure { server: 1, addr: None, reason: x() }],
        };
        assert_eq!(postcard::to_allocvec(&partly).expect("encodes"), [5, 2, 1, 1, 0, 1, b'x']);
        let nan = RequestError::Shard(ShardError::NonFinite(1, 2));
        let server: Vec<(ServerError, Vec<u8>)> = vec![
            (ServerError::Prepare(x()), vec![2, 0, 1, b'x']),
            (ServerError::Unprepared(1), vec![2, 1, 1]),
            (
                ServerError::Commit(vec![ShardFailure { shard: 1, error: nan.clone() }]),
                vec![2, 2, 1, 1, 5, 4, 1, 2],
            ),
            (
                ServerError::Attach { shard: 1, addr, reason: x() },
                vec![2, 3, 1, 0, 127, 0, 0, 1, 0xac, 0x02, 1, b'x'],
            ),
            (ServerError::NoBackup { shard: 1, server: 2 }, vec![2, 4, 1, 2]),
            (ServerError::Promote(nan), vec![2, 5, 5, 4, 1, 2]),
            (ServerError::Checkpoint(x()), vec![2, 6, 1, b'x']),
        ];
        for (error, want) in server {
            let reply = ServerReply::Error(error);
            let got = postcard::to_allocvec(&reply).expect("encodes");
            assert_eq!(got, want, "{reply:?}");
            assert_eq!(postcard::from_bytes::<ServerReply>(&got).expect("decodes"), reply);
        }
        // What people read stays what it was.
        let refused = CoordError::NoneSwitched(vec![
            ServerFailure { server: 0, addr: Some(addr), reason: "a".into() },
            ServerFailure { server: 1, addr: None, reason: "b".into() },
        ]);
        assert_eq!(refused.to_string(), "no server switched: server 0 (127.0.0.1:300): a; server 1: b");
    }

    /// A lease's end is a code, not a string: a server stops on these and only these.
    #[test]
    fn a_lease_end_encodes_as_its_code_in_protocol_16() {
        let bytes = |r: &CoordResponse| postcard::to_allocvec(r).expect("encodes");
        assert_eq!(bytes(&CoordResponse::LeaseEnded(LeaseEnd::FailedOver)), [6, 0]);
        assert_eq!(bytes(&CoordResponse::LeaseEnded(LeaseEnd::Replaced)), [6, 1]);
        assert_eq!(bytes(&CoordResponse::LeaseEnded(LeaseEnd::Unknown(300))), [6, 2, 0xac, 0x02]);
        let back: CoordResponse = postcard::from_bytes(&[6, 1]).expect("decodes");
        assert_eq!(back, CoordResponse::LeaseEnded(LeaseEnd::Replaced));
        assert!(postcard::from_bytes::<CoordResponse>(&[6, 3]).is_err(), "an unknown code is refused");
    }
}
