"""Real clusters for the tests: the `syncopate` binary's coordinator and servers as processes on
loopback, with their own certificates and token. Nothing is mocked."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from syncopate.cluster import Cluster, clean_env

__all__ = ["ROOT", "Cluster", "binary", "clean_env", "cluster_at"]

ROOT = Path(__file__).resolve().parents[2]


def binary() -> Path:
    """The `syncopate` executable: $SYNCOPATE_BIN, or cargo's debug build (`cargo build`)."""
    exe = Path(os.environ.get("SYNCOPATE_BIN", ROOT / "target" / "debug" / "syncopate"))
    if not exe.exists():
        pytest.fail(f"{exe} not found: run `cargo build --bin syncopate` (scripts/test.sh does)")
    return exe


def cluster_at(tmp: Path, **kw: object) -> Cluster:
    """A coordinator and servers of :func:`binary`, in ``tmp``."""
    return Cluster(tmp, exe=binary(), **kw)  # type: ignore[arg-type]


ClusterFactory = Callable[..., Cluster]
"""What the ``cluster`` fixture gives: ``cluster(workers=2, policy="ssp:s=1")`` starts one."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Starts clusters (`cluster(workers=2, policy="ssp:s=1")`); all are stopped afterwards."""
    started: list[Cluster] = []

    def start(**kw: object) -> Cluster:
        c = cluster_at(tmp_path / f"cluster-{len(started)}", **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()
