"""normscope.tools.viz: the scope -> picture mapping is the engine's scope, and the pictures are valid files."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from normscope import engine, reference
from normscope.scope import Scope
from normscope.tools.viz import cube_faces, layer_names, layer_scope, lengths_mask, scope_ids

# (scope, shape, mask lengths or None, layout of the lengths)
CASES = [
    *[(layer_scope(n, "nchw", 2), (3, 6, 4), None, "nchw") for n in layer_names("nchw")],
    *[(layer_scope(n, "bsd", 3), (2, 5, 6), None, "bsd") for n in layer_names("bsd")],
    *[(layer_scope(n, "bsd", 2), (3, 4, 6), [4, 2, 1], "bsd") for n in layer_names("bsd")],
    *[(layer_scope(n, "nchw", 3), (2, 6, 2, 3), [5, 2], "nchw") for n in layer_names("nchw")],
    (Scope.group(3), (2, 6, 2, 2), None, "nchw"),
    (Scope.batch(), (4, 3, 5), None, "nchw"),
    (Scope.batch(), (4, 3), None, "nchw"),  # BatchNorm1d on (N, C)
    (Scope(keep=(0, 1), groups=2, group_dim=-1), (2, 3, 8), None, "bsd"),  # groups of features per token
    (Scope.group(1), (2, 4, 3), None, "nchw"),  # canonicalised to LayerNorm
    (Scope.group(4), (2, 4, 3), None, "nchw"),  # canonicalised to InstanceNorm
    (Scope.rms(2), (2, 3, 4), None, "nchw"),
]


def _mask(shape, lengths, layout):
    return None if lengths is None else lengths_mask(shape, lengths, layout)


@pytest.mark.parametrize("scope,shape,lengths,layout", CASES)
def test_ids_are_the_engine_scopes(scope, shape, lengths, layout):
    """Same id <=> same statistics: each id's members, taken directly from x, give the engine's
    mean and variance for that id, distinct ids give distinct statistics, and the engine's output
    is (x - mean) / sqrt(var + eps) with each element's statistics taken from its id's members."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    mask = _mask(shape, lengths, layout)
    r = scope.resolve(shape)
    ids = scope_ids(scope, shape, mask)
    assert ids.shape == torch.Size(shape) and ids.dtype == torch.long
    if mask is not None:
        assert torch.equal(ids < 0, ~mask.expand(shape))
    m = reference.moments(x, r, mask)
    mean, var = m.mean.flatten(), m.var.flatten()
    eps = 1e-5
    y = engine.norm(x, r, eps=eps, mask=mask, backend="reference")
    present = ids[ids >= 0].unique().tolist()
    direct_means = []
    for k in present:
        v = x[ids == k]
        mu = v.mean() if r.centered else torch.zeros((), dtype=x.dtype)
        s2 = (v - mu).square().mean()
        torch.testing.assert_close(mean[k], mu)
        torch.testing.assert_close(var[k], s2)
        torch.testing.assert_close(y[ids == k], (v - mu) / torch.sqrt(s2 + eps))
        direct_means.append(float(v.mean()))
    # different ids, different statistics (random data: no two scopes share a mean)
    assert len(set(round(d, 12) for d in direct_means)) == len(present)
    # every non-empty statistic of the engine is some element's scope
    counts = m.count.flatten() if isinstance(m.count, torch.Tensor) else torch.full_like(mean, m.count)
    assert sorted(present) == [k for k in range(mean.numel()) if counts[k] > 0]
    assert all(int((ids == k).sum()) == int(counts[k]) for k in present)


def _same_partition(ids: torch.Tensor, key: torch.Tensor) -> bool:
    """ids and key group the elements identically (a bijection between their values)."""
    pairs = set(zip(ids.flatten().tolist(), key.flatten().tolist()))
    return len(pairs) == len(set(ids.flatten().tolist())) == len(set(key.flatten().tolist()))


# the articles' pictures, as independent index formulas: which elements share statistics
N, C, L, G = 3, 6, 4, 2
n_, c_, l_ = torch.meshgrid(torch.arange(N), torch.arange(C), torch.arange(L), indexing="ij")
B, S, D = 2, 5, 6
b_, s_, d_ = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(D), indexing="ij")
EXPECTED = {
    ("batch", "nchw"): c_,  # a slab per channel
    ("layer", "nchw"): n_,  # a slab per sample
    ("instance", "nchw"): n_ * C + c_,  # a column per (sample, channel)
    ("group", "nchw"): n_ * G + c_ // (C // G),  # a block of channels per sample
    ("rms", "nchw"): n_,
    ("layer2d", "nchw"): n_ * L + l_,  # a line through the channels per position
    ("batch", "bsd"): d_,  # per feature, through every token
    ("layer", "bsd"): b_ * S + s_,  # a strip per token
    ("instance", "bsd"): b_ * D + d_,
    ("group", "bsd"): b_ * G + d_ // (D // G),
    ("rms", "bsd"): b_ * S + s_,
}


@pytest.mark.parametrize("name,layout", sorted(EXPECTED))
def test_named_layers_highlight_the_articles_cells(name, layout):
    shape = (N, C, L) if layout == "nchw" else (B, S, D)
    ids = scope_ids(layer_scope(name, layout, G), shape)
    assert _same_partition(ids, EXPECTED[name, layout])


def test_padding_is_excluded_and_batch_scope_runs_through_valid_tokens():
    shape = (B, S, D)
    mask = lengths_mask(shape, [5, 3], "bsd")
    ids = scope_ids(layer_scope("batch", "bsd"), shape, mask)
    assert (ids[1, 3:] == -1).all() and (ids[0] >= 0).all() and (ids[1, :3] >= 0).all()
    # one feature's scope spans both sequences' valid tokens
    assert int((ids == ids[0, 0, 2]).sum()) == 5 + 3


def test_layer2d_is_not_a_bsd_layer_and_errors_are_clear():
    with pytest.raises(ValueError, match="layer2d.*bsd"):
        layer_scope("layer2d", "bsd")
    with pytest.raises(ValueError, match="one of"):
        layer_scope("nope")
    with pytest.raises(ValueError, match="divisible"):
        scope_ids(Scope.group(4), (2, 6, 3))
    with pytest.raises(ValueError, match="resolved for"):
        scope_ids(Scope.batch().resolve((2, 3, 4)), (2, 3, 5))
    with pytest.raises(ValueError, match="one length per sample"):
        lengths_mask((2, 5, 6), [1], "bsd")
    with pytest.raises(ValueError, match="layout"):
        layer_scope("batch", "nhwc")


def test_cube_faces_cover_exactly_the_visible_surface():
    faces = cube_faces((3, 6, 4), "nchw")
    idx = [(f["face"], f["index"]) for f in faces]
    assert len(idx) == len(set(idx)) == 3 * 6 + 3 * 4 + 6 * 4
    flat = lambda n, c, p: (n * 6 + c) * 4 + p  # noqa: E731
    assert {i for f, i in idx if f == "front"} == {flat(0, c, p) for c in range(6) for p in range(4)}
    assert {i for f, i in idx if f == "top"} == {flat(n, c, 0) for n in range(3) for c in range(6)}
    assert {i for f, i in idx if f == "side"} == {flat(n, 5, p) for n in range(3) for p in range(4)}
    bsd = cube_faces((2, 5, 6), "bsd")
    assert {f["index"] for f in bsd if f["face"] == "front"} == {s * 6 + d for s in range(5) for d in range(6)}


# -- pictures -----------------------------------------------------------------------------------------

needs_mpl = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="drawing needs matplotlib: pip install 'normscope[viz]'"
)


def _highlighted(ax):
    from matplotlib.colors import to_hex

    from normscope.tools.viz.figures import HIGHLIGHT

    return sum(1 for p in ax.patches if to_hex(p.get_facecolor()) == HIGHLIGHT)


@needs_mpl
@pytest.mark.parametrize(
    "name,layout,n_hl",
    [("group", "bsd", 15), ("layer", "bsd", 6), ("batch", "bsd", 10), ("instance", "nchw", 4), ("layer2d", "nchw", 6)],
)
def test_slices_shade_exactly_one_scope(name, layout, n_hl):
    from normscope.tools.viz import draw

    ax = draw(name, layout, groups=2, view="slices")
    assert _highlighted(ax) == n_hl  # (2,5,6) / (3,6,4): the scope of the first element


@needs_mpl
def test_draw_accepts_torch_and_normscope_layers():
    import normscope
    from normscope.tools.viz import draw

    a = draw(nn.GroupNorm(3, 6), shape=(2, 6, 4), view="slices")
    b = draw(normscope.GroupNorm(3, 6), shape=(2, 6, 4), view="slices")
    assert _highlighted(a) == _highlighted(b) == 2 * 4
    assert "G=3" in a.get_title()
    # LayerNorm's normalized_shape decides the scope: last axis only -> one scope per (n, c)
    ln = draw(nn.LayerNorm(4), shape=(2, 6, 4), view="slices")
    assert _highlighted(ln) == 4 and "LayerNorm((4,))" in ln.get_title()
    assert _highlighted(draw(nn.LayerNorm((6, 4)), shape=(2, 6, 4), view="slices")) == 24
    with pytest.raises(TypeError, match="norm layer"):
        draw(nn.Linear(2, 2))


@needs_mpl
@pytest.mark.parametrize("ext", ["svg", "png", "pdf"])
def test_cli_writes_valid_files(tmp_path, ext):
    from normscope.tools.viz import main

    out = tmp_path / f"g.{ext}"
    assert main(["group", "--groups", "3", "--shape", "2,6,2,2", "-o", str(out)]) == 0
    data = out.read_bytes()
    if ext == "svg":
        assert ET.fromstring(data).tag.endswith("svg")
    elif ext == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert data[:5] == b"%PDF-" and b"%%EOF" in data[-32:]


@needs_mpl
def test_cli_grid_and_bad_input(tmp_path, capsys):
    from normscope.tools.viz import main

    assert main(["all", "--layout", "bsd", "--mask", "5,3", "-o", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").stat().st_size > 5000
    assert main(["group", "--groups", "4", "-o", str(tmp_path / "x.png")]) == 2
    assert "divisible" in capsys.readouterr().err
    assert main(["nope", "-o", str(tmp_path / "x.png")]) == 2
    assert main(["layer", "-o", str(tmp_path / "x.txt")]) == 2
    assert "png" in capsys.readouterr().err


@needs_mpl
def test_draw_all_writes_every_layer(tmp_path):
    from normscope.tools.viz import draw_all

    paths = draw_all(tmp_path, fmt="svg")
    names = {p.name for p in paths}
    assert {f"scope-{n}-nchw.svg" for n in layer_names("nchw")} <= names
    assert {f"scope-{n}-bsd.svg" for n in layer_names("bsd")} <= names
    assert {"scopes-nchw.svg", "scopes-bsd.svg"} <= names
    for p in paths:
        ET.parse(p)


def _caption(ax) -> str:
    return next(t.get_text() for t in ax.texts if "scopes; shaded" in t.get_text())


def test_draw_layer_norm_on_nchw_of_rank_4_is_one_scope_per_sample():
    """LayerNorm over (C, H, W): a (2, 4, 2, 2) input has 2 scopes of 16 (it drew (H, W) only: 8 of 4)."""
    pytest.importorskip("matplotlib")
    from normscope.tools.viz import draw

    assert _caption(draw("layer", shape=(2, 4, 2, 2))) == "2 scopes; shaded: one scope of 16 elements"
    assert _caption(draw("rms", shape=(2, 4, 2, 2))) == "2 scopes; shaded: one scope of 16 elements"
    # the torch layer of the same configuration says the same
    assert _caption(draw(nn.LayerNorm((4, 2, 2)), shape=(2, 4, 2, 2))) == "2 scopes; shaded: one scope of 16 elements"


def test_draw_normscope_layer_norm_2d_normalizes_over_channels():
    """normscope.LayerNorm2d is an nn.LayerNorm subclass over C, channels-first: (3, 6, 4) has 3 x 4 scopes of 6
    channels (it was drawn as a LayerNorm over the last axis: 18 scopes of 4)."""
    pytest.importorskip("matplotlib")
    import normscope
    from normscope.tools.viz import draw

    ax = draw(normscope.LayerNorm2d(6))
    assert _caption(ax) == "12 scopes; shaded: one scope of 6 elements"
    assert ax.get_title() == "LayerNorm2d (channels)"
