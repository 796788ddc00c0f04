"""What the trainer sends to the experiment trackers (run.report_to, opsd/tracking.py), and when.

Each step's `StepReport` (its metrics.jsonl values, histograms, sampled trajectories) is staged in
<run_dir>/tracking/step_NNNNN.json when the step ends, and sent once the checkpoint that holds the step is
on disk. A resumed run trains the steps after its checkpoint again: sending only checkpointed steps means
no tracker receives a step twice, or a value metrics.jsonl no longer holds. The trackers trail by the
checkpoint write (trainer.checkpoint_every 1, the default below 1B parameters: seconds) or by up to
checkpoint_every steps; metrics.jsonl, /metrics and Grafana are live.

Sending runs on a thread of its own, so a slow or unreachable tracker never holds a training step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from opsd.config import RunConfig
from opsd.tracking import Histogram, StepReport, Trackers, read_state, scalars, write_state
from opsd.types import RolloutGroup, ScoredGroup

log = logging.getLogger("trainer")
STAGED = "tracking"  # <run_dir>/tracking/step_NNNNN.json: reports of steps not yet sent


def step_report(record: dict, advantages_ML: np.ndarray, loss_mask_ML: np.ndarray,
                trajectory_advantages: dict[tuple[int, int], np.ndarray], distributions: dict[str, np.ndarray],
                groups: list[RolloutGroup], scored: list[ScoredGroup] | None, cfg: RunConfig) -> StepReport:
    """The trackers' report of one step.

    record: the step's metrics.jsonl record; advantages_ML / loss_mask_ML: the trained advantages and their
    mask (float32 [M, L]); trajectory_advantages: (group, trajectory) -> float32 [S] token advantages;
    distributions: compute_advantages' arrays (AlignOPSD span lengths in turns). Histograms (cfg.tracking.
    histogram_bins bins): histograms/advantages (per loss token), histograms/teacher_student_gap (teacher minus
    sampler log-prob per loss token, nats; with a teacher), histograms/span_turns (AlignOPSD). The table: up
    to cfg.tracking.trajectories_per_step trajectories drawn with a generator seeded by (run.seed, step) (a step
    trained again draws the same ones), text cut at cfg.tracking.table_chars.
    """
    t = cfg.tracking
    hists = {"histograms/advantages": Histogram.of(advantages_ML[loss_mask_ML > 0], t.histogram_bins)}
    if scored:
        gaps = [lp[tr.loss_mask_S == 1] - tr.sampler_logprobs_S[tr.loss_mask_S == 1]
                for sg in scored for tr, lp in zip(sg.rollout.trajectories, sg.teacher_logprobs_S)]
        hists["histograms/teacher_student_gap"] = Histogram.of(np.concatenate(gaps) if gaps else np.zeros(0), t.histogram_bins)
    if "alignopsd/span_turns" in distributions:
        hists["histograms/span_turns"] = Histogram.of(distributions["alignopsd/span_turns"], t.histogram_bins)
    keys = [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.trajectories))]
    rng = np.random.default_rng([cfg.run.seed, record["step"]])
    picked = sorted(rng.choice(len(keys), size=min(t.trajectories_per_step, len(keys)), replace=False)) if keys else []
    rows = [trajectory_row(record["step"], groups[keys[j][0]], keys[j][1], trajectory_advantages.get(keys[j]), t.table_chars)
            for j in picked]
    return StepReport(record["step"], scalars(record), {k: h for k, h in hists.items() if h is not None}, rows)


def trajectory_row(step: int, group: RolloutGroup, index: int, advantages_S: np.ndarray | None, chars: int) -> list:
    """One table row (opsd.tracking.TABLE_COLUMNS): step, task ("<task id> [<category>]"), group id, rollout id,
    turns, the actions joined by " | " ("(invalid)" for a turn without one), reward, won, and each turn's mean
    advantage over its loss tokens (4 decimals; 0 for a turn without loss tokens)."""
    traj = group.trajectories[index]
    per_turn = []
    for turn in traj.turns:
        sl = slice(turn.response_start, turn.response_end)
        m = traj.loss_mask_S[sl] == 1
        per_turn.append(round(float(advantages_S[sl][m].mean()), 4) if advantages_S is not None and m.any() else 0.0)
    task = f"{group.task.task_id} [{group.task.category}]" if group.task.category else group.task.task_id
    actions = " | ".join(turn.action if turn.format_valid else "(invalid)" for turn in traj.turns)
    cut = lambda s: s if len(s) <= chars else s[: chars - 1] + "…"  # noqa: E731
    return [step, cut(task), group.task.group_id, traj.rollout_id, len(traj.turns), cut(actions),
            float(traj.reward), bool(traj.won), cut(json.dumps(per_turn))]


def stage_report(reporter: "Reporter", record: dict, result, groups: list[RolloutGroup],
                 scored: list[ScoredGroup] | None, cfg: RunConfig) -> None:
    """Stage the step's report (`step_report` of a services.trainer.step.StepResult `result`). A report that
    cannot be built (a bug, odd data) costs its histograms and table, never the step: the scalars are staged
    alone then; a staging file that cannot be written (a full disk) is logged and the step not sent."""
    try:
        try:
            report = step_report(record, result.advantages_ML, result.batch.loss_mask_ML, result.trajectory_advantages,
                                 result.distributions, groups, scored, cfg)
        except Exception as e:  # noqa: BLE001 - reporting never stops training
            log.warning("step %d: the trackers' histograms and table failed (%s: %s); sending its scalars only",
                        record["step"], type(e).__name__, e)
            report = StepReport(record["step"], scalars(record))
        reporter.stage(report)
    except OSError as e:
        log.warning("step %d: could not stage its tracker report (%s); the trackers skip it", record["step"], e)


class Reporter:
    """Sends staged step reports to the run's trackers on a thread of its own (see the module docstring).

    cfg: the run's config (run.report_to, tracking); config: the resolved config as JSON data with the model
    record (what the trackers show as the run's config); resumed_step: the step the trainer starts at (its
    checkpoint's; 0 for a new run): steps before it are in the checkpoint, steps from it on run again, so
    their staged reports are deleted; records: metrics.jsonl records of the steps before it (a tracker that
    has not received one of them, e.g. added on resume, gets its values from here when no staged report is
    left); checkpoint: the checkpoint resumed (its copy of trackers.json, when the run directory has none).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, config: dict, resumed_step: int, records: list[dict],
                 checkpoint: Path | None = None):
        self.cfg, self.run_dir, self.config = cfg, Path(run_dir), config
        self.dir = self.run_dir / STAGED
        self.dir.mkdir(exist_ok=True)
        for f in self.dir.glob("step_*.json"):
            if _step_of(f) is None or _step_of(f) >= resumed_step:
                f.unlink()
        self.records = {r["step"]: r for r in records if isinstance(r.get("step"), int) and r["step"] < resumed_step}
        self.state = read_state(self.run_dir) or (read_state(checkpoint) if checkpoint is not None else {})
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(resumed_step,), name="trackers", daemon=True)
        self.thread.start()

    def stage(self, report: StepReport) -> None:
        """Keep `report` until the checkpoint holding its step is written (a file: a crash in between loses nothing)."""
        path = self.dir / f"step_{report.step:05d}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(report.to_json()))
        os.replace(tmp, path)

    def commit(self, checkpoint_step: int) -> None:
        """A checkpoint of `checkpoint_step` (TrainerState.step: it holds steps < checkpoint_step) is on disk:
        send those steps. Thread-safe (the checkpoint writer's thread calls it)."""
        self.queue.put(checkpoint_step)

    def close(self, finished: bool, timeout_s: float = 120.0) -> None:
        """Send what is committed, close the trackers (W&B and MLflow mark the run finished, or not), and stop the
        thread; a tracker still busy after `timeout_s` is left behind with a warning."""
        self.queue.put(("close", finished))
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("the trackers did not finish within %.0f s; leaving them", timeout_s)

    def _run(self, resumed_step: int) -> None:
        durable = self.state.setdefault("sent_through", {})
        tb = durable.get("tensorboard")
        trackers = Trackers(list(self.cfg.run.report_to), self.cfg.tracking, self.run_dir, self.config, self.state,
                            "trainer", purge_step=tb + 1 if tb is not None else 0)
        self.state.update(trackers.state())
        self._save()
        self.logged = {t.name: durable.get(t.name, -1) for t in trackers.open}  # handed to the tracker's library
        self.pending: list[tuple[float, str, int]] = []  # (when it is durable, tracker, step)
        self._send(trackers, resumed_step)
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                self._confirm(time.monotonic())
                continue
            if isinstance(item, tuple):
                trackers.close(finished=item[1])
                self._confirm(math.inf)  # closed: W&B's finish wrote everything out
                return
            self._send(trackers, item)
            self._confirm(time.monotonic())

    def _send(self, trackers: Trackers, through: int) -> None:
        """Send every step < `through` that an open tracker has not received, in order."""
        if not self.logged:  # no tracker started: nothing will read the staged reports
            for f in self.dir.glob("step_*.json"):
                if (_step_of(f) or 0) < through:
                    f.unlink(missing_ok=True)
            return
        first = min(self.logged.values()) + 1
        for step in range(first, through):
            names = [n for n, last in self.logged.items() if last < step]
            report = self._report(step)
            if report is not None:
                trackers.each("log_step", report, only=names)
            for t in trackers.open:  # sent, or failed and counted: a failed step is not retried
                if t.name in names:
                    self.logged[t.name] = step
                    self.pending.append((time.monotonic() + t.durable_after_s, t.name, step))

    def _confirm(self, now: float) -> None:
        """Record in trackers.json the steps each tracker holds durably (W&B writes its log some seconds after a
        call: `durable_after_s`), and delete the staged reports every tracker holds. A restart sends the
        steps not recorded again."""
        done = [p for p in self.pending if p[0] <= now]
        if not done:
            return
        self.pending = [p for p in self.pending if p[0] > now]
        durable = self.state["sent_through"]
        for _, name, step in done:
            durable[name] = max(durable.get(name, -1), step)
        self._save()
        held = min(durable.get(n, -1) for n in self.logged)  # self.logged: not empty when anything was sent
        for f in self.dir.glob("step_*.json"):
            if (_step_of(f) if _step_of(f) is not None else held + 1) <= held:
                f.unlink(missing_ok=True)

    def _report(self, step: int) -> StepReport | None:
        path = self.dir / f"step_{step:05d}.json"
        try:
            return StepReport.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged file: its scalars from the records
            log.warning("%s does not read (%s); sending the step's metrics.jsonl values only", path, e)
        record = self.records.get(step)
        return StepReport(step, scalars(record)) if record is not None else None

    def _save(self) -> None:
        try:
            write_state(self.run_dir, self.state)
        except OSError as e:  # a full disk: the trackers go on; a restart may send a step again
            log.warning("could not write %s: %s", self.run_dir / "trackers.json", e)


def _step_of(path: Path) -> int | None:
    try:
        return int(path.stem.removeprefix("step_"))
    except ValueError:
        return None
