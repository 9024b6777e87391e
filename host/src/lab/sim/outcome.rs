//! What a simulation reports: the watcher's points as the run goes, the run's report at its end,
//! and the counts of what its faults did ([`Simulated`]).

use super::{sim_shard, Sim};
use crate::lab::report::{RunReport, ServerRecord, StopRules, WatchPoint};
use crate::net::proto::{ShardStatus, WorkerStatus};
use crate::worker::WorkerReport;

/// A finished simulation.
#[derive(Debug)]
pub struct Simulated {
    /// The same report a real run writes (its `model_file` is empty until the model is saved).
    pub report: RunReport,
    /// The final parameters, every shard's in order (one value per shard without gradients).
    pub model: Vec<f32>,
    /// Events handled: a [`SimFailure`](super::SimFailure) can name any of them.
    pub events: u64,
    /// A hash of every event the run's queue delivered, in order, with its time: the same for
    /// every run of the same case, in any process (the determinism test compares it).
    pub trace: u64,
    /// Where a backup differed from its primary: at any point where it had applied every op its
    /// primary had (parameters, version or the clocks' view), or, at the end, once the ops on their way
    /// have reached it (their whole snapshots); `None` when every backup always equalled its
    /// primary.
    pub replicas_differ: Option<String>,
    /// The first time a server accepted a push for a shard after another server had been
    /// promoted to it (two primaries in one term); `None` when that never happened.
    pub two_primaries: Option<String>,
    /// Messages that reached a shard's primary or backup a second time
    /// ([`SimFaults::duplicate`](super::SimFaults::duplicate)).
    pub duplicates: u64,
    /// Bad requests the shards refused ([`SimFaults::bad_inputs`](super::SimFaults::bad_inputs)).
    pub bad_inputs: u64,
    /// What a restarted coordinator's rebuild did ([`SimFaults::coordinator_crash`](super::SimFaults::coordinator_crash)).
    pub rebuild: RebuildCounts,
    /// What became of the checkpoint rounds ([`SimFaults::checkpoints`](super::SimFaults::checkpoints)).
    pub checkpoints: CheckpointCounts,
    /// Servers restarted that took their id back ([`SimFaults::server_restarts`](super::SimFaults::server_restarts)).
    pub restarts: u64,
    /// Servers killed after another's restart ([`SimRestart::then_kill`](super::SimRestart::then_kill)) while the run went on.
    pub killed_after_restart: u64,
    /// Ops from a deposed primary (a stale term) that reached its old backup after that backup
    /// was promoted, each ignored.
    pub stale_ops: u64,
    /// Requests a worker gave up when it stopped that its goodbye overtook: the shard refused
    /// them as a stranger's, and nobody waited for the answer.
    pub late_refusals: u64,
    /// Where, at the end, a live primary ran another policy than the one its coordinator records
    /// (the module of its last committed swap); `None` when every one ran the recorded policy.
    pub policy_differs: Option<String>,
    /// Preparations of a swap a server refused because a shard's state was refused.
    pub swaps_refused: u64,
    /// Hot swaps that ended before the run did (one drawn near its end may not have).
    pub swaps_ended: u64,
    /// The most time a worker's pulls and pushes waited on shards it could not reach (sent to
    /// a dead primary, or lost with it, until the worker heard of the move), added up.
    pub unreachable_ns: u64,
    /// Promoted primaries that switched to the policy their server records (their old primary
    /// died before it streamed a swap's commit).
    pub conformed: u64,
}

/// What became of a run's checkpoint rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointCounts {
    /// Rounds taken (and checked).
    pub taken: u64,
    /// Rounds abandoned: a shard's snapshot could not be written (its primary died, or had
    /// moved, when the command arrived).
    pub abandoned: u64,
    /// Rounds the coordinator would not begin then (a swap, a failover or a rebuild under way,
    /// or it was down).
    pub refused: u64,
}

impl std::ops::AddAssign for CheckpointCounts {
    fn add_assign(&mut self, o: Self) {
        self.taken += o.taken;
        self.abandoned += o.abandoned;
        self.refused += o.refused;
    }
}

/// What restarted coordinators' rebuilds did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebuildCounts {
    /// Rebuilds.
    pub rebuilds: u64,
    /// Backups promoted because their primary did not rejoin.
    pub promoted: u64,
    /// Servers refused: stale (failed over before the crash) or too late to rejoin.
    pub refused: u64,
    /// Servers told to commit a swap that others had committed before the crash.
    pub swaps_finished: u64,
}

impl std::ops::AddAssign for RebuildCounts {
    fn add_assign(&mut self, o: Self) {
        self.rebuilds += o.rebuilds;
        self.promoted += o.promoted;
        self.refused += o.refused;
        self.swaps_finished += o.swaps_finished;
    }
}

impl Sim {
    pub(super) fn stop_rules(&self) -> StopRules {
        self.opts.run.scenario.stop_rules()
    }

    pub(super) fn model(&self) -> Vec<f32> {
        self.shards.nodes.iter().flat_map(|s| sim_shard(s).values().iter().copied()).collect()
    }

    /// Every shard's status, as its primary reports it.
    fn statuses(&self) -> Vec<ShardStatus> {
        self.shards.nodes.iter().enumerate().map(|(i, s)| ShardStatus::of(i as u32, sim_shard(s))).collect()
    }

    pub(super) fn observe(&mut self) {
        let t_s = self.now as f64 / 1e9;
        let score =
            self.score.evaluator.as_ref().filter(|_| self.opts.gradients).map(|e| e.evaluate(&self.model()));
        let status = self.statuses();
        let mut point = WatchPoint::of_shards(t_s, &status.iter().collect::<Vec<_>>());
        point.accuracy = score.map(|s| s.accuracy);
        point.loss = score.map(|s| s.loss);
        point.lost_servers.clone_from(&self.servers.lost);
        let n = self.workers.len();
        point.server_bytes = (0..self.opts.run.scenario.servers as usize)
            .map(|id| {
                let (sent, received) = self.net.bytes(n + id);
                sent + received
            })
            .sum();
        if self.score.time_to_target.is_none() && self.stop_rules().reached(&point) {
            self.score.time_to_target = Some(t_s);
        }
        self.score.watch.push(point);
    }

    pub(super) fn report(mut self) -> RunReport {
        self.observe();
        let n = self.workers.len();
        let shards = self.statuses();
        let staleness = RunReport::staleness_of(shards.iter());
        let servers = (0..self.opts.run.scenario.servers)
            .map(|id| {
                let node = n + id as usize;
                let mine = shards
                    .iter()
                    .filter(|s| self.shards.server_of[s.shard as usize] == id)
                    .cloned()
                    .collect();
                ServerRecord {
                    server: id,
                    shards: mine,
                    bytes_sent: self.net.bytes(node).0,
                    bytes_received: self.net.bytes(node).1,
                    payload_bytes: Vec::new(),
                }
            })
            .collect();
        let model = self.model();
        // The look `observe` took above scored this same final model.
        let last = self.score.watch.last();
        let (final_accuracy, final_loss) = (last.and_then(|p| p.accuracy), last.and_then(|p| p.loss));
        let best = self.score.watch.iter().filter_map(|p| p.accuracy).reduce(f32::max);
        let best_loss = self.score.watch.iter().filter_map(|p| p.loss).reduce(f32::min);
        let members = self
            .workers
            .iter()
            .map(|w| WorkerStatus {
                worker: w.machine.config().id,
                connected: false,
                finished: w.machine.is_done(),
            })
            .collect();
        let workers: Vec<WorkerReport> = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut r = w.machine.report().clone();
                if !w.machine.is_done() {
                    // Still waiting when the run was ended: it ran until then.
                    r.elapsed_ns = self.now;
                }
                (r.bytes_sent, r.bytes_received) = self.net.bytes(i);
                r.codec_owed = w.encoder.owed();
                r
            })
            .collect();
        let phases = crate::lab::report::phases(&self.score.watch);
        // The policy at the end: the one the last committed swap switched to (hot swaps by the
        // run's faults or its cluster policy), as a spec.
        let swaps = self.coord.machine.swaps();
        let policy = match self.coord.swap_modules.get(&swaps) {
            Some((m, config)) if swaps > 0 => {
                crate::builtin::PolicySpec { source: m.info().name.clone(), config: config.clone() }
            }
            _ => self.opts.run.policy.clone(),
        };
        let failovers = crate::lab::report::failovers(&self.score.watch);
        RunReport {
            simulated: true,
            modelled: self.opts.run.scenario.modelled.as_ref().map(|m| m.name.clone()),
            elapsed_s: self.now as f64 / 1e9,
            workers,
            failed_workers: Vec::new(),
            policy: policy.to_string(),
            sha256: shards.first().map(|s| s.sha256.clone()).unwrap_or_default(),
            config: policy.config,
            swaps,
            servers,
            members,
            model_len: model.len(),
            model_version: self.shards.nodes.iter().map(|s| sim_shard(s).version()).min().unwrap_or(0),
            model_file: None,
            started_unix_s: 0.0,
            watch: self.score.watch,
            final_accuracy,
            best_accuracy: best,
            final_loss,
            best_loss,
            time_to_target_s: self.score.time_to_target,
            staleness,
            plots: Vec::new(),
            phases,
            failovers,
            coordinator_restarts: Vec::new(),
            pilot: self.coord.pilot.as_ref().map(|p| p.0.status()),
        }
    }
}
