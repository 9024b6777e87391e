"""Syncopate from Python: train numpy and PyTorch models on a Syncopate parameter server.

A training script joins a cluster as one worker. The cluster's policy (BSP, SSP, ASP, ...)
decides when each pull is served and each gradient applied; the script only pulls, computes and
pushes::

    import numpy as np
    import syncopate

    w = syncopate.Worker([weights, bias])          # joins; the first worker's values seed the model
    while (step := w.pull([weights, bias])) is not None:
        gw, gb = compute_gradients(weights, bias, batch_size=step.batch)
        w.push([gw, gb], loss=loss)                 # the servers' optimizer applies it
    w.leave()

PyTorch users wrap their optimizer instead (:mod:`syncopate.torch`).

Where the cluster is comes from the environment, the same settings ``syncopate worker`` takes
as ``SYNCOPATE_*`` variables (``SYNCOPATE_COORDINATOR``, ``SYNCOPATE_TOKEN``, ``SYNCOPATE_CA``,
or ``SYNCOPATE_CLUSTER`` naming a ``cluster.json``; ``syncopate local --script`` sets them all),
or from keyword arguments, which win: ``syncopate.Worker(tensors, cluster="runs/x/cluster.json")``.

Every failure is a :class:`SyncopateError`: :class:`ConfigError`, :class:`ClusterUnreachable`,
:class:`TokenRefused`, :class:`ServerLost`, :class:`RequestRefused`, :class:`UsageError`,
:class:`TensorError`. No call hangs: a dead server is noticed within the cluster's peer timeout,
and Ctrl-C interrupts any wait and leaves the cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from . import _tensors
from ._native import (
    PROTOCOL_VERSION,
    ClusterUnreachable,
    ConfigError,
    NativeSession,
    RequestRefused,
    ServerLost,
    SyncopateError,
    TensorError,
    TokenRefused,
    UsageError,
)
from ._native import settings as _settings
from ._native import status as _status
from ._native import swap as _swap

__all__ = [
    "PROTOCOL_VERSION",
    "ClusterUnreachable",
    "ConfigError",
    "Handle",
    "RequestRefused",
    "ServerLost",
    "Step",
    "SyncopateError",
    "TensorError",
    "TokenRefused",
    "UsageError",
    "Worker",
    "current",
    "init",
    "leave",
    "rank",
    "size",
    "status",
    "swap",
]


class Step(NamedTuple):
    """The iteration to compute next, as :meth:`Worker.pull` returns it."""

    iteration: int
    """The iteration, in the cluster's numbering (a late joiner starts with the slowest worker;
    a policy may skip iterations)."""
    batch: int
    """Samples to compute it on: the batch size in force (a policy may change it)."""
    local_steps: int = 0
    """The local steps the cluster's policy asks this iteration to take (0: push one
    gradient). A loop that takes local steps pushes the pseudo-gradient with
    ``push(..., local_steps=H)``; :class:`syncopate.torch.DiLoCo` does."""


def _flags(settings: dict[str, Any]) -> list[str]:
    """Keyword settings as ``syncopate worker`` flags: ``slow_factor=3`` is ``--slow-factor 3``."""
    out: list[str] = []
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, (tuple, list)):
            value = ":".join(str(v) for v in value) if key != "part" else "/".join(map(str, value))
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


_defaults: dict[str, Any] = {}

_wake_pipe: tuple[int, int, int] | None = None
"""This process's wakeup pipe: (pid, read end, write end)."""


@contextlib.contextmanager
def _interruptible() -> Iterator[int | None]:
    """Around a native call that may wait: what wakes it when a signal arrives.

    On the main thread (where CPython runs signal handlers), CPython's C-level handler writes to
    a pipe (``signal.set_wakeup_fd``) that the call watches, so Ctrl-C wakes it at once and it
    raises ``KeyboardInterrupt``, however busy the CPU is; the previous wakeup descriptor is put
    back afterwards. Gives the pipe's read end; ``-1`` when another wakeup descriptor is set (an
    asyncio loop's, which is left alone: the call then looks for signals every 50 ms); ``None``
    off the main thread (no signal handler runs there; :meth:`Worker.leave` cancels such calls).
    """
    global _wake_pipe
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    if _wake_pipe is None or _wake_pipe[0] != os.getpid():  # none yet, or a forked child's
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        _wake_pipe = (os.getpid(), r, w)
    _, r, w = _wake_pipe
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # a subinterpreter's main thread
        yield -1
        return
    if old not in (-1, w):
        signal.set_wakeup_fd(old)
        yield -1
        return
    try:
        yield r
    finally:
        signal.set_wakeup_fd(old)


def init(cluster: str | os.PathLike[str] | None = None, **settings: Any) -> dict[str, Any]:
    """Reads and checks the settings later calls join with: the ``SYNCOPATE_*`` environment,
    with ``cluster`` (a ``cluster.json``) and ``settings`` (``syncopate worker``'s flags as
    keywords: ``coordinator``, ``token``, ``ca``, ``id``, ``batch``, ...) over it.

    Returns the resolved settings. Raises :class:`ConfigError` when something is missing or
    wrong; nothing is contacted yet (the model's size is needed to join: :class:`Worker`).
    """
    global _defaults
    merged = dict(settings)
    if cluster is not None:
        merged["cluster"] = os.fspath(cluster)
    resolved = json.loads(_settings(_flags(merged)))
    _defaults = merged
    return resolved


class Handle:
    """A pull or push in flight (:meth:`Worker.pull_async`, :meth:`Worker.push_async`)."""

    def __init__(self, future: Future[Any], keep: Any) -> None:
        self._future = future
        self._keep = keep  # the tensors, alive until the call is done

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result (what the blocking call returns); raises what it raised."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self._keep = None


_current: weakref.ref[Worker] | None = None


class Worker:
    """One worker of a cluster, driven by the caller's training loop.

    ``tensors`` is the model: numpy arrays or CPU torch tensors of float32, in a fixed order.
    Joining makes the shards from them if this is the first worker (the others' values are
    ignored); the first :meth:`pull` then brings every worker to the same model. Settings are
    those of :func:`init` (the environment, a cluster file, keywords). ``threads``: the I/O
    threads (the computation keeps the other cores).
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        cluster: str | os.PathLike[str] | None = None,
        threads: int = 2,
        **settings: Any,
    ) -> None:
        global _current
        merged = {**_defaults, **settings}
        if cluster is not None:
            merged["cluster"] = os.fspath(cluster)
        model = _tensors.tensors(tensors, None, writable=False, what="join")
        self._layout = [_tensors.numel(t) for t in model]
        if sum(self._layout) == 0:
            raise TensorError("join: the model has no values")
        with _interruptible() as wake:
            native = NativeSession(model, _flags(merged), threads, wake)
        self._native: NativeSession | None = native
        # Read once: a call in flight holds the session, and these never change.
        self._rank: int = native.rank
        self._size: int = native.size
        self._server_optimizer: tuple[float, float, float] = native.server_optimizer
        self._done: bool = native.done
        self._pool: ThreadPoolExecutor | None = None
        self._last: Step | None = None
        _current = weakref.ref(self)
        atexit.register(_leave_at_exit, weakref.ref(self))

    def _session(self) -> NativeSession:
        if self._native is None:
            raise UsageError("this worker has left the cluster")
        return self._native

    @property
    def rank(self) -> int:
        """This worker's id in the cluster."""
        return self._rank

    @property
    def size(self) -> int:
        """How many workers the cluster expects."""
        return self._size

    @property
    def layout(self) -> list[int]:
        """Values per tensor of the model, in order."""
        return list(self._layout)

    @property
    def done(self) -> bool:
        """Whether training is over (the iterations done, a target reached, the run stopped)."""
        return self._native is None or self._done

    @property
    def server_optimizer(self) -> tuple[float, float, float]:
        """The servers' optimizer: (learning rate, momentum, weight decay)."""
        return self._server_optimizer

    def pull(self, out: Sequence[Any], iteration: int | None = None) -> Step | None:
        """Pulls the model into ``out`` (the model's tensors, written in place) for the next
        iteration and returns it, or ``None`` once training is over. The policy may defer the
        pull (that is what synchronizes workers); the wait releases the GIL.

        ``iteration``, if given, must be the iteration the cluster serves next
        (:class:`UsageError` otherwise): a check for loops that count for themselves.
        """
        targets = _tensors.tensors(out, self._layout, writable=True, what="pull")
        with _interruptible() as wake:
            got = self._session().pull(targets, wake)
        step = None if got is None else Step(*got)
        self._done = step is None
        if step is not None and iteration is not None and step.iteration != iteration:
            self._last = step
            raise UsageError(
                f"pull for iteration {iteration}, but the cluster serves iteration "
                f"{step.iteration} next (the model was pulled for it)"
            )
        self._last = step
        return step

    def push(
        self,
        grads: Sequence[Any],
        iteration: int | None = None,
        *,
        samples: int | None = None,
        loss: float = 0.0,
        local_steps: int = 0,
        tokens: int = 0,
    ) -> int | None:
        """Pushes the gradient computed on what the last :meth:`pull` returned (the model's
        tensors' gradients, in order), computed on ``samples`` samples (default: the step's
        batch) with mean loss ``loss`` (it goes into the run's report, and the shards'
        policies see it with the push) on ``tokens`` tokens (a language model's; 0: not
        reported). With ``local_steps``
        above 0, ``grads`` is the pseudo-gradient of that many local steps (the model pulled
        minus the model they reached), which the servers step with their outer optimizer.
        Returns how many shards' policies dropped it (0: applied everywhere), or ``None`` if a
        policy's skip abandoned the iteration and it was not sent.
        """
        staged = self._stage(grads)
        return self._push_staged(staged, iteration, samples, loss, local_steps, tokens)

    def _stage(self, grads: Sequence[Any]) -> Any:
        """Checks a push's tensors and copies its gradient out of them."""
        checked = _tensors.tensors(grads, self._layout, writable=False, what="push")
        return self._session().stage(checked)

    def _push_staged(
        self,
        staged: Any,
        iteration: int | None,
        samples: int | None,
        loss: float,
        local_steps: int,
        tokens: int = 0,
    ) -> int | None:
        if self._last is None:
            raise UsageError("push called without a pull first")
        if iteration is not None and iteration != self._last.iteration:
            raise UsageError(
                f"push for iteration {iteration}, but the last pull was for {self._last.iteration}"
            )
        if not 0 <= int(tokens) <= 2**40:
            raise UsageError(f"push of {tokens} tokens: a count from 0 to 2^40")
        n = self._last.batch if samples is None else int(samples)
        self._last = None
        session = self._session()
        with _interruptible() as wake:
            dropped = session.push(staged, n, float(loss), int(local_steps), wake, int(tokens))
        self._done = session.done
        return dropped

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncopate")
        return self._pool

    def pull_async(self, out: Sequence[Any], iteration: int | None = None) -> Handle:
        """:meth:`pull` in the background: returns at once; ``handle.wait()`` gives the
        :class:`Step`. ``out`` is written when the pull is back (a tensor resized meanwhile
        gets a :class:`TensorError` then); read it after ``wait()``."""
        return Handle(self._executor().submit(self.pull, out, iteration), out)

    def push_async(
        self,
        grads: Sequence[Any],
        iteration: int | None = None,
        *,
        samples: int | None = None,
        loss: float = 0.0,
        local_steps: int = 0,
    ) -> Handle:
        """:meth:`push` in the background: the gradient is checked and copied before this
        returns (``grads`` may then be reused, overwritten or freed at once), and sent in the
        background; ``handle.wait()`` gives the dropped count. Calls run in the order they
        were made."""
        staged = self._stage(grads)
        args = (staged, iteration, samples, loss, local_steps)
        return Handle(self._executor().submit(self._push_staged, *args), None)

    def _feed(self) -> Any:
        """A push to fill in pieces while the gradient is computed (``put(offset, tensors)``,
        ``fill_rest()``), for :meth:`_exchange_async`; :mod:`syncopate.torch`'s overlap."""
        return self._session().feed()

    def _exchange_async(self, feed: Any, samples: int | None = None) -> Handle:
        """In the background: pushes what ``feed`` is fed (each shard's part as soon as it is
        whole), declaring ``samples`` (default: the pulled iteration's batch), then pulls the
        next iteration into the session's buffers, shard by shard (:meth:`_land_part` copies
        it into the model, while this still runs once :meth:`_planned` says the pull goes
        early). ``handle.wait()`` gives (shards that dropped the push, the next :class:`Step`
        or ``None``)."""
        if self._last is None:
            raise UsageError("push called without a pull first")
        if samples is None:
            samples = self._last.batch
        self._last = None
        session = self._session()

        def run() -> tuple[int | None, Step | None]:
            dropped, got = session.exchange(feed, samples, 0, None)
            step = None if got is None else Step(*got)
            self._last = step
            self._done = step is None
            return dropped, step

        return Handle(self._executor().submit(run), feed)

    def _planned(self) -> int | None:
        """Waits until the exchange in flight knows how it pulls: the iteration it pulls early,
        shard by shard, or ``None`` (the pull waits for the whole push, or the exchange is
        over): then wait for its handle."""
        return self._session().planned()

    def _land_part(self, offset: int, out: Sequence[Any]) -> bool:
        """Copies values ``offset`` on of the model the last exchange pulled into ``out``
        (tensors of the model, in order), once the shards holding them have landed; ``False``
        (nothing written) if the exchange ended without landing them."""
        targets = _tensors.tensors(out, None, writable=True, what="pull")
        return bool(self._session().land_part(int(offset), targets))

    def _record_loss(self, loss: float) -> None:
        """The loss of the iteration last exchanged (its push began before it was known)."""
        self._session().record_loss(float(loss))

    def controls(self) -> list[dict[str, Any]]:
        """The control messages the policies sent since the last call, each already obeyed by
        the worker (pauses waited, batch sizes in :attr:`Step.batch`, skips taken):
        ``[{"shard": 0, "control": {"SetBatchSize": {"batch": 64}}}, ...]``."""
        return json.loads(self._session().controls())

    def score(self, accuracy: float, loss: float | None = None) -> None:
        """Tells the cluster how the model this worker last pulled scores on held-out data:
        ``accuracy`` from 0 to 1, and the mean test ``loss`` if measured. ``syncopate local``
        (and ``syncopate ab``) record the latest score as the run's test accuracy: for its
        ``--target-accuracy``, its plots and its report. One worker scoring is enough."""
        acc = float(accuracy)
        if not 0.0 <= acc <= 1.0:
            raise ValueError(f"accuracy must be within 0 and 1, not {acc}")
        self._session().score(acc, None if loss is None else float(loss))

    def report(self) -> dict[str, Any]:
        """This worker's report so far: iterations, waits, deferred pulls, losses, bytes."""
        return json.loads(self._session().report())

    def leave(self) -> dict[str, Any] | None:
        """Leaves the cluster (the others stop waiting for this worker at once) and returns the
        final report; ``None`` if it had already left. Called at exit if the script does not."""
        global _current
        native, self._native = self._native, None
        if self._pool is not None:
            # A background call may wait for ever (a pull the policy defers): it gives up.
            if native is not None:
                native.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None
        if _current is not None and _current() is self:
            _current = None
        if native is None:
            return None
        with _interruptible() as wake:
            text = native.leave(wake)
        return None if text is None else json.loads(text)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


def _leave_at_exit(ref: weakref.ref[Worker]) -> None:
    w = ref()
    if w is not None:
        try:
            w.leave()
        except SyncopateError:
            pass


def current() -> Worker:
    """The worker this process joined with most recently (:class:`UsageError` if none)."""
    w = _current() if _current is not None else None
    if w is None:
        raise UsageError("no worker has joined yet: create a syncopate.Worker first")
    return w


def rank() -> int:
    """This process's worker id: of the joined worker, else ``SYNCOPATE_ID`` (``syncopate local``
    sets it), else :class:`UsageError`."""
    w = _current() if _current is not None else None
    if w is not None:
        return w.rank
    env = os.environ.get("SYNCOPATE_ID")
    if env is not None:
        return int(env)
    raise UsageError("the rank is assigned on joining: create a syncopate.Worker first")


def size() -> int:
    """How many workers the cluster expects: from the joined worker, else from
    ``SYNCOPATE_PART`` (``I/N``, which ``syncopate local`` sets), else :class:`UsageError`."""
    w = _current() if _current is not None else None
    if w is not None:
        return w.size
    part = os.environ.get("SYNCOPATE_PART")
    if part is not None and "/" in part:
        return int(part.split("/")[1])
    raise UsageError("the cluster's size is known on joining: create a syncopate.Worker first")


def leave() -> dict[str, Any] | None:
    """Leaves the cluster with the current worker, if any; returns its final report."""
    w = _current() if _current is not None else None
    return None if w is None else w.leave()


def _cluster_file(cluster: str | os.PathLike[str] | None) -> str:
    path = cluster if cluster is not None else os.environ.get("SYNCOPATE_CLUSTER")
    if path is None:
        raise ConfigError("no cluster file: pass cluster=... or set SYNCOPATE_CLUSTER")
    return os.fspath(path)


def swap(policy: str, cluster: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Hot-swaps the running cluster's policy (``"ssp:s=3"``, a built-in name with its
    configuration, or a ``.wasm`` file); returns (swap number, shards). Every server prepares
    the module first: if any cannot load it, none switches and this raises."""
    return _swap(_cluster_file(cluster), policy)


def status(cluster: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The running cluster's status: the policy on each shard, the workers, the counters."""
    return json.loads(_status(_cluster_file(cluster)))
