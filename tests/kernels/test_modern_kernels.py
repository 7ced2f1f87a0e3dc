"""The modern norms' fused Triton kernels (forced backend) against float64 formulas and the unfused path.

CPU: the kernels run in Triton's interpreter on tiny shapes; ``NORMSCOPE_TEST_DEVICE=cuda`` runs the
same tests compiled, plus the > 2^31-element cases (skipped, visibly, on CPU). The bugs peers shipped are cases
here: width 1536 (Liger #518), a stride-0 upstream gradient from ``.sum()`` (QuACK #88),
empty input (QuACK), bf16 ``1 + w`` (Liger #1462), weights that are views.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402

DEV = torch.device(TEST_DEVICE)
cuda_only = pytest.mark.skipif(DEV.type == "cpu", reason="> 2^31 elements run only with NORMSCOPE_TEST_DEVICE=cuda")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _mod64(x, shift, scale, w, b, centered, eps=1e-6):
    x = x.double()
    if centered:
        x = x - x.mean(-1, keepdim=True)
    n = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        n = n * w.double()
    if b is not None:
        n = n + b.double()
    if shift.dim() == 2 and n.dim() == 3:
        shift, scale = shift[:, None], scale[:, None]
    return n * (1 + scale.double()) + shift.double()


def _leaf(t):
    return t.to(DEV).detach().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_modulated_kernel_forward_backward(dtype, centered, per_token):
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 3, 1536  # 1536: a masked tail in a 2048 block (Liger #518)
    x = _leaf((torch.randn(b, s, d, generator=g) * 2 + 1).to(dtype))
    mshape = (b, s, d) if per_token else (b, d)
    shift = _leaf(torch.randn(mshape, generator=g).to(dtype))
    scale = _leaf((torch.randn(mshape, generator=g) * 0.2).to(dtype))
    base = _leaf(torch.randn(2 * d, generator=g).to(dtype))  # the weight is a strided view of base
    bias = _leaf(torch.randn(d, generator=g).to(dtype)) if centered else None
    norm = "layer" if centered else "rms"
    y = FM.modulated_norm(x, shift, scale, base[::2], bias, norm=norm, backend="triton")
    assert normscope.last_backend() == "triton" and y.dtype == dtype
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    expected = _mod64(x.detach().cpu(), shift.detach().cpu(), scale.detach().cpu(), base[::2].detach().cpu(),
                      None if bias is None else bias.detach().cpu(), centered)  # fmt: skip
    torch.testing.assert_close(y.detach().cpu().double(), expected, atol=tol, rtol=tol)
    # gradients against the unfused path (engine + autograd) on the same inputs, in fp32
    y.sum().backward()  # a stride-0 upstream gradient (QuACK #88)
    got = [t.grad.clone() for t in (x, shift, scale, base) + ((bias,) if centered else ())]
    ins = [t.detach().float().requires_grad_() for t in (x, shift, scale, base) + ((bias,) if centered else ())]
    xr, shr, scr, br = ins[:4]
    yr = FM.modulated_norm(xr, shr, scr, br[::2], ins[4] if centered else None, norm=norm, backend="reference")
    yr.sum().backward()
    for a, r in zip(got, ins):
        torch.testing.assert_close(a.float(), r.grad, atol=tol * 10, rtol=tol)


def test_modulated_kernel_backward_is_deterministic_and_double_backward_works():
    g = torch.Generator().manual_seed(1)
    x = _leaf(torch.randn(3, 5, 24, generator=g))
    shift, scale = _leaf(torch.randn(3, 24, generator=g)), _leaf(torch.randn(3, 24, generator=g))
    w = _leaf(torch.randn(24, generator=g))
    dy = torch.randn(3, 5, 24, generator=g).to(DEV)
    grads = []
    for _ in range(2):
        y = FM.modulated_norm(x, shift, scale, w, backend="triton")
        grads.append(torch.autograd.grad(y, (x, shift, scale, w), dy))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    y = FM.modulated_norm(x, shift, scale, w, backend="triton")
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    gx.square().sum().backward()  # a gradient penalty: through the differentiable path
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_modulated_kernel_empty_input_and_refusals(monkeypatch):
    x = torch.randn(0, 4, 8).to(DEV)
    y = FM.modulated_norm(x, torch.randn(0, 8).to(DEV), torch.randn(0, 8).to(DEV), backend="triton")
    assert y.shape == (0, 4, 8)
    with pytest.raises(ValueError, match="casting='eager'"):
        FM.modulated_norm(torch.randn(2, 3, 8).to(DEV), casting="eager", backend="triton")
    monkeypatch.setattr(KC, "ROWS_MAX_FUSED_N", 8)
    with pytest.raises(ValueError, match="triton.*16 elements.*registers"):
        FM.modulated_norm(torch.randn(2, 3, 16).to(DEV), backend="triton")
    with pytest.raises(ValueError, match="float64"):
        FM.modulated_norm(torch.randn(2, 3, 4, dtype=torch.float64).to(DEV), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_weight_in_the_rows_kernel(dtype):
    g = torch.Generator().manual_seed(2)
    x = _leaf((torch.randn(4, 1536, generator=g) * 3).to(dtype))
    w = _leaf((torch.randn(1536, generator=g) * 0.05).to(dtype))
    y = FM.rms_norm(x, 1536, w, 1e-6, weight_offset=1.0, casting="gemma", backend="triton")
    assert normscope.last_backend() == "triton"
    ref = FM.rms_norm(x, 1536, w, 1e-6, weight_offset=1.0, casting="gemma", backend="reference")
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), atol=tol * 4, rtol=tol)
    y.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_bf16_one_plus_tiny_weight_in_the_kernel():
    # Liger #1462: in bf16, 1 + 2^-8 == 1; the kernel forms the scale in fp32
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.bfloat16).to(DEV)
    w = torch.full((4,), 2.0**-8, dtype=torch.bfloat16).to(DEV)
    y = FM.rms_norm(x.float(), 4, w, 0.0, weight_offset=1.0, casting="gemma", backend="triton")
    assert y.abs().max().item() == pytest.approx(1 + 2**-8)
    qn, kn = FM.qk_norm(
        x.float().reshape(1, 1, 1, 4), x.float().reshape(1, 1, 1, 4), w, w, 0.0,
        weight_offset=1.0, casting="gemma", backend="triton",
    )  # fmt: skip
    assert qn.abs().max().item() == pytest.approx(1 + 2**-8)


@cuda_only
def test_modulated_kernel_past_2_pow_31_elements():
    rows, d = (1 << 31) // 1024 + 8, 1024
    x = torch.zeros(rows, d, dtype=torch.bfloat16, device=DEV)
    x[-1].normal_()
    shift = torch.zeros(1, d, dtype=torch.bfloat16, device=DEV)
    y = FM.modulated_norm(x, shift, shift, backend="triton")
    ref = FM.modulated_norm(x[-1:], shift, shift, backend="reference")
    torch.testing.assert_close(y[-1:].float(), ref.float(), atol=2e-2, rtol=2e-2)


class _Counting:
    """Stands in for a jitted kernel: counts launches, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout, per_head, norm, offset",
    [
        ("bshd", True, "rms", 1.0),  # Gemma 3
        ("bhsd", True, "rms", 0.0),  # a transposed view: copied once
        ("bshd", False, "rms", 0.0),  # OLMo 2: all heads of a token
        ("bshd", True, "layer", 0.0),  # ViT-22B style LayerNorm with bias
    ],
)
def test_qk_norm_one_launch(monkeypatch, dtype, layout, per_head, norm, offset):
    from normscope.kernels import modern as MK

    counter = _Counting(MK._qk_fwd_kernel)
    monkeypatch.setattr(MK, "_qk_fwd_kernel", counter)
    g = torch.Generator().manual_seed(3)
    b, s, h, hkv, d = 2, 3, 4, 2, 16
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = (torch.randn(b, s, hkv, d, generator=g) + 2).to(dtype)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if not per_head:  # OLMo 2 with equal q and k widths (no GQA): one row length for both
        k = (torch.randn(b, s, h, d, generator=g) + 2).to(dtype)
    wshape_q = (d,) if per_head else (h * d,)
    wshape_k = (d,) if per_head else (k.shape[2] * d,)
    wq = _leaf((torch.randn(wshape_q, generator=g) * 0.1).to(dtype))
    wk = _leaf((torch.randn(wshape_k, generator=g) * 0.1).to(dtype))
    bq = _leaf(torch.randn(wshape_q, generator=g).to(dtype)) if norm == "layer" else None
    bk = _leaf(torch.randn(wshape_k, generator=g).to(dtype)) if norm == "layer" else None
    q, k = _leaf(q), _leaf(k)
    opts = dict(
        layout=layout, per_head=per_head, norm=norm, q_bias=bq, k_bias=bk, weight_offset=offset, casting="gemma"
    )
    qn, kn = FM.qk_norm(q, k, wq, wk, **opts, backend="triton")
    assert counter.launches == 1 and normscope.last_backend() == "triton"
    assert qn.shape == q.shape and kn.shape == k.shape and qn.dtype == dtype
    (qn.sum() + kn.sum()).backward()  # stride-0 upstream gradients
    leaves = [t for t in (q, k, wq, wk, bq, bk) if t is not None]
    got = [t.grad.clone() for t in leaves]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    rq, rk, rwq, rwk = ref_leaves[:4]
    ropts = dict(
        opts, q_bias=ref_leaves[4] if bq is not None else None, k_bias=ref_leaves[5] if bk is not None else None
    )
    eq, ek = FM.qk_norm(rq, rk, rwq, rwk, **ropts, backend="reference")
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(qn.float(), eq, atol=tol, rtol=tol)
    torch.testing.assert_close(kn.float(), ek, atol=tol, rtol=tol)
    (eq.sum() + ek.sum()).backward()
    for a, r in zip(got, ref_leaves):
        torch.testing.assert_close(a.float(), r.grad, atol=tol * 20, rtol=tol * 5)


def test_qk_norm_kernel_double_backward_and_empty():
    q = _leaf(torch.randn(1, 2, 2, 8))
    k = _leaf(torch.randn(1, 2, 1, 8))
    w = _leaf(torch.randn(8) * 0.1)
    qn, kn = FM.qk_norm(q, k, w, w, weight_offset=1.0, casting="gemma", backend="triton")
    (gq,) = torch.autograd.grad(qn.square().sum() + kn.sum(), q, create_graph=True)
    gq.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    e = torch.randn(0, 2, 2, 8).to(DEV)
    qn, kn = FM.qk_norm(e, e, None, None, casting="gemma", backend="triton")
    assert qn.shape == e.shape and kn.shape == e.shape


def test_qk_norm_kernel_refusal_names_the_weights_dtypes():
    """Weights of two dtypes are declined before any launch, and the reason names them: it said only
    "got q torch.float32, k torch.float32" -- the two dtypes that agree."""
    q, k = torch.randn(1, 2, 2, 8, device=DEV), torch.randn(1, 2, 2, 8, device=DEV)
    wq, wk = torch.ones(8, device=DEV, dtype=torch.bfloat16), torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match=r"q_weight torch\.bfloat16, k_weight torch\.float32"):
        FM.qk_norm(q, k, wq, wk, casting="gemma", backend="triton")


def _poly64(x, w, b, eps=1e-6):
    x = x.double()

    def rms(u):
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    w = w.double()
    return w[0] * rms(x**3) + w[1] * rms(x**2) + w[2] * rms(x) + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poly_norm_kernel(dtype):
    g = torch.Generator().manual_seed(4)
    x = _leaf(torch.randn(2, 3, 1536, generator=g).to(dtype))
    w = _leaf(torch.tensor([0.3, -0.7, 1.1]).to(dtype))
    b = _leaf(torch.tensor([0.25]).to(dtype))
    y = FM.poly_norm(x, w, b, backend="triton")
    assert normscope.last_backend() == "triton" and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(
        y.double().cpu(), _poly64(x.detach().cpu(), w.detach().cpu(), b.detach().cpu()), atol=tol, rtol=tol
    )
    y.sum().backward()  # stride-0 upstream gradient
    got = [t.grad.clone() for t in (x, w, b)]
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    _poly64(*ref).sum().backward()
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r.grad, atol=tol * 50, rtol=tol * 5)
    # deterministic: the same bits twice
    again = torch.autograd.grad(FM.poly_norm(x, w, b, backend="triton").sum(), (x, w, b))
    for a, r in zip(got, again):
        assert torch.equal(a, r)
    assert FM.poly_norm(torch.zeros(0, 8).to(DEV), w, b, backend="triton").shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_derf_kernel(dtype, affine):
    g = torch.Generator().manual_seed(5)
    x = _leaf((torch.randn(3, 5, 40, generator=g) * 2).to(dtype))
    a, s = _leaf(torch.tensor([0.7]).to(dtype)), _leaf(torch.tensor([0.1]).to(dtype))
    base = _leaf(torch.randn(80, generator=g).to(dtype))
    w, b = (base[::2], base[1::2]) if affine else (None, None)  # views as weights
    y = FM.derf(x, a, s, w, b, backend="triton")
    assert normscope.last_backend() == "triton"
    y.sum().backward()
    leaves = [x, a, s] + ([base] if affine else [])
    got = [t.grad.clone() for t in leaves]
    ref = [t.detach().double().requires_grad_() for t in leaves]
    rw, rb = (ref[3][::2], ref[3][1::2]) if affine else (None, None)
    yr = FM.derf(ref[0], ref[1], ref[2], rw, rb)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.double(), yr.detach(), atol=tol, rtol=tol)
    yr.sum().backward()
    for t, r in zip(got, ref):
        torch.testing.assert_close(t.double(), r.grad, atol=tol * 50, rtol=tol * 5)
    with pytest.raises(ValueError, match="last axis"):
        FM.derf(x, a, s, channel_dim=1, backend="triton")


@cuda_only
def test_qk_and_poly_and_offset_kernels_past_2_pow_31_elements():
    # only the last row is nonzero: an int32 offset would wrap and read or write the wrong row
    d = 128
    rows = (1 << 31) // d + 8
    q = torch.zeros(1, rows, 1, d, dtype=torch.bfloat16, device=DEV)
    q[0, -1].normal_()
    k = torch.randn(1, 4, 1, d, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(d, dtype=torch.bfloat16, device=DEV) * 0.1
    qn, _ = FM.qk_norm(q, k, w, w, weight_offset=1.0, casting="gemma", backend="triton")
    ref, _ = FM.qk_norm(q[:, -1:], k, w, w, weight_offset=1.0, casting="gemma", backend="reference")
    torch.testing.assert_close(qn[:, -1:].float(), ref.float(), atol=2e-2, rtol=2e-2)
    del qn
    x = q.view(rows, d)
    y = FM.poly_norm(x, torch.full((3,), 1 / 3, device=DEV), torch.ones(1, device=DEV), backend="triton")
    ref = FM.poly_norm(x[-1:], torch.full((3,), 1 / 3, device=DEV), torch.ones(1, device=DEV), backend="reference")
    torch.testing.assert_close(y[-1:].float(), ref.float(), atol=2e-2, rtol=2e-2)
    del y
    y = FM.rms_norm(x, d, w, 1e-6, weight_offset=1.0, casting="gemma", backend="triton")
    ref = FM.rms_norm(x[-1:], d, w, 1e-6, weight_offset=1.0, casting="gemma", backend="reference")
    torch.testing.assert_close(y[-1:].float(), ref.float(), atol=2e-2, rtol=2e-2)
