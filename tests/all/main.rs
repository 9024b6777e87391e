//! The integration-test binary: one binary (so wasmtime links once), a module per topic. Every
//! test loads real wasm modules built from `policies/` and `tests/hostile-policy`.

mod cli;
mod harness;
mod oracles;
mod sandbox;
mod swap;
