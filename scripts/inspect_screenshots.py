"""The `opsd inspect` screenshots of docs/how-to/inspect.md: docs/inspect-group.png and docs/inspect-trajectory.png.

    .venv/bin/python scripts/inspect_screenshots.py [--tokenizer PATH] [--out docs]

Writes a small run (tests/inspect_run.py: one real dump per credit method, 4 rollouts x 4 turns,
responses tokenized with SmolLM2's tokenizer from the model cache when it is there), serves it with
`opsd inspect`, and shoots the AlignOPSD step's group page and one trajectory page in Debian's
headless Chromium (/usr/bin/chromium) through Playwright.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_tok = Path(os.environ.get("OPSD_CACHE", Path.home() / ".cache/opsd")) / "models/smollm2-135m-instruct/tokenizer.json"
    ap.add_argument("--tokenizer", type=Path, default=default_tok)
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from opsd.credit import registered
    from tests.inspect_run import write_run

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "quickstart-20261204-2300"
        write_run(run, args.tokenizer if args.tokenizer.is_file() else None, G=4, turns=4)
        step = registered().index("alignopsd")
        proc = subprocess.Popen([sys.executable, "-m", "opsd.cli", "inspect", str(run), "--port", "0"], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        try:
            url = proc.stdout.readline().split("open ", 1)[1].strip()
            base = url.split("/?")[0]
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1200, "height": 760})
                page.goto(url)
                page.goto(f"{base}/#/step/{step}")
                page.wait_for_selector("#groups a")
                page.click("#groups a")
                page.wait_for_selector("#trajectories .turn")
                args.out.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out / "inspect-group.png"))
                # The trajectory page of a token-level method (grpo_opd: GRPO + coef x gap), where colours vary by token.
                page.goto(f"{base}/#/step/{registered().index('grpo_opd')}")
                page.wait_for_selector("#groups a")
                page.click("#groups a")
                page.wait_for_selector("#trajectories .turn")
                page.click("#trajectories .traj h2 a")
                page.wait_for_selector(".tokens .tok")
                page.set_viewport_size({"width": 1200, "height": 480})
                page.screenshot(path=str(args.out / "inspect-trajectory.png"))
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    from PIL import Image

    for name in ("inspect-group.png", "inspect-trajectory.png"):
        path = args.out / name
        Image.open(path).convert("RGB").quantize(colors=64).save(path, optimize=True)  # ~3x smaller, same look
        print(f"wrote {args.out / name} ({(args.out / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
