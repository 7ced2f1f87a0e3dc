"""FrozenBatchNorm2d: BatchNorm with fixed statistics and affine (detection/segmentation backbones).

Same semantics and state_dict as ``torchvision.ops.FrozenBatchNorm2d``: ``weight``, ``bias``,
``running_mean`` and ``running_var`` are *buffers* (no gradient, no update, not in
``parameters()``), so an optimizer never touches them and small per-GPU batches never corrupt
them. Scope: :meth:`normscope.Scope.batch` with ``Running(use_input_stats=False)``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from .._surgery import bare_copy, probe_input, sample, then


class FrozenBatchNorm2d(nn.Module):
    r"""Batch Normalization with frozen running statistics and affine.

    .. math:: y = \frac{x - \mu_{\text{running}}}{\sqrt{\sigma^2_{\text{running}} + \epsilon}} \gamma + \beta

    Always evaluates with the running statistics, in train mode too. Loads a
    :class:`torch.nn.BatchNorm2d` state_dict (``num_batches_tracked`` is ignored). Accepts any
    (N, C, *) input, so it also freezes BatchNorm1d/3d (see :func:`freeze_batchnorm`).

    Args:
        num_features: channels C.
        eps: added to the running variance. Default: 1e-5.
        channel_dim: the channel axis: 1, or -1 for channels-last input such as (B, S, D) (what
            :func:`freeze_batchnorm` gives a ``BatchNorm1d(channel_dim=-1)``). Default: 1.
        fold: round as ``torchvision.ops.FrozenBatchNorm2d`` does -- the statistics and affine folded
            into one scale and shift first (``x * scale + shift``, with ``scale = w * rsqrt(var + eps)``,
            ``shift = b - mean * scale``), in the buffers' dtype -- instead of as a BatchNorm in
            evaluation (what :func:`freeze_batchnorm` needs). The two differ in the last bit. Default: False.

    Shape:
        - Input: (N, C, *); (N, *, C) with ``channel_dim=-1``. Output: same shape.

    Example::

        >>> frozen = normscope.FrozenBatchNorm2d(64)
        >>> _ = frozen.load_state_dict(torch.nn.BatchNorm2d(64).state_dict())
        >>> y = frozen(torch.randn(2, 64, 8, 8))
    """

    channel_dim: int = 1  # a class attribute: the default adds nothing to __dict__ or repr

    fold: bool = False

    def __init__(
        self, num_features: int, eps: float = 1e-5, device=None, dtype=None, *, channel_dim: int = 1, fold: bool = False
    ) -> None:
        super().__init__()
        num_features = check.size(num_features, "num_features", "FrozenBatchNorm2d")  # NumPy's ints too
        channel_dim = check.channel_dim(channel_dim, "FrozenBatchNorm2d")
        if channel_dim != 1:
            self.channel_dim = channel_dim
        if not isinstance(fold, bool):
            raise TypeError(f"FrozenBatchNorm2d: expected `fold` to be a bool, got {type(fold).__name__} {fold!r}")
        if fold:
            self.fold = True
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.eps = num_features, eps
        self.register_buffer("weight", torch.ones(num_features, **kw))
        self.register_buffer("bias", torch.zeros(num_features, **kw))
        self.register_buffer("running_mean", torch.zeros(num_features, **kw))
        self.register_buffer("running_var", torch.ones(num_features, **kw))
        # the class and the constructor options (momentum, rmax...) that unfreeze_batchnorm
        # restores (not state: plain attributes)
        self.source_cls: type[nn.Module] | None = None
        self.source_options: dict[str, object] = {}

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm checkpoint's counter
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        s = f"{self.num_features}, eps={self.eps}"
        s = s if self.channel_dim == 1 else f"{s}, channel_dim={self.channel_dim}"
        return f"{s}, fold=True" if self.fold else s

    def forward(self, input: Tensor) -> Tensor:
        name, c, cd = type(self).__name__, self.num_features, self.channel_dim
        check.tensor(input, "input", name)
        if input.dim() < 2 or input.shape[cd] != c:
            layout = f"(N, {c}, *)" if cd == 1 else f"(N, *, {c})"
            raise ValueError(
                f"{name}({c}): expected input of shape {layout} with {c} channels at dim {cd}, "
                f"got shape {tuple(input.shape)}"
            )
        rm, rv, w, b = self.running_mean, self.running_var, self.weight, self.bias
        if self.fold:  # torchvision's order of operations, op for op (type promotion included)
            if rm.device != input.device:  # as F.batch_norm's check (the unfolded path), before any op
                raise ValueError(
                    f"{name}: expected `running_mean` on the input's device {input.device}, got {rm.device}"
                )
            for tname, t in (("weight", w), ("bias", b), ("running_mean", rm), ("running_var", rv)):
                if t.shape != (c,):  # a buffer replaced after construction: not a broadcast RuntimeError below
                    raise ValueError(f"{name}({c}): expected `{tname}` of shape ({c},), got {tuple(t.shape)}")
            scale = w * (rv + self.eps).rsqrt()
            shape = [1] * input.dim()
            shape[cd] = c
            return input * scale.reshape(shape) + (b - rm * scale).reshape(shape)
        # functional.batch_norm in evaluation: its checks (dtypes, eps) and the hot path (normscope.hot)
        return F.batch_norm(input, rm, rv, w, b, False, 0.0, self.eps, channel_dim=cd)


def _replace(model: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> nn.Module:
    if match(model):
        return make(model)
    # one replacement per module object: a layer reached by two paths (tied, shared) stays one
    # layer after the surgery, as it was before
    made: dict[int, nn.Module] = {}
    for parent in list(model.modules()):  # modules() visits a shared module once, not its parents
        # _modules, not named_children(): that skips a second name of the same child
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in made:
                setattr(parent, child_name, made[id(child)])
            elif match(child):
                made[id(child)] = make(child)
                setattr(parent, child_name, made[id(child)])
    return model


# constructor keywords of normscope's BatchNorm family kept as instance attributes (channel_dim
# only when not the class default 1; rmax/dmax/warmup_iters on BatchRenorm)
_OPTIONS = ("channel_dim", "rmax", "dmax", "warmup_iters")


def _frozen_from(bn: nn.Module) -> FrozenBatchNorm2d:
    ref = bn.running_mean if bn.running_mean is not None else bn.weight
    cd = getattr(bn, "channel_dim", 1)
    frozen = FrozenBatchNorm2d(bn.num_features, bn.eps, device=ref.device, dtype=ref.dtype, channel_dim=cd)
    with torch.no_grad():
        if bn.running_mean is not None:
            frozen.running_mean.copy_(bn.running_mean)
            frozen.running_var.copy_(bn.running_var)
        if bn.weight is not None:
            frozen.weight.copy_(bn.weight)
        if bn.bias is not None:
            frozen.bias.copy_(bn.bias)
    frozen.source_cls = type(bn)
    # what the frozen layer has no use for but the trainable one needs back
    frozen.source_options = {"momentum": bn.momentum}
    frozen.source_options.update({k: getattr(bn, k) for k in _OPTIONS if k in vars(bn)})
    frozen.train(bn.training)  # no effect on a frozen layer, but restored by unfreeze_batchnorm
    return frozen


def _plain(m: nn.Module) -> bool:
    """A BatchNorm of torch.nn or normscope as it is (no subclass from elsewhere, nothing inside)."""
    return type(m).__module__.split(".")[0] in ("torch", "normscope") and not m._modules


def _frozen_like(bn: nn.Module) -> tuple[FrozenBatchNorm2d | None, str | None]:
    """A frozen layer for a BatchNorm from elsewhere (timm's ``BatchNormAct2d``: norm, drop,
    activation), probed bit for bit against the layer in evaluation: its child modules run after
    the frozen norm under the same names. ``(None, why)`` when it does not reproduce the layer."""
    frozen = _frozen_from(bare_copy(bn))
    if bn._modules:
        frozen.__class__ = then(FrozenBatchNorm2d)
        for name, child in bare_copy(bn)._modules.items():
            frozen.add_module(name, child)
    ref = bare_copy(bn).eval()
    base = next(t for t in (nn.BatchNorm1d, nn.BatchNorm3d, nn.BatchNorm2d) if isinstance(bn, t))
    dtype = frozen.running_mean.dtype
    with torch.no_grad():
        x = probe_input(sample(base, bn), dtype, frozen.running_mean.device)
        want, got = ref(x), frozen(x)
    if not isinstance(want, Tensor) or want.dtype != got.dtype or not torch.equal(want, got):
        return (
            None,
            f"a FrozenBatchNorm2d{' then ' + ', '.join(bn._modules) if bn._modules else ''} does not "
            "reproduce it in evaluation",
        )
    return frozen, None


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm (``torch.nn`` or normscope, 1d/2d/3d, SyncBatchNorm, BatchRenorm)
    that tracks running statistics by a :class:`FrozenBatchNorm2d` carrying its running
    statistics, weight and bias (ones/zeros when ``affine=False``) and its channel axis
    (``channel_dim=-1`` included). A BatchNorm subclass from elsewhere is frozen only where a probe
    shows the frozen layer reproduces it in evaluation, bit for bit; one that does more than
    normalize (timm's ``BatchNormAct2d``: drop and activation after the norm) keeps those modules
    after the frozen norm, under the same names. A layer left as it is is named in a warning, with
    why. A layer shared by several paths becomes one frozen layer shared by the same paths. In
    place; returns the model (the new layer itself when ``model`` is a BatchNorm). A BatchNorm
    without running statistics (``track_running_stats=False``) has nothing to freeze and is left alone.

    Example::

        >>> backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> backbone = normscope.freeze_batchnorm(backbone)
        >>> type(backbone[1]).__name__
        'FrozenBatchNorm2d'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze_batchnorm: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    match = lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None  # noqa: E731
    left: dict[int, str] = {}

    def make(bn: nn.Module) -> nn.Module:
        if _plain(bn):
            return _frozen_from(bn)
        probed, why = _frozen_like(bn)
        if probed is None:
            left[id(bn)] = why
            return bn
        frozen = _frozen_from(bn)  # from the layer itself: its own values and children
        if bn._modules:
            frozen.__class__ = type(probed)
            for name, child in bn._modules.items():
                frozen.add_module(name, child)
        # the layer itself comes back on unfreeze_batchnorm (its class, activation and options)
        frozen.__dict__["_normscope_source"] = bn
        return frozen

    model = _replace(model, match, make)
    if left:
        names = {id(m): path for path, m in model.named_modules()}
        lines = "; ".join(f"at {names.get(k, '?')!r}: {why}" for k, why in left.items())
        warnings.warn(f"freeze_batchnorm: {len(left)} BatchNorm layer(s) left as they are: {lines}", stacklevel=2)
    return model


def _unfrozen_from(frozen: FrozenBatchNorm2d) -> nn.Module:
    from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d  # not the package: it imports this module

    source = frozen.__dict__.get("_normscope_source")
    if source is not None:  # a BatchNorm from elsewhere: the layer itself, with the frozen values
        with torch.no_grad():
            for name in ("weight", "bias", "running_mean", "running_var"):
                if getattr(source, name, None) is not None:
                    getattr(source, name).copy_(getattr(frozen, name))
        for name, child in frozen._modules.items():
            source.add_module(name, child)
        source.train(frozen.training)
        return source

    cls = frozen.source_cls
    if cls is None or not issubclass(cls, nn.modules.batchnorm._BatchNorm):
        cls = BatchNorm2d
    if cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        # the normscope namesake: same state, the engine behind it
        cls = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d}[cls]
    ref = frozen.running_mean
    options = dict(getattr(frozen, "source_options", {}))
    if frozen.channel_dim != 1:
        options["channel_dim"] = frozen.channel_dim
    if "channel_dim" in options and not _takes(cls, "channel_dim"):
        if options["channel_dim"] != 1:  # e.g. a hand-built FrozenBatchNorm2d(channel_dim=-1)
            cls = BatchNorm1d
        else:
            del options["channel_dim"]
    bn = cls(frozen.num_features, eps=frozen.eps, device=ref.device, dtype=ref.dtype, **options)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(bn, name).copy_(getattr(frozen, name))
    bn.train(frozen.training)
    return bn


def _takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def unfreeze_batchnorm(model: nn.Module) -> nn.Module:
    """Undo :func:`freeze_batchnorm`: every :class:`FrozenBatchNorm2d` becomes a trainable
    BatchNorm (the class it was frozen from -- a torch.nn BatchNorm comes back as its normscope
    namesake -- else :class:`normscope.BatchNorm2d`) with ``affine=True`` and running statistics,
    carrying all four values and the options it was frozen with (``momentum``, ``channel_dim``,
    BatchRenorm's ``rmax``/``dmax``/``warmup_iters``). A layer shared by several paths stays
    one layer. In place; returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unfreeze_batchnorm: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    return _replace(model, lambda m: isinstance(m, FrozenBatchNorm2d), _unfrozen_from)
