"""Fashion-MNIST from its IDX files (gzipped or not), as float32 tensors in [0, 1]: the same
files the Rust workloads read (scripts/setup.sh installs Debian's dataset-fashion-mnist)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"


def _read(path: Path) -> bytes:
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        with gzip.open(gz, "rb") as f:
            return f.read()
    return path.read_bytes()


def _idx(path: Path) -> np.ndarray:
    raw = _read(path)
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(split: str, data_dir: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 1, 28, 28) float32 in [0, 1] and labels (N,) int64 of ``train`` or ``test``."""
    d = Path(data_dir or os.environ.get("SYNCOPATE_DATA") or DEFAULT_DIR)
    prefix = "train" if split == "train" else "t10k"
    images = _idx(d / f"{prefix}-images-idx3-ubyte")
    labels = _idx(d / f"{prefix}-labels-idx1-ubyte")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))
