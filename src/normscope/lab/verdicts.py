"""Claim verdicts: each rule is fixed here, in code, before any run, as a pure function of the
measured metrics. A rule is never tuned to the numbers it judges; if the numbers do not meet it
the report says "not reproduced at this scale".

Each rule returns a :class:`Verdict` with the claim, the published figure, what we measured and
the outcome; ``rule`` states the criterion in words so the report can print it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced at this scale"


@dataclass(frozen=True)
class Verdict:
    claim: str
    published: str
    measured: str
    outcome: str
    rule: str

    def asdict(self) -> dict:
        return asdict(self)


def skipped(claim: str, published: str, reason: str) -> Verdict:
    """The verdict of a claim whose pieces are missing: never a pass, never a fail."""
    return Verdict(claim, published, "-", f"skipped: {reason}", "-")


def _ok(cond: bool) -> str:
    return REPRODUCED if cond else NOT_REPRODUCED


def _finite(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


# ---------------------------------------------------------------------------------------------
# batch-size (Wu & He 2018)

BATCH_SIZE_CLAIM = "BatchNorm's error grows as the batch shrinks while GroupNorm's stays flat"
BATCH_SIZE_PUBLISHED = ("Wu & He 2018, ResNet-50 ImageNet top-1 error: BN 23.6 -> 34.7 from 32 to 2 images/GPU, "
                        "GN 24.1 flat; at 32: BN 23.6, LN 25.3, IN 28.4, GN 24.1")
BATCH_SIZE_RULE = ("BN's test error at the smallest batch exceeds its error at the largest by >= 1.0 point, by more "
                   "than twice GN's change, and GN beats BN at the smallest batch")


def batch_size_rule(bn_err: dict[int, float], gn_err: dict[int, float]) -> Verdict:
    """``bn_err``/``gn_err``: batch size -> mean test error in percent."""
    big, small = max(bn_err), min(bn_err)
    d_bn, d_gn = bn_err[small] - bn_err[big], gn_err[small] - gn_err[big]
    ok = _finite(d_bn, d_gn) and d_bn >= 1.0 and d_bn > 2 * abs(d_gn) and bn_err[small] > gn_err[small]
    measured = (f"BN {bn_err[big]:.1f} -> {bn_err[small]:.1f} (batch {big} -> {small}), "
                f"GN {gn_err[big]:.1f} -> {gn_err[small]:.1f} (test error %)")
    return Verdict(BATCH_SIZE_CLAIM, BATCH_SIZE_PUBLISHED, measured, _ok(ok), BATCH_SIZE_RULE)


# ---------------------------------------------------------------------------------------------
# padding (Shen et al. 2020, PowerNorm)

PADDING_CLAIM = "Padding tokens contaminate BatchNorm's statistics in a transformer; masking them out helps"
PADDING_PUBLISHED = ("Shen et al. 2020 (PowerNorm): naive BN in transformers underperforms LN on NLP; "
                     "statistics must exclude padding")
PADDING_RULE = "masked BN's test accuracy exceeds plain BN's (pads counted) by >= 1.0 point"


def padding_rule(plain_bn_acc: float, masked_bn_acc: float) -> Verdict:
    """Accuracies in percent."""
    ok = _finite(plain_bn_acc, masked_bn_acc) and masked_bn_acc - plain_bn_acc >= 1.0
    measured = f"test accuracy: plain BN {plain_bn_acc:.1f}%, masked BN {masked_bn_acc:.1f}%"
    return Verdict(PADDING_CLAIM, PADDING_PUBLISHED, measured, _ok(ok), PADDING_RULE)


FLUCT_CLAIM = "Batch statistics fluctuate far more on text than on images"
FLUCT_PUBLISHED = ("Shen et al. 2020, Fig. 2/3: |mu_B - mu| and |var_B - var| for a transformer on IWSLT14 are "
                   "much larger than for ResNet on CIFAR-10")
FLUCT_RULE = "mean distance of batch statistics from the running ones is >= 2x larger for text than for images"


def fluctuation_rule(text_dist: float, image_dist: float) -> Verdict:
    ok = _finite(text_dist, image_dist) and text_dist >= 2.0 * image_dist
    measured = f"distance of batch mean+var from running: text {text_dist:.3f}, images {image_dist:.3f}"
    return Verdict(FLUCT_CLAIM, FLUCT_PUBLISHED, measured, _ok(ok), FLUCT_RULE)


POWER_CLAIM = "PowerNorm (quadratic mean, running statistics in the forward pass) closes BN's gap to LN"
POWER_PUBLISHED = "Shen et al. 2020: PN outperforms LN and BN on IWSLT14 and WMT14 translation"
POWER_RULE = "PowerNorm's test accuracy is within 1.0 point of LN's or above it, and above plain BN's"


def power_rule(power_acc: float, ln_acc: float, plain_bn_acc: float) -> Verdict:
    ok = _finite(power_acc, ln_acc, plain_bn_acc) and power_acc >= ln_acc - 1.0 and power_acc > plain_bn_acc
    measured = f"test accuracy: PowerNorm {power_acc:.1f}%, LN {ln_acc:.1f}%, plain BN {plain_bn_acc:.1f}%"
    return Verdict(POWER_CLAIM, POWER_PUBLISHED, measured, _ok(ok), POWER_RULE)


# ---------------------------------------------------------------------------------------------
# prenorm (Xiong et al. 2020)

PRENORM_GRAD_CLAIM = "At init, Post-LN's per-layer gradient norms grow toward the top layers; Pre-LN's stay flat"
PRENORM_GRAD_PUBLISHED = ("Xiong et al. 2020, Fig. 3: Post-LN gradient norm of W2 rises with the layer index, "
                          "Pre-LN flat")
PRENORM_GRAD_RULE = ("at the deepest depth, Post-LN's last/first-layer gradient-norm ratio is >= 2 and "
                     "Pre-LN's lies in [0.5, 2]")


def prenorm_grad_rule(post_ratio: float, pre_ratio: float, depth: int) -> Verdict:
    ok = _finite(post_ratio, pre_ratio) and post_ratio >= 2.0 and 0.5 <= pre_ratio <= 2.0
    measured = f"depth {depth}: last/first layer gradient ratio Post-LN {post_ratio:.2f}, Pre-LN {pre_ratio:.2f}"
    return Verdict(PRENORM_GRAD_CLAIM, PRENORM_GRAD_PUBLISHED, measured, _ok(ok), PRENORM_GRAD_RULE)


WARMUP_CLAIM = "Post-LN needs learning-rate warm-up; Pre-LN trains without it"
WARMUP_PUBLISHED = ("Xiong et al. 2020: Post-LN without warm-up fails / is much worse (BLEU far below) at lr 5e-4 "
                    "and 1e-3; Pre-LN reaches comparable results without warm-up")
WARMUP_RULE = ("Post-LN without warm-up fails more often than Pre-LN without warm-up, or its validation loss is "
               ">= 0.1 nats worse than both Post-LN with warm-up and Pre-LN without warm-up")


def warmup_rule(loss: dict[str, float], failed: dict[str, float]) -> Verdict:
    """``loss``/``failed``: variant ('post', 'post+warmup', 'pre') -> mean final validation loss
    (nats) / fraction of seeds that failed (diverged or stuck at the unigram loss)."""
    post, post_w, pre = loss["post"], loss["post+warmup"], loss["pre"]
    by_fail = failed["post"] > failed["pre"]
    by_loss = _finite(post, post_w, pre) and post - post_w >= 0.1 and post - pre >= 0.1
    ok = by_fail or by_loss
    measured = (f"val loss Post-LN {post:.3f} (failed {failed['post']:.0%}), Post-LN+warm-up {post_w:.3f} "
                f"(failed {failed['post+warmup']:.0%}), Pre-LN {pre:.3f} (failed {failed['pre']:.0%})")
    return Verdict(WARMUP_CLAIM, WARMUP_PUBLISHED, measured, _ok(ok), WARMUP_RULE)


# ---------------------------------------------------------------------------------------------
# rms-vs-layer (Zhang & Sennrich 2019)

RMS_QUALITY_CLAIM = "RMSNorm matches LayerNorm's quality"
RMS_QUALITY_PUBLISHED = "Zhang & Sennrich 2019: RMSNorm comparable to LN on translation/LM/vision tasks"
RMS_QUALITY_RULE = "RMSNorm's validation loss is at most 0.05 nats above LayerNorm's"


def rms_quality_rule(ln_loss: float, rms_loss: float) -> Verdict:
    ok = _finite(ln_loss, rms_loss) and rms_loss - ln_loss <= 0.05
    measured = f"char-LM val loss: LN {ln_loss:.3f}, RMSNorm {rms_loss:.3f} nats"
    return Verdict(RMS_QUALITY_CLAIM, RMS_QUALITY_PUBLISHED, measured, _ok(ok), RMS_QUALITY_RULE)


RMS_SPEED_CLAIM = "RMSNorm is cheaper than LayerNorm"
RMS_SPEED_PUBLISHED = "Zhang & Sennrich 2019: 7%-64% faster than LN (model running time)"
RMS_SPEED_RULE = "the RMSNorm operator (forward+backward) takes <= 93% of LayerNorm's time (>= 7% faster)"


def rms_speed_rule(ln_ms: float, rms_ms: float, what: str = "operator fwd+bwd") -> Verdict:
    ok = _finite(ln_ms, rms_ms) and rms_ms <= 0.93 * ln_ms
    measured = f"{what}: LN {ln_ms:.3f} ms, RMSNorm {rms_ms:.3f} ms (RMS/LN time ratio {rms_ms / ln_ms:.2f})"
    return Verdict(RMS_SPEED_CLAIM, RMS_SPEED_PUBLISHED, measured, _ok(ok), RMS_SPEED_RULE)


NO_NORM_CLAIM = "A transformer without normalization fails to train"
NO_NORM_PUBLISHED = "Zhang & Sennrich 2019 / Xiong et al. 2020: without LN the model diverges or fails to converge"
NO_NORM_RULE = "at least half the seeds without a norm fail (diverge, or end no better than the unigram loss)"


def no_norm_rule(failed_fraction: float, ln_loss: float, none_loss: float) -> Verdict:
    ok = _finite(failed_fraction) and failed_fraction >= 0.5
    measured = f"no norm: {failed_fraction:.0%} of seeds failed; val loss none {none_loss:.3f} vs LN {ln_loss:.3f}"
    return Verdict(NO_NORM_CLAIM, NO_NORM_PUBLISHED, measured, _ok(ok), NO_NORM_RULE)


# ---------------------------------------------------------------------------------------------
# smoothness (Santurkar et al. 2018)

SMOOTH_CLAIM = "BatchNorm makes the loss landscape smoother along the gradient"
SMOOTH_PUBLISHED = ("Santurkar et al. 2018, Fig. 4: VGG on CIFAR-10, BN shrinks the loss range, the gradient-change "
                    "range and the effective beta-smoothness along the gradient direction")
SMOOTH_RULE = "with BN, the median (over training) loss range and effective beta-smoothness are both lower than without"


def smoothness_rule(bn: dict[str, float], plain: dict[str, float]) -> Verdict:
    """``bn``/``plain``: {'loss_range': median, 'beta': median}."""
    ok = (_finite(bn["loss_range"], plain["loss_range"], bn["beta"], plain["beta"])
          and bn["loss_range"] < plain["loss_range"] and bn["beta"] < plain["beta"])
    measured = (f"median loss range BN {bn['loss_range']:.3g} vs none {plain['loss_range']:.3g}; "
                f"beta BN {bn['beta']:.3g} vs none {plain['beta']:.3g}")
    return Verdict(SMOOTH_CLAIM, SMOOTH_PUBLISHED, measured, _ok(ok), SMOOTH_RULE)


NOISY_CLAIM = "BN with injected (time-varying, non-zero-mean) noise still trains as well as no BN"
NOISY_PUBLISHED = "Santurkar et al. 2018, Fig. 2: 'noisy' BN trains nearly as well as standard BN, better than none"
NOISY_RULE = "noisy-BN test accuracy is >= the no-norm network's minus 1.0 point"


def noisy_rule(noisy_acc: float, plain_acc: float, bn_acc: float) -> Verdict:
    ok = _finite(noisy_acc, plain_acc) and noisy_acc >= plain_acc - 1.0
    measured = f"test accuracy: BN {bn_acc:.1f}%, noisy BN {noisy_acc:.1f}%, no norm {plain_acc:.1f}%"
    return Verdict(NOISY_CLAIM, NOISY_PUBLISHED, measured, _ok(ok), NOISY_RULE)


# ---------------------------------------------------------------------------------------------
# contrast-style (Ulyanov et al. 2016; Huang & Belongie 2017)

CONTRAST_CLAIM = "InstanceNorm removes per-image contrast: accuracy survives contrast/brightness changes"
CONTRAST_PUBLISHED = ("Ulyanov et al. 2016 / Huang & Belongie 2017: IN normalizes away per-instance contrast "
                      "(style); BN with running statistics does not")
CONTRAST_RULE = ("IN's mean accuracy drop under the contrast/brightness changes is <= 2.0 points and BN's is "
                 ">= IN's + 5.0")


def contrast_rule(drop: dict[str, float]) -> Verdict:
    """``drop``: norm -> mean accuracy drop in points (clean minus transformed)."""
    ok = _finite(drop["instance"], drop["batch"]) and drop["instance"] <= 2.0 and drop["batch"] >= drop["instance"] + 5
    measured = "mean accuracy drop: " + ", ".join(f"{k} {v:.1f}" for k, v in drop.items())
    return Verdict(CONTRAST_CLAIM, CONTRAST_PUBLISHED, measured, _ok(ok), CONTRAST_RULE)


ADAIN_CLAIM = "AdaIN re-injects style by swapping per-channel mean/std"
ADAIN_PUBLISHED = "Huang & Belongie 2017: AdaIN(x, y) = sigma(y) (x - mu(x)) / sigma(x) + mu(y)"
ADAIN_RULE = "after AdaIN the output's per-channel mean and std equal the style's within 1e-3"


def adain_rule(max_stat_err: float) -> Verdict:
    ok = _finite(max_stat_err) and max_stat_err <= 1e-3
    return Verdict(ADAIN_CLAIM, ADAIN_PUBLISHED, f"max |stat(out) - stat(style)| = {max_stat_err:.2e}", _ok(ok),
                   ADAIN_RULE)


# ---------------------------------------------------------------------------------------------
# sync (Peng et al. 2018 MegDet; Wu & He 2018)

SYNC_CLAIM = "SyncBatchNorm over 4 ranks x 2 samples recovers BatchNorm at the global batch (8)"
SYNC_PUBLISHED = "Peng et al. 2018 (MegDet): cross-GPU BN makes small per-GPU batches trainable"
SYNC_RULE = "SyncBN's test error is >= 1.0 point below per-rank BN's (2 samples per rank)"


def sync_rule(local_bn_err: float, sync_err: float, gn_err: float) -> Verdict:
    ok = _finite(local_bn_err, sync_err) and local_bn_err - sync_err >= 1.0
    measured = f"test error: per-rank BN {local_bn_err:.1f}%, SyncBN {sync_err:.1f}%, GN {gn_err:.1f}%"
    return Verdict(SYNC_CLAIM, SYNC_PUBLISHED, measured, _ok(ok), SYNC_RULE)
