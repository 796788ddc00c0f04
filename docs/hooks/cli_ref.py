"""The CLI reference page, generated from the click commands behind `opsd` (opsd/cli.py, a typer app).

`cli_reference()` writes every command and subcommand with its usage line, help text, arguments and
options (type, default, help). `resolve(argv)` says whether a command line names a real command and
real options; tests/test_docs.py and the site build (docs/hooks/docs_hooks.py) check the docs'
command lines with it.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import typer

from opsd.cli import app


def root():
    """The click command behind `opsd`."""
    return typer.main.get_command(app)


def _commands(cmd, ctx) -> list:
    """`cmd` and every subcommand below it, depth first, with the context that names it (`opsd credit check`)."""
    out = [(cmd, ctx)]
    if _is_group(cmd):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                out += _commands(sub, _ctx(sub, info_name=name, parent=ctx))
    return out


def _ctx(cmd, info_name: str, parent=None):
    """A context for `cmd`, of the click that typer uses (typer carries its own copy of click)."""
    return cmd.context_class(cmd, info_name=info_name, parent=parent)


def _is_group(cmd) -> bool:
    """A command with subcommands (typer's groups are not click.Group instances: typer carries its own click)."""
    return hasattr(cmd, "list_commands")


def _cell(text: str | None) -> str:
    """`text` for a Markdown table cell: one line, pipes and angle brackets escaped."""
    text = " ".join((text or "").split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


# Python type -> the name click gives its parameter type in --help (click.INT is "integer", ...).
_CLICK_TYPES = {int: "INTEGER", float: "FLOAT", str: "TEXT", bool: "BOOLEAN"}
_CLICK_PATHS = {"file": "FILE", "dir": "DIRECTORY", "path": "PATH"}  # click.Path(file_okay=..., dir_okay=...)


def _is_argument(param) -> bool:
    return param.param_type_name == "argument"


def click_type(param) -> str:
    """The parameter's type as click writes it (`INTEGER`, `PATH`, `FILE`, `INTEGER RANGE`, `PATH...` for many
    values), "" for a flag. typer 0.29's own help writes `<int>`, `<file>`, `<list[Path]>` instead."""
    if getattr(param, "is_flag", False):
        return ""
    desc = param.type_descriptor
    annotation = desc.annotation
    if desc.is_list:
        (annotation,) = typing.get_args(annotation) or (str,)
    if desc.is_choice:
        name = "[" + "|".join(str(c) for c in desc.choices or ()) + "]"
    elif desc.is_path or annotation is Path:
        name = _CLICK_PATHS.get(desc.path_type, "PATH")
    else:
        name = _CLICK_TYPES.get(annotation, getattr(annotation, "__name__", str(annotation)).upper())
        if desc.is_ranged:
            name += " RANGE"
    return name + ("..." if param.nargs != 1 else "")


def _argument_metavar(param) -> str:
    """An argument as click's usage line writes it: CONFIG, [CONFIG] when optional, PATHS... for many."""
    name = param.metavar or param.name.upper()
    if not param.required:
        name = f"[{name}]"
    return name + ("..." if param.nargs != 1 else "")


def usage(cmd, ctx) -> str:
    """The command's usage line, click's own (`Command.get_usage`), its arguments written as click writes them
    (`opsd credit check [OPTIONS] PATHS...`; typer 0.29 writes `{paths}...`)."""
    line = cmd.get_usage(ctx)
    for param in cmd.get_params(ctx):
        if _is_argument(param):
            for piece in param.get_usage_pieces(ctx):
                line = line.replace(f" {piece}", f" {_argument_metavar(param)}", 1)
    return line


def _param_row(param, ctx) -> str:
    """One table row: the option's names (an argument's name as the usage line writes it), click's type, and
    the help of the parameter's own `--help` record (default, range, required)."""
    _, help_text = param.get_help_record(ctx) or ("", "")
    if _is_argument(param):
        names = param.metavar or param.name.upper()
    else:
        names = ", ".join(sorted([*param.opts, *param.secondary_opts], key=lambda o: (o.startswith("--"), o)))
    kind = click_type(param)
    return f"| `{names}` | {f'`{kind}`' if kind else ''} | {_cell(help_text)} |"


def cli_reference() -> str:
    """The Markdown of the CLI reference: every `opsd` command, its usage, arguments and options."""
    top = root()
    out = ["# CLI reference", "",
           "Every `opsd` command, generated from opsd/cli.py when the site is built (`opsd --help` and "
           "`opsd COMMAND --help` print the same help; they write a type as `<int>` where this page, as click "
           "does, writes `INTEGER`). The command is installed in `.venv/bin/`.", ""]
    for cmd, ctx in _commands(top, _ctx(top, info_name="opsd")):
        path = ctx.command_path
        out += [f"## `{path}`", "", "```text", usage(cmd, ctx), "```", ""]
        if cmd.help:
            out += [_cell_block(cmd.help), ""]
        if _is_group(cmd):
            subs = [n for n in cmd.list_commands(ctx) if not cmd.get_command(ctx, n).hidden]
            out += ["Commands: " + ", ".join(f"`{path} {n}`" for n in subs) + ".", ""]
        params = [p for p in cmd.get_params(ctx)]
        if params:
            out += ["| argument or option | type | help (default, range) |", "|---|---|---|"]
            out += [_param_row(p, ctx) for p in params]
            out.append("")
    return "\n".join(out)


# "docs/getting-started.md" in a help text, and the heading named after it ("docs/x.md: Where the outputs land")
_DOC_PATH = re.compile(r"\bdocs/(?P<page>[\w./-]+?\.md)(?::\s+(?P<heading>[A-Z][\w ,'-]*\w))?")
DOCS = Path(__file__).resolve().parents[1]


def _slug(heading: str) -> str:
    """The anchor MkDocs (toc's slugify) gives a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def link_doc_paths(text: str) -> str:
    """`docs/<page>.md` mentions in a help text as links from the CLI reference page (reference/cli.md), to the
    heading named after the colon when the page has it; a path that is no page stays text."""
    def link(m: re.Match) -> str:
        page, heading = m.group("page"), m.group("heading")
        if not (DOCS / page).is_file():
            return m.group(0)
        headings = {_slug(h) for h in re.findall(r"^#+\s+(.+?)\s*$", (DOCS / page).read_text(), flags=re.M)}
        if heading and _slug(heading) in headings:
            return f"[docs/{page}: {heading}](../{page}#{_slug(heading)})"
        return f"[docs/{page}](../{page}){m.group(0)[len('docs/' + page):]}"
    return _DOC_PATH.sub(link, text)


def _cell_block(text: str) -> str:
    """A command's help as Markdown paragraphs, angle brackets escaped, docs/ paths made links."""
    return link_doc_paths(text.replace("<", "&lt;").replace(">", "&gt;").replace("\b\n", ""))


def resolve(argv: list[str]) -> str | None:
    """None when `argv` (after `opsd`) names real commands and options, else what is wrong.

    Placeholders are allowed: a bracketed option (`[--steps N]`), `...`, `<...>` and upper-case words
    (`COMMAND`)."""
    cmd, path = root(), "opsd"
    ctx = _ctx(cmd, info_name="opsd")
    words = [w.strip("[]") for w in argv]
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word or word == "..." or word.startswith("<") or re.fullmatch(r"[A-Z][A-Z_]*", word):
            continue
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            known = {o: p for p in cmd.get_params(ctx) for o in [*p.opts, *p.secondary_opts]}
            if name not in known:
                return f"`{path}` has no option {name}"
            if "=" not in word and not getattr(known[name], "is_flag", False):
                i += 1  # the option's value
            continue
        if _is_group(cmd):
            sub = cmd.get_command(ctx, word)
            if sub is None:
                return f"`{path}` has no command {word!r}"
            cmd, path = sub, f"{path} {word}"
            ctx = _ctx(cmd, info_name=word, parent=ctx)
    return None
