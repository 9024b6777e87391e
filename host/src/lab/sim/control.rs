//! The simulated control plane: leases and the coordinator.
//!
//! With backups (`replicas = 1`) the simulator runs the cluster's own coordinator machine
//! ([`CoordinatorMachine`]) and both sides of the lease rule ([`crate::lease`]), over the
//! modelled network, as the tokio coordinator and servers do:
//! - every live server asks for a renewal every [`HEARTBEAT_MS`]; the request and its answer
//!   each take the latency, and the server's own lease runs from when it asked;
//! - the coordinator fails a server over when its lease lapses in the machine, and sends the
//!   machine's commands (promote, drop a backup, attach a new one) to the servers, each taking
//!   the latency there and back; a command to a dead server fails;
//! - a partition ([`SimPartition`]) cuts a server's messages to the coordinator, or the
//!   coordinator's to it, or both: lease renewals and their answers are lost (new ones are
//!   sent), commands and their answers wait for the partition to heal, as a connection's
//!   retransmissions make them;
//! - each worker hears where a shard moved after the latency (and, with
//!   [`SimFaults::notice_delay_ns`](super::SimFaults::notice_delay_ns), a drawn delay of its
//!   own), rejoins its new primary and asks it again for every pull and push that was lost.
//!   Until it hears, it addresses the old primary: what it sends meanwhile is lost if that
//!   server is dead, and refused if it lives without a lease; were it accepted, the shard would
//!   have two primaries, which the run records;
//! - a hot swap is the machine's, two-phase: every server not failed over prepares and answers
//!   with its primaries' clocks, then each switches its primaries when its commit arrives,
//!   raising the clocks by the levelling the machine chose.
//!
//! - the coordinator may crash and restart (`rebuild.rs`), and checkpoint rounds are the
//!   machine's too (`checkpoints.rs`);
//! - a dead server may be started again ([`SimRestart`](super::SimRestart)): a new process under
//!   its id, holding nothing, which asks the machine for its id every heartbeat until it is
//!   admitted, then gets backups of the shards that have none;
//! - each server keeps its own state as a cluster's server does ([`ServerState`]): the shards it
//!   holds and their terms (a promotion bumps its shard's), the terms its lease answers told,
//!   the workers whose connection to it ended, and which connection joined each membership.
//!
//! So the failover a simulation shows, timing included, is decided by the code a cluster runs.

use rand::Rng;
use syncopate_engine::coordinator::{
    Answer, CheckpointOutcome, Command, CommandError, CoordOutput, Gathering, Refusal, Replacement,
    ServerError, SwapOutcome,
};
use syncopate_policy_sdk::abi::LeaveReason;

use super::events::Ev;
use super::{server_addr, Cut, Req, Sim, SimError, SimPartition};
use crate::lease::{ServerLease, HEARTBEAT_MS};
use crate::runtime::PolicyModule;
use crate::shard::{ClockRaise, Frontier, Quiet, ShardNode, ShardSnapshot, SwapTo};
use syncopate_engine::pilot::{PilotAction, ShardSample};
use syncopate_engine::server::ServerState;

pub(super) const MS: u64 = 1_000_000;

/// What becomes of a worker's message to a shard when it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arrival {
    /// The shard's primary handles it.
    Primary,
    /// It went to a dead server: lost ([`Loss::Lost`]).
    Lost,
    /// The server it went to has no lease or no longer holds the primary: refused
    /// ([`Loss::Unleased`]).
    Refused,
}

/// Whether the coordinator runs.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Phase {
    /// It runs.
    Up,
    /// It crashed: nothing reaches it.
    Down,
    /// It restarted, and gathers the holdings of the servers that rejoin it.
    Rejoining(Gathering),
    /// It rebuilt the cluster and its commands are under way; servers are answered once done.
    Rebuilding,
}

impl Sim {
    /// Whether the control plane runs (with backups: without, nothing fails over).
    pub(super) fn controlled(&self) -> bool {
        self.opts.run.scenario.replicas > 0
    }

    /// Starts the servers' lease renewals and the coordinator's lease watch.
    pub(super) fn start_control(&mut self) {
        if !self.controlled() {
            return;
        }
        for x in 0..self.servers.dead.len() as u32 {
            self.at(self.now, Ev::Heartbeat(x));
        }
        self.arm_coordinator();
    }

    /// Server `x` dies: from now on what reaches it is lost, and it renews its lease no more.
    pub(super) fn kill(&mut self, x: u32) {
        if !std::mem::replace(&mut self.servers.dead[x as usize], true) {
            tracing::debug!(server = x, t_ns = self.now, "server killed");
            // A deposed primary that dies is no shard's zombie any more: restarted under its
            // id, it is a new process that holds nothing (it refuses a push for a shard it
            // does not have), not the old primary come back.
            for z in self.shards.zombie_of.iter_mut().filter(|z| **z == Some(x)) {
                *z = None;
            }
            if let Some((r, under_way)) =
                self.servers.restarts.iter_mut().find(|(r, on)| r.server == x && !on)
            {
                *under_way = true;
                let at = self.now + r.after_ns;
                self.at(at, Ev::ServerRestart(x));
            }
        }
    }

    /// Dead server `x` starts again, a new process under its id, holding nothing
    /// ([`SimFaults::server_restarts`](super::SimFaults::server_restarts)): refused (and asking
    /// again a heartbeat later) until the coordinator has failed the old one over; then it
    /// takes the id back, renews its lease, and gets backups of the shards that have none.
    fn restart_server(&mut self, x: u32) -> Result<(), SimError> {
        let retry = self.now + HEARTBEAT_MS * MS;
        if !self.servers.dead[x as usize] || !self.controlled() {
            return Ok(());
        }
        if self.coord.phase != Phase::Up {
            self.at(retry, Ev::ServerRestart(x));
            return Ok(());
        }
        match self.coord.machine.replace_server_at(self.now, server_addr(x)) {
            Ok(id) => debug_assert_eq!(id, x, "a restarted server takes the id at its address"),
            Err(Replacement::Refused(Refusal::NotYet { why, .. })) => {
                tracing::debug!(server = x, t_ns = self.now, "restarted server refused for now: {why}");
                self.at(retry, Ev::ServerRestart(x));
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(server = x, t_ns = self.now, "restarted server refused: {e}");
                return Ok(());
            }
        }
        tracing::debug!(server = x, t_ns = self.now, "restarted server takes its id back");
        let xu = x as usize;
        self.servers.dead[xu] = false;
        self.found.restarted += 1;
        self.servers.leases[xu] = ServerLease::new(self.now);
        (self.servers.cut_to[xu], self.servers.cut_from[xu]) = (false, false);
        // A new process: it holds nothing, and the live workers connect to it again (a worker
        // redials a server whose connection ended when its next request goes there).
        self.servers.state[xu] = ServerState::new(self.shards.nodes.len() as u32);
        for w in (0..self.workers.len() as u32).filter(|&w| !self.workers[w as usize].dead) {
            self.servers.state[xu].connected(w, w as usize);
        }
        self.servers.answer_terms[xu].clear();
        // It runs the policy the others run (it was welcomed with it).
        let newest = (0..self.servers.dead.len())
            .filter(|&y| !self.servers.dead[y])
            .max_by_key(|&y| self.servers.committed[y].0);
        self.servers.committed[xu] = newest.map(|y| self.servers.committed[y].clone()).unwrap_or_default();
        self.at(self.now, Ev::Heartbeat(x));
        if let Some(k) = self.servers.restarts.iter().position(|(r, on)| r.server == x && *on) {
            if let Some((y, after_ns)) = self.servers.restarts.remove(k).0.then_kill {
                self.at(self.now + after_ns, Ev::ServerKill(y));
            }
        }
        self.drive_coordinator()
    }

    /// Schedules the coordinator's next lease check, unless one as early is scheduled.
    fn arm_coordinator(&mut self) {
        if let Some(t) = self.coord.machine.poll_timeout() {
            if self.coord.timer_at.is_none_or(|at| t < at || at < self.now) {
                self.coord.timer_at = Some(t);
                self.at(t.max(self.now), Ev::CoordTimer);
            }
        }
    }

    /// Where worker `w`'s message to shard `s` (a push if `push`) lands: at the server its
    /// client machine routes the shard to, which is the shard's primary until the worker hears
    /// that it moved. A dead server loses it. A live server that no longer holds the primary (a
    /// deposed one, or a process restarted under a lost one's id) refuses it, as one without a
    /// lease does; were a deposed primary with a lease to accept a push, the shard would have
    /// two primaries, which is recorded.
    pub(super) fn arrival(&mut self, w: u32, s: u32, push: bool) -> Arrival {
        let su = s as usize;
        let x = self.workers[w as usize].client.server(su);
        if self.servers.dead[x as usize] {
            return Arrival::Lost;
        }
        if self.controlled() && !self.servers.leases[x as usize].valid(self.now) {
            return Arrival::Refused;
        }
        if x != self.shards.server_of[su] {
            if push && self.shards.zombie_of[su] == Some(x) && self.found.two_primaries.is_none() {
                self.found.two_primaries = Some(format!(
                    "at {} ns, server {x} accepted worker {w}'s push for shard {s}, which server {} had \
                     been promoted to",
                    self.now, self.shards.server_of[su]
                ));
            }
            // What the old primary does with it is lost to the run: the worker asks again.
            return Arrival::Refused;
        }
        Arrival::Primary
    }

    /// A partition begins: the server's messages to the coordinator, or the coordinator's to
    /// it, or both, are lost until it heals.
    pub(super) fn cut(&mut self, p: SimPartition) {
        let x = p.server as usize;
        self.servers.cut_to[x] |= matches!(p.cut, Cut::Both | Cut::ToCoordinator);
        self.servers.cut_from[x] |= matches!(p.cut, Cut::Both | Cut::FromCoordinator);
        tracing::debug!(server = p.server, cut = ?p.cut, t_ns = self.now, "partition");
        self.at(self.now + p.heal_after_ns, Ev::Heal(p.server));
    }

    /// Handles a control-plane event (the events this file schedules).
    pub(super) fn control(&mut self, ev: Ev) -> Result<(), SimError> {
        match ev {
            Ev::Heartbeat(x) if !self.servers.dead[x as usize] => {
                if !self.servers.cut_to[x as usize] {
                    self.at(self.now + self.net.latency_ns, Ev::Renew(x, self.now));
                }
                self.at(self.now + HEARTBEAT_MS * MS, Ev::Heartbeat(x));
            }
            Ev::Heartbeat(_) => {}
            // A coordinator down or rebuilding answers no renewal.
            Ev::Renew(..) if self.coord.phase != Phase::Up => {}
            Ev::Renew(x, asked) => {
                let answer = match self.coord.machine.renew(self.now, x) {
                    Ok(()) => {
                        // The answer tells every shard's term.
                        self.servers.answer_terms[x as usize] = self.coord.machine.terms().to_vec();
                        Ev::Renewed(x, asked)
                    }
                    // Told it was failed over, a server stops (its shards have other primaries).
                    Err(_) => Ev::Stop(x),
                };
                if !self.servers.cut_from[x as usize] {
                    self.at(self.now + self.net.latency_ns, answer);
                }
            }
            // What the partition held up goes on its way (the connection retransmits it).
            Ev::Heal(x) => {
                (self.servers.cut_to[x as usize], self.servers.cut_from[x as usize]) = (false, false);
                for ev in std::mem::take(&mut self.servers.held[x as usize]) {
                    self.at(self.now + self.net.latency_ns, ev);
                }
            }
            Ev::Renewed(x, asked) => {
                self.servers.leases[x as usize].renewed(asked);
                self.servers.state[x as usize].renewed(&self.servers.answer_terms[x as usize]);
            }
            Ev::Stop(x) => self.kill(x),
            Ev::CoordTimer => {
                if self.coord.timer_at == Some(self.now) {
                    self.coord.timer_at = None;
                }
                if self.coord.phase == Phase::Up {
                    self.coord.machine.handle_timeout(self.now);
                    self.drive_coordinator()?;
                }
            }
            // A command of a coordinator that crashed before it arrived may have been lost
            // with it (still in its process's buffers): half are.
            Ev::Command(i, ..) if i != self.coord.incarnation && self.rng.random_bool(0.5) => {}
            Ev::Command(i, id, x, command) => {
                let result = match self.servers.dead[x as usize] {
                    // What the coordinator's driver says of a connection that ended.
                    true => Err(CommandError::Transport("connection lost".into())),
                    false => self.carry_out(x, command)?.map_err(CommandError::Refused),
                };
                let answer = match (result, command) {
                    (Ok(()), Command::Prepare { .. }) => {
                        let mut frontier = Frontier::default();
                        for s in (0..self.shards.nodes.len()).filter(|&s| self.shards.server_of[s] == x) {
                            frontier.merge(
                                self.shards.nodes[s].shard().map(|sh| sh.workers()).unwrap_or_default(),
                            );
                        }
                        Ok(Answer::Clocks(frontier.clocks().collect()))
                    }
                    (result, _) => result.map(|()| Answer::Done),
                };
                self.coord.answers.insert((i, id), answer);
                if self.servers.cut_to[x as usize] {
                    self.servers.held[x as usize].push(Ev::CommandDone(i, id));
                } else {
                    self.at(self.now + self.net.latency_ns, Ev::CommandDone(i, id));
                }
            }
            // An answer to a coordinator that crashed since is lost with it.
            Ev::CommandDone(i, id) if i != self.coord.incarnation || self.coord.phase == Phase::Down => {
                self.coord.answers.remove(&(i, id));
            }
            Ev::CommandDone(i, id) => {
                let result =
                    self.coord.answers.remove(&(i, id)).expect("every command delivered is answered");
                self.coord.machine.command_done(id, result);
                self.drive_coordinator()?;
            }
            Ev::Moved(w, s) => self.moved(w, s)?,
            Ev::CoordRestart => self.restart_coordinator()?,
            Ev::Rejoin(x) => self.rejoin(x)?,
            Ev::ServerRestart(x) => self.restart_server(x)?,
            Ev::ServerKill(x) => {
                self.found.killed_after_restart += u64::from(!self.servers.dead[x as usize]);
                self.kill(x)
            }
            Ev::RebuildDue(i) if i == self.coord.incarnation => self.rebuild()?,
            Ev::RebuildDue(_) | Ev::Tick => {}
            _ => unreachable!("not a control-plane event: {ev:?}"),
        }
        Ok(())
    }

    /// Sends a command to server `x`: after the latency, or, while a partition cuts the
    /// coordinator's messages to it, once the partition heals (the connection retransmits it;
    /// simulated partitions are shorter than the peer timeout that would end it).
    fn command_to(&mut self, x: u32, ev: Ev) {
        if self.servers.cut_from[x as usize] {
            self.servers.held[x as usize].push(ev);
        } else {
            self.at(self.now + self.net.latency_ns, ev);
        }
    }

    /// The cluster policy looks at the cluster: every live primary's sample goes to it, and a
    /// swap it asks for begins as an operator's would (its outcome goes back to it when the
    /// swap ends, [`Sim::pilot_swapped`]).
    pub(super) fn pilot(&mut self) -> Result<(), SimError> {
        let now = self.now;
        let due = self.coord.pilot.as_ref().and_then(|p| p.0.due());
        if due.is_none_or(|due| due > now) {
            return Ok(());
        }
        let samples: Vec<_> = (0..self.shards.nodes.len() as u32)
            .filter(|&s| !self.down(s))
            .filter_map(|s| self.shards.nodes[s as usize].shard().map(|sh| ShardSample::of(s, sh)))
            .collect();
        let Some((pilot, rt)) = self.coord.pilot.as_mut() else { return Ok(()) };
        let rt = rt.clone();
        for action in pilot.observe(now, samples) {
            let PilotAction::Swap { policy, config, .. } = action;
            let module = match crate::builtin::wasm(&policy) {
                Some(wasm) => rt.compile(&format!("builtin:{policy}"), wasm).map_err(|e| e.to_string()),
                None => Err(format!("no built-in policy `{policy}`")),
            };
            let begun = match module {
                Ok(module) => {
                    if !self.modules.iter().any(|m| m.sha256() == module.sha256()) {
                        self.modules.push(module.clone());
                    }
                    // Begun if the coordinator numbered it (it may even have ended already).
                    let before = self.coord.swap_modules.len();
                    self.swap(module, config)?;
                    if self.coord.swap_modules.len() > before {
                        Ok(())
                    } else {
                        Err("the coordinator could not begin it (another swap, or no coordinator)"
                            .to_string())
                    }
                }
                Err(e) => Err(e),
            };
            if let (Err(e), Some((pilot, _))) = (begun, self.coord.pilot.as_mut()) {
                pilot.swapped(now, &policy, Err(e));
            }
        }
        self.pilot_next();
        Ok(())
    }

    /// Schedules the cluster policy's next look, if it has one due.
    pub(super) fn pilot_next(&mut self) {
        if let Some(due) = self.coord.pilot.as_ref().and_then(|p| p.0.due()) {
            self.at(due.max(self.now), Ev::Pilot);
        }
    }

    /// Swap `swap` ended: the cluster policy hears how, if it asked for one.
    fn pilot_swapped(&mut self, swap: u64, outcome: &SwapOutcome) {
        let name = self.coord.swap_modules.get(&swap).map(|m| m.0.info().name.clone()).unwrap_or_default();
        let now = self.now;
        let Some((pilot, _)) = self.coord.pilot.as_mut() else { return };
        if pilot.swapping().is_none() {
            return; // not one it asked for
        }
        let result = match outcome {
            SwapOutcome::Committed => Ok(()),
            other => Err(format!("{other:?}")),
        };
        pilot.swapped(now, &name, result);
        self.pilot_next();
    }

    /// A hot swap, begun by the coordinator's machine, two-phase: every server it has not
    /// failed over is asked to prepare the module (a dead one cannot), and only if all can,
    /// each switches its primaries when its commit arrives ([`Sim::commit`]). While another
    /// swap is under way, this one is not begun (the log says so).
    pub(super) fn swap(
        &mut self,
        module: PolicyModule,
        config: Vec<(String, String)>,
    ) -> Result<(), SimError> {
        if self.coord.phase != Phase::Up {
            tracing::debug!(policy = module.label(), t_ns = self.now, "hot swap not begun: no coordinator");
            return Ok(());
        }
        match self.coord.machine.begin_swap() {
            Ok(swap) => {
                tracing::debug!(swap, policy = module.label(), t_ns = self.now, "hot swap begins");
                self.coord.swap_modules.insert(swap, (module.clone(), config.clone()));
                self.coord.swapping = Some((swap, module, config));
                self.drive_coordinator()
            }
            Err(e) => {
                tracing::debug!(policy = module.label(), t_ns = self.now, "hot swap not begun: {e}");
                Ok(())
            }
        }
    }

    /// Server `x` commits a hot swap: each primary it holds switches to `module` (with
    /// `config`, and the run's per-shard overrides), and the op stream carries the switch to
    /// its backup. A shard that refuses the module (its state) says why in the log.
    fn commit(
        &mut self,
        x: u32,
        module: PolicyModule,
        config: Vec<(String, String)>,
        raise: Vec<ClockRaise>,
        swap: u64,
    ) -> Result<(), SimError> {
        for s in 0..self.shards.nodes.len() as u32 {
            if self.shards.server_of[s as usize] != x {
                continue;
            }
            let config = crate::builtin::shard_config(&config, &self.opts.run.overrides, s);
            self.next_token += 1;
            self.requests.insert(self.next_token, Req::Ignore { s });
            let to = SwapTo { module: module.clone(), config, raise: raise.clone(), swap };
            self.shards.nodes[s as usize].swap(self.now, self.next_token, to, &mut Quiet);
            self.drain(s)?;
        }
        Ok(())
    }

    /// Carries out what the coordinator machine decided.
    pub(super) fn drive_coordinator(&mut self) -> Result<(), SimError> {
        while let Some(out) = self.coord.machine.poll_output() {
            match out {
                CoordOutput::Command { id, server, command } => {
                    self.command_to(server, Ev::Command(self.coord.incarnation, id, server, command))
                }
                CoordOutput::Rebuilt => self.rebuilt(),
                CoordOutput::Moved { shard, .. } => {
                    let most = self.opts.faults.notice_delay_ns;
                    for w in 0..self.workers.len() as u32 {
                        let mut delay = if most > 0 { self.rng.random_range(0..=most) } else { 0 };
                        if let Some((_, by)) = self.opts.faults.late_worker.filter(|l| l.0 == w) {
                            delay += by;
                        }
                        self.at(self.now + self.net.latency_ns + delay, Ev::Moved(w, shard));
                    }
                }
                CoordOutput::ServerLost { server } => {
                    tracing::debug!(server, t_ns = self.now, "lease lapsed: failing over");
                    self.servers.lost.push(server);
                }
                CoordOutput::ShardLost { shard, server } => {
                    return Err(SimError::ShardLost { shard, server })
                }
                CoordOutput::NewBackup { shard, primary, backup } => {
                    tracing::debug!(shard, primary, backup, "re-replicated")
                }
                CoordOutput::NoBackupPlace { shard } => tracing::debug!(shard, "no server for a new backup"),
                CoordOutput::FailoverDone { server } => tracing::debug!(server, "failed over"),
                CoordOutput::SwapDone { swap, outcome } => {
                    tracing::debug!(swap, ?outcome, t_ns = self.now, "hot swap done");
                    self.coord.swapping = None;
                    self.found.swaps_ended += 1;
                    self.pilot_swapped(swap, &outcome);
                }
                CoordOutput::CheckpointDone { round, outcome: CheckpointOutcome::Taken } => {
                    self.round_taken(round)?
                }
                CoordOutput::CheckpointDone { round, outcome: CheckpointOutcome::Abandoned(failed) } => {
                    tracing::debug!(round, ?failed, t_ns = self.now, "checkpoint round abandoned");
                    self.found.checkpoints.abandoned += 1;
                }
                CoordOutput::Replicated => {}
                CoordOutput::Started { .. } => self.release_barrier()?,
            }
        }
        self.arm_coordinator();
        Ok(())
    }

    /// Server `x` carries out a coordinator's command; returns whether it could.
    fn carry_out(&mut self, x: u32, command: Command) -> Result<Result<(), ServerError>, SimError> {
        match command {
            Command::Promote { shard } => {
                let Some(gone) = self.promote(shard, x) else {
                    return Ok(Err(ServerError::NoBackup { shard, server: x }));
                };
                self.conform(shard, x);
                // A member whose connection to this server timed out already leaves at once, as
                // the server's state tells its promoted shards.
                for w in gone {
                    self.shards.nodes[shard as usize].lost(self.now, w, LeaveReason::TimedOut, &mut Quiet);
                }
                self.drain(shard)?;
                Ok(Ok(()))
            }
            // A server answers it whether or not it holds the shard's primary.
            Command::DropBackup { shard } => {
                let su = shard as usize;
                if self.shards.server_of[su] == x {
                    (self.shards.backups[su], self.shards.backup_of[su]) = (None, None);
                    self.shards.epoch[su] += 1;
                    self.shards.nodes[su].drop_backup();
                    self.drain(shard)?;
                }
                Ok(Ok(()))
            }
            Command::AttachBackup { shard, backup } => Ok(match self.attach(shard, x, backup)? {
                true => Ok(()),
                false => Err(ServerError::Attach {
                    shard,
                    addr: server_addr(backup),
                    reason: "the shard is not primary here, or its backup's server is dead".into(),
                }),
            }),
            // Every module the run may swap to was compiled before it began; each primary tries
            // the hand-over of its policy's state, as a server does, and one refusal refuses it.
            Command::Prepare { swap } => match self.coord.swapping.clone() {
                Some((n, module, config)) if n == swap => {
                    for s in (0..self.shards.nodes.len() as u32)
                        .filter(|&s| self.shards.server_of[s as usize] == x)
                    {
                        let config = crate::builtin::shard_config(&config, &self.opts.run.overrides, s);
                        if let Err(e) = self.shards.nodes[s as usize].check_swap(self.now, &module, &config) {
                            tracing::debug!(swap, shard = s, t_ns = self.now, "swap refused: {e}");
                            self.found.swaps_refused += 1;
                            return Ok(Err(ServerError::Prepare(format!("shard {s}: {e}"))));
                        }
                    }
                    Ok(Ok(()))
                }
                _ => Ok(Err(ServerError::Prepare(format!("swap {swap} is not under way")))),
            },
            // A server answers it whether or not it prepared the swap.
            Command::Abort { .. } => Ok(Ok(())),
            Command::Snapshot { round, shard } => {
                let su = shard as usize;
                if su >= self.shards.nodes.len() || self.shards.server_of[su] != x {
                    return Ok(Err(ServerError::Checkpoint(format!("shard {shard} is not primary here"))));
                }
                let snap = match self.shards.nodes[su].snapshot(self.now) {
                    Ok(snap) => snap,
                    Err(e) => return Ok(Err(ServerError::Checkpoint(e.to_string()))),
                };
                if let Some(r) = self.coord.rounds.get_mut(&round) {
                    r.written.insert(shard, snap.encode());
                }
                Ok(Ok(()))
            }
            Command::Commit { swap } => match self.coord.swapping.clone() {
                Some((n, module, config)) if n == swap => {
                    let raise = self.coord.machine.levelling(swap).to_vec();
                    if self.coord.phase == Phase::Rebuilding {
                        self.found.rebuild.swaps_finished += 1;
                    }
                    self.servers.committed[x as usize] = (swap, raise.clone());
                    self.commit(x, module, config, raise, swap)?;
                    Ok(Ok(()))
                }
                _ => Ok(Err(ServerError::Unprepared(swap))),
            },
        }
    }

    /// Shard `s`, just promoted on server `x`, takes the policy `x` records (its last committed
    /// swap's), unless it runs that swap or a newer one ([`ShardNode::conform`], as a server
    /// does).
    fn conform(&mut self, s: u32, x: u32) {
        let (n, raise) = self.servers.committed[x as usize].clone();
        let Some((module, config)) = self.coord.swap_modules.get(&n).cloned() else { return };
        let config = crate::builtin::shard_config(&config, &self.opts.run.overrides, s);
        if self.shards.nodes[s as usize].conform(
            self.now,
            SwapTo { module, config, raise, swap: n },
            &mut Quiet,
        ) {
            self.found.conformed += 1;
        }
    }

    /// Shard `s`'s backup on server `b` becomes its primary; the old primary's node goes, and
    /// with it the acknowledgements it held and the requests it had not answered (the workers
    /// ask again when they hear of the move). Returns the workers whose connection to server
    /// `b` ended, which the promoted shard must hear of (`None`: no backup to promote).
    fn promote(&mut self, s: u32, b: u32) -> Option<Vec<u32>> {
        let su = s as usize;
        if self.shards.backup_of[su] != Some(b) {
            return None;
        }
        let mut backup = self.shards.backups[su].take()?;
        backup.promote(&self.servers.state[b as usize].connected_workers());
        let old = self.shards.server_of[su];
        self.shards.zombie_of[su] = (!self.servers.dead[old as usize]).then_some(old);
        // Ops the old primary sent on the stream it had to this node still reach it.
        self.shards.promoted_epoch[su] = Some(self.shards.epoch[su]);
        // The old primary's server still holds it at its term (what it claims if it lives).
        let state = &mut self.servers.state[b as usize];
        state.take_backup(s);
        let gone = state.promoted(s, ());
        self.shards.nodes[su] = backup;
        // The requests the old primary had not answered are lost with it: the workers ask
        // again when they hear of the move.
        let mut lost = Vec::new();
        self.requests.retain(|_, r| match *r {
            Req::Pull { w, s: x, iteration } if x == s => {
                lost.push(Ev::PullArrive(w, s, iteration));
                false
            }
            Req::Push { w, s: x, help, .. } if x == s => {
                lost.push(Ev::PushArrive(w, s, help));
                false
            }
            _ => r.shard() != s,
        });
        let now = self.now;
        self.mail.limbo.extend(lost.into_iter().map(|ev| (ev, now)));
        (self.shards.server_of[su], self.shards.backup_of[su]) = (b, None);
        self.shards.epoch[su] += 1;
        self.shards.timer_at[su] = None;
        self.shards.term[su] += 1;
        self.arm_timer(s);
        Some(gone)
    }

    /// Shard `s`'s primary, on server `primary`, starts streaming to a new backup on server `b`:
    /// it restarts from its own snapshot, which crosses the servers' link to the new backup, and
    /// the ops that follow it on the same link. Returns whether it could.
    fn attach(&mut self, s: u32, primary: u32, b: u32) -> Result<bool, SimError> {
        let su = s as usize;
        if self.shards.server_of[su] != primary || self.servers.dead[b as usize] {
            return Ok(false);
        }
        let (seq, snapshot) = match self.shards.nodes[su].attach_backup(self.now, &mut Quiet) {
            Ok(Some(started)) => started,
            Ok(None) => (0, Vec::new()),
            Err(e) => {
                tracing::warn!(shard = s, "no new backup: {e}");
                return Ok(false);
            }
        };
        let node = &self.shards.nodes[su];
        let backup = if snapshot.is_empty() {
            // No op yet: the primary's first op (the shard's creation) creates the backup too,
            // as on a server (`start_backup` without a snapshot).
            ShardNode::new(self.shards.node_cfgs[su].clone(), node.module().clone(), Vec::new(), true)
        } else {
            let snap = ShardSnapshot::decode(&snapshot).map_err(|e| SimError::Options(e.to_string()))?;
            ShardNode::restore(
                self.shards.node_cfgs[su].clone(),
                node.module().clone(),
                Vec::new(),
                true,
                snap,
                &mut Quiet,
            )
            .map_err(|e| SimError::Options(format!("shard {s}: a new backup cannot start: {e}")))?
        };
        self.shards.backups[su] = Some(backup);
        self.shards.backup_of[su] = Some(b);
        // The new backup's server keeps it at its primary's term, which the stream's opening
        // says.
        self.servers.state[b as usize].hold_backup(s, ());
        self.servers.state[b as usize].stream_opened(s, self.shards.term[su] as u64);
        self.shards.epoch[su] += 1;
        let (from, to) = (self.workers.len() + primary as usize, self.workers.len() + b as usize);
        let t = self.net.transfer(self.now, from, to, snapshot.len() as u64 + 64);
        let epoch = self.shards.epoch[su];
        self.at(t + self.net.latency_ns, Ev::Confirm(s, epoch, seq));
        self.drain(s)?;
        Ok(true)
    }
}
