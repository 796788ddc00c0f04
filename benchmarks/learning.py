"""The learning benchmark: GRPO, AgentOPSD and AlignOPSD from one start, held-out success vs step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning.py [--config configs/learning.yaml]
        [--methods grpo agentopsd alignopsd] [--steps N] [--out DIR] [--quick] [--json OUT]

Each method trains with the real pipeline (`opsd run`: Redis, rollout, teacher, embedder, trainer
processes) from the same SmolLM2 start with the same config, seeds and budget (run.steps x
env.num_games groups x rollout.group_size episodes); only `run.method` differs. The trainer keeps
every `trainer.snapshot_every`-th policy version in `<run>/snapshots/`; each is then played on the
env's held-out eval split (`opsd eval`'s code: `eval.episodes_per_task` episodes per game at
`eval.temperature`, success with a 95% bootstrap interval), and deleted unless --keep-snapshots.
Step 0 (the untrained policy, shared by all methods) is evaluated once.

Writes to DIR (default runs/learning/<timestamp>/): learning.json (every point, each run's
per-step training records: success, privileged_signal, ...), learning.png (held-out success vs
step, one line per method, bootstrap bands) and one run directory per method,
DIR/<method>/<run>/, which keeps the run's final `checkpoint/` (about 1.6 GB for SmolLM2 in fp32 with
the optimizer state: delete it when done). The JSON is rewritten after every evaluation, so a run
stopped early keeps what it measured; its "config" holds the steps actually run (--steps, --quick).
Every method's config is validated as `opsd run` validates it before anything is evaluated.
`--quick`: GRPO only, 1 step of env.num_games groups x 4 episodes (2 x 4 with configs/learning.yaml)
of at most 2 turns, held-out on 2 games x 1 episode (a smoke test of the whole path).

`--teacher` (issue 19: a teacher that knows more than its student; default config
configs/learning-teacher.yaml, methods grpo opd gc_opd alignopsd): GRPO trains first, for
`--teacher-steps` (default twice run.steps: more data), and its final policy (the snapshot of its last
version) becomes the external teacher (teacher.source: model) of every other method, which trains
run.steps from the same fresh start: opd and gc_opd without privileged context (env.privileged: none),
alignopsd with the config's privileged context. GRPO's curve is its snapshots up to run.steps; the
teacher's own held-out success is reported, and for each method the first step whose held-out
success reaches GRPO's at run.steps ("steps_to_grpo_final"). With --quick: grpo 2 steps, opd 1.

`--resume --out DIR` (same other arguments) continues a benchmark that was stopped (a killed shell, the
machine's session ending): what learning.json already holds is kept, a method that finished is skipped,
a method whose run stopped continues it with `opsd run --resume` (from its last checkpoint, every
trainer.checkpoint_every steps), and only snapshots not yet evaluated are played. learning.json's
"resumed" lists when and what.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib  # noqa: E402
import yaml  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import Row, command_line, machine, write_json  # noqa: E402

METHODS = ("grpo", "agentopsd", "alignopsd", "opd", "gc_opd")
DEFAULT_METHODS = ("grpo", "agentopsd", "alignopsd")
TEACHER_METHODS = ("grpo", "opd", "gc_opd", "alignopsd")  # --teacher: grpo first, it becomes the teacher
COLORS = {"grpo": "tab:blue", "agentopsd": "tab:orange", "alignopsd": "tab:green", "opd": "tab:red",
          "gc_opd": "tab:purple"}
STYLES = {"grpo": ("o", "-"), "agentopsd": ("s", "--"), "alignopsd": ("^", ":"), "opd": ("D", "-."),
          "gc_opd": ("v", (0, (3, 1, 1, 1)))}  # equal curves stay visible


def method_config(base: dict, method: str, steps: int | None) -> dict:
    """The shared config with run.method / run.name (and run.steps when given) replaced."""
    cfg = json.loads(json.dumps(base))
    cfg.setdefault("run", {}).update(method=method, name=f"learning-{method}")
    if steps is not None:
        cfg["run"]["steps"] = steps
    return cfg


def teacher_config(base: dict, method: str, steps: int | None, teacher_dir: Path) -> dict:
    """--teacher: `method_config`, and for every method but grpo the frozen external teacher at `teacher_dir`
    (teacher.source: model, the student's dtype, context and threads); opd and gc_opd see no privileged
    context (env.privileged: none), alignopsd the config's."""
    cfg = method_config(base, method, steps)
    if method != "grpo":
        model = cfg.get("model", {})
        cfg.setdefault("teacher", {}).update(source="model", model={
            "name": str(teacher_dir), **{k: model[k] for k in ("dtype", "max_model_len", "threads", "cache_dir") if k in model}})
        if method in ("opd", "gc_opd"):
            cfg.setdefault("env", {})["privileged"] = "none"
    return cfg


def headline(point: dict) -> float:
    """A held-out point's headline value: the env's eval metric (success rate; F1 for the evidence env). Points
    written before the metric was recorded hold success alone."""
    return point.get("value", point["success"])


def steps_to_reach(points: list[dict], target: float) -> int | None:
    """The first step of `points` (held-out points in step order) whose headline is >= `target`; None if none."""
    return next((p["step"] for p in points if headline(p) >= target), None)


def validated(cfg: dict, path: Path):
    """`cfg` written to `path` and read back as `opsd run` reads it: a RunConfig, or exit 2 after the CLI has
    printed one line per problem (its typer.Exit would otherwise end this script with a traceback)."""
    import typer

    from opsd.cli import _installed, load_config

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        return _installed(load_config(path))
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None


def run_dirs(out: Path, method: str) -> list[Path]:
    """The run directories `opsd run` made under out/<method>/, oldest first (their names carry a timestamp)."""
    runs = out / method
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []


def train(cfg: dict, out: Path, method: str, resume: Path | None = None) -> Path:
    """Run `opsd run` on `cfg` into out/<method>/ (log: out/<method>.log), or `opsd run --resume` of the
    stopped run directory `resume` (log appended); returns the run directory. RuntimeError when the run
    fails (the log's tail in the message)."""
    cfg_path = out / f"{method}.yaml"
    log_path = out / f"{method}.log"
    opsd = str(Path(sys.executable).parent / "opsd")
    if resume is None:
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = [opsd, "run", str(cfg_path), "--output-dir", str(out / method)]
    else:
        cmd = [opsd, "run", "--resume", str(resume)]
    with open(log_path, "a" if resume else "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    dirs = run_dirs(out, method)
    if rc != 0 or not dirs:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"opsd run ({method}) exited {rc}:\n{tail}")
    return dirs[-1]


def held_out(run_cfg, backend, ctx, out_dir: Path, label: str) -> dict:
    """Play the eval split with `backend`'s current weights: {"metric" (the env's headline eval metric:
    "success", "f1" for graded verifiers, "score" for WebShop, here as a fraction), "value", "lo", "hi" (its
    95% interval), "success", "episodes", "format_valid_rate", "seconds"}."""
    from services.rollout.evaluate import evaluate

    report = evaluate(run_cfg, backend, ctx, out_dir, checkpoint=label)
    overall = report["overall"]
    metric = report["metrics"][0]
    scale = 0.01 if metric == "score" else 1.0  # WebShop's Score is in percent: every curve here is in [0, 1]
    lo, hi = (x * scale for x in overall[metric]["ci95"]) if overall[metric]["ci95"] else (None, None)
    value = overall[metric]["value"]
    return {"metric": metric, "value": None if value is None else value * scale, "lo": lo, "hi": hi,
            "success": overall["success"]["value"] if "success" in overall else None, "episodes": overall["episodes"],
            "format_valid_rate": overall["format_valid_rate"], "seconds": report["seconds"]}


def plot(result: dict, path: Path) -> Path:
    """learning.png: held-out success vs step per method (95% bootstrap band), step 0 shared."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = result.get("untrained")
    for i, (method, points) in enumerate(result["curves"].items()):
        pts = ([{"step": 0, **base}] if base else []) + points
        if not pts:
            continue
        shift = 0.06 * (i - (len(result["curves"]) - 1) / 2)  # methods side by side: identical points do not hide
        xs = [p["step"] + shift for p in pts]
        marker, line = STYLES.get(method, ("o", "-"))
        ax.plot(xs, [headline(p) for p in pts], marker=marker, linestyle=line, label=method, color=COLORS.get(method))
        ax.fill_between(xs, [p["lo"] for p in pts], [p["hi"] for p in pts], alpha=0.15, color=COLORS.get(method))
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out {(base or {}).get('metric', 'success')}")
    ax.set_ylim(-0.02, 1.04)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(result.get("title", "held-out success"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def training_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl lines, reduced to what the learning report shows."""
    keys = ("step", "success_rate", "format_valid_rate", "reward_mean", "mixed_groups", "teacher_student_gap",
            "privileged_signal", "hint_match_turns", "hint_other_turns", "teacher", "teacher_guard/worse_share",
            "loss", "step_seconds")
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append({k: rec.get(k) for k in keys})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="default configs/learning.yaml (--teacher: learning-teacher.yaml)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                    help=f"default {' '.join(DEFAULT_METHODS)}; with --teacher {' '.join(TEACHER_METHODS)} (grpo first)")
    ap.add_argument("--steps", type=int, default=None, help="override run.steps (>= 1)")
    ap.add_argument("--teacher", action="store_true", help="the external-teacher experiment (module docstring)")
    ap.add_argument("--teacher-steps", type=int, default=None, help="--teacher: GRPO's steps (default 2 x run.steps)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-snapshots", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the benchmark rows here (benchmarks/run.py)")
    ap.add_argument("--resume", action="store_true", help="continue the stopped benchmark in --out (module docstring)")
    args = ap.parse_args()
    if args.resume and (args.out is None or not (args.out / "learning.json").is_file()):
        ap.error("--resume needs --out DIR of a benchmark that wrote DIR/learning.json")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1 (got {args.steps})")
    if args.teacher_steps is not None and not args.teacher:
        ap.error("--teacher-steps needs --teacher")
    if args.teacher_steps is not None and args.teacher_steps < (args.steps or 1):
        ap.error(f"--teacher-steps must be >= the students' steps ({args.steps or 1}): GRPO's curve is read up to them")
    if args.teacher and args.methods is not None and args.methods[0] != "grpo":
        ap.error(f"--methods with --teacher must start with grpo (it trains the teacher), got {' '.join(args.methods)}")
    if args.config is None:
        args.config = ROOT / "configs" / ("learning-teacher.yaml" if args.teacher else "learning.yaml")
    args.methods = args.methods or list(TEACHER_METHODS if args.teacher else DEFAULT_METHODS)
    if not args.config.is_file():
        ap.error(f"--config {args.config}: not a file (give a run config YAML, e.g. configs/learning.yaml)")
    from opsd.config import read_yaml

    try:  # as `opsd run` reads it: a repeated key (a second trainer: block) is refused, not dropped on the rewrite
        base = read_yaml(args.config)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
        ap.error(f"--config {args.config}: cannot read it as YAML: {e}")
    if not isinstance(base, dict):
        ap.error(f"--config {args.config}: the top level must be a mapping of sections (run:, model:, ...)")

    from opsd.envs import local_context
    from opsd.models import load_backend

    if args.quick:
        args.methods, args.steps = (["grpo", "opd"], 1) if args.teacher else (["grpo"], 1)
        base.setdefault("env", {}).update(eval_pool=2, max_turns=2)
        base.setdefault("rollout", {}).update(group_size=4)
        base.setdefault("eval", {}).update(episodes_per_task=1)
        base.setdefault("trainer", {}).update(snapshot_every=1)
    if args.steps is not None:  # into the shared config: learning.json and config.yaml record the steps run
        base.setdefault("run", {})["steps"] = args.steps
    steps = int(base.get("run", {}).get("steps", 3))
    teacher_steps = (args.teacher_steps or 2 * steps) if args.teacher else None
    if teacher_steps is not None and teacher_steps < steps:
        ap.error(f"--teacher-steps must be >= run.steps ({steps}): GRPO's curve is read up to run.steps")

    def config_of(method: str, teacher_dir: Path) -> dict:
        if not args.teacher:
            return method_config(base, method, args.steps)
        return teacher_config(base, method, teacher_steps if method == "grpo" else args.steps, teacher_dir)

    # Every method's config now, as `opsd run` will read it: a bad one fails in seconds, not after the eval.
    with tempfile.TemporaryDirectory(prefix="opsd-learning-") as tmp:
        for method in args.methods:
            validated(config_of(method, Path(tmp) / "teacher"), Path(tmp) / f"{method}.yaml")
    out = args.out or ROOT / "runs" / "learning" / datetime.now().strftime("%Y%m%d-%H%M%S")
    before = json.loads((out / "learning.json").read_text()) if args.resume else None
    if before is not None and (before["config"] != base or before["methods"] != args.methods
                               or before.get("teacher_steps") != teacher_steps):
        raise SystemExit(f"--resume: {out / 'learning.json'} was written with another config, methods or teacher steps")
    out.mkdir(parents=True, exist_ok=True)
    run_cfg = validated(base, out / "config.yaml")
    if run_cfg.trainer.snapshot_every < 1:
        raise SystemExit("trainer.snapshot_every must be >= 1: the curve is evaluated on the kept snapshots")
    if teacher_steps is not None and teacher_steps % run_cfg.trainer.snapshot_every:
        raise SystemExit(f"--teacher-steps {teacher_steps} must be a multiple of trainer.snapshot_every "
                         f"({run_cfg.trainer.snapshot_every}): the teacher is GRPO's last snapshot")
    command = command_line()
    result: dict = {
        "command": command, "machine": machine(), "config": base, "methods": args.methods,
        "title": (f"{run_cfg.env.name}: {run_cfg.env.eval_pool} held-out games x {run_cfg.eval.episodes_per_task} "
                  f"episodes, T={run_cfg.eval.temperature}; {run_cfg.env.num_games}x{run_cfg.rollout.group_size} "
                  f"episodes/step"),
        "untrained": None, "curves": {m: [] for m in args.methods}, "training": {}, "seconds": {},
    }
    if args.teacher:
        result.update(teacher_steps=teacher_steps, teacher=None, steps_to_grpo_final={})
    if before is not None:  # --resume: keep what was measured (the same experiment, checked above)
        result = {**result, **{k: v for k, v in before.items() if k not in ("command", "machine")}}
        result.setdefault("resumed", []).append({"at": datetime.now().isoformat(timespec="seconds"), "command": command})

    def save() -> None:
        tmp = out / ".learning.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out / "learning.json")
        plot(result, out / "learning.png")

    t_all = time.perf_counter()
    ctx = local_context(run_cfg)
    backend = load_backend(run_cfg.model)
    if result["untrained"] is None:
        result["untrained"] = held_out(run_cfg, backend, ctx, out / "eval" / "untrained", "untrained")
    print(f"untrained: held-out {result['untrained'].get('metric', 'success')} {headline(result['untrained']):.3f} "
          f"[{result['untrained']['lo']:.3f}, {result['untrained']['hi']:.3f}]", flush=True)
    save()
    teacher_dir = out / "teacher"  # --teacher: GRPO's last snapshot as an HF directory, once GRPO has run
    for method in args.methods:
        if method in result["seconds"]:  # --resume: finished and evaluated before
            continue
        t0 = time.perf_counter()
        prior = run_dirs(out, method) if args.resume else []  # --resume: a finished run, or one to continue
        done = next((d for d in reversed(prior) if (d / "DONE").exists()), None)
        # A run killed before it wrote its config cannot be continued: it starts again in a new directory.
        stopped = next((d for d in reversed(prior) if not (d / "DONE").exists() and (d / "config.yaml").is_file()), None)
        run_dir = done or train(config_of(method, teacher_dir), out, method, resume=stopped)
        result["seconds"][f"train/{method}"] = result["seconds"].get(f"train/{method}", 0.0) + time.perf_counter() - t0
        result["training"][method] = training_records(run_dir)
        snaps = sorted((int(p.stem.removeprefix("policy-v")), p)
                       for p in (run_dir / "snapshots").glob("policy-v*.safetensors"))
        scored = {p["step"] for p in result["curves"][method]}
        for version, path in snaps:
            if version == 0 or version in scored:
                continue  # the untrained policy (evaluated once above), or a point evaluated before a --resume
            backend.load_weights(path, version)
            if version > steps:  # --teacher: GRPO past run.steps trains the teacher; only its last version is scored
                if version == teacher_steps and result["teacher"] is None:
                    result["teacher"] = {"step": version, **held_out(run_cfg, backend, ctx, out / "eval" / "teacher", "teacher")}
                    backend.save_checkpoint(teacher_dir)
                    print(f"teacher (grpo step {version}): held-out {headline(result['teacher']):.3f}", flush=True)
                if not args.keep_snapshots:
                    path.unlink()
                continue
            point = {"step": version, **held_out(run_cfg, backend, ctx, out / "eval" / f"{method}-{version:03d}",
                                                 f"{method} step {version}")}
            result["curves"][method].append(point)
            print(f"{method} step {version}: held-out {point['metric']} {headline(point):.3f} "
                  f"[{point['lo']:.3f}, {point['hi']:.3f}]", flush=True)
            if not args.keep_snapshots:
                path.unlink()
            save()
        if args.teacher and method == "grpo" and result["teacher"] is None:
            raise SystemExit(f"GRPO left no snapshot of version {teacher_steps} to be the teacher ({run_dir / 'snapshots'})")
        if args.teacher and result["curves"]["grpo"]:
            target = headline(result["curves"]["grpo"][-1])
            result["steps_to_grpo_final"] = {m: steps_to_reach(result["curves"][m], target) for m in args.methods
                                             if result["curves"][m]}
        result["seconds"][method] = time.perf_counter() - t0
        save()
    result["seconds"]["total"] = time.perf_counter() - t_all
    save()
    print(f"wrote {out / 'learning.json'} and {out / 'learning.png'} in {result['seconds']['total'] / 60:.1f} min")

    if args.json:
        u = headline(result["untrained"])
        rows = [Row(f"untrained held-out {result['untrained'].get('metric', 'success')}", u, "rate", note="step 0, shared by every method")]
        for method, pts in result["curves"].items():
            if not pts:
                continue
            last = pts[-1]
            rows.append(Row(f"{method}: held-out {last.get('metric', 'success')} at step {last['step']}", headline(last), "rate",
                            note=f"95% CI [{last['lo']:.3f}, {last['hi']:.3f}]"))
            if method == "grpo":  # the proof the RL loop is right: the whole interval above the start
                rows.append(Row("grpo: lower 95% bound - untrained", last["lo"] - u, "rate", "> 0 rate",
                                note="held-out success rose measurably"))
            if args.teacher:
                reach = result["steps_to_grpo_final"].get(method)
                rows.append(Row(f"{method}: steps to GRPO's step-{steps} success", reach, "steps",
                                note="never within run.steps" if reach is None else ""))
        if args.teacher and result["teacher"] is not None:
            t = result["teacher"]
            rows.append(Row(f"teacher (grpo step {t['step']}) held-out {t.get('metric', 'success')}", headline(t), "rate",
                            note=f"95% CI [{t['lo']:.3f}, {t['hi']:.3f}]"))
        write_json(args.json, "learning", command_line(), rows)

if __name__ == "__main__":
    main()
