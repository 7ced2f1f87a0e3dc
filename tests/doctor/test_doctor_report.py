"""The doctor's report for people: findings grouped by check and severity, one screen in the terminal
whatever the model's size, ``--all`` for every layer, one fix line per group that does exactly what the
group's own lines do (run here on copies of the model and compared), and an HTML page with a picture per
measured quantity. The facts the tests hold it to are computed here from the model (which layers see
how many values), not read back from the report."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn

import normscope
from normscope.cli import main
from normscope.doctor import SCHEMA, Report, apply_fixes, doctor
from normscope.doctor._group import collapse, where_for
from normscope.doctor._render import text_lines


class Deep(nn.Module):
    """A deep CNN trained at batch 2: stages of conv-BN blocks whose spatial size halves, so the BatchNorms
    of the later stages see fewer values per statistic (errors), the first ones more (warnings, or none)."""

    def __init__(self, blocks=(6, 20, 20, 20), width=8):
        super().__init__()
        stages, cin = [], 3
        for i, n in enumerate(blocks):
            layers = []
            for j in range(n):
                layers += [
                    nn.Conv2d(cin, width, 3, 2 if j == 0 and i else 1, 1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(inplace=True),
                ]
                cin = width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)

    def forward(self, x):
        return self.stages(x)


def _values_per_statistic(model, x):
    """Each BatchNorm's N x H x W, from a hook: the fact bn-elements measures."""
    seen = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, p=p: seen.__setitem__(p, a[0].numel() // a[0].shape[1]))
        for p, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.fixture(scope="module")
def deep():
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(2, 3, 40, 40)
    report = doctor(model, x)
    return model, x, report


def test_a_hundred_findings_fit_one_screen_and_every_check_is_named(deep):
    model, x, report = deep
    assert len(report.findings) >= 80  # the situation the summary is for
    lines = [t for t, _ in text_lines(report)]
    assert len(lines) <= 40, "\n".join(lines)
    text = "\n".join(lines)
    for check in report.checks:
        assert re.search(rf"\b{re.escape(check)}\b", text), f"{check} not named"
    # --all: every finding, each with its own layer and fix
    everything = "\n".join(t for t, _ in text_lines(report, all=True))
    for f in report.findings:
        assert f"{f.check} {f.module or '<model>'}: {f.reason}" in everything and f.fix in everything


def test_groups_hold_the_layers_in_forward_order_with_the_measured_range(deep):
    model, x, report = deep
    torch.manual_seed(0)
    truth = _values_per_statistic(copy.deepcopy(model), x)
    groups = {(g.check, g.severity): g for g in report.groups()}
    errors = groups[("bn-elements", "error")]
    expected = [p for p in truth if truth[p] < 100]  # forward order: named_modules' order here
    assert list(errors.modules) == expected
    assert (errors.low, errors.high) == (min(truth[p] for p in expected), max(truth[p] for p in expected))
    # every finding is in exactly one group
    assert sorted(f.module + f.check + f.severity for g in report.groups() for f in g.findings) == sorted(
        f.module + f.check + f.severity for f in report.findings
    )


@pytest.mark.parametrize("severity", ["error", "warning"])
def test_one_fix_for_a_group_converts_exactly_the_layers_its_own_lines_convert(deep, severity):
    model, x, report = deep
    (group,) = [g for g in report.groups() if g.check == "bn-elements" and g.severity == severity]
    by_group = copy.deepcopy(model)
    namespace = {"model": by_group, "torch": torch, "normscope": normscope}
    exec(compile(group.fix, "group fix", "exec"), namespace)
    by_lines = copy.deepcopy(model)
    namespace2 = {"model": by_lines, "torch": torch, "normscope": normscope}
    for f in group.findings:
        exec(compile(f.fix, "line", "exec"), namespace2)
    kinds = lambda m: {p: type(q).__name__ for p, q in m.named_modules()}  # noqa: E731
    assert kinds(namespace["model"]) == kinds(namespace2["model"])
    converted = {p for p, t in kinds(namespace["model"]).items() if t == "GroupNorm"}
    assert converted == set(group.modules)


def test_collapse_and_where_name_exactly_the_group():
    layers = ["a.0.bn", "a.1.bn", "b.0.bn", "b.1.bn", "b.2.bn", "c"]
    assert collapse(["a.0.bn", "a.1.bn", "b.0.bn"], layers) == "a.*, b.0.bn"
    assert collapse(["b.0.bn", "b.1.bn", "b.2.bn", "c"], layers) == "b.*, c"
    assert collapse([""], layers) == "<model>"
    typed = [(p, "BatchNorm2d") for p in layers[:-1]] + [("c", "LayerNorm")]
    for group in (["a.0.bn", "a.1.bn", "b.0.bn"], ["b.1.bn", "c"], layers[:-1], ["a.1.bn"]):
        where = eval(where_for(group, typed))  # noqa: S307 - the line the report prints
        picked = [p for p, t in typed if where(p, type(t, (), {})())]
        assert picked == group, (group, where_for(group, typed))


def test_json_keeps_its_schema_and_adds_the_groups_and_pictures(deep):
    model, x, report = deep
    doc = json.loads(report.to_json())
    assert doc["schema"] == SCHEMA == "normscope.doctor/1"
    assert len(doc["findings"]) == len(report.findings)
    assert [g["fix"] for g in doc["groups"]] == [g.fix for g in report.groups()]
    assert [entry["path"] for entry in doc["layers"]] == [p for p, _ in report.layers]
    assert {s["check"] for s in doc["series"]} >= {"bn-elements", "train-eval-drift"}
    assert doc["source"] == "doctor" and str(Report([])).splitlines()[0].startswith("normscope doctor:")
    with pytest.raises(ValueError, match=r"`source`.*'doctor', 'watch'.*'lab'"):
        Report([], source="lab")


def test_apply_fixes_still_runs_each_finding_once(deep):
    model, x, report = deep
    fixed, lines = apply_fixes(copy.deepcopy(model), report)
    assert len(lines) == len({f.fix for f in report.findings if f.check == "bn-elements"})
    assert doctor(fixed, x, checks=["bn-elements"]).by_check("bn-elements") == []


def test_the_command_prints_one_screen_and_all_on_request(tmp_path, monkeypatch, capsys):
    (tmp_path / "deep_models.py").write_text(
        "import torch\nfrom test_doctor_report import Deep\n\ndef build():\n"
        "    torch.manual_seed(0)\n    return Deep(), torch.randn(2, 3, 40, 40)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "deep_models:build", "--plain", "--quiet"]) == 0
    short = capsys.readouterr().out.strip().splitlines()
    assert 3 < len(short) <= 40
    assert main(["doctor", "deep_models:build", "--plain", "--quiet", "--all"]) == 0
    full = capsys.readouterr().out
    torch.manual_seed(0)
    truth = _values_per_statistic(Deep(), torch.randn(2, 3, 40, 40))
    for path, n in truth.items():  # every BatchNorm below the error bound, on a line of its own
        assert (f"[error] bn-elements {path}:" in full) == (n < 100), path
