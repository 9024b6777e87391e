//! The integration-test binary: one binary (so wasmtime links once), a module per topic. Every
//! test loads real wasm modules built from `policies/` and `tests/hostile-policy`.

mod ab;
mod checkpoint;
mod cli;
mod cluster;
mod codecs;
mod dashboard;
mod failover;
mod harness;
mod local_sgd;
mod metrics;
mod net;
mod oracles;
mod partition;
mod pilot;
mod progress;
mod restart;
mod rules;
mod sandbox;
mod signals;
mod sim;
mod swap;
mod tasks;
mod training;
mod vocabulary;
