"""normscope.functional against torch.nn.functional (same signatures, same semantics, running
buffers updated in place), the generic normalize() over any axes against the float64 formula, and
torch's argument checks (eps, momentum) in the functional batch norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import normscope
import normscope.functional as F
from conftest import BACKENDS, direct

g = torch.Generator().manual_seed(0)

X3 = torch.randn(4, 6, 5, generator=g, dtype=torch.float64) * 2 + 1

X4 = torch.randn(2, 6, 3, 5, generator=g, dtype=torch.float64) - 1

W6 = torch.randn(6, generator=g, dtype=torch.float64)

B6 = torch.randn(6, generator=g, dtype=torch.float64)

W5 = torch.randn(5, generator=g, dtype=torch.float64)


def _buffers():
    return torch.randn(6, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64) + 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("x", [X3, X4, X3[:, :, 0]], ids=["3d", "4d", "2d"])
@pytest.mark.parametrize("momentum", [0.1, 0.7])
def test_batch_norm(x, training, momentum, backend):
    rm, rv = _buffers()
    trm, trv = rm.clone(), rv.clone()
    y = F.batch_norm(x, rm, rv, W6, B6, training, momentum, 1e-3, backend=backend)
    yt = TF.batch_norm(x, trm, trv, W6, B6, training, momentum, 1e-3)
    assert normscope.last_backend() == backend
    torch.testing.assert_close(y, yt)
    torch.testing.assert_close(rm, trm)
    torch.testing.assert_close(rv, trv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_norm_without_buffers(backend):
    y = F.batch_norm(X4, None, None, None, None, True, backend=backend)
    torch.testing.assert_close(y, TF.batch_norm(X4, None, None, None, None, True))
    torch.testing.assert_close(y, direct(X4, (0, 2, 3)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_input_stats", [True, False])
@pytest.mark.parametrize("x", [X3, X4], ids=["3d", "4d"])
def test_instance_norm(x, use_input_stats, backend):
    rm, rv = _buffers()
    trm, trv = rm.clone(), rv.clone()
    y = F.instance_norm(x, rm, rv, W6, B6, use_input_stats, 0.3, 1e-4, backend=backend)
    yt = TF.instance_norm(x, trm, trv, W6, B6, use_input_stats, 0.3, 1e-4)
    torch.testing.assert_close(y, yt)
    torch.testing.assert_close(rm, trm)
    torch.testing.assert_close(rv, trv)
    y = F.instance_norm(x, backend=backend)
    torch.testing.assert_close(y, TF.instance_norm(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
@pytest.mark.parametrize("shape", [5, (5,), [3, 5], torch.Size([6, 3, 5])], ids=["int", "tuple", "list", "size"])
def test_layer_norm(shape, affine, backend):
    dims = [shape] if isinstance(shape, int) else list(shape)
    w = None if affine == "none" else torch.randn(dims, generator=g, dtype=torch.float64)
    b = torch.randn(dims, generator=g, dtype=torch.float64) if affine == "both" else None
    y = F.layer_norm(X4, shape, w, b, 1e-5, backend=backend)
    torch.testing.assert_close(y, TF.layer_norm(X4, dims, w, b, 1e-5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm(eps, dtype, backend):
    x = X4.to(dtype) * 1e-3  # small values: eps=None (fp32's epsilon for half input) matters
    w = W5.to(dtype)
    y = F.rms_norm(x, (5,), w, eps, backend=backend)
    yt = TF.rms_norm(x, (5,), w, eps)
    assert y.dtype == dtype
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(y.double(), yt.double(), rtol=tol, atol=tol)
    assert normscope.last_backend() == backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [1, 2, 3, 6])
@pytest.mark.parametrize("x", [X3, X4], ids=["3d", "4d"])
def test_group_norm(x, groups, backend):
    y = F.group_norm(x, groups, W6, B6, 1e-4, backend=backend)
    torch.testing.assert_close(y, TF.group_norm(x, groups, W6, B6, 1e-4))
    torch.testing.assert_close(F.group_norm(x, groups, backend=backend), TF.group_norm(x, groups))


@pytest.mark.parametrize("size", [1, 2, 5, 8])
@pytest.mark.parametrize("x", [X3, X4], ids=["3d", "4d"])
def test_local_response_norm(x, size):
    torch.testing.assert_close(F.local_response_norm(x, size, 1e-2, 0.6, 1.5),
                               TF.local_response_norm(x, size, 1e-2, 0.6, 1.5))


# -------------------------------------------------------------------------------------------------
# the generic entry point


def test_normalize_named_scopes_against_formula():
    x = X4
    torch.testing.assert_close(normscope.normalize(x, dims=(2, 3)), direct(x, (2, 3)))  # instance
    torch.testing.assert_close(normscope.normalize(x, keep=1), direct(x, (0, 2, 3)))  # batch
    torch.testing.assert_close(normscope.normalize(x, dims=1), direct(x, (1,)))  # channels-first LN
    torch.testing.assert_close(normscope.normalize(x, keep=0, groups=3), direct(x, (1, 2, 3), groups=3))
    torch.testing.assert_close(normscope.normalize(x, dims=-1, centered=False), direct(x, (3,), centered=False))


def test_normalize_affine_defaults():
    x = X4
    # affine_dims defaults to dims
    w = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(normscope.normalize(x, dims=(2, 3), weight=w),
                               direct(x, (2, 3), affine=(2, 3), weight=w))
    # ... and to group_dim with keep=
    torch.testing.assert_close(normscope.normalize(x, keep=0, groups=2, weight=W6, bias=B6),
                               direct(x, (1, 2, 3), groups=2, affine=(1,), weight=W6, bias=B6))
    # explicit affine_dims
    w3 = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(normscope.normalize(x, dims=-1, weight=w3, affine_dims=2),
                               direct(x, (3,), affine=(2,), weight=w3))


@pytest.mark.parametrize("shape", [(2, 6, 3, 5), (1, 6, 3, 5), (2, 6, 1, 5)])
def test_normalize_mask_broadcast(shape):
    x = X4[: shape[0], :, : shape[2]]
    mask = torch.rand(shape[0], 1, shape[2], 5, generator=g) < 0.6
    y = normscope.normalize(x, keep=1, mask=mask, weight=W6, bias=B6)
    assert normscope.last_backend() == "composite"
    torch.testing.assert_close(y, direct(x, (0, 2, 3), affine=(1,), weight=W6, bias=B6, mask=mask))


@pytest.mark.parametrize("dims", [(1,), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)])
def test_normalize_any_axes_float64_formula(dims):
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64) * 2 + 7
    var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
    want = (x - mean) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(normscope.normalize(x, dims=dims), want)
    # an uncentered scope over the same axes: the root mean square
    want_rms = x / torch.sqrt(x.square().mean(dims, keepdim=True) + 1e-5)
    torch.testing.assert_close(normscope.normalize(x, dims=dims, centered=False), want_rms)


@pytest.mark.parametrize("training, eps", [(True, 0.0), (True, -1e-5), (False, -1e-5)])
def test_batch_norm_eps_checked_like_torch(training, eps):
    """eps <= 0 in training (NaN) and eps < 0 in evaluation are refused, as torch refuses them."""
    x = torch.randn(4, 3, 5)
    with pytest.raises(ValueError, match="eps"):
        torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), training=training, eps=eps)
    with pytest.raises(ValueError, match=rf"batch_norm: expected `eps` .* got {eps!r}"):
        F.batch_norm(x, torch.zeros(3), torch.ones(3), training=training, eps=eps)
    bn = normscope.BatchNorm1d(3, eps=eps).train(training)
    with pytest.raises(ValueError, match="eps"):
        bn(x)


def test_batch_norm_eps_zero_in_eval_is_allowed_like_torch():
    x, rm, rv = torch.randn(4, 3, 5), torch.randn(3), torch.rand(3) + 0.5
    want = torch.nn.functional.batch_norm(x, rm, rv, training=False, eps=0.0)
    torch.testing.assert_close(F.batch_norm(x, rm, rv, training=False, eps=0.0), want)


@pytest.mark.parametrize("fn", ["batch_norm", "instance_norm"])
def test_momentum_none_is_a_type_error_like_torch(fn):
    """F.batch_norm(momentum=None) silently meant 0; torch raises TypeError."""
    x, rm, rv = torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3)
    args = (x, rm, rv, None, None, True)
    with pytest.raises(TypeError):
        getattr(torch.nn.functional, fn)(*args, momentum=None)
    with pytest.raises(TypeError, match=rf"{fn}: expected `momentum` to be a float .* got None"):
        getattr(F, fn)(*args, momentum=None)
    torch.testing.assert_close(rm, torch.zeros(3))  # nothing was updated
