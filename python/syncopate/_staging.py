"""Where a torch model's tensors meet the wire: the one device abstraction of
:mod:`syncopate.torch`.

The native half moves float32 host memory. A model on a CUDA device is staged through pinned
host buffers: what is pushed is copied device-to-host asynchronously on a side stream (after the
stream that computed it), and the stream is synchronized before the push; pulled parameters land
in pinned buffers and go back host-to-device the same way, the compute stream waiting for them.
A CPU model runs the same code, with synchronous copies and the parameters themselves as the
pull's targets, so every CPU test exercises this module; the CUDA tests run where a device is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._native import TensorError


class Staging:
    """Host buffers for a model's tensors (``params``, all float32 on one device)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        devices = {p.device for p in params}
        if not devices:
            raise TensorError("the model has no parameters")
        if len(devices) != 1:
            found = ", ".join(sorted(str(d) for d in devices))
            raise TensorError(f"the model's parameters are on several devices ({found}); use one")
        self.device: torch.device = next(iter(devices))
        if self.device.type not in ("cpu", "cuda"):
            raise TensorError(f"parameters on {self.device}: Syncopate stages cpu and cuda tensors")
        for p in params:
            if p.dtype != torch.float32:
                raise TensorError(f"a parameter of {p.dtype}: Syncopate moves float32 values")
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

        def host() -> list[torch.Tensor]:
            return [torch.empty(p.shape, dtype=torch.float32, pin_memory=self.cuda) for p in params]

        # What is pushed, and (on a device) what pulls land in.
        self._out = host()
        self._into = host() if self.cuda else []

    def stage(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (``None``: zeros), complete when this returns. The buffers
        are reused: push them before the next call."""
        with torch.no_grad():
            if self._stream is None:
                for h, t in zip(self._out, tensors, strict=True):
                    if t is None:
                        h.zero_()
                    else:
                        h.copy_(t)
                return self._out
            # The copies follow whatever the compute stream queued (the backward pass).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for h, t in zip(self._out, tensors, strict=True):
                    if t is None:
                        h.zero_()
                    else:
                        h.copy_(t, non_blocking=True)
            self._stream.synchronize()
            return self._out

    def stage_part(
        self, indices: Sequence[int], tensors: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """On a device, for a push fed in pieces: queues device-to-host copies of ``tensors``
        (parameters ``indices``' gradients) into their pinned buffers on the side stream, after
        what the compute stream queued, and returns the buffers and an event that completes
        with the copies. The buffers are reused: feed them before the next iteration's copies.
        """
        if self._stream is None:
            raise RuntimeError(
                "stage_part stages device tensors; a CPU model feeds them as they are"
            )
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        hosts = [self._out[i] for i in indices]
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for h, t in zip(hosts, tensors, strict=True):
                # The gradient's memory stays the copy's until it is done, whatever frees it.
                t.record_stream(self._stream)
                h.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return hosts, done

    def pull_targets(
        self, params: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Where a pull of ``params`` (or of those at ``indices``) should land: the parameters
        themselves on the CPU, pinned buffers on a device (then :meth:`finish_pull`)."""
        which = range(len(params)) if indices is None else indices
        if self.cuda:
            return [self._into[i] for i in which]
        return [params[i].data for i in which]

    def finish_pull(
        self, params: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> None:
        """Copies a pull's pinned buffers into ``params`` (or those at ``indices``) on the
        device (nothing on the CPU); the compute stream waits for the copies."""
        if self._stream is None:
            return
        which = range(len(params)) if indices is None else indices
        # The copies follow what the compute stream queued before (a forward pass under way
        # may still read the old values).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for i in which:
                params[i].data.copy_(self._into[i], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        # The buffers are the next pull's: that may not start before these copies are done.
        self._stream.synchronize()
