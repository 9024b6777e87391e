//! The worker's client library: what a workload uses to talk to the parameter server.
//!
//! The model is one flat `f32` vector whose index space is split into contiguous key ranges,
//! one per shard (the coordinator's map). [`WorkerClient::push`] and [`WorkerClient::pull`]
//! take the whole model and split it per shard; requests to different servers (and shards)
//! go out concurrently, each on its own QUIC stream, so a slow shard does not hold up the
//! others' transfers. [`WorkerClient::push_buffer`] takes the gradient by value and sends it
//! without a copy, which large models want. Control messages from the shards' policies arrive
//! on [`WorkerClient::next_control`].
//!
//! If the coordinator goes away, the client waits for it to come back at the same address
//! (it may be restarting) and rejoins it under the same id; meanwhile requests to servers wait
//! out servers that refuse for want of a lease.
//!
//! Any tokio runtime with I/O and timers will do; one from
//! [`crate::net::spin::runtime_builder`] (what `syncopate worker` uses) also spins briefly
//! before it sleeps, which makes small requests several times faster on virtual machines.

use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use syncopate_engine::tasks::Handover;
use syncopate_engine::worker::client::{ClientMachine, Loss, PushSlot, Retry, Tally};
pub use syncopate_engine::worker::client::{PullStats, ShardPulled};
use syncopate_engine::worker::join::{JoinAnswer, JoinStep, Joining};
use syncopate_policy_sdk::abi::{Control, IterationReport, Signals, WorkerId};
use tokio::sync::{mpsc, watch};

use crate::codec::{Codec, Encoded, PushEncoder};
use crate::net::pool::TensorPool;
use crate::net::proto::{
    ControlMessage, CoordRequest, CoordResponse, DataRequest, DataResponse, Hello, ModelScore, Role,
    ShardPlace, Welcome, WorkerNotice, PROTOCOL_VERSION,
};
use crate::net::tls::ClusterAccess;
use crate::net::wire::{self, Limits, Payload};
use crate::net::{self, NetError};
use crate::NodeError;

use super::links::ServerLinks;

/// How long a wait notice ([`WorkerClient::waiting`]) may take before it is given up.
const NOTICE_WAIT: Duration = Duration::from_secs(5);

/// The QUIC stream priority of requests without a payload (pulls, reports): they go ahead of
/// the parts of a push in flight, whose priorities are their shards' indices.
const URGENT: i32 = i32::MAX;

/// A worker's connection to the cluster.
#[derive(Debug)]
pub struct WorkerClient {
    id: WorkerId,
    endpoint: quinn::Endpoint,
    /// The link to the coordinator, which a background task renews if it restarts.
    coordinator: watch::Receiver<CoordinatorLink>,
    /// Set when this worker leaves: the coordinator connection's end is then no loss.
    leaving: Arc<AtomicBool>,
    /// The servers' connections, by id (dialed again when one ended: a restarted server).
    servers: ServerLinks,
    shards: Vec<ShardPlace>,
    /// Per shard: held while this worker joins it again after losing its primary, so that the
    /// renumbering a fresh join brings is in place before any other request goes there.
    rejoining: Vec<tokio::sync::Mutex<()>>,
    model_len: usize,
    /// Workers the cluster expects.
    workers: u32,
    /// The servers' optimizer.
    optimizer: crate::shard::OptimizerConfig,
    /// Per shard: the codec pushes go in, and what the codecs left out of earlier pushes.
    encoder: std::sync::Mutex<PushEncoder>,
    controls: mpsc::UnboundedReceiver<ControlMessage>,
    stop: watch::Sender<bool>,
    limits: Limits,
    /// Gradient buffers handed back by QUIC once sent ([`WorkerClient::push_buffer`]).
    pool: TensorPool,
    /// The client machine (which server holds each shard now, how each numbers this worker's
    /// iterations, what each request still waits for), shared with the task that follows the
    /// coordinator's moves.
    route: Arc<Route>,
}

/// The worker's link to the coordinator.
#[derive(Clone, Debug)]
enum CoordinatorLink {
    /// Connected.
    Up(quinn::Connection),
    /// Lost; waiting for it to come back (it may be restarting).
    Away,
    /// Lost for good: it did not come back in time, refused us, or shut the cluster down.
    Gone(String),
}

/// The client machine, kept current by the coordinator's notices, and a signal of its moves.
#[derive(Debug)]
struct Route {
    /// Locked only for a decision or an update, never across a wait.
    client: Mutex<ClientMachine>,
    /// Bumped on every move.
    moved: watch::Sender<u64>,
    /// Whether the shards have backups (the machine's, fixed at the welcome: read without the
    /// lock on every request).
    replicated: bool,
    /// The machine's clock starts here.
    epoch: tokio::time::Instant,
}

/// What a request to a shard is, for the client machine to say whether it still waits for it
/// after a move.
#[derive(Clone, Copy, Debug)]
enum Asked {
    Pull(u64),
    Push(PushSlot, u64),
    /// Anything else: it is sent again after a move (a join, a skip, an acknowledgement, a
    /// report: each is idempotent at the shard).
    Note,
}

/// Checks a welcome's map before anything indexes by it: shards numbered `0..n` in order, each
/// on a listed server, their ranges contiguous and covering the model.
fn check_places(shards: &[ShardPlace], servers: usize, model_len: usize) -> Result<(), String> {
    let mut next = 0u64;
    for (k, p) in shards.iter().enumerate() {
        if p.shard as usize != k || p.server as usize >= servers || p.start != next || p.end < p.start {
            return Err(format!(
                "the coordinator's map of shards is inconsistent at shard {k} ({p:?}, {servers} servers)"
            ));
        }
        next = p.end;
    }
    if shards.is_empty() || next != model_len as u64 {
        return Err(format!(
            "the coordinator's map of shards covers {next} parameters in {} shards; the model has {model_len}",
            shards.len()
        ));
    }
    Ok(())
}

impl Route {
    fn client(&self) -> MutexGuard<'_, ClientMachine> {
        self.client.lock().expect("not poisoned")
    }

    fn server(&self, i: usize) -> u32 {
        self.client().server(i)
    }

    /// The machine's time now, in nanoseconds.
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The coordinator says `shard` is on `server` now (a notice, or a new welcome's map).
    fn moved(&self, shard: u32, server: u32) {
        match self.client().moved(shard, server) {
            Ok(true) => tracing::warn!(shard, server, "the coordinator moved a shard"),
            Ok(false) => return,
            Err(e) => return tracing::warn!("ignoring a move from the coordinator: {e}"),
        }
        self.moved.send_modify(|n| *n += 1);
    }
}

/// Whether an error means the shard's server is gone or no longer its primary.
fn server_lost(e: &NetError) -> bool {
    matches!(
        e,
        NetError::Lost { .. }
            | NetError::Unavailable { .. }
            | NetError::Moved { .. }
            | NetError::Timeout { .. }
            | NetError::Wire { .. }
    )
}

fn refused(conn: &quinn::Connection, what: DataResponse) -> NetError {
    match what {
        DataResponse::Unavailable(why) => NetError::Unavailable { addr: conn.remote_address(), why },
        DataResponse::Error(error) => NetError::RefusedByServer { addr: conn.remote_address(), error },
        DataResponse::Refused(error) => NetError::RefusedByShard { addr: conn.remote_address(), error },
        other => NetError::Unexpected { addr: conn.remote_address(), what: format!("{other:?}") },
    }
}

/// A shard's answer to a join, or its refusal. A fresh join numbers the worker's iterations
/// from its clock there.
fn join_answer(conn: &quinn::Connection, r: DataResponse) -> Result<JoinAnswer, NetError> {
    match r {
        DataResponse::Joined { clock, .. } => Ok(JoinAnswer { next: clock, clock, member: false }),
        DataResponse::Rejoined { next, clock } => Ok(JoinAnswer { next, clock, member: true }),
        other => Err(refused(conn, other)),
    }
}

impl WorkerClient {
    /// Registers with the coordinator (as worker `id`, or the lowest free id) for a model of
    /// `model_len` parameters, and connects to every server.
    pub async fn connect(
        access: &ClusterAccess,
        id: Option<WorkerId>,
        model_len: usize,
    ) -> Result<Self, NodeError> {
        let bootstrap = Duration::from_secs(30);
        let mut endpoint = net::tls::dial_only(access.tls.client_config(bootstrap)?, access.coordinator)?;
        let hello = |worker, ticket| Hello {
            protocol: PROTOCOL_VERSION,
            token: access.token.secret().to_string(),
            role: Role::Worker { worker, model_len: model_len as u64, ticket },
        };
        let name = &access.tls.server_name;
        let (coordinator, welcome) =
            net::connect(&endpoint, access.coordinator, name, &hello(id, None)).await?;
        let rejoin = Rejoin {
            endpoint: endpoint.clone(),
            addr: access.coordinator,
            name: name.clone(),
            token: access.token.secret().to_string(),
            model_len: model_len as u64,
        };
        let Welcome::Worker {
            worker,
            shards,
            servers,
            peer_timeout_ms,
            workers,
            optimizer,
            push_codec,
            replicated,
            ticket,
        } = welcome
        else {
            return Err(NodeError::Protocol(format!("the coordinator answered {welcome:?} to a worker")));
        };
        check_places(&shards, servers.len(), model_len).map_err(NodeError::Protocol)?;
        // Data connections use the cluster's peer timeout, so servers and we agree on liveness.
        endpoint.set_default_client_config(access.tls.client_config(Duration::from_millis(peer_timeout_ms))?);
        let (tx, controls) = mpsc::unbounded_channel();
        let mut conns = Vec::with_capacity(servers.len());
        net::tls::reach(&endpoint, &servers)?;
        for &addr in &servers {
            let (conn, _) = net::connect(&endpoint, addr, name, &hello(Some(worker), Some(ticket))).await?;
            tokio::spawn(read_controls(conn.clone(), tx.clone()));
            conns.push(conn);
        }
        let routes: Vec<u32> = shards.iter().map(|p| p.server).collect();
        let client = ClientMachine::new(&routes, conns.len() as u32, replicated)
            .map_err(|e| NodeError::Protocol(format!("the coordinator's map of shards: {e}")))?;
        let conns = ServerLinks::new(conns, servers, hello(Some(worker), Some(ticket)), name.clone(), tx);
        let stop = watch::Sender::new(false);
        let replicated = client.replicated();
        let route = Arc::new(Route {
            client: Mutex::new(client),
            moved: watch::channel(0).0,
            replicated,
            epoch: tokio::time::Instant::now(),
        });
        let (link, linked) = watch::channel(CoordinatorLink::Up(coordinator.clone()));
        let leaving = Arc::new(AtomicBool::new(false));
        let follow =
            Follow { id: worker, rejoin, leaving: leaving.clone(), stop: stop.clone(), route: route.clone() };
        tokio::spawn(follow_coordinator(coordinator, link, follow));
        tracing::info!(worker, shards = shards.len(), "connected to the cluster");
        let encoder = std::sync::Mutex::new(PushEncoder::new(worker, shards.len(), push_codec));
        Ok(WorkerClient {
            id: worker,
            endpoint,
            coordinator: linked,
            leaving,
            servers: conns,
            rejoining: shards.iter().map(|_| tokio::sync::Mutex::new(())).collect(),
            shards,
            model_len,
            workers,
            optimizer,
            encoder,
            controls,
            stop,
            limits: Limits::default(),
            pool: TensorPool::default(),
            route,
        })
    }

    /// Runs `f` against the server holding shard `i` now. After a move was heard (a notice, or
    /// the coordinator's map when the worker rejoins it) the worker first joins the shard's
    /// new primary, which takes it back only if it does so within its rejoin grace
    /// ([`ClientMachine::rejoin_due`]). When the server is lost (the coordinator moves the
    /// shard, or the server says it no longer holds it), the client machine decides: without
    /// backups the request fails; with them the worker waits for the server to serve again or
    /// for the move, as long as the machine says ([`ClientMachine::after_loss`]), joins the
    /// shard's new primary and, if the machine still waits for what `f` asks (`asked`), runs
    /// `f` again there: a push is then acknowledged once (as a duplicate if the new primary had
    /// it), a parked pull is answered by the one the new primary has parked. `f` numbers
    /// iterations as the shard does each time it runs
    /// ([`shard_iteration`](Self::shard_iteration)): a new primary that had dropped this worker
    /// (it stayed away past the promoted shard's backstop) takes it as a new member, and says
    /// where its old numbering stopped; the machine numbers its iterations from the clock it
    /// joined at from there on ([`ClientMachine::rejoined`]).
    async fn on_primary<T>(
        &self,
        i: usize,
        asked: Asked,
        mut f: impl AsyncFnMut(&quinn::Connection) -> Result<T, NetError>,
    ) -> Result<T, NetError> {
        let shard = i as u32;
        let replicated = self.route.replicated;
        // The loss that made this request be asked again, if one did.
        let mut lost_before: Option<NetError> = None;
        loop {
            let (server, rejoin) = {
                let client = self.route.client();
                (client.server(i), client.rejoin_due(i).is_some())
            };
            let conn = match replicated {
                true => self.servers.live(&self.endpoint, server).await,
                false => self.servers.get(server),
            };
            let attempt = async {
                if rejoin {
                    self.rejoin(&conn, i).await?;
                    if lost_before.is_some() && !self.awaited(i, asked) {
                        // The lost request's answer was counted already: nothing to ask the
                        // new primary.
                        return Ok(None);
                    }
                }
                f(&conn).await.map(Some)
            };
            let result = if replicated {
                let mut moved = self.route.moved.subscribe();
                let gone = moved.wait_for(|_| self.route.server(i) != server);
                tokio::select! {
                    r = attempt => r,
                    _ = gone => Err(NetError::Moved { addr: conn.remote_address(), shard }),
                }
            } else {
                // No backup to move to: the request needs no watch.
                attempt.await
            };
            let lost = match result {
                Ok(Some(answer)) => {
                    self.route.client().reached(i);
                    return Ok(answer);
                }
                Ok(None) => {
                    return Err(lost_before.expect("only a request asked again finds itself answered"))
                }
                Err(e) if server_lost(&e) => e,
                Err(e) => {
                    // The server answered, with a refusal.
                    self.route.client().reached(i);
                    return Err(e);
                }
            };
            let loss = match lost {
                NetError::Unavailable { .. } => Loss::Unleased,
                _ => Loss::Lost,
            };
            // A server that missed a lease renewal refuses for a moment, then serves again if
            // the coordinator did not fail it over: it is asked again after a pause. A lost
            // one is waited out until the shard moves. The machine says for how long.
            let now = self.route.now();
            let pause = match self.route.client().after_loss(now, i, loss) {
                Retry::Fail => return Err(lost),
                Retry::AskAgain { after_ns } => Duration::from_nanos(after_ns),
                Retry::AwaitMove { within_ns } => Duration::from_nanos(within_ns),
            };
            let mut moved = self.route.moved.subscribe();
            let wait = moved.wait_for(|_| self.route.server(i) != server);
            // No move within the pause: the server is asked again (the machine gives up once
            // the wait is over).
            if tokio::time::timeout(pause, wait).await.is_ok() {
                tracing::warn!(
                    worker = self.id,
                    shard,
                    from = server,
                    to = self.route.server(i),
                    "shard moved ({lost}); retrying there"
                );
            }
            lost_before = Some(lost);
        }
    }

    /// Joins shard `i`'s primary over `conn` after a move, one join at a time, and tells the
    /// machine how it answered.
    async fn rejoin(&self, conn: &quinn::Connection, i: usize) -> Result<(), NetError> {
        let _alone = self.rejoining[i].lock().await;
        // Another request may have joined meanwhile.
        let Some(ticket) = self.route.client().rejoin_due(i) else { return Ok(()) };
        let shard = i as u32;
        let request = DataRequest::Join { shard };
        let answer =
            match net::request::<_, DataResponse>(conn, &request, Payload::EMPTY, &self.limits).await? {
                (DataResponse::Rejoined { next, clock }, _) => JoinAnswer { next, clock, member: true },
                // Taken afresh: `next` is where its old numbering stopped.
                (DataResponse::Joined { clock, next }, _) => JoinAnswer { next, clock, member: false },
                (other, _) => return Err(refused(conn, other)),
            };
        if let Some(by) = self.route.client().rejoined(i, ticket, answer) {
            tracing::warn!(
                worker = self.id,
                shard,
                next = answer.next,
                clock = answer.clock,
                by,
                "the shard's new primary had dropped this worker: it numbers our iterations from {} on \
                 from {} now",
                answer.next,
                answer.clock
            );
        }
        Ok(())
    }

    /// Whether the machine still waits for shard `i`'s answer to what was asked.
    fn awaited(&self, i: usize, asked: Asked) -> bool {
        match asked {
            Asked::Pull(iteration) => self.route.client().awaits_pull(i, iteration),
            Asked::Push(slot, iteration) => self.route.client().awaits_push(slot, i, iteration),
            Asked::Note => true,
        }
    }

    /// Whether the coordinator asked the workers to stop (target reached, budget spent).
    pub fn stop_requested(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once the coordinator has asked the workers to stop: a driver waiting on a
    /// request that a policy keeps waiting wakes to give it up.
    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// QUIC statistics of each server connection (path MTU, round-trip time, lost packets,
    /// congestion events), by server address: what to look at when transfers are slower than
    /// the link.
    pub fn connection_stats(&self) -> Vec<(std::net::SocketAddr, quinn::ConnectionStats)> {
        self.servers.all().iter().map(|c| (c.remote_address(), c.stats())).collect()
    }

    /// Bytes sent and received on all this worker's connections (UDP payloads, so QUIC and TLS
    /// overheads included).
    pub fn bytes(&self) -> (u64, u64) {
        let all = self.servers.all();
        all.iter().chain(self.coordinator_conn().as_ref()).fold(
            self.servers.retired_bytes(),
            |(tx, rx), c| {
                let s = c.stats();
                (tx + s.udp_tx.bytes, rx + s.udp_rx.bytes)
            },
        )
    }

    /// This worker's id.
    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// Where each shard lives.
    pub fn shards(&self) -> &[ShardPlace] {
        &self.shards
    }

    /// Joins every shard. `init` (the whole model) creates shards that do not exist yet; shards
    /// that exist keep their parameters. Returns the iteration to start at, as [`Joining`] decides
    /// from the shards' answers: a worker every shard still counts as a member (restored from a
    /// checkpoint, or a process restarted under its id before any shard dropped its
    /// predecessor) starts at the earliest iteration any of them expects from it, and the
    /// shards already past it acknowledge those pushes as duplicates; any other (a late joiner)
    /// starts with the slowest worker of the shard whose slowest is furthest on, the others
    /// skipping it up to there, so that its clock is the same on every shard.
    ///
    /// # Panics
    /// If `init` is not the whole model (the length given to [`connect`](Self::connect)); the
    /// same holds for `pull`'s `out` and `push`'s `grad`.
    pub async fn join(&mut self, init: &[f32]) -> Result<u64, NodeError> {
        assert_eq!(init.len(), self.model_len, "init must be the whole model");
        let limits = self.limits;
        let joins = self.shards.iter().map(|p| {
            let conn = self.servers.get(p.server);
            let values = wire::f32_bytes(&init[p.start as usize..p.end as usize]);
            async move {
                let conn = &conn;
                let request = DataRequest::Join { shard: p.shard };
                let (r, _) = net::request::<_, DataResponse>(conn, &request, values.into(), &limits).await?;
                join_answer(conn, r)
            }
        });
        // The answers go to the join machine one by one, as the simulator's do.
        let mut joining = Joining::new(self.shards.len());
        let mut step = None;
        for (i, answer) in futures::future::try_join_all(joins).await?.into_iter().enumerate() {
            step = joining.joined(i, answer);
        }
        loop {
            match step {
                Some(JoinStep::Start { at, offsets }) => {
                    self.route.client().start(&offsets);
                    tracing::info!(worker = self.id, start = at, "joined the shards");
                    return Ok(at);
                }
                // Where it stands on every shard now: a hot swap's levelling may have raised
                // its clock on the shards it joined before it joined the others.
                Some(JoinStep::Check) => {
                    let checks = self.shards.iter().enumerate().map(|(i, p)| {
                        self.on_primary(i, Asked::Note, async |conn| {
                            let request = DataRequest::Join { shard: p.shard };
                            let (r, _) =
                                net::request::<_, DataResponse>(conn, &request, Payload::EMPTY, &limits)
                                    .await?;
                            join_answer(conn, r)
                        })
                    });
                    step = None;
                    for (i, answer) in futures::future::try_join_all(checks).await?.into_iter().enumerate() {
                        step = joining.joined(i, answer);
                    }
                }
                Some(JoinStep::Skip(behind)) => {
                    let skips = behind.iter().map(|&(i, to)| {
                        let shard = self.shards[i].shard;
                        self.on_shard(shard, move |_| DataRequest::Skip { shard, to })
                    });
                    futures::future::try_join_all(skips).await?;
                    step = None;
                    for (i, _) in behind {
                        step = joining.skipped(i);
                    }
                }
                None => {
                    return Err(NodeError::Protocol(
                        "joining the shards stopped short of a step (a client bug)".into(),
                    ))
                }
            }
        }
    }

    /// Waits until training may start: the coordinator answers once the cluster's expected
    /// workers have all joined (at once for a late joiner).
    pub async fn ready(&self) -> Result<(), NodeError> {
        let req = CoordRequest::Ready { worker: self.id };
        // The start barrier may hold the answer back for as long as the cluster's start-up takes.
        match self.ask_coordinator(&req, None).await? {
            CoordResponse::Ok => Ok(()),
            other => Err(NodeError::Protocol(format!("the coordinator answered {other:?} to ready"))),
        }
    }

    /// How shard `i` numbers this worker's iteration `iteration`.
    fn shard_iteration(&self, i: usize, iteration: u64) -> u64 {
        self.route.client().numbered(i, iteration)
    }

    /// Pulls the whole model before computing `iteration`, into `out`. Returns when every shard
    /// has served the pull (its policy may defer it).
    pub async fn pull(&self, iteration: u64, out: &mut [f32]) -> Result<PullStats, NodeError> {
        self.pull_segments(iteration, &mut [out]).await
    }

    /// [`pull`](Self::pull) into a model held in several pieces (one per tensor): `out` is the
    /// whole model in order, and each shard's answer is read straight into the pieces its key
    /// range covers, with no copy in between.
    ///
    /// # Panics
    /// If the pieces do not add up to the whole model.
    pub async fn pull_segments(
        &self,
        iteration: u64,
        out: &mut [&mut [f32]],
    ) -> Result<PullStats, NodeError> {
        let total: usize = out.iter().map(|s| s.len()).sum();
        assert_eq!(total, self.model_len, "out must be the whole model");
        let parts = carve(out, self.shards.iter().map(|p| (p.end - p.start) as usize));
        let pulls = parts
            .into_iter()
            .enumerate()
            .map(|(i, mut mine)| async move { self.pull_counted(i, iteration, &mut mine).await });
        let answers = futures::future::try_join_all(pulls).await?;
        // The client machine's count of the answers, whose last is the pull's; a pull its
        // caller asked again is counted here.
        let done = answers.iter().find_map(|(_, tally)| match tally {
            Tally::Done(stats) => Some(*stats),
            _ => None,
        });
        Ok(done.unwrap_or_else(|| {
            let mut stats = PullStats::default();
            answers.iter().for_each(|(answer, _)| stats.add(*answer));
            stats
        }))
    }

    /// Pulls shard `i`'s part of the model before computing `iteration` into `out` (its key
    /// range, in pieces), as [`pull_segments`](Self::pull_segments) pulls every shard's: for a
    /// driver that pulls shard by shard (a push overlapped with backward pulls each shard as
    /// soon as it has acknowledged its part of the push).
    ///
    /// # Panics
    /// If `i` is not a shard's index or `out` not its length.
    pub async fn pull_shard(
        &self,
        i: usize,
        iteration: u64,
        out: &mut [&mut [f32]],
    ) -> Result<ShardPulled, NodeError> {
        Ok(self.pull_counted(i, iteration, out).await?.0)
    }

    /// [`pull_shard`](Self::pull_shard), with what the answer did to the client machine's count
    /// of the pull across shards.
    async fn pull_counted(
        &self,
        i: usize,
        iteration: u64,
        out: &mut [&mut [f32]],
    ) -> Result<(ShardPulled, Tally<PullStats>), NodeError> {
        let p = &self.shards[i];
        let got: usize = out.iter().map(|s| s.len()).sum();
        assert_eq!(got, (p.end - p.start) as usize, "out must be the shard's key range");
        let limits = self.limits;
        self.route.client().pull_begun(iteration);
        let (waited_ns, version, local_steps) = self
            .on_primary(i, Asked::Pull(iteration), async |conn| {
                let req = DataRequest::Pull { shard: p.shard, iteration: self.shard_iteration(i, iteration) };
                pull_into(conn, &req, out, limits, &self.pool).await
            })
            .await?;
        let answer = ShardPulled { waited_ns, version, local_steps };
        let mut client = self.route.client();
        let tally = client.pulled(i, iteration, answer);
        if tally == Tally::Stale {
            // Asked again by its caller after it was answered: the values landed all the same.
            client.landed(i, version);
        }
        Ok((answer, tally))
    }

    /// The number of parameters: the length of the whole model.
    pub fn model_len(&self) -> usize {
        self.model_len
    }

    /// The servers' optimizer: what every pushed gradient goes through.
    pub fn server_optimizer(&self) -> crate::shard::OptimizerConfig {
        self.optimizer
    }

    /// What the push codecs left out and no push has carried yet, summed over every value
    /// ([`PushEncoder::owed`]).
    pub fn codec_owed(&self) -> f64 {
        self.encoder.lock().expect("not poisoned").owed()
    }

    /// How many workers the cluster expects (its start barrier; later workers may join).
    pub fn expected_workers(&self) -> u32 {
        self.workers
    }

    /// [`push_local`](Self::push_local) of a model held in several pieces (one per tensor):
    /// they are gathered into one of this client's pooled buffers (the one copy QUIC needs),
    /// which is sent without another. `local_steps` 0 pushes a gradient.
    ///
    /// # Panics
    /// If the pieces do not add up to the whole model.
    pub async fn push_segments(
        &self,
        iteration: u64,
        grad: &[&[f32]],
        samples: u32,
        local_steps: u32,
        signals: Signals,
    ) -> Result<u32, NodeError> {
        let total: usize = grad.iter().map(|s| s.len()).sum();
        assert_eq!(total, self.model_len, "grad must be the whole model");
        let mut buf = self.gradient_buffer();
        let mut at = 0;
        for piece in grad {
            buf[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
        self.push_local(iteration, buf, samples, local_steps, signals).await
    }

    /// Pushes the gradient of `iteration` (the whole model), computed on `samples` samples.
    /// Returns when every shard has decided it (its policy may hold it first), with how many
    /// shards' policies dropped it (0: every shard applied it).
    ///
    /// QUIC copies `grad` into its send buffer; [`push_buffer`](Self::push_buffer) saves that
    /// copy, which matters for large models.
    pub async fn push(&self, iteration: u64, grad: &[f32], samples: u32) -> Result<u32, NodeError> {
        self.push_whole(iteration, Payload::Borrowed(wire::f32_bytes(grad)), samples, 0, Signals::default())
            .await
    }

    /// A buffer for a gradient to push with [`push_buffer`](Self::push_buffer): as long as the
    /// model, and reused from gradients already sent when one is free, so its contents are
    /// unspecified (write all of it).
    pub fn gradient_buffer(&self) -> Vec<f32> {
        self.pool.take(self.model_len)
    }

    /// The pool [`gradient_buffer`](Self::gradient_buffer) takes from (shared).
    pub fn pool(&self) -> TensorPool {
        self.pool.clone()
    }

    /// [`push`](Self::push), taking the gradient by value: QUIC sends its bytes without copying
    /// them and hands the buffer back to [`gradient_buffer`](Self::gradient_buffer) once every
    /// server has acknowledged them. In the transport benchmark, 16 MiB pushes ran 1.35-1.47x
    /// as fast this way as borrowed ones.
    pub async fn push_buffer(&self, iteration: u64, grad: Vec<f32>, samples: u32) -> Result<u32, NodeError> {
        self.push_local(iteration, grad, samples, 0, Signals::default()).await
    }

    /// Pushes the pseudo-gradient of an iteration of `local_steps` local steps (the parameters
    /// pulled minus those reached), taken by value as [`push_buffer`](Self::push_buffer) takes
    /// a gradient: every shard applies it with its outer optimizer. `local_steps` 0 is
    /// [`push_buffer`](Self::push_buffer). `signals`: what the iteration reports to the
    /// shards' policies (loss, tokens, step time).
    pub async fn push_local(
        &self,
        iteration: u64,
        delta: Vec<f32>,
        samples: u32,
        local_steps: u32,
        signals: Signals,
    ) -> Result<u32, NodeError> {
        let bytes = self.pool.send_shared(Arc::new(delta));
        self.push_whole(iteration, Payload::Shared(bytes), samples, local_steps, signals).await
    }

    /// Pushes a whole iteration's gradient (or pseudo-gradient): each shard's part in the codec
    /// its policy set, with what earlier pushes' codecs left out added (error feedback), or as
    /// it is when neither applies.
    async fn push_whole(
        &self,
        iteration: u64,
        grad: Payload<'_>,
        samples: u32,
        local_steps: u32,
        signals: Signals,
    ) -> Result<u32, NodeError> {
        let parts = {
            let values: std::borrow::Cow<'_, [f32]> = match bytemuck::try_cast_slice(grad.as_slice()) {
                Ok(v) => v.into(),
                Err(_) => grad
                    .as_slice()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect::<Vec<f32>>()
                    .into(),
            };
            let f32s = std::mem::size_of::<f32>();
            let mut parts = Vec::with_capacity(self.shards.len());
            for (i, p) in self.shards.iter().enumerate() {
                let range = p.start as usize..p.end as usize;
                parts.push(match self.encode_part(i, iteration, &values[range.clone()]) {
                    Some(encoded) => encoded,
                    None => (Codec::None, grad.slice(range.start * f32s..range.end * f32s)),
                });
            }
            parts
        };
        let asked = Asked::Push(PushSlot::Own, iteration);
        self.push_parts(parts, asked, self.push_request(iteration, samples, local_steps, signals)).await
    }

    /// Shard `i`'s part of a push in the codec its policy set, error feedback added; `None`
    /// when it goes as it is.
    fn encode_part(&self, i: usize, iteration: u64, values: &[f32]) -> Option<(Codec, Payload<'static>)> {
        let mut out = Vec::new();
        match self.encoder.lock().expect("not poisoned").encode(i, iteration, values, &mut out) {
            Encoded::Raw => None,
            Encoded::Bytes(codec) => Some((codec, Payload::Shared(bytes::Bytes::from(out)))),
        }
    }

    /// What builds each shard's request of a push of `iteration` ([`push_parts`](Self::push_parts)'s
    /// `make`): `make(index, shard, based_on, codec)`.
    fn push_request(
        &self,
        iteration: u64,
        samples: u32,
        local_steps: u32,
        signals: Signals,
    ) -> impl Fn(usize, u32, Option<u64>, Codec) -> DataRequest + '_ {
        move |i, shard, based_on, codec| DataRequest::Push {
            shard,
            iteration: self.shard_iteration(i, iteration),
            samples,
            based_on,
            local_steps,
            codec,
            signals,
        }
    }

    /// The key ranges of the shards, in order: where each shard's part of the whole model lies
    /// (what [`push_shard`](Self::push_shard) sends).
    pub fn shard_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.shards.iter().map(|p| p.start as usize..p.end as usize).collect()
    }

    /// Pushes shard `i`'s part of iteration `iteration` (`values`: the part of the whole model
    /// in its key range, [`shard_ranges`](Self::shard_ranges)), taken by value as
    /// [`push_buffer`](Self::push_buffer) takes a whole gradient. An iteration pushed this way
    /// is pushed once per shard, as a whole push is (the policy sees the same requests), but
    /// each part can go as soon as the caller has it: a push overlapped with the backward
    /// pass. Its QUIC stream priority is minus the shard's index: while parts compete for the
    /// link, the earlier shards' (the model's first layers, which the next forward pass needs
    /// first) go first.
    /// Returns 1 if the shard's policy dropped it, else 0.
    ///
    /// # Panics
    /// If `i` is not a shard's index or `values` not its length.
    pub async fn push_shard(
        &self,
        i: usize,
        iteration: u64,
        values: Vec<f32>,
        samples: u32,
        local_steps: u32,
        signals: Signals,
    ) -> Result<u32, NodeError> {
        let p = &self.shards[i];
        assert_eq!(values.len(), (p.end - p.start) as usize, "a shard's part is its key range");
        let (codec, payload) = match self.encode_part(i, iteration, &values) {
            Some(encoded) => {
                self.pool.give(values);
                encoded
            }
            None => (Codec::None, Payload::Shared(self.pool.send_shared(Arc::new(values)))),
        };
        let make = self.push_request(iteration, samples, local_steps, signals);
        self.route.client().push_begun(PushSlot::Own, iteration);
        // The first layers' parts (the first shards' keys) go first when several share the
        // link, as ByteScheduler orders them: backward feeds them last, and the next forward
        // pass needs them first, so they overtake what is left of the last layers' parts, whose
        // pulls are needed only later in that pass. Alone on the link, a part goes at once.
        let priority = -i32::try_from(i).unwrap_or(i32::MAX);
        let asked = Asked::Push(PushSlot::Own, iteration);
        Ok(self.push_one(i, codec, payload, asked, priority, &make).await?)
    }

    /// Pushes tasks `mask` (of `total`) of worker `owner`'s iteration `iteration`: this worker's
    /// own partial iteration, or tasks moved to it. `grad` is their mean gradient over `samples`.
    /// Returns when every shard has counted them.
    ///
    /// Another worker's iteration is numbered as that worker numbers it; moves are only made
    /// between workers that joined before training started, whose numbering every shard shares.
    pub async fn push_tasks(
        &self,
        owner: WorkerId,
        iteration: u64,
        mask: u64,
        total: u32,
        grad: &[f32],
        samples: u32,
    ) -> Result<u32, NodeError> {
        let grad = Payload::Borrowed(wire::f32_bytes(grad));
        let f32s = std::mem::size_of::<f32>();
        let parts = self
            .shards
            .iter()
            .map(|p| (Codec::None, grad.slice(p.start as usize * f32s..p.end as usize * f32s)))
            .collect();
        let slot = if owner == self.id { PushSlot::Own } else { PushSlot::Help };
        self.push_parts(parts, Asked::Push(slot, iteration), |i, shard, based_on, _| {
            let iteration = if owner == self.id { self.shard_iteration(i, iteration) } else { iteration };
            DataRequest::PushTasks { shard, owner, iteration, samples, based_on, mask, total }
        })
        .await
    }

    /// Sends every shard its slice of `grad` (the whole model's bytes) with the request
    /// `make(index, shard, based_on)` builds, at once; each must acknowledge. Returns how many
    /// dropped it.
    async fn push_parts(
        &self,
        parts: Vec<(Codec, Payload<'_>)>,
        asked: Asked,
        make: impl Fn(usize, u32, Option<u64>, Codec) -> DataRequest,
    ) -> Result<u32, NodeError> {
        assert_eq!(parts.len(), self.shards.len(), "a part per shard");
        if let Asked::Push(slot, iteration) = asked {
            self.route.client().push_begun(slot, iteration);
        }
        let pushes = parts
            .into_iter()
            .enumerate()
            .map(|(i, (codec, values))| self.push_one(i, codec, values, asked, 0, &make));
        Ok(futures::future::try_join_all(pushes).await?.into_iter().sum())
    }

    /// Sends shard `i` its part of a push (`asked`: whose, of which iteration) with the request
    /// `make(index, shard, based_on, codec)` builds, at QUIC stream priority `priority`, and
    /// waits for its answer: 1 if its policy dropped it, else 0. `based_on` is the shard
    /// version of the model this worker last pulled there (`None` before any pull).
    async fn push_one(
        &self,
        i: usize,
        codec: Codec,
        values: Payload<'_>,
        asked: Asked,
        priority: i32,
        make: &impl Fn(usize, u32, Option<u64>, Codec) -> DataRequest,
    ) -> Result<u32, NetError> {
        let p = &self.shards[i];
        let based_on = self.route.client().based_on(i);
        let dropped = self
            .on_primary(i, asked, async move |conn| {
                let req = make(i, p.shard, based_on, codec);
                let values = values.clone();
                match net::request_with_priority::<_, DataResponse>(
                    conn,
                    &req,
                    values,
                    &self.limits,
                    priority,
                )
                .await?
                {
                    // A duplicate is an iteration the shard already has (the worker redoes it
                    // after a restore, or retries it after a failover): acknowledged, applied once.
                    (DataResponse::PushAcked | DataResponse::PushDuplicate, _) => Ok(0),
                    (DataResponse::PushDropped, _) => Ok(1),
                    (other, _) => Err(refused(conn, other)),
                }
            })
            .await?;
        if let Asked::Push(slot, iteration) = asked {
            self.route.client().push_answered(slot, i, iteration, Ok(dropped == 1));
        }
        Ok(dropped)
    }

    /// Whether every shard numbers this worker's iterations as it does (always, unless a
    /// promoted shard dropped the worker and took it back renumbered): only then can its tasks
    /// move and can it skip ahead.
    pub fn numbering_shared(&self) -> bool {
        self.route.client().numbering_shared()
    }

    /// Sends the server holding `shard` the request `make(index)` builds (`index`: the shard's
    /// place in [`shards`](Self::shards)); it must answer Ok.
    async fn on_shard(&self, shard: u32, make: impl Fn(usize) -> DataRequest) -> Result<(), NodeError> {
        let index = self.shards.iter().position(|p| p.shard == shard).ok_or_else(|| {
            NodeError::Protocol(format!("a control message named shard {shard}, which we do not use"))
        })?;
        let result = self
            .on_primary(index, Asked::Note, async |conn| {
                let req = make(index);
                match net::request::<_, DataResponse>(conn, &req, Payload::EMPTY, &self.limits).await? {
                    (DataResponse::Ok, _) => Ok(()),
                    (other, _) => Err(refused(conn, other)),
                }
            })
            .await;
        Ok(result?)
    }

    /// Answers a move request from `shard`'s policy: the tasks `handover` names (of this
    /// worker's iteration) go to its helper (`count` 0: none could).
    pub async fn tasks_yielded(&self, shard: u32, handover: &Handover) -> Result<(), NodeError> {
        let Handover { to, iteration, first, count, split, .. } = *handover;
        let (total, batch, part) = (split.total, split.batch, split.part);
        let req = DataRequest::TasksYielded { shard, to, iteration, first, count, total, batch, part };
        self.on_shard(shard, |_| req.clone()).await
    }

    /// Acknowledges a control message from `shard`'s policy: it applies from `iteration` on.
    pub async fn control_applied(
        &self,
        shard: u32,
        control: Control,
        iteration: u64,
    ) -> Result<(), NodeError> {
        if let Control::SetPushCodec { codec } = control {
            if let Some(i) = self.shards.iter().position(|p| p.shard == shard) {
                self.encoder.lock().expect("not poisoned").set(i, codec, iteration);
            }
        }
        self.on_shard(shard, |i| DataRequest::ControlApplied {
            shard,
            control,
            iteration: self.shard_iteration(i, iteration),
        })
        .await
    }

    /// Tells every shard this worker skips to iteration `to` (a policy's `SkipTo`); returns once
    /// every shard has taken it, so its next push is in order everywhere.
    pub async fn skip(&self, to: u64) -> Result<(), NodeError> {
        self.on_every_shard(|i, shard| DataRequest::Skip { shard, to: self.shard_iteration(i, to) }).await
    }

    /// Takes the stream of control messages, so a training loop can wait on it alongside its
    /// requests; [`try_control`](Self::try_control) and [`next_control`](Self::next_control) see
    /// nothing afterwards.
    pub fn take_controls(&mut self) -> mpsc::UnboundedReceiver<ControlMessage> {
        std::mem::replace(&mut self.controls, mpsc::unbounded_channel().1)
    }

    /// Tells every shard's policy that an iteration is finished.
    pub async fn finished(&self, report: IterationReport) -> Result<(), NodeError> {
        self.on_every_shard(|i, shard| self.finished_request(i, shard, report)).await
    }

    /// [`finished`](Self::finished), told to shard `i` only (a driver that pulls shard by
    /// shard tells each shard before its pull).
    pub async fn finished_shard(&self, i: usize, report: IterationReport) -> Result<(), NodeError> {
        self.tell_shard(i, &|i, shard| self.finished_request(i, shard, report)).await
    }

    fn finished_request(&self, i: usize, shard: u32, report: IterationReport) -> DataRequest {
        DataRequest::Finished {
            shard,
            report: IterationReport { iteration: self.shard_iteration(i, report.iteration), ..report },
        }
    }

    /// Tells every shard that this worker's pull of `iteration` has waited a while (`waiting`),
    /// or that every shard answered it ([`syncopate_engine::worker::Action::Waiting`]). Best
    /// effort: a notice only helps the shards see a rule that stalls the run, so one that cannot
    /// be delivered within 5 s (a shard moving to its backup) is given up, with a
    /// debug line, and is not an error.
    pub async fn waiting(&self, iteration: u64, waiting: bool) {
        let notices = self.on_every_shard(|i, shard| DataRequest::Waiting {
            shard,
            iteration: self.shard_iteration(i, iteration),
            waiting,
        });
        match tokio::time::timeout(NOTICE_WAIT, notices).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(worker = self.id, iteration, waiting, "wait notice not delivered: {e}")
            }
            Err(_) => tracing::debug!(
                worker = self.id,
                iteration,
                waiting,
                "wait notice given up after {NOTICE_WAIT:?}"
            ),
        }
    }

    /// Sends every shard the request `make(index, shard)` builds, at once; each must answer Ok.
    async fn on_every_shard(&self, make: impl Fn(usize, u32) -> DataRequest) -> Result<(), NodeError> {
        let make = &make;
        let calls = (0..self.shards.len()).map(|i| self.tell_shard(i, make));
        futures::future::try_join_all(calls).await?;
        Ok(())
    }

    /// Sends shard `i` the request `make(i, shard)` builds, which it answers with `Ok`.
    async fn tell_shard(&self, i: usize, make: &impl Fn(usize, u32) -> DataRequest) -> Result<(), NodeError> {
        let p = &self.shards[i];
        self.on_primary(i, Asked::Note, async move |conn| {
            let req = make(i, p.shard);
            // A few bytes: ahead of pushes in flight, as a pull's request is.
            match net::request_with_priority::<_, DataResponse>(
                conn,
                &req,
                Payload::EMPTY,
                &self.limits,
                URGENT,
            )
            .await?
            {
                (DataResponse::Ok, _) => Ok(()),
                (other, _) => Err(refused(conn, other)),
            }
        })
        .await?;
        Ok(())
    }

    /// The next control message, if one has arrived.
    pub fn try_control(&mut self) -> Option<ControlMessage> {
        self.controls.try_recv().ok()
    }

    /// Waits for the next control message.
    pub async fn next_control(&mut self) -> Option<ControlMessage> {
        self.controls.recv().await
    }

    /// Tells the coordinator how the model this worker computes on scores on held-out data (a
    /// training script's own evaluation), for the launcher's target and plots.
    pub async fn score(&self, score: ModelScore) -> Result<(), NodeError> {
        let req = CoordRequest::Score { worker: self.id, score };
        match self.ask_coordinator(&req, Some(COORDINATOR_PATIENCE)).await? {
            CoordResponse::Ok => Ok(()),
            CoordResponse::Error(e) => {
                Err(NodeError::Protocol(format!("the coordinator refused the score: {e}")))
            }
            other => Err(NodeError::Protocol(format!("the coordinator answered {other:?} to a score"))),
        }
    }

    /// The connection to the coordinator, while there is one.
    fn coordinator_conn(&self) -> Option<quinn::Connection> {
        match &*self.coordinator.borrow() {
            CoordinatorLink::Up(c) => Some(c.clone()),
            _ => None,
        }
    }

    /// Sends the coordinator a request and reads its answer. If the coordinator is away, or
    /// goes away before it answers, the request waits for it to come back and is sent again;
    /// so only requests that may be carried out twice come here. No answer within `patience`
    /// means the coordinator is gone (a dead one's connection would take the peer timeout to
    /// fail): the connection is given up, and the link follows the coordinator anew.
    async fn ask_coordinator(
        &self,
        req: &CoordRequest,
        patience: Option<Duration>,
    ) -> Result<CoordResponse, NodeError> {
        let mut link = self.coordinator.clone();
        loop {
            let conn = {
                let up = link.wait_for(|l| !matches!(l, CoordinatorLink::Away)).await;
                match up.as_deref() {
                    Ok(CoordinatorLink::Up(c)) => c.clone(),
                    Ok(CoordinatorLink::Gone(reason)) => return Err(NodeError::Lost(reason.clone())),
                    _ => return Err(NodeError::Lost("the coordinator link ended".into())),
                }
            };
            let asked = net::request::<_, CoordResponse>(&conn, req, Payload::EMPTY, &self.limits);
            let answer = match patience {
                Some(p) => tokio::time::timeout(p, asked).await.unwrap_or_else(|_| {
                    tracing::warn!(
                        worker = self.id,
                        "the coordinator did not answer within {p:?}; reconnecting"
                    );
                    conn.close(net::close::SILENT.into(), b"no answer");
                    Err(NetError::Lost {
                        addr: conn.remote_address(),
                        reason: quinn::ConnectionError::LocallyClosed,
                    })
                }),
                None => asked.await,
            };
            match answer {
                Ok((answer, _)) => return Ok(answer),
                // Lost on the way: the link follows the coordinator; ask again once it has.
                Err(_) if conn.close_reason().is_some() => {
                    let _ = link
                        .wait_for(
                            |l| !matches!(l, CoordinatorLink::Up(c) if c.stable_id() == conn.stable_id()),
                        )
                        .await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Leaves every shard and tells the coordinator, then closes the connections.
    pub async fn leave(self) -> Result<(), NodeError> {
        self.on_every_shard(|_, shard| DataRequest::Leave { shard }).await?;
        let bye = CoordRequest::Leaving { worker: self.id };
        match self.ask_coordinator(&bye, Some(COORDINATOR_PATIENCE)).await? {
            CoordResponse::Ok => {}
            other => tracing::warn!("the coordinator answered {other:?} to our goodbye"),
        }
        self.leaving.store(true, Ordering::SeqCst);
        for c in self.servers.all().iter().chain(self.coordinator_conn().as_ref()) {
            c.close(net::close::DONE.into(), b"worker done");
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        Ok(())
    }
}

/// Splits the pieces `segs` (a model in order) into consecutive groups of `lens` values each,
/// cutting pieces where a group ends inside one. The groups must cover the pieces exactly.
pub(crate) fn carve<'a>(
    segs: &'a mut [&mut [f32]],
    lens: impl Iterator<Item = usize>,
) -> Vec<Vec<&'a mut [f32]>> {
    let mut pieces = segs.iter_mut().map(|s| &mut **s).filter(|s| !s.is_empty());
    let mut cur: &'a mut [f32] = &mut [];
    let mut groups = Vec::new();
    for mut need in lens {
        let mut group = Vec::new();
        while need > 0 {
            if cur.is_empty() {
                cur = pieces.next().expect("the pieces cover every group");
            }
            let take = need.min(cur.len());
            let (head, tail) = std::mem::take(&mut cur).split_at_mut(take);
            group.push(head);
            cur = tail;
            need -= take;
        }
        groups.push(group);
    }
    groups
}

/// One shard's pull: the answer's payload is read straight into `out`, piece after piece.
async fn pull_into(
    conn: &quinn::Connection,
    req: &DataRequest,
    out: &mut [&mut [f32]],
    limits: Limits,
    pool: &TensorPool,
) -> Result<(u64, u64, u32), NetError> {
    let addr = conn.remote_address();
    let (mut send, mut recv) = conn.open_bi().await.map_err(|reason| NetError::Lost { addr, reason })?;
    // A pull's request is a few bytes: ahead of any push this worker is sending (a push
    // overlapped with backward pulls shard by shard while its other parts still travel).
    let _ = send.set_priority(URGENT);
    let mut scratch = Vec::new();
    let wire_err = |e| net::wire_or_lost(conn, e);
    wire::write_frame(&mut send, req, Payload::EMPTY, &mut scratch).await.map_err(wire_err)?;
    let head = wire::read_head::<DataResponse>(&mut recv, &limits, &mut scratch).await.map_err(wire_err)?;
    match head.header {
        DataResponse::Pulled { waited_ns, version, local_steps, codec, .. } => {
            let values: usize = out.iter().map(|p| p.len()).sum();
            if codec != Codec::None {
                // Encoded: read whole (bounded by the frame limit), decode, copy into the pieces.
                let bytes = wire::read_payload_bytes(&mut recv, head.payload_len).await.map_err(wire_err)?;
                wire::expect_end(&mut recv).await.map_err(wire_err)?;
                let mut decoded = pool.take(values);
                let mut checked = crate::codec::decode(codec, &bytes, values, &mut decoded)
                    .map_err(|e| format!("a pull that does not decode: {e}"));
                if checked.is_ok() && decoded.len() != values {
                    checked = Err(format!("expected a tensor of {values} values, got {}", decoded.len()));
                }
                if checked.is_ok() {
                    let mut at = 0;
                    for piece in out.iter_mut() {
                        piece.copy_from_slice(&decoded[at..at + piece.len()]);
                        at += piece.len();
                    }
                }
                pool.give(decoded);
                checked.map_err(|e| wire_err(wire::WireError::Stream(e)))?;
                return Ok((waited_ns, version, local_steps));
            }
            if head.payload_len != values * 4 {
                let e = wire::WireError::Stream(format!(
                    "expected a tensor of {values} values, got {} bytes",
                    head.payload_len
                ));
                return Err(wire_err(e));
            }
            for piece in out.iter_mut() {
                wire::read_payload_into(&mut recv, piece.len() * 4, piece).await.map_err(wire_err)?;
            }
            wire::expect_end(&mut recv).await.map_err(wire_err)?;
            Ok((waited_ns, version, local_steps))
        }
        other => Err(refused(conn, other)),
    }
}

/// How long a worker waits for the coordinator to answer a request that it answers at once.
const COORDINATOR_PATIENCE: Duration = Duration::from_secs(3);

/// What follows the coordinator for a worker.
struct Follow {
    id: WorkerId,
    rejoin: Rejoin,
    /// Set once the worker leaves.
    leaving: Arc<AtomicBool>,
    stop: watch::Sender<bool>,
    route: Arc<Route>,
}

/// How a worker reaches the coordinator again.
struct Rejoin {
    endpoint: quinn::Endpoint,
    addr: std::net::SocketAddr,
    name: String,
    token: String,
    model_len: u64,
}

/// Follows the coordinator: reads its notices and, when it goes away (not by shutting the
/// cluster down), waits for it to come back and rejoins it as worker `id`, for up to
/// [`COORDINATOR_WAIT_MS`](crate::net::proto::COORDINATOR_WAIT_MS). The new welcome's map
/// replaces the route, as moves would have.
async fn follow_coordinator(mut conn: quinn::Connection, link: watch::Sender<CoordinatorLink>, f: Follow) {
    let Follow { id, rejoin, leaving, stop, route } = f;
    loop {
        read_notices(&conn, &stop, &route).await;
        let reason = conn.close_reason();
        // We left, or the cluster was shut down.
        let ended = leaving.load(Ordering::SeqCst)
            || matches!(&reason, Some(quinn::ConnectionError::ApplicationClosed(c)) if c.error_code == net::close::DONE.into());
        if ended || link.is_closed() {
            link.send_replace(CoordinatorLink::Gone(format!(
                "the coordinator closed our connection: {reason:?}"
            )));
            return;
        }
        link.send_replace(CoordinatorLink::Away);
        route.client().coordinator_away();
        tracing::warn!(
            worker = id,
            "lost the coordinator ({}); waiting for it to come back",
            reason.map(|r| r.to_string()).unwrap_or_default()
        );
        match rejoin_coordinator(&rejoin, id).await {
            Ok((c, places)) => {
                for p in places {
                    route.moved(p.shard, p.server);
                }
                route.client().coordinator_back(route.now());
                // Wakes every request waiting on a lost server to look again.
                route.moved.send_modify(|n| *n += 1);
                link.send_replace(CoordinatorLink::Up(c.clone()));
                conn = c;
            }
            Err(e) => {
                tracing::error!(worker = id, "{e}");
                link.send_replace(CoordinatorLink::Gone(e));
                return;
            }
        }
    }
}

/// Reconnects to the coordinator as worker `id`: the connection and the shards' places.
async fn rejoin_coordinator(
    r: &Rejoin,
    id: WorkerId,
) -> Result<(quinn::Connection, Vec<ShardPlace>), String> {
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        token: r.token.clone(),
        role: Role::Worker { worker: Some(id), model_len: r.model_len, ticket: None },
    };
    let wait = Duration::from_millis(crate::net::proto::COORDINATOR_WAIT_MS);
    let started = tokio::time::Instant::now();
    loop {
        let last = match attempt_rejoin(r, &hello).await {
            Ok((c, Welcome::Worker { shards, .. })) => {
                tracing::warn!(
                    worker = id,
                    ms = started.elapsed().as_millis() as u64,
                    "rejoined the coordinator"
                );
                return Ok((c, shards));
            }
            Ok((c, other)) => {
                c.close(net::close::DONE.into(), b"unexpected welcome");
                format!("it answered {other:?}")
            }
            // A refusal may be passing: our id may still be held by the connection the
            // coordinator has not yet seen die.
            Err(e) => e,
        };
        if started.elapsed() >= wait {
            return Err(format!(
                "the coordinator went away and did not take us back within {} s (last attempt: {last})",
                wait.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One attempt: a handshake that a coordinator still down never answers (so it is cut short),
/// then the hello, whose welcome a restarted coordinator sends once it has rebuilt the cluster.
async fn attempt_rejoin(r: &Rejoin, hello: &Hello) -> Result<(quinn::Connection, Welcome), String> {
    let conn = net::dial(&r.endpoint, r.addr, &r.name, Some(Duration::from_secs(1)))
        .await
        .map_err(|e| e.to_string())?;
    let wait = Duration::from_millis(crate::net::proto::REJOIN_WAIT_MS) + Duration::from_secs(20);
    match tokio::time::timeout(wait, net::greet(&conn, hello, &Limits::default())).await {
        Ok(Ok((welcome, _))) => Ok((conn, welcome)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no welcome within {wait:?}")),
    }
}

async fn read_notices(conn: &quinn::Connection, stop: &watch::Sender<bool>, route: &Route) {
    let limits = Limits { max_header: 4096, max_payload: 0 };
    while let Ok(mut recv) = conn.accept_uni().await {
        match wire::read_message::<WorkerNotice>(&mut recv, &limits).await {
            Ok((WorkerNotice::Stop, _)) => {
                tracing::info!("the coordinator asked us to stop");
                stop.send_replace(true);
            }
            Ok((WorkerNotice::Moved { shard, server }, _)) => route.moved(shard, server),
            Err(e) => tracing::warn!("unreadable notice from the coordinator: {e}"),
        }
    }
}

pub(super) async fn read_controls(conn: quinn::Connection, tx: mpsc::UnboundedSender<ControlMessage>) {
    let limits = Limits { max_header: 4096, max_payload: 0 };
    while let Ok(mut recv) = conn.accept_uni().await {
        match wire::read_message::<ControlMessage>(&mut recv, &limits).await {
            Ok((msg, _)) => {
                if tx.send(msg).is_err() {
                    return;
                }
            }
            Err(e) => tracing::warn!("unreadable control message: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::carve;

    #[test]
    fn carve_cuts_pieces_into_shard_ranges_in_order() {
        let (mut a, mut b, mut c, mut empty) = ([0f32; 3], [0f32; 5], [0f32; 2], [0f32; 0]);
        let mut pieces: Vec<&mut [f32]> = vec![&mut a, &mut empty, &mut b, &mut c];
        {
            let groups = carve(&mut pieces, [4, 0, 6].into_iter());
            let lens: Vec<Vec<usize>> = groups.iter().map(|g| g.iter().map(|p| p.len()).collect()).collect();
            assert_eq!(lens, vec![vec![3, 1], vec![], vec![4, 2]]);
            let mut n = 0.0;
            for group in groups {
                for piece in group {
                    for v in piece.iter_mut() {
                        *v = n;
                        n += 1.0;
                    }
                }
            }
        }
        assert_eq!(a, [0.0, 1.0, 2.0]);
        assert_eq!(b, [3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(c, [8.0, 9.0]);
    }
}
