"""What CI runs does not let a skipped check pass for a done one.

A required dependency that is missing fails the run under the OPSD_REQUIRE_* variables `.ci/run` exports,
and every skip that is left is named with its reason in the output. Each check runs pytest in a fresh
interpreter with the options of the Makefile's `test-main` recipe and `.ci/run`'s variables, read from
those files, so it checks the commands CI really runs; the missing piece is made missing in that
interpreter only (a blocked import, a refused IPv6 bind).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_test_options() -> list[str]:
    """The pytest options of the Makefile's `test-main` recipe (what comes between `pytest` and `tests`)."""
    recipe = re.search(r"^test-main:.*\n\t\$\(PY\) -m pytest (.+) tests --ignore=tests/vllm$",
                       (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile's test-main recipe is no longer `$(PY) -m pytest OPTIONS tests --ignore=tests/vllm`"
    return shlex.split(recipe.group(1))


def ci_exports() -> dict[str, str]:
    """The variables `.ci/run` exports (its `export NAME=VALUE` lines)."""
    return dict(re.findall(r"^export (\w+)=(\S+)$", (ROOT / ".ci" / "run").read_text(), re.M))


def run_pytest(prelude: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """pytest with `make test-main`'s options and `args`, in a fresh interpreter that first runs `prelude`
    (Python source); its output (stdout and stderr) in `.stdout`."""
    code = f"import sys\n{prelude}\nimport pytest\nsys.exit(pytest.main({make_test_options() + args!r}))\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


NO_ALFWORLD = "sys.modules['alfworld'] = None  # `import alfworld` raises ImportError"


def test_ci_fails_without_alfworld_and_a_plain_run_names_the_skip():
    exports = ci_exports()
    assert exports.get("OPSD_REQUIRE_ALFWORLD") == "1"
    ci = run_pytest(NO_ALFWORLD, ["tests/test_env_alfworld.py"], {**os.environ, **exports})
    assert ci.returncode == pytest.ExitCode.INTERRUPTED, ci.stdout[-3000:]  # a collection error, not a pass
    assert "alfworld is not importable" in ci.stdout and "OPSD_REQUIRE_ALFWORLD=1 requires it" in ci.stdout
    assert "skipped" not in ci.stdout, ci.stdout[-3000:]
    # Without the variable (a developer's machine): a skip, named with its reason.
    plain = run_pytest(NO_ALFWORLD, ["tests/test_env_alfworld.py"],
                       {k: v for k, v in os.environ.items() if k != "OPSD_REQUIRE_ALFWORLD"})
    assert plain.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, plain.stdout[-3000:]  # the skip is all there is
    assert re.search(r"^SKIPPED \[1\] tests/test_env_alfworld\.py:\d+: alfworld is not importable", plain.stdout,
                     re.M), plain.stdout[-3000:]


NO_IPV6 = """\
import errno, socket
_bind = socket.socket.bind
def _no_ipv6_bind(self, address):
    if self.family == socket.AF_INET6:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address (IPv6 refused by tests/test_ci.py)")
    return _bind(self, address)
socket.socket.bind = _no_ipv6_bind
"""


def test_ci_names_the_ipv6_skip_and_its_reason():
    """On a host without IPv6 loopback the IPv6 test skips (the host, not opsd, lacks it): CI's output says so."""
    ci = run_pytest(NO_IPV6, ["tests/test_container_env.py::test_a_role_can_serve_on_ipv6"],
                    {**os.environ, **ci_exports()})
    assert ci.returncode == 0 and "1 skipped" in ci.stdout, ci.stdout[-3000:]
    assert re.search(r"^SKIPPED \[1\] tests/test_container_env\.py:\d+: this machine has no IPv6 loopback: "
                     r".*refused by tests/test_ci\.py", ci.stdout, re.M), ci.stdout[-3000:]

