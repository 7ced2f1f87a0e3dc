"""How the zoo tests import timm and torchvision, and the checks that the way they do it hides nothing.

timm needs torchvision, and the only torchvision wheel for the CPU torch pinned here (0.28.0 for
torch 2.13.0) is a CUDA build: its C++ library (``torchvision._C``) needs ``libc10_cuda`` and does not
load. torchvision's Python code copes with that (every op checks ``_has_ops()`` and says so) except
one spot: ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``qnms`` without checking, so ``import torchvision`` raises ``operator torchvision::nms does not
exist``. Installed into site-packages, that would break every ``import transformers`` too
(transformers imports torchvision when it is installed), so .ci/run installs both packages
(``--no-deps``: their other dependencies come with the ``integrations`` extra) into ``build/zoo``,
a folder only these tests put on ``sys.path``. When the C++ library does not load, the two op
schemas are declared (no kernel: calling ``nms`` still raises torchvision's own "Couldn't load custom
C++ ops") and the import is retried: the model code -- pure Python on torch's CPU ops -- then runs.
A torchvision whose C++ library loads is imported as it is.

``NORMSCOPE_ZOO`` names another folder; without timm the zoo tests skip, saying why.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

ZOO = Path(os.environ.get("NORMSCOPE_ZOO", Path(__file__).resolve().parents[2] / "build" / "zoo"))
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY: list[torch.library.Library] = []  # kept alive: a Library's definitions last as long as it does
_WHY: list[str] = []


def _import_torchvision():
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package: imported again below
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBRARY.append(lib)
    return importlib.import_module("torchvision")


def zoo_import(name: str):
    """``timm`` or ``torchvision`` (from :data:`ZOO` if it exists), or skip the test saying why."""
    if _WHY:
        pytest.skip(_WHY[0])
    if ZOO.is_dir() and str(ZOO) not in sys.path:
        sys.path.append(str(ZOO))
    try:
        _import_torchvision()
        return importlib.import_module(name)
    except ImportError as e:
        _WHY.append(
            f"{name} is not importable ({e}); .ci/run installs timm and torchvision into {ZOO} "
            "(python3 -m pip install -c constraints.txt --no-deps --target build/zoo timm torchvision)"
        )
        pytest.skip(_WHY[0])


def test_torchvision_models_run_and_its_ops_still_say_they_are_missing():
    tv = zoo_import("torchvision")
    from torchvision.models import resnet18
    from torchvision.ops import nms

    model = resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (1, 10)
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    if not tv.extension._has_ops():  # the declared schema has no kernel: torchvision's own message, not a wrong answer
        with pytest.raises(RuntimeError, match="Couldn't load custom C"):
            nms(boxes, torch.ones(1), 0.5)


def test_timm_imports_with_torchvisions_frozen_batchnorm():
    timm = zoo_import("timm")
    from timm.layers import create_norm

    tv_frozen = importlib.import_module("torchvision.ops.misc").FrozenBatchNorm2d
    assert create_norm.get_norm_layer("frozenbatchnorm2d") is tv_frozen
    assert timm.create_model("resnet18", num_classes=3).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
