"""``normscope.doctor`` on a ResNet-18-sized model on this CPU (a benchmark, not a test).

    PYTHONPATH=src python3 benchmarks/doctor_speed.py [--batch 8] [--size 224] [--reps 3]
                                                      [--json benchmarks/results/doctor_speed.json]

The model is built here with ResNet-18's layout (torchvision is not needed: basic blocks
[2, 2, 2, 2], 64-128-256-512 channels, 11.7 M parameters) and random weights, in training mode, on
one random batch. Measured in the same run, alternating: one plain training-mode forward of the
model (the floor: the doctor runs the model at least once), and the full diagnosis with every check.
Prints the medians, the ratio, and whether the goal (< 30 s) holds; saves the samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

import normscope

GOAL_S = 30.0


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout, module names included (``layer1.0.bn1``, ``fc``)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, c in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c, 1)))
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "doctor_speed.json"))
    args = ap.parse_args()

    torch.manual_seed(0)
    model = ResNet18()
    x = torch.randn(args.batch, 3, args.size, args.size)
    load = os.getloadavg()[0]
    forward_s, doctor_s, report = [], [], None
    for _ in range(args.reps):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        forward_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        report = normscope.doctor(model, x)
        doctor_s.append(time.perf_counter() - t0)
    fwd, doc = statistics.median(forward_s), statistics.median(doctor_s)
    result = {
        "model": "ResNet-18 layout, random weights, training mode",
        "parameters": sum(p.numel() for p in model.parameters()),
        "input": [args.batch, 3, args.size, args.size],
        "goal_s": GOAL_S,
        "doctor_s": round(doc, 3),
        "forward_s": round(fwd, 3),
        "ratio_doctor_to_forward": round(doc / fwd, 2),
        "goal_met": doc < GOAL_S,
        "findings": {s: report.count(s) for s in ("error", "warning", "info")},
        "reps": args.reps,
        "samples_s": {"doctor": [round(t, 3) for t in doctor_s], "forward": [round(t, 3) for t in forward_s]},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_start": round(load, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }
    print(
        f"doctor on ResNet-18, batch {args.batch} x {args.size}x{args.size}: {doc:.2f} s (median of {args.reps}); "
        f"one plain forward {fwd:.2f} s; ratio {doc / fwd:.1f}x; goal < {GOAL_S:.0f} s: "
        f"{'met' if doc < GOAL_S else 'NOT met'} (load average {load:.1f} at start)"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
