"""End-to-end: the explorer page in a real headless Chromium (Debian's chromium + chromium-driver).

Starts the server on a free loopback port, picks GroupNorm with 2 groups, hovers an element and
checks the highlighted cells and the numbers on the page against an independent torch computation.
A screenshot is saved to test-artifacts/. Skips (with the reason) when Chromium, its driver or
selenium is missing; CI installs them with .ci/setup-browser.sh and the `browser-test` extra.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from conftest import ARTIFACTS, needs_chromium

# one browser (conftest's browser, a module fixture) for every test here: one worker runs them (pytest-xdist)
pytestmark = [needs_chromium, pytest.mark.xdist_group("explorer_browser")]


@pytest.fixture(scope="module")
def server():
    from normscope.tools.explorer import serve_in_thread

    srv, thread, url = serve_in_thread("127.0.0.1", 0)
    yield url
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _wait(driver, predicate, what: str, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = predicate()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _set(driver, element_id: str, value: str) -> None:
    # set the value and fire the event the page listens to, as typing would
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('change', {bubbles: true}));",
        element_id,
        value,
    )


def _settled(driver, condition: str):
    # the page's last good response (the global DATA) satisfies a JS condition, and nothing is pending
    js = f"return document.body.dataset.state === 'ready' && typeof DATA !== 'undefined' && !!DATA && ({condition})"
    _wait(driver, lambda: driver.execute_script(js), f"the page to render {condition!r}")


def _num(driver, element_id: str) -> float:
    return float(driver.find_element("id", element_id).text)


def test_groupnorm_hover_highlights_scope_and_numbers_match_torch(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains

    browser.get(server)
    _wait(browser, lambda: browser.execute_script("return document.body.dataset.state") == "ready", "first render")
    from selenium.webdriver.support.ui import Select

    _set(browser, "layout", "nchw")
    _set(browser, "shape", "3,6,4")
    _set(browser, "seed", "7")
    # choose GroupNorm with 2 groups the way a user does: the drop-down, then typing
    Select(browser.find_element("id", "layer")).select_by_visible_text("GroupNorm")
    groups = browser.find_element("id", "groups")
    groups.clear()
    groups.send_keys("2")
    _set(browser, "celltext", "x")
    _settled(browser, "DATA.layer === 'group' && DATA.groups === 2 && DATA.seed === 7")

    N, C, L, G = 3, 6, 4, 2
    n, c, pos = 1, 4, 2
    i = (n * C + c) * L + pos
    cell = browser.find_element("css selector", f'#slices .cell[data-i="{i}"]')
    ActionChains(browser).move_to_element(cell).perform()
    _wait(browser, lambda: browser.find_element("id", "info").get_attribute("data-i") == str(i), "hover info")

    # the highlighted cells are exactly sample n's channels of c's group (independent formula)
    per = C // G
    expected = {
        (a * C + b) * L + p for a in range(N) for b in range(C) for p in range(L) if a == n and b // per == c // per
    }
    got = set(
        browser.execute_script(
            "return [...document.querySelectorAll('#slices .cell.hl')].map(e => Number(e.dataset.i))"
        )
    )
    assert got == expected
    cube = set(
        browser.execute_script("return [...document.querySelectorAll('#cube .cell.hl')].map(e => Number(e.dataset.i))")
    )
    assert cube and cube <= expected  # only the visible faces of the scope are drawn on the cube

    # the numbers shown are the library's, computed independently here with torch
    x = torch.randn((N, C, L), generator=torch.Generator().manual_seed(7))
    x = torch.round(x * 100) / 100
    block = x[n, (c // per) * per : (c // per + 1) * per].double()
    y = F.group_norm(x.double(), G, eps=1e-5)[n, c, pos]
    assert _num(browser, "info-x") == pytest.approx(float(x[n, c, pos]), abs=1e-4)
    assert int(browser.find_element("id", "info-count").text) == block.numel()
    assert _num(browser, "info-mean") == pytest.approx(float(block.mean()), abs=1e-4)
    assert _num(browser, "info-var") == pytest.approx(float(block.var(unbiased=False)), abs=1e-4)
    assert _num(browser, "info-y") == pytest.approx(float(y), abs=1e-4)
    assert "✓" in browser.find_element("id", "check-diff").text

    # no script error or blocked (CSP) resource; answered 4xx requests (while typing) are expected
    errors = [
        e["message"]
        for e in browser.get_log("browser")
        if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]
    ]
    assert errors == []

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "explorer-groupnorm.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def test_bad_groups_shows_message_and_padding_is_excluded(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains

    browser.get(server)
    _wait(browser, lambda: browser.execute_script("return document.body.dataset.state") == "ready", "first render")
    _set(browser, "groups", "4")  # 6 channels do not split into 4 groups
    err = _wait(browser, lambda: browser.find_element("id", "error").text, "an error message")
    assert "divisible" in err and "groups=4" in err and "HTTP 400" in err

    # padded tokens: hatched, in no scope, and the BatchNorm statistics skip them
    _set(browser, "layout", "bsd")
    _set(browser, "layer", "batch")
    _set(browser, "mask", "5,3")
    _settled(browser, "DATA.layer === 'batch' && DATA.layout === 'bsd' && DATA.mask !== null")
    assert not browser.find_element("id", "error").is_displayed()
    B, S, D = 2, 5, 6
    pad = (1 * S + 4) * D + 0  # sequence 1, token 4 > length 3
    ActionChains(browser).move_to_element(
        browser.find_element("css selector", f'#slices .cell[data-i="{pad}"]')
    ).perform()
    _wait(browser, lambda: "padding" in browser.find_element("id", "info").text, "padding info")
    valid = (0 * S + 1) * D + 2
    ActionChains(browser).move_to_element(
        browser.find_element("css selector", f'#slices .cell[data-i="{valid}"]')
    ).perform()
    _wait(browser, lambda: browser.find_element("id", "info").get_attribute("data-i") == str(valid), "hover info")
    x = torch.round(torch.randn((B, S, D), generator=torch.Generator().manual_seed(0)) * 100) / 100
    feat = torch.cat([x[0, :5, 2], x[1, :3, 2]]).double()
    assert int(browser.find_element("id", "info-count").text) == 8
    assert _num(browser, "info-mean") == pytest.approx(float(feat.mean()), abs=1e-4)
    assert _num(browser, "info-var") == pytest.approx(float(feat.var(unbiased=False)), abs=1e-4)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "explorer-batchnorm-padding.png"))
