"""AdaIN: Adaptive Instance Normalization (style transfer).

Paper: Huang & Belongie 2017, "Arbitrary Style Transfer in Real-time with Adaptive Instance
Normalization". Scope: :meth:`normscope.Scope.instance`; see :func:`normscope.functional.adain`.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as F


class AdaIN(nn.Module):
    r"""Adaptive Instance Normalization: the content's instance statistics replaced by the style's.

    .. math:: \mathrm{AdaIN}(x, s) = \sigma(s) \frac{x - \mu(x)}{\sigma(x)} + \mu(s)

    with :math:`\mu, \sigma` per sample and channel over the spatial axes (biased variance, eps
    inside the square root, as InstanceNorm). No parameters; see
    :func:`normscope.functional.adain`.

    Args:
        eps: added to the variances. Default: 1e-5.

    Shape:
        - content: (N, C, *); style: (N or 1, C, *') or a ``(mean, std)`` tuple. Output: content's shape.

    Example::

        >>> adain = normscope.AdaIN()
        >>> y = adain(torch.randn(2, 64, 32, 32), torch.randn(2, 64, 16, 16))
    """

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def forward(self, content: Tensor, style: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        return F.adain(content, style, self.eps)
