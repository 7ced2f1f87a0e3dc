"""Model surgery inside the zoos: one model of each timm architecture family, torchvision's models
and detection backbone, with random weights and a small input (32 px).

For each model: ``convert(model)`` gives the original's output bit for bit (evaluation and one
training step: outputs, running statistics, gradients), ``convert(model, to="torch")`` gives back
the original classes at every path and the same output, every norm the model holds is either
converted or named in ``report.skipped``, and the test prints converted/recognised. Everything is
compared with the original model, never with normscope.

The models were chosen as the smallest of each family (by parameter count) that builds at a small
input. The default run covers 13 families with every kind of timm norm (BatchNorm, the NormAct
layers, LayerNorm/LayerNorm2d, GroupNorm1, RmsNorm, EvoNorm, LeViT's BatchNorm1d) within the time
budget of a 2-core CI machine; ``NORMSCOPE_ZOO_ALL=1`` adds one model of 52 more families
(``LARGE``; about ten minutes there). Families whose smallest model exceeds 30 M parameters
(BEiT, Inception-ResNet, NasNet, ...) are not listed.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from test_zoo_setup import zoo_import
from torch import nn

import normscope

# family (timm.models module) -> (model, create_model keywords, input size)
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "convnext": ("test_convnext", {}, 32),
    "edgenext": ("edgenext_xx_small", {}, 32),
    "efficientnet": ("efficientnet_b0", {}, 32),
    "efficientnet (EvoNorm)": ("test_efficientnet_evos", {}, 32),
    "hgnet": ("hgnetv2_b0", {}, 32),
    "levit": ("levit_128s", {"img_size": 32}, 32),
    "mambaout": ("test_mambaout", {}, 32),
    "maxxvit": ("test_coatnet", {"img_size": 32}, 32),
    "mobilenetv3": ("lcnet_035", {}, 32),
    "nfnet": ("test_nfnet", {}, 32),
    "resnet": ("resnet10t", {}, 32),
    "starnet": ("starnet_s050", {}, 32),
    "vision_transformer": ("vit_tiny_patch16_224", {"img_size": 32}, 32),
}
LARGE: dict[str, tuple[str, dict, int]] = {
    "cait": ("cait_xxs24_224", {"img_size": 64}, 64),
    "convit": ("convit_tiny", {"img_size": 64}, 64),
    "cpubone": ("cpubone_nano", {}, 64),
    "cspnet": ("cs3darknet_focus_s", {}, 64),
    "cspnext": ("cspnext_tiny", {}, 64),
    "deit": ("deit_tiny_patch16_224", {"img_size": 64}, 64),
    "densenet": ("densenet121", {}, 64),
    "dla": ("dla46x_c", {}, 64),
    "dpn": ("dpn48b", {}, 64),
    "efficientformer_v2": ("efficientformerv2_s0", {"img_size": 64}, 64),
    "efficientvim": ("efficientvim_m1", {}, 64),
    "efficientvit_mit": ("efficientvit_b0", {}, 64),
    "efficientvit_msra": ("efficientvit_m0", {"img_size": 64}, 64),
    "eva": ("vit_tiny_patch16_dinov3_qkvb", {"img_size": 64}, 64),
    "fasternet": ("fasternet_t0", {}, 64),
    "gcvit": ("gcvit_xxtiny", {"img_size": 64}, 64),
    "ghostnet": ("ghostnet_050", {}, 64),
    "hardcorenas": ("hardcorenas_b", {}, 64),
    "inception_next": ("inception_next_atto", {}, 64),
    "lcnetv2": ("lcnetv2_small", {}, 64),
    "lowformer": ("lowformer_b0", {}, 64),
    "metaformer": ("poolformerv2_s12", {}, 64),
    "mlp_mixer": ("gmlp_ti16_224", {"img_size": 64}, 64),
    "mobilevit": ("mobilevit_xxs", {"img_size": 64}, 64),
    "mvitv2": ("mvitv2_tiny", {"img_size": 64}, 64),
    "pit": ("pit_ti_224", {"img_size": 64}, 64),
    "pvt_v2": ("pvt_v2_b0", {}, 64),
    "resnest": ("resnest14d", {}, 64),
    "resnetv2": ("resnetv2_18", {}, 64),
    "tiny_vit": ("tiny_vit_5m_224", {}, 64),
    "byoanet": ("eca_botnext26ts_256", {"img_size": 64}, 64),
    "byobnet": ("mobileone_s1", {"img_size": 64}, 64),
    "coat": ("coat_tiny", {"img_size": 64}, 64),
    "convmixer": ("convmixer_768_32", {}, 64),
    "crossvit": ("crossvit_tiny_240", {}, 64),
    "csatv2": ("csatv2", {}, 64),
    "davit": ("davit_tiny", {}, 64),
    "efficientformer": ("efficientformer_l1", {}, 224),
    "fastvit": ("fastvit_t8", {}, 64),
    "focalnet": ("focalnet_tiny_srf", {}, 64),
    "hiera": ("hiera_tiny_224", {"img_size": 64}, 64),
    "hieradet_sam2": ("sam2_hiera_tiny", {}, 64),
    "hrnet": ("hrnet_w18_small", {}, 64),
    "iformer": ("iformer_t", {}, 64),
    "inception_v3": ("adv_inception_v3", {}, 224),
    "nest": ("jx_nest_tiny", {"img_size": 64}, 64),
    "rdnet": ("rdnet_tiny", {}, 64),
    "regnet": ("regnetx_002", {}, 64),
    "repghost": ("repghostnet_050", {}, 64),
    "repvit": ("repvit_m1", {"img_size": 64}, 64),
    "res2net": ("res2next50", {}, 64),
    "resnetv2 (GroupNormAct)": ("resnetv2_50x1_bit", {}, 64),
}
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
    # one training step: the same values to rounding (each converted layer was probed bit for bit on
    # one input shape; batch statistics over another extent may round differently in the last bit)
    a, b = copy.deepcopy(model).train(), copy.deepcopy(converted).train()
    ya = torch.manual_seed(7) and a(x)  # the same dropout draws on both sides
    yb = torch.manual_seed(7) and b(x)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-5, msg=f"{label}: training output")
    ya.square().mean().backward(), yb.square().mean().backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"{label}: grad of {n}")
    for (n, s), (_, t) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(t, s, rtol=1e-4, atol=1e-6, msg=f"{label}: buffer {n}")
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
    from torchvision.models import mobilenet_v3_small, resnet18
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    for make in (resnet18, mobilenet_v3_small):
        torch.manual_seed(0)
        model = make(num_classes=4)
        _randomize_norms(model)
        _check_round_trip(model.eval(), torch.randn(2, 3, 32, 32), f"torchvision {make.__name__}")
    # ConvNeXt's LayerNorm2d (a torch LayerNorm subclass that permutes to channels last)
    from torchvision.models.convnext import LayerNorm2d

    layer = LayerNorm2d(8, eps=1e-6)
    _randomize_norms(nn.Sequential(layer))
    x = torch.randn(2, 8, 5, 5)
    converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)))
    assert isinstance(converted[0], normscope.LayerNorm2d) and not report.skipped
    assert torch.equal(converted[0](x), layer(x))
    assert type(normscope.convert(converted, to="torch")[0][0]) is LayerNorm2d
    # FrozenBatchNorm2d: torchvision's has no num_features attribute; all 20 must still convert
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None).eval()
    _randomize_norms(backbone)
    x = torch.randn(1, 3, 32, 32)
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


def test_convert_to_frozen_keeps_torchvisions_frozen_batchnorm_bit_for_bit():
    """A detection backbone built with torchvision's FrozenBatchNorm2d, converted with ``to="frozen"``:
    convert built FrozenBatchNorm2d's default (unfolded) formula, 4.5e-5 off torchvision's output (2e-6
    relative), where ``convert(model)`` finds the folded one and is bit for bit. Asked for the kind of
    layer it already is, a layer keeps its numbers. Oracle: the torchvision backbone itself."""
    tv = zoo_import("torchvision")
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, norm_layer=tv.ops.FrozenBatchNorm2d)
    _randomize_norms(backbone.eval())
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = backbone(x)
    for spec in ("frozen", "frozenbatchnorm2d", normscope.FrozenBatchNorm2d):
        converted, report = normscope.convert(copy.deepcopy(backbone), to=spec, where=tv.ops.FrozenBatchNorm2d)
        assert len(report) == 20 and not report.skipped, spec
        assert isinstance(converted.body.bn1, normscope.FrozenBatchNorm2d), spec
        with torch.no_grad():
            got = converted(x)
        assert all(torch.equal(got[k], want[k]) for k in want), spec
    back, _ = normscope.convert(converted, to="torch")  # the same layer: torchvision's comes back
    assert type(back.body.bn1) is tv.ops.FrozenBatchNorm2d
    # a setting given is a setting asked for: fold=False is the unfolded formula, as asked
    unfolded, _ = normscope.convert(copy.deepcopy(backbone), to="frozen", where=tv.ops.FrozenBatchNorm2d, fold=False)
    assert not unfolded.body.bn1.fold


def _same_kind_cases():
    """(a zoo layer, the specs naming its kind, an input): timm's and torchvision's classes that convert
    maps to a normscope layer, under the registry's names for that layer (timm's names included)."""
    from timm import layers as L
    from timm.layers.norm_act import FrozenBatchNormAct2d
    from torchvision.models.convnext import LayerNorm2d as TorchvisionLayerNorm2d
    from torchvision.ops import FrozenBatchNorm2d as TorchvisionFrozenBatchNorm2d

    nchw, nlc = (4, 8, 5, 5), (4, 5, 8)
    return [
        (TorchvisionFrozenBatchNorm2d(8), ("frozen", "frozenbatchnorm2d"), nchw),
        (FrozenBatchNormAct2d(8, act_layer=nn.SiLU), ("frozen",), nchw),
        (TorchvisionLayerNorm2d(8, eps=1e-6), ("layer2d", "layernorm2d"), nchw),
        (L.LayerNorm2d(8), ("layer2d", "layernorm2d"), nchw),
        (L.LayerNormAct2d(8, act_layer=nn.SiLU), ("layer2d",), nchw),
        (L.LayerNorm(8, eps=1e-3), ("layer", "layernorm"), nlc),
        (L.LayerNormFp32(8).to(torch.bfloat16), ("layer", "layernorm"), nlc),  # fp32 gradients in bf16
        (L.RmsNorm(8), ("rms", "rmsnorm"), nlc),
        (L.GroupNorm1(8), ("group:1", "groupnorm1"), nchw),
        (L.GroupNorm(8, num_groups=4), ("group:4",), nchw),
        (L.GroupNormAct(8, num_groups=2, act_layer=nn.GELU), ("group:2",), nchw),
        (L.BatchNormAct2d(8, act_layer=nn.SiLU), ("batch", "batchnorm2d"), nchw),
        (L.BatchNormAct2d(8, act_layer=nn.SiLU, track_running_stats=False), ("batch",), nchw),
    ]


def test_convert_to_the_kind_a_zoo_layer_is_keeps_its_numbers():
    """``to=`` the normscope layer a zoo layer already converts to (by any of the registry's names for
    it) gives what ``convert(model)`` gives: the layer's numbers bit for bit -- a training step's output,
    gradients and running statistics, and evaluation. Built anew from the spec, the layer lost what the
    probe finds: FrozenBatchNorm's folding (1e-7 off), LayerNormFp32's fp32 gradients in bf16,
    ``track_running_stats=False`` (0.56 off in evaluation). A spec that sets something else (timm's
    "groupnorm": 32 groups, clipped to 8 here) builds what it says. Oracle: the zoo layer itself."""
    zoo_import("timm")
    zoo_import("torchvision")
    from timm import layers as L

    for layer, specs, shape in _same_kind_cases():
        _randomize_norms(nn.Sequential(layer))
        dtype = next(iter(layer.state_dict().values())).dtype
        g = torch.Generator().manual_seed(2)
        x, dy = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        for spec in specs:
            label = f"{type(layer).__module__}.{type(layer).__name__} to={spec!r}"
            converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)), to=spec)
            assert len(report) == 1 and not report.skipped and report[0].dropped == (), label
            results = []
            for m in (copy.deepcopy(layer), converted[0]):
                params = [p for p in m.parameters() if p.requires_grad]
                xi = x.clone().requires_grad_()
                y = m.train()(xi)
                grads = torch.autograd.grad(y, [xi, *params], dy) if y.requires_grad else ()
                with torch.no_grad():
                    results.append((y, *grads, *m.buffers(), m.eval()(x)))
            assert len(results[0]) == len(results[1]), label
            for i, (a, b) in enumerate(zip(*results)):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{label}: result {i}"
    converted, _ = normscope.convert(nn.Sequential(L.GroupNorm(8, num_groups=4)), to="groupnorm")
    assert converted[0].num_groups == 8


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


def test_timm_surgery_after_convert_keeps_the_normact_layers():
    """timm tells its NormAct layers by class: convert made BatchNormAct2d a normscope BatchNorm2d (its
    act kept as a child), so timm's freeze_batch_norm_2d took it for a plain BatchNorm2d and dropped the
    SiLU (efficientnet_b0 3.5 off) and convert_sync_batchnorm gave a SyncBatchNorm whose act never ran.
    The converted layers are instances of the classes they came from. Oracle: the same surgery on the
    original model, bit for bit."""
    timm = zoo_import("timm")
    from timm.layers import convert_sync_batchnorm
    from timm.utils.model import freeze_batch_norm_2d

    model, x = _build(timm, "efficientnet_b0", {}, 64)
    converted, report = normscope.convert(copy.deepcopy(model))
    assert not report.skipped
    for name, old in model.named_modules():
        if type(old).__name__.endswith("Act2d"):
            new = converted.get_submodule(name)
            assert isinstance(new, type(old)) and isinstance(new, normscope.BatchNorm2d), name
    with torch.no_grad():
        frozen, frozen_converted = freeze_batch_norm_2d(copy.deepcopy(model)), freeze_batch_norm_2d(converted)
        assert torch.equal(frozen_converted(x), frozen(x))
        synced = convert_sync_batchnorm(normscope.convert(copy.deepcopy(model))[0]).eval()
        assert type(synced.bn1) is type(convert_sync_batchnorm(copy.deepcopy(model)).bn1)
        assert torch.equal(synced(x), model(x))


@pytest.mark.parametrize("name", ["LayerNormFp32", "LayerNorm2dFp32", "LayerNormActFp32", "LayerNormAct2dFp32"])
def test_timm_fp32_layernorms_in_bf16_keep_their_gradients_after_convert(name):
    """timm's *Fp32 LayerNorms normalize a bf16 input in fp32. convert probed the forward only and took
    LayerNorm(casting='torch') (LayerNorm2d for the channels-first ones): the output's bits, but torch's
    bf16 backward, whose weight and bias gradients were ~8x further from float64. The probe compares a
    training step's gradients too: the last-axis ones become LayerNorm(casting='gemma'), which gives both;
    LayerNorm2d has no casting option, so the channels-first ones are left alone, saying why. Oracle: the
    timm layer itself, bit for bit."""
    zoo_import("timm")
    from timm import layers as L

    torch.manual_seed(0)
    layer = getattr(L, name)(64).to(torch.bfloat16)
    _randomize_norms(nn.Sequential(layer))
    converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)))
    if "2d" in name:
        assert [s.path for s in report.skipped] == ["0"] and "gradient" in report.skipped[0].reason
        assert type(converted[0]) is type(layer)
        return
    assert not report.skipped
    shape = (4, 64, 3, 5) if "2d" in name else (4, 7, 64)
    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2))
    results = []
    for m in (layer, converted[0]):
        xi = x.clone().requires_grad_()
        y = m(xi)
        results.append((y, *torch.autograd.grad(y, (xi, m.weight, m.bias), dy)))
    for what, a, b in zip(("output", "input grad", "weight grad", "bias grad"), *results):
        assert torch.equal(a, b), what


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
    for layer in (L.GroupNormAct(8, num_groups=2, act_layer=nn.GELU), L.LayerNormAct2d(8, act_layer=nn.SiLU)):
        _randomize_norms(nn.Sequential(layer))
        converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)))
        assert not report.skipped and type(converted[0].act) is type(layer.act), type(layer).__name__
        assert torch.equal(converted[0](x), layer(x)), type(layer).__name__
        assert type(normscope.convert(converted, to="torch")[0][0]) is type(layer)
    converted, report = normscope.convert(nn.Sequential(L.LayerNorm(8, eps=1e-3)), to="layer")
    assert converted[0].eps == 1e-3
    _, report = normscope.convert(nn.Sequential(L.RmsNorm2d(8), L.SimpleNorm(8)))
    assert [s.path for s in report.skipped] == ["0", "1"]
    assert all("reproduces it" in s.reason for s in report.skipped)


def test_timm_normact_with_a_drop_layer_converts_and_draws_as_the_original():
    """A NormAct layer with a ``drop_layer`` (timm's ConvNormAct passes cspnet's and byobnet's DropBlock as
    one) draws random numbers in training. The probe ran the layer and its candidate on different draws,
    found them 6.2 apart and left every such layer unconverted; it also advanced the caller's random
    generator. The probe now gives both sides the same draws and restores the generator. Oracle: the timm
    layer itself, on the same seed, bit for bit (output, input and parameter gradients, running stats)."""
    zoo_import("timm")
    from timm import layers as L

    for drop in (nn.Dropout, functools.partial(L.DropBlock2d, drop_prob=0.3, block_size=3)):
        torch.manual_seed(0)
        layer = L.BatchNormAct2d(8, act_layer=nn.SiLU, drop_layer=drop)
        _randomize_norms(nn.Sequential(layer))
        state = torch.get_rng_state()
        converted, report = normscope.convert(nn.Sequential(copy.deepcopy(layer)))
        assert torch.equal(torch.get_rng_state(), state), "convert consumed the caller's random numbers"
        assert not report.skipped and isinstance(converted[0], normscope.BatchNorm2d), report
        assert type(converted[0].drop) is type(layer.drop)
        x = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(1))
        dy = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(2))
        results = []
        for m in (layer, converted[0]):
            xi = x.clone().requires_grad_()
            torch.manual_seed(5)
            y = m.train()(xi)
            results.append((y, *torch.autograd.grad(y, (xi, m.weight, m.bias), dy), m.running_mean, m.running_var))
        for what, a, b in zip(("output", "input grad", "weight grad", "bias grad", "mean", "var"), *results):
            assert torch.equal(a, b), what
