"""docs/tensorboard-scalars.png: TensorBoard's scalars page for a run's event files (docs/trackers.md).

    .venv/bin/python scripts/tensorboard_screenshot.py RUN_DIR [--filter REGEX] [--out docs/tensorboard-scalars.png]

Serves <RUN_DIR>/tensorboard with the installed `tensorboard` on a free local port and shoots its Scalars
page in Debian's headless Chromium (/usr/bin/chromium) through Playwright, with the tag filter `--filter`
(default: a few headline curves), raw values (smoothing 0, outliers not ignored).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--filter", default="learning/success_rate|teacher_student_gap|trainer/loss|trainer/kl$|entropy|generated_tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "tensorboard-scalars.png")
    args = ap.parse_args()
    log_dir = args.run_dir / "tensorboard"
    if not log_dir.is_dir():
        sys.exit(f"{log_dir} does not exist: run with --report-to tensorboard first")

    from playwright.sync_api import sync_playwright

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(120):  # TensorBoard answers once it has loaded its plugins
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}#scalars")
            page.wait_for_load_state("networkidle", timeout=60_000)
            # Inside TensorBoard's Polymer shadow roots: the tag filter; the raw values (no smoothing, no outlier
            # clipping: a 5-step curve is all "outliers").
            page.locator("tf-tag-filterer input").fill(args.filter)
            page.get_by_text("Ignore outliers in chart scaling").click()
            page.locator("input[type=number][step]").first.fill("0")
            page.wait_for_load_state("networkidle", timeout=60_000)
            time.sleep(5)  # the charts draw after their data arrives
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
