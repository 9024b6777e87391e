"""PyTorch on Syncopate: wrap the optimizer, as with Horovod's or BytePS's.

::

    import syncopate.torch as sps

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = sps.DistributedOptimizer(opt, model.named_parameters(), mode="server")
    sps.broadcast_parameters(opt)          # every worker starts from the same model
    while not opt.done:
        x, y = next_batch(opt.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss=loss.item())          # push, then pull the next iteration's model

Two modes:

- ``server``: the gradients are pushed and the **servers' optimizer** steps (its learning rate,
  momentum and weight decay are the cluster's: ``syncopate local --lr --momentum``); the new
  parameters are pulled into the model. The wrapped optimizer's own ``step`` is not called. This
  is the parameter server's classic mode, and what the policies' papers measured.
- ``delta``: the wrapped torch optimizer steps locally (any optimizer: Adam, LAMB, ...), and the
  **change of the weights** is pushed, scaled so that the servers' plain SGD adds it. The servers
  must run without momentum or weight decay (``--momentum 0``); with ``mean`` push weighting (the
  default) each push moves the servers' model by the worker's change divided by the workers, so
  under BSP the model moves by the mean of the workers' changes.

``overlap=True`` starts each push from the gradient hooks during ``backward()`` (see
:class:`DistributedOptimizer`).

Every parameter (any shapes, any number) is mapped onto the cluster's flat key space in
``named_parameters`` order; the user never sees keys. Parameters are float32, on the CPU or on
one CUDA device: a device's tensors are staged through pinned host buffers with asynchronous
copies on a side stream (``syncopate._staging``, which CPU models run too).

``tensorboard=`` (a ``torch.utils.tensorboard.SummaryWriter``) logs each step's figures beside
the script's own scalars: ``syncopate/loss``, ``syncopate/step_s`` (wall time per step),
``syncopate/exchange_s`` (time in the push and pull), ``syncopate/waiting_share`` (the second
over the first) and ``syncopate/batch_size``, at the worker's iteration.

:class:`DiLoCo` runs local steps instead: any inner optimizer, a pseudo-gradient pushed every
``sync_every`` steps, the outer optimizer on the servers (the ``diloco`` or ``localsgd`` policy).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from . import Step, TensorError, UsageError, Worker
from ._overlap import Overlap
from ._staging import Staging


def _named(
    optimizer: torch.optim.Optimizer, given: Iterable[Any] | None
) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters in the order they map onto the cluster, each with a name: the pairs of
    ``model.named_parameters()``, or bare parameters (``model.parameters()``; as Horovod does,
    the optimizer's own when none are given) named by their position."""
    items = (
        list(given)
        if given is not None
        else [p for g in optimizer.param_groups for p in g["params"]]
    )
    named: list[tuple[str, torch.nn.Parameter]] = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            named.append((f"param.{i}", item))  # type: ignore[arg-type]
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            named.append((str(item[0]), item[1]))
        else:
            raise TypeError(
                "named_parameters takes model.named_parameters(), model.parameters() or "
                f"(name, tensor) pairs, not an item of type {type(item).__name__}"
            )
    return named


class ScalarWriter(Protocol):
    """What ``tensorboard=`` takes: ``torch.utils.tensorboard.SummaryWriter`` has it."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any:
        """Logs one scalar."""
        ...


class DistributedOptimizer:
    """Wraps a torch optimizer so that ``step()`` trains through the cluster; see the module docs.

    Joins the cluster on construction, with the parameters' current values (the first worker's
    values seed the servers). ``named_parameters`` fixes the order of the parameters; the
    optimizer's parameters must be among them. It takes ``model.named_parameters()``,
    ``model.parameters()``, or nothing (the optimizer's parameters, in its groups' order), as
    Horovod's does. Settings for joining go in ``settings``
    (:class:`syncopate.Worker`'s keywords). Attributes: ``worker`` (the :class:`syncopate.Worker`),
    ``step_info`` (the current :class:`syncopate.Step`), ``done``, ``batch_size``.

    ``overlap=True`` (``server`` mode) pushes from the backward pass, as Horovod and BytePS do:
    gradient hooks feed buckets of about ``bucket_mb`` MB, in reverse layer order, and each
    shard's part of the push goes as soon as its buckets are in, so the last layers' gradients
    travel while the first layers' are computed; each shard is pulled for the next iteration
    as soon as it has acknowledged its part, and ``step()`` waits only for what is still in
    flight (:mod:`syncopate._overlap`). The policy sees the same pushes and pulls. The push
    declares the iteration's ``batch_size`` samples, gradients are pushed as backward leaves
    them (use ``overlap=False`` to clip or change them before pushing), and one
    backward pass per ``step()``. What can overlap depends on the shard map: start the cluster
    with several shards (``--shards``).

    ``model=`` (with ``overlap=True``) also overlaps the pull with the next forward pass, as
    ByteScheduler does: ``step()`` returns once the push is fed and the next iteration's pull
    is under way, and each of the model's modules waits, in a forward pre-hook, only for its
    own parameters, so the first layers compute while the last ones still arrive. The cluster
    sends the first layers' parts first. Outside the model's forward pass the parameters may
    still be the last iteration's until :meth:`synchronize` (call it before saving or
    evaluating them some other way); the next backward pass, ``synchronize()`` and ``leave()``
    land the rest. Parameters used outside any module's own forward (functional code) land
    then too.

    ``tensorboard=`` takes a ``torch.utils.tensorboard.SummaryWriter`` and logs each step's
    figures to it (see the module docs).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]]
        | Iterable[torch.nn.Parameter]
        | None = None,
        mode: str = "server",
        *,
        overlap: bool = False,
        bucket_mb: float = 4.0,
        model: torch.nn.Module | None = None,
        tensorboard: ScalarWriter | None = None,
        **settings: Any,
    ) -> None:
        if tensorboard is not None and not callable(getattr(tensorboard, "add_scalar", None)):
            raise TypeError(
                "tensorboard= takes a torch.utils.tensorboard.SummaryWriter (anything with "
                f"add_scalar), not {type(tensorboard).__name__}"
            )
        self._tensorboard = tensorboard
        self._last_step_end: float | None = None
        if mode not in ("server", "delta"):
            raise ValueError(f"mode must be 'server' or 'delta', not {mode!r}")
        bucket_bytes = int(bucket_mb * 2**20) if bucket_mb > 0 else 0
        if overlap and bucket_bytes < 1:
            raise ValueError(f"bucket_mb must be above 0, not {bucket_mb!r}")
        if model is not None and not overlap:
            raise ValueError(
                "model= lands the pull in the next forward pass: it needs overlap=True"
            )
        if overlap and mode != "server":
            raise ValueError(
                "overlap=True pushes gradients from backward; delta mode's weight changes exist "
                "only after the local optimizer's step"
            )
        self.optimizer = optimizer
        self.mode = mode
        named = _named(optimizer, named_parameters)
        seen: set[int] = set()
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.names.append(name)
            self.params.append(p)
        ours = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise TensorError("the optimizer has a parameter not in named_parameters")
        if model is not None and any(id(p) not in ours for p in model.parameters()):
            raise TensorError("model= has a parameter not in named_parameters")
        self._staging = Staging(self.params)
        with torch.no_grad():
            self.worker = Worker(self._staging.stage([p.data for p in self.params]), **settings)
        lr, momentum, decay = self.worker.server_optimizer
        if mode == "delta" and (momentum != 0.0 or decay != 0.0):
            self.worker.leave()
            raise UsageError(
                f"delta mode needs plain SGD on the servers, but they run momentum {momentum} "
                f"and weight decay {decay}: start the cluster with --momentum 0 --weight-decay 0"
            )
        self._server_lr = lr
        # Delta mode's weight changes, on the parameters' device, before they are staged.
        self._grads = [torch.zeros_like(p.data) for p in self.params] if mode == "delta" else []
        self._before = [torch.empty_like(p.data) for p in self.params] if mode == "delta" else []
        self.step_info: Step | None = None
        self._started = False
        self._overlap = (
            Overlap(self.worker, self.params, self._staging, bucket_bytes, self._settled, model)
            if overlap
            else None
        )

    def _settled(self, step: Step | None) -> None:
        """The overlap's exchange left in flight by ``step()`` ended with ``step``."""
        self.step_info = step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (for learning-rate schedulers)."""
        return self.optimizer.param_groups

    @property
    def done(self) -> bool:
        """Whether training is over (the budget spent, a target reached, the run stopped)."""
        if not self._started:
            self._pull()
        return self.step_info is None

    @property
    def batch_size(self) -> int:
        """Samples the current iteration should be computed on (a policy may change it)."""
        if not self._started:
            self._pull()
        if self.step_info is None:
            raise UsageError("training is over")
        return self.step_info.batch

    def _pull(self) -> None:
        self._started = True
        with torch.no_grad():
            self.step_info = self.worker.pull(self._staging.pull_targets(self.params))
            if self.step_info is not None:
                self._staging.finish_pull(self.params)
            if self.mode == "delta" and self.step_info is not None:
                for b, p in zip(self._before, self.params, strict=True):
                    b.copy_(p.data)
        if self._overlap is not None and self.step_info is not None:
            self._overlap.arm(self.step_info.batch)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (the wrapped optimizer's ``zero_grad``)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Makes sure the model holds the cluster's parameters for the current iteration (the
        first call pulls; with ``model=``, a later one waits for the pull ``step()`` left in
        flight and lands it; otherwise later ones do nothing). :func:`broadcast_parameters`
        calls it; call it before reading the parameters outside the model's forward pass
        (saving them, or evaluating them some other way) when the optimizer has ``model=``."""
        if not self._started:
            self._pull()
        elif self._overlap is not None:
            self._overlap.settle()

    def step(
        self, closure: Any = None, *, loss: float | None = None, samples: int | None = None
    ) -> Any:
        """Pushes this iteration's gradient (``server``) or weight change (``delta``) and pulls
        the next iteration's model into the parameters. ``loss`` (the batch's mean loss) and
        ``samples`` go into the run's report. Returns the closure's loss, if one was given."""
        if not self._started:
            raise UsageError("step() before the model was pulled: call broadcast_parameters first")
        if self.step_info is None and self._overlap is not None and self._overlap.ended_late:
            # Training ended while the pass that led here ran (model=): nothing is pushed.
            self._overlap.ended_late = False
            return None
        if self.step_info is None:
            raise UsageError("training is over (check .done)")
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
            if loss is None and isinstance(out, torch.Tensor):
                loss = float(out.detach())
        if self._overlap is not None:
            if samples is not None and samples != self._overlap.batch:
                raise UsageError(
                    f"samples={samples}: with overlap=True the push starts during backward, "
                    f"declaring the iteration's batch ({self._overlap.batch})"
                )
            done_step = self.step_info
            t0 = time.perf_counter()
            self.step_info = self._overlap.finish(loss)
            self._log(done_step, loss, t0)
            return out
        with torch.no_grad():
            if self.mode == "server":
                grads = self._staging.stage([p.grad for p in self.params])
            else:
                self.optimizer.step()
                scale = 1.0 / self._server_lr
                for g, b, p in zip(self._grads, self._before, self.params, strict=True):
                    torch.sub(b, p.data, out=g)
                    g.mul_(scale)
                grads = self._staging.stage(self._grads)
        done_step = self.step_info
        t0 = time.perf_counter()
        self.worker.push(grads, samples=samples, loss=0.0 if loss is None else loss)
        self._pull()
        self._log(done_step, loss, t0)
        return out

    def _log(self, step: Step | None, loss: float | None, exchange_began: float) -> None:
        """Writes the step's figures to ``tensorboard=``, if given, at ``step``'s iteration."""
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, now
        w = self._tensorboard
        if w is None or step is None:
            return
        it = step.iteration
        exchange = now - exchange_began
        w.add_scalar("syncopate/exchange_s", exchange, it)
        w.add_scalar("syncopate/batch_size", step.batch, it)
        if loss is not None:
            w.add_scalar("syncopate/loss", loss, it)
        if last is not None and now > last:
            w.add_scalar("syncopate/step_s", now - last, it)
            w.add_scalar("syncopate/waiting_share", min(1.0, exchange / (now - last)), it)

    def leave(self) -> dict[str, Any] | None:
        """Leaves the cluster; returns this worker's report."""
        if self._overlap is not None:
            try:
                self._overlap.settle()
            finally:
                self._overlap.close()
        return self.worker.leave()


class DiLoCo:
    """Local steps with any torch optimizer, synchronized every ``sync_every`` steps: DiLoCo's
    and local SGD's loop, in the shape of torchft's ``DiLoCo``.

    ::

        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with sps.DiLoCo(model, inner, sync_every=8) as diloco:
            while not diloco.done:
                x, y = next_batch(diloco.batch_size)
                inner.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                inner.step()         # every 8th step: push the pseudo-gradient, pull the model

    The inner optimizer steps the local model as usual (its state stays on this worker, across
    rounds, as in the paper). After every ``sync_every``-th of its steps (a post-step hook),
    the worker pushes the **pseudo-gradient**, the parameters pulled at the round's start
    minus the ones reached, marked as ``sync_every`` local steps, and pulls the new model.
    The **outer optimizer runs on the servers**: the policy chooses it (``diloco``: SGD with
    Nesterov momentum, lr 0.7, momentum 0.9; ``localsgd`` or any other: averaging, unless the
    cluster was started with ``--outer-lr/--outer-momentum/--outer-nesterov``); the policy's
    rule decides when a round's model is served (``diloco`` and ``localsgd``: once every
    worker's round is in). ``sync_every=None`` takes, each round, the local steps the policy
    asks for (at least 1); a ``sync_every`` that differs from the rounds the policy asks for is
    refused with :class:`syncopate.UsageError` (at the start, or when the policy's rounds change).

    Joins the cluster on construction with the model's current values (the first worker's
    seed the servers); ``settings`` are :class:`syncopate.Worker`'s keywords. Parameters are
    float32, on the CPU or one CUDA device (staged as :class:`DistributedOptimizer` stages
    them). Attributes: ``worker``, ``step_info``, ``done``, ``batch_size``,
    ``local_step`` (steps taken in the current round).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int | None = None,
        **settings: Any,
    ) -> None:
        if sync_every is not None and not 1 <= int(sync_every) <= 10_000:
            raise ValueError(f"sync_every must be 1 to 10000, not {sync_every!r}")
        self.sync_every = None if sync_every is None else int(sync_every)
        self.inner_optimizer = inner_optimizer
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        ours = {id(p) for p in self.params}
        for group in inner_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise TensorError("the inner optimizer has a parameter that is not the model's")
        self._staging = Staging(self.params)
        with torch.no_grad():
            self.worker = Worker(self._staging.stage([p.data for p in self.params]), **settings)
        self._start = [torch.empty_like(p.data) for p in self.params]
        self._delta = [torch.empty_like(p.data) for p in self.params]
        self.step_info: Step | None = None
        self.local_step = 0
        self._loss = 0.0
        self._hook: Any = None
        self._pull()

    def __enter__(self) -> DiLoCo:
        self._hook = self.inner_optimizer.register_step_post_hook(self._stepped)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def done(self) -> bool:
        """Whether training is over (the budget spent, a target reached, the run stopped)."""
        return self.step_info is None

    @property
    def batch_size(self) -> int:
        """Samples each local step should be computed on (a policy may change it)."""
        if self.step_info is None:
            raise UsageError("training is over")
        return self.step_info.batch

    def _round_length(self) -> int:
        if self.sync_every is not None:
            return self.sync_every
        return max(1, self.step_info.local_steps if self.step_info is not None else 1)

    def record_loss(self, loss: float) -> None:
        """Notes a local step's loss: the round's mean goes into the run's report."""
        self._loss += float(loss)

    def _pull(self) -> None:
        with torch.no_grad():
            self.step_info = self.worker.pull(self._staging.pull_targets(self.params))
            if self.step_info is not None:
                self._staging.finish_pull(self.params)
                for s, p in zip(self._start, self.params, strict=True):
                    s.copy_(p.data)
        self.local_step = 0
        self._loss = 0.0
        asked = self.step_info.local_steps if self.step_info is not None else 0
        if self.sync_every is not None and asked > 0 and asked != self.sync_every:
            # A round of another length than the policy's would be pushed as if it were one:
            # refused, rather than trained on silently.
            self.worker.leave()
            self.step_info = None
            raise UsageError(
                f"sync_every={self.sync_every}, but the cluster's policy asks for rounds of "
                f"{asked} local steps: pass sync_every=None to follow the policy, or configure "
                f"the policy's round length (for example diloco:h={self.sync_every})"
            )

    def _stepped(self, *_: Any) -> None:
        if self.step_info is None:
            raise UsageError("training is over (check .done)")
        self.local_step += 1
        if self.local_step >= self._round_length():
            self.sync()

    def sync(self) -> None:
        """Ends the round now: pushes the pseudo-gradient of the local steps taken so far and
        pulls the new model (the hook calls it every ``sync_every`` steps; nothing happens with
        no step taken)."""
        if self.step_info is None or self.local_step == 0:
            return
        steps = self.local_step
        with torch.no_grad():
            for d, s, p in zip(self._delta, self._start, self.params, strict=True):
                torch.sub(s, p.data, out=d)
            delta = self._staging.stage(self._delta)
        samples = self.step_info.batch * steps
        self.worker.push(delta, samples=samples, loss=self._loss / steps, local_steps=steps)
        self._pull()

    def leave(self) -> dict[str, Any] | None:
        """Leaves the cluster (local steps of an unfinished round are not pushed); returns this
        worker's report."""
        return self.worker.leave()


def broadcast_parameters(optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """Makes every worker's model the cluster's: pulls the servers' parameters (seeded by the
    first worker to join) into the model. ``root_rank`` is accepted for Horovod compatibility;
    the servers hold the model, so the root is whichever worker joined first."""
    del root_rank
    optimizer.synchronize()
