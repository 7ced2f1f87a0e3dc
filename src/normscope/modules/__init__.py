"""Drop-in replacements for the ``torch.nn`` normalization layers.

Each class *subclasses* its ``torch.nn`` namesake and replaces only ``forward``: constructor
signature, defaults, parameter and buffer names, ``state_dict`` layout, ``_version`` upgrades,
``reset_parameters`` and ``repr`` are torch's own, so checkpoints move both ways and
``isinstance(layer, torch.nn.LayerNorm)`` -- which optimizers' weight-decay filters and
conv-bn fusers rely on -- stays true. ``forward`` goes through :mod:`normscope.functional`, i.e.
the one engine, with clearer errors than torch's.
"""

from .. import hot as _hot
from .adain import AdaIN
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .dyt import DyT
from .frozen import FrozenBatchNorm2d, freeze_batchnorm, unfreeze_batchnorm
from .instancenorm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .layernorm2d import LayerNorm2d
from .modern import AdaLayerNorm, Derf, PolyNorm, QKNorm
from .normalization import GroupNorm, LayerNorm, LocalResponseNorm, RMSNorm
from .powernorm import PowerNorm
from .renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d
from .syncbatchnorm import SyncBatchNorm

for _cls in (
    AdaIN, BatchNorm1d, BatchNorm2d, BatchNorm3d, DyT, FrozenBatchNorm2d, InstanceNorm1d, InstanceNorm2d,
    InstanceNorm3d, LayerNorm2d, AdaLayerNorm, Derf, PolyNorm, QKNorm, GroupNorm, LayerNorm, LocalResponseNorm,
    RMSNorm, PowerNorm, BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, SyncBatchNorm,
):  # fmt: skip
    # torch.jit.script asks each module of a model for this first: a TypeError that names the way
    # that works (torch.compile, torch.export), not TorchScript's from inside the hot path
    _cls.__prepare_scriptable__ = _hot.refuse_script
del _cls

__all__ = [
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
]
