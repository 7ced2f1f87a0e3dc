"""The hot path (normscope.hot): a signature seen before skips checks, resolution and
planning -- and must still give torch's numbers, honour a forced backend, reject bad input and keep
the cancellation check."""

from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import normscope
import normscope.functional as NF

LAYERS = [
    ("LayerNorm", lambda m: m.LayerNorm(16), (4, 16)),
    ("RMSNorm", lambda m: m.RMSNorm(16), (4, 16)),
    ("GroupNorm", lambda m: m.GroupNorm(2, 8), (3, 8, 5)),
    ("BatchNorm1d", lambda m: m.BatchNorm1d(8), (6, 8)),
    ("BatchNorm2d", lambda m: m.BatchNorm2d(8), (2, 8, 3, 3)),
    ("InstanceNorm1d", lambda m: m.InstanceNorm1d(4, affine=True), (3, 4, 10)),
    ("InstanceNorm2d-tracked", lambda m: m.InstanceNorm2d(4, affine=True, track_running_stats=True), (2, 4, 5, 6)),
]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name,make,shape", LAYERS, ids=[c[0] for c in LAYERS])
def test_repeated_calls_match_torch_in_train_and_eval(name, make, shape, backend):
    # auto: aten's runners, whose layer entries the hot calls run; reference: the engine's adapter of
    # a Call runner (engine.layer_entry), running statistics included
    g = torch.Generator().manual_seed(0)
    ours, theirs = make(normscope), make(nn)
    with normscope.use_backend(backend):
        _train_and_eval(ours, theirs, shape, g)
        assert normscope.last_backend() == ("aten" if backend == "auto" else backend)


def _train_and_eval(ours, theirs, shape, g):
    for train in (True, True, True, False, False):
        ours.train(train), theirs.train(train)
        x = torch.randn(shape, generator=g, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y, y_t = ours(x), theirs(x2)
        torch.testing.assert_close(y, y_t)
        gy = torch.randn(shape, generator=g)
        y.backward(gy), y_t.backward(gy)
        torch.testing.assert_close(x.grad, x2.grad)
    for (n, b), (_, b_t) in zip(ours.named_buffers(), theirs.named_buffers()):
        torch.testing.assert_close(b, b_t, msg=n)


def test_forced_backend_between_calls_is_honoured():
    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x)
    ln(x)
    assert normscope.last_backend() == "aten"
    with normscope.use_backend("reference"):
        y = ln(x)
        assert normscope.last_backend() == "reference"
    torch.testing.assert_close(y, nn.functional.layer_norm(x, (16,), ln.weight, ln.bias))
    ln(x)
    assert normscope.last_backend() == "aten"


def test_environment_backend_read_per_call(monkeypatch):
    gn, x = normscope.GroupNorm(2, 8), torch.randn(3, 8, 5)
    gn(x)
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    gn(x)
    assert normscope.last_backend() == "reference"


def test_bad_input_after_a_good_call_still_raises():
    gn = normscope.GroupNorm(2, 8)
    gn(torch.randn(3, 8, 5))
    with pytest.raises(ValueError, match="expected input with 8 channels"):
        gn(torch.randn(3, 6, 5))
    # a BatchNorm1d that saw a 4D-shaped signature must not let BatchNorm2d's check be skipped, nor
    # the other way round: the layer's class is part of the key
    normscope.BatchNorm2d(8)(torch.randn(2, 8, 3, 3))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        normscope.BatchNorm1d(8)(torch.randn(2, 8, 3, 3))
    # a parameter changed after the first call (dtype, shape) is checked again
    ln = normscope.LayerNorm(16)
    x = torch.randn(4, 16)
    ln(x)
    ln.weight.data = torch.ones(16, dtype=torch.float64)
    with pytest.raises(TypeError, match="weight"):
        ln(x)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ln([1.0] * 16)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("bad", [(16.0,), (4, 4.0)])
def test_a_float_size_after_an_int_one_is_still_refused(fn, bad):
    """(16.0,) == (16,) and hashes alike: a plan keyed on the value alone would let a float size
    through the checks that refuse it cold (torch.nn.functional refuses it too)."""
    good = tuple(int(n) for n in bad)
    x = torch.randn(3, *good)
    getattr(NF, fn)(x, good)
    with pytest.raises(TypeError):
        getattr(nn.functional, fn)(x, bad)
    with pytest.raises(TypeError, match="`normalized_shape` to be an int or a sequence of ints"):
        getattr(NF, fn)(x, bad)


@pytest.mark.parametrize("bad", [1.0, -1.0])
def test_batch_norm_refuses_a_float_channel_dim_cold_and_warm(bad):
    """``channel_dim=1.0`` equals 1 in a key: refused with a TypeError naming it, also after a call
    with the int (the plan's key holds its type)."""
    x = torch.randn(4, 3, 5)
    for warm in (False, True):
        if warm:
            NF.batch_norm(x, None, None, training=True, channel_dim=int(bad))
        with pytest.raises(TypeError, match=r"expected `channel_dim` to be an int \(1 or -1\), got 1.0|got -1.0"):
            NF.batch_norm(x, None, None, training=True, channel_dim=bad)


def test_dtype_change_replans():
    ln = normscope.LayerNorm(16)
    x = torch.randn(4, 16)
    ln(x)
    ln.double()
    y = ln(x.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, nn.functional.layer_norm(x.double(), (16,), ln.weight, ln.bias))


def _first(x):  # the scopes of the first sample (LayerNorm's row, GroupNorm's groups, InstanceNorm's channels)
    return x[0]


def _channel(x):  # BatchNorm's first channel, over every sample and position
    return x[:, 0]


def _batch_stats(x):
    return nn.functional.batch_norm(x, None, None, training=True)


CANCELLING = [
    (lambda: normscope.LayerNorm(64), (8, 64), _first, lambda x: nn.functional.layer_norm(x, (64,))),
    (lambda: normscope.GroupNorm(2, 4), (2, 4, 16), _first, lambda x: nn.functional.group_norm(x, 2)),
    (
        lambda: normscope.InstanceNorm2d(4, affine=True),
        (2, 4, 4, 4),
        _first,
        lambda x: nn.functional.instance_norm(x),
    ),
    (lambda: normscope.BatchNorm2d(4), (8, 4, 3, 3), _channel, lambda x: _batch_stats(x)),
    (lambda: normscope.BatchNorm1d(4), (8, 4), _channel, lambda x: _batch_stats(x)),
]


@pytest.mark.parametrize(
    "make,shape,part,exact", CANCELLING, ids=["LayerNorm", "GroupNorm", "InstanceNorm2d", "BatchNorm2d", "BatchNorm1d"]
)
def test_cancellation_check_on_the_hot_path_one_scope_is_enough(make, shape, part, exact):
    # one scope with mean 1e4 / std 1e-2 among ordinary ones: the exact max |mean| * rstd catches it
    layer = make()
    g = torch.Generator().manual_seed(1)
    ordinary = torch.randn(shape, generator=g)
    layer(ordinary)
    layer(ordinary)
    assert normscope.last_backend() == "aten"
    x = torch.randn(shape, generator=g)
    part(x).mul_(1e-2).add_(1e4)
    y = layer(x)
    assert normscope.last_backend() == "reference"
    # float64 from torch (weight ones, bias zeros at initialization); fp32 cannot hold a mean of 1e4
    # closer than 5e-4, i.e. 0.05 of this scope's unit, so that is the bound
    torch.testing.assert_close(y.double(), exact(x.double()), atol=0.1, rtol=0)


def test_cancellation_check_on_the_hot_path_in_evaluation():
    # BatchNorm in evaluation: the running statistics decide, read before the call
    bn = normscope.BatchNorm1d(4).eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=g)
    bn(x), bn(x)
    assert normscope.last_backend() == "aten"
    bn.running_mean[1] = 1e4
    bn.running_var[1] = 1e-4
    x[:, 1] = 1e4 + 1e-2 * torch.randn(8, generator=g)
    y = bn(x)
    assert normscope.last_backend() == "reference"
    exact = nn.functional.batch_norm(x.double(), bn.running_mean.double(), bn.running_var.double(), eps=bn.eps)
    torch.testing.assert_close(y.double(), exact, atol=0.1, rtol=0)


def test_pickle_and_deepcopy_after_calls():
    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x)
    for clone in (pickle.loads(pickle.dumps(ln)), copy.deepcopy(ln)):
        torch.testing.assert_close(clone(x), ln(x))


def test_torch_compile_of_a_layer_that_ran_eagerly():
    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x)
    compiled = torch.compile(ln, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), nn.functional.layer_norm(x, (16,), ln.weight, ln.bias))


@pytest.mark.parametrize("rows", [8, 600], ids=["bits", "torch_ops"])  # either side of aten._BOUNDED_MAX
def test_cancellation_check_is_exact_past_the_bound(rows):
    # means past the cheap bound (max |mean| <= 1024 * sqrt(eps)) but |mean| * rstd far below the
    # limit stay on ATen; one scope over the limit among many goes to the reference
    ln = normscope.LayerNorm(32)
    g = torch.Generator().manual_seed(2)
    x = 10.0 + torch.randn(rows, 32, generator=g)  # mean 10, rstd ~1: product ~10
    ln(x)
    ln(x)
    assert normscope.last_backend() == "aten"
    x[rows // 2] = 1e4 + 1e-2 * torch.randn(32, generator=g)
    ln(x)
    assert normscope.last_backend() == "reference"


# ---------------------------------------------------------------------------------------------
# what may change between two calls of one signature: every tensor and setting is compared again


def _ln_ref(x, ln):
    return nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def test_a_new_parameter_object_or_attribute_is_seen():
    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x), ln(x)
    ln.weight = nn.Parameter(torch.full((16,), 3.0))  # setattr: forgets the last call
    torch.testing.assert_close(ln(x), _ln_ref(x, ln))
    ln.eps = 10.0  # configuration: setattr too
    torch.testing.assert_close(ln(x), _ln_ref(x, ln))
    # written into _parameters directly (as FSDP does), bypassing setattr: a different object
    ln._parameters["bias"] = nn.Parameter(torch.full((16,), -2.0))
    torch.testing.assert_close(ln(x), _ln_ref(x, ln))
    ln.weight.data = torch.full((16,), 0.5)  # same object, data swapped in place: read per call anyway
    torch.testing.assert_close(ln(x), _ln_ref(x, ln))


def test_data_swapped_for_a_wrong_shape_raises_in_the_layers_terms():
    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x), ln(x)
    ln.weight.data = torch.ones(8)  # same Parameter object, shape no longer fits
    with pytest.raises(ValueError, match="weight"):
        ln(x)


def test_parametrized_and_property_weights_are_read_the_usual_way():
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    ln, x = normscope.LayerNorm(16), torch.randn(4, 16)
    ln(x), ln(x)
    parametrize.register_parametrization(ln, "weight", Doubled())
    y = ln(x)
    assert "weight" not in ln._parameters  # the hot path must not read a missing entry as "no weight"
    torch.testing.assert_close(y, _ln_ref(x, ln))
    torch.testing.assert_close(ln.weight, 2 * ln.parametrizations.weight.original)

    class Scaled(normscope.RMSNorm):  # a subclass whose weight is a property over the parameter
        @property
        def weight(self):
            p = self._parameters.get("weight")
            if p is None:  # during construction: not there yet (hasattr must say so)
                raise AttributeError("weight")
            return 3 * p

    rms = Scaled(16)
    with torch.no_grad():  # reset_parameters filled the property's temporary, not the parameter
        rms._parameters["weight"].fill_(1.0)
    for _ in range(3):
        y = rms(x)
    torch.testing.assert_close(y, nn.functional.rms_norm(x, (16,), 3 * torch.ones(16)))


def test_module_to_and_train_eval_forget_the_last_call():
    bn = normscope.BatchNorm1d(8)
    ref = nn.BatchNorm1d(8)
    g = torch.Generator().manual_seed(5)
    for step in range(6):
        x = torch.randn(10, 8, generator=g)
        if step == 3:
            bn.double(), ref.double()
        if step == 4:
            bn.eval(), ref.eval()
        x = x.to(bn.weight.dtype)
        torch.testing.assert_close(bn(x), ref(x))
    for (n, a), (_, b) in zip(bn.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(a, b, msg=n)


def test_alternating_signatures_use_the_shared_table():
    ln = normscope.LayerNorm(16)
    xs = [torch.randn(4, 16), torch.randn(2, 3, 16), torch.randn(4, 16).double()]
    ln(xs[0]), ln(xs[1])
    for _ in range(2):
        for x in xs[:2]:
            torch.testing.assert_close(ln(x), _ln_ref(x, ln))
            assert normscope.last_backend() == "aten"
    ln.double()
    torch.testing.assert_close(ln(xs[2]), _ln_ref(xs[2], ln))


@pytest.mark.parametrize("track", [False, True])
def test_instance_norm_unbatched_between_batched_calls(track):
    ours = normscope.InstanceNorm2d(4, affine=True, track_running_stats=track)
    theirs = nn.InstanceNorm2d(4, affine=True, track_running_stats=track)
    g = torch.Generator().manual_seed(6)
    for train in (True, True, False, False):
        ours.train(train), theirs.train(train)
        x = torch.randn(2, 4, 5, 6, generator=g)
        torch.testing.assert_close(ours(x), theirs(x))
        torch.testing.assert_close(ours(x[0]), theirs(x[0]))
    for (n, b), (_, b_t) in zip(ours.named_buffers(), theirs.named_buffers()):
        torch.testing.assert_close(b, b_t, msg=n)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 0.3, 1e-30, 1e80])
def test_statistics_bound_matches_the_direct_comparison(eps):
    # aten._bounded reads fp32 bits as integer lanes; the direct answer: every |m| <= 1024 * sqrt(eps)
    # compared in float64 (exact for fp32 values), NaN never within
    from normscope.backends import aten

    bound = 1024.0 * math.sqrt(eps)
    near = np.float32(min(bound, 3e38))  # the fp32 nearest the bound and its neighbours
    just = [float(near), float(np.nextafter(near, np.float32(0))), float(np.nextafter(near, np.float32(np.inf)))]
    g = torch.Generator().manual_seed(7)
    specials = [0.0, -0.0, 1e-45, -1e-45, math.inf, -math.inf, math.nan, 3.4e38, -3.4e38, *just, *(-v for v in just)]
    for n in (1, 3, 32, 256, 512):
        check = aten._bounded(n)
        for trial in range(40):
            t = torch.randn(n, generator=g) * bound * (0.5 if trial % 2 else 1.2)
            if trial >= 4:  # one special value at a random place
                i = int(torch.randint(n, (1,), generator=g))
                t[i] = specials[trial % len(specials)]
            expected = bool((t.double().abs() <= bound).all())  # NaN compares False
            assert check(t, eps) is expected, (n, trial, t)
        # one tensor rewritten in place (the same address, read again) and two tensors alternating
        # (another address each call): every answer from the values read now
        past = bound * 2 if bound * 2 < 3.4e38 else math.inf  # past the bound (inf past every finite one)
        t, u = torch.zeros(n), torch.full((n,), past)
        for trial in range(6):
            assert check(t, eps) is (trial % 2 == 0) and check(u, eps) is False
            t.fill_(past if trial % 2 == 0 else 0.0)
    assert aten._bounded(0) is None and aten._bounded(513) is None
    assert aten._bounded(4)(torch.zeros(4), 0.0) is False  # eps <= 0: rstd unbounded, never "within"


def test_functional_call_and_vmap_over_weights_see_the_given_tensors():
    from torch.func import functional_call, vmap

    ln, x = normscope.LayerNorm(8), torch.randn(4, 8)
    ln(x), ln(x)  # the layer's last call holds its own parameters
    given = {"weight": torch.full((8,), 2.0), "bias": torch.full((8,), 1.0)}
    torch.testing.assert_close(functional_call(ln, given, (x,)), nn.functional.layer_norm(x, (8,), **given))
    torch.testing.assert_close(ln(x), _ln_ref(x, ln))  # its own again afterwards
    ws = torch.randn(3, 8)
    ys = vmap(lambda w: functional_call(ln, {"weight": w, "bias": ln.bias}, (x,)))(ws)
    torch.testing.assert_close(ys, torch.stack([nn.functional.layer_norm(x, (8,), w, ln.bias) for w in ws]))


def test_call_of_builds_the_same_call_as_the_constructor():
    # the hot path builds Calls from all fields in order (engine.call_of): a new field must be added there too
    from normscope.engine import Call, call_of

    x = torch.randn(2, 3)
    fields = (x, "scope", None, None, 1e-5, None, None, None, 0.0, False, None, "torch")
    assert len(Call._fields) == len(fields)
    assert call_of(fields) == Call(x, "scope", None, None, 1e-5, None, None)
    assert type(call_of(fields)) is Call
    assert Call._field_defaults == {
        "residual": None,
        "weight_offset": 0.0,
        "residual_fp32": False,
        "op": None,
        "casting": "torch",
    }


def test_the_layer_and_functional_forms_build_one_settings_value():
    """One settings function per op: the layer, the functional form and the Hugging Face patch key
    their calls alike, so the same call planned by one is a plan of the other."""
    from normscope import functional as NF
    from normscope import functional_modern as FM

    op, fields = FM.last_axes(False, [4], None, 1.0, "gemma")
    s = op.settings_type(*fields)  # what the checked call reads
    assert op is FM.RMS_NORM_FAMILY and op.settings_type is FM.FamilySettings
    assert (s.normalized_shape, s.weight_offset, s.offset_type, s.casting) == ((4,), 1.0, float, "gemma")
    op, fields = FM.last_axes(True, 4)
    assert op is FM.LAYER_NORM and op.settings_type(*fields).where == "layer_norm"
    x = torch.randn(3, 23)
    for layer, functional, op in (
        (normscope.LayerNorm(23), lambda m: NF.layer_norm(x, (23,), m.weight, m.bias), FM.LAYER_NORM),
        (normscope.RMSNorm(23, eps=1e-6), lambda m: NF.rms_norm(x, (23,), m.weight, 1e-6), FM.RMS_NORM),
    ):
        before = len(op.plans)
        want = layer(x)
        assert len(op.plans) == before + 1
        assert torch.equal(functional(layer), want)
        assert len(op.plans) == before + 1, f"{op}: the functional form keyed its call apart from the layer's"
    # a Gemma-order layer runs the plain op with its scale w + 1 as weight (see
    # tests/modern/test_family_scale_cache.py); its functional form plans the family op: the bits agree
    gemma = normscope.RMSNorm(23, eps=1e-6, weight_offset=1.0, casting="gemma")
    fam = FM.rms_norm(x, (23,), gemma.weight, 1e-6, weight_offset=1.0, casting="gemma")
    assert torch.equal(gemma(x), fam)
    gn = normscope.GroupNorm(2, 4)
    xg = torch.randn(2, 4, 3)
    assert NF.group_norm_settings(2, 4) == (2, int, 4, None) and NF.GROUP_NORM.settings_type is NF.GroupNormSettings
    torch.testing.assert_close(gn(xg), torch.nn.functional.group_norm(xg, 2, gn.weight, gn.bias))


_TRACE_CAPTURED = """
import torch, normscope
import normscope.functional as NF
torch.set_num_threads(1)
w, x = torch.ones(64, requires_grad=True), torch.randn(8, 64)
ours = {"function": lambda t: NF.layer_norm(t, (64,), w), "layer": normscope.LayerNorm(64),
        "rms": lambda t: NF.rms_norm(t, (64,), w), "group": lambda t: NF.group_norm(t.view(8, 16, 4), 4, w[:16])}
theirs = {"function": lambda t: torch.nn.functional.layer_norm(t, (64,), w), "layer": torch.nn.LayerNorm(64),
          "rms": lambda t: torch.nn.functional.rms_norm(t, (64,), w),
          "group": lambda t: torch.nn.functional.group_norm(t.view(8, 16, 4), 4, w[:16])}
for name, table in (("ours", ours), ("theirs", theirs)):
    f = table[WHAT]
    try:
        torch.jit.trace(f, x)  # a layer is traced as a function here, its parameters captured
        print(name, "traced")
    except RuntimeError as e:
        print(name, "RuntimeError", "requires grad" in str(e))
"""


@pytest.mark.parametrize("what", ["function", "layer", "rms", "group"])
def test_a_torchscript_trace_torch_refuses_raises_torchs_error_and_no_crash(what):
    # torch.jit.trace of a function that captures a tensor requiring grad: the tracer raises from the
    # first read of its size ("Cannot insert a Tensor that requires grad as a constant"), for torch.nn
    # too. The hot path caught that RuntimeError while building its key and carried on into the
    # checked call: the trace then ended in a segfault. In a subprocess, so that a crash fails the test
    code = textwrap.dedent(_TRACE_CAPTURED).replace("WHAT", repr(what))
    path = os.pathsep.join([str(Path(normscope.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert lines["ours"] == lines["theirs"], done.stdout
