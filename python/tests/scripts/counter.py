"""A worker script with known values: worker ``rank`` pushes a gradient of ``rank + 1`` in every
parameter at every iteration, 20 ms apart. With SGD at learning rate 1, no momentum and summed
pushes, every parameter ends at exactly minus the sum of all pushes, so a lost or doubled
update shows as a wrong number."""

from __future__ import annotations

import time

import numpy as np

import syncopate

DIM = 16


def main() -> None:
    weights = np.zeros(DIM, dtype=np.float32)
    worker = syncopate.Worker([weights])
    grad = np.full(DIM, worker.rank + 1, dtype=np.float32)
    while worker.pull([weights]) is not None:
        time.sleep(0.02)
        worker.push([grad])
    report = worker.leave()
    print(f"rank {report['worker']} iterations {report['iterations']}", flush=True)


if __name__ == "__main__":
    main()
