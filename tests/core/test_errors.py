"""Bad input: every error path raises ValueError/TypeError before any work, with a message that
names the argument, what was expected and what was received.

The engine's own entry (``engine.norm``) refuses running statistics, weights and devices that do not
fit the scope; a scope layer needs a positive number of dimensions."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import normscope
import normscope.functional as F
from conftest import state_of
from normscope import Scope
from normscope.engine import Running, norm

x3 = torch.randn(2, 6, 5)


# (id, call, exception type, fragments that must all appear in the message)
CASES = [
    ("gn_channels", lambda: normscope.GroupNorm(3, 6)(torch.randn(2, 5, 4)), ValueError,
     ["GroupNorm(3, 6)", "expected input with 6 channels", "got 5", "(2, 5, 4)"]),
    ("gn_ctor_not_divisible", lambda: normscope.GroupNorm(4, 6), ValueError,
     ["num_channels (6)", "divisible by num_groups (4)", "[1, 2, 3, 6]"]),
    ("gn_ctor_zero_groups", lambda: normscope.GroupNorm(0, 6), ValueError, ["num_groups", "positive int", "got 0"]),
    # a wrong type is a TypeError, as torch's F.group_norm raises for a bool or float num_groups
    ("gn_functional_bool_groups", lambda: F.group_norm(x3, True), TypeError, ["num_groups", "positive int", "True"]),
    ("gn_functional_float_groups", lambda: F.group_norm(x3, 2.0), TypeError, ["num_groups", "positive int", "2.0"]),
    ("gn_ctor_float_channels", lambda: normscope.GroupNorm(2, 6.0), TypeError, ["num_channels", "got float 6.0"]),
    ("gn_ctor_float_groups", lambda: normscope.GroupNorm(2.0, 6), TypeError, ["num_groups", "got float 2.0"]),
    ("gn_functional_not_divisible", lambda: F.group_norm(x3, 4), ValueError,
     ["group_norm", "input.shape[1] = 6", "num_groups=4"]),
    ("gn_1d_input", lambda: normscope.GroupNorm(2, 4)(torch.randn(4)), ValueError,
     ["group_norm", "at least 2 dims", "(4,)"]),
    ("bn2d_ndim", lambda: normscope.BatchNorm2d(6)(x3), ValueError,
     ["BatchNorm2d", "expected 4D input", "got 3D", "(2, 6, 5)"]),
    ("bn1d_ndim", lambda: normscope.BatchNorm1d(6)(torch.randn(2, 6, 5, 5)), ValueError, ["2D or 3D", "got 4D"]),
    ("bn1d_channels", lambda: normscope.BatchNorm1d(6)(torch.randn(2, 5, 3)), ValueError,
     ["BatchNorm1d(6)", "6 channels at dim 1", "got 5"]),
    # the channels on the last axis: said, with the way out (BatchNorm1d takes channel_dim=-1; 2d/3d do not)
    ("bn1d_channels_last", lambda: normscope.BatchNorm1d(6)(torch.randn(4, 10, 6)), ValueError,
     ["BatchNorm1d(6)", "6 channels at dim 1", "got 10", "the last axis has 6", "channel_dim=-1"]),
    ("brn1d_channels_last", lambda: normscope.BatchRenorm1d(6)(torch.randn(4, 10, 6)), ValueError,
     ["BatchRenorm1d(6)", "got 10", "the last axis has 6", "channel_dim=-1"]),
    ("bn2d_channels_last", lambda: normscope.BatchNorm2d(6)(torch.randn(2, 8, 8, 6)), ValueError,
     ["BatchNorm2d(6)", "6 channels at dim 1", "got 8", "the last axis has 6", "movedim(-1, 1)"]),
    ("bn_one_value_per_channel", lambda: normscope.BatchNorm1d(3)(torch.randn(1, 3)), ValueError,
     ["more than 1 value per channel", "(1, 3)"]),
    ("bn_eval_without_running", lambda: F.batch_norm(x3, None, None), ValueError,
     ["training=False", "running_mean", "got None"]),
    ("bn_running_shape", lambda: F.batch_norm(x3, torch.zeros(5), torch.ones(6)), ValueError,
     ["`running_mean` of shape (6,)", "got shape (5,)"]),
    ("in_ndim", lambda: normscope.InstanceNorm1d(6)(torch.randn(6)), ValueError,
     ["InstanceNorm1d", "2D (unbatched) or 3D (batched)", "got 1D"]),
    ("in_channels_affine", lambda: normscope.InstanceNorm1d(3, affine=True)(torch.randn(2, 4, 5)), ValueError,
     ["InstanceNorm1d(3)", "3 channels at dim 1", "got 4"]),
    ("in_one_spatial", lambda: normscope.InstanceNorm1d(3)(torch.randn(2, 3, 1)), ValueError,
     ["more than 1 spatial element", "(2, 3, 1)"]),
    ("in_eval_without_running", lambda: F.instance_norm(x3, use_input_stats=False), ValueError,
     ["use_input_stats=False", "running_mean", "got None"]),
    ("ln_shape_mismatch", lambda: normscope.LayerNorm((6, 5))(torch.randn(2, 5, 6)), ValueError,
     ["normalized_shape=[6, 5]", "(2, 5, 6)"]),
    ("ln_too_few_dims", lambda: normscope.LayerNorm((2, 3, 4))(torch.randn(3, 4)), ValueError,
     ["last 3 dimension(s)", "normalized_shape=[2, 3, 4]", "(3, 4)"]),
    ("ln_ctor_negative", lambda: normscope.LayerNorm(-1), ValueError, ["normalized_shape", "non-negative", "(-1,)"]),
    ("gn_ctor_zero_groups", lambda: normscope.GroupNorm(0, 4), ValueError, ["num_groups", "positive int", "0"]),
    ("ln_ctor_str", lambda: normscope.LayerNorm("a"), TypeError, ["normalized_shape", "sequence of ints", "'a'"]),
    ("ln_ctor_float", lambda: normscope.LayerNorm([2.5]), TypeError, ["normalized_shape", "[2.5]"]),
    ("ln_weight_shape", lambda: F.layer_norm(x3, (5,), weight=torch.ones(4)), ValueError,
     ["`weight` of shape (5,)", "input of shape (2, 6, 5)", "got shape (4,)"]),
    ("ln_bias_shape", lambda: F.layer_norm(x3, (5,), bias=torch.ones(5, 1)), ValueError,
     ["`bias` of shape (5,)", "got shape (5, 1)"]),
    ("ln_weight_type", lambda: F.layer_norm(x3, (5,), weight=[1.0] * 5), TypeError, ["`weight`", "got list"]),
    ("ln_weight_dtype", lambda: F.layer_norm(x3, (5,), weight=torch.ones(5, dtype=torch.float64)), TypeError,
     ["`weight` of dtype torch.float32", "got torch.float64"]),
    ("ln_weight_device", lambda: F.layer_norm(x3, (5,), weight=torch.ones(5, device="meta")), ValueError,
     ["`weight` on the input's device cpu", "got meta"]),
    ("bn_buffer_dtype_half", lambda: normscope.BatchNorm1d(6).half()(x3), TypeError,
     ["`running_mean` of dtype torch.float32", "got torch.float16"]),
    ("half_weight_dtype", lambda: F.layer_norm(x3.bfloat16(), (5,), torch.ones(5, dtype=torch.float16)), TypeError,
     ["torch.bfloat16 or torch.float32", "got torch.float16"]),
    ("rms_weight_shape", lambda: F.rms_norm(x3, (5,), weight=torch.ones(6)), ValueError,
     ["rms_norm", "`weight` of shape (5,)", "got shape (6,)"]),
    ("int_input", lambda: normscope.BatchNorm1d(6)(torch.ones(2, 6, 4, dtype=torch.int32)), TypeError,
     ["`input`", "floating-point", "torch.int32"]),
    ("complex_input", lambda: normscope.LayerNorm(5)(x3.to(torch.complex64)), TypeError,
     ["floating-point", "torch.complex64"]),
    ("list_input", lambda: normscope.LayerNorm(5)([1.0] * 5), TypeError, ["`input`", "torch.Tensor", "got list"]),
    ("lrn_int_input", lambda: normscope.LocalResponseNorm(2)(torch.ones(2, 3, 4, dtype=torch.int64)), TypeError,
     ["local_response_norm", "torch.int64"]),
    ("lrn_ndim", lambda: F.local_response_norm(torch.randn(2, 3), 2), ValueError, ["at least 3 dims", "(2, 3)"]),
    ("lrn_size", lambda: F.local_response_norm(x3, 0), ValueError, ["`size`", "positive int", "got 0"]),
    ("normalize_mask_dtype", lambda: normscope.normalize(x3, dims=-1, mask=torch.ones(5)), TypeError,
     ["`mask`", "torch.bool", "got torch.float32"]),
    ("normalize_mask_type", lambda: normscope.normalize(x3, dims=-1, mask=[True] * 5), TypeError,
     ["`mask`", "got list"]),
    ("normalize_mask_shape", lambda: normscope.normalize(x3, dims=-1, mask=torch.ones(3, dtype=torch.bool)),
     ValueError, ["`mask` broadcastable to (2, 6, 5)", "got (3,)"]),
    ("normalize_dims_and_keep", lambda: normscope.normalize(x3, dims=-1, keep=0), ValueError,
     ["exactly one of `dims` and `keep`", "dims=-1", "keep=0"]),
    ("normalize_neither", lambda: normscope.normalize(x3), ValueError, ["exactly one of `dims` and `keep`"]),
    ("normalize_axis", lambda: normscope.normalize(x3, dims=5), ValueError,
     ["axis 5", "rank 3", "[-3, 2]"]),
    ("normalize_eps", lambda: normscope.normalize(x3, dims=-1, eps=-1), ValueError,
     ["`eps`", "non-negative", "got -1"]),
    # not a real number: a TypeError, as every other op's eps (docs/differences.md); was a ValueError here
    ("normalize_eps_tensor", lambda: normscope.normalize(x3, dims=-1, eps=torch.tensor(1e-5)), TypeError,
     ["normalize", "`eps`", "got Tensor tensor(1.0000e-05)"]),
    ("normalize_eps_str", lambda: normscope.normalize(x3, dims=-1, eps="1e-5"), TypeError,
     ["normalize", "`eps`", "got str '1e-5'"]),
    ("adain_eps_bool", lambda: F.adain(torch.randn(2, 3, 4), torch.randn(2, 3, 5), eps=True), TypeError,
     ["adain", "`eps`", "got bool True"]),
    ("normalize_groups", lambda: normscope.normalize(x3, keep=0, groups=4), ValueError,
     ["axis 1, got 6", "groups=4"]),
    ("normalize_weight_shape", lambda: normscope.normalize(x3, dims=-1, weight=torch.ones(3)), ValueError,
     ["`weight` of shape (5,)", "got shape (3,)"]),
    # the modern layers' constructors: float(eps) named no argument ("could not convert string to float") and
    # turned True into 1.0
    ("qknorm_eps_str", lambda: normscope.QKNorm(8, eps="a"), TypeError, ["QKNorm", "`eps`", "got 'a'"]),
    ("polynorm_eps_none", lambda: normscope.PolyNorm(eps=None), TypeError, ["PolyNorm", "`eps`", "got None"]),
    ("adaln_eps_bool", lambda: normscope.AdaLayerNorm(8, 4, eps=True), TypeError,
     ["AdaLayerNorm", "`eps`", "got True"]),
    ("adaln_eps_nan", lambda: normscope.AdaLayerNorm(8, 4, eps=float("nan")), ValueError,
     ["AdaLayerNorm", "`eps`", "got nan"]),
    # a float channel_dim passed `in (1, -1)` (-1.0 == -1); the forward then indexed a shape with it
    ("bn1d_channel_dim_float", lambda: normscope.BatchNorm1d(6, channel_dim=-1.0), TypeError,
     ["BatchNorm1d", "`channel_dim`", "got -1.0"]),
    ("frozen_channel_dim_float", lambda: normscope.FrozenBatchNorm2d(6, channel_dim=1.0), TypeError,
     ["FrozenBatchNorm2d", "`channel_dim`", "got 1.0"]),
    ("powernorm_channel_dim_float", lambda: normscope.PowerNorm(6, channel_dim=-1.0), TypeError,
     ["PowerNorm", "`channel_dim`", "got -1.0"]),
    # torch's constructor reached torch.empty: a RuntimeError ("Trying to create tensor with negative dimension")
    # and "argument 'size' must be tuple of ints", neither naming the argument
    ("bn_num_features_negative", lambda: normscope.BatchNorm2d(-1), ValueError,
     ["BatchNorm2d", "`num_features`", "non-negative int", "got -1"]),
    ("bn_num_features_float", lambda: normscope.BatchNorm1d(4.0), TypeError, ["BatchNorm1d", "`num_features`", "4.0"]),
    ("brn_num_features_str", lambda: normscope.BatchRenorm3d("4"), TypeError,
     ["BatchRenorm3d", "`num_features`", "'4'"]),
    ("syncbn_num_features_negative", lambda: normscope.SyncBatchNorm(-3), ValueError,
     ["SyncBatchNorm", "`num_features`", "got -3"]),
    # a NaN limit made every training output NaN
    ("batchrenorm_rmax_nan", lambda: normscope.BatchRenorm1d(6, rmax=float("nan")), ValueError,
     ["BatchRenorm1d", "`rmax`", ">= 1", "got nan"]),
    ("batchrenorm_dmax_nan", lambda: normscope.BatchRenorm2d(6, dmax=float("nan")), ValueError,
     ["BatchRenorm2d", "`dmax`", ">= 0", "got nan"]),
    # float() named no argument, and took NaN (every output NaN)
    ("dyt_alpha_init_str", lambda: normscope.DyT(6, alpha_init="a"), TypeError, ["DyT", "`alpha_init`", "'a'"]),
    ("dyt_alpha_init_nan", lambda: normscope.DyT(6, alpha_init=float("nan")), ValueError,
     ["DyT", "`alpha_init`", "finite", "nan"]),
    ("derf_shift_init_str", lambda: normscope.Derf(6, shift_init="a"), TypeError, ["Derf", "`shift_init`", "'a'"]),
    # derf's own check named the weight: "expected `weight` of shape (5,), got (6,)"
    ("derf_features", lambda: normscope.Derf(6)(torch.randn(2, 5)), ValueError,
     ["Derf(6)", "6 features at dim -1", "(2, 5)"]),
    # the x that SiLU(cond) is cast to misfits the projection; the message said "of dtype float32, got float32"
    ("adaln_scale_shift_x_dtype",
     lambda: normscope.AdaLayerNorm(6, 4, order="scale_shift")(torch.randn(2, 3, 6, dtype=torch.bfloat16),
                                                               torch.randn(2, 4)),
     TypeError, ["`x` of the projection's dtype torch.float32", "got x of dtype torch.bfloat16"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_message(call, exc, fragments):
    with pytest.raises(exc) as e:
        call()
    assert type(e.value) is exc  # not a subclass raised deep inside ATen
    msg = str(e.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_errors_are_raised_before_any_work():
    """A rejected call leaves the layer's state untouched (no num_batches_tracked increment)."""
    bn = normscope.BatchNorm1d(6)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError):
        bn(torch.randn(2, 5, 3))
    with pytest.raises(TypeError):
        bn(torch.ones(2, 6, 3, dtype=torch.int64))
    with pytest.raises(ValueError):
        bn(torch.randn(1, 6))  # one value per channel
    with pytest.raises(TypeError):
        bn(torch.randn(4, 6, dtype=torch.float64))  # fp32 buffers, fp64 input
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_instancenorm_channel_mismatch_without_affine_warns_like_torch():
    x = torch.randn(2, 4, 5)
    with pytest.warns(UserWarning, match=re.escape("does not match num_features (3)")):
        y = normscope.InstanceNorm1d(3)(x)
    torch.testing.assert_close(y, torch.nn.functional.instance_norm(x))


# ---------------------------------------------------------------------------------------------
# engine misuse: a wrong-size buffer raises before any kernel reads it


def test_engine_rejects_running_statistics_of_the_wrong_size():
    x = torch.randn(64, 256, 50)
    with pytest.raises(ValueError, match=r"running.mean.*256 elements.*\(3,\)"):
        norm(x, Scope.batch(), running=Running(torch.zeros(3), torch.ones(3), 0.1, True))
    with pytest.raises(ValueError, match=r"running.var.*256"):
        norm(x, Scope.batch(), running=Running(torch.zeros(256), torch.ones(5), 0.1, False))


@pytest.mark.parametrize("scope", [Scope.batch(), Scope.instance(), Scope.group(4), Scope.layer()])
def test_engine_rejects_weights_that_do_not_fit_the_scope(scope):
    x = torch.randn(8, 16, 5)
    with pytest.raises(ValueError, match="expected `weight` of shape"):
        norm(x, scope, weight=torch.ones(3))
    with pytest.raises(ValueError, match="expected `bias` of shape"):
        norm(x, scope, bias=torch.ones(17))
    with pytest.raises(ValueError, match="no affine axes"):
        norm(x, Scope(keep=(1,)), weight=torch.ones(16))


def test_engine_rejects_a_weight_on_another_device():
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="expected `weight` on cpu, got meta"):
        norm(x, Scope.batch(), weight=torch.ones(4, device="meta"))


@pytest.mark.parametrize("ndims", [0, -1, True])
@pytest.mark.parametrize("ctor", ["layer", "rms"])
def test_scope_layer_needs_positive_ndims(ctor, ndims):
    """Scope.layer(0)/layer(-1) gave an empty scope (all-zero output)."""
    with pytest.raises(ValueError, match=r"expected `ndims` to be a positive int"):
        getattr(normscope.Scope, ctor)(ndims)


_HALF_X = torch.randn(3, 4, 5).to(torch.bfloat16)
_ones = lambda d: [torch.ones(4, dtype=t) for t in d]  # noqa: E731
_MIXED_CALLS = {  # name: call(functional module, dtypes of the parameters in order)
    "layer_norm": lambda f, d: f.layer_norm(_HALF_X.transpose(1, 2).contiguous(), (4,), *_ones(d)),
    "group_norm": lambda f, d: f.group_norm(_HALF_X, 2, *_ones(d)),
    "instance_norm": lambda f, d: f.instance_norm(_HALF_X, None, None, *_ones(d)),
    "batch_norm_train": lambda f, d: f.batch_norm(_HALF_X, *_ones(d), training=True),
    "batch_norm_eval": lambda f, d: f.batch_norm(_HALF_X, *_ones(d), training=False),
}
_F32, _B16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("name", list(_MIXED_CALLS))
@pytest.mark.parametrize("which", range(4))
def test_half_input_with_parameters_of_two_dtypes_is_a_type_error(name, which):
    """fp16/bf16 input takes parameters of its own dtype or fp32, but all of one dtype: torch's kernels
    raise a RuntimeError for a mixture (``mixed dtype (CPU): expect parameter to have scalar type of
    Float``), normscope a TypeError naming the argument. Every mixture torch accepts is accepted."""
    n = 4 if name.startswith("batch_norm") else 2
    if which >= n:
        pytest.skip("fewer parameters")
    dtypes = [_F32] * n
    dtypes[which] = _B16
    for d in (dtypes, [_B16 if t == _F32 else _F32 for t in dtypes]):
        call = _MIXED_CALLS[name]
        try:
            want = call(torch.nn.functional, d)
        except RuntimeError:
            with pytest.raises(TypeError, match=r"expected `\w+` of dtype torch\.\w+ like `\w+`"):
                call(F, d)
        else:
            assert torch.equal(call(F, d), want)


@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d", "SyncBatchNorm", "BatchRenorm1d"])
def test_a_layer_momentum_torch_refuses_is_refused_before_the_state_moves(name):
    # torch.nn's layers pass momentum to batch_norm/instance_norm, which raise TypeError for a str; ours
    # took float("0.1") silently. What torch takes (a bool, a 0-dim tensor) stays accepted
    x = torch.randn(4, 6, 5)
    kw = {"track_running_stats": True} if name.startswith("Instance") else {}
    if hasattr(nn, name):
        theirs = getattr(nn, name)(6, **kw)
        theirs.momentum = "0.1"
        with pytest.raises(TypeError):
            theirs(x)
    ours = getattr(normscope, name)(6, **kw)
    ours.momentum = "0.1"
    before = state_of(ours)
    with pytest.raises(TypeError, match="momentum"):
        ours(x)
    for k, v in state_of(ours).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused call"
    ours.momentum = torch.tensor(0.5)
    ours(x)


_NESTED_CALLS = {
    "LayerNorm": lambda nt: normscope.LayerNorm(16)(nt),
    "RMSNorm": lambda nt: normscope.RMSNorm(16)(nt),
    "RMSNorm-gemma": lambda nt: normscope.RMSNorm(16, casting="gemma", weight_offset=1.0)(nt),
    "GroupNorm": lambda nt: normscope.GroupNorm(2, 16)(nt),
    "BatchNorm1d": lambda nt: normscope.BatchNorm1d(16)(nt),
    "BatchNorm1d-eval": lambda nt: normscope.BatchNorm1d(16).eval()(nt),
    "InstanceNorm1d": lambda nt: normscope.InstanceNorm1d(16)(nt),
    "SyncBatchNorm": lambda nt: normscope.SyncBatchNorm(16)(nt),
    "BatchRenorm1d": lambda nt: normscope.BatchRenorm1d(16)(nt),
    "PowerNorm": lambda nt: normscope.PowerNorm(16)(nt),
    "LayerNorm2d": lambda nt: normscope.LayerNorm2d(16)(nt),
    "DyT": lambda nt: normscope.DyT(16)(nt),
    "Derf": lambda nt: normscope.Derf(16)(nt),
    "PolyNorm": lambda nt: normscope.PolyNorm()(nt),
    "QKNorm": lambda nt: normscope.QKNorm(16)(nt, nt),
    "AdaLayerNorm": lambda nt: normscope.AdaLayerNorm(16, 8)(nt, torch.randn(2, 8)),
    "AdaIN": lambda nt: normscope.AdaIN()(nt, nt),
    "F.layer_norm": lambda nt: F.layer_norm(nt, (16,)),
    "F.fused_add_rms_norm": lambda nt: F.fused_add_rms_norm(nt, nt, torch.ones(16)),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("call", list(_NESTED_CALLS.values()), ids=list(_NESTED_CALLS))
def test_a_nested_tensor_is_refused_by_name(call, layout):
    # ragged sizes resolve no scope: a strided nested tensor raised torch's internal "NestedTensorImpl
    # doesn't support sizes" from the plan's key, a jagged one AttributeError/ValueError from the
    # scope's resolution on its symbolic length. The way to ragged input here is padding and a mask
    nt = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)], layout=layout)
    with pytest.raises(TypeError, match=r"expected `(input|x|q|content)` to be a dense tensor, got a nested tensor"):
        call(nt)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(
    "replace,exc,fragments",
    [
        ({"running_var": torch.ones(6, dtype=torch.float64)}, TypeError,
         ["`running_var` of dtype torch.float32 like `running_mean` and the input", "got torch.float64"]),
        ({"running_mean": torch.zeros(6, dtype=torch.float64), "running_var": None}, ValueError,
         ["`running_mean` and `running_var` both or neither", "`running_mean` without `running_var`"]),
    ],
    ids=["var_dtype", "var_none"],
)  # fmt: skip
def test_instancenorm_running_buffers_replaced_after_a_call(training, replace, exc, fragments):
    """An InstanceNorm layer whose running buffer is replaced after a call -- by one of another dtype
    than its partner, or by None -- is refused by torch.nn's layer too, with a RuntimeError from inside
    its kernel ("expected scalar type Float but found Double", "Expected a proper Tensor but got None");
    ours names the buffers, and changes nothing. Buffers of one dtype, any, still run as torch's."""
    ours, theirs = normscope.InstanceNorm1d(6, track_running_stats=True), nn.InstanceNorm1d(6, track_running_stats=True)
    for m in (ours, theirs):
        m.train(training)
        m(x3)  # a planned call first: the replaced buffer must not run on its plan
        for k, v in replace.items():
            setattr(m, k, v)
    with pytest.raises(RuntimeError):
        theirs(x3)
    before = state_of(ours)
    with pytest.raises(exc) as e:
        ours(x3)
    assert type(e.value) is exc
    for frag in fragments:
        assert frag in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in state_of(ours).items())
    for m in (ours, theirs):  # both of fp64: torch runs it, and so do we
        m.running_mean, m.running_var = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(ours(x3), theirs(x3))
    torch.testing.assert_close(ours.running_var, theirs.running_var)


@pytest.mark.parametrize(
    "name, args, shape, what",
    [("LayerNorm", (5,), (2, 6, 5), "weight"), ("RMSNorm", (5,), (2, 6, 5), "weight"),
     ("GroupNorm", (2, 6), (2, 6, 5), "bias"), ("BatchNorm1d", (6,), (2, 6, 5), "running_mean"),
     ("InstanceNorm1d", (6,), (2, 6, 5), "input")],
)  # fmt: skip
def test_a_sparse_parameter_buffer_or_input_after_a_call_is_refused_by_name(name, args, shape, what):
    """A layer's weight, bias or buffer replaced by a sparse tensor after a call (or a sparse input):
    torch.nn's layer raises from inside its kernel (RuntimeError "unsupported memory format option
    Contiguous", or NotImplementedError); ours a TypeError naming it, with the state as it was."""
    ours, theirs = getattr(normscope, name)(*args), getattr(nn, name)(*args)
    x = torch.randn(shape)
    for m in (ours, theirs):
        m(x)  # planned: the sparse tensor must not run on the strided call's plan
        if what in m._buffers:
            setattr(m, what, getattr(m, what).to_sparse())
        elif what != "input":
            setattr(m, what, nn.Parameter(getattr(m, what).detach().to_sparse()))
    x = x.to_sparse() if what == "input" else x
    with pytest.raises((RuntimeError, NotImplementedError)):
        theirs(x)
    before = state_of(ours)
    with pytest.raises(TypeError, match=f"`{what}` to be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        ours(x)
    assert all(torch.equal(v.to_dense(), before[k].to_dense()) for k, v in state_of(ours).items())


_NP = np.int64
# (id, the call with NumPy integers, the same call with Python ints): torch.nn's constructors and functions
# take any ``numbers.Integral`` size; so must normscope's, its layers beyond torch.nn included
NUMPY_SIZES = [
    ("GroupNorm", lambda: normscope.GroupNorm(_NP(2), _NP(6)), lambda: nn.GroupNorm(2, 6)),
    ("LocalResponseNorm", lambda: normscope.LocalResponseNorm(_NP(3)), lambda: nn.LocalResponseNorm(3)),
    ("LayerNorm", lambda: normscope.LayerNorm(_NP(5)), lambda: nn.LayerNorm(5)),
    ("RMSNorm", lambda: normscope.RMSNorm(np.int32(5)), lambda: nn.RMSNorm(5)),
    ("LayerNorm2d", lambda: normscope.LayerNorm2d(_NP(6)), lambda: normscope.LayerNorm2d(6)),
    ("FrozenBatchNorm2d", lambda: normscope.FrozenBatchNorm2d(_NP(6)), lambda: normscope.FrozenBatchNorm2d(6)),
    ("DyT", lambda: normscope.DyT(_NP(5)), lambda: normscope.DyT(5)),
    ("Derf", lambda: normscope.Derf(_NP(5)), lambda: normscope.Derf(5)),
    ("PowerNorm", lambda: normscope.PowerNorm(_NP(5), warmup_iters=_NP(1)),
     lambda: normscope.PowerNorm(5, warmup_iters=1)),
    ("BatchRenorm1d", lambda: normscope.BatchRenorm1d(6, warmup_iters=_NP(2)), lambda: nn.BatchNorm1d(6)),
    ("BatchNorm1d channels last", lambda: normscope.BatchNorm1d(5, channel_dim=_NP(-1)),
     lambda: normscope.BatchNorm1d(5, channel_dim=-1)),
]


@pytest.mark.parametrize("make,make_int", [c[1:] for c in NUMPY_SIZES], ids=[c[0] for c in NUMPY_SIZES])
def test_numpy_integer_sizes_are_taken_as_torch_takes_them(make, make_int):
    """A NumPy integer size builds the layer the Python int builds (torch.nn's namesake where there is one),
    held as a Python int, and computes its numbers; the layers beyond torch.nn refused it as "not a positive int"."""
    layer, oracle = make(), make_int()
    four_d = isinstance(layer, (normscope.LayerNorm2d, normscope.FrozenBatchNorm2d))
    x = torch.randn(2, 6, 3, 4) if four_d else torch.randn(2, 6, 5)
    if isinstance(layer, normscope.BatchRenorm1d):  # its first step (no warm-up yet: r = 1, d = 0) is BatchNorm's
        layer.rmax = layer.dmax = 0.0
    torch.testing.assert_close(layer(x), oracle(x), rtol=1e-6, atol=1e-6)
    # (LRN's `size` is torch's constructor's to keep)
    for name in ("num_features", "num_channels", "num_groups", "warmup_iters", "channel_dim"):
        if hasattr(layer, name):
            assert type(getattr(layer, name)) is int, name


def test_numpy_integer_sizes_of_the_functions_and_modern_layers():
    """``F.group_norm``/``F.local_response_norm`` take a NumPy ``num_groups``/``size`` as torch's do (a TypeError
    and a ValueError before); QKNorm/AdaLayerNorm their sizes; ``normalize``, ``batch_norm``, ``derf`` and
    ``adain`` NumPy numbers where they take Python ones (each refused them)."""
    x = torch.randn(2, 6, 5)
    assert torch.equal(F.group_norm(x, _NP(3)), nn.functional.group_norm(x, 3))
    assert torch.equal(F.local_response_norm(x, _NP(3)), nn.functional.local_response_norm(x, 3))
    q, k = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4)
    got = normscope.QKNorm(_NP(4), _NP(2), _NP(1), per_head=False)(q, k)
    want = normscope.QKNorm(4, 2, 1, per_head=False)(q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ada = normscope.AdaLayerNorm(_NP(4), _NP(3), gate=True, chunks=_NP(6))
    assert (ada.embedding_dim, ada.cond_dim, ada.chunks) == (4, 3, 6)
    assert len(ada(torch.randn(2, 3, 4), torch.randn(2, 3))) == 5
    # the engine's own entries: a scope's groups and axes, BatchNorm's channel_dim, Derf's scalars, AdaIN's eps
    assert torch.equal(F.normalize(x, keep=0, groups=_NP(3)), F.normalize(x, keep=0, groups=3))
    assert torch.equal(F.normalize(x, dims=_NP(-1)), F.normalize(x, dims=-1))
    xt, rm, rv = x.transpose(1, 2), torch.zeros(6), torch.ones(6)
    assert torch.equal(F.batch_norm(xt, rm, rv, channel_dim=_NP(-1)), F.batch_norm(xt, rm, rv, channel_dim=-1))
    assert torch.equal(F.derf(x, np.float32(0.5), channel_dim=_NP(-1)), F.derf(x, 0.5))
    c, eps = x[:, :, None], np.float32(1e-5)
    assert torch.equal(F.adain(c, c, eps=eps), F.adain(c, c, eps=float(eps)))
