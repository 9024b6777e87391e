//! Checkpoint rounds: the coordinator's part of writing the whole model to disk.
//!
//! A round ([`CoordinatorMachine::begin_checkpoint`]) asks each shard's primary, by the map as
//! it stands, to write that shard's snapshot into the round ([`Command::Snapshot`]); once every
//! shard has answered, [`CoordOutput::CheckpointDone`] says whether all were written. Its
//! driver writes the round's manifest only then, so a round on disk without a manifest is one
//! that did not finish, and is never resumed from. What the machine rules out:
//! - **a round missing a shard.** Every shard gets its command; one that fails (its primary
//!   died, or is no longer its primary when the command arrives) abandons the round.
//! - **a round of two policies.** A round does not begin while a hot swap is under way, and a
//!   swap does not begin while a round is ([`SwapError::Checkpointing`](super::SwapError::Checkpointing)), so every shard of a
//!   round runs the policy its manifest names.
//! - **a round over a moving map.** A round does not begin while a failover or a rebuild is
//!   under way (its commands would go to primaries about to change). A server that dies during
//!   a round fails its commands, and the round is abandoned; the next one goes to the new map.
//!
//! Nothing acknowledged is missing from a round taken: each snapshot is its shard's primary's
//! whole state when the command reached it, and a primary acknowledges only what it applied.
//! (It may hold pushes not yet acknowledged, each once: a checkpoint is a state the shard was
//! in.) Two drivers run it: the tokio coordinator (`host/src/coordinator`, which writes the
//! folder, the module and the manifest) and the simulator (`host/src/lab/sim/control.rs`,
//! which keeps each round's snapshots and checks them when the round is taken).

use super::{Command, CommandError, CoordOutput, CoordinatorMachine, Purpose};

/// How a checkpoint round ended.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckpointOutcome {
    /// Every shard's snapshot was written.
    Taken,
    /// These shards' snapshots were not, with why: the round is not usable.
    Abandoned(Vec<(u32, CommandError)>),
}

/// A checkpoint round that cannot begin now (a later one may).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// Another round is under way.
    #[error("checkpoint round {0} is under way")]
    Busy(u64),
    /// A hot swap is under way (a round's shards all run one policy).
    #[error("hot swap {0} is under way")]
    Swapping(u64),
    /// A server is being failed over: the map is about to change.
    #[error("server {0} is being failed over")]
    FailingOver(u32),
    /// A restarted coordinator is rebuilding the cluster.
    #[error("the cluster is being rebuilt after a coordinator restart")]
    Rebuilding,
    /// Not every server has registered yet.
    #[error("only {registered} of {servers} servers are registered")]
    Registering {
        /// Servers registered.
        registered: u32,
        /// Servers the cluster has.
        servers: u32,
    },
    /// No worker has joined, so the shards hold nothing yet.
    #[error("training has not started yet")]
    NotStarted,
}

/// The checkpoint round under way.
#[derive(Debug)]
pub(super) struct CheckpointRound {
    pub(super) round: u64,
    /// Shards whose snapshot was not written, with why.
    pub(super) failed: Vec<(u32, CommandError)>,
}

impl CoordinatorMachine {
    /// Begins checkpoint round [`next_round`](Self::next_round): every shard's primary is told to
    /// write its snapshot ([`Command::Snapshot`]). Returns the round; its end comes out as
    /// [`CoordOutput::CheckpointDone`]. A driver prepares the round's folder before it carries
    /// the commands out, and writes the manifest only once the round is taken.
    pub fn begin_checkpoint(&mut self) -> Result<u64, CheckpointError> {
        if let Some(r) = &self.checkpoint {
            return Err(CheckpointError::Busy(r.round));
        }
        if let Some(round) = &self.swap {
            return Err(CheckpointError::Swapping(round.swap));
        }
        if let Some(server) = self.failing.or_else(|| self.queued.front().copied()) {
            return Err(CheckpointError::FailingOver(server));
        }
        if self.rebuilding.is_some() {
            return Err(CheckpointError::Rebuilding);
        }
        let registered = self.registered();
        if registered < self.cfg.servers {
            return Err(CheckpointError::Registering { registered, servers: self.cfg.servers });
        }
        if self.model_len.is_none() {
            return Err(CheckpointError::NotStarted);
        }
        let round = self.next_round;
        self.next_round += 1;
        self.checkpoint = Some(CheckpointRound { round, failed: Vec::new() });
        for shard in 0..self.cfg.shards {
            let primary = self.places[shard as usize].primary;
            self.send(primary, Command::Snapshot { round, shard }, Purpose::Checkpoint { shard });
        }
        Ok(round)
    }

    /// The number the next checkpoint round will have (rounds count from 1).
    pub fn next_round(&self) -> u64 {
        self.next_round
    }

    /// Sets the next round's number: a driver that finds rounds on disk (a resumed cluster, a
    /// restarted coordinator) goes on past them.
    pub fn set_next_round(&mut self, round: u64) {
        self.next_round = round.max(1);
    }

    /// A shard's snapshot command is done: once all are, the round ends.
    pub(super) fn snapshot_done(&mut self, shard: u32, result: Result<(), CommandError>) {
        if let (Some(r), Err(e)) = (self.checkpoint.as_mut(), result) {
            r.failed.push((shard, e));
        }
        if self.pending.values().any(|p| matches!(p, Purpose::Checkpoint { .. })) {
            return;
        }
        let Some(r) = self.checkpoint.take() else { return };
        let outcome = if r.failed.is_empty() {
            CheckpointOutcome::Taken
        } else {
            CheckpointOutcome::Abandoned(r.failed)
        };
        self.outputs.push_back(CoordOutput::CheckpointDone { round: r.round, outcome });
    }
}
