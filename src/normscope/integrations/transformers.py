"""Run Hugging Face ``transformers`` models' normalization layers on normscope's engine, exactly.

Which classes, and how each rounds, is *discovered* from the installed transformers, not listed by
hand: every ``...RMSNorm`` / ``...LayerNorm`` class defined in a ``transformers.models.<type>.
modeling_<type>`` module is a candidate, and it is patched only if one normscope configuration
reproduces it **bit for bit** on random probes -- fp32, bf16, and an fp32 weight on bf16 input (the
``_keep_in_fp32_modules`` case) -- with random weights. The configurations tried (from
:func:`normscope.functional_modern.rms_norm` / ``layer_norm``):

    casting="llama", weight_offset=0    w * (x32 * rstd).to(x.dtype)            Llama, Mistral, Qwen2/3, Phi-3 ...
    casting="gemma", weight_offset=0    (w32 * x32 * rstd).to(x.dtype)          OLMo 2, ...
    casting="gemma", weight_offset=1    (x32 * rstd * (1 + w32)).to(x.dtype)    Gemma, Gemma 2/3, Qwen3-Next ...
    casting="torch"                     torch's own LayerNorm / RMSNorm          nn.LayerNorm subclasses ...

A class none of them reproduces -- another formula, another constructor, a forward with more
arguments (gated norms), parameters other than ``weight``/``bias`` -- is left alone, and the report
says why. QK-norms are instances of these same classes (Qwen3's and Gemma 3's ``q_norm`` over
``head_dim``, OLMo 2's over ``H * head_dim``), so they are covered with the rest.

A patched layer **stays an instance of its family's class**: patching makes a subclass of it
whose only change is ``forward`` (one call into normscope), and

* :func:`patch` (a built model) switches each layer's ``__class__`` to it, in place: the same
  module objects, Parameters, hooks, ``state_dict`` keys; each layer's own weights are probed too;
* :func:`patch_classes` (before a model exists, like Liger-Kernel's ``apply_liger_kernel_to_*``)
  puts it in place of the class in its modeling module, so models built afterwards --
  ``from_pretrained`` included -- are built with it. An instance built with constructor arguments
  other than the probed ones (``(dim, eps)``) keeps the original forward. :func:`unpatch_classes`
  restores the originals.

``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` themselves (BERT, GPT-2, ViT, ...) are replaced by
:class:`normscope.LayerNorm` / :class:`normscope.RMSNorm`, their subclasses, sharing the Parameters.

:class:`LlamaRMSNorm` and :class:`GemmaRMSNorm` are standalone layers with the two families'
casting orders, for models written outside transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import functional_modern as FM
from .._surgery import class_named, generated, named
from ..modules import LayerNorm, RMSNorm
from ._exact import (
    _OTHER_DTYPES,
    CONFIGURATIONS,
    Exact,
    _agree,
    _by_weight,
    _construct,
    _run,
    _shape,
    _why_unfit,
    probe_class,
)
from ._probe import probe_dtypes as _probe_dtypes
from ._probe import probe_input as _probe_input
from ._probe import randomized as _randomized
from ._probe import restore_classes
from ._probe import torch_agree as _torch_agree
from ._probe import torch_replacement as _torch_replacement

__all__ = [
    "LlamaRMSNorm",
    "GemmaRMSNorm",
    "PatchReport",
    "Exact",
    "patch",
    "patch_classes",
    "unpatch_classes",
    "families",
    "probe_class",
    "CONFIGURATIONS",
    "DoctorCallback",
]


_CANDIDATE = re.compile(r"^class (\w+(?:RMSNorm|LayerNorm))\(", re.M)
# (modeling module, class name) -> the original class, for unpatch_classes
_ORIGINAL_CLASSES: dict[tuple[str, str], type] = {}
# original class -> (its exact subclass or None, why not)
_PROBED: dict[type, tuple[type | None, str | None]] = {}


class LlamaRMSNorm(RMSNorm):
    r"""RMSNorm with Llama's rounding: normalize in fp32, cast to the input dtype, then scale.

    Paper: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".

    .. math:: y = \gamma \cdot \mathrm{cast}_{x}\!\left(\frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}}\right)

    A :class:`normscope.RMSNorm` (so ``isinstance(m, torch.nn.RMSNorm)``; ``weight`` means the
    same) whose only difference is where it rounds: torch's RMSNorm scales before casting, Llama
    after. The product ``weight * y`` follows type promotion, as in ``transformers`` (an fp32
    weight with bf16 activations gives fp32 output).

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square. Default: 1e-6 (``transformers``' default).

    Shape:
        - Input: (*, hidden_size). Output: same shape.

    Example::

        >>> norm = LlamaRMSNorm(4096, eps=1e-5)
        >>> y = norm(torch.randn(2, 7, 4096, dtype=torch.bfloat16))
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, True, device, dtype)

    @property
    def variance_epsilon(self) -> float:  # the attribute name transformers' code reads
        return self.eps

    def forward(self, x: Tensor) -> Tensor:
        return FM.rms_norm(x, self.normalized_shape, self.weight, self.eps, casting="llama")


class GemmaRMSNorm(nn.Module):
    r"""RMSNorm with Gemma's parametrization and rounding: scale by ``1 + weight`` in fp32, then cast.

    .. math:: y = \mathrm{cast}_{x}\!\left(\frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} (1 + w)\right)

    Not a ``torch.nn.RMSNorm``: its ``weight`` is an offset (initialized to zeros), and treating it
    as a scale (weight decay towards 0, conversion to another RMSNorm) would be wrong.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square. Default: 1e-6.

    Shape:
        - Input: (*, dim). Output: same shape and dtype.

    Example::

        >>> norm = GemmaRMSNorm(2048)
        >>> y = norm(torch.randn(2, 7, 2048, dtype=torch.bfloat16))
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return FM.rms_norm(x, self.normalized_shape, self.weight, self.eps, weight_offset=1.0, casting="gemma")

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


@dataclass
class PatchReport:
    """What :func:`patch` (``unit="layer"``) or :func:`patch_classes` (``unit="class"``) did:
    ``replaced[class name] = count`` (layers patched, or 1 per class), ``skipped[class name] = why``,
    and ``how[class name]``: the normscope configuration that reproduces it."""

    replaced: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)
    unit: str = "layer"

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    def __str__(self) -> str:
        noun = "normalization layer(s)" if self.unit == "layer" else "normalization class(es)"
        lines = [f"normscope patched {self.total} {noun}"]
        for name, n in sorted(self.replaced.items()):
            how = f" as {self.how[name]}" if name in self.how else ""
            lines.append(f"  {name}: {n} replaced{how}" if self.unit == "layer" else f"  {name}: patched{how}")
        lines += [f"  {name}: skipped ({why})" for name, why in sorted(self.skipped.items())]
        return "\n".join(lines)


# -- discovery -------------------------------------------------------------------------------------


_FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {}


def families() -> dict[str, tuple[tuple[str, str], ...]]:
    """Every model type of the installed transformers with candidate norm classes:
    ``{model type: ((modeling module, class name), ...)}``.

    A text scan of ``transformers/models/*/modeling_*.py`` for ``class ...RMSNorm(`` and ``class
    ...LayerNorm(``: cheap, imports nothing; whether a candidate is patched is decided by probing
    it (:func:`probe_class`)."""
    if not _FAMILIES:
        spec = importlib.util.find_spec("transformers")
        if spec is None or spec.origin is None:
            raise ImportError(
                "normscope.integrations.transformers needs transformers (pip install normscope[integrations])"
            )
        root = os.path.join(os.path.dirname(spec.origin), "models")
        for model_type in sorted(os.listdir(root)):
            folder = os.path.join(root, model_type)
            if not os.path.isdir(folder):
                continue
            found = []
            for fname in sorted(os.listdir(folder)):
                if fname.startswith("modeling_") and fname.endswith(".py"):
                    with open(os.path.join(folder, fname), encoding="utf-8") as f:
                        names = _CANDIDATE.findall(f.read())
                    module = f"transformers.models.{model_type}.{fname[:-3]}"
                    found += [(module, n) for n in dict.fromkeys(names)]
            if found:
                _FAMILIES[model_type] = tuple(found)
    return dict(_FAMILIES)


def _instance_matches(
    m: nn.Module, original: type, how: Exact, unreproduced: frozenset = frozenset(), probed: dict | None = None
) -> str | None:
    """Probe ``m`` itself, with its own weights: in their dtype, and on bf16 input (a constructor
    option the class probe did not see changes the bits here). A dtype in ``unreproduced`` is not
    probed: the patched layer runs the original forward on it. Weights on the meta device (a model
    built before its checkpoint is loaded) are checked as ``verify=False`` checks them (:func:`_unprobed`,
    ``probed``: the class probe instance's options)."""
    w = getattr(m, "weight", None)
    if isinstance(w, Tensor) and w.is_meta:  # nothing to run on: the class probe stands, for a layer made as its was
        return _unprobed(m, original, _options(_construct(original)) if probed is None else probed)
    why = _why_unfit(m, original.forward)
    if why is not None:
        return why
    device = w.device if isinstance(w, Tensor) else torch.device("cpu")
    dtype = w.dtype if isinstance(w, Tensor) and w.is_floating_point() else torch.float32
    for xdtype in _probe_dtypes(dtype):
        if xdtype in unreproduced:
            continue
        try:
            miss = _agree(original.forward, m, _probe_input(_shape(m), xdtype, device), how)
        except (TypeError, ValueError, RuntimeError) as e:  # an instance option the class probe did not see
            # (ConvNext's data_format="channels_first" permutes a 4-D input): a probe that raises is a mismatch
            miss = f"raised {type(e).__name__}: {e}"
        if miss is not None:
            return f"this layer {miss} on {xdtype} input"
    return None


# -- the exact subclasses ------------------------------------------------------------------------

_NAMES_OK = {"eps", "variance_epsilon", "epsilon", "device", "dtype"}


def _as_probed(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """Whether a constructor call gives what the class probe built: the size, eps, device and
    dtype may differ; every other argument must be its default."""
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return False
    names = list(signature.parameters)
    for name, value in bound.arguments.items():
        if name in (names[0], names[1]) or name in _NAMES_OK:
            continue
        default = signature.parameters[name].default
        if default is inspect.Parameter.empty or type(value) is not type(default) or value != default:
            return False
    return True


def _options(m: nn.Module) -> dict[str, object]:
    """The options a layer records as plain attributes (a str or a bool: ConvNext's ``data_format``,
    Gemma 3n's ``with_scale``), where its size and eps are numbers."""
    found = vars(m).items()
    return {k: v for k, v in found if not k.startswith("_") and k != "training" and isinstance(v, (str, bool))}


def _unprobed(m: nn.Module, original: type, probed: dict[str, object]) -> str | None:
    """What :func:`patch` checks of a layer without probing it (``verify=False``): that it is made as the
    class probe's instance was -- the same structure (:func:`_why_unfit`) and the same options (``probed``:
    :func:`_options` of that instance); None if it is."""
    why = _why_unfit(m, original.forward)
    if why is not None:
        return why
    mine = _options(m)
    other = {k: mine[k] for k, v in probed.items() if k in mine and mine[k] != v}
    if other:
        return f"built with options the class probe did not see ({other})"
    return None


def _unreproduced(cls: type, how: Exact) -> frozenset[torch.dtype]:
    """The dtypes of :data:`_OTHER_DTYPES` on which ``how`` does not give ``cls``'s bits (probed as
    :func:`probe_class` probes, with weights and input in that dtype)."""
    missed = set()
    for dtype in _OTHER_DTYPES:
        m = _randomized(_construct(cls), dtype)
        try:
            miss = _agree(cls.forward, m, _probe_input(_shape(m), dtype, torch.device("cpu")), how)
        except Exception as e:  # noqa: BLE001 -- a probe that raises is a mismatch: the original runs there
            miss = f"raised {type(e).__name__}"
        if miss is not None:
            missed.add(dtype)
    return frozenset(missed)


def _exact_subclass(original: type, how: Exact) -> type:
    """A subclass of ``original`` whose ``forward`` is normscope's ``how``, for instances that are
    as probed (``_normscope_exact``) and input in a dtype ``how`` reproduces; anything else runs
    ``original.forward``."""
    signature = inspect.signature(original.__init__)
    unreproduced = _unreproduced(original, how)

    def __init__(self, *args, **kwargs):
        original.__init__(self, *args, **kwargs)
        self._normscope_exact = _as_probed(signature, args, kwargs)

    by_weight = None if how.centered else _by_weight(how)  # the settings of the call, built once

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not self.__dict__.get("_normscope_exact", False) or hidden_states.dtype in unreproduced:
            return original.forward(self, hidden_states)
        return _run(self, hidden_states, how, by_weight)

    key = f"_Exact_{original.__module__.replace('.', '_')}_{original.__qualname__.replace('.', '_')}"
    sub = generated(
        original.__name__,
        (original,),
        {
            "__init__": __init__,
            "forward": forward,
            "__module__": __name__,
            "__qualname__": key,  # found here by pickle; the name stays the family's
            "__doc__": f"{original.__name__} computed by normscope as {how} (bit for bit; see "
            f"normscope.integrations.transformers).\n\n{original.__doc__ or ''}",
            "_normscope_original": original,
            "_normscope_how": how,
            "_normscope_unreproduced": unreproduced,
            "_normscope_options": _options(_construct(original)),  # of the class probe's instance
        },
        # pickled as: made again (probed) in the process that loads it
        None if named(original) is None else (_rebuilt, named(original)),
    )
    setattr(sys.modules[__name__], key, sub)
    return sub


def _rebuilt(module: str, qualname: str) -> type:
    """The class of a patched layer loaded from a pickle: the exact subclass of the family's class
    ``module.qualname`` probed in this process, or that class itself where no configuration reproduces it
    here (its own forward runs)."""
    original = class_named(module, qualname)
    sub, _ = _subclass_for(original)
    return original if sub is None else sub


def _subclass_for(cls: type) -> tuple[type | None, str | None]:
    """The exact subclass of ``cls`` (probed once per class), or ``(None, why not)``."""
    original = getattr(cls, "_normscope_original", cls)
    if original not in _PROBED:
        how, why = probe_class(original)
        _PROBED[original] = (None, why) if how is None else (_exact_subclass(original, how), None)
    return _PROBED[original]


def _candidate(cls: type) -> bool:
    if cls in (LayerNorm, RMSNorm, LlamaRMSNorm, GemmaRMSNorm) or "_normscope_original" in cls.__dict__:
        return False
    return cls.__name__.endswith(("RMSNorm", "LayerNorm")) and cls not in (nn.LayerNorm, nn.RMSNorm)


# -- patching --------------------------------------------------------------------------------------


def patch(model: nn.Module, *, verify: bool = True) -> PatchReport:
    """Run a built ``transformers`` model's normalization layers on normscope, in place.

    Every layer of a class that a normscope configuration reproduces bit for bit (see the module
    docstring) keeps its identity -- same object, same Parameters, still an instance of its class --
    with its class switched to the exact subclass; ``torch.nn.LayerNorm``/``RMSNorm`` layers are
    replaced by normscope's subclasses sharing their Parameters, with their hooks moved over
    (:func:`normscope.convert`).

    Args:
        model: any ``torch.nn.Module`` (a ``PreTrainedModel`` or a part of one).
        verify: also probe each layer with its own weights (in their dtype and bf16) before
            switching it; a layer that differs is left alone and reported. The class is always
            probed (that is how its configuration is found); with ``verify=False`` a layer is still
            left alone and reported where its structure or its str/bool options (ConvNext's
            ``data_format``, Gemma 3n's ``with_scale``) are not those of the class probe's instance.
            Default: True.

    Returns:
        A printable :class:`PatchReport`: layers replaced per class, classes skipped and why.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from normscope.integrations.transformers import patch
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=4, intermediate_size=64, vocab_size=100))
        >>> print(patch(model))
        normscope patched 5 normalization layer(s)
          LlamaRMSNorm: 5 replaced as rms_norm(casting='llama', weight_offset=0)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(verify, bool):  # "no" is truthy: a string here would verify, silently
        raise TypeError(f"patch: expected `verify` to be a bool, got {verify!r}")
    from torch.nn.utils import parametrize

    from ..convert import convert

    report = PatchReport()
    checked: dict[type, str | None] = {}
    for parent in list(model.modules()):
        for child in list(parent.children()):
            cls = type(child)
            name = cls.__name__
            if cls in (nn.LayerNorm, nn.RMSNorm):
                if verify and cls not in checked:
                    checked[cls] = _torch_agree(child, _torch_replacement(child))
                if checked.get(cls) is not None:
                    report.skipped[name] = checked[cls]
                elif parametrize.is_parametrized(child):
                    report.skipped[name] = "parametrized weight or bias (weight_norm, spectral_norm): not carried over"
                continue  # replaced below, by convert
            elif _candidate(cls) or "_normscope_original" in cls.__dict__:
                original = getattr(cls, "_normscope_original", cls)
                sub, why = _subclass_for(original)
                if sub is None:
                    report.skipped[name] = why
                    continue
                how, unreproduced = sub._normscope_how, sub._normscope_unreproduced
                if verify:
                    why = _instance_matches(child, original, how, unreproduced, sub._normscope_options)
                else:
                    why = _unprobed(child, original, sub._normscope_options)
                if why is not None:
                    report.skipped[name] = why
                    continue
                child.__class__ = sub
                child._normscope_exact = True
                report.how[name] = str(sub._normscope_how)
            else:
                continue
            report.replaced[name] = report.replaced.get(name, 0) + 1

    # torch.nn's own layers become normscope's namesakes through convert, which moves their hooks, mode and
    # attributes with their Parameters and replaces a layer registered at several paths at every one of them
    # (a new layer object in place of the old, as the model itself is kept: not the root)
    def chosen(path: str, m: nn.Module) -> bool:
        cls = type(m)
        return (
            bool(path)
            and cls in (nn.LayerNorm, nn.RMSNorm)
            and checked.get(cls) is None
            and (not parametrize.is_parametrized(m))
        )

    for r in convert(model, where=chosen)[1]:
        name = r.source.split("(")[0].split(".")[-1]
        report.replaced[name] = report.replaced.get(name, 0) + 1
    return report


def patch_classes(*model_types: str) -> PatchReport:
    """Make ``transformers`` build normscope-backed norms for these model families, before any model exists.

    Each candidate class of each family (:func:`families`) that a normscope configuration
    reproduces bit for bit (:func:`probe_class`) is replaced, in its modeling module -- and in any
    loaded ``transformers.models`` module that imported it -- by its exact subclass, so models
    built afterwards (``Model(config)``, ``from_pretrained``) hold layers that are still instances
    of the family's class. Models built before are untouched (use :func:`patch` for those).

    Args:
        *model_types: keys of :func:`families` (``"llama"``, ``"qwen3"``, ``"gemma3"``, ``"olmo2"``,
            ...). Default: every family of the installed transformers (this imports each modeling
            module: tens of seconds).

    Returns:
        A :class:`PatchReport` with ``unit="class"``: ``replaced[class name] = 1`` per class
        patched, ``skipped`` with why, ``how`` with the configuration.

    Example::

        >>> from normscope.integrations.transformers import patch_classes, unpatch_classes
        >>> report = patch_classes("llama")
        >>> report.replaced
        {'LlamaRMSNorm': 1}
        >>> # from now on, LlamaForCausalLM(config) or .from_pretrained(path) runs its norms on normscope
        >>> unpatch_classes()
        ['LlamaRMSNorm']
    """
    not_names = [t for t in model_types if not isinstance(t, str)]
    if not_names:
        raise TypeError(f"patch_classes: expected model type names (strings, as separate arguments), got {not_names!r}")
    found = families()
    unknown = [t for t in model_types if t not in found]
    if unknown:
        some = ", ".join(sorted(found)[:12])
        raise ValueError(
            f"patch_classes: unknown model type(s) {unknown}: expected model types of the installed transformers "
            f"with RMSNorm/LayerNorm classes ({len(found)} of them, e.g. {some}, ...; see families())"
        )
    report = PatchReport(unit="class")
    for model_type in model_types or tuple(found):
        for module_name, name in found[model_type]:
            try:
                module = importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001 -- optional dependencies of a family: reported, not fatal
                report.skipped[name] = f"{module_name} is not importable ({type(e).__name__}: {e})"
                continue
            current = getattr(module, name, None)
            if not isinstance(current, type) or not issubclass(current, nn.Module):
                report.skipped[name] = f"{module_name} has no class {name}"
                continue
            original = current.__dict__.get("_normscope_original", current)
            sub, why = _subclass_for(original)
            if sub is None:
                report.skipped[name] = why
                continue
            for mod in [m for k, m in list(sys.modules.items()) if k.startswith("transformers.models.")]:
                if mod is not None and mod.__dict__.get(name) is original:
                    _ORIGINAL_CLASSES.setdefault((mod.__name__, name), original)
                    setattr(mod, name, sub)
            report.replaced[name] = 1
            report.how[name] = str(sub._normscope_how)
    return report


def unpatch_classes() -> list[str]:
    """Undo :func:`patch_classes`: put the original classes back; returns their names (once each)."""
    return restore_classes(_ORIGINAL_CLASSES)


# ---------------------------------------------------------------------------------------------- training


class DoctorCallback:
    """A ``transformers.TrainerCallback`` that watches the model's norms during ``Trainer.train()``.

    A thin wrapper over :func:`normscope.watch`, counted in the Trainer's optimizer steps
    (``state.global_step``: the forwards of gradient accumulation belong to one step). Each finding is
    logged once through transformers' logging (the ``transformers.normscope`` logger, at the Trainer's
    log level) when the Trainer logs (``on_log``), and the counts per severity join the logs
    (``normscope/errors``, ``normscope/warnings``, ``normscope/infos``, and ``normscope/non_finite_step``
    once an inf/NaN was seen) for the callbacks after this one and ``trainer.state.log_history``. At the
    end of training the report is written to ``args.output_dir`` (``filename``, and the same name with
    ``.html``), by the main process. With ``stop_on="non-finite"`` training stops at the end of the step
    in which a norm first saw inf or NaN.

    transformers is not imported here: the Trainer calls every ``on_*`` method a callback has, and this
    class answers the events it does not use with nothing.

    Args:
        every: record the norms' statistics every ``every`` optimizer steps. Default: 50.
        stop_on: None, or ``"non-finite"``. Default: None.
        checks: the checks to run, as :func:`normscope.watch` takes them. Default: all.
        filename: the report's file name in the output directory, None for none. Default:
            ``"normscope-watch.json"``.

    With ``model``, ``args`` and ``data`` of your own::

        from normscope.integrations.transformers import DoctorCallback

        callback = DoctorCallback(every=50, stop_on="non-finite")
        trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[callback])
        trainer.train()   # the report: args.output_dir/normscope-watch.json and .html
    """

    def __init__(
        self,
        every: int = 50,
        *,
        stop_on: str | None = None,
        checks: list[str] | None = None,
        filename: str | None = "normscope-watch.json",
    ) -> None:
        from ._callback import Watcher, check_options

        check_options("DoctorCallback", every, stop_on, filename)
        self.filename = filename
        self.report_path = None
        logger = logging.getLogger("transformers.normscope")
        self._watcher = Watcher("DoctorCallback", every, checks, stop_on, logger)

    @property
    def watch(self):
        """The :class:`normscope.doctor.Watch` of the current (or last) training run, None before one."""
        return self._watcher.watch

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._watcher.start(model, state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._watcher.step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._watcher.should_stop():
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        figures = self._watcher.log()
        if logs is not None:
            logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        write = bool(getattr(state, "is_world_process_zero", True))
        self.report_path = self._watcher.finish(getattr(args, "output_dir", None), self.filename, write)

    def __getattr__(self, name: str):
        if name.startswith("on_"):  # an event this callback does not use (the Trainer calls them all)
            return _no_event
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _no_event(*args, **kwargs) -> None:
    return None
