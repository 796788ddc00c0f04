"""What every benchmark shares: the machine line, result rows, the JSON file, one combined table.

A benchmark script builds `Row`s and, with `--json OUT`, calls
`write_json(OUT, benchmark, command_line(), rows)`, which writes

    {"benchmark": str, "machine": str, "command": str,
     "rows": [{"name", "value", "unit", "target", "ok", "note"}, ...]}

`value` is a finite float or null (not measured: the note says why). A target
is a comparison against the row's value, `"<op> <number> [unit]"` with op one
of < <= > >= == (e.g. "< 2 %", ">= 2 x"); a unit written there must be the
row's. `ok` is computed from the target when it is not given. `print_table`
and `markdown_table` show many such reports as one table (run.py's summary).

Scripts run as `python benchmarks/<name>.py` import this module as
`benchmarks.common` after putting the repository root on sys.path.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("benchmark", "measure", "value", "unit", "target", "ok")
_TARGET = re.compile(r"^\s*(<=|>=|==|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")
_OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__, "==": float.__eq__}


def parse_target(target: str) -> tuple[str, float, str]:
    """Split a target like "< 2 %" into (op, number, unit); unit may be "".

    Raises ValueError for anything else (targets are compared by machine, not read by eye).
    """
    m = _TARGET.match(target)
    if not m:
        raise ValueError(f"target {target!r} is not '<op> <number> [unit]' with op one of < <= > >= ==")
    return m.group(1), float(m.group(2)), m.group(3)


def meets(value: float, target: str) -> bool:
    """True when `value` satisfies `target` (see parse_target). Raises ValueError for a bad target."""
    op, number, _ = parse_target(target)
    return _OPS[op](float(value), number)


@dataclass
class Row:
    """One measured figure. value: finite float, or None when not measured (say why in `note`).

    ok: whether value meets target; None (and no target) means the row has no target.
    Given a target and a value but no ok, ok is computed. Raises ValueError for a
    target that does not parse, or whose unit differs from `unit`.
    """

    name: str
    value: float | None
    unit: str = ""
    target: str | None = None
    ok: bool | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.value is not None:
            self.value = float(self.value)
            if not math.isfinite(self.value):  # JSON has no NaN: keep the file valid, the problem visible
                self.note = f"{self.note} (value was {self.value})".strip()
                self.value, self.ok = None, False
        if self.target is not None:
            _, _, unit = parse_target(self.target)
            if unit and unit != self.unit:
                raise ValueError(f"row {self.name!r}: target unit {unit!r} differs from the row's {self.unit!r}")
            if self.ok is None and self.value is not None:
                self.ok = meets(self.value, self.target)


def machine() -> str:
    """One line: cores, CPU model, RAM, OS, Python and torch versions, current load average."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        ram = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        ram = "RAM unknown"
    try:
        torch = f"torch {metadata.version('torch')}"  # the version without importing torch (seconds)
    except metadata.PackageNotFoundError:
        torch = "no torch"
    load = f"load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return ", ".join(x for x in (f"{os.cpu_count()} cores ({cpu})", ram, f"{platform.system()} {platform.release()}",
                                 f"Python {platform.python_version()}", torch, load) if x)


def command_line(argv: list[str] | None = None) -> str:
    """How this script was run, as a shell line from the repository root (OMP_NUM_THREADS included)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        argv[0] = str(script.relative_to(REPO))
    except ValueError:
        argv[0] = str(script)
    threads = os.environ.get("OMP_NUM_THREADS")
    return shlex.join(([f"OMP_NUM_THREADS={threads}"] if threads else []) + [".venv/bin/python", *argv])


def report(benchmark: str, command: str, rows: list[Row], machine_line: str | None = None) -> dict[str, Any]:
    """The JSON document of one benchmark run (see the module docstring)."""
    return {"benchmark": benchmark, "machine": machine_line or machine(), "command": command,
            "rows": [asdict(r) for r in rows]}


def write_json(path: str | Path, benchmark: str, command: str, rows: list[Row]) -> dict[str, Any]:
    """Write the benchmark's JSON to `path` (parents created); returns the document."""
    doc = report(benchmark, command, rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def fmt_value(value: float | None) -> str:
    """A figure for a table: 3 significant digits, thousands separated; "n/a" for None."""
    if value is None:
        return "n/a"
    if value != 0 and (abs(value) >= 1000 or abs(value) < 1e-3):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2e}"
    return f"{value:.3g}"


def fmt_ok(ok: bool | None) -> str:
    return "" if ok is None else ("yes" if ok else "NO")


def print_rows(rows: list[Row], width: int = 60) -> None:
    """Print one script's rows, a line each: name, value (n/a when not measured), unit, target, ok, note."""
    for r in rows:
        print(f"{r.name:<{width}} {fmt_value(r.value):>10} {r.unit:<8} {r.target or '':<8} {fmt_ok(r.ok):<3} {r.note}")


def table_rows(reports: list[dict[str, Any]], notes: bool = False) -> list[list[str]]:
    """The cells of one combined table, a list per row in COLUMNS order (+ note when `notes`).

    reports: benchmark JSON documents (as written by write_json), in display order.
    """
    out = []
    for rep in reports:
        for r in rep["rows"]:
            cells = [rep["benchmark"], r["name"], fmt_value(r["value"]), r.get("unit") or "",
                     r.get("target") or "", fmt_ok(r.get("ok"))]
            out.append(cells + [r.get("note") or ""] if notes else cells)
    return out


def print_table(reports: list[dict[str, Any]], title: str | None = None) -> None:
    """Print every report's rows as ONE rich table (columns COLUMNS); failed targets in red."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for col in COLUMNS:
        table.add_column(col, justify="right" if col == "value" else "left", overflow="fold")
    for cells in table_rows(reports):
        table.add_row(*cells, style="red" if cells[-1] == "NO" else None)
    console = Console()
    (console if console.is_terminal else Console(width=160)).print(table)  # a log or pipe: no 80-column wrap


def markdown_table(reports: list[dict[str, Any]], notes: bool = True) -> str:
    """The same table in markdown (with a note column when `notes`); `|` in cells escaped."""
    cols = list(COLUMNS) + (["note"] if notes else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if c == "value" else "---" for c in cols) + "|"]
    for cells in table_rows(reports, notes=notes):
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def load_report(path: str | Path) -> dict[str, Any]:
    """Read one benchmark JSON; raises ValueError when it lacks the fields of the format."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not {"benchmark", "machine", "command", "rows"} <= set(doc):
        raise ValueError(f"{path}: not a benchmark report (needs benchmark, machine, command, rows)")
    for r in doc["rows"]:
        if not {"name", "value"} <= set(r):
            raise ValueError(f"{path}: a row without name/value: {r}")
    return doc
