"""`make bench`: run every benchmark, one after another, and print ONE table of their results.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py [--quick] [--out DIR] [--learning] [--backends hf vllm]
                                                         [--only NAME ...]

Each benchmark in SCRIPTS runs as its own process (`python benchmarks/<name>.py
[--quick] --json DIR/<name>.json`, OMP_NUM_THREADS=1 unless set), its output
shown and kept in DIR/<name>.log. DIR defaults to runs/bench/<timestamp>/.
Then the rows of every JSON are printed as one table and written to
DIR/summary.md (the table with notes, the machine, each command) and
DIR/summary.json (the reports). A benchmark whose script is missing, that
exits non-zero or writes no valid JSON gets a row "failed: <reason>" and the
driver goes on; the exit code is then 1. A target not met is a result, not a
failure (its row says NO).

The learning benchmark (about 3 hours) runs only with `--learning` (or `--only
learning`, which implies it). `--only` takes file stems (transport, overlap,
backends, embedder, credit, scaling, inflight, inspect_page, precision, memory, learning) or the table's names
("teacher scoring (backends)", short "teacher"). Teacher
scoring runs the transformers backend; `--backends hf vllm` adds vLLM, run
with `.venv-vllm/bin/python` when that venv exists (`make install-vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

from benchmarks.common import REPO, Row, load_report, machine, markdown_table, print_table, report  # noqa: E402

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
_LOAD = re.compile(r", load average [\d.]+")


@dataclass
class Script:
    """One benchmark: its name in the table, its file, extra arguments, whether `make bench` runs it by default."""

    name: str
    path: str
    args: list[str] = field(default_factory=list)
    default: bool = True
    python: str = sys.executable

    @property
    def stem(self) -> str:
        return Path(self.path).stem


# The order: transport, overlap, teacher scoring, embedder, credit, scaling; learning on request.
SCRIPTS = [
    Script("transport", "benchmarks/transport.py"),
    Script("overlap", "benchmarks/overlap.py"),
    Script("teacher scoring (backends)", "benchmarks/backends.py", ["--backends", "hf"]),
    Script("embedder", "benchmarks/embedder.py"),
    Script("credit", "benchmarks/credit.py"),
    Script("scaling", "benchmarks/scaling.py"),
    Script("in flight (hf)", "benchmarks/inflight.py", ["--backend", "hf"]),
    Script("inspect", "benchmarks/inspect_page.py"),
    Script("precision", "benchmarks/precision.py"),
    Script("memory", "benchmarks/memory.py"),
    Script("weights", "benchmarks/weights.py"),
    Script("reference KL", "benchmarks/reference_kl.py"),
    Script("learning", "benchmarks/learning.py", default=False),
]
# `--only` names: file stems, the table's names, and "teacher" (the table's teacher-scoring row is backends.py).
ONLY_NAMES = {s.stem: s.stem for s in SCRIPTS} | {s.name: s.stem for s in SCRIPTS} | {"teacher": "backends"}


def selected(only: list[str] | None, learning: bool) -> list[Script]:
    """The scripts to run: the default ones (+ learning with `learning`), or exactly those named in `only`
    (ONLY_NAMES keys; naming learning runs it). Raises ValueError for an unknown name."""
    if only is None:
        return [s for s in SCRIPTS if s.default or (learning and s.stem == "learning")]
    unknown = [n for n in only if n not in ONLY_NAMES]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(map(repr, unknown))}; valid: {', '.join(ONLY_NAMES)}")
    stems = {ONLY_NAMES[n] for n in only}
    return [s for s in SCRIPTS if s.stem in stems]


def failed_report(script: Script, command: str, reason: str) -> dict[str, Any]:
    """A report holding one row "failed: <reason>" (no value, ok False) for a benchmark that produced none."""
    reason = " ".join(reason.split())[:300]
    return report(script.name, command, [Row(f"failed: {reason}", None, ok=False)])


def command_of(script: Script, json_path: Path, quick: bool) -> list[str]:
    """The argv that runs `script` from the repository root, writing its JSON to `json_path`."""
    return [script.python, script.path, *script.args, *(["--quick"] if quick else []), "--json", str(json_path)]


def run_script(script: Script, out: Path, quick: bool, timeout_s: float | None) -> dict[str, Any]:
    """Run one benchmark (output shown and kept in out/<stem>.log); returns its report or a failed one."""
    json_path = out / f"{script.stem}.json"
    # Relative to the repository root (the child's cwd) when inside it: the command in the report stays short.
    argv = command_of(script, json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path, quick)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    shown = shlex.join([f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}",
                        os.path.relpath(argv[0], REPO) if argv[0].startswith(str(REPO)) else argv[0], *argv[1:]])
    if not (REPO / script.path).is_file():
        return failed_report(script, shown, f"{script.path} does not exist")
    print(f"\n=== {script.name}: {shown}", flush=True)
    tail: list[str] = []
    t0 = time.monotonic()
    with open(out / f"{script.stem}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        watchdog = threading.Timer(timeout_s, proc.kill) if timeout_s else None  # also kills a silent hang
        if watchdog:
            watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # shown as it comes: a long benchmark is not silent
                sys.stdout.write(line)
                log.write(line)
                tail = (tail + [line.rstrip()])[-20:]
            code = proc.wait()
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
            raise
        finally:
            if watchdog:
                watchdog.cancel()
    seconds = time.monotonic() - t0
    print(f"=== {script.name}: exit {code} after {seconds:.0f} s", flush=True)
    if timeout_s and seconds >= timeout_s:
        return failed_report(script, shown, f"timed out after {timeout_s:.0f} s")
    if code != 0:
        last = next((t for t in reversed(tail) if t.strip()), "")
        return failed_report(script, shown, f"exit {code}: {last}")
    try:
        return load_report(json_path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        return failed_report(script, shown, f"no valid JSON: {e}")


def load_reports(paths: list[Path]) -> list[dict[str, Any]]:
    """Reports from benchmark JSON files, in order; an unreadable file becomes a failed report."""
    out = []
    for p in paths:
        try:
            out.append(load_report(p))
        except (OSError, ValueError) as e:
            out.append(report(Path(p).stem, "", [Row(f"failed: unreadable {p}: {e}", None, ok=False)]))
    return out


def failures(reports: list[dict[str, Any]]) -> list[str]:
    """`benchmark: row name` of every failed row (a row named "failed: ...")."""
    return [f"{r['benchmark']}: {row['name']}" for r in reports for row in r["rows"] if row["name"].startswith("failed:")]


def summary_markdown(reports: list[dict[str, Any]], machine_line: str, driver: str, seconds: float) -> str:
    """summary.md: the combined table (with notes), the machine, how the driver and each benchmark ran."""
    lines = ["# Benchmark results", "", f"Machine: {machine_line}", "", f"Driver: `{driver}` ({seconds / 60:.1f} min)",
             "", markdown_table(reports), "", "## Commands", ""]
    for r in reports:  # the machine only where it differs from the driver's (the load average always does)
        base, load = _LOAD.sub("", r["machine"]), _LOAD.search(r["machine"])
        differs = base != _LOAD.sub("", machine_line)
        where = f" (machine: {r['machine']})" if differs else (f" ({load.group(0).lstrip(', ')})" if load else "")
        lines.append(f"- {r['benchmark']}: `{r['command']}`{where}")
    bad = failures(reports)
    if bad:
        lines += ["", "## Failed", ""] + [f"- {b}" for b in bad]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (small sizes)")
    ap.add_argument("--out", type=Path, default=None, help="results dir (default runs/bench/<timestamp>/)")
    ap.add_argument("--learning", action="store_true", help="also run benchmarks/learning.py (about 3 hours)")
    ap.add_argument("--backends", nargs="+", choices=["hf", "vllm"], default=["hf"],
                    help="teacher-scoring backends; vllm runs with .venv-vllm/bin/python when it exists")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help=f"run only these: {', '.join(s.stem for s in SCRIPTS)} (file stems) or the table's names, "
                         f"e.g. teacher for backends; naming learning implies --learning")
    ap.add_argument("--timeout-s", type=float, default=None, help="seconds per benchmark, > 0 (default: none)")
    args = ap.parse_args()
    if args.timeout_s is not None and not args.timeout_s > 0:  # also NaN; 0 meant no limit, < 0 killed at once
        ap.error(f"--timeout-s must be > 0 seconds (got {args.timeout_s:g}); leave it out for no limit")
    try:
        scripts = selected(args.only, args.learning)
    except ValueError as e:
        ap.error(f"--only: {e}")

    out = (args.out or REPO / "runs" / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reports: list[dict[str, Any]] = []
    if "vllm" in args.backends:
        for s in scripts:
            if s.stem == "backends":
                if VLLM_PYTHON.exists():
                    s.python, s.args = str(VLLM_PYTHON), ["--backends", *args.backends]
                else:
                    reports.append(report("teacher scoring (vllm)", "", [Row(
                        f"failed: vllm asked for but {VLLM_PYTHON.relative_to(REPO)} is missing (make install-vllm)",
                        None, ok=False)]))
    driver = shlex.join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "1"), ".venv/bin/python",
                         "benchmarks/run.py", *sys.argv[1:]])
    machine_line = machine()
    t0 = time.monotonic()
    for s in scripts:
        reports.append(run_script(s, out, args.quick, args.timeout_s))
    seconds = time.monotonic() - t0

    print()
    print_table(reports, title=f"opsd benchmarks{' (--quick)' if args.quick else ''}")
    print(f"machine: {machine_line}")
    (out / "summary.md").write_text(summary_markdown(reports, machine_line, driver, seconds))
    (out / "summary.json").write_text(json.dumps(reports, indent=2) + "\n")
    print(f"results: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}/summary.md")
    bad = failures(reports)
    if bad:
        print(f"{len(bad)} benchmark(s) failed: " + "; ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
