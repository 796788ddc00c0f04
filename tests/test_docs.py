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
    assert {"demo", "test", "docs", "docs-serve", "install"} <= make_targets()
    # A block titled as output shows what a command printed ("opsd run alignopsd x 3 steps, hf backend -> DIR").
    printed = "opsd run alignopsd x 3 steps, hf backend -> runs/x\n"
    assert command_problems(f'```text title="make demo\'s output"\n{printed}```\n') == []
    assert len(command_problems(f"```text\n{printed}```\n")) == 1


def test_cli_reference_writes_usage_and_types_as_click_does():
    """Usage lines and types as click writes them (typer 0.29's own help writes `{paths}...`, `<list[Path]>`,
    `<int>`), and a `docs/<page>.md` mention in a help text is a link."""
    from cli_ref import cli_reference

    page = cli_reference()
    assert "Usage: opsd credit check [OPTIONS] PATHS..." in page and "Usage: opsd run [OPTIONS] [CONFIG]" in page
    assert "Usage: opsd inspect [OPTIONS] RUN_DIR" in page and "Usage: opsd credit [OPTIONS] COMMAND [ARGS]..." in page
    assert "| `PATHS` | `PATH...` |" in page and "| `--steps` | `INTEGER` |" in page
    assert "| `--resume` | `DIRECTORY` |" in page and "| `--port` | `INTEGER RANGE` |" in page
    assert "| `-v, --verbose` |  |" in page
    assert not re.search(r"\{\w+\}|&lt;(?:int|str|file|dir|path|list)", page), "typer's metavars left in the page"
    assert "[docs/getting-started.md: Where the outputs land](../getting-started.md#where-the-outputs-land)" in page
    prepare = page.split("## `opsd prepare`")[1].split("## ")[0]
    assert re.search(r"^\| `CONFIG` \| `FILE` \| run config", prepare, flags=re.M)  # the argument has a help text


_LIST_ITEM = re.compile(r"(?:[-*+]|\d+[.)]) ")
_FENCE = re.compile(r"\s*(`{3,}|~{3,})")


def list_problems(markdown: str) -> list[str]:
    """Lines that start a list directly under a line of text. Python-Markdown (the site) needs a blank line
    before a list and renders such items as one paragraph with a literal "- "; GitHub starts a list there (also
    from a wrapped line that happens to begin with "+ "). A line after a list item, a continuation line
    (indented), a table row or a heading is fine, and fenced code blocks are skipped."""
    problems, fence, prev = [], None, ""
    for number, line in enumerate(markdown.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            prev = ""
            continue
        if opened:
            fence, prev = opened.group(1), ""
            continue
        if (_LIST_ITEM.match(line) and prev.strip() and not _LIST_ITEM.match(prev)
                and not prev.startswith((" ", "\t")) and not prev.startswith(("|", "#"))):
            problems.append(f"line {number}: a list item right after a line of text (add a blank line): {line[:60]}")
        prev = line
    return problems


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_lists_follow_a_blank_line(path: Path):
    assert list_problems(path.read_text()) == []


def test_list_check_finds_a_list_glued_to_text():
    bad = "Reading:\n- one\n- two\n\nSteps:\n1. first\n\nwrapped text, 2.11\n+ CUDA 13\n"
    assert [p.split(":")[0] for p in list_problems(bad)] == ["line 2", "line 6", "line 9"]
    ok = ("Reading:\n\n- one\n- two, wrapped\n  over lines\n  - nested\n- three\n\n## Heading\n- item\n\n"
          "| a | b |\n|---|---|\n\n```bash\ntext\n- not a list in code\n```\n"
          "- item\n  ```text\n  code\n  ```\n  more\n\n**bold** and *emphasis* on a line\n")
    assert list_problems(ok) == []


def test_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert links, "the README links to no page"
    assert [t for t in links if not (ROOT / t).exists()] == []
    assert len(readme.encode()) < 10_000, "README.md should stay under ~10 KB: move the detail to a docs page"


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_in_the_repository(path: Path):
    """A page read on GitHub: each relative link names a file of the repository (the site's hook rewrites them to
    the site's paths, and a generated page keeps a placeholder in docs/)."""
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
             if "://" not in t and not t.startswith(("#", "mailto:"))]
    assert [t for t in links if not (path.parent / t).exists()] == []


def test_site_builds_strict(tmp_path: Path):
    """`mkdocs build --strict`: any warning (an unresolved link or anchor, a page left out of the nav, a bad
    command line, a docstring mkdocstrings cannot read) fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "max_staleness" in config_page and (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    assert config_page.count("Unknown keys are errors") == 1  # opsd.config's docstring says it; the page once
    # No list rendered as a paragraph with a literal "- " (a list glued to the text above it, in a page or in a
    # docstring the API pages show).
    glued = []
    for page in sorted((tmp_path / "site").rglob("*.html")):
        html = re.sub(r"<pre.*?</pre>", "", page.read_text(), flags=re.S)
        glued += [f"{page.relative_to(tmp_path)}: {p[:80]!r}" for p in re.findall(r"<p>(.*?)</p>", html, flags=re.S)
                  if re.search(r"\n\s*(?:[-*+] |\d+\. )", p)]
    assert glued == []
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert 'href="../../getting-started/#where-the-outputs-land"' in cli_page
