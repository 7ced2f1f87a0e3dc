"""prenorm: Post-LN vs Pre-LN transformers (Xiong et al. 2020, "On Layer Normalization in the
Transformer Architecture").

Part 1, no training, the paper's Fig. 3: the gradient norm of each layer's second
feed-forward weight (W2) at initialization in a 6+6 layer *encoder-decoder* with cross-attention,
Post-LN (x <- LN(x + f(x))) vs Pre-LN (x <- x + f(LN(x))), Xavier init, on a sequence-reversal
batch of Python standard-library source (source: a window of characters, target: the window
reversed, teacher-forced). The theorem's other half: the last layer's W2 gradient against depth
(2 to 32) in a decoder-only stack, and its log-log slope (Post-LN ~ 0, Pre-LN ~ -1/2).

Part 2, training: a 6-layer character LM with Adam over a pre-registered learning-rate grid,
Post-LN without / with linear warm-up and Pre-LN without, counting failed runs (non-finite loss,
or a validation loss no better than the unigram entropy). Decoder-only, not the paper's
translation model: the budget is minutes on a CPU.
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from .core import Context, mean_std, pyplot, seed_all
from .data import char_batch, char_splits, unigram_entropy
from .models import EncoderDecoder, TinyTransformer, lm_loss, norm_sources, train_lm
from .verdicts import depth_rule, prenorm_grad_rule, warmup_rule

NAME = "prenorm"
TITLE = "Pre-LN vs Post-LN: gradients at init and warm-up"
VERSION = "2"  # 2: encoder-decoder gradients, depth slope, learning-rate grid, >= 3 seeds
VOCAB = 128


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"depths": [2, 4], "grad_seeds": 1, "d": 32, "seq": 32, "batch": 8, "train_depth": 2, "encdec_depth": 2,
                "steps": 20, "warmup": 10, "lrs": [1e-3], "n_chars": 50_000, "seeds": 1}
    if mode == "quick":
        return {"depths": [2, 4, 8, 16, 32], "grad_seeds": 3, "d": 64, "seq": 32, "batch": 16, "train_depth": 6,
                "encdec_depth": 6, "steps": 100, "warmup": 30, "lrs": [1e-3, 3e-3, 1e-2], "n_chars": 300_000,
                "seeds": 3}
    return {"depths": [2, 4, 6, 8, 12, 16, 24, 32], "grad_seeds": 5, "d": 128, "seq": 128, "batch": 32,
            "train_depth": 12, "encdec_depth": 6, "steps": 4000, "warmup": 1000, "lrs": [5e-4, 1e-3, 3e-3, 1e-2],
            "n_chars": 2_000_000, "seeds": 5}


def _encdec_grad_norms(cfg: dict, prenorm: bool, seed: int) -> dict[str, list[float]]:
    """|dL/dW2| per encoder and decoder layer at init, on a reversal batch (BOS = 0)."""
    train, _ = char_splits(cfg["n_chars"])
    g = seed_all(seed)
    model = EncoderDecoder(VOCAB, d=cfg["d"], depth=cfg["encdec_depth"], max_len=cfg["seq"] + 1, prenorm=prenorm)
    src, _ = char_batch(train, cfg["batch"], cfg["seq"], g)
    tgt = src.flip(1)
    tgt_in = F.pad(tgt[:, :-1], (1, 0))
    logits = model(src, tgt_in)
    F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)).backward()
    return {"encoder": [float(b.ff2.weight.grad.norm()) for b in model.encoder],
            "decoder": [float(b.ff2.weight.grad.norm()) for b in model.decoder], "source": norm_sources(model)}


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _grad_norms(cfg: dict, depth: int, prenorm: bool, seed: int) -> list[float]:
    train, _ = char_splits(cfg["n_chars"])
    g = seed_all(seed)
    model = TinyTransformer(VOCAB, VOCAB, d=cfg["d"], depth=depth, max_len=cfg["seq"], norm="layer",
                            prenorm=prenorm, causal=True)
    x, y = char_batch(train, cfg["batch"], cfg["seq"], g)
    lm_loss(model, x, y).backward()
    return [float(b.ff2.weight.grad.norm()) for b in model.blocks]


def execute(ctx: Context, cfg: dict) -> dict:
    grads: dict[str, dict[str, list[float]]] = {"post": {}, "pre": {}}
    total = len(cfg["depths"]) * 2 * cfg["grad_seeds"]
    done = 0
    for depth in cfg["depths"]:
        for kind in ("post", "pre"):
            per_seed = []
            for seed in range(cfg["grad_seeds"]):
                key = {"part": "grad", "depth": depth, "kind": kind, "seed": seed, "d": cfg["d"], "seq": cfg["seq"],
                       "batch": cfg["batch"], "n_chars": cfg["n_chars"]}
                per_seed.append(ctx.cached(key, lambda d=depth, k=kind, s=seed: {
                    "norms": _grad_norms(cfg, d, k == "pre", s)})["norms"])
                done += 1
                ctx.progress("gradient norms at init", done, total, f"depth {depth} {kind}")
            grads[kind][str(depth)] = [sum(v) / len(v) for v in zip(*per_seed)]
    ratios = {k: {d: v[-1] / v[0] for d, v in grads[k].items()} for k in grads}
    depths = [int(d) for d in grads["post"]]
    slopes = {k: _slope(depths, [grads[k][str(d)][-1] for d in depths]) for k in grads}

    encdec: dict[str, dict[str, list[float]]] = {}
    for kind in ("post", "pre"):
        per_seed = []
        for seed in range(cfg["grad_seeds"]):
            key = {"part": "encdec", "kind": kind, "seed": seed, **{k: cfg[k] for k in
                   ("d", "seq", "batch", "n_chars", "encdec_depth")}}
            per_seed.append(ctx.cached(key, lambda k=kind, s=seed: _encdec_grad_norms(cfg, k == "pre", s)))
            ctx.sources[f"encdec {kind}"] = per_seed[-1]["source"]
        encdec[kind] = {stack: [sum(v) / len(v) for v in zip(*[p[stack] for p in per_seed])]
                        for stack in ("encoder", "decoder")}
    encdec_ratio = {k: {stack: v[-1] / v[0] for stack, v in encdec[k].items()} for k in encdec}

    train, val = char_splits(cfg["n_chars"])
    h_uni = unigram_entropy(train, VOCAB)
    variants = {"post": (False, 0), "post+warmup": (False, cfg["warmup"]), "pre": (True, 0)}
    runs = []
    for lr in cfg["lrs"]:
        for name, (prenorm, warmup) in variants.items():
            for seed in ctx.seeds:
                key = {"part": "train", "variant": name, "seed": seed, "lr": lr, **{k: cfg[k] for k in
                       ("d", "seq", "batch", "train_depth", "steps", "warmup", "n_chars")}}

                def go(prenorm=prenorm, warmup=warmup, seed=seed, name=name, lr=lr) -> dict:
                    g = seed_all(seed)
                    model = TinyTransformer(VOCAB, VOCAB, d=cfg["d"], depth=cfg["train_depth"], max_len=cfg["seq"],
                                            norm="layer", prenorm=prenorm, causal=True)
                    out = train_lm(model, train, val, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"],
                                   lr=lr, warmup=warmup, g=g, fail_above=h_uni,
                                   tick=lambda s, t, i: ctx.progress(f"train {name} lr={lr} s={seed}", s, t, i))
                    return {**out, "source": norm_sources(model)}

                r = ctx.cached(key, go)
                ctx.sources["train"] = r["source"]
                runs.append({"variant": name, "seed": seed, "lr": lr, **r})
    by_lr = {str(lr): {v: {"loss": mean_std([r["val_loss"] for r in runs if r["variant"] == v and r["lr"] == lr])[0],
                           "failed": mean_std([float(r["failed"]) for r in runs
                                               if r["variant"] == v and r["lr"] == lr])[0]}
                       for v in variants} for lr in cfg["lrs"]}
    return {"grad_norms": grads, "top_bottom_ratio": ratios, "depth_slope": slopes, "encdec_grad_norms": encdec,
            "encdec_ratio": encdec_ratio, "train_runs": runs, "by_lr": by_lr, "unigram_entropy": h_uni}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    depths = cfg["depths"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, kind, title in zip(axes, ("post", "pre"), ("Post-LN", "Pre-LN")):
        for i, d in enumerate(depths):
            v = metrics["grad_norms"][kind][str(d)]
            ax.plot(range(1, len(v) + 1), v, marker="o", ms=3, color=cmap(i / max(len(depths) - 1, 1)),
                    label=f"{d} layers")
        ax.set_title(f"{title}: |dL/dW2| per layer at init")
        ax.set_xlabel("layer (1 = bottom)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"gradient norm (mean of n={cfg['grad_seeds']} seeds)")
    axes[1].legend(fontsize=8)
    ctx.savefig(fig, "prenorm_grad_norms")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, stack in zip(axes, ("encoder", "decoder")):
        for kind, c in (("post", "tab:red"), ("pre", "tab:blue")):
            v = metrics["encdec_grad_norms"][kind][stack]
            ax.plot(range(1, len(v) + 1), v, marker="o", color=c, label={"post": "Post-LN", "pre": "Pre-LN"}[kind])
        ax.set_title(f"{stack}: |dL/dW2| at init (n={cfg['grad_seeds']} seeds)")
        ax.set_xlabel("layer (1 = bottom)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gradient norm")
    axes[0].legend()
    ctx.savefig(fig, "prenorm_encdec_grad_norms")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors = {"post": "tab:red", "post+warmup": "tab:orange", "pre": "tab:blue"}
    lrs = sorted(metrics["by_lr"], key=float)
    for v, c in colors.items():
        ys = [metrics["by_lr"][lr][v]["loss"] for lr in lrs]
        ax.plot([float(lr) for lr in lrs], [y if math.isfinite(y) else float("nan") for y in ys], marker="o",
                color=c, label=v)
    ax.axhline(metrics["unigram_entropy"], color="gray", ls="--", label="unigram entropy (fail line)")
    ax.set_xscale("log")
    ax.set_xlabel("Adam learning rate")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"{cfg['train_depth']}-layer char LM, {cfg['steps']} steps (mean of n={len(ctx.seeds)} seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ctx.savefig(fig, "prenorm_training")


def verdicts(metrics: dict) -> list:
    return [prenorm_grad_rule(metrics["encdec_ratio"]["post"], metrics["encdec_ratio"]["pre"]),
            depth_rule(metrics["depth_slope"]["post"], metrics["depth_slope"]["pre"]),
            warmup_rule(metrics["by_lr"])]


