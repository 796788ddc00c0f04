"""How a run is run and watched: `run:`, `redis:`, `eval:`, `simulate:`, `weights:`, `tracking:` and `probes:`."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from opsd.config.base import _Section


class RunSection(_Section):
    # One path component under output_dir (no "/", no leading "."): "../x" or an absolute name would put the run
    # directory anywhere on the machine.
    name: str = Field("quickstart", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    steps: int = Field(3, ge=1)
    seed: int = 0
    output_dir: str = "runs"  # the run directory is output_dir/<name>-<timestamp>
    method: str = "alignopsd"  # one of CREDIT_METHODS (each a registered estimator, opsd.credit), checked on load
    step_timeout_s: float = Field(1800.0, gt=0)  # a step waiting this long re-issues its missing groups once; twice this long fails the run
    # 0 = synchronous (step n+1's tasks are issued after step n's update); k >= 1 = k-step-off:
    # tasks of steps n+1..n+k are in flight (sampled with older policies) while step n trains,
    # and a group more than k policy versions older than the trainer is dropped and counted.
    max_staleness: int = Field(0, ge=0, le=16)
    max_restarts: int = Field(3, ge=0)  # `opsd run` restarts a role that died at most this many times (per role)
    # Experiment trackers the trainer logs to (opsd/tracking.py; settings in `tracking:`): any of wandb,
    # tensorboard, mlflow. Each is an optional extra (pip install 'opsd[wandb]'); a missing one is refused at start.
    report_to: list[Literal["wandb", "tensorboard", "mlflow"]] = []

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice: {value}")
        return value


class RedisSection(_Section):
    url: str | None = None  # None and no REDIS_URL env: start a local redis-server
    stream_prefix: str | None = None  # default: "opsd:<run id>"
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    block_ms: int = Field(2000, ge=1)
    # Pending entries idle this long are re-claimed by a live worker (a running job's heartbeat, every
    # third of this, keeps it fresh): how soon the job of a dead worker, or a failed job, runs again.
    reclaim_idle_ms: int = Field(60_000, ge=1000)
    max_deliveries: int = Field(3, ge=1)  # then an entry goes to the dead-letter stream
    # Backpressure: a producer waits while the stream it writes to holds more than this many
    # entries not yet delivered to their consumer group (work streams are never trimmed).
    max_stream_lag: int = Field(64, ge=1)
    # The embedded redis-server (no url) keeps an append-only file under <run_dir>/redis/
    # (fsync always): a restarted server, or `opsd run --resume`, loses no acknowledged work.
    appendonly: bool = True


class EvalSection(_Section):
    """`opsd eval` (services/rollout/evaluate.py): the eval split of the env at the papers' validation temperature."""

    temperature: float = Field(0.4, gt=0)
    episodes_per_task: int = Field(1, ge=1, le=64)
    # Tasks played together (one batched generate call per turn, up to rollout.batch_size episodes); their
    # envs are open at once (a TextWorld-Express or ScienceWorld env is a JVM of a few hundred MB).
    parallel_tasks: int = Field(8, ge=1, le=256)
    bootstrap_samples: int = Field(1000, ge=100)  # resamples for the 95% intervals
    seed: int = 0


class SimulateSection(_Section):
    """Simulated compute (benchmarks/overlap.py): every role runs for real on a tiny model and holds each job
    for a configured compute time, so the pipeline's overlap is measured without the cost of a real model.

    Off unless `enabled: true`, and then only with `model.name: tiny-random` (opsd/models/hf.py: a 2-layer,
    hidden-64 random Llama with SmolLM2's tokenizer) on the hf backend: it cannot slow down a real run by
    accident. Everything else is real: Redis streams, message encoding and validation, the environment,
    credit assignment, the PPO update, checkpoints, weight publishing, metrics. A job's real work counts
    toward its compute time and the role sleeps the rest (nothing when the work took longer: the overrun
    shows in the stage's seconds), so each stage takes its configured time:
    rollout_s: seconds per group (the rollout of its G episodes); teacher_s: seconds per group (scoring);
    trainer_s: seconds per step (credit assignment + PPO update; the checkpoint and weight publishing come on
    top, as they are). Every role logs "simulated compute" at start; each metrics.jsonl line carries
    `simulated_compute: true`. Changes only timing, never what is trained (not part of the config hash).
    """

    enabled: bool = False
    rollout_s: float = Field(0.0, ge=0, le=3600)
    teacher_s: float = Field(0.0, ge=0, le=3600)
    trainer_s: float = Field(0.0, ge=0, le=3600)


def base_url(url: str, what: str = "weights.url") -> str:
    """`url` checked as an http(s) base URL such as http://trainer:8000 (scheme lower-cased); raises ValueError
    naming `what` for anything else: no or another scheme, no host, a port outside 1-65535, whitespace, a query or
    fragment."""
    bad = ValueError(f"{what} {url!r} is not an http(s) base URL such as http://trainer:8000")
    if not isinstance(url, str) or any(c.isspace() for c in url):
        raise bad
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or parts.query or parts.fragment:
        raise bad
    return urllib.parse.urlunsplit(parts)


class WeightsSection(_Section):
    """How rollout and teacher get the weights the trainer publishes (opsd/weights.py). Changes only how bytes
    travel, never what is trained (not part of the config hash).

    transport "file": from <run_dir>/weights/, which they must share with the trainer (one machine, or a
    shared volume). "http": from the trainer's HTTP API (GET /weights/<file>, services/trainer/weights_api.py,
    bearer token OPSD_API_TOKEN), so they need no weights volume. url: the trainer's base URL (e.g.
    http://trainer:8000); None = read from the trainer's port file in the run dir (`opsd run` on one box). The
    environment variables OPSD_WEIGHTS_TRANSPORT and OPSD_WEIGHTS_URL, when set, win over them (compose and k8s
    set them beside the volumes they mount: docker-compose.http.yml, k8s/components/weights-http).
    """

    transport: Literal["file", "http"] = "file"
    url: Annotated[str, AfterValidator(base_url)] | None = None


# No surrounding blanks (a path or a name of blanks alone was taken as given); W&B refuses / \\ # ? % : in a
# project or entity name.
_TRIMMED = r"^\S(.*\S)?$"
_WANDB_NAME = r"^[^\s/\\#?%:]([^/\\#?%:]*[^\s/\\#?%:])?$"
# MLflow's stores: a server (http, https, databricks) or a database (sqlite, postgresql, mysql, mssql, with an
# optional +driver); MLflow 3 keeps a plain directory (file:) in maintenance mode.
_MLFLOW_SCHEMES = ("http", "https", "databricks", "databricks-uc", "sqlite", "postgresql", "mysql", "mssql", "file")


def _mlflow_uri(value: str | None) -> str | None:
    if value is None:
        return value
    scheme = value if value in ("databricks", "databricks-uc") else urllib.parse.urlsplit(value).scheme.split("+", 1)[0]
    if scheme not in _MLFLOW_SCHEMES or value != value.strip():
        raise ValueError(f"tracking_uri {value!r}: expected a URI of scheme {', '.join(_MLFLOW_SCHEMES)} "
                         "(http://mlflow:5000, sqlite:////abs/path/mlflow.db)")
    return value


def _run_name(value: str | None) -> str | None:
    # A directory name too (TensorBoard's <log_dir>/<name>): no separator, not "." or "..", not "eval" (opsd eval's).
    if value is not None and ("/" in value or "\\" in value or value in (".", "..", "eval")):
        raise ValueError(f"tracking.name {value!r}: a name without / or \\, not '.', '..' or 'eval'")
    return value


class WandbSection(_Section):
    """Weights & Biases (run.report_to: [wandb]). None: the WANDB_* variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE,
    WANDB_API_KEY, WANDB_BASE_URL for a server of your own), else W&B's default (project "opsd")."""

    project: str | None = Field(None, min_length=1, max_length=128, pattern=_WANDB_NAME)
    entity: str | None = Field(None, min_length=1, max_length=128, pattern=_WANDB_NAME)
    group: str | None = Field(None, min_length=1, max_length=128, pattern=_TRIMMED)
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = []
    mode: Literal["online", "offline", "disabled"] | None = None  # offline: files only, `wandb sync` later
    dir: str | None = Field(None, pattern=_TRIMMED)  # where wandb/ is written (default: the run directory; a relative path: under it)
    init_timeout_s: float = Field(90.0, gt=0, le=3600)  # wandb.init's wait for the service (a server down: then counted)


class MlflowSection(_Section):
    """MLflow (run.report_to: [mlflow]). tracking_uri None: MLFLOW_TRACKING_URI, else a SQLite store in the run
    directory (sqlite:///<run_dir>/mlflow.db); experiment_name None: MLFLOW_EXPERIMENT_NAME, else "opsd"."""

    tracking_uri: Annotated[str | None, AfterValidator(_mlflow_uri)] = None
    experiment_name: str | None = Field(None, min_length=1, max_length=256, pattern=_TRIMMED)


class TensorBoardSection(_Section):
    """TensorBoard (run.report_to: [tensorboard]): event files in <run_dir>/tensorboard, or with log_dir (shared by
    runs, say) in <log_dir>/<tracking.name or the run directory's name>; a relative log_dir is under the run
    directory."""

    log_dir: str | None = Field(None, pattern=_TRIMMED)


class TrackingSection(_Section):
    """What the experiment trackers of run.report_to receive besides metrics.jsonl's values (opsd/tracking.py).

    name: the tracker run's name (default: the run directory's name). trajectories_per_step: rows of the
    per-step trajectory table (0: none); table_chars: the longest text cell (a task, the actions), cut
    beyond; histogram_bins: bins of the advantage, teacher-student gap and span-length histograms.
    Reporting only (not part of the config hash): a resumed run may add or drop a tracker.
    """

    name: Annotated[str | None, AfterValidator(_run_name)] = Field(None, min_length=1, max_length=128, pattern=_TRIMMED)
    trajectories_per_step: int = Field(4, ge=0, le=64)
    table_chars: int = Field(500, ge=20, le=10_000)
    histogram_bins: int = Field(64, ge=2, le=1024)
    wandb: WandbSection = WandbSection()
    mlflow: MlflowSection = MlflowSection()
    tensorboard: TensorBoardSection = TensorBoardSection()


class ProbesSection(_Section):
    """Readiness and liveness: every role's GET /readyz and /livez (opsd/probes.py, opsd/service.py). Limits in
    seconds, sized for a 7-8B model on real GPUs: a limit too short restarts a healthy worker mid-job, so they err
    long. Changes only when a hang is declared, never what is trained (not part of the config hash).

    beat_s: the longest a role's work loop may go without a beat while no guarded call runs. A healthy loop
    beats at least every redis.block_ms (a blocking read), on every Redis retry (waits of up to 30 s), while it
    waits for room downstream or for a step's groups; a job or a trainer stage runs under a guard of its own: at
    least twice the longest of those waits.
    generate_s: one engine call: a generate of a batch (one turn of every episode in flight, queued behind the
    engine's other requests), one teacher scoring pass, a policy version's load, the embedder's work on one
    request.
    job_s: one rollout or teacher group in all (every turn of its episodes, its environment steps and embedder
    calls, waiting for a version switch); at least generate_s.
    update_s: each trainer stage of a step: credit assignment and the PPO update with its collectives (FSDP2),
    gathering and publishing the new version, waiting for a checkpoint write (a 7B fp32 + AdamW checkpoint is
    ~91 GB).
    """

    beat_s: float = Field(300.0, gt=0)
    generate_s: float = Field(1800.0, gt=0)
    job_s: float = Field(7200.0, gt=0)
    update_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _job_holds_its_calls(self) -> "ProbesSection":
        if self.job_s < self.generate_s:
            raise ValueError(f"probes.job_s ({self.job_s:g}) must be at least probes.generate_s ({self.generate_s:g}): "
                             "a job makes engine calls")
        return self
