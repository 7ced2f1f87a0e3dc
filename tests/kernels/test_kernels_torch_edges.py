"""The Triton kernels (forced backend; Triton's interpreter on CPU, compiled with
NORMSCOPE_TEST_DEVICE=cuda) against torch.nn.functional on the same device and float64 formulas, at two
edges where a kernel parted from torch: the memory layout of the output on channels_last /
channels_last_3d input, and a constant InstanceNorm/BatchNorm scope with eps=0 (the bias on a CPU, as
torch's CPU kernel; NaN on CUDA, as torch's CUDA kernels).
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import functional as nf  # noqa: E402

DEV = torch.device(TEST_DEVICE)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.mark.parametrize("training", (True, False))
@pytest.mark.parametrize("dims", (4, 5))
def test_batch_norm_kernel_keeps_a_channels_last_layout(dims, training):
    """BatchNorm2d/3d on channels_last(_3d) input: torch returns the input's layout, so must the
    kernel -- the 5-D input came back NCDHW-contiguous (the kernel kept 4-D channels_last only)."""
    g = torch.Generator().manual_seed(0)
    c = 3
    shape = (2, c, 3, 2) if dims == 4 else (2, c, 2, 3, 2)
    x = torch.randn(shape, generator=g).to(DEV).contiguous(memory_format=LAYOUTS[dims])
    w, b = torch.randn(c, generator=g).to(DEV), torch.randn(c, generator=g).to(DEV)
    mean, var = torch.randn(c, generator=g).to(DEV), (torch.rand(c, generator=g) + 0.5).to(DEV)
    y = nf.batch_norm(x, mean.clone(), var.clone(), w, b, training=training, backend="triton")
    assert normscope.last_backend() == "triton"
    want = F.batch_norm(x.double(), mean.double(), var.double(), w.double(), b.double(), training=training)
    assert y.stride() == F.batch_norm(x, mean.clone(), var.clone(), w, b, training=training).stride()
    assert y.is_contiguous(memory_format=LAYOUTS[dims])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


EPS0_CALLS = {
    "instance_norm": lambda x, w, b: nf.instance_norm(x, weight=w, bias=b, eps=0.0, backend="triton"),
    "instance_norm channels_last": lambda x, w, b: nf.instance_norm(
        x.contiguous(memory_format=torch.channels_last), weight=w, bias=b, eps=0.0, backend="triton"
    ),
    # the same scope through the generic entry point: per (sample, channel) over the last axes, which
    # the rows kernel takes when they are trailing
    "normalize(dims=(2, 3))": lambda x, w, b: nf.normalize(
        x, dims=(2, 3), weight=w, bias=b, affine_dims=1, eps=0.0, backend="triton"
    ),
}


@pytest.mark.parametrize("name", EPS0_CALLS)
def test_instance_scope_with_eps_zero_gives_torchs_bias_on_the_kernels(name):
    """InstanceNorm's scope with eps=0: torch's kernel gives a constant channel rstd 0 -- its output the
    bias, its gradients 0 -- where the kernels' rsqrt(0 + 0) gave NaN output and NaN gradients for
    every input of the call (the reference and aten backends give the bias)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 3, generator=g)
    x[0, 1] = 7.25  # one constant channel of one sample
    x = x.to(DEV).requires_grad_()
    w = torch.tensor([1.0, 2.0, 3.0], device=DEV, requires_grad=True)
    b = torch.tensor([0.5, -1.0, 2.0], device=DEV, requires_grad=True)
    dy = torch.randn(2, 3, 2, 3, generator=g).to(DEV)
    y = EPS0_CALLS[name](x, w, b)
    # torch's own on this device: the bias on a CPU; NaN on CUDA, whose kernels compute 1 / sqrt(0)
    # (measured on an H200, torch 2.11), as the kernels do
    want = F.instance_norm(x.double(), weight=w.double(), bias=b.double(), eps=0.0)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
    if DEV.type == "cpu":
        assert torch.equal(y[0, 1].detach(), b[1].detach().expand(2, 3))
    got = torch.autograd.grad(y, (x, w, b), dy)
    for gk, gw in zip(got, torch.autograd.grad(want, (x, w, b), dy.double())):
        assert DEV.type != "cpu" or torch.isfinite(gk).all()
        torch.testing.assert_close(gk.double(), gw.double(), rtol=1e-4, atol=1e-4, equal_nan=True)


def test_batch_norm_scope_with_eps_zero_gives_torchs_bias_on_the_kernels():
    """normalize(keep=1): BatchNorm's scope (batch statistics) with eps=0, where torch's batch_norm
    kernel gives a constant channel the bias; the channels kernel gave NaN."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 4, generator=g)
    x[:, 1] = -3.5
    x = x.to(DEV).requires_grad_()
    y = nf.normalize(x, keep=1, eps=0.0, backend="triton")
    if DEV.type != "cpu":  # torch's CUDA kernels compute 1 / sqrt(0) there (H200, torch 2.11), as the kernel
        assert torch.isnan(y[:, 1]).all()
        return
    assert torch.equal(y[:, 1].detach(), torch.zeros(3, 4, device=DEV))
    x0 = x[:, 0].detach().double()
    want = (x0 - x0.mean()) / x0.var(unbiased=False).sqrt()  # the other channel: the formula, eps 0
    torch.testing.assert_close(y[:, 0].double(), want, rtol=1e-5, atol=1e-5)
    (gx,) = torch.autograd.grad(y, x, torch.randn(3, 2, 4, generator=g).to(DEV))
    assert torch.isfinite(gx).all() and torch.equal(gx[:, 1], torch.zeros(3, 4, device=DEV))
