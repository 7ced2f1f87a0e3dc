"""The output's memory layout is torch's on every backend: a path never shows in the strides of what it
returns. For every registered backend (``normscope.backends()``, so a new one is covered by registering
it) and the automatic choice, each layer's output and input gradient have the strides torch.nn's
namesake gives the same input -- contiguous, channels_last(_3d), a channel slice of a channels_last
batch, transposed, an expanded batch. Where torch has no namesake the oracle is the implementation the
model families ship: LayerNorm2d is timm's and torchvision's (move the channels last, ``F.layer_norm``,
move them back), and a masked norm returns its unmasked namesake's layout. The oracle is torch's own
output, never normscope's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normscope

BACKENDS = ("auto", *normscope.backends())
C = 4


def _layer_norm_2d(x: torch.Tensor) -> torch.Tensor:
    # timm's and torchvision's LayerNorm2d
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],)).permute(0, 3, 1, 2)


def _cases():
    """(name, shape, normscope layer factory, torch's namesake factory, masked)."""
    return [
        ("BatchNorm1d", (3, C, 5), lambda: normscope.BatchNorm1d(C), lambda: nn.BatchNorm1d(C), False),
        ("BatchNorm2d", (2, C, 3, 3), lambda: normscope.BatchNorm2d(C), lambda: nn.BatchNorm2d(C), False),
        (
            "BatchNorm2d eval",
            (2, C, 3, 3),
            lambda: normscope.BatchNorm2d(C).eval(),
            lambda: nn.BatchNorm2d(C).eval(),
            False,
        ),
        ("BatchNorm3d", (2, C, 2, 2, 3), lambda: normscope.BatchNorm3d(C), lambda: nn.BatchNorm3d(C), False),
        (
            "InstanceNorm2d",
            (2, C, 3, 3),
            lambda: normscope.InstanceNorm2d(C, affine=True),
            lambda: nn.InstanceNorm2d(C, affine=True),
            False,
        ),
        (
            "InstanceNorm2d running eval",
            (2, C, 3, 3),
            lambda: normscope.InstanceNorm2d(C, track_running_stats=True).eval(),
            lambda: nn.InstanceNorm2d(C, track_running_stats=True).eval(),
            False,
        ),
        ("InstanceNorm3d", (2, C, 2, 2, 3), lambda: normscope.InstanceNorm3d(C), lambda: nn.InstanceNorm3d(C), False),
        ("GroupNorm(2)", (2, C, 3, 3), lambda: normscope.GroupNorm(2, C), lambda: nn.GroupNorm(2, C), False),
        ("GroupNorm(1)", (2, C, 3, 3), lambda: normscope.GroupNorm(1, C), lambda: nn.GroupNorm(1, C), False),
        ("GroupNorm(C)", (2, C, 3, 3), lambda: normscope.GroupNorm(C, C), lambda: nn.GroupNorm(C, C), False),
        ("GroupNorm(2) 5-D", (2, C, 2, 2, 3), lambda: normscope.GroupNorm(2, C), lambda: nn.GroupNorm(2, C), False),
        ("LayerNorm last", (2, 3, 5, C), lambda: normscope.LayerNorm(C), lambda: nn.LayerNorm(C), False),
        ("LayerNorm last two", (2, C, 3, 3), lambda: normscope.LayerNorm((3, 3)), lambda: nn.LayerNorm((3, 3)), False),
        ("RMSNorm last", (2, 3, 5, C), lambda: normscope.RMSNorm(C), lambda: nn.RMSNorm(C), False),
        ("RMSNorm last two", (2, C, 3, 3), lambda: normscope.RMSNorm((3, 3)), lambda: nn.RMSNorm((3, 3)), False),
        ("LayerNorm2d", (2, C, 3, 3), lambda: normscope.LayerNorm2d(C), lambda: _layer_norm_2d, False),
        ("masked BatchNorm2d", (2, C, 3, 3), lambda: normscope.BatchNorm2d(C), lambda: nn.BatchNorm2d(C), True),
        ("masked GroupNorm", (2, C, 3, 3), lambda: normscope.GroupNorm(2, C), lambda: nn.GroupNorm(2, C), True),
        (
            "masked InstanceNorm2d",
            (2, C, 3, 3),
            lambda: normscope.InstanceNorm2d(C),
            lambda: nn.InstanceNorm2d(C),
            True,
        ),
    ]


def _layouts(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    wider = torch.randn(shape[0], shape[1] + 2, *shape[2:], generator=g)
    out = {
        "contiguous": x,
        "transposed": x.transpose(-1, -2).contiguous().transpose(-1, -2),
        "expanded batch": x[:1].expand(shape),
    }
    if len(shape) in (4, 5):
        out["channels_last"] = x.movedim(1, -1).contiguous().movedim(-1, 1)
        wider_cl = wider.movedim(1, -1).contiguous().movedim(-1, 1)
        out["channel slice of channels_last"] = wider_cl[:, 1 : 1 + shape[1]]
    return out


def _forward_backward(f, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    y = f(x)
    y.backward(torch.ones(y.shape))  # a contiguous output gradient, as a loss's
    return y.detach(), x.grad


def _strides_differ(what: str, ours: tuple, torchs: tuple) -> list[str]:
    """``[what's mismatch]`` where the output's or the input gradient's strides differ from torch's, else []."""
    (y, g), (ey, eg) = ours, torchs
    if y.stride() == ey.stride() and g.stride() == eg.stride():
        return []
    return [
        f"{what}: output strides {y.stride()}, torch's {ey.stride()}; "
        f"input gradient {g.stride()}, torch's {eg.stride()}"
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_and_input_gradient_strides_are_torch_nn(backend):
    ran, mismatches = 0, []
    for name, shape, ours, theirs, masked in _cases():
        mask = torch.rand((shape[0], *shape[2:]), generator=torch.Generator().manual_seed(1)) > 0.3
        for layout, x in _layouts(shape).items():
            expected_y, expected_g = _forward_backward(theirs(), x)
            layer = ours()
            call = (lambda t, m=layer, k=mask: m(t, k)) if masked else layer
            try:
                with normscope.use_backend(None if backend == "auto" else backend):
                    y, g = _forward_backward(call, x)
            except ValueError as e:
                if backend != "auto" and "cannot run" in str(e):
                    continue  # the backend declines this call: nothing of its to compare
                raise
            ran += 1
            if not masked:
                torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
            mismatches += _strides_differ(f"{name} on {layout} input", (y, g), (expected_y, expected_g))
    assert ran, f"backend {backend!r} ran none of the calls"
    assert not mismatches, "\n".join(mismatches)


# -- the modern ops: torch has no namesake; the oracle is each op's formula composed of torch's own ops, its
# statistics by torch's norm op (F.layer_norm / F.rms_norm), so a modern op's output is laid out as the op
# of its statistics lays it out -- every backend alike. (A PolyNorm written with a hand-made RMS,
# ``t * rsqrt(t.pow(2).mean(-1) + eps)``, keeps a transposed input's strides where torch's rms_norm returns
# contiguous output; normscope follows torch's op.)

D = 8


def _modern_cases():
    """(name, normscope op, torch composition): each ``f(x)`` for x of shape (B, T, D)."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(D, generator=g), torch.randn(D, generator=g)
    scale, shift = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)  # per sample (B, D)
    poly_w, poly_b = torch.randn(3, generator=g), torch.randn(1, generator=g)
    NF = normscope.functional

    def rms(t: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(t, (D,), eps=1e-6)

    return [
        (
            "modulated_norm layer",
            lambda x, be: NF.modulated_norm(x, shift, scale, norm="layer", backend=be),
            lambda x: F.layer_norm(x, (D,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None],
        ),
        (
            "modulated_norm rms",
            lambda x, be: NF.modulated_norm(x, shift, scale, norm="rms", backend=be),
            lambda x: F.rms_norm(x, (D,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None],
        ),
        (
            "poly_norm",
            lambda x, be: NF.poly_norm(x, poly_w, poly_b, backend=be),
            lambda x: poly_w[0] * rms(x**3) + poly_w[1] * rms(x**2) + poly_w[2] * rms(x) + poly_b,
        ),
        (
            "derf",
            lambda x, be: NF.derf(x, torch.tensor(0.5), torch.tensor(0.1), w, b, backend=be),
            lambda x: w * torch.erf(0.5 * x + 0.1) + b,
        ),
        (
            "fused_add_rms_norm",
            lambda x, be: NF.fused_add_rms_norm(x, 0.5 * x, w, backend=be)[0],
            lambda x: F.rms_norm(x + 0.5 * x, (D,), w, eps=1e-6),
        ),
        (
            "rms_norm gemma",
            lambda x, be: NF.rms_norm(x, (D,), w, weight_offset=1.0, casting="gemma", backend=be),
            lambda x: F.rms_norm(x, (D,), w + 1.0, eps=1e-6),
        ),
    ]


def _modern_layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, D, generator=g)
    return {
        "contiguous": x,
        "transposed": x.transpose(1, 2).contiguous().transpose(1, 2),
        "strided": torch.randn(2, 3, 2 * D, generator=g)[..., ::2],
        "expanded batch": x[:1].expand(x.shape),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_modern_ops_output_and_input_gradient_strides_are_their_torch_compositions(backend):
    ran, mismatches = 0, []
    for name, ours, theirs in _modern_cases():
        for layout, x in _modern_layouts().items():
            expected_y, expected_g = _forward_backward(theirs, x)
            try:
                y, g = _forward_backward(lambda t, f=ours: f(t, None if backend == "auto" else backend), x)
            except ValueError as e:
                if backend != "auto" and f"backend {backend!r}" in str(e):
                    continue  # the backend declines this op: nothing of its to compare
                raise
            ran += 1
            torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
            mismatches += _strides_differ(f"{name} on {layout} input", (y, g), (expected_y, expected_g))
    assert ran, f"backend {backend!r} ran none of the calls"
    assert not mismatches, "\n".join(mismatches)
