"""How often ``train-eval-drift`` warns on healthy layers, and how often it finds stale statistics, by batch
size (a measurement, not a test; the figures behind the check's sampling-noise margin).

    PYTHONPATH=src python3 benchmarks/doctor_drift_noise.py [--batches 10]
                                                    [--json benchmarks/results/doctor_drift_noise.json]

timm's resnet18 and efficientnet_b0 (random weights; timm from ``build/zoo`` as the zoo tests import it)
get running statistics that fit the data: in an evaluation-mode forward on 256 random images (64 px), each
BatchNorm's statistics are set from its own input before it normalizes it. Then, for each batch size, on
``--batches`` new batches in evaluation mode, every BatchNorm's distance (the doctor's ``_distance``) and
the sampling noise of the batch (``sampling_noise``) are measured, and the rate at which a layer would
warn is counted under two rules: the threshold alone (distance - noise > 0.133) and the doctor's (beyond
the noise by more than max(0.133, NOISE_MARGIN x noise)). "healthy" batches come from the same
distribution; "stale" ones are brighter and more contrasted (x 1.3 + 0.3), so the statistics no longer fit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

from normscope.doctor._observe import Call, NormScope
from normscope.doctor.checks import DRIFT_WARNING, NOISE_MARGIN, _distance, sampling_noise

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))


def _calibrate(model: nn.Module, x: torch.Tensor) -> None:
    def set_from_input(m, args):
        h = args[0].detach().double()
        with torch.no_grad():
            m.running_mean.copy_(h.mean((0, 2, 3)))
            m.running_var.copy_(h.var((0, 2, 3), unbiased=True))

    handles = [m.register_forward_pre_hook(set_from_input) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "doctor_drift_noise.json")
    args = p.parse_args()
    from test_zoo_setup import ZOO, _import_torchvision

    sys.path.append(str(ZOO))
    _import_torchvision()
    import timm

    rows = []
    for name in ("resnet18", "efficientnet_b0"):
        torch.manual_seed(0)
        model = timm.create_model(name)
        _calibrate(model, torch.randn(256, 3, 64, 64))
        bns = [(k, m) for k, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
        seen: dict[str, torch.Tensor] = {}
        for k, m in bns:
            m.register_forward_pre_hook(lambda m, a, k=k, seen=seen: seen.__setitem__(k, a[0].detach()))
        g = torch.Generator().manual_seed(1)
        for kind, (scale, shift) in (("healthy", (1.0, 0.0)), ("stale", (1.3, 0.3))):
            for n in (2, 4, 16, 32):
                alone = margin = layers = 0
                for _ in range(args.batches):
                    with torch.no_grad():
                        model(torch.randn(n, 3, 64, 64, generator=g) * scale + shift)
                    for k, m in bns:
                        call = Call(k, m, False, 0, 0, args=(seen[k],))
                        call.extra["scope"] = NormScope("batch", (0, 2, 3), 1, None, True, m.eps)
                        mz, vz = _distance(call, m.running_mean, m.running_var, m.eps)
                        d, z = float(mz.mean() + vz.mean()), sum(sampling_noise(call, m.running_var, m.eps))
                        layers += 1
                        alone += d - z > DRIFT_WARNING
                        margin += d - z > max(DRIFT_WARNING, NOISE_MARGIN * z)
                row = {"model": name, "batches": kind, "batch": n, "layers": layers,
                       "rate_threshold_alone": alone / layers, "rate_doctor": margin / layers}  # fmt: skip
                rows.append(row)
                print(f"{name:16} {kind:8} batch {n:3}: warns on {100 * row['rate_doctor']:5.1f}% of layers "
                      f"(threshold alone: {100 * row['rate_threshold_alone']:5.1f}%)")  # fmt: skip
    doc = {
        "command": "PYTHONPATH=src python3 benchmarks/doctor_drift_noise.py" + f" --batches {args.batches}",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "noise_margin": NOISE_MARGIN,
        "threshold": DRIFT_WARNING,
        "rows": rows,
    }
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
