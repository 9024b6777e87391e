"""The boundary between Python and Rust is sound: every abuse of a tensor is a clean
``TensorError`` (or ``UsageError``), never a crash, whether the Python half's checks catch it
first or the native half's (which take tensors through DLPack only, with the GIL held)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import syncopate
from conftest import ClusterFactory

N = 64


def model() -> list[np.ndarray]:
    return [np.zeros(N, dtype=np.float32), np.zeros(N, dtype=np.float32)]


def test_pull_push_refuse_aliases_views_and_wrong_dtypes_and_pushes_are_copies(
    cluster: ClusterFactory,
) -> None:
    c = cluster(workers=1, servers=1, lr=1.0)
    w = syncopate.Worker(model(), **c.settings, iterations=3)
    t = np.zeros(N, dtype=np.float32)
    with pytest.raises(syncopate.TensorError, match="tensors 0 and 1 share memory"):
        w.pull([t, t])
    whole = np.zeros(2 * N, dtype=np.float32)
    with pytest.raises(syncopate.TensorError, match="share memory"):
        w.pull([whole[:N], whole[N // 2 : N // 2 + N]])
    x = torch.zeros(N)
    with pytest.raises(syncopate.TensorError, match="share memory"):
        w.pull([x, x.view(8, 8)])
    with pytest.raises(syncopate.TensorError, match="not contiguous"):
        w.pull([torch.zeros(8, 16)[:, ::2], t])
    with pytest.raises(syncopate.TensorError, match="float32"):
        w.pull([np.zeros(N, dtype=np.float64), t])
    # None of that pulled anything: the loop starts as if nothing happened.
    a, b = model()
    assert w.pull([a, b]).iteration == 0

    # An async push copies before it returns: the tensors freed, overwritten and resized at
    # once change nothing that was pushed.
    g = [np.ones(N, dtype=np.float32), torch.ones(N)]
    h = w.push_async(g)
    g[0][:] = 1000.0
    g[1].resize_(1 << 20).fill_(1000.0)
    del g
    gc.collect()
    assert h.wait(30) == 0
    assert w.pull([a, b]).iteration == 1
    np.testing.assert_array_equal(a, -np.ones(N, dtype=np.float32))
    np.testing.assert_array_equal(b, -np.ones(N, dtype=np.float32))
    w.push([np.zeros(N, dtype=np.float32)] * 2)  # read twice: sound, and allowed
    w.leave()


class _NotACapsule:
    """Says it speaks DLPack and does not."""

    def __dlpack__(self, **_: object) -> int:
        return 12345


def test_the_native_half_checks_on_its_own(cluster: ClusterFactory) -> None:
    """Straight to the native session, past the Python half's checks: the same refusals."""
    c = cluster(workers=1, servers=1)
    w = syncopate.Worker(model(), **c.settings, iterations=1)
    native = w._session()
    t = np.zeros(N, dtype=np.float32)
    ro = np.zeros(N, dtype=np.float32)
    ro.flags.writeable = False
    cases = [
        ([t, t], "share memory"),
        ([np.zeros(N, dtype=np.float64), t], "float32"),
        ([np.zeros(2 * N, dtype=np.float32)[::2], t], "not contiguous"),
        ([ro, t], "read-only"),
        ([12345, t], "numpy array or a torch tensor"),
        ([_NotACapsule(), t], "did not return a capsule"),
        ([torch.zeros(N, requires_grad=True), t], "cannot be shared"),
    ]
    for tensors, message in cases:
        with pytest.raises(syncopate.TensorError, match=message):
            native.pull(tensors)
        with pytest.raises(syncopate.TensorError, match=message):
            native.land_part(0, tensors)
    # Landing part of an exchange's pull: nothing exchanged yet, or values outside the model.
    with pytest.raises(syncopate.TensorError, match="no exchange"):
        native.land_part(0, [np.zeros(1, dtype=np.float32)])
    feed = native.feed()  # readies the landing for this model's shards
    for offset in (2 * N - 1, 2**64 - 1):
        with pytest.raises(syncopate.TensorError, match="outside the model"):
            native.land_part(offset, [np.zeros(2, dtype=np.float32)])
    # Inside the model, with the feed dropped unexchanged: nothing lands, and nothing waits.
    del feed
    assert native.land_part(0, [np.zeros(2, dtype=np.float32)]) is False
    assert native.planned() is None
    with pytest.raises(syncopate.TensorError, match="float32"):
        native.stage([np.zeros(N, dtype=np.int32), t])
    staged = native.stage([np.zeros(N, dtype=np.float32), ro])  # read-only is fine to read
    assert w.pull(model()).iteration == 0
    assert native.push(staged, 1, 0.0) == 0
    with pytest.raises(syncopate.UsageError, match="pushed already"):
        native.push(staged, 1, 0.0)
    w.leave()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_get_a_clear_error_until_they_are_staged(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1)
    with pytest.raises(syncopate.TensorError, match="CPU"):
        syncopate.Worker([torch.zeros(N, device="cuda")], **c.settings)
