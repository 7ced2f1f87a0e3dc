"""rms-vs-layer: RMSNorm vs LayerNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization").

Part 1: the operator's cost, like with like. Forward+backward CPU time of LayerNorm
and RMSNorm on the same (rows, features) tensor, interleaved, median per timing block, >= 3
blocks, in three implementation styles: both as plain-PyTorch formulas (judged: the same style
for both, as the paper compared them within one framework), both through normscope's reference
backend, and torch's fused kernels (``F.layer_norm`` vs ``F.rms_norm``: kernel maturity, reported
only).

Part 2: a small Pre-LN character-level transformer on the Python standard library's own source
with LayerNorm or RMSNorm (quality, at the middle depth) and, over a depth sweep, LayerNorm
against no normalization (does a deep transformer without a norm fail?).
"""

from __future__ import annotations

import statistics
import time

import torch

import normscope

from .core import Context, mean_std, pyplot, seed_all
from .data import char_splits, unigram_entropy
from .models import TinyTransformer, norm_sources, train_lm
from .verdicts import no_norm_rule, rms_quality_rule, rms_speed_rule

NAME = "rms-vs-layer"
TITLE = "RMSNorm vs LayerNorm: cost and quality"
VOCAB = 128
NORMS = ["layer", "rms", "none"]
VERSION = "2"  # 2: like-with-like CPU timing, depth sweep for the no-norm claim, >= 3 seeds


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"op_shape": [256, 64], "op_reps": 5, "op_blocks": 3, "d": 32, "depths": [1, 2], "quality_depth": 2,
                "seq": 32, "batch": 8, "steps": 20, "lr": 3e-3, "n_chars": 50_000, "seeds": 1}
    if mode == "quick":
        return {"op_shape": [4096, 512], "op_reps": 15, "op_blocks": 3, "d": 64, "depths": [2, 4, 8],
                "quality_depth": 4, "seq": 32, "batch": 16, "steps": 150, "lr": 3e-3, "n_chars": 300_000, "seeds": 3}
    return {"op_shape": [8192, 1024], "op_reps": 100, "op_blocks": 5, "d": 128, "depths": [2, 6, 12, 24],
            "quality_depth": 6, "seq": 128, "batch": 32, "steps": 4000, "lr": 1e-3, "n_chars": 2_000_000, "seeds": 5}


def _ln_formula(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * w + b


def _rms_formula(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _time_ops(shape: list[int], reps: int, blocks: int) -> dict[str, dict]:
    """Per style, per block: median CPU milliseconds (``time.process_time``: this process only,
    so other processes' load does not count) of forward+backward for LN and RMSNorm, the two
    alternating every repetition."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    dy = torch.randn(*shape, generator=g)
    d = shape[-1]
    w = torch.ones(d, requires_grad=True)
    b = torch.zeros(d, requires_grad=True)
    ref = {"layer": normscope.LayerNorm(d), "rms": normscope.RMSNorm(d)}
    styles = {
        "formula": {"layer": lambda: _ln_formula(x, w, b), "rms": lambda: _rms_formula(x, w)},
        "reference": {"layer": lambda: ref["layer"](x), "rms": lambda: ref["rms"](x)},
        "fused": {"layer": lambda: F.layer_norm(x, (d,), w, b), "rms": lambda: F.rms_norm(x, (d,), w)},
    }
    out: dict[str, dict] = {}
    for style, fns in styles.items():
        per_block = []
        for _ in range(blocks):
            times: dict[str, list[float]] = {"layer": [], "rms": []}
            ctxm = normscope.use_backend("reference") if style == "reference" else _null()
            with ctxm:
                for rep in range(reps + 2):
                    for name, fn in fns.items():
                        t0 = time.process_time()
                        fn().backward(dy)
                        dt = time.process_time() - t0
                        x.grad = w.grad = b.grad = None
                        if rep >= 2:  # warm-up repetitions are not timed
                            times[name].append(dt * 1000)
            med = {k: statistics.median(v) for k, v in times.items()}
            per_block.append({**med, "ratio": med["rms"] / med["layer"]})
        out[style] = {"blocks": per_block}
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def execute(ctx: Context, cfg: dict) -> dict:
    # timings are not cached: they describe this machine now
    ops = _time_ops(cfg["op_shape"], cfg["op_reps"], cfg["op_blocks"])
    ctx.progress("operator timing", 1, 1, "")
    train, val = char_splits(cfg["n_chars"])
    h_uni = unigram_entropy(train, VOCAB)
    plan = [(n, dep) for dep in cfg["depths"] for n in ("layer", "none")] + [("rms", cfg["quality_depth"])]
    runs = []
    for norm, depth in plan:
        for seed in ctx.seeds:
            key = {"norm": norm, "seed": seed, "depth": depth, **{k: cfg[k] for k in ("d", "seq", "batch", "steps",
                                                                                     "lr", "n_chars")}}

            def go(norm=norm, seed=seed, depth=depth) -> dict:
                g = seed_all(seed)
                model = TinyTransformer(VOCAB, VOCAB, d=cfg["d"], depth=depth, max_len=cfg["seq"], norm=norm,
                                        prenorm=True, causal=True)
                out = train_lm(model, train, val, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"],
                               lr=cfg["lr"], warmup=0, g=g, fail_above=h_uni,
                               tick=lambda s, t, i: ctx.progress(f"char LM {norm} L={depth} s={seed}", s, t, i))
                return {**out, "source": norm_sources(model)}

            r = ctx.cached(key, go)
            ctx.sources[norm] = r["source"]
            runs.append({"norm": norm, "seed": seed, "depth": depth, **r})

    def sel(n: str, dep: int, field: str) -> list[float]:
        return [float(r[field]) for r in runs if r["norm"] == n and r["depth"] == dep]

    by_depth = {str(dep): {n: {"val_loss": mean_std(sel(n, dep, "val_loss"))[0],
                               "val_loss_std": mean_std(sel(n, dep, "val_loss"))[1],
                               "failed": mean_std(sel(n, dep, "failed"))[0],
                               "ms_per_step": mean_std(sel(n, dep, "ms_per_step"))[0]}
                           for n in NORMS if sel(n, dep, "val_loss")} for dep in cfg["depths"]}
    return {"op_ms": ops, "op_shape": cfg["op_shape"], "runs": runs, "by_depth": by_depth,
            "quality_depth": cfg["quality_depth"], "unigram_entropy": h_uni}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    styles = list(metrics["op_ms"])
    w = 0.35
    for i, n in enumerate(("layer", "rms")):
        vals = [statistics.median(b[n] for b in metrics["op_ms"][s]["blocks"]) for s in styles]
        ax.bar([j + i * w for j in range(len(styles))], vals, w, label={"layer": "LayerNorm", "rms": "RMSNorm"}[n])
    ax.set_xticks([j + w / 2 for j in range(len(styles))], styles)
    ax.set_ylabel("CPU ms, forward + backward (median)")
    ax.set_title(f"{tuple(metrics['op_shape'])} fp32, {cfg['op_blocks']} blocks", fontsize=9)
    ax.legend()
    ax = axes[1]
    depths = [int(d) for d in metrics["by_depth"]]
    for n, c in (("layer", "tab:blue"), ("none", "tab:red")):
        ax.errorbar(depths, [metrics["by_depth"][str(d)][n]["val_loss"] for d in depths],
                    yerr=[metrics["by_depth"][str(d)][n]["val_loss_std"] for d in depths], marker="o", color=c,
                    capsize=3, label={"layer": "Pre-LN (LN)", "none": "no norm"}[n])
    q = metrics["by_depth"][str(metrics["quality_depth"])]
    if "rms" in q:
        ax.errorbar([metrics["quality_depth"]], [q["rms"]["val_loss"]], yerr=[q["rms"]["val_loss_std"]], marker="s",
                    color="tab:green", capsize=3, label="RMSNorm")
    ax.axhline(metrics["unigram_entropy"], color="gray", ls="--", label="unigram entropy (fail line)")
    ax.set_xlabel("layers")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"char LM, mean ± std over n={len(ctx.seeds)} seeds", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ctx.savefig(fig, "rms_vs_layer")


def verdicts(metrics: dict) -> list:
    q = metrics["by_depth"][str(metrics["quality_depth"])]
    deepest = max(metrics["by_depth"], key=int)
    dd = metrics["by_depth"][deepest]
    ln_failed_any = any(v["layer"]["failed"] > 0 for v in metrics["by_depth"].values())
    return [rms_quality_rule(q["layer"]["val_loss"], q["rms"]["val_loss"]),
            rms_speed_rule([b["ratio"] for b in metrics["op_ms"]["formula"]["blocks"]]),
            no_norm_rule(int(deepest), dd["none"]["failed"], dd["none"]["val_loss"], dd["layer"]["val_loss"],
                            ln_failed_any)]
