"""Lab v2 (issue 16): the verdict rules on fixed inputs -- every outcome, gates included -- and the
pieces of the new designs that can be checked without training (bucketed batching, the cluttered
digits, the docs table generated from result.json)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("sklearn")
import torch  # noqa: E402

from normscope.tools.lab import verdicts as V  # noqa: E402
from normscope.tools.lab.verdicts import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED  # noqa: E402


def _inconclusive(v: V.Verdict) -> bool:
    return v.outcome.startswith(INCONCLUSIVE)


def test_batch_size_rule_v2_outcomes():
    gn_flat = {32: (3.0, 0.3), 2: (3.2, 0.3)}
    assert V.batch_size_rule_v2({32: (3.0, 0.4), 2: (8.0, 0.5)}, gn_flat).outcome == REPRODUCED
    # BN's rise within twice its seed spread: not enough
    assert V.batch_size_rule_v2({32: (3.0, 2.0), 2: (6.0, 0.5)}, gn_flat).outcome == NOT_REPRODUCED
    # GN rises as much as BN
    assert (
        V.batch_size_rule_v2({32: (3.0, 0.4), 2: (8.0, 0.5)}, {32: (3.0, 0.3), 2: (7.0, 0.3)}).outcome == NOT_REPRODUCED
    )
    # GN falling as the batch shrinks does not count against the claim
    assert V.batch_size_rule_v2({32: (3.5, 0.4), 2: (8.0, 0.5)}, {32: (3.0, 0.3), 2: (2.0, 0.3)}).outcome == REPRODUCED
    # gate: GN(32) more than 1 point from BN(32) -> inconclusive, whatever BN does
    assert _inconclusive(V.batch_size_rule_v2({32: (3.0, 0.4), 2: (8.0, 0.5)}, {32: (9.0, 3.0), 2: (3.0, 0.3)}))
    assert V.batch_size_rule_v2({32: (3.0, 0.4), 2: (math.nan, 0.5)}, gn_flat).outcome == NOT_REPRODUCED


def test_padding_rule_v2_outcomes():
    assert V.padding_rule_v2((90.0, 0.5), (95.0, 0.5), (96.0, 0.2)).outcome == REPRODUCED
    assert V.padding_rule_v2((90.0, 2.0), (93.0, 0.5), (96.0, 0.2)).outcome == NOT_REPRODUCED  # 3 < 2 x 2.0
    assert V.padding_rule_v2((95.0, 0.5), (95.5, 0.5), (96.0, 0.2)).outcome == NOT_REPRODUCED
    assert _inconclusive(V.padding_rule_v2((60.0, 0.5), (70.0, 0.5), (70.0, 0.2)))  # LN did not learn
    assert _inconclusive(V.padding_rule_v2((99.8, 0.1), (100.0, 0.0), (100.0, 0.0)))  # ceiling


def test_fluctuation_rule_v2_outcomes():
    assert V.fluctuation_rule_v2([0.5, 0.6, 0.4], [0.1, 0.2, 0.1], 3.0, 3.0, 5.0).outcome == REPRODUCED
    assert V.fluctuation_rule_v2([0.3, 0.3, 0.3], [0.2, 0.2, 0.2], 3.0, 3.0, 5.0).outcome == NOT_REPRODUCED
    # mean ratio large but one seed reversed
    assert V.fluctuation_rule_v2([1.0, 1.0, 0.1], [0.1, 0.1, 0.2], 3.0, 3.0, 5.0).outcome == NOT_REPRODUCED
    assert _inconclusive(V.fluctuation_rule_v2([0.5] * 3, [0.1] * 3, 30.0, 3.0, 5.0))  # CNN did not learn
    assert _inconclusive(V.fluctuation_rule_v2([0.5] * 3, [0.1] * 3, 3.0, 5.5, 5.0))  # LM no better than unigram


def test_prenorm_rules_v2_outcomes():
    flat = {"encoder": 1.1, "decoder": 0.9}
    assert V.prenorm_grad_rule_v2({"encoder": 1.5, "decoder": 3.0}, flat).outcome == REPRODUCED
    assert V.prenorm_grad_rule_v2({"encoder": 1.5, "decoder": 1.5}, flat).outcome == NOT_REPRODUCED
    assert (
        V.prenorm_grad_rule_v2({"encoder": 1.5, "decoder": 3.0}, {"encoder": 0.3, "decoder": 1.0}).outcome
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


def test_warmup_rule_v2_outcomes():
    assert V.warmup_rule_v2(_grid(1.0, math.inf)).outcome == REPRODUCED
    assert V.warmup_rule_v2(_grid(0.0, 2.2)).outcome == REPRODUCED  # >= 0.1 nats worse, no failure
    assert V.warmup_rule_v2(_grid(0.0, 2.05)).outcome == NOT_REPRODUCED
    assert _inconclusive(V.warmup_rule_v2(_grid(1.0, math.inf, pre_fail0=1 / 3)))


def test_rms_speed_and_no_norm_rules_v2_outcomes():
    assert V.rms_speed_rule_v2([0.8, 0.85, 0.9]).outcome == REPRODUCED
    assert V.rms_speed_rule_v2([0.95, 1.1, 1.0]).outcome == NOT_REPRODUCED
    assert _inconclusive(V.rms_speed_rule_v2([0.8, 1.1, 0.9]))
    assert V.no_norm_rule_v2(12, 2 / 3, math.inf, 2.0, False).outcome == REPRODUCED
    assert V.no_norm_rule_v2(12, 0.0, 2.3, 2.0, False).outcome == REPRODUCED  # 0.3 nats worse
    assert V.no_norm_rule_v2(12, 0.0, 2.05, 2.0, False).outcome == NOT_REPRODUCED
    assert _inconclusive(V.no_norm_rule_v2(12, 1.0, math.inf, 2.0, True))


def test_bucketed_batches_vary_the_pad_fraction():
    from normscope.tools.lab.data import padded_sequences
    from normscope.tools.lab.exp_padding import bucketed_batches

    _, mask, _ = padded_sequences(2000, seed=1234)
    batches = bucketed_batches(mask.sum(1), 32, torch.Generator().manual_seed(0))
    assert len(batches) == 2000 // 32
    flat = torch.cat(batches)
    assert len(set(flat.tolist())) == len(flat)  # each sequence at most once per epoch
    pads = [1 - float(mask[b].float().mean()) for b in batches]
    assert max(pads) - min(pads) > 0.5  # the mechanism: batches of short sequences are mostly padding
    lengths = mask.sum(1)
    assert all(int(lengths[b].max() - lengths[b].min()) <= 4 for b in batches)  # a batch holds similar lengths


def test_cluttered_digits_places_each_digit_on_the_canvas():
    from normscope.tools.lab.data import cluttered_digits, digits

    xtr, ytr, xte, yte = cluttered_digits(16, 0.0)
    assert xtr.shape[1:] == (1, 16, 16) and len(xtr) == len(digits()[0])
    assert torch.equal(ytr, digits()[1])
    # without noise, all but an 8x8 window is the (standardized) background value
    bg = xtr[0].flatten().mode().values
    assert int((xtr[0] != bg).sum()) <= 64


def test_docs_table_is_generated_from_result_json(tmp_path):
    from normscope.tools.lab.report import markdown_table

    v = {"claim": "c", "published": "p", "measured": "m 1.23", "outcome": REPRODUCED, "rule": "r"}
    (tmp_path / "padding").mkdir()
    (tmp_path / "padding" / "result.json").write_text(
        json.dumps({"experiment": "padding", "verdicts": [v], "seeds": [0, 1, 2], "wall_s": 12.5, "mode": "quick"})
    )
    table = markdown_table(tmp_path)
    assert "| padding | c | m 1.23 | reproduced | 3 |" in table
    assert "padding 12 s" in table


def test_smoke_records_one_thread_and_judges_nothing(tmp_path):
    from normscope.tools import lab

    torch.set_num_threads(2)  # the runner must record the 1 thread its runs used, not the caller's setting
    r = lab.run_one("contrast-style", "smoke", tmp_path)
    assert r["versions"]["torch_threads"] == "1"
    assert r["verdicts"] and all(v["outcome"] == V.NOT_JUDGED for v in r["verdicts"])
