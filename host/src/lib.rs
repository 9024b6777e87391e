//! # Syncopate host
//!
//! The native side of the Syncopate parameter server:
//! - [`runtime`]: loads policy modules into wasmtime and runs them sandboxed;
//! - [`shard`]: the sans-IO shard engine (parameters, optimizer, clocks, pending requests) that
//!   consults a policy on every event;
//! - [`net`]: the QUIC transport, its messages and its TLS set-up;
//! - [`coordinator`], [`server`], [`worker`]: the cluster's roles, one process each;
//! - [`local`]: a whole cluster on this machine, as separate processes;
//! - [`scenario`], [`ab`]: scenarios as TOML files, and one scenario under several policies with
//!   a comparison report; [`sim`]: the deterministic simulator behind `ab --simulate`;
//! - [`builtin`]: the policy modules shipped with Syncopate, built from `policies/` at build time;
//! - [`cli`]: the `syncopate` command.

pub mod ab;
pub mod cli;
pub mod coordinator;
pub mod local;
pub mod net;
mod node;
pub mod operator;
mod plots;
pub mod scenario;
pub mod server;
pub mod sim;
pub mod worker;

pub use node::NodeError;
pub use syncopate_engine::{builtin, runtime, shard, tasks};
