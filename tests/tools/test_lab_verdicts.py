"""The lab's verdict rules (normscope.tools.lab.verdicts) on fixed inputs: every outcome of every
rule -- reproduced, not reproduced, inconclusive -- gates included."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("sklearn")

from normscope.tools.lab import verdicts  # noqa: E402
from normscope.tools.lab import verdicts as V  # noqa: E402
from normscope.tools.lab.verdicts import (  # noqa: E402
    INCONCLUSIVE,  # noqa: E402
    NOT_REPRODUCED,
    REPRODUCED,
)

# ---------------------------------------------------------------------------------------------
# verdict rules on fixed inputs: both outcomes


def test_power_rule():
    assert verdicts.power_rule(90.0, 90.5, 85.0).outcome == REPRODUCED
    assert verdicts.power_rule(84.0, 90.5, 85.0).outcome == NOT_REPRODUCED


def test_rms_quality_rule():
    assert verdicts.rms_quality_rule(2.00, 2.03).outcome == REPRODUCED
    assert verdicts.rms_quality_rule(2.00, 2.20).outcome == NOT_REPRODUCED


def test_other_rules():
    assert verdicts.smoothness_rule({"loss_range": 0.1, "beta": 1.0}, {"loss_range": 0.5, "beta": 3.0}).outcome \
        == REPRODUCED
    assert verdicts.smoothness_rule({"loss_range": 0.6, "beta": 1.0}, {"loss_range": 0.5, "beta": 3.0}).outcome \
        == NOT_REPRODUCED
    assert verdicts.noisy_rule(90.0, 90.5, 95.0).outcome == REPRODUCED
    assert verdicts.noisy_rule(80.0, 90.5, 95.0).outcome == NOT_REPRODUCED
    drop = {"batch": 30.0, "instance": 1.0, "group:8": 3.0, "layer": 5.0}
    assert verdicts.contrast_rule(drop).outcome == REPRODUCED
    assert verdicts.contrast_rule({**drop, "instance": 10.0}).outcome == NOT_REPRODUCED
    assert verdicts.adain_rule(1e-5).outcome == REPRODUCED
    assert verdicts.adain_rule(0.1).outcome == NOT_REPRODUCED
    assert verdicts.sync_rule(20.0, 10.0, 12.0).outcome == REPRODUCED
    assert verdicts.sync_rule(20.0, 19.5, 12.0).outcome == NOT_REPRODUCED
    assert verdicts.skipped("c", "p", "needs X").outcome == "skipped: needs X"


def _inconclusive(v: V.Verdict) -> bool:
    return v.outcome.startswith(INCONCLUSIVE)


def test_batch_size_rule_outcomes():
    gn_flat = {32: (3.0, 0.3), 2: (3.2, 0.3)}
    assert V.batch_size_rule({32: (3.0, 0.4), 2: (8.0, 0.5)}, gn_flat).outcome == REPRODUCED
    # BN's rise within twice its seed spread: not enough
    assert V.batch_size_rule({32: (3.0, 2.0), 2: (6.0, 0.5)}, gn_flat).outcome == NOT_REPRODUCED
    # GN rises as much as BN
    assert (
        V.batch_size_rule({32: (3.0, 0.4), 2: (8.0, 0.5)}, {32: (3.0, 0.3), 2: (7.0, 0.3)}).outcome == NOT_REPRODUCED
    )
    # GN falling as the batch shrinks does not count against the claim
    assert V.batch_size_rule({32: (3.5, 0.4), 2: (8.0, 0.5)}, {32: (3.0, 0.3), 2: (2.0, 0.3)}).outcome == REPRODUCED
    # gate: GN(32) more than 1 point from BN(32) -> inconclusive, whatever BN does
    assert _inconclusive(V.batch_size_rule({32: (3.0, 0.4), 2: (8.0, 0.5)}, {32: (9.0, 3.0), 2: (3.0, 0.3)}))
    assert V.batch_size_rule({32: (3.0, 0.4), 2: (math.nan, 0.5)}, gn_flat).outcome == NOT_REPRODUCED


def test_padding_rule_outcomes():
    assert V.padding_rule((90.0, 0.5), (95.0, 0.5), (96.0, 0.2)).outcome == REPRODUCED
    assert V.padding_rule((90.0, 2.0), (93.0, 0.5), (96.0, 0.2)).outcome == NOT_REPRODUCED  # 3 < 2 x 2.0
    assert V.padding_rule((95.0, 0.5), (95.5, 0.5), (96.0, 0.2)).outcome == NOT_REPRODUCED
    assert _inconclusive(V.padding_rule((60.0, 0.5), (70.0, 0.5), (70.0, 0.2)))  # LN did not learn
    assert _inconclusive(V.padding_rule((99.8, 0.1), (100.0, 0.0), (100.0, 0.0)))  # ceiling


def test_fluctuation_rule_outcomes():
    assert V.fluctuation_rule([0.5, 0.6, 0.4], [0.1, 0.2, 0.1], 3.0, 3.0, 5.0).outcome == REPRODUCED
    assert V.fluctuation_rule([0.3, 0.3, 0.3], [0.2, 0.2, 0.2], 3.0, 3.0, 5.0).outcome == NOT_REPRODUCED
    # mean ratio large but one seed reversed
    assert V.fluctuation_rule([1.0, 1.0, 0.1], [0.1, 0.1, 0.2], 3.0, 3.0, 5.0).outcome == NOT_REPRODUCED
    assert _inconclusive(V.fluctuation_rule([0.5] * 3, [0.1] * 3, 30.0, 3.0, 5.0))  # CNN did not learn
    assert _inconclusive(V.fluctuation_rule([0.5] * 3, [0.1] * 3, 3.0, 5.5, 5.0))  # LM no better than unigram


def test_prenorm_rules_outcomes():
    flat = {"encoder": 1.1, "decoder": 0.9}
    assert V.prenorm_grad_rule({"encoder": 1.5, "decoder": 3.0}, flat).outcome == REPRODUCED
    assert V.prenorm_grad_rule({"encoder": 1.5, "decoder": 1.5}, flat).outcome == NOT_REPRODUCED
    assert (
        V.prenorm_grad_rule({"encoder": 1.5, "decoder": 3.0}, {"encoder": 0.3, "decoder": 1.0}).outcome
        == NOT_REPRODUCED
    )
    assert V.depth_rule(0.02, -0.42).outcome == REPRODUCED
    assert V.depth_rule(0.3, -0.42).outcome == NOT_REPRODUCED
    assert V.depth_rule(0.0, -0.1).outcome == NOT_REPRODUCED


def _grid(post_fail: float, post_loss: float, pre_fail0: float = 0.0) -> dict:
    ok = {"loss": 2.0, "failed": 0.0}
    return {
        "0.001": {"post": ok, "post+warmup": ok, "pre": {"loss": 2.0, "failed": pre_fail0}},
        "0.01": {"post": {"loss": post_loss, "failed": post_fail}, "post+warmup": ok, "pre": ok},
    }


def test_warmup_rule_outcomes():
    assert V.warmup_rule(_grid(1.0, math.inf)).outcome == REPRODUCED
    assert V.warmup_rule(_grid(0.0, 2.2)).outcome == REPRODUCED  # >= 0.1 nats worse, no failure
    assert V.warmup_rule(_grid(0.0, 2.05)).outcome == NOT_REPRODUCED
    assert _inconclusive(V.warmup_rule(_grid(1.0, math.inf, pre_fail0=1 / 3)))


def test_rms_speed_and_no_norm_rules_outcomes():
    assert V.rms_speed_rule([0.8, 0.85, 0.9]).outcome == REPRODUCED
    assert V.rms_speed_rule([0.95, 1.1, 1.0]).outcome == NOT_REPRODUCED
    assert _inconclusive(V.rms_speed_rule([0.8, 1.1, 0.9]))
    assert V.no_norm_rule(12, 2 / 3, math.inf, 2.0, False).outcome == REPRODUCED
    assert V.no_norm_rule(12, 0.0, 2.3, 2.0, False).outcome == REPRODUCED  # 0.3 nats worse
    assert V.no_norm_rule(12, 0.0, 2.05, 2.0, False).outcome == NOT_REPRODUCED
    assert _inconclusive(V.no_norm_rule(12, 1.0, math.inf, 2.0, True))


def test_qk_norm_rule_every_outcome():
    from normscope.tools.lab.verdicts import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, qk_norm_rule

    inf = float("inf")
    with_ = {1e-3: ([2.0, 2.1], [4.0, 4.0]), 1e-1: ([2.1, 2.0], [5.0, 5.0])}
    grows = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, 3.0], [40.0, 60.0])}
    assert qk_norm_rule(grows, with_, 3.0).outcome == REPRODUCED
    # logits grow but training stays fine: (b) fails
    calm = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([2.1, 2.1], [40.0, 60.0])}
    assert qk_norm_rule(calm, with_, 3.0).outcome == NOT_REPRODUCED
    # unstable, but the logits did not grow 3x: (a) fails
    flat = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, inf], [6.0, 6.0])}
    assert qk_norm_rule(flat, with_, 3.0).outcome == NOT_REPRODUCED
    # one seed without QK-norm was fine at that lr: not "every seed"
    one = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, 2.1], [40.0, 60.0])}
    assert qk_norm_rule(one, with_, 3.0).outcome == NOT_REPRODUCED
    # QK-norm itself unstable at the high lr: no lr where it is stable and the other is not
    bad_with = {1e-3: ([2.0, 2.1], [4.0, 4.0]), 1e-1: ([2.6, 2.7], [5.0, 5.0])}
    assert qk_norm_rule(grows, bad_with, 3.0).outcome == NOT_REPRODUCED
    assert qk_norm_rule(grows, with_, 1.5).outcome.startswith(INCONCLUSIVE)


def test_derf_rule_every_outcome():
    from normscope.tools.lab.verdicts import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, derf_rule

    ln = [2.00, 2.01, 2.02]
    assert derf_rule({"layer": ln, "dyt": [2.04] * 3, "derf": [1.99] * 3}, 3.0).outcome == REPRODUCED
    assert derf_rule({"layer": ln, "dyt": [2.10] * 3, "derf": [1.99] * 3}, 3.0).outcome == NOT_REPRODUCED
    assert derf_rule({"layer": ln, "dyt": [2.0] * 3, "derf": [2.0, float("inf"), 2.0]}, 3.0).outcome == NOT_REPRODUCED
    # a noisy LN widens the tolerance to 2x its seed std
    noisy = [1.9, 2.0, 2.1]
    assert derf_rule({"layer": noisy, "dyt": [2.15] * 3, "derf": [2.0] * 3}, 3.0).outcome == REPRODUCED
    assert derf_rule({"layer": ln, "dyt": ln, "derf": ln}, 1.0).outcome.startswith(INCONCLUSIVE)
