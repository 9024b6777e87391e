"""A driver that launches a long counter run on the Ray cluster at ``$RAY_ADDRESS`` and is
interrupted by the test that starts it (``test_ray.py``): it prints ``training`` once the
workers are pushing, and then waits in :func:`syncopate.ray.RayRun.wait`."""

from __future__ import annotations

import os
import signal
import sys
import time

import ray
from test_ray import counter

import syncopate.ray


def main() -> None:
    # The actors import the training function from the tests' folder, as this driver does.
    ray.init(
        _node_ip_address="127.0.0.1",  # as the tests' Ray nodes: loopback only
        runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}},
    )
    run = syncopate.ray.start(
        counter,
        workers=2,
        servers=2,
        iterations=100_000,
        config={"pace_s": 0.01},
        run_dir=sys.argv[1],
        lr=1.0,
        momentum=0.0,
        push_weight="sum",
    )
    while not (run._look() or {}).get("pushes"):
        if not run.running():
            run.wait()  # raises what the workers raised
        time.sleep(0.1)
    print("training", flush=True)
    run.wait()


if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt here whatever this process inherited (a suite started in
    # the background hands its children SIGINT ignored, and Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
