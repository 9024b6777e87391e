//! # Syncopate host
//!
//! The native side of the Syncopate parameter server:
//! - [`runtime`]: loads policy modules into wasmtime and runs them sandboxed;
//! - [`shard`]: the sans-IO shard engine (parameters, optimizer, clocks, pending requests) that
//!   consults a policy on every event;
//! - [`net`]: the QUIC transport, its messages and its TLS set-up;
//! - [`coordinator`], [`server`], [`worker`]: the cluster's roles, one process each;
//! - [`metrics`]: Prometheus `/metrics` on the coordinator and every server;
//! - [`dashboard`]: the coordinator's live web page of the cluster, with hot swaps;
//! - [`http`]: the HTTP sockets those two serve;
//! - [`checkpoint`]: rounds of shard snapshots on disk, written crash-safely, for `--resume`;
//! - [`lab`]: scenarios, local clusters, the simulator, A/B comparisons, run reports and plots;
//! - [`builtin`]: the policy modules shipped with Syncopate, built from `policies/` at build time,
//!   and policy references (`ssp:s=3`, `my.wasm:k=v`) as the command line writes them;
//! - [`authoring`]: `policy new` and `policy build` for policy authors;
//! - [`cli`]: the `syncopate` command.

pub mod authoring;
pub mod builtin;
pub mod checkpoint;
pub mod cli;
pub mod coordinator;
pub mod dashboard;
pub mod http;
pub mod lab;
pub mod metrics;
pub mod net;
mod node;
pub mod operator;
pub mod server;
pub mod worker;

pub use node::{ErrorKind, NodeError};
pub use syncopate_engine::{codec, lease, placement, recording, replay, runtime, shard, tasks};
