"""contrast-style: InstanceNorm removes per-image contrast (Ulyanov et al. 2016, "Instance
Normalization"); AdaIN puts style back by swapping statistics (Huang & Belongie 2017).

Part 1: the digits CNN with BN / IN (GN G=C) / GN / LN (GN G=1) trained on clean images, tested on
images whose contrast and brightness are changed per image (x -> a x + b with fixed a, b and
with a, b drawn per image). Zero padding at the borders keeps IN from being exactly invariant.

Part 2: AdaIN on generated textures: the per-channel statistics of a "style" texture are put on
a "content" texture; the output's statistics are checked against the style's.
"""

from __future__ import annotations

import math

import torch

from .core import Context, mean_std, pyplot, seed_all
from .data import digits
from .models import SmallCNN, error_rate, norm_sources, train_classifier
from .norms import Missing, adain_fn
from .verdicts import ADAIN_CLAIM, ADAIN_PUBLISHED, adain_rule, contrast_rule, skipped

NAME = "contrast-style"
TITLE = "InstanceNorm, contrast and style"
NORMS = ["batch", "instance", "group:8", "layer"]
LABEL = {"batch": "BN", "instance": "IN", "group:8": "GN (G=8)", "layer": "LN"}
CONDITIONS = {"clean": (1.0, 0.0), "contrast x0.5": (0.5, 0.0), "contrast x2": (2.0, 0.0), "contrast x4": (4.0, 0.0),
              "brightness -1": (1.0, -1.0), "brightness +1": (1.0, 1.0), "random per image": None}


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"epochs": 1, "n_train": 256, "width": 8, "size": 16, "seeds": 1}
    if mode == "quick":
        return {"epochs": 6, "n_train": None, "width": 32, "size": 64, "seeds": 3}
    return {"epochs": 20, "n_train": None, "width": 32, "size": 128, "seeds": 5}


def _transform(x: torch.Tensor, cond: str) -> torch.Tensor:
    if CONDITIONS[cond] is not None:
        a, b = CONDITIONS[cond]
        return a * x + b
    g = torch.Generator().manual_seed(7)
    a = torch.exp((torch.rand(len(x), 1, 1, 1, generator=g) * 2 - 1) * math.log(4))  # log-uniform in [1/4, 4]
    b = torch.rand(len(x), 1, 1, 1, generator=g) * 2 - 1
    return a * x + b


def _textures(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Content: RGB stripes and a disc; style: a high-contrast, colour-shifted checkerboard with noise."""
    g = torch.Generator().manual_seed(3)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    stripes = torch.sin(xx * 12) * 0.5
    disc = ((xx ** 2 + yy ** 2) < 0.4).float()
    content = torch.stack([stripes + disc, 0.5 * stripes, disc - 0.3 * stripes])[None]
    checker = torch.sign(torch.sin(xx * 20) * torch.sin(yy * 20))
    style = torch.stack([1.5 * checker + 2.0, 0.3 * checker - 1.0, 0.8 * checker + 0.5])[None]
    style = style + 0.3 * torch.randn(style.shape, generator=g)
    return content, style


def execute(ctx: Context, cfg: dict) -> dict:
    runs = []
    for norm in NORMS:
        for seed in ctx.seeds:
            key = {"norm": norm, "seed": seed, **{k: cfg[k] for k in ("epochs", "n_train", "width")}}

            def go(norm=norm, seed=seed) -> dict:
                xtr, ytr, xte, yte = digits()
                if cfg["n_train"]:
                    xtr, ytr = xtr[: cfg["n_train"]], ytr[: cfg["n_train"]]
                g = seed_all(seed)
                model = SmallCNN(norm, cfg["width"])
                train_classifier(model, xtr, ytr, batch=32, epochs=cfg["epochs"], lr=0.1, g=g,
                                 tick=lambda s, t, i: ctx.progress(f"{LABEL[norm]} s={seed}", s, t, i))
                acc = {c: 100 - error_rate(model, _transform(xte, c), yte) for c in CONDITIONS}
                return {"acc": acc, "source": norm_sources(model)}

            r = ctx.cached(key, go)
            ctx.sources[norm] = r["source"]
            runs.append({"norm": norm, "seed": seed, **r})
    acc = {n: {c: mean_std([r["acc"][c] for r in runs if r["norm"] == n])[0] for c in CONDITIONS} for n in NORMS}
    drop = {n: acc[n]["clean"] - mean_std([acc[n][c] for c in CONDITIONS if c != "clean"])[0] for n in NORMS}
    adain: dict = {}
    try:
        fn = adain_fn()
        content, style = _textures(cfg["size"])
        out = fn(content, style)
        err = max(float((out.mean((2, 3)) - style.mean((2, 3))).abs().max()),
                  float((out.std((2, 3), unbiased=False) - style.std((2, 3), unbiased=False)).abs().max()))
        adain = {"max_stat_err": err}
        torch.save({"content": content, "style": style, "out": out.detach()}, ctx.out / "adain_tensors.pt")
    except Missing as why:
        ctx.skipped["adain"] = str(why)
        adain = {"skipped": str(why)}
    return {"runs": runs, "acc": acc, "drop": drop, "adain": adain}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    conds = list(CONDITIONS)
    w = 0.8 / len(NORMS)
    for i, n in enumerate(NORMS):
        ax.bar([j + i * w for j in range(len(conds))], [metrics["acc"][n][c] for c in conds], w, label=LABEL[n])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(conds))], conds, fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"digits CNN, clean training, tested under x -> a x + b (n={len(ctx.seeds)} seeds)", fontsize=9)
    ax.legend(fontsize=8, ncol=4)
    ctx.savefig(fig, "contrast_accuracy")
    p = ctx.out / "adain_tensors.pt"
    if "max_stat_err" in metrics["adain"] and p.exists():
        t = torch.load(p)
        fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
        # one colour scale for all three (per channel, over the three images): a per-image
        # rescale would undo exactly the mean/std change AdaIN makes
        allpix = torch.cat([t[k][0].flatten(1) for k in ("content", "style", "out")], 1)
        lo, hi = allpix.amin(1), allpix.amax(1)
        for ax, k in zip(axes, ("content", "style", "out")):
            img = t[k][0].permute(1, 2, 0)
            img = (img - lo) / (hi - lo + 1e-8)
            ax.imshow(img.numpy())
            ax.set_title({"out": "AdaIN(content, style)"}.get(k, k))
            ax.axis("off")
        ctx.savefig(fig, "adain_demo")


def verdicts(metrics: dict) -> list:
    out = [contrast_rule(metrics["drop"])]
    a = metrics["adain"]
    out.append(adain_rule(a["max_stat_err"]) if "max_stat_err" in a
               else skipped(ADAIN_CLAIM, ADAIN_PUBLISHED, a["skipped"]))
    return out
