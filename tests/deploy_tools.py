"""Finding the offline validators the deployment tests run (kubectl, hadolint, ...).

The Python ones come with the dev extras (next to this interpreter); kubectl
and docker-compose come from the machine. A missing tool skips its test with
the reason, unless OPSD_REQUIRE_DEPLOY_TOOLS=1 (set by .ci/run), where it fails:
in CI a skipped validation must not pass for a done one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "OPSD_REQUIRE_DEPLOY_TOOLS"


def tool(name: str) -> str:
    """The path of executable `name`: beside sys.executable first, then on PATH; skips or fails if absent."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found:
        return found
    reason = f"{name} is not installed (dev extras or the machine)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)


def run_tool(args: list[str], stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a validator from the repo root; fails the test with its output on a non-zero exit."""
    p = subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(args[:3])} ... exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p
