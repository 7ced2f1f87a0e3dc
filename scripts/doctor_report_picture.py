"""The picture of the doctor's HTML report in docs/doctor.md (docs/img/doctor-report.png).

Runs the page's first example (the ResNet-18 layout trained at batch 2, random weights), writes its HTML
report, and photographs it in headless Chromium (Debian's ``chromium``; nothing is fetched).

Run: ``PYTHONPATH=src python3 scripts/doctor_report_picture.py [OUT.png]`` from the repository root.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(out: Path) -> None:
    page = (ROOT / "docs" / "doctor.md").read_text()
    first = re.search(r"```python\n(.*?)```", page, re.S).group(1)  # builds `model`, `x`, `report`
    namespace: dict = {}
    exec(compile(first, "docs/doctor.md", "exec"), namespace)  # noqa: S102 - the documentation's own example
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs Chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "report.html"
        html.write_text(namespace["report"].to_html())
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp}/profile",
             "--hide-scrollbars", "--window-size=1180,1500", f"--screenshot={out}", html.as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img" / "doctor-report.png")
