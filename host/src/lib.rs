//! # Syncopate host
//!
//! The native side of the Syncopate parameter server:
//! - [`runtime`]: loads policy modules into wasmtime and runs them sandboxed;
//! - [`shard`]: the sans-IO shard engine (parameters, optimizer, clocks, pending requests) that
//!   consults a policy on every event;
//! - [`builtin`]: the policy modules shipped with Syncopate, built from `policies/` at build time;
//! - [`cli`]: the `syncopate` command.

pub mod builtin;
pub mod cli;
pub mod runtime;
pub mod shard;
