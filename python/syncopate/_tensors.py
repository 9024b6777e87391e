"""Tensors as the native half takes them: checked ``(address, length)`` pairs of float32 memory.

numpy arrays and CPU torch tensors are accepted as they are, without a copy; anything else (another
dtype, a GPU tensor, a strided view) gets a :class:`TensorError` that says how to fix it. The
caller keeps the objects alive (and untouched) while the native call runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._native import TensorError

Buffers = list[tuple[int, int]]


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch") and hasattr(t, "data_ptr")


def describe(t: Any) -> str:
    """A short description of a tensor for error messages."""
    if isinstance(t, np.ndarray):
        return f"numpy array {t.dtype} {tuple(t.shape)}"
    if _is_torch(t):
        return f"torch tensor {t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def numel(t: Any) -> int:
    """How many values a tensor holds."""
    if isinstance(t, np.ndarray):
        return int(t.size)
    if _is_torch(t):
        return int(t.numel())
    raise TensorError(f"expected a numpy array or a torch tensor, got {describe(t)}")


def buffer(t: Any, *, writable: bool, what: str) -> tuple[int, int]:
    """The (address, length) of one float32 tensor, checked."""
    if isinstance(t, np.ndarray):
        if t.dtype != np.float32:
            raise TensorError(
                f"{what}: {describe(t)}: Syncopate moves float32 values; "
                "convert with .astype(np.float32)"
            )
        if not t.flags.c_contiguous:
            raise TensorError(f"{what}: {describe(t)} is not contiguous; use np.ascontiguousarray")
        if writable and not t.flags.writeable:
            raise TensorError(f"{what}: {describe(t)} is read-only")
        return (int(t.ctypes.data), int(t.size))
    if _is_torch(t):
        import torch

        if t.dtype != torch.float32:
            raise TensorError(
                f"{what}: {describe(t)}: Syncopate moves float32 values; convert with .float()"
            )
        if t.device.type != "cpu":
            raise TensorError(f"{what}: {describe(t)}: move it to the CPU first (.cpu())")
        if not t.is_contiguous():
            raise TensorError(f"{what}: {describe(t)} is not contiguous; use .contiguous()")
        return (int(t.data_ptr()), int(t.numel()))
    raise TensorError(f"{what}: expected a numpy array or a torch tensor, got {describe(t)}")


def buffers(
    tensors: Sequence[Any], layout: Sequence[int] | None, *, writable: bool, what: str
) -> Buffers:
    """Every tensor's buffer, checked against the model's layout (values per tensor)."""
    if isinstance(tensors, (np.ndarray,)) or _is_torch(tensors):
        tensors = [tensors]
    tensors = list(tensors)
    if layout is not None:
        if len(tensors) != len(layout):
            raise TensorError(
                f"{what}: {len(tensors)} tensors given, the model has {len(layout)} "
                "(the tensors the worker joined with)"
            )
    out = []
    for i, t in enumerate(tensors):
        b = buffer(t, writable=writable, what=f"{what}: tensor {i}")
        if layout is not None and b[1] != layout[i]:
            raise TensorError(
                f"{what}: tensor {i} ({describe(t)}) has {b[1]} values, "
                f"the model's tensor {i} has {layout[i]}"
            )
        out.append(b)
    return out
