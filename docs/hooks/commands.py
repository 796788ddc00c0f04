"""Command lines in the docs must name real commands: `opsd ...` against the CLI, `make ...` against the Makefile.

`command_problems(markdown)` reads every fenced code block, and every inline code span, of a Markdown text
and returns one line per command line that names a command, subcommand, option or make target that does
not exist. A line counts when it starts (after `$ `, environment assignments and `sudo`) with `opsd`,
`.venv/bin/opsd`, `.venv-vllm/bin/opsd` or `make`. A block whose title says it is output
(```` ```text title="make demo's output" ````) shows what a command printed, and is not read.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

from cli_ref import resolve

ROOT = Path(__file__).resolve().parents[2]
OPSD = ("opsd", ".venv/bin/opsd", ".venv-vllm/bin/opsd")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OUTPUT = re.compile(r'\btitle="[^"]*\boutput\b', flags=re.I)  # a fence's info string: a block of output


@lru_cache(maxsize=1)
def make_targets(makefile: Path = ROOT / "Makefile") -> frozenset[str]:
    """The targets a user can name: every plain `name:` rule of the Makefile (not variables, not patterns)."""
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*(?:\s+[A-Za-z0-9][A-Za-z0-9_.-]*)*)\s*:(?!=)", line)
        if m:
            targets |= set(m.group(1).split())
    return frozenset(targets - {".PHONY"})


def _code_lines(markdown: str) -> list[str]:
    """The lines of fenced code blocks (backslash continuations joined) and the inline code spans outside them."""
    out, fence, block, output = [], None, [], False
    for line in markdown.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence, block, output = m.group(2), [], bool(_OUTPUT.search(m.group(3)))
        elif fence is not None and m and m.group(2).startswith(fence) and not m.group(3).strip():
            if not output:
                out += "\n".join(block).replace("\\\n", " ").splitlines()
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            out += _INLINE.findall(line)
    return out


def _words(line: str) -> list[str] | None:
    """The words of a command line from the command on, or None when the line runs no opsd or make."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and (_ASSIGN.match(words[0]) or words[0] == "sudo"):
        words = words[1:]
    if words and (words[0] in OPSD or words[0] == "make"):
        return words
    return None


def check_line(words: list[str]) -> str | None:
    """None when a command line's words (`opsd ...` or `make ...`) name real things, else what is wrong."""
    if words[0] == "make":
        for word in words[1:]:
            if word.startswith("-") or "=" in word or word.startswith("<"):
                continue
            if word not in make_targets():
                return f"the Makefile has no target {word!r}"
        return None
    return resolve(words[1:])


def command_problems(markdown: str) -> list[str]:
    """One line per command line of `markdown` that names a command, option or target that does not exist."""
    problems = []
    for line in _code_lines(markdown):
        words = _words(line)
        if words:
            problem = check_line(words)
            if problem:
                problems.append(f"{line.strip()!r}: {problem}")
    return problems
