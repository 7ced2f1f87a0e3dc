"""smoothness: BatchNorm smooths the loss landscape (Santurkar et al. 2018, "How Does Batch
Normalization Help Optimization?").

A small VGG-style CNN (4 conv layers) on digits, with BN, without, and with BN followed by
injected noise (per step and channel, a random scale in [0.5, 1.5] and shift in [-0.5, 0.5]:
non-zero mean, non-unit variance, changing every step -- "internal covariate shift" on purpose).
Every few steps, along the gradient direction g at the current weights, for several step sizes
eta: the range of the loss L(w - eta g), the largest gradient change |grad L(w - eta g) - g|, and
the effective beta-smoothness max |grad L(w - eta g) - g| / |eta g|.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .core import Context, mean_std, pyplot, seed_all
from .data import digits
from .models import SmallCNN, error_rate, norm_sources
from .verdicts import noisy_rule, smoothness_rule

NAME = "smoothness"
TITLE = "BatchNorm and the smoothness of the loss landscape"
VARIANTS = {"batch": "BN", "none": "no norm", "batch-noisy": "BN + noise"}


class NoisyAfter(nn.Module):
    """Wraps a norm; in training adds per-step, per-channel random scale and shift after it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.source = getattr(inner, "source", "?")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if not self.training:
            return y
        c = y.shape[1]
        scale = torch.rand(1, c, 1, 1) + 0.5
        shift = torch.rand(1, c, 1, 1) - 0.5
        return y * scale + shift


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"steps": 12, "probe_every": 6, "etas": [0.05, 0.2], "probe_batch": 64, "lr": 0.05, "width": 8,
                "seeds": 1}
    if mode == "quick":
        return {"steps": 400, "probe_every": 25, "etas": [0.05, 0.1, 0.2, 0.4], "probe_batch": 256, "lr": 0.05,
                "width": 32, "seeds": 3}
    return {"steps": 3000, "probe_every": 100, "etas": [0.05, 0.1, 0.2, 0.3, 0.4], "probe_batch": 512, "lr": 0.05,
            "width": 64, "seeds": 5}


def _grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in model.parameters()]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params)
    return loss.item(), [gi.detach() for gi in grads]


def _probe(model: nn.Module, x: torch.Tensor, y: torch.Tensor, etas: list[float]) -> dict:
    """Loss and gradient along -g; BN uses batch statistics (as in training) without updating its
    running estimates."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    moms = [m.momentum for m in bns]
    for m in bns:
        m.momentum = 0.0
    params = list(model.parameters())
    base = [p.detach().clone() for p in params]
    loss0, g0 = _grad(model, x, y)
    gnorm = math.sqrt(sum(float((gi ** 2).sum()) for gi in g0))
    losses, changes, betas = [loss0], [], []
    for eta in etas:
        with torch.no_grad():
            for p, b, gi in zip(params, base, g0):
                p.copy_(b - eta * gi)
        li, gi_ = _grad(model, x, y)
        diff = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(gi_, g0)))
        losses.append(li)
        changes.append(diff)
        betas.append(diff / max(eta * gnorm, 1e-12))
    with torch.no_grad():
        for p, b in zip(params, base):
            p.copy_(b)
    for m, mom in zip(bns, moms):
        m.momentum = mom
    finite = [v for v in losses if math.isfinite(v)]
    return {"loss_range": (max(finite) - min(finite)) if finite else float("inf"),
            "grad_change": max(changes) if changes else 0.0, "beta": max(betas) if betas else 0.0}


def _train(ctx: Context, cfg: dict, variant: str, seed: int) -> dict:
    xtr, ytr, xte, yte = digits()
    g = seed_all(seed)
    norm = "none" if variant == "none" else "batch"
    model = SmallCNN(norm, cfg["width"], vgg=True, wrap=NoisyAfter if variant == "batch-noisy" else None)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    probe_idx = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(99))[: cfg["probe_batch"]]
    px, py = xtr[probe_idx], ytr[probe_idx]
    probes, losses = [], []
    perm = torch.randperm(len(xtr), generator=g)
    pos = 0
    for step in range(1, cfg["steps"] + 1):
        model.train()
        if pos + 32 > len(perm):
            perm, pos = torch.randperm(len(xtr), generator=g), 0
        idx = perm[pos:pos + 32]
        pos += 32
        if variant != "batch-noisy" and (step == 1 or step % cfg["probe_every"] == 0):
            probes.append({"step": step, **_probe(model, px, py, cfg["etas"])})
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        if not torch.isfinite(loss):
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ctx.progress(f"{VARIANTS[variant]} s={seed}", step, cfg["steps"], f"loss {loss.item():.3f}")
    return {"probes": probes, "acc": 100 - error_rate(model, xte, yte), "final_loss": losses[-1] if losses else None,
            "source": norm_sources(model)}


def execute(ctx: Context, cfg: dict) -> dict:
    runs = []
    for variant in VARIANTS:
        for seed in ctx.seeds:
            key = {"variant": variant, "seed": seed, **{k: cfg[k] for k in ("steps", "probe_every", "etas",
                                                                            "probe_batch", "lr", "width")}}
            r = ctx.cached(key, lambda v=variant, s=seed: _train(ctx, cfg, v, s))
            ctx.sources[variant] = r["source"]
            runs.append({"variant": variant, "seed": seed, **r})
    med = {}
    for v in ("batch", "none"):
        ps = [p for r in runs if r["variant"] == v for p in r["probes"]]
        med[v] = {k: float(torch.tensor([p[k] for p in ps]).median()) for k in ("loss_range", "grad_change", "beta")}
    acc = {v: mean_std([r["acc"] for r in runs if r["variant"] == v])[0] for v in VARIANTS}
    return {"runs": runs, "median": med, "acc": acc}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    colors = {"batch": "tab:blue", "none": "tab:red"}
    for ax, k, title in zip(axes, ("loss_range", "grad_change", "beta"),
                            ("loss range along -g", "max gradient change", "effective beta-smoothness")):
        for r in metrics["runs"]:
            if r["variant"] in colors and r["probes"]:
                ax.plot([p["step"] for p in r["probes"]], [p[k] for p in r["probes"]], color=colors[r["variant"]],
                        alpha=0.8, label=VARIANTS[r["variant"]] if r["seed"] == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_title(f"{title} (n={len(ctx.seeds)} seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    ctx.savefig(fig, "smoothness")


def verdicts(metrics: dict) -> list:
    m, acc = metrics["median"], metrics["acc"]
    return [smoothness_rule(m["batch"], m["none"]), noisy_rule(acc["batch-noisy"], acc["none"], acc["batch"])]
