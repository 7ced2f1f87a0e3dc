"""``normscope.integrations.diffusers`` and ``AdaLayerNorm`` against diffusers itself.

Tiny DiT, PixArt, SD3 and Flux transformers are built from configs (random weights, nothing
downloaded); a copy is patched and the two are compared with ``torch.equal`` -- outputs in fp32 and
bf16, gradients, ``state_dict`` -- so every claim is checked against diffusers' own code.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import normscope

diffusers = pytest.importorskip("diffusers")
from diffusers.models import normalization as DN  # noqa: E402

from normscope.integrations import diffusers as ND  # noqa: E402


def _dit():
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10,
    )  # fmt: skip
    return model, {
        "hidden_states": (2, 4, 8, 8),
        "timestep": torch.tensor([3, 7]),
        "class_labels": torch.tensor([1, 2]),
    }


def _pixart():
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=12,
    )  # fmt: skip
    return model, {
        "hidden_states": (2, 4, 8, 8),
        "encoder_hidden_states": (2, 3, 12),
        "timestep": torch.tensor([3, 7]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def _sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4, qk_norm="rms_norm",
    )  # fmt: skip
    return model, {
        "hidden_states": (2, 4, 8, 8),
        "encoder_hidden_states": (2, 3, 16),
        "pooled_projections": (2, 8),
        "timestep": torch.tensor([3, 7]),
    }


def _flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip
    return model, {
        "hidden_states": (2, 6, 8),
        "encoder_hidden_states": (2, 3, 16),
        "pooled_projections": (2, 8),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_ids": torch.randn(6, 3, generator=torch.Generator().manual_seed(5)),
        "txt_ids": torch.randn(3, 3, generator=torch.Generator().manual_seed(6)),
    }


MODELS = {"dit": _dit, "pixart": _pixart, "sd3": _sd3, "flux": _flux}
# what each model's patch must replace (class -> layers), against diffusers' structure
EXPECTED = {
    "dit": {"AdaLayerNormZero": 2},
    "pixart": {},
    "sd3": {"AdaLayerNormZero": 3, "AdaLayerNormContinuous": 2, "RMSNorm": 8},
    "flux": {"AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1, "AdaLayerNormContinuous": 1, "RMSNorm": 6},
}


def _build(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model, spec = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random weights everywhere: adaLN-Zero's zero projections would hide the modulation
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model = model.to(dtype).eval()  # eval: DiT's label embedding drops labels at random in training
    g = torch.Generator().manual_seed(2)
    inputs = {
        k: (torch.randn(v, generator=g).to(dtype) if isinstance(v, tuple) else v) for k, v in spec.items()
    }  # fmt: skip
    return model, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_transformer_is_bitwise_the_original(name, dtype):
    original, inputs = _build(name, dtype)
    model = copy.deepcopy(original)
    classes = {p: type(m) for p, m in model.named_modules()}
    report = ND.patch(model)
    for cls, n in EXPECTED[name].items():
        assert report.replaced.get(cls) == n, str(report)
    for path, m in model.named_modules():  # still instances of diffusers' classes
        assert isinstance(m, classes[path]), path
    assert list(model.state_dict()) == list(original.state_dict())
    with torch.no_grad():
        want, got = original(**inputs).sample, model(**inputs).sample
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_patched_transformer_cast_to_float64_is_bitwise_the_original():
    """Patched in fp32, then cast to fp64 (a dtype the fp32/bf16 class probe does not cover), the
    model gives the bits of the original cast the same way: diffusers' RMSNorm takes its variance of
    ``x.to(torch.float32)``, so on fp64 input the patched layer runs diffusers' forward. Patched in
    fp64, its RMSNorms are patched (not refused) and keep the output too."""
    original, inputs = _build("sd3", torch.float32)
    model = copy.deepcopy(original)
    ND.patch(model)
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    original, model = original.double(), model.double()
    with torch.no_grad():
        want = original(**inputs).sample
        assert torch.equal(model(**inputs).sample, want)
    again = copy.deepcopy(original)
    report = ND.patch(again)
    assert report.replaced.get("RMSNorm") == EXPECTED["sd3"]["RMSNorm"], str(report)
    with torch.no_grad():
        assert torch.equal(again(**inputs).sample, want)


@pytest.mark.parametrize("name", ["dit", "sd3", "flux"])
def test_patched_transformer_gradients_are_bitwise(name):
    original, inputs = _build(name, torch.float32)
    model = copy.deepcopy(original)
    ND.patch(model)
    for m in (original, model):
        m(**inputs).sample.square().sum().backward()
    for (n, a), (_, b) in zip(original.named_parameters(), model.named_parameters()):
        if a.grad is None:
            assert b.grad is None, n
            continue
        assert torch.equal(b.grad, a.grad), n


def test_patched_block_compiles_in_one_graph():
    original, inputs = _build("flux", torch.float32)
    model = copy.deepcopy(original)
    ND.patch(model)
    norm = model.transformer_blocks[0].norm1
    assert isinstance(norm, DN.AdaLayerNormZero)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    emb = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    want = original.transformer_blocks[0].norm1(x, emb=emb)
    for a, b in zip(compiled(x, emb=emb), want):
        assert torch.equal(a, b)


def test_plain_and_adaptive_classes_keep_diffusers_call_sites_and_pickle():
    layer = DN.AdaLayerNormZero(16, num_embeddings=10).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    original = copy.deepcopy(layer)
    ND.patch(layer)
    x, t, c = torch.randn(2, 5, 16), torch.tensor([3, 7]), torch.tensor([1, 2])
    for a, b in zip(layer(x, t, c, hidden_dtype=torch.float32), original(x, t, c, hidden_dtype=torch.float32)):
        assert torch.equal(a, b)  # the timestep/class-label path, not only emb=
    again = pickle.loads(pickle.dumps(layer))
    assert type(again) is type(layer) and torch.equal(again(x, t, c)[0], original(x, t, c)[0])


def test_patch_classes_builds_patched_layers_and_unpatches():
    report = ND.patch_classes()
    try:
        assert {"AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous", "RMSNorm"} <= set(
            report.replaced
        ), str(report)
        assert "AdaLayerNorm" in report.skipped  # diffusers' older (x, timestep, temb) signature: said, not hidden
        patched, inputs = _build("flux", torch.float32)
        norm = patched.transformer_blocks[0].norm1
        assert type(norm).__module__ == "normscope.integrations.diffusers" and isinstance(norm, DN.AdaLayerNormZero)
    finally:
        restored = ND.unpatch_classes()
    assert "AdaLayerNormZero" in restored and DN.AdaLayerNormZero.__module__ == "diffusers.models.normalization"
    plain, _ = _build("flux", torch.float32)
    assert type(plain.transformer_blocks[0].norm1) is DN.AdaLayerNormZero
    with torch.no_grad():
        assert torch.equal(patched(**inputs).sample, plain(**inputs).sample)


def test_unreproduced_layers_are_reported():
    original, _ = _build("pixart", torch.float32)
    report = ND.patch(original)
    assert "AdaLayerNormSingle" in report.skipped and "call signature" in report.skipped["AdaLayerNormSingle"]
    with pytest.raises(TypeError, match="probe: expected `m` to be a torch.nn.Module"):
        ND.probe(DN.RMSNorm)  # the class, not a layer: named, not an AttributeError from inside
    with pytest.raises(TypeError, match="patch: expected `verify` to be a bool, got 'no'"):
        ND.patch(original, verify="no")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_affine_layer_is_patched_by_its_class_configuration(dtype):
    # Wan's blocks hold FP32LayerNorm with and without an affine. A fresh affine one (weight 1, bias 0) is
    # reproduced by several configurations; its own-weights check asked for the first of them, not the
    # class's, and skipped it ("this layer matches layer_norm(casting='llama'...), its class ...casting='torch'").
    torch.manual_seed(0)
    plain = torch.nn.Sequential(DN.FP32LayerNorm(16, eps=1e-6, elementwise_affine=False),
                                DN.FP32LayerNorm(16, eps=1e-6, elementwise_affine=True)).to(dtype)  # fmt: skip
    patched = copy.deepcopy(plain)
    report = ND.patch(patched)
    assert report.replaced == {"FP32LayerNorm": 2} and not report.skipped
    x = torch.randn(3, 5, 16).to(dtype)
    with torch.no_grad():
        assert torch.equal(patched(x), plain(x))


# -- AdaLayerNorm as diffusers' layers -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaln_chunks_6_is_ada_layer_norm_zero(dtype):
    ref = DN.AdaLayerNormZero(24)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref = ref.to(dtype)
    ours = normscope.AdaLayerNorm(24, 24, gate=True, chunks=6, casting="eager", dtype=dtype)
    ours.load_state_dict(ref.state_dict())  # 6 chunks: the shapes match (they did not with 3)
    back = DN.AdaLayerNormZero(24).to(dtype)
    back.load_state_dict(ours.state_dict())
    x, emb = torch.randn(2, 5, 24).to(dtype), torch.randn(2, 24).to(dtype)
    want = ref(x, emb=emb)
    for got in (ours(x, emb=emb), back(x, emb=emb)):
        assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_adaln_scale_shift_casts_an_fp32_condition_as_diffusers_does():
    ref = DN.AdaLayerNormContinuous(16, 8, elementwise_affine=False, eps=1e-6)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref = ref.to(torch.bfloat16)
    ours = normscope.AdaLayerNorm(16, 8, order="scale_shift", casting="eager", dtype=torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x, cond = torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(2, 8)  # fp32 condition (HunyuanDiT)
    assert torch.equal(ours(x, cond), ref(x, cond))


def test_adaln_errors_name_the_argument_passed():
    ada = normscope.AdaLayerNorm(8, 4)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"`cond` of shape \(2, 4\)") as e:
        ada(x, torch.randn(2, 5))
    assert "shift" not in str(e.value)
    with pytest.raises(ValueError, match=r"`emb` of shape") as e:
        ada(x, emb=torch.randn(3, 4))  # wrong batch
    with pytest.raises(ValueError, match=r"expected `x` of shape \(B, \*, 8\), got \(2, 3, 7\)"):
        ada(torch.randn(2, 3, 7), torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"`cond` to be a floating-point tensor, got torch.int64"):
        ada(x, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="`cond` or `emb`"):
        ada(x)
    with pytest.raises(TypeError, match=r"`cond` of the projection's dtype torch.float32, got torch.bfloat16"):
        ada(x, torch.randn(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="`chunks` to be an int >= 3"):
        normscope.AdaLayerNorm(8, 4, gate=True, chunks=2)


def test_a_patched_layer_whose_projection_weight_was_set_to_none_is_refused_by_name():
    """A patched diffusers layer runs AdaLayerNorm's forward on its own ``linear``: a weight set to None
    raised AttributeError ('NoneType' object has no attribute 'dtype'), naming nothing."""
    layer = DN.AdaLayerNormZero(16).eval()
    ND.patch(layer)
    layer.linear.weight = None
    named = r"AdaLayerNormZero: expected `linear.weight` to be a tensor of shape \(96, 16\)"
    with pytest.raises(TypeError, match=named):
        layer(torch.randn(2, 5, 16), emb=torch.randn(2, 16))


def test_a_condition_diffusers_does_not_treat_per_sample_runs_diffusers_code():
    """diffusers chunks the projection along dim 1: a (B, S, C) condition is not AdaLayerNorm's per-token one."""
    layer = DN.AdaLayerNormZeroSingle(8).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    original = copy.deepcopy(layer)
    ND.patch(layer)
    x, emb = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    try:
        want = original(x, emb=emb)
    except RuntimeError as e:
        with pytest.raises(type(e)):
            layer(x, emb=emb)
    else:
        assert all(torch.equal(a, b) for a, b in zip(layer(x, emb=emb), want))


def test_unpatch_classes_reaches_modules_imported_while_patched():
    """A diffusers module first imported while the classes are patched binds the patched class under
    its own name; after ``unpatch_classes`` it must hold diffusers' class again (a fresh interpreter,
    so that the Flux module is imported for the first time inside the patch)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from normscope.integrations import diffusers as ND\n"
        "from diffusers.models import normalization as DN\n"
        "assert 'diffusers.models.transformers.transformer_flux' not in sys.modules\n"
        "original = DN.AdaLayerNormZero\n"
        "ND.patch_classes()\n"
        "import diffusers.models.transformers.transformer_flux as flux\n"
        "assert flux.AdaLayerNormZero is not original\n"
        "ND.unpatch_classes()\n"
        "assert flux.AdaLayerNormZero is original, flux.AdaLayerNormZero\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
