//! What the simulator checks as a run goes: every shard runs the policy its server records,
//! and a backup that has applied every op of its primary's holds the very same shard, bit for
//! bit. (The other invariants, two primaries and acknowledged updates lost, are checked where
//! the events that could break them happen.)

use super::events::Ev;
use super::{control, sim_shard, Sim, SimError};
use crate::shard::{Shard, ShardNode};

impl Sim {
    /// Where a live primary runs another policy than the coordinator records (the module of the
    /// swap its machine counts last, or of the swap whose commit is under way, for a run that
    /// ended during it), once the coordinator is up.
    pub(super) fn policy_differs(&self) -> Option<String> {
        if self.coord.phase != control::Phase::Up {
            return None;
        }
        let (recorded, _) = self.coord.swap_modules.get(&self.coord.machine.swaps())?;
        // A run that ended during a swap's commit: a shard may have taken it already.
        let committing = self.coord.machine.committing().and_then(|n| self.coord.swap_modules.get(&n));
        for (k, node) in self.shards.nodes.iter().enumerate() {
            if self.servers.dead[self.shards.server_of[k] as usize] {
                continue;
            }
            let sha = node.module().sha256();
            if sha != recorded.sha256() && committing.is_none_or(|(m, _)| sha != m.sha256()) {
                return Some(format!(
                    "shard {k} runs {}, but the coordinator records {} (swap {})",
                    node.module().display_name(),
                    recorded.display_name(),
                    self.coord.machine.swaps()
                ));
            }
        }
        None
    }

    /// Lets the ops still on their way reach the live backups (nothing else happens), then says
    /// where a live backup differs from its primary. The run's time is left where it ended.
    pub(super) fn replicas_differ(&mut self) -> Result<Option<String>, SimError> {
        let end = self.now;
        while let Some((t, ev)) = self.queue.pop() {
            if let Ev::Replicate(..) = ev {
                self.now = t;
                self.handle(ev)?;
            }
        }
        self.now = end;
        for (k, backup) in self.shards.backups.iter_mut().enumerate() {
            let (Some(backup), Some(b)) = (backup.as_mut(), self.shards.backup_of[k]) else { continue };
            if self.servers.dead[b as usize] || self.servers.dead[self.shards.server_of[k] as usize] {
                continue;
            }
            // The whole state, policy included: both snapshots taken at the same time.
            let snap = |n: &mut ShardNode| n.snapshot(end).map(|s| s.encode()).map_err(|e| e.to_string());
            let (ps, qs) = (snap(&mut self.shards.nodes[k]), snap(backup));
            let (p, q) = (sim_shard(&self.shards.nodes[k]), sim_shard(backup));
            if ps != qs && bits_equal(p, q) && p.version() == q.version() && p.workers() == q.workers() {
                return Ok(Some(format!(
                    "shard {k}: its backup on server {b} has the primary's parameters, version and members, \
                     but not its whole state (policy, pending requests or counters)"
                )));
            }
            if !bits_equal(p, q) || p.version() != q.version() || p.workers() != q.workers() {
                return Ok(Some(format!(
                    "shard {k}: its backup on server {b} is at version {} with members {:?}, its primary at {} with {:?}{}",
                    q.version(),
                    q.workers(),
                    p.version(),
                    p.workers(),
                    if bits_equal(p, q) { "" } else { ", and their parameters differ" }
                )));
            }
        }
        Ok(None)
    }
}

/// Whether two shards hold the same parameters, bit for bit.
pub(super) fn bits_equal(p: &Shard, q: &Shard) -> bool {
    p.values().iter().map(|v| v.to_bits()).eq(q.values().iter().map(|v| v.to_bits()))
}
