"""Checkpoints move both ways between torch.nn and normscope; layers deepcopy, pickle, save and
load whole; repr and isinstance are torch's.
The layers beyond torch.nn round-trip through state_dict and pickle."""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

import normscope

# (class name, ctor args, ctor kwargs, input shape)
LAYERS = [
    ("BatchNorm1d", (5,), {}, (4, 5, 3)),
    ("BatchNorm2d", (3,), {"momentum": None, "eps": 1e-3}, (2, 3, 4, 5)),
    ("BatchNorm3d", (2,), {"affine": False}, (2, 2, 3, 2, 2)),
    ("BatchNorm2d", (3,), {"track_running_stats": False}, (2, 3, 4, 5)),
    ("LayerNorm", ((4, 5),), {}, (2, 4, 5)),
    ("LayerNorm", (5,), {"bias": False, "eps": 1e-6}, (2, 4, 5)),
    ("LayerNorm", (5,), {"elementwise_affine": False}, (2, 4, 5)),
    ("RMSNorm", (5,), {}, (2, 4, 5)),
    ("RMSNorm", ((4, 5),), {"eps": 1e-6, "elementwise_affine": False}, (2, 4, 5)),
    ("GroupNorm", (2, 6), {}, (2, 6, 5)),
    ("GroupNorm", (3, 6), {"affine": False, "eps": 1e-3}, (2, 6, 5)),
    ("InstanceNorm1d", (3,), {}, (2, 3, 7)),
    ("InstanceNorm2d", (3,), {"affine": True, "track_running_stats": True}, (2, 3, 4, 5)),
    ("InstanceNorm3d", (2,), {"affine": True}, (2, 2, 3, 4, 2)),
    ("LocalResponseNorm", (3,), {"alpha": 1e-3, "beta": 0.5, "k": 2.0}, (2, 5, 7)),
]


IDS = [f"{c[0]}-{i}" for i, c in enumerate(LAYERS)]


def _randomize(mod, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for name, b in mod.named_buffers():
            if name == "num_batches_tracked":
                b.fill_(7)
            elif b is not None:
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return mod


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert getattr(sa, "_metadata", None) == getattr(sb, "_metadata", None)


@pytest.mark.parametrize("name,args,kwargs,shape", LAYERS, ids=IDS)
def test_checkpoint_round_trip_torch_normscope_torch(name, args, kwargs, shape):
    t = _randomize(getattr(torch.nn, name)(*args, **kwargs))
    n = getattr(normscope, name)(*args, **kwargs)
    n.load_state_dict(t.state_dict(), strict=True)
    _same_state(t, n)
    back = getattr(torch.nn, name)(*args, **kwargs)
    back.load_state_dict(n.state_dict(), strict=True)
    _same_state(t, back)
    x = torch.randn(shape)
    t.eval(), n.eval()
    torch.testing.assert_close(n(x), t(x))


@pytest.mark.parametrize("name,args,kwargs,shape", LAYERS, ids=IDS)
def test_repr_and_isinstance_are_torchs(name, args, kwargs, shape):
    t = getattr(torch.nn, name)(*args, **kwargs)
    n = getattr(normscope, name)(*args, **kwargs)
    assert repr(n) == repr(t)
    assert isinstance(n, getattr(torch.nn, name))
    assert type(n) is not type(t)


def test_isinstance_layernorm():
    assert isinstance(normscope.LayerNorm(4), torch.nn.LayerNorm)
    assert isinstance(normscope.BatchNorm2d(4), torch.nn.modules.batchnorm._BatchNorm)
    assert isinstance(normscope.InstanceNorm2d(4), torch.nn.modules.instancenorm._InstanceNorm)


@pytest.mark.parametrize("cls", ["BatchNorm1d", "BatchNorm2d"])
def test_version1_batchnorm_checkpoint_without_num_batches_tracked_loads_as_in_torch(cls):
    """Checkpoints from torch < 0.4.1 (metadata version 1) have no num_batches_tracked."""
    t = _randomize(getattr(torch.nn, cls)(3))
    v1 = OrderedDict((k, v) for k, v in t.state_dict().items() if k != "num_batches_tracked")
    v1._metadata = OrderedDict({"": {"version": 1}})
    n = getattr(normscope, cls)(3)
    ref = getattr(torch.nn, cls)(3)
    with torch.no_grad():
        n.num_batches_tracked.fill_(5)
        ref.num_batches_tracked.fill_(5)
    n.load_state_dict(v1, strict=True)
    ref.load_state_dict(v1, strict=True)
    # torch's upgrade path keeps the layer's own counter for the missing entry; ours is torch's
    assert int(n.num_batches_tracked) == int(ref.num_batches_tracked) == 5
    torch.testing.assert_close(n.running_mean, t.running_mean)
    torch.testing.assert_close(n.running_var, t.running_var)
    # the same checkpoint without the version marker is rejected in strict mode, as by torch
    fresh = OrderedDict(v1)
    fresh._metadata = OrderedDict({"": {"version": 2}})
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        getattr(normscope, cls)(3).load_state_dict(fresh, strict=True)


def _roundtrips():
    def deepcopy(m):
        return copy.deepcopy(m)

    def pickled(m):
        return pickle.loads(pickle.dumps(m))

    def torch_save(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    return [deepcopy, pickled, torch_save]


@pytest.mark.parametrize("how", _roundtrips(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,args,kwargs,shape", LAYERS, ids=IDS)
def test_whole_module_roundtrip(name, args, kwargs, shape, how):
    n = _randomize(getattr(normscope, name)(*args, **kwargs))
    m = how(n)
    assert type(m) is type(n)
    assert repr(m) == repr(n)
    _same_state(n, m)
    x = torch.randn(shape)
    # train step on both: same output and same buffer updates (forward survived the round trip)
    torch.testing.assert_close(m(x), n(x))
    _same_state(n, m)
    n.eval(), m.eval()
    torch.testing.assert_close(m(x), n(x))


def test_model_with_normscope_layers_state_dict_loads_into_torch_model():
    def build(lib):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 6, 3), lib.BatchNorm2d(6), lib.GroupNorm(3, 6), torch.nn.Flatten(2), lib.LayerNorm(16)
        )

    t = build(torch.nn)
    for m in t.modules():
        if m is not t:
            _randomize(m)
    n = build(normscope)
    n.load_state_dict(t.state_dict(), strict=True)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(n(x), t(x))
    t.load_state_dict(n.state_dict(), strict=True)
    torch.testing.assert_close(n(x), t(x))


def test_state_dict_and_pickle_round_trips():
    import pickle

    brn = normscope.BatchRenorm2d(3)
    brn(torch.randn(4, 3, 2, 2))
    bn = nn.BatchNorm2d(3)
    bn.load_state_dict(brn.state_dict())  # a BatchRenorm checkpoint is a BatchNorm checkpoint
    assert torch.equal(bn.running_var, brn.running_var)
    for m in (normscope.BatchNorm1d(3, channel_dim=-1), brn, normscope.PowerNorm(3), normscope.LayerNorm2d(3),
              normscope.FrozenBatchNorm2d(3), normscope.DyT(3), normscope.AdaIN()):
        m2 = pickle.loads(pickle.dumps(m))
        assert repr(m2) == repr(m)
        for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items()):
            assert k == k2 and torch.equal(v, v2)
    pn = normscope.PowerNorm(3)
    assert set(pn.state_dict()) == {"weight", "bias", "running_phi", "ema_gz", "num_batches_tracked"}
