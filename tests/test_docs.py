"""The documentation site (mkdocs.yml, docs/): the generated config reference lists every key of RunConfig, every
command line in the docs names a real command, option or make target, the README's links lead to files, and
`mkdocs build --strict` passes (a broken link or anchor there is an error)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from opsd.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

from commands import command_problems, make_targets  # noqa: E402
from config_ref import config_reference  # noqa: E402


def _keys(cls: type[BaseModel], path: str = "") -> list[tuple[str, str]]:
    """(section path, key) of every leaf key of `cls`, optional sections (`teacher.model`) included."""
    out = []
    for name, info in cls.model_fields.items():
        args = typing.get_args(info.annotation) or (info.annotation,)
        sub = next((a for a in args if inspect.isclass(a) and issubclass(a, BaseModel)), None)
        dotted = f"{path}.{name}" if path else name
        out += _keys(sub, dotted) if sub is not None else [(path, name)]
    return out


def _sections(markdown: str) -> dict[str, str]:
    """The config reference's `## \\`section\\`` headings -> the text under each."""
    parts = re.split(r"^## `([^`]+)`.*$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_config_reference_lists_every_key():
    sections = _sections(config_reference())
    keys = _keys(RunConfig)
    assert len(keys) > 200  # a walk that found few keys read the wrong class
    missing = [f"{s}.{k}" for s, k in keys if not re.search(rf"^\| `{k}` \|", sections.get(s, ""), flags=re.M)]
    assert not missing, f"the config reference lacks {missing}"


def test_config_reference_has_types_defaults_bounds_and_comments():
    run = _sections(config_reference())["run"]
    row = next(line for line in run.splitlines() if line.startswith("| `max_staleness` |"))
    assert "| int | `0` | >= 0, <= 16 |" in row and "k-step-off" in row  # comment from the lines above the field
    row = next(line for line in run.splitlines() if line.startswith("| `max_restarts` |"))
    assert "restarts a role that died" in row  # inline comment
    model = _sections(config_reference())["model"]
    assert '| `backend` | string | `"hf"` | one of `"hf"`, `"vllm"` |' in model


def _doc_files() -> list[Path]:
    """README.md, the pages in docs/ and the Markdown files from elsewhere that the site shows."""
    from docs_hooks import EXTERNAL

    shown = [ROOT / p for p in EXTERNAL if p.endswith(".md")]
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *shown]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_name_real_commands(path: Path):
    assert command_problems(path.read_text()) == []


def test_command_check_finds_what_does_not_exist():
    text = "```bash\nopsd run configs/quickstart.yaml --stepz 3\nopsd credit chek x\nmake demoo\n```\n"
    problems = command_problems(text)
    assert len(problems) == 3 and "--stepz" in problems[0] and "chek" in problems[1] and "demoo" in problems[2]
    ok = ("```bash\n.venv/bin/opsd run --resume RUN_DIR [--steps N] \\\n  --report-to wandb\n"
          "OMP_NUM_THREADS=1 opsd eval CONFIG --checkpoint runs/x --episodes 2  # a comment\nmake install\n```\n"
          "and `opsd inspect RUN_DIR --port 0` inline")
    assert command_problems(ok) == []
    assert {"demo", "test", "docs", "install"} <= make_targets()


def test_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert links, "the README links to no page"
    assert [t for t in links if not (ROOT / t).exists()] == []
    assert len(readme.encode()) < 10_000, "README.md should stay under ~10 KB: move the detail to a docs page"


def test_site_builds_strict(tmp_path: Path):
    """`mkdocs build --strict`: any warning (an unresolved link or anchor, a page left out of the nav, a bad
    command line, a docstring mkdocstrings cannot read) fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "max_staleness" in config_page and (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
