"""The class-level Hugging Face patch: applied before a model exists, it makes ``Model(config)``
and ``from_pretrained`` build normscope layers, with the same logits as the unpatched model.

No downloads: the checkpoint is a tiny random model saved to a temporary directory."""

from __future__ import annotations

import pytest
import torch

from normscope.integrations import transformers as hf

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install normscope[integrations])"
)

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100)


@pytest.fixture(autouse=True)
def _restore():
    yield
    hf.unpatch_classes()


def _norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize(
    "model_type,make,name",
    [
        ("llama", lambda t: (t.LlamaConfig(**SMALL, num_key_value_heads=2), t.LlamaForCausalLM), "LlamaRMSNorm"),
        (
            "qwen3",
            lambda t: (t.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8), t.Qwen3ForCausalLM),
            "Qwen3RMSNorm",
        ),
        (
            "gemma",
            lambda t: (t.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=8), t.GemmaForCausalLM),
            "GemmaRMSNorm",
        ),
    ],
)
def test_from_pretrained_after_patch_classes_builds_normscope_layers(tmp_path, model_type, make, name):
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = getattr(modeling, name)

    def ours(m):  # the family's class still, computing on normscope
        return isinstance(m, original) and type(m) is not original and type(m)._normscope_original is original

    config, cls = make(transformers)
    torch.manual_seed(0)
    reference = cls(config).eval()
    with torch.no_grad():  # random norm weights: Gemma's zero offsets would hide a wrong 1 + weight
        for m in _norms(reference):
            m.weight.normal_()
    reference.save_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    assert not any(ours(m) for m in reference.modules())

    report = hf.patch_classes(model_type)
    assert report.replaced == {name: 1} and not report.skipped, str(report)

    loaded = cls.from_pretrained(tmp_path).eval()
    norms = _norms(loaded)
    assert norms and all(ours(m) for m in norms), {type(m).__qualname__ for m in norms}
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, expected)
    built = cls(config)  # plain construction too
    assert all(ours(m) for m in _norms(built))

    assert hf.unpatch_classes() == [name]
    assert not any(ours(m) for m in cls(config).modules())


def test_patch_classes_skips_a_class_that_computes_something_else(monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    class WrongRMSNorm(modeling.LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) * 1.01

    WrongRMSNorm.__name__ = "LlamaRMSNorm"  # a changed forward under the family's name
    monkeypatch.setattr(modeling, "LlamaRMSNorm", WrongRMSNorm)
    report = hf.patch_classes("llama")
    assert report.replaced == {} and "differ" in report.skipped["LlamaRMSNorm"]
    assert modeling.LlamaRMSNorm is WrongRMSNorm  # left alone


def test_patch_classes_all_families_and_bad_names():
    families = ("llama", "qwen2", "gemma", "t5")
    report = hf.patch_classes(*families)
    expected = {name for t in families for _, name in hf.families()[t]}
    assert set(report.replaced) | set(report.skipped) == expected
    assert "normscope patched 3 normalization class(es)" in str(report)
    with pytest.raises(ValueError, match="unknown model type"):
        hf.patch_classes("llama3000")
    # a list passed as one argument: a TypeError saying what is expected, not "unhashable type: 'list'"
    with pytest.raises(TypeError, match="patch_classes: expected model type names"):
        hf.patch_classes(["llama", "qwen2"])
    with pytest.raises(TypeError, match="probe_class: expected `cls` to be a class, got str"):
        hf.probe_class("LlamaRMSNorm")
    # `verify` is a flag: a string ("no" is truthy) would verify while the caller meant not to
    with pytest.raises(TypeError, match="patch: expected `verify` to be a bool, got 'no'"):
        hf.patch(torch.nn.Linear(2, 2), verify="no")


def test_patch_classes_takes_no_verify_keyword():
    """Classes are always probed (the probe finds their configuration): `verify=` is refused by name."""
    with pytest.raises(TypeError, match="verify"):
        hf.patch_classes("llama", verify=False)
