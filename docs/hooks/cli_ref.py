"""The CLI reference page, generated from the click commands behind `opsd` (opsd/cli.py, a typer app).

`cli_reference()` writes every command and subcommand with its usage line, help text, arguments and
options (type, default, help). `resolve(argv)` says whether a command line names a real command and
real options; tests/test_docs.py and the site build (docs/hooks/docs_hooks.py) check the docs'
command lines with it.
"""

from __future__ import annotations

import re

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


def _param_row(param, ctx) -> str:
    """One table row from the parameter's own `--help` record: its names and value, and its help."""
    names, help_text = param.get_help_record(ctx) or (param.name, "")
    return f"| `{names}` | {_cell(help_text)} |"


def cli_reference() -> str:
    """The Markdown of the CLI reference: every `opsd` command, its usage, arguments and options."""
    top = root()
    out = ["# CLI reference", "",
           "Every `opsd` command, generated from opsd/cli.py when the site is built (`opsd --help` and "
           "`opsd COMMAND --help` print the same). The command is installed in `.venv/bin/`.", ""]
    for cmd, ctx in _commands(top, _ctx(top, info_name="opsd")):
        path = ctx.command_path
        out += [f"## `{path}`", "", "```text", cmd.get_usage(ctx), "```", ""]
        if cmd.help:
            out += [_cell_block(cmd.help), ""]
        if _is_group(cmd):
            subs = [n for n in cmd.list_commands(ctx) if not cmd.get_command(ctx, n).hidden]
            out += ["Commands: " + ", ".join(f"`{path} {n}`" for n in subs) + ".", ""]
        params = [p for p in cmd.get_params(ctx)]
        if params:
            out += ["| argument or option | help (default, range) |", "|---|---|"]
            out += [_param_row(p, ctx) for p in params]
            out.append("")
    return "\n".join(out)


def _cell_block(text: str) -> str:
    """A command's help as Markdown paragraphs, angle brackets escaped."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("\b\n", "")


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
