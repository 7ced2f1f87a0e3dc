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
            if y.stride() != expected_y.stride() or g.stride() != expected_g.stride():
                mismatches.append(
                    f"{name} on {layout} input: output strides {y.stride()}, torch's {expected_y.stride()}; "
                    f"input gradient {g.stride()}, torch's {expected_g.stride()}"
                )
    assert ran, f"backend {backend!r} ran none of the calls"
    assert not mismatches, "\n".join(mismatches)
