"""The ``"reference"`` backend: :mod:`normscope.reference`'s plain PyTorch ops, any scope, any device.

Last in the automatic order: it runs every call it is given (masks of any shape, uncentered
scopes, any axes), so it is what runs where no fast path applies, and what every fast path is
tested against. Its steps are the engine's two: moments -> (running statistics) -> rstd -> apply.
"""

from __future__ import annotations

from torch import Tensor

from .. import engine
from .. import reference as ref
from .._strides import fills_memory
from ..engine import Backend, Call, Runner

NAME = "reference"


def run(call: Call) -> Tensor:
    r, x = call.running, call.x
    # one cast to the accumulation dtype: the gradient's two paths (through the statistics and
    # through the normalized value) then meet in fp32 and are rounded to a half type once, not twice
    xf = x.to(ref.acc_dtype(x.dtype))
    if x.dim() > 1 and 0 not in call.scope.reduce and not fills_memory(x.shape[1:], x.stride()[1:]):
        # per-sample scopes of a sample with gaps (a (C, B, L) tensor viewed as (B, C, L), a transposed
        # (D, B) one as (B, D)): ATen's reductions and autograd's sums merge the axes of such a view
        # one way for a sample alone and another for a batch, so a sample's bits depended on the batch
        # size (scope isolation). A contiguous copy (decided on x: ``.to`` lays a copy out in an order
        # of its own) gives every sample one layout, alone or not
        xf = xf.contiguous()
    if r is not None and not r.use_input_stats:
        mean, rstd = engine.running_as_stats(call)
    else:
        m = ref.moments(xf, call.scope, call.mask)
        if r is not None:
            engine.update_running(call, m)
        constant_bias = call.eps == 0 and ref.constant_gives_bias(call.scope, call.op, call.x.device)
        mean, rstd = m.mean, ref.rstd(m.var, call.eps, m.count, constant_bias)
    if call.casting != "torch" or call.weight_offset != 0.0:  # a model family's affine and rounding
        y = ref.apply(xf, mean, rstd, call.scope, None, None, call.mask)
        return ref.cast_affine(y, call.scope, call.weight, call.bias, call.weight_offset, call.casting, x.dtype)
    return ref.apply(xf, mean, rstd, call.scope, call.weight, call.bias, call.mask).to(x.dtype)


def why_not(call: Call) -> str | None:
    r = call.running
    if r is not None and not r.use_input_stats and (r.mean is None or r.var is None):
        return "evaluation with running statistics needs running mean and var"
    return None


def prepare(call: Call, automatic: bool) -> Runner:
    return run


BACKEND = Backend(NAME, why_not, prepare)
