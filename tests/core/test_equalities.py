"""The equalities DESIGN.md promises, proven: GroupNorm(1, C) is LayerNorm over (C, *),
GroupNorm(C, C) is InstanceNorm with affine, BatchNorm on one sample is InstanceNorm."""

from __future__ import annotations

import pytest
import torch

import normscope
from conftest import BACKENDS
from normscope import Scope

SHAPES = [(2, 6, 5), (3, 4, 3, 5), (1, 3, 7), (2, 5, 2, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_group_one_resolves_like_layer_over_channels_and_positions(shape):
    nd = len(shape)
    assert Scope.group(1).resolve(shape) == Scope(keep=(0,), affine=(1,)).resolve(shape)
    assert Scope.group(1).resolve(shape) == Scope(reduce=tuple(range(1, nd)), affine=(1,)).resolve(shape)
    # and a genuine grouping does not
    if shape[1] % 2 == 0:
        assert Scope.group(2).resolve(shape) != Scope(keep=(0,), affine=(1,)).resolve(shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_group_c_resolves_like_instance(shape):
    c = shape[1]
    assert Scope.group(c).resolve(shape) == Scope.instance().resolve(shape)
    assert Scope.group(c).resolve(shape).groups == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_groupnorm_one_group_equals_layernorm_over_c_star(shape, backend):
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    c = shape[1]
    gn = normscope.GroupNorm(1, c).double()
    with torch.no_grad():
        gn.weight.copy_(torch.randn(c))
        gn.bias.copy_(torch.randn(c))
    ln = normscope.LayerNorm(shape[1:], elementwise_affine=False).double()
    with normscope.use_backend(backend):
        y_gn = gn(x)
        y_ln = ln(x)
    view = (1, c) + (1,) * (len(shape) - 2)
    torch.testing.assert_close(y_gn, y_ln * gn.weight.view(view) + gn.bias.view(view))
    # and against torch.nn.LayerNorm directly (independent of our own layers)
    y_torch = torch.nn.functional.layer_norm(x, shape[1:])
    torch.testing.assert_close(y_gn, y_torch * gn.weight.view(view) + gn.bias.view(view))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if len(s) >= 3])
def test_groupnorm_c_groups_equals_instancenorm_affine(shape, backend):
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    c = shape[1]
    gn = normscope.GroupNorm(c, c).double()
    inst_cls = {3: normscope.InstanceNorm1d, 4: normscope.InstanceNorm2d, 5: normscope.InstanceNorm3d}[len(shape)]
    inorm = inst_cls(c, affine=True).double()
    with torch.no_grad():
        gn.weight.copy_(torch.randn(c))
        gn.bias.copy_(torch.randn(c))
    inorm.load_state_dict(gn.state_dict())  # same parameter names: weight, bias
    with normscope.use_backend(backend):
        torch.testing.assert_close(gn(x), inorm(x))
    torch_in = getattr(torch.nn, inst_cls.__name__)(c, affine=True).double()
    torch_in.load_state_dict(gn.state_dict())
    torch.testing.assert_close(gn(x), torch_in(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 3, 7), (1, 4, 3, 5)])
def test_batchnorm_on_one_sample_equals_instancenorm(shape, backend):
    x = torch.randn(shape, dtype=torch.float64) * 2 - 1
    c = shape[1]
    bn_cls = {3: normscope.BatchNorm1d, 4: normscope.BatchNorm2d}[len(shape)]
    in_cls = {3: normscope.InstanceNorm1d, 4: normscope.InstanceNorm2d}[len(shape)]
    bn = bn_cls(c, affine=False).double()
    inorm = in_cls(c, track_running_stats=True).double()
    with normscope.use_backend(backend):
        y_bn, y_in = bn(x), inorm(x)
    torch.testing.assert_close(y_bn, y_in)
    # same statistics, so the same running estimates too (unbiased variance, momentum 0.1)
    torch.testing.assert_close(bn.running_mean, inorm.running_mean)
    torch.testing.assert_close(bn.running_var, inorm.running_var)
    # the scopes differ only in the batch axis, which has size 1 here
    rb, ri = Scope.batch().resolve(shape), Scope.instance().resolve(shape)
    assert set(rb.reduce) - set(ri.reduce) == {0}
