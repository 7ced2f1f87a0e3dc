"""Patching Hugging Face models: logits before and after ``patch`` on tiny random models.

No downloads: every model is built from a small config. The norm weights are randomized first
(Gemma initializes its offsets to zeros, which would hide a wrong ``1 + weight``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import normscope
from normscope.integrations import transformers as hf

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install normscope[integrations])"
)

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100)


def _configs():
    t = transformers
    return {
        "llama": (t.LlamaConfig(**SMALL, num_key_value_heads=2), t.LlamaForCausalLM, "LlamaRMSNorm", 5),
        "mistral": (t.MistralConfig(**SMALL, num_key_value_heads=2), t.MistralForCausalLM, "MistralRMSNorm", 5),
        "qwen2": (t.Qwen2Config(**SMALL, num_key_value_heads=2), t.Qwen2ForCausalLM, "Qwen2RMSNorm", 5),
        "gemma": (t.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=8), t.GemmaForCausalLM, "GemmaRMSNorm", 5),
        "gemma2": (t.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8), t.Gemma2ForCausalLM, "Gemma2RMSNorm", 9),
        "bert": (
            t.BertConfig(**SMALL),
            t.BertForMaskedLM, "LayerNorm", 6,
        ),
        "gpt2": (t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64), t.GPT2LMHeadModel,
                 "LayerNorm", 5),
    }


def _build(name: str):
    config, cls, _, _ = _configs()[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if "Norm" in type(mod).__name__:
                for p in mod.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (0 if "Gemma" in type(mod).__name__ else 1))
    return model


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_logits_equal(name, dtype):
    _, _, norm_cls, expected = _configs()[name]
    model = _build(name).to(dtype)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    patched = copy.deepcopy(model)
    report = hf.patch(patched)
    assert report.replaced == {norm_cls: expected}, str(report)
    assert not report.skipped, str(report)
    left = [m for m in patched.modules() if type(m).__module__.startswith(("transformers", "torch"))]
    assert not any(type(m).__name__ == norm_cls for m in left), "a layer was left unpatched"
    # the families' norms keep their class (a subclass computing on normscope); nn.LayerNorm's are normscope's
    ours = [m for m in patched.modules() if isinstance(m, normscope.LayerNorm) or hasattr(type(m), "_normscope_how")]
    assert len(ours) == expected
    # the patched model uses the same parameter objects: state_dict keys and values unchanged
    assert patched.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        after = patched(input_ids=ids).logits
    assert after.dtype == before.dtype
    # every patched class was probed bit for bit against its original: the logits are the same bits
    assert torch.equal(after, before)


def test_each_family_keeps_its_casting_order():
    """On bf16 input the two casting orders give different bits; each class reproduces its own."""
    t = transformers
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemma
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlama

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 48, generator=g) * 4).to(torch.bfloat16)
    w = torch.randn(48, generator=g)
    llama, gemma = HFLlama(48, eps=1e-6), HFGemma(48, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(w)
        ours_l, ours_g = hf.LlamaRMSNorm(48, 1e-6), hf.GemmaRMSNorm(48, 1e-6)
        ours_l.weight.copy_(w)
        ours_g.weight.copy_(w)
        # a bf16 model: bf16 weights
        for m in (llama, gemma, ours_l, ours_g):
            m.to(torch.bfloat16)
        ref_l, ref_g = llama(x), gemma(x)
        got_l, got_g = ours_l(x), ours_g(x)
    assert got_l.dtype == ref_l.dtype == got_g.dtype == ref_g.dtype == torch.bfloat16
    bf16_ulp = 2.0**-7
    mag = lambda r: r.float().abs().clamp_min(1e-3)  # noqa: E731
    assert ((got_l.float() - ref_l.float()).abs() / mag(ref_l)).max() <= bf16_ulp
    assert ((got_g.float() - ref_g.float()).abs() / mag(ref_g)).max() <= bf16_ulp
    assert (got_l == ref_l).float().mean() > 0.99 and (got_g == ref_g).float().mean() > 0.99
    # and the orders really differ (otherwise the test above could not tell them apart)
    gemma_with_llama_order = hf.LlamaRMSNorm(48, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        gemma_with_llama_order.weight.copy_((1.0 + w).to(torch.bfloat16))
        assert not torch.equal(gemma_with_llama_order(x), ref_g)
    del t


def test_unknown_rmsnorm_is_reported_not_patched():
    class FancyRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return x

    model = torch.nn.Sequential(FancyRMSNorm(), torch.nn.LayerNorm(8))
    report = hf.patch(model)
    assert type(model[0]) is FancyRMSNorm and type(model[1]) is normscope.LayerNorm
    assert "FancyRMSNorm" in report.skipped and report.replaced == {"LayerNorm": 1}
    with pytest.raises(TypeError, match="model"):
        hf.patch("not a model")


def test_torch_norms_keep_their_hooks_and_ties_when_patched():
    """BERT's nn.LayerNorm layers become normscope's with the user's hooks still on them (and a hook does
    not run on patch's probe input), and a LayerNorm registered at two paths is replaced at both: the
    outputs are the unpatched model's, and the hooks see one call per forward as on the original."""
    model = _build("bert")
    original = copy.deepcopy(model)
    calls = []
    norm = model.bert.embeddings.LayerNorm
    norm.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    norm.register_forward_hook(lambda m, args, out: calls.append("post"))
    model.bert.embeddings.tied = norm  # the same layer object at a second path
    report = hf.patch(model)
    assert calls == [], "a user's hook ran on the probe input"
    assert report.replaced == {"LayerNorm": 6}, str(report)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    assert calls == ["pre", "post"]
    embeddings = model.bert.embeddings
    assert type(embeddings.LayerNorm) is normscope.LayerNorm and embeddings.tied is embeddings.LayerNorm


def _assert_patched_as_batch_invariant_as_the_original(model, ids: torch.Tensor, replaced: dict) -> None:
    """Sample 0's logits alone and inside the batch ``ids``: equal for the unpatched ``model`` (else there is
    nothing to compare), and for a patched copy (which replaced ``replaced``) equal to each other and to the
    original's."""

    def alone_and_batched(m):
        with torch.no_grad():
            return m(input_ids=ids[:1]).logits[0], m(input_ids=ids).logits[0]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with two, torch's own matrix products split by the batch: not invariant
    try:
        alone, batched = alone_and_batched(model)
        assert torch.equal(alone, batched), "the unpatched model is not batch-invariant here: nothing to compare"
        patched = copy.deepcopy(model)
        assert hf.patch(patched).replaced == replaced
        p_alone, p_batched = alone_and_batched(patched)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(p_alone, p_batched)
    assert torch.equal(p_alone, alone)


def test_patched_llama_is_as_batch_invariant_as_the_original():
    # sample 0's logits alone and inside a batch of 8: 8 x 130 tokens of hidden 1024 cross the CPU's
    # size threshold between torch's rms_norm and the rows path (rms.MIN_AUTO_ELEMENTS), one sample not
    t = transformers
    config = t.LlamaConfig(
        hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=64,
    )
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (8, 130), generator=torch.Generator().manual_seed(3))

    _assert_patched_as_batch_invariant_as_the_original(model, ids, {"LlamaRMSNorm": 5})


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_patched_qk_norm_families_are_as_batch_invariant_as_the_original(family):
    # the QK-norms (Qwen3, Gemma 3: RMSNorm over head_dim 128, Gemma's offset casting) run on rows of
    # 128: 8 x 130 tokens x 8 heads cross rms.MIN_AUTO_ELEMENTS (the rows path), one sample does not
    t = transformers
    kw = dict(
        hidden_size=1024, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8, head_dim=128, vocab_size=64,
    )
    config = t.Qwen3Config(**kw) if family == "qwen3" else t.Gemma3TextConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    cls = t.Qwen3ForCausalLM if family == "qwen3" else t.Gemma3ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():  # weights other than the initial ones (ones / zeros)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 64, (8, 130), generator=torch.Generator().manual_seed(3))

    # the q_norm / k_norm layers are instances of the family's RMSNorm class: 2 of 5 (Qwen3), of 7 (Gemma 3)
    replaced = {"Qwen3RMSNorm": 5} if family == "qwen3" else {"Gemma3RMSNorm": 7}
    _assert_patched_as_batch_invariant_as_the_original(model, ids, replaced)
