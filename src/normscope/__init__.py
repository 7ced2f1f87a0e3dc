"""normscope: every normalization layer as one engine over a different scope.

Every normalization is the same four steps -- mean, variance, normalize, affine -- over a
different *scope*, the elements that share one mean and variance. :class:`Scope` describes it;
:func:`normscope.engine.norm` computes it on the best backend; the layers are torch-compatible
configurations of it.
"""

import warnings as _warnings

import torch as _torch

from . import functional
from ._version import __version__  # noqa: F401 - the package version, `normscope.__version__`
from .convert import convert
from .doctor import doctor, recalibrate, watch  # the functions: ``normscope.doctor`` is the function, as ``convert``
from .engine import last_backend, use_backend
from .functional import normalize
from .modules import (
    AdaIN,
    AdaLayerNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    Derf,
    DyT,
    FrozenBatchNorm2d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    LayerNorm2d,
    LocalResponseNorm,
    PolyNorm,
    PowerNorm,
    QKNorm,
    RMSNorm,
    SyncBatchNorm,
    freeze_batchnorm,
    unfreeze_batchnorm,
)
from .registry import get_norm, norm_names, register_norm
from .scope import Scope

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
    "SyncBatchNorm",
    "AdaIN",
    "BatchRenorm1d",
    "BatchRenorm2d",
    "BatchRenorm3d",
    "DyT",
    "FrozenBatchNorm2d",
    "LayerNorm2d",
    "PowerNorm",
    "freeze_batchnorm",
    "unfreeze_batchnorm",
    "AdaLayerNorm",
    "QKNorm",
    "PolyNorm",
    "Derf",
    "get_norm",
    "norm_names",
    "register_norm",
    "convert",
    "doctor",
    "recalibrate",
    "watch",
]

# every backend, registered with the engine in the automatic order named in normscope/backends/. Then
# ``normscope.backends`` is the function (the names in that order), as ``normscope.convert`` and
# ``normscope.doctor`` are their functions; the package is ``import normscope.backends``'s module
# (``from normscope.backends import TRITON``)
from . import backends as _backends_package  # noqa: E402,F401
from . import kernels  # noqa: E402,F401  (normscope.kernels, an attribute as before)
from .engine import backends  # noqa: E402

# The TorchScript tracer (the ONNX exporter with ``dynamo=False``) warns on every Python bool taken from a traced
# size. normscope's argument checks and scope resolution take such bools by design: they validate the
# example call, and what they decide is constant for the exported graph (the ONNX tests export with a
# dynamic batch and run other batch sizes in onnxruntime). Warnings attributed to other modules stay.
# (The tracer warns from C++ with a file name and no module, so the "module" matched is the file's
# path without ".py": the pattern takes both that and a dotted name.)
_warnings.filterwarnings("ignore", category=_torch.jit.TracerWarning, module=r"(.*[\\/])?normscope([\\/.]|$)")
