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
import secrets
import string
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
    """Sends staged step reports to the run's trackers, each tracker on a thread of its own (a `_Lane`: an
    unreachable MLflow server never holds W&B or TensorBoard back, nor a training step).

    cfg: the run's config (run.report_to, tracking); config: the resolved config as JSON data with the model
    record (what the trackers show as the run's config); resumed_step: the step the trainer starts at (its
    checkpoint's; 0 for a new run): steps before it are in the checkpoint, steps from it on run again, so
    their staged reports are deleted; records: metrics.jsonl records of the steps before it (a tracker that
    has not received one of them, e.g. added on resume, gets its values from here when no staged report is
    left); checkpoint: the checkpoint resumed (its copy of trackers.json, when the run directory has none).
    Raises OSError when <run_dir>/tracking cannot be made (the trainer then runs without trackers).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, config: dict, resumed_step: int, records: list[dict],
                 checkpoint: Path | None = None):
        self.cfg, self.run_dir, self.config = cfg, Path(run_dir), config
        self.dir = self.run_dir / STAGED
        self.dir.mkdir(exist_ok=True)
        for f in self.dir.glob("step_*.json"):
            if _step_of(f) is None or _step_of(f) >= resumed_step:
                f.unlink(missing_ok=True)
        self.records = {r["step"]: r for r in records if isinstance(r.get("step"), int) and r["step"] < resumed_step}
        self.state = read_state(self.run_dir) or (read_state(checkpoint) if checkpoint is not None else {})
        # A resume from an older checkpoint (the newest one damaged) trains steps a tracker may hold again: they
        # are sent again (TensorBoard's purge_step hides the old ones; W&B and MLflow keep both).
        sent = self.state.setdefault("sent_through", {})
        for name in sent:
            sent[name] = min(sent[name], resumed_step - 1)
        self.lock = threading.Lock()  # self.state, trackers.json and the staged files, shared by the lanes
        self.lanes = [_Lane(self, name, resumed_step) for name in cfg.run.report_to]
        for lane in self.lanes:
            lane.thread.start()

    def alive(self) -> bool:
        """Whether a tracker's thread still runs."""
        return any(lane.thread.is_alive() for lane in self.lanes)

    def stage(self, report: StepReport) -> None:
        """Keep `report` until the checkpoint holding its step is written (a file: a crash in between loses nothing).
        Nothing is kept once no tracker started."""
        if all(lane.status == "failed" for lane in self.lanes):
            return
        path = self.dir / f"step_{report.step:05d}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(report.to_json()))
        os.replace(tmp, path)

    def commit(self, checkpoint_step: int) -> None:
        """A checkpoint of `checkpoint_step` (TrainerState.step: it holds steps < checkpoint_step) is on disk:
        send those steps. Thread-safe (the checkpoint writer's thread calls it)."""
        for lane in self.lanes:
            lane.queue.put(checkpoint_step)

    def close(self, finished: bool, timeout_s: float = 120.0) -> None:
        """Send what is committed, close the trackers (W&B and MLflow mark the run finished, or not), and stop the
        threads; a tracker still busy `timeout_s` after the call is left behind with a warning."""
        for lane in self.lanes:
            lane.queue.put(("close", finished))
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                log.warning("tracker %s did not finish within %.0f s; leaving it", lane.name, timeout_s)

    def report(self, step: int) -> StepReport | None:
        """The staged report of `step`, else its metrics.jsonl values (None: neither is here)."""
        path = self.dir / f"step_{step:05d}.json"
        try:
            return StepReport.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged file: its scalars from the records
            log.warning("%s does not read (%s); sending the step's metrics.jsonl values only", path, e)
        record = self.records.get(step)
        return StepReport(step, scalars(record)) if record is not None else None

    def held(self, name: str, step: int | None, tracker_state: dict | None = None) -> None:
        """Record that tracker `name` holds every step <= `step` durably (None: it did not start), with its ids
        (`tracker_state`), in trackers.json; delete the staged reports every started tracker holds. A restart
        sends the steps not recorded again."""
        with self.lock:
            if tracker_state is not None:
                self.state[name] = tracker_state
            if step is not None:
                durable = self.state["sent_through"]
                durable[name] = max(durable.get(name, -1), step)
            self._save()
            waiting = [lane.name for lane in self.lanes if lane.status != "failed"]
            done = min((self.state["sent_through"].get(n, -1) for n in waiting), default=math.inf)
            for f in self.dir.glob("step_*.json"):
                if (_step_of(f) if _step_of(f) is not None else done + 1) <= done:
                    f.unlink(missing_ok=True)

    def _save(self) -> None:
        try:
            write_state(self.run_dir, self.state)
        except OSError as e:  # a full disk: the trackers go on; a restart may send a step again
            log.warning("could not write %s: %s", self.run_dir / "trackers.json", e)


class _Lane:
    """One tracker of a `Reporter`: its thread opens it, then sends each committed step it has not received, in
    order. status: "opening", "open" or "failed" (it did not start: left out until the trainer restarts)."""

    def __init__(self, reporter: Reporter, name: str, resumed_step: int):
        self.reporter, self.name, self.resumed_step = reporter, name, resumed_step
        self.status = "opening"
        self.queue: queue.Queue = queue.Queue()
        self.pending: list[tuple[float, int]] = []  # (when it is durable, step)
        self.thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self._open_and_send()
        except Exception as e:  # noqa: BLE001 - a bug here must not outlive the tracker quietly, nor stop training
            log.warning("tracker %s stopped (%s: %s); training goes on", self.name, type(e).__name__, e)
            self.status = "failed"
            self.reporter.held(self.name, None)

    def _open_and_send(self) -> None:
        r = self.reporter
        name = self.name
        if name == "wandb" and not r.state.get("wandb", {}).get("id"):
            # The id saved before wandb.init (seconds): a process killed meanwhile leaves no second W&B run behind.
            r.held(name, None, {"id": "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))})
        with r.lock:
            state = json.loads(json.dumps(r.state))  # the other lanes write theirs meanwhile
        saved = state.get(name)
        sent = state["sent_through"].get(name)
        purge = {"purge_step": sent + 1 if sent is not None else 0} if name == "tensorboard" else {}
        trackers = Trackers([name], r.cfg.tracking, r.run_dir, r.config, state, "trainer", **purge)
        if not trackers.open:
            self.status = "failed"
            r.held(name, None)
            return
        self.tracker = trackers.open[0]
        if saved is not None and self.tracker.new_run:  # the saved run is gone: this one starts at step 0
            with r.lock:
                r.state["sent_through"].pop(name, None)
        self.logged = r.state["sent_through"].get(name, -1)  # handed to the tracker's library
        if name == "mlflow" and not self.tracker.new_run:
            # The checkpoint's steps not recorded as sent: a killed process may have sent them (their values are the
            # same). Steps trained again after an older checkpoint are new values: MLflow keeps both.
            self.tracker.in_doubt = range(self.logged + 1, self.resumed_step)
        self.status = "open"
        r.held(name, None, self.tracker.state)
        self._send(trackers, self.resumed_step)
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
        """Send every step < `through` this tracker has not received, in order; a step that failed is counted
        (Trackers) and not sent again."""
        for step in range(self.logged + 1, through):
            report = self.reporter.report(step)
            if report is not None:
                trackers.each("log_step", report)
            self.logged = step
            self.pending.append((time.monotonic() + self.tracker.durable_after_s, step))
            self._confirm(time.monotonic())  # a step at a time: a kill leaves at most one in doubt

    def _confirm(self, now: float) -> None:
        """Record the steps the tracker holds durably (W&B writes its log some seconds after a call:
        `durable_after_s`)."""
        done = [step for when, step in self.pending if when <= now]
        if done:
            self.pending = [p for p in self.pending if p[0] > now]
            self.reporter.held(self.name, max(done))


def _step_of(path: Path) -> int | None:
    try:
        return int(path.stem.removeprefix("step_"))
    except ValueError:
        return None
