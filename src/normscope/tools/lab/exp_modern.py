"""modern: two claims about today's transformers, at small scale on a character language model.

1. **QK-norm prevents attention-logit growth** (Dehghani et al. 2023, "Scaling Vision Transformers
   to 22 Billion Parameters"; Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
   training instabilities", which reproduce the instability in small transformers at high learning
   rate). Protocol after Wortsman et al.: the same Pre-LN causal transformer with and without
   LayerNorm on the queries and keys (per head, over the head dimension, with weight and bias), a
   learning-rate sweep, Adam with linear warm-up then cosine decay; measured per run: the final validation loss and
   the largest attention logit (q.k/sqrt(d_head), over layers, heads and positions) on a validation
   batch at the end of training -- or at the last finite step for a run that diverged.
2. **Normalization-free layers match LayerNorm** (DyT: Zhu, Chen, He, LeCun & Liu 2025,
   "Transformers without Normalization"; Derf: Chen, Lu, Zhu, Sun & Liu 2025, "Stronger
   Normalization-Free Transformers", arXiv:2512.10938): the same model with LN, DyT
   (weight * tanh(alpha x) + bias, alpha from 0.5) and Derf (weight * erf(alpha x + s) + bias, alpha
   from 0.5, s from 0) in every norm slot, at equal steps and learning rate.

Norms come from normscope's registry where it has them (``"layer"``, ``"dyt"``, ``"derf"``); QK-norm
is normscope's LayerNorm over the head dimension, and Derf, while the registry lacks it, is the
plain formula above (the result records which).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import normscope

from .core import Context, mean_std, pyplot, seed_all
from .data import char_batch, char_splits, unigram_entropy
from .models import lm_eval
from .norms import Missing, make
from .verdicts import Verdict, derf_rule, qk_norm_rule

NAME = "modern"
TITLE = "QK-norm and normalization-free transformers"
VERSION = "2"  # 2: cosine decay after warm-up (Wortsman et al.'s schedule), chosen in the seed-100 pilot
VOCAB = 128
LABEL = {"layer": "LN", "dyt": "DyT", "derf": "Derf"}


def config(mode: str) -> dict:
    if mode == "smoke":
        return {
            "d": 32,
            "depth": 1,
            "heads": 2,
            "seq": 32,
            "batch": 8,
            "steps": 20,
            "warmup": 4,
            "lrs": [1e-3, 3e-2],
            "free_lr": 3e-3,
            "free_steps": 20,
            "n_chars": 50_000,
            "seeds": 1,
        }
    if mode == "quick":
        return {
            "d": 64,
            "depth": 2,
            "heads": 4,
            "seq": 64,
            "batch": 16,
            "steps": 400,
            "warmup": 40,
            "lrs": [1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
            "free_lr": 3e-3,
            "free_steps": 600,
            "n_chars": 300_000,
            "seeds": 3,
        }
    return {
        "d": 128,
        "depth": 4,
        "heads": 4,
        "seq": 128,
        "batch": 32,
        "steps": 2000,
        "warmup": 200,
        "lrs": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
        "free_lr": 1e-3,
        "free_steps": 3000,
        "n_chars": 2_000_000,
        "seeds": 5,
    }


class Derf(nn.Module):
    """weight * erf(alpha * x + shift) + bias over the last axis (Chen et al. 2025), alpha and
    shift learnable scalars."""

    def __init__(self, d: int, alpha_init: float = 0.5, shift_init: float = 0.0) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.shift = nn.Parameter(torch.tensor(float(shift_init)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.weight * torch.erf(self.alpha * x + self.shift) + self.bias


def _norm(name: str, d: int) -> tuple[nn.Module, str]:
    try:
        slot = make(name, d, "tokens")
        return slot, slot.source
    except Missing:
        if name == "derf":
            return Derf(d), "plain formula (normscope has no Derf yet)"
        raise


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, norm: str, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        (self.n1, _), (self.n2, _) = _norm(norm, d), _norm(norm, d)
        dh = d // heads
        self.qn = normscope.LayerNorm(dh) if qk_norm else None
        self.kn = normscope.LayerNorm(dh) if qk_norm else None
        self.max_logit = 0.0

    def attn(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.qn is not None:
            q, k = self.qn(q), self.kn(k)
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        self.max_logit = float(logits.detach().masked_fill(~causal, -math.inf).max())
        att = logits.masked_fill(~causal, -math.inf).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.ff2(F.gelu(self.ff1(self.n2(x))))


class _LM(nn.Module):
    """A Pre-LN causal character LM; ``norm`` fills every norm slot, ``qk_norm`` adds QK-LayerNorm."""

    def __init__(self, cfg: dict, norm: str = "layer", qk_norm: bool = False) -> None:
        super().__init__()
        d = cfg["d"]
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(cfg["seq"], d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, cfg["heads"], norm, qk_norm) for _ in range(cfg["depth"]))
        self.final, self.source = _norm(norm, d)
        self.head = nn.Linear(d, VOCAB)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.final(x))

    def max_logit(self) -> float:
        return max(b.max_logit for b in self.blocks)


def _train(
    ctx: Context, cfg: dict, label: str, model: _LM, lr: float, steps: int, seed: int, train: Tensor, val: Tensor
) -> dict:
    g = seed_all(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95))
    warm = cfg["warmup"]
    # Wortsman et al.'s schedule: linear warm-up, then cosine decay (to zero here)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
    )
    last_logit = 0.0
    for step in range(1, steps + 1):
        model.train()
        x, y = char_batch(train, cfg["batch"], cfg["seq"], g)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if not torch.isfinite(loss) or not math.isfinite(model.max_logit()):
            return {"val_loss": math.inf, "diverged_at": step, "max_logit": last_logit}
        last_logit = model.max_logit()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ctx.progress(label, step, steps, f"loss {loss.item():.3f}")
    vl = lm_eval(model, val, cfg["seq"])
    model.eval()
    with torch.no_grad():
        x, _ = char_batch(val, cfg["batch"], cfg["seq"], torch.Generator().manual_seed(0))
        model(x)
    m = model.max_logit()
    return {"val_loss": vl, "diverged_at": None, "max_logit": m if math.isfinite(m) else last_logit}


def execute(ctx: Context, cfg: dict) -> dict:
    train, val = char_splits(cfg["n_chars"])
    h_uni = unigram_entropy(train, VOCAB)
    shape = {k: cfg[k] for k in ("d", "depth", "heads", "seq", "batch", "warmup", "n_chars")}
    qk_runs = []
    for qk in (False, True):
        for lr in cfg["lrs"]:
            for seed in ctx.seeds:
                label = f"{'QK-norm' if qk else 'no QK-norm'} lr={lr:g} s={seed}"
                key = {"part": "qk", "qk_norm": qk, "lr": lr, "seed": seed, "steps": cfg["steps"], **shape}

                def go(qk=qk, lr=lr, seed=seed, label=label) -> dict:
                    seed_all(seed)
                    return _train(ctx, cfg, label, _LM(cfg, "layer", qk), lr, cfg["steps"], seed, train, val)

                qk_runs.append({"qk_norm": qk, "lr": lr, "seed": seed, **ctx.cached(key, go)})
    free_runs = []
    for norm in ("layer", "dyt", "derf"):
        for seed in ctx.seeds:
            key = {
                "part": "free",
                "norm": norm,
                "seed": seed,
                "lr": cfg["free_lr"],
                "steps": cfg["free_steps"],
                **shape,
            }

            def go(norm=norm, seed=seed) -> dict:
                seed_all(seed)
                model = _LM(cfg, norm)
                out = _train(
                    ctx, cfg, f"{LABEL[norm]} s={seed}", model, cfg["free_lr"], cfg["free_steps"], seed, train, val
                )
                return {**out, "source": model.source}

            r = ctx.cached(key, go)
            ctx.sources[norm] = r["source"]
            free_runs.append({"norm": norm, "seed": seed, **r})
    return {"qk_runs": qk_runs, "free_runs": free_runs, "unigram_entropy": h_uni, "lrs": cfg["lrs"]}


def _by(runs: list[dict], field: str, **sel) -> list[float]:
    return [float(r[field]) for r in runs if all(r[k] == v for k, v in sel.items())]


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    lrs = metrics["lrs"]
    for qk, color in ((False, "tab:red"), (True, "tab:blue")):
        name = "QK-norm" if qk else "no QK-norm"
        logit = [mean_std(_by(metrics["qk_runs"], "max_logit", qk_norm=qk, lr=lr))[0] for lr in lrs]
        axes[0].plot(lrs, logit, "o-", color=color, label=name)
        loss = [
            mean_std([min(v, 10.0) for v in _by(metrics["qk_runs"], "val_loss", qk_norm=qk, lr=lr)])[0] for lr in lrs
        ]
        axes[1].plot(lrs, loss, "o-", color=color, label=name)
    for ax, title in (
        (axes[0], "largest attention logit at the end"),
        (axes[1], "final validation loss (diverged = 10)"),
    ):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].axhline(metrics["unigram_entropy"], color="gray", ls=":", label="unigram")
    names = [n for n in ("layer", "dyt", "derf") if _by(metrics["free_runs"], "val_loss", norm=n)]
    vals = [mean_std(_by(metrics["free_runs"], "val_loss", norm=n)) for n in names]
    axes[2].bar([LABEL[n] for n in names], [v[0] for v in vals], yerr=[v[1] for v in vals], capsize=3)
    lo = min(v[0] for v in vals if math.isfinite(v[0])) if vals else 0.0
    axes[2].set_ylim(max(0.0, lo - 0.3), None)
    axes[2].set_title(f"final validation loss, equal steps (n={len(ctx.seeds)} seeds)", fontsize=9)
    ctx.savefig(fig, "modern")


def verdicts(metrics: dict) -> list[Verdict]:
    qk = {}
    for flag in (False, True):
        qk[flag] = {
            lr: (
                _by(metrics["qk_runs"], "val_loss", qk_norm=flag, lr=lr),
                _by(metrics["qk_runs"], "max_logit", qk_norm=flag, lr=lr),
            )
            for lr in metrics["lrs"]
        }
    free = {n: _by(metrics["free_runs"], "val_loss", norm=n) for n in ("layer", "dyt", "derf")}
    return [qk_norm_rule(qk[False], qk[True], metrics["unigram_entropy"]), derf_rule(free, metrics["unigram_entropy"])]
