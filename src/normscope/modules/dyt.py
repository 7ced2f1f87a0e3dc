"""DyT, Dynamic Tanh: an element-wise replacement for normalization layers in Transformers.

Paper: Zhu, Chen, He, LeCun & Liu 2025, "Transformers without Normalization".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _checks as check


class DyT(nn.Module):
    r"""Dynamic Tanh: :math:`y = \gamma \odot \tanh(\alpha x) + \beta`.

    *Not* a normalization and not an engine configuration: there are no statistics at all (no
    scope, no mean, no variance); a learnable scalar :math:`\alpha` squashes activations the way a
    LayerNorm's S-shaped input-output map does in trained Transformers. It lives here so that
    ``get_norm("dyt", C)`` and :func:`normscope.convert` can swap it in for a LayerNorm.

    Args:
        num_features: size of the feature axis (``weight``/``bias`` length).
        alpha_init: initial value of the scalar :math:`\alpha`. Default: 0.5 (the paper's default
            for non-LLM models).
        channel_dim: the feature axis; -1 for Transformer activations (B, S, D), 1 for (N, C, H, W).
            Default: -1.
        affine: learnable per-feature ``weight`` (ones) and ``bias`` (zeros). Default: True.

    Shape:
        - Input: any shape with ``num_features`` at ``channel_dim``. Output: same shape.

    Example::

        >>> dyt = normscope.DyT(512)
        >>> y = dyt(torch.randn(4, 10, 512))
    """

    def __init__(
        self,
        num_features: int,
        alpha_init: float = 0.5,
        channel_dim: int = -1,
        affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_features = check.size(num_features, "num_features", "DyT")  # a Python int, from NumPy's too
        if not isinstance(channel_dim, int) or isinstance(channel_dim, bool):
            raise TypeError(f"DyT: expected `channel_dim` to be an int, got {channel_dim!r}")
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.channel_dim = num_features, channel_dim
        self.alpha_init = check.finite(alpha_init, "alpha_init", "DyT")
        self.alpha = nn.Parameter(torch.full((1,), self.alpha_init, **kw))
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **kw))
            self.bias = nn.Parameter(torch.zeros(num_features, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            if self.weight is not None:
                self.weight.fill_(1.0)
                self.bias.zero_()

    def extra_repr(self) -> str:
        return f"{self.num_features}, alpha_init={self.alpha_init}, channel_dim={self.channel_dim}"

    def forward(self, input: Tensor) -> Tensor:
        cd = self.channel_dim
        if not isinstance(input, Tensor):
            raise TypeError(f"DyT: expected input to be a torch.Tensor, got {type(input).__name__}")
        check.dense(input, "input", "DyT")
        if not input.is_floating_point():  # tanh would return an int input as float, silently
            raise TypeError(f"DyT: expected input to be a floating-point tensor, got dtype {input.dtype}")
        if not -input.dim() <= cd < input.dim() or input.shape[cd] != self.num_features:
            raise ValueError(
                f"DyT({self.num_features}): expected input with {self.num_features} features at dim {cd}, "
                f"got shape {tuple(input.shape)}"
            )
        alpha, w, b, n = self.alpha, self.weight, self.bias, self.num_features
        # a parameter replaced after construction (another size, None): refused by name, not a RuntimeError
        # from the product's broadcast or view(), nor an AttributeError of None -- and an alpha of one
        # value per feature is no scalar (it broadcast silently), as Derf refuses it
        if alpha is None or alpha.numel() != 1:
            got = None if alpha is None else f"shape {tuple(alpha.shape)}"
            raise ValueError(f"DyT({n}): expected `alpha` to have one element, got {got}")
        y = torch.tanh(alpha * input)
        if w is None:
            return y
        if w.shape != (n,) or b is None or b.shape != (n,):
            raise ValueError(
                f"DyT({n}): expected `weight` and `bias` of shape ({n},), got "
                f"{tuple(w.shape)} and {None if b is None else tuple(b.shape)}"
            )
        view = [1] * input.dim()
        view[cd] = n
        return y * w.view(view) + b.view(view)
