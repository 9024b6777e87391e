"""A worker that blocks in one call and is interrupted there by the test that starts it
(``test_errors.py``): ``blocked.py join|pull|push``.

- ``join``: joins a cluster whose start barrier waits for a second worker that never comes;
- ``pull``: pulls a second time under BSP while the other worker never pushes (deferred);
- ``push``: prints ``ready`` and waits for a line on stdin, by which the test has stopped the
  server (SIGSTOP); then pushes, and no answer comes.

It prints ``calling <call>`` just before the call (for ``pull`` and ``push``, from a profile
hook as the native call starts), then, on ``KeyboardInterrupt``, ``interrupted in <function>``
(the innermost Python frame: the call's own method, so the signal was taken inside it), leaves
the cluster, prints ``left`` and exits with status 3."""

from __future__ import annotations

import signal
import sys
import traceback
from types import FrameType
from typing import Any

import numpy as np

import syncopate


def say(line: str) -> None:
    print(line, flush=True)


def main(mode: str) -> None:
    model = [np.zeros(8, dtype=np.float32)]
    worker: syncopate.Worker | None = None

    def announce(frame: FrameType, event: str, arg: Any) -> None:
        # The native method of the mode, about to run: the wait is next.
        if event == "c_call" and getattr(arg, "__name__", None) == mode:
            sys.setprofile(None)
            say(f"calling {mode}")

    try:
        if mode == "join":
            say("calling join")
            worker = syncopate.Worker(model)
        else:
            worker = syncopate.Worker(model)
            worker.pull(model)
            if mode == "pull":
                worker.push(model)
            else:
                # The server must be stopped before the push leaves: a push already answered
                # returns, and the signal then lands after the call.
                say("ready")
                sys.stdin.readline()
            sys.setprofile(announce)
            if mode == "pull":
                worker.pull(model)
            else:
                worker.push(model)
        say("returned")
    except KeyboardInterrupt as e:
        sys.setprofile(None)
        say(f"interrupted in {traceback.extract_tb(e.__traceback__)[-1].name}")
        if worker is not None:
            worker.leave()
        say("left")
        sys.exit(3)


if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt here whatever this process inherited: Python installs its
    # handler only where SIGINT is not ignored, and a suite started in the background (`&`,
    # nohup, a scheduler) hands its children SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1])
