//! The coordinator's decisions as a sans-IO machine: server ids and leases, the shard map,
//! what a server's death calls for, and worker admission.
//!
//! A [`CoordinatorMachine`] takes events, each with its driver's time in nanoseconds (a server
//! registers or renews its lease, a worker asks to join, a command a server was sent is done,
//! time passes), and puts out what to do ([`CoordOutput`]): commands for servers, each with an
//! id that its result comes back with ([`CoordinatorMachine::command_done`]), notices for the
//! workers, and what happened, for the driver's log. Two drivers run it, so a simulated
//! failover is decided exactly as a cluster's:
//! - the tokio coordinator (`host/src/coordinator`) sends the commands over QUIC;
//! - the simulator (`host/src/lab/sim`) carries them out on its nodes in virtual time.
//!
//! What it decides:
//! - **membership.** Servers get ids in the order they register, up to the cluster's count;
//!   once all have been answered, each primary is told to attach its shard's backup
//!   ([`Command::AttachBackup`]), and workers are welcomed only after that
//!   ([`CoordOutput::Replicated`]), so a backup sees its shard's every op.
//! - **leases** ([`crate::lease`]): a server whose lease lapses is failed over: its shards'
//!   backups are promoted ([`crate::placement::fail_over`]), the workers are told where the
//!   shards moved, and once those commands are done every shard left without a backup gets a
//!   new one on a live server ([`crate::placement::new_backups`]). One failover runs at a time;
//!   a second lapse waits for the first to finish.
//! - **restarted servers** ([`CoordinatorMachine::replace_server_at`]): a new process at a
//!   lost server's address (workers reach a server at the address they were given) takes its
//!   id back, empty, once the old one is failed over and a peer timeout has passed, and shards
//!   without a backup get one on it. A server that lost its connection to the coordinator
//!   reconnects under its id from its own address, or while it is not live
//!   ([`CoordinatorMachine::reconnect_server`]).
//! - **worker ids.** Ids are dense and bounded: a worker may ask for one below `max_workers`
//!   that no connected worker holds, or is given the lowest never given out.
//! - **the start barrier** ([`CoordinatorMachine::worker_ready`]): training starts once the
//!   workers it waits for are ready, or its wait after the first has run out; a worker ready
//!   later starts at once.
//! - **hot swaps**, two-phase: every live server prepares the module off the hot path and answers
//!   with its primaries' clocks; only if all can does every one commit (each switching its
//!   primaries as the commit arrives; the backups follow by their op streams), else all abort and
//!   none switches. The commit levels the workers by one raise per worker that every shard
//!   applies alike ([`CoordinatorMachine::levelling`], see [`crate::shard::Frontier`]). One at a
//!   time.
//! - **checkpoint rounds** ([`checkpoint`]): each shard's primary writes its snapshot into the
//!   round; the round is taken only if every shard's was written, and it never overlaps a swap,
//!   a failover or a rebuild.
//! - **the rebuild after a restart** ([`rebuild`]): a coordinator that comes back while its
//!   servers ran on rebuilds the map, the policy and the leases from what they hold.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;

use syncopate_policy_sdk::abi::{WorkerClock, WorkerId};

use crate::lease::{LeaseTable, LEASE_MS};
use crate::placement::{self, Failover, Place};
use crate::shard::{ClockRaise, Frontier};

pub mod checkpoint;
pub mod errors;
pub mod rebuild;
pub use checkpoint::{CheckpointError, CheckpointOutcome};
pub use errors::{listed, CommandError, ServerError, ShardFailure};
pub use rebuild::{resolve, GatherError, Gathered, Gathering, Held, Rebuilt, Resolution, REJOIN_WAIT_MS};

/// What the cluster is set up as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Servers the cluster has.
    pub servers: u32,
    /// Shards the model is split into.
    pub shards: u32,
    /// Backups per shard (0 or 1).
    pub replicas: u32,
    /// Worker ids are `0..max_workers`.
    pub max_workers: u32,
    /// The cluster's peer timeout, in milliseconds: a silent connection ends this long after
    /// its peer's last packet. A server restarted in a lost one's place takes its id only this
    /// long after the loss, by when every peer's connection to the old process has ended, so
    /// none sends the new one what was meant for the old.
    pub peer_timeout_ms: u64,
    /// The start barrier ([`CoordinatorMachine::worker_ready`]): training starts once this many
    /// workers are ready (0: at the first), or this many milliseconds after the first was.
    pub start: (u32, u64),
}

/// The machine's name for a command it sent, returned with its result.
pub type CommandId = u64;

/// What a server is told to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Command {
    /// Start streaming the shard's ops to a backup on server `backup` (from a snapshot, if the
    /// shard has state already).
    AttachBackup {
        /// The shard.
        shard: u32,
        /// The server that keeps the backup.
        backup: u32,
    },
    /// Its backup of the shard becomes the primary.
    Promote {
        /// The shard.
        shard: u32,
    },
    /// Its primary of the shard goes on without a backup.
    DropBackup {
        /// The shard.
        shard: u32,
    },
    /// Load the policy module of hot swap `swap` off the hot path, and answer whether it can
    /// run it (the driver attaches the module), with its primaries' clocks
    /// ([`Answer::Clocks`]).
    Prepare {
        /// The swap's number.
        swap: u64,
    },
    /// Switch every primary it holds to the module of swap `swap`, prepared before, raising its
    /// workers' clocks by [`CoordinatorMachine::levelling`].
    Commit {
        /// The swap's number.
        swap: u64,
    },
    /// Forget the module of swap `swap`: another server could not prepare it.
    Abort {
        /// The swap's number.
        swap: u64,
    },
    /// Write its primary of `shard`'s snapshot into checkpoint round `round` (refused if it is
    /// not the shard's primary).
    Snapshot {
        /// The round.
        round: u64,
        /// The shard.
        shard: u32,
    },
}

/// What a server answered a command with, when it could carry it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Done.
    Done,
    /// Done; the clocks of the workers on its primaries, each worker's largest (the answer to
    /// [`Command::Prepare`]).
    Clocks(Vec<WorkerClock>),
}

/// How a hot swap ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SwapOutcome {
    /// Every server switched.
    Committed,
    /// These servers could not prepare the module, with why: no server switched.
    Refused(Vec<(u32, CommandError)>),
    /// Every server prepared it, but these could not switch all their shards, with why (a
    /// shard's state refused it, or the server died meanwhile): the others switched.
    Partial(Vec<(u32, CommandError)>),
}

/// A hot swap that cannot begin (on the wire inside the coordinator's refusal: add variants
/// only at the end).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum SwapError {
    /// Another swap is under way.
    #[error("swap {0} is under way")]
    Busy(u64),
    /// Not every server has registered yet.
    #[error("only {registered} of {servers} servers are registered")]
    Registering {
        /// Servers registered.
        registered: u32,
        /// Servers the cluster has.
        servers: u32,
    },
    /// A checkpoint round is under way (a round's shards all run one policy).
    #[error("checkpoint round {0} is under way")]
    Checkpointing(u64),
}

/// What the machine asks its driver to do, or tells it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum CoordOutput {
    /// Send `command` to server `server`, and report its result with
    /// [`CoordinatorMachine::command_done`].
    Command {
        /// Its id.
        id: CommandId,
        /// The server to send it to.
        server: u32,
        /// What to do.
        command: Command,
    },
    /// Tell every worker that `shard`'s primary is now on `server`.
    Moved {
        /// The shard.
        shard: u32,
        /// Its new primary's server.
        server: u32,
    },
    /// Every backup the cluster starts with is attached (or failed to): workers may be welcomed.
    Replicated,
    /// The start barrier opened: training starts, with `ready` of the `want` workers it waits
    /// for (fewer when its wait ran out).
    Started {
        /// Workers ready when it opened.
        ready: u32,
        /// Workers it waited for.
        want: u32,
    },
    /// Server `server`'s lease lapsed: it is being failed over.
    ServerLost {
        /// The server.
        server: u32,
    },
    /// A shard died with its primary: it had no backup, or its backup could not take over.
    ShardLost {
        /// The shard.
        shard: u32,
        /// The server being failed over.
        server: u32,
    },
    /// A shard left without a backup by a failover has a new one.
    NewBackup {
        /// The shard.
        shard: u32,
        /// Its primary's server.
        primary: u32,
        /// The new backup's server.
        backup: u32,
    },
    /// No live server other than its primary's can keep a new backup of the shard.
    NoBackupPlace {
        /// The shard.
        shard: u32,
    },
    /// The failover of server `server` is done, re-replication included.
    FailoverDone {
        /// The server.
        server: u32,
    },
    /// A restarted coordinator's rebuild ([`CoordinatorMachine::rebuild`]) carried out its
    /// promotions, dropped backups and the commit of an interrupted swap: the cluster serves
    /// again, and workers may be welcomed. New backups follow.
    Rebuilt,
    /// Hot swap `swap` ended.
    SwapDone {
        /// The swap's number.
        swap: u64,
        /// How.
        outcome: SwapOutcome,
    },
    /// Checkpoint round `round` ended ([`CoordinatorMachine::begin_checkpoint`]).
    CheckpointDone {
        /// The round.
        round: u64,
        /// How.
        outcome: CheckpointOutcome,
    },
}

/// A request the coordinator refuses; its message is what the peer is told, and it crosses the
/// wire as it is (the index of each variant is its code).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum Refusal {
    /// All the cluster's servers have registered.
    #[error("the cluster already has its {0} servers")]
    ServersFull(u32),
    /// A server restarted in the place of one the cluster does not have.
    #[error("the cluster has no server {server} (it has {servers})")]
    NoSuchServer {
        /// The id it would take.
        server: u32,
        /// Servers the cluster has.
        servers: u32,
    },
    /// A server restarted in the place of server `server` cannot take it now; it may later.
    #[error("server {server} cannot be replaced yet: {why}")]
    NotYet {
        /// The id it would take.
        server: u32,
        /// Why not now.
        why: NotYet,
    },
    /// The worker asked for an id at or above `max_workers`.
    #[error("worker id {id} is out of range: this cluster admits ids 0 to {} (its --max-workers is {max})", max - 1)]
    IdOutOfRange {
        /// The id asked for.
        id: WorkerId,
        /// The cluster's `max_workers`.
        max: u32,
    },
    /// A connected worker holds the id.
    #[error("worker id {0} is taken by a connected worker")]
    IdTaken(WorkerId),
    /// Every id has been given out.
    #[error("the cluster is full: all {0} worker ids have been given out (--max-workers)")]
    WorkersFull(u32),
    /// The worker's model has no parameters.
    #[error("a model needs at least one parameter")]
    EmptyModel,
    /// The worker's model is not the cluster's.
    #[error("this cluster trains a model of {cluster} parameters, the worker's has {worker}")]
    ModelLength {
        /// The cluster's model length.
        cluster: u64,
        /// The worker's.
        worker: u64,
    },
}

/// Why a server restarted in a lost one's place cannot take its id back yet
/// ([`Refusal::NotYet`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum NotYet {
    /// The old one's lease has not lapsed.
    #[error(
        "it is still live in the cluster's view (a restarted server takes its id back once its lease has \
         lapsed and it was failed over)"
    )]
    StillLive,
    /// The old one is being failed over.
    #[error("it is being failed over")]
    FailingOver,
    /// Too soon after the old one was lost.
    #[error(
        "a peer timeout has not passed since it was lost (the old process's connections may still be open)"
    )]
    PeerTimeout,
    /// A restarted coordinator is rebuilding the cluster.
    #[error("the cluster is being rebuilt after a coordinator restart")]
    Rebuilding,
    /// A hot swap is under way.
    #[error("a hot swap is under way")]
    Swapping,
    /// New backups are being attached.
    #[error("new backups are being attached")]
    AttachingBackups,
}

/// Why a server registering with a full cluster does not take a lost server's id
/// ([`CoordinatorMachine::replace_server_at`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Replacement {
    /// It is not at the address of a server the cluster has: workers reach a server at the
    /// address they were given, so a replacement must listen where the lost one did.
    #[error("the cluster has all its servers, and none at this address")]
    NotAtLostAddress {
        /// The servers not live now, with their addresses: where a replacement may start.
        lost: Vec<(u32, SocketAddr)>,
    },
    /// It is at a server's address, but cannot take its id (now, or at all).
    #[error(transparent)]
    Refused(Refusal),
}

/// Why a registered server's reconnection is refused ([`CoordinatorMachine::reconnect_server`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reconnect {
    /// No server has that id at that address, and the id's server is live: another process
    /// holds it.
    #[error("server {server} is registered at another address, and live")]
    NotRegistered {
        /// The id it gave.
        server: u32,
    },
    /// Its lease cannot be renewed (it was failed over).
    #[error(transparent)]
    Lease(#[from] crate::lease::LeaseError),
}

/// What a coordinator records outside itself (its driver keeps it in the checkpoint directory)
/// for a restarted coordinator's rebuild: what no surviving server may know.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// Each shard's term ([`CoordinatorMachine::terms`]): a promotion's term is recorded before
    /// the workers hear of the move, so a rebuild never takes a copy older than one they used.
    pub terms: Vec<u64>,
    /// Each server's address, by id ([`CoordinatorMachine::server_addrs`]): a server lost
    /// before the restart can still be replaced at its address after it. (Absent from a record
    /// written before addresses were recorded: none.)
    #[serde(default)]
    pub servers: Vec<SocketAddr>,
}

/// The address a server has before it is known: one that no server listens at.
pub const UNKNOWN_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// A worker the cluster has admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerEntry {
    /// Connected now.
    pub connected: bool,
    /// Left cleanly.
    pub finished: bool,
}

/// Why a command was sent: what its result changes.
#[derive(Clone, Copy, Debug)]
enum Purpose {
    /// One of the backups the cluster starts with.
    InitialBackup { shard: u32, backup: u32 },
    /// A failover move.
    Failover(Failover),
    /// A new backup after a failover.
    NewBackup { shard: u32, backup: u32 },
    /// A swap's preparation or commit on a server.
    Swap { server: u32 },
    /// A swap's abort (nothing waits for it).
    Abort,
    /// A command of a restarted coordinator's rebuild: a promotion (of `promoting`), a dropped
    /// backup, or the commit of a swap some servers had not committed.
    Rebuild { promoting: Option<u32> },
    /// A shard's snapshot for the checkpoint round under way.
    Checkpoint { shard: u32 },
}

/// The hot swap under way.
#[derive(Debug)]
struct SwapRound {
    swap: u64,
    /// The servers it involves: those live when it began.
    servers: Vec<u32>,
    /// Preparing, or (once every server prepared) committing.
    committing: bool,
    /// Servers whose preparation or commit failed, with why.
    failed: Vec<(u32, CommandError)>,
    /// The workers' clocks the servers answered their preparation with.
    frontier: Frontier,
    /// What the commit raises the workers' clocks by (set once every server prepared).
    raise: Vec<ClockRaise>,
}

/// The coordinator's decisions (the module's doc).
#[derive(Debug)]
pub struct CoordinatorMachine {
    cfg: CoordinatorConfig,
    places: Vec<Place>,
    leases: LeaseTable,
    /// Each server's address, by id ([`UNKNOWN_ADDR`] for one a rebuild did not hear from).
    addrs: Vec<SocketAddr>,
    /// Servers answered (welcomed); the backups are attached when all are.
    answered: u32,
    replicated: bool,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    model_len: Option<u64>,
    /// Commands sent and not yet done.
    pending: BTreeMap<CommandId, Purpose>,
    next_command: CommandId,
    /// The server being failed over, if one is.
    failing: Option<u32>,
    /// Whether the failover under way has planned its new backups.
    re_replicated: bool,
    /// Lapsed servers waiting for the failover under way.
    queued: VecDeque<u32>,
    /// When each lost server was lost (its lease lapsed, or a rebuild went on without it).
    lost_at: BTreeMap<u32, u64>,
    /// Hot swaps committed (the number of the last).
    swaps: u64,
    /// The hot swap under way, if one is.
    swap: Option<SwapRound>,
    /// A rebuild's commands are under way; with the swap it finishes and that swap's levelling.
    rebuilding: Option<Option<(u64, Vec<ClockRaise>)>>,
    /// Per shard, its term: how many times it was promoted.
    terms: Vec<u64>,
    /// The checkpoint round under way, if one is.
    checkpoint: Option<checkpoint::CheckpointRound>,
    /// The next checkpoint round's number.
    next_round: u64,
    /// The start barrier: the workers ready, and when it opens at the latest; `None` once open.
    start: Option<(BTreeSet<WorkerId>, Option<u64>)>,
    outputs: VecDeque<CoordOutput>,
}

impl CoordinatorMachine {
    /// A coordinator for a cluster set up as `cfg`, before any server has registered.
    pub fn new(cfg: CoordinatorConfig) -> Self {
        CoordinatorMachine {
            places: placement::initial(cfg.shards, cfg.servers, cfg.replicas),
            cfg,
            leases: LeaseTable::default(),
            addrs: Vec::new(),
            answered: 0,
            replicated: false,
            workers: BTreeMap::new(),
            model_len: None,
            pending: BTreeMap::new(),
            next_command: 0,
            failing: None,
            re_replicated: false,
            queued: VecDeque::new(),
            lost_at: BTreeMap::new(),
            swaps: 0,
            swap: None,
            rebuilding: None,
            terms: vec![0; cfg.shards as usize],
            checkpoint: None,
            next_round: 1,
            start: Some((BTreeSet::new(), None)),
            outputs: VecDeque::new(),
        }
    }

    /// What the cluster is set up as.
    pub fn config(&self) -> CoordinatorConfig {
        self.cfg
    }

    /// The next thing to do, if any.
    pub fn poll_output(&mut self) -> Option<CoordOutput> {
        self.outputs.pop_front()
    }

    /// When the machine wants [`handle_timeout`](Self::handle_timeout): the start barrier's end
    /// of wait, or the next lease to lapse (with backups only: without, a lost server has
    /// nothing to fail over to).
    pub fn poll_timeout(&self) -> Option<u64> {
        let lapse = self.watches_leases().then(|| self.leases.next_lapse()).flatten();
        let start = self.start.as_ref().and_then(|(_, due)| *due);
        lapse.into_iter().chain(start).min()
    }

    /// Time has passed: the start barrier opens if its wait ran out; servers whose lease lapsed
    /// are failed over.
    pub fn handle_timeout(&mut self, now_ns: u64) {
        if self.start.as_ref().and_then(|(_, due)| *due).is_some_and(|due| now_ns >= due) {
            self.open_start();
        }
        if !self.watches_leases() {
            return;
        }
        for server in self.leases.lapsed(now_ns) {
            self.leases.lose(server);
            self.lost_at.insert(server, now_ns);
            self.outputs.push_back(CoordOutput::ServerLost { server });
            self.queued.push_back(server);
        }
        self.next_failover();
    }

    /// Worker `worker` has joined its shards and is ready to train, at `now_ns`: whether the
    /// start barrier is open (training has started). It opens once the workers it waits for
    /// ([`CoordinatorConfig::start`]) are ready, each counted once, or, at the latest, that wait
    /// after the first was ready ([`CoordOutput::Started`]); a worker ready after it opened (a
    /// late joiner, a restarted one) starts at once. Without workers to wait for, the first
    /// ready opens it.
    pub fn worker_ready(&mut self, now_ns: u64, worker: WorkerId) -> bool {
        let (want, wait_ms) = self.cfg.start;
        let Some((ready, due)) = self.start.as_mut() else { return true };
        ready.insert(worker);
        due.get_or_insert(now_ns.saturating_add(wait_ms.saturating_mul(1_000_000)));
        if ready.len() as u32 >= want {
            self.open_start();
        }
        self.start.is_none()
    }

    /// Whether training has started (the start barrier opened, or a rebuild found it under way).
    pub fn has_started(&self) -> bool {
        self.start.is_none()
    }

    fn open_start(&mut self) {
        if let Some((ready, _)) = self.start.take() {
            let want = self.cfg.start.0;
            self.outputs.push_back(CoordOutput::Started { ready: ready.len() as u32, want });
        }
    }

    /// The driver did not run for `stalled_ns`: that time is not counted against the leases
    /// ([`LeaseTable::credit`]).
    pub fn credit_stall(&mut self, now_ns: u64, stalled_ns: u64) {
        self.leases.credit(now_ns, stalled_ns);
    }

    fn watches_leases(&self) -> bool {
        self.cfg.replicas > 0
    }

    /// A server listening at `addr` registers at `now_ns`: its id, unless the cluster has all
    /// its servers (then see [`replace_server_at`](Self::replace_server_at)).
    pub fn register_server(&mut self, now_ns: u64, addr: SocketAddr) -> Result<u32, Refusal> {
        if self.leases.len() as u32 >= self.cfg.servers {
            return Err(Refusal::ServersFull(self.cfg.servers));
        }
        self.addrs.push(addr);
        Ok(self.leases.add(now_ns))
    }

    /// Each server's address, by id ([`UNKNOWN_ADDR`] for one a rebuild did not hear from).
    pub fn server_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// What to record for a restarted coordinator ([`Record`]).
    pub fn record(&self) -> Record {
        Record { terms: self.terms.clone(), servers: self.addrs.clone() }
    }

    /// A server registering at `now_ns` from `addr` with a full cluster: a process restarted in
    /// the place of the lost server at that address takes its id back, holding nothing, with a
    /// lease from `now_ns` as a new server's, and every shard without a backup gets one on the
    /// next live server after its primary's, this one included (at once, or when the failover
    /// under way re-replicates). Refused while the server still counts as live (its old
    /// process's lease has not lapsed: the driver must also refuse that process's renewals from
    /// now on), or while it or the map is changing (its failover, a swap, a rebuild, new
    /// backups under way): [`Refusal::NotYet`], and nothing changes. At another address it is
    /// refused, and told where the lost servers were.
    pub fn replace_server_at(&mut self, now_ns: u64, addr: SocketAddr) -> Result<u32, Replacement> {
        let Some(id) = self.addrs.iter().position(|a| *a == addr).map(|i| i as u32) else {
            let lost = (0..self.addrs.len() as u32)
                .filter(|&i| !self.leases.is_live(i))
                .map(|i| (i, self.addrs[i as usize]))
                .collect();
            return Err(Replacement::NotAtLostAddress { lost });
        };
        self.replace_server(now_ns, id).map_err(Replacement::Refused)?;
        Ok(id)
    }

    /// Registered server `server` reconnects from `addr` at `now_ns` (it lost its connection to
    /// this coordinator, which ran on): from its own address, or while its id is not live (the
    /// lease then says whether it was failed over), its lease is renewed; from another address
    /// while its id is live, it is refused: another process holds the id.
    pub fn reconnect_server(&mut self, now_ns: u64, server: u32, addr: SocketAddr) -> Result<(), Reconnect> {
        match self.addrs.get(server as usize) {
            Some(a) if *a == addr || !self.leases.is_live(server) => Ok(self.renew(now_ns, server)?),
            _ => Err(Reconnect::NotRegistered { server }),
        }
    }

    /// A registered server was answered. Once all have been, the primaries are told to attach
    /// their backups; [`CoordOutput::Replicated`] follows when those commands are done.
    /// Returns how many have been answered.
    pub fn server_answered(&mut self) -> u32 {
        self.answered += 1;
        if self.answered != self.cfg.servers {
            return self.answered;
        }
        let planned: Vec<(u32, u32)> =
            self.places.iter().enumerate().filter_map(|(k, p)| Some((k as u32, p.backup?))).collect();
        for &(shard, backup) in &planned {
            self.places[shard as usize].backup = None;
            let primary = self.places[shard as usize].primary;
            self.send(
                primary,
                Command::AttachBackup { shard, backup },
                Purpose::InitialBackup { shard, backup },
            );
        }
        self.check_replicated();
        self.answered
    }

    /// Lost server `server`'s id taken back by a new process ([`replace_server_at`]'s rules,
    /// once the address has named the id).
    ///
    /// [`replace_server_at`]: Self::replace_server_at
    fn replace_server(&mut self, now_ns: u64, server: u32) -> Result<(), Refusal> {
        let servers = self.cfg.servers;
        let not_yet = |why| Err(Refusal::NotYet { server, why });
        if server >= self.leases.len() as u32 {
            return Err(Refusal::NoSuchServer { server, servers });
        }
        if self.leases.is_live(server) {
            return not_yet(NotYet::StillLive);
        }
        if self.failing == Some(server) || self.queued.contains(&server) {
            return not_yet(NotYet::FailingOver);
        }
        let quiet_ns = self.cfg.peer_timeout_ms * 1_000_000;
        if self.lost_at.get(&server).is_some_and(|&at| now_ns < at + quiet_ns) {
            return not_yet(NotYet::PeerTimeout);
        }
        if self.rebuilding.is_some() {
            return not_yet(NotYet::Rebuilding);
        }
        if self.swap.is_some() {
            return not_yet(NotYet::Swapping);
        }
        if self.pending.values().any(|p| matches!(p, Purpose::NewBackup { .. })) {
            return not_yet(NotYet::AttachingBackups);
        }
        self.leases.revive(now_ns, server);
        self.lost_at.remove(&server);
        if self.failing.is_none() {
            self.re_replicate();
        }
        Ok(())
    }

    /// Server `server` renews its lease at `now_ns` (its heartbeat, or its reconnection).
    pub fn renew(&mut self, now_ns: u64, server: u32) -> Result<(), crate::lease::LeaseError> {
        self.leases.renew(now_ns, server)
    }

    /// A restarted coordinator rebuilds the cluster at `now_ns` from what the servers that
    /// rejoined it hold (`held`; see [`rebuild`]): the map their terms say, the newest policy's
    /// swap count, and leases for every rejoined server that is not stale, running from its
    /// next renewal (allowed [`LEASE_MS`]). Its commands come out as outputs: backups promoted
    /// where their primary did not come back, primaries without a backup told to go on alone,
    /// and the commit of a swap that some servers had committed on the others (with the same
    /// levelling). Once they are done, [`CoordOutput::Rebuilt`], then new backups. A holding
    /// from a server id outside the cluster is ignored. `recorded` is what the old coordinator
    /// recorded ([`record`](Self::record), kept by its driver; empty if none). `addrs` are the
    /// rejoined servers' addresses; a server that did not rejoin keeps its recorded one, or
    /// [`UNKNOWN_ADDR`].
    pub fn rebuild(
        &mut self,
        now_ns: u64,
        held: &[Held],
        recorded: &Record,
        addrs: &BTreeMap<u32, SocketAddr>,
    ) -> Rebuilt {
        let n = self.cfg.servers;
        self.addrs = (0..n)
            .map(|i| {
                let kept = recorded.servers.get(i as usize).copied();
                addrs.get(&i).copied().or(kept).unwrap_or(UNKNOWN_ADDR)
            })
            .collect();
        let recorded = recorded.terms.as_slice();
        let held: Vec<Held> = held.iter().filter(|h| h.server < n).cloned().collect();
        let resolution = resolve(self.cfg.shards, &held, recorded);
        let rejoined = |i: u32| held.iter().any(|h| h.server == i);
        let live: Vec<bool> = (0..n).map(|i| rejoined(i) && !resolution.stale.contains_key(&i)).collect();
        let missing = (0..n).filter(|&i| !rejoined(i)).collect();
        // A lost shard keeps a nominal place; its driver reports it lost.
        self.places = resolution
            .places
            .iter()
            .enumerate()
            .map(|(k, p)| p.unwrap_or(Place { primary: k as u32 % n, backup: None }))
            .collect();
        // A rejoined server's lease starts again with its next renewal, which follows its
        // welcome at once: the first lease's allowance covers a slow one.
        self.leases.reset(&live, now_ns + LEASE_MS * 1_000_000);
        self.lost_at = (0..n).filter(|&i| !live[i as usize]).map(|i| (i, now_ns)).collect();
        self.answered = n;
        self.replicated = true;
        self.model_len = resolution.model_len(&held);
        // Training was under way if the servers hold a model: its start barrier had opened.
        if self.model_len.is_some() {
            self.start = None;
        }
        // The newest term each shard is known at (a lost one's too); a promotion adds one.
        for (k, term) in self.terms.iter_mut().enumerate() {
            let claims =
                held.iter().flat_map(|h| h.primaries.iter().chain(&h.backups)).filter(|c| c.0 as usize == k);
            let heard = held.iter().filter_map(|h| h.known.get(k).copied());
            *term = claims.map(|c| c.1).chain(heard).chain(recorded.get(k).copied()).max().unwrap_or(0);
        }
        // The newest swap a live server committed, or one of its copies runs (its primary
        // committed it and died before the coordinator's crash let the others commit it).
        let newest = held.iter().filter(|h| live[h.server as usize]).max_by_key(|h| h.newest_swap());
        let finishing = newest.map(|h| (h.newest_swap(), h.levelled.clone()));
        self.swaps = newest.map_or(self.swaps, |h| h.newest_swap());
        let newest = newest.map(|h| h.server);
        self.rebuilding = Some(finishing.clone());
        for &(shard, server) in &resolution.promote {
            self.send(server, Command::Promote { shard }, Purpose::Rebuild { promoting: Some(shard) });
        }
        // Primaries whose backup did not come back stop waiting for it.
        for (k, place) in resolution.places.iter().enumerate() {
            let promoted = resolution.promote.iter().any(|p| p.0 as usize == k);
            if let Some(Place { primary, backup: None }) = place.filter(|_| !promoted) {
                self.send(
                    primary,
                    Command::DropBackup { shard: k as u32 },
                    Purpose::Rebuild { promoting: None },
                );
            }
        }
        if let Some((swap, _)) = finishing {
            for h in held.iter().filter(|h| live[h.server as usize] && h.swaps < swap) {
                self.send(h.server, Command::Commit { swap }, Purpose::Rebuild { promoting: None });
            }
        }
        self.step_rebuild();
        Rebuilt { resolution, missing, newest }
    }

    /// Once a rebuild's commands are done: [`CoordOutput::Rebuilt`], then new backups.
    fn step_rebuild(&mut self) {
        if self.rebuilding.is_none() || self.pending.values().any(|p| matches!(p, Purpose::Rebuild { .. })) {
            return;
        }
        self.rebuilding = None;
        self.outputs.push_back(CoordOutput::Rebuilt);
        self.re_replicate();
    }

    /// The result of command `id`.
    pub fn command_done(&mut self, id: CommandId, result: Result<Answer, CommandError>) {
        let Some(purpose) = self.pending.remove(&id) else { return };
        let ok = result.is_ok();
        match purpose {
            Purpose::InitialBackup { shard, backup } => {
                if ok {
                    self.places[shard as usize].backup = Some(backup);
                }
            }
            Purpose::NewBackup { shard, backup } => {
                if ok {
                    self.places[shard as usize].backup = Some(backup);
                    let primary = self.places[shard as usize].primary;
                    self.outputs.push_back(CoordOutput::NewBackup { shard, primary, backup });
                }
            }
            Purpose::Failover(m) => match m {
                Failover::Promote { shard, to } if ok => {
                    self.terms[shard as usize] += 1;
                    placement::apply(&mut self.places, m);
                    self.outputs.push_back(CoordOutput::Moved { shard, server: to });
                }
                Failover::Promote { shard, .. } => {
                    let server = self.failing.unwrap_or(u32::MAX);
                    self.outputs.push_back(CoordOutput::ShardLost { shard, server })
                }
                // Its primary goes on without a backup whatever it answered (a primary that did
                // not answer is dying itself).
                Failover::DropBackup { .. } => placement::apply(&mut self.places, m),
                Failover::Lost { .. } => {}
            },
            Purpose::Swap { server } => {
                if let Some(round) = self.swap.as_mut() {
                    match result {
                        Ok(Answer::Clocks(clocks)) => round.frontier.merge(clocks),
                        Ok(Answer::Done) => {}
                        Err(e) => round.failed.push((server, e)),
                    }
                }
                self.step_swap();
            }
            Purpose::Abort => {}
            Purpose::Rebuild { promoting } => {
                match (promoting, ok) {
                    (Some(shard), true) => self.terms[shard as usize] += 1,
                    (Some(shard), false) => {
                        let server = self.places[shard as usize].primary;
                        self.outputs.push_back(CoordOutput::ShardLost { shard, server });
                    }
                    (None, _) => {}
                }
                self.step_rebuild();
            }
            Purpose::Checkpoint { shard } => self.snapshot_done(shard, result.map(|_| ())),
        }
        self.check_replicated();
        self.step_failover();
    }

    /// Begins hot swap number [`swaps`](Self::swaps) + 1: every live server is told to prepare
    /// its module. If all can, all are told to commit; if any cannot, all are told to abort and
    /// none switches. [`CoordOutput::SwapDone`] says how it ended.
    pub fn begin_swap(&mut self) -> Result<u64, SwapError> {
        if let Some(round) = &self.swap {
            return Err(SwapError::Busy(round.swap));
        }
        if let Some(r) = &self.checkpoint {
            return Err(SwapError::Checkpointing(r.round));
        }
        let registered = self.registered();
        if registered < self.cfg.servers {
            return Err(SwapError::Registering { registered, servers: self.cfg.servers });
        }
        let swap = self.swaps + 1;
        let servers: Vec<u32> = (0..registered).filter(|&x| self.leases.is_live(x)).collect();
        for &server in &servers {
            self.send(server, Command::Prepare { swap }, Purpose::Swap { server });
        }
        self.swap = Some(SwapRound {
            swap,
            servers,
            committing: false,
            failed: Vec::new(),
            frontier: Frontier::default(),
            raise: Vec::new(),
        });
        self.step_swap();
        Ok(swap)
    }

    /// Moves the swap under way on once its servers have answered.
    fn step_swap(&mut self) {
        if self.pending.values().any(|p| matches!(p, Purpose::Swap { .. })) {
            return;
        }
        let Some(round) = self.swap.take() else { return };
        let swap = round.swap;
        if !round.committing && round.failed.is_empty() {
            for &server in &round.servers {
                self.send(server, Command::Commit { swap }, Purpose::Swap { server });
            }
            let raise = round.frontier.levelling();
            self.swap = Some(SwapRound { committing: true, raise, ..round });
            return self.step_swap();
        }
        let outcome = match (round.committing, round.failed.is_empty()) {
            (true, true) => SwapOutcome::Committed,
            (true, false) => SwapOutcome::Partial(round.failed),
            (false, _) => {
                for &server in &round.servers {
                    self.send(server, Command::Abort { swap }, Purpose::Abort);
                }
                SwapOutcome::Refused(round.failed)
            }
        };
        if round.committing {
            self.swaps = swap;
        }
        self.outputs.push_back(CoordOutput::SwapDone { swap, outcome });
    }

    /// What the commit of swap `swap` raises the workers' clocks by, the same on every shard
    /// (empty unless that swap is committing). A driver sends it with [`Command::Commit`].
    pub fn levelling(&self, swap: u64) -> &[ClockRaise] {
        match (&self.swap, &self.rebuilding) {
            (Some(round), _) if round.swap == swap && round.committing => &round.raise,
            // A rebuild finishing an interrupted swap raises as the servers that committed it did.
            (_, Some(Some((n, raise)))) if *n == swap => raise,
            _ => &[],
        }
    }

    /// The swap whose commit is under way (sent to its servers, not all answered yet): until
    /// it ends, a server may run the new policy while [`swaps`](Self::swaps) still counts the
    /// old one.
    pub fn committing(&self) -> Option<u64> {
        self.swap.as_ref().filter(|round| round.committing).map(|round| round.swap)
    }

    /// Hot swaps committed so far (each the number of the last).
    pub fn swaps(&self) -> u64 {
        self.swaps
    }

    /// Sets the swaps committed (a cluster resumed from a checkpoint, or rebuilt from servers
    /// that ran on).
    pub fn set_swaps(&mut self, swaps: u64) {
        self.swaps = swaps;
    }

    /// Starts the next queued failover, if none is under way.
    fn next_failover(&mut self) {
        while self.failing.is_none() {
            let Some(dead) = self.queued.pop_front() else { return };
            self.failing = Some(dead);
            for m in placement::fail_over(&self.places, dead) {
                match m {
                    Failover::Promote { to, .. } if self.leases.is_live(to) => {
                        self.send(to, Self::command_of(m), Purpose::Failover(m))
                    }
                    // Its backup's server is lost too: nothing can take over.
                    Failover::Promote { shard, .. } | Failover::Lost { shard } => {
                        self.outputs.push_back(CoordOutput::ShardLost { shard, server: dead })
                    }
                    Failover::DropBackup { primary, .. } => {
                        self.send(primary, Self::command_of(m), Purpose::Failover(m))
                    }
                }
            }
            self.step_failover();
        }
    }

    fn command_of(m: Failover) -> Command {
        // (`Failover::Lost` sends nothing: `next_failover` reports it.)
        match m {
            Failover::Promote { shard, .. } => Command::Promote { shard },
            Failover::DropBackup { shard, .. } | Failover::Lost { shard } => Command::DropBackup { shard },
        }
    }

    /// Moves the failover under way on: once its moves are done, the new backups; once those
    /// are done, the next failover.
    fn step_failover(&mut self) {
        let Some(dead) = self.failing else { return };
        if self.pending.values().any(|p| matches!(p, Purpose::Failover(_) | Purpose::NewBackup { .. })) {
            return;
        }
        if !self.re_replicated {
            self.re_replicated = true;
            self.re_replicate();
            if self.pending.values().any(|p| matches!(p, Purpose::NewBackup { .. })) {
                return;
            }
        }
        self.re_replicated = false;
        self.failing = None;
        self.outputs.push_back(CoordOutput::FailoverDone { server: dead });
        self.next_failover();
    }

    /// A new backup for every shard without one whose primary lives, on the next live server
    /// (a failover and a rebuild do this themselves once their moves are done).
    fn re_replicate(&mut self) {
        if self.cfg.replicas == 0 {
            return;
        }
        let live = self.leases.live();
        let planned = placement::new_backups(&self.places, &live, self.cfg.replicas);
        for (k, place) in self.places.iter().enumerate() {
            let primary_lives = live.get(place.primary as usize).copied().unwrap_or(false);
            if place.backup.is_none() && primary_lives && !planned.iter().any(|p| p.0 as usize == k) {
                self.outputs.push_back(CoordOutput::NoBackupPlace { shard: k as u32 });
            }
        }
        for (shard, primary, backup) in planned {
            self.send(primary, Command::AttachBackup { shard, backup }, Purpose::NewBackup { shard, backup });
        }
    }

    fn check_replicated(&mut self) {
        let initial = self.pending.values().any(|p| matches!(p, Purpose::InitialBackup { .. }));
        if !self.replicated && self.answered == self.cfg.servers && !initial {
            self.replicated = true;
            self.outputs.push_back(CoordOutput::Replicated);
        }
    }

    fn send(&mut self, server: u32, command: Command, purpose: Purpose) {
        let id = self.next_command;
        self.next_command += 1;
        self.pending.insert(id, purpose);
        self.outputs.push_back(CoordOutput::Command { id, server, command });
    }

    /// A worker asks to join with a model of `model_len` parameters, for id `asked` or any.
    /// Returns its id; the shard map is [`places`](Self::places).
    pub fn admit_worker(&mut self, asked: Option<WorkerId>, model_len: u64) -> Result<WorkerId, Refusal> {
        if model_len == 0 {
            return Err(Refusal::EmptyModel);
        }
        if let Some(cluster) = self.model_len.filter(|&l| l != model_len) {
            return Err(Refusal::ModelLength { cluster, worker: model_len });
        }
        let max = self.cfg.max_workers;
        let id = match asked {
            Some(id) if id >= max => return Err(Refusal::IdOutOfRange { id, max }),
            Some(id) if self.workers.get(&id).is_some_and(|w| w.connected) => {
                return Err(Refusal::IdTaken(id))
            }
            Some(id) => id,
            None => (0..max).find(|w| !self.workers.contains_key(w)).ok_or(Refusal::WorkersFull(max))?,
        };
        self.model_len = Some(model_len);
        self.workers.insert(id, WorkerEntry { connected: true, finished: false });
        Ok(id)
    }

    /// Worker `id` said it leaves (it finished).
    pub fn worker_finished(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.finished = true;
        }
    }

    /// Worker `id`'s connection ended; returns whether it had not finished (it was lost).
    pub fn worker_disconnected(&mut self, id: WorkerId) -> bool {
        match self.workers.get_mut(&id) {
            Some(w) => {
                w.connected = false;
                !w.finished
            }
            None => false,
        }
    }

    /// The workers admitted, by id.
    pub fn workers(&self) -> &BTreeMap<WorkerId, WorkerEntry> {
        &self.workers
    }

    /// The model's length, once a worker has told it.
    pub fn model_len(&self) -> Option<u64> {
        self.model_len
    }

    /// Sets the model's length (a cluster resumed from a checkpoint knows it before any worker).
    pub fn set_model_len(&mut self, len: Option<u64>) {
        self.model_len = len;
    }

    /// Per shard, its term: how many times it was promoted (what a lease renewal's answer tells
    /// the servers, so that a restarted coordinator learns it from them: [`Held::known`]).
    pub fn terms(&self) -> &[u64] {
        &self.terms
    }

    /// The shard map.
    pub fn places(&self) -> &[Place] {
        &self.places
    }

    /// Whether every initial backup is attached (workers may be welcomed).
    pub fn is_replicated(&self) -> bool {
        self.replicated
    }

    /// Servers registered so far.
    pub fn registered(&self) -> u32 {
        self.leases.len() as u32
    }

    /// Whether server `server` is registered and not lost.
    pub fn is_live(&self, server: u32) -> bool {
        self.leases.is_live(server)
    }

    /// Per server: whether it is live.
    pub fn live(&self) -> Vec<bool> {
        self.leases.live()
    }
}

#[cfg(test)]
mod tests;
