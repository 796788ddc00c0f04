"""The config reference page, generated from opsd/config/ so that it cannot drift from the code.

`config_reference()` walks `RunConfig` section by section (sections inside sections too, and the optional
ones such as `teacher.model` and `trainer.lora`) and writes, for every key, its type, default, bounds
(ge/gt/le/lt, lengths, pattern, the choices of a Literal) and the comment the source gives it: the
comment lines just above the field and its inline `#` comment, read with `tokenize` and `ast` from the file
each section is defined in (the package's modules, opsd/config/*.py).
`config_keys()` lists the dotted keys the page holds (tests/test_docs.py compares them with RunConfig).
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import tokenize
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from opsd import config as config_module

_BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"),
           (at.MinLen, "min_length", "length >="), (at.MaxLen, "max_length", "length <="))
_MARKDOWN_SPECIAL = re.compile(r"([\\*_\[\]|<>])")


def _comments(path: Path) -> dict[str, dict[str, str]]:
    """{class name: {field name: its comment}} for every annotated field of every class in `path`."""
    source = path.read_text()
    lines = source.splitlines()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields = out.setdefault(node.name, {})
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, n = [], stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, by_line.get(n, ""))
                n -= 1
            inline = [by_line[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in by_line]
            inline = [c for c in inline if not c.startswith("type: ignore")]
            fields[stmt.target.id] = " ".join(c for c in above + inline if c)
    return out


def _section_comments(root: type[BaseModel]) -> dict[str, dict[str, str]]:
    """`_comments` of every file that defines a section below `root` or a class one inherits its fields from."""
    files = {Path(inspect.getfile(c)) for _, cls, _ in _sections(root, "") for c in cls.__mro__
             if c.__module__.startswith(config_module.__name__)}
    out: dict[str, dict[str, str]] = {}
    for f in sorted(files):
        out.update(_comments(f))
    return out


def _escape(text: str) -> str:
    """`text` for a Markdown table cell: code spans kept, other Markdown and HTML characters escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1
                   else _MARKDOWN_SPECIAL.sub(r"\\\1", p) for p in parts)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field that holds one (`ModelSection | None` too), else None."""
    for t in typing.get_args(annotation) or (annotation,):
        if inspect.isclass(t) and issubclass(t, BaseModel):
            return t
    return None


def _type_name(t: Any) -> str:
    """A short, readable name of an annotation (Annotated's constraints are listed as bounds instead)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "string" if all(isinstance(a, str) for a in args) else "literal"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if t is type(None):
        return "null"
    if inspect.isclass(t) and issubclass(t, BaseModel):
        return "section"
    return {str: "string", bool: "bool", int: "int", float: "float"}.get(t, getattr(t, "__name__", str(t)))


def _constraints(metadata: list, prefix: str = "") -> list[str]:
    """Human-readable bounds of pydantic/annotated-types metadata (FieldInfo inside Annotated included)."""
    out = []
    for m in metadata:
        if isinstance(m, FieldInfo):
            out += _constraints(m.metadata, prefix)
            continue
        for kind, attr, symbol in _BOUNDS:
            if isinstance(m, kind):
                out.append(f"{prefix}{symbol} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            out.append(f"{prefix}pattern `{m.pattern}`")
    return out


def _walk_annotation(t: Any, prefix: str = "") -> tuple[list[str], list[str]]:
    """(bounds, choices) held inside an annotation: Annotated constraints and Literal values, list items too."""
    bounds, choices = [], []
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Annotated:
        bounds += _constraints(list(args[1:]), prefix)
        b, c = _walk_annotation(args[0], prefix)
        bounds, choices = bounds + b, choices + c
    elif origin in (typing.Union, types.UnionType):
        for a in args:
            b, c = _walk_annotation(a, prefix)
            bounds, choices = bounds + b, choices + c
    elif origin is Literal:
        choices += [f"{prefix}`{json.dumps(a)}`" for a in args]
    elif origin in (list, dict):
        b, c = _walk_annotation(args[-1], "each item " if origin is list else "each value ")
        bounds, choices = bounds + b, choices + c
    return bounds, choices


def _default(info: FieldInfo) -> str:
    """The default as YAML would spell it, long lists shortened."""
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, list) and len(value) > 8:
        return f"`[{json.dumps(value[0])}, {json.dumps(value[1])}, ..., {json.dumps(value[-1])}]` ({len(value)} items)"
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _sections(cls: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel], bool]]:
    """(dotted path, class, optional) of `cls` and every section below it, depth first, in source order."""
    out = [(path, cls, False)]
    for name, info in cls.model_fields.items():
        sub = _section_type(info.annotation)
        if sub is not None:
            found = _sections(sub, f"{path}.{name}" if path else name)
            out += [(found[0][0], found[0][1], info.default is None)] + found[1:]
    return out


def config_keys(cls: type[BaseModel] | None = None, path: str = "") -> list[str]:
    """Every dotted key of `cls` (default RunConfig) that is not itself a section, in source order."""
    cls = cls or config_module.RunConfig
    keys = []
    for name, info in cls.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        sub = _section_type(info.annotation)
        keys += config_keys(sub, dotted) if sub is not None else [dotted]
    return keys


def config_reference() -> str:
    """The Markdown of the config reference: one table per section of RunConfig, every key in it."""
    comments = _section_comments(config_module.RunConfig)
    out = ["# Config reference", "",
           "Every key of a run config (YAML, `configs/*.yaml`), generated from `opsd/config/` when the site is "
           "built: type, default, bounds and the comment the source gives it. A "
           "section's keys may be left out: each has its default. Cross-field rules (a setting refused with "
           "another) are checked on load and named in the error; they are not listed here.", ""]
    top_doc = inspect.getdoc(config_module)
    if top_doc:
        out += [top_doc, ""]
    for path, cls, optional in _sections(config_module.RunConfig, ""):
        if not path:
            continue
        out += [f"## `{path}` {{ #{_anchor(path)} }}", ""]
        doc = cls.__doc__ if "__doc__" in cls.__dict__ else None
        if doc:
            out += [_escape(inspect.cleandoc(doc)), ""]
        if optional:
            out += [f"`{path}` is `null` by default: these keys apply once the section is written.", ""]
        out += ["| key | type | default | bounds and choices | comment |", "|---|---|---|---|---|"]
        for name, info in cls.model_fields.items():
            if _section_type(info.annotation) is not None:
                sub = f"{path}.{name}"
                out.append(f"| `{name}` | section | | | [`{sub}`](#{_anchor(sub)}) |")
                continue
            owner = next(c.__name__ for c in cls.__mro__ if name in getattr(c, "__annotations__", {}))
            bounds, choices = _walk_annotation(info.annotation)
            bounds = _constraints(info.metadata) + bounds
            limits = ", ".join(bounds + ([("one of " if not choices[0].startswith("each") else "") +
                                          ", ".join(choices)] if choices else []))
            comment = _escape(comments.get(owner, {}).get(name, ""))
            out.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {_escape_pipes(limits)} "
                       f"| {comment} |")
        out.append("")
    return "\n".join(out)


def _escape_pipes(text: str) -> str:
    """Pipes outside code spans escaped for a table cell (inside them Python-Markdown leaves them alone)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _anchor(path: str) -> str:
    """The id of a section's heading: its dotted path with hyphens (`teacher.model` -> `teacher-model`)."""
    return path.replace(".", "-").replace("_", "-")
