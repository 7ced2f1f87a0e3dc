"""prenorm: Post-LN vs Pre-LN transformers (Xiong et al. 2020, "On Layer Normalization in the
Transformer Architecture").

Part 1, no training: the gradient norm of each layer's second feed-forward weight (W2) at
initialization, for depths 2 to 32, Post-LN (x <- LN(x + f(x))) vs Pre-LN (x <- x + f(LN(x))),
Xavier init, on a character language-modelling batch of Python standard-library source.

Part 2, training: the same character model with Adam at a fixed learning rate, with and without
linear warm-up, counting failed runs (non-finite loss, or a validation loss no better than the
unigram entropy).
"""

from __future__ import annotations

from .core import Context, mean_std, pyplot, seed_all
from .data import char_batch, char_splits, unigram_entropy
from .models import TinyTransformer, lm_loss, train_lm
from .verdicts import prenorm_grad_rule, warmup_rule

NAME = "prenorm"
TITLE = "Pre-LN vs Post-LN: gradients at init and warm-up"
VOCAB = 128


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"depths": [2, 4], "grad_seeds": 1, "d": 32, "seq": 32, "batch": 8, "train_depth": 2,
                "steps": 20, "warmup": 10, "lr": 1e-3, "n_chars": 50_000, "seeds": 1}
    if mode == "quick":
        return {"depths": [2, 4, 8, 16, 32], "grad_seeds": 3, "d": 64, "seq": 64, "batch": 16, "train_depth": 6,
                "steps": 300, "warmup": 100, "lr": 1e-3, "n_chars": 300_000, "seeds": 2}
    return {"depths": [2, 4, 6, 8, 12, 16, 24, 32], "grad_seeds": 5, "d": 128, "seq": 128, "batch": 32,
            "train_depth": 12, "steps": 4000, "warmup": 1000, "lr": 1e-3, "n_chars": 2_000_000, "seeds": 5}


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

    train, val = char_splits(cfg["n_chars"])
    h_uni = unigram_entropy(train, VOCAB)
    variants = {"post": (False, 0), "post+warmup": (False, cfg["warmup"]), "pre": (True, 0)}
    runs = []
    for name, (prenorm, warmup) in variants.items():
        for seed in ctx.seeds:
            key = {"part": "train", "variant": name, "seed": seed, **{k: cfg[k] for k in
                   ("d", "seq", "batch", "train_depth", "steps", "warmup", "lr", "n_chars")}}

            def go(prenorm=prenorm, warmup=warmup, seed=seed, name=name) -> dict:
                g = seed_all(seed)
                model = TinyTransformer(VOCAB, VOCAB, d=cfg["d"], depth=cfg["train_depth"], max_len=cfg["seq"],
                                        norm="layer", prenorm=prenorm, causal=True)
                return train_lm(model, train, val, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"],
                                lr=cfg["lr"], warmup=warmup, g=g, fail_above=h_uni,
                                tick=lambda s, t, i: ctx.progress(f"train {name} s={seed}", s, t, i))

            runs.append({"variant": name, "seed": seed, **ctx.cached(key, go)})
    loss = {v: mean_std([r["val_loss"] for r in runs if r["variant"] == v])[0] for v in variants}
    failed = {v: mean_std([float(r["failed"]) for r in runs if r["variant"] == v])[0] for v in variants}
    return {"grad_norms": grads, "top_bottom_ratio": ratios, "train_runs": runs, "val_loss": loss,
            "failed": failed, "unigram_entropy": h_uni}


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
    axes[0].set_ylabel("gradient norm")
    axes[1].legend(fontsize=8)
    ctx.savefig(fig, "prenorm_grad_norms")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors = {"post": "tab:red", "post+warmup": "tab:orange", "pre": "tab:blue"}
    for r in metrics["train_runs"]:
        c = r["curve"]
        if c:
            ax.plot([p[0] for p in c], [p[1] for p in c], color=colors[r["variant"]], alpha=0.8,
                    label=r["variant"] if r["seed"] == 0 else None)
    ax.axhline(metrics["unigram_entropy"], color="gray", ls="--", label="unigram entropy (fail line)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title(f"{cfg['train_depth']}-layer char LM, Adam lr {cfg['lr']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ctx.savefig(fig, "prenorm_training")


def verdicts(metrics: dict) -> list:
    deepest = max(metrics["top_bottom_ratio"]["post"], key=int)
    return [prenorm_grad_rule(metrics["top_bottom_ratio"]["post"][deepest],
                              metrics["top_bottom_ratio"]["pre"][deepest], int(deepest)),
            warmup_rule(metrics["val_loss"], metrics["failed"])]


