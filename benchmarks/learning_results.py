"""The raw results files of `benchmarks/learning.py` (issue 41): one small JSON file per (method, training seed),
RDIR/<method>-seed<S>.json, and one for the step-0 policy, RDIR/untrained.json (RDIR/start.json with --init),
meant to be committed so that `--table` recomputes every number of the report from them alone.

A file (`ResultsFile`): {"method", "seed" (null: the step-0 policy), "config_hash", the experiment's header
("config" (the shared base config), "run_steps", "teacher_steps", "compute_matched", "ppo_epochs", with --init
"init"), "metric", "teacher" (a student's: {"method": "grpo", "seed", "step"}), "steps": {policy version:
{"value", "lo", "hi", "n", "episodes": [{task_id, category, episode, reward, won, turns}], "errors"}},
"training": per-step records (success, mixed groups, episodes, generated, sequence and teacher-forward tokens,
credit diagnostics, ...), "compute" ({"own"}: `stats.training_compute`; a student's "teacher" and "with_teacher"
add GRPO seed S's training up to teacher_steps), "seconds" ({"train", "eval"}), "missing_steps", "complete"}.

`read_results` validates every file (types, ranges, the name against its method and seed, the config hash
against the header it was computed from, a header that --compute-matched without --teacher cannot write,
training steps 0, 1, 2, ... in order with their policy versions and one for every evaluated step, each game's
episodes 0..eval.episodes_per_task-1 once, each evaluation's n, value and interval against its episodes, the
evaluated and missing steps against the experiment's, a complete file's final evaluation and training records,
a student's teacher of its own seed) and the folder (every evaluation played the same games, one metric, each
teacher trained to its students' step), and stops naming the file and the field: a hand edit or a partial copy
never turns into a silently wrong table. Not checked: `won` against `reward` (their relation is the env's), an
interval's bounds (the evaluation's bootstrap), and the "compute" block (the table recomputes compute from the
training records).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

METHODS = ("grpo", "agentopsd", "alignopsd", "opd", "gc_opd")
START_METHODS = ("untrained", "start")  # the step-0 policy's record: the config's model, or --init's checkpoint
HEADER_KEYS = ("config", "run_steps", "teacher_steps", "compute_matched", "ppo_epochs", "init")

# Rewards and held-out values are fractions (every env's reward lies in [0, 1]; WebShop's score is scaled).
Unit = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, strict=True)]
Count = Annotated[float, Field(ge=0.0, le=1e18, allow_inf_nan=False, strict=True)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
Steps = Annotated[StrictInt, Field(ge=1, le=1_000_000)]  # training steps of one run


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # later fields (a new diagnostic) do not invalidate older files


class Episode(_Open):
    """One held-out episode: its game, its index within the game, its reward and outcome."""
    task_id: str = Field(min_length=1)
    episode: NonNegInt
    reward: Unit
    won: StrictBool
    turns: NonNegInt


class TaskError(_Open):
    """A held-out task that failed (its episodes are not played): the game and the error."""
    task_id: str = Field(min_length=1)
    error: str


class Evaluation(_Open):
    """One evaluated policy version: the value and its 95% interval (None when every task failed), episodes."""
    value: Unit | None
    lo: Unit | None
    hi: Unit | None
    n: NonNegInt
    episodes: list[Episode]
    errors: list[TaskError]

    @model_validator(mode="after")
    def _interval_holds_value(self):
        if None not in (self.value, self.lo, self.hi) and not self.lo - 1e-9 <= self.value <= self.hi + 1e-9:
            raise ValueError(f"the interval [{self.lo}, {self.hi}] does not hold the value {self.value}")
        return self


class TrainingStep(_Open):
    """One training step's record: the fields the report reads (counts >= 0, rates in [0, 1]; None: not measured)."""
    step: NonNegInt
    policy_version: NonNegInt | None = None
    episodes: Count | None = None
    generated_tokens: Count | None = None
    sequence_tokens: Count | None = None
    teacher_forward_tokens: Count | None = None
    success_rate: Unit | None = None
    mixed_groups: NonNegInt | None = None

    @model_validator(mode="after")
    def _diagnostics_are_numbers(self):
        for key, value in (self.model_extra or {}).items():  # credit diagnostics, loss, ...; "teacher": its names
            if key != "teacher" and value is not None and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise ValueError(f"{key} is {value!r}: a finite number or null expected")
        return self


class TeacherRef(_Open):
    method: Literal["grpo"]
    seed: NonNegInt
    step: Annotated[StrictInt, Field(ge=1)]


class InitRef(_Open):
    """--init's start: the sha256 of its weights and its folder's name."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str


class ConfigPart(_Open):
    """The parts of the header's base config the report reads."""
    env: dict = {}
    trainer: dict = {}


class Seconds(_Open):
    train: Count
    eval: Count


class ResultsFile(_Open):
    """A results file's schema (the module docstring lists its fields)."""
    method: Literal[METHODS + START_METHODS]
    seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None  # numpy's seed range, as --seeds
    config_hash: str = Field(pattern=r"^[0-9a-f]{16}$")
    config: ConfigPart
    init: InitRef | None = None
    run_steps: Steps
    teacher_steps: Steps | None
    compute_matched: StrictBool
    ppo_epochs: Annotated[StrictInt, Field(ge=1)]
    metric: Literal["success", "em", "score", "f1"] | None = None  # services/rollout/evaluate.py's METRICS
    teacher: TeacherRef | None
    steps: dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")], Evaluation]
    training: list[TrainingStep]
    seconds: Seconds
    missing_steps: list[Steps] = []
    complete: StrictBool


def config_hash(header: dict) -> str:
    """16 hex digits of sha256 over the experiment's identity (`header`: base config, run steps, teacher steps,
    compute-matched, PPO epochs, --init's identity): results files with the same hash come from the same
    experiment and can be compared."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:16]


def results_path(results: Path, method: str, seed: int | None) -> Path:
    """RDIR/<method>-seed<S>.json; the step-0 policy's (seed None, method "untrained" or "start" with --init):
    RDIR/<method>.json."""
    return results / (f"{method}.json" if seed is None else f"{method}-seed{seed}.json")


def _problem(path: Path, rec: dict) -> str | None:
    """What is wrong with a parsed results file beyond its schema, or None."""
    if (rec["seed"] is None) != (rec["method"] in START_METHODS):
        return f"method {rec['method']!r} with seed {rec['seed']!r} (only untrained/start have no seed)"
    if path.name != results_path(path.parent, rec["method"], rec["seed"]).name:
        return (f"holds method {rec['method']!r} seed {rec['seed']!r}, whose file is "
                f"{results_path(path.parent, rec['method'], rec['seed']).name}")
    if rec["compute_matched"] and rec["teacher_steps"] is None:
        return "compute_matched without teacher_steps (--compute-matched needs --teacher)"
    teacher = rec["teacher"]
    student = rec["seed"] is not None and rec["method"] != "grpo" and rec["teacher_steps"] is not None
    if teacher is None and student and (rec["training"] or rec["steps"] or rec["complete"]):
        return f"no teacher: a {rec['method']} student of the teacher experiment learns from GRPO seed {rec['seed']}"
    if teacher is not None and not student:
        return f"has a teacher, but {rec['method']} {'is the teacher' if rec['method'] == 'grpo' else 'has none here'}"
    if teacher is not None and (teacher["seed"] != rec["seed"] or teacher["step"] != rec["teacher_steps"]):
        return (f"teacher is GRPO seed {teacher['seed']} step {teacher['step']}; seed {rec['seed']}'s students "
                f"learn from GRPO seed {rec['seed']} at teacher_steps {rec['teacher_steps']}")
    steps = [t["step"] for t in rec["training"]]
    if steps != list(range(len(steps))):
        return f"training: steps {steps} are not 0, 1, 2, ... in order (a training record lost or repeated)"
    versions = [t.get("policy_version") for t in rec["training"]]
    if any(v is not None and v != k + 1 for k, v in enumerate(versions)):
        return f"training: policy versions {versions} are not step + 1 (step k trains version k + 1)"
    if rec["steps"] and not rec.get("metric"):
        return "evaluations without a metric (success, f1, score, ...)"
    every = rec["config"].get("trainer", {}).get("snapshot_every")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
        return f"config.trainer.snapshot_every is {every!r}: an integer >= 0 expected"
    evaluated = sorted(int(k) for k in rec["steps"])
    extra = [k for k in evaluated if not may_evaluate(rec, k)]
    if extra:
        return f"steps: {', '.join(map(str, extra))} evaluated, not one of the experiment's policy versions"
    if rec["seed"] is not None and evaluated and len(rec["training"]) < evaluated[-1]:
        return (f"step {evaluated[-1]} evaluated, but {len(rec['training'])} training records (each step's is written "
                "before its policy is evaluated)")
    missing = rec.get("missing_steps", [])
    if len(set(missing)) != len(missing) or set(missing) & set(evaluated) or not all(may_evaluate(rec, k) for k in missing):
        return f"missing_steps {missing}: each once, not evaluated, and one of the experiment's policy versions"
    per_game = (rec["config"].get("eval") or {}).get("episodes_per_task")
    if not isinstance(per_game, int) or isinstance(per_game, bool) or per_game < 1:
        per_game = None  # the header does not say: not checked
    for version, ev in rec["steps"].items():
        problem = _evaluation_problem(ev, rec.get("metric"), per_game)
        if problem:
            return f"steps.{version}: {problem}"
    header = {k: rec[k] for k in HEADER_KEYS if k in rec}
    if config_hash(header) != rec["config_hash"]:
        return (f"config_hash {rec['config_hash']} is not the hash of its header ({config_hash(header)}): "
                "the config, steps or start were edited after the run")
    if rec["complete"]:
        lacking = sorted(final_steps(rec) - {int(k) for k in rec["steps"]} - set(rec.get("missing_steps", [])))
        if lacking:
            return (f"complete, but step {', '.join(map(str, lacking))} is neither evaluated (steps) nor listed in "
                    "missing_steps: an evaluation lost")
        trained = max(final_steps(rec)) if rec["seed"] is not None else 0
        if len(rec["training"]) != trained:
            return f"complete, but {len(rec['training'])} training records for {trained} steps"
    return None


def final_steps(rec: dict) -> set[int]:
    """The policy versions a complete results record must hold (or list in missing_steps): 0 for the step-0 record;
    run_steps for a method (`benchmarks/learning.py` refuses a run.steps that is not a multiple of
    trainer.snapshot_every, so its final policy is always evaluated); GRPO with a teacher also teacher_steps and,
    compute-matched, teacher_steps + run_steps."""
    if rec["seed"] is None:
        return {0}
    out = {rec["run_steps"]}
    if rec["method"] == "grpo" and rec["teacher_steps"] is not None:
        out |= {rec["teacher_steps"]} | ({rec["teacher_steps"] + rec["run_steps"]} if rec["compute_matched"] else set())
    return out


def may_evaluate(rec: dict, step: int) -> bool:
    """Whether policy version `step` is one a results record may hold: 0 for the step-0 record; for a method
    `final_steps` and every multiple of the header's trainer.snapshot_every up to run_steps (any step up to
    run_steps when the header does not give snapshot_every)."""
    if rec["seed"] is None:
        return step == 0
    every = rec["config"].get("trainer", {}).get("snapshot_every")
    return step in final_steps(rec) or (1 <= step <= rec["run_steps"] and (not every or step % every == 0))


def _evaluation_problem(ev: dict, metric: str | None, per_game: int | None) -> str | None:
    """What disagrees within one evaluation: each (game, episode) once and, with `per_game` (eval.episodes_per_task),
    each game's episodes 0..per_game-1; n is its number of episodes; the value is the mean episode value (won as
    0/1 for "success", the reward for "em", "f1" and "score" (a fraction here), None without episodes), with an
    interval exactly when it has a value. The bounds are not recomputed (the evaluation's bootstrap)."""
    seen = [(e["task_id"], e["episode"]) for e in ev["episodes"]]
    if len(set(seen)) != len(seen):
        return "an episode listed twice (task_id, episode) — each is played once"
    if per_game is not None:
        counts = Counter(game for game, _ in seen)
        bad = sorted({game for game, episode in seen if episode >= per_game or counts[game] != per_game})
        if bad:
            return f"game {bad[0]} has not episodes 0..{per_game - 1} (config.eval.episodes_per_task {per_game})"
    if ev["n"] != len(ev["episodes"]):
        return f"n is {ev['n']}, but {len(ev['episodes'])} episodes are listed"
    if (ev["value"] is None) != (ev["lo"] is None) or (ev["value"] is None) != (ev["hi"] is None):
        return f"value {ev['value']} with interval [{ev['lo']}, {ev['hi']}]: both given, or neither"
    if metric is not None:
        of = (lambda e: float(e["won"])) if metric == "success" else (lambda e: e["reward"])  # noqa: E731
        mean = sum(map(of, ev["episodes"])) / len(ev["episodes"]) if ev["episodes"] else None
        if (mean is None) != (ev["value"] is None) or (mean is not None and abs(mean - ev["value"]) > 1e-9):
            return f"value is {ev['value']}, but the episodes listed give {mean if mean is None else round(mean, 6)}"
    return None


def read_results(results: Path) -> list[dict]:
    """Every results file in `results` (*.json but dot-files; none when the folder does not exist), validated as
    the module docstring lists (each file, then the folder: the same games, one metric, teachers trained to their
    students' step, one step-0 record). Returns the parsed dicts. SystemExit naming the file and the problem: not
    a regular file or not JSON, a field of the wrong type or range, a name that does not match, an edited header,
    a record that contradicts itself or the folder."""
    out = []
    for path in sorted(p for p in results.glob("*.json") if not p.name.startswith(".")) if results.is_dir() else []:
        if not path.is_file():  # a FIFO would block the read; a directory or a link loop is no file either
            raise SystemExit(f"{path}: not a learning results file (not a regular file)")
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise SystemExit(f"{path}: not a learning results file ({type(e).__name__}: {e})") from None
        if not isinstance(rec, dict):
            raise SystemExit(f"{path}: not a learning results file (a JSON object expected)")
        try:
            ResultsFile.model_validate(rec)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise SystemExit(f"{path}: not a valid learning results file: {where}: {first['msg']}"
                             + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else "")) from None
        problem = _problem(path, rec)
        if problem:
            raise SystemExit(f"{path}: {problem}")
        out.append(rec)
    _same_games(out, results)
    _consistent(out, results)
    starts = [results_path(results, r["method"], None).name for r in out if r["seed"] is None]
    if len(starts) > 1:
        raise SystemExit(f"{results}: two step-0 records ({', '.join(starts)}): one experiment per folder")
    return out


def _consistent(recs: list[dict], results: Path) -> None:
    """SystemExit unless the folder's records agree with each other: one metric, and each student's teacher
    (GRPO of its seed) trained at least to the step the student learned from."""
    metrics = {r["metric"]: r for r in recs if r.get("metric")}
    if len(metrics) > 1:
        names = ", ".join(f"{m} ({results_path(results, r['method'], r['seed']).name})" for m, r in metrics.items())
        raise SystemExit(f"{results}: the results measure different metrics: {names}")
    grpo = {r["seed"]: r for r in recs if r["method"] == "grpo"}
    for r in recs:
        t = r["teacher"]
        if t is not None and t["seed"] in grpo and len(grpo[t["seed"]]["training"]) < t["step"]:
            raise SystemExit(f"{results_path(results, r['method'], r['seed'])}: its teacher is GRPO seed {t['seed']} at "
                             f"step {t['step']}, but {results_path(results, 'grpo', t['seed']).name} holds "
                             f"{len(grpo[t['seed']]['training'])} training records")


def _same_games(recs: list[dict], results: Path) -> None:
    """SystemExit unless every evaluation in `recs` played the same held-out games (a failed task, in "errors",
    counts as played): the paired comparison pairs game by game, so a file with a game removed, renamed or added
    would shift every mean and interval without a word."""
    first = None
    for rec in recs:
        for version, ev in rec["steps"].items():
            games = {e["task_id"] for e in ev["episodes"] + ev["errors"]}
            where = f"{results_path(results, rec['method'], rec['seed'])}: steps.{version}"
            if first is None:
                first = (games, where)
            elif games != first[0]:
                diff = sorted(str(g) for g in games ^ first[0])
                raise SystemExit(f"{where}: its held-out games differ from {first[1]}'s ({len(diff)} differ, e.g. "
                                 f"{', '.join(diff[:3])}): every method and seed plays the same games")


def write_results(results: Path, rec: dict) -> Path:
    """Write `rec` to its `results_path` atomically, compact (a file stays well under 200 KB: no weights, one
    short row per held-out episode)."""
    path = results_path(results, rec["method"], rec["seed"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(rec, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def new_record(header: dict, method: str, seed: int | None) -> dict:
    """An empty results record of (method, seed) in the experiment `header` (see the module docstring)."""
    return {"method": method, "seed": seed, "config_hash": config_hash(header), **header, "teacher": None,
            "steps": {}, "training": [], "compute": None, "seconds": {"train": 0.0, "eval": 0.0}, "complete": False}

