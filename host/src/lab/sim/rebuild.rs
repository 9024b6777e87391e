//! The simulated coordinator's crash and restart
//! ([`SimFaults::coordinator_crash`](super::SimFaults::coordinator_crash)): the commands and
//! answers on their way to it are lost, renewals go unanswered, so leases lapse and the servers
//! refuse requests. When it restarts, each live server rejoins it (a cut-off one once its
//! partition heals) and says what it holds (from its own state, as a cluster's server does);
//! once all have, or [`REJOIN_WAIT_MS`](syncopate_engine::coordinator::REJOIN_WAIT_MS) after the
//! first, the new machine rebuilds the cluster from those holdings with the engine's gathering
//! and rebuild ([`CoordinatorMachine::rebuild`]), as a restarted cluster coordinator does: stale
//! servers and late ones are told to stop, backups whose primary did not come back are
//! promoted, an interrupted swap is finished. Renewals are answered again once its commands
//! are done, and each worker then gets the map.

use syncopate_engine::coordinator::{
    CoordinatorConfig, CoordinatorMachine, GatherError, Gathered, Gathering, Held,
};

use rand::Rng as _;

use super::control::{Phase, MS};
use super::events::Ev;
use super::{sim_shard, Sim, SimError, PEER_TIMEOUT_NS};
use crate::lease::HEARTBEAT_MS;
use crate::shard::ShardNode;

impl Sim {
    /// The coordinator crashes, and restarts `down_ns` later: what is on its way to it is lost
    /// (answers to its commands by incarnation, renewals by its phase), its lease checks stop.
    pub(super) fn crash_coordinator(&mut self, down_ns: u64) {
        if !self.controlled() {
            return;
        }
        tracing::debug!(t_ns = self.now, down_ns, "coordinator crashed");
        self.coord.phase = Phase::Down;
        // What it recorded at its last promotion (the machine's terms now), if it keeps them.
        self.coord.recorded =
            if self.opts.faults.crash_keeps_terms { self.coord.machine.record() } else { Default::default() };
        self.coord.incarnation += 1;
        self.coord.timer_at = None;
        self.at(self.now + down_ns, Ev::CoordRestart);
        // The workers notice at the peer timeout, or sooner if it is back by then (its new
        // process resets their old connections).
        self.at(self.now + down_ns.min(PEER_TIMEOUT_NS), Ev::CoordinatorAway);
    }

    /// The workers notice the coordinator is away: their client machines wait for lost
    /// servers without end until it is back ([`Sim::rebuilt`]).
    pub(super) fn coordinator_away(&mut self) {
        for wk in self.workers.iter_mut().filter(|wk| !wk.dead) {
            wk.client.coordinator_away();
        }
    }

    /// The coordinator restarts with a machine of its own: the live servers rejoin it, each a
    /// latency and up to a heartbeat later (they retry); one cut off from it, once it heals.
    /// With every server dead, nothing rejoins it: every shard is lost.
    pub(super) fn restart_coordinator(&mut self) -> Result<(), SimError> {
        let sc = &self.opts.run.scenario;
        let cfg = CoordinatorConfig {
            servers: sc.servers,
            shards: self.shards.nodes.len() as u32,
            replicas: sc.replicas,
            max_workers: self.coord.machine.config().max_workers,
            peer_timeout_ms: PEER_TIMEOUT_NS / 1_000_000,
            start: self.coord.machine.config().start,
        };
        self.coord.machine = CoordinatorMachine::new(cfg);
        // Its rounds go on past those begun before (a cluster's coordinator finds their folders).
        self.coord.machine.set_next_round(self.coord.rounds.keys().max().map_or(1, |r| r + 1));
        self.coord.phase = Phase::Rejoining(Gathering::new(self.servers.dead.len() as u32));
        tracing::debug!(t_ns = self.now, "coordinator restarted");
        for x in 0..self.servers.dead.len() as u32 {
            if self.servers.dead[x as usize] {
                continue;
            }
            if self.servers.cut_to[x as usize] || self.servers.cut_from[x as usize] {
                self.servers.held[x as usize].push(Ev::Rejoin(x));
            } else {
                let retry = self.rng.random_range(0..=HEARTBEAT_MS * MS);
                self.at(self.now + self.net.latency_ns + retry, Ev::Rejoin(x));
            }
        }
        self.nobody_left()
    }

    /// While the restarted coordinator waits for its first server, every server is dead: it
    /// will wait for ever, and the shards are lost.
    pub(super) fn nobody_left(&self) -> Result<(), SimError> {
        let waiting = matches!(&self.coord.phase, Phase::Rejoining(g) if g.is_empty());
        match waiting && self.servers.dead.iter().all(|&d| d) {
            true => Err(SimError::ShardLost { shard: 0, server: self.shards.server_of[0] }),
            false => Ok(()),
        }
    }

    /// What server `x` holds, as it tells a restarted coordinator: its primaries at their
    /// terms (and those promoted away from it, at the term it knew), its backups at their
    /// primaries' terms, and its swaps.
    pub(super) fn holdings(&self, x: u32) -> Held {
        let len = |s: usize| sim_shard(&self.shards.nodes[s]).values().len() as u64;
        let state = &self.servers.state[x as usize];
        // Its primaries at the terms its state keeps: those it holds now, and those promoted
        // away from it while it lived.
        let primaries =
            state.primaries().into_iter().map(|(s, ())| (s, state.term(s), len(s as usize))).collect();
        let mut backups = Vec::new();
        for s in 0..self.shards.nodes.len() {
            if self.shards.backup_of[s] == Some(x) && self.shards.backups[s].is_some() {
                backups.push((s as u32, state.term(s as u32), len(s)));
            }
        }
        let (swaps, mut levelled) = self.servers.committed[x as usize].clone();
        // The newest swap a copy here runs (a backup takes its primary's swap from its ops).
        let mut copies = 0;
        for s in 0..self.shards.nodes.len() {
            let copy = match (self.shards.server_of[s] == x, self.shards.backup_of[s] == Some(x)) {
                (true, _) => self.shards.nodes[s].shard(),
                (false, true) => self.shards.backups[s].as_ref().and_then(ShardNode::shard),
                _ => None,
            };
            if let Some((swap, raise)) = copy.map(|c| c.swap()) {
                if swap > copies {
                    copies = swap;
                    if swap > swaps {
                        levelled = raise.to_vec();
                    }
                }
            }
        }
        Held { server: x, swaps, levelled, primaries, backups, known: state.known_terms().to_vec(), copies }
    }

    /// Server `x` rejoins the restarted coordinator, which gathers its holdings as the cluster's
    /// does ([`Gathering`]): once every server has rejoined, or the wait after the first is over,
    /// it rebuilds. One that comes after the rebuild began is refused, and stops.
    pub(super) fn rejoin(&mut self, x: u32) -> Result<(), SimError> {
        if self.servers.dead[x as usize] {
            return self.nobody_left();
        }
        let held = self.holdings(x);
        let gathered = match &mut self.coord.phase {
            Phase::Rejoining(gathering) => gathering.rejoined(self.now, held),
            _ => Err(GatherError::TooLate),
        };
        match gathered {
            Ok(Gathered::Waiting { due_ns, first }) => {
                if first {
                    self.at(due_ns, Ev::RebuildDue(self.coord.incarnation));
                }
                Ok(())
            }
            Ok(Gathered::Complete) => self.rebuild(),
            Err(e) => {
                tracing::debug!(server = x, t_ns = self.now, "rejoin refused, it stops: {e}");
                self.found.rebuild.refused += 1;
                self.at(self.now + self.net.latency_ns, Ev::Stop(x));
                Ok(())
            }
        }
    }

    /// The restarted coordinator rebuilds the cluster from the holdings it gathered. A shard
    /// nobody holds is lost, as on a cluster.
    pub(super) fn rebuild(&mut self) -> Result<(), SimError> {
        let Phase::Rejoining(gathering) = &mut self.coord.phase else { return Ok(()) };
        let Some(rejoined) = gathering.begin() else { return Ok(()) };
        self.coord.phase = Phase::Rebuilding;
        let addrs = rejoined.keys().map(|&x| (x, super::server_addr(x))).collect();
        let held: Vec<Held> = rejoined.into_values().collect();
        let rebuilt = self.coord.machine.rebuild(self.now, &held, &self.coord.recorded, &addrs);
        tracing::debug!(t_ns = self.now, ?rebuilt, "coordinator rebuilt the cluster");
        self.found.rebuild.rebuilds += 1;
        self.found.rebuild.promoted += rebuilt.resolution.promote.len() as u64;
        self.found.rebuild.refused += rebuilt.resolution.stale.len() as u64;
        for &x in rebuilt.resolution.stale.keys() {
            self.at(self.now + self.net.latency_ns, Ev::Stop(x));
        }
        if let Some((&shard, &(newest, held))) = rebuilt.resolution.outdated.iter().next() {
            return Err(SimError::Outdated { shard, newest, held });
        }
        if let Some(shard) = rebuilt.resolution.places.iter().position(Option::is_none) {
            return Err(SimError::ShardLost { shard: shard as u32, server: self.shards.server_of[shard] });
        }
        // A shard whose newest copies all died before the restart resolves to an older one (a
        // server failed over while cut off, which claims it at the term it knew): the
        // coordinator cannot know of a term nobody reports. That copy lacks acknowledged
        // pushes, so the shard's last current copy is lost, as a double fault loses it; a
        // cluster would go on from the stale one (docs/fault-tolerance.md says so).
        // That excuse holds only if the rebuild had nothing better: no copy that came back, and
        // no term a rejoined server heard of or the old coordinator recorded, newer than the
        // copy it chose. Otherwise the rebuild itself chose wrong.
        for (k, place) in rebuilt.resolution.places.iter().enumerate() {
            let Some(place) = place else { continue };
            let copies = |h: &Held| {
                let all = h.primaries.iter().chain(&h.backups);
                all.filter(|c| c.0 as usize == k).map(|c| c.1).collect::<Vec<_>>()
            };
            let chosen =
                held.iter().filter(|h| h.server == place.primary).flat_map(copies).max().unwrap_or(0);
            let heard = held.iter().filter_map(|h| h.known.get(k).copied());
            let newest = held
                .iter()
                .flat_map(copies)
                .chain(heard)
                .chain(self.coord.recorded.terms.get(k).copied())
                .max()
                .unwrap_or(0);
            if newest > chosen {
                return Err(SimError::OlderCopy { shard: k as u32, chosen, newest });
            }
            if chosen != self.shards.term[k] as u64 {
                return Err(SimError::StaleCopy { shard: k as u32, server: place.primary });
            }
        }
        self.drive_coordinator()
    }

    /// The rebuild's commands are done: renewals are answered again, the swap it finished is
    /// over, and every worker gets the map (and joins each shard's primary again).
    pub(super) fn rebuilt(&mut self) {
        self.coord.phase = Phase::Up;
        self.coord.swapping = None;
        let len = self.coord.machine.model_len().unwrap_or(1);
        for w in 0..self.workers.len() as u32 {
            if self.workers[w as usize].dead {
                continue;
            }
            let _ = self.coord.machine.admit_worker(Some(w), len);
            // It is linked to the coordinator again: a wait for a lost server counts from now,
            // and the map it is sent places every shard, as `WorkerClient` takes it (each a
            // move: a rebuild may have promoted a backup on the server the worker addresses).
            self.workers[w as usize].client.coordinator_back(self.now);
            for s in 0..self.shards.nodes.len() as u32 {
                self.at(self.now + self.net.latency_ns, Ev::Moved(w, s));
            }
        }
    }
}
