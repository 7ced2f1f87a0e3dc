"""The Triton kernels (forced backend; Triton's interpreter on CPU) against torch.nn.functional and
float64 formulas on the edges probe 23 found: the memory layout of the output of every kernel family
on channels_last / channels_last_3d input is torch's.
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
