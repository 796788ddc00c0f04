"""`opsd eval`: play an env's eval split with one policy and report its metric per category.

Every eval task is played `cfg.eval.episodes_per_task` times at the papers'
validation temperature (`cfg.eval.temperature`, top-p 1) with the rollout's
own episode code (`run_groups`: up to eval.parallel_tasks tasks share each batched generate
call, at most rollout.batch_size episodes). Per category and overall: the env's metric
(its adapter's METRIC: "success" rate, exact match "em", WebShop "score"
and "acc", both in percent, or "f1" and "success" for graded verifiers) with a 95% percentile bootstrap interval over
episodes, mean turns, the format-valid turn rate and how episodes ended.
A task whose group raises is recorded with its error; the others still run.

Writes `<out_dir>/eval.json` and `<out_dir>/eval.png` (a bar per category,
bootstrap intervals as error bars). `resolve_checkpoint` tells what a
`--checkpoint` path holds (run directory, HF model directory, weights file).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from opsd.lora import has_peft_names

log = logging.getLogger(__name__)

# What each adapter METRIC reports: the metric names (the first is the headline) and how to read them.
METRICS = {"success": ("success",), "em": ("em",), "score": ("score", "acc"), "f1": ("f1", "success")}
LABELS = {
    "success": "success rate",
    "em": "exact match",
    "score": "WebShop Score (100 x mean reward)",
    "acc": "WebShop Acc (% of episodes with score 1)",
    "f1": "F1 (mean graded reward)",
}
SHORT = {"success": "success", "em": "EM", "score": "Score", "acc": "Acc", "f1": "F1"}  # table columns, y label
OVERALL = "overall"


# ---------------------------------------------------------------------------
# Statistics (pure)


def bootstrap_interval(values: Sequence[float], samples: int, rng: np.random.Generator,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`.

    Draws `samples` resamples of len(values) values with replacement from
    `rng`, takes each resample's mean, and returns the (1-level)/2 and
    (1+level)/2 quantiles of those means as floats (lo <= mean-ish <= hi,
    always inside [min(values), max(values)]). One value, or all values
    equal, gives the degenerate interval (x, x) without drawing.
    Raises ValueError for no values, non-finite values, samples < 1 or a
    level outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("bootstrap_interval: no values")
    if not np.isfinite(x).all():
        raise ValueError("bootstrap_interval: values must be finite")
    if samples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_interval: need samples >= 1 and 0 < level < 1 (got {samples}, {level})")
    if x.size == 1 or (x == x[0]).all():
        return float(x[0]), float(x[0])
    means = np.empty(samples)
    chunk = max(1, 2_000_000 // x.size)  # bound the index matrix's memory for large categories
    for lo in range(0, samples, chunk):
        hi = min(samples, lo + chunk)
        means[lo:hi] = x[rng.integers(0, x.size, size=(hi - lo, x.size))].mean(axis=1)
    q_lo, q_hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(q_lo), float(q_hi)


def metric_values(metric: str, rewards: Sequence[float], wons: Sequence[bool]) -> dict[str, np.ndarray]:
    """Per-episode values whose mean is each reported metric of adapter METRIC `metric`.

    "success": {"success": won as 0/1}; "em": {"em": reward} (Search's reward
    is the exact match); "score": {"score": 100 * reward, "acc": 100 * (reward == 1)}
    (WebShop's Score and Acc, in percent); "f1": {"f1": reward, "success": won as 0/1} (graded
    verifiers: the evidence env's F1). Raises ValueError for another metric.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if metric == "success":
        return {"success": np.asarray(wons, dtype=np.float64)}
    if metric == "em":
        return {"em": r}
    if metric == "score":
        return {"score": 100.0 * r, "acc": 100.0 * (r == 1.0)}
    if metric == "f1":
        return {"f1": r, "success": np.asarray(wons, dtype=np.float64)}
    raise ValueError(f"unknown eval metric {metric!r} (expected one of {sorted(METRICS)})")


def category_seed(seed: int, category: str) -> np.random.Generator:
    """The bootstrap Generator of one category: from (cfg.eval.seed, crc32 of the name), so a category's
    interval does not depend on which other categories exist or their order."""
    return np.random.default_rng([seed & (2**63 - 1), zlib.crc32(category.encode())])


def summarize(episodes: list[dict], metric: str, samples: int, seed: int, category: str, errors: int = 0) -> dict:
    """The numbers of one bucket of episode records (see `evaluate`'s per-task "episodes").

    Returns {"episodes": n, "errors": tasks that failed, "<metric>": {"value", "ci95": [lo, hi]} per
    reported metric (value and ci95 None when n == 0), "mean_turns", "format_valid_rate" (valid
    turns / turns, None without turns), "endings": {ending: count}}. Intervals: `bootstrap_interval`
    with `samples` resamples and `category_seed(seed, category)`.
    """
    out: dict[str, Any] = {"episodes": len(episodes), "errors": errors}
    values = metric_values(metric, [e["reward"] for e in episodes], [e["won"] for e in episodes])
    for i, (name, v) in enumerate(values.items()):
        if v.size == 0:
            out[name] = {"value": None, "ci95": None}
            continue
        # One Generator per (category, metric): the headline metric's draws do not shift the others'.
        lo, hi = bootstrap_interval(v, samples, category_seed(seed + i, category))
        out[name] = {"value": float(v.mean()), "ci95": [lo, hi]}
    turns = sum(e["turns"] for e in episodes)
    out["mean_turns"] = turns / len(episodes) if episodes else None
    out["format_valid_rate"] = sum(e["valid_turns"] for e in episodes) / turns if turns else None
    endings: dict[str, int] = {}
    for e in episodes:
        endings[e["ending"]] = endings.get(e["ending"], 0) + 1
    out["endings"] = dict(sorted(endings.items()))
    return out


def task_seed(seed: int, task_id: str) -> int:
    """The sampling seed of one eval task's group: from (cfg.eval.seed, crc32(task_id)), stable across runs."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), zlib.crc32(task_id.encode())]).generate_state(1)[0])


# ---------------------------------------------------------------------------
# Playing the eval split


def evaluate(cfg, backend, ctx, out_dir: Path, *, checkpoint: str | None = None, max_tasks: int | None = None,
             chat=None, on_task: Callable[[dict], None] | None = None) -> dict:
    """Play `cfg.env`'s eval split with `backend` and write `out_dir`/eval.json and eval.png.

    cfg: the RunConfig (env, rollout's max_new_tokens / batch_size, model.max_model_len, eval section).
    backend: an HFBackend-like sampler (its `policy_version` is recorded).
    ctx: the EnvContext (`opsd.envs.local_context(cfg)`).
    checkpoint: what to call the policy in the report (default: the model name).
    max_tasks: play only the first N eval tasks (None: all `cfg.env.eval_pool`).
    chat: a ChatFormat (default: `ChatFormat.for_env(backend.tokenizer, cfg.env, cfg.model)`).
    on_task: called with each task's result dict as it finishes (progress display).

    Returns the report written to eval.json: config name, env, metric(s), checkpoint,
    policy_version, temperature, episodes_per_task, tasks_per_call, "categories" {name: `summarize`},
    "overall", "tasks" [{task_id, category, seed, chunk, alone, seconds, error (None or "Type: message"),
    episodes [{rollout_id, reward, won, ending, turns, valid_turns}]}] and the written paths.
    Tasks share generate calls `tasks_per_call` at a time (eval.parallel_tasks, rollout.batch_size);
    a call samples from its first task's seed, so the same config (and `chunk`/`alone`) replays the
    same episodes, and another eval.parallel_tasks draws others.
    Raises what the adapter's make_tasks raises (no task could be built); errors of
    single tasks are recorded instead.
    """
    from opsd.chat import ChatFormat
    from opsd.envs import get_adapter, task_group
    from services.rollout.episodes import run_groups

    t0 = time.perf_counter()
    adapter = get_adapter(cfg.env.name)
    metric = adapter.METRIC
    if metric not in METRICS:
        raise ValueError(f"env {cfg.env.name!r} declares METRIC {metric!r}; opsd eval knows {sorted(METRICS)}")
    tasks = adapter.make_tasks(cfg.env, ctx, "eval")
    if max_tasks is not None:
        tasks = tasks[:max_tasks]
    chat = chat or ChatFormat.for_env(backend.tokenizer, cfg.env, cfg.model)
    rollout = cfg.rollout.model_copy(update={"temperature": cfg.eval.temperature, "top_p": 1.0})
    version = int(getattr(backend, "policy_version", 0))

    results = []
    # Tasks are played together, up to rollout.batch_size episodes per generate call (`run_groups`).
    per_call = max(1, min(cfg.eval.parallel_tasks, cfg.rollout.batch_size // cfg.eval.episodes_per_task))
    for lo in range(0, len(tasks), per_call):
        chunk = tasks[lo : lo + per_call]
        seeds = [task_seed(cfg.eval.seed, task.task_id) for task in chunk]
        groups = [task_group(cfg, task, group_id=f"eval-{task.task_id}", step=0, policy_version=version,
                             group_size=cfg.eval.episodes_per_task) for task in chunk]
        t_chunk, alone = time.perf_counter(), False
        try:
            played = run_groups(groups, backend, chat, cfg.env, rollout, cfg.model.max_model_len, seeds, ctx=ctx)
        except Exception as e:  # noqa: BLE001 - a failed batched call: each task alone, so one bad task fails alone
            log.warning("eval tasks %s failed together (%r); playing them one by one", [t.task_id for t in chunk], e)
            played, alone = [], True
            for group, seed in zip(groups, seeds):
                try:
                    played += run_groups([group], backend, chat, cfg.env, rollout, cfg.model.max_model_len, [seed], ctx=ctx)
                except Exception as err:  # noqa: BLE001 - recorded with the task
                    played.append(err)
        seconds = (time.perf_counter() - t_chunk) / len(chunk)  # the chunk's wall time, shared
        for task, seed, outcome in zip(chunk, seeds, played):
            # The sampler draws once per generate call, so a task's episodes depend on the tasks that shared its
            # calls: `chunk` (tasks_per_call apart) and `alone` (replayed by itself) make an eval reproducible.
            result = {"task_id": task.task_id, "category": task.category, "seed": seed, "chunk": lo // per_call,
                      "alone": alone or len(chunk) == 1, "error": None, "episodes": [], "seconds": seconds}
            if isinstance(outcome, Exception):  # one broken task (a game that fails, a server error) must not end the eval
                log.error("eval task %s failed: %r", task.task_id, outcome)
                result["error"] = f"{type(outcome).__name__}: {outcome}"
            else:
                result["episodes"] = [{
                    "rollout_id": t.rollout_id, "reward": float(t.reward), "won": bool(t.won), "ending": t.ending,
                    "turns": len(t.turns), "valid_turns": sum(bool(x.format_valid) for x in t.turns),
                } for t in outcome[0].trajectories]
            results.append(result)
            if on_task is not None:
                on_task(result)

    report = {
        "config": cfg.run.name, "env": cfg.env.name, "metric": metric, "metrics": list(METRICS[metric]),
        "checkpoint": checkpoint or cfg.model.name, "policy_version": version,
        "temperature": cfg.eval.temperature, "top_p": 1.0, "episodes_per_task": cfg.eval.episodes_per_task,
        "bootstrap_samples": cfg.eval.bootstrap_samples, "seed": cfg.eval.seed, "tasks_per_call": per_call,
        **report_numbers(results, metric, cfg.eval.bootstrap_samples, cfg.eval.seed),
        "tasks": results, "seconds": time.perf_counter() - t0,
        "created": datetime.now().isoformat(timespec="seconds"),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["paths"] = {"json": str(out_dir / "eval.json"), "png": str(out_dir / "eval.png")}
    plot_report(report, out_dir / "eval.png")
    tmp = out_dir / ".eval.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out_dir / "eval.json")
    return report


def report_numbers(results: list[dict], metric: str, samples: int, seed: int) -> dict:
    """{"categories": {category: summarize(...)} in first-seen order, "overall": summarize(all), "errors": n}
    from per-task results (as `evaluate` records them)."""
    by_cat: dict[str, list[dict]] = {}
    errors: dict[str, int] = {}
    for r in results:
        by_cat.setdefault(r["category"], []).extend(r["episodes"])
        errors[r["category"]] = errors.get(r["category"], 0) + (r["error"] is not None)
    every = [e for r in results for e in r["episodes"]]
    return {
        "categories": {c: summarize(eps, metric, samples, seed, c, errors[c]) for c, eps in by_cat.items()},
        "overall": summarize(every, metric, samples, seed, OVERALL, sum(errors.values())),
        "errors": sum(errors.values()),
    }


def plot_report(report: dict, path: Path) -> Path:
    """Write a bar chart of `report` (as `evaluate` returns it) to `path` (PNG, matplotlib Agg).

    One bar per category and one for "overall" (darker, hatched), per reported
    metric side by side (WebShop: score and acc); bootstrap 95% intervals as
    error bars; a category without episodes (only failed tasks) is marked "error".
    """
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    # One category: its bar is the overall figure already (a second, identical bar would say nothing).
    with_overall = len(report["categories"]) != 1
    names = [*report["categories"]] + ([OVERALL] if with_overall else [])
    rows = [*report["categories"].values()] + ([report["overall"]] if with_overall else [])
    metrics = report["metrics"]
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4.2))
    x = np.arange(len(names))
    for m, name in enumerate(metrics):
        vals = [r[name]["value"] for r in rows]
        heights = [v if v is not None else 0.0 for v in vals]
        err = np.array([[v - r[name]["ci95"][0], r[name]["ci95"][1] - v] if v is not None else [0.0, 0.0]
                        for v, r in zip(vals, rows)]).T
        colors = [f"C{m}"] * len(names)
        if with_overall and len(metrics) == 1:
            colors[-1] = "0.25"
        bars = ax.bar(x + (m - (len(metrics) - 1) / 2) * width, heights, width * 0.95, yerr=np.clip(err, 0, None),
                      capsize=4, color=colors, label=LABELS[name], edgecolor="black", linewidth=0.6)
        if with_overall:
            bars[-1].set_hatch("//")
        for b, v in zip(bars, vals):
            if v is None:
                ax.annotate("error", (b.get_x() + b.get_width() / 2, 0), ha="center", va="bottom", fontsize=8, color="red")
    top = 100.0 if report["metric"] == "score" else 1.0
    ax.set_ylim(0, top * 1.08)
    ax.set_xticks(x, [f"{n}\n(n={r['episodes']}" + (f", {r['errors']} failed)" if r["errors"] else ")")
                      for n, r in zip(names, rows)], fontsize=8)
    ylabel = LABELS[metrics[0]] if len(metrics) == 1 else " / ".join(SHORT[m] for m in metrics) + (
        " (%)" if report["metric"] == "score" else "")
    ax.set_ylabel(f"{ylabel}, 95% bootstrap CI", fontsize=9)
    ckpt = Path(str(report["checkpoint"]))
    shown = f"{ckpt.parent.name}/{ckpt.name}" if ckpt.name in ("checkpoint", "final_model") else ckpt.name
    # Two lines: a run directory's name alone can be wider than the figure.
    ax.set_title(f"{report['env']} eval, policy v{report['policy_version']}, T={report['temperature']}\n{shown}",
                 fontsize=9)
    if len(metrics) > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# What `--checkpoint` points at

_VERSION = re.compile(r"policy-v(\d+)\.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class CheckpointSource:
    """A resolved `opsd eval --checkpoint` path.

    kind: "run" (a run directory), "model" (an HF model dir: config.json + model*.safetensors,
    e.g. a trainer checkpoint/ or a LoRA run's final_model/) or "weights" (a published
    weights file). model_dir: the HF dir to load as model.name (None: load the config's
    model). weights_file: a file to load into that model with `backend.load_weights`
    (a weights file, or the model file of a dir without tokenizer files).
    run_dir: the run directory the path belongs to (None if none). policy_version: from
    the checkpoint's trainer_state.json, the run's DONE, or the weights file name (None: unknown).
    """

    path: Path
    kind: str
    model_dir: Path | None
    weights_file: Path | None
    run_dir: Path | None
    policy_version: int | None


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file())


def _has_tokenizer(p: Path) -> bool:
    return any((p / f).is_file() for f in TOKENIZER_FILES)


def _is_run_dir(p: Path) -> bool:
    return (p / "config.yaml").is_file() or any((p / d).is_dir() for d in ("checkpoint", "final_model", "weights"))


def _json_int(path: Path, key: str) -> int | None:
    try:
        return int(json.loads(path.read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _model_source(p: Path, kind: str, run_dir: Path | None) -> CheckpointSource:
    if has_peft_names(p):
        final = (run_dir / "final_model") if run_dir else None
        hint = f"evaluate {final} instead" if final and final.is_dir() else \
            "a LoRA run leaves <run dir>/final_model/ (the merged policy) when it finishes"
        raise ValueError(f"{p} holds LoRA adapters under peft's names, not a plain model: {hint}")
    version = _json_int(p / "trainer_state.json", "policy_version")
    if version is None and run_dir is not None and p.name == "final_model":
        version = _json_int(run_dir / "DONE", "policy_version")
    weights = None
    if not _has_tokenizer(p):
        if not (p / "model.safetensors").is_file():
            raise ValueError(f"{p} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and a sharded model: "
                             "copy the base model's tokenizer files into it")
        weights = p / "model.safetensors"  # loaded into the config's model, whose tokenizer it shares
    return CheckpointSource(p, kind, None if weights else p, weights, run_dir, version)


def resolve_checkpoint(path: Path) -> CheckpointSource:
    """What `path` holds, decided from what exists.

    - a run directory (config.yaml, checkpoint/, final_model/ or weights/): its final_model/ (a
      finished LoRA run's merged policy) if present, else checkpoint/ (else .checkpoint-old/, left by
      a crash mid-save), else its newest published weights file;
    - an HF model directory (config.json + model.safetensors or its index): loaded as model.name;
      without tokenizer files its model.safetensors is loaded into the config's model instead;
    - a .safetensors weights file (weights/policy-vN.safetensors, full or LoRA adapter): loaded
      into the config's model with `load_weights`.
    Raises ValueError (a usage error, with what was expected) for anything else.
    """
    from opsd.weights import published_versions, weights_path

    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ValueError(f"--checkpoint {path}: no such file or directory")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"--checkpoint {path} is a file but not a .safetensors weights file")
        m = _VERSION.fullmatch(p.name)
        run_dir = p.parent.parent if p.parent.name == "weights" else None
        return CheckpointSource(p, "weights", None, p, run_dir, int(m.group(1)) if m else None)
    if _is_model_dir(p):
        parent = p.parent
        in_run = p.name in ("checkpoint", ".checkpoint-old", "final_model") or (parent / "config.yaml").is_file()
        return _model_source(p, "model", parent if in_run else None)
    if _is_run_dir(p):
        problems = []
        for sub in ("final_model", "checkpoint", ".checkpoint-old"):
            if _is_model_dir(p / sub):
                try:
                    return _model_source(p / sub, "run", p)
                except ValueError as e:  # e.g. a crash mid-save: fall back to the older one
                    problems.append(str(e))
        if problems:
            raise ValueError(f"--checkpoint {path}: no usable checkpoint: {'; '.join(problems)}")
        versions = published_versions(p)
        if versions:
            return CheckpointSource(p, "run", None, weights_path(p, versions[-1]), p, versions[-1])
        raise ValueError(f"--checkpoint {path} looks like a run directory but holds no checkpoint/, final_model/ "
                         "or weights/policy-v*.safetensors to evaluate")
    raise ValueError(f"--checkpoint {path} is neither a run directory (with checkpoint/ or final_model/), "
                     "an HF model directory (config.json + model.safetensors), nor a .safetensors weights file")
