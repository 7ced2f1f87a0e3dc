"""ONNX export of normscope layers, run in onnxruntime, against PyTorch's outputs (1e-5).

Both exporters: the TorchScript one (``dynamo=False``, with :mod:`normscope.onnx`'s rms_norm
conversion) and the torch.export one (``dynamo=True``, needs onnxscript). Each exports once with a
dynamic batch axis and is run on two batch sizes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import normscope

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install normscope[integrations])")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install normscope[integrations])")
import normscope.onnx  # noqa: E402  (registers the rms_norm conversion for the TorchScript exporter)


class Net(torch.nn.Module):
    """Every exported layer in one model: BatchNorm2d and SyncBatchNorm (eval), GroupNorm,
    channels-first LayerNorm via ``normalize(dims=1)``, LayerNorm and RMSNorm over the last axis."""

    def __init__(self, c: int = 4, w: int = 6) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, c, 3, padding=1)
        self.bn = normscope.BatchNorm2d(c)
        self.sbn = normscope.SyncBatchNorm(c)
        self.gn = normscope.GroupNorm(2, c)
        self.cw = torch.nn.Parameter(torch.randn(c))
        self.cb = torch.nn.Parameter(torch.randn(c))
        self.ln = normscope.LayerNorm(w)
        self.rms = normscope.RMSNorm(w, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sbn(self.bn(self.conv(x)))
        y = self.gn(y)
        y = normscope.normalize(y, dims=1, weight=self.cw, bias=self.cb)  # LayerNorm2d
        return self.rms(self.ln(y))


def _model() -> Net:
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():  # non-trivial parameters and running statistics
        for mod in m.modules():
            for name, p in mod.named_parameters(recurse=False):
                if name in ("weight", "bias") and not isinstance(mod, torch.nn.Conv2d):
                    p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name == "weight" else 0.0))
        for bn in (m.bn, m.sbn):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_export_runs_in_onnxruntime(tmp_path, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    model = _model()
    x = torch.randn(2, 3, 5, 6)
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=64)
            prog = torch.onnx.export(model, (x,), dynamo=True, input_names=["x"], dynamic_shapes={"x": {0: batch}})
            prog.save(str(path))
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for n in (2, 7):
        xn = torch.randn(n, 3, 5, 6)
        with torch.no_grad():
            want = model(xn)
        got = torch.from_numpy(session.run(None, {name: xn.numpy()})[0])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_register_is_idempotent_and_export_helper(tmp_path):
    normscope.onnx.register()
    normscope.onnx.register()
    model = torch.nn.Sequential(normscope.RMSNorm(8)).eval()  # eps=None: fp32 machine epsilon
    x = torch.randn(3, 8)
    path = tmp_path / "rms.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normscope.onnx.export(model, (x,), str(path), dynamo=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (8,)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [normscope.RMSNorm, torch.nn.RMSNorm])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_torchscript_rms_norm_in_float64_uses_torch_s_float64_epsilon(tmp_path, layer, eps):
    # torch's default eps is the machine epsilon of the type it computes in: float64's for float64 input
    # (the conversion wrote float32's, 1.2e-7: a tenth of the mean square of this input)
    model = torch.nn.Sequential(layer(8, eps=eps)).double().eval()
    x = torch.randn(3, 8, dtype=torch.float64) * 1e-3
    path = tmp_path / "rms64.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normscope.onnx.export(model, (x,), str(path), dynamo=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    want = x / torch.sqrt(x.square().mean(-1, keepdim=True) + (torch.finfo(torch.float64).eps if eps is None else eps))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_torchscript_export_prints_no_tracer_warning_from_normscope(tmp_path):
    # the checks' Python bools of traced sizes are constants by design (the export above runs other
    # batch sizes): the TorchScript exporter must not flood the user with TracerWarnings about them.
    # A fresh interpreter, as a user's script: under pytest normscope is imported inside the warning
    # context of collection, which drops the filter it installs when the context closes
    import subprocess
    import sys
    from pathlib import Path

    script = """
import io, sys, warnings, torch
sys.path.insert(0, sys.argv[1])
import test_onnx
with warnings.catch_warnings(record=True) as caught:
    torch.onnx.export(test_onnx._model(), (torch.randn(2, 3, 5, 6),), io.BytesIO(), dynamo=False,
                      input_names=["x"], dynamic_axes={"x": {0: "batch"}})
tracer = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
print(len(tracer), [f"{w.filename}:{w.lineno}" for w in tracer if "normscope" in w.filename])
"""
    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", script, str(here)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("[]"), out.stdout
