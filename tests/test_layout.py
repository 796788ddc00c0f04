"""The house's import rules, checked on the source: imports flow one way and no two files import each other
(docs/concepts/layout.md). Function-level imports count too: a lazy import is still a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Far below today's counts (61 files in opsd/, 27 in services/): a scan that finds fewer read the wrong place,
# and its empty graph would pass every rule below.
MIN_FILES = {"opsd": 40, "services": 15}


def _module(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path = ROOT, min_files: dict[str, int] = MIN_FILES) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (from-imports resolved to a submodule
    when one exists: `from opsd.credit import alignopsd` is an import of opsd.credit.alignopsd).

    Raises AssertionError when opsd/ or services/ under `root` holds fewer .py files than `min_files` says."""
    found = {top: sorted((root / top).rglob("*.py")) for top in min_files}
    for top, least in min_files.items():
        assert len(found[top]) >= least, f"the layout scan found {len(found[top])} .py files in {root / top} (expected >= {least})"
    files = [p for paths in found.values() for p in paths]
    known = {_module(p, root) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        mod, out = _module(p, root), set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                out |= subs or {node.module}
        graph[mod] = out - {mod}
    return graph


def _mutual(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})


def _opsd_into_services(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    # opsd/cli.py is the command line that starts and evaluates the roles; nothing else in opsd/ may reach into one.
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if a.startswith("opsd") and a != "opsd.cli" and b.startswith("services"))


def test_the_scan_reads_the_whole_source_tree():
    """The rules below pass on an empty graph: the scan must have found the files and their imports."""
    graph = _imports()
    assert sum(m.startswith("opsd") for m in graph) >= MIN_FILES["opsd"]
    assert sum(m.startswith("services") for m in graph) >= MIN_FILES["services"]
    assert {"opsd.queue", "opsd.wire"} <= graph["services.trainer.controller"]  # plain from-imports
    assert "opsd.credit.alignopsd.spans" in graph["opsd.credit.alignopsd"]  # resolved to the submodule
    assert "opsd.models" in graph["services.trainer.__main__"]  # a package (its __init__)


def test_the_rules_catch_planted_violations(tmp_path):
    """A tree where opsd.a and opsd.b import each other (one lazily) and opsd.c reaches into services.x."""
    files = {"opsd/__init__.py": "", "opsd/a.py": "from opsd import b\n",
             "opsd/b.py": "def f():\n    import opsd.a\n", "opsd/c.py": "from services.x import run\n",
             "opsd/cli.py": "import services.x\n", "services/__init__.py": "", "services/x.py": "import opsd.a\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _imports(tmp_path, {"opsd": 5, "services": 2})
    assert _mutual(graph) == [("opsd.a", "opsd.b")]
    assert _opsd_into_services(graph) == [("opsd.c", "services.x")]  # opsd.cli may


def test_no_two_files_import_each_other():
    pairs = _mutual(_imports())
    assert pairs == [], f"files importing each other: {pairs}"


def test_opsd_does_not_import_services_except_the_cli_entry_point():
    bad = _opsd_into_services(_imports())
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
