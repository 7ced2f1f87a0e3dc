"""``normscope tour``: the worked examples that tutorials on normalization layers use, recomputed and checked.

Each section redoes one example by hand (the tutorial's own formula), with normscope, and with ``torch.nn``,
and compares them at run time. Read it top to bottom: it is meant for learners. Sections 1 to 3 come from two
articles, named in their output (:data:`SOURCES`): section 1 from "Q5: 层归一化（Layer Normalization）详解"
("Q5: Layer Normalization explained"), sections 2 and 3 from an untitled article on normalization from CNNs to
the Transformer's LayerNorm and RMSNorm; neither names its author.

1. LayerNorm of one vector, [10, 2, 6, 14]: mean 8, variance 20, normalized ~[0.45, -1.34, -0.45, 1.34].
2. BatchNorm2d on a 2x3x2x2 tensor: one mean and variance per channel.
3. LayerNorm and RMSNorm on a (4, 10, 32) batch of token vectors: ManualLayerNorm / ManualRMSNorm
   against normscope and torch, ``allclose(atol=1e-6)`` and the largest difference.
4. BatchNorm vs LayerNorm vs InstanceNorm vs GroupNorm on one (N, C, H, W) tensor: which elements
   share statistics.
5. QK-norm on (B, S, H, D) queries: one scope per (token, head) -- Qwen3, Gemma 3 -- or one per
   token over all heads -- OLMo 2.
6. AdaLN: LayerNorm's scope, with the affine (shift, scale) computed from a conditioning vector.

:func:`run` returns the sections (numbers, tables and checks); :func:`render` prints them. A
check that fails makes ``normscope tour`` exit with status 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import normscope

from .. import reference
from ..scope import Scope
from ..terminal import Out, fmt, vec
from .explain import axis_names, scope_ids

__all__ = ["Check", "SOURCES", "Section", "run", "render"]

#: the articles the worked examples come from, as they title themselves (neither names an author). What the
#: tour prints is the English line, which every terminal can show; the JSON carries both.
SOURCES = {
    "q5": {
        "title": "Q5: 层归一化（Layer Normalization）详解",
        "english": 'the article "Q5: Layer Normalization explained" (no author named)',
    },
    "cnn_to_transformer": {
        "title": "(untitled; its first section is 1 写在前面, its last 9 引用)",
        "english": "an untitled article on normalization from CNNs to the Transformer's LayerNorm and RMSNorm "
        "(no author named; its figures: demo.phimes.top)",
    },
}


@dataclass
class Check:
    """One comparison: passes when the largest absolute difference is at most ``tol``."""

    name: str
    max_abs_diff: float
    tol: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tol  # False for NaN too

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs_diff": self.max_abs_diff, "tol": self.tol, "passed": self.passed}


@dataclass
class Section:
    key: str
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list], str | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed after the tables
    checks: list[Check] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    source: str | None = None  # a key of SOURCES: the article the worked example comes from

    def check(self, name: str, a: Tensor | float, b: Tensor | float, tol: float) -> None:
        diff = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max()
        self.checks.append(Check(name, diff.item(), tol))


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------
# 1. LayerNorm of one vector (a tutorial's worked example)


def layernorm_vector() -> Section:
    s = Section("layernorm_vector", "1. LayerNorm of one vector: x = [10, 2, 6, 14]")
    x = torch.tensor([10.0, 2.0, 6.0, 14.0])
    eps = 1e-5  # torch's default (the article writes 1e-6; the rounded numbers are the same)

    # By hand, the article's four steps (gamma = 1, beta = 0):
    mean = x.sum() / x.numel()  # step 1: (10 + 2 + 6 + 14) / 4 = 8
    var = ((x - mean) ** 2).sum() / x.numel()  # step 2: (4 + 36 + 4 + 36) / 4 = 20
    by_hand = (x - mean) / torch.sqrt(var + eps)  # step 3: [2, -6, -2, 6] / 4.47

    with torch.no_grad():
        ours = normscope.LayerNorm(4)(x)
        theirs = nn.LayerNorm(4)(x)
    article = torch.tensor([0.45, -1.34, -0.45, 1.34])  # as printed, rounded to 2 decimals

    s.source = "q5"
    s.text = [
        f"step 1  mean      = (10 + 2 + 6 + 14) / 4                     = {fmt(mean.item())}",
        f"step 2  variance  = (4 + 36 + 4 + 36) / 4                     = {fmt(var.item())}",
        f"step 3  normalize = ([10, 2, 6, 14] - {fmt(mean.item())}) / sqrt({fmt(var.item())} + eps)",
    ]
    s.tables.append(
        (
            "",
            ["computed by", "normalized x", "max |diff| to torch"],
            [
                ["the formula (by hand)", vec(by_hand.tolist()), f"{max_abs_diff(by_hand, theirs):.1e}"],
                ["normscope.LayerNorm(4)", vec(ours.tolist()), f"{max_abs_diff(ours, theirs):.1e}"],
                ["torch.nn.LayerNorm(4)", vec(theirs.tolist()), "-"],
                ["the Q5 article (rounded)", vec(article.tolist(), 2), f"{max_abs_diff(article, theirs):.1e}"],
            ],
            "llr",
        )
    )
    s.check("mean is 8", mean, 8.0, 0.0)
    s.check("variance is 20", var, 20.0, 0.0)
    s.check("normscope vs torch", ours, theirs, 1e-6)
    s.check("normscope vs formula", ours, by_hand, 1e-6)
    s.check("the Q5 article's rounded values", theirs, article, 0.005)
    s.data = {
        "x": x.tolist(),
        "eps": eps,
        "mean": mean.item(),
        "var": var.item(),
        "manual": by_hand.tolist(),
        "normscope": ours.tolist(),
        "torch": theirs.tolist(),
    }
    return s


# ----------------------------------------------------------------------------------------------
# 2. BatchNorm2d on a tutorial's 2x3x2x2 tensor

ARTICLE_004_DATA = [
    [  # sample 0
        [[0.1, 0.2], [0.3, 0.4]],  # channel 0
        [[1.0, 0.9], [1.2, -1.1]],  # channel 1
        [[1.1, 0.3], [-0.6, 0.2]],  # channel 2
    ],
    [  # sample 1
        [[0.3, 0.8], [-0.2, -0.3]],
        [[-0.2, 2.1], [1.1, 0.2]],
        [[0.4, 0.7], [-2.1, 0.5]],
    ],
]
#: the per-channel statistics the article prints (channel: (mean, biased variance))
ARTICLE_004_STATS = {0: (0.2, 0.105), 1: (0.65, 0.8475)}


def batchnorm_channels() -> Section:
    s = Section("batchnorm_channels", "2. BatchNorm2d: one mean and variance per channel (2 x 3 x 2 x 2 input)")
    x = torch.tensor(ARTICLE_004_DATA)
    n, c, h, w = x.shape
    eps = 1e-5

    # By hand, as the article does: take one channel across the batch and every position
    by_hand = torch.empty_like(x)
    means, variances = [], []
    for ch in range(c):
        values = x[:, ch, :, :]  # 2 samples x 2 x 2 = 8 numbers
        mean = values.mean()
        var = values.var(unbiased=False)  # biased: divide by 8, not 7
        by_hand[:, ch] = (values - mean) / torch.sqrt(var + eps)
        means.append(mean.item())
        variances.append(var.item())

    # normscope's statistics for the BatchNorm scope, and the two layers in training mode
    stats = reference.moments(x, Scope.batch().resolve(tuple(x.shape)))
    with torch.no_grad():
        ours = normscope.BatchNorm2d(c).train()(x)
        theirs = nn.BatchNorm2d(c).train()(x)

    s.source = "cnn_to_transformer"
    s.text = [f"BatchNorm2d reduces over N, H, W: each channel's {n * h * w} numbers share one mean and variance."]
    s.tables.append(
        (
            "Statistics per channel",
            ["channel", "mean (by hand)", "variance (by hand)", "mean (normscope)", "variance (normscope)"],
            [
                [
                    ch,
                    fmt(means[ch]),
                    fmt(variances[ch]),
                    fmt(stats.mean[0, ch, 0, 0].item()),
                    fmt(stats.var[0, ch, 0, 0].item()),
                ]
                for ch in range(c)
            ],
            None,
        )
    )
    s.tables.append(
        (
            "Normalized values (normscope.BatchNorm2d, training mode)",
            ["channel", "sample", "normalized 2x2 (row-major)"],
            [[ch, i, vec(ours[i, ch].flatten().tolist())] for ch in range(c) for i in range(n)],
            "rrl",
        )
    )
    s.notes = [
        f"max |normscope - torch.nn.BatchNorm2d| = {max_abs_diff(ours, theirs):.1e}",
        f"max |normscope - by hand|              = {max_abs_diff(ours, by_hand):.1e}",
    ]
    for ch, (mean, var) in ARTICLE_004_STATS.items():
        s.check(f"channel {ch} mean is {mean} (the article)", means[ch], mean, 1e-6)
        s.check(f"channel {ch} variance is {var} (the article)", variances[ch], var, 1e-6)
    s.check("normscope statistics vs by hand", stats.mean.flatten(), torch.tensor(means), 1e-6)
    s.check("normscope variance vs by hand", stats.var.flatten(), torch.tensor(variances), 1e-6)
    s.check("normscope vs torch", ours, theirs, 1e-6)
    s.check("normscope vs by hand", ours, by_hand, 1e-5)
    s.data = {
        "x": x.tolist(),
        "eps": eps,
        "mean": means,
        "var": variances,
        "normscope_mean": stats.mean.flatten().tolist(),
        "normscope_var": stats.var.flatten().tolist(),
        "normalized": ours.tolist(),
        "max_abs_diff_torch": max_abs_diff(ours, theirs),
    }
    return s


# ----------------------------------------------------------------------------------------------
# 3. LayerNorm and RMSNorm on a batch of token vectors (a tutorial's ManualLayerNorm/ManualRMSNorm)


class ManualLayerNorm(nn.Module):
    """The article's LayerNorm: mean and biased variance over the normalized (trailing) dims."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(self.normalized_shape))
        self.beta = nn.Parameter(torch.zeros(self.normalized_shape))

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        mean = x.mean(dim=dims, keepdim=True)
        var = x.var(dim=dims, unbiased=False, keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta


class ManualRMSNorm(nn.Module):
    """The article's RMSNorm: no mean, divide by the root of the mean square."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(self.normalized_shape))

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        rms = torch.sqrt(x.pow(2).mean(dim=dims, keepdim=True) + self.eps)
        return self.gamma * (x / rms)


def tokens() -> Section:
    batch, seq_len, dim = 4, 10, 32
    s = Section("tokens", f"3. LayerNorm and RMSNorm on ({batch}, {seq_len}, {dim}) token vectors")
    x = torch.randn(batch, seq_len, dim, generator=torch.Generator().manual_seed(0))
    eps = 1e-5  # the article's; passed to torch's RMSNorm too (its default is the dtype's epsilon)

    layers = {
        "LayerNorm": (ManualLayerNorm(dim, eps), normscope.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)),
        "RMSNorm": (ManualRMSNorm(dim, eps), normscope.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)),
    }
    rows, first, s.data = [], [], {"shape": [batch, seq_len, dim], "eps": eps, "seed": 0}
    for name, (manual, ours, theirs) in layers.items():
        with torch.no_grad():
            y_manual, y_ours, y_torch = manual(x), ours(x), theirs(x)
        close_manual = torch.allclose(y_manual, y_torch, atol=1e-6)
        close_ours = torch.allclose(y_ours, y_torch, atol=1e-6)
        rows.append(
            [
                name,
                str(close_manual),
                f"{max_abs_diff(y_manual, y_torch):.1e}",
                str(close_ours),
                f"{max_abs_diff(y_ours, y_torch):.1e}",
            ]
        )
        first += [
            [f"{name}: {who}", vec(y[0, 0, :5].tolist())]
            for who, y in (("manual", y_manual), ("normscope", y_ours), ("torch", y_torch))
        ]
        s.check(f"{name}: manual vs torch", y_manual, y_torch, 1e-6)
        s.check(f"{name}: normscope vs torch", y_ours, y_torch, 1e-6)
        s.data[name] = {
            "manual_allclose": close_manual,
            "manual_max_abs_diff": max_abs_diff(y_manual, y_torch),
            "normscope_allclose": close_ours,
            "normscope_max_abs_diff": max_abs_diff(y_ours, y_torch),
            "first_values": y_ours[0, 0, :5].tolist(),
        }
    s.source = "cnn_to_transformer"
    s.text = ["Both normalize each token's 32 features; RMSNorm skips the mean (and has no bias)."]
    s.tables.append(("The first 5 outputs of token [0, 0]", ["layer: computed by", "y[0, 0, :5]"], first, "ll"))
    s.tables.append(
        (
            "Against torch.nn (allclose with atol=1e-6)",
            ["norm", "manual allclose", "manual max |diff|", "normscope allclose", "normscope max |diff|"],
            rows,
            None,
        )
    )
    return s


# ----------------------------------------------------------------------------------------------
# 4. Four layers, one tensor: which elements share statistics


def scopes() -> Section:
    n, c, h, w = 2, 4, 2, 2
    groups = 2
    s = Section("scopes", f"4. Who shares statistics? Four layers on one ({n}, {c}, {h}, {w}) tensor")
    x = (torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0)) * 10).round() / 10
    names = axis_names(4)
    layers = {
        "BatchNorm2d": (Scope.batch(), normscope.BatchNorm2d(c), nn.BatchNorm2d(c)),
        "LayerNorm": (Scope.layer(3), normscope.LayerNorm([c, h, w]), nn.LayerNorm([c, h, w])),
        "InstanceNorm2d": (Scope.instance(), normscope.InstanceNorm2d(c), nn.InstanceNorm2d(c)),
        f"GroupNorm({groups})": (Scope.group(groups), normscope.GroupNorm(groups, c), nn.GroupNorm(groups, c)),
    }
    summary, maps, s.data = [], {}, {"x": x.tolist(), "layers": {}}
    for name, (scope, ours, theirs) in layers.items():
        resolved = scope.resolve(tuple(x.shape))
        ids = scope_ids(resolved)  # the scope each element belongs to
        with torch.no_grad():
            y_ours, y_torch = ours.train()(x), theirs.train()(x)

        # Independent check of the id map: gather each scope's elements, normalize them with their
        # own mean and variance, and compare with torch's layer.
        y_from_ids = torch.empty_like(x)
        per_scope = []
        for k in ids.unique().tolist():
            members = x[ids == k]
            mean, var = members.mean(), members.var(unbiased=False)
            y_from_ids[ids == k] = (members - mean) / torch.sqrt(var + 1e-5)
            per_scope.append({"scope": k, "count": members.numel(), "mean": mean.item(), "var": var.item()})

        maps[name] = ids[:, :, 0, 0]  # every layer here reduces over H and W: one id per (n, c)
        counts = sorted({p["count"] for p in per_scope})
        summary.append(
            [
                name,
                _reduced_words(resolved, names),
                len(per_scope),
                ",".join(map(str, counts)),
                f"{max_abs_diff(y_ours, y_torch):.1e}",
            ]
        )
        s.check(f"{name}: normscope vs torch", y_ours, y_torch, 1e-6)
        s.check(f"{name}: statistics of the scope map vs torch", y_from_ids, y_torch, 1e-5)
        s.data["layers"][name] = {
            "reduced_axes": [names[d] for d in resolved.reduce],
            "num_scopes": len(per_scope),
            "scope_ids_nc": ids[:, :, 0, 0].tolist(),
            "scopes": per_scope,
            "max_abs_diff_torch": max_abs_diff(y_ours, y_torch),
        }

    s.text = [
        "Every layer is mean, variance, normalize, affine; only the scope -- the set of elements",
        "sharing one mean and variance -- differs. Equal ids share statistics (all H x W positions",
        "of one (n, c) slice share them for these four layers).",
    ]
    # one column per layer, one row per sample; a cell lists the scope ids of channels 0..C-1
    s.tables.append(
        (
            f"Scope id of each (n, c) slice, channels c=0..{c - 1} left to right",
            ["sample"] + list(maps),
            [[f"n={i}"] + [" ".join(map(str, m[i].tolist())) for m in maps.values()] for i in range(n)],
            "l" * (len(maps) + 1),
        )
    )
    s.tables.append(
        ("Summary", ["layer", "reduces over", "scopes", "elements/scope", "max |diff| to torch"], summary, "llrrr")
    )
    stats_rows = [
        [name, p["scope"], p["count"], fmt(p["mean"]), fmt(p["var"])]
        for name, d in s.data["layers"].items()
        for p in d["scopes"]
    ]
    s.tables.append(("Statistics per scope", ["layer", "scope", "elements", "mean", "variance"], stats_rows, "lrrrr"))
    return s


def _reduced_words(resolved, names: list[str]) -> str:
    words = [names[d] for d in resolved.reduce]
    if resolved.groups > 1:  # the grouped axis is reduced only within a group
        d = resolved.group_dim
        words[resolved.reduce.index(d)] = f"{names[d]} (in groups of {resolved.shape[d] // resolved.groups})"
    return ", ".join(words)


# ----------------------------------------------------------------------------------------------
# 5. QK-norm: the per-head scope


def qk_norm() -> Section:
    from .. import functional_modern as FM

    b, seq, h, d = 1, 3, 2, 4
    s = Section("qk_norm", f"5. QK-norm on ({b}, {seq}, {h}, {d}) queries: per head, or over all heads")
    q = (torch.randn(b, seq, h, d, generator=torch.Generator().manual_seed(0)) * 10).round() / 10
    eps = 1e-6
    per_head = FM.qk_norm(q, q, eps=eps)[0]
    full = FM.qk_norm(q, q, eps=eps, per_head=False)[0]
    # by hand: the root mean square of each scope
    manual_head = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps)
    manual_full = q / torch.sqrt(q.pow(2).mean((-2, -1), keepdim=True) + eps)
    torch_head = nn.functional.rms_norm(q, (d,), eps=eps)
    torch_full = nn.functional.rms_norm(q.reshape(b, seq, h * d), (h * d,), eps=eps).reshape(q.shape)
    s.check("per head: normscope vs by hand", per_head, manual_head, 1e-6)
    s.check("per head: normscope vs torch rms_norm over head_dim", per_head, torch_head, 1e-6)
    s.check("all heads: normscope vs by hand", full, manual_full, 1e-6)
    s.check("all heads: normscope vs torch rms_norm over H*D", full, torch_full, 1e-6)
    ids_head = [[t * h + i] * d for t in range(seq) for i in range(h)]
    rows = [
        [f"s={t}, head {i}", vec(q[0, t, i].tolist()), " ".join(map(str, ids_head[t * h + i])), str(t)]
        for t in range(seq)
        for i in range(h)
    ]
    s.text = [
        "Queries and keys are normalized before attention so their dot products cannot grow without bound.",
        "Qwen3 and Gemma 3 take the RMSNorm scope over head_dim of each head (weight: head_dim values,",
        "shared by all heads); OLMo 2 takes it over the whole projected width of a token, all heads at",
        "once, before splitting it into heads (weight: H * head_dim values).",
    ]
    s.tables.append(
        ("Scope id of each element: per head vs all heads", ["row", "q", "per head", "all heads"], rows, "llll")
    )
    s.tables.append(
        (
            "Normalized row s=0, head 0",
            ["scope", "y"],
            [["per head", vec(per_head[0, 0, 0].tolist())], ["all heads", vec(full[0, 0, 0].tolist())]],
            "ll",
        )
    )
    s.data = {"q": q.tolist(), "per_head": per_head.tolist(), "all_heads": full.tolist(), "eps": eps}
    return s


# ----------------------------------------------------------------------------------------------
# 6. AdaLN: an affine from another tensor


def adaln() -> Section:
    b, seq, d, c = 2, 3, 4, 5
    s = Section("adaln", f"6. AdaLN on ({b}, {seq}, {d}) tokens: the affine comes from a condition ({b}, {c})")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, seq, d, generator=g) * 10).round() / 10
    cond = (torch.randn(b, c, generator=g) * 10).round() / 10
    ada = normscope.AdaLayerNorm(d, c, gate=True)
    with torch.no_grad():
        y0, gate0 = ada(x, cond)  # adaLN-Zero: the projection starts at zero
        ln = nn.functional.layer_norm(x, (d,), eps=ada.eps)
        s.check("zero-initialised: AdaLN(x) equals LayerNorm(x)", y0, ln, 1e-6)
        s.check("zero-initialised: the gate is 0", gate0, torch.zeros_like(gate0), 0.0)
        ada.linear.weight.copy_(torch.randn(ada.linear.weight.shape, generator=g) * 0.3)
        ada.linear.bias.copy_(torch.randn(ada.linear.bias.shape, generator=g) * 0.3)
        y, gate = ada(x, cond)
        # by hand: shift, scale, gate = Linear(SiLU(cond)); y = LN(x) * (1 + scale) + shift, per sample
        emb = nn.functional.silu(cond) @ ada.linear.weight.T + ada.linear.bias
        shift, scale, g_hand = emb.chunk(3, dim=-1)
        manual = ln * (1 + scale[:, None]) + shift[:, None]
    s.check("AdaLN: normscope vs by hand", y, manual, 1e-6)
    s.check("AdaLN: gate vs by hand", gate, g_hand, 1e-6)
    s.text = [
        "A diffusion transformer (DiT) conditions every block on the timestep and class: the LayerNorm's",
        "scope is unchanged (each token's D features), but its shift and scale are not parameters -- they",
        "are computed from the condition, one (shift, scale) per sample, as AdaIN takes them from a style.",
        "The projection starts at zero (adaLN-Zero), so each block starts as a plain LayerNorm whose",
        "branch is gated off.",
    ]
    s.tables.append(
        (
            "Per-sample affine from the condition",
            ["sample", "shift", "1 + scale"],
            [[f"b={i}", vec(shift[i].tolist()), vec((1 + scale[i]).tolist())] for i in range(b)],
            "lll",
        )
    )
    s.tables.append(
        (
            "Token [b, 0]: LayerNorm, then the sample's affine",
            ["sample", "LayerNorm(x)", "AdaLN(x, c)"],
            [[f"b={i}", vec(ln[i, 0].tolist()), vec(y[i, 0].tolist())] for i in range(b)],
            "lll",
        )
    )
    s.data = {"x": x.tolist(), "cond": cond.tolist(), "shift": shift.tolist(), "scale": scale.tolist(), "y": y.tolist()}
    return s


SECTIONS = (layernorm_vector, batchnorm_channels, tokens, scopes, qk_norm, adaln)


def run() -> list[Section]:
    """Compute every section (no printing)."""
    return [make() for make in SECTIONS]


def render(sections: list[Section], out: Out) -> None:
    for s in sections:
        out.heading(s.title)
        if s.source:
            out.line(f"From {SOURCES[s.source]['english']}.")
        for line in s.text:
            out.line(line)
        for title, headers, rows, align in s.tables:
            out.table(headers, rows, title=title or None, align=align)
        for line in s.notes:
            out.line(line)
        out.line(
            "checks: " + "; ".join(f"{c.name} [{out.mark(c.passed)}]" for c in s.checks),
            style="green" if all(c.passed for c in s.checks) else "bold red",
        )
    checks = [c for s in sections for c in s.checks]
    failed = [c for c in checks if not c.passed]
    out.line()
    if failed:
        out.line(f"{len(failed)} of {len(checks)} checks FAILED:", style="bold red")
        for c in failed:
            out.line(f"  {c.name}: max |diff| {c.max_abs_diff:.3g} > {c.tol:g}", style="red")
    else:
        out.line(
            f"All {len(checks)} checks passed: normscope agrees with the formulas and with torch.nn.",
            style="bold green",
        )


def as_json(sections: list[Section]) -> dict:
    checks = [dict(c.as_dict(), section=s.key) for s in sections for c in s.checks]
    return {
        "passed": all(c["passed"] for c in checks),
        "torch_version": torch.__version__,
        "normscope_version": normscope.__version__,
        "sections": {s.key: s.data for s in sections},
        "sources": {s.key: SOURCES[s.source] for s in sections if s.source},
        "checks": checks,
    }
