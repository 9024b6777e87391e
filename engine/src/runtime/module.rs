//! A validated, compiled policy module.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use syncopate_policy_sdk::abi::{self, exports, ModuleInfo};
use syncopate_policy_sdk::cluster;
use wasmtime::{ExternType, FuncType, Module, TypedFunc, ValType};

use super::sandbox::{new_store, root_cause, typed, Sandbox};
use super::{PolicyError, PolicyRuntime};

/// A policy module that passed validation and compiled. Cheap to clone; instantiate it with
/// [`PolicyInstance::new`](super::PolicyInstance::new).
#[derive(Clone)]
pub struct PolicyModule {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) runtime: PolicyRuntime,
    pub(crate) pre: wasmtime::InstancePre<Sandbox>,
    pub(crate) module: Module,
    pub(crate) info: ModuleInfo,
    pub(crate) sha256: [u8; 32],
    pub(crate) label: String,
    pub(crate) display: String,
    /// The ABI version the module was built for (2 or 3; 1 for a cluster policy's ABI).
    pub(crate) abi: u32,
    /// A shard policy or a cluster policy.
    pub(crate) kind: ModuleKind,
}

/// What a module is: a shard policy (run by each shard on its pushes and pulls) or a cluster
/// policy (run by the coordinator on the cluster's figures; see
/// [`syncopate_policy_sdk::cluster`]). Each runs only where it belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// Built with `export_policy!`.
    Shard,
    /// Built with `export_cluster_policy!`.
    Cluster,
}

impl fmt::Display for ModuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModuleKind::Shard => "a shard policy",
            ModuleKind::Cluster => "a cluster policy",
        })
    }
}

impl fmt::Debug for PolicyModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyModule")
            .field("name", &self.inner.info.name)
            .field("version", &self.inner.info.version)
            .field("sha256", &self.sha256_hex())
            .finish()
    }
}

const I32: ValType = ValType::I32;
const I64: ValType = ValType::I64;

/// The ABI versions this host loads, newest first, by their marker exports.
const MARKERS: &[(&str, u32, ModuleKind)] = &[
    (abi::ABI_MARKER, abi::ABI_VERSION, ModuleKind::Shard),
    (abi::ABI_MARKER_V2, 2, ModuleKind::Shard),
    (cluster::CLUSTER_ABI_MARKER, cluster::CLUSTER_ABI_VERSION, ModuleKind::Cluster),
];

/// Every other function export (the same in ABI v2 and v3): name, parameter types, result
/// types, and how to say it.
const REQUIRED: &[(&str, &[ValType], &[ValType], &str)] = &[
    (exports::BUFFER, &[I32], &[I32], "a function (i32) -> i32"),
    (exports::INFO, &[], &[I64], "a function () -> i64"),
    (exports::INIT, &[I32], &[I64], "a function (i32) -> i64"),
    (exports::IMPORT_STATE, &[I32], &[I64], "a function (i32) -> i64"),
    (exports::EVENT, &[I32], &[I64], "a function (i32) -> i64"),
    (exports::EXPORT_STATE, &[], &[I64], "a function () -> i64"),
    (exports::LAST_PANIC, &[], &[I64], "a function () -> i64"),
];

impl PolicyModule {
    pub(crate) fn compile(rt: &PolicyRuntime, label: &str, wasm: &[u8]) -> Result<Self, PolicyError> {
        if !wasm.starts_with(b"\0asm") {
            return Err(PolicyError::Invalid {
                label: label.into(),
                reason: "not a WebAssembly module (it does not start with the `\\0asm` header)".into(),
            });
        }
        let sha256: [u8; 32] = Sha256::digest(wasm).into();
        let module = rt.compiled(&sha256, || {
            Module::new(rt.engine(), wasm)
                .map_err(|e| PolicyError::Invalid { label: label.into(), reason: root_cause(&e) })
        })?;
        Self::from_module(rt, label, module, sha256)
    }

    /// Loads a module precompiled by [`PolicyModule::precompiled`] (about 0.15 ms instead of a
    /// full compile). `sha256` is the digest of the original wasm.
    ///
    /// # Safety
    /// `bytes` must come from [`PolicyModule::precompiled`] of this same build of the host:
    /// wasmtime trusts precompiled code (see `wasmtime::Module::deserialize`).
    pub unsafe fn from_precompiled(
        rt: &PolicyRuntime,
        label: &str,
        bytes: &[u8],
        sha256: [u8; 32],
    ) -> Result<Self, PolicyError> {
        // SAFETY: the caller guarantees the bytes came from `precompiled` of this host build.
        let module = unsafe { Module::deserialize(rt.engine(), bytes) }
            .map_err(|e| PolicyError::Invalid { label: label.into(), reason: root_cause(&e) })?;
        Self::from_module(rt, label, module, sha256)
    }

    /// The compiled machine code, for [`PolicyModule::from_precompiled`].
    pub fn precompiled(&self) -> Result<Vec<u8>, PolicyError> {
        self.inner
            .module
            .serialize()
            .map_err(|e| PolicyError::Host(format!("cannot serialize {}: {e}", self.inner.label)))
    }

    fn from_module(
        rt: &PolicyRuntime,
        label: &str,
        module: Module,
        sha256: [u8; 32],
    ) -> Result<Self, PolicyError> {
        let (abi, kind) = validate(label, &module)?;
        let linker = wasmtime::Linker::new(rt.engine());
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| PolicyError::Invalid { label: label.into(), reason: root_cause(&e) })?;
        let info = read_info(rt, label, &pre)?;
        if info.name.is_empty() {
            return Err(PolicyError::Invalid {
                label: label.into(),
                reason: "the policy's name is empty".into(),
            });
        }
        let what = if kind == ModuleKind::Cluster { "cluster policy" } else { "policy" };
        let display = format!("{what} `{}` {} ({})", info.name, info.version, &hex(&sha256)[..12]);
        Ok(PolicyModule {
            inner: Arc::new(Inner {
                runtime: rt.clone(),
                pre,
                module,
                info,
                sha256,
                label: label.into(),
                display,
                abi,
                kind,
            }),
        })
    }

    /// The ABI version the module was built for: 3, or 2 for a module built by an earlier SDK
    /// (it is sent ABI v2's envelopes and cannot ask for measures).
    pub fn abi(&self) -> u32 {
        self.inner.abi
    }

    /// A shard policy or a cluster policy.
    pub fn kind(&self) -> ModuleKind {
        self.inner.kind
    }

    /// Name, version, description and parameters, as the module declares them.
    pub fn info(&self) -> &ModuleInfo {
        &self.inner.info
    }

    /// SHA-256 of the module's wasm bytes.
    pub fn sha256(&self) -> [u8; 32] {
        self.inner.sha256
    }

    /// SHA-256 of the module's wasm bytes, in hex.
    pub fn sha256_hex(&self) -> String {
        hex(&self.inner.sha256)
    }

    /// The label it was loaded with (a file name, or `builtin:NAME`).
    pub fn label(&self) -> &str {
        &self.inner.label
    }

    /// How errors name this module: `policy `ssp` 0.1.0 (3fa2c1...)`.
    pub fn display_name(&self) -> &str {
        &self.inner.display
    }
}

/// Checks the module contract; returns the ABI version the module declares and its kind.
fn validate(label: &str, module: &Module) -> Result<(u32, ModuleKind), PolicyError> {
    if let Some(import) = module.imports().next() {
        return Err(PolicyError::ForbiddenImport {
            label: label.into(),
            module: import.module().into(),
            name: import.name().into(),
        });
    }
    let Some(&(marker, version, kind)) = MARKERS.iter().find(|(m, ..)| module.get_export(m).is_some()) else {
        let other =
            module.exports().find_map(|e| e.name().strip_prefix(abi::ABI_MARKER_PREFIX).map(str::to_owned));
        return Err(match other {
            Some(found) => PolicyError::WrongAbi { label: label.into(), found },
            None => PolicyError::NotAPolicy { label: label.into() },
        });
    };
    if !matches!(module.get_export(marker), Some(ExternType::Func(f)) if signature_is(&f, &[], &[I32])) {
        return Err(PolicyError::BadExport {
            label: label.into(),
            name: marker,
            expected: "a function () -> i32",
        });
    }
    match module.get_export(exports::MEMORY) {
        Some(ExternType::Memory(m)) if !m.is_64() && !m.is_shared() => {}
        _ => {
            return Err(PolicyError::BadExport {
                label: label.into(),
                name: exports::MEMORY,
                expected: "a 32-bit linear memory",
            })
        }
    }
    for (name, params, results, expected) in REQUIRED {
        let ok = match module.get_export(name) {
            Some(ExternType::Func(f)) => signature_is(&f, params, results),
            _ => false,
        };
        if !ok {
            return Err(PolicyError::BadExport { label: label.into(), name, expected });
        }
    }
    Ok((version, kind))
}

fn signature_is(f: &FuncType, params: &[ValType], results: &[ValType]) -> bool {
    let same = |a: &mut dyn ExactSizeIterator<Item = ValType>, b: &[ValType]| {
        a.len() == b.len() && a.zip(b).all(|(x, y)| ValType::eq(&x, y))
    };
    same(&mut f.params(), params) && same(&mut f.results(), results)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads a module's [`ModuleInfo`] from a throwaway instance.
pub(crate) fn read_info(
    rt: &PolicyRuntime,
    label: &str,
    pre: &wasmtime::InstancePre<Sandbox>,
) -> Result<ModuleInfo, PolicyError> {
    let mut store = new_store(rt);
    let fail = |detail: String| PolicyError::Invalid { label: label.into(), reason: detail };
    let instance = pre.instantiate(&mut store).map_err(|e| {
        if store.data().denied.is_some() {
            fail(format!("its initial memory exceeds the {} byte cap", rt.limits().max_memory_bytes))
        } else {
            fail(format!("cannot instantiate: {}", root_cause(&e)))
        }
    })?;
    let info: TypedFunc<(), i64> = typed(&instance, &mut store, label, exports::INFO)?;
    let packed =
        info.call(&mut store, ()).map_err(|e| fail(format!("`sp_info` failed: {}", root_cause(&e))))?;
    let (ptr, len) = abi::unpack_ptr_len(packed);
    let memory = instance.get_memory(&mut store, exports::MEMORY).ok_or_else(|| fail("no memory".into()))?;
    let bytes = memory
        .data(&store)
        .get(ptr as usize..ptr as usize + len as usize)
        .ok_or_else(|| fail("`sp_info` returned a buffer outside its memory".into()))?;
    postcard::from_bytes(bytes).map_err(|e| fail(format!("`sp_info` returned undecodable info: {e}")))
}
