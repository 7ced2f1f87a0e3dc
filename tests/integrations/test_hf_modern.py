"""Hugging Face patching across the families normscope reproduces, QK-norms included.

Tiny random models built from configs (nothing downloaded). The contract: a patched layer stays
an instance of its family's class, and the logits are the same bits before and after patching,
in fp32 and bf16; a class that normscope does not reproduce exactly is refused with a reason.
"""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch

import normscope.functional_modern as FM
from normscope.integrations import transformers as hf

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=100,
)

# model type -> (config class, model class, norm class name, expected norm layers, has QK-norm)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm", 5, False),
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralRMSNorm", 5, False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2RMSNorm", 5, False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3RMSNorm", 9, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "GemmaRMSNorm", 5, False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "Gemma2RMSNorm", 9, False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma3RMSNorm", 13, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "Olmo2RMSNorm", 9, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi3RMSNorm", 5, False),
}


@pytest.fixture(autouse=True)
def _restore():
    yield
    hf.unpatch_classes()


def _original(model_type: str):
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    name = FAMILIES[model_type][2]
    cls = getattr(modeling, name)
    return getattr(cls, "_normscope_original", cls)


def _build(model_type: str, dtype: torch.dtype):
    cfg_name, model_name, *_ = FAMILIES[model_type]
    config = getattr(transformers, cfg_name)(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norm weights: Gemma's zeros and Llama's ones would hide 1 + w versus w
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3 + 0.2)
    return model.to(dtype)


IDS = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_keeps_class_and_logits_bitwise(model_type, dtype):
    _, _, name, count, qk = FAMILIES[model_type]
    original = _original(model_type)
    model = _build(model_type, dtype)
    with torch.no_grad():
        before = model(IDS).logits
    patched = copy.deepcopy(model)
    report = hf.patch(patched)
    assert report.replaced == {name: count} and not report.skipped, str(report)
    assert f"normscope patched {count} normalization layer(s)" in str(report)
    norms = [m for m in patched.modules() if isinstance(m, original)]
    assert len(norms) == count and all(type(m)._normscope_original is original for m in norms)
    if qk:  # the attention's q_norm / k_norm are the same class: patched with the rest
        attn = patched.model.layers[0].self_attn
        assert hasattr(type(attn.q_norm), "_normscope_how") and hasattr(type(attn.k_norm), "_normscope_how")
    assert patched.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        after = patched(IDS).logits
    assert after.dtype == before.dtype and torch.equal(after, before)


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_patched_model_cast_to_another_dtype_keeps_the_logits(model_type, dtype):
    """A model patched in fp32, then cast to fp16 or fp64 (dtypes the class probe's fp32/bf16 runs do
    not cover), gives the bits of the unpatched model cast the same way: the families round fp64 input
    down to fp32 (``.to(torch.float32)``), so there the patched layer runs the original forward. A model
    patched in fp64 is patched (not refused) and keeps its logits too."""
    _, _, name, count, _ = FAMILIES[model_type]
    model = _build(model_type, torch.float32)
    patched = copy.deepcopy(model)
    hf.patch(patched)
    with torch.no_grad():
        assert torch.equal(patched.to(dtype)(IDS).logits, model.to(dtype)(IDS).logits)
    again = copy.deepcopy(_build(model_type, dtype))
    report = hf.patch(again)
    assert report.replaced == {name: count} and not report.skipped, str(report)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_classes_keeps_isinstance_and_logits_bitwise(model_type, dtype):
    _, _, name, count, _ = FAMILIES[model_type]
    original = _original(model_type)
    reference = _build(model_type, dtype)
    with torch.no_grad():
        expected = reference(IDS).logits
    report = hf.patch_classes(model_type)
    assert report.replaced == {name: 1}, str(report)
    assert "normscope patched 1 normalization class(es)" in str(report)  # classes, not layers
    model = _build(model_type, dtype)
    norms = [m for m in model.modules() if type(m).__name__ == name]
    assert len(norms) == count
    assert isinstance(model.model.norm, original)  # e.g. isinstance(m.model.norm, Qwen2RMSNorm)
    assert all(type(m) is not original and m._normscope_exact for m in norms)
    with torch.no_grad():
        got = model(IDS).logits
    assert torch.equal(got, expected)
    assert hf.unpatch_classes() == [name]
    assert all(type(m) is original for m in _build(model_type, dtype).modules() if type(m).__name__ == name)


def test_discovery_finds_the_families_and_the_configurations():
    found = hf.families()
    for model_type in FAMILIES:
        assert any(n == FAMILIES[model_type][2] for _, n in found[model_type])
    expected = {
        "llama": ("llama", 0.0),
        "qwen3": ("llama", 0.0),
        "gemma": ("gemma", 1.0),
        "gemma3": ("gemma", 1.0),
        "olmo2": ("gemma", 0.0),
    }
    for model_type, (casting, offset) in expected.items():
        how, why = hf.probe_class(_original(model_type))
        assert why is None and how == hf.Exact(False, casting, offset), (model_type, how, why)


def test_a_class_normscope_does_not_reproduce_is_refused_with_a_reason():
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    # T5 keeps the fp32 product when the weight is fp32 and the input bf16: no configuration matches
    how, why = hf.probe_class(T5LayerNorm)
    assert how is None and "bit for bit" in why and "bfloat16" in why
    report = hf.patch_classes("t5")
    assert report.replaced == {} and "T5LayerNorm" in report.skipped
    model = torch.nn.Sequential(T5LayerNorm(16))
    report = hf.patch(model)
    assert type(model[0]) is T5LayerNorm and "T5LayerNorm" in report.skipped


def test_an_instance_built_with_other_options_keeps_the_original_forward():
    from transformers.models.convnext import modeling_convnext as modeling

    original = modeling.ConvNextLayerNorm
    assert hf.patch_classes("convnext").replaced == {"ConvNextLayerNorm": 1}
    as_probed = modeling.ConvNextLayerNorm(16, eps=1e-6)
    other = modeling.ConvNextLayerNorm(16, eps=1e-6, data_format="channels_first")  # not what the probe saw
    assert as_probed._normscope_exact and not other._normscope_exact
    x = torch.randn(3, 16, 4, 4)
    assert torch.equal(other(x), original.forward(other, x))


def test_a_class_whose_gradient_bits_differ_is_left_alone():
    # Gemma 3n's RMSNorm gives the output's bits but normalizes by pow(v, -0.5), whose gradient rounds
    # otherwise than rsqrt's: a patched layer must train as the original does, so it is not patched
    from transformers.models.gemma3n import modeling_gemma3n as modeling

    norm = modeling.Gemma3nRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ours = FM.rms_norm(x, 16, norm.weight, 1e-6, casting="gemma")
    assert torch.equal(ours, norm(x))  # the output's bits ...
    dy = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    g_ours = torch.autograd.grad(ours, x, dy)[0]
    g_module = torch.autograd.grad(norm(x), x, dy)[0]
    assert not torch.equal(g_ours, g_module)  # ... not the input gradient's
    how, why = hf.probe_class(modeling.Gemma3nRMSNorm)
    assert how is None and "gradient of input" in why
    model = torch.nn.Sequential(norm)
    assert "Gemma3nRMSNorm" in hf.patch(model).skipped and type(model[0]) is modeling.Gemma3nRMSNorm


def test_patched_layer_pickles_and_trains():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16)
    ref = copy.deepcopy(norm)
    hf.patch(torch.nn.Sequential(norm))
    assert isinstance(norm, LlamaRMSNorm) and type(norm) is not LlamaRMSNorm
    clone = pickle.loads(pickle.dumps(norm))
    x = torch.randn(4, 16, requires_grad=True)
    assert torch.equal(clone(x), norm(x))
    x2 = x.detach().clone().requires_grad_()
    norm(x).square().sum().backward()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad)


def _views(dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views a family's norm receives or could: contiguous, a query/key ``view(...).transpose(1, 2)``,
    a permutation of three leading axes, a slice (no dense tensor behind it), an expanded batch."""
    return {
        "contiguous": dense,
        "transposed": dense.transpose(1, 2),
        "permuted": dense.permute(2, 0, 1, 3),
        "sliced": dense[:, ::2],
        "expanded": dense[:1].expand(3, -1, -1, -1),
    }


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_norm_on_views_matches_the_original_values_strides_and_gradients(model_type, dtype):
    """A patched norm given a strided view of its input -- the transposed query a Gemma 3 / OLMo 2
    q_norm receives, a permutation, a slice, an expanded batch -- gives the original module's output
    bit for bit, in the original's memory order (its elementwise ops keep the input's), and the same
    input and weight gradients."""
    model = _build(model_type, dtype)
    copied = copy.deepcopy(model)
    hf.patch(copied)
    norm, patched = model.model.norm, copied.model.norm
    assert hasattr(type(patched), "_normscope_how") and not hasattr(type(norm), "_normscope_how")
    dense = torch.randn(3, 5, 4, SMALL["hidden_size"], generator=torch.Generator().manual_seed(3)).to(dtype)
    for name, view in _views(dense).items():
        xa = view.detach().clone().requires_grad_() if name == "contiguous" else None
        x0 = dense.detach().clone().requires_grad_()
        x1 = dense.detach().clone().requires_grad_()
        v0, v1 = (_views(x0)[name], _views(x1)[name]) if xa is None else (x0, x1)
        y0, y1 = norm(v0), patched(v1)
        assert torch.equal(y1, y0), name
        assert y1.stride() == y0.stride(), (name, y1.stride(), y0.stride())
        dy = torch.randn(y0.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        g0 = torch.autograd.grad(y0, (x0, norm.weight), dy)
        g1 = torch.autograd.grad(y1, (x1, patched.weight), dy)
        assert torch.equal(g1[0], g0[0]), name
        torch.testing.assert_close(g1[1], g0[1], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_patched_norm_follows_its_weight_and_eps_when_replaced(model_type):
    """The patched forward reads the weight and eps on every call and takes the normalized shape
    from the weight: a weight swapped through ``.data`` for one of another width, a new Parameter,
    or a changed eps gives what the original module gives with the same state -- never a plan made
    for the old weight. A weight that is no 1-D tensor is refused with a ValueError naming it."""
    model = _build(model_type, torch.float32)
    copied = copy.deepcopy(model)
    hf.patch(copied)
    norm, patched = model.model.norm, copied.model.norm
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, SMALL["hidden_size"], generator=g)
    assert torch.equal(patched(x), norm(x))  # planned for the first weight
    wide = torch.randn(48, generator=g)
    for m in (norm, patched):
        m.weight.data = wide.clone()
    x48 = torch.randn(2, 3, 48, generator=g)
    assert torch.equal(patched(x48), norm(x48))
    for m in (norm, patched):
        m.weight = torch.nn.Parameter(torch.randn(24, generator=torch.Generator().manual_seed(6)))
        for name in ("variance_epsilon", "eps"):
            if name in m.__dict__:
                setattr(m, name, 0.25)
    x24 = torch.randn(2, 3, 24, generator=g)
    assert torch.equal(patched(x24), norm(x24))
    patched.weight = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(ValueError, match="weight"):
        patched(x24)
