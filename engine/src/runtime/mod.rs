//! The policy runtime: loads policy modules into wasmtime and runs them sandboxed.
//!
//! - [`PolicyRuntime`] owns the wasmtime engine, the sandbox limits and the epoch ticker that
//!   enforces each call's CPU deadline.
//! - [`PolicyModule`] is a validated, compiled module: ABI marker checked, no imports, every
//!   required export present with the right type, its [`ModuleInfo`] read.
//! - [`PolicyInstance`] is one running instance (one per shard): encode an event, copy it into the
//!   guest buffer, call, copy the decisions out. Traps, deadline overruns, memory-cap hits and
//!   panics come back as [`PolicyError`]s naming the module and the event.
//!
//! Compiling is CPU-heavy (tens of milliseconds): do it before the hot path, or on a thread of its
//! own (the host's drivers use a blocking-pool task), never on an async reactor.

mod error;
mod instance;
mod module;

pub use error::PolicyError;
pub(crate) use instance::describe as describe_event;
pub use instance::PolicyInstance;
pub use module::PolicyModule;
pub use syncopate_policy_sdk::abi::ModuleInfo;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Limits every policy instance runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxLimits {
    /// Largest linear memory an instance may have, in bytes.
    pub max_memory_bytes: usize,
    /// CPU time one call (one event) may take before it is interrupted: it is interrupted
    /// once it has used between one and two times this, and never for time spent waiting for
    /// a core (see `new_store` in `instance.rs`).
    pub call_deadline: Duration,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits { max_memory_bytes: 64 << 20, call_deadline: Duration::from_millis(100) }
    }
}

/// How often the epoch ticker advances: a tenth of the call deadline, between 1 and 10 ms. A
/// call's deadline is a whole number of ticks, so it is enforced to within one tick (10%); the
/// default 100 ms deadline ticks every 10 ms. Each tick wakes a thread, which on a small
/// machine is CPU taken from the transfers (1 ms ticks cost each process about 0.5% of a
/// 2-core machine's time during a transport benchmark).
fn epoch_tick(limits: &SandboxLimits) -> Duration {
    (limits.call_deadline / 10).clamp(Duration::from_millis(1), Duration::from_millis(10))
}

/// The wasmtime engine, configured for policy modules, plus the sandbox limits.
#[derive(Clone, Debug)]
pub struct PolicyRuntime {
    engine: wasmtime::Engine,
    limits: SandboxLimits,
    /// Compiled code of the modules compiled lately, by the SHA-256 of their wasm: loading a
    /// module again (every run of `syncopate ab --simulate`, each server's copy of a swap)
    /// skips the compiler, which costs tens of milliseconds.
    compiled: Arc<std::sync::Mutex<Vec<Compiled>>>,
    _ticker: Arc<Ticker>,
}

/// A module's SHA-256 and its compiled code.
type Compiled = ([u8; 32], wasmtime::Module);

/// How many compiled modules a runtime keeps (the oldest goes first).
const COMPILED_KEPT: usize = 16;

#[derive(Debug)]
struct Ticker {
    stop: Arc<AtomicBool>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl PolicyRuntime {
    /// A runtime with default limits.
    pub fn new() -> Result<Self, PolicyError> {
        Self::with_limits(SandboxLimits::default())
    }

    /// A runtime with the given limits.
    pub fn with_limits(limits: SandboxLimits) -> Result<Self, PolicyError> {
        let mut config = wasmtime::Config::new();
        config
            .epoch_interruption(true)
            .cranelift_opt_level(wasmtime::OptLevel::Speed)
            .max_wasm_stack(1 << 20);
        let engine = wasmtime::Engine::new(&config)
            .map_err(|e| PolicyError::Host(format!("cannot create the wasm engine: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let weak = engine.weak();
        let flag = Arc::clone(&stop);
        let tick = epoch_tick(&limits);
        std::thread::Builder::new()
            .name("policy-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    match weak.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .map_err(|e| PolicyError::Host(format!("cannot start the epoch ticker: {e}")))?;
        Ok(PolicyRuntime { engine, limits, compiled: Arc::default(), _ticker: Arc::new(Ticker { stop }) })
    }

    /// The limits instances run under.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
    }

    /// How often the epoch ticker advances.
    pub(crate) fn tick(&self) -> Duration {
        epoch_tick(&self.limits)
    }

    /// Deadline in epoch ticks for one call.
    pub(crate) fn deadline_ticks(&self) -> u64 {
        let tick = self.tick().as_micros() as u64;
        (self.limits.call_deadline.as_micros() as u64 / tick).max(1) + 1
    }

    pub(crate) fn engine(&self) -> &wasmtime::Engine {
        &self.engine
    }

    /// The compiled code of the wasm with this SHA-256, compiling it with `compile` the first
    /// time (and after it was evicted).
    pub(crate) fn compiled(
        &self,
        sha256: &[u8; 32],
        compile: impl FnOnce() -> Result<wasmtime::Module, PolicyError>,
    ) -> Result<wasmtime::Module, PolicyError> {
        let cached = self
            .compiled
            .lock()
            .expect("not poisoned")
            .iter()
            .find(|(k, _)| k == sha256)
            .map(|c| c.1.clone());
        if let Some(m) = cached {
            return Ok(m);
        }
        let module = compile()?;
        let mut kept = self.compiled.lock().expect("not poisoned");
        if kept.len() >= COMPILED_KEPT {
            kept.remove(0);
        }
        kept.push((*sha256, module.clone()));
        Ok(module)
    }

    /// Validates and compiles a module. `label` names it in errors (a file name, say).
    pub fn compile(&self, label: &str, wasm: &[u8]) -> Result<PolicyModule, PolicyError> {
        PolicyModule::compile(self, label, wasm)
    }

    /// Reads and compiles a module file.
    pub fn load_file(&self, path: &std::path::Path) -> Result<PolicyModule, PolicyError> {
        let label = path.display().to_string();
        let wasm = std::fs::read(path).map_err(|e| PolicyError::Invalid {
            label: label.clone(),
            reason: format!("cannot read the file: {e}"),
        })?;
        self.compile(&label, &wasm)
    }
}
