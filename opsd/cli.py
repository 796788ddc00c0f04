"""`opsd ...`: the command line.

`opsd run CONFIG` starts Redis (unless REDIS_URL or redis.url is set), the
embedder, rollout, teacher and trainer as separate processes, shows a
progress bar with one metrics line per step, and leaves a run directory:

    <output_dir>/<name>-<timestamp>/
      config.yaml      the resolved config        metrics.jsonl  one line a step
      metrics.png      the curves                 checkpoint/    final weights + tokenizer
      logs/            one log per service (+ redis)
      scrapes/         each service's last /metrics and /health answer
      run_summary.json wall time, which services answered
      weights/ ports/ DONE   working files of the run (policy versions, service ports)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import httpx
import pydantic
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from opsd.config import RunConfig
from opsd.service import read_port

app = typer.Typer(add_completion=False, help="opsd: RL + on-policy self-distillation for LLM agents.")
console = Console(soft_wrap=True)  # one line per step, also when piped to a file

STEP_COLUMNS = (
    ("success_rate", "success", "{:.2f}"),
    ("format_valid_rate", "valid", "{:.2f}"),
    ("reward_mean", "reward", "{:.2f}"),
    ("teacher_student_gap", "gap", "{:+.3f}"),
    ("mean_span_length", "span", "{:.1f}"),
    ("loss", "loss", "{:+.4f}"),
    ("rollout_seconds", "rollout_s", "{:.0f}"),
    ("teacher_seconds", "teacher_s", "{:.0f}"),
    ("train_seconds", "train_s", "{:.0f}"),
    ("step_seconds", "step_s", "{:.0f}"),
)


def load_config(path: Path, **run_overrides) -> RunConfig:
    """Read and validate a run config, applying `run:` overrides (e.g. steps) that are not None.

    A missing/unreadable file, bad YAML or an invalid value (typo, wrong type,
    out of range, NaN) prints one line per problem and exits with code 2,
    never a traceback.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        _config_error(path, [f"cannot read it as YAML: {e}"])
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _config_error(path, [f"the top level must be a mapping of sections (run:, model:, ...), got {type(data).__name__}"])
    overrides = {k: v for k, v in run_overrides.items() if v is not None}
    try:
        cfg = RunConfig.model_validate(data)
        if overrides:  # validated like the file's own values (e.g. --steps 0 is refused)
            cfg = RunConfig.model_validate({**cfg.model_dump(), "run": {**cfg.run.model_dump(), **overrides}})
    except pydantic.ValidationError as e:
        _config_error(path, [
            f"{'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']} (got {repr(err.get('input'))[:120]})"
            for err in e.errors()
        ])
    return cfg


def _config_error(path: Path, problems: list[str]) -> None:
    console.print(f"[red]invalid config[/red] {escape(str(path))}:", soft_wrap=True)
    for line in problems:
        console.print("  " + escape(line), soft_wrap=True)
    raise typer.Exit(2)


def complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of a file another process appends to (a half-written last line is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def format_step(record: dict) -> str:
    """One human line for a metrics.jsonl record."""
    parts = [f"step {record['step']}"]
    for key, label, fmt in STEP_COLUMNS:
        if record.get(key) is not None:
            parts.append(f"{label} {fmt.format(record[key])}")
    return "  ".join(parts)


def prepare(cfg: RunConfig) -> None:
    """Build the caches every role needs (model conversion, game files) once, before the roles start."""
    from opsd.envs.textworld import make_games
    from opsd.models.hf import ensure_model

    t0 = time.perf_counter()
    ensure_model(cfg.model)
    games = make_games(cfg.env, cfg.cache_root)
    console.print(f"[dim]model and {len(games)} games ready in {time.perf_counter() - t0:.1f}s (cache {cfg.cache_root})[/dim]")


class Services:
    """The role processes of one run: start, watch, scrape, stop."""

    def __init__(self, run_dir: Path, config_path: Path, redis_url: str):
        self.run_dir = run_dir
        self.config_path = config_path
        self.env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str) -> None:
        log = open(self.run_dir / "logs" / f"{role}.log", "ab")
        cmd = [sys.executable, "-m", f"services.{role}", "--config", str(self.config_path), "--run-dir", str(self.run_dir)]
        # Own process group: Ctrl-C reaches only the CLI, which then stops each role in order.
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def failed(self) -> tuple[str, int] | None:
        for role, p in self.procs.items():
            if p.poll() is not None:
                return role, p.returncode
        return None

    def scrape(self) -> dict[str, bool]:
        """GET every role's /metrics and /health; save the answers under scrapes/; returns which answered."""
        out = {}
        (self.run_dir / "scrapes").mkdir(exist_ok=True)
        for role in self.procs:
            info = read_port(self.run_dir, role)
            ok = False
            if info:
                host = "127.0.0.1" if info["host"] in ("0.0.0.0", "") else info["host"]
                try:
                    m = httpx.get(f"http://{host}:{info['port']}/metrics", timeout=10)
                    h = httpx.get(f"http://{host}:{info['port']}/health", timeout=10)
                    ok = m.status_code == 200 and h.status_code == 200
                    (self.run_dir / "scrapes" / f"{role}.prom").write_text(m.text)
                    (self.run_dir / "scrapes" / f"{role}.health.json").write_text(h.text)
                except httpx.HTTPError:
                    ok = False
            out[role] = ok
        return out

    def stop(self, timeout_s: float = 20.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def new_run_dir(output_dir: Path, name: str) -> Path:
    """Create `<output_dir>/<name>-<timestamp>[-N]/logs` (a suffix when two runs start in the same second)."""
    stamp = f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        run_dir = output_dir.resolve() / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run_dir.mkdir(parents=True)
        except FileExistsError:
            continue
        (run_dir / "logs").mkdir()
        return run_dir
    raise FileExistsError(f"no free run directory for {stamp} in {output_dir}")


def tail(path: Path, n: int = 30) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@app.command()
def run(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="run config (YAML)"),
    steps: Optional[int] = typer.Option(None, help="override run.steps"),
    output_dir: Optional[Path] = typer.Option(None, help="override run.output_dir"),
    dump_credit: bool = typer.Option(False, "--dump-credit", help="write each step's credit inputs to <run>/credit/ (replay: opsd credit check)"),
) -> None:
    """Train: start Redis (if needed) and the four roles, run the configured steps, write the run directory."""
    from opsd.redis_server import resolve_redis_url

    cfg = load_config(config, steps=steps, output_dir=None if output_dir is None else str(output_dir))
    if dump_credit:
        cfg.trainer.dump_credit = True
    run_dir = new_run_dir(Path(cfg.run.output_dir), cfg.run.name)
    run_id = run_dir.name
    cfg.redis.stream_prefix = cfg.redis.stream_prefix or f"opsd:{run_id}"
    resolved = run_dir / "config.yaml"
    cfg.dump(resolved)
    console.print(f"[bold]opsd run[/bold] {cfg.run.method} x {cfg.run.steps} steps -> {run_dir}")

    prepare(cfg)
    redis_url, local_redis = resolve_redis_url(cfg.redis.url, run_dir / "logs" / "redis.log")
    # Ctrl-C (SIGINT, even if a parent shell ignored it) and SIGTERM (docker/k8s stop) both stop the run cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    services = Services(run_dir, resolved, redis_url)
    roles = (["embedder"] if cfg.run.method == "alignopsd" else []) + ["rollout"] + (["teacher"] if cfg.needs_teacher else []) + ["trainer"]
    t0 = time.perf_counter()
    ok = False
    try:
        for role in roles:
            services.start(role)
        seen = 0
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                      TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("training", total=cfg.run.steps)
            while True:
                failed = services.failed()
                if failed:
                    role, rc = failed
                    raise RuntimeError(f"{role} exited with code {rc}; last lines of its log:\n{tail(run_dir / 'logs' / f'{role}.log')}")
                lines = complete_lines(run_dir / "metrics.jsonl")
                for line in lines[seen:]:
                    progress.console.print(format_step(json.loads(line)))
                    progress.advance(bar)
                    services.scrape()
                seen = len(lines)
                if (run_dir / "DONE").exists():
                    break
                time.sleep(1.0)
        answered = services.scrape()
        ok = True
        wall = time.perf_counter() - t0
        (run_dir / "run_summary.json").write_text(json.dumps({"wall_seconds": wall, "metrics_answered": answered, "roles": roles}))
        console.print(f"[green]done[/green] in {wall:.0f}s; /metrics answered: {answered}")
        console.print(f"outputs: {run_dir}/metrics.jsonl, metrics.png, checkpoint/, logs/")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping services[/yellow]")
    except RuntimeError as e:
        console.print(f"[red]run failed:[/red] {e}")
    finally:
        services.stop()
        if local_redis is not None:
            local_redis.stop()
    if not ok:
        raise typer.Exit(1)


credit_app = typer.Typer(add_completion=False, help="Credit-assignment tools.")
app.add_typer(credit_app, name="credit")


@credit_app.command("check")
def credit_check(
    paths: list[Path] = typer.Argument(..., help="vector files (JSON) or folders of them"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print every field, not only failures"),
) -> None:
    """Replay credit vector files (../shared/refvectors schema, or a run's credit/ dumps) and compare.

    Prints, per file, the max absolute error of every `expected` field, then
    `N passed, M failed`; exits 1 on any failure (a field that differs, or one
    the replay cannot compute), 2 when a path does not exist or holds no files.
    """
    from opsd.credit.replay import check_file, vector_files

    try:
        files = vector_files(paths)
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    if not files:
        console.print("[red]error:[/red] no .json vector files under the given paths")
        raise typer.Exit(2)
    passed = failed = 0
    for f in files:
        r = check_file(f)
        status = "[green]PASS[/green]" if r.ok else "[red]FAIL[/red]"
        errs = [x.max_abs_error for x in r.fields if x.max_abs_error is not None]
        worst = f"max|err| {max(errs):.2e}" if errs else "exact"
        console.print(f"{status} {escape(str(f))}  {escape(r.method)}/{escape(r.case)}  {len(r.fields)} fields, {worst}")
        if r.error:
            console.print(f"    [red]replay failed:[/red] {escape(r.error)}")
        for x in r.fields:
            if verbose or not x.ok:
                err = "exact" if x.max_abs_error is None else f"{x.max_abs_error:.2e}"
                mark = "ok " if x.ok else "BAD"
                console.print(f"    {mark} {escape(x.name)}: {err}" + (f"  {escape(x.detail)}" if x.detail else ""))
        passed += r.ok
        failed += not r.ok
    console.print(f"{passed} passed, {failed} failed")
    if failed:
        raise typer.Exit(1)


@app.command("prepare")
def prepare_cmd(config: Path = typer.Argument(..., exists=True, dir_okay=False)) -> None:
    """Convert the model and generate the games into the cache (what `run` does first)."""
    prepare(load_config(config))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
