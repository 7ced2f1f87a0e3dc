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


# ---------------------------------------------------------------------------------------------
# padding (Shen et al. 2020, PowerNorm)

PADDING_CLAIM = "Padding tokens contaminate BatchNorm's statistics in a transformer; masking them out helps"


FLUCT_CLAIM = "Batch statistics fluctuate far more on text than on images"


POWER_CLAIM = "PowerNorm (quadratic mean, running statistics in the forward pass) closes BN's gap to LN"
POWER_PUBLISHED = "Shen et al. 2020: PN outperforms LN and BN on IWSLT14 and WMT14 translation"
POWER_RULE = ("PowerNorm as the authors' transformer builds it (group scaling over the attention heads) has a mean "
              "test accuracy within 1.0 point of LN's or above it, and above plain BN's")


def power_rule(power_acc: float, ln_acc: float, plain_bn_acc: float, others: dict[str, float] | None = None
               ) -> Verdict:
    """``others``: label -> accuracy of PowerNorm variants that are reported, not judged."""
    ok = _finite(power_acc, ln_acc, plain_bn_acc) and power_acc >= ln_acc - 1.0 and power_acc > plain_bn_acc
    measured = f"test accuracy: PowerNorm {power_acc:.1f}%, LN {ln_acc:.1f}%, plain BN {plain_bn_acc:.1f}%"
    if others:
        measured += " (not judged: " + ", ".join(f"{k} {v:.1f}%" for k, v in others.items()) + ")"
    return Verdict(POWER_CLAIM, POWER_PUBLISHED, measured, _ok(ok), POWER_RULE)


# ---------------------------------------------------------------------------------------------
# prenorm (Xiong et al. 2020)

PRENORM_GRAD_CLAIM = "At init, Post-LN's per-layer gradient norms grow toward the top layers; Pre-LN's stay flat"


WARMUP_CLAIM = "Post-LN needs learning-rate warm-up; Pre-LN trains without it"


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


# =============================================================================================
# Each claim tested the way its paper did. The rules are committed before the runs that produce
# docs/lab/*, so a result cannot bend its own rule. A rule with a *gate* returns INCONCLUSIVE when
# the gate fails (an unconverged baseline, a task at its ceiling, timings that disagree): the
# experiment then cannot speak to the claim either way.

INCONCLUSIVE = "inconclusive"
NOT_JUDGED = "not judged: smoke run (models barely trained)"


def _v(claim: str, published: str, measured: str, ok: bool, rule: str, gate: bool = True,
       why: str = "") -> Verdict:
    outcome = (REPRODUCED if ok else NOT_REPRODUCED) if gate else f"{INCONCLUSIVE}: {why}"
    return Verdict(claim, published, measured, outcome, rule)


BATCH_SIZE_PUBLISHED = ("Wu & He 2018, Fig. 1/Table 2: ResNet-50 on ImageNet, 8 GPUs, equal epochs, lr 0.1 x batch/32; "
                      "BN top-1 error 23.6 (32/GPU) -> 34.7 (2/GPU), GN 24.1 -> 24.1")
BATCH_SIZE_RULE = ("gate: GN's error at the largest batch is within 1.0 point of BN's there (both converged), else "
                 "inconclusive. Reproduced if BN's mean error rises from the largest to the smallest batch by >= 1.0 "
                 "point AND by more than 2x the larger of BN's seed std at the two batches, GN's mean error rises by "
                 "less than half of BN's rise (a fall counts as no rise), and BN is worse than GN at the smallest "
                 "batch")


def batch_size_rule(bn: dict[int, tuple[float, float]], gn: dict[int, tuple[float, float]]) -> Verdict:
    """``bn``/``gn``: batch size -> (mean, std over seeds) test error in percent."""
    big, small = max(bn), min(bn)
    d_bn, d_gn = bn[small][0] - bn[big][0], gn[small][0] - gn[big][0]
    spread = max(bn[small][1], bn[big][1])
    vals = (d_bn, d_gn, spread, bn[small][0], gn[small][0])
    gate = _finite(gn[big][0], bn[big][0]) and abs(gn[big][0] - bn[big][0]) <= 1.0
    ok = _finite(*vals) and d_bn >= 1.0 and d_bn > 2 * spread and max(d_gn, 0.0) < 0.5 * d_bn \
        and bn[small][0] > gn[small][0]
    measured = (f"BN {bn[big][0]:.1f}±{bn[big][1]:.1f} -> {bn[small][0]:.1f}±{bn[small][1]:.1f} (batch {big} -> "
                f"{small}), GN {gn[big][0]:.1f}±{gn[big][1]:.1f} -> {gn[small][0]:.1f}±{gn[small][1]:.1f} "
                "(test error %, mean±std over seeds)")
    return _v(BATCH_SIZE_CLAIM, BATCH_SIZE_PUBLISHED, measured, ok, BATCH_SIZE_RULE, gate,
              f"GN({big}) {gn[big][0]:.1f}% vs BN({big}) {bn[big][0]:.1f}%: baselines not converged alike")


PADDING_PUBLISHED = ("Shen et al. 2020 (PowerNorm), Sec. 3: transformer BN on IWSLT14/WMT14 with length-bucketed "
                        "batches (fairseq); BN's statistics must exclude pads; naive BN trails LN by ~1 BLEU")
PADDING_RULE = ("gate: LN learns the task (test accuracy >= 80%) and plain BN is below the 99.5% ceiling, else "
                   "inconclusive. Reproduced if masked BN's mean accuracy exceeds plain BN's (pads counted) by >= 1.0 "
                   "point AND by more than 2x the larger of their seed std")


def padding_rule(plain: tuple[float, float], masked: tuple[float, float], ln: tuple[float, float]) -> Verdict:
    """(mean, std over seeds) test accuracy in percent for plain BN, masked BN and LN."""
    d = masked[0] - plain[0]
    gate = _finite(ln[0], plain[0]) and ln[0] >= 80.0 and plain[0] < 99.5
    ok = _finite(d, plain[1], masked[1]) and d >= 1.0 and d > 2 * max(plain[1], masked[1])
    measured = (f"test accuracy, length-bucketed batches: plain BN {plain[0]:.1f}±{plain[1]:.1f}%, masked BN "
                f"{masked[0]:.1f}±{masked[1]:.1f}%, LN {ln[0]:.1f}±{ln[1]:.1f}%")
    why = f"LN {ln[0]:.1f}% (task not learned)" if not ln[0] >= 80.0 else f"plain BN {plain[0]:.1f}% (ceiling)"
    return _v(PADDING_CLAIM, PADDING_PUBLISHED, measured, ok, PADDING_RULE, gate, why)


FLUCT_PUBLISHED = ("Shen et al. 2020, Fig. 2: during training, first BN layer, (1/d)||mu_B - mu|| and "
                      "(1/d)||sigma_B^2 - sigma^2|| against the running statistics; transformer on IWSLT14 "
                      "(word-level batches of variable-length sentences) far above ResNet-20 on CIFAR-10")
FLUCT_RULE = ("both measured at the first BN layer during training (mean over the second half of training, "
                 "relative to the running statistics: |mu_B - mu|/sigma and |sigma_B^2/sigma^2 - 1|, mean over "
                 "channels). gate: both models learned (digits CNN test error <= 10%, word LM validation loss below "
                 "the word unigram entropy), else inconclusive. Reproduced if text's mean+variance distance is >= 2x "
                 "images' for the mean over seeds AND text > images in every seed")


def fluctuation_rule(text: list[float], images: list[float], img_err: float, lm_loss: float,
                        unigram: float) -> Verdict:
    """Per-seed distances (mean term + variance term) for text and images; the gate's inputs."""
    mt, mi = sum(text) / len(text), sum(images) / len(images)
    gate = _finite(img_err, lm_loss, unigram) and img_err <= 10.0 and lm_loss < unigram
    ok = _finite(mt, mi) and mt >= 2.0 * mi and all(t > i for t, i in zip(text, images))
    measured = (f"first-BN batch-vs-running distance during training: text {mt:.3f}, images {mi:.3f} "
                f"(ratio {mt / mi:.2f}; {len(text)} seeds); digits error {img_err:.1f}%, word LM val loss "
                f"{lm_loss:.2f} vs unigram {unigram:.2f}")
    return _v(FLUCT_CLAIM, FLUCT_PUBLISHED, measured, ok, FLUCT_RULE, gate, "a baseline did not learn")


PRENORM_PUBLISHED = ("Xiong et al. 2020, Fig. 3: 6-6 layer encoder-decoder Transformer (IWSLT14 De-En), at "
                        "initialization: Post-LN's |dL/dW2| (FFN) grows with the layer index, Pre-LN's stays flat")
PRENORM_RULE = ("encoder-decoder with cross-attention, 6+6 layers, Xavier init, mean over >= 3 seeds: reproduced "
                   "if Post-LN's top/bottom W2 gradient-norm ratio is >= 2 in the decoder and >= 1 in the encoder, "
                   "and Pre-LN's lies in [0.5, 2] in both")


def prenorm_grad_rule(post: dict[str, float], pre: dict[str, float]) -> Verdict:
    """``post``/``pre``: {'encoder': top/bottom ratio, 'decoder': top/bottom ratio}."""
    ok = (_finite(*post.values(), *pre.values()) and post["decoder"] >= 2.0 and post["encoder"] >= 1.0
          and all(0.5 <= pre[k] <= 2.0 for k in ("encoder", "decoder")))
    measured = (f"top/bottom |dL/dW2| at init: Post-LN encoder {post['encoder']:.2f}, decoder {post['decoder']:.2f}; "
                f"Pre-LN encoder {pre['encoder']:.2f}, decoder {pre['decoder']:.2f}")
    return _v(PRENORM_GRAD_CLAIM, PRENORM_PUBLISHED, measured, ok, PRENORM_RULE)


DEPTH_CLAIM = "Post-LN's last-layer gradient does not shrink with depth; Pre-LN's shrinks like 1/sqrt(L)"
DEPTH_PUBLISHED = ("Xiong et al. 2020, Theorems 1-2: at init, Post-LN ||dL/dW2 (last layer)|| = O(d sqrt(ln d)), "
                   "Pre-LN O(d sqrt(ln d / L))")
DEPTH_RULE = ("log-log slope of the last layer's W2 gradient norm against depth (2..32, mean over seeds): "
              "reproduced if Post-LN's slope is in [-0.15, 0.15] and Pre-LN's in [-0.75, -0.25]")


def depth_rule(post_slope: float, pre_slope: float) -> Verdict:
    ok = _finite(post_slope, pre_slope) and -0.15 <= post_slope <= 0.15 and -0.75 <= pre_slope <= -0.25
    measured = f"log-log slope vs depth: Post-LN {post_slope:+.2f}, Pre-LN {pre_slope:+.2f} (theory 0 and -0.5)"
    return Verdict(DEPTH_CLAIM, DEPTH_PUBLISHED, measured, _ok(ok), DEPTH_RULE)


WARMUP_PUBLISHED = ("Xiong et al. 2020, Fig. 2/Sec. 3.1: IWSLT14 De-En, Adam; Post-LN without warm-up fails "
                       "(BLEU far below) at lr 5e-4 and 1e-3, works with warm-up; Pre-LN trains without warm-up")
WARMUP_RULE = ("pre-registered Adam lr grid. gate: Pre-LN without warm-up trains (no seed fails) at the smallest "
                  "lr, else inconclusive. Reproduced if at some lr of the grid Post-LN without warm-up fails in >= "
                  "half the seeds OR ends >= 0.1 nats worse (mean) than Post-LN with warm-up, while at that lr Pre-LN "
                  "without warm-up fails in < half the seeds and is not >= 0.1 nats worse than Post-LN with warm-up")


def warmup_rule(by_lr: dict[str, dict[str, dict[str, float]]]) -> Verdict:
    """``by_lr``: lr (str) -> variant ('post', 'post+warmup', 'pre') -> {'loss': mean val loss, 'failed': fraction}."""
    lrs = sorted(by_lr, key=float)
    lo = by_lr[lrs[0]]
    gate = lo["pre"]["failed"] == 0.0
    hits = []
    for lr in lrs:
        v = by_lr[lr]
        post_bad = v["post"]["failed"] >= 0.5 or (v["post"]["loss"] - v["post+warmup"]["loss"] >= 0.1)
        pre_ok = v["pre"]["failed"] < 0.5 and not (v["pre"]["loss"] - v["post+warmup"]["loss"] >= 0.1)
        if post_bad and pre_ok:
            hits.append(lr)
    measured = "; ".join(
        f"lr {lr}: Post-LN {by_lr[lr]['post']['loss']:.3f} (failed {by_lr[lr]['post']['failed']:.0%}), +warm-up "
        f"{by_lr[lr]['post+warmup']['loss']:.3f} ({by_lr[lr]['post+warmup']['failed']:.0%}), Pre-LN "
        f"{by_lr[lr]['pre']['loss']:.3f} ({by_lr[lr]['pre']['failed']:.0%})" for lr in lrs)
    measured += f" -> separating lr: {', '.join(hits) or 'none'}"
    return _v(WARMUP_CLAIM, WARMUP_PUBLISHED, measured, bool(hits), WARMUP_RULE, gate,
              f"Pre-LN failed at lr {lrs[0]}")


RMS_SPEED_PUBLISHED = ("Zhang & Sennrich 2019, Table 1-6: RMSNorm speeds up the whole model 7%-64% over LN, same "
                          "framework and implementation style for both")
RMS_SPEED_RULE = ("like with like: both norms as plain-PyTorch formulas (autograd), forward+backward on (rows, "
                     "features) fp32, interleaved, CPU time of this process; >= 3 timing blocks. Reproduced if "
                     "RMS/LN time ratio <= 0.93 in every block, not reproduced if > 0.93 in every block, else "
                     "inconclusive (blocks disagree). torch's fused kernels are reported, not judged")


def rms_speed_rule(ratios: list[float]) -> Verdict:
    """``ratios``: RMS/LN CPU-time ratio (median within a block), one per timing block."""
    fin = _finite(*ratios) and len(ratios) >= 1
    yes = fin and all(r <= 0.93 for r in ratios)
    no = fin and all(r > 0.93 for r in ratios)
    measured = "plain-formula RMS/LN CPU-time ratio per block: " + ", ".join(f"{r:.2f}" for r in ratios)
    return _v(RMS_SPEED_CLAIM, RMS_SPEED_PUBLISHED, measured, yes, RMS_SPEED_RULE, yes or no,
              "timing blocks disagree")


NO_NORM_CLAIM = "A deep transformer without normalization fails to train"
NO_NORM_PUBLISHED = ("Zhang & Sennrich 2019 / Xiong et al. 2020: without LN the (6+ layer) model diverges or fails "
                        "to converge; the failure is a matter of depth")
NO_NORM_RULE = ("depth sweep, same Adam lr for all. gate: LN (Pre-LN) trains in every seed at every depth, else "
                   "inconclusive. Reproduced if at the deepest depth >= half of the no-norm seeds fail (diverge, or "
                   "end no better than the unigram loss) or end >= 0.1 nats worse than LN (mean)")


def no_norm_rule(depth: int, none_failed: float, none_loss: float, ln_loss: float, ln_failed_any: bool) -> Verdict:
    gate = not ln_failed_any
    ok = _finite(none_failed) and (none_failed >= 0.5 or (_finite(none_loss, ln_loss) and none_loss - ln_loss >= 0.1))
    measured = (f"depth {depth}: no norm {none_failed:.0%} of seeds failed, val loss none {none_loss:.3f} vs LN "
                f"{ln_loss:.3f}")
    return _v(NO_NORM_CLAIM, NO_NORM_PUBLISHED, measured, ok, NO_NORM_RULE, gate, "LN failed somewhere")


# ---------------------------------------------------------------------------------------------
# modern: QK-norm (Dehghani et al. 2023; Wortsman et al. 2023) and DyT / Derf (Zhu et al. 2025; Chen et al. 2025)

QK_CLAIM = ("Without QK-norm the attention logits grow and training becomes unstable at learning rates where "
            "QK-norm keeps it stable")
QK_PUBLISHED = ("Dehghani et al. 2023 (ViT-22B): attention logits grow without bound and training diverges unless "
                "queries and keys are LayerNorm-ed; Wortsman et al. 2023, Fig. 1/2: small transformers show the same "
                "logit growth and loss divergence at high learning rate, removed by qk-layernorm")
QK_RULE = ("per learning rate, mean over seeds (a diverged run's loss is infinite). gate: with QK-norm the best "
           "mean validation loss over the grid is below the unigram entropy, else inconclusive. Reproduced if (a) "
           "at the largest learning rate the mean largest attention logit without QK-norm is >= 3x with it, AND "
           "(b) at some learning rate every seed without QK-norm diverged or ended >= 0.2 nats above the mean with "
           "QK-norm there, while with QK-norm the mean there is within 0.2 nats of its best over the grid")


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals) if vals and all(math.isfinite(v) for v in vals) else math.inf


def qk_norm_rule(without: dict[float, tuple[list[float], list[float]]],
                 with_: dict[float, tuple[list[float], list[float]]], unigram: float) -> Verdict:
    """``without``/``with_``: learning rate -> (final validation losses, largest attention logits), per seed."""
    lrs = sorted(with_)
    loss_w = {lr: _mean(with_[lr][0]) for lr in lrs}
    best = min(loss_w.values())
    top = lrs[-1]
    logit_wo, logit_w = _mean(without[top][1]), _mean(with_[top][1])
    growth = _finite(logit_wo, logit_w) and logit_w > 0 and logit_wo >= 3 * logit_w
    unstable = [lr for lr in lrs if math.isfinite(loss_w[lr]) and loss_w[lr] <= best + 0.2
                and all(not math.isfinite(v) or v >= loss_w[lr] + 0.2 for v in without[lr][0])]
    gate = _finite(best, unigram) and best < unigram
    loss_wo = {lr: _mean(without[lr][0]) for lr in lrs}
    measured = (f"largest attention logit at lr {top:g}: {logit_wo:.1f} without QK-norm vs {logit_w:.1f} with; final "
                "val loss without/with by lr: " + ", ".join(f"{lr:g}: {loss_wo[lr]:.2f}/{loss_w[lr]:.2f}" for lr in lrs)
                + f"; unstable without only at: {', '.join(f'{lr:g}' for lr in unstable) or 'none'}")
    return _v(QK_CLAIM, QK_PUBLISHED, measured, growth and bool(unstable), QK_RULE, gate,
              f"best loss with QK-norm {best:.2f} not below the unigram entropy {unigram:.2f}")


FREE_CLAIM = "Normalization-free layers (DyT, Derf) match LayerNorm in a transformer at equal steps"
FREE_PUBLISHED = ("Zhu et al. 2025 (DyT), Tables 1-7: DyT matches LN/RMSNorm across ViT, DiT, LLaMA, wav2vec, DNA "
                  "models; Chen et al. 2025 (Derf, arXiv:2512.10938): Derf matches or beats LN, RMSNorm and DyT")
FREE_RULE = ("mean final validation loss over seeds, equal steps and learning rate. gate: LN's is below the unigram "
             "entropy, else inconclusive. Reproduced if DyT's and Derf's are each at most LN's + max(0.05 nats, 2x "
             "LN's seed std)")


def derf_rule(losses: dict[str, list[float]], unigram: float) -> Verdict:
    """``losses``: "layer" / "dyt" / "derf" -> final validation loss per seed."""
    m = {k: _mean(v) for k, v in losses.items()}
    ln_std = _sd(losses["layer"])
    tol = max(0.05, 2 * ln_std)
    gate = _finite(m["layer"], unigram) and m["layer"] < unigram
    ok = _finite(m["dyt"], m["derf"], m["layer"]) and m["dyt"] <= m["layer"] + tol and m["derf"] <= m["layer"] + tol
    measured = (f"final val loss: LN {m['layer']:.3f}±{ln_std:.3f}, DyT {m['dyt']:.3f}±{_sd(losses['dyt']):.3f}, "
                f"Derf {m['derf']:.3f}±{_sd(losses['derf']):.3f} (nats; tolerance {tol:.3f})")
    return _v(FREE_CLAIM, FREE_PUBLISHED, measured, ok, FREE_RULE, gate,
              f"LN {m['layer']:.2f} not below the unigram entropy {unigram:.2f}")


def _sd(vals: list[float]) -> float:
    """Sample standard deviation (0 for fewer than 2 values or any non-finite one)."""
    if len(vals) < 2 or not all(math.isfinite(v) for v in vals):
        return 0.0
    mu = sum(vals) / len(vals)
    return math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
