//! The worker role: the client library workloads use ([`client`]), the training loop that
//! `syncopate worker` runs ([`run`]), and the step-by-step driver a user's own training loop
//! (the Python package) runs ([`session`]).

pub mod client;
mod clock;
pub mod feed;
mod links;
mod run;
pub mod session;

pub use crate::net::tls::ClusterAccess;
pub use client::{PullStats, ShardPulled, WorkerClient};
pub use feed::{FedParts, FeedError, PushFeed};
pub use run::{run, WorkerOptions};
pub use session::{Interrupt, Landing, Session, SessionError, Step};
pub use syncopate_engine::worker::WorkerReport;
