"""Registry names are exact (lower-case, no spaces, ':G' only after 'group'): a malformed name is a
ValueError naming the argument, the valid forms and the value received -- never a layer built by
accident. timm's own names keep timm's matching (underscores dropped, case ignored).
The registry's names build the right classes and partials, and its sync with torch.nn is lazy."""

from __future__ import annotations

import functools
import importlib
import re

import pytest
from torch import nn

import normscope
from normscope.registry import get_norm, norm_names, register_norm

BAD = [
    "batch:",  # an argument separator with nothing after it, on a name that takes none
    "GROUP:2",  # upper case: normscope's names are exact
    " layer",  # surrounding whitespace
    "layer ",
    "Layer",
    "BATCH",
    "group:",  # the argument is missing
    "group: 2",
    "group:+2",
    "group:02",
    "group:0",
    "group:-2",
    "group:2.0",
    "group:²",  # str.isdigit() says yes, int() says no
    "group:2:2",
    "batch:2",
    "layer:3",
    "",
    ":",
]


@pytest.mark.parametrize("spec", BAD)
def test_malformed_names_are_refused_with_a_clear_message(spec):
    with pytest.raises(ValueError) as info:
        get_norm(spec, 8)
    msg = str(info.value)
    assert "`spec`" in msg, msg  # names the argument
    assert repr(spec) in msg, msg  # repeats the value received
    assert "group:G" in msg, msg  # states the expected form


@pytest.mark.parametrize("spec", ["GROUP:2", " layer", "BATCH", "nonsense", ""])
def test_unknown_name_lists_every_valid_name(spec):
    with pytest.raises(ValueError, match="expected one of: ") as info:
        get_norm(spec, 8)
    for name in norm_names():
        assert re.search(rf"\b{re.escape(name)}\b", str(info.value)), name


def test_a_near_miss_says_why():
    with pytest.raises(ValueError, match="names are exact"):
        get_norm(" layer", 8)
    with pytest.raises(ValueError, match="names are exact"):
        get_norm("GROUP:2", 8)


def test_convert_refuses_a_malformed_name_before_touching_the_model():
    model = nn.Sequential(nn.BatchNorm2d(8))
    with pytest.raises(ValueError, match="`to`.*Group:2"):
        normscope.convert(model, to="Group:2")
    assert type(model[0]) is nn.BatchNorm2d


def test_well_formed_names_resolve():
    assert get_norm("group:2", 8).num_groups == 2
    assert get_norm("group:32", 64).num_groups == 32
    assert get_norm("groupnorm:4", 8).num_groups == 4
    assert type(get_norm("layer", 8)) is normscope.LayerNorm
    assert type(get_norm("batch", 8)) is normscope.BatchNorm2d
    # timm's names keep timm's own matching (timm.layers.get_norm_layer: replace("_", "").lower())
    assert type(get_norm("Group_Norm", 8)) is normscope.GroupNorm
    assert type(get_norm("LayerNorm2d", 8)) is normscope.LayerNorm2d
    assert type(get_norm("BatchNorm2d", 8)) is normscope.BatchNorm2d


@pytest.mark.parametrize("spec", ["layer", "group:2", "batch", "power", "dyt", "qknorm", "layernorm2d"])
def test_a_numpy_channel_count_builds_the_layer_a_python_int_builds(spec):
    # torch.nn's constructors take NumPy integers; get_norm refused them ("expected a positive int")
    np = pytest.importorskip("numpy")
    assert repr(get_norm(spec, np.int64(8))) == repr(get_norm(spec, 8))


@pytest.mark.parametrize("name", ["MyNorm", " mine", "mine ", "", "a:b", "my-norm"])
def test_register_norm_refuses_a_name_get_norm_could_never_match(name):
    with pytest.raises(ValueError, match="`name`"):
        register_norm(name, nn.Identity)


def test_register_norm_exact_name_round_trip():
    register_norm("x_strict_identity", lambda c, **kw: nn.Identity())
    assert type(get_norm("x_strict_identity", 4)) is nn.Identity
    with pytest.raises(ValueError, match="names are exact"):
        get_norm("X_Strict_Identity", 4)


@pytest.mark.parametrize("via", ["name", "callable"])
def test_a_factory_that_builds_no_module_is_a_type_error_naming_spec(via, monkeypatch):
    """A registered factory returning something else than a module: get_norm handed it back and convert
    then failed inside the model with "AttributeError: 'str' object has no attribute 'to'"."""
    factory = lambda c, **kw: "not a module"  # noqa: E731
    monkeypatch.setattr(normscope.registry, "_REGISTRY", dict(normscope.registry._REGISTRY))  # gone afterwards
    register_norm("x_builds_no_module", factory)
    spec = "x_builds_no_module" if via == "name" else factory
    with pytest.raises(TypeError, match=r"get_norm: expected `spec` .* to build an nn.Module, got str 'not a module'"):
        get_norm(spec, 4)
    model = nn.Sequential(nn.BatchNorm2d(4))
    with pytest.raises(TypeError, match="to build an nn.Module"):
        normscope.convert(model, to=spec)
    assert type(model[0]) is nn.BatchNorm2d  # refused before the model changed


# -- registry --------------------------------------------------------------------------------------


def test_registry_names_classes_partials():
    assert type(normscope.get_norm("batch", 8)) is normscope.BatchNorm2d
    assert type(normscope.get_norm("batch1d", 8)) is normscope.BatchNorm1d
    assert type(normscope.get_norm("batch3d", 8)) is normscope.BatchNorm3d
    ln = normscope.get_norm("layer", 8, eps=1e-6)
    assert type(ln) is normscope.LayerNorm and ln.normalized_shape == (8,) and ln.eps == 1e-6
    assert type(normscope.get_norm("rms", 8)) is normscope.RMSNorm
    assert type(normscope.get_norm("instance", 8)) is normscope.InstanceNorm2d
    assert normscope.get_norm("group:4", 8).num_groups == 4
    assert normscope.get_norm("group", 64).num_groups == 32
    assert normscope.get_norm("group", 48).num_groups == 24  # 32 clipped to a divisor
    assert normscope.get_norm("group", 64, num_groups=8).num_groups == 8
    assert type(normscope.get_norm("layer2d", 8)) is normscope.LayerNorm2d
    assert type(normscope.get_norm("batchrenorm", 8)) is normscope.BatchRenorm2d
    assert type(normscope.get_norm("power", 8)) is normscope.PowerNorm
    assert type(normscope.get_norm("frozen", 8)) is normscope.FrozenBatchNorm2d
    assert type(normscope.get_norm("dyt", 8)) is normscope.DyT
    assert type(normscope.get_norm("none", 8)) is nn.Identity
    assert type(normscope.get_norm("identity", 8)) is nn.Identity
    assert type(normscope.get_norm(nn.BatchNorm2d, 8)) is nn.BatchNorm2d
    assert normscope.get_norm(nn.GroupNorm, 64).num_groups == 32
    bn = normscope.get_norm(functools.partial(normscope.BatchNorm1d, momentum=0.01), 8)
    assert bn.momentum == 0.01 and bn.num_features == 8
    with pytest.raises(ValueError, match="expected one of: .*batch.*layer2d"):
        normscope.get_norm("batchnrom", 8)  # ("batchnorm" is timm's name now: it resolves)
    with pytest.raises(ValueError, match="group:G"):
        normscope.get_norm("layer:3", 8)
    with pytest.raises(ValueError, match="divisible"):
        normscope.get_norm("group:5", 8)


def test_registry_sync_is_lazy():
    try:
        importlib.import_module("normscope.modules.syncbatchnorm")
    except ImportError:
        with pytest.raises(ValueError, match="normscope.modules.syncbatchnorm:SyncBatchNorm"):
            normscope.get_norm("sync", 8)
    else:
        assert type(normscope.get_norm("sync", 8)).__name__ == "SyncBatchNorm"


@pytest.mark.parametrize(
    "spec, kwargs, missing",
    [
        ("adaln", {}, "missing a required argument: 'cond_dim'"),
        ("layer", {"bogus": 1}, "unexpected keyword argument 'bogus'"),
    ],
)
def test_get_norm_arguments_that_do_not_fit_the_constructor_name_spec_and_signature(spec, kwargs, missing):
    """Python's own message named ``AdaLayerNorm.__init__()`` and no way out; the refusal names the spec,
    what does not fit and the constructor's signature (which holds the argument to pass)."""
    with pytest.raises(TypeError) as e:
        normscope.get_norm(spec, 8, **kwargs)
    message = str(e.value)
    assert message.startswith(f"get_norm: {spec!r} cannot be built so") and missing in message
    assert "eps: 'float' =" in message  # the constructor's signature
