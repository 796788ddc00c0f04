"""The experiment trackers (opsd/tracking.py) through the trainer's Reporter (services/trainer/reporting.py): real
W&B (offline), TensorBoard and MLflow (SQLite) writing real files, read back with each tracker's own reader
(tests/tracker_readers.py). No model, no services."""

from __future__ import annotations

import glob
import json
import logging
import math
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import wandb
import yaml
from prometheus_client import REGISTRY
from pydantic import ValidationError

from opsd.config import RunConfig
from opsd.tracking import (TABLE_COLUMNS, Histogram, StepReport, markdown_table, missing_trackers, mlflow_key, scalars,
                           tracker_name)
from services.trainer.reporting import Reporter
from tests import tracker_readers as read


@pytest.fixture(scope="session")
def process_tmp(tmp_path_factory) -> Path:
    """One temporary directory for the whole session: SQLite (MLflow's store) reads TMPDIR once per process, so a
    per-test one, deleted after its test, would leave the next tests' stores unable to write."""
    return tmp_path_factory.mktemp("tmpdir")


@pytest.fixture(autouse=True)
def tracker_env(tmp_path, monkeypatch, process_tmp):
    """Trackers configured by the test alone: no WANDB_* / MLFLOW_* from the shell, W&B's home folders under
    tmp_path; after the test W&B's process-wide setup is torn down, so the next test's variables apply (W&B
    reads them once per process otherwise)."""
    for name in ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    monkeypatch.setenv("TMPDIR", str(process_tmp))  # W&B's temporary files and service socket
    monkeypatch.setattr(tempfile, "tempdir", str(process_tmp))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    yield
    wandb.teardown()


def cfg_of(report_to: list[str], **tracking) -> RunConfig:
    tracking.setdefault("wandb", {}).setdefault("mode", "offline")
    return RunConfig(run={"report_to": report_to}, tracking=tracking)


def record_of(step: int, run: int = 0) -> dict:
    """A metrics.jsonl-like record; `run` > 0: the values a step trained again after a resume gets."""
    return {"step": step, "loss": 0.25 + step / 7 + run, "success_rate": step / 8, "episodes": 8 + step,
            "alignopsd/span_mean": 1.5 * step + run, "tokens_<1k": step % 3, "kl": None, "model": {"name": "tiny"}}


def report_of(step: int, run: int = 0) -> StepReport:
    """A StepReport as the trainer builds it: scalars of `record_of`, an 8-bin and a 1001-bin histogram (more than
    W&B takes; its logs span several 32 KiB blocks then) and two table rows (a "|" in a cell)."""
    rng = np.random.default_rng([step, run])
    hists = {"histograms/advantages": Histogram.of(rng.normal(size=50), 8),
             "histograms/teacher_student_gap": Histogram.of(rng.normal(size=5000), 1001)}
    rows = [[step, f"task-{i} [pick]", f"g{step}", f"r{i}", 2 + i, "go north | take key", 1.0 - i, i == 0,
             json.dumps([0.5 + run, -0.25])] for i in range(2)]
    return StepReport(step, scalars(record_of(step, run)), hists, rows)


def run_reporter(cfg: RunConfig, run_dir: Path, reports: list[StepReport], commits: list[int], *, resumed_step: int = 0,
                 records: list[dict] = (), finished: bool = True) -> Reporter:
    """Stage `reports` in order; after the report of step s, commit s + 1 when it is in `commits` (a checkpoint
    holding steps <= s); then close."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {**cfg.model_dump(mode="json"), "models": [{"name": "tiny", "revision": "abc"}]}
    reporter = Reporter(cfg, run_dir, config, resumed_step, list(records))
    for report in reports:
        reporter.stage(report)
        if report.step + 1 in commits:
            reporter.commit(report.step + 1)
    reporter.close(finished=finished, timeout_s=120)
    assert not reporter.alive()
    # run.finish() may return while W&B's service still writes the transaction log; teardown waits for it, as
    # the trainer's exit does (W&B's atexit hook). The next Reporter starts a new service, as a restart does.
    wandb.teardown()
    return reporter


def errors(tracker: str) -> float:
    return REGISTRY.get_sample_value("opsd_tracker_errors_total", {"role": "trainer", "tracker": tracker}) or 0.0


def warnings_of(caplog) -> list[str]:
    """Every warning or error any logger propagated, sorted."""
    return sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def links_of(run_dir: Path) -> dict:
    return {"run_dir": str(run_dir.resolve()), "inspect": f"opsd inspect {run_dir.resolve()}"}


# ---------------------------------------------------------------- what each tracker holds, read back


def wandb_bins(h: Histogram) -> tuple[list[int], list[float]]:
    """What W&B holds of `h` (at most 512 bins): 1001 bins merged in pairs, the last one alone."""
    if len(h.counts) <= 512:
        return h.counts, h.edges
    assert len(h.counts) == 1001
    return np.reshape(h.counts[:-1], (-1, 2)).sum(1).tolist() + h.counts[-1:], h.edges[:-1:2] + h.edges[-1:]


def check_wandb(run_dir: Path, reports: list[StepReport]) -> read.WandbRun:
    """Every report's scalars, histograms and table in W&B's offline log, each step once and in order."""
    w = read.wandb_run(run_dir)
    assert w.steps == [r.step for r in reports]
    for r in reports:
        row = w.history[r.step]
        assert {k: row[k] for k in r.scalars} == r.scalars
        for key, h in r.histograms.items():
            assert (row[key]["_type"], (row[key]["values"], row[key]["bins"])) == ("histogram", wandb_bins(h))
        table = row["learning/trajectories"]
        assert (table["columns"], table["data"]) == (list(TABLE_COLUMNS), r.trajectories)
    return w


def check_tensorboard(log_dir: Path, reports: list[StepReport]) -> None:
    """Every report in the event files: scalars at float32 (what TensorBoard stores), histograms (the first edge
    is not stored: TensorBoard's buckets are right limits), the table as Markdown; each step once."""
    found, hists, texts = read.tensorboard_scalars(log_dir), read.tensorboard_histograms(log_dir), read.tensorboard_texts(log_dir)
    keys = {k for r in reports for k in r.scalars}
    assert set(found) == keys
    for key in keys:
        assert found[key] == [(r.step, float(np.float32(r.scalars[key]))) for r in reports if key in r.scalars]
    with_hists = [r for r in reports if r.histograms]
    for key in {k for r in with_hists for k in r.histograms}:
        got = [(s, (v["bucket"], v["bucket_limit"], v["min"], v["max"], v["num"], v["sum"], v["sum_squares"]))
               for s, v in hists[key]]
        h_of = {r.step: r.histograms[key] for r in with_hists}
        assert got == [(s, (h.counts, h.edges[1:], h.min, h.max, h.num, h.sum, h.sum_squares)) for s, h in h_of.items()]
    tables = [(r.step, markdown_table(list(TABLE_COLUMNS), r.trajectories)) for r in reports if r.trajectories]
    assert texts.get("learning/trajectories/text_summary", []) == tables


def check_mlflow(run_dir: Path, run_id: str, reports: list[StepReport], status: str = "FINISHED") -> read.MlflowRun:
    """Every report's scalars (each step once) and its histograms and table artifacts in the run's SQLite store."""
    m = read.mlflow_run(run_dir, run_id)
    keys = {k for r in reports for k in r.scalars}
    assert set(m.metrics) == {mlflow_key(k) for k in keys}
    for key in keys:
        assert m.metrics[mlflow_key(key)] == [(r.step, r.scalars[key]) for r in reports if key in r.scalars]
    for r in reports:
        if r.histograms:
            assert m.artifacts[f"histograms/step_{r.step:05d}.json"] == {k: asdict(h) for k, h in r.histograms.items()}
        if r.trajectories:
            assert m.artifacts[f"trajectories/step_{r.step:05d}.json"] == {"columns": list(TABLE_COLUMNS), "data": r.trajectories}
    written = {f"{kind}/step_{r.step:05d}.json" for r in reports for kind, has in (("histograms", r.histograms),
                                                                                   ("trajectories", r.trajectories)) if has}
    assert set(m.artifacts) - {"config.json"} == written
    assert m.status == status
    return m


def test_each_tracker_reads_back_every_step(tmp_path):
    run_dir = tmp_path / "run-1"
    cfg = cfg_of(["wandb", "tensorboard", "mlflow"])
    reports = [report_of(s) for s in range(5)]
    reporter = run_reporter(cfg, run_dir, reports, commits=[2, 4, 5])

    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"wandb": 4, "tensorboard": 4, "mlflow": 4}
    assert list((run_dir / "tracking").iterdir()) == []  # every staged report was sent and removed
    assert reporter.state == state

    w = check_wandb(run_dir, reports)
    assert w.run_ids == [state["wandb"]["id"]]
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert log.stat().st_size > 2 * read.BLOCK  # records cross block boundaries (first and last chunks)
    assert w.config["opsd"] == links_of(run_dir)
    assert w.config["run"]["report_to"] == ["wandb", "tensorboard", "mlflow"]
    assert w.config["models"] == [{"name": "tiny", "revision": "abc"}]
    assert w.summary["trainer/loss"] == reports[-1].scalars["trainer/loss"]

    check_tensorboard(run_dir / "tensorboard", reports)
    texts = read.tensorboard_texts(run_dir / "tensorboard")
    assert [s for s, _ in texts["config/text_summary"]] == [0]
    text = texts["config/text_summary"][0][1]
    assert text.startswith("```yaml\n") and text.endswith("```")
    assert yaml.safe_load(text[len("```yaml\n"):-3]) == {**cfg.model_dump(mode="json"), "models": [{"name": "tiny", "revision": "abc"}]}
    assert texts["run/text_summary"] == [(0, f"**run_dir**: `{run_dir.resolve()}`\n\n**inspect**: `opsd inspect {run_dir.resolve()}`")]

    m = check_mlflow(run_dir, state["mlflow"]["run_id"], reports)
    assert mlflow_key("learning/tokens_<1k") == "learning/tokens_lt1k" and "learning/tokens_lt1k" in m.metrics
    assert m.params["run.report_to"] == '["wandb", "tensorboard", "mlflow"]' and m.params["redis.url"] == "null"
    assert m.params["tracking.histogram_bins"] == "64" and m.params["run.seed"] == "0"
    assert m.params["models"] == '[{"name": "tiny", "revision": "abc"}]'
    assert (m.tags["opsd.run_dir"], m.tags["opsd.inspect"]) == (links_of(run_dir)["run_dir"], links_of(run_dir)["inspect"])
    assert m.artifacts["config.json"]["tracking"]["histogram_bins"] == 64


# ---------------------------------------------------------------- opsd eval adds to the same runs


def eval_report(version: int) -> dict:
    """An `opsd eval` report's numbers as services/rollout/evaluate.py computes them (real bootstrap intervals) for
    two categories of 6 episodes, 4 and 1 won."""
    from services.rollout.evaluate import report_numbers

    results = [{"category": cat, "error": None, "episodes": [
        {"reward": float(i < wins), "won": i < wins, "turns": 3, "valid_turns": 2, "ending": "done"} for i in range(6)]}
        for cat, wins in (("pick", 4), ("clean", 1))]
    return {"metric": "success", "metrics": ["success"], "policy_version": version,
            **report_numbers(results, "success", 200, 0)}


@pytest.mark.parametrize("finished", [True, False])
def test_eval_adds_its_results_to_the_run_and_leaves_its_history_and_status(tmp_path, finished):
    from opsd.tracking import report_eval

    # A name of its own per case: pytest may hand the next case the same tmp_path (this one's deleted once it passed),
    # and MLflow keeps one store per tracking URI for the process.
    run_dir = tmp_path / f"run-eval-{finished}"
    cfg = cfg_of(["wandb", "tensorboard", "mlflow"])
    reports = [report_of(s) for s in range(3)]
    run_reporter(cfg, run_dir, reports, commits=[3], finished=finished)
    state = json.loads((run_dir / "trackers.json").read_text())
    report = eval_report(3)
    assert sorted(report_eval(cfg, run_dir, report)) == ["mlflow", "tensorboard", "wandb"]
    wandb.teardown()

    overall = report["overall"]["success"]
    want = {"eval/overall/success": overall["value"], "eval/overall/success_ci95_low": overall["ci95"][0],
            "eval/overall/success_ci95_high": overall["ci95"][1],
            "eval/pick/success": 4 / 6, "eval/clean/success": 1 / 6}
    assert 0 <= overall["ci95"][0] < overall["value"] == 5 / 12 < overall["ci95"][1] <= 1
    w = read.wandb_run(run_dir)
    assert set(w.run_ids) == {state["wandb"]["id"]}
    assert {k: w.summary[k] for k in want} == want
    assert w.steps == [0, 1, 2]  # in the summary: no history step of its own
    (table,) = run_dir.glob("wandb/offline-run-*/files/" + w.summary["eval/table"]["path"])
    assert [r[:4] for r in json.loads(table.read_text())["data"]] == [
        ["pick", 6, "success", 4 / 6], ["clean", 6, "success", 1 / 6], ["overall", 12, "success", 5 / 12]]
    # TensorBoard: a run of its own beside training's (a resumed trainer's purge_step would hide it there).
    tb, tb_eval = read.tensorboard_scalars(run_dir / "tensorboard"), read.tensorboard_scalars(run_dir / "tensorboard" / "eval")
    assert {k: tb_eval[k] for k in want} == {k: [(3, float(np.float32(v)))] for k, v in want.items()}
    assert not set(want) & set(tb) and [s for s, _ in tb["trainer/loss"]] == [0, 1, 2]
    m = read.mlflow_run(run_dir, state["mlflow"]["run_id"])
    assert {k: m.metrics[k] for k in want} == {k: [(3, v)] for k, v in want.items()}
    assert m.status == ("FINISHED" if finished else "KILLED")  # as the trainer left it
    assert [s for s, _ in m.metrics["trainer/loss"]] == [0, 1, 2]

    # The same version evaluated again: TensorBoard's point replaced (purge_step), W&B's summary overwritten.
    time.sleep(1.1)  # event file names carry the second they were opened in
    assert "tensorboard" in report_eval(cfg, run_dir, report)
    wandb.teardown()
    again = read.tensorboard_scalars(run_dir / "tensorboard" / "eval")
    assert {k: again[k] for k in want} == {k: [(3, float(np.float32(v)))] for k, v in want.items()}


# ---------------------------------------------------------------- resume: the same tracker runs, each step once


def test_resume_continues_the_same_runs_and_sends_each_step_once(tmp_path):
    run_dir = tmp_path / "run-r"
    first = [report_of(s) for s in range(5)]
    # The first process: steps 0-4 trained, the checkpoint of step 2 (holding steps 0, 1) sent; it stops before
    # the checkpoint of step 3 is sent: steps 2-4 stay staged.
    run_reporter(cfg_of(["wandb", "mlflow"]), run_dir, first, commits=[2], finished=False)
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"wandb": 1, "mlflow": 1}
    assert sorted(p.name for p in (run_dir / "tracking").iterdir()) == ["step_00002.json", "step_00003.json", "step_00004.json"]
    assert read.mlflow_run(run_dir, state["mlflow"]["run_id"]).status == "KILLED"

    # The second process resumes the checkpoint of step 3 (steps 0-2): step 2's staged report is sent, steps 3
    # and 4 train again with other values; TensorBoard, added now, gets steps 0 and 1 from metrics.jsonl's records.
    second = [report_of(s, run=1) for s in range(3, 6)]
    records = [record_of(s) for s in range(3)]
    reporter = run_reporter(cfg_of(["wandb", "tensorboard", "mlflow"]), run_dir, second, commits=[4, 6],
                            resumed_step=3, records=records)
    resumed = json.loads((run_dir / "trackers.json").read_text())
    assert resumed["sent_through"] == {"wandb": 5, "tensorboard": 5, "mlflow": 5}
    assert (resumed["wandb"]["id"], resumed["mlflow"]["run_id"]) == (state["wandb"]["id"], state["mlflow"]["run_id"])
    assert reporter.state == resumed

    sent = first[:3] + second  # steps 0-5, each once: step 3 and 4 as trained the second time
    w = check_wandb(run_dir, sent)
    assert w.run_ids == [state["wandb"]["id"]] * 2  # two offline logs of one W&B run
    # trackers.json's sync command names both: `wandb sync` uploads one run's directories in order of start time.
    command = resumed["wandb"]["url"]
    assert command.startswith("wandb sync ")
    assert sorted(glob.glob(command.removeprefix("wandb sync "))) == sorted(map(str, (run_dir / "wandb").glob("offline-run-*")))
    assert len(glob.glob(command.removeprefix("wandb sync "))) == 2
    check_mlflow(run_dir, state["mlflow"]["run_id"], sent)
    from_records = [StepReport(r["step"], scalars(r)) for r in records[:2]]
    check_tensorboard(run_dir / "tensorboard", from_records + sent[2:])


def test_a_step_mlflow_committed_before_a_kill_is_held_once_after_the_resume(tmp_path):
    """A process killed after MLflow committed steps 1 and 2 and before trackers.json recorded them (their staged
    reports still on disk): the resumed process sends them again, and the store keeps each value once (test_faults' crashed
    run hit this window in CI). A config param changed on the resume keeps the value the run was started with."""
    run_dir = tmp_path / "run-doubt"
    first = [report_of(s) for s in range(3)]
    run_reporter(cfg_of(["mlflow"]), run_dir, first, commits=[3], finished=False)
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"mlflow": 2}
    state["sent_through"]["mlflow"] = 0  # steps 1 and 2 in doubt
    (run_dir / "trackers.json").write_text(json.dumps(state))
    for report in first[1:]:
        (run_dir / "tracking" / f"step_{report.step:05d}.json").write_text(json.dumps(report.to_json()))

    second = [report_of(3, run=1)]
    run_reporter(cfg_of(["mlflow"], name="renamed"), run_dir, second, commits=[4], resumed_step=3,
                 records=[record_of(s) for s in range(3)])
    assert json.loads((run_dir / "trackers.json").read_text())["sent_through"] == {"mlflow": 3}
    m = check_mlflow(run_dir, state["mlflow"]["run_id"], first + second)
    assert m.params["tracking.name"] == "null"


def test_mlflow_keeps_a_retrained_steps_new_values_when_a_later_kill_leaves_them_in_doubt(tmp_path, caplog):
    """Steps 0-5 sent; the newest checkpoint damaged, the run resumes at 3 and trains 3-5 again (new values); that
    session sends step 3 and is killed before trackers.json records it. The next resume, at 6, has 3-5 in doubt:
    MLflow already holds steps 3-5 of the first session, but only the same value counts as sent, so the second
    session's values of 3, 4 and 5 are each held once, beside the first session's."""
    run_dir = tmp_path / "run-older-doubt"
    run_reporter(cfg_of(["mlflow"]), run_dir, [report_of(s) for s in range(6)], commits=[6], finished=False)
    second = [report_of(s, run=1) for s in range(3, 6)]
    run_reporter(cfg_of(["mlflow"]), run_dir, second, commits=[4], resumed_step=3, finished=False,
                 records=[record_of(s) for s in range(3)])
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"mlflow": 3}
    state["sent_through"]["mlflow"] = 2
    (run_dir / "trackers.json").write_text(json.dumps(state))
    (run_dir / "tracking" / "step_00003.json").write_text(json.dumps(second[0].to_json()))
    run_reporter(cfg_of(["mlflow"]), run_dir, [report_of(6, run=1)], commits=[7], resumed_step=6,
                 records=[record_of(s) for s in range(3)] + [record_of(s, run=1) for s in range(3, 6)])
    m = read.mlflow_run(run_dir, state["mlflow"]["run_id"])
    loss = lambda s, run: scalars(record_of(s, run))["trainer/loss"]  # noqa: E731
    assert m.metrics["trainer/loss"] == sorted([(s, loss(s, 0)) for s in range(6)] + [(s, loss(s, 1)) for s in range(3, 7)])

    # Two names one MLflow key: the last value is held, with one warning.
    from opsd import tracking

    cfg = cfg_of(["mlflow"])
    t = tracking.MlflowTracker(cfg.tracking, run_dir, "x", cfg.model_dump(mode="json"), {}, links_of(run_dir))
    with caplog.at_level(logging.WARNING):
        t.log_step(StepReport(0, {"learning/a:b": 1.0, "learning/a_b": 2.0}))
        t.log_step(StepReport(1, {"learning/a:b": 1.0, "learning/a_b": 3.0}))
    assert read.mlflow_run(run_dir, t.run_id).metrics["learning/a_b"] == [(0, 2.0), (1, 3.0)]
    assert len([r for r in caplog.records if "both 'learning/a_b'" in r.getMessage()]) == 1
    t.close(True)


def test_an_eval_without_trackers_json_adds_to_the_runs_the_checkpoint_names(tmp_path):
    """trackers.json deleted: `opsd eval` finds the tracker runs in the checkpoint's copy and keeps its progress,
    so the resumed trainer goes on in the same runs."""
    from opsd.tracking import report_eval

    run_dir = tmp_path / "run-eval-ckpt"
    cfg = cfg_of(["mlflow"])
    run_reporter(cfg, run_dir, [report_of(s) for s in range(3)], commits=[3])
    (run_dir / "checkpoint").mkdir()
    (run_dir / "trackers.json").rename(run_dir / "checkpoint" / "trackers.json")
    before = json.loads((run_dir / "checkpoint" / "trackers.json").read_text())
    assert report_eval(cfg, run_dir, eval_report(3)) == ["mlflow"]
    after = json.loads((run_dir / "trackers.json").read_text())
    assert after["mlflow"]["run_id"] == before["mlflow"]["run_id"] and after["sent_through"] == {"mlflow": 2}
    m = read.mlflow_run(run_dir, after["mlflow"]["run_id"])
    assert [s for s, _ in m.metrics["trainer/loss"]] == [0, 1, 2] and "eval/overall/success" in m.metrics


def test_mlflow_params_a_kill_left_unsent_are_sent_by_the_resume(tmp_path):
    """The run id saved, the process killed before its first step sent the params: the resumed process sends them."""
    from opsd import tracking

    run_dir = tmp_path / "run-params"
    run_dir.mkdir()
    cfg = cfg_of(["mlflow"])
    m = tracking.MlflowTracker(cfg.tracking, run_dir, "run-params", cfg.model_dump(mode="json"), {}, links_of(run_dir))
    tracking.write_state(run_dir, {"mlflow": m.state, "sent_through": {}})
    run_reporter(cfg, run_dir, [report_of(0)], commits=[1])
    got = read.mlflow_run(run_dir, m.run_id)
    config = {**cfg.model_dump(mode="json"), "models": [{"name": "tiny", "revision": "abc"}]}  # as run_reporter's
    assert set(got.params) == set(tracking.flatten(config)) and got.params["trainer.lr"] == str(cfg.trainer.lr)
    check_mlflow(run_dir, m.run_id, [report_of(0)])


def test_tensorboard_resume_hides_steps_written_after_the_saved_progress(tmp_path, caplog):
    """A process killed after TensorBoard wrote steps 1 and 2 but before trackers.json said so: the resumed
    writer's purge_step hides them, and the steps sent again appear once. A damaged staged report is sent
    as its metrics.jsonl values."""
    run_dir = tmp_path / "run-tb"
    first = [report_of(s) for s in range(4)]
    run_reporter(cfg_of(["tensorboard"]), run_dir, first, commits=[3], finished=False)
    state = json.loads((run_dir / "trackers.json").read_text())
    state["sent_through"]["tensorboard"] = 0  # the progress as saved before steps 1 and 2 were written
    (run_dir / "trackers.json").write_text(json.dumps(state))
    (run_dir / "tracking" / "step_00001.json").write_text('{"step": 1, "scal')  # cut off by the crash
    (run_dir / "tracking" / "step_00002.json").write_text(json.dumps(report_of(2, run=1).to_json()))
    time.sleep(1.1)  # event file names carry the second they were opened in: the second file sorts after the first

    records = [record_of(s, run=1) for s in range(3)]
    second = [report_of(3, run=1)]
    with caplog.at_level(logging.WARNING):
        run_reporter(cfg_of(["tensorboard"]), run_dir, second, commits=[4], resumed_step=3, records=records)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert any("step_00001.json does not read" in r.getMessage() for r in caplog.records)
    check_tensorboard(run_dir / "tensorboard", [first[0], StepReport(1, scalars(records[1])), report_of(2, run=1)] + second)
    # Each session's config (a resume may change run.steps, run.report_to) at its first step: 0, then 1.
    texts = read.tensorboard_texts(run_dir / "tensorboard")
    assert [s for s, _ in texts["config/text_summary"]] == [0, 1]
    assert [s for s, _ in texts["run/text_summary"]] == [0, 1]


# ---------------------------------------------------------------- failures: counted, logged once, survived


def test_a_slow_tracker_holds_neither_the_others_nor_loses_its_steps(tmp_path, monkeypatch):
    """MLflow still opening (a server that does not answer): TensorBoard receives and holds every committed step
    meanwhile; the staged reports stay until MLflow holds them too."""
    from opsd import tracking

    gate, opened = threading.Event(), tracking.MlflowTracker.__init__
    monkeypatch.setattr(tracking.MlflowTracker, "__init__", lambda self, *a, **k: (gate.wait(120), opened(self, *a, **k))[1])
    run_dir = tmp_path / "run-slow"
    run_dir.mkdir()
    reports = [report_of(s) for s in range(3)]
    cfg = cfg_of(["tensorboard", "mlflow"])
    reporter = Reporter(cfg, run_dir, cfg.model_dump(mode="json"), 0, [])
    for r in reports:
        reporter.stage(r)
    reporter.commit(3)
    deadline = time.monotonic() + 60
    while reporter.state["sent_through"].get("tensorboard") != 2:  # a wait, not a timing check
        assert time.monotonic() < deadline, reporter.state
        time.sleep(0.1)
    saved = json.loads((run_dir / "trackers.json").read_text())
    assert "tensorboard" in saved and "mlflow" not in saved and saved["sent_through"] == {"tensorboard": 2}
    assert len(list((run_dir / "tracking").glob("step_*.json"))) == 3  # MLflow has none of them yet
    check_tensorboard(run_dir / "tensorboard", reports)
    gate.set()
    reporter.close(finished=True, timeout_s=120)
    assert not reporter.alive()
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"tensorboard": 2, "mlflow": 2} and not list((run_dir / "tracking").iterdir())
    check_mlflow(run_dir, state["mlflow"]["run_id"], reports)


def test_ids_are_saved_before_a_tracker_run_can_be_left_behind(tmp_path, monkeypatch):
    """W&B's id is in trackers.json before wandb.init (a kill during it: the restart continues that id); MLflow's
    params wait for the first step, after its run id is saved; a half-made local store of a killed process is
    removed."""
    from opsd import tracking

    run_dir = tmp_path / "run-ids"
    run_dir.mkdir()
    for left in (".mlflow.db.999.tmp", ".mlflow.db.999.tmp-journal"):
        (run_dir / left).write_text("half")
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **k: (_ for _ in ()).throw(RuntimeError("killed during init")))
    run_reporter(cfg_of(["wandb"]), run_dir, [report_of(0)], commits=[1])
    saved = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert re.fullmatch(r"[a-z0-9]{8}", saved)
    monkeypatch.setattr(wandb, "init", real_init)
    run_reporter(cfg_of(["wandb"]), run_dir, [report_of(0)], commits=[1])
    assert read.wandb_run(run_dir).run_ids == [saved]

    cfg = cfg_of(["mlflow"])
    m = tracking.MlflowTracker(cfg.tracking, run_dir, "run-ids", cfg.model_dump(mode="json"), {}, links_of(run_dir))
    assert not list(run_dir.glob(".mlflow.db.*"))
    assert read.mlflow_run(run_dir, m.run_id).params == {}  # nothing until the caller saved the id
    m.log_step(report_of(0))
    assert read.mlflow_run(run_dir, m.run_id).params["trainer.lr"] == str(cfg.trainer.lr)
    m.close(True)


def test_tensorboard_same_name_in_a_shared_log_dir_gets_a_directory_of_its_own(tmp_path, caplog):
    shared = tmp_path / "shared-named"
    a, b = [report_of(s) for s in range(2)], [report_of(s, run=1) for s in range(2)]
    cfg = cfg_of(["tensorboard"], tensorboard={"log_dir": str(shared)}, name="baseline")
    run_reporter(cfg, tmp_path / "run-a", a, commits=[2])
    with caplog.at_level(logging.WARNING):
        run_reporter(cfg, tmp_path / "run-b", b, commits=[2])
    assert any("holds another run's events" in r.getMessage() for r in caplog.records)
    check_tensorboard(shared / "baseline", a)
    check_tensorboard(shared / "baseline-2", b)


def test_a_resume_from_an_older_checkpoint_sends_its_steps_again(tmp_path):
    """The newest checkpoint damaged, the run resumes from step 2's: steps 2 and 3, sent already, are trained and
    sent again; TensorBoard hides the first copies."""
    run_dir = tmp_path / "run-older"
    first = [report_of(s) for s in range(4)]
    run_reporter(cfg_of(["tensorboard"]), run_dir, first, commits=[4])
    time.sleep(1.1)  # event file names carry the second they were opened in
    second = [report_of(s, run=1) for s in range(2, 4)]
    run_reporter(cfg_of(["tensorboard"]), run_dir, second, commits=[4], resumed_step=2,
                 records=[record_of(s) for s in range(2)])
    check_tensorboard(run_dir / "tensorboard", first[:2] + second)


def test_an_eval_that_starts_a_new_mlflow_run_leaves_the_resume_to_fill_it(tmp_path):
    from opsd.tracking import report_eval

    run_dir = tmp_path / "run-eval-new"
    cfg = cfg_of(["mlflow"])
    run_reporter(cfg, run_dir, [report_of(s) for s in range(3)], commits=[3])
    state = json.loads((run_dir / "trackers.json").read_text())
    state["mlflow"]["run_id"] = "0" * 32  # the store lost it
    (run_dir / "trackers.json").write_text(json.dumps(state))
    assert report_eval(cfg, run_dir, eval_report(3)) == ["mlflow"]
    after = json.loads((run_dir / "trackers.json").read_text())
    assert "mlflow" not in after["sent_through"] and after["mlflow"]["run_id"] != "0" * 32
    records = [record_of(s) for s in range(3)]
    second = [report_of(s, run=1) for s in range(3, 5)]
    run_reporter(cfg, run_dir, second, commits=[5], resumed_step=3, records=records)
    m = read.mlflow_run(run_dir, after["mlflow"]["run_id"])
    assert [s for s, _ in m.metrics["trainer/loss"]] == [0, 1, 2, 3, 4]
    assert m.params["trainer.lr"] == str(cfg.trainer.lr)  # the run's config, not a stub


def test_a_lost_mlflow_run_starts_a_new_one_sent_from_step_0(tmp_path, caplog):
    run_dir = tmp_path / "run-lost"
    first = [report_of(s) for s in range(3)]
    run_reporter(cfg_of(["mlflow"]), run_dir, first, commits=[3])
    state = json.loads((run_dir / "trackers.json").read_text())
    state["mlflow"]["run_id"] = "0" * 32  # a store that lost the run (a deleted mlflow.db, a server reset)
    (run_dir / "trackers.json").write_text(json.dumps(state))
    records = [record_of(s) for s in range(3)]
    second = [report_of(s, run=1) for s in range(3, 5)]
    with caplog.at_level(logging.WARNING):
        run_reporter(cfg_of(["mlflow"]), run_dir, second, commits=[5], resumed_step=3, records=records)
    assert any("not in" in r.getMessage() and "starting a new run" in r.getMessage() for r in caplog.records)
    new = json.loads((run_dir / "trackers.json").read_text())
    assert new["mlflow"]["run_id"] != "0" * 32 and new["sent_through"] == {"mlflow": 4}
    check_mlflow(run_dir, new["mlflow"]["run_id"], [StepReport(r["step"], scalars(r)) for r in records] + second)


def test_wandb_disabled_is_off_not_failed_and_marks_nothing_sent(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DISABLED", "true")  # HF Trainer's switch (wandb 0.31 no longer reads it)
    run_dir = tmp_path / "run-off"
    before = errors("wandb")
    run_reporter(cfg_of(["wandb", "tensorboard"]), run_dir, [report_of(s) for s in range(2)], commits=[2])
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"tensorboard": 1} and set(state.get("wandb", {})) <= {"id"}
    assert errors("wandb") == before and not (run_dir / "wandb").exists()


def test_tensorboard_log_dir_of_your_own_holds_each_run_in_a_directory_of_its_own(tmp_path):
    """Two runs sharing tracking.tensorboard.log_dir: neither hides the other's steps; a relative log_dir is under
    the run directory, whatever the working directory."""
    shared = tmp_path / "shared-tb"
    a, b = [report_of(s) for s in range(2)], [report_of(s, run=1) for s in range(3)]
    run_reporter(cfg_of(["tensorboard"], tensorboard={"log_dir": str(shared)}), tmp_path / "run-a", a, commits=[2])
    run_reporter(cfg_of(["tensorboard"], tensorboard={"log_dir": str(shared)}), tmp_path / "run-b", b, commits=[3])
    check_tensorboard(shared / "run-a", a)
    check_tensorboard(shared / "run-b", b)
    run_reporter(cfg_of(["tensorboard"], tensorboard={"log_dir": "tb"}), tmp_path / "run-c", a, commits=[2])
    check_tensorboard(tmp_path / "run-c" / "tb" / "run-c", a)
    assert json.loads((tmp_path / "run-c" / "trackers.json").read_text())["tensorboard"]["log_dir"] == str(
        (tmp_path / "run-c" / "tb" / "run-c").resolve())


def test_unreachable_wandb_leaves_the_others_every_step(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    run_dir = tmp_path / "run-w"
    before = {t: errors(t) for t in ("wandb", "tensorboard", "mlflow")}
    reports = [report_of(s) for s in range(3)]
    cfg = cfg_of(["wandb", "tensorboard", "mlflow"], wandb={"mode": None, "init_timeout_s": 2})
    with caplog.at_level(logging.WARNING):
        run_reporter(cfg, run_dir, reports, commits=[1, 3])
    assert {t: errors(t) - before[t] for t in before} == {"wandb": 1, "tensorboard": 0, "mlflow": 0}
    (line,) = warnings_of(caplog)
    assert line.startswith("tracker wandb failed (")  # connection refused until init_timeout_s
    state = json.loads((run_dir / "trackers.json").read_text())
    # W&B's id, saved before wandb.init, is all it keeps: a restart tries that run again.
    assert set(state["wandb"]) == {"id"} and state["sent_through"] == {"tensorboard": 2, "mlflow": 2}
    check_tensorboard(run_dir / "tensorboard", reports)
    check_mlflow(run_dir, state["mlflow"]["run_id"], reports)


def test_unreachable_mlflow_and_unwritable_tensorboard_leave_wandb_every_step(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    (tmp_path / "a-file").write_text("not a directory")
    run_dir = tmp_path / "run-m"
    before = {t: errors(t) for t in ("wandb", "tensorboard", "mlflow")}
    reports = [report_of(s) for s in range(3)]
    cfg = cfg_of(["wandb", "tensorboard", "mlflow"], mlflow={"tracking_uri": "http://127.0.0.1:9"},
                 tensorboard={"log_dir": str(tmp_path / "a-file" / "tb")})
    with caplog.at_level(logging.WARNING):
        run_reporter(cfg, run_dir, reports, commits=[2, 3])
    assert {t: errors(t) - before[t] for t in before} == {"wandb": 0, "tensorboard": 1, "mlflow": 1}
    mlflow_line, tensorboard_line = warnings_of(caplog)
    assert mlflow_line.startswith("tracker mlflow failed (MlflowException: API request to http://127.0.0.1:9/")
    assert tensorboard_line.startswith("tracker tensorboard failed (NotADirectoryError: ")
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == {"wandb": 2}
    check_wandb(run_dir, reports)


def test_mlflow_failing_mid_run_is_counted_and_survived(tmp_path, caplog):
    """The MLflow store disappears after step 0 was sent (its SQLite file moved aside, a directory in its place):
    steps 1-3 and the close fail, are counted and logged once; TensorBoard gets every step."""
    run_dir = tmp_path / "run-x"
    reports = [report_of(s) for s in range(4)]
    run_dir.mkdir()
    before = {t: errors(t) for t in ("tensorboard", "mlflow")}
    cfg = cfg_of(["tensorboard", "mlflow"])
    reporter = Reporter(cfg, run_dir, cfg.model_dump(mode="json"), 0, [])
    reporter.stage(reports[0])
    reporter.commit(1)
    deadline = time.monotonic() + 120
    while reporter.state.get("sent_through", {}).get("mlflow") != 0:  # a wait, not a timing check
        assert reporter.alive() and time.monotonic() < deadline, reporter.state
        time.sleep(0.05)
    (run_dir / "mlflow.db").rename(run_dir / "moved.db")
    (run_dir / "mlflow.db").mkdir()
    with caplog.at_level(logging.WARNING):
        for r in reports[1:]:
            reporter.stage(r)
            reporter.commit(r.step + 1)
        reporter.close(finished=True, timeout_s=120)
    assert not reporter.alive()
    assert {t: errors(t) - before[t] for t in before} == {"tensorboard": 0, "mlflow": 4}
    (line,) = warnings_of(caplog)  # MLflow's own logger (not propagated) prints its tracebacks to stderr besides
    assert line.startswith("tracker mlflow failed (") and "attempt to write a readonly database" in line
    assert reporter.state["sent_through"] == {"tensorboard": 3, "mlflow": 3}  # a failed step is not retried
    check_tensorboard(run_dir / "tensorboard", reports)
    m = read.mlflow_run(run_dir, reporter.state["mlflow"]["run_id"], db=run_dir / "moved.db")
    assert m.metrics["trainer/loss"] == [(0, reports[0].scalars["trainer/loss"])] and m.status == "RUNNING"


# ---------------------------------------------------------------- pure logic


def test_tracker_name_groups_keys_as_the_dashboard_does():
    assert tracker_name("loss") == "trainer/loss"
    assert tracker_name("episodes") == "throughput/episodes"
    assert tracker_name("staleness_max") == "policy/staleness_max"
    assert tracker_name("teacher_guard/refused") == "reliability/teacher_guard/refused"
    assert tracker_name("alignopsd/span_mean") == "credit/alignopsd/span_mean"
    assert tracker_name("trainer/custom") == "trainer/custom"  # its prefix is a group already
    assert tracker_name("success_rate") == "learning/success_rate"
    assert tracker_name("eval/win_rate") == "learning/eval/win_rate"


def test_scalars_keeps_finite_numbers_only():
    record = {"step": 4, "loss": 0.5, "episodes": 8, "won": True, "note": "x", "names": [1.0], "model": {"a": 1},
              "kl": None, "grad_norm": math.inf, "entropy": math.nan}
    out = scalars(record)
    assert out == {"trainer/loss": 0.5, "throughput/episodes": 8.0}
    assert all(type(v) is float for v in out.values())


def test_mlflow_key_spells_out_comparisons_and_replaces_other_characters():
    assert mlflow_key("learning/len_<1k") == "learning/len_lt1k"
    assert mlflow_key(">=8k") == "ge8k" and mlflow_key("<=2") == "le2" and mlflow_key("a>b") == "agtb"
    assert mlflow_key("a:b[c]é") == "a_b_c__"
    assert mlflow_key("ok/x y.z-w_v") == "ok/x y.z-w_v"


def test_markdown_table_keeps_one_line_per_row():
    table = markdown_table(["a", "b"], [["x|y", "line\r\nnext\rcr\nnl"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | line next cr nl |"]


def test_histogram_of_constant_empty_and_nan_input():
    h = Histogram.of(np.full(3, 2.0), 4)
    assert h.edges == [1.5, 1.75, 2.0, 2.25, 2.5] and h.counts == [0, 0, 3, 0]
    assert (h.min, h.max, h.sum, h.sum_squares, h.num) == (2.0, 2.0, 6.0, 12.0, 3)
    assert Histogram.of(np.zeros(0), 4) is None
    assert Histogram.of(np.array([np.nan, np.inf, -np.inf]), 4) is None
    h = Histogram.of(np.array([[1.0, np.nan], [np.inf, 3.0]]), 2)
    assert (h.edges, h.counts, h.min, h.max, h.sum, h.sum_squares, h.num) == ([1.0, 2.0, 3.0], [1, 1], 1.0, 3.0, 4.0, 10.0, 2)


def test_step_report_json_round_trip_and_refusals():
    report = report_of(3)
    assert StepReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert StepReport.from_json(json.loads(json.dumps(StepReport(0, {}).to_json()))) == StepReport(0, {})
    with pytest.raises(KeyError):
        StepReport.from_json({"step": 1, "scalars": {}})
    with pytest.raises(TypeError):
        StepReport.from_json({"step": 1, "scalars": {}, "histograms": {"h": {"edges": []}}, "trajectories": []})
    with pytest.raises(ValueError):
        StepReport.from_json({"step": 1, "scalars": {"a": "x"}, "histograms": {}, "trajectories": []})


def test_missing_trackers_names_the_pip_extra(monkeypatch):
    assert missing_trackers(["wandb", "tensorboard", "mlflow"]) is None  # all three are installed here
    assert missing_trackers([]) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib reports for a module that cannot be imported
    monkeypatch.setitem(sys.modules, "mlflow", None)
    line = missing_trackers(["wandb", "tensorboard", "mlflow"])
    assert line.startswith("run.report_to names wandb, mlflow, not installed here: pip install 'opsd[wandb,mlflow]'")
    assert "wandb==0.31.0" in line and "mlflow-skinny==3.18.0" in line and "tensorboard" not in line.split("opsd[")[1].split("]")[0]


@pytest.mark.parametrize("data, problem", [
    ({"run": {"report_to": ["wandb", "mlflow", "wandb"]}}, "names a tracker twice"),
    ({"run": {"report_to": ["comet"]}}, "report_to"),
    ({"tracking": {"trajectories_per_step": 65}}, "trajectories_per_step"),
    ({"tracking": {"trajectories_per_step": -1}}, "trajectories_per_step"),
    ({"tracking": {"table_chars": 19}}, "table_chars"),
    ({"tracking": {"histogram_bins": 1}}, "histogram_bins"),
    ({"tracking": {"histogram_bins": 1025}}, "histogram_bins"),
    ({"tracking": {"histogram_bins": True}}, "expects a number"),
    ({"tracking": {"wandb": {"init_timeout_s": 0}}}, "init_timeout_s"),
    ({"tracking": {"wandb": {"mode": "shared"}}}, "mode"),
    ({"tracking": {"mlflow": {"tracking_uri": ""}}}, "tracking_uri"),
    ({"tracking": {"mlflow": {"tracking_uri": "   "}}}, "tracking_uri"),
    ({"tracking": {"mlflow": {"tracking_uri": "garbage://x"}}}, "expected a URI of scheme"),
    ({"tracking": {"mlflow": {"experiment_name": "  "}}}, "experiment_name"),
    ({"tracking": {"wandb": {"project": "team/project"}}}, "project"),
    ({"tracking": {"tensorboard": {"log_dir": "   "}}}, "log_dir"),
    ({"tracking": {"wandb": {"dir": " x"}}}, "dir"),
    ({"tracking": {"name": "../x"}}, "tracking.name"),
    ({"tracking": {"name": ".."}}, "tracking.name"),
    ({"tracking": {"name": "eval"}}, "tracking.name"),
    ({"tracking": {"tensorboard": {"logdir": "x"}}}, "logdir"),
])
def test_config_refuses_bad_tracking_settings(data, problem):
    with pytest.raises(ValidationError, match=problem):
        RunConfig.model_validate(data)


def test_config_accepts_the_tracking_bounds():
    cfg = RunConfig.model_validate({"run": {"report_to": ["mlflow", "wandb"]}, "tracking": {
        "trajectories_per_step": 0, "table_chars": 20, "histogram_bins": 1024, "wandb": {"init_timeout_s": 3600},
        "mlflow": {"tracking_uri": "postgresql+psycopg2://u@db/mlflow"}}})
    for uri in ("http://mlflow:5000", "https://m.example/x", "sqlite:////abs/mlflow.db", "databricks", "file:///tmp/m"):
        assert RunConfig.model_validate({"tracking": {"mlflow": {"tracking_uri": uri}}}).tracking.mlflow.tracking_uri == uri
    assert cfg.run.report_to == ["mlflow", "wandb"]
    assert (cfg.tracking.trajectories_per_step, cfg.tracking.table_chars, cfg.tracking.histogram_bins) == (0, 20, 1024)


def test_opsd_run_refuses_a_tracker_that_is_not_installed_before_the_run_directory(tmp_path):
    """`opsd run --report-to wandb` where wandb cannot be imported (sys.modules["wandb"] = None: find_spec says
    absent): one line naming the extra, exit 2, no run directory."""
    import subprocess

    code = ("import sys; sys.modules['wandb'] = None; from opsd.cli import main; "
            f"sys.argv = ['opsd', 'run', 'tests/configs/tiny.yaml', '--output-dir', {str(tmp_path / 'runs')!r}, "
            "'--report-to', 'tensorboard,wandb']; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                          timeout=120)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out
    assert "run.report_to names wandb, not installed here: pip install 'opsd[wandb]'" in out
    assert "Traceback" not in out and not (tmp_path / "runs").exists()
