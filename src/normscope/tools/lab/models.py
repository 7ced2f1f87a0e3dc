"""Small models with a norm slot, and the training loops shared by the experiments."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .norms import NormSlot, make


class SmallCNN(nn.Module):
    """conv-norm-relu x3 for 8x8 digits: (N,1,8,8) -> 10 logits. ``width`` channels everywhere so
    the GroupNorm group sweep has many divisors; ``vgg=True`` adds a fourth conv (the
    smoothness experiment's "VGG-style" net)."""

    def __init__(self, norm: str, width: int = 32, vgg: bool = False, wrap: Callable | None = None) -> None:
        super().__init__()
        n_conv = 4 if vgg else 3
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        c_in = 1
        for _ in range(n_conv):
            self.convs.append(nn.Conv2d(c_in, width, 3, padding=1, bias=norm == "none"))
            slot: nn.Module = make(norm, width, "channels")
            self.norms.append(wrap(slot) if wrap else slot)
            c_in = width
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = F.relu(norm(conv(x)))
            if i == 1:
                x = F.max_pool2d(x, 2)
        return self.head(x.mean((2, 3)))


def norm_sources(model: nn.Module) -> str:
    srcs = sorted({m.source for m in model.modules() if isinstance(m, NormSlot)})
    return ", ".join(srcs) or "-"


PLACEMENTS = ("post", "pre", "sandwich", "peri")


class Block(nn.Module):
    """A transformer block with a Pre-LN (x + f(norm(x))) or Post-LN (norm(x + f(x))) residual, or
    (``placement``) a norm on both sides of each sublayer, x + norm_out(f(norm_in(x))): Gemma 2/3's
    "sandwich" (pre/post_feedforward_layernorm) and Peri-LN (Kim et al. 2025, arXiv 2502.02732) --
    the same block; Peri-LN also normalizes the embedding (see TinyTransformer)."""

    def __init__(self, d: int, heads: int, norm: str, prenorm: bool, causal: bool, norm_kwargs: dict | None = None,
                 placement: str | None = None) -> None:
        super().__init__()
        placement = placement or ("pre" if prenorm else "post")
        if placement not in PLACEMENTS:
            raise ValueError(f"Block: expected `placement` to be one of {PLACEMENTS}, got {placement!r}")
        self.placement, self.sandwich = placement, placement in ("sandwich", "peri")
        self.heads, self.prenorm, self.causal = heads, placement != "post", causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)
        kw = norm_kwargs or {}
        self.n1, self.n2 = make(norm, d, "tokens", **kw), make(norm, d, "tokens", **kw)
        if self.sandwich:  # the output norms of the sandwich
            self.n1_out, self.n2_out = make(norm, d, "tokens", **kw), make(norm, d, "tokens", **kw)

    def attn(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        am = None
        if mask is not None:
            am = mask[:, None, None, :]  # keys that are real tokens
            if self.causal:
                am = am & torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=am, is_causal=self.causal and am is None)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))

    def ff(self, x: Tensor) -> Tensor:
        return self.ff2(F.gelu(self.ff1(x)))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.sandwich:
            x = x + self.n1_out(self.attn(self.n1(x, mask), mask), mask)
            return x + self.n2_out(self.ff(self.n2(x, mask)), mask)
        if self.prenorm:
            x = x + self.attn(self.n1(x, mask), mask)
            return x + self.ff(self.n2(x, mask))
        x = self.n1(x + self.attn(x, mask), mask)
        return self.n2(x + self.ff(x), mask)


class TinyTransformer(nn.Module):
    """Embedding + ``depth`` blocks (+ a final norm for Pre-LN) + a linear head.

    ``pool=True``: mean over the valid tokens, one prediction per sequence; else one per token.
    Linear weights use Xavier-normal init and zero biases (Xiong et al. 2020's setting).
    """

    def __init__(self, vocab: int, n_out: int, d: int = 64, depth: int = 2, heads: int = 4, max_len: int = 64,
                 norm: str = "layer", prenorm: bool = True, causal: bool = False, pool: bool = False,
                 norm_kwargs: dict | None = None, placement: str | None = None) -> None:
        super().__init__()
        placement = placement or ("pre" if prenorm else "post")
        prenorm = placement != "post"
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        blocks = (Block(d, heads, norm, prenorm, causal, norm_kwargs, placement) for _ in range(depth))
        self.blocks = nn.ModuleList(blocks)
        self.final = make(norm, d, "tokens", **(norm_kwargs or {})) if prenorm else make("none", d, "tokens")
        # Peri-LN normalizes the embedding too
        self.embed_norm = make(norm, d, "tokens", **(norm_kwargs or {})) if placement == "peri" else None
        self.head = nn.Linear(d, n_out)
        self.pool = pool
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.tok.weight, std=d ** -0.5)

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.tok(tokens) * math.sqrt(self.tok.embedding_dim) + self.pos[: tokens.shape[1]]
        if self.embed_norm is not None:
            x = self.embed_norm(x, mask)
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.final(x, mask)
        if self.pool:
            if mask is None:
                return self.head(x.mean(1))
            m = mask[..., None].to(x.dtype)
            return self.head((x * m).sum(1) / m.sum(1).clamp_min(1))
        return self.head(x)


def train_classifier(model: nn.Module, x: Tensor, y: Tensor, *, batch: int, epochs: int, lr: float,
                     g: torch.Generator, tick: Callable[[int, int, str], None] | None = None,
                     weight_decay: float = 5e-4) -> list[float]:
    """SGD with momentum 0.9 and a cosine learning-rate decay; returns the loss per epoch
    (NaN-safe: a diverged run stops early and reports inf)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    steps_per_epoch = len(x) // batch  # drop the last partial batch: BN on a batch of 1 is undefined
    total = steps_per_epoch * epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    losses = []
    step = 0
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=g)
        run = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if not torch.isfinite(loss):
                return losses + [float("inf")]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += loss.item()
            step += 1
            if tick:
                tick(step, total, f"loss {loss.item():.3f}")
        losses.append(run / max(steps_per_epoch, 1))
    return losses


@torch.no_grad()
def error_rate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 256, batch_stats: bool = False) -> float:
    """Test error in percent. ``batch_stats=True``: BatchNorm layers normalize with the statistics
    of each test batch of size ``batch`` (their running estimates are left untouched)."""
    model.eval()
    saved = []
    if batch_stats:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                saved.append((m, m.momentum))
                m.train()
                m.momentum = 0.0  # normalize with batch statistics, leave the running ones as they are
    wrong = 0
    n_eval = (len(x) // batch) * batch if batch_stats else len(x)
    for i in range(0, n_eval, batch):
        out = model(x[i:i + batch])
        wrong += int((out.argmax(1) != y[i:i + batch]).sum())
    for m, mom in saved:
        m.momentum = mom
        m.eval()
    return 100.0 * wrong / max(n_eval, 1)


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_lm(model: nn.Module, train: Tensor, val: Tensor, *, steps: int, batch: int, seq: int, lr: float,
             warmup: int, g: torch.Generator, fail_above: float,
             tick: Callable[[int, int, str], None] | None = None) -> dict:
    """Adam (betas 0.9/0.98, as Vaswani et al.) with linear warm-up over ``warmup`` steps then a
    constant rate. A run *fails* if its loss becomes non-finite or its final validation loss
    is not below ``fail_above`` (the unigram entropy: nothing learned beyond character counts)."""
    from .data import char_batch

    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    curve: list[list[float]] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        model.train()
        x, y = char_batch(train, batch, seq, g)
        loss = lm_loss(model, x, y)
        if not torch.isfinite(loss):
            return {"val_loss": float("inf"), "failed": True, "curve": curve, "diverged_at": step,
                    "ms_per_step": 1000 * (time.perf_counter() - t0) / step}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % max(steps // 10, 1) == 0 or step == steps:
            curve.append([step, loss.item()])
        if tick:
            tick(step, steps, f"loss {loss.item():.3f}")
    ms = 1000 * (time.perf_counter() - t0) / steps
    vl = lm_eval(model, val, seq)
    return {"val_loss": vl, "failed": not (vl < fail_above), "curve": curve, "ms_per_step": ms}


@torch.no_grad()
def lm_eval(model: nn.Module, val: Tensor, seq: int, max_batches: int = 16) -> float:
    """Mean loss over non-overlapping windows of the validation text (deterministic)."""
    model.eval()
    n = min((len(val) - 1) // seq, max_batches * 32)
    x = val[: n * seq].view(n, seq)
    y = val[1: n * seq + 1].view(n, seq)
    total = 0.0
    for i in range(0, n, 32):
        total += float(lm_loss(model, x[i:i + 32], y[i:i + 32])) * len(x[i:i + 32])
    v = total / max(n, 1)
    return v if math.isfinite(v) else float("inf")


def _mha(q_in: Tensor, kv_in: Tensor, q_lin: nn.Linear, kv_lin: nn.Linear, proj: nn.Linear, heads: int,
         causal: bool) -> Tensor:
    b, s, d = q_in.shape
    q = q_lin(q_in).view(b, s, heads, d // heads).transpose(1, 2)
    k, v = kv_lin(kv_in).view(b, kv_in.shape[1], 2, heads, d // heads).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return proj(y.transpose(1, 2).reshape(b, s, d))


class DecoderBlock(nn.Module):
    """A Transformer decoder layer: causal self-attention, cross-attention to the encoder's
    output, feed-forward; each sub-layer with a Pre-LN or Post-LN residual (Xiong et al. 2020)."""

    def __init__(self, d: int, heads: int, norm: str, prenorm: bool) -> None:
        super().__init__()
        self.heads, self.prenorm = heads, prenorm
        self.sq, self.skv, self.sproj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.cq, self.ckv, self.cproj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.n1, self.n2, self.n3 = (make(norm, d, "tokens") for _ in range(3))

    def forward(self, x: Tensor, mem: Tensor) -> Tensor:
        subs = [lambda h: _mha(h, h, self.sq, self.skv, self.sproj, self.heads, True),
                lambda h: _mha(h, mem, self.cq, self.ckv, self.cproj, self.heads, False),
                lambda h: self.ff2(F.gelu(self.ff1(h)))]
        for f, n in zip(subs, (self.n1, self.n2, self.n3)):
            x = x + f(n(x)) if self.prenorm else n(x + f(x))
        return x


class EncoderDecoder(nn.Module):
    """The original Transformer's shape at small width: ``depth`` encoder layers (:class:`Block`,
    bidirectional) and ``depth`` decoder layers (:class:`DecoderBlock`), Pre-LN (with final norms)
    or Post-LN, Xavier-normal init and zero biases as in Xiong et al. 2020."""

    def __init__(self, vocab: int, d: int = 64, depth: int = 6, heads: int = 4, max_len: int = 64,
                 norm: str = "layer", prenorm: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.encoder = nn.ModuleList(Block(d, heads, norm, prenorm, causal=False) for _ in range(depth))
        self.decoder = nn.ModuleList(DecoderBlock(d, heads, norm, prenorm) for _ in range(depth))
        self.enc_final = make(norm if prenorm else "none", d, "tokens")
        self.dec_final = make(norm if prenorm else "none", d, "tokens")
        self.head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.tok.weight, std=d ** -0.5)

    def embed(self, t: Tensor) -> Tensor:
        return self.tok(t) * math.sqrt(self.tok.embedding_dim) + self.pos[: t.shape[1]]

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        mem = self.embed(src)
        for blk in self.encoder:
            mem = blk(mem)
        mem = self.enc_final(mem)
        x = self.embed(tgt_in)
        for blk in self.decoder:
            x = blk(x, mem)
        return self.head(self.dec_final(x))
