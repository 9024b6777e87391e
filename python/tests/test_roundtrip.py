"""Pushes and pulls through a real cluster: exact values, many tensors, numpy and torch."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import syncopate
from conftest import ClusterFactory


def model() -> list[np.ndarray]:
    """Tensors of several shapes with integer values (exact in float32 arithmetic)."""
    rng = np.random.default_rng(7)
    shapes = [(3, 4), (17,), (5, 5, 5), (1,), (64, 33)]
    return [rng.integers(-50, 50, size=s).astype(np.float32) for s in shapes]


def test_first_pull_is_the_first_joiners_model_and_push_pull_is_exact(
    cluster: ClusterFactory,
) -> None:
    c = cluster(workers=1, servers=2, shards=3, lr=1.0)
    init = model()
    with syncopate.Worker(init, **c.settings, iterations=3) as w:
        assert (w.rank, w.size) == (0, 1)
        assert w.layout == [t.size for t in init]
        out = [np.zeros_like(t) for t in init]
        step = w.pull(out)
        assert step == syncopate.Step(iteration=0, batch=32)
        for o, t in zip(out, init, strict=True):
            np.testing.assert_array_equal(o, t)
        # lr 1, no momentum, one worker: the servers' model moves by exactly -gradient.
        rng = np.random.default_rng(8)
        grads = [rng.integers(-5, 5, size=t.shape).astype(np.float32) for t in init]
        assert w.push(grads, 0, loss=1.5) == 0
        step = w.pull(out, 1)
        assert step is not None and step.iteration == 1
        for o, t, g in zip(out, init, grads, strict=True):
            np.testing.assert_array_equal(o, t - g)
        # Torch tensors, mixed with numpy ones, work the same way and are written in place.
        tout = [torch.zeros(t.shape) for t in init[:2]] + out[2:]
        assert w.push([torch.from_numpy(g) for g in grads]) == 0
        assert w.pull(tout).iteration == 2
        for o, t, g in zip(tout, init, grads, strict=True):
            np.testing.assert_array_equal(np.asarray(o), t - 2 * g)
        assert w.push(grads) == 0
        assert w.pull(out) is None and w.done
        report = w.leave()
    assert report is not None and report["iterations"] == 3
    assert w.leave() is None


def test_async_handles_overlap_and_keep_order(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1, lr=1.0)
    init = [np.arange(1000, dtype=np.float32), np.ones((10, 10), dtype=np.float32)]
    w = syncopate.Worker(init, **c.settings, iterations=2)
    out = [np.zeros_like(t) for t in init]
    h = w.pull_async(out)
    assert h.wait(30) == syncopate.Step(0, 32)
    np.testing.assert_array_equal(out[0], init[0])
    grads = [np.full_like(t, 2.0) for t in init]
    hp = w.push_async(grads)
    hl = w.pull_async(out)  # queued behind the push
    assert hp.wait(30) == 0
    assert hl.wait(30).iteration == 1
    np.testing.assert_array_equal(out[1], init[1] - 2.0)
    w.leave()


def test_a_loop_that_ends_itself_reports_its_time(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1)
    model = np.zeros(10, dtype=np.float32)
    w = syncopate.Worker([model], **c.settings)  # no budget: the script's loop decides
    for _ in range(3):
        assert w.pull([model]) is not None
        time.sleep(0.01)
        w.push([np.ones_like(model)])
    report = w.leave()
    assert report is not None and report["iterations"] == 3
    assert report["elapsed_ns"] >= 30_000_000 and report["compute_ns"] >= 30_000_000, report


def test_bad_tensors_raise_tensor_error(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1)
    init = [np.zeros((4, 4), dtype=np.float32), np.zeros(3, dtype=np.float32)]
    with pytest.raises(syncopate.TensorError, match="float32"):
        syncopate.Worker([np.zeros(3)], **c.settings)
    w = syncopate.Worker(init, **c.settings, iterations=5)
    good = [np.zeros((4, 4), dtype=np.float32), np.zeros(3, dtype=np.float32)]
    with pytest.raises(syncopate.UsageError, match="without a pull"):
        w.push(good)
    bad_cases = [
        ([np.zeros((4, 4)), np.zeros(3, dtype=np.float32)], "float32"),
        ([np.zeros((4, 4), dtype=np.int32), np.zeros(3, dtype=np.float32)], "float32"),
        ([torch.zeros(4, 4, dtype=torch.float64), torch.zeros(3)], "float32"),
        ([np.zeros((4, 8), dtype=np.float32)[:, ::2], np.zeros(3, dtype=np.float32)], "contiguous"),
        ([torch.zeros(4, 8)[:, ::2], torch.zeros(3)], "contiguous"),
        ([np.zeros((4, 4), dtype=np.float32)], "1 tensors given, the model has 2"),
        ([np.zeros(16, dtype=np.float32), np.zeros(4, dtype=np.float32)], "has 4 values"),
        (["not a tensor", np.zeros(3, dtype=np.float32)], "numpy array or a torch tensor"),
    ]
    for tensors, message in bad_cases:
        with pytest.raises(syncopate.TensorError, match=message):
            w.pull(tensors)
    ro = np.zeros((4, 4), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(syncopate.TensorError, match="read-only"):
        w.pull([ro, np.zeros(3, dtype=np.float32)])
    # Nothing above consumed the pull: the loop goes on.
    assert w.pull(good).iteration == 0
    with pytest.raises(syncopate.UsageError, match="before the gradient"):
        w.pull(good)
    with pytest.raises(syncopate.UsageError, match="last pull was for 0"):
        w.push(good, 3)
    with pytest.raises(syncopate.UsageError, match="2\\^40"):
        w.push(good, tokens=2**41)
    w.push(good, loss=0.5, tokens=64)
    w.leave()
    with pytest.raises(syncopate.UsageError, match="left"):
        w.pull(good)


def test_reading_a_worker_while_its_async_pull_is_deferred_does_not_deadlock(
    cluster: ClusterFactory,
) -> None:
    # BSP with two workers: w0's second pull waits for w1's push. Meanwhile the main thread reads
    # w0's properties; the background pull must still see w1's push and return.
    c = cluster(workers=2, servers=1, policy="bsp", lr=1.0)
    init = [np.zeros(16, dtype=np.float32)]
    # Joining waits for the start barrier (both workers): join from two threads.
    with ThreadPoolExecutor(2) as pool:
        j0, j1 = (
            pool.submit(syncopate.Worker, init, **c.settings, id=i, iterations=2) for i in (0, 1)
        )
        w0, w1 = j0.result(60), j1.result(60)
    b0, b1 = [np.zeros(16, dtype=np.float32)], [np.zeros(16, dtype=np.float32)]
    w0.pull(b0)
    w1.pull(b1)
    w0.push([np.ones(16, dtype=np.float32)])
    h = w0.pull_async(b0)
    seen: list[tuple[int, int, bool]] = []
    reader = threading.Thread(target=lambda: seen.append((w0.rank, w0.size, w0.done)), daemon=True)
    reader.start()
    reader.join(5)
    assert seen == [(0, 2, False)], "reading the worker waited for its deferred pull"
    assert not h.done()
    w1.push([np.ones(16, dtype=np.float32)])
    assert h.wait(30).iteration == 1
    np.testing.assert_array_equal(b0[0], -np.ones(16, dtype=np.float32))
    w0.leave()
    w1.leave()


def test_the_tokens_and_loss_a_python_worker_reports_reach_the_policies(
    cluster: ClusterFactory,
) -> None:
    # Issue 53: `push(..., loss=, tokens=)` travel with the push to every shard's policy.
    # decoupled-diloco weighs each pseudo-gradient by its tokens and records those of each outer
    # step (one learner: every push closes one); adacomm records the first loss it heard.
    init = model()
    for policy, metric, want in [
        ("decoupled-diloco:h=1", "decoupled.tokens", 64.0),
        ("adacomm:tau=2,interval_ms=1", "adacomm.f0", 1.5),
    ]:
        c = cluster(workers=1, servers=1, shards=2, lr=1.0, policy=policy)
        with syncopate.Worker(init, **c.settings, iterations=2) as w:
            out = [np.zeros_like(t) for t in init]
            assert w.pull(out) is not None
            w.push([np.ones_like(t) for t in init], loss=1.5, tokens=64)
            assert w.pull(out) is not None
            shards = syncopate.status(c.cluster_file)["servers"][0]["shards"]
            seen = [m["last"] for s in shards for m in s["metrics"] if m["name"] == metric]
            assert seen == [want, want], (policy, shards)
            w.push([np.ones_like(t) for t in init], loss=1.5, tokens=64)


def test_pushes_and_pulls_cross_in_the_policys_codecs_and_stay_exact_on_integers(
    cluster: ClusterFactory,
) -> None:
    # fp16 both ways, chosen by the policy: small integers are exact in fp16, so the servers'
    # model moves by exactly -gradient, through the same client Rust workers use.
    policy = "bsp:push_codec=fp16,pull_codec=fp16"
    c = cluster(workers=1, servers=2, shards=3, lr=1.0, policy=policy)
    init = model()
    with syncopate.Worker(init, **c.settings, iterations=3) as w:
        out = [np.zeros_like(t) for t in init]
        assert w.pull(out) is not None
        rng = np.random.default_rng(9)
        grads = [rng.integers(-5, 5, size=t.shape).astype(np.float32) for t in init]
        for _ in range(2):
            assert w.push(grads) == 0
            assert w.pull(out) is not None
        for o, t, g in zip(out, init, grads, strict=True):
            np.testing.assert_array_equal(o, t - 2 * g)
        report = w.report()
    assert report["controls"] >= 3, report  # each shard's policy told it the push codec
    assert report["codec_owed"] == 0.0
