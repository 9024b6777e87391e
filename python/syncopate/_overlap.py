"""Communication overlapped with the backward pass, and the next forward pass:
:class:`syncopate.torch.DistributedOptimizer`'s ``overlap=True``.

The parameters are grouped into **buckets** of about ``bucket_bytes``, in reverse order of
``named_parameters`` (backward produces the last layers' gradients first), as Horovod's fusion
buffer and DDP's buckets group them. A ``register_post_accumulate_grad_hook`` on every parameter
notes its gradient; once a bucket's gradients are all in, the bucket is copied into the push
(:class:`~syncopate._native.Feed`; on a CUDA device, device-to-host into pinned buffers on a side
stream first, and fed from a small thread once the copy is done). The push itself runs in the
background from the first bucket on: each shard's part goes as soon as the buckets over its key
range are in, so the shards that hold the last layers are sent while the first layers' gradients
are still computed. Each shard is pulled for the next iteration as soon as it has acknowledged
its part. ``step()`` puts what no hook put (parameters that got no gradient push zeros), and
waits for what is still in flight.

**Landing in the next forward pass** (``model=`` given). ``step()`` then returns as soon as the
push is fed and the worker knows it pulls the next iteration early (the machine's
``next_pull_if_quiet``): the iteration it returns is the one being pulled. A forward pre-hook on
each of the model's modules waits only for the shards that hold that module's own parameters,
and copies them in, so the next forward pass starts with the first layers while the last ones
still travel. The cluster orders the traffic for it, as ByteScheduler does: a push's first
layers' parts overtake what is left of the last layers' (QUIC stream priorities), and a
server answers its first shards' pulls first. The first gradient of the next backward pass (or
:meth:`Overlap.settle`: ``synchronize()``, ``leave()``) lands whatever no hook took and waits for
the exchange. If the early pull is abandoned meanwhile (a stop or a skip came in: rare), the
pull that replaces it lands then, and the pass computed on the early one is pushed for the
iteration pulled instead, or, when training is over, not at all.

The policy sees exactly what the serial ``step()`` sends: one push and one pull per iteration
per shard. What overlaps is bounded by the shard map: with one shard the push can only start
once every gradient is in (only the copies overlap), so run the cluster with several shards
(``syncopate local --shards``; measured in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import Handle, Step, UsageError, Worker
from ._staging import Staging


class Overlap:
    """The buckets, hooks and in-flight exchange of one :class:`DistributedOptimizer`."""

    def __init__(
        self,
        worker: Worker,
        params: Sequence[torch.nn.Parameter],
        staging: Staging,
        bucket_bytes: int,
        on_step: Callable[[Step | None], None],
        model: torch.nn.Module | None = None,
    ) -> None:
        self.worker = worker
        self.on_step = on_step
        self.params = list(params)
        self.staging = staging
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        # Buckets of consecutive parameters, from the last: each a run of indices, ascending.
        self.buckets: list[list[int]] = []
        run: list[int] = []
        size = 0
        for i in reversed(range(len(self.params))):
            run.insert(0, i)
            size += 4 * sizes[i]
            if size >= bucket_bytes:
                self.buckets.append(run)
                run, size = [], 0
        if run:
            self.buckets.append(run)
        self.bucket_of = {i: b for b, run in enumerate(self.buckets) for i in run}
        self._feeder = ThreadPoolExecutor(1, "syncopate-feed") if staging.cuda else None
        self._fed: list[Future[Any]] = []
        self._feed: Any = None
        self._handle: Handle | None = None
        self._ready = [False] * len(self.params)
        self._missing = [len(run) for run in self.buckets]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)
        ]
        # Landing in the next forward pass: the exchange step() left in flight, the iteration
        # it pulls, the loss to record once it is back, and which parameters are in.
        self._pending: Handle | None = None
        self._early: Step | None = None
        self._loss: float | None = None
        self._landed = [True] * len(self.params)
        self.batch = 0
        """Samples the iteration being computed declares (its batch when it was handed out)."""
        self._in_force = 0  # the batch size the last pull brought
        self.ended_late = False
        """Whether training turned out over while the next forward pass ran (see the module)."""
        self.forward = model is not None
        if model is not None:
            index = {id(p): i for i, p in enumerate(self.params)}
            for module in model.modules():
                own = sorted(
                    index[id(p)] for p in module.parameters(recurse=False) if id(p) in index
                )
                if own:
                    self._hooks.append(module.register_forward_pre_hook(self._arriving(own)))

    def close(self) -> None:
        """Removes the hooks (the optimizer no longer pushes from backward)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._feeder is not None:
            self._feeder.shutdown(wait=True)

    def arm(self, batch: int) -> None:
        """Makes the next backward pass push (after a pull brought an iteration, computed on
        ``batch`` samples); the model must be landed."""
        self.batch = batch
        self._in_force = self._in_force or batch
        self._feed = self.worker._feed()
        self._handle = None
        self._fed = []
        self._ready = [False] * len(self.params)
        self._missing = [len(run) for run in self.buckets]

    def _arriving(self, own: list[int]) -> Any:
        def land(*_: Any) -> None:
            if self._pending is not None and not self._land(
                [i for i in own if not self._landed[i]]
            ):
                self.settle()  # the exchange ended without them: raises why, or training is over

        return land

    def _runs(self, indices: Sequence[int]) -> list[list[int]]:
        """``indices`` (ascending) as runs of consecutive parameters (consecutive values)."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _land(self, indices: Sequence[int]) -> bool:
        """Copies parameters ``indices`` from the exchange in flight, once their shards are in;
        ``False`` if it ended without landing them (then :meth:`settle` says why)."""
        for run in self._runs(indices):
            with torch.no_grad():
                targets = self.staging.pull_targets(self.params, run)
                if not self.worker._land_part(self.offsets[run[0]], targets):
                    return False
                self.staging.finish_pull(self.params, run)
            for i in run:
                self._landed[i] = True
        return True

    def settle(self) -> None:
        """Ends the exchange ``step()`` left in flight, if any: lands what the forward pass did
        not take, waits for it, and arms the next push (or ends training)."""
        if self._pending is None:
            return
        handle, self._pending = self._pending, None
        early, self._early = self._early, None
        self._land([i for i, done in enumerate(self._landed) if not done])
        self._landed = [True] * len(self.params)
        _, step = handle.wait()
        if self._loss is not None:
            self.worker._record_loss(self._loss)
            self._loss = None
        if step is not None and early is not None and step.iteration != early.iteration:
            # The early pull was abandoned; the pull that replaced it lands now.
            self.land()
        self.on_step(step)
        if step is None:
            self.ended_late = True
        else:
            self._in_force = step.batch
            self.arm(self.batch)

    def _hook(self, i: int) -> Any:
        def ready(p: torch.Tensor) -> None:
            if self._feed is None and self._pending is not None:
                self.settle()  # the next backward pass: the pull must be in
            if self._feed is None:
                return  # no iteration pulled (before the first pull, or training is over)
            if self._ready[i]:
                raise UsageError(
                    "a second backward pass before step(): with overlap=True each gradient is "
                    "pushed as soon as backward makes it, so it cannot accumulate over several "
                    "passes (use overlap=False for gradient accumulation)"
                )
            self._ready[i] = True
            b = self.bucket_of[i]
            self._missing[b] -= 1
            if self._missing[b] == 0:
                self._put(self.buckets[b])

        return ready

    def _start(self) -> None:
        if self._handle is None:
            self._handle = self.worker._exchange_async(self._feed, self.batch)

    def _put(self, run: Sequence[int]) -> None:
        """Feeds parameters ``run`` (consecutive, ascending, each with its gradient)."""
        self._start()
        grads = [self.params[i].grad for i in run]
        offset = self.offsets[run[0]]
        if self._feeder is None:
            self._feed.put(offset, grads)
            return
        hosts, done = self.staging.stage_part(run, grads)
        feed = self._feed

        def put() -> None:
            done.synchronize()
            feed.put(offset, hosts)

        self._fed.append(self._feeder.submit(put))

    def finish(self, loss: float | None) -> Step | None:
        """``step()``'s half: puts what backward did not (zeros where no gradient came), waits
        for the exchange, records the loss, lands the model and arms the next push; returns the
        next step or ``None``. Landing in the forward pass, it returns the iteration pulled
        early as soon as the push is fed, and leaves the rest to the hooks."""
        self.settle()  # a step() with no backward pass since the last
        if self._feed is None:
            raise UsageError("training is over (check .done)")
        self._start()
        for b, run in enumerate(self.buckets):
            if self._missing[b] == 0:
                continue
            # A bucket some of whose parameters got no gradient: the others go one by one.
            for i in run:
                if self._ready[i]:
                    self._put([i])
        for f in self._fed:
            f.result()
        self._feed.fill_rest()
        assert self._handle is not None
        handle, self._handle, self._feed = self._handle, None, None
        if self.forward:
            early = self.worker._planned()
            if early is not None:
                self._pending, self._loss = handle, loss
                self._landed = [False] * len(self.params)
                self._early = Step(early, self._in_force, 0)
                return self._early
        _, step = handle.wait()
        if loss is not None:
            self.worker._record_loss(loss)
        if step is not None:
            self.land()
            self._in_force = step.batch
            self.arm(step.batch)
        return step

    def land(self) -> None:
        """Copies the model the exchange pulled into the parameters."""
        if not self._land(range(len(self.params))):
            raise UsageError("the exchange ended without the model")  # not reached: it raised
