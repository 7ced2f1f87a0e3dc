"""Model surgery inside the zoos: one model of each timm architecture family, torchvision's models
and detection backbone, with random weights and a 64 px input (some families fix their input size).

For each model: ``convert(model)`` gives the original's output bit for bit (evaluation and one
training step: outputs, running statistics, gradients), ``convert(model, to="torch")`` gives back
the original classes at every path and the same output, every norm the model holds is either
converted or named in ``report.skipped``, and the test prints converted/recognised. Everything is
compared with the original model, never with normscope.

The families' models were chosen as the smallest of each family (by parameter count) that builds
at this input size; families whose smallest model has more than 30 M parameters are left out of the
default run to keep it short (``NORMSCOPE_ZOO_ALL=1`` adds the models listed in ``LARGE``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import normscope
from test_zoo_setup import zoo_import

# family (timm.models module) -> (model, create_model keywords, input size)
FAMILIES: dict[str, tuple[str, dict, int]] = {}
LARGE: dict[str, tuple[str, dict, int]] = {}
if os.environ.get("NORMSCOPE_ZOO_ALL"):
    FAMILIES = {**FAMILIES, **LARGE}

# the norms a model can hold, recognised independently of normscope's own rule: torch's norm bases,
# and the classes of timm's and torchvision's norm modules
_TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
_ZOO_NORM_MODULES = (
    "timm.layers.norm",
    "timm.layers.norm_act",
    "timm.layers.evo_norm",
    "timm.layers.filter_response_norm",
)


def _is_norm(m: nn.Module) -> bool:
    cls = type(m)
    return isinstance(m, _TORCH_NORMS) or cls.__module__ in _ZOO_NORM_MODULES or cls.__name__ == "FrozenBatchNorm2d"


def _randomize_norms(model: nn.Module) -> None:
    """Norm state away from its initial values (unit weights, zero means would hide a swap)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if not _is_norm(m):
                continue
            for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t is None or not t.is_floating_point():
                    continue
                noise = torch.randn(t.shape, generator=g) * 0.1
                t.copy_(t + noise if "var" not in name else t * (1 + noise.abs()))


def _build(timm, name: str, kwargs: dict, size: int):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4, **kwargs)
    _randomize_norms(model)
    return model.eval(), torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def _check_round_trip(model: nn.Module, x: torch.Tensor, label: str) -> None:
    classes = {path: type(m) for path, m in model.named_modules()}
    norms = {path for path, m in model.named_modules() if _is_norm(m)}
    with torch.no_grad():
        want = model(x)
    converted, report = normscope.convert(copy.deepcopy(model))
    done, skipped = {r.path for r in report}, {s.path for s in report.skipped}
    inside = {p for p in norms if any(p.startswith(q + ".") for q in done)}  # moved with a replaced layer
    missing = norms - done - skipped - inside
    assert not missing, f"{label}: norms neither converted nor reported: {sorted(missing)[:5]}"
    print(f"{label}: {len(done)}/{len(done) + len(skipped)} norms converted")
    with torch.no_grad():
        assert torch.equal(converted(x), want), label
    # one training step: outputs and running statistics bitwise, gradients to rounding
    a, b = copy.deepcopy(model).train(), copy.deepcopy(converted).train()
    ya = torch.manual_seed(7) and a(x)  # the same dropout draws on both sides
    yb = torch.manual_seed(7) and b(x)
    assert torch.equal(ya, yb), f"{label}: training output"
    ya.square().mean().backward(), yb.square().mean().backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"{label}: grad of {n}")
    for (n, s), (_, t) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(s, t), f"{label}: buffer {n}"
    back, _ = normscope.convert(converted, to="torch")
    assert {p: type(m) for p, m in back.named_modules()} == classes, label
    assert list(back.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        assert torch.equal(back(x), want), label


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_round_trip_in_each_timm_family(family):
    timm = zoo_import("timm")
    name, kwargs, size = FAMILIES[family]
    model, x = _build(timm, name, kwargs, size)
    _check_round_trip(model, x, f"timm {family} ({name})")


def test_torchvision_models_and_detection_backbone():
    zoo_import("torchvision")
    from torchvision.models import convnext_tiny, mobilenet_v3_small, resnet18
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    for make in (resnet18, mobilenet_v3_small):
        torch.manual_seed(0)
        model = make(num_classes=4)
        _randomize_norms(model)
        _check_round_trip(model.eval(), torch.randn(2, 3, 64, 64), f"torchvision {make.__name__}")
    # ConvNeXt's LayerNorm2d: evaluation only (its stochastic depth draws random numbers in training)
    torch.manual_seed(0)
    model = convnext_tiny(num_classes=4).eval()
    _randomize_norms(model)
    x = torch.randn(1, 3, 32, 32)
    converted, report = normscope.convert(copy.deepcopy(model))
    assert not report.skipped and any("LayerNorm2d" in r.source for r in report)
    with torch.no_grad():
        assert torch.equal(converted(x), model(x))
    # FrozenBatchNorm2d: 0 of 20 were converted before (no num_features attribute)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None).eval()
    _randomize_norms(backbone)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = backbone(x)
    converted, report = normscope.convert(copy.deepcopy(backbone))
    assert len(report) == 20 and not report.skipped
    assert isinstance(converted.body.bn1, normscope.FrozenBatchNorm2d)
    with torch.no_grad():
        got = converted(x)
    assert all(torch.equal(got[k], want[k]) for k in want)
    back, _ = normscope.convert(converted, to="torch")
    assert type(back.body.bn1).__module__ == "torchvision.ops.misc"


def test_timm_normact_freeze_and_convert_to_another_norm():
    """efficientnet_b0: BatchNormAct2d lost its SiLU (off by 0.57 after convert(to="group:8"), by 1.18 after
    freeze_batchnorm) and unfreeze brought back a ReLU."""
    timm = zoo_import("timm")
    model, x = _build(timm, "efficientnet_b0", {}, 64)
    with torch.no_grad():
        want = model(x)
    frozen = normscope.freeze_batchnorm(copy.deepcopy(model))
    assert isinstance(frozen.bn1, normscope.FrozenBatchNorm2d) and isinstance(frozen.bn1.act, nn.SiLU)
    with torch.no_grad():
        assert torch.equal(frozen(x), want)
    back = normscope.unfreeze_batchnorm(frozen)
    assert type(back.bn1).__name__ == "BatchNormAct2d" and isinstance(back.bn1.act, nn.SiLU)
    grouped, report = normscope.convert(copy.deepcopy(model), to="group:8", where=nn.BatchNorm2d)
    assert isinstance(grouped.bn1, normscope.GroupNorm) and isinstance(grouped.bn1.act, nn.SiLU)
    assert not report.skipped


def test_timm_norms_with_their_eps_and_the_ones_no_configuration_reproduces():
    zoo_import("timm")
    from timm import layers as L

    x = torch.randn(2, 8, 5, 5)
    for layer, want in (
        (L.LayerNorm(8, eps=1e-3), normscope.LayerNorm),  # eps 1e-3 became 1e-6 with to="layer"
        (L.LayerNorm2d(8, eps=1e-3), normscope.LayerNorm2d),
        (L.RmsNorm(8, eps=1e-3), normscope.RMSNorm),
        (L.GroupNorm1(8), normscope.GroupNorm),
    ):
        converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)))
        assert isinstance(converted[0], want) and converted[0].eps == layer.eps, type(layer).__name__
        inp = x.permute(0, 2, 3, 1) if isinstance(layer, (L.LayerNorm, L.RmsNorm)) else x
        assert torch.equal(converted[0](inp), layer(inp)), type(layer).__name__
    converted, report = normscope.convert(nn.Sequential(L.LayerNorm(8, eps=1e-3)), to="layer")
    assert converted[0].eps == 1e-3
    _, report = normscope.convert(nn.Sequential(L.RmsNorm2d(8), L.SimpleNorm(8)))
    assert [s.path for s in report.skipped] == ["0", "1"]
    assert all("reproduces it" in s.reason for s in report.skipped)
