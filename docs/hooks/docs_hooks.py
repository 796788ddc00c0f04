"""MkDocs hooks of the opsd site (mkdocs.yml `hooks:`).

- The config and CLI reference pages are generated from the code at every build (config_ref.py, cli_ref.py).
- Markdown files that live beside the code (BENCHMARKS.md, k8s/README.md, ...) and the figures they show are
  added to the site under the paths of EXTERNAL; every page's relative links to repository files are rewritten
  to the site's paths (docs/ links to the repository's own paths, which GitHub shows too), so a link that leads
  nowhere in the site is a warning (an error under `mkdocs build --strict`).
- Every command line in a code block must name a real `opsd` command and option or `make` target
  (commands.py): a line that does not is a warning too.
- Docstrings are plain text rendered as Markdown: an index such as `x[i][j]` there reads as a reference link,
  which mkdocs-autorefs would try to resolve. Such a link whose target is no dotted name (`opsd.types.X`) is
  put back as the text it was.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

HOOKS = Path(__file__).resolve().parent
sys.path.insert(0, str(HOOKS))

from cli_ref import cli_reference  # noqa: E402
from commands import command_problems  # noqa: E402
from config_ref import config_reference  # noqa: E402

ROOT = HOOKS.parents[1]
log = logging.getLogger("mkdocs.plugins.opsd")

# repo path -> site path of the files outside docs/ that the site shows
EXTERNAL = {
    "BENCHMARKS.md": "benchmarks/results.md",
    "k8s/README.md": "how-to/kubernetes-reference.md",
    "opsd/envs/WEBSHOP.md": "how-to/webshop-server.md",
    "opsd/envs/data/search/README.md": "how-to/search-corpus.md",
    **{f"benchmarks/results/{p.name}": f"benchmarks/results/{p.name}"
       for p in sorted((ROOT / "benchmarks/results").glob("*.png"))},
}
GENERATED = {"reference/config.md": config_reference, "reference/cli.md": cli_reference}
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_AUTOREF = re.compile(r"<autoref (?P<attrs>.*?)>(?P<title>.*?)</autoref>", flags=re.DOTALL)
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_IDENTIFIER = re.compile(r'\bidentifier="(?P<id>[^"]*)"')


def on_files(files: Files, config) -> Files:
    """Add the generated reference pages (in place of their placeholders in docs/, which a reader of the
    repository sees) and the files that live outside docs/."""
    for uri, make in GENERATED.items():
        placeholder = files.get_file_from_path(uri)
        if placeholder is not None:
            files.remove(placeholder)
        files.append(File.generated(config, uri, content=make()))
    for repo_path, uri in EXTERNAL.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / repo_path)))
    return files


def _site_path(repo_path: str) -> str | None:
    """Where a repository file is in the site, or None when the site does not hold it."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):]
    return EXTERNAL.get(repo_path)


def _rewrite_links(markdown: str, repo_path: str, uri: str) -> str:
    """`markdown` of the repository file `repo_path` shown at `uri`, its relative links made site-relative."""
    def fix(m: re.Match) -> str:
        target, _, anchor = m.group(2).partition("#")
        if not target or "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        site = _site_path(posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), target)))
        if site is None:
            return m.group(0)
        new = posixpath.relpath(site, posixpath.dirname(uri) or ".")
        return f"{m.group(1)}{new}{'#' + anchor if anchor else ''}{m.group(3)}"
    return _LINK.sub(fix, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Rewrite a page's links to repository files the site shows elsewhere (a docs/ page's `../../BENCHMARKS.md`
    works on GitHub and in the site); warn about command lines that name no real command or option."""
    uri = page.file.src_uri
    external = {v: k for k, v in EXTERNAL.items()}
    if uri not in GENERATED:
        markdown = _rewrite_links(markdown, external.get(uri, f"docs/{uri}"), uri)
    for problem in command_problems(markdown):
        log.warning("%s: %s", uri, problem)
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    """Put back, as text, the reference links of docstrings that are indexes (`[B][L]`), not cross-references."""
    def restore(m: re.Match) -> str:
        found = _IDENTIFIER.search(m.group("attrs"))
        if found is None or _DOTTED.fullmatch(found.group("id")) or re.search(r"\boptional\b", m.group("attrs")):
            return m.group(0)
        return f"[{m.group('title')}][{found.group('id')}]"
    return _AUTOREF.sub(restore, html)
