"""``normscope doctor MODULE:CALLABLE``: JSON, the table, HTML, --fail-on exit codes, --fix (in memory
only), and clear errors -- with the model untouched -- when the callable or the forward fails."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from normscope.cli import main

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    SMALL = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))        # batch 2: bn-elements error
    PLAIN = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8))  # nothing above info

    def small():
        return SMALL, torch.randn(2, 3, 5, 5)

    def with_kwargs():
        return PLAIN, (), {"input": torch.randn(6, 4)}

    def plain():
        return PLAIN.eval(), (torch.randn(6, 4),)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            self.bn(x)
            raise RuntimeError("forward exploded")

    BOOM = Boom()

    def boom():
        return BOOM, torch.randn(8, 4)

    def raises():
        raise KeyError("no such checkpoint")

    def wrong():
        return SMALL

    def not_a_model():
        return "resnet", torch.randn(2, 3)

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "doctor_cli_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("doctor_cli_models", None)
    import doctor_cli_models

    yield doctor_cli_models
    sys.modules.pop("doctor_cli_models", None)


def _run(capsys, *argv):
    rc = main(["doctor", *argv, "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_is_the_report(models, capsys):
    rc, out, _ = _run(capsys, "doctor_cli_models:small", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["schema"] == "normscope.doctor/1" and doc["model"] == "Sequential"
    (f,) = [f for f in doc["findings"] if f["check"] == "bn-elements"]
    assert f["severity"] == "error" and f["measured"]["elements"] == 2 * 3 * 3 and f["module"] == "1"


@pytest.mark.parametrize(
    ("target", "fail_on", "rc"),
    [
        ("small", "error", 1),
        ("small", "warning", 1),
        ("plain", "error", 0),
        ("plain", "warning", 0),
        ("small", None, 0),
    ],
)
def test_fail_on_exit_status(models, capsys, target, fail_on, rc):
    args = [f"doctor_cli_models:{target}", "--json"] + (["--fail-on", fail_on] if fail_on else [])
    got, out, _ = _run(capsys, *args)
    worst = {f["severity"] for f in json.loads(out)["findings"]}
    assert got == rc
    assert ("error" in worst) == (target == "small")


def test_checks_option_runs_only_those(models, capsys):
    rc, out, _ = _run(capsys, "doctor_cli_models:small", "--json", "--checks", "bn-elements, syncbn")
    assert rc == 0 and set(json.loads(out)["checks"]) == {"bn-elements", "syncbn"}


def test_kwargs_and_a_py_path(models, capsys, tmp_path):
    rc, out, _ = _run(capsys, "doctor_cli_models:with_kwargs", "--json")
    assert rc == 0 and json.loads(out)["inputs"] == ["input=float32[6, 4]"]
    rc, out, _ = _run(capsys, f"{tmp_path / 'doctor_cli_models.py'}:small", "--json")
    assert rc == 0 and json.loads(out)["summary"]["error"] >= 1


def test_table_is_ordered_by_severity_and_progress_goes_to_stderr(models, capsys):
    rc = main(["doctor", "doctor_cli_models:small", "--plain"])
    out, err = capsys.readouterr()
    assert rc == 0 and "doctor: forward with hooks" in err and "doctor: check bn-elements" in err
    rows = [
        line.split()[0] for line in out.splitlines() if line.strip().split()[:1] in (["error"], ["warning"], ["info"])
    ]
    assert rows and rows == sorted(rows, key=["error", "warning", "info"].index)
    assert "fix: model, _ = normscope.convert(" in out


def test_html_is_self_contained(models, capsys, tmp_path):
    page = tmp_path / "report.html"
    rc, _, _ = _run(capsys, "doctor_cli_models:small", "--html", str(page))
    text = page.read_text()
    assert rc == 0 and text.startswith("<!doctype html>") and "bn-elements" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text  # nothing fetched or run
    assert "<svg" in text and "data-check='bn-elements'" in text  # the elements-per-statistic picture, inline


def test_fix_converts_in_memory_and_the_finding_is_gone(models, capsys, tmp_path):
    source = (tmp_path / "doctor_cli_models.py").read_bytes()
    state = {k: v.clone() for k, v in models.SMALL.state_dict().items()}
    rc, out, _ = _run(capsys, "doctor_cli_models:small", "--json", "--fix")
    doc = json.loads(out)
    assert rc == 0 and any("to='group'" in line for line in doc["fix"]["applied"])
    assert not [f for f in doc["fix"]["after"]["findings"] if f["check"] == "bn-elements"]
    assert (tmp_path / "doctor_cli_models.py").read_bytes() == source  # nothing written
    assert type(models.SMALL[1]).__name__ == "BatchNorm2d"  # the user's model is not the converted one
    assert all(torch.equal(v, state[k]) for k, v in models.SMALL.state_dict().items())
    rc, out, _ = _run(capsys, "doctor_cli_models:small", "--fix", "--plain")
    assert "fixes applied (to the model in memory; no file written)" in out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("doctor_cli_models:raises", "doctor_cli_models:raises raised KeyError: 'no such checkpoint'"),
        ("doctor_cli_models:wrong", "must return (model, inputs) or (model, inputs, kwargs), got Sequential"),
        ("doctor_cli_models:not_a_model", "returned a str as the model, expected a torch.nn.Module"),
        ("doctor_cli_models:missing", "has no callable 'missing' (found nothing)"),
        ("doctor_cli_models:NOT_CALLABLE", "has no callable 'NOT_CALLABLE' (found int)"),
        ("no_such_module_xyz:build", "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
        ("nocolon", "expected MODULE:CALLABLE"),
        ("./missing_file.py:build", "no such file"),
    ],
)
def test_bad_callables_are_one_clear_line(models, capsys, target, message):
    rc, out, err = _run(capsys, target)
    assert rc == 1 and out == "" and message in err and "Traceback" not in err


def test_a_raising_forward_leaves_the_model_untouched(models, capsys):
    bn = models.BOOM.bn
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    rc, out, err = _run(capsys, "doctor_cli_models:boom")
    assert rc == 1 and "forward raised RuntimeError: forward exploded" in err and "model is unchanged" in err
    assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())  # running stats moved, then restored


def test_bad_options_exit_2(models, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "doctor_cli_models:small", "--fail-on", "info"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["doctor", "doctor_cli_models:small", "--world-size", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["doctor", "doctor_cli_models:small", "--checks", "bn-elements,nope"])
    assert e.value.code == 2 and "expected names from bn-elements" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["doctor", "doctor_cli_models:small", "--html", "/no/such/dir/r.html"])
    assert e.value.code == 2
    assert "--html" in capsys.readouterr().err


def test_html_naming_a_directory_exits_2_before_the_diagnosis(models, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "doctor_cli_models:small", "--html", str(tmp_path)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "Traceback" not in err
    assert f"argument --html: expected a file to write, got the directory {str(tmp_path)!r}" in err
