"""Communication overlapped with the backward pass: :class:`syncopate.torch.DistributedOptimizer`'s
``overlap=True``.

The parameters are grouped into **buckets** of about ``bucket_bytes``, in reverse order of
``named_parameters`` (backward produces the last layers' gradients first), as Horovod's fusion
buffer and DDP's buckets group them. A ``register_post_accumulate_grad_hook`` on every parameter
notes its gradient; once a bucket's gradients are all in, the bucket is copied into the push
(:class:`~syncopate._native.Feed`; on a CUDA device, device-to-host into pinned buffers on a side
stream first, and fed from a small thread once the copy is done). The push itself runs in the
background from the first bucket on: each shard's part goes as soon as the buckets over its key
range are in, so the shards that hold the last layers are sent while the first layers' gradients
are still computed. Each shard is pulled for the next iteration as soon as it has acknowledged
its part (so the last layers' shards first; the arrivals are not ordered for the next forward
pass, since ``step()`` returns only once all are in). ``step()`` puts what no hook put
(parameters that got no gradient push zeros), waits for what is still in flight, and copies the
pulled model into the parameters.

The policy sees exactly what the serial ``step()`` sends: one push and one pull per iteration
per shard. What overlaps is bounded by the shard map: with one shard the push can only start
once every gradient is in (only the copies overlap), so run the cluster with several shards
(``syncopate local --shards``; measured in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    ) -> None:
        self.worker = worker
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

    def close(self) -> None:
        """Removes the hooks (the optimizer no longer pushes from backward)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._feeder is not None:
            self._feeder.shutdown(wait=True)

    def arm(self) -> None:
        """Makes the next backward pass push (after a pull brought an iteration)."""
        self._feed = self.worker._feed()
        self._handle = None
        self._fed = []
        self._ready = [False] * len(self.params)
        self._missing = [len(run) for run in self.buckets]

    def _hook(self, i: int) -> Any:
        def ready(p: torch.Tensor) -> None:
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
            self._handle = self.worker._exchange_async(self._feed)

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

    def finish(self, loss: float | None) -> tuple[int | None, Step | None]:
        """``step()``'s half: puts what backward did not (zeros where no gradient came), waits
        for the exchange, and records the loss. Returns (shards that dropped the push, the next
        step or ``None``); the pulled model is then :meth:`land`-ed."""
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
        dropped, step = handle.wait()
        if loss is not None:
            self.worker._record_loss(loss)
        return dropped, step

    def land(self) -> None:
        """Copies the model the exchange pulled into the parameters."""
        with torch.no_grad():
            self.worker._land(self.staging.pull_targets(self.params))
            self.staging.finish_pull(self.params)
