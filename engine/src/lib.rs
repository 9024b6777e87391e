//! # Syncopate engine
//!
//! Syncopate's protocol logic, with no I/O: no sockets, no clock, no threads, no randomness of
//! its own. Every part takes events (each with the time it happened on its driver's clock) and
//! returns decisions or actions. Drivers own time and I/O: the tokio cluster in the
//! `syncopate` crate, the deterministic simulator, and the tests. This is the split of
//! quinn-proto (pure protocol logic) from quinn (its tokio driver); the compiler keeps it, since
//! this crate depends on neither tokio nor quinn.
//!
//! - [`runtime`]: loads policy modules into wasmtime and runs them sandboxed;
//! - [`shard`]: one shard's parameters, optimizer, clocks and pending requests, consulting its
//!   policy on every event, and a server's protocol for it (`ShardNode`);
//! - [`placement`]: the shard map, and the coordinator's decisions when a server dies;
//! - [`lease`]: the lease rule that keeps a shard from having two primaries, both sides;
//! - [`server`]: a server's own state beside its shards (what it holds at which term, workers
//!   gone, connections by worker), with one owner;
//! - [`coordinator`]: the coordinator as a state machine (server ids and leases, failover and
//!   re-replication, worker admission, two-phase hot swaps);
//! - [`pilot`]: the cluster policy, run by the coordinator on the cluster's figures (the
//!   autopilot is one);
//! - [`tasks`]: split iterations and the exactly-once ledger of tasks moved between workers;
//! - [`worker`]: the worker as a state machine (pull, compute, push, control messages, task
//!   hand-over, the emulated device), its client (route, numbering, what each request waits
//!   for, what to send again after a move) and its join;
//! - [`recording`] and [`replay`]: a shard's policy events recorded, and fed to any module;
//! - [`builtin`]: the policy modules shipped with Syncopate, built from `policies/`.

pub mod builtin;
pub mod codec;
pub mod coordinator;
pub mod lease;
pub mod pilot;
pub mod placement;
pub mod recording;
pub mod replay;
pub mod runtime;
pub mod server;
pub mod shard;
pub mod tasks;
pub mod worker;
