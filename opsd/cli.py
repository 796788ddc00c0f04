"""`opsd ...`: the command line.

`opsd run CONFIG` starts Redis (unless REDIS_URL or redis.url is set), the
embedder, rollout, teacher and trainer as separate processes, shows a
progress bar with one metrics line per step, and leaves a run directory:

    <output_dir>/<name>-<timestamp>/
      config.yaml      the resolved config        metrics.jsonl  one line a step
      model.json       the models resolved (Hub id, revision, commit, local path)
      metrics.png      the curves                 checkpoint/    weights + tokenizer (resume point)
      logs/            one log per service (+ redis, supervisor)
      scrapes/         each service's last /metrics and /health answer
      run_summary.json wall time, which services answered, restarts per role
      redis/           the embedded Redis's append-only file (redis.appendonly)
      weights/ ports/ DONE   working files of the run (policy versions, service ports)

`opsd run --resume RUN_DIR [--steps N]` continues a run in its own directory:
same config (with --steps applied), same stream prefix, the embedded Redis
reloaded from RUN_DIR/redis/, and the trainer restarting from RUN_DIR/checkpoint.

A role process that dies during the run is started again (same command), at
most run.max_restarts times per role; past that the run fails with the role's
log tail. Each role gets the run's API token in OPSD_API_TOKEN (a fresh one a
run, unless OPSD_API_TOKEN is already set).

`opsd eval CONFIG --checkpoint DIR` plays the env's eval split with a
checkpoint in this process (services/rollout/evaluate.py) and writes
eval.json and eval.png. `opsd credit check` replays dumped credit inputs;
`opsd inspect RUN_DIR` shows them (and the metrics) in a local web page;
`opsd prepare` fills the caches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import reprlib
import secrets
import shutil
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import pydantic
import typer
import yaml
from rich.console import Console
from rich.markup import escape

from opsd.config import RunConfig, read_yaml
from opsd.progress import StepProgress, complete_lines, format_line, in_step_line, printable_line, progress_bar
from opsd.supervisor import Services

# Plain click help: typer's rich help prints a type for every option, so flags such as --dump-credit and --help
# read as if they took a <bool> value.
app = typer.Typer(add_completion=False, rich_markup_mode=None, help="opsd: RL + on-policy self-distillation for LLM agents.")
console = Console(soft_wrap=True)  # one line per step, also when piped to a file


def load_config(path: Path, backend: str | None = None, **run_overrides) -> RunConfig:
    """Read and validate a run config, applying `run:` overrides (e.g. steps) and `backend` (model.backend) when not None.

    A missing/unreadable file, bad YAML or an invalid value (typo, wrong type,
    out of range, NaN) prints one line per problem and exits with code 2,
    never a traceback.
    """
    try:
        data = read_yaml(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
        _config_error(path, [f"cannot read it as YAML: {e}"])
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _config_error(path, [f"the top level must be a mapping of sections (run:, model:, ...), got {type(data).__name__}"])
    overrides = {k: v for k, v in run_overrides.items() if v is not None}
    try:
        cfg = RunConfig.model_validate(data)
        if overrides or backend is not None:  # validated like the file's own values (e.g. --steps 0 is refused)
            model = {**cfg.model.model_dump(), **({"backend": backend} if backend is not None else {})}
            cfg = RunConfig.model_validate({**cfg.model_dump(), "run": {**cfg.run.model_dump(), **overrides}, "model": model})
    except pydantic.ValidationError as e:
        # A check across sections (loc empty) names its fields in its message; its input is the whole config.
        _config_error(path, [
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {_SHORT.repr(err.get('input'))[:120]})" if err["loc"]
            else err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        ])
    return cfg


_SHORT = reprlib.Repr()  # a bad value's repr, bounded (a huge value is never rendered whole)
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 80, 80


def _config_error(path: Path, problems: list[str]) -> None:
    console.print(f"[red]invalid config[/red] {escape(str(path))}:", soft_wrap=True)
    for line in problems:
        console.print("  " + escape(line), soft_wrap=True)
    raise typer.Exit(2)



def prepare(cfg: RunConfig, models: dict | None = None) -> dict:
    """Build the caches every role needs (model files, game files) once, before the roles start.

    models: the run's resolved models (`resolve_models`), resolved here when None (which pins cfg's Hub
    revisions to their commits). Returns them. Raises ValueError (ModelUnavailableError: a Hub model that
    cannot be had; a teacher of another tokenizer) or OSError (a model that is not there), each one line.
    """
    from opsd.envs import EnvContext, get_adapter
    from opsd.models.hub import resolve_run
    from opsd.models.tokenizer import check_chat_model

    t0 = time.perf_counter()
    if models is None:  # `opsd run` resolved and checked them before its run directory existed (resolve_models)
        models = resolve_run(cfg)
        check_chat_model(cfg.model, cfg.env, models["model"].path)  # tokenizer, chat template, stop ids
    for key, m in models.items():
        if m.commit is not None:
            console.print(f"[dim]{key} {escape(m.name)} revision {escape(m.revision)}: commit {m.commit} "
                          f"({escape(str(m.path))})[/dim]")
    if "teacher_model" in models:
        from opsd.models import check_teacher_model

        check_teacher_model(cfg.model, cfg.teacher_model)
    games = get_adapter(cfg.env.name).make_tasks(cfg.env, EnvContext(cache_dir=cfg.cache_root), "train")
    console.print(f"[dim]model and {len(games)} {cfg.env.name} tasks ready in {time.perf_counter() - t0:.1f}s (cache {cfg.cache_root})[/dim]")
    return models


def resolve_models(cfg: RunConfig) -> dict:
    """`opsd.models.hub.resolve_run(cfg)` (pins cfg's Hub revisions to their commits) and `check_chat_model`; a
    model that cannot be had, is no model, or whose tokenizer, chat template or stop ids opsd cannot serve, is one
    red line and exit 2, before anything starts (no run directory is left)."""
    from opsd.models.hub import resolve_run
    from opsd.models.tokenizer import check_chat_model

    try:
        models = resolve_run(cfg)
        check_chat_model(cfg.model, cfg.env, models["model"].path)
        return models
    except (ValueError, OSError) as e:
        _usage_error(str(e))


def check_disk(cfg: RunConfig, models: dict, where: Path, held: int = 0) -> None:
    """Print the run's disk peak and its terms (opsd.footprint.run_disk_peak, from the resolved policy's
    config.json) in one line; a peak above the free space at `where` (its nearest existing parent) plus `held`
    (bytes a resumed run's directory holds already) is a usage error, exit 2, before anything starts."""
    from opsd import footprint

    try:
        terms = footprint.run_disk_peak(cfg, models["model"].path)
    except (KeyError, ValueError, OSError) as e:  # an architecture transformers cannot build: no estimate
        console.print(f"disk peak: not estimated ({escape(str(e).splitlines()[0] if str(e) else repr(e))})")
        return
    free = footprint.free_bytes(where)
    console.print(f"disk peak {footprint.describe(terms)}; {free / footprint.GB:.1f} GB free at {escape(str(where))}")
    problem = footprint.disk_problem(terms["total"], free + held, where)
    if problem:
        _usage_error(problem)


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


def finished_steps(run_dir: Path) -> int | None:
    """Steps a finished run trained: the checkpoint's `step` when DONE exists, else None (not finished)."""
    if not (run_dir / "DONE").exists():
        return None
    try:
        return int(json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


JAVA_ENVS = ("twx", "scienceworld")  # TextWorld-Express and ScienceWorld: py4j over a bundled jar


def _installed(cfg: RunConfig, trackers: bool = False) -> RunConfig:
    """`cfg`, after checking that its model backend is importable here and that its env's runtime is installed
    (and, with `trackers`, the experiment trackers of run.report_to; usage error, exit 2, if not)."""
    if trackers:
        from opsd.tracking import missing_trackers

        problem = missing_trackers(cfg.run.report_to)
        if problem:
            _usage_error(problem)
    if cfg.env.name in JAVA_ENVS and shutil.which("java") is None:
        _usage_error(f"env {cfg.env.name} runs a bundled jar and needs Java 11+: `make java` (apt-get install "
                     f"default-jre-headless) or any JRE on PATH")
    if cfg.model.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        _usage_error("model.backend=vllm needs vLLM in this environment: `make install-vllm`, then "
                     "`.venv-vllm/bin/opsd run ...` (or --backend hf)")
    if cfg.needs_teacher and cfg.teacher_model.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        _usage_error("teacher.model.backend=vllm needs vLLM in this environment: `make install-vllm`, then "
                     "`.venv-vllm/bin/opsd run ...` (or teacher.model.backend hf)")
    return cfg


def _trackers(option: str | None) -> list[str] | None:
    """--report-to's value as run.report_to (validated there): "a,b" -> ["a", "b"], "none" -> [], None -> None."""
    if option is None:
        return None
    names = [n.strip() for n in option.split(",")]
    if "" in names:  # `--report-to ""` turned off the config's trackers without a word
        raise typer.BadParameter(f"{option!r}: tracker names separated by commas (wandb,tensorboard,mlflow), or none",
                                 param_hint="--report-to")
    return [] if names == ["none"] else names


def _usage_error(message: str) -> None:
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(2)


def _prepare_or_exit(cfg: RunConfig, models: dict) -> None:
    """`prepare`, or its one-line refusal and exit 2 (a model that is not there, a teacher of another tokenizer)."""
    try:
        prepare(cfg, models)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2)


@app.command()
def run(
    config: Optional[Path] = typer.Argument(None, exists=True, dir_okay=False, help="run config (YAML); or use --resume"),
    resume: Optional[Path] = typer.Option(None, "--resume", exists=True, file_okay=False,
                                          help="continue the run in this run directory (its config.yaml, Redis data, checkpoint)"),
    steps: Optional[int] = typer.Option(None, help="override run.steps"),
    output_dir: Optional[Path] = typer.Option(None, help="override run.output_dir"),
    dump_credit: bool = typer.Option(False, "--dump-credit", help="write each step's credit inputs to <run>/credit/ (replay: opsd credit check)"),
    backend: Optional[str] = typer.Option(None, help="override model.backend: hf (transformers) or vllm (`make install-vllm`)"),
    report_to: Optional[str] = typer.Option(None, "--report-to", help="override run.report_to: experiment trackers, "
                                            "comma-separated (wandb,tensorboard,mlflow; 'none' for none)"),
) -> None:
    """Train: start Redis and the four roles, run the configured steps.

    Redis starts only when neither REDIS_URL nor redis.url is set; the run directory holds the metrics, the
    checkpoint and one log per role (docs/getting-started.md: Where the outputs land).
    """
    if (config is None) == (resume is None):
        _usage_error("give exactly one of CONFIG and --resume RUN_DIR")
    _check_own_token()
    if resume is not None:
        reopened = _reopen_run(resume, steps, report_to, output_dir, backend)
        if reopened is None:  # it finished its steps already
            return
        cfg, models, run_dir, lock = reopened
    else:
        cfg = _installed(load_config(config, backend=backend, steps=steps, report_to=_trackers(report_to),
                                     output_dir=None if output_dir is None else str(output_dir)), trackers=True)
        models = resolve_models(cfg)  # before the run directory exists: a model that cannot be had leaves nothing
        check_disk(cfg, models, Path(cfg.run.output_dir))
        _prepare_or_exit(cfg, models)  # a model or chat template opsd cannot serve leaves no run directory
        run_dir = new_run_dir(Path(cfg.run.output_dir), cfg.run.name)
        lock = lock_run_dir(run_dir)
    if dump_credit:
        cfg.trainer.dump_credit = True
    _write_run_config(cfg, models, run_dir, resumed=resume is not None)
    done_before = len(complete_lines(run_dir / "metrics.jsonl"))
    verb = f"resuming after {done_before} logged steps" if resume is not None else "->"
    console.print(f"[bold]opsd run[/bold] {cfg.run.method} x {cfg.run.steps} step{'' if cfg.run.steps == 1 else 's'}, {cfg.model.backend} backend {verb} {run_dir}")

    redis_url, local_redis = _start_redis(cfg, run_dir, resumed=resume is not None)
    # Ctrl-C (SIGINT, even if a parent shell ignored it) and SIGTERM (docker/k8s stop) both stop the run cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    token = os.environ.get("OPSD_API_TOKEN") or secrets.token_urlsafe(32)
    services = Services(run_dir, run_dir / "config.yaml", redis_url, token, cfg.run.max_restarts,
                        trainer_ranks=cfg.trainer.nproc_per_node)
    roles = (["embedder"] if cfg.run.method == "alignopsd" or cfg.env.name == "search" else []) + ["rollout"] + (["teacher"] if cfg.needs_teacher else []) + ["trainer"]
    t0 = time.perf_counter()
    ok = False
    answered: dict[str, bool] = {}
    try:
        for role in roles:
            services.start(role)
        _follow_steps(services, cfg, run_dir, redis_url, done_before)
        answered = services.scrape()
        ok = True
        console.print(f"[green]done[/green] in {time.perf_counter() - t0:.0f}s; /metrics answered: {answered}")
        dumps = ", credit/ (opsd inspect, opsd credit check)" if cfg.trainer.dump_credit else ""
        console.print(f"outputs: {run_dir}/metrics.jsonl, metrics.png, checkpoint/, logs/{dumps}")
        from opsd.tracking import read_state

        trackers = read_state(run_dir)
        for name in cfg.run.report_to:  # each tracker run and how to open it (trackers.json)
            url = trackers.get(name, {}).get("url") if isinstance(trackers.get(name), dict) else None
            console.print(f"{name}: {url or 'did not start (its error: logs/trainer.log)'}", markup=False, highlight=False)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping services[/yellow]")
    except RuntimeError as e:
        console.print(f"[red]run failed:[/red] {e}")
    finally:
        services.stop()
        if local_redis is not None:
            local_redis.stop()
        (run_dir / "run_summary.json").write_text(json.dumps({
            "ok": ok, "wall_seconds": time.perf_counter() - t0, "metrics_answered": answered, "roles": roles,
            "restarts": services.restarts, "resumed": resume is not None,
        }))
        lock.close()
    if not ok:
        raise typer.Exit(1)


def _check_own_token() -> None:
    """A user's own OPSD_API_TOKEN that the roles would refuse: refused here (exit 2), before any run dir, not in every role."""
    if os.environ.get("OPSD_API_TOKEN"):
        from opsd.auth import api_token

        try:
            api_token()
        except RuntimeError as e:
            console.print(f"[red]error:[/red] {escape(str(e))}")
            raise typer.Exit(2)


def _reopen_run(resume: Path, steps: int | None, report_to: str | None, output_dir: Path | None,
                backend: str | None) -> tuple[RunConfig, dict, Path, object] | None:
    """`opsd run --resume RUN_DIR`: (its config with --steps and --report-to applied, its models, the run dir, the
    run dir's lock), its DONE and port files cleared; None (said so) when it has trained its steps already."""
    if output_dir is not None:
        _usage_error("--output-dir cannot be used with --resume: a resumed run keeps its directory")
    if backend is not None:
        _usage_error("--backend cannot be used with --resume: a resumed run keeps its config")
    run_dir = resume.resolve()
    if not (run_dir / "config.yaml").is_file():
        _usage_error(f"{run_dir} is not a run directory: it has no config.yaml")
    lock = lock_run_dir(run_dir)
    cfg = _installed(load_config(run_dir / "config.yaml", steps=steps, report_to=_trackers(report_to)), trackers=True)
    done = finished_steps(run_dir)
    if done is not None and done >= cfg.run.steps:
        console.print(f"run {run_dir} already finished: {done} steps (run.steps {cfg.run.steps}); nothing to do")
        return None
    from services.trainer.checkpoint import OPTIMIZER_DROPPED

    if done is not None and (run_dir / "checkpoint" / OPTIMIZER_DROPPED).exists():
        _usage_error(f"{run_dir} finished with trainer.keep_optimizer_state false: its optimizer state was "
                     f"dropped, so it cannot train on; start a new run with model.name: {run_dir / 'checkpoint'}")
    models = resolve_models(cfg)  # the commits config.yaml pins: the snapshot the run started with
    check_disk(cfg, models, run_dir, held=sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file()))
    _prepare_or_exit(cfg, models)
    # The old run's DONE and port files would make this run look finished, or point at dead services.
    (run_dir / "DONE").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "ports", ignore_errors=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    return cfg, models, run_dir, lock


def _write_run_config(cfg: RunConfig, models: dict, run_dir: Path, resumed: bool) -> None:
    """<run_dir>/config.yaml, the config every role reads (the stream prefix set), and the resolved models' record."""
    cfg.redis.stream_prefix = cfg.redis.stream_prefix or f"opsd:{run_dir.name}"
    tmp = run_dir / ".config.yaml.tmp"  # replaced in one step: a resumable run never has half a config
    cfg.dump(tmp)  # with each Hub model's revision pinned to its commit: every role loads the same snapshot
    tmp.replace(run_dir / "config.yaml")
    from opsd.models.hub import RUN_FILE, write_run_models

    if not resumed or not (run_dir / RUN_FILE).exists():  # a resumed run keeps the revision first asked for
        write_run_models(run_dir, models)


def _start_redis(cfg: RunConfig, run_dir: Path, resumed: bool):
    """(Redis URL, the embedded server or None): the configured Redis, or one started for the run; a Redis that
    does not start or that our client cannot use is one red line and exit 2, before any role starts."""
    from opsd.redis_server import resolve_redis_url

    redis_dir = run_dir / "redis" if cfg.redis.appendonly else None
    try:
        redis_url, local_redis = resolve_redis_url(cfg.redis.url, run_dir / "logs" / "redis.log", redis_dir, cfg.redis.appendonly)
    except (RuntimeError, FileNotFoundError) as e:
        hint = (f"\n  if its append-only file is damaged: `redis-check-aof --fix {redis_dir}/<file>.aof`, or move "
                f"{redis_dir} away to resume from the checkpoint alone" if redis_dir is not None and resumed else "")
        console.print(f"[red]error:[/red] redis-server did not start: {escape(str(e).splitlines()[-1] if str(e) else repr(e))}"
                      f"{escape(hint)}  (log: {run_dir / 'logs' / 'redis.log'})")
        raise typer.Exit(2)
    problem = check_redis(redis_url, cfg.redis.block_ms)
    if problem:  # every role would fail the same way and be restarted for nothing
        if local_redis is not None:
            local_redis.stop()
        console.print(f"[red]error:[/red] {escape(problem)}")
        raise typer.Exit(2)
    return redis_url, local_redis


def _follow_steps(services: Services, cfg: RunConfig, run_dir: Path, redis_url: str, seen: int) -> None:
    """Supervise the roles until DONE: a line per step metrics.jsonl gains (`seen` logged already), the progress
    bar, news from inside the step in progress. Raises RuntimeError for a role out of restarts."""
    inside = StepProgress(redis_url, cfg, console.is_terminal)
    with progress_bar(console, disable=not console.is_terminal) as progress:
        bar = progress.add_task("training", total=cfg.run.steps, completed=min(seen, cfg.run.steps))
        while True:
            for msg in services.supervise():
                progress.console.print(f"[yellow]{escape(msg)}[/yellow]")
            lines = complete_lines(run_dir / "metrics.jsonl")
            if len(lines) < seen:  # a resumed trainer rewrote the steps after its checkpoint
                seen = len(lines)
                progress.update(bar, completed=min(seen, cfg.run.steps))
            for line in lines[seen:]:
                progress.console.print(format_line(line))
                progress.update(bar, advance=1, description="training")
                services.scrape()
            seen = len(lines)
            if (run_dir / "DONE").exists():
                return
            # After the step lines: the step in progress is the one after them (none after the last).
            news = in_step_line(seen, cfg.run.steps, inside.poll(seen))
            if news and console.is_terminal:
                progress.update(bar, description=news)
            elif news:  # a file or a pipe has no bar (it would draw once, at the end): a plain line now and then
                progress.console.print(news)
            time.sleep(1.0)


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on `<run_dir>/.lock` for this process's life (returned: keep it open).

    Two `opsd run` on one run directory would share its Redis files and
    checkpoint and interleave its records: the second exits 2, naming the first.
    """
    import fcntl

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        console.print(f"[red]error:[/red] {escape(str(run_dir))} is in use by another `opsd run` (pid {escape(owner)})")
        raise typer.Exit(2)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def check_redis(url: str, block_ms: int) -> str | None:
    """None if Redis at `url` accepts our client and answers PING; else one line saying why."""
    import redis

    from opsd.redis_server import connect

    try:
        client = connect(url, block_ms)
        client.ping()
        client.close()
    except ValueError as e:  # a URL without a password
        return str(e)
    except redis.RedisError as e:
        return f"cannot use Redis at {url.split('@')[-1]}: {type(e).__name__}: {e}"
    return None


credit_app = typer.Typer(add_completion=False, help="Credit-assignment tools.")
app.add_typer(credit_app, name="credit")



@credit_app.command("check")
def credit_check(
    paths: list[Path] = typer.Argument(..., help="vector files (JSON) or folders of them"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print every field, not only failures"),
) -> None:
    """Replay credit vector files and compare with their expected values.

    The files are in the schema of the authors' reference vectors (refvectors/ in the project's shared
    folder: ../shared beside the repository, or $OPSD_SHARED) or of a run's credit/ dumps.
    Prints, per file, the max absolute error of every `expected` field, then
    `N passed, M failed`; exits 1 on any failure (a field that differs, or one
    the replay cannot compute), 2 when a path does not exist or holds no files.
    """
    from opsd.credit.replay import check_file, vector_files

    try:
        files = vector_files(paths)
    except FileNotFoundError as exc:
        # The reference vectors are not in a clone: say where they live instead of only "not found".
        console.print(f"[red]error:[/red] {printable_line(str(exc), 4096)} (the reference vectors are refvectors/ in the project's "
                      "shared folder: ../shared beside the repository, or $OPSD_SHARED; a run's own dumps are "
                      "RUN_DIR/credit/, written by opsd run --dump-credit)")
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
        console.print(f"{status} {printable_line(str(f), 4096)}  {printable_line(r.method)}/{printable_line(r.case)}  {len(r.fields)} field{'' if len(r.fields) == 1 else 's'}, {worst}")
        if r.error:
            console.print(f"    [red]replay failed:[/red] {printable_line(r.error)}")
        for x in r.fields:
            if verbose or not x.ok:
                err = "exact" if x.max_abs_error is None else f"{x.max_abs_error:.2e}"
                mark = "ok " if x.ok else "BAD"
                console.print(f"    {mark} {printable_line(x.name)}: {err}" + (f"  {printable_line(x.detail)}" if x.detail else ""))
        passed += r.ok
        failed += not r.ok
    console.print(f"{passed} passed, {failed} failed")
    if failed:
        raise typer.Exit(1)


@app.command("inspect")
def inspect_cmd(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="a run directory (runs/<name>-<timestamp>/)"),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="port on 127.0.0.1 (0: a free one)"),
    max_dump_mib: int = typer.Option(256, "--max-dump-mib", min=1, max=1 << 20,
                                     help="largest credit dump opened, MiB (a parse holds ~9x that in memory)"),
) -> None:
    """See where the credit went: a local web page over a run directory.

    The page shows RUN_DIR's metrics and credit dumps.

    Serves on 127.0.0.1 only, behind a fresh token of its own (never the run's
    OPSD_API_TOKEN), and prints the URL to open (it carries the token once; the
    page then keeps it in a cookie). Steps have dumps when the run was started
    with --dump-credit. Stops on Ctrl-C.
    """
    from opsd.inspect import serve

    if not (run_dir / "credit").is_dir() and not (run_dir / "metrics.jsonl").is_file():
        console.print(f"[yellow]warning:[/yellow] {escape(str(run_dir))} has no credit/ dumps and no metrics.jsonl "
                      "(was it run with --dump-credit?)")
    try:
        serve(run_dir, port, on_ready=lambda url: print(f"opsd inspect: open {url}", flush=True), max_dump_mib=max_dump_mib)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot listen on 127.0.0.1:{port}: {escape(str(exc))}")
        raise typer.Exit(2)
    except KeyboardInterrupt:
        pass


@app.command("prepare")
def prepare_cmd(
    config: Path = typer.Argument(..., exists=True, dir_okay=False,
                                  help="run config (YAML): the model and the env whose caches to fill"),
) -> None:
    """Fill the caches (model files, games) without training.

    Converts a packaged model or downloads a Hub model (model.name org/name, at model.revision) into its cache,
    and generates the games, as `opsd run` does first. A model that cannot be had, or whose tokenizer, chat
    template or stop ids opsd cannot serve, is one line, exit 2.
    """
    cfg = load_config(config)
    try:
        prepare(cfg)
    except (ValueError, OSError) as e:  # a model that cannot be had or is not there, a teacher of another tokenizer
        _usage_error(str(e))


@app.command("eval")
def eval_cmd(
    config: Optional[Path] = typer.Argument(None, exists=True, dir_okay=False,
                                            help="run config (YAML): env, eval section, model; default: the "
                                                 "config.yaml of the run --checkpoint belongs to"),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="a run directory, an HF model directory (a run's "
                                    "checkpoint/ or final_model/) or a published weights file (.safetensors)"),
    backend: Optional[str] = typer.Option(None, help="override model.backend: hf or vllm"),
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: <run dir>/eval/<timestamp>/)"),
    episodes: Optional[int] = typer.Option(None, "--episodes", min=1, max=64, help="override eval.episodes_per_task"),
    max_tasks: Optional[int] = typer.Option(None, "--max-tasks", min=1, help="play only the first N eval tasks"),
) -> None:
    """Validate a policy on the env's eval split (eval.json, eval.png).

    Plays the eval split at eval.temperature and reports the metric per category with 95% bootstrap intervals.
    """
    from opsd.envs import local_context
    from services.rollout.evaluate import resolve_checkpoint

    try:
        src = resolve_checkpoint(checkpoint)
    except ValueError as e:
        _usage_error(str(e))
    cfg = _eval_config(config, src, checkpoint, backend, episodes)
    out_dir = _eval_out_dir(out, src, cfg)
    console.print(f"[bold]opsd eval[/bold] {escape(str(src.path))} ({src.kind}) on {cfg.env.name}, "
                  f"T={cfg.eval.temperature}, {cfg.eval.episodes_per_task} episode(s) per task -> {escape(str(out_dir))}")
    t0 = time.perf_counter()
    model = _load_policy(cfg, src)
    console.print(f"[dim]policy loaded in {time.perf_counter() - t0:.1f}s[/dim]")

    from services.rollout.evaluate import evaluate

    try:
        report = evaluate(cfg, model, local_context(cfg), out_dir, checkpoint=str(src.path), max_tasks=max_tasks,
                          on_task=_print_eval_task)
    except (OSError, ValueError, RuntimeError) as e:  # no eval task could be built (a missing data file, a dead server)
        console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1)
    console.print(_eval_table(cfg, report))
    console.print(f"wrote {escape(report['paths']['json'])} and {escape(report['paths']['png'])} "
                  f"in {time.perf_counter() - t0:.0f}s")
    if src.run_dir is not None and cfg.run.report_to:
        _eval_to_trackers(cfg, src.run_dir, report)
    if report["errors"]:
        console.print(f"[yellow]{report['errors']} of {len(report['tasks'])} task(s) failed; their errors are in eval.json[/yellow]")
    if report["tasks"] and report["errors"] == len(report["tasks"]):
        raise typer.Exit(1)


def _eval_config(config: Path | None, src, checkpoint: Path, backend: str | None, episodes: int | None) -> RunConfig:
    """The eval's config: CONFIG, or the config.yaml of the run `src` (the resolved --checkpoint) belongs to, with
    --backend and --episodes applied and a local model directory as the model; usage error (exit 2) if invalid."""
    if config is None:  # a run's own config says which env and eval split it was trained for
        if src.run_dir is None or not (src.run_dir / "config.yaml").is_file():
            _usage_error(f"--checkpoint {checkpoint} is not inside a run directory with a config.yaml: give CONFIG")
        config = src.run_dir / "config.yaml"
    cfg = _installed(load_config(config, backend=backend))
    if episodes is not None:  # validated as the file's own value (the wire's bound on a group's turns)
        try:
            cfg = RunConfig.model_validate({**cfg.model_dump(), "eval": {**cfg.eval.model_dump(), "episodes_per_task": episodes}})
        except pydantic.ValidationError as e:
            _usage_error(f"--episodes {episodes}: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    if src.model_dir is not None:
        # A local directory has no Hub revision: the run's pinned one named the base model's snapshot.
        cfg.model = cfg.model.model_copy(update={"name": str(src.model_dir), "revision": None})
    return cfg


def _eval_out_dir(out: Path | None, src, cfg: RunConfig) -> Path:
    """--out, or a fresh <run dir>/eval/<timestamp>/ (<output_dir>/<name>-eval-<timestamp> outside a run)."""
    if out is not None:
        return out
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = src.run_dir / "eval" / stamp if src.run_dir is not None else Path(cfg.run.output_dir) / f"{cfg.run.name}-eval-{stamp}"
    base, n = out_dir, 2
    while out_dir.exists():  # two evals in the same second
        out_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out_dir


def _load_policy(cfg: RunConfig, src):
    """The policy to evaluate: cfg.model with the resolved checkpoint's weights and version; exit 1 if it does not load."""
    from opsd.models import load_backend

    try:
        model = load_backend(cfg.model)
        if src.weights_file is not None:
            model.load_weights(src.weights_file, src.policy_version or 0)
        elif src.policy_version is not None:
            model.policy_version = src.policy_version
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        console.print(f"[red]error:[/red] cannot load the policy from {escape(str(src.path))}: {escape(str(e))}")
        raise typer.Exit(1)
    return model


def _print_eval_task(result: dict) -> None:
    """One line per eval task played (evaluate's on_task)."""
    if result["error"]:
        console.print(f"  [red]{escape(result['task_id'])}: {escape(result['error'])}[/red]")
    else:
        wins = sum(e["won"] for e in result["episodes"])
        # Tasks are played together (eval.parallel_tasks a call): the time is the batch's, shared between them.
        share = "" if result["alone"] else " (its share of a batch played together)"
        console.print("  " + escape(f"{result['task_id']} [{result['category']}]: {wins}/{len(result['episodes'])} won, "
                                    f"{result['seconds']:.1f}s{share}"))


def _eval_table(cfg: RunConfig, report: dict):
    """The eval report as a table: a row per category and overall, each metric with its 95% interval."""
    from rich.table import Table

    from services.rollout.evaluate import SHORT

    table = Table(title=f"{cfg.env.name} eval, policy v{report['policy_version']}")
    table.add_column("category", no_wrap=True)
    table.add_column("n", justify="right")
    for m in report["metrics"]:
        table.add_column(SHORT[m], justify="right")
        table.add_column("95% CI", justify="right", no_wrap=True)
    table.add_column("turns", justify="right")
    table.add_column("valid", justify="right")
    table.add_column("failed", justify="right")
    pct = report["metric"] == "score"
    for name, row in [*report["categories"].items(), ("overall", report["overall"])]:
        cells = []
        for m in report["metrics"]:
            v = row[m]
            if v["value"] is None:
                cells += ["-", "-"]
            else:
                f = "{:.1f}" if pct else "{:.3f}"
                cells += [f.format(v["value"]), escape(f"[{f.format(v['ci95'][0])}, {f.format(v['ci95'][1])}]")]
        table.add_row(escape(name), str(row["episodes"]), *cells,
                      "-" if row["mean_turns"] is None else f"{row['mean_turns']:.2f}",
                      "-" if row["format_valid_rate"] is None else f"{row['format_valid_rate']:.2f}", str(row["errors"]),
                      style="bold" if name == "overall" else None)
    return table


def _eval_to_trackers(cfg: RunConfig, run_dir: Path, report: dict) -> None:
    """Send an eval of a run's policy to the run's trackers (run.report_to), unless its trainer still runs (one
    writer per tracker run); a tracker not installed here or failing is named, never an error."""
    import fcntl

    from opsd.tracking import missing_trackers, report_eval

    with open(run_dir / ".trainer.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            console.print("[yellow]the run's trainer is running: the eval is not sent to its trackers (eval.json has it)[/yellow]")
            return
        missing = missing_trackers(cfg.run.report_to)
        if missing:
            console.print(f"[yellow]{escape(missing)}[/yellow]")
        sent = report_eval(cfg, run_dir, report)
    console.print(f"sent to the run's trackers: {', '.join(sent) or 'none (see the log)'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
