//! What every policy instance runs in: the store's data and its memory cap, the store itself
//! (fuelled per call by its user), and the helpers that module loading and instances share.

use wasmtime::{Instance, ResourceLimiter, Store, TypedFunc, WasmParams, WasmResults};

use super::{PolicyError, PolicyRuntime};

/// Store data: the memory cap, and whether the instance hit it.
#[derive(Debug)]
pub(crate) struct Sandbox {
    cap: usize,
    /// The size the instance asked to grow to past the cap, if it did.
    pub(crate) denied: Option<usize>,
}

impl ResourceLimiter for Sandbox {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap {
            self.denied = Some(desired);
            return Err(wasmtime::Error::msg("policy memory cap exceeded"));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 10_000)
    }
}

/// A store under the runtime's memory cap. Each call is given its fuel right before it starts.
pub(crate) fn new_store(rt: &PolicyRuntime) -> Store<Sandbox> {
    let sandbox = Sandbox { cap: rt.limits().max_memory_bytes, denied: None };
    let mut store = Store::new(rt.engine(), sandbox);
    store.limiter(|s| s as &mut dyn ResourceLimiter);
    // Instantiation runs the module's start function and data initialisers: one call's worth.
    let _ = store.set_fuel(rt.limits().call_fuel);
    store
}

pub(crate) fn typed<P: WasmParams, R: WasmResults>(
    instance: &Instance,
    store: &mut Store<Sandbox>,
    name: &str,
    export: &str,
) -> Result<TypedFunc<P, R>, PolicyError> {
    instance
        .get_typed_func::<P, R>(&mut *store, export)
        .map_err(|e| PolicyError::Host(format!("{name}: export `{export}`: {e}")))
}

/// The error and its innermost cause, on one line.
pub(crate) fn root_cause(e: &wasmtime::Error) -> String {
    let mut msg = e.to_string();
    if let Some(src) = e.chain().last() {
        let src = src.to_string();
        if src != msg {
            msg = format!("{msg}: {src}");
        }
    }
    msg.split_whitespace().collect::<Vec<_>>().join(" ")
}
