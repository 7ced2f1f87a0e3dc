"""normscope.doctor: every check finds its planted problem with the right number -- computed here
independently, from the layer's input or from torch -- and stays silent on a healthy twin; the
model's state and the random generators are bitwise the same afterwards; recalibrate equals
fvcore's PreciseBN estimate (its loop written out here) and the direct formula."""

from __future__ import annotations

import copy
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import normscope
from normscope.doctor import CHECKS, SCHEMA, Finding, Report, apply_fixes, doctor, recalibrate


def _only(report: Report, check: str, module: str | None = None) -> Finding:
    found = [f for f in report.by_check(check) if module is None or f.module == module]
    assert len(found) == 1, (check, module, report.by_check(check))
    return found[0]


def _conv_bn(bias=False, c=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, c, 3, bias=bias), nn.BatchNorm2d(c))


# ------------------------------------------------------------------------------------------ bn-elements


@pytest.mark.parametrize(("n", "hw", "severity"), [(2, 10, "warning"), (2, 5, "error"), (16, 10, None)])
def test_bn_elements_counts_n_times_spatial_per_channel(n, hw, severity):
    model = _conv_bn()
    report = doctor(model, torch.randn(n, 3, hw, hw))
    expected = n * (hw - 2) * (hw - 2)  # the conv's output: N x H' x W' values per channel
    found = report.by_check("bn-elements")
    if severity is None:
        assert expected >= 784 and found == []
        return
    f = _only(report, "bn-elements", "1")
    assert f.measured["elements"] == expected and f.severity == severity
    assert "to='group'" in f.fix and "Wu & He 2018" in f.threshold["source"]


def test_bn_elements_per_rank_under_world_size_and_syncbn_counts_every_rank():
    x = torch.randn(16, 3, 10, 10)
    f = _only(doctor(_conv_bn(), x, world_size=4), "bn-elements", "1")
    assert f.measured["elements"] == 4 * 64 and f.measured["samples"] == 4
    assert "to='sync'" in f.fix
    torch.manual_seed(0)
    synced = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), normscope.SyncBatchNorm(8))
    assert doctor(synced, x, world_size=4).by_check("bn-elements") == []  # 16 x 64 over all ranks


def test_bn_elements_silent_in_eval_mode_and_says_why():
    report = doctor(_conv_bn().eval(), torch.randn(2, 3, 5, 5))
    assert report.by_check("bn-elements") == []
    assert "batch statistics" in report.checks["bn-elements"]["note"]


# ------------------------------------------------------------------------------------------ train-eval-drift


def test_train_eval_drift_is_the_lab_distance_and_the_output_difference():
    model = _conv_bn()
    x = torch.randn(8, 3, 10, 10) * 2 + 3
    report = doctor(model, x)
    f = _only(report, "train-eval-drift", "1")
    with torch.no_grad():
        h = model[0](x).double()
    mu, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
    sd = math.sqrt(1 + 1e-5)  # fresh running statistics: mean 0, variance 1
    expected = float((mu.abs() / sd).mean() + ((var + 1e-5) / (1 + 1e-5) - 1).abs().mean())
    assert f.measured["distance"] == pytest.approx(expected, rel=1e-9)
    whole = _only(report, "train-eval-drift", "")
    with torch.no_grad():  # each from the user's state: the train-mode forward moves the running statistics
        y_train, y_eval = copy.deepcopy(model).train()(x), copy.deepcopy(model).eval()(x)
    rel = float((y_train - y_eval).double().norm() / y_eval.double().norm())
    assert whole.measured["output_relative_difference"] == pytest.approx(rel, rel=1e-5)
    assert f.fix.startswith("model = normscope.recalibrate(")


def test_train_eval_drift_silent_when_running_statistics_fit_the_data():
    model = _conv_bn()
    x = torch.randn(8, 3, 10, 10) * 2 + 3
    with torch.no_grad():
        h = model[0](x)
        model[1].running_mean.copy_(h.mean((0, 2, 3)))
        model[1].running_var.copy_(h.var((0, 2, 3), unbiased=False))
    assert doctor(model, x).by_check("train-eval-drift") == []


class SpatialBN(nn.Module):
    """A BatchNorm whose input is known exactly: sample-level offsets (shared by a sample's positions, as
    image brightness is) plus independent noise, N(mu_c, 1 + 0.5^2) per channel in the population."""

    def __init__(self, c=32):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.register_buffer("mu", torch.linspace(-1, 1, c))

    def forward(self, x):  # x: (N, C, H, W) standard normal; the offset of each (sample, channel) is x's mean
        return self.bn(self.mu[None, :, None, None] + x)


def _exact_statistics(model):
    with torch.no_grad():
        model.bn.running_mean.copy_(model.mu)
        model.bn.running_var.fill_(1.0)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_train_eval_drift_sampling_noise_is_what_the_batch_size_alone_gives(n):
    # the running statistics are exactly the population's: the distance a batch gives is sampling noise,
    # and the doctor's estimate of it (from the spread of per-sample statistics) must match its average
    # over many batches -- the average computed here directly, from the formula
    from normscope.doctor._observe import Call, NormScope
    from normscope.doctor.checks import sampling_noise

    torch.manual_seed(0)
    model = SpatialBN().eval()
    _exact_statistics(model)
    g = torch.Generator().manual_seed(1)
    actual, estimated = [], []
    for _ in range(200):
        x = torch.randn(n, 32, 2, 2, generator=g)
        h = (model.mu[None, :, None, None] + x).double()
        mu, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
        actual.append(float((mu - model.mu.double()).abs().mean() + ((var + 1e-5) / (1 + 1e-5) - 1).abs().mean()))
        call = Call("bn", model.bn, False, 0, 0, args=(h.float(),))
        call.extra["scope"] = NormScope("batch", (0, 2, 3), 1, None, True, 1e-5)
        estimated.append(sum(sampling_noise(call, model.bn.running_var, 1e-5)))
    assert sum(estimated) / len(estimated) == pytest.approx(sum(actual) / len(actual), rel=0.2)
    # and a batch of this size gives no finding on these statistics, while stale ones are found
    flagged = sum(
        bool(doctor(model, torch.randn(n, 32, 2, 2, generator=g)).by_check("train-eval-drift")) for _ in range(20)
    )
    assert flagged <= 1
    with torch.no_grad():  # stale: the data's mean moved by 3 standard deviations (1 is found from batch 16 on)
        model.bn.running_mean.add_(3.0 if n < 16 else 1.0)
    assert doctor(model, torch.randn(n, 32, 2, 2, generator=g)).by_check("train-eval-drift")


class FoldedTokensBN(nn.Module):
    """BatchNorm1d over (N x T, C) -- a sample's T tokens folded into the norm's batch axis, as timm's LeViT
    does -- on tokens that share their sample's offset: N(mu_c + s, 0.5^2) with s ~ N(0, 1) per sample and
    channel, N(mu_c, 1.25) per channel in the population."""

    def __init__(self, c=32):
        super().__init__()
        self.bn = nn.BatchNorm1d(c)
        self.register_buffer("mu", torch.linspace(-1, 1, c))

    def forward(self, x):  # x: (N, T, C), each sample's tokens around its own offset
        return self.bn((self.mu + x).flatten(0, 1))


def _tokens(n: int, g: torch.Generator, t: int = 50, c: int = 32) -> torch.Tensor:
    return torch.randn(n, 1, c, generator=g) + 0.5 * torch.randn(n, t, c, generator=g)


@pytest.mark.parametrize("n", [4, 16])
def test_train_eval_drift_noise_of_tokens_folded_into_the_batch_axis(n):
    # the norm sees n x 50 rows, but their means move with n samples' offsets: the noise is n samples', which
    # the doctor gets from one block of rows per sample. Taken as n x 50 independent rows, the estimate was
    # 6-8x too small (0.10 for 0.81 at 4 samples) and every batch of a healthy model warned
    from normscope.doctor._observe import Call, NormScope
    from normscope.doctor.checks import sampling_noise

    model = FoldedTokensBN().eval()
    with torch.no_grad():
        model.bn.running_mean.copy_(model.mu)
        model.bn.running_var.fill_(1.25)
    g = torch.Generator().manual_seed(1)
    actual, estimated = [], []
    for _ in range(200):
        h = (model.mu + _tokens(n, g)).flatten(0, 1).double()
        mu, var = h.mean(0), h.var(0, unbiased=False)
        actual.append(
            float((mu - model.mu.double()).abs().mean() / 1.25**0.5 + ((var + 1e-5) / (1.25 + 1e-5) - 1).abs().mean())
        )
        call = Call("bn", model.bn, False, 0, 0, args=(h.float(),))
        call.extra["scope"] = NormScope("batch", (0,), 1, None, True, 1e-5)
        estimated.append(sum(sampling_noise(call, model.bn.running_var, 1e-5, batch=n)))
    assert sum(estimated) / len(estimated) == pytest.approx(sum(actual) / len(actual), rel=0.25)
    flagged = sum(bool(doctor(model, _tokens(n, g)).by_check("train-eval-drift")) for _ in range(20))
    assert flagged <= 1
    with torch.no_grad():  # stale: the mean moved by 3 standard deviations
        model.bn.running_mean.add_(3.0)
    assert doctor(model, _tokens(n, g)).by_check("train-eval-drift")


# ------------------------------------------------------------------------------------------ padding


class TokenBN(nn.Module):
    """BatchNorm over tokens, as transformer code writes it: (B, S, D) -> BatchNorm1d over (B, D, S)."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x, attention_mask=None):
        return self.bn(self.proj(x).transpose(1, 2)).transpose(1, 2)


class TokenLN(TokenBN):
    def __init__(self, d):
        super().__init__(d)
        self.bn = nn.LayerNorm(d)

    def forward(self, x, attention_mask=None):
        return self.bn(self.proj(x))


class MaskedTokenBN(TokenBN):
    def __init__(self, d):
        super().__init__(d)
        self.bn = normscope.BatchNorm1d(d, channel_dim=-1)

    def forward(self, x, attention_mask=None):
        return self.bn(self.proj(x), attention_mask.bool())


def _padded(b=4, s=10, d=16):
    torch.manual_seed(1)
    x = torch.randn(b, s, d)
    lengths = torch.tensor([10, 7, 3, 5])
    mask = torch.arange(s)[None, :] < lengths[:, None]
    x[~mask] = 0.0  # zero pads, as an embedding with padding_idx gives
    return x, mask


def test_padding_fraction_and_shift_against_the_valid_only_statistics():
    x, mask = _padded()
    model = TokenBN(16)
    f = _only(doctor(model, x, attention_mask=mask.long()), "padding", "bn")
    assert f.measured["pad_fraction_max"] == pytest.approx(1 - 25 / 40)
    assert f.measured["mask"] == "attention_mask"
    with torch.no_grad():
        h = model.proj(x).double()  # (B, S, D): the BN's scope is every (b, s) of a channel
    valid = h[mask]
    mu_all, var_all = h.reshape(-1, 16).mean(0), h.reshape(-1, 16).var(0, unbiased=False)
    mu_v, var_v = valid.mean(0), valid.var(0, unbiased=False)
    shift = float(((mu_all - mu_v).abs() / (var_v + 1e-5).sqrt()).max())
    ratio = float((((var_all + 1e-5) / (var_v + 1e-5)).log().abs()).max().exp())
    assert f.measured["mean_shift_in_std"] == pytest.approx(shift, rel=1e-9)
    assert f.measured["variance_ratio"] == pytest.approx(ratio, rel=1e-9)
    assert f.severity == "warning" and "lab" in f.threshold["source"]


@pytest.mark.parametrize("healthy", [TokenLN, MaskedTokenBN])
@pytest.mark.parametrize("d", [16, 10], ids=["d16", "d_equals_s"])
def test_padding_silent_for_per_token_norms_and_masked_batchnorm(healthy, d):
    x, mask = _padded(d=d)
    report = doctor(healthy(d), x, attention_mask=mask.long())
    assert report.by_check("padding") == [] and report.checks["padding"]["ran"]


def test_padding_on_channels_as_many_as_positions_is_read_on_the_positions():
    # (B, D, S) with D == S: the mask's (B, S) fits axes (0, 1) and (0, 2); BatchNorm1d's axis 1 is its
    # channels, so the positions are axis 2 -- every channel holds the same 25 valid of 40 positions
    x, mask = _padded(d=10)
    model = TokenBN(10)
    f = _only(doctor(model, x, attention_mask=mask.long()), "padding", "bn")
    assert f.measured["pad_fraction_max"] == pytest.approx(1 - 25 / 40)
    assert f.measured["pad_fraction_mean"] == pytest.approx(1 - 25 / 40)
    with torch.no_grad():
        h = model.proj(x).double()
    valid = h[mask]
    mu_all, mu_v, var_v = h.reshape(-1, 10).mean(0), valid.mean(0), valid.var(0, unbiased=False)
    shift = float(((mu_all - mu_v).abs() / (var_v + 1e-5).sqrt()).max())
    assert f.measured["mean_shift_in_std"] == pytest.approx(shift, rel=1e-9)


def test_padding_reads_torch_key_padding_masks_and_says_when_there_is_none():
    x, mask = _padded()
    assert doctor(TokenBN(16), x, mask=mask).by_check("padding")[0].measured["mask"] == "mask="
    report = doctor(TokenBN(16), x)
    assert report.by_check("padding") == [] and not report.checks["padding"]["ran"]


# ------------------------------------------------------------------------------------------ frozen-bn-updating


def test_frozen_bn_updating_measures_the_running_mean_step():
    model = _conv_bn()
    for p in model[1].parameters():
        p.requires_grad_(False)
    x = torch.randn(8, 3, 10, 10) + 2
    f = _only(doctor(model, x), "frozen-bn-updating", "1")
    with torch.no_grad():
        mu = model[0](x).double().mean((0, 2, 3))
    # momentum 0.1 from running mean 0, variance 1: the mean moves by 0.1 * mu / sqrt(1 + eps)
    assert f.measured["running_mean_moved_in_std"] == pytest.approx(
        float((0.1 * mu).abs().max() / math.sqrt(1 + 1e-5)), rel=1e-5
    )
    assert f.measured["batches_tracked_added"] == 1
    assert f.fix == "model = normscope.freeze_batchnorm(model)"
    assert model[1].num_batches_tracked.item() == 0  # and the doctor put it back


def test_frozen_bn_silent_when_evaluating_or_training_it():
    frozen = _conv_bn().eval()
    for p in frozen[1].parameters():
        p.requires_grad_(False)
    x = torch.randn(8, 3, 10, 10)
    assert doctor(frozen, x).by_check("frozen-bn-updating") == []
    assert doctor(_conv_bn(), x).by_check("frozen-bn-updating") == []  # trainable: moving is right
    fixed = normscope.freeze_batchnorm(copy.deepcopy(frozen).train())
    assert doctor(fixed, x).by_check("frozen-bn-updating") == []


# ------------------------------------------------------------------------------------------ half-overflow, eps


class HalfRMSNorm(nn.Module):
    """A family-style RMSNorm that squares in the input dtype (as T5's did before its fp32 fix)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight.to(x.dtype) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _half_input(peak):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64)
    x[0, 0, 0] = peak
    return x.half()


def test_half_overflow_inside_a_layer_that_squares_in_float16():
    x = _half_input(300.0)
    f = _only(doctor(HalfRMSNorm(64).half(), x), "half-overflow")
    assert f.severity == "error"
    assert f.measured["max_abs"] == 300.0 and f.measured["dtype_max"] == 65504.0
    assert f.measured["max_sum_of_squares"] == pytest.approx(float(x.double().square().sum(-1).max()))
    # torch's LayerNorm computes in float32: the same input is fine
    assert doctor(nn.LayerNorm(64).half(), x).by_check("half-overflow") == []
    assert doctor(HalfRMSNorm(64).half(), _half_input(10.0)).by_check("half-overflow") == []


def test_half_overflow_headroom_and_overflowed_input():
    f = _only(doctor(nn.LayerNorm(64).half(), _half_input(40000.0)), "half-overflow")
    assert f.severity == "warning" and f.measured["headroom"] == pytest.approx(65504 / 40000)
    f = _only(doctor(nn.LayerNorm(64).half(), _half_input(float("inf"))), "half-overflow")
    assert f.severity == "error" and f.measured["max_abs"] == math.inf
    f = _only(doctor(nn.LayerNorm(64), torch.randn(2, 5, 64) * 1e5), "half-overflow")
    assert f.severity == "info"  # float32 beyond float16's range: only if it ran in float16


@pytest.mark.parametrize(("eps", "severity"), [(1e-8, "error"), (1e-7, "warning"), (1e-6, None), (1e-3, None)])
def test_eps_underflow_on_near_constant_scopes_against_float32(eps, severity):
    norm, x = HalfRMSNorm(64, eps=eps).half(), _half_input(1.0)
    found = doctor(norm, x).by_check("eps-underflow")
    stored = torch.tensor(eps, dtype=torch.float16).item()
    # the probe: the first sample scaled so that every row's mean square is eps, through the layer
    # in float16 and through a float32 copy
    x0 = x[:1].float()
    probe = (x0 / x0.square().mean(-1, keepdim=True).sqrt() * math.sqrt(eps)).half()
    with torch.no_grad():
        y16, y32 = norm(probe).double(), copy.deepcopy(norm).float()(probe.float()).double()
    if severity is None:  # 1e-6 is subnormal in float16, but this CPU keeps the result within 5%
        assert found == []
        return
    f = found[0]
    assert f.severity == severity and f.measured["eps_in_dtype"] == stored
    if severity == "error":
        assert stored == 0 and not torch.isfinite(y16).all()
    else:
        expected = float((y16 - y32).abs().max() / y32.abs().max())
        assert expected > 0.05 and f.measured["near_constant_vs_float32"] == pytest.approx(expected)


class T5LayerNorm(nn.Module):
    """transformers' T5LayerNorm: an RMSNorm, statistics in float32, named LayerNorm."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


def test_t5_style_layer_norm_in_float16():
    # its statistics are float32: |x| = 300 (x^2 beyond float16) and eps = 1e-8 do it no harm
    norm = T5LayerNorm(64, eps=1e-8).half()
    report = doctor(norm, _half_input(300.0))
    assert report.by_check("half-overflow") == [] and report.by_check("eps-underflow") == []
    # an RMSNorm (probed: a shift changes its output), so a large mean is no cancellation risk
    torch.manual_seed(0)
    assert doctor(T5LayerNorm(64), torch.randn(4, 6, 64) + 1e4).by_check("cancellation") == []
    # T5's fp16 failure: the feed-forward output overflows to inf before the norm
    f = _only(doctor(norm, _half_input(float("inf"))), "half-overflow")
    assert f.severity == "error" and "already holds inf" in f.reason


def test_eps_underflow_silent_for_layers_that_add_eps_in_float32():
    assert doctor(nn.LayerNorm(64, eps=1e-8).half(), _half_input(1.0)).by_check("eps-underflow") == []


# ------------------------------------------------------------------------------------------ cancellation


class OnePassLayerNorm(nn.Module):
    """LayerNorm with the textbook one-pass variance E[x^2] - E[x]^2."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + self.eps) * self.weight + self.bias


@pytest.mark.parametrize(("offset", "severity"), [(1e3, "warning"), (1e4, "error")])
def test_cancellation_ratio_and_probed_one_pass(offset, severity):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 64) + offset
    f = _only(doctor(OnePassLayerNorm(64), x), "cancellation")
    xd = x.double()
    ratio = float((xd.mean(-1).abs() / xd.var(-1, unbiased=False).sqrt()).max())
    assert f.measured["max_mean_over_std"] == pytest.approx(ratio, rel=1e-9)
    # the error of what the layer divides by: u (mean^2 + var) / (var + eps), u (1 + ratio^2) where var >> eps
    mean, var = xd.mean(-1), xd.var(-1, unbiased=False)
    expected = float((2**-24 * (mean.square() + var) / (var + 1e-5)).max())
    assert f.measured["one_pass_relative_error"] == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(2**-24 * (1 + ratio**2), rel=1e-3)
    assert f.measured["one_pass_in_use"] is True and f.severity == severity


def test_cancellation_where_eps_dominates_the_variance_is_silent():
    # |mean|/std 1e3 over a variance 1e-8, a thousandth of eps: the one-pass error is ~15% of the variance
    # but 6e-5 of the var + eps the layer divides by -- its output agrees with float64 (timm's resnest14d's
    # split attention on pooled features at batch 2 warned here)
    torch.manual_seed(0)
    x = 0.1 + 1e-4 * torch.randn(4, 6, 64)
    assert doctor(OnePassLayerNorm(64), x).by_check("cancellation") == []
    xd = x.double()
    exact = (xd - xd.mean(-1, keepdim=True)) / (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    with torch.no_grad():
        y = OnePassLayerNorm(64)(x).double()
    assert float((y - exact).abs().max() / exact.abs().max()) < 1e-3


def test_cancellation_two_pass_layers_are_information_and_centred_data_silent():
    torch.manual_seed(0)
    f = _only(doctor(nn.LayerNorm(64), torch.randn(4, 6, 64) + 1e3), "cancellation")
    assert f.severity == "info" and f.measured["one_pass_in_use"] is False
    assert doctor(OnePassLayerNorm(64), torch.randn(4, 6, 64)).by_check("cancellation") == []


# ------------------------------------------------------------------------------------------ dead-channels


def test_dead_channels_below_eps_and_the_gain_eps_then_gives():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8))
    with torch.no_grad():
        model[0].weight[[2, 5]] = 0.0
        model[0].bias[[2, 5]] = -1.0  # ReLU never fires: constant 0
    x = torch.randn(8, 3, 10, 10)
    f = _only(doctor(model, x), "dead-channels", "2")
    with torch.no_grad():
        var = model[1](model[0](x)).double().var((0, 2, 3), unbiased=False)
    assert f.measured["indices"] == (var < 1e-5).nonzero().flatten().tolist() == [2, 5]
    assert f.measured["gain"] == pytest.approx(1 / math.sqrt(1e-5))
    assert f.severity == "info"  # one batch: the cause is the layer before; the watch warns when channels die
    torch.manual_seed(0)
    healthy = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8))
    assert doctor(healthy, x).by_check("dead-channels") == []


def test_dead_channels_in_eval_are_dead_in_the_running_statistics_too():
    # a sparse channel (a ReLU that fires on few inputs) can be constant on one batch while the running
    # statistics saw it vary: not dead. One they saw constant too is
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8)).eval()
    with torch.no_grad():
        model[0].weight[[2, 5]] = 0.0
        model[0].bias[[2, 5]] = -1.0  # constant 0 on every input
        x = torch.randn(8, 3, 10, 10)
        h = model[1](model[0](x)).double()
        model[2].running_mean.copy_(h.mean((0, 2, 3)))
        model[2].running_var.copy_(h.var((0, 2, 3)))
        model[2].running_var[2] = 0.5  # channel 2 varied in the data the statistics came from
    f = _only(doctor(model, x), "dead-channels", "2")
    assert f.measured["indices"] == [5] and f.severity == "info"


# ------------------------------------------------------------------------------------------ bias-before-norm


def test_bias_before_batchnorm_found_and_the_fix_keeps_eval_outputs():
    model = _conv_bn(bias=True)
    x = torch.randn(8, 3, 10, 10)
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
    f = _only(doctor(model, x), "bias-before-norm", "1")
    assert f.measured["producer"] == "0" and f.severity == "info"  # changes nothing, costs its parameters
    assert f.measured["bias_max_abs"] == float(model[0].bias.detach().abs().max())
    model.eval()
    with torch.no_grad():
        before = model(x)
    fixed, lines = apply_fixes(model, doctor(model, x))
    assert fixed[0].bias is None and lines
    with torch.no_grad():
        torch.testing.assert_close(fixed(x), before, rtol=1e-5, atol=1e-5)


def test_bias_before_groupnorm_with_one_channel_per_group_found_and_fixed():
    # GroupNorm(C, C) is InstanceNorm's scope: the per-(sample, channel) mean removes a conv's bias. It was
    # not reported (only BatchNorm/InstanceNorm classes were), and the fix line read `norm.running_mean`,
    # which a GroupNorm does not have. Oracle: the model's output with the bias zeroed, computed here.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(8, 8))
    x = torch.randn(4, 3, 6, 6)
    with torch.no_grad():
        model[0].bias.uniform_(-2, 2)
        before = model(x)
        without = copy.deepcopy(model)
        without[0].bias.zero_()
        torch.testing.assert_close(without(x), before, rtol=1e-5, atol=1e-5)  # the bias cannot matter
    f = _only(doctor(model, x, checks=["bias-before-norm"]), "bias-before-norm", "1")
    assert f.measured["producer"] == "0"
    fixed, lines = apply_fixes(model, doctor(model, x, checks=["bias-before-norm"]))
    assert fixed[0].bias is None and lines
    with torch.no_grad():
        torch.testing.assert_close(fixed(x), before, rtol=1e-5, atol=1e-5)


def test_a_bias_before_a_batchnorm_that_bn_elements_converts_is_kept():
    # both fixes at once removed the conv's bias, then replaced the BatchNorm by GroupNorm(32, 64), whose
    # group mean spans two channels of different biases: the bias then counts, and it was gone. Oracle:
    # torch's own GroupNorm(32, 64) on the original conv's output (bias included).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64))
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        model[0].bias.uniform_(-2, 2)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    report = doctor(model, x, checks=["bias-before-norm", "bn-elements"])
    assert {f.check for f in report.findings} == {"bias-before-norm", "bn-elements"}
    gn = nn.GroupNorm(32, 64)
    gn.load_state_dict({"weight": model[1].weight, "bias": model[1].bias})
    with torch.no_grad():
        expected = gn(model[0](x))
    fixed, lines = apply_fixes(model, report)
    assert fixed[0].bias is not None and len(lines) == 1, lines
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 32
    with torch.no_grad():
        torch.testing.assert_close(fixed(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "healthy",
    [
        lambda: _conv_bn(bias=False),
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8)),  # removes only the group's mean
        lambda: nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8)),  # removes only the bias's mean
    ],
)
def test_bias_before_norm_silent_where_the_norm_does_not_remove_it(healthy):
    x = torch.randn(8, 3, 10, 10) if not isinstance(healthy()[0], nn.Linear) else torch.randn(8, 3)
    assert doctor(healthy(), x).by_check("bias-before-norm") == []


class _ConvBnResidual(nn.Module):
    """The conv's output goes into the BatchNorm and, with its bias, around it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class _ConvCalledTwice(nn.Module):
    """The conv feeds the BatchNorm in one call and the output directly in another."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.conv(2 * x)


@pytest.mark.parametrize("build", [_ConvBnResidual, _ConvCalledTwice])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_bias_before_norm_silent_where_the_bias_also_reaches_the_output_another_way(build, mode):
    # the norm removes the bias from its own input only; removing the bias (the fix) changes this model's
    # output by the bias itself, so it is no finding and apply_fixes leaves the model as it is
    torch.manual_seed(0)
    model = getattr(build(), mode)()
    x = torch.randn(8, model.conv.in_channels, 6, 6)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        before = model(x)
        without = copy.deepcopy(model)
        without.bn.running_mean.sub_(without.conv.bias)
        without.conv.bias.zero_()
        assert (without(x) - before).abs().max() > 0.05  # the bias matters here
    report = doctor(model, x, checks=["bias-before-norm"])
    assert report.by_check("bias-before-norm") == []
    fixed, _ = apply_fixes(model, report)
    assert fixed.conv.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(fixed(x), before, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ post-ln


def _encoder(norm_first, frozen=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    if frozen:
        model.requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", [False, True])
def test_post_ln_norms_on_the_residual_stream(frozen):
    report = doctor(_encoder(norm_first=False, frozen=frozen), torch.randn(2, 5, 16))
    found = {f.module for f in report.by_check("post-ln")}
    if frozen:  # no autograd graph: torch's layers say norm_first=False, every norm of them
        assert found == {f"layers.{i}.norm{j}" for i in (0, 1) for j in (1, 2)}
    else:  # the first norm's residual comes from the input; every later one from a norm
        assert found == {"layers.0.norm2", "layers.1.norm1", "layers.1.norm2"}
    assert all(f.severity == "info" and "Xiong" in f.threshold["source"] for f in report.by_check("post-ln"))


def test_pre_ln_silent():
    assert doctor(_encoder(norm_first=True), torch.randn(2, 5, 16)).by_check("post-ln") == []


class Residual(nn.Module):
    """Two residual blocks after an embedding norm, wired as ``kind`` says:

    * ``post``: ``x = norm(x + f(x))`` -- Post-LN, the stream passes through each norm;
    * ``sandwich``: ``x = x + post(f(pre(x)))`` -- a norm at the end of each branch (Gemma 2, OLMo 2);
    * ``pre_after_embedding_norm``: ``x = x + f(pre(x))`` after ``x = emb_norm(x)`` (BLOOM's first layer);
    * ``identity_first_pre``: as ``pre``, the first block's own norm left out because the embedding norm
      already normalized its input (ModernBERT's first layer), so the first sum is read by the next norm
      *and* the next add.
    """

    def __init__(self, kind: str, d: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.emb_norm = nn.LayerNorm(d)
        self.f = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.pre = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
        self.post = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))

    def forward(self, x):
        x = self.emb_norm(x)
        for i in range(2):
            if self.kind == "post":
                x = self.post[i](x + self.f[i](x))
            elif self.kind == "sandwich":
                x = x + self.post[i](self.f[i](self.pre[i](x)))
            elif self.kind == "pre_after_embedding_norm":
                x = x + self.f[i](self.pre[i](x))
            else:
                x = x + self.f[i](x if i == 0 else self.pre[i](x))
        return self.post[0](x) if self.kind != "post" else x


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("post", {"post.0": "emb_norm", "post.1": "post.0"}),
        ("sandwich", {}),
        ("pre_after_embedding_norm", {}),
        ("identity_first_pre", {}),
    ],
)
def test_post_ln_only_where_the_stream_passes_through_the_norm(kind, expected):
    # a norm's output as an operand of the add is not enough: it must be the skip (the branch computed from
    # it, no norm in between) and the sum must go nowhere but into the norm. Every wiring but the first read as
    # Post-LN when any operand of the add was a norm's output
    report = doctor(Residual(kind), torch.randn(2, 5, 16))
    assert {f.module: f.measured["residual_from"] for f in report.by_check("post-ln")} == expected


# ------------------------------------------------------------------------------------------ casting-order


class LlamaStyleRMSNorm(nn.Module):
    """A model family's RMSNorm written out: normalize in float32, cast, then scale (Llama's order)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.to(x.dtype)


def test_casting_order_probed_and_compared_with_torch_rounding():
    torch.manual_seed(0)
    norm = LlamaStyleRMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.bfloat16()
    x = (torch.randn(4, 8, 64) * 3).bfloat16()
    f = _only(doctor(norm, x), "casting-order")
    assert f.measured["implements"] == "rms_norm(casting='llama', weight_offset=0)"
    assert f.measured["other_orders"]["llama"]["max_abs"] == 0.0
    with torch.no_grad():  # torch's own rounding of the same layer: F.rms_norm in bfloat16
        ours = norm(x)
        theirs = TF.rms_norm(x, (64,), norm.weight, 1e-6)
    differ = (theirs.double() != ours.double()).double().mean().item()
    assert differ > 0
    assert f.measured["other_orders"]["torch"]["fraction_different"] == pytest.approx(differ)
    assert f.measured["other_orders"]["torch"]["max_abs"] == (theirs.double() - ours.double()).abs().max().item()
    assert f.severity == "info" and "casting='llama'" in f.fix


def test_casting_order_silent_in_float32():
    assert doctor(nn.RMSNorm(64), torch.randn(4, 8, 64)).by_check("casting-order") == []


# ------------------------------------------------------------------------------------------ batch-invariance


class MixBatch(nn.Module):
    """A per-sample layer in name that subtracts the batch mean (mixing samples)."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_batch_invariance_names_a_module_that_mixes_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MixBatch(), nn.LayerNorm(8)).eval()
    x = torch.randn(6, 8)
    f = _only(doctor(model, x), "batch-invariance", "1")
    with torch.no_grad():
        h = model[0](x)
        inside = (h - h.mean(0))[:1]
        alone = h[:1] - h[:1]
    expected = float((inside - alone).abs().max() / inside.abs().max())
    assert f.severity == "warning" and f.measured["relative_difference"] == pytest.approx(expected)


def test_batch_invariance_batchnorm_by_design_and_per_sample_model_silent():
    report = doctor(_conv_bn(), torch.randn(4, 3, 10, 10))
    (f,) = [g for g in report.by_check("batch-invariance") if g.measured["kind"] == "by design"]
    assert f.severity == "info" and f.module == "" and f.measured["paths"] == ["1"]
    assert all(g.severity == "info" for g in report.by_check("batch-invariance"))  # the conv: rounding at most
    torch.manual_seed(0)
    healthy = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16)).eval()
    found = doctor(healthy, torch.randn(6, 8)).by_check("batch-invariance")
    assert [f for f in found if f.severity != "info"] == []


class NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a BatchNorm2d subclass with children, its activation applied in place."""

    def __init__(self, c):
        super().__init__(c)
        self.drop = nn.Identity()
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


class InPlaceAfterNorms(nn.Module):
    """torchvision's ResNet pattern (bn, then ReLU(inplace=True) on its output) and timm's NormAct."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, bias=False)
        self.bn2 = NormAct(8)

    def forward(self, x):
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))


@pytest.mark.parametrize("training", [False, True])
def test_batch_invariance_not_fooled_by_in_place_activations(training):
    # the activations overwrite the tensors the hooks see; every sample stands alone in eval mode, and in
    # training the BatchNorms -- the NormAct one itself, not its activation child -- mix the batch by design
    torch.manual_seed(0)
    model = InPlaceAfterNorms().train(training)
    x = torch.randn(4, 3, 12, 12)
    with torch.no_grad():  # the fact the check must agree with: eval mode is batch-invariant here
        m = copy.deepcopy(model).eval()
        assert (m(x)[:1] - m(x[:1])).abs().max() < 1e-5
    found = doctor(model, x).by_check("batch-invariance")
    assert [f for f in found if f.severity != "info"] == []
    design = [f for f in found if f.measured["kind"] == "by design"]
    assert (design[0].measured["paths"] if design else []) == (["bn1", "bn2"] if training else [])


class MixesInItsOwnCode(nn.Module):
    """A block whose children are per-sample but whose own forward subtracts the batch mean."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.fc(x))
        return h - h.mean(0, keepdim=True)


def test_batch_invariance_names_the_innermost_module_whose_input_agreed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Identity(), MixesInItsOwnCode()), nn.LayerNorm(8)).eval()
    x = torch.randn(6, 8)
    (f,) = [g for g in doctor(model, x).by_check("batch-invariance") if g.severity == "warning"]
    # not the root, not the Sequential around it (their outputs differ because of it), not the LayerNorm
    # after it (its input already differs), not its children (they agree)
    assert f.module == "1.1" and f.measured["input_relative_difference"] <= 1e-5  # the Linear before: rounding
    with torch.no_grad():
        h = model[1][1].act(model[1][1].fc(model[0](x)))
        inside, alone = (h - h.mean(0))[:1], h[:1] - h[:1]
    assert f.measured["relative_difference"] == pytest.approx(float((inside - alone).abs().max() / inside.abs().max()))


class WritesAfterTheNorm(nn.Module):
    """A norm's input and output both written in place after the norm returned."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        h = self.conv(x)
        y = self.bn(h)
        y.mul_(0.0)  # the norm's output, overwritten
        h.add_(1000.0)  # the norm's input, overwritten
        return y + h


def test_checks_read_what_the_norm_saw_not_what_was_written_later():
    torch.manual_seed(0)
    model, x = WritesAfterTheNorm(), torch.randn(8, 3, 10, 10) * 2 + 3
    f = _only(doctor(model, x), "train-eval-drift", "bn")
    with torch.no_grad():
        h = model.conv(x).double()
    mu, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
    expected = float((mu.abs() / math.sqrt(1 + 1e-5)).mean() + ((var + 1e-5) / (1 + 1e-5) - 1).abs().mean())
    assert f.measured["distance"] == pytest.approx(expected, rel=1e-9)


def test_casting_order_compares_the_output_the_norm_returned():
    torch.manual_seed(0)
    norm = nn.RMSNorm(64, eps=1e-6).half()
    model = nn.Sequential(norm, nn.ReLU(inplace=True))  # overwrites the RMSNorm's output
    f = _only(doctor(model, torch.randn(4, 8, 64).half()), "casting-order", "0")
    assert f.measured["other_orders"]["torch"]["max_abs"] == 0.0  # its own order: the very same bits


# ------------------------------------------------------------------------------------------ syncbn


def _synced():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), normscope.SyncBatchNorm(8))


@pytest.mark.parametrize(
    ("world", "severity", "per_rank"),
    [
        (None, "info", None),
        (1, "warning", None),
        (3, "warning", [3, 3, 2]),
        (16, "warning", [1] * 8 + [0] * 8),
        (4, None, None),
    ],
)
def test_syncbn_hazards(world, severity, per_rank):
    found = doctor(_synced(), torch.randn(8, 3, 10, 10), world_size=world).by_check("syncbn")
    if severity is None:
        assert found == []
        return
    assert found[0].severity == severity
    if per_rank is not None:
        assert found[0].measured["per_rank"] == per_rank == [len(c) for c in torch.arange(8).tensor_split(world)]


def test_syncbn_check_silent_without_syncbn():
    report = doctor(_conv_bn(), torch.randn(8, 3, 10, 10), world_size=2)
    assert report.by_check("syncbn") == [] and "no SyncBatchNorm" in report.checks["syncbn"]["note"]


# ------------------------------------------------------------------------------------------ state


class Trainee(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.mean((2, 3)))


def _state(model):
    return {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}


def test_state_rng_and_flags_are_restored_bitwise():
    torch.manual_seed(3)
    model = Trainee()
    model.head.eval()  # a mixed-mode model
    model.conv.weight.requires_grad_(False)
    model(torch.randn(4, 3, 8, 8)).sum().backward()  # populated gradients
    objects = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    before, grads = _state(model), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    flags = {n: m.training for n, m in model.named_modules()}
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    calls = model.calls
    x = torch.randn(4, 3, 8, 8)
    random.seed(5)
    np.random.seed(5)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    doctor(model, x)
    for k, v in model.state_dict(keep_vars=True).items():
        assert v is objects[k] and torch.equal(v, before[k]) and v.dtype == before[k].dtype, k
    assert {n: p.grad for n, p in model.named_parameters() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert {n: p.requires_grad for n, p in model.named_parameters()} == requires
    assert model.calls == calls
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    np_state = np.random.get_state()
    assert np_state[0] == rng[2][0] and np.array_equal(np_state[1], rng[2][1]) and np_state[2:] == rng[2][2:]


class Explodes(Trainee):
    def forward(self, x):
        self.bn(self.conv(x))  # the running statistics move first
        raise RuntimeError("boom")


def test_state_restored_when_the_forward_raises():
    model = Explodes()
    before = _state(model)
    x = torch.randn(4, 3, 8, 8)
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        doctor(model, x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


# ------------------------------------------------------------------------------------------ recalibrate


def _population(tensors, dims):
    """The direct formula: mean and unbiased variance of every element of ``tensors`` together, float64."""
    flat = torch.cat([t.double().movedim(1, 0).reshape(t.shape[1], -1) for t in tensors], 1)
    return flat.mean(1), flat.var(1, unbiased=True)


def test_recalibrate_is_the_population_mean_and_variance_of_all_the_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))
    # six batches of different sizes and means: the spread between the batches' means is part of the
    # population's variance (fvcore's first PreciseBN, averaging per-batch variances, missed it)
    batches = [torch.randn(2 + i, 3, 10, 10) + 2 * i for i in range(6)]
    model.eval()
    nbt = model[1].num_batches_tracked.clone()
    out = recalibrate(model, batches)
    assert out is model and not model[1].training and model[1].momentum == 0.1
    assert torch.equal(model[1].num_batches_tracked, nbt)
    with torch.no_grad():  # the BatchNorms' inputs, the first normalizing each batch with its own statistics
        h1 = [model[0](x).double() for x in batches]
        h2, conv2 = [], copy.deepcopy(model[3]).double()
        for h in h1:
            mu, var = h.mean((0, 2, 3), keepdim=True), h.var((0, 2, 3), unbiased=False, keepdim=True)
            w, b = model[1].weight.double()[:, None, None], model[1].bias.double()[:, None, None]
            h2.append(conv2(torch.relu((h - mu) / (var + 1e-5).sqrt() * w + b)))
    for bn, hs in ((model[1], h1), (model[4], h2)):
        mean, var = _population(hs, (0, 2, 3))
        torch.testing.assert_close(bn.running_mean.double(), mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bn.running_var.double(), var, rtol=1e-6, atol=1e-6)
    # the average of the batches' variances is far from it here
    averaged = sum(h.var((0, 2, 3), unbiased=True) for h in h1) / len(h1)
    assert float((averaged / _population(h1, (0, 2, 3))[1]).min()) < 0.9


def test_recalibrate_counts_only_the_valid_elements_of_a_masked_batchnorm():
    torch.manual_seed(0)
    bn = normscope.BatchNorm1d(4)
    g = torch.Generator().manual_seed(3)
    batches = []
    for n, t in ((2, 7), (5, 3), (3, 11)):
        x = torch.randn(n, 4, t, generator=g) * 3 + 1
        mask = torch.rand(n, t, generator=g) < 0.6
        x = x.masked_fill(~mask[:, None], 100.0)  # padding that must not count
        batches.append((x, mask))
    recalibrate(bn, batches)
    valid = torch.cat([x.double().transpose(1, 2)[m] for x, m in batches])  # (valid positions, C)
    # float32 buffers: one rounding of the float64 result
    torch.testing.assert_close(bn.running_mean.double(), valid.mean(0), rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(bn.running_var.double(), valid.var(0, unbiased=True), rtol=1e-7, atol=1e-7)


def _recalibrate_rank(rank, world, store, shards, out):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    try:
        bn = normscope.SyncBatchNorm(3)
        recalibrate(bn, shards[rank])
        torch.save((bn.running_mean, bn.running_var), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_recalibrate_a_syncbatchnorm_over_every_rank(tmp_path):
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(5)
    # unequal shards: rank 0 holds 2 batches, rank 1 holds 2 of other sizes and means
    shards = [
        [torch.randn(3, 3, 4, generator=g) + 1, torch.randn(5, 3, 4, generator=g)],
        [torch.randn(2, 3, 4, generator=g) - 2, torch.randn(4, 3, 4, generator=g) * 2],
    ]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_recalibrate_rank, args=(r, 2, str(tmp_path / "store"), shards, str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"a rank failed (exit code {p.exitcode})"
    # each step's statistics span both ranks' batches of that step: together, every element of every shard
    mean, var = _population([x for shard in shards for x in shard], (0, 2))
    for r in range(2):
        rm, rv = torch.load(tmp_path / f"rank{r}.pt")
        torch.testing.assert_close(rm.double(), mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rv.double(), var, rtol=1e-6, atol=1e-6)


def test_recalibrate_removes_the_drift_finding_and_checks_its_arguments():
    model = _conv_bn()
    x = torch.randn(8, 3, 10, 10) * 2 + 3
    assert doctor(model, x).by_check("train-eval-drift")
    recalibrate(model, [x])
    assert doctor(model, x).by_check("train-eval-drift") == []
    with pytest.raises(TypeError, match="iterable of batches"):
        recalibrate(model, x)
    with pytest.raises(ValueError, match="at least one batch"):
        recalibrate(model, [])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        recalibrate("model", [x])


# ------------------------------------------------------------------------------------------ report, arguments


def test_report_json_schema_and_order():
    report = doctor(_conv_bn(bias=True), torch.randn(2, 3, 5, 5))
    doc = json.loads(report.to_json())
    assert doc["schema"] == SCHEMA == "normscope.doctor/1"
    assert set(doc) >= {"normscope", "torch", "model", "inputs", "world_size", "summary", "checks", "findings"}
    assert set(doc["checks"]) == set(CHECKS)
    sev = [f["severity"] for f in doc["findings"]]
    assert sev == sorted(sev, key=["error", "warning", "info"].index)
    assert set(doc["findings"][0]) == {"check", "module", "severity", "measured", "threshold", "reason", "fix"}
    assert doc["summary"]["error"] == report.count("error") >= 1
    assert all(f["threshold"]["source"] for f in doc["findings"])


def test_every_fix_line_compiles():
    report = doctor(_conv_bn(bias=True), torch.randn(2, 3, 5, 5))
    for f in report.findings:
        compile(f.fix, f.check, "exec")


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(TypeError, match="expected `model` to be a torch.nn.Module, got str"):
        doctor("resnet", torch.randn(2, 3))
    with pytest.raises(ValueError, match="expected `world_size` to be a positive int or None, got 0"):
        doctor(_conv_bn(), torch.randn(2, 3, 5, 5), world_size=0)
    with pytest.raises(TypeError, match="expected `checks` to be a list of check names, got the string 'padding'"):
        doctor(_conv_bn(), torch.randn(2, 3, 5, 5), checks="padding")
    with pytest.raises(ValueError, match="unknown \\['bn'\\]"):
        doctor(_conv_bn(), torch.randn(2, 3, 5, 5), checks=["bn"])
    with pytest.raises(ValueError, match="expected `mask` to be a \\(batch, positions\\) tensor"):
        doctor(_conv_bn(), torch.randn(2, 3, 5, 5), mask=torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected `name` to be one of"):
        Report([]).by_check("no-such-check")


def test_exported_from_normscope():
    assert normscope.doctor is doctor and normscope.recalibrate is recalibrate
    assert {"doctor", "recalibrate"} <= set(normscope.__all__)


def test_a_subset_of_checks_runs_only_those():
    report = doctor(_conv_bn(bias=True), torch.randn(2, 3, 5, 5), checks=["bn-elements"])
    assert set(report.checks) == {"bn-elements"} and {f.check for f in report.findings} == {"bn-elements"}


class PermutingLayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: an nn.LayerNorm over C of (N, C, H, W), by permuting inside."""

    def forward(self, x):
        y = TF.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return y.permute(0, 3, 1, 2)


def test_channels_first_layer_norm_gets_the_channel_scope():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 7) + 300.0
    f = _only(doctor(PermutingLayerNorm2d(8), x), "cancellation")
    xd = x.double()  # statistics over C at each (n, h, w)
    expected = float((xd.mean(1).abs() / xd.var(1, unbiased=False).sqrt()).max())
    assert f.measured["max_mean_over_std"] == pytest.approx(expected, rel=1e-9)


def test_a_healthy_cnn_has_nothing_above_information():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(32, 3, 10, 10)  # 32 x 8 x 8 = 2048 values per statistic
    recalibrate(model, [x])
    report = doctor(model, x)
    assert [f for f in report.findings if f.severity != "info"] == []


def test_one_value_per_channel_is_the_bn_elements_error_not_a_traceback():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(8))
    before = _state(model)
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model(x)  # what torch says, and where the forward stops
    model.load_state_dict(before)
    report = doctor(model, x)
    f = _only(report, "bn-elements", "3")
    assert f.severity == "error" and f.measured["elements"] == 1 and f.measured["input_shape"] == [1, 8]
    assert not report.checks["padding"]["ran"] and "stopped at 3" in report.checks["padding"]["note"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # any other error of the forward is the model's own, and propagates
    with pytest.raises(RuntimeError):
        doctor(model, torch.randn(4, 5, 8, 8))
