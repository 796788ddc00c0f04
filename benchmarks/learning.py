"""The learning benchmark: RL credit methods (GRPO, AgentOPSD, AlignOPSD; OPD, GC-OPD with --teacher) from one
start, held-out success vs step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning.py [--config configs/learning.yaml]
        [--methods grpo agentopsd alignopsd] [--seeds S [S ...]] [--steps N] [--out DIR] [--results DIR]
        [--init MODEL_DIR] [--teacher [--teacher-steps N] [--compute-matched]] [--keep-snapshots]
        [--drop-checkpoints] [--quick] [--json OUT] [--resume] [--table]

Each method trains with the real pipeline (`opsd run`: Redis, rollout, teacher, embedder, trainer
processes) from the same SmolLM2 start with the same config, seeds and budget (run.steps x
env.num_games groups x rollout.group_size episodes); only `run.method` differs. The trainer keeps
every `trainer.snapshot_every`-th policy version in `<run>/snapshots/`; each is then played on the
env's held-out eval split (`opsd eval`'s code: `eval.episodes_per_task` episodes per game at
`eval.temperature`, success with a 95% bootstrap interval), and deleted unless --keep-snapshots.
Step 0 (the untrained policy, shared by all methods) is evaluated once.

Training seeds (issue 41): `--seeds S [S ...]` (default the config's run.seed alone) trains every method once
per seed with run.seed = S (the rollout's sampling, the training games drawn each step, the trainer's init);
the held-out games and eval.seed are the same for every method and seed, so a method and GRPO are compared
game by game (benchmarks/stats.py: per-step mean and spread over seeds, the paired per-(seed, game) difference
with a two-way bootstrap over seeds and games). Seeds run one after another, every method of a seed
before the next seed.

Writes to DIR (default runs/learning/<timestamp>/): learning.json (every point, per seed; per-step seed
summaries, paired comparisons with GRPO and compute columns), learning.png (held-out success vs step, one line
per method: with one seed its bootstrap band, with several the mean over seeds and a min-max band) and one run
directory per method and seed, DIR/<method>/seed<S>/<run>/, which keeps the run's final `checkpoint/` (about
1.6 GB for SmolLM2 in fp32 with the optimizer state: delete it when done, or pass --drop-checkpoints to delete
it as soon as the (method, seed)'s results file is complete: a seeded experiment's 12 runs would hold 19 GB). The JSON is rewritten after every
evaluation, so a run stopped early keeps what it measured; its "config" holds the steps actually run.
Every method's config is validated as `opsd run` validates it before anything is evaluated.

Raw results (`--results RDIR`, default benchmarks/results/<experiment>/, <experiment> the config's name plus
-teacher / -quick): one small JSON per (method, seed), RDIR/<method>-seed<S>.json, and RDIR/untrained.json,
meant to be committed; their fields and the checks made on reading them: `benchmarks/learning_results.py`.
Every number of the report is recomputed from these files alone: `--table` prints BENCHMARKS.md's Markdown
tables from RDIR without running anything (with --methods / --seeds: their rows, GRPO's and step 0's). A results file of a (method, seed) about to run is never
overwritten without --resume.

`--quick`: GRPO only, 1 step of env.num_games groups x 4 episodes (2 x 4 with configs/learning.yaml)
of at most 2 turns, held-out on 2 games x 1 episode (a smoke test of the whole path).

`--teacher` (issue 19: a teacher that knows more than its student; default config
configs/learning-teacher.yaml, methods grpo opd gc_opd alignopsd): GRPO trains first, for
`--teacher-steps` (default twice run.steps: more data), and its policy at teacher_steps (the snapshot of
that version) becomes the external teacher (teacher.source: model) of every other method of the same
seed, which trains run.steps from the same fresh start: opd and gc_opd without privileged context
(env.privileged: none), alignopsd with the config's privileged context. GRPO's curve is its snapshots up to
run.steps; the teacher's own held-out success is reported, and for each method the first step whose held-out
success reaches GRPO's at run.steps ("steps_to_grpo_final"). `--compute-matched`: GRPO trains on to
teacher_steps + run.steps and is evaluated there too, the episodes a student and its teacher used together;
each student's final point is paired with it (the table's compute-matched column). With --quick: grpo 2 steps, opd 1.

`--init MODEL_DIR` (issue 41: every method from one mid-competence checkpoint): every method of every seed starts
from the HF model directory MODEL_DIR (model.name = its absolute path) instead of the config's model, and step 0 is
that policy's held-out point, RDIR/start.json (method "start"). The results files identify the start by the sha256
of its *.safetensors and tokenizer files (header "init"), not by its path, so a fresh checkout continues them from a copy.
configs/learning-mid.yaml is the experiment this is for (BENCHMARKS.md says how its start was made).

`--resume --out DIR` (same other arguments) continues a benchmark that was stopped (a killed shell, the
machine's session ending): a (method, seed) whose results file says complete is skipped even when DIR's
run directory is gone (a later session in a fresh checkout), a run that finished is evaluated, a run that
stopped continues with `opsd run --resume` (from its last checkpoint, every trainer.checkpoint_every steps),
and only snapshots not yet evaluated are played. --methods may differ between sittings (a method added or left
out); the config and teacher steps may not. learning.json's "resumed" lists when and what.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
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
from benchmarks import stats  # noqa: E402
from benchmarks.common import Row, command_line, machine, write_json  # noqa: E402
from benchmarks.learning_results import (METHODS, config_hash, new_record, read_results, results_path,  # noqa: E402
                                         write_results)

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
    return point["value"] if "value" in point else point["success"]


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


def run_root(out: Path, method: str, seed: int) -> Path:
    """Where `opsd run` makes (method, seed)'s run directories: out/<method>/seed<S>/."""
    return out / method / f"seed{seed}"


def run_dirs(root: Path) -> list[Path]:
    """The run directories `opsd run` made under `root` (`run_root`), oldest first (their names carry a timestamp)."""
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def train(cfg: dict, out: Path, method: str, seed: int, resume: Path | None = None) -> Path:
    """Run `opsd run` on `cfg` into out/<method>/seed<S>/ (log: out/<method>-seed<S>.log), or `opsd run --resume`
    of the stopped run directory `resume` (log appended); returns the run directory. RuntimeError when the run
    fails (the log's tail in the message)."""
    cfg_path = out / f"{method}-seed{seed}.yaml"
    log_path = out / f"{method}-seed{seed}.log"
    opsd = str(Path(sys.executable).parent / "opsd")
    if resume is None:
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = [opsd, "run", str(cfg_path), "--output-dir", str(run_root(out, method, seed))]
    else:
        cmd = [opsd, "run", "--resume", str(resume)]
    with open(log_path, "a" if resume else "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    dirs = run_dirs(run_root(out, method, seed))
    if rc != 0 or not dirs:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"opsd run ({method}, seed {seed}) exited {rc}:\n{tail}")
    return dirs[-1]


def episode_rows(report: dict) -> tuple[list[dict], list[dict]]:
    """An `evaluate` report's per-episode rows [{task_id, category, episode (index within the game), reward,
    won, turns}] and its failed tasks [{task_id, error}]: what a results file keeps of an evaluation."""
    rows, errors = [], []
    for task in report["tasks"]:
        if task["error"] is not None:
            errors.append({"task_id": task["task_id"], "error": task["error"]})
        rows += [{"task_id": task["task_id"], "category": task["category"], "episode": i, "reward": e["reward"],
                  "won": e["won"], "turns": e["turns"]} for i, e in enumerate(task["episodes"])]
    return rows, errors


def held_out(run_cfg, backend, ctx, out_dir: Path, label: str) -> tuple[dict, dict]:
    """Play the eval split with `backend`'s current weights. Returns (point, raw): point {"metric" (the env's
    headline eval metric: "success", "f1" for graded verifiers, "score" for WebShop, here as a fraction),
    "value", "lo", "hi" (its 95% interval), "success", "episodes", "format_valid_rate", "seconds"}; raw, what a
    results file keeps: {"value", "lo", "hi", "n" (episodes), "episodes" (`episode_rows`), "errors"}."""
    from services.rollout.evaluate import evaluate

    report = evaluate(run_cfg, backend, ctx, out_dir, checkpoint=label)
    overall = report["overall"]
    metric = report["metrics"][0]
    scale = 0.01 if metric == "score" else 1.0  # WebShop's Score is in percent: every curve here is in [0, 1]
    lo, hi = (x * scale for x in overall[metric]["ci95"]) if overall[metric]["ci95"] else (None, None)
    value = overall[metric]["value"]
    point = {"metric": metric, "value": None if value is None else value * scale, "lo": lo, "hi": hi,
             "success": overall["success"]["value"] if "success" in overall else None, "episodes": overall["episodes"],
             "format_valid_rate": overall["format_valid_rate"], "seconds": report["seconds"]}
    rows, errors = episode_rows(report)
    return point, {"value": point["value"], "lo": lo, "hi": hi, "n": len(rows), "episodes": rows, "errors": errors}


def plot(result: dict, path: Path) -> Path:
    """learning.png: held-out success vs step per method (95% bootstrap band), step 0 shared."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = result.get("untrained")
    base = base if base and headline(base) is not None else None  # a step 0 whose tasks all failed: no point
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


# Per-step credit metrics that say whether a method's advantages differed from GRPO's (opsd/credit/*: their
# docstrings): AlignOPSD's turn weights (1 everywhere = GRPO's advantage unchanged), AgentOPSD's multiplier,
# GC-OPD's identifiable groups and sign flips, and the invalid turns the z-scored penalty gives advantages.
CREDIT_DIAGNOSTICS = ("advantage_abs_mean", "grpo/invalid_turns", "alignopsd/turn_weight_min",
                      "alignopsd/turn_weight_max", "alignopsd/mean_span_turns", "alignopsd/projection_active_trajectories",
                      "agentopsd/multiplier_mean", "gc_opd/group_identifiable_ratio", "gc_opd/final_sign_flip_ratio",
                      "gc_opd/residual_abs_mean")


def training_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl lines, reduced to what the learning report shows, one per step (a step written
    twice, redone after a restart, counts once: its last record, the one the run kept)."""
    keys = ("step", "policy_version", "success_rate", "format_valid_rate", "reward_mean", "mixed_groups",
            "teacher_student_gap", "privileged_signal", "hint_match_turns", "hint_other_turns", "teacher",
            "teacher_guard/worse_share", "loss", "step_seconds",
            # compute counted (benchmarks/stats.py training_compute)
            "episodes", "turns", "generated_tokens", "sequence_tokens", "teacher_forward_tokens", "loss_tokens",
            # whether a method's credit differed from GRPO's (`training_table`)
            *CREDIT_DIAGNOSTICS)
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append({k: rec.get(k) for k in keys})
    last = {r["step"]: i for i, r in enumerate(out)}
    return [r for i, r in enumerate(out) if last[r["step"]] == i]


# ---------------------------------------------------------------------------
# Results files: one small JSON per (method, seed), the source of every reported number (issue 41)

RESULTS = ROOT / "benchmarks" / "results"


def experiment_name(config: Path, teacher: bool, quick: bool) -> str:
    """The default results folder's name: the config file's name, plus -teacher (unless it says so already)
    with --teacher and -quick with --quick (a smoke run never mixes with the real experiment's files)."""
    name = config.stem + ("-teacher" if teacher and "teacher" not in config.stem else "")
    return name + ("-quick" if quick else "")


# What makes a start policy behave as it does, besides its weights: how its text becomes ids and back. (config.json
# is left out: transformers writes the directory it was loaded from into it; the weights fix the architecture.)
POLICY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "chat_template.jinja", "generation_config.json")


@functools.lru_cache(maxsize=4)
def weights_sha256(model_dir: Path) -> str:
    """sha256 (hex) over the *.safetensors files of an HF model directory and its tokenizer and chat-template files
    (`POLICY_FILES`), by name: the identity of an --init start that does not depend on where it lies.
    SystemExit when there are no weights."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise SystemExit(f"--init {model_dir}: no *.safetensors files (give an HF model directory, such as a "
                         "--teacher experiment's out/teacher-seed<S>/)")
    files = weights + [model_dir / n for n in POLICY_FILES if (model_dir / n).is_file()]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# The report: everything from results records alone (learning.json's summaries and `--table`)


def by_method(recs: list[dict]) -> dict[str, dict[int, dict]]:
    """{method: {seed: record}} of the trained runs (the untrained record left out), methods in METHODS' order
    (grpo first), seeds sorted."""
    def order(r: dict) -> tuple:
        return (METHODS.index(r["method"]) if r["method"] in METHODS else len(METHODS), r["method"], r["seed"])

    out: dict[str, dict[int, dict]] = {}
    for rec in sorted((r for r in recs if r["seed"] is not None), key=order):
        out.setdefault(rec["method"], {})[rec["seed"]] = rec
    return out


def at_step(runs: dict[int, dict], step: int, key: str = "episodes") -> dict:
    """{seed: its evaluation at `step`'s `key`} over the seeds of `runs` ({seed: record}) evaluated there."""
    return {seed: rec["steps"][str(step)][key] for seed, rec in runs.items() if str(step) in rec["steps"]}


def seed_values(runs: dict[int, dict], step: int, metric: str) -> dict[int, float]:
    """{seed: held-out value at `step`} as the paired comparison counts it: the mean over games of each game's
    mean episode value (`stats.game_values`); a seed whose evaluation played no episode (every task failed) is
    left out."""
    out = {}
    for seed, rows in at_step(runs, step).items():
        games = stats.game_values(rows, metric)
        if games:
            out[seed] = sum(games.values()) / len(games)
    return out


def compute_at(runs: dict[int, dict], grpo: dict[int, dict], step: int) -> dict:
    """The mean over the seeds evaluated at `step` (those the row's summary has) of a method's training compute
    up to `step` ("own", `stats.training_compute`) and with its external teacher's training ("with_teacher": plus the
    GRPO run its record's "teacher" names, up to that step: seed S's up to teacher_steps for a student of seed S;
    a method without one: its own; None when a student's teacher record is missing, rather than a count without
    it). Counts are means over seeds (floats)."""
    own, total = [], []
    for seed, rec in runs.items():
        if str(step) not in rec["steps"]:
            continue
        mine = stats.training_compute(rec["training"], rec["ppo_epochs"], step)
        own.append(mine)
        teacher = rec.get("teacher")
        if teacher:
            t = grpo.get(teacher["seed"])
            mine = (stats.add_compute(mine, stats.training_compute(t["training"], rec["ppo_epochs"], teacher["step"]))
                    if t else None)
        total.append(mine)
    mean = lambda ds: {k: sum(d[k] for d in ds) / len(ds) for k in ds[0]}  # noqa: E731
    return {"own": mean(own), "with_teacher": None if None in total else mean(total)}


def aggregate(recs: list[dict]) -> dict:
    """The report of an experiment's results records: {"metric", "run_steps", "teacher_steps", "compute_matched",
    "seeds", "games" (held-out games), "untrained" (the step-0 point), "init" (--init's identity or None), "methods": {method: {step: {"summary":
    `stats.seed_summary`, "paired": `stats.paired_comparison` with GRPO at the same step (None for grpo),
    "compute": `compute_at`, "ci95": {seed: its eval's bootstrap [lo, hi]}}}}, "compute_matched_paired": {method: its
    final step against GRPO at teacher_steps + run_steps}, "vs_start": {method: its run_steps point paired with the
    step-0 record's evaluation, used as every seed's base}, "wall_seconds": {"train", "eval"} summed over the records,
    "runs": (method, seed) records, "incomplete": ["<method> seed <S>", or "<method> (step 0)", of the records not complete yet]}. Steps are
    ints; GRPO's past run_steps are its teacher and compute-matched points.
    SystemExit when the records come from different experiments (config hashes)."""
    hashes: dict[str, list[str]] = {}
    for r in recs:
        hashes.setdefault(r["config_hash"], []).append(results_path(Path(), r["method"], r["seed"]).name)
    if len(hashes) > 1:
        which = "; ".join(f"{h}: {', '.join(names)}" for h, names in sorted(hashes.items()))
        raise SystemExit(f"the results mix experiments (config hashes {which}): one folder per experiment")
    ref = recs[0]
    metric = next((r.get("metric") for r in recs if r.get("metric")), "success")
    runs, untrained = by_method(recs), next((r for r in recs if r["seed"] is None), None)
    grpo = runs.get("grpo", {})
    methods = {}
    for method, mruns in runs.items():
        rows = {}
        for step in sorted({int(k) for rec in mruns.values() for k in rec["steps"]}):
            paired = None if method == "grpo" else stats.paired_comparison(at_step(mruns, step), at_step(grpo, step), metric)
            lo, hi = at_step(mruns, step, "lo"), at_step(mruns, step, "hi")
            values = seed_values(mruns, step, metric)
            if not values:  # every evaluation at this step failed: no point, its errors are in the records
                continue
            rows[step] = {"summary": stats.seed_summary(values), "paired": paired,
                          "compute": compute_at(mruns, grpo, step), "ci95": {s: [lo[s], hi[s]] for s in lo if s in values}}
        methods[method] = rows
    matched = {}
    if ref.get("compute_matched"):
        far = ref["teacher_steps"] + ref["run_steps"]
        matched = {m: stats.paired_comparison(at_step(r, ref["run_steps"]), at_step(grpo, far), metric)
                   for m, r in runs.items() if m != "grpo" and ref["run_steps"] in methods.get(m, {})}
    vs_start = {}
    if untrained and "0" in untrained["steps"]:  # step 0 is one evaluation: every seed's base
        base = untrained["steps"]["0"]["episodes"]
        vs_start = {m: stats.paired_comparison(mine, {s: base for s in mine}, metric)
                    for m, r in runs.items() if (mine := at_step(r, ref["run_steps"]))}
    games = {e["task_id"] for r in recs for ev in r["steps"].values() for e in ev["episodes"]}
    return {"metric": metric, "run_steps": ref["run_steps"], "teacher_steps": ref.get("teacher_steps"),
            "compute_matched": bool(ref.get("compute_matched")), "config_hash": ref["config_hash"],
            "seeds": sorted({r["seed"] for r in recs if r["seed"] is not None}), "games": len(games),
            "untrained": untrained["steps"].get("0") if untrained else None, "init": ref.get("init"),
            "methods": methods,
            "compute_matched_paired": matched, "vs_start": vs_start,
            "wall_seconds": {k: sum(r["seconds"][k] for r in recs) for k in ("train", "eval")},
            "runs": sum(r["seed"] is not None for r in recs),
            "incomplete": [f"{r['method']} seed {r['seed']}" if r["seed"] is not None else f"{r['method']} (step 0)"
                           for r in recs if not r["complete"]]}


def _num(x: float | None) -> str:
    """A value for a table cell or a progress line: "0.250", or "n/a" for an evaluation whose tasks all failed."""
    return "n/a" if x is None else f"{x:.3f}"


def _count(n: float) -> str:
    """A count for a table cell: 1234 -> "1234", 123456 -> "123k", 12345678 -> "12.3M"."""
    return f"{n:.0f}" if n < 1e4 else f"{n / 1e3:.0f}k" if n < 1e7 else f"{n / 1e6:.1f}M"


def _duration(seconds: float) -> str:
    """A wall time for the report: "1.4 h" from an hour on, else "23 min"."""
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _interval(p: dict | None) -> str:
    """A paired comparison's cell: "+0.125 [+0.031, +0.219]" (signed: method - GRPO), "" without one."""
    return "" if p is None else f"{p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] ({p['seeds']}x{p['games']})"


def _label(agg: dict, method: str, step: int) -> str:
    """A table row's method: GRPO past run.steps is the teacher's policy or the compute-matched point."""
    if method == "grpo" and step > agg["run_steps"]:
        return "grpo (teacher)" if step == agg["teacher_steps"] else "grpo (compute-matched)"
    return method


def markdown_tables(agg: dict) -> str:
    """BENCHMARKS.md's seeded, paired, compute-counted tables of `aggregate`'s report (Markdown text)."""
    m, matched = agg["metric"], agg["compute_matched"]
    far = (agg["teacher_steps"] or 0) + agg["run_steps"]
    lines = [f"Held-out {m} over training seeds {agg['seeds']} ({agg['games']} held-out games, the same for every "
             f"method and seed; config {agg['config_hash']}). Spread: [min, max] and sample std over seeds. "
             "Paired: method - GRPO at the same step, per (seed, game), mean and 95% two-way bootstrap "
             "interval (seeds and games drawn, the same games for every drawn seed; seeds x games). Compute: mean per "
             "seed, in forward-token equivalents = rollout (every trajectory token) + teacher (every token it ran) + "
             "3 x trainer (trajectory tokens x PPO epochs, forward and backward), k = thousand, M = million tokens; FLOPs = "
             "about 2 x parameters x that. A step evaluated on one seed shows that evaluation's 95% bootstrap interval over "
             "its games in place of [min, max]."
             + (" Every method started from the --init policy; its own training is not counted." if agg.get("init") else "")
             + (f" Compute-matched: a student's step {agg['run_steps']} paired, per (seed, game), with GRPO continued to "
                f"step {far}, the episodes of student and teacher together." if matched else ""), "",
             f"| method | step | seeds | held-out {m}: mean [min, max] | std | paired vs GRPO | episodes | "
             "forward tokens (rollout + teacher + 3 x trainer) | with teacher's training: episodes, forward tokens |"
             + (f" compute-matched: paired vs GRPO step {far} |" if matched else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if matched else "")]
    if agg["untrained"]:
        u = agg["untrained"]
        name = f"start (--init sha256 {agg['init']['sha256'][:12]})" if agg.get("init") else "untrained"
        lines.append(f"| {name} | 0 | | {_num(u['value'])} (95% CI [{_num(u['lo'])}, {_num(u['hi'])}]) | | | 0 | 0 | |"
                     + (" |" if matched else ""))
    for method, rows in agg["methods"].items():
        for step, row in rows.items():
            s, own, full = row["summary"], row["compute"]["own"], row["compute"]["with_teacher"]
            std = "" if s["std"] is None else f"{s['std']:.3f}"
            passes = (f"{_count(own['forward_tokens'])} ({_count(own['rollout_tokens'])} + "
                      f"{_count(own['teacher_tokens'])} + 3 x {_count(own['trainer_tokens'])})")
            teacher = ("its teacher's GRPO record is missing" if full is None else "" if full == own
                       else f"{_count(full['episodes'])}, {_count(full['forward_tokens'])}")
            lo, hi = next(iter(row["ci95"].values()))  # one seed: that evaluation's interval
            spread = (f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]" if s["seeds"] > 1 else
                      f"{s['mean']:.3f} (95% CI [{_num(lo)}, {_num(hi)}])")
            far_cell = _interval(agg["compute_matched_paired"].get(method) if step == agg["run_steps"] else None)
            lines.append(f"| {_label(agg, method, step)} | {step} | {s['seeds']} | {spread} | {std} | "
                         f"{_interval(row['paired'])} | {_count(own['episodes'])} | {passes} | {teacher} |"
                         + (f" {far_cell} |" if matched else ""))
    wall = agg["wall_seconds"]
    lines += ["", f"Wall time on this machine (the results files' seconds): training {_duration(wall['train'])}, "
              f"held-out evaluations {_duration(wall['eval'])}, {_duration(wall['train'] + wall['eval'])} for "
              f"{agg['runs']} (method, seed) runs and the step-0 evaluation."]
    if agg.get("vs_start"):
        name = "the start" if agg.get("init") else "the untrained policy"
        lines += ["", f"Against {name} (step 0's one evaluation as every seed's base), paired per (seed, game), at step "
                  f"{agg['run_steps']}: " + "; ".join(f"{m} {_interval(p)}" for m, p in agg["vs_start"].items()) + "."]
    if agg.get("incomplete"):
        lines += ["", f"Not complete yet (stopped or still running; their rows hold the steps evaluated so far): "
                  f"{', '.join(agg['incomplete'])}."]
    return "\n".join(lines) + "\n"


def _steps_cell(values: list) -> str:
    """A per-step list for a table cell: "0.25 0.50 -" (None: no value that step)."""
    return " ".join("-" if v is None else f"{v:.2f}" for v in values)


def training_table(recs: list[dict]) -> str:
    """The training side of an experiment (Markdown): per method and step, training success (mean over seeds),
    groups with mixed outcomes (summed over seeds) and the credit diagnostics that show whether its advantages
    differed from GRPO's (`CREDIT_DIAGNOSTICS`: AlignOPSD's turn-weight range over seeds, AgentOPSD's mean
    multiplier, GC-OPD's identifiable-group and sign-flip ratios). GRPO's steps past run.steps are left out."""
    ref = next((r for r in recs if r["seed"] is not None), None)
    if ref is None:
        return ""
    steps, groups = ref["run_steps"], ref["config"].get("env", {}).get("num_games", "?")
    methods = {r["method"] for r in recs}
    terms = {"alignopsd": "turn weights: the smallest and largest of AlignOPSD's per-turn weights that step over all its "
                          "turns and seeds, the redistribution of the trajectory's GRPO advantage, 1 = GRPO's",
             "agentopsd": "multiplier: AgentOPSD's belief-revision multiplier on the advantage, mean over its tokens and "
                          "seeds, 1 = GRPO's",
             "gc_opd": "identifiable: the share of GC-OPD's responses in groups whose rewards and teacher scores both "
                       "vary, the only ones its residual z(reward) - z(teacher score) acts on; sign flips: the share of "
                       "its tokens with a nonzero OPD advantage whose final advantage does not keep its sign"}
    lines = [f"Training, {'step 0' if steps == 1 else f'steps 0-{steps - 1}'} (each step {groups} groups; mixed = groups "
             "with both outcomes, summed over seeds"
             + "".join(f"; {text}" for method, text in terms.items() if method in methods) + ").", "",
             "| method | seeds | training success per step (mean) | mixed groups per step (sum) | credit diagnostics per step |",
             "|---|---|---|---|---|"]

    def per_step(runs: dict, key: str, how) -> list:
        out = []
        for step in range(steps):
            vals = [t[key] for rec in runs.values() for t in rec["training"] if t["step"] == step and t.get(key) is not None]
            out.append(how(vals) if vals else None)
        return out

    mean = lambda v: sum(v) / len(v)  # noqa: E731
    for method, runs in by_method(recs).items():
        diag = ""
        if method == "alignopsd":
            lo, hi = per_step(runs, "alignopsd/turn_weight_min", min), per_step(runs, "alignopsd/turn_weight_max", max)
            diag = "turn weights " + " ".join("-" if a is None else f"{a:.2f}-{b:.2f}" for a, b in zip(lo, hi))
        elif method == "agentopsd":
            diag = "multiplier " + _steps_cell(per_step(runs, "agentopsd/multiplier_mean", mean))
        elif method == "gc_opd":
            diag = ("identifiable " + _steps_cell(per_step(runs, "gc_opd/group_identifiable_ratio", mean))
                    + "; sign flips " + _steps_cell(per_step(runs, "gc_opd/final_sign_flip_ratio", mean)))
        mixed = per_step(runs, "mixed_groups", sum)
        lines.append(f"| {method} | {len(runs)} | {_steps_cell(per_step(runs, 'success_rate', mean))} | "
                     f"{' '.join('-' if m is None else str(int(m)) for m in mixed)} | {diag} |")
    return "\n".join(lines) + "\n"


def curves(agg: dict) -> dict[str, list[dict]]:
    """learning.png's lines: per method, its points up to run.steps as {"step", "metric", "value" (mean over
    seeds), "lo", "hi" (one seed: its 95% bootstrap interval; several: min and max over seeds), "seeds"}."""
    out = {}
    for method, rows in agg["methods"].items():
        out[method] = []
        for step, r in rows.items():
            s = r["summary"]
            if step > agg["run_steps"]:
                continue
            lo, hi = (s["min"], s["max"]) if s["seeds"] > 1 else next(iter(r["ci95"].values()))
            out[method].append({"step": step, "metric": agg["metric"], "value": s["mean"], "lo": lo, "hi": hi,
                                "seeds": s["seeds"]})
    return out


# ---------------------------------------------------------------------------
# Running: (method, seed) by (method, seed), every record written as soon as something is measured


class Plan:
    """One invocation's experiment: the base config, methods, seeds, steps and where things go."""

    def __init__(self, args, base: dict, run_cfg, steps: int, teacher_steps: int | None):
        self.base, self.run_cfg, self.steps, self.teacher_steps = base, run_cfg, steps, teacher_steps
        self.methods, self.seeds, self.teacher, self.compute_matched = args.methods, args.seeds, args.teacher, args.compute_matched
        self.out, self.results, self.keep_snapshots, self.resume = args.out, args.results, args.keep_snapshots, args.resume
        self.drop_checkpoints = args.drop_checkpoints
        self.records: dict[tuple[str, int | None], dict] = {}  # (method, seed) -> results record; step 0: seed None
        self.header = self.header_of(args, base, run_cfg, steps, teacher_steps)
        self.start = "start" if args.init is not None else "untrained"  # the step-0 record's method

    @staticmethod
    def header_of(args, base: dict, run_cfg, steps: int, teacher_steps: int | None) -> dict:
        """The experiment's identity (`config_hash`'s input, copied into every results file): the base config,
        steps, teacher steps, compute-matched, PPO epochs; with --init the start's sha256 in place of its path
        (the same start copied elsewhere continues the same experiment)."""
        header = {"config": base, "run_steps": steps, "teacher_steps": teacher_steps,
                  "compute_matched": bool(args.compute_matched), "ppo_epochs": run_cfg.trainer.ppo_epochs}
        if args.init is not None:
            sha = weights_sha256(args.init)
            header["config"] = json.loads(json.dumps(base))
            header["config"]["model"]["name"] = f"--init sha256:{sha[:16]}"
            header["init"] = {"sha256": sha, "name": args.init.name}
        return header

    def grpo_steps(self) -> int:
        """GRPO's training steps: run.steps; with --teacher teacher_steps (+ run.steps with --compute-matched)."""
        if not self.teacher:
            return self.steps
        return self.teacher_steps + (self.steps if self.compute_matched else 0)

    def config_of(self, method: str, seed: int, teacher_dir: Path | None = None) -> dict:
        """`method`'s run config for training seed `seed` (run.seed; run.name gets -seed<S>)."""
        if not self.teacher:
            cfg = method_config(self.base, method, self.steps)
        else:
            steps = self.grpo_steps() if method == "grpo" else self.steps
            cfg = teacher_config(self.base, method, steps, teacher_dir or self.teacher_dir(seed))
        cfg["run"].update(seed=seed, name=f"{cfg['run']['name']}-seed{seed}")
        return cfg

    def teacher_dir(self, seed: int) -> Path:
        """--teacher: GRPO seed S's policy at teacher_steps as an HF directory, the teacher of seed S's students."""
        return self.out / f"teacher-seed{seed}"

    def wanted(self, method: str) -> set[int]:
        """The policy versions evaluated: every snapshot up to run.steps; GRPO with --teacher also teacher_steps
        (the teacher) and, with --compute-matched, teacher_steps + run.steps."""
        every = self.run_cfg.trainer.snapshot_every
        out = set(range(every, self.steps + 1, every))
        if self.teacher and method == "grpo":
            out |= {self.teacher_steps} | ({self.teacher_steps + self.steps} if self.compute_matched else set())
        return out


class Evaluator:
    """The held-out evaluation (`held_out`), its model loaded on first use: a --resume whose results are all
    complete loads nothing."""

    def __init__(self, run_cfg, out: Path):
        self.run_cfg, self.out, self._backend, self._ctx = run_cfg, out, None, None

    @property
    def backend(self):
        if self._backend is None:
            from opsd.envs import local_context
            from opsd.models import load_backend

            self._ctx, self._backend = local_context(self.run_cfg), load_backend(self.run_cfg.model)
        return self._backend

    def play(self, name: str, label: str) -> tuple[dict, dict]:
        """`held_out` of the backend's current weights into out/eval/<name>/."""
        backend = self.backend  # loads the model and the env context on first use
        return held_out(self.run_cfg, backend, self._ctx, self.out / "eval" / name, label)


def snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's kept snapshots as (policy version, file), by version."""
    return sorted((int(p.stem.removeprefix("policy-v")), p) for p in (run_dir / "snapshots").glob("policy-v*.safetensors"))


def trained_run(plan: Plan, method: str, seed: int) -> Path:
    """(method, seed)'s finished run directory: one found finished (--resume), one found stopped and continued
    with `opsd run --resume`, or a new run. A run killed before it wrote its config starts again."""
    prior = run_dirs(run_root(plan.out, method, seed)) if plan.resume else []
    done = next((d for d in reversed(prior) if (d / "DONE").exists()), None)
    stopped = next((d for d in reversed(prior) if not (d / "DONE").exists() and (d / "config.yaml").is_file()), None)
    if done is not None:
        return done
    if method != "grpo" and plan.teacher and not (plan.teacher_dir(seed) / "config.json").is_file():
        raise SystemExit(f"the teacher of seed {seed}'s students, {plan.teacher_dir(seed)}, is gone (GRPO seed {seed}'s "
                         f"results are complete but its run directory was removed): move "
                         f"{results_path(plan.results, 'grpo', seed)} aside to train it again")
    return train(plan.config_of(method, seed), plan.out, method, seed, resume=stopped)


def evaluate_snapshots(plan: Plan, ev: Evaluator, rec: dict, run_dir: Path, on_point) -> None:
    """Play the wanted snapshots of `run_dir` not yet in `rec["steps"]`, calling `on_point(version, point)` after
    each; GRPO's snapshot at teacher_steps (--teacher) is also saved as its seed's teacher. Snapshots are deleted
    once used unless --keep-snapshots."""
    method, seed = rec["method"], rec["seed"]
    wanted = plan.wanted(method)
    teacher = plan.teacher_dir(seed) if plan.teacher and method == "grpo" else None
    for version, path in snapshots(run_dir):
        play = version in wanted and str(version) not in rec["steps"]
        save_teacher = teacher is not None and version == plan.teacher_steps and not (teacher / "config.json").is_file()
        if play or save_teacher:
            ev.backend.load_weights(path, version)
        if play:
            point, raw = ev.play(f"{method}-seed{seed}-{version:03d}", f"{method} seed {seed} step {version}")
            rec["steps"][str(version)] = raw
            rec["metric"] = point["metric"]
            rec["seconds"]["eval"] += point["seconds"]
            on_point(version, point)
        if save_teacher:
            ev.backend.save_checkpoint(teacher)
        if not plan.keep_snapshots:
            path.unlink()
    if teacher is not None and str(plan.teacher_steps) not in rec["steps"]:
        raise SystemExit(f"GRPO seed {seed} left no snapshot of version {plan.teacher_steps} to be the teacher "
                         f"({run_dir / 'snapshots'})")


def forget_lost_run(plan: Plan, rec: dict) -> None:
    """--resume of an incomplete (method, seed) whose training run directory (`rec["run"]`) is gone (a later sitting
    in a fresh checkout): a new run starts from step 0, so the lost run's evaluations and training records are
    dropped rather than mixed with the new run's. A GRPO run that was a teacher (--teacher): its saved teacher
    belongs to the lost run and is removed (the new run's snapshot takes its place), unless a student of the seed
    has started from it: SystemExit then, naming the results files to move aside."""
    method, seed = rec["method"], rec["seed"]
    if not rec.get("run") or (run_root(plan.out, method, seed) / rec["run"]).is_dir():
        return
    print(f"{method} seed {seed}: its run {rec['run']} is gone; its evaluations are dropped and it trains again", flush=True)
    if plan.teacher and method == "grpo":
        students = [results_path(plan.results, m, seed) for m in plan.methods if m != "grpo"
                    if (s := plan.records.get((m, seed))) and (s["steps"] or s["training"])]
        if students:
            raise SystemExit(f"GRPO seed {seed}'s run {rec['run']} is gone, and its teacher taught "
                             f"{', '.join(map(str, students))}: move those aside too, to train the seed again")
        shutil.rmtree(plan.teacher_dir(seed), ignore_errors=True)
    rec.update(steps={}, training=[], run=None, seconds={"train": 0.0, "eval": 0.0})


def compute_block(rec: dict, grpo: dict | None) -> dict:
    """A results file's "compute": {"own": its whole training (`stats.training_compute`), and for a student of an
    external teacher "teacher" (GRPO seed S's training up to teacher_steps, from `grpo`, its record) and
    "with_teacher" (the two summed)}."""
    own = stats.training_compute(rec["training"], rec["ppo_epochs"])
    if not rec.get("teacher") or grpo is None:
        return {"own": own}
    teacher = stats.training_compute(grpo["training"], rec["ppo_epochs"], rec["teacher"]["step"])
    return {"own": own, "teacher": teacher, "with_teacher": stats.add_compute(own, teacher)}


def run_one(plan: Plan, ev: Evaluator, rec: dict, on_point) -> dict:
    """Train (or continue) and evaluate one (method, seed) whose record `rec` is not complete (a student's teacher,
    GRPO of the same seed, is in plan.records); its results file
    is rewritten after every evaluation and marked complete at the end. Returns `rec`."""
    method, seed = rec["method"], rec["seed"]
    forget_lost_run(plan, rec)
    t0 = time.perf_counter()
    run_dir = trained_run(plan, method, seed)
    rec["seconds"]["train"] += time.perf_counter() - t0
    rec["run"] = run_dir.name  # which training run the evaluations below belong to
    rec["training"] = training_records(run_dir)
    if plan.teacher and method != "grpo":
        rec["teacher"] = {"method": "grpo", "seed": seed, "step": plan.teacher_steps}
    write_results(plan.results, rec)

    def point(version: int, p: dict) -> None:
        write_results(plan.results, rec)
        on_point(rec, version, p)

    evaluate_snapshots(plan, ev, rec, run_dir, point)
    rec["missing_steps"] = sorted(plan.wanted(method) - {int(k) for k in rec["steps"]})  # snapshots never written
    rec["compute"] = compute_block(rec, plan.records.get(("grpo", seed)))
    rec["complete"] = True
    write_results(plan.results, rec)
    if plan.drop_checkpoints:  # the results file holds what the report needs; a teacher is a copy of its own
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    return rec


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The command line, checked, and its parser; args.config, args.methods and args.results filled with their
    defaults."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="default configs/learning.yaml (--teacher: learning-teacher.yaml)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                    help=f"default {' '.join(DEFAULT_METHODS)}; with --teacher {' '.join(TEACHER_METHODS)} (grpo first)")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="training seeds (run.seed); default the config's")
    ap.add_argument("--steps", type=int, default=None, help="override run.steps (>= 1)")
    ap.add_argument("--teacher", action="store_true", help="the external-teacher experiment (module docstring)")
    ap.add_argument("--teacher-steps", type=int, default=None, help="--teacher: GRPO's steps (default 2 x run.steps)")
    ap.add_argument("--compute-matched", action="store_true",
                    help="--teacher: GRPO trains on to teacher_steps + run.steps and is evaluated there")
    ap.add_argument("--out", type=Path, default=None,
                    help="the run directories, learning.json and learning.png (default runs/learning/<timestamp>/)")
    ap.add_argument("--results", type=Path, default=None,
                    help="raw results folder (default benchmarks/results/<experiment>/; module docstring)")
    ap.add_argument("--table", action="store_true",
                    help="print the Markdown tables from --results alone (of --methods and --seeds, when given) and exit")
    ap.add_argument("--keep-snapshots", action="store_true",
                    help="keep each run's snapshots/ after they are evaluated (default: deleted)")
    ap.add_argument("--drop-checkpoints", action="store_true",
                    help="delete a (method, seed)'s checkpoint/ (1.6 GB for SmolLM2) once its results file is complete")
    ap.add_argument("--init", type=Path, default=None,
                    help="start every method from this HF model directory (module docstring)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run of the whole path: 1 step, 2 held-out games, results into <experiment>-quick/")
    ap.add_argument("--json", type=Path, default=None, help="also write the benchmark rows here (benchmarks/run.py)")
    ap.add_argument("--resume", action="store_true", help="continue the stopped benchmark in --out (module docstring)")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1 (got {args.steps})")
    if args.teacher_steps is not None and not args.teacher:
        ap.error("--teacher-steps needs --teacher")
    if args.compute_matched and not args.teacher:
        ap.error("--compute-matched needs --teacher (GRPO continued for its teacher's and a student's episodes)")
    if args.teacher_steps is not None and args.teacher_steps < (args.steps or 1):
        ap.error(f"--teacher-steps must be >= the students' steps ({args.steps or 1}): GRPO's curve is read up to them")
    if args.teacher and args.methods is not None and args.methods[0] != "grpo" and not args.table:
        ap.error(f"--methods with --teacher must start with grpo (it trains the teacher), got {' '.join(args.methods)}")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds: each seed once (got {' '.join(map(str, args.seeds))})")
    if args.seeds is not None and not all(0 <= s < 2**32 for s in args.seeds):
        ap.error(f"--seeds: each seed in [0, 2**32) (numpy's seed range; got {' '.join(map(str, args.seeds))})")
    if args.methods is not None and len(set(args.methods)) != len(args.methods):
        ap.error(f"--methods: each method once (got {' '.join(args.methods)})")
    if args.init is not None and args.teacher:
        ap.error("--init with --teacher: the teacher experiment starts every method from the config's model")
    if args.init is not None and not args.table and not (args.init / "config.json").is_file():
        ap.error(f"--init {args.init}: not an HF model directory (no config.json)")
    if args.config is None:
        args.config = ROOT / "configs" / ("learning-teacher.yaml" if args.teacher else "learning.yaml")
    args.table_methods, args.table_seeds = args.methods, args.seeds  # --table: only those given (table_records)
    args.methods = args.methods or list(TEACHER_METHODS if args.teacher else DEFAULT_METHODS)
    if args.quick:
        args.methods = ["grpo", "opd"] if args.teacher else ["grpo"]
    args.results = args.results or RESULTS / experiment_name(args.config, args.teacher, args.quick)
    if args.table:
        return args, ap
    if args.resume and (args.out is None or not ((args.out / "learning.json").is_file() or read_results(args.results))):
        ap.error(f"--resume needs --out DIR of a benchmark that wrote DIR/learning.json, or results files in {args.results}")
    if not args.config.is_file():
        ap.error(f"--config {args.config}: not a file (give a run config YAML, e.g. configs/learning.yaml)")
    return args, ap


def base_config(args, error) -> dict:
    """The shared config: --config as `opsd run` reads it, with --quick's and --steps' changes. `error`: the
    parser's error (a usage error, exit 2)."""
    from opsd.config import read_yaml

    try:  # as `opsd run` reads it: a repeated key (a second trainer: block) is refused, not dropped on the rewrite
        base = read_yaml(args.config)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
        error(f"--config {args.config}: cannot read it as YAML: {e}")
    if not isinstance(base, dict):
        error(f"--config {args.config}: the top level must be a mapping of sections (run:, model:, ...)")
    if args.quick:
        args.steps = 1
        base.setdefault("env", {}).update(eval_pool=2, max_turns=2)
        base.setdefault("rollout", {}).update(group_size=4)
        base.setdefault("eval", {}).update(episodes_per_task=1)
        base.setdefault("trainer", {}).update(snapshot_every=1)
    if args.steps is not None:  # into the shared config: learning.json and config.yaml record the steps run
        base.setdefault("run", {})["steps"] = args.steps
    if args.init is not None:
        base.setdefault("model", {})["name"] = str(args.init.resolve())
    return base


def load_records(plan: Plan) -> None:
    """Into plan.records: the results files of this invocation's (method, seed)s and the untrained record.
    SystemExit when one exists without --resume (committed results are never overwritten by accident) or
    comes from another experiment (config hash)."""
    want = config_hash(plan.header)
    for rec in read_results(plan.results):
        key = (rec["method"], rec["seed"])
        if key != (plan.start, None) and not (rec["method"] in plan.methods and rec["seed"] in plan.seeds):
            continue
        path = results_path(plan.results, *key)
        if not plan.resume:
            raise SystemExit(f"{path} exists: --resume continues that experiment, or give another --results")
        if rec["config_hash"] != want:
            raise SystemExit(f"--resume: {path} was written with another config or steps (hash {rec['config_hash']}, "
                             f"this run's {want})")
        plan.records[key] = rec


def report(plan: Plan, result: dict) -> None:
    """learning.json's report fields from plan.records: "curves" (learning.png's lines), "runs" ({method: {seed:
    {"curve", "training", "compute", "complete"}}}), "report" (`aggregate`), "teacher" (--teacher: GRPO's
    point at teacher_steps over seeds) and "steps_to_grpo_final" (on the seed-mean curves)."""
    recs = [r for r in plan.records.values() if r["steps"]]
    if not recs:
        return
    agg = aggregate(recs)
    result["report"] = agg
    result["curves"] = {m: [] for m in plan.methods} | curves(agg)
    result["runs"] = {m: {s: {"curve": [{"step": int(k), **{x: v for x, v in e.items() if x != "episodes"}}
                                        for k, e in rec["steps"].items()],
                              "training": rec["training"], "compute": rec["compute"], "complete": rec["complete"]}
                          for s, rec in runs.items()} for m, runs in by_method(recs).items()}
    if plan.teacher and plan.teacher_steps in agg["methods"].get("grpo", {}):
        result["teacher"] = {"step": plan.teacher_steps, **agg["methods"]["grpo"][plan.teacher_steps]["summary"]}
    if plan.teacher and result["curves"].get("grpo"):
        target = headline(result["curves"]["grpo"][-1])
        result["steps_to_grpo_final"] = {m: steps_to_reach(result["curves"][m], target) for m in plan.methods
                                         if result["curves"].get(m)}


def benchmark_rows(result: dict, steps: int, teacher: bool) -> list[Row]:
    """--json: the rows benchmarks/run.py shows (the final point of each method's seed-mean curve)."""
    u = headline(result["untrained"])
    rows = [Row(f"untrained held-out {result['untrained'].get('metric', 'success')}", u, "rate", note="step 0, shared by every method")]
    for method, pts in result["curves"].items():
        if not pts:
            continue
        last = pts[-1]
        band = "95% CI" if last.get("seeds", 1) == 1 else f"min-max over {last['seeds']} seeds"
        rows.append(Row(f"{method}: held-out {last.get('metric', 'success')} at step {last['step']}", headline(last), "rate",
                        note=f"{band} [{last['lo']:.3f}, {last['hi']:.3f}]"))
        if method == "grpo" and u is not None:  # the proof the RL loop is right: the whole interval above the start
            rows.append(Row("grpo: lower bound - untrained", last["lo"] - u, "rate", "> 0 rate",
                            note="held-out success rose measurably"))
        if teacher:
            reach = result.get("steps_to_grpo_final", {}).get(method)
            rows.append(Row(f"{method}: steps to GRPO's step-{steps} success", reach, "steps",
                            note="never within run.steps" if reach is None else ""))
    if teacher and result.get("teacher"):
        t = result["teacher"]
        rows.append(Row(f"teacher (grpo step {t['step']}) held-out, mean over {t['seeds']} seeds", t["mean"], "rate",
                        note=f"min-max [{t['min']:.3f}, {t['max']:.3f}]"))
    return rows


def prepare(args, ap) -> tuple[Plan, dict | None]:
    """The checked experiment of the command line and, with --resume, the learning.json it continues (None
    without one). Every method's config is validated as `opsd run` will read it (a bad one fails in seconds, not
    after the untrained evaluation); nothing is written. Usage errors exit 2, another experiment's learning.json 1."""
    base = base_config(args, ap.error)
    steps = int(base.get("run", {}).get("steps", 3))
    args.seeds = args.seeds if args.seeds is not None else [int(base.get("run", {}).get("seed", 0))]
    teacher_steps = (args.teacher_steps or 2 * steps) if args.teacher else None
    if teacher_steps is not None and teacher_steps < steps:
        ap.error(f"--teacher-steps must be >= run.steps ({steps}): GRPO's curve is read up to run.steps")
    with tempfile.TemporaryDirectory(prefix="opsd-learning-") as tmp:
        for method in args.methods:
            cfg = (teacher_config(base, method, steps, Path(tmp) / "teacher") if args.teacher
                   else method_config(base, method, steps))
            validated(cfg, Path(tmp) / f"{method}.yaml")
        run_cfg = validated(base, Path(tmp) / "config.yaml")
    args.out = args.out or ROOT / "runs" / "learning" / datetime.now().strftime("%Y%m%d-%H%M%S")
    before = json.loads((args.out / "learning.json").read_text()) if args.resume and (args.out / "learning.json").is_file() else None
    # The methods may change between sittings (each (method, seed) has its own results file); the config may not.
    if before is not None and (before.get("config_hash") != config_hash(Plan.header_of(args, base, run_cfg, steps, teacher_steps))):
        raise SystemExit(f"--resume: {args.out / 'learning.json'} was written with another config or teacher steps")
    every = run_cfg.trainer.snapshot_every
    if every < 1:
        raise SystemExit("trainer.snapshot_every must be >= 1: the curve is evaluated on the kept snapshots")
    grpo_points = {"run.steps": steps}  # every method's final policy is evaluated on its snapshot
    if args.teacher:  # GRPO's snapshots read past run.steps
        grpo_points["--teacher-steps"] = teacher_steps
    if args.compute_matched:
        grpo_points["--teacher-steps + run.steps"] = teacher_steps + steps
    for name, n in grpo_points.items():
        if n % every:
            raise SystemExit(f"{name} ({n}) must be a multiple of trainer.snapshot_every ({every}): the policy there "
                             "is evaluated on its snapshot")
    return Plan(args, base, run_cfg, steps, teacher_steps), before


def table_records(recs: list[dict], results: Path, methods: list[str] | None, seeds: list[int] | None) -> list[dict]:
    """--table's records: those of --methods and --seeds when given (the step-0 record and GRPO, every comparison's
    baseline and the students' teacher, always). SystemExit when
    the folder has no step-0 record beside the seeds' files (a partial copy: the table's step-0 row and its
    comparisons need it), or when a method or seed asked for has no file (a method: none of those seeds)."""
    if any(r["seed"] is not None for r in recs) and not any(r["seed"] is None for r in recs):
        raise SystemExit(f"{results}: no step-0 record (untrained.json, or start.json with --init) beside the seeds' "
                         "files: a partial copy of the experiment")
    have_methods = {r["method"] for r in recs if r["seed"] is not None}
    have_seeds = {r["seed"] for r in recs if r["seed"] is not None}
    for flag, asked, have in (("--methods", methods, have_methods), ("--seeds", seeds, have_seeds)):
        absent = [x for x in asked or [] if x not in have]
        if absent:
            raise SystemExit(f"--table {flag}: {' '.join(map(str, absent))} not in {results} "
                             f"(it holds {' '.join(map(str, sorted(have)))})")
    out = [r for r in recs if r["seed"] is None or ((methods is None or r["method"] in methods or r["method"] == "grpo")
                                                     and (seeds is None or r["seed"] in seeds))]
    empty = [m for m in methods or [] if not any(r["method"] == m for r in out)]
    if empty:
        raise SystemExit(f"--table: no {' '.join(empty)} file of seeds {' '.join(map(str, seeds or []))} in {results}")
    return out


def main() -> None:
    args, ap = parse_args()
    if args.table:  # from the results files alone: nothing trained, no model loaded
        recs = read_results(args.results)
        if not recs:
            ap.error(f"--table: no results files in {args.results} (the committed experiments: --teacher, or "
                     "--config configs/learning-mid.yaml)")
        recs = table_records(recs, args.results, args.table_methods, args.table_seeds)
        print(markdown_tables(aggregate(recs)) + "\n" + training_table(recs), end="")
        return
    plan, before = prepare(args, ap)
    base, run_cfg, steps, teacher_steps, out = plan.base, plan.run_cfg, plan.steps, plan.teacher_steps, plan.out
    load_records(plan)
    out.mkdir(parents=True, exist_ok=True)
    validated(base, out / "config.yaml")
    command = command_line()
    result: dict = {
        "command": command, "machine": machine(), "config": base, "methods": args.methods, "seeds": args.seeds,
        "results": str(args.results), "config_hash": config_hash(plan.header),
        "title": (f"{run_cfg.env.name}: {run_cfg.env.eval_pool} held-out games x {run_cfg.eval.episodes_per_task} "
                  f"episodes, T={run_cfg.eval.temperature}; {run_cfg.env.num_games}x{run_cfg.rollout.group_size} "
                  f"episodes/step" + (f"; {len(args.seeds)} seeds: mean, min-max band" if len(args.seeds) > 1 else "")),
        "untrained": None, "curves": {m: [] for m in args.methods}, "seconds": {},
    }
    if args.teacher:
        result.update(teacher_steps=teacher_steps, compute_matched=args.compute_matched, teacher=None, steps_to_grpo_final={})
    if before is not None:  # --resume: keep what was measured (the same experiment, checked above)
        result = {**result, **{k: v for k, v in before.items() if k not in ("command", "machine", "seeds", "methods")}}
        result.setdefault("resumed", []).append({"at": datetime.now().isoformat(timespec="seconds"), "command": command})
    elif args.resume:
        result["resumed"] = [{"at": datetime.now().isoformat(timespec="seconds"), "command": command,
                              "from": f"results files in {args.results}"}]

    def save() -> None:
        report(plan, result)
        tmp = out / ".learning.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out / "learning.json")
        plot(result, out / "learning.png")

    t_all = time.perf_counter()
    ev = Evaluator(run_cfg, out)
    untrained = plan.records.get((plan.start, None)) or new_record(plan.header, plan.start, None)
    measured_before = untrained["complete"]
    if not untrained["complete"]:
        point, raw = ev.play(plan.start, plan.start)
        untrained.update(steps={"0": raw}, metric=point["metric"], complete=True)
        untrained["seconds"]["eval"] = point["seconds"]
        write_results(args.results, untrained)
    plan.records[(plan.start, None)] = untrained
    u = untrained["steps"]["0"]
    result["untrained"] = {"metric": untrained["metric"], **{k: v for k, v in u.items() if k != "episodes"}}
    print(f"{plan.start}: held-out {untrained['metric']} {_num(u['value'])} [{_num(u['lo'])}, {_num(u['hi'])}]"
          + (f" (from {results_path(args.results, plan.start, None)}, not played again)" if measured_before else ""), flush=True)
    save()

    def on_point(rec: dict, version: int, p: dict) -> None:
        print(f"{rec['method']} seed {rec['seed']} step {version}: held-out {p['metric']} {_num(headline(p))} "
              f"[{_num(p['lo'])}, {_num(p['hi'])}]", flush=True)
        save()

    for seed in args.seeds:  # every method of a seed before the next seed: a stopped benchmark has whole seeds
        for method in args.methods:
            rec = plan.records.setdefault((method, seed), new_record(plan.header, method, seed))
            if rec["complete"]:  # --resume: trained and evaluated before (its run directory may be gone)
                print(f"{method} seed {seed}: complete in {results_path(args.results, method, seed)}, skipped", flush=True)
                continue
            t0 = time.perf_counter()
            run_one(plan, ev, rec, on_point)
            result["seconds"][f"{method}/seed{seed}"] = result["seconds"].get(f"{method}/seed{seed}", 0.0) + time.perf_counter() - t0
            save()
    result["seconds"]["total"] = time.perf_counter() - t_all
    save()
    print(f"wrote {out / 'learning.json'}, {out / 'learning.png'} and {args.results}/ in {result['seconds']['total'] / 60:.1f} min")
    if args.json:
        write_json(args.json, "learning", command_line(), benchmark_rows(result, steps, args.teacher))


if __name__ == "__main__":
    main()
