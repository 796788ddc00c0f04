"""The house's import rules, checked on the source: imports flow one way and no two files import each other
(README "Layout"). Function-level imports count too: a lazy import is still a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (from-imports resolved to a submodule
    when one exists: `from opsd.credit import alignopsd` is an import of opsd.credit.alignopsd)."""
    files = [p for top in ("opsd", "services") for p in (ROOT / top).rglob("*.py")]
    known = {_module(p) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        mod, out = _module(p), set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                out |= subs or {node.module}
        graph[mod] = out - {mod}
    return graph


def test_no_two_files_import_each_other():
    graph = _imports()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert pairs == [], f"files importing each other: {pairs}"


def test_opsd_does_not_import_services_except_the_cli_entry_point():
    # opsd/cli.py is the command line that starts and evaluates the roles; nothing else in opsd/ may reach into one.
    graph = _imports()
    bad = sorted((a, b) for a, deps in graph.items() for b in deps
                 if a.startswith("opsd") and a != "opsd.cli" and b.startswith("services"))
    assert bad == [], f"opsd/ importing services/: {bad}"


def test_config_loads_without_the_credit_estimators():
    """opsd.config validates run.method against CREDIT_METHODS without importing opsd.credit (which imports it),
    and every name there is a registered estimator."""
    code = ("import sys, opsd.config as c; c.RunConfig.model_validate({'run': {'method': 'gc_opd'}}); "
            "print(sorted(m for m in sys.modules if m.startswith('opsd.credit')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from opsd.config import CREDIT_METHODS
    from opsd.credit import registered

    assert sorted(CREDIT_METHODS) == registered()
