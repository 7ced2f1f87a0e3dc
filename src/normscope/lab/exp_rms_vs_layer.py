"""rms-vs-layer: RMSNorm vs LayerNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization").

Part 1: the operator's cost -- forward+backward time of LayerNorm and RMSNorm on the same
(rows, features) tensor, interleaved and repeated, median taken (the default backend, which is
PyTorch's fused ops where they exist, and the readable reference backend).

Part 2: a small Pre-LN character-level transformer on the Python standard library's own source
with LayerNorm, RMSNorm or no normalization: validation loss and time per training step.
"""

from __future__ import annotations

import statistics
import time

import torch

import normscope

from .core import Context, mean_std, pyplot, seed_all
from .data import char_splits, unigram_entropy
from .models import TinyTransformer, train_lm
from .verdicts import no_norm_rule, rms_quality_rule, rms_speed_rule

NAME = "rms-vs-layer"
TITLE = "RMSNorm vs LayerNorm: cost and quality"
VOCAB = 128
NORMS = ["layer", "rms", "none"]


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"op_shape": [256, 64], "op_reps": 5, "d": 32, "depth": 2, "seq": 32, "batch": 8, "steps": 20,
                "lr": 3e-3, "n_chars": 50_000, "seeds": 1}
    if mode == "quick":
        return {"op_shape": [4096, 512], "op_reps": 30, "d": 64, "depth": 4, "seq": 64, "batch": 16, "steps": 300,
                "lr": 3e-3, "n_chars": 300_000, "seeds": 2}
    return {"op_shape": [8192, 1024], "op_reps": 100, "d": 128, "depth": 6, "seq": 128, "batch": 32, "steps": 4000,
            "lr": 1e-3, "n_chars": 2_000_000, "seeds": 5}


def _time_ops(shape: list[int], reps: int, backend: str | None) -> dict[str, float]:
    """Median milliseconds of forward+backward for each norm; LN and RMS alternate every
    repetition so that load from other processes hits both alike."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    dy = torch.randn(*shape, generator=g)
    layers = {"layer": normscope.LayerNorm(shape[-1]), "rms": normscope.RMSNorm(shape[-1])}
    times: dict[str, list[float]] = {k: [] for k in layers}
    with normscope.use_backend(backend):
        for rep in range(reps + 3):
            for name, layer in layers.items():
                t0 = time.perf_counter()
                layer(x).backward(dy)
                dt = time.perf_counter() - t0
                x.grad = None
                if rep >= 3:  # warm-up repetitions are not timed
                    times[name].append(dt * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def execute(ctx: Context, cfg: dict) -> dict:
    ops = {}
    for backend in (None, "reference"):
        label = backend or "auto"
        # timings are not cached: they describe this machine now
        ops[label] = _time_ops(cfg["op_shape"], cfg["op_reps"], backend)
        ctx.progress("operator timing", 1 if backend is None else 2, 2, label)
    train, val = char_splits(cfg["n_chars"])
    h_uni = unigram_entropy(train, VOCAB)
    runs = []
    for norm in NORMS:
        for seed in ctx.seeds:
            key = {"norm": norm, "seed": seed, **{k: cfg[k] for k in ("d", "depth", "seq", "batch", "steps", "lr",
                                                                      "n_chars")}}

            def go(norm=norm, seed=seed) -> dict:
                g = seed_all(seed)
                model = TinyTransformer(VOCAB, VOCAB, d=cfg["d"], depth=cfg["depth"], max_len=cfg["seq"], norm=norm,
                                        prenorm=True, causal=True)
                return train_lm(model, train, val, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"],
                                lr=cfg["lr"], warmup=0, g=g, fail_above=h_uni,
                                tick=lambda s, t, i: ctx.progress(f"char LM {norm} s={seed}", s, t, i))

            runs.append({"norm": norm, "seed": seed, **ctx.cached(key, go)})
    val_loss = {n: mean_std([r["val_loss"] for r in runs if r["norm"] == n]) for n in NORMS}
    failed = {n: mean_std([float(r["failed"]) for r in runs if r["norm"] == n])[0] for n in NORMS}
    ms = {n: mean_std([r["ms_per_step"] for r in runs if r["norm"] == n])[0] for n in NORMS}
    return {"op_ms": ops, "op_shape": cfg["op_shape"], "runs": runs,
            "val_loss": {n: {"mean": m, "std": s} for n, (m, s) in val_loss.items()}, "failed": failed,
            "ms_per_step": ms, "unigram_entropy": h_uni}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    backends = list(metrics["op_ms"])
    w = 0.35
    for i, n in enumerate(("layer", "rms")):
        ax.bar([j + i * w for j in range(len(backends))], [metrics["op_ms"][b][n] for b in backends], w,
               label={"layer": "LayerNorm", "rms": "RMSNorm"}[n])
    ax.set_xticks([j + w / 2 for j in range(len(backends))], [f"backend: {b}" for b in backends])
    ax.set_ylabel("ms, forward + backward (median)")
    ax.set_title(f"operator cost on {tuple(metrics['op_shape'])} fp32")
    ax.legend()
    ax = axes[1]
    colors = {"layer": "tab:blue", "rms": "tab:green", "none": "tab:red"}
    for r in metrics["runs"]:
        c = r["curve"]
        if c:
            ax.plot([p[0] for p in c], [p[1] for p in c], color=colors[r["norm"]],
                    label=r["norm"] if r["seed"] == 0 else None)
    ax.axhline(metrics["unigram_entropy"], color="gray", ls="--", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title("char LM on the stdlib's source")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ctx.savefig(fig, "rms_vs_layer")


def verdicts(metrics: dict) -> list:
    vl = metrics["val_loss"]
    return [rms_quality_rule(vl["layer"]["mean"], vl["rms"]["mean"]),
            rms_speed_rule(metrics["op_ms"]["auto"]["layer"], metrics["op_ms"]["auto"]["rms"],
                           "operator fwd+bwd, default backend"),
            no_norm_rule(metrics["failed"]["none"], vl["layer"]["mean"], vl["none"]["mean"])]
