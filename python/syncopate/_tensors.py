"""Tensors as the native half takes them: numpy arrays and CPU torch tensors of float32.

The native half reads and writes a tensor only through DLPack (``__dlpack__``), with the GIL
held, and checks everything again there (dtype, device, contiguity, read-only, tensors sharing
memory); the checks here come first so that the common mistakes get a message that says how to
fix them. Nothing here hands the native half an address.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._native import TensorError


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


def checked(t: Any, *, writable: bool, what: str) -> Any:
    """One float32 tensor, checked, as the native half takes it (a torch tensor detached from
    autograd, which shares its memory)."""
    if isinstance(t, np.ndarray):
        if t.dtype != np.float32:
            raise TensorError(
                f"{what}: {describe(t)}: Syncopate moves float32 values; "
                "convert with .astype(np.float32)"
            )
        if not t.flags.c_contiguous:
            raise TensorError(f"{what}: {describe(t)} is not contiguous; use np.ascontiguousarray")
        if not t.flags.writeable:
            if writable:
                raise TensorError(f"{what}: {describe(t)} is read-only")
            if np.lib.NumpyVersion(np.__version__) < "2.1.0":
                # Older numpy cannot share a read-only array through DLPack; it is only read.
                return t.copy()
        return t
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
        return t.detach()
    raise TensorError(f"{what}: expected a numpy array or a torch tensor, got {describe(t)}")


def tensors(
    given: Sequence[Any], layout: Sequence[int] | None, *, writable: bool, what: str
) -> list[Any]:
    """Every tensor of a call, checked against the model's layout (values per tensor)."""
    if isinstance(given, np.ndarray) or _is_torch(given):
        given = [given]
    given = list(given)
    if layout is not None and len(given) != len(layout):
        raise TensorError(
            f"{what}: {len(given)} tensors given, the model has {len(layout)} "
            "(the tensors the worker joined with)"
        )
    out = []
    for i, t in enumerate(given):
        c = checked(t, writable=writable, what=f"{what}: tensor {i}")
        n = numel(c)
        if layout is not None and n != layout[i]:
            raise TensorError(
                f"{what}: tensor {i} ({describe(t)}) has {n} values, "
                f"the model's tensor {i} has {layout[i]}"
            )
        out.append(c)
    return out
