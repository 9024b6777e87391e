//! The simulated checkpoint rounds ([`SimFaults::checkpoints`](super::SimFaults::checkpoints)):
//! the coordinator's machine begins each; each shard's primary takes its snapshot when the
//! command reaches it (a dead server, or one the shard moved from, cannot); and a round the
//! machine reports taken is checked ([`SimError::Checkpoint`]).

use std::collections::BTreeMap;

use super::control::Phase;
use super::{sim_shard, Sim, SimError};
use crate::shard::ShardSnapshot;

/// A checkpoint round begun: what its shards were when it began, and the snapshots written.
#[derive(Debug, Default)]
pub(super) struct SimRound {
    /// Per shard: its policy module's SHA-256 when the round began.
    pub(super) policies: Vec<[u8; 32]>,
    /// Per shard: the fewest optimizer steps any live copy of it had applied when the round
    /// began (every push acknowledged by then is among them).
    pub(super) floors: Vec<u64>,
    /// The snapshots written, as a server writes them (encoded), by shard.
    pub(super) written: BTreeMap<u32, Vec<u8>>,
}

impl Sim {
    /// A checkpoint round, begun by the coordinator's machine ([`SimFaults::checkpoints`](super::SimFaults::checkpoints)):
    /// each shard's primary is told to take its snapshot. One the machine will not begin now
    /// is counted and skipped, as a cluster's periodic round is.
    pub(super) fn checkpoint(&mut self) -> Result<(), SimError> {
        if !self.controlled() || self.coord.phase != Phase::Up {
            tracing::debug!(t_ns = self.now, "checkpoint round not begun: no coordinator");
            self.found.checkpoints.refused += 1;
            return Ok(());
        }
        match self.coord.machine.begin_checkpoint() {
            Ok(round) => {
                let mut r = SimRound::default();
                for s in 0..self.shards.nodes.len() {
                    let primary = sim_shard(&self.shards.nodes[s]);
                    r.policies.push(primary.policy().sha256());
                    let backup = self.shards.backups[s].as_ref().and_then(|b| b.shard());
                    let backup = backup
                        .filter(|_| self.shards.backup_of[s].is_some_and(|b| !self.servers.dead[b as usize]));
                    r.floors.push(backup.map_or(primary.version(), |b| b.version().min(primary.version())));
                }
                tracing::debug!(round, t_ns = self.now, "checkpoint round begins");
                self.coord.rounds.insert(round, r);
                self.drive_coordinator()
            }
            Err(e) => {
                tracing::debug!(t_ns = self.now, "checkpoint round not begun: {e}");
                self.found.checkpoints.refused += 1;
                Ok(())
            }
        }
    }

    /// The machine says round `round` was taken: it must hold every shard's snapshot, each
    /// decoding to its shard, running the policy its shard ran when the round began, and having
    /// applied at least what every live copy of it had then.
    pub(super) fn round_taken(&mut self, round: u64) -> Result<(), SimError> {
        let bad = |why: String| Err(SimError::Checkpoint { round, why });
        let Some(r) = self.coord.rounds.get(&round) else { return bad("it was never begun".into()) };
        let shards = self.shards.nodes.len() as u32;
        for k in 0..shards {
            let Some(bytes) = r.written.get(&k) else {
                return bad(format!("shard {k}'s snapshot was never written"));
            };
            let snap = match ShardSnapshot::decode(bytes) {
                Ok(snap) => snap,
                Err(e) => return bad(format!("shard {k}'s snapshot does not decode: {e}")),
            };
            if (snap.shard(), snap.shards()) != (k, shards) {
                return bad(format!("shard {k}'s file holds shard {} of {}", snap.shard(), snap.shards()));
            }
            let began = r.policies[k as usize];
            if snap.policy_sha256() != began {
                return bad(format!(
                    "shard {k}'s snapshot runs another policy than the shard ran when the round began \
                     (a swap overlapped the round)"
                ));
            }
            let floor = r.floors[k as usize];
            if snap.version() < floor {
                return bad(format!(
                    "shard {k}'s snapshot has applied {} steps, fewer than every copy had when the round \
                     began ({floor}): acknowledged pushes are missing from it",
                    snap.version()
                ));
            }
        }
        tracing::debug!(round, t_ns = self.now, "checkpoint round taken");
        self.found.checkpoints.taken += 1;
        Ok(())
    }
}
