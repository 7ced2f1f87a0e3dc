"""A layer changed after its first call is still torch.nn's function on its very next call.

The layers plan their hot path on their first call and reuse the plan (``normscope.hot``); users
change layers after first use all the time -- an attribute written (``eps``, ``momentum``,
``track_running_stats``, ``num_groups``, ``training``), a buffer or parameter replaced or written
through ``.data``, ``load_state_dict`` (``assign=True`` too), a cast of the whole module, a
parametrization, hooks, ``torch.func.functional_call`` with other tensors, a copy changed apart from
its original. Each test warms a normscope layer and its torch.nn twin (the same weights, several
calls in training and in evaluation), makes the same change to both, and compares the next calls
bit for bit with the twin: output, input/weight/bias gradients and every buffer. The oracle is
torch.nn's module (timm's permute-LayerNorm-permute for LayerNorm2d), never normscope's output.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as TF
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.utils import parametrize

import normscope
from conftest import refused_with_state_kept


class _TimmLayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: ``F.layer_norm`` over the channels of a permuted view."""

    def __init__(self, c: int) -> None:
        super().__init__(c, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = TF.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return y.permute(0, 3, 1, 2)


# (id, normscope layer, torch.nn twin, input shape)
TWINS = [
    ("LayerNorm", lambda: normscope.LayerNorm(6), lambda: nn.LayerNorm(6), (4, 3, 6)),
    ("RMSNorm", lambda: normscope.RMSNorm(6), lambda: nn.RMSNorm(6), (4, 3, 6)),
    ("GroupNorm", lambda: normscope.GroupNorm(2, 6), lambda: nn.GroupNorm(2, 6), (4, 6, 5)),
    ("BatchNorm1d", lambda: normscope.BatchNorm1d(6), lambda: nn.BatchNorm1d(6), (4, 6, 5)),
    ("BatchNorm2d", lambda: normscope.BatchNorm2d(6), lambda: nn.BatchNorm2d(6), (4, 6, 3, 3)),
    (
        "BatchNorm3d-cumulative",
        lambda: normscope.BatchNorm3d(6, momentum=None),
        lambda: nn.BatchNorm3d(6, momentum=None),
        (2, 6, 2, 3, 2),
    ),
    ("InstanceNorm1d", lambda: normscope.InstanceNorm1d(6), lambda: nn.InstanceNorm1d(6), (4, 6, 5)),
    (
        "InstanceNorm2d-affine-tracked",
        lambda: normscope.InstanceNorm2d(6, affine=True, track_running_stats=True),
        lambda: nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
        (4, 6, 3, 3),
    ),
    (
        "InstanceNorm3d-tracked-cumulative",
        lambda: normscope.InstanceNorm3d(6, track_running_stats=True, momentum=None),
        lambda: nn.InstanceNorm3d(6, track_running_stats=True, momentum=None),
        (2, 6, 2, 3, 2),
    ),
    ("SyncBatchNorm", lambda: normscope.SyncBatchNorm(6), lambda: nn.SyncBatchNorm(6), (4, 6, 3, 3)),
    ("LayerNorm2d", lambda: normscope.LayerNorm2d(6), lambda: _TimmLayerNorm2d(6), (4, 6, 3, 3)),
]
IDS = [t[0] for t in TWINS]


def _has_tensors(twin) -> bool:
    m = twin[2]()
    return bool(list(m.parameters()) or list(m.buffers()))


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _pair(twin) -> tuple[nn.Module, nn.Module]:
    """The twin's two layers with the same random weights and statistics."""
    _, make_ours, make_theirs, _ = twin
    ours, theirs = make_ours(), make_theirs()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in theirs.state_dict().items():
            if t.is_floating_point():
                r = torch.randn(t.shape, generator=g)
                t.copy_(r.abs() + 0.5 if "var" in name else r)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _assert_same_call(ours: nn.Module, theirs: nn.Module, x: torch.Tensor, what: str) -> None:
    """One call of each on ``x``, then a backward: output, gradients and state bit for bit."""
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    for m in (ours, theirs):
        m.zero_grad(set_to_none=True)
    yo, yt = ours(xo), theirs(xt)
    assert _same(yo, yt), f"{what}: output differs from torch.nn's"
    if yt.requires_grad:
        g = _randn(yt.shape, 7).to(yt.dtype)
        yo.backward(g)
        yt.backward(g)
        assert _same(xo.grad, xt.grad), f"{what}: input gradient differs from torch.nn's"
        po = dict(ours.named_parameters())
        for name, p in theirs.named_parameters():
            assert _same(po[name].grad, p.grad), f"{what}: {name}.grad differs from torch.nn's"
    so, st = ours.state_dict(), theirs.state_dict()
    assert so.keys() == st.keys(), what
    for name, t in st.items():
        assert _same(so[name], t), f"{what}: {name} differs from torch.nn's"


def _warm(ours: nn.Module, theirs: nn.Module, shape: tuple) -> None:
    for i, mode in enumerate((True, False, True)):
        ours.train(mode)
        theirs.train(mode)
        _assert_same_call(ours, theirs, _randn(shape, 100 + i), f"warm-up call {i}")


def _after(ours: nn.Module, theirs: nn.Module, shape: tuple, cast=None, what: str = "") -> None:
    """The first calls after a change, in training then in evaluation."""
    for i, mode in enumerate((True, False)):
        ours.train(mode)
        theirs.train(mode)
        x = _randn(shape, 200 + i)
        _assert_same_call(ours, theirs, x if cast is None else cast(x), f"{what}: call {i} after the change")


# -- attribute writes, tensors replaced, casts, hooks: one change made to both -----------------------


def _has(m: nn.Module, name: str) -> bool:
    return getattr(m, name, None) is not None


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a non-contiguous view (every other element of a larger tensor)."""
    big = torch.zeros(t.shape + (2,), dtype=t.dtype)
    big[..., 0] = t
    return big[..., 0]


def _init(m: nn.Module) -> None:
    with torch.no_grad():
        if isinstance(getattr(m, "weight", None), nn.Parameter):
            m.weight.fill_(0.75)
        if isinstance(getattr(m, "bias", None), nn.Parameter):
            m.bias.fill_(-0.25)


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


# name: (applies to the layer, the change, the input's cast after it)
CHANGES = {
    "eps": (lambda m: True, lambda m: setattr(m, "eps", 0.125), None),
    "momentum": (lambda m: hasattr(m, "momentum"), lambda m: setattr(m, "momentum", 0.5), None),
    "momentum-None": (lambda m: hasattr(m, "momentum"), lambda m: setattr(m, "momentum", None), None),
    "track_running_stats-off": (
        lambda m: hasattr(m, "track_running_stats"),
        lambda m: setattr(m, "track_running_stats", False),
        None,
    ),
    "track_running_stats-on": (  # with buffers to use: torch.nn refuses evaluation without
        lambda m: _has(m, "running_mean"),
        lambda m: setattr(m, "track_running_stats", True),
        None,
    ),
    "num_groups": (lambda m: hasattr(m, "num_groups"), lambda m: setattr(m, "num_groups", 3), None),
    "num_batches_tracked-reset": (
        lambda m: _has(m, "num_batches_tracked"),
        lambda m: m.num_batches_tracked.zero_(),
        None,
    ),
    "weight-None": (lambda m: _has(m, "weight"), lambda m: m.register_parameter("weight", None), None),
    "bias-deleted": (
        lambda m: _has(m, "bias"),
        lambda m: (delattr(m, "bias"), m.register_parameter("bias", None)),
        None,
    ),
    "running_mean-assigned": (
        lambda m: _has(m, "running_mean"),
        lambda m: setattr(m, "running_mean", torch.full_like(m.running_mean, 0.5)),
        None,
    ),
    "running_var-strided": (
        lambda m: _has(m, "running_var"),
        lambda m: setattr(m, "running_var", _strided(m.running_var + 1)),
        None,
    ),
    "weight-parameter-strided": (
        lambda m: _has(m, "weight"),
        lambda m: setattr(m, "weight", nn.Parameter(_strided(m.weight.detach() * 2))),
        None,
    ),
    "weight.data-assigned": (
        lambda m: _has(m, "weight"),
        lambda m: setattr(m.weight, "data", m.weight.data * 3),
        None,
    ),
    "running_var.data-written": (lambda m: _has(m, "running_var"), lambda m: m.running_var.data.mul_(4), None),
    "double": (lambda m: True, lambda m: m.double(), lambda x: x.double()),
    "bfloat16": (lambda m: True, lambda m: m.to(torch.bfloat16), lambda x: x.bfloat16()),
    "input-double": (
        lambda m: not _has(m, "weight") and not _has(m, "running_mean"),
        lambda m: None,
        torch.Tensor.double,
    ),
    "requires_grad-off": (lambda m: _has(m, "weight"), lambda m: m.weight.requires_grad_(False), None),
    "parametrized-weight": (
        lambda m: _has(m, "weight"),
        lambda m: parametrize.register_parametrization(m, "weight", _Doubled()),
        None,
    ),
    "forward-pre-hook": (lambda m: True, lambda m: m.register_forward_pre_hook(lambda _, a: (a[0] * 2 + 1,)), None),
    "apply-init": (lambda m: True, lambda m: m.apply(_init), None),
    "reset_parameters": (lambda m: True, lambda m: m.reset_parameters(), None),
}


#: torch.nn's own failures, where no twin is an oracle: GroupNorm without a weight but with a bias
#: raises "tensor does not have a device" in torch's CPU backward (normscope's passes gradcheck)
_TORCH_FAILS = {("GroupNorm", "weight-None")}
CASES = [
    pytest.param(twin, change, id=f"{twin[0]}-{change}")
    for twin in TWINS
    for change, (applies, _, _) in CHANGES.items()
    if applies(twin[2]()) and (twin[0], change) not in _TORCH_FAILS
]


@pytest.mark.parametrize(("twin", "change"), CASES)
def test_change_reaches_the_next_call(twin, change):
    _, fn, cast = CHANGES[change]
    ours, theirs = _pair(twin)
    _warm(ours, theirs, twin[3])
    fn(ours)
    fn(theirs)
    _after(ours, theirs, twin[3], cast, change)


# -- load_state_dict both ways, assign=True --------------------------------------------------------------


@pytest.mark.parametrize("assign", [False, True], ids=["copied", "assigned"])
@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_load_state_dict_from_the_twin(twin, assign):
    ours, theirs = _pair(twin)
    _warm(ours, theirs, twin[3])
    # each loads the other's state, changed: ours torch.nn's, torch.nn's ours
    from_theirs = {k: v * 1.5 if v.is_floating_point() else v + 3 for k, v in theirs.state_dict().items()}
    from_ours = {k: v * 1.5 if v.is_floating_point() else v + 3 for k, v in ours.state_dict().items()}
    ours.load_state_dict(from_theirs, assign=assign)
    theirs.load_state_dict(from_ours, assign=assign)
    _after(ours, theirs, twin[3], what=f"load_state_dict(assign={assign})")


@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_load_state_dict_assign_double(twin):
    ours, theirs = _pair(twin)
    _warm(ours, theirs, twin[3])
    state = {k: v.double() if v.is_floating_point() else v for k, v in theirs.state_dict().items()}
    ours.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    theirs.load_state_dict(state, assign=True)
    _after(ours, theirs, twin[3], torch.Tensor.double, "load_state_dict(float64, assign=True)")


# -- torch.func: swapped tensors, ensembles ---------------------------------------------------------------


def _swapped(m: nn.Module, how: str) -> dict[str, torch.Tensor]:
    out, params = {}, dict(m.named_parameters())
    for name, t in {**params, **dict(m.named_buffers())}.items():
        t = t.detach().clone()
        if t.is_floating_point():
            t = {
                "scaled": lambda t: t * 1.5,
                "double": torch.Tensor.double,
                "strided": _strided,
                "frozen": lambda t: t,
                "grad": lambda t, p=name in params: t.requires_grad_(p),  # torch refuses buffers that need grad
            }[how](t)
        out[name] = t
    return out


@pytest.mark.parametrize("how", ["scaled", "double", "strided", "frozen", "grad"])
@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_functional_call_with_swapped_tensors(twin, how):
    ours, theirs = _pair(twin)
    _warm(ours, theirs, twin[3])
    for i, mode in enumerate((True, False)):
        ours.train(mode)
        theirs.train(mode)
        so, st = _swapped(theirs, how), _swapped(theirs, how)
        x = _randn(twin[3], 300 + i)
        x = x.double() if how == "double" else x
        yo, yt = functional_call(ours, so, (x,)), functional_call(theirs, st, (x,))
        assert _same(yo, yt), f"functional_call({how}), training={mode}: output differs from torch.nn's"
        for name, t in st.items():
            assert _same(so[name].detach(), t.detach()), f"functional_call({how}): the swapped {name} differs"
        # and the layer's own tensors are back for its next call
        _assert_same_call(ours, theirs, _randn(twin[3], 310 + i), f"after functional_call({how})")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("twin", [t for t in TWINS if _has_tensors(t)], ids=lambda t: t[0])
def test_vmap_ensemble(twin, training):
    pairs = []
    for i in range(3):
        ours, theirs = _pair(twin)
        _warm(ours, theirs, twin[3])  # a plan of the same signature exists before the ensemble runs
        with torch.no_grad():
            for m in (ours, theirs):
                for t in m.parameters():
                    t.add_(i)
        pairs.append((ours.train(training), theirs.train(training)))
    x = _randn(twin[3], 400)

    def ensemble(side: int):
        params, buffers = stack_module_state([p[side] for p in pairs])
        base = copy.deepcopy(pairs[0][side]).to("meta")
        y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
        return y, buffers

    if training and twin[0] == "BatchNorm3d-cumulative":
        # momentum=None reads the batch count as a Python number, which vmap refuses: in torch.nn too
        for side in (0, 1):
            with pytest.raises(RuntimeError, match="item"):
                ensemble(side)
        return
    (yo, bo), (yt, bt) = ensemble(0), ensemble(1)
    assert _same(yo, yt), "vmap ensemble: output differs from torch.nn's"
    for name, t in bt.items():
        assert _same(bo[name], t), f"vmap ensemble: stacked {name} differs from torch.nn's"


# -- built on meta, copies, shared weights, alternating inputs --------------------------------------------


@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_meta_to_empty_reset_parameters(twin):
    _, make_ours, make_theirs, shape = twin
    with torch.device("meta"):
        ours, theirs = make_ours(), make_theirs()
    for m in (ours, theirs):
        m.to_empty(device="cpu")
        m.reset_parameters()
    _warm(ours, theirs, shape)
    _after(ours, theirs, shape, what="built on meta")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_changed_copy_leaves_its_original(twin, how):
    ours, theirs = _pair(twin)
    _warm(ours, theirs, twin[3])
    dup = copy.deepcopy if how == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))
    co, ct = dup(ours), dup(theirs)
    for m in (co, ct):
        m.eps = 0.25
        with torch.no_grad():
            for t in m.state_dict().values():
                t.add_(2)
    _after(co, ct, twin[3], what=f"the {how}")
    _after(ours, theirs, twin[3], what=f"the original of a changed {how}")


@pytest.mark.parametrize("twin", [t for t in TWINS if _has(t[2](), "weight")], ids=lambda t: t[0])
def test_two_layers_share_one_weight(twin):
    (o1, t1), (o2, t2) = _pair(twin), _pair(twin)
    o2.weight, t2.weight = o1.weight, t1.weight
    shape = twin[3]
    for i, mode in enumerate((True, False, True)):
        for m in (o1, o2, t1, t2):
            m.train(mode)
        x = _randn(shape, 500 + i)
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = o2(o1(xo)), t2(t1(xt))
        assert _same(yo, yt), f"shared weight, call {i}: output differs from torch.nn's"
        yo.sum().backward()
        yt.sum().backward()
        assert _same(xo.grad, xt.grad) and _same(o1.weight.grad, t1.weight.grad), f"shared weight, call {i}: gradients"
        with torch.no_grad():
            o1.weight.mul_(1.25)
            t1.weight.mul_(1.25)
        o1.weight.grad = t1.weight.grad = None


@pytest.mark.parametrize("twin", TWINS, ids=IDS)
def test_one_layer_alternating_inputs(twin):
    ours, theirs = _pair(twin)
    shape = twin[3]
    x = _randn(shape, 600)
    longer = list(shape)
    longer[1 if twin[0].startswith(("LayerNorm-", "RMSNorm")) or twin[0] == "LayerNorm" else -1] += 2
    inputs = [x, x.double(), x.bfloat16(), _randn((shape[0] + 1, *shape[1:]), 601), _randn(longer, 602)]
    inputs.append(_randn((2 * shape[0], *shape[1:]), 603)[::2])  # strided
    if len(shape) == 4:
        inputs.append(x.to(memory_format=torch.channels_last))
    for round_ in range(2):
        for mode in (True, False):
            ours.train(mode)
            theirs.train(mode)
            for i, xi in enumerate(inputs):
                if xi.dtype != torch.float32 and (_has(theirs, "weight") or _has(theirs, "running_mean")):
                    continue  # torch.nn refuses a float32 layer's parameters with another input dtype
                _assert_same_call(ours, theirs, xi, f"round {round_}, training={mode}, input {i}")


# -- hostile changes: the first call after them is refused by name, before any state moves ----------------


def _data(name: str, value):
    def mutate(m: nn.Module) -> None:
        getattr(m, name).data = value

    return mutate


def _buffer(name: str, value):
    def mutate(m: nn.Module) -> None:
        setattr(m, name, value)

    return mutate


# (what, applies, mutate, exception, fragments of its message)
HOSTILE = [
    ("weight.data-shape", "weight", _data("weight", torch.ones(5)), ValueError, ["`weight`", "(5,)"]),
    ("bias.data-shape", "bias", _data("bias", torch.ones(7)), ValueError, ["`bias`", "(7,)"]),
    ("running_mean-shape", "running_mean", _buffer("running_mean", torch.zeros(5)), ValueError, ["`running_mean`"]),
    ("running_var-shape", "running_var", _buffer("running_var", torch.ones(2, 3)), ValueError, ["`running_var`"]),
    (
        "weight-meta",
        "weight",
        lambda m: setattr(m, "weight", nn.Parameter(torch.ones(6, device="meta"))),
        ValueError,
        ["`weight`", "meta"],
    ),
    (
        "weight-int",
        "weight",
        lambda m: m._parameters.update(weight=torch.ones(6, dtype=torch.int32)),
        TypeError,
        ["`weight`", "int32"],
    ),
    (
        "running_mean-int",
        "running_mean",
        _buffer("running_mean", torch.zeros(6, dtype=torch.int32)),
        TypeError,
        ["`running_mean`", "int32"],
    ),
]
HOSTILE_CASES = [
    pytest.param(twin, *case, id=f"{twin[0]}-{case[0]}")
    for twin in TWINS
    for case in HOSTILE
    if _has(twin[2](), case[1])
    # RMSNorm takes an integer weight as torch.nn's does (promoted), InstanceNorm integer running statistics
    # as torch.nn's does (its update truncated into them): the same outputs, as the tests above check
    and not (twin[0].startswith("RMSNorm") and case[0] == "weight-int")
    and not (twin[0].startswith("InstanceNorm") and case[0] == "running_mean-int")
]


class TestHostile:
    """A tensor replaced after the layer's first call -- another shape, device, dtype or layout -- is
    refused with an error naming it on the very next call (torch.nn's twin raises a RuntimeError from
    inside its kernel, or none), and the refused call moves no state."""

    @pytest.mark.parametrize(("twin", "what", "name", "mutate", "exc", "fragments"), HOSTILE_CASES)
    def test_replaced_tensor_refused_on_the_next_call(self, twin, what, name, mutate, exc, fragments):
        ours, theirs = _pair(twin)
        _warm(ours, theirs, twin[3])
        for mode in (True, False):
            m = copy.deepcopy(ours).train(mode)
            refused_with_state_kept(m, mutate, _randn(twin[3], 700), exc, fragments)

    @pytest.mark.parametrize("twin", [t for t in TWINS if _has(t[2](), "running_mean")], ids=lambda t: t[0])
    @pytest.mark.parametrize("name", ["running_mean", "running_var"])
    def test_expanded_running_statistic_refused_where_updated_and_read_in_evaluation(self, twin, name):
        """A running statistic replaced by an expanded tensor (its channels sharing one element) after
        planned calls: training, which updates it in place, is refused naming it -- torch.nn's BatchNorm
        writes every channel's update into the one element, the last winning, and its InstanceNorm raises
        from inside -- while evaluation only reads it: torch.nn's twin's bits on the same buffer."""
        ours, theirs = _pair(twin)
        _warm(ours, theirs, twin[3])
        value = getattr(theirs, name)[:1].clone().expand(6)
        x = _randn(twin[3], 701)
        trained = copy.deepcopy(ours).train(True)
        refused_with_state_kept(trained, _buffer(name, value), x, ValueError, [f"`{name}`", "share memory", "(0,)"])
        ours.eval()
        theirs.eval()
        setattr(ours, name, value)
        setattr(theirs, name, value)
        _assert_same_call(ours, theirs, x, f"evaluation on an expanded {name}")
