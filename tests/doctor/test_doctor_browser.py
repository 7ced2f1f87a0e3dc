"""End-to-end: the doctor's HTML report in a real headless Chromium (Debian's chromium + chromium-driver).

A model that trips many checks at once (small batch, stale statistics, padding, a bias before a norm, a
dead channel, a module that mixes the batch, a frozen BatchNorm still updating, Post-LN, a SyncBatchNorm
over one process) is diagnosed; its page is opened from a file (nothing served, nothing fetched) and must
load without a console error, list every group in its summary, and show a picture for every check that
found something or measured a quantity -- drawn, with a size, and with a point per measured layer. A
screenshot is saved to test-artifacts/. Skips (saying why) without Chromium, its driver or selenium;
CI installs them (.ci/setup-browser.sh, the `browser-test` extra).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normscope
from conftest import ARTIFACTS, needs_chromium
from normscope.doctor import doctor

# one browser (conftest's browser, a module fixture) for every test here: one worker runs them (pytest-xdist)
pytestmark = [needs_chromium, pytest.mark.xdist_group("doctor_browser")]


class MixBatch(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Troubled(nn.Module):
    """Images through a conv (with a bias) and a BatchNorm, tokens through a BatchNorm over positions
    (padded) and a Post-LN transformer layer, a frozen BatchNorm in training mode, a SyncBatchNorm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.frozen = nn.BatchNorm2d(8)
        self.frozen.requires_grad_(False)
        self.sync = normscope.SyncBatchNorm(8)
        self.proj = nn.Linear(16, 16)
        self.token_bn = nn.BatchNorm1d(16)
        self.mix = MixBatch()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        with torch.no_grad():
            self.conv.weight[0].zero_()  # channel 0: the bias alone, constant -- dead

    def forward(self, images, tokens, attention_mask=None):
        h = self.sync(self.frozen(self.bn(self.conv(images))))
        t = self.token_bn(self.proj(tokens).transpose(1, 2)).transpose(1, 2)
        t = self.layer(self.mix(t), src_key_padding_mask=None if attention_mask is None else ~attention_mask.bool())
        return h.mean() + t.mean()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    torch.manual_seed(0)
    model = Troubled()
    lengths = torch.tensor([10, 6, 3, 8])
    mask = (torch.arange(10)[None] < lengths[:, None]).long()
    report = doctor(model, torch.randn(4, 3, 8, 8) * 3 + 2, torch.randn(4, 10, 16), attention_mask=mask)
    path = tmp_path_factory.mktemp("doctor") / "report.html"
    path.write_text(report.to_html())
    return report, path


def test_the_report_loads_and_shows_every_checks_picture(page, browser):
    report, path = page
    found = {f.check for f in report.findings}
    # the model above was built to trip these; the page must show each
    assert {
        "bn-elements",
        "train-eval-drift",
        "padding",
        "frozen-bn-updating",
        "dead-channels",
        "bias-before-norm",
        "post-ln",
        "batch-invariance",
        "syncbn",
    } <= found, found
    browser.get(path.as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
    rows = browser.find_elements("css selector", "table.summary tr")
    assert len(rows) == 1 + len(report.groups())  # a header, then a row per group
    measured = {s.check: s for s in report.series}
    for check in found | set(measured):
        charts = browser.find_elements("css selector", f"svg[data-check='{check}']")
        assert charts, f"no picture for {check}"
        box = charts[0].rect
        assert charts[0].is_displayed() and box["width"] > 300 and box["height"] > 150, (check, box)
        if check in measured:  # a point per measured layer, each named on hover
            points = charts[0].find_elements("css selector", "circle")
            assert len(points) == sum(len(v) for v in measured[check].lines.values()), check
    # every section is reachable from the summary's links
    for link in browser.find_elements("css selector", "table.summary a"):
        target = link.get_attribute("href").split("#")[1]
        assert browser.find_elements("id", target), target
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "doctor-report.png"))
