"""Experiment trackers (run.report_to): Weights & Biases, TensorBoard and MLflow, each through its own library.

The trainer (services/trainer/reporting.py) and `opsd eval` write here; one writer per run (the trainer's
rank 0). What a tracker receives for a step is a `StepReport`: the step's metrics.jsonl values under the
dashboard's groups ("trainer/loss", "learning/success_rate"), histograms (advantages, teacher-student gaps,
AlignOPSD span lengths) and a bounded table of sampled trajectories.

<run_dir>/trackers.json keeps each tracker's run id (W&B id, MLflow run id, TensorBoard directory), its
links and how far each tracker has been sent (`sent_through`): a resumed run continues the same tracker
runs. A tracker that fails (no network, a bad API key, a full disk) never stops training: `Trackers` logs
its first error, counts every one (opsd_tracker_errors_total{tracker}) and goes on with the others.

The trackers are optional extras: `pip install 'opsd[wandb]'`, `'opsd[tensorboard]'`, `'opsd[mlflow]'`
(or `opsd[trackers]` for all three); `missing_trackers` names what to install.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from opsd import metrics

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "tensorboard", "mlflow")
# tracker -> (module imported, pip extra, pinned package)
PACKAGES = {
    "wandb": ("wandb", "wandb", "wandb==0.31.0"),
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard==2.21.0"),
    "mlflow": ("mlflow", "mlflow", "mlflow-skinny==3.18.0 sqlalchemy alembic"),
}
STATE_FILE = "trackers.json"
# The Grafana dashboard's rows, as tracker sections: a metrics.jsonl key goes to the first group listing it
# (or its prefix before "/"); any other key to "learning".
GROUPS = {
    "throughput": ("episodes", "turns", "generated_tokens", "rollout_seconds", "teacher_seconds", "loss_tokens",
                   "sequence_tokens", "teacher_forward_tokens"),
    "policy": ("policy_version", "staleness_max", "groups_dropped_stale", "groups_dropped_duplicate",
               "groups_dropped_future", "teacher_version_min", "teacher_version_max"),
    "trainer": ("loss", "clip_frac", "entropy", "grad_norm", "ratio_dev_max", "sampler_logprob_mismatch", "mismatch_kl",
                "kl", "dropped_sequences", "skipped_steps", "sdar_loss", "reference_seconds", "is_masked_frac",
                "wait_seconds", "train_seconds", "step_seconds", "finished_at"),
    "reliability": ("embedder_fallbacks", "teacher_guard", "credit"),
    "credit": ("alignopsd", "agentopsd", "gc_opd", "gcopd", "grpo", "opd", "grpo_opd", "uni_opd", "power_opd", "ex_opd",
               "fire_opd", "sdar"),
}
_GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}
TABLE_COLUMNS = ("step", "task", "group", "rollout", "turns", "actions", "reward", "won", "turn_advantages")


def missing_trackers(report_to: list[str]) -> str | None:
    """One line naming the install command for the trackers of `report_to` whose library is not importable
    (None when all are)."""
    missing = [t for t in report_to if importlib.util.find_spec(PACKAGES[t][0]) is None]
    if not missing:
        return None
    extras = ",".join(PACKAGES[t][1] for t in missing)
    return (f"run.report_to names {', '.join(missing)}, not installed here: pip install 'opsd[{extras}]' "
            f"(or: pip install {' '.join(PACKAGES[t][2] for t in missing)}; `make install` installs all three)")


def tracker_name(key: str) -> str:
    """The tracker name of metrics.jsonl key `key`: "<group>/<key>" (GROUPS), or `key` itself when its prefix
    before "/" is a group already."""
    head = key.split("/", 1)[0]
    if head in GROUPS:
        return key
    return f"{_GROUP_OF.get(key, _GROUP_OF.get(head, 'learning'))}/{key}"


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of a metrics.jsonl record under their tracker names (`tracker_name`). Left out: "step"
    (the tracker's own step axis), None (a non-finite value metrics.jsonl writes as null), bools, strings,
    lists and objects (the model record, the teacher's names: in the run's config)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[tracker_name(key)] = float(value)
    return out


@dataclass
class Histogram:
    """A binned distribution (what TensorBoard's raw histogram and W&B's np_histogram take).

    edges: bins + 1 increasing bin edges; counts: bins counts (ints); min/max/sum/sum_squares/num over the
    raw values (num = sum(counts))."""

    edges: list[float]
    counts: list[int]
    min: float
    max: float
    sum: float
    sum_squares: float
    num: int

    @classmethod
    def of(cls, values: np.ndarray, bins: int) -> "Histogram | None":
        """The histogram of the finite entries of `values` (any shape, float) in `bins` equal bins; None without
        any (a step with no loss token, a method without spans)."""
        v = np.asarray(values, dtype=np.float64).ravel()
        v = v[np.isfinite(v)]
        if v.size == 0:
            return None
        lo, hi = float(v.min()), float(v.max())
        if hi == lo:  # one value: a bin around it (numpy's default width)
            lo, hi = lo - 0.5, hi + 0.5
        counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
        return cls([float(e) for e in edges], [int(c) for c in counts], float(v.min()), float(v.max()),
                   float(v.sum()), float((v * v).sum()), int(v.size))


@dataclass
class StepReport:
    """What the trackers receive for one training step (JSON data: the trainer stages it in a file until the
    checkpoint holding the step is on disk).

    step: the metrics.jsonl step; scalars: `scalars(record)`; histograms: name ("learning/advantages") ->
    Histogram; trajectories: table rows, one list of TABLE_COLUMNS values per sampled trajectory."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, Histogram] = field(default_factory=dict)
    trajectories: list[list] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "StepReport":
        """Raises KeyError / TypeError / ValueError for data that is not a StepReport's."""
        return cls(int(data["step"]), {str(k): float(v) for k, v in data["scalars"].items()},
                   {str(k): Histogram(**h) for k, h in data["histograms"].items()}, [list(r) for r in data["trajectories"]])


# ---------------------------------------------------------------- the trackers


def _free_dir(path: Path) -> Path:
    """`path`, or `path`-2, -3, ... when it holds event files already (another run of the same tracking.name)."""
    candidate, n = path, 1
    while candidate.is_dir() and any(candidate.glob("events.out.tfevents.*")):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    if candidate != path:
        log.warning("TensorBoard: %s holds another run's events; writing to %s", path, candidate)
    return candidate


class TrackerOff(Exception):
    """A tracker its own settings turn off (WANDB_MODE=disabled, WANDB_DISABLED=true): not started, not an error."""


def _under(run_dir: Path, path: str | None, default: str) -> Path:
    """`path` (a relative one under the run directory, so a resume or `opsd eval` from another working directory
    finds it), else <run_dir>/<default>; absolute."""
    return (Path(run_dir) / (path or default)).resolve()


class WandbTracker:
    """A W&B run (wandb.init with the saved id and resume="allow"): config, scalars and histograms (at most 512
    bins: more are merged) at the step, the trajectories as a wandb.Table. WANDB_* variables apply where the config
    leaves a setting None."""

    name = "wandb"
    # wandb-core writes its log (<dir>/wandb/*/run-<id>.wandb) every x_transaction_log_flush_interval seconds
    # (15 by default; FLUSH_S here): a crash of the whole process tree loses what came since. A step counts
    # as held this long after the call (services/trainer/reporting.py sends it again after a crash).
    FLUSH_S = 1.0
    durable_after_s = 3 * FLUSH_S

    def __init__(self, tracking, run_dir: Path, run_name: str, config: dict, state: dict, links: dict):
        import wandb

        self.wandb = wandb
        c = tracking.wandb
        mode = c.mode or os.environ.get("WANDB_MODE")
        if mode == "disabled" or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
            raise TrackerOff("W&B is disabled (tracking.wandb.mode, WANDB_MODE or WANDB_DISABLED): nothing sent")
        saved = state.get("wandb", {})
        directory = _under(run_dir, c.dir, ".")
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=c.project or os.environ.get("WANDB_PROJECT") or "opsd", entity=c.entity, group=c.group,
            tags=c.tags or None, name=tracking.name or run_name, mode=c.mode, dir=str(directory),
            id=saved.get("id"), resume="allow", config={**config, "opsd": links}, notes=links["inspect"],
            settings=wandb.Settings(console="off", init_timeout=c.init_timeout_s, silent=True,
                                    x_transaction_log_flush_interval=self.FLUSH_S),
        )
        if self.run.offline:
            # Every process (first launch, each resume, each `opsd eval`) writes an offline-run-<time>-<id> directory
            # of its own; `wandb sync` uploads those of one run in order of start time. Reading run.url offline warns.
            url = f"wandb sync {Path(self.run.dir).parent.parent / f'offline-run-*-{self.run.id}'}"
        else:
            url = self.run.url
        self.state = {"id": self.run.id, "url": url, "dir": str(directory), "mode": mode}
        self.new_run = self.run.id != saved.get("id")

    def log_step(self, report: StepReport) -> None:
        data: dict[str, Any] = dict(report.scalars)
        for key, h in report.histograms.items():
            # wandb.Histogram refuses more than MAX_LENGTH (512) bins, and tracking.histogram_bins allows 1024:
            # adjacent bins merged k at a time (the last group may be short), so a step is never lost to it.
            k = -(-len(h.counts) // self.wandb.Histogram.MAX_LENGTH)
            counts = [sum(h.counts[i:i + k]) for i in range(0, len(h.counts), k)]
            edges = h.edges[::k] + ([h.edges[-1]] if len(h.counts) % k else [])
            data[key] = self.wandb.Histogram(np_histogram=(counts, edges))
        if report.trajectories:
            data["learning/trajectories"] = self.wandb.Table(columns=list(TABLE_COLUMNS), data=report.trajectories)
        self.run.log(data, step=report.step)

    def log_eval(self, step: int, values: dict[str, float], table: list[list], columns: list[str]) -> None:
        # The run's summary, not its history: an offline run resumed in another process does not know its last
        # history step, and an eval logged at a step would collide with training's.
        self.run.summary.update({**values, "eval/table": self.wandb.Table(columns=columns, data=table)})

    def close(self, finished: bool | None) -> None:
        self.run.finish(exit_code=1 if finished is False else 0)


class TensorBoardTracker:
    """Event files in tracking.tensorboard.log_dir (default <run_dir>/tensorboard), written with PyTorch's
    SummaryWriter: scalars, raw histograms, the config, links and trajectories as text. A resumed run writes
    to the same directory with purge_step at the first step not yet sent, so TensorBoard hides anything a
    killed process wrote beyond it."""

    name = "tensorboard"
    durable_after_s = 0.0  # flushed to the event file at every step

    def __init__(self, tracking, run_dir: Path, run_name: str, config: dict, state: dict, links: dict, purge_step=None):
        from torch.utils.tensorboard import SummaryWriter

        saved = state.get("tensorboard", {})
        # A log_dir of your own may hold other runs: this one writes to <log_dir>/<run name> (TensorBoard's runs are
        # directories), so its purge_step hides nothing of theirs. `opsd eval` (purge_step None) finds it saved.
        custom = tracking.tensorboard.log_dir
        log_dir = Path(saved["log_dir"]) if purge_step is None and saved.get("log_dir") else (
            _under(run_dir, custom, "") / (tracking.name or run_name) if custom else _under(run_dir, None, "tensorboard"))
        if custom and not saved.get("log_dir") and purge_step is not None:
            log_dir = _free_dir(log_dir)  # another run of this name writes there: its steps would be purged
        self.new_run = saved.get("log_dir") != str(log_dir)
        # purge_step None (`opsd eval` adding results): nothing hidden. The trainer passes 0 for a first session (nothing
        # to hide): TensorBoard's Python loader (--load_fast=false, and where its Rust data server does not run) takes
        # the first session start it reads for the run's start and purges only at a later one, so without it a
        # resumed run's steps showed twice there.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=10)
        self.state = {"log_dir": str(log_dir), "url": f"tensorboard --logdir {log_dir}"}
        # A trainer session writes them at its first step (a resume may change run.steps, the trackers...); `opsd eval`
        # (purge_step None) adds nothing to a directory that has them.
        if purge_step is not None or not saved:
            import yaml

            at = purge_step or 0
            self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", at)
            self.writer.add_text("run", "\n\n".join(f"**{k}**: `{v}`" for k, v in links.items()), at)

    def log_step(self, report: StepReport) -> None:
        for key, value in report.scalars.items():
            self.writer.add_scalar(key, value, report.step)
        for key, h in report.histograms.items():
            self.writer.add_histogram_raw(key, h.min, h.max, h.num, h.sum, h.sum_squares, h.edges[1:], h.counts,
                                          global_step=report.step)
        if report.trajectories:
            self.writer.add_text("learning/trajectories", markdown_table(list(TABLE_COLUMNS), report.trajectories), report.step)
        self.writer.flush()

    def log_eval(self, step: int, values: dict[str, float], table: list[list], columns: list[str]) -> None:
        # A run of its own, <log_dir>/eval: a resumed trainer's purge_step would hide an eval at its policy version
        # in the training directory; purge_step=step replaces an earlier eval of the same version.
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=str(Path(self.state["log_dir"]) / "eval"), purge_step=step) as writer:
            for key, value in values.items():
                writer.add_scalar(key, value, step)
            writer.add_text("eval/table", markdown_table(columns, table), step)

    def close(self, finished: bool | None) -> None:
        self.writer.close()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_WORDS = (("<=", "le"), (">=", "ge"), ("<", "lt"), (">", "gt"))


def _local_store(path: Path) -> Path:
    """`path`, a SQLite tracking store with MLflow's tables. A new one is made aside and renamed into place: MLflow
    creates its tables in a few dozen migrations, and a process killed halfway left a store that every later
    start refused ("table ... already exists")."""
    if path.exists():
        return path
    from mlflow import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    for left in path.parent.glob(f".{path.name}.*.tmp*"):  # a process killed while it made one (and its journal)
        left.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)  # creates and migrates it
    os.replace(tmp, path)
    return path


def mlflow_key(name: str) -> str:
    """`name` as an MLflow metric key (letters, digits, _ - . space /): "<1k" -> "lt1k", ">=8k" -> "ge8k", any other
    character -> "_"."""
    for sign, word in _MLFLOW_WORDS:
        name = name.replace(sign, word)
    return _MLFLOW_BAD.sub("_", name)


class MlflowTracker:
    """An MLflow run through MlflowClient: params (the flattened config), metrics at the step, histograms and
    trajectories as JSON artifacts (histograms/step_NNNNN.json, trajectories/step_NNNNN.json, a table as
    mlflow.log_table writes it), tags linking the run directory. The tracking URI: tracking.mlflow.tracking_uri,
    else MLFLOW_TRACKING_URI, else a SQLite store in the run directory (sqlite:///<run_dir>/mlflow.db, artifacts
    in <run_dir>/mlflow-artifacts)."""

    name = "mlflow"
    durable_after_s = 0.0  # each call is a committed store transaction (or a server's answer)

    def __init__(self, tracking, run_dir: Path, run_name: str, config: dict, state: dict, links: dict):
        from mlflow import MlflowClient

        c = tracking.mlflow
        saved = state.get("mlflow", {})
        # MLflow's HTTP client retries 7 times with exponential backoff (minutes per call to a server that is down);
        # a tracker fails fast here instead (training never waits for it). Your own MLFLOW_HTTP_* settings win.
        for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                           ("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")):
            os.environ.setdefault(key, value)
        uri = c.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = uri is None
        if local:
            uri = f"sqlite:///{_local_store(Path(run_dir).resolve() / 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        name = c.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "opsd"
        self.status_before = None
        self.run_id = self._saved_run(saved, uri)
        self.new_run = self.run_id is None
        if self.run_id is not None:
            self.status_before = self.client.get_run(self.run_id).info.status
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (Path(run_dir).resolve() / "mlflow-artifacts").as_uri() if local else None
                experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
            run = self.client.create_run(experiment_id, run_name=tracking.name or run_name,
                                         tags={"opsd.run_dir": links["run_dir"], "opsd.inspect": links["inspect"],
                                               "mlflow.note.content": links["inspect"]})
            self.run_id = run.info.run_id
        experiment_id = self.client.get_run(self.run_id).info.experiment_id
        self.state = {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri,
                      "url": f"{uri} experiment {experiment_id} run {self.run_id}"}
        # Sent with the first step or eval, after the caller saved the run id: a process killed in between leaves
        # no second run behind (the params, a batch per 100, are round trips to a server).
        self.config_pending = config
        # Steps the run may hold already (services/trainer/reporting.py sets them on a resume: those after the last
        # one trackers.json records as sent, held by the checkpoint resumed; a process killed between MLflow's commit
        # and that record left them in the store). MLflow keeps every value logged, so `log_step` sends only what
        # the store lacks of them.
        self.in_doubt: range = range(0)
        self._history: dict[str, set[tuple[int, float]]] = {}  # key -> (step, value)s the store holds, for steps in doubt
        self._merged: set[str] = set()  # MLflow keys two names map to (warned once each)

    def _send_config(self) -> None:
        if self.config_pending is None:
            return
        self._log_params(self.config_pending)
        self.client.log_dict(self.run_id, self.config_pending, "config.json")
        self.config_pending = None

    def _saved_run(self, saved: dict, uri: str) -> str | None:
        """The saved run id, when that run is in the store at `uri`; None (start a new run, with a warning) when the
        store changed or lost it (a deleted mlflow.db, another MLFLOW_TRACKING_URI)."""
        from mlflow.exceptions import MlflowException

        run_id = saved.get("run_id")
        if not run_id:
            return None
        if saved.get("tracking_uri") not in (None, uri):
            log.warning("MLflow: the run's tracker run %s is in %s, now %s: starting a new run there",
                        run_id, saved["tracking_uri"], uri)
            return None
        try:
            self.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("MLflow: run %s is not in %s any more: starting a new run, sent from step 0", run_id, uri)
            return None
        return run_id

    def _log_params(self, config: dict) -> None:
        """The flattened config as params, those the run lacks: a param is immutable in MLflow, so one a resume
        changed (run.steps raised) keeps the run's first value, and params a killed process left unsent are sent."""
        from mlflow.entities import Param

        text = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731 - lists, null, true as JSON
        held = self.client.get_run(self.run_id).data.params
        params = [Param(mlflow_key(k)[:250], text(v)[:500]) for k, v in flatten(config).items()]
        params = [p for p in params if p.key not in held]
        for lo in range(0, len(params), 100):  # MLflow's log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[lo:lo + 100])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        keys: dict[str, float] = {}
        for name, value in values.items():
            key = mlflow_key(name)[:250]  # MLflow: keys <= 250 chars
            if key in keys and key not in self._merged:
                self._merged.add(key)
                log.warning("MLflow: two metrics are both %r there (%r and another); it holds the last one", key, name)
            keys[key] = value
        if step in self.in_doubt:
            for key in keys.keys() - self._history.keys():  # one history read per key, once per resume
                self._history[key] = {(m.step, m.value) for m in self.client.get_metric_history(self.run_id, key)}
            # The same value at the step: sent before the kill. Another value (the step trained again after an older
            # checkpoint, and that session killed too) is this run's: sent, beside the old one.
            keys = {k: v for k, v in keys.items() if (step, v) not in self._history[k]}
        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in keys.items()]
        for lo in range(0, len(batch), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[lo:lo + 1000])

    def log_step(self, report: StepReport) -> None:
        self._send_config()
        self._metrics(report.scalars, report.step)
        if report.histograms:
            self.client.log_dict(self.run_id, {k: asdict(h) for k, h in report.histograms.items()},
                                 f"histograms/step_{report.step:05d}.json")
        if report.trajectories:
            self.client.log_dict(self.run_id, {"columns": list(TABLE_COLUMNS), "data": report.trajectories},
                                 f"trajectories/step_{report.step:05d}.json")

    def log_eval(self, step: int, values: dict[str, float], table: list[list], columns: list[str]) -> None:
        self._send_config()
        self._metrics(values, step)
        self.client.log_dict(self.run_id, {"columns": columns, "data": table}, f"eval/step_{step:05d}.json")

    def close(self, finished: bool | None) -> None:
        """finished: the run ended (FINISHED) or stopped before its last step (KILLED); None: the status it had
        when opened (`opsd eval` adding results)."""
        status = {True: "FINISHED", False: "KILLED"}.get(finished, self.status_before or "FINISHED")
        self._send_config()
        self.client.set_terminated(self.run_id, status)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists and scalars are leaves)."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it); "|" in a cell is escaped."""
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\r\n", " ").replace("\n", " ").replace("\r", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- the run's trackers, failures contained


def read_state(run_dir: Path) -> dict:
    """<run_dir>/trackers.json as a dict ({} without it, or when it does not read as a JSON object: a new
    tracker run is started then, and the file rewritten)."""
    try:
        data = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(run_dir: Path, state: dict) -> None:
    """Write <run_dir>/trackers.json atomically."""
    path = Path(run_dir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


class Trackers:
    """The run's open trackers; every call to one is contained: its first error is logged (one line), every
    error counted in opsd_tracker_errors_total{role, tracker}, and the other trackers and the caller go on.
    A tracker that cannot start is left out for the rest of the process.

    report_to: tracker names (TRACKERS); tracking: the config's TrackingSection; config: the resolved config
    (JSON data) with the model record; state: trackers.json's content (ids to continue); role: the Prometheus
    label; purge_step: TensorBoard's first step to write (steps from it on, written before, are hidden; None:
    hide nothing).
    """

    def __init__(self, report_to: list[str], tracking, run_dir: Path, config: dict, state: dict, role: str,
                 purge_step: int | None = None):
        self.role, self.errors, self.open = role, dict.fromkeys(report_to, 0), []
        run_dir = Path(run_dir)
        links = {"run_dir": str(run_dir.resolve()), "inspect": f"opsd inspect {run_dir.resolve()}"}
        makers = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}
        for name in report_to:
            metrics.TRACKER_ERRORS.labels(role, name)  # at 0 from the start
            extra = {"purge_step": purge_step} if name == "tensorboard" else {}
            tracker = self._call(name, lambda m=makers[name]: m(tracking, run_dir, run_dir.name, config, state, links, **extra))
            if tracker is not None:
                self.open.append(tracker)
                log.info("tracker %s: %s", name, tracker.state.get("url") or tracker.state)

    def _call(self, name: str, fn: Callable):
        try:
            return fn()
        except TrackerOff as e:
            log.info("tracker %s off: %s", name, e)
            return None
        except Exception as e:  # noqa: BLE001 - whatever a tracker's library raises: training goes on
            self.errors[name] = self.errors.get(name, 0) + 1
            metrics.TRACKER_ERRORS.labels(self.role, name).inc()
            if self.errors[name] == 1:
                log.warning("tracker %s failed (%s: %s); training goes on, its errors are counted in "
                            "opsd_tracker_errors_total", name, type(e).__name__, str(e)[:300])
                # Its library's own logging (MLflow prints a traceback per failed call) would repeat the error at
                # every step: only its critical messages from now on.
                logging.getLogger(PACKAGES[name][0]).setLevel(logging.CRITICAL)
            return None

    def state(self) -> dict:
        """{tracker: its ids and link} of the trackers that started."""
        return {t.name: t.state for t in self.open}

    def each(self, method: str, *args, only: list[str] | None = None) -> list[str]:
        """Call `method(*args)` on every open tracker (named in `only`, when given); returns the names of those it
        succeeded on."""
        done = []
        for t in self.open:
            if only is not None and t.name not in only:
                continue
            if self._call(t.name, lambda t=t: (getattr(t, method)(*args), True)[1]):
                done.append(t.name)
        return done

    def close(self, finished: bool | None) -> None:
        """Close every tracker: `finished` True (the run's last step is sent), False (stopped before it), None
        (leave the run's status as it was: `opsd eval`)."""
        self.each("close", finished)
        self.open = []


EVAL_COLUMNS = ["category", "episodes", "metric", "value", "ci95_low", "ci95_high", "mean_turns", "format_valid_rate", "errors"]


def eval_values(report: dict) -> tuple[dict[str, float], list[list]]:
    """An `opsd eval` report (services/rollout/evaluate.py: "categories" and "overall" rows, each metric a
    {"value", "ci95": [low, high]}) as tracker values {"eval/<category>/<metric>": value, "..._ci95_low",
    "..._ci95_high"} (None values left out) and table rows (EVAL_COLUMNS)."""
    values, rows = {}, []
    for name, row in [*report["categories"].items(), ("overall", report["overall"])]:
        for metric in report["metrics"]:
            v = row[metric]
            low, high = v["ci95"] if v.get("ci95") else (None, None)
            rows.append([name, row["episodes"], metric, v["value"], low, high, row.get("mean_turns"),
                         row.get("format_valid_rate"), row.get("errors")])
            for suffix, x in (("", v["value"]), ("_ci95_low", low), ("_ci95_high", high)):
                if isinstance(x, (int, float)) and math.isfinite(x):
                    values[f"eval/{name}/{metric}{suffix}"] = float(x)
    return values, rows


def report_eval(cfg, run_dir: Path, report: dict) -> list[str]:
    """Add an `opsd eval` report to the tracker runs of `run_dir` (trackers.json; cfg.run.report_to, those
    installed here), at step report["policy_version"]. Returns the names of the trackers that took it. Failures
    are contained as in `Trackers`. Without <run_dir>/trackers.json, its copy in the run's checkpoint names the
    tracker runs (a new file would send the resumed trainer's steps to new runs)."""
    def saved_state() -> dict:
        return read_state(run_dir) or read_state(Path(run_dir) / "checkpoint")  # the trainer's checkpoint folder

    state = saved_state()
    names = [t for t in cfg.run.report_to if importlib.util.find_spec(PACKAGES[t][0]) is not None]
    trackers = Trackers(names, cfg.tracking, run_dir, cfg.model_dump(mode="json"), state, "eval")
    values, rows = eval_values(report)
    done = trackers.each("log_eval", int(report["policy_version"]), values, rows, EVAL_COLUMNS)
    if trackers.open:  # a tracker run started here (report_to added after training) is found again next time
        saved = saved_state()
        for t in trackers.open:  # a new tracker run (the store lost the old one): a resume sends it every step
            if t.new_run:
                saved.get("sent_through", {}).pop(t.name, None)
        try:
            write_state(run_dir, {**saved, **trackers.state()})
        except OSError as e:
            log.warning("could not write %s: %s", Path(run_dir) / STATE_FILE, e)
    trackers.close(None)
    return done
