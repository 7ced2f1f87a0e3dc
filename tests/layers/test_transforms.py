"""The beyond-torch layers under PyTorch's transforms: torch.compile(fullgraph=True) without graph
breaks or normscope warnings (and the same numbers and state as eager), torch.export, meta
tensors, torch.func.vmap/grad.

Training-mode BatchRenorm/PowerNorm update their buffers in place, which torch.func does not
allow for captured buffers -- torch's own BatchNorm fails the same way in training (functorch's
``replace_all_batch_norm_modules_``) -- so they are transformed in evaluation mode, where their
forward is a pure function; training mode is covered by compile/export/meta.

The torch.nn-equivalent and masked layers too: torch.func.vmap / jacrev, masked BatchNorm under
grad and vmap, meta tensors, torch.jit.trace (and torch.jit.script refused as documented), masked
layers compiled fullgraph in training."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as TF
from torch.func import functional_call, grad, vmap

import normscope
import normscope.functional as nf


def _cases():
    return {
        "BatchRenorm2d": (lambda: normscope.BatchRenorm2d(4, warmup_iters=2), [(3, 4, 5, 5)]),
        "BatchRenorm1d_last": (lambda: normscope.BatchRenorm1d(4, channel_dim=-1), [(3, 5, 4)]),
        "PowerNorm": (lambda: normscope.PowerNorm(4, warmup_iters=2), [(3, 5, 4)]),
        "FrozenBatchNorm2d": (lambda: normscope.FrozenBatchNorm2d(4), [(3, 4, 5, 5)]),
        "AdaIN": (lambda: normscope.AdaIN(), [(3, 4, 5, 5), (3, 4, 6, 6)]),
        "DyT": (lambda: normscope.DyT(4), [(3, 5, 4)]),
        "LayerNorm2d": (lambda: normscope.LayerNorm2d(4), [(3, 4, 5, 5)]),
    }


def _layer(name):
    make, shapes = _cases()[name]
    torch.manual_seed(0)
    m = make()
    with torch.no_grad():  # non-trivial state and affine, so a wrong buffer read shows
        for b in m.buffers():
            if b.is_floating_point():
                b.uniform_(0.5, 1.5)
        for p in m.parameters():
            p.uniform_(0.5, 1.5)
    return m, [torch.randn(s, dtype=torch.float32) for s in shapes]


NAMES = list(_cases())


def _ours(ws):
    """Warnings raised from normscope's code or about it (lru_cache, graph breaks), not torch's own
    deprecations."""
    return [
        str(w.message)
        for w in ws
        if "normscope" in str(w.filename)
        or "normscope" in str(w.message)
        or "lru_cache" in str(w.message)
        or "Graph break" in str(w.message)
    ]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_matches_eager(name, training):
    """fullgraph=True fails on any graph break (a Python int read off a buffer is one), and a cache
    wrapper that dynamo cannot trace warns on every compile: both show here."""
    torch._dynamo.reset()
    m, args = _layer(name)
    m.train(training)
    eager, compiled = copy.deepcopy(m), copy.deepcopy(m)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(3):  # warm-up counters move: every step must match
            xs_e = [a.clone().requires_grad_() for a in args]
            xs_c = [a.clone().requires_grad_() for a in args]
            ye, yc = eager(*xs_e), fn(*xs_c)
            dy = torch.randn_like(ye)
            (ye * dy).sum().backward()
            (yc * dy).sum().backward()
            torch.testing.assert_close(yc, ye)
            for a, b in zip(xs_c, xs_e):
                torch.testing.assert_close(a.grad, b.grad)
    assert not _ours(ws), _ours(ws)
    for (n, a), (_, b) in zip(compiled.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(a, b, msg=n)
    for (n, a), (_, b) in zip(compiled.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_export_matches_eager(name, training):
    m, args = _layer(name)
    m.train(training)
    eager = copy.deepcopy(m)
    ep = torch.export.export(copy.deepcopy(m).train(training), tuple(args))
    torch.testing.assert_close(ep.module()(*args), eager(*args))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_meta_tensors(name, training):
    """BatchRenorm and PowerNorm read their step counter with int(), which a meta tensor refuses."""
    m, args = _layer(name)
    m = copy.deepcopy(m).train(training).to("meta")
    y = m(*[a.to("meta") for a in args])
    assert y.device.type == "meta" and y.shape == args[0].shape


_FUNC = ["BatchRenorm2d", "BatchRenorm1d_last", "PowerNorm", "FrozenBatchNorm2d", "AdaIN", "DyT"]


@pytest.mark.parametrize("name", _FUNC)
def test_vmap_equals_loop(name):
    m, args = _layer(name)
    m.eval()
    stacked = [torch.stack([a, 2 * a + 1]) for a in args]
    got = vmap(m)(*stacked)
    want = torch.stack([m(*[s[i] for s in stacked]) for i in range(2)])
    torch.testing.assert_close(got, want)


def test_vmap_layernorm2d():
    # the engine's fp32 numerics check (an .item()) is skipped inside torch.func transforms
    m, args = _layer("LayerNorm2d")
    x = torch.stack([args[0], args[0] * 2 + 1])
    torch.testing.assert_close(vmap(m)(x), torch.stack([m(t) for t in x]))


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("AdaIN", "FrozenBatchNorm2d")])
def test_func_grad_equals_autograd(name):
    m, args = _layer(name)
    m.eval()  # training updates buffers in place: not a function (as torch's BatchNorm)
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = grad(lambda p: functional_call(m, p, tuple(args)).square().sum())(params)
    m.zero_grad()
    m(*args).square().sum().backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, msg=k)


def _ctor_args(layer):
    if isinstance(layer, torch.nn.GroupNorm):
        return (layer.num_groups, layer.num_channels)
    if isinstance(layer, torch.nn.LayerNorm):
        return (layer.normalized_shape,)
    if isinstance(layer, torch.nn.modules.instancenorm._InstanceNorm):
        return (layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    return (layer.num_features,)


# ---------------------------------------------------------------------------------------------
# torch.func transforms and meta tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda: normscope.LayerNorm(5),
        lambda: normscope.GroupNorm(2, 4),
        lambda: normscope.InstanceNorm1d(4, affine=True),
        lambda: normscope.BatchNorm1d(4).eval(),
        lambda: normscope.BatchNorm1d(4, track_running_stats=False),
        lambda: normscope.RMSNorm(5),
    ],
)
def test_vmap_and_jacrev_match_torch(make):
    layer = make()
    torch_layer = getattr(torch.nn, type(layer).__name__)(*_ctor_args_any(layer))
    torch_layer.load_state_dict(layer.state_dict())
    torch_layer.train(layer.training)
    x = torch.randn(3, 2, 4, 5)
    torch.testing.assert_close(torch.func.vmap(layer)(x), torch.func.vmap(torch_layer)(x))
    jac = torch.func.jacrev(lambda t: layer(t).square().sum())(x[0])
    jac_t = torch.func.jacrev(lambda t: torch_layer(t).square().sum())(x[0])
    torch.testing.assert_close(jac, jac_t, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls, shape", [("BatchNorm2d", (3, 2, 4, 4, 4)), ("BatchNorm3d", (2, 2, 4, 3, 3, 3))])
def test_vmap_over_a_non_batch_axis_matches_torch(cls, shape, training):
    # vmap over axis 1 hands the layer a batched tensor that is not contiguous, whose layout in
    # another memory format functorch cannot ask ("NYI: querying is_contiguous inside of vmap"):
    # BatchNorm2d/3d's layout fix asked it, and raised where torch.nn's layer runs
    layer = getattr(normscope, cls)(4, track_running_stats=False).train(training)
    torch_layer = getattr(torch.nn, cls)(4, track_running_stats=False).train(training)
    with torch.no_grad():
        torch_layer.weight.uniform_(0.5, 1.5)
        torch_layer.bias.uniform_(-0.5, 0.5)
    layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(shape)
    got, want = vmap(layer, in_dims=1)(x), vmap(torch_layer, in_dims=1)(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "cls, args, shape",
    [
        ("LayerNorm", (16,), (4, 8, 16)),
        ("GroupNorm", (2, 8), (2, 8, 5, 5)),
        ("BatchNorm2d", (8,), (3, 8, 4, 4)),
        ("InstanceNorm2d", (8,), (3, 8, 4, 4)),
    ],
)
def test_fake_tensor_mode_after_an_eager_call_matches_torch(cls, args, shape):
    # the fp32 CPU plan's cancellation check read the statistics' values, which a FakeTensor has not
    # (DataDependentOutputException) -- torch.nn's layer gives the fake output. The plan is made by
    # a real call first: a FakeTensor's device is the CPU, so the fake call finds it
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer, torch_layer = getattr(normscope, cls)(*args), getattr(torch.nn, cls)(*args)
    x = torch.randn(shape)
    assert torch.equal(layer(x), torch_layer(x))
    with FakeTensorMode(allow_non_fake_inputs=True):
        xf = torch.randn(shape)
        got, want = layer(xf), torch_layer(xf)
        assert (type(got), got.shape, got.dtype, got.stride()) == (type(want), want.shape, want.dtype, want.stride())


def _ctor_args_any(layer):
    if isinstance(layer, torch.nn.RMSNorm):
        return (layer.normalized_shape,)
    if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
        return (layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    return _ctor_args(layer)


def test_masked_batch_norm_under_torch_func_grad_and_vmap():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 5, generator=g) > 0.3
    mask[0, 0] = True

    def f(t):
        return nf.batch_norm(t, None, None, training=True, mask=mask).square().mul(torch.arange(5.0)).sum()

    f(x)  # an eager call first: its plan (the composite backend) is cached for this signature ...
    assert normscope.last_backend() == "composite"
    got = torch.func.grad(f)(x)  # ... and must still run inside the transform
    assert normscope.last_backend() == "reference"
    xr = x.clone().requires_grad_()
    with normscope.use_backend("reference"):
        (want,) = torch.autograd.grad(f(xr), xr)
    torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda t: normscope.normalize(t, keep=0, mask=mask[0][None]))(x)
    with normscope.use_backend("reference"):
        want = torch.stack([normscope.normalize(t, keep=0, mask=mask[0][None]) for t in x])
    torch.testing.assert_close(batched, want)


def test_meta_tensors_run_masked_batch_norm_and_layers():
    xm = torch.randn(2, 4, 5, device="meta")
    mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    assert nf.batch_norm(xm, None, None, training=True, mask=mask).shape == (2, 4, 5)
    for layer in (normscope.BatchNorm1d(4), normscope.GroupNorm(2, 4), normscope.LayerNorm(5)):
        assert layer.to("meta")(xm).shape == (2, 4, 5)


def test_torchscript_trace_works_and_script_is_refused_as_documented():
    m = normscope.LayerNorm(5)
    x = torch.randn(2, 5)
    with torch.no_grad():
        traced = torch.jit.trace(m, (x,), check_trace=False)
    torch.testing.assert_close(traced(x * 3 + 1), TF.layer_norm(x * 3 + 1, (5,), m.weight, m.bias))
    with pytest.raises(TypeError, match=r"torch\.compile.*torch\.export"):
        torch.jit.script(m)


@pytest.mark.parametrize("name", ["PowerNorm", "BatchRenorm1d", "BatchNorm1d"])
def test_masked_layers_compile_fullgraph_in_training(name):
    import copy

    g = torch.Generator().manual_seed(3)
    if name == "PowerNorm":
        eager, x, mask = normscope.PowerNorm(4), torch.randn(3, 5, 4, generator=g), torch.rand(3, 5, generator=g) > 0.3
    else:
        eager = getattr(normscope, name)(4)
        x, mask = torch.randn(3, 4, 5, generator=g), torch.rand(3, 5, generator=g) > 0.3
    mask[0, 0] = True
    mod = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")  # a graph break raises
    for _ in range(2):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe, mask=mask), compiled(xc, mask=mask)
        torch.testing.assert_close(yc, ye)
        ye.square().sum().backward()
        yc.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)
    for (k, be), (_, bc) in zip(eager.named_buffers(), mod.named_buffers()):
        torch.testing.assert_close(bc, be, msg=k)
    with pytest.raises(ValueError, match="at least one valid"):  # eager still refuses an all-False mask
        eager(x, mask=torch.zeros_like(mask))


# ---------------------------------------------------------------------------------------------
# torch.compile after eager training calls: the layers that keep state between calls


def _stateful():
    """Every layer whose calls leave state for the next: running statistics and their batch count
    (a momentum=None factor is read from it), a warm-up step, PowerNorm's backward state, BatchRenorm's
    corrections kept for checkpointed recomputation, SyncBatchNorm on one process (no group: BatchNorm's
    path). ``(make, input shape, mask shape or None)``. Not BatchNorm with momentum=None: its factor
    ``1 / count`` is read off the count as a Python float, which fullgraph refuses, fresh or not, as it
    refuses torch.nn.BatchNorm's (a data-dependent guard)."""
    return {
        "BatchNorm1d": (lambda: normscope.BatchNorm1d(4), (6, 4), None),
        "BatchNorm1d_masked": (lambda: normscope.BatchNorm1d(4), (3, 4, 5), (3, 5)),
        "BatchNorm2d": (lambda: normscope.BatchNorm2d(4), (3, 4, 5, 5), None),
        "BatchNorm3d": (lambda: normscope.BatchNorm3d(4), (2, 4, 3, 3, 3), None),
        "BatchRenorm1d": (lambda: normscope.BatchRenorm1d(4), (6, 4), None),
        "BatchRenorm1d_last_masked": (lambda: normscope.BatchRenorm1d(4, channel_dim=-1), (3, 5, 4), (3, 5)),
        "BatchRenorm2d_warmup": (lambda: normscope.BatchRenorm2d(4, warmup_iters=5), (3, 4, 5, 5), None),
        "BatchRenorm3d": (lambda: normscope.BatchRenorm3d(4, momentum=None), (2, 4, 3, 3, 3), None),
        "PowerNorm": (lambda: normscope.PowerNorm(4, warmup_iters=5), (3, 5, 4), None),
        "PowerNorm_masked": (lambda: normscope.PowerNorm(4), (3, 5, 4), (3, 5)),
        "InstanceNorm1d_tracked": (
            lambda: normscope.InstanceNorm1d(4, affine=True, track_running_stats=True),
            (3, 4, 5),
            None,
        ),
        "InstanceNorm2d_tracked": (lambda: normscope.InstanceNorm2d(4, track_running_stats=True), (3, 4, 5, 5), None),
        "InstanceNorm3d_tracked": (
            lambda: normscope.InstanceNorm3d(4, affine=True, track_running_stats=True, momentum=None),
            (2, 4, 3, 3, 3),
            None,
        ),
        "SyncBatchNorm_one_process": (lambda: normscope.SyncBatchNorm(4), (3, 4, 5, 5), None),
    }


@pytest.mark.parametrize("name", list(_stateful()))
def test_compile_fullgraph_after_eager_training_calls_matches_eager(name):
    """A layer trained eagerly for a few steps, then compiled (fullgraph, aot_eager): what its eager calls
    left behind -- BatchRenorm's corrections kept for checkpointed recomputation, once read through an
    untraceable ``_current_graph_task_id`` -- must neither break the trace nor change the numbers. The
    compile tests above start from fresh layers. Checked against a copy of the layer that goes on eagerly:
    outputs, the input's and parameters' gradients, and the state after each step."""
    make, shape, mask_shape = _stateful()[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = make()
    g = torch.Generator().manual_seed(5)

    def batch():
        x = torch.randn(shape, generator=g) * 2 + 0.5
        if mask_shape is None:
            return x, {}
        mask = torch.rand(mask_shape, generator=g) > 0.3
        mask.view(-1)[0] = True
        return x, {"mask": mask}

    for _ in range(3):  # eager training steps, forward and backward
        x, kw = batch()
        layer(x.requires_grad_(), **kw).square().sum().backward()
    layer.zero_grad(set_to_none=True)
    eager = copy.deepcopy(layer)  # what the eager steps left, on both sides
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # a graph break raises
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for step in range(2):
            x, kw = batch()
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            ye, yc = eager(xe, **kw), compiled(xc, **kw)
            torch.testing.assert_close(yc, ye, msg=lambda m, s=step: f"step {s}: {m}")
            dy = torch.randn(ye.shape, generator=g)
            (ye * dy).sum().backward()
            (yc * dy).sum().backward()
            torch.testing.assert_close(xc.grad, xe.grad, msg=lambda m, s=step: f"step {s}, input grad: {m}")
            for (k, be), (_, bc) in zip(eager.named_buffers(), layer.named_buffers()):
                torch.testing.assert_close(bc, be, msg=lambda m, k=k, s=step: f"step {s}, {k}: {m}")
    assert not _ours(ws), _ours(ws)
    for (k, pe), (_, pc) in zip(eager.named_parameters(), layer.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, msg=lambda m, k=k: f"{k}.grad: {m}")
