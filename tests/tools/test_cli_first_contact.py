"""`normscope explain` and `normscope draw` as a new user meets them: every name the help lists works with no
options, both commands read names through one table (normscope.tools.named.parse), the masked norms are explained
against a direct float64 computation over the valid elements, and an unwritable picture path is named."""

import json
import re

import pytest
import torch

from normscope import cli
from normscope.tools import explain
from normscope.tools.named import MASKED, NAMED, parse, spellings


def run(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _listed_names(capsys) -> list[str]:
    """The names `normscope explain --help` lists for LAYER (before its parenthesis of torch names)."""
    rc, out, _ = run(capsys, "explain", "--help")
    assert rc == 0
    text = " ".join(out.split())
    listed = re.search(r"arguments: LAYER (.*?) \(or torch names", text).group(1)
    return [n.strip() for n in listed.split(",")]


def test_help_lists_every_name_of_the_table_and_the_masked_ones(capsys):
    listed = _listed_names(capsys)
    assert set(listed) >= {"qknorm", "adaln", "layer2d", "masked_batch", "masked_instance", "masked_group"}
    assert set(listed) == set(NAMED) | {f"masked_{n}" for n in MASKED}


@pytest.mark.parametrize("name", spellings())
def test_every_listed_name_works_with_no_options(capsys, name):
    rc, out, err = run(capsys, "explain", name, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["torch"]["allclose"], r["torch"]
    assert r["scope"]["num_scopes"] >= 2  # a default input shows more than one scope
    assert all(s["count"] >= 2 for s in r["stats"])  # and more than one value in each
    assert (r["mask_lengths"] is not None) == name.startswith("masked_")


@pytest.mark.parametrize("name", ["BatchNorm2d", "InstanceNorm3d", "GroupNorm", "LayerNorm", "RMSNorm", "LayerNorm2d"])
def test_torch_names_work_with_no_options(capsys, name):
    rc, out, err = run(capsys, "explain", name, "--plain")
    assert rc == 0, err and "[ok]" in out


def test_qk_takes_heads_and_defaults_to_two():
    r = explain.explain("qknorm", (1, 2, 12), heads=3)
    assert r["groups"] == 3 and r["scope"]["elements_per_scope"] == 4 and r["scope"]["num_scopes"] == 2 * 3
    assert explain.explain("qknorm")["groups"] == 2


def test_group_without_groups_takes_two_or_the_smallest_divisor():
    assert explain.explain("group", (2, 6, 4))["groups"] == 2
    assert explain.explain("group", (2, 9, 4))["groups"] == 3


def test_masked_statistics_count_only_valid_elements():
    # masked InstanceNorm on (2, 1, 4) with lengths 4 and 2: the second sample's statistics are those of its
    # first two values, computed here by hand
    values = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 99.0, -99.0]
    r = explain.explain("masked_instance", (2, 1, 4), values=values, mask=[4, 2])
    (s0, s1) = r["stats"]
    assert s0["count"] == 4 and s0["mean"] == pytest.approx(2.5) and s0["var"] == pytest.approx(1.25)
    assert s1["count"] == 2 and s1["mean"] == pytest.approx(15.0) and s1["var"] == pytest.approx(25.0)
    y = torch.tensor(r["output"])[1, 0, :2]
    torch.testing.assert_close(y, torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)
    assert r["scope_ids"][1][0][2:] == [-1, -1]  # padding belongs to no scope


@pytest.mark.parametrize("name", [f"masked_{n}" for n in MASKED])
def test_a_wrong_masked_norm_is_caught_by_the_comparison(monkeypatch, name):
    # the comparison must be able to fail: a layer that ignores the mask disagrees with the direct computation
    real = explain._masked_outputs

    def ignoring_the_mask(setup, x, mask):
        y, y_ref, compared, what = real(setup, x, mask)
        unmasked = explain._Setup(setup.kind, setup.shape, setup.groups, setup.last, setup.eps)
        y_plain = explain._outputs(unmasked, x)[0]
        return y_plain, y_ref, compared, what

    monkeypatch.setattr(explain, "_masked_outputs", ignoring_the_mask)
    assert not explain.explain(name)["torch"]["allclose"]


def test_draw_and_explain_read_names_through_one_table():
    pytest.importorskip("matplotlib")
    from normscope.tools.viz import draw

    for text in ("BatchNorm2d", "gn", "LayerNorm2d", "masked_layer", "QKNorm"):
        name = parse(text).name
        layout = "bsd" if NAMED[name].nchw is None else "nchw"
        assert draw(text, layout).get_title() == draw(name, layout).get_title()
        explain.parse_layer(text)  # accepted by explain too


@pytest.mark.parametrize("name", [*spellings(), "BatchNorm2d", "LayerNorm2d"])
def test_draw_cli_accepts_every_name_explain_lists(tmp_path, name):
    pytest.importorskip("matplotlib")
    from normscope.tools.viz import main as draw_main

    out = tmp_path / "x.png"
    assert draw_main([name, "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_draw_names_the_path_it_cannot_write(capsys):
    pytest.importorskip("matplotlib")
    from normscope.tools.viz import main as draw_main

    assert draw_main(["group", "-o", "/proc/x.png"]) == 2
    err = capsys.readouterr().err
    assert "'/proc/x.png'" in err and "cannot write" in err
