//! One sandboxed policy instance: the per-event call path and its failure classification.

use std::ops::Range;
use syncopate_policy_sdk::abi::{self, exports, Envelope, Handoff, InitArgs, ENVELOPE_LEN, ENVELOPE_LEN_V2};
use syncopate_policy_sdk::guest::Encoder;

use wasmtime::{Memory, Store, Trap, TypedFunc, WasmParams, WasmResults};

use super::sandbox::{new_store, root_cause, typed, Sandbox};
use super::{ModuleKind, PolicyError, PolicyModule};

/// A running policy instance. One per shard; not shared between threads while in use.
pub struct PolicyInstance {
    module: PolicyModule,
    store: Store<Sandbox>,
    memory: Memory,
    buffer: TypedFunc<u32, u32>,
    init: TypedFunc<u32, i64>,
    import: TypedFunc<u32, i64>,
    event: TypedFunc<u32, i64>,
    export: TypedFunc<(), i64>,
    last_panic: TypedFunc<(), i64>,
    buf_ptr: u32,
    buf_cap: u32,
    enc: Encoder,
    fuel: u64,
    /// Fuel the next event's call is charged in advance: the host's measures it answers.
    debt: u64,
    /// The envelope's size for this module's ABI (v2 modules get the first 88 bytes).
    envelope_len: usize,
    /// Events handled and the fuel they burned.
    usage: PolicyUsage,
}

/// What a policy's event calls have cost: how many there were and the fuel they burned
/// (about one unit per wasm instruction, the host's measures charged as
/// [`MEASURE_VALUES_PER_FUEL`] says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyUsage {
    /// Event calls (each push, pull, join, leave, timer... the module decided), failed ones too.
    pub calls: u64,
    /// Fuel they burned (a call that ran out burned its whole budget).
    pub fuel: u64,
}

impl std::ops::Add for PolicyUsage {
    type Output = PolicyUsage;

    fn add(self, o: PolicyUsage) -> PolicyUsage {
        PolicyUsage { calls: self.calls + o.calls, fuel: self.fuel.saturating_add(o.fuel) }
    }
}

impl std::fmt::Debug for PolicyInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyInstance").field("module", &self.module).finish_non_exhaustive()
    }
}

impl PolicyInstance {
    /// Instantiates `module` and creates the policy from `init`. Returns the instance and the
    /// decisions the policy made at start-up (its update mode, timers).
    pub fn new(module: &PolicyModule, init: &InitArgs<'_>) -> Result<(Self, Vec<u8>), PolicyError> {
        let mut inst = Self::instantiate(module, ModuleKind::Shard)?;
        inst.enc.clear();
        inst.enc.push(init);
        let start = inst.create(exports::INIT, "its configuration")?;
        Ok((inst, start))
    }

    /// Instantiates `module` and creates the policy from `init` and the state handed over by the
    /// outgoing policy of a hot swap (or by a checkpoint, on recovery).
    pub fn import(
        module: &PolicyModule,
        init: &InitArgs<'_>,
        handoff: &Handoff<'_>,
    ) -> Result<(Self, Vec<u8>), PolicyError> {
        Self::import_kind(module, init, handoff, ModuleKind::Shard)
    }

    /// Instantiates a cluster policy `module` and creates it from `init` (its `shard`
    /// unused). Returns the instance and its start-up decisions, encoded
    /// ([`syncopate_policy_sdk::cluster::decode_decisions`]).
    pub fn new_cluster(module: &PolicyModule, init: &InitArgs<'_>) -> Result<(Self, Vec<u8>), PolicyError> {
        let mut inst = Self::instantiate(module, ModuleKind::Cluster)?;
        inst.enc.clear();
        inst.enc.push(init);
        let start = inst.create(exports::INIT, "its configuration")?;
        Ok((inst, start))
    }

    /// A cluster policy created from the state an earlier instance exported (a restart).
    pub fn import_cluster(
        module: &PolicyModule,
        init: &InitArgs<'_>,
        handoff: &Handoff<'_>,
    ) -> Result<(Self, Vec<u8>), PolicyError> {
        Self::import_kind(module, init, handoff, ModuleKind::Cluster)
    }

    /// Hands a cluster policy one encoded [`ClusterEnvelope`](syncopate_policy_sdk::cluster::ClusterEnvelope);
    /// returns its encoded decisions. `what` names the event in errors.
    pub fn on_cluster_event(&mut self, bytes: &[u8], what: &str) -> Result<Vec<u8>, PolicyError> {
        self.enc.set(bytes);
        self.write_input()?;
        let f = self.event.clone();
        let packed = self.call(&f, bytes.len() as u32, || what.to_owned())?;
        let range = self.output_range(packed, || what.to_owned())?;
        Ok(self.output(range).to_vec())
    }

    fn import_kind(
        module: &PolicyModule,
        init: &InitArgs<'_>,
        handoff: &Handoff<'_>,
        kind: ModuleKind,
    ) -> Result<(Self, Vec<u8>), PolicyError> {
        let mut inst = Self::instantiate(module, kind)?;
        inst.enc.clear();
        inst.enc.push(init);
        inst.enc.push(handoff);
        let start = inst.create(exports::IMPORT_STATE, "the handed-over state")?;
        Ok((inst, start))
    }

    fn instantiate(module: &PolicyModule, wanted: ModuleKind) -> Result<Self, PolicyError> {
        if module.kind() != wanted {
            return Err(PolicyError::WrongKind {
                policy: module.display_name().to_owned(),
                is: module.kind(),
                wanted,
            });
        }
        let rt = &module.inner.runtime;
        let mut store = new_store(rt);
        let instance =
            module.inner.pre.instantiate(&mut store).map_err(|e| instantiate_error(module, &store, &e))?;
        let name = module.display_name();
        let event = typed(&instance, &mut store, name, exports::EVENT)?;
        let init = typed(&instance, &mut store, name, exports::INIT)?;
        let import = typed(&instance, &mut store, name, exports::IMPORT_STATE)?;
        let buffer = typed(&instance, &mut store, name, exports::BUFFER)?;
        let export = typed(&instance, &mut store, name, exports::EXPORT_STATE)?;
        let last_panic = typed(&instance, &mut store, name, exports::LAST_PANIC)?;
        let memory = instance
            .get_memory(&mut store, exports::MEMORY)
            .ok_or_else(|| PolicyError::Host(format!("{name}: memory export vanished")))?;
        Ok(PolicyInstance {
            module: module.clone(),
            store,
            memory,
            buffer,
            init,
            import,
            event,
            export,
            last_panic,
            buf_ptr: 0,
            buf_cap: 0,
            enc: Encoder::new(),
            fuel: module.inner.runtime.limits().call_fuel,
            debt: 0,
            envelope_len: if module.inner.abi >= 3 { ENVELOPE_LEN } else { ENVELOPE_LEN_V2 },
            usage: PolicyUsage::default(),
        })
    }

    fn create(&mut self, export: &'static str, what: &'static str) -> Result<Vec<u8>, PolicyError> {
        let f = if export == exports::INIT { self.init.clone() } else { self.import.clone() };
        self.write_input()?;
        let len = self.enc.as_slice().len() as u32;
        let packed = self.call(&f, len, || format!("`{export}`"))?;
        let reply = self.output(self.output_range(packed, || format!("`{export}`"))?).to_vec();
        let (result, rest) = postcard::take_from_bytes::<Result<(), String>>(&reply).map_err(|e| {
            PolicyError::BadDecision {
                policy: self.name(),
                event: format!("`{export}`"),
                detail: format!("undecodable reply: {e}"),
            }
        })?;
        match result {
            Ok(()) => Ok(rest.to_vec()),
            Err(reason) => Err(PolicyError::Refused { policy: self.name(), what, reason }),
        }
    }

    /// Handles one event. Returns the encoded decisions, valid until the next call.
    ///
    /// This is the per-event hot path: no allocation once the buffers have grown to size.
    pub fn on_event(&mut self, env: &Envelope) -> Result<&[u8], PolicyError> {
        let len = self.envelope_len;
        self.write_envelope(&env.to_bytes()[..len])?;
        // Called in place rather than through `call`: cloning the `TypedFunc` to satisfy the
        // borrow checker costs two reference-count round trips per event.
        let debt = std::mem::take(&mut self.debt);
        self.refuel(self.fuel.saturating_sub(debt));
        let called = self.event.call(&mut self.store, len as u32);
        // What is left of the budget (the debt counts as burned: the host's work for this call).
        let left = self.store.get_fuel().unwrap_or(0);
        self.usage.calls += 1;
        self.usage.fuel = self.usage.fuel.saturating_add(self.fuel.saturating_sub(left));
        let packed = match called {
            Ok(packed) => packed,
            Err(e) => return Err(self.classify(&e, describe(env))),
        };
        let range = self.output_range(packed, || describe(env))?;
        Ok(self.output(range))
    }

    /// Charges the next event's call `fuel` in advance: the cost of the host's measures that
    /// call answers ([`MEASURE_VALUES_PER_FUEL`] values read per unit). A call charged all its
    /// fuel runs out of fuel, as a module that computed as much itself would.
    pub fn charge(&mut self, fuel: u64) {
        self.debt = self.debt.saturating_add(fuel);
    }

    /// The policy's exported state.
    pub fn export_state(&mut self) -> Result<Vec<u8>, PolicyError> {
        let f = self.export.clone();
        let packed = self.call(&f, (), || "`export_state`".into())?;
        let range = self.output_range(packed, || "`export_state`".into())?;
        Ok(self.output(range).to_vec())
    }

    /// What its event calls have cost so far.
    pub fn usage(&self) -> PolicyUsage {
        self.usage
    }

    /// The module this instance runs.
    pub fn module(&self) -> &PolicyModule {
        &self.module
    }

    fn name(&self) -> String {
        self.module.display_name().to_owned()
    }

    fn write_envelope(&mut self, bytes: &[u8]) -> Result<(), PolicyError> {
        let ptr = self.ensure_buffer(bytes.len())?;
        copy_in(&self.memory, &mut self.store, &self.module, ptr, bytes)
    }

    fn write_input(&mut self) -> Result<(), PolicyError> {
        let ptr = self.ensure_buffer(self.enc.as_slice().len())?;
        copy_in(&self.memory, &mut self.store, &self.module, ptr, self.enc.as_slice())
    }

    /// The guest input buffer's address, asking the guest to grow it when `len` exceeds what it
    /// last gave (it only moves when it grows).
    fn ensure_buffer(&mut self, len: usize) -> Result<usize, PolicyError> {
        let len = len as u32;
        if len > self.buf_cap {
            let f = self.buffer.clone();
            self.buf_ptr = self.call(&f, len, || "`sp_buffer`".into())?;
            self.buf_cap = len;
        }
        Ok(self.buf_ptr as usize)
    }

    /// Checks that a packed `(ptr, len)` reply lies inside guest memory.
    fn output_range(&self, packed: i64, event: impl Fn() -> String) -> Result<Range<usize>, PolicyError> {
        let (ptr, len) = abi::unpack_ptr_len(packed);
        let range = ptr as usize..ptr as usize + len as usize;
        if range.end <= self.memory.data_size(&self.store) {
            Ok(range)
        } else {
            Err(PolicyError::BadDecision {
                policy: self.module.display_name().to_owned(),
                event: event(),
                detail: format!("returned {len} bytes at {ptr:#x}, outside its memory"),
            })
        }
    }

    /// The guest's reply, read in place (valid until the next call).
    fn output(&self, range: Range<usize>) -> &[u8] {
        &self.memory.data(&self.store)[range]
    }

    fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        f: &TypedFunc<P, R>,
        args: P,
        event: impl Fn() -> String,
    ) -> Result<R, PolicyError> {
        self.refuel(self.fuel);
        match f.call(&mut self.store, args) {
            Ok(r) => Ok(r),
            Err(e) => Err(self.classify(&e, event())),
        }
    }

    fn classify(&mut self, e: &wasmtime::Error, event: String) -> PolicyError {
        let policy = self.name();
        if let Some(wanted) = self.store.data_mut().denied.take() {
            let cap = self.module.inner.runtime.limits().max_memory_bytes;
            return PolicyError::MemoryCap { policy, wanted, cap, event };
        }
        match e.downcast_ref::<Trap>() {
            Some(Trap::OutOfFuel) => PolicyError::OutOfFuel { policy, fuel: self.fuel, event },
            Some(Trap::UnreachableCodeReached) => match self.panic_message() {
                Some(message) => PolicyError::Panic { policy, event, message },
                None => {
                    PolicyError::Trap { policy, event, detail: "reached `unreachable` (an abort)".into() }
                }
            },
            Some(trap) => PolicyError::Trap { policy, event, detail: trap.to_string() },
            None => PolicyError::Trap { policy, event, detail: root_cause(e) },
        }
    }

    /// Gives the next call `fuel` to burn.
    fn refuel(&mut self, fuel: u64) {
        // Cannot fail: fuel is enabled on every runtime's engine.
        let _ = self.store.set_fuel(fuel);
    }

    /// The guest's panic message, read from a poisoned instance on a small budget.
    fn panic_message(&mut self) -> Option<String> {
        self.refuel(PANIC_MESSAGE_FUEL);
        let packed = self.last_panic.call(&mut self.store, ()).ok()?;
        let (ptr, len) = abi::unpack_ptr_len(packed);
        let bytes = self.memory.data(&self.store).get(ptr as usize..ptr as usize + len as usize)?;
        let msg = String::from_utf8_lossy(bytes).into_owned();
        (!msg.is_empty()).then_some(msg)
    }
}

/// Copies `bytes` into guest memory at `ptr`, or reports a buffer the guest placed outside it.
fn copy_in(
    memory: &Memory,
    store: &mut Store<Sandbox>,
    module: &PolicyModule,
    ptr: usize,
    bytes: &[u8],
) -> Result<(), PolicyError> {
    match memory.data_mut(store).get_mut(ptr..ptr + bytes.len()) {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        None => Err(PolicyError::BadDecision {
            policy: module.display_name().to_owned(),
            event: "`sp_buffer`".into(),
            detail: format!("returned a buffer at {ptr:#x} outside its memory"),
        }),
    }
}

/// How many tensor values the host's measures read per unit of fuel charged: a unit of fuel is
/// about one wasm instruction, and the host reads (and multiplies and adds) about eight values
/// in the time one instruction takes.
pub const MEASURE_VALUES_PER_FUEL: u64 = 8;

/// Fuel for reading a panic message: a copy of a short string, with room to spare.
const PANIC_MESSAGE_FUEL: u64 = 1_000_000;

fn instantiate_error(module: &PolicyModule, store: &Store<Sandbox>, e: &wasmtime::Error) -> PolicyError {
    let policy = module.display_name().to_owned();
    if let Some(wanted) = store.data().denied {
        return PolicyError::MemoryCap {
            policy,
            wanted,
            cap: module.inner.runtime.limits().max_memory_bytes,
            event: "instantiation".into(),
        };
    }
    PolicyError::Trap { policy, event: "instantiation".into(), detail: root_cause(e) }
}

/// A short description of an event for error messages (only built on the error path).
pub(crate) fn describe(env: &Envelope) -> String {
    use syncopate_policy_sdk::abi::Event;
    match env.event {
        Event::Pull(p) => format!("pull #{} from worker {} at iteration {}", p.id, p.worker, p.iteration),
        Event::Push(p) => format!("push #{} from worker {} for iteration {}", p.id, p.worker, p.iteration),
        Event::WorkerJoined { worker, .. } => format!("worker {worker} joining"),
        Event::WorkerLeft { worker, .. } => format!("worker {worker} leaving"),
        Event::IterationFinished(r) => format!("worker {}'s report of iteration {}", r.worker, r.iteration),
        Event::Timer { timer } => format!("timer {timer}"),
        Event::ControlApplied(a) => {
            format!("worker {} applied {:?} at iteration {}", a.worker, a.control, a.iteration)
        }
        Event::Measured { query, .. } => format!("the answer to measure {query}"),
    }
}
