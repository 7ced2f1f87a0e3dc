#!/usr/bin/env bash
# Install the headless browser for the explorer's end-to-end test (tests/tools/test_explorer_browser.py):
# Debian's chromium and its matching chromedriver. Idempotent: does nothing when both are present.
# The test drives them with selenium (pip install 'normscope[browser-test]'); no browser download.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    echo "setup-browser: chromium and chromedriver already installed: $(chromium --version 2>/dev/null | head -n1)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
echo "setup-browser: installed $(chromium --version 2>/dev/null | head -n1)"
