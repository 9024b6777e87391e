"""A worker script: linear regression y = X @ w_true on synthetic data, trained with numpy
through whatever cluster the SYNCOPATE_* environment names. Prints the final loss.

Worker 0 scores the model every 10 iterations on a held-out set (the share of predictions
within 0.1 of the truth) and reports it to the cluster, as a training script reports its test
accuracy to the launcher."""

from __future__ import annotations

import os
import sys

import numpy as np

import syncopate

DIM = 20


def main() -> None:
    w_true = np.linspace(-1, 1, DIM).astype(np.float32)
    weights = np.zeros(DIM, dtype=np.float32)
    rng = np.random.default_rng(int(os.environ.get("SYNCOPATE_ID", "0")))
    worker = syncopate.Worker([weights])
    held_out = np.random.default_rng(99).standard_normal((500, DIM)).astype(np.float32)
    loss = float("nan")
    while (step := worker.pull([weights])) is not None:
        if worker.rank == 0 and step.iteration % 10 == 0:
            err = held_out @ weights - held_out @ w_true
            worker.score(float(np.mean(np.abs(err) < 0.1)), loss=float(np.mean(err**2)))
        x = rng.standard_normal((step.batch, DIM)).astype(np.float32)
        err = x @ weights - x @ w_true
        loss = float(np.mean(err**2))
        grad = (2.0 / step.batch) * (x.T @ err)
        worker.push([grad.astype(np.float32)], loss=loss)
    report = worker.leave()
    print(f"rank {report['worker']} iterations {report['iterations']} loss {loss:.6f}")
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
