"""normscope: every normalization layer as one engine over a different scope.

Every normalization is the same four steps -- mean, variance, normalize, affine -- over a
different *scope*, the elements that share one mean and variance. :class:`Scope` describes it;
:func:`normscope.engine.norm` computes it on the best backend; the layers are torch-compatible
configurations of it.
"""

from . import functional
from .engine import backends, last_backend, use_backend
from .functional import normalize
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    LocalResponseNorm,
    RMSNorm,
)
from .scope import Scope

__version__ = "0.1.0"

__all__ = [
    "Scope",
    "normalize",
    "functional",
    "backends",
    "last_backend",
    "use_backend",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "GroupNorm",
    "LayerNorm",
    "LocalResponseNorm",
    "RMSNorm",
]

# the "triton" backend registers itself when Triton is installed (the package imports without it)
from . import kernels  # noqa: E402,F401
