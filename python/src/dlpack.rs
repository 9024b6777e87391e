//! Tensors borrowed from Python through DLPack, the exchange protocol numpy (1.22 and later)
//! and torch both speak (`obj.__dlpack__()`), and the only way this extension reads or writes
//! a caller's tensor.
//!
//! Why DLPack: the buffer protocol is not in the stable ABI before Python 3.11 and our wheel
//! is abi3 for 3.10 and later; `rust-numpy` takes numpy arrays only; a DLPack capsule is a
//! plain `PyCapsule` (stable ABI) that torch and numpy produce for their own tensors, which
//! says the dtype, device, shape, strides and (from version 1.0) whether the tensor is
//! read-only, and which keeps the producer's memory alive for as long as we hold it. No
//! address ever comes from Python as an integer.
//!
//! The rules, each checked with the GIL held:
//! - a tensor is borrowed ([`borrow_all`]) only for the length of one copy, with the GIL held
//!   throughout, so Python code (which could free, resize or write the tensor) cannot run
//!   while Rust reads or writes it; calls that wait on the network release the GIL only over
//!   memory of their own (`Staged`, and the session's pull buffer);
//! - every tensor is float32, on the CPU, contiguous (row-major, any shape), aligned;
//! - a tensor written to must not be read-only, and no two tensors written by one call may
//!   share memory (`pull([t, t])` is refused, not two aliasing `&mut`); tensors only read
//!   (a push's, a join's) may, since reading memory twice is sound (one zero gradient buffer
//!   for several tensors);
//! - anything else (no `__dlpack__`, a capsule of another kind, a newer major version) is a
//!   `TensorError` that says what was given.
//!
//! What this does not defend against: Python code that the caller wrote to run *during* a
//! call, in a `__dlpack__` of its own that resizes another tensor of the same call in place
//! (torch's `resize_` moves a storage that an earlier export already described). Exporting is
//! the only Python code a call runs while it holds tensors; such code could as well break the
//! process through `ctypes`.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use crate::TensorError;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack before 1.0 (capsule `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.0 (capsule `dltensor_versioned`), which adds a version and flags.
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const UNVERSIONED: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const FLAG_READ_ONLY: u64 = 1;
const DEVICE_CPU: i32 = 1;
const DEVICE_CUDA: i32 = 2;
const DEVICE_CUDA_HOST: i32 = 3;
const FLOAT: u8 = 2;
/// Dimensions we read from a capsule's shape (a hostile capsule could claim more).
const MAX_DIMS: i32 = 64;

/// One float32 tensor's memory, borrowed while the GIL is held (`'py`): its capsule keeps the
/// producer's tensor alive, and no Python code runs while the slices below are in use.
pub struct Borrowed<'py> {
    _capsule: Bound<'py, PyCapsule>,
    ptr: *mut f32,
    len: usize,
}

impl Borrowed<'_> {
    /// Values in the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The values.
    pub fn read(&self) -> &[f32] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: checked by `borrow_all`: a live (the capsule holds it), aligned, contiguous
        // float32 buffer of `len` values; the GIL is held for as long as `self` lives and we
        // call no Python code while the slice is in use, so nothing frees or writes it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The values, to overwrite (the tensor was borrowed writable).
    pub fn write(&mut self) -> &mut [f32] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as for `read`; `borrow_all(.., writable = true)` checked that the tensor is
        // not read-only and shares no memory with another tensor of the call, and `&mut self`
        // makes this the only slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Which tensor of which call, for errors: formatted only when one is raised, so that a call
/// that goes through allocates no message per tensor.
struct Which<'a>(&'a str, usize);

impl std::fmt::Display for Which<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: tensor {}", self.0, self.1)
    }
}

/// A tensor's description for errors: its type and what `__dlpack__` said.
fn describe(t: &Bound<'_, PyAny>) -> String {
    t.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

/// Calls `t.__dlpack__`, asking for DLPack 1.0 (older producers take no argument).
fn export<'py>(t: &Bound<'py, PyAny>, what: &Which<'_>) -> PyResult<Bound<'py, PyCapsule>> {
    let py = t.py();
    if !t.hasattr("__dlpack__")? {
        return Err(TensorError::new_err(format!(
            "{what}: expected a numpy array or a torch tensor, got {}",
            describe(t)
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match t.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => t.call_method0("__dlpack__").map_err(|e| {
            TensorError::new_err(format!("{what}: the {} cannot be shared: {e}", describe(t)))
        })?,
        Err(e) => {
            return Err(TensorError::new_err(format!("{what}: the {} cannot be shared: {e}", describe(t))))
        }
    };
    capsule.cast_into::<PyCapsule>().map_err(|_| {
        TensorError::new_err(format!("{what}: the {}'s __dlpack__ did not return a capsule", describe(t)))
    })
}

/// The tensor inside a capsule, and whether it is read-only.
fn tensor_of<'c>(capsule: &'c Bound<'_, PyCapsule>, what: &Which<'_>) -> PyResult<(&'c DlTensor, bool)> {
    if let Ok(p) = capsule.pointer_checked(Some(VERSIONED)) {
        // SAFETY: a `dltensor_versioned` capsule holds a `DLManagedTensorVersioned` (the DLPack
        // specification); the capsule, borrowed for `'c`, keeps it alive.
        let m = unsafe { p.cast::<DlManagedTensorVersioned>().as_ref() };
        if m.version.major != 1 {
            return Err(TensorError::new_err(format!(
                "{what}: DLPack {}.{}, this build reads 1.x",
                m.version.major, m.version.minor
            )));
        }
        return Ok((&m.dl_tensor, m.flags & FLAG_READ_ONLY != 0));
    }
    if let Ok(p) = capsule.pointer_checked(Some(UNVERSIONED)) {
        // SAFETY: a `dltensor` capsule holds a `DLManagedTensor` (the DLPack specification).
        let m = unsafe { p.cast::<DlManagedTensor>().as_ref() };
        return Ok((&m.dl_tensor, false));
    }
    Err(TensorError::new_err(format!("{what}: not a DLPack capsule (already consumed?)")))
}

/// Checks one tensor and gives its (address, values, read-only).
fn check(t: &DlTensor, read_only: bool, what: &Which<'_>) -> PyResult<(*mut f32, usize, bool)> {
    let dt = &t.dtype;
    if (dt.code, dt.bits, dt.lanes) != (FLOAT, 32, 1) {
        return Err(TensorError::new_err(format!(
            "{what}: a tensor of DLPack type code {} with {} bits x {}: Syncopate moves float32 \
             values; convert with .float() or .astype(np.float32)",
            dt.code, dt.bits, dt.lanes
        )));
    }
    match t.device.device_type {
        DEVICE_CPU | DEVICE_CUDA_HOST => {}
        DEVICE_CUDA => {
            return Err(TensorError::new_err(format!(
                "{what}: a tensor on cuda:{}: move it to the CPU first (.cpu())",
                t.device.device_id
            )))
        }
        other => {
            return Err(TensorError::new_err(format!(
                "{what}: a tensor on DLPack device {other}, not the CPU"
            )))
        }
    }
    if !(0..=MAX_DIMS).contains(&t.ndim) {
        return Err(TensorError::new_err(format!("{what}: a tensor of {} dimensions", t.ndim)));
    }
    let ndim = t.ndim as usize;
    let shape: &[i64] = match ndim {
        0 => &[],
        // SAFETY: DLPack: `shape` points to `ndim` values, alive with the tensor.
        _ => unsafe { std::slice::from_raw_parts(t.shape, ndim) },
    };
    let mut len: usize = 1;
    for &d in shape {
        let d =
            usize::try_from(d).map_err(|_| TensorError::new_err(format!("{what}: a dimension of {d}")))?;
        len = len.checked_mul(d).ok_or_else(|| TensorError::new_err(format!("{what}: {shape:?} values")))?;
    }
    if !t.strides.is_null() && len > 1 {
        // SAFETY: DLPack: non-null `strides` points to `ndim` values, alive with the tensor.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expect: i64 = 1;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            if d != 1 && s != expect {
                return Err(TensorError::new_err(format!(
                    "{what}: a view of shape {shape:?} with strides {strides:?} is not contiguous; \
                     use .contiguous() or np.ascontiguousarray"
                )));
            }
            expect = expect.saturating_mul(d);
        }
    }
    let addr = (t.data as usize).checked_add(t.byte_offset as usize);
    let ptr = addr.map_or(std::ptr::null_mut(), |a| a as *mut f32);
    if len > 0 && (ptr.is_null() || !ptr.is_aligned()) {
        return Err(TensorError::new_err(format!("{what}: a buffer that is not float32-aligned")));
    }
    if len.checked_mul(4).is_none_or(|b| b > isize::MAX as usize) {
        return Err(TensorError::new_err(format!("{what}: {len} values")));
    }
    Ok((ptr, len, read_only))
}

/// Borrows every tensor of one call (see the module's rules); `writable`: the call writes them.
pub fn borrow_all<'py>(
    tensors: &[Bound<'py, PyAny>],
    writable: bool,
    what: &str,
) -> PyResult<Vec<Borrowed<'py>>> {
    let mut out = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let what = Which(what, i);
        let capsule = export(t, &what)?;
        let (tensor, read_only) = tensor_of(&capsule, &what)?;
        let (ptr, len, read_only) = check(tensor, read_only, &what)?;
        if writable && read_only && len > 0 {
            return Err(TensorError::new_err(format!("{what}: the {} is read-only", describe(t))));
        }
        out.push(Borrowed { _capsule: capsule, ptr, len });
    }
    if !writable {
        return Ok(out);
    }
    let mut spans: Vec<(usize, usize, usize)> = out
        .iter()
        .enumerate()
        .filter(|(_, b)| b.len > 0)
        .map(|(i, b)| (b.ptr as usize, b.ptr as usize + 4 * b.len, i))
        .collect();
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        let (a, b) = (w[0].2.min(w[1].2), w[0].2.max(w[1].2));
        return Err(TensorError::new_err(format!(
            "{what}: tensors {a} and {b} share memory; give each tensor of the model once"
        )));
    }
    Ok(out)
}
