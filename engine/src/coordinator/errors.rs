//! What a command of the coordinator's machine can come to, beside its [`Answer`]: a
//! [`CommandError`], what a driver gives [`CoordinatorMachine::command_done`]: the server's
//! refusal ([`ServerError`], which crosses the wire as it is), or no answer at all.
//!
//! [`Answer`]: super::Answer
//! [`CoordinatorMachine::command_done`]: super::CoordinatorMachine::command_done

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::shard::RequestError;

/// Items joined by "; ": how an error or a report that lists several reads.
pub fn listed<T: std::fmt::Display>(items: &[T]) -> String {
    items.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// Why a server refuses a command of the coordinator (the server's `ServerReply::Error` on the
/// wire). The variant is the code; text is the account of what lies outside this protocol (a
/// module, the disk, a peer). The wire carries the variant's index (pinned by a test): add
/// variants only at the end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum ServerError {
    /// The module could not be prepared here: it does not compile, or a shard's policy refused
    /// the state handed over.
    #[error("{0}")]
    Prepare(String),
    /// A commit of a swap this server did not prepare.
    #[error("swap {0} was not prepared here")]
    Unprepared(u64),
    /// The commit reached these shards, which refused it.
    #[error("{}", listed(.0))]
    Commit(Vec<ShardFailure>),
    /// A new backup could not be attached.
    #[error("shard {shard}'s backup at {addr}: {reason}")]
    Attach {
        /// The shard.
        shard: u32,
        /// The backup's server.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A promotion of a backup this server does not keep.
    #[error("server {server} keeps no backup of shard {shard}")]
    NoBackup {
        /// The shard.
        shard: u32,
        /// This server.
        server: u32,
    },
    /// The backup refused its promotion.
    #[error("{0}")]
    Promote(RequestError),
    /// A checkpoint could not be written.
    #[error("{0}")]
    Checkpoint(String),
}

/// A shard's refusal of a command ([`ServerError::Commit`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardFailure {
    /// The shard.
    pub shard: u32,
    /// Why.
    pub error: RequestError,
}

impl std::fmt::Display for ShardFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {}: {}", self.shard, self.error)
    }
}

/// Why a command the machine sent was not carried out, as its driver reports it
/// ([`CoordinatorMachine::command_done`](super::CoordinatorMachine::command_done)). The
/// variant is the code; text is the account of what lies outside this protocol (a connection).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CommandError {
    /// The server refused it.
    #[error(transparent)]
    Refused(#[from] ServerError),
    /// The server has no connection to the coordinator, or never registered.
    #[error("server {0} is not connected")]
    NotConnected(u32),
    /// No answer came within the driver's time, in milliseconds.
    #[error("no answer within {0} ms")]
    Unanswered(u64),
    /// The connection failed on the way: its account.
    #[error("{0}")]
    Transport(String),
    /// The server answered with what answers another command.
    #[error("an answer that does not fit the command: {0}")]
    Unexpected(String),
    /// The driver had nothing to send: swap `0`'s module is not there any more.
    #[error("swap {0}'s module is not here")]
    NoModule(u64),
    /// A backup's server that never registered (the driver has no address for it).
    #[error("server {0} is not registered")]
    NotRegistered(u32),
    /// A snapshot, but the coordinator keeps no checkpoint directory.
    #[error("no checkpoint directory is set")]
    NoCheckpointDirectory,
}
