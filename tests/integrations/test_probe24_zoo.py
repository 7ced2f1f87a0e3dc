"""Model integrations probed from outside: patched Hugging Face models in the dtypes they are run in, and
layers built with options the class probe did not see.

Tiny random models built from configs (nothing downloaded); the oracle is the unpatched model (a deepcopy)
on the same input: logits must be the same bits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from normscope.integrations import transformers as hf

transformers = pytest.importorskip("transformers")


def _bert():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).eval(), torch.randint(0, 100, (2, 7))


def _convnext():
    config = transformers.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_channels=3, image_size=32, num_labels=5
    )
    torch.manual_seed(0)
    return transformers.ConvNextForImageClassification(config).eval(), torch.randn(2, 3, 32, 32)


def _patched_logits_equal(make, dtype, **kwargs):
    model, x = make()
    model = model.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    patched = copy.deepcopy(model)
    report = hf.patch(patched, **kwargs)
    with torch.no_grad():
        assert torch.equal(patched(x).logits, model(x).logits), str(report)
    return patched, report


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("make", [_bert, _convnext], ids=["bert", "convnext"])
def test_patch_a_model_in_fp16_or_fp64_with_torch_layernorms(make, dtype):
    """``patch`` on an fp16 or fp64 model whose norms are nn.LayerNorm (or subclasses of it) used to raise
    torch's "mixed dtype (CPU)": its probe ran bf16 input on the fp16/fp64 weights, a pair torch's CPU
    LayerNorm refuses. The model is patched and its logits are the original's bits."""
    _, report = _patched_logits_equal(make, dtype)
    assert report.replaced.get("LayerNorm", 0) >= 1, str(report)


def test_patch_leaves_convnext_channels_first_layers_to_their_own_forward():
    """HF ConvNext's ``ConvNextLayerNorm(data_format="channels_first")`` permutes a 4-D input: the probe with
    the layer's own weights raised on the (3, 5, C) probe input and ``patch`` crashed. Such a layer is now
    left alone and reported; the channels_last ones are patched; logits are the original's bits."""
    patched, report = _patched_logits_equal(_convnext, torch.float32)
    assert "ConvNextLayerNorm" in report.skipped and report.replaced.get("ConvNextLayerNorm", 0) >= 1, str(report)
    for m in patched.modules():
        if type(m).__name__ == "ConvNextLayerNorm":
            assert hasattr(type(m), "_normscope_how") == (m.data_format == "channels_last")
