"""``normscope.convert`` is lossless: compared with the torch.nn layer on the same state, the converted
layer keeps every tensor object (so dtype, device, requires_grad, None entries and optimizers follow),
its hooks, mode, ``_version`` and configuration -- and ``to="torch"`` brings it back unchanged.
Parametrized layers are refused before the model is touched.

``convert`` and ``freeze_batchnorm`` on layers that are not exactly torch.nn's: subclasses, layers
that do more than normalize (a norm followed by an activation, as timm's NormAct layers), layers of
other libraries. A layer is converted only to what reproduces it, never stripped of its activation,
and a layer left unconverted is named in the report with why. Each case is checked against the
original layer (a copy kept aside), never against normscope.

Whole models (a CNN, a transformer block) convert losslessly, and converting to another norm carries
what fits."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import normscope

# every torch.nn layer convert handles, in the configurations that change its state
CASES = {
    "bn1d": (lambda: nn.BatchNorm1d(5), (6, 5, 4)),
    "bn1d_2d_input": (lambda: nn.BatchNorm1d(5, momentum=None), (6, 5)),
    "bn2d": (lambda: nn.BatchNorm2d(5), (4, 5, 3, 3)),
    "bn2d_noaffine": (lambda: nn.BatchNorm2d(5, affine=False), (4, 5, 3, 3)),
    "bn2d_nobias": (lambda: nn.BatchNorm2d(5, bias=False), (4, 5, 3, 3)),
    "bn2d_untracked": (lambda: nn.BatchNorm2d(5, track_running_stats=False), (4, 5, 3, 3)),
    "bn3d": (lambda: nn.BatchNorm3d(5, eps=1e-3, momentum=0.3), (2, 5, 2, 3, 2)),
    "in1d": (lambda: nn.InstanceNorm1d(5, affine=True, track_running_stats=True), (3, 5, 7)),
    "in2d": (lambda: nn.InstanceNorm2d(5), (3, 5, 4, 4)),
    "in3d": (lambda: nn.InstanceNorm3d(5, affine=True), (2, 5, 2, 3, 3)),
    "ln": (lambda: nn.LayerNorm((3, 5)), (4, 3, 5)),
    "ln_nobias": (lambda: nn.LayerNorm(5, bias=False), (4, 5)),
    "ln_noaffine": (lambda: nn.LayerNorm(5, elementwise_affine=False), (4, 5)),
    "rms": (lambda: nn.RMSNorm(5, eps=1e-4), (4, 5)),
    "rms_eps_none": (lambda: nn.RMSNorm([2, 5]), (4, 2, 5)),
    "gn": (lambda: nn.GroupNorm(2, 6), (3, 6, 5)),
    "gn_nobias": (lambda: nn.GroupNorm(3, 6, bias=False), (3, 6, 5)),
    "lrn": (lambda: nn.LocalResponseNorm(3), (2, 5, 4)),
    "syncbn": (lambda: nn.SyncBatchNorm(5), (4, 5, 3)),
}


def _randomized(make, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = make()
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if "var" in name else torch.randn_like(t))
            else:
                t.fill_(3)
    return m


def _x(shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 5


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].device == sb[k].device, k
        assert torch.equal(sa[k], sb[k]), k
    assert sa._metadata == sb._metadata  # _version per module
    for (na, ta), (nb, tb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and ta.requires_grad == tb.requires_grad
    assert {n: t is None for n, t in a._buffers.items()} == {n: t is None for n, t in b._buffers.items()}
    assert {n: t is None for n, t in a._parameters.items()} == {n: t is None for n, t in b._parameters.items()}


def _assert_same_behaviour(ref: nn.Module, got: nn.Module, shape) -> None:
    """Train and eval: outputs, gradients and running statistics equal (same state in, same out)."""
    assert ref.training == got.training
    for step in range(2):
        x1 = _x(shape, seed=step).requires_grad_()
        x2 = x1.detach().clone().requires_grad_()
        y1, y2 = ref(x1), got(x2)
        torch.testing.assert_close(y2, y1, atol=1e-5, rtol=1e-5)
        g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(9))
        y1.backward(g), y2.backward(g)
        torch.testing.assert_close(x2.grad, x1.grad, atol=1e-4, rtol=1e-4)
    for (n, p1), (_, p2) in zip(ref.named_parameters(), got.named_parameters()):
        if p1.grad is not None or p2.grad is not None:
            torch.testing.assert_close(p2.grad, p1.grad, atol=1e-4, rtol=1e-4, msg=n)
    for (n, b1), (_, b2) in zip(ref.named_buffers(), got.named_buffers()):
        torch.testing.assert_close(b2, b1, atol=1e-5, rtol=1e-5, msg=n)
    ref.eval(), got.eval()
    x = _x(shape, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(got(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_kind_is_lossless_both_ways(case):
    make, shape = CASES[case]
    torch_layer = _randomized(make)
    ref = copy.deepcopy(torch_layer)
    tensors = {n: t for n, t in [*torch_layer._parameters.items(), *torch_layer._buffers.items()]}
    ns, report = normscope.convert(torch_layer)
    assert type(ns).__module__.startswith("normscope.") and type(ns).__name__ == type(ref).__name__
    assert report[0].dropped == ()
    for n, t in [*ns._parameters.items(), *ns._buffers.items()]:
        assert t is tensors[n], f"{n}: not the same object"
    _assert_same_state(ref, ns)
    # back to torch.nn: the same again
    back, report = normscope.convert(ns, to="torch")
    assert type(back) is type(ref)
    for n, t in [*back._parameters.items(), *back._buffers.items()]:
        assert t is tensors[n]
    _assert_same_state(ref, back)
    _assert_same_behaviour(copy.deepcopy(ref), copy.deepcopy(ns), shape)
    _assert_same_behaviour(ref, back, shape)


@pytest.mark.parametrize("how", ["set_to_none", "untracked"])
def test_batchnorm_without_running_statistics_stays_so(how):
    if how == "set_to_none":
        bn = _randomized(lambda: nn.BatchNorm2d(4))
        bn.running_mean, bn.running_var = None, None  # torch then normalizes with batch statistics in eval
    else:
        bn = _randomized(lambda: nn.BatchNorm2d(4, track_running_stats=False))
    bn.eval()
    ref = copy.deepcopy(bn)
    model, _ = normscope.convert(nn.Sequential(bn))
    assert model[0].running_mean is None and model[0].running_var is None
    x = _x((3, 4, 2, 2))
    torch.testing.assert_close(model(x), ref(x))
    _assert_same_state(ref, model[0])


def test_frozen_parameters_stay_frozen():
    bn = _randomized(lambda: nn.BatchNorm2d(4))
    bn.weight.requires_grad_(False)
    gn = _randomized(lambda: nn.GroupNorm(2, 4))
    gn.bias.requires_grad_(False)
    model, _ = normscope.convert(nn.Sequential(bn, gn))
    assert not model[0].weight.requires_grad and model[0].bias.requires_grad
    assert model[1].weight.requires_grad and not model[1].bias.requires_grad
    model(_x((2, 4, 3, 3))).sum().backward()
    assert model[0].weight.grad is None and model[1].bias.grad is None
    # another kind (to=spec) keeps it too
    bn = nn.BatchNorm2d(4)
    bn.weight.requires_grad_(False)
    (gn2,), _ = normscope.convert(nn.Sequential(bn), to="group:2")
    assert type(gn2) is normscope.GroupNorm and not gn2.weight.requires_grad


def test_dtype_per_tensor_is_kept():
    bn = _randomized(lambda: nn.BatchNorm1d(4))
    bn.weight.data = bn.weight.data.bfloat16()
    bn.bias.data = bn.bias.data.bfloat16()  # bf16 affine, fp32 running statistics
    ref = copy.deepcopy(bn)
    (new,), _ = normscope.convert(nn.Sequential(bn))
    assert new.weight.dtype == new.bias.dtype == torch.bfloat16
    assert new.running_mean.dtype == new.running_var.dtype == torch.float32
    assert new.num_batches_tracked.dtype == torch.int64
    _assert_same_state(ref, new)
    ln = nn.LayerNorm(4, dtype=torch.float64)
    (new,), _ = normscope.convert(nn.Sequential(ln))
    assert new.weight.dtype == torch.float64
    # another kind: what moves keeps its dtype; the new running statistics take the weights' dtype
    bn = nn.GroupNorm(2, 4).bfloat16()
    (new,), _ = normscope.convert(nn.Sequential(bn), to="batch")
    assert new.weight.dtype == new.running_mean.dtype == torch.bfloat16


def test_device_is_kept():
    bn = nn.BatchNorm2d(4, device="meta")
    (new,), _ = normscope.convert(nn.Sequential(bn))
    assert all(t.device.type == "meta" for t in [*new.parameters(), *new.buffers()])
    bn = nn.GroupNorm(2, 4, device="meta")
    (new,), _ = normscope.convert(nn.Sequential(bn), to="batch")
    assert all(t.device.type == "meta" for t in [*new.parameters(), *new.buffers()])


@pytest.mark.parametrize("training", [True, False])
def test_mode_is_kept(training):
    model = nn.Sequential(nn.BatchNorm2d(4), nn.LayerNorm(3)).train(training)
    model, _ = normscope.convert(model)
    assert model[0].training is training and model[1].training is training
    model, _ = normscope.convert(model, to="torch")
    assert model[0].training is training and model[1].training is training


def test_hooks_move_and_their_handles_still_work():
    bn = _randomized(lambda: nn.BatchNorm1d(4))
    seen: list[str] = []
    handles = [
        bn.register_forward_pre_hook(lambda m, args: seen.append("pre")),
        bn.register_forward_pre_hook(lambda m, args, kwargs: seen.append("pre_kw"), with_kwargs=True),
        bn.register_forward_hook(lambda m, args, out: seen.append("fwd")),
        bn.register_forward_hook(lambda m, args, kwargs, out: seen.append("fwd_kw"), with_kwargs=True),
        bn.register_full_backward_pre_hook(lambda m, gout: seen.append("bwd_pre")),
        bn.register_full_backward_hook(lambda m, gin, gout: seen.append("bwd")),
        bn.register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append("sd_pre")),
        bn.register_state_dict_post_hook(lambda m, sd, prefix, meta: seen.append("sd")),
        bn.register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: seen.append("load_pre")),
        bn.register_load_state_dict_post_hook(lambda m, keys: seen.append("load")),
    ]
    model, _ = normscope.convert(nn.Sequential(bn))
    new = model[0]
    assert type(new) is normscope.BatchNorm1d

    def run() -> list[str]:
        seen.clear()
        x = _x((3, 4)).requires_grad_()
        new(x).sum().backward()
        new.load_state_dict(new.state_dict())
        return sorted(seen)

    want = sorted(["pre", "pre_kw", "fwd", "fwd_kw", "bwd_pre", "bwd", "sd_pre", "sd", "load_pre", "load"])
    assert run() == want
    back, _ = normscope.convert(new, to="torch")
    new = back
    assert run() == want
    for h in handles:
        h.remove()
    assert run() == []


def test_optimizer_built_before_conversion_still_trains_the_model():
    torch.manual_seed(0)
    torch_model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.BatchNorm1d(6))
    ours = copy.deepcopy(torch_model)
    opt_t = torch.optim.Adam(torch_model.parameters(), lr=0.1)
    opt_o = torch.optim.Adam(ours.parameters(), lr=0.1)
    ours, _ = normscope.convert(ours)  # after the optimizer was built
    assert type(ours[1]) is normscope.LayerNorm and type(ours[3]) is normscope.BatchNorm1d
    for step in range(3):
        x = _x((8, 4), seed=step)
        for model, opt in ((torch_model, opt_t), (ours, opt_o)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    before = nn.LayerNorm(6).weight
    assert not torch.equal(ours[1].weight, before)  # it moved
    for (n, p1), (_, p2) in zip(torch_model.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(p2, p1, atol=1e-5, rtol=1e-5, msg=n)
    for (n, b1), (_, b2) in zip(torch_model.named_buffers(), ours.named_buffers()):
        torch.testing.assert_close(b2, b1, atol=1e-5, rtol=1e-5, msg=n)


def test_round_trip_of_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6, momentum=None),
        nn.GroupNorm(3, 6),
        nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
        nn.LocalResponseNorm(2),
        nn.Flatten(),
        nn.LayerNorm(6 * 16),
        nn.RMSNorm(6 * 16),
    )
    model[1].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    ours, report = normscope.convert(copy.deepcopy(model))
    assert [r.path for r in report] == ["1", "2", "3", "4", "6", "7"]
    back, report = normscope.convert(copy.deepcopy(ours), to="torch")
    assert [type(m) for m in back.modules()] == [type(m) for m in ref.modules()]
    for m in (ours, back):
        _assert_same_state(ref, m)
    x = _x((2, 3, 4, 4))
    want = ref(x)  # one training step each: running statistics move alike
    for m in (ours, back):
        torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
    ref.eval(), ours.eval(), back.eval()
    want = ref(x)
    for m in (ours, back):
        torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)


def test_version_and_attributes_set_after_construction_are_kept():
    bn = nn.BatchNorm2d(4)
    bn.momentum = 0.02  # changed after construction
    bn.tag = "stem"  # a user attribute
    bn._version = 1  # an instance that reports an older layout
    (new,), _ = normscope.convert(nn.Sequential(bn))
    assert new.momentum == 0.02 and new.tag == "stem" and new._version == 1
    assert new.state_dict()._metadata[""]["version"] == 1


def test_non_persistent_buffer_stays_out_of_the_state_dict():
    bn = nn.BatchNorm1d(4)
    bn.register_buffer("num_batches_tracked", bn.num_batches_tracked, persistent=False)
    ref = copy.deepcopy(bn)
    (new,), _ = normscope.convert(nn.Sequential(bn))
    assert "num_batches_tracked" not in new.state_dict()
    _assert_same_state(ref, new)


def test_parametrized_layers_are_refused_and_the_model_is_untouched():
    from torch.nn.utils import parametrizations

    model = nn.Sequential(nn.BatchNorm2d(4), nn.GroupNorm(2, 4))
    parametrizations.weight_norm(model[1], "weight", dim=0)
    with pytest.raises(ValueError, match=r"1 \(ParametrizedGroupNorm\) has parametrized tensors \(weight"):
        normscope.convert(model)
    assert type(model[0]) is nn.BatchNorm2d  # nothing replaced: the refusal came first
    # torch.nn.utils.weight_norm, which works by a forward pre-hook, too (its weight_g / weight_v have no place)
    model = nn.Sequential(nn.BatchNorm2d(4), nn.GroupNorm(2, 4))
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(model[1], "weight", dim=0)
    with pytest.raises(ValueError, match=r"weight_g.*weight_norm is applied"):
        normscope.convert(model)
    assert type(model[0]) is nn.BatchNorm2d
    # left out explicitly, the rest converts
    model, report = normscope.convert(model, where=nn.BatchNorm2d)
    assert [r.path for r in report] == ["0"]


def test_a_target_that_cannot_be_built_names_the_layer_and_leaves_the_model():
    # group:32 fits the 64-channel layer, not the 6-channel one: the error says which layer of the model
    model = nn.Sequential(nn.BatchNorm2d(64), nn.Conv2d(64, 6, 1), nn.Sequential(nn.BatchNorm2d(6)))
    with pytest.raises(
        ValueError, match=r"^convert: at '2\.0' \(torch\.BatchNorm2d\(6, .*divisible by num_groups \(32\)"
    ):
        normscope.convert(model, to="group:32")
    assert type(model[0]) is nn.BatchNorm2d and type(model[2][0]) is nn.BatchNorm2d


def test_to_torch_refuses_a_layout_torch_does_not_have():
    model = nn.Sequential(normscope.BatchNorm1d(4, channel_dim=-1), normscope.LayerNorm(4))
    with pytest.raises(ValueError, match="channel_dim=1"):
        normscope.convert(model, to="torch")
    assert type(model[1]) is normscope.LayerNorm
    model, report = normscope.convert(model, to="torch", where=nn.LayerNorm)
    assert type(model[1]) is nn.LayerNorm and type(model[0]) is normscope.BatchNorm1d


@pytest.mark.parametrize(
    "make",
    [
        lambda: normscope.RMSNorm(4, weight_offset=1.0),
        lambda: normscope.LayerNorm(4, weight_offset=1.0),
        lambda: normscope.LayerNorm(4, casting="llama"),
        lambda: normscope.RMSNorm(4, casting="gemma"),
    ],
    ids=["rms_offset", "ln_offset", "ln_llama", "rms_gemma"],
)
def test_to_torch_refuses_family_options_torch_does_not_have(make):
    # torch.nn's LayerNorm/RMSNorm have no weight offset and round as casting="torch": the namesake
    # would compute another function (a weight offset of 1.0 moves every output by ~x_hat)
    layer = make()
    with torch.no_grad():
        layer.weight.normal_()
    model = nn.Sequential(layer)
    with pytest.raises(ValueError, match=r"weight_offset=0\.0 and casting='torch'"):
        normscope.convert(model, to="torch")
    assert model[0] is layer  # refused before the model is touched
    x = torch.randn(3, 5, 4)
    y = layer(x)
    model, report = normscope.convert(model, to="torch", where=lambda m: False)
    assert torch.equal(model[0](x), y) and not report


class MyLN(nn.LayerNorm):
    pass


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in miniature: BatchNorm, then drop, then the activation (children)."""

    def __init__(self, c: int, act: type = nn.SiLU, eps: float = 1e-5) -> None:
        super().__init__(c, eps=eps)
        self.drop = nn.Identity()
        self.act = act()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


class ScaledLN(nn.LayerNorm):
    """Does more than normalize and says nothing about it: no configuration reproduces it."""

    def forward(self, x):
        return super().forward(x) * 2


class ForeignRMSNorm(nn.Module):
    """Another library's RMSNorm (no torch base class), computing torch's."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _randomized_in_place(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if "var" in name else torch.randn(t.shape, generator=g))
    return m


def _input(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def test_a_subclass_named_by_where_is_converted_not_silently_skipped():
    model = nn.Sequential(_randomized_in_place(MyLN(16)))
    original = copy.deepcopy(model)
    model, report = normscope.convert(model, where=MyLN)
    assert [r.path for r in report] == ["0"] and isinstance(model[0], normscope.LayerNorm)
    x = _input(3, 5, 16)
    assert torch.equal(model(x), original(x))
    back, _ = normscope.convert(model, to="torch")
    assert type(back[0]) is MyLN  # the subclass itself comes back


def test_normact_keeps_its_activation_lossless_and_to_another_norm():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _randomized_in_place(BatchNormAct(6)))
    original = copy.deepcopy(model)
    x = _input(2, 3, 7, 7)
    converted, report = normscope.convert(copy.deepcopy(model))
    assert [r.path for r in report] == ["1"] and not report.skipped
    assert isinstance(converted[1], normscope.BatchNorm2d) and isinstance(converted[1].act, nn.SiLU)
    assert list(converted.state_dict()) == list(original.state_dict())
    for mode in ("train", "eval"):
        getattr(original, mode)(), getattr(converted, mode)()
        assert torch.equal(converted(x), original(x)), mode
    assert torch.equal(converted[1].running_mean, original[1].running_mean)
    # to another norm: the activation stays after it (dropping it would change the output by O(1))
    grouped, report = normscope.convert(copy.deepcopy(model), to="group:2", where=nn.BatchNorm2d)
    assert isinstance(grouped[1], normscope.GroupNorm) and isinstance(grouped[1].act, nn.SiLU)
    ref = nn.Sequential(model[0], nn.GroupNorm(2, 6), nn.SiLU())
    with torch.no_grad():
        ref[1].weight.copy_(model[1].weight), ref[1].bias.copy_(model[1].bias)
    torch.testing.assert_close(grouped(x), ref(x), rtol=1e-5, atol=1e-5)
    assert pickle.loads(pickle.dumps(converted))[1].act is not None  # the generated class pickles


def test_a_layer_that_does_more_is_skipped_and_named():
    model = nn.Sequential(nn.Linear(4, 8), _randomized_in_place(ScaledLN(8)), nn.LayerNorm(8))
    x = _input(2, 4)
    want = model(x)
    model, report = normscope.convert(model)
    assert [r.path for r in report] == ["2"]
    assert [s.path for s in report.skipped] == ["1"] and "reproduces it" in report.skipped[0].reason
    assert type(model[1]) is ScaledLN and torch.equal(model(x), want)
    assert "at '1'" in str(report) and "left as they are" in str(report)
    _, report = normscope.convert(model, to="group:2", where=ScaledLN)
    assert len(report) == 1  # another norm is asked for: what the layer computes is replaced on purpose


def test_foreign_norms_are_probed_and_carried_both_ways():
    layer = ForeignRMSNorm(8, eps=1e-3)
    original = copy.deepcopy(layer)
    model, report = normscope.convert(nn.Sequential(layer))
    assert isinstance(model[0], normscope.RMSNorm) and model[0].eps == 1e-3
    x = _input(3, 8)
    assert torch.equal(model(x), original(x))
    back, _ = normscope.convert(model, to="torch")
    assert type(back[0]) is ForeignRMSNorm and back[0].weight is layer.weight


def test_convert_to_another_norm_carries_eps_momentum_and_affine():
    bn = nn.BatchNorm2d(4, eps=1e-3, momentum=0.3, affine=False)
    model, _ = normscope.convert(nn.Sequential(bn), to="batchrenorm")
    assert (model[0].eps, model[0].momentum, model[0].affine) == (1e-3, 0.3, False)
    model, _ = normscope.convert(nn.Sequential(nn.LayerNorm(8, eps=1e-3)), to="rms")
    assert model[0].eps == 1e-3
    model, _ = normscope.convert(nn.Sequential(nn.LayerNorm(8, eps=1e-3)), to="rms", eps=1e-7)
    assert model[0].eps == 1e-7  # the caller's keyword wins


@pytest.mark.parametrize(
    "make, to, shape",
    [
        (lambda: nn.BatchNorm2d(4, track_running_stats=False), "batch", (3, 4, 2, 2)),  # eval: batch statistics
        (lambda: nn.LayerNorm((3, 5)), "layer", (4, 3, 5)),  # was LayerNorm(5), its weight dropped
        (lambda: nn.LayerNorm(5, bias=False), "layer", (4, 5)),
        (lambda: nn.GroupNorm(3, 6, eps=1e-3), "group:3", (2, 6, 5)),
        (lambda: nn.InstanceNorm1d(5, affine=True, track_running_stats=True), "instance1d", (3, 5, 7)),
        (lambda: normscope.FrozenBatchNorm2d(4, fold=True), "frozen", (3, 4, 2, 2)),  # was fold=False
        (lambda: normscope.RMSNorm(5, casting="gemma", weight_offset=1.0), "rms", (4, 5)),
        (lambda: normscope.BatchNorm1d(5, channel_dim=-1), "batch1d", (4, 3, 5)),
    ],
)
def test_convert_to_the_kind_a_layer_is_keeps_the_layer(make, to, shape):
    """Asked for the kind of layer it already is, a layer keeps its numbers and configuration (as the
    lossless conversion does): built anew from the spec, it lost what the spec does not say --
    track_running_stats=False, a LayerNorm over two axes, a normscope layer's fold, casting, weight
    offset or channel axis. Oracle: the original layer, on the same state."""
    layer = _randomized(make)
    ref = copy.deepcopy(layer)
    (new,), report = normscope.convert(nn.Sequential(layer), to=to)
    assert len(report) == 1 and report[0].dropped == ()
    assert type(new).__name__ == type(ref).__name__ and new.extra_repr() == ref.extra_repr()
    if type(ref).__module__.startswith("normscope"):
        assert new is layer  # already that layer: it stays, the same object
    _assert_same_state(ref, new)
    _assert_same_behaviour(ref, new, shape)


def test_convert_to_the_kind_a_layer_is_with_other_settings_builds_what_is_asked():
    """A setting given -- by the spec (``"group:2"``, ``"group"``'s default groups) or as a keyword -- is
    asked for: the layer is built anew with it."""
    (new,), _ = normscope.convert(nn.Sequential(nn.GroupNorm(3, 6)), to="group:2")
    assert new.num_groups == 2
    (new,), _ = normscope.convert(nn.Sequential(nn.GroupNorm(3, 6)), to="group")
    assert new.num_groups == 6
    (new,), _ = normscope.convert(nn.Sequential(normscope.FrozenBatchNorm2d(4, fold=True)), to="frozen", fold=False)
    assert not new.fold
    (new,), _ = normscope.convert(nn.Sequential(nn.BatchNorm2d(4)), to="batch", track_running_stats=False)
    assert not new.track_running_stats and new.running_mean is None


def test_report_paths_are_quoted_and_skips_listed():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LayerNorm(4))
    _, report = normscope.convert(model, to="group:2", where=nn.BatchNorm2d)
    text = str(report)
    assert "at '1': torch.BatchNorm2d(4" in text and "\n  1:" not in text
    assert [(s.path, s.reason) for s in report.skipped] == [("2", "not selected by `where`")]
    _, report = normscope.convert(nn.Sequential(ScaledLN(4)))
    assert str(report).startswith("convert: no layer replaced\nconvert: 1 normalization-like layer(s) left")


def test_freeze_keeps_the_activation_and_unfreeze_brings_back_the_layer():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _randomized_in_place(BatchNormAct(6, act=nn.GELU))).eval()
    x = _input(2, 3, 7, 7)
    want = model(x)
    frozen = normscope.freeze_batchnorm(copy.deepcopy(model))
    assert isinstance(frozen[1], normscope.FrozenBatchNorm2d) and isinstance(frozen[1].act, nn.GELU)
    assert torch.equal(frozen(x), want)
    back = normscope.unfreeze_batchnorm(frozen)
    assert type(back[1]) is BatchNormAct and isinstance(back[1].act, nn.GELU)  # not a ReLU, not a plain BN
    assert torch.equal(back.eval()(x), want)


def test_freeze_leaves_what_it_cannot_reproduce_and_warns():
    class OddBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) + 1

    model = nn.Sequential(OddBN(3)).eval()
    with pytest.warns(UserWarning, match=r"at '0': a FrozenBatchNorm2d does not reproduce it"):
        frozen = normscope.freeze_batchnorm(model)
    assert type(frozen[0]) is OddBN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normscope.freeze_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


# -- convert ---------------------------------------------------------------------------------------


def _cnn() -> nn.Module:
    torch.manual_seed(3)
    return _randomize(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8, momentum=None),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.GroupNorm(4, 8),
            nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
            nn.Conv2d(8, 4, 1),
            nn.BatchNorm2d(4, affine=False),
        ),
        seed=3,
    )


def test_convert_cnn_is_lossless():
    torch_model = _cnn()
    model, report = normscope.convert(copy.deepcopy(torch_model))
    assert [r.path for r in report] == ["1", "4", "5", "7"]
    assert type(model[1]) is normscope.BatchNorm2d and type(model[4]) is normscope.GroupNorm
    assert "running_mean" in report[0].carried and "num_batches_tracked" in report[0].carried
    assert "at '1': torch.BatchNorm2d" in str(report)
    for _ in range(2):  # training: outputs, gradients and running statistics identical
        x = torch.randn(2, 3, 6, 6)
        y1, y2 = torch_model(x), model(x)
        torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-6)
        y1.square().sum().backward(), y2.square().sum().backward()
    for (n1, p1), (n2, p2) in zip(torch_model.named_parameters(), model.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p1.grad, p2.grad, atol=1e-5, rtol=1e-5)
    for (n1, b1), (n2, b2) in zip(torch_model.named_buffers(), model.named_buffers()):
        assert n1 == n2
        torch.testing.assert_close(b1, b2, atol=1e-6, rtol=1e-6)
    torch_model.eval(), model.eval()
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(torch_model(x), model(x), atol=1e-6, rtol=1e-6)
    _, again = normscope.convert(model)  # nothing left to convert
    assert len(again) == 0


def test_convert_transformer_block_is_lossless():
    torch.manual_seed(4)
    block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    _randomize(block.norm1, 1), _randomize(block.norm2, 2)
    model, report = normscope.convert(copy.deepcopy(block))
    assert [r.path for r in report] == ["norm1", "norm2"]
    assert type(model.norm1) is normscope.LayerNorm
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(model(x), block(x), atol=1e-6, rtol=1e-6)
    block.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), block(x), atol=1e-6, rtol=1e-6)


def test_convert_to_other_norms_carries_what_fits():
    model = _cnn()
    with torch.no_grad():
        want_w = model[1].weight.clone()
    model, report = normscope.convert(model, to="group:2", where=nn.BatchNorm2d)
    assert [r.path for r in report] == ["1", "7"]
    assert type(model[1]) is normscope.GroupNorm and model[1].num_groups == 2
    assert torch.equal(model[1].weight, want_w)
    assert report[0].carried == ("weight", "bias") and "running_mean" in report[0].dropped
    model, report = normscope.convert(model, to="frozen", where=lambda name, m: name == "5")
    assert [r.path for r in report] == ["5"] and isinstance(model[5], normscope.FrozenBatchNorm2d)
    block = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    block, report = normscope.convert(block, to="dyt", where=lambda m: isinstance(m, nn.LayerNorm))
    assert type(block.norm1) is normscope.DyT and report[0].carried == ("weight", "bias")
    block(torch.randn(2, 3, 8))
    root, report = normscope.convert(nn.LayerNorm(4), to="rms")
    assert type(root) is normscope.RMSNorm and report[0].path == ""
    with pytest.raises(ValueError, match="unknown"):
        normscope.convert(_cnn(), to="nonsense")
    with pytest.raises(TypeError, match="where"):
        normscope.convert(_cnn(), where=3)


def test_a_bad_to_is_refused_in_converts_own_terms_before_any_layer_changes():
    # the errors named get_norm's argument `spec`, an argument convert has not: a user of convert(to=...)
    # read about another function's argument
    for to, error in (("nonsense", ValueError), ("torch ", ValueError), (3, TypeError), (1.5, TypeError)):
        model = _cnn()
        before = [type(m) for m in model.modules()]
        with pytest.raises(error) as raised:
            normscope.convert(model, to=to)
        message = str(raised.value)
        assert message.startswith("convert: ") and "`to`" in message and "`spec`" not in message, message
        assert "'normscope', 'torch'" in message and (repr(to) in message or type(to).__name__ in message), message
        assert [type(m) for m in model.modules()] == before


def test_weight_norm_and_spectral_norm_parametrizations_are_not_reported_as_norm_layers():
    """torch's weight_norm / spectral_norm parametrizations of a conv next to a norm are modules named
    ``_WeightNorm`` / ``_SpectralNorm``: convert listed them in ``report.skipped`` as normalization layers
    it could not reproduce. They map a weight, they normalize no activation. Oracle: torch's parametrize
    registry (the modules under ``parametrizations``), and the model's output, unchanged bit for bit."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(
        parametrizations.weight_norm(nn.Conv2d(3, 8, 3)),
        nn.BatchNorm2d(8),
        parametrizations.spectral_norm(nn.Conv2d(8, 4, 1)),
    ).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        want = model(x)
    model, report = normscope.convert(model)
    assert [r.path for r in report] == ["1"] and report.skipped == []
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_network_named_like_a_norm_is_not_reported_as_a_norm_layer():
    """timm's ``NormFreeNet`` (nfnet) holds layers and normalizes nothing itself: its name's "Norm" made
    convert list the whole model (path ``''``) in ``report.skipped``. Oracle: the model's own modules
    (no norm among them) and its output, unchanged bit for bit."""

    class NormFreeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stem(x).relu()

    torch.manual_seed(0)
    model, x = NormFreeNet(), torch.randn(1, 3, 5, 5)
    want = model(x)
    model, report = normscope.convert(model)
    assert list(report) == [] and report.skipped == []
    assert torch.equal(model(x), want)
