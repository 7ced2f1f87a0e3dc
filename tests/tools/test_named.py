"""The one table of named layers (normscope.tools.named): explain, draw and explore accept its names and build its
scopes, and each entry's torch.nn equivalent computes what the engine computes on the entry's scope."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normscope import engine, get_norm, norm_names
from normscope.scope import Scope
from normscope.tools import explain
from normscope.tools.explorer.api import layers_info, scope_example
from normscope.tools.named import LAYOUTS, NAMED, get, module_scope, names, parse, scope_ids

# a picture shape and a rank-4 shape per layout (the explorer takes (N, C, L) and (N, C, H, W) in nchw)
SHAPES = {"nchw": [(3, 6, 4), (2, 6, 2, 3)], "bsd": [(2, 5, 6)]}
KEYED = [(name, layout) for name, entry in NAMED.items() for layout in entry.layouts]


@pytest.mark.parametrize("name,layout", KEYED)
def test_torch_equivalent_is_what_the_engine_computes_on_the_tables_scope(name, layout):
    entry = NAMED[name]
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES[layout]:
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
        scope = entry.scope(layout, len(shape), groups=3)
        want, what = entry.torch_equivalent(x, layout, groups=3, eps=1e-5)
        assert what.startswith("torch.nn.functional.")
        got = engine.norm(x, scope.resolve(shape), eps=1e-5, backend="reference")
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=f"{name} {layout} {shape}")


@pytest.mark.parametrize("name,layout", KEYED)
def test_explorer_uses_the_tables_scope(name, layout):
    for shape in SHAPES[layout]:
        r = scope_example({"layer": name, "layout": layout, "shape": list(shape), "groups": 2})
        scope = NAMED[name].scope(layout, len(shape), groups=2)
        assert r["scope"] == repr(scope) and r["title"].startswith(NAMED[name].title) and r["note"] == NAMED[name].note
        assert r["scope_ids"] == scope_ids(scope, shape).flatten().tolist()
    info = {e["name"]: e for e in layers_info()["layers"]}
    assert list(info) == list(NAMED) and info[name]["layouts"] == list(NAMED[name].layouts)


@pytest.mark.parametrize("name,layout", KEYED)
def test_draw_uses_the_tables_scope(name, layout):
    pytest.importorskip("matplotlib")
    from normscope.tools.viz import draw, figures, layer_names

    assert layer_names(layout) == names(layout)
    for shape in SHAPES[layout]:
        scope, title = figures._resolve_target(name, layout, 2, len(shape))
        assert scope == NAMED[name].scope(layout, len(shape), groups=2)
        assert title.startswith(NAMED[name].title)
        ax = draw(name, layout, 2, shape)
        n_scopes = len(set(scope_ids(scope, shape).flatten().tolist()))
        assert any(t.get_text().startswith(f"{n_scopes} scopes;") for t in ax.texts)


# the torch.nn class of each name, built for C = 6 channels and a trailing shape (4,)
_TORCH = {
    "BatchNorm1d": lambda: nn.BatchNorm1d(6),
    "BatchNorm2d": lambda: nn.BatchNorm2d(6),
    "BatchNorm3d": lambda: nn.BatchNorm3d(6),
    "LayerNorm": lambda: nn.LayerNorm(4),
    "InstanceNorm1d": lambda: nn.InstanceNorm1d(6),
    "InstanceNorm2d": lambda: nn.InstanceNorm2d(6),
    "InstanceNorm3d": lambda: nn.InstanceNorm3d(6),
    "GroupNorm": lambda: nn.GroupNorm(3, 6),
    "RMSNorm": lambda: nn.RMSNorm(4),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_explain_accepts_every_name_torch_has_and_builds_the_tables_scope(name):
    entry = NAMED[name]
    if name in explain.BSD_KINDS:  # shown on (B, S, D) against torch.nn.functional: tests/modern/test_modern.py
        assert entry.torch_names == () and explain.parse_layer(name) == (name, None)
        return
    if entry.torch_class is None:  # LayerNorm2d: compared with its torch.nn.functional equivalent
        assert entry.torch_names == () and explain.parse_layer(name) == (name, None)
        for shape in [(2, 6, 4), (2, 6, 2, 2)]:
            r = explain.explain(name, shape)
            assert r["scope_ids"] == scope_ids(entry.scope("nchw", len(shape)).resolve(shape)).tolist()
            assert r["torch_call"].startswith("torch.nn.functional.") and r["torch"]["allclose"], r["torch"]
        return
    assert explain.KINDS[name] == entry.torch_class
    for alias in (name, *entry.aliases, *entry.torch_names):
        key, _ = explain.parse_layer(alias)
        assert key == name, alias
    groups = 3 if name == "group" else None
    for shape in [(2, 6, 4), (2, 6, 2, 2)]:
        r = explain.explain(name, shape, groups=groups)
        scope = entry.scope("nchw", len(shape), groups=groups or 1)
        setup = explain._setup(name, None, shape, groups, None, 1e-5)
        assert setup.scope() == scope and r["torch_layer"] == entry.torch_name(len(shape))
        assert r["scope_ids"] == scope_ids(scope.resolve(shape)).tolist()
        assert r["torch"]["allclose"], r["torch"]
    # the table's torch class names are torch.nn classes, and their instances are this entry
    for torch_name in entry.torch_names:
        m = _TORCH[torch_name]()
        assert type(m) is getattr(nn, torch_name)
        assert module_scope(m)[0] == name


def test_module_scope_prefers_the_most_specific_class_and_refuses_others():
    import normscope

    assert module_scope(normscope.LayerNorm2d(6)) == ("layer2d", Scope.channels())
    assert module_scope(normscope.LayerNorm((6, 4))) == ("layer", Scope.layer(2))
    assert module_scope(nn.SyncBatchNorm(6), "bsd")[1] == Scope.batch(channel_dim=-1)
    with pytest.raises(TypeError, match="expected a norm layer among"):
        module_scope(nn.Linear(2, 2))


def test_scope_ids_of_a_resolved_scope_and_bad_arguments():
    r = Scope.group(2).resolve((2, 4, 3))
    ids = scope_ids(r)
    assert ids.tolist() == scope_ids(Scope.group(2), (2, 4, 3)).tolist()
    assert ids[1, :, 0].tolist() == [2, 2, 3, 3]  # sample 1, groups 0 and 1 of 2 channels each
    with pytest.raises(TypeError, match="expected `shape`"):
        scope_ids(Scope.group(2))
    with pytest.raises(ValueError, match=r"expected `layer` to be one of \['batch'"):
        get("nope")
    with pytest.raises(ValueError, match="expected `layout`"):
        NAMED["batch"].scope("nhwc")
    with pytest.raises(ValueError, match="not defined in layout 'bsd'"):
        NAMED["layer2d"].torch_equivalent(torch.zeros(2, 3, 4), "bsd")
    assert LAYOUTS == ("nchw", "bsd")
    assert names("bsd") == ["batch", "layer", "instance", "group", "rms", "qknorm", "adaln"]


# ---------------------------------------------------------------------------------------------
# one list of names: the teaching table adds to the registry's names


def test_every_teaching_entry_names_a_registered_norm():
    assert set(NAMED) <= set(norm_names()), sorted(set(NAMED) - set(norm_names()))


@pytest.mark.parametrize("name", [n for n, e in NAMED.items() if e.module_types])
def test_the_registry_builds_the_layer_each_teaching_entry_describes(name):
    built = get_norm(name, 4)
    assert isinstance(built, NAMED[name].module_types), (name, type(built))
    assert module_scope(built)[0] == name


def test_a_name_both_tables_read_means_one_layer():
    """A registered name that explain and draw also read (``"batchnorm2d"``, ``"layernorm2d"``) names the
    layer that get_norm builds for it; a registered name they do not read stays the registry's alone."""
    checked = []
    for registered in norm_names():
        try:
            key = parse(registered).name
        except ValueError:
            continue
        if NAMED[key].module_types:
            assert module_scope(get_norm(registered, 4))[0] == key, registered
            checked.append(registered)
        else:  # a layer of two inputs (adaln, qknorm): the names must still agree
            assert registered == key or registered.replace("_", "") in {a.replace("_", "") for a in NAMED[key].aliases}
    assert {"batch", "batch2d", "batchnorm2d", "layernorm2d", "rmsnorm", "group", "layer2d"} <= set(checked)
