//! The simulated workers' side: what each worker's driver keeps (its [`WorkerMachine`], its
//! [`ClientMachine`], buffers, the push and pull in flight) and what it does with the machines'
//! actions and the shards' answers, as `syncopate worker` drives the same machines over QUIC.
//! What the client decides (how shards number the worker's iterations, what a push is based on,
//! when a pull or push is answered everywhere, where each shard is, how long a lost server is
//! waited for, what to send again after a move) is the [`ClientMachine`]'s, as in
//! `WorkerClient`; the simulator keeps only time and bytes.

use syncopate_engine::worker::client::{ClientMachine, Loss, PullStats, PushSlot, Retry, ShardPulled, Tally};
use syncopate_engine::worker::join::Joining;
use syncopate_engine::worker::{
    Action, Buffers, Input, JobKind, PushFailed, PushJob, WorkerConfig, WorkerMachine,
};
use syncopate_policy_sdk::abi::{Applied, Control, LeaveReason, WorkerId};
use syncopate_workloads::Workload;

use super::control::Phase;
use super::events::{Ev, ToShard};
use super::{sim_shard, Req, Sim, SimError, PEER_TIMEOUT_NS};
use crate::codec::{self, Codec, Encoded, PushEncoder};
use crate::shard::{PushOutcome, Quiet, RequestError, Served, ShardError};

/// A push on its way: the job, when the latest acknowledgement sent so far arrives, and, once
/// every shard has answered, its result.
#[derive(Clone, Debug)]
pub(super) struct InFlight {
    pub(super) job: PushJob,
    pub(super) acks_at: u64,
    pub(super) result: Option<Result<u32, PushFailed>>,
}

/// Which push slot a job goes in.
pub(super) fn slot(help: bool) -> PushSlot {
    if help {
        PushSlot::Help
    } else {
        PushSlot::Own
    }
}

/// One simulated worker: the machines and what its driver keeps (buffers, transfers in flight).
pub(super) struct SimWorker {
    pub(super) cfg: WorkerConfig,
    /// Not joined yet: a late joiner before its time.
    pub(super) absent: bool,
    /// A late joiner joining.
    pub(super) joining: Option<Joining>,
    pub(super) machine: WorkerMachine,
    /// What its client knows and decides about its shards.
    pub(super) client: ClientMachine,
    pub(super) bufs: Buffers,
    pub(super) workload: Option<Box<dyn Workload>>,
    /// When the latest pull reply sent so far arrives, and, once every shard has answered, what
    /// they said.
    pub(super) replies_at: u64,
    pub(super) pulled: Option<PullStats>,
    /// Its push codecs and error-feedback residuals, as a cluster worker's client keeps them.
    pub(super) encoder: PushEncoder,
    /// Per shard, the own push in flight as that shard decodes it (when its codec is not
    /// `none`; `None`: the values as they are).
    pub(super) encoded: Vec<Option<Vec<f32>>>,
    pub(super) own: Option<InFlight>,
    pub(super) help: Option<InFlight>,
    pub(super) wake_at: Option<u64>,
    /// Counted in [`Sim::done`].
    pub(super) done: bool,
    /// Its process died.
    pub(super) dead: bool,
    /// Started (its first joins answered, the start barrier open).
    pub(super) started: bool,
    /// The shards that answered its first join; it starts once all have.
    pub(super) joins: u32,
    /// How long its pulls and pushes waited in limbo (on a shard it could not reach), added up.
    pub(super) unreachable_ns: u64,
}

impl Sim {
    /// Encodes worker `w`'s own push `job` for shard `s` as its client would (with error
    /// feedback), keeps what the shard will decode, and returns the bytes on the wire.
    pub(super) fn encode_push(&mut self, w: u32, s: u32, job: &PushJob) -> u64 {
        let (lo, hi) = self.shards.ranges[s as usize];
        let wk = &mut self.workers[w as usize];
        wk.encoded[s as usize] = None;
        if !self.opts.gradients {
            let codec = wk.encoder.codec(s as usize, job.iteration);
            return self.coded_bytes(s, codec);
        }
        let mut out = Vec::new();
        match wk.encoder.encode(s as usize, job.iteration, &wk.bufs.grad[lo..hi], &mut out) {
            Encoded::Raw => self.shard_bytes(s),
            Encoded::Bytes(Codec::None) => {
                wk.encoded[s as usize] = Some(bytemuck::cast_slice(&out).to_vec());
                self.shard_bytes(s)
            }
            Encoded::Bytes(c) => {
                let mut decoded = Vec::new();
                codec::decode(c, &out, hi - lo, &mut decoded).expect("our own encoding decodes");
                wk.encoded[s as usize] = Some(decoded);
                self.coded_bytes(s, c)
            }
        }
    }

    /// Shard `s` answers worker `w`'s pull for `iteration`.
    pub(super) fn served(&mut self, s: u32, w: WorkerId, iteration: u64, served: Served) {
        let wk = &mut self.workers[w as usize];
        let answer = ShardPulled {
            waited_ns: served.waited_ns,
            version: served.version,
            local_steps: served.local_steps,
        };
        // The answer to a pull asked again after a failover, which the old primary had
        // answered already, changes nothing.
        let tally = wk.client.pulled(s as usize, iteration, answer);
        if tally == Tally::Stale {
            return;
        }
        if self.opts.gradients {
            let (lo, hi) = self.shards.ranges[s as usize];
            let params = &mut wk.bufs.params[lo..hi];
            if served.codec == Codec::None {
                params.copy_from_slice(&served.values);
            } else {
                // What the worker's client decodes from the encoded reply.
                let (mut bytes, mut decoded) = (Vec::new(), Vec::new());
                codec::encode(served.codec, &served.values, None, &mut codec::Scratch::default(), &mut bytes);
                codec::decode(served.codec, &bytes, params.len(), &mut decoded)
                    .expect("our own encoding decodes");
                params.copy_from_slice(&decoded);
            }
        }
        let (from, bytes) = (self.server_node(s), self.coded_bytes(s, served.codec));
        let t = self.net.transfer(self.now, from, w as usize, bytes);
        // The worker goes on when the last reply arrives: one event at that time, not one
        // per shard (a fifth of a large run's events).
        let wk = &mut self.workers[w as usize];
        wk.replies_at = wk.replies_at.max(t);
        if let Tally::Done(stats) = tally {
            wk.pulled = Some(stats);
            let at = wk.replies_at;
            self.at(at, Ev::PullDone(w));
        }
    }

    /// Shard `s` answers worker `w`'s push (of moved tasks if `help`; of its own whole
    /// iteration if `whole`).
    pub(super) fn pushed(
        &mut self,
        s: u32,
        w: WorkerId,
        help: bool,
        iteration: u64,
        whole: bool,
        r: Result<PushOutcome, RequestError>,
    ) -> Result<(), SimError> {
        let answer = match r {
            // Only a whole push counts its shards' drops (parts are counted by their owner).
            Ok(outcome) => Ok(whole && outcome == PushOutcome::Dropped),
            // The owner left meanwhile: its iteration is void, as on the cluster.
            Err(e) if help => {
                tracing::debug!("moved tasks refused: {e}");
                Err(e)
            }
            // A push it gave up at a stop, overtaken by its goodbye: nobody waits for the
            // answer, and the shard applied nothing.
            Err(e) if self.left_already(w, &e) => {
                tracing::debug!(worker = w, shard = s, "a push after its goodbye refused: {e}");
                self.found.late_refusals += 1;
                return Ok(());
            }
            Err(e) => return Err(SimError::Refused(s, e.to_string())),
        };
        self.ack(w, s, help, iteration, answer);
        Ok(())
    }

    /// Whether `e`, a shard's refusal of worker `w`'s request, is only the late answer to a
    /// request the worker gave up when it stopped: it has left, and the shard no longer knows it.
    pub(super) fn left_already(&self, w: WorkerId, e: &RequestError) -> bool {
        matches!(e, RequestError::Shard(ShardError::UnknownWorker(..)))
            && self.workers[w as usize].machine.is_done()
    }

    /// Shard `s`'s answer to worker `w`'s push of `iteration` (`help`: of tasks moved to it)
    /// is on its way. Every acknowledgement takes the latency alone (after a cut link heals):
    /// the last to arrive becomes an event once the client has counted every shard's.
    fn ack(&mut self, w: u32, s: u32, help: bool, iteration: u64, answer: Result<bool, RequestError>) {
        let at = self.net.after_latency(self.now, self.server_node(s), w as usize);
        let wk = &mut self.workers[w as usize];
        let p = if help { &mut wk.help } else { &mut wk.own };
        let Some(p) = p.as_mut() else { return };
        let done = match wk.client.push_answered(slot(help), s as usize, iteration, answer) {
            Tally::Stale => return,
            Tally::Counted => None,
            Tally::Done(result) => Some(result.map_err(PushFailed::Refused)),
        };
        p.acks_at = p.acks_at.max(at);
        if let Some(result) = done {
            p.result = Some(result);
            let at = p.acks_at;
            self.at(at, Ev::AckArrive(w, help));
        }
    }

    /// Worker `w`'s message `ev` to shard `s` got no answer (`loss`), and its client machine
    /// decides what comes of it, as `WorkerClient` does: a refused one is asked again after the
    /// pause; a lost one waits for the shard to move (sent again by [`moved`](Self::moved)), and
    /// once the wait the machine allows is over it is sent again
    /// ([`wait_over`](Self::wait_over)). A worker whose machine gives up fails the run: its
    /// shard neither moved nor served again within the move wait.
    pub(super) fn lost(&mut self, w: u32, s: u32, ev: Ev, loss: Loss) -> Result<(), SimError> {
        match self.workers[w as usize].client.after_loss(self.now, s as usize, loss) {
            Retry::AskAgain { after_ns } => self.at(self.now + 2 * self.net.latency_ns + after_ns, ev),
            Retry::AwaitMove { within_ns } => {
                self.mail.limbo.push((ev, self.now));
                self.at(self.now + within_ns, Ev::WaitOver(w, s));
            }
            Retry::Fail => return Err(SimError::GaveUp { worker: w, shard: s }),
        }
        Ok(())
    }

    /// The wait worker `w`'s client machine allowed for shard `s` to move is over: what it
    /// sent there that is still lost is sent again (and is lost again, or answered, if the
    /// shard's server serves again).
    pub(super) fn wait_over(&mut self, w: u32, s: u32) {
        for ev in self.take_limbo(w, s) {
            self.at(self.now, ev);
        }
    }

    /// Takes worker `w`'s messages to shard `s` out of limbo, in the order they were lost, and
    /// counts the time its pulls and pushes spent there.
    fn take_limbo(&mut self, w: u32, s: u32) -> Vec<Ev> {
        let mine = |ev: &Ev| matches!(ev, Ev::PullArrive(v, x, _) | Ev::PushArrive(v, x, _) | Ev::ToShard(v, x, _) if *x == s && *v == w);
        let (taken, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.mail.limbo).into_iter().partition(|(ev, _)| mine(ev));
        self.mail.limbo = rest;
        let mut lost = Vec::with_capacity(taken.len());
        for (ev, since) in taken {
            if let Ev::PullArrive(..) | Ev::PushArrive(..) = ev {
                self.workers[w as usize].unreachable_ns += self.now.saturating_sub(since);
            }
            lost.push(ev);
        }
        lost
    }

    /// Worker `w`'s process dies: nothing reaches it any more, and the run no longer waits for
    /// it; a peer timeout later, the servers make it leave their shards.
    pub(super) fn kill_worker(&mut self, w: u32) {
        let wk = &mut self.workers[w as usize];
        if std::mem::replace(&mut wk.dead, true) {
            return;
        }
        tracing::debug!(worker = w, t_ns = self.now, "worker killed");
        if !wk.done {
            wk.done = true;
            self.done += 1;
        }
        self.at(self.now + PEER_TIMEOUT_NS, Ev::WorkerLost(w));
    }

    /// The servers' connections to dead worker `w` time out. Each live server does what its
    /// state says, as the cluster's servers do: the worker leaves the shards it joined through
    /// that connection, and every primary there hears it is gone (a promoted shard that still
    /// awaits it lets it go).
    pub(super) fn worker_lost(&mut self, w: u32) -> Result<(), SimError> {
        for x in 0..self.servers.state.len() as u32 {
            if self.servers.dead[x as usize] {
                continue;
            }
            let ended = self.servers.state[x as usize].connection_ended(w, w as usize);
            // The shards this server is primary of now (its state also keeps those promoted
            // away from it while it lived, whose nodes the simulator does not keep).
            let here = |sim: &Self, s: u32| sim.shards.server_of[s as usize] == x && !sim.down(s);
            for (s, ()) in ended.leave {
                if here(self, s) && sim_shard(&self.shards.nodes[s as usize]).is_member(w) {
                    self.shards.nodes[s as usize].leave(self.now, None, w, LeaveReason::TimedOut, &mut Quiet);
                    self.drain(s)?;
                }
            }
            for (s, ()) in ended.lost {
                if here(self, s) {
                    self.shards.nodes[s as usize].lost(self.now, w, LeaveReason::TimedOut, &mut Quiet);
                    self.drain(s)?;
                }
            }
        }
        Ok(())
    }

    /// Worker `w` has joined every shard and tells the coordinator it is ready: it starts once
    /// the start barrier is open, the coordinator machine's as on a cluster
    /// ([`CoordinatorMachine::worker_ready`](syncopate_engine::coordinator::CoordinatorMachine::worker_ready)),
    /// with every worker the barrier held back. (A coordinator that is down or rebuilding would
    /// answer once it is back, with training under way: at once, here.)
    pub(super) fn ready(&mut self, w: u32) -> Result<(), SimError> {
        self.at_barrier.push(w);
        if self.coord.phase != Phase::Up || self.coord.machine.worker_ready(self.now, w) {
            self.release_barrier()?;
        }
        self.drive_coordinator()
    }

    /// The start barrier opened: the workers it held start.
    pub(super) fn release_barrier(&mut self) -> Result<(), SimError> {
        for w in std::mem::take(&mut self.at_barrier) {
            self.start(w)?;
        }
        Ok(())
    }

    /// Worker `w` starts (once).
    fn start(&mut self, w: u32) -> Result<(), SimError> {
        if std::mem::replace(&mut self.workers[w as usize].started, true) || self.workers[w as usize].dead {
            return Ok(());
        }
        self.drive(w)
    }

    /// Feeds worker `w`'s machine an input, then carries out its actions.
    pub(super) fn feed(&mut self, w: u32, input: Input) -> Result<(), SimError> {
        self.workers[w as usize].machine.handle(self.now, input).map_err(|e| SimError::Worker(w, e))?;
        self.drive(w)
    }

    /// Carries out every action worker `w`'s machine has, and sets its timer.
    pub(super) fn drive(&mut self, w: u32) -> Result<(), SimError> {
        let shards = self.shards.nodes.len() as u32;
        while let Some(action) = self.workers[w as usize].machine.poll_action(self.now) {
            match action {
                Action::Pull { iteration } => {
                    let wk = &mut self.workers[w as usize];
                    (wk.replies_at, wk.pulled) = (0, None);
                    wk.client.pull_begun(iteration);
                    for s in 0..shards {
                        let t = self.net.transfer(self.now, w as usize, self.server_node(s), 64);
                        let t = self.reorder(t);
                        self.at(t, Ev::PullArrive(w, s, iteration));
                    }
                }
                Action::Compute(job) => {
                    let wk = &mut self.workers[w as usize];
                    let workload = wk.workload.as_deref_mut().map(|x| x as &mut dyn Workload);
                    let step = wk.bufs.compute(w, &job, workload);
                    wk.machine
                        .handle(self.now, Input::Computed { step, compute_ns: 0 })
                        .map_err(|e| SimError::Worker(w, e))?;
                }
                Action::Push(job) => {
                    let wk = &mut self.workers[w as usize];
                    if self.opts.gradients {
                        wk.bufs.gradient(&job);
                    }
                    let help = job.kind != JobKind::Own;
                    wk.client.push_begun(slot(help), job.iteration);
                    let p = if help { &mut wk.help } else { &mut wk.own };
                    *p = Some(InFlight { job, acks_at: 0, result: None });
                    for s in 0..shards {
                        let bytes = if help { self.shard_bytes(s) } else { self.encode_push(w, s, &job) };
                        let t = self.net.transfer(self.now, w as usize, self.server_node(s), bytes);
                        let t = self.reorder(t);
                        self.at(t, Ev::PushArrive(w, s, help));
                    }
                }
                Action::Handover { shard, handover } => {
                    self.send(w, shard..shard + 1, ToShard::Handover(handover));
                }
                Action::Applied { shard, control, iteration } => {
                    if let Control::SetPushCodec { codec } = control {
                        self.workers[w as usize].encoder.set(shard as usize, codec, iteration);
                    }
                    let msg = ToShard::Applied(Applied { worker: w, control, iteration });
                    self.send(w, shard..shard + 1, msg);
                }
                Action::Finished(report) => self.send(w, 0..shards, ToShard::Finished(report)),
                Action::Skip { to, .. } => self.send(w, 0..shards, ToShard::Skip(to)),
                Action::Waiting { iteration, waiting } => {
                    self.send(w, 0..shards, ToShard::Waiting(iteration, waiting));
                }
                Action::Leave => self.send(w, 0..shards, ToShard::Goodbye),
            }
        }
        let wk = &mut self.workers[w as usize];
        if !wk.done && wk.machine.is_done() {
            wk.done = true;
            self.done += 1;
        }
        if let Some(t) = wk.machine.poll_timeout() {
            if wk.wake_at.is_none_or(|at| t < at) {
                wk.wake_at = Some(t);
                self.at(t.max(self.now), Ev::Wake(w));
            }
        }
        Ok(())
    }

    /// Worker `w` hears that shard `s` moved: it rejoins the new primary (a member, or, if its
    /// join had not reached the backup, anew) and sends again the pulls and pushes that were
    /// lost on the way to the old primary or with it, if it still waits for them (a push
    /// applied twice is a duplicate; a parked pull answers the retried one).
    pub(super) fn moved(&mut self, w: u32, s: u32) -> Result<(), SimError> {
        let (su, wu) = (s as usize, w as usize);
        let to = self.shards.server_of[su];
        self.workers[wu].client.moved(s, to).expect("the simulator moves shards to its own servers");
        if self.workers[wu].absent {
            // A late joiner before its time: it asks where the shards are when it joins.
            return Ok(());
        }
        let node = self.server_node(s);
        // What it sent that was lost on the way to the old primary, or with it.
        let mine = self.take_limbo(w, s);
        let member = sim_shard(&self.shards.nodes[su]).is_member(w);
        if self.workers[wu].machine.is_done() {
            // Its goodbye went to the dead primary. A cluster makes it leave when it closes its
            // connection to the new primary's server, after its goodbye; the simulator, now.
            if member {
                self.shards.nodes[su].leave(self.now, None, w, LeaveReason::TimedOut, &mut Quiet);
                self.drain(s)?;
            }
            return Ok(());
        }
        // Its client machine says whether it must join the shard's new primary (it does at
        // once; a cluster's worker, before its next request there).
        if let Some(ticket) = self.workers[wu].client.rejoin_due(su) {
            let token = self.token(Req::Join { w, s, again: Some(ticket) });
            self.shards.nodes[su].join(self.now, token, w, Vec::new(), &mut Quiet);
            self.drain(s)?;
        }
        // Each lost pull and push is asked again, once, if the worker's client still waits for
        // it there.
        let mut asked = std::collections::BTreeSet::new();
        for ev in mine {
            let wk = &self.workers[wu];
            match ev {
                Ev::ToShard(..) => {
                    let t = self.net.after_latency(self.now, wu, node);
                    self.at(t, ev)
                }
                Ev::PullArrive(_, _, iteration)
                    if wk.client.awaits_pull(su, iteration) && asked.insert(ev) =>
                {
                    let t = self.net.transfer(self.now, wu, node, 64);
                    self.at(t, ev);
                }
                Ev::PushArrive(_, _, help) => {
                    let p = if help { &wk.help } else { &wk.own };
                    let awaited =
                        p.as_ref().is_some_and(|p| wk.client.awaits_push(slot(help), su, p.job.iteration));
                    if awaited && asked.insert(ev) {
                        let t = self.net.transfer(self.now, wu, node, self.shard_bytes(s));
                        self.at(t, ev);
                    }
                }
                _ => {}
            }
        }
        tracing::debug!(worker = w, shard = s, ?asked, t_ns = self.now, "heard the shard moved");
        Ok(())
    }
}
