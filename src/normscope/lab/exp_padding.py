"""padding: BatchNorm in a transformer on heavily padded sequences (Shen et al. 2020, "PowerNorm:
Rethinking Batch Normalization in Transformers").

Part 1: a 2-layer Pre-LN transformer encoder classifies generated variable-length sequences
(~70% of positions are padding; the fraction varies from batch to batch) with LN, RMSNorm,
plain BN (statistics count the pads), masked BN (statistics over real tokens only), PowerNorm,
DyT or no norm. Attention and pooling are masked in every variant: only the norm differs.
PowerNorm switches from batch to running statistics after a quarter of the steps.

Part 2: how far each batch's statistics are from the running ones -- mean over channels of
|mu_B - mu| / sigma and |var_B / var - 1| at every BN layer -- for a BN CNN on digit images and
a BN transformer on text (Python standard-library source, no padding), both trained briefly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .core import Context, mean_std, pyplot, seed_all
from .data import char_batch, char_splits, digits, padded_sequences
from .models import SmallCNN, TinyTransformer, lm_loss, norm_sources, train_classifier
from .norms import available
from .verdicts import fluctuation_rule, padding_rule, power_rule, skipped

NAME = "padding"
TITLE = "Padding, BatchNorm and transformers"
VERSION = "2"  # 2: layers from normscope.get_norm (masked BN native, PowerNorm, DyT)
NORMS = ["layer", "rms", "batch", "batch-masked", "power", "dyt", "none"]
LABEL = {"layer": "LN", "rms": "RMSNorm", "batch": "BN (pads counted)", "batch-masked": "masked BN",
         "power": "PowerNorm", "dyt": "DyT", "none": "none"}


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"n_train": 256, "n_test": 128, "d": 16, "depth": 1, "steps": 10, "batch": 16, "lr": 1e-3,
                "fluct_steps": 10, "fluct_batches": 3, "n_chars": 50_000, "seeds": 1}
    if mode == "quick":
        return {"n_train": 4000, "n_test": 1000, "d": 32, "depth": 2, "steps": 400, "batch": 32, "lr": 2e-3,
                "fluct_steps": 150, "fluct_batches": 20, "n_chars": 300_000, "seeds": 2}
    return {"n_train": 20000, "n_test": 4000, "d": 64, "depth": 4, "steps": 4000, "batch": 32, "lr": 1e-3,
            "fluct_steps": 1000, "fluct_batches": 100, "n_chars": 2_000_000, "seeds": 5}


def _train_seq(ctx: Context, cfg: dict, norm: str, seed: int) -> dict:
    tok, mask, lab = padded_sequences(cfg["n_train"] + cfg["n_test"], seed=1234)
    n = cfg["n_train"]
    g = seed_all(seed)
    # PowerNorm uses batch statistics for its first warmup_iters steps (the reference's default is
    # 10000, longer than these runs): a quarter of the run here
    kw = {"warmup_iters": cfg["steps"] // 4} if norm == "power" else None
    model = TinyTransformer(12, 2, d=cfg["d"], depth=cfg["depth"], max_len=tok.shape[1], norm=norm, pool=True,
                            norm_kwargs=kw)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    for step in range(1, cfg["steps"] + 1):
        model.train()
        idx = torch.randint(0, n, (cfg["batch"],), generator=g)
        loss = F.cross_entropy(model(tok[idx], mask[idx]), lab[idx])
        if not torch.isfinite(loss):
            return {"acc": 0.0, "diverged": True, "source": norm_sources(model)}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.progress(f"{LABEL[norm]} s={seed}", step, cfg["steps"], f"loss {loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(tok[i:i + 256], mask[i:i + 256]).argmax(1) for i in range(n, len(tok), 256)])
    acc = 100.0 * float((pred == lab[n:]).float().mean())
    return {"acc": acc, "diverged": False, "source": norm_sources(model)}


def _bn_distance(model: nn.Module, batches) -> dict[str, float]:
    """Mean over BN layers, channels and batches of |mu_B - mu|/sigma and |var_B/var - 1|."""
    dm, dv = [], []

    def hook(mod, inp, _out):
        x = inp[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        mu, var = x.mean(dims), x.var(dims, unbiased=False)
        sd = (mod.running_var + mod.eps).sqrt()
        dm.append(float(((mu - mod.running_mean).abs() / sd).mean()))
        dv.append(float((var / (mod.running_var + mod.eps) - 1).abs().mean()))

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model.eval()
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {"mean": mean_std(dm)[0], "var": mean_std(dv)[0], "total": mean_std(dm)[0] + mean_std(dv)[0]}


def _fluctuation(ctx: Context, cfg: dict, seed: int) -> dict:
    g = seed_all(seed)
    xtr, ytr, _, _ = digits()
    cnn = SmallCNN("batch", 32)
    steps_img = cfg["fluct_steps"]
    epochs = max(1, round(steps_img * 32 / len(xtr)))
    train_classifier(cnn, xtr, ytr, batch=32, epochs=epochs, lr=0.1, g=g,
                     tick=lambda s, t, i: ctx.progress("fluctuation: images", s, t, i))
    img_batches = [xtr[torch.randperm(len(xtr), generator=g)[:32]] for _ in range(cfg["fluct_batches"])]
    images = _bn_distance(cnn, img_batches)

    train, _ = char_splits(cfg["n_chars"])
    lm = TinyTransformer(128, 128, d=cfg["d"], depth=cfg["depth"], max_len=64, norm="batch", causal=True)
    opt = torch.optim.Adam(lm.parameters(), lr=cfg["lr"])
    for step in range(1, cfg["fluct_steps"] + 1):
        lm.train()
        x, y = char_batch(train, 32, 64, g)
        loss = lm_loss(lm, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.progress("fluctuation: text", step, cfg["fluct_steps"], f"loss {loss.item():.3f}")
    text = _bn_distance(lm, [char_batch(train, 32, 64, g)[0] for _ in range(cfg["fluct_batches"])])
    return {"images": images, "text": text}


def execute(ctx: Context, cfg: dict) -> dict:
    keys = ("n_train", "n_test", "d", "depth", "steps", "batch", "lr")
    runs = []
    for norm in NORMS:
        why = available(norm, cfg["d"], "tokens")
        if why:
            ctx.skipped[norm] = why
            continue
        for seed in ctx.seeds:
            r = ctx.cached({"norm": norm, "seed": seed, **{k: cfg[k] for k in keys}},
                           lambda norm=norm, seed=seed: _train_seq(ctx, cfg, norm, seed))
            ctx.sources[norm] = r["source"]
            runs.append({"norm": norm, "seed": seed, **r})
    acc = {}
    for norm in NORMS:
        vals = [r["acc"] for r in runs if r["norm"] == norm]
        if vals:
            m, s = mean_std(vals)
            acc[norm] = {"mean": m, "std": s}
    fl_keys = ("fluct_steps", "fluct_batches", "n_chars", "d", "depth", "lr")
    fluct = [ctx.cached({"part": "fluct", "seed": s, **{k: cfg[k] for k in fl_keys}},
                        lambda s=s: _fluctuation(ctx, cfg, s)) for s in ctx.seeds]
    tok, mask, _ = padded_sequences(cfg["n_train"], seed=1234)
    return {"runs": runs, "acc": acc, "fluctuation": fluct, "pad_fraction": 1 - float(mask.float().mean())}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    names = [n for n in NORMS if n in metrics["acc"]]
    ax.bar([LABEL[n] for n in names], [metrics["acc"][n]["mean"] for n in names],
           yerr=[metrics["acc"][n]["std"] for n in names], capsize=3,
           color=["tab:red" if n == "batch" else "tab:green" if n == "batch-masked" else "tab:blue" for n in names])
    ax.set_ylim(40, 100)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"padded-sequence task ({metrics['pad_fraction']:.0%} padding)")
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[1]
    fl = metrics["fluctuation"]
    kinds = ["mean", "var"]
    for i, modality in enumerate(("images", "text")):
        vals = [mean_std([f[modality][k] for f in fl])[0] for k in kinds]
        ax.bar([j + 0.38 * i for j in range(2)], vals, 0.38, label=modality)
    ax.set_xticks([0.19, 1.19], ["|mu_B - mu| / sigma", "|var_B / var - 1|"])
    ax.set_title("BN batch stats vs running stats")
    ax.legend()
    ctx.savefig(fig, "padding")


def verdicts(metrics: dict) -> list:
    acc = {k: v["mean"] for k, v in metrics["acc"].items()}
    fl = metrics["fluctuation"]
    out = [padding_rule(acc["batch"], acc["batch-masked"]),
           fluctuation_rule(mean_std([f["text"]["total"] for f in fl])[0],
                            mean_std([f["images"]["total"] for f in fl])[0])]
    if "power" in acc:
        out.append(power_rule(acc["power"], acc["layer"], acc["batch"]))
    else:
        from .verdicts import POWER_CLAIM, POWER_PUBLISHED

        out.append(skipped(POWER_CLAIM, POWER_PUBLISHED, available("power", 8, "tokens") or "no runs"))
    return out


