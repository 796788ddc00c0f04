"""The run directory's record: metrics.jsonl (one line a step), a PNG of the curves, and what a line holds."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import matplotlib
import numpy as np

from opsd.config import RunConfig
from opsd.credit.diagnostics import teacher_verifier_metrics, trajectory_scores
from opsd.models.hub import COMMIT, read_run_models, resolve_model
from opsd.types import RolloutGroup, ScoredGroup

log = logging.getLogger(__name__)
matplotlib.use("Agg")  # headless: no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PLOTTED = (  # (metrics.jsonl key(s), panel title, y-axis label, fixed y range or None)
    (("success_rate", "reward_mean"), "success rate and mean reward", "per episode", (0.0, 1.0)),
    (("format_valid_rate",), "format-valid turns", "share of turns", (0.0, 1.0)),
    (("loss",), "policy loss", "PPO loss", None),
    (("teacher_student_gap",), "teacher - student log-prob", "nats / token", None),
    (("privileged_signal",), "privileged signal (gold-action turns minus others)", "nats / token", None),
    (("mean_span_length",), "mean AlignOPSD span", "turns", None),
)


def summarize(
    groups: list[RolloutGroup], scored: list[ScoredGroup] | None, prompt_buckets: list[int] | None = None
) -> dict[str, float]:
    """Rollout and teacher statistics of a step (rates in [0, 1], gaps in nats per loss token; success also
    per task category, keys "success/<category>"). With a teacher, the teacher-verifier disagreement
    diagnostics ("teacher_verifier/<bucket>/...", opsd/credit/diagnostics.py) over the prompt-length buckets
    cut at `prompt_buckets` (tokens; None: none, "all" only)."""
    trajs = [t for g in groups for t in g.trajectories]
    turns = [k for t in trajs for k in t.turns]
    out = {
        "episodes": len(trajs),
        "turns": len(turns),
        "reward_mean": float(np.mean([t.reward for t in trajs])) if trajs else 0.0,
        "success_rate": float(np.mean([t.won for t in trajs])) if trajs else 0.0,
        "format_valid_rate": float(np.mean([k.format_valid for k in turns])) if turns else 0.0,
        "truncated_turn_rate": float(np.mean([k.finish_reason == "length" for k in turns])) if turns else 0.0,
        # A reply cut by the token cap is truncated, not a format error (bad-input case 16).
        "format_error_rate": float(np.mean([k.format_error for k in turns])) if turns else 0.0,
        "mixed_groups": sum(len({t.reward for t in g.trajectories}) > 1 for g in groups),
        "rollout_seconds": float(sum(g.rollout_seconds for g in groups)),
        "generated_tokens": int(sum(t.loss_mask_S.sum() for t in trajs)),
        # Every trajectory's tokens (prompts, observations, responses): the rollout runs each through the model
        # at least once, the trainer once per PPO epoch (compute counted, issue 41).
        "sequence_tokens": int(sum(t.token_ids_S.shape[0] for t in trajs)),
    }
    # Per task category (ALFWorld task type, Search data source, ...): "success/<category>".
    by_category: dict[str, list[bool]] = {}
    for g in groups:
        by_category.setdefault(g.task.category or "all", []).extend(t.won for t in g.trajectories)
    for category, won in sorted(by_category.items()):
        out[f"success/{category}"] = float(np.mean(won))
    if scored:
        gap = corr = n = 0.0
        for sg in scored:
            for t, lp, clp in zip(sg.rollout.trajectories, sg.teacher_logprobs_S, sg.corrected_logprobs_S):
                m = t.loss_mask_S == 1
                gap += float((lp[m] - t.sampler_logprobs_S[m]).sum())
                corr += float((clp[m] - t.sampler_logprobs_S[m]).sum())
                n += float(m.sum())
        out["teacher_student_gap"] = gap / max(n, 1.0)
        out["corrected_gap"] = corr / max(n, 1.0)
        out["teacher_seconds"] = float(sum(sg.teacher_seconds for sg in scored))
        # Tokens the teacher ran through its model (compute counted, issue 41): privileged prefixes, every view,
        # matched continuations and its own generations (`ScoredGroup.teacher_forward_tokens`).
        out["teacher_forward_tokens"] = int(sum(sg.teacher_forward_tokens for sg in scored))
        # Which teacher scored the step's groups, and the policy versions it held (self: the groups' own).
        out["teacher"] = sorted({sg.teacher or "self:live" for sg in scored})
        out["teacher_version_min"] = min(sg.teacher_version for sg in scored)
        out["teacher_version_max"] = max(sg.teacher_version for sg in scored)
        out["embedder_fallbacks"] = sum(sg.identity_fallback for sg in scored)
        out["matched_turn_rate"] = float(np.mean([bool(s) for sg in scored for s in sg.selected_sources_M])) if turns else 0.0
        out.update(privileged_signal(scored))
        out.update(teacher_verifier(scored, prompt_buckets or []))
    return out


def model_records(run_dir: Path, cfg: RunConfig) -> dict[str, dict]:
    """What metrics.jsonl's first line records about the models: "model" and, when an external teacher scores,
    "teacher_model", each {"name", "revision", "commit", "path"} (opsd.models.hub.ResolvedModel.record).

    Those `opsd run` resolved for the run (<run_dir>/model.json: the revision as asked, not the commit the run's
    config.yaml pins); without that file (roles started one by one: compose, k8s) the trainer's own resolution
    of its policy, and the teacher's config (its path null: the trainer does not hold the teacher's files).
    """
    recorded = read_run_models(run_dir)
    if recorded is not None:
        return recorded
    out = {"model": resolve_model(cfg.model).record()}
    if cfg.needs_teacher and cfg.teacher.source == "model":
        t = cfg.teacher.model
        pinned = t.revision if t.revision is not None and COMMIT.fullmatch(t.revision) else None
        out["teacher_model"] = {"name": t.name, "revision": t.revision, "commit": pinned, "path": None}
    return out


def teacher_verifier(scored: list[ScoredGroup], prompt_buckets: list[int]) -> dict[str, float]:
    """The step's teacher-verifier diagnostics over the trajectories `trajectory_scores` can rank; see
    opsd.credit.diagnostics.teacher_verifier_metrics."""
    rows = [(g, r, s, p) for g, sg in enumerate(scored) for r, s, p in trajectory_scores(sg)]
    group_N, reward_N, score_N, prompt_N = (np.asarray(col) for col in (zip(*rows) if rows else ([],) * 4))
    try:
        return teacher_verifier_metrics(reward_N, score_N, group_N, prompt_N, prompt_buckets)
    except ValueError as e:  # a report, never a reason to lose a step that has been trained
        log.warning("teacher-verifier diagnostics skipped this step: %s", e)
        return {}


def _norm(action: str) -> str:
    # As the envs compare commands (twx.clean_action, alfworld._normalize): case, whitespace runs and a
    # trailing period do not make "take coin." a different command from "take coin".
    return " ".join(action.lower().split()).rstrip(".").strip()


def privileged_signal(scored: list[ScoredGroup]) -> dict[str, float | int | None]:
    """Does the teacher's privileged context carry signal? Over the turns where the env knew the
    hint (`TurnRecord.hint`, the remaining gold path), the mean per-turn teacher - student gap
    (identity view minus sampler log-probs, averaged over the turn's loss tokens; nats/token) on
    turns whose action is the hint's next command, minus the same mean on the other turns.

    A teacher that uses its context favours the gold command: the signal is positive. Near 0 the
    teacher scores gold and other actions alike (issue 8: SmolLM2-135M barely reads its privileged
    context). Returns {"privileged_signal": float | None (None when either set of turns is empty),
    "hint_match_turns": int, "hint_other_turns": int}.
    """
    match: list[float] = []
    other: list[float] = []
    for sg in scored:
        for t, lp_S in zip(sg.rollout.trajectories, sg.teacher_logprobs_S):
            for rec in t.turns:
                sl = slice(rec.response_start, rec.response_end)
                m = t.loss_mask_S[sl] == 1
                if not rec.hint or not m.any():
                    continue
                gap = float((lp_S[sl][m] - t.sampler_logprobs_S[sl][m]).mean())
                hit = rec.format_valid and _norm(rec.action) == _norm(rec.hint[0])
                (match if hit else other).append(gap)
    signal = float(np.mean(match) - np.mean(other)) if match and other else None
    return {"privileged_signal": signal, "hint_match_turns": len(match), "hint_other_turns": len(other)}


def _line(record: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean) + "\n"


def append_metrics(run_dir: Path, record: dict) -> None:
    """Append one step's record to metrics.jsonl (non-finite values written as null, never NaN)."""
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(_line(record))


def write_records(path: Path, records: list[dict]) -> None:
    """Replace the JSON-lines file `path` with `records` atomically (temp file + rename; nulls for non-finite)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(_line(r) for r in records))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl` ([] without the file); a torn last line (a crash mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def metric_panels(rows: list[dict]) -> list[tuple[str, str, tuple[float, float] | None, dict[str, list]]]:
    """The metrics.png panels of metrics.jsonl `rows`: (title, y label, y range, {curve name: [(step, value)]}) for
    each PLOTTED entry the rows record. Success and mean reward share a panel and become one curve, named
    "success_rate = reward_mean", when they are equal at every step (0/1 rewards). The y range is the fixed
    one for rates, else at least max(0.1, a quarter of the values' size) wide around them (so noise does not
    look like a trend)."""
    panels = []
    for keys, title, ylabel, ylim in PLOTTED:
        curves = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        curves = {k: pts for k, pts in curves.items() if pts}
        if not curves:
            continue
        if len(curves) == 2 and curves[keys[0]] == curves[keys[1]]:
            curves = {f"{keys[0]} = {keys[1]}": curves[keys[0]]}
        values = [v for pts in curves.values() for _, v in pts]
        mid = (max(values) + min(values)) / 2
        width = max(0.1, 0.25 * abs(mid))  # a span of 3.875-4.0 turns is not a trend
        if ylim is None and max(values) - min(values) < width:
            ylim = (mid - width / 2, mid + width / 2)
        panels.append((title, ylabel, ylim, curves))
    return panels


def plot_metrics(run_dir: Path) -> Path:
    """Write <run_dir>/metrics.png: one panel per `metric_panels` entry, each with its y-axis label."""
    panels = metric_panels(read_metrics(run_dir)) or [("no steps yet", "", None, {})]
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 3.3 * nrows), squeeze=False)
    for ax, (title, ylabel, ylim, curves) in zip(axes.flat, panels):
        for name, pts in curves.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if ylim is not None:
            ax.set_ylim(ylim[0] - 0.03 * (ylim[1] - ylim[0]), ylim[1] + 0.03 * (ylim[1] - ylim[0]))
        if len(curves) > 1 or any(" = " in name for name in curves):  # say which curves are drawn, or merged
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"opsd run: {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(run_dir) / "metrics.png"
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out
