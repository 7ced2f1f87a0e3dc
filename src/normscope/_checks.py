"""Argument checks shared by the functional API and the layers.

Every user error is raised here, before any work, as ValueError/TypeError naming the argument, the
expected and the received value. The checks are cheap (attribute reads, no tensor ops) because
they run on every call.
"""

from __future__ import annotations

import numbers
import operator
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from . import engine


def tensor(x: object, name: str, where: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: expected `{name}` to be a torch.Tensor, got {type(x).__name__}")
    dense(x, name, where)
    if not x.is_floating_point():  # complex too: no normalization here is defined for it
        raise TypeError(f"{where}: expected `{name}` to be a floating-point tensor, got dtype {x.dtype}")
    return x


def dense(x: Tensor, name: str, where: str) -> None:
    """Refuse a nested tensor: its ragged sizes resolve no scope (reading them raises torch's internal
    "NestedTensorImpl doesn't support sizes"); normscope's way to ragged input is padding and a mask.
    And a sparse (or any other non-strided) one: torch's kernels refuse it from inside, with a
    RuntimeError or NotImplementedError ("unsupported memory format option Contiguous") -- a layer's
    weight or buffer replaced by ``.to_sparse()`` included (the plans key the layout, so a planned call
    of strided tensors never gets here)."""
    if x.is_nested:
        raise TypeError(
            f"{where}: expected `{name}` to be a dense tensor, got a nested tensor; pad it "
            f"(`nt.to_padded_tensor(0.0)`) and pass a mask of its valid positions, or use torch.nn's layer"
        )
    if x.layout != torch.strided:
        raise TypeError(f"{where}: expected `{name}` to be a dense (strided) tensor, got layout {x.layout}")


def ndim(x: Tensor, allowed: Sequence[int], name: str, where: str) -> None:
    if x.dim() not in allowed:
        want = " or ".join(f"{d}D" for d in allowed)
        raise ValueError(f"{where}: expected `{name}` to be {want}, got {x.dim()}D input of shape {tuple(x.shape)}")


_HALF = (torch.float16, torch.bfloat16)


def channels_first(x: Tensor, min_dims: int, where: str, name: str = "input") -> None:
    """An (N, C, *) tensor with at least ``min_dims`` dims."""
    if x.dim() < min_dims:
        what = "input" if name == "input" else f"`{name}`"
        raise ValueError(
            f"{where}: expected {what} of shape (N, C, *) with at least {min_dims} dims, got shape {tuple(x.shape)}"
        )


def param(p: Tensor | None, name: str, shape: Sequence[int], x: Tensor, where: str, any_dtype: bool = False) -> None:
    """An optional weight/bias/running buffer: right type, shape, dtype and device for input ``x``.

    The dtype is the input's, or fp32 for fp16/bf16 input (mixed precision) -- exactly what
    torch's CPU kernels accept, so every backend accepts the same calls (``any_dtype``: rms_norm,
    which torch runs with any parameter dtype).
    """
    if p is None:
        return
    if not isinstance(p, Tensor):
        raise TypeError(f"{where}: expected `{name}` to be a torch.Tensor or None, got {type(p).__name__}")
    dense(p, name, where)
    if p.shape != shape:
        raise ValueError(
            f"{where}: expected `{name}` of shape {tuple(shape)} to match input of shape "
            f"{tuple(x.shape)}, got shape {tuple(p.shape)}"
        )
    if p.device != x.device:
        raise ValueError(f"{where}: expected `{name}` on the input's device {x.device}, got {p.device}")
    if not any_dtype and p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in _HALF):
        also = " or torch.float32" if x.dtype in _HALF else ""
        raise TypeError(f"{where}: expected `{name}` of dtype {x.dtype}{also} like the input, got {p.dtype}")


def one_dtype(x: Tensor, where: str, **params: Tensor | None) -> None:
    """fp16/bf16 input: the given parameters (each checked by :func:`param`) all of one dtype -- the
    input's or fp32, never both: torch's kernels refuse a mixture with a RuntimeError from inside."""
    if x.dtype not in _HALF:
        return  # :func:`param` holds every parameter to the input's own dtype
    first = None
    for name, p in params.items():
        if p is None:
            continue
        if first is None:
            first = name, p.dtype
        elif p.dtype != first[1]:
            raise TypeError(
                f"{where}: expected `{name}` of dtype {first[1]} like `{first[0]}` (a {x.dtype} input takes "
                f"parameters of one dtype, its own or torch.float32), got {p.dtype}"
            )


def mask(m: Tensor | None, x: Tensor, channel_dim: int | None, where: str) -> Tensor | None:
    """A bool mask with the input's shape minus the channel axis; returned broadcastable to x."""
    if m is None:
        return None
    if not isinstance(m, Tensor):
        raise TypeError(f"{where}: expected `mask` to be a bool torch.Tensor or None, got {type(m).__name__}")
    if m.dtype != torch.bool:
        raise TypeError(f"{where}: expected `mask` of dtype torch.bool (True = valid), got {m.dtype}")
    if channel_dim is None:
        want = tuple(x.shape)
    else:
        cd = channel_dim % x.dim()
        want = tuple(x.shape[:cd]) + tuple(x.shape[cd + 1 :])
    if tuple(m.shape) != want:
        extra = ""
        if channel_dim is not None:
            extra = f" (the input's shape {tuple(x.shape)} without channel axis {channel_dim})"
        raise ValueError(f"{where}: expected `mask` of shape {want}{extra}, got {tuple(m.shape)}")
    if m.device != x.device:
        raise ValueError(f"{where}: expected `mask` on the input's device {x.device}, got {m.device}")
    return m if channel_dim is None else m.unsqueeze(channel_dim % x.dim())


def layer_momentum(value: object, where: str) -> None:
    """A BatchNorm/InstanceNorm layer's ``momentum`` attribute (not None): a real number or a tensor,
    as torch's ops take it. ``float()`` would take ``"0.1"`` silently, where torch raises a TypeError.
    The layers call it for a value that is not exactly a float (their hot path asks that alone)."""
    if not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(f"{where}: expected `momentum` to be a float or None, got {value!r}")


def eps(value: object, where: str) -> None:
    """``eps`` of every op but BatchNorm's: a number, as torch accepts it -- a negative one too (torch's
    own test samples call ``layer_norm`` with ``eps=-0.5``) -- but not NaN, which would silently make
    every output NaN (``docs/differences.md``). BatchNorm keeps torch's stricter rule
    (``functional._check_momentum_eps``)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # NumPy scalars too, as torch
        raise TypeError(f"{where}: expected `eps` to be a float, got {value!r}")
    if value != value:
        raise ValueError(f"{where}: expected `eps` to be a number, got {value!r}")


def weight_offset(value: object, where: str) -> float:
    """``weight_offset`` of the ops that take one (the scale is ``weight + weight_offset``): a finite
    real number -- NaN would make every output NaN (as a NaN ``eps`` would), and an infinite offset
    every output infinite or NaN."""
    return finite(value, "weight_offset", where)


def finite(value: object, name: str, where: str) -> float:
    """A scalar setting that enters every output (a weight offset, DyT's/Derf's initial ``alpha`` and
    shift) as a float: a finite real number, not a bool -- NaN or an infinity would make every output NaN
    or infinite, and ``float()`` of a string names no argument ("could not convert string to float")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # NumPy's numbers too
        raise TypeError(f"{where}: expected `{name}` to be a float, got {type(value).__name__} {value!r}")
    # one comparison for an int (exact in Python, however large) and a float (NaN compares False): not
    # math.isfinite, which dynamo cannot trace on the symbolic float torch.compile(dynamic=True) makes of a
    # layer's float attribute (a graph break: an error under fullgraph=True)
    if not abs(value) <= _FLOAT_MAX:
        raise ValueError(f"{where}: expected `{name}` to be a finite number, got {value!r}")
    return float(value)


_FLOAT_MAX = sys.float_info.max


def positive_eps(eps: float, where: str) -> None:
    # a value that is not a real number (a string, a bool, a 0-d tensor) is a TypeError, as in every other
    # op's check (:func:`eps`; docs/differences.md); NumPy's floats are real numbers
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"{where}: expected `eps` to be a non-negative number, got {type(eps).__name__} {eps!r}")
    # ``not eps >= 0``, not ``eps < 0``: NaN compares False both ways, and a NaN eps makes every output
    # NaN (refused by every other op's check, :func:`eps`)
    if not eps >= 0:
        raise ValueError(f"{where}: expected `eps` to be a non-negative number, got {eps!r}")


def size(value: object, name: str, where: str, low: int = 1) -> int:
    """A size or count argument (``num_features``, ``num_groups``, ``head_dim``...) as a Python int: an
    integer of any kind torch.nn's constructors take -- NumPy's included, as ``numbers.Integral`` (what
    ``torch.nn.LayerNorm`` tests) -- but not a bool, a float or a tensor (a TypeError, as torch's ops
    give one), at least ``low`` (a ValueError)."""
    kind = "a positive" if low == 1 else "a non-negative" if low == 0 else f"an >= {low}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected `{name}` to be {kind} int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{where}: expected `{name}` to be {kind} int, got {value!r}")
    return int(value)


def num_features(value: object, where: str, makes_tensors: bool) -> object:
    """A BatchNorm constructor's ``num_features``. torch's hands it to ``torch.empty`` when the layer has a
    parameter or running statistic, which answers -1 with a RuntimeError ("Trying to create tensor with
    negative dimension -1") and 4.0 or True with "argument 'size' must be tuple of ints" -- neither names the
    argument; for those numbers, a TypeError or ValueError that does, before torch runs. Whatever else torch's
    constructor takes (any value without tensors -- ``affine=False, track_running_stats=False`` -- and a size
    ``torch.empty`` takes) goes to it as it came."""
    if not makes_tensors or not isinstance(value, (numbers.Number, str)):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected `num_features` to be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{where}: expected `num_features` to be a non-negative int, got {value!r}")
    return int(value)


def channel_dim(value: object, where: str) -> int:
    """A layer's ``channel_dim``, 1 or -1, as a Python int: an integer of any kind (NumPy's, and True as 1, as
    ``functional.batch_norm`` and torch's int arguments take it), not a float -- ``-1.0 == -1`` passed a
    ``in (1, -1)`` test, and the forward then indexed a shape with it (TypeError "tuple indices must be
    integers or slices, not float")."""
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected `channel_dim` to be an int, 1 or -1, got {value!r}")
    if value not in (1, -1):
        raise ValueError(f"{where}: expected `channel_dim` to be 1 or -1, got {value!r}")
    return int(value)


def normalized_shape(shape: int | Sequence[int] | torch.Size, where: str) -> tuple[int, ...]:
    """LayerNorm/RMSNorm's ``normalized_shape``: an int or a non-empty sequence of non-negative ints (a
    size of 0, an empty scope, is torch's too: ``torch.nn.LayerNorm(0)`` returns an empty output)."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):  # NumPy's too, as torch.nn.LayerNorm
        shape = (shape,)
    try:
        # operator.index, not int(): int() would accept "4" and 2.5 and raise ValueError on "a"
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        expected = "an int or a sequence of ints"
        raise TypeError(f"{where}: expected `normalized_shape` to be {expected}, got {shape!r}") from None
    if not out or any(s < 0 for s in out):
        # a size of 0 is torch's too (an empty scope: an empty output, as torch.nn.LayerNorm(0) gives)
        raise ValueError(f"{where}: expected `normalized_shape` to be non-empty with non-negative sizes, got {out}")
    return out


def trailing(x: Tensor, shape: tuple[int, ...], where: str) -> None:
    """The input ends with ``shape`` (LayerNorm/RMSNorm)."""
    k = len(shape)
    if x.dim() < k or x.shape[-k:] != shape:
        raise ValueError(
            f"{where}: expected input whose last {k} dimension(s) are normalized_shape={list(shape)}, "
            f"got input of shape {tuple(x.shape)}"
        )


def all_masked(mask: Tensor | None) -> bool:
    """Whether ``mask`` is given, non-empty and has no valid (True) element -- the training-time error
    of masked layers. Data-dependent, so it is not asked (False) where it cannot be answered without
    harm: on meta tensors (no values) and while torch.compile / the TorchScript tracer records (a Python
    bool of a tensor breaks the graph); an all-False mask there normalizes with no valid element and
    returns the bias. An empty batch is not "all masked": it returns empty, as torch does."""
    if mask is None or not mask.numel() or mask.device.type == "meta":
        return False
    if engine.tracing() or _batched(mask):
        return False
    return not bool(mask.any())


def _batched(t: Tensor) -> bool:
    """Whether ``t`` is batched by a torch.func.vmap (at any of the transforms' levels it is wrapped in):
    there a Python bool of its values is vmap's "data-dependent control flow" RuntimeError."""
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False


_functorch = torch._C._functorch
