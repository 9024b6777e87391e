//! The policy runtime: loads policy modules into wasmtime and runs them sandboxed.
//!
//! - [`PolicyRuntime`] owns the wasmtime engine and the sandbox limits: a memory cap and a fuel
//!   budget per call. Both are deterministic: the same module given the same event makes the
//!   same decision, or fails the same way, on a primary, its backup and in the simulator.
//! - [`PolicyModule`] is a validated, compiled module: ABI marker checked, no imports, every
//!   required export present with the right type, its [`ModuleInfo`] read.
//! - [`PolicyInstance`] is one running instance (one per shard): encode an event, copy it into the
//!   guest buffer, call, copy the decisions out. Traps, fuel exhaustion, memory-cap hits and
//!   panics come back as [`PolicyError`]s naming the module and the event.
//!
//! Compiling is CPU-heavy (tens of milliseconds): do it before the hot path, or on a thread of its
//! own (the host's drivers use a blocking-pool task), never on an async reactor.

mod error;
mod instance;
mod module;
mod sandbox;

pub use error::PolicyError;
pub(crate) use instance::describe as describe_event;
pub use instance::{PolicyInstance, PolicyUsage, MEASURE_VALUES_PER_FUEL};
pub use module::{ModuleKind, PolicyModule};
pub use syncopate_policy_sdk::abi::ModuleInfo;

use std::sync::Arc;

/// Limits every policy instance runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxLimits {
    /// Largest linear memory an instance may have, in bytes.
    pub max_memory_bytes: usize,
    /// Fuel one call (one event, or the start, hand-over or export of a policy) may burn before
    /// it is stopped: wasmtime charges about one unit per wasm instruction executed.
    ///
    /// Fuel, not time, so that the limit is deterministic: a call that runs out does so at the
    /// same instruction wherever it runs, and a primary and its backup, fed the same ops, fail
    /// (and fall back) together. A clock-based deadline could trap on one and not the other.
    /// The default, a billion, lets a tight loop run for about 65 ms on our 2-core machine
    /// (the `fuel_exhausted` benchmark in `benches/policy_event.rs`); a built-in policy's event
    /// burns a few hundred to a few thousand.
    pub call_fuel: u64,
}

/// The default fuel budget of one call.
pub const DEFAULT_CALL_FUEL: u64 = 1_000_000_000;

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits { max_memory_bytes: 64 << 20, call_fuel: DEFAULT_CALL_FUEL }
    }
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
}

/// A module's SHA-256 and its compiled code.
type Compiled = ([u8; 32], wasmtime::Module);

/// How many compiled modules a runtime keeps (the oldest goes first).
const COMPILED_KEPT: usize = 16;

impl PolicyRuntime {
    /// A runtime with default limits.
    pub fn new() -> Result<Self, PolicyError> {
        Self::with_limits(SandboxLimits::default())
    }

    /// A runtime with the given limits.
    pub fn with_limits(limits: SandboxLimits) -> Result<Self, PolicyError> {
        let mut config = wasmtime::Config::new();
        config.consume_fuel(true).cranelift_opt_level(wasmtime::OptLevel::Speed).max_wasm_stack(1 << 20);
        // The same bits on every CPU: a primary and its backup may run on different machines
        // and must decide alike. A NaN's bits otherwise follow the CPU (x86 makes 0/0 negative,
        // ARM positive), and relaxed SIMD may fuse or not.
        config.cranelift_nan_canonicalization(true).relaxed_simd_deterministic(true);
        let engine = wasmtime::Engine::new(&config)
            .map_err(|e| PolicyError::Host(format!("cannot create the wasm engine: {e}")))?;
        Ok(PolicyRuntime { engine, limits, compiled: Arc::default() })
    }

    /// The limits instances run under.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
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
}

#[cfg(test)]
mod tests {
    use super::PolicyRuntime;

    /// Issue 51: a policy's floats have the same bits on every CPU. 0/0 makes a NaN whose sign
    /// the CPU picks (x86 sets it, ARM does not); canonicalised, it is 0x7fc00000 (f32) and
    /// 0x7ff8000000000000 (f64) everywhere, so a decision that looks at the bits (a hash, a
    /// comparison of raw values, an exported state) is the same on a primary and its backup.
    #[test]
    fn a_nan_a_policy_makes_has_the_same_bits_on_every_cpu() {
        let rt = PolicyRuntime::new().unwrap();
        let wasm = wat::parse_str(
            r#"(module
                (func (export "div32") (param f32 f32) (result i32)
                    local.get 0 local.get 1 f32.div i32.reinterpret_f32)
                (func (export "div64") (param f64 f64) (result i64)
                    local.get 0 local.get 1 f64.div i64.reinterpret_f64))"#,
        )
        .unwrap();
        let module = wasmtime::Module::new(rt.engine(), wasm).unwrap();
        let mut store = wasmtime::Store::new(rt.engine(), ());
        store.set_fuel(1_000_000).unwrap();
        let instance = wasmtime::Instance::new(&mut store, &module, &[]).unwrap();
        let div32 = instance.get_typed_func::<(f32, f32), i32>(&mut store, "div32").unwrap();
        let div64 = instance.get_typed_func::<(f64, f64), i64>(&mut store, "div64").unwrap();
        assert_eq!(div32.call(&mut store, (0.0, 0.0)).unwrap() as u32, 0x7fc0_0000);
        assert_eq!(div64.call(&mut store, (0.0, 0.0)).unwrap() as u64, 0x7ff8_0000_0000_0000);
        // Numbers are untouched.
        assert_eq!(div32.call(&mut store, (1.0, 4.0)).unwrap() as u32, 0.25f32.to_bits());
    }
}
