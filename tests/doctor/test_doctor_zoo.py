"""The doctor on models of the zoos people use -- timm, torchvision, transformers, diffusers -- with random
weights and small inputs, nothing downloaded.

Every expectation is a fact about that model's code, stated where it is tested, and checked against a
figure computed here from the model itself (hooks on its layers, its own length arithmetic), never read
back from the doctor:

* healthy configurations -- evaluation mode with running statistics that fit the data (set here from
  a large batch, as a trained model's are), a large batch, no padding -- give no warning and no error;
* each failure users meet -- a small batch, padding inside a BatchNorm's statistics, stale statistics, a
  frozen BatchNorm still updating, float16 overflow -- is found on the module that causes it;
* in-place activations after a norm and norm layers with children (timm's NormAct) give no false finding;
* every diagnosis leaves the model's parameters, buffers, modes and the random generators bitwise as
  they were.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from normscope.doctor import doctor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from test_zoo_setup import zoo_import  # noqa: E402

# ------------------------------------------------------------------------------------------ helpers


def _state(model: nn.Module) -> tuple:
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [m.training for m in model.modules()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state()[1].copy(),
    )


def _same(a: tuple, b: tuple) -> bool:
    sa, ta, ga, ra, pa, na = a
    sb, tb, gb, rb, pb, nb = b
    return (
        sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
        and ta == tb
        and all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(ga, gb)
        )
        and torch.equal(ra, rb)
        and pa == pb
        and np.array_equal(na, nb)
    )


def diagnose(model: nn.Module, *inputs, **kwargs):
    """normscope.doctor, and the check that it left the model and the generators as they were."""
    before = _state(model)
    report = doctor(model, *inputs, **kwargs)
    assert _same(before, _state(model)), "the diagnosis changed the model's state, modes or the RNG"
    return report


def problems(report) -> list[str]:
    return [f"{f.severity} {f.check} {f.module}: {f.reason}" for f in report.findings if f.severity != "info"]


def _batchnorms(model: nn.Module) -> dict[str, nn.Module]:
    return {
        p: m
        for p, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    }


def calibrate(model: nn.Module, *inputs, **kwargs) -> nn.Module:
    """Running statistics that fit the data, as a trained model's do: in an evaluation-mode forward on a
    large batch, each BatchNorm's running mean and (unbiased) variance are set from its own input just
    before it normalizes it, so every later layer sees what it will see in evaluation."""

    def set_from_input(m, args):
        x = args[0].detach().double()
        c = getattr(m, "channel_dim", 1) % x.dim()
        dims = [d for d in range(x.dim()) if d != c]
        with torch.no_grad():
            m.running_mean.copy_(x.mean(dims))
            m.running_var.copy_(x.var(dims, unbiased=True))

    handles = [m.register_forward_pre_hook(set_from_input) for m in _batchnorms(model).values()]
    model.eval()
    with torch.no_grad():
        model(*inputs, **kwargs)
    for h in handles:
        h.remove()
    return model


def values_per_statistic(model: nn.Module, *inputs, **kwargs) -> dict[str, int]:
    """Each BatchNorm's values per channel (N x positions) in a forward, from a hook on its input."""
    seen = {}

    def count(path):
        def hook(m, args):  # returns None: a pre-hook's return value would replace the inputs
            seen.setdefault(path, args[0].numel() // args[0].shape[1])

        return hook

    handles = [m.register_forward_pre_hook(count(p)) for p, m in _batchnorms(model).items()]
    with torch.no_grad():
        model(*inputs, **kwargs)
    for h in handles:
        h.remove()
    return seen


def _images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _small_batch_findings(model, size: int) -> None:
    """Trained at batch 2: bn-elements names exactly the BatchNorms with fewer than 784 values per
    statistic, errors exactly those below 100 (the counts from hooks), and nothing mixes the batch but
    the BatchNorms themselves (by design)."""
    import copy

    x = _images(2, size, seed=1)
    truth = values_per_statistic(copy.deepcopy(model).train(), x)
    report = diagnose(model.train(), x)
    found = {f.module: f for f in report.by_check("bn-elements")}
    assert set(found) == {p for p, n in truth.items() if n < 784}
    assert {p for p, f in found.items() if f.severity == "error"} == {p for p, n in truth.items() if n < 100}
    assert all(found[p].measured["elements"] == truth[p] for p in found)
    assert [f for f in report.by_check("batch-invariance") if f.severity != "info"] == []
    return report


# ------------------------------------------------------------------------------------------ timm


@pytest.fixture(scope="module")
def timm():
    return zoo_import("timm")


def test_timm_resnet(timm):
    torch.manual_seed(0)
    model = calibrate(timm.create_model("resnet18", num_classes=10), _images(128, 64))
    assert problems(diagnose(model, _images(16, 64, seed=2))) == []
    _small_batch_findings(model, 64)
    # stale statistics: the images got brighter and more contrasted than those the statistics were taken
    # on; the first BatchNorm sees the shift directly (its input is a convolution of the image)
    stale = diagnose(model.eval(), _images(16, 64, seed=3) * 2 + 1)
    assert "bn1" in {f.module for f in stale.by_check("train-eval-drift") if f.severity == "warning"}
    # a frozen backbone left in training mode: every BatchNorm's running statistics still move
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(False)
    frozen = diagnose(model.train(), _images(16, 64, seed=4))
    assert {f.module for f in frozen.by_check("frozen-bn-updating")} == set(_batchnorms(model))


def test_timm_efficientnet_norm_act_and_in_place_activations(timm):
    # timm's BatchNormAct2d is a BatchNorm2d subclass with children; its SiLU(inplace=True) overwrites the
    # tensor its own hooks see
    torch.manual_seed(0)
    model = calibrate(timm.create_model("efficientnet_b0", num_classes=10), _images(128, 64))
    assert type(model.bn1).__name__ == "BatchNormAct2d" and model.bn1.act.inplace
    with torch.no_grad():  # the fact: in evaluation a sample alone gives its output in the batch
        x = _images(2, 64, seed=5)
        assert float((model(x)[:1] - model(x[:1])).abs().max()) < 1e-4
    assert problems(diagnose(model, _images(16, 64, seed=2))) == []
    assert problems(diagnose(model, x)) == []
    report = _small_batch_findings(model, 64)
    (design,) = [f for f in report.by_check("batch-invariance") if f.measured.get("kind") == "by design"]
    assert "bn1" in design.measured["paths"] and not any(p.endswith(".act") for p in design.measured["paths"])
    # dozens of findings at batch 2, one screen in the terminal; every one with --all
    from normscope.doctor._render import text_lines

    assert len(report.findings) > 40 and len(text_lines(report)) <= 40
    assert len([t for t, _ in text_lines(report, all=True) if t[:1].isdigit()]) == len(report.findings)


def test_timm_convnext_layernorm2d(timm):
    # ConvNeXt has no BatchNorm: its LayerNorm2d normalizes each position over the channels, so a batch of
    # two is as healthy as sixteen
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", num_classes=10).eval()
    assert problems(diagnose(model, _images(16, 64))) == []
    report = diagnose(model.train(), _images(2, 64))
    assert problems(report) == [] and not report.by_check("bn-elements")


def test_timm_vit_is_pre_ln(timm):
    # timm's ViT Block: x + attn(norm1(x)), then x + mlp(norm2(x)) -- Pre-LN, so no post-ln information
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    for mode in (False, True):
        report = diagnose(model.train(mode), _images(4, 32))
        assert problems(report) == [] and report.by_check("post-ln") == []


def test_timm_levit_batchnorm_over_folded_tokens(timm):
    # LeViT's linear layers normalize with BatchNorm1d on x.flatten(0, 1): each image's 196 tokens are rows of
    # the norm's batch axis, correlated within an image. The batch's sampling noise is that of 16 images, not
    # of 3,136 independent rows: calibrated on 64 other images, a healthy LeViT warned on 21 layers
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", num_classes=10)
    folded = values_per_statistic(model.eval(), _images(16, 224, seed=2))
    assert folded["stages.0.blocks.0.attn.qkv.bn"] == 16 * 196  # the fact: tokens as rows, no positions
    calibrate(model, _images(64, 224))
    assert problems(diagnose(model, _images(16, 224, seed=2))) == []
    # statistics the inputs no longer fit: found, on the stem's first BatchNorm among others
    stale = diagnose(model.eval(), _images(16, 224, seed=3) * 2 + 1)
    assert "stem.conv1.bn" in {f.module for f in stale.by_check("train-eval-drift") if f.severity == "warning"}


def test_timm_repvgg_sparse_channels_are_not_dead(timm):
    # RepVGG's identity branch is a BatchNorm of the block's input, a ReLU's output: at random weights some of
    # its channels fire on few images. Calibrated on 64 images, evaluated on 16 others, a channel this batch
    # barely excites is one its running statistics saw vary -- neither dead nor a warning
    torch.manual_seed(0)
    model = calibrate(timm.create_model("repvgg_a0", num_classes=10), _images(64, 64))
    report = diagnose(model, _images(16, 64, seed=2))
    assert problems(report) == []
    for f in report.by_check("dead-channels"):  # what is still said: dead in the running statistics too
        m = model.get_submodule(f.module)
        if f.measured.get("indices"):
            assert bool((m.running_var[f.measured["indices"]] < m.eps).all()), f


def test_timm_resnest_split_attention_bias_is_information(timm):
    # ResNeSt's split attention: fc1 (a 1x1 convolution with a bias) straight into bn1, a BatchNorm2d -- the
    # bias is removed again by bn1's mean (true: the output without it is the same), a redundancy its authors
    # kept, so information only
    torch.manual_seed(0)
    model = calibrate(timm.create_model("resnest14d", num_classes=10), _images(64, 64))
    attn = model.layer1[0].conv2
    assert isinstance(attn.fc1, nn.Conv2d) and attn.fc1.bias is not None and isinstance(attn.bn1, nn.BatchNorm2d)
    report = diagnose(model, _images(16, 64, seed=2))
    assert problems(report) == []
    found = {f.module: f for f in report.by_check("bias-before-norm")}
    assert found["layer1.0.conv2.bn1"].measured["producer"] == "layer1.0.conv2.fc1"
    assert {f.severity for f in found.values()} == {"info"}


# ------------------------------------------------------------------------------------------ torchvision


@pytest.fixture(scope="module")
def torchvision():
    return zoo_import("torchvision")


def test_torchvision_detection_backbone_with_frozen_batchnorm(torchvision):
    # detection backbones replace BatchNorm by FrozenBatchNorm2d: fixed statistics, so training at batch 2
    # is healthy -- no bn-elements, nothing mixes the batch
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops import FrozenBatchNorm2d

    torch.manual_seed(0)
    model = resnet_fpn_backbone(backbone_name="resnet18", weights=None, norm_layer=FrozenBatchNorm2d)
    report = diagnose(model.train(), _images(2, 64))
    frozen = {p for p, m in model.named_modules() if isinstance(m, FrozenBatchNorm2d)}
    assert frozen and frozen <= {p for p, _ in report.layers}  # recognised as norms
    assert problems(report) == [] and not report.by_check("bn-elements")


def test_torchvision_mobilenet_in_place_hardswish(torchvision):
    # torchvision's Conv2dNormActivation: conv, BatchNorm2d, Hardswish(inplace=True) on its output
    torch.manual_seed(0)
    model = calibrate(torchvision.models.mobilenet_v3_small(num_classes=10), _images(128, 64))
    assert problems(diagnose(model, _images(16, 64, seed=2))) == []
    _small_batch_findings(model, 64)


def test_torchvision_efficientnet_v2_eps_and_quiet_channels(torchvision):
    # torchvision's EfficientNetV2 keeps TensorFlow's eps 1e-3; at random weights the depthwise BatchNorms of
    # its last stage have channels far quieter than their peers (below eps) -- a matter of scale at these
    # weights, said as information, not a healthy model's warning
    torch.manual_seed(0)
    model = calibrate(torchvision.models.efficientnet_v2_s(num_classes=10), _images(64, 64))
    assert model.features[6][0].block[1][1].eps == 1e-3
    assert problems(diagnose(model, _images(16, 64, seed=2))) == []


def test_torchvision_swin(torchvision):
    # Swin normalizes tokens with LayerNorm over the channels of (B, H, W, C): per-sample
    torch.manual_seed(0)
    model = torchvision.models.swin_t(num_classes=10).eval()
    assert problems(diagnose(model, _images(4, 64))) == []


# ------------------------------------------------------------------------------------------ transformers


def _padded_ids(vocab: int, lengths: list[int], seq: int, left: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), seq), generator=g)
    pos = torch.arange(seq)[None]
    n = torch.tensor(lengths)[:, None]
    mask = (pos >= seq - n) if left else (pos < n)
    return ids.masked_fill(~mask, 0), mask.long()


def test_transformers_padded_bert_is_post_ln_and_per_token():
    # BERT normalizes each token (LayerNorm over the hidden size): padding never enters a statistic. It is
    # Post-LN: LayerNorm(x + sublayer(x)), information
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = transformers.BertModel(cfg).eval()
    ids, mask = _padded_ids(100, [12, 7, 3, 9], 12)
    report = diagnose(model, ids, attention_mask=mask)
    assert problems(report) == [] and report.by_check("padding") == []
    post = {f.module for f in report.by_check("post-ln")}
    assert {"encoder.layer.0.attention.output.LayerNorm", "encoder.layer.1.output.LayerNorm"} <= post


def _tiny(transformers, family: str):
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100)
    return {
        "gemma2": lambda: transformers.Gemma2Model(
            transformers.Gemma2Config(**small, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
        ),
        "bloom": lambda: transformers.BloomModel(
            transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=100)
        ),
        "modernbert": lambda: transformers.ModernBertModel(
            transformers.ModernBertConfig(**small, max_position_embeddings=64, pad_token_id=0)
        ),
        "distilbert": lambda: transformers.DistilBertModel(
            transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=100)
        ),
    }[family]()


@pytest.mark.parametrize(
    ("family", "post_ln"),
    [
        # x + post_attention_layernorm(attn(input_layernorm(x))): a norm at each branch's end, the stream never
        # passes through one (Gemma2DecoderLayer.forward)
        ("gemma2", set()),
        # the embeddings' LayerNorm, then layernorm_output = input_layernorm(h), attention_output = attn(...) + h,
        # post_attention_layernorm(attention_output) feeds the MLP, whose residual is attention_output: Pre-LN
        # (BloomBlock.forward)
        ("bloom", set()),
        # the embeddings' norm, then layer 0's attn_norm is nn.Identity (the embeddings were just normalized):
        # x + attn(x), then mlp_norm on that sum, which the MLP's add takes as its residual too (ModernBertEncoderLayer)
        ("modernbert", set()),
        # sa_layer_norm(attention(x) + x), output_layer_norm(ffn(h) + h): Post-LN (TransformerBlock.forward)
        ("distilbert", {f"transformer.layer.{i}.{n}" for i in (0, 1) for n in ("sa_layer_norm", "output_layer_norm")}),
    ],
)
def test_transformers_post_ln_only_where_the_stream_passes_through_the_norm(family, post_ln):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _tiny(transformers, family).eval()
    ids, mask = _padded_ids(100, [16, 11, 5, 13], 16, left=family in ("gemma2", "bloom"))
    report = diagnose(model, ids, attention_mask=mask)
    assert problems(report) == []
    assert {f.module for f in report.by_check("post-ln")} == post_ln


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_transformers_padded_decoders_are_healthy(family, dtype):
    # RMSNorm per token (and per head for Qwen3's and Gemma 3's q_norm/k_norm): left padding enters no
    # statistic. In bfloat16 the casting order each family's RMSNorm implements is information: Llama and
    # Qwen3 cast to the input dtype before the weight, Gemma 3 multiplies by (1 + weight) in float32
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, sliding_window=8),
    }[family]()
    model_cls = {
        "llama": transformers.LlamaModel,
        "qwen3": transformers.Qwen3Model,
        "gemma3": transformers.Gemma3TextModel,
    }[family]
    model = model_cls(cfg).to(dtype).eval()
    ids, mask = _padded_ids(100, [16, 11, 5, 13], 16, left=True)
    report = diagnose(model, ids, attention_mask=mask)
    assert problems(report) == [], problems(report)
    assert report.by_check("padding") == []
    if dtype == torch.bfloat16:
        orders = {f.measured["implements"] for f in report.by_check("casting-order")}
        want = "casting='gemma', weight_offset=1" if family == "gemma3" else "casting='llama', weight_offset=0"
        assert orders and all(want in o for o in orders), orders


def _conformer(transformers):
    cfg = transformers.Wav2Vec2ConformerConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        conv_depthwise_kernel_size=7,
        feat_extract_norm="group",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
    )
    return transformers.Wav2Vec2ConformerModel(cfg)


def test_transformers_padded_audio_encoder_batchnorm_over_frames():
    # Wav2Vec2-Conformer takes attention_mask over raw samples, derives a frame-level mask
    # (_get_feature_vector_attention_mask) and passes it to its encoder; each layer's convolution module
    # runs BatchNorm1d over (batch, channels, frames) and is given no mask -- the padded frames are inside
    # its statistics. Its feature extractor's GroupNorm (one group per channel) spans raw time, where no
    # frame-level mask fits: information naming the axis
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _conformer(transformers).train()
    lengths = torch.tensor([1600, 1100, 700, 1500])
    samples = (torch.arange(1600)[None] < lengths[:, None]).long()
    audio = torch.randn(4, 1600) * samples
    report = diagnose(model, audio, attention_mask=samples)
    frames = model._get_feat_extract_output_lengths(lengths)  # the model's own arithmetic
    padded = 1 - float(frames.sum()) / (4 * int(frames.max()))
    bns = {f"encoder.layers.{i}.conv_module.batch_norm" for i in range(2)}
    found = {f.module: f for f in report.by_check("padding") if f.severity == "warning"}
    assert set(found) == bns
    for f in found.values():
        assert f.measured["pad_fraction_max"] == pytest.approx(padded)
        assert "encoder" in f.measured["mask_passed_to"]  # the frame-level mask, where the model passed it
    info = [f for f in report.by_check("padding") if f.severity == "info"]
    assert [f.module for f in info] == ["feature_extractor.conv_layers.0.layer_norm"] and info[0].measured["axis"] == 2
    # healthy: no padding, statistics that fit, evaluation
    full = torch.randn(8, 1600)
    calibrate(model, torch.randn(64, 1600))
    assert problems(diagnose(model, full)) == []


def test_transformers_t5_in_float16_overflow():
    # T5 in float16: its LayerNorm (an RMSNorm) squares in float32, but the residual stream itself must stay
    # below 65504. Embeddings scaled so that the first norm's input reaches 4e4 -- within 2x of float16's
    # largest value -- are found on that norm; the same model at a normal scale is healthy
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0
    )
    model = transformers.T5EncoderModel(cfg).half().eval()
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    assert problems(diagnose(model, ids)) == []
    with torch.no_grad():
        model.shared.weight.mul_(4e4 / model.shared.weight.abs().max())
    first = "encoder.block.0.layer.0.layer_norm"
    report = diagnose(model, ids)
    found = {f.module: f for f in report.by_check("half-overflow")}
    assert first in found and found[first].severity in ("warning", "error")
    assert found[first].measured["max_abs"] == pytest.approx(float(model.shared.weight[ids].abs().max()))


# ------------------------------------------------------------------------------------------ diffusers


def test_diffusers_unet_vae_and_dit_are_healthy():
    # GroupNorm over (channels of a group, H, W) per sample in the UNet and the VAE; DiT's adaLN-Zero is an
    # nn.LayerNorm without affine, modulated by the timestep and class embedding: all per sample
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    ).eval()
    report = diagnose(unet, _images(4, 16), torch.tensor([10, 20, 30, 40]))
    assert problems(report) == [] and any(t == "GroupNorm" for _, t in report.layers)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32,),
        latent_channels=4,
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    ).eval()
    assert problems(diagnose(vae, _images(4, 16))) == []
    dit = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_type="ada_norm_zero",
    ).eval()
    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    report = diagnose(dit, latents, timestep=torch.tensor([1, 2, 3, 4]), class_labels=torch.tensor([0, 1, 2, 3]))
    assert problems(report) == [] and sum(t == "LayerNorm" for _, t in report.layers) >= 4
