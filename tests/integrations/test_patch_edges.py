"""Model integrations probed from outside: patched Hugging Face and diffusers models in the dtypes they are
run in or cast to, and layers built with options the class probe did not see.

Tiny random models built from configs (nothing downloaded); the oracle is the unpatched model (a deepcopy)
on the same input, cast the same way: outputs must be the same bits.
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


def _aura_layer():
    from diffusers.models.normalization import AdaLayerNormZero

    layer = AdaLayerNormZero(16, bias=False, norm_type="fp32_layer_norm")
    g = torch.Generator().manual_seed(2)
    x, emb = torch.randn(2, 5, 16, generator=g), torch.randn(2, 16, generator=g)
    return layer, lambda m, dtype: m(x.to(dtype), emb=emb.to(dtype))


def _aura_model():
    import diffusers

    model = diffusers.AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 3, 16, generator=g)
    t = torch.tensor([3, 7])
    return model, lambda m, dtype: m(hidden_states=x.to(dtype), encoder_hidden_states=ctx.to(dtype), timestep=t).sample


@pytest.mark.parametrize("make", [_aura_layer, _aura_model], ids=["AdaLayerNormZero", "AuraFlow"])
def test_diffusers_adaptive_norm_patched_then_cast_to_float64_keeps_the_bits(make):
    """An ``AdaLayerNormZero(norm_type="fp32_layer_norm")`` (AuraFlow's) patched in fp32, then the model
    cast to fp64: its FP32LayerNorm rounds fp64 input to fp32, normscope's AdaLayerNorm computed in fp64,
    and the output differed from the original cast the same way (by 3.4e-6 on AuraFlow). The adaptive
    norms now run diffusers' forward on a dtype their configuration does not reproduce, as the plain ones do."""
    pytest.importorskip("diffusers")
    from normscope.integrations import diffusers as ND

    torch.manual_seed(0)
    original, run = make()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random weights: adaLN-Zero's zero projections would hide the modulation
        for p in original.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    original.eval()
    model = copy.deepcopy(original)
    assert ND.patch(model).replaced.get("AdaLayerNormZero", 0) >= 1
    original, model = original.double(), model.double()
    with torch.no_grad():
        want, got = run(original, torch.float64), run(model, torch.float64)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_patch_without_verify_leaves_layers_built_with_other_options_alone():
    """``patch(verify=False)`` switched every layer of a probed class, whatever its options: HF ConvNext's
    channels_first ConvNextLayerNorm then normalized the wrong axis (a tiny ConvNext's logits differed, with
    W == C no error), and Gemma 3n's ``Gemma3nRMSNorm(with_scale=False)`` raised a TypeError on its first
    call. Such layers are now left alone and reported, without a probe."""
    patched, report = _patched_logits_equal(_convnext, torch.float32, verify=False)
    assert "data_format" in report.skipped["ConvNextLayerNorm"] and report.replaced["ConvNextLayerNorm"] == 2
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    norm = Gemma3nRMSNorm(16, eps=1e-6, with_scale=False)
    report = hf.patch(torch.nn.Sequential(norm), verify=False)
    assert "Gemma3nRMSNorm" in report.skipped and not report.replaced
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4))
    assert torch.equal(norm(x), Gemma3nRMSNorm.forward(norm, x))



def _tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert hf.patch(model).replaced == {"LlamaRMSNorm": 3}
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(ids).logits, hf, {"_PROBED": {}}


def _tiny_dit(classes: bool = False):
    """A DiT patched by ``patch``, or built after ``patch_classes`` (pickled while its classes are patched)."""
    diffusers = pytest.importorskip("diffusers")
    from normscope.integrations import diffusers as ND

    if classes:
        ND.patch_classes("AdaLayerNormZero")
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()  # fmt: skip
    assert classes or ND.patch(model).replaced.get("AdaLayerNormZero") == 1
    assert hasattr(type(model.transformer_blocks[0].norm1), "_normscope_how")
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    call = lambda m: m(x, timestep=torch.tensor([3, 7]), class_labels=torch.tensor([1, 2])).sample  # noqa: E731
    return model, call, ND, {"_PROBED": {}, "_SUBCLASSES": {}, "_UNREPRODUCED": {}}


def _timm_normact():
    import importlib

    from test_zoo_setup import zoo_import

    import normscope

    C = importlib.import_module("normscope._surgery")  # where the classes convert makes at run time live
    layers = zoo_import("timm").layers
    model, _ = normscope.convert(torch.nn.Sequential(layers.BatchNormAct2d(8, act_layer=torch.nn.SiLU).eval()))
    x = torch.randn(2, 8, 3, 3, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x), C, {"_THEN": {}}


@pytest.mark.parametrize(
    "make",
    [_tiny_llama, _tiny_dit, lambda: _tiny_dit(classes=True), _timm_normact],
    ids=["transformers", "diffusers", "diffusers patch_classes", "convert"],
)
def test_a_patched_or_converted_model_pickled_whole_loads_where_its_classes_were_never_made(make, monkeypatch):
    """``torch.save(model)`` of a patched (transformers, diffusers) or converted (a timm NormAct) model
    pickled its layers' classes by a name that exists only in the process that made them: ``torch.load`` in
    another process (or a worker started by spawn) raised "Can't get attribute '_Exact_..._LlamaRMSNorm'"
    / "'_Then_BatchNorm2d'". Here the other process is this one with those classes and the caches that
    made them removed; the loaded model gives the saved output, bit for bit."""
    import io

    model, call, module, caches = make()
    with torch.no_grad():
        want = call(model)
    generated = {type(m) for m in model.modules() if type(m).__module__ == module.__name__}
    assert generated, "nothing generated to remove"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for cls in generated:  # a process that has not made them
        monkeypatch.delattr(module, cls.__qualname__)
    for name, empty in caches.items():
        monkeypatch.setattr(module, name, empty)
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=False)
    finally:
        if module.__name__.endswith("diffusers"):
            module.unpatch_classes()
    with torch.no_grad():
        assert torch.equal(call(loaded), want)


def test_patch_a_model_on_the_meta_device_leaves_layers_built_with_other_options_alone():
    """A layer with meta weights (a model built before its checkpoint is loaded) has nothing to probe, and
    ``patch`` switched it whatever its options: a channels_first ConvNextLayerNorm then gave other numbers
    once its weights were loaded. It is now checked as ``verify=False`` checks a layer; a Llama norm on the
    meta device is still patched."""
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    loaded = torch.nn.Sequential(ConvNextLayerNorm(16, eps=1e-6, data_format="channels_first"), LlamaRMSNorm(5))
    with torch.no_grad():
        for p in loaded.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + 1)
    with torch.device("meta"):
        model = torch.nn.Sequential(ConvNextLayerNorm(16, eps=1e-6, data_format="channels_first"), LlamaRMSNorm(5))
    report = hf.patch(model)
    assert "data_format" in report.skipped["ConvNextLayerNorm"] and report.replaced == {"LlamaRMSNorm": 1}
    model.to_empty(device="cpu").load_state_dict(loaded.state_dict())
    x = torch.randn(2, 16, 4, 5, generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(x), loaded(x))


def test_diffusers_patch_a_model_on_the_meta_device():
    """``diffusers.patch`` on a model built on the meta device (before its checkpoint is loaded) raised
    NotImplementedError (``aten::equal`` on meta tensors) from the adaptive norms' probe, which runs on random
    weights and now runs them on the CPU. Once the weights are loaded the outputs are the original's bits."""
    pytest.importorskip("diffusers")
    from diffusers.models.normalization import AdaLayerNormZero, RMSNorm

    from normscope.integrations import diffusers as ND

    def build():
        return torch.nn.ModuleList([RMSNorm(16, eps=1e-6), AdaLayerNormZero(16, norm_type="fp32_layer_norm")])

    torch.manual_seed(0)
    loaded = build()
    with torch.no_grad():
        for p in loaded.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    with torch.device("meta"):
        model = build()
    report = ND.patch(model)
    assert report.replaced.get("AdaLayerNormZero") == 1 and report.replaced.get("RMSNorm") == 1, str(report)
    model.to_empty(device="cpu").load_state_dict(loaded.state_dict())
    g = torch.Generator().manual_seed(4)
    x, emb = torch.randn(2, 3, 16, generator=g), torch.randn(2, 16, generator=g)
    with torch.no_grad():
        assert torch.equal(model[0](x), loaded[0](x))
        assert all(torch.equal(a, b) for a, b in zip(model[1](x, emb=emb), loaded[1](x, emb=emb)))
