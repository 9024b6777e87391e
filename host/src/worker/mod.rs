//! The worker role: the client library workloads use ([`client`]) and the training loop that
//! `syncopate worker` runs ([`run`]).

pub mod client;
mod run;

pub use crate::net::tls::ClusterAccess;
pub use client::{PullStats, WorkerClient};
pub use run::{run, WorkerOptions};
pub use syncopate_engine::worker::WorkerReport;
