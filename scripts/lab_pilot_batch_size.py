"""Pilot for the ``batch-size`` experiment: find settings under which both BN and GN(8) converge at
batch 32 within the quick budget, on a seed (100) that the reported runs (0, 1, 2) never use.

Run: ``PYTHONPATH=src python scripts/lab_pilot_batch_size.py OUT.json [CANDIDATE ...]``; a candidate is
``width:epochs:base_lr`` (default: a small grid). Writes every run's test error, final loss and
wall time. Its output chose the quick settings committed in ``exp_batch_size.py``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from normscope.tools.lab.core import deterministic, seed_all, versions
from normscope.tools.lab.data import cluttered_digits
from normscope.tools.lab.models import SmallCNN, error_rate, train_classifier

PILOT_SEED = 100
GRID = ["16:6:0.1", "32:6:0.1", "32:12:0.02", "32:30:0.1", "16:30:0.1", "32:20:0.1", "32:30:0.05"]


def one(norm: str, batch: int, width: int, epochs: int, base_lr: float) -> dict:
    xtr, ytr, xte, yte = cluttered_digits(16, 0.5)
    g = seed_all(PILOT_SEED)
    model = SmallCNN(norm, width)
    t0 = time.perf_counter()
    losses = train_classifier(model, xtr, ytr, batch=batch, epochs=epochs, lr=base_lr * batch / 32, g=g)
    return {
        "norm": norm,
        "batch": batch,
        "width": width,
        "epochs": epochs,
        "base_lr": base_lr,
        "err": error_rate(model, xte, yte),
        "final_loss": losses[-1],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str]) -> None:
    out, cands = argv[0], argv[1:] or GRID
    rows = []
    with deterministic(threads=1):
        for cand in cands:
            w, e, lr = cand.split(":")
            for norm in ("batch", "group:8"):
                r = one(norm, 32, int(w), int(e), float(lr))
                rows.append(r)
                print(json.dumps(r), flush=True)
                with open(out, "w") as f:
                    json.dump(
                        {
                            "seed": PILOT_SEED,
                            "runs": rows,
                            "versions": versions(),
                            "load_note": "nice -n 15, 1 thread, on a 2-core machine shared with other jobs",
                        },
                        f,
                        indent=1,
                    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
