"""What every role process shares: its HTTP endpoints, signals, run directory and Redis.

Each role serves from a FastAPI app on its own port: `/health` (JSON status),
`/metrics` (Prometheus text), `/readyz` and `/livez` (the platform's probes).
The port actually bound is written to `<run_dir>/ports/<role>.json` so the
CLI and tests can find every service.

/readyz answers 200 once the role can serve: its model is loaded and answered
one real request (`RoleProcess.check_engine`; the embedder: one encode; the
trainer: model loaded, checkpoint resumed, Redis answered), else 503 with the
reason (`RoleProcess.unready`); 503 "stopping" again from the first SIGTERM,
so a rolling update drains the pod. /livez answers 200 while the work loop
progresses (opsd.probes.Liveness: beats, guarded long calls), else 503.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import redis
import uvicorn
import yaml
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from opsd import metrics
from opsd.config import RunConfig, config_hash, hashed_config
from opsd.metrics import REDIS_RECONNECTS
from opsd.probes import Liveness
from opsd.queue import RedisFullError, StreamNames
from opsd.types import MessageLimits
from opsd.weights import StalePolicyError
from opsd.wire import WireError

# A role exits with this code when restarting it cannot help (a config or checkpoint it refuses, a step
# that cannot complete): `opsd run`'s supervisor then fails the run instead of restarting the role.
FATAL_EXIT = 3
DEPTH_EVERY_S = 10.0  # how often a worker exports its stream's lag/pending gauges
REDIS_RETRY_FIRST_S = 0.5  # after the client's own ~1.5 s of retries: a restarting server is back in ~1 s
REDIS_RETRY_MAX_S = 10.0
BIND_HOST_ENV = "OPSD_BIND_HOST"  # 0.0.0.0 inside containers; loopback by default
PORT_ENV = "OPSD_PORT"  # containers: every role serves on one fixed port (8000), whatever the config says
_STATUS_LOCK = threading.Lock()  # proc.status counters updated by job threads
PARENT_PID_ENV = "OPSD_PARENT_PID"  # set by `opsd run`: its roles stop when it dies (see `die_with_parent`)
# "1": the trainer exits 0 after writing DONE instead of serving on (a Kubernetes Job completes and frees its GPUs).
# A platform setting, not a run's (never hashed or resumed); `opsd run` removes it: its supervisor needs the trainer up.
EXIT_WHEN_DONE_ENV = "OPSD_EXIT_WHEN_DONE"
# Kubernetes (ConfigMap opsd-run): the run's name. The roles' run directory is /data/runs/<it> and KEDA's stream
# names opsd:<it>:... (k8s/run), which match the prefix a role derives from its run directory's name only for a
# name that is one path component: a DNS label, as k8s/README.md asks.
RUN_NAME_ENV = "OPSD_RUN_NAME"
_RUN_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
LOG_LEVEL_ENV = "OPSD_LOG_LEVEL"  # every role's log level (compose passes it through; INFO when unset)


def add_observability(app: FastAPI, role: str, health: Callable[[], dict[str, Any]], *,
                      unready: Callable[[], str | None], liveness: Liveness) -> None:
    """Add GET /health (role, status, pid, plus `health()`'s fields), /metrics, /readyz and /livez to `app`.

    /readyz: 200 {"role", "ready": true} while `unready()` is None, else 503
    {"role", "ready": false, "reason": unready()}. /livez: `liveness.state()`
    plus "role", 200 while live, else 503. All four need no token (opsd.auth.OPEN_PATHS).
    """

    @app.get("/health")
    def _health() -> dict[str, Any]:
        return {"role": role, "status": "ok", "pid": os.getpid(), **health()}

    @app.get("/readyz")
    def _ready() -> JSONResponse:
        reason = unready()
        body = {"role": role, "ready": reason is None, **({"reason": reason} if reason else {})}
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @app.get("/livez")
    def _live() -> JSONResponse:
        state = liveness.state()
        return JSONResponse({"role": role, **state}, status_code=200 if state["live"] else 503)

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text, and so documented
    def _metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read it from getsockname).

    The address family follows `host` (IPv4 or IPv6, e.g. "::" on IPv6-only
    clusters, which then also accepts IPv4 where the kernel allows dual stack);
    "" means every IPv4 interface.
    Raises OSError (socket.gaierror) for a host that does not resolve.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    sock.listen(128)
    return sock


def serve_in_thread(app: FastAPI, sock: socket.socket) -> uvicorn.Server:
    """Run `app` on an already-bound socket in a daemon thread (no port race); returns the server."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    return server


def write_port(run_dir: Path, role: str, host: str, port: int) -> None:
    """Record where `role` serves, atomically (readers never see half a file)."""
    ports = run_dir / "ports"
    ports.mkdir(parents=True, exist_ok=True)
    # One temp name per process: scaled replicas of a role share the run dir (a k8s/compose volume).
    tmp = ports / f".{role}.{socket.gethostname()}.{os.getpid()}.json.tmp"
    tmp.write_text(json.dumps({"role": role, "host": host, "port": port, "pid": os.getpid()}))
    tmp.replace(ports / f"{role}.json")


def read_port(run_dir: Path, role: str) -> dict[str, Any] | None:
    path = run_dir / "ports" / f"{role}.json"
    return json.loads(path.read_text()) if path.exists() else None


def service_url(info: dict[str, Any]) -> str:
    """`http://host:port` of a port file's record (`read_port`), for a client on this machine.

    A wildcard bind address becomes the loopback of its family; an IPv6
    address is bracketed. Raises KeyError/ValueError for a record without a
    host or an integer port.
    """
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(info["host"], info["host"])
    return f"http://{f'[{host}]' if ':' in host else host}:{int(info['port'])}"


@dataclass
class RoleProcess:
    """One role's process-wide state: config, run dir, stop flag, health fields, readiness and liveness.

    unready: why the role cannot serve yet ("starting", "loading the model", ...), None once it can (/readyz).
    liveness: its work loop's beats and guarded calls (/livez; limits in cfg.probes).
    """

    role: str
    cfg: RunConfig
    run_dir: Path
    status: dict[str, Any] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    unready: str | None = "starting"
    liveness: Liveness = field(init=False)

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.cfg.probes.beat_s)

    def not_ready_reason(self) -> str | None:
        """What /readyz reports: "stopping" from the first SIGTERM/SIGINT on, else `unready` (None: ready)."""
        return "stopping" if self.stop.is_set() else self.unready

    def check_engine(self, backend, engine=None) -> None:
        """Mark the role ready once its model answers a real request: one 1-token generation.

        Sent through `engine` (an opsd.models.engine.Engine: what a worker with
        many groups in flight samples with) or else `backend.generate`, with a
        fixed seed (the global RNG is left alone), under a "probe generation"
        guard of probes.generate_s. Records {"tokens", "seconds"} as /health's
        "probe"; raises what the engine raises (the role then dies, and its
        platform restarts it).
        """
        from opsd.models.engine import SampleRequest

        self.unready = "waiting for the engine to answer a probe request"
        ids = backend.tokenizer.encode("ping", add_special_tokens=False)
        t0 = time.perf_counter()
        with self.liveness.guard("probe generation", self.cfg.probes.generate_s):
            if engine is not None:
                gen = engine.submit(SampleRequest(ids, max_new_tokens=1, temperature=1.0, seed=0)).result()
            else:
                (gen,) = backend.generate([ids], max_new_tokens=1, temperature=1.0, seed=0)
        self.status["probe"] = {"tokens": len(gen.token_ids), "seconds": round(time.perf_counter() - t0, 3)}
        self.unready = None

    @classmethod
    def from_argv(cls, role: str, description: str | None = None) -> "RoleProcess":
        """Parse `--config C --run-dir D` (every role's command line) and `start` the role."""
        ap = argparse.ArgumentParser(prog=f"python -m services.{role}", description=description)
        ap.add_argument("--config", required=True, help="the run config (YAML)")
        ap.add_argument("--run-dir", required=True, help="the run directory (ports/, weights/, logs)")
        args = ap.parse_args()
        return cls.start(role, args.config, args.run_dir)

    @classmethod
    def start(cls, role: str, config_path: str, run_dir: str) -> "RoleProcess":
        """Load the config, set up logging and signals (serving /health + /metrics is `serve`)."""
        try:
            cfg = RunConfig.load(config_path)
            if os.environ.get(PORT_ENV):
                env_port(os.environ[PORT_ENV])
            check_run_name(run_dir)
            log_level = env_log_level()
        except (OSError, ValueError, yaml.YAMLError) as e:  # pydantic's ValidationError is a ValueError
            fatal(role, str(e))
        # `opsd run` sets the prefix in the resolved config; a role started by a container platform
        # derives the same one from its run directory, so every role of a deployment agrees on it.
        cfg.redis.stream_prefix = cfg.redis.stream_prefix or f"opsd:{Path(run_dir).resolve().name}"
        proc = cls(role=role, cfg=cfg, run_dir=Path(run_dir))
        metrics.init_series(role)
        logging.basicConfig(
            level=log_level,
            format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        )
        # httpx logs every request at INFO (one line per embedder call in the teacher's log): its warnings stay.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if cfg.model.threads:
            import torch

            torch.set_num_threads(cfg.model.threads)
        # First SIGTERM/SIGINT: finish the current job, then leave the loop (an
        # unfinished job stays pending and is replayed). A second one: exit now.
        def _on_signal(signum, _frame):
            if proc.stop.is_set():
                os._exit(128 + signum)
            proc.stop.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        die_with_parent(proc.stop)
        return proc

    @property
    def config_hash(self) -> str:
        """The run identity of this role's config (`opsd.config.config_hash`): the trainer publishes its own."""
        return config_hash(hashed_config(self.cfg))

    def open_queue(self, stream: str, cls: type, vocab_size: int | None = None, max_deliveries: int | None = None):
        """A consumer-group reader of `stream` for this role (group = role name, one consumer per process).

        `max_deliveries` overrides redis.max_deliveries (deliveries before an entry is dead-lettered).

        Connects to REDIS_URL (set by `opsd run`, or by the deployment) and
        creates the group if missing; outputs are counted in the run's counts
        hash. Waits (retry_redis) for a Redis that is not up yet. Exits the
        process with FATAL_EXIT (`fatal`) without REDIS_URL, for a URL without a
        password or one that does not parse (see `connect`), and when Redis
        refuses the password.
        """
        from opsd.queue import StreamQueue
        from opsd.redis_server import connect

        r = self.cfg.redis
        try:
            client = connect(os.environ["REDIS_URL"], r.block_ms)
        except KeyError:
            fatal(self.role, "REDIS_URL is not set (redis://:PASSWORD@host:port/db)")
        except ValueError as e:  # a URL without a password, or one that does not parse
            fatal(self.role, str(e))
        names = StreamNames(r.stream_prefix)
        queue = StreamQueue(
            client, stream, group=self.role, consumer=f"{self.role}-{socket.gethostname()}-{os.getpid()}", cls=cls,
            role=self.role, max_bytes=r.max_message_bytes, dead_stream=names.dead,
            max_deliveries=max_deliveries or r.max_deliveries, vocab_size=vocab_size, counts_key=names.counts,
            limits=MessageLimits.for_config(self.cfg),
        )
        metrics.MESSAGES_RECLAIMED.labels(role=self.role, stream=stream)
        for reason in ("malformed", "oversized", "over_limits", "deleted", "too_many_deliveries", "stale_policy_version"):
            metrics.MESSAGES_REJECTED.labels(role=self.role, stream=stream, reason=reason)
        # In a cluster, Redis may come up after the roles (no start order): wait for it, do not crash-loop.
        try:
            retry_redis(self, f"creating consumer group {self.role} on {stream}", queue.ensure_group)
        except redis.AuthenticationError as e:  # a wrong password is not an outage: waiting cannot fix it
            fatal(self.role, f"Redis refused the password in REDIS_URL: {e}")
        return queue

    def serve(self, app: FastAPI | None = None, port: int = 0) -> int:
        """Serve `app` (or a bare one) with /health, /metrics, /readyz and /livez added; returns the bound port.

        `port` is the config's (0 = a free one); the OPSD_PORT environment
        variable, when set, wins (containers: 8000 for every role, which
        Prometheus, probes and the teacher's embedder URL rely on). Raises
        ValueError for an OPSD_PORT that is not an integer in 1..65535.
        """
        # A metrics-only app has no API to document: no /docs or /openapi.json to leave unauthenticated.
        app = app or FastAPI(title=f"opsd {self.role}", docs_url=None, redoc_url=None, openapi_url=None)
        add_observability(app, self.role, lambda: {**self.status, "ready": self.not_ready_reason() is None},
                          unready=self.not_ready_reason, liveness=self.liveness)
        host = os.environ.get(BIND_HOST_ENV, "127.0.0.1")
        if os.environ.get(PORT_ENV):
            port = env_port(os.environ[PORT_ENV])
        sock = bind_socket(host, port)
        serve_in_thread(app, sock)
        bound = sock.getsockname()[1]
        write_port(self.run_dir, self.role, host, bound)
        return bound


def embedder_url(run_dir: Path) -> str | None:
    """The embedder's base URL: OPSD_EMBEDDER_URL, else from the port file it writes; None while there is none."""
    if os.environ.get("OPSD_EMBEDDER_URL"):
        return os.environ["OPSD_EMBEDDER_URL"]
    try:
        info = read_port(run_dir, "embedder")
        if not info:
            return None
        return service_url(info)
    except (OSError, ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        logging.getLogger("opsd.service").warning("unreadable embedder port file (%s)", e)
        return None


def check_run_name(run_dir: str | os.PathLike) -> None:
    """Check OPSD_RUN_NAME, when set (Kubernetes): a DNS label (a-z, 0-9, '-'; 1-63 characters; a letter or digit
    first and last) that names `run_dir`.

    Raises ValueError naming the variable otherwise: a name such as "a/b", ".." or "" would give the roles
    another stream prefix (opsd:<the run directory's name>) than the one KEDA polls (opsd:<OPSD_RUN_NAME>),
    and the workers would never scale while the run waits.
    """
    name = os.environ.get(RUN_NAME_ENV)
    if name is None:
        return
    if not _RUN_NAME.fullmatch(name):
        raise ValueError(f"{RUN_NAME_ENV}={name!r} (ConfigMap opsd-run) is not a DNS label: 1 to 63 characters "
                         "a-z, 0-9 and '-', a letter or digit first and last")
    if Path(run_dir).resolve().name != name:
        raise ValueError(f"{RUN_NAME_ENV}={name!r} but the run directory is {run_dir}: KEDA polls the streams "
                         f"opsd:{name}:..., the roles would use opsd:{Path(run_dir).resolve().name}:...")


def env_log_level() -> int:
    """OPSD_LOG_LEVEL as a `logging` level: a level name in any case ("debug", "INFO", "warning"), INFO when unset or
    empty. Raises ValueError naming the variable for anything else: logging.basicConfig refused "debug" and any
    unknown name with a traceback out of every role's start (exit 1: restarted, to fail the same way)."""
    text = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not text:
        return logging.INFO
    level = logging.getLevelName(text.upper())  # the level's number for a name, else the string "Level ..."
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={text!r} is not a log level: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def fatal(role: str, reason: str) -> NoReturn:
    """Stop a role that a restart cannot help (bad config or environment): one line on stderr, exit FATAL_EXIT."""
    print(f"{role}: cannot start: {reason}", file=sys.stderr, flush=True)
    sys.exit(FATAL_EXIT)


def load_worker_backend(role: str, cfg, model=None, **load_args) -> Any:
    """`opsd.models.load_backend(model or cfg.model, **load_args)` for rollout, teacher and trainer (which passes
    backend="hf" and its master weights' dtype); what cannot start is fatal.

    model: a ModelSection (the teacher passes `cfg.teacher_model`). Every error of the load but a RuntimeError
    exits FATAL_EXIT with its first line: an ImportError (backend vllm without vLLM), an OSError (a missing
    model directory or weight file), a ModelUnavailableError, an UntrustedModelError, and what a malformed
    directory raises from transformers, tokenizers or safetensors (a config.json that is a list: TypeError; a
    tokenizer_config.json that is one: AttributeError; a truncated model.safetensors: SafetensorError; a
    field of the wrong type: huggingface_hub's validation error): restarting the role cannot fix the files.
    A RuntimeError (out of memory, a device error) propagates: a restart may find the device free.
    """
    from opsd.models import load_backend

    try:
        return load_backend(model or cfg.model, **load_args)
    except RuntimeError:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary of a role's start: the files are wrong, one line
        fatal(role, (str(e).strip().splitlines() or [type(e).__name__])[0])


def env_port(text: str) -> int:
    """OPSD_PORT's value as a port number (ASCII digits, 1-65535, spaces around allowed).

    Raises ValueError naming the variable for anything else, 0 included: a
    deployment sets OPSD_PORT so that probes and scrapers know the port.
    """
    digits = text.strip()
    port = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 1 <= port <= 65535:
        raise ValueError(f"{PORT_ENV}={text!r} is not a port number (1-65535)")
    return port


def die_with_parent(stop: threading.Event) -> bool:
    """Under `opsd run` (OPSD_PARENT_PID set, Linux): get SIGTERM when the CLI dies, even by SIGKILL.

    Each role runs in a session of its own (Ctrl-C reaches only the CLI), so
    without this a killed CLI left its roles running as orphans, retrying a
    Redis that died with it. SIGTERM is the usual graceful stop; if the CLI
    is already gone, `stop` is set instead. Returns True if armed.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    # Under torchrun (`trainer.nproc_per_node` > 1) the parent is torchrun's agent, which dies with
    # the CLI (services/trainer/torchrun.py) and stops its ranks: the signal comes when the agent dies.
    if "TORCHELASTIC_RUN_ID" not in os.environ and os.getppid() != int(parent):  # it died before prctl
        stop.set()
    return True


def consume_forever(
    proc: RoleProcess,
    queue,
    out_stream: str,
    handle: Callable[[Any], Any],
    reclaim_idle_ms: int,
    block_ms: int,
    out_group: str | None = None,
    max_in_flight: int = 1,
) -> None:
    """The rollout/teacher job loop: take a message, `handle` it, write the output, then ack.

    queue: the role's StreamQueue on its input stream; out_stream/out_group:
    where outputs go and the consumer group that reads them (tasks ->
    "rollout", rollouts -> "teacher", or "trainer" for grpo, scored ->
    "trainer"); None disables backpressure. Returns when `proc.stop` is set
    (after the jobs in flight have finished or been left pending).

    max_in_flight: jobs held at once (>= 1). With more than one, each job
    runs `handle` in a thread of its own (so `handle` must be thread-safe)
    and is heartbeated and acknowledged on its own, when its own output is
    written; the loop takes a new job whenever one of the K slots is free.
    GROUPS_IN_FLIGHT{role} shows how many are held.

    Backpressure: before taking the next job the loop waits while
    `out_stream` holds more than `redis.max_stream_lag` entries not yet
    delivered to `out_group` (`queue.wait_for_room`).
    The input entry is acknowledged in the same server-side step that writes
    the output (`queue.produce_then_ack`), so a crash before that replays the
    job (re-claimed from the pending list after `reclaim_idle_ms`) and never
    loses it. While a job runs, a heartbeat keeps its entry fresh so live
    workers do not re-claim it. A job whose handler raises, or whose output is
    invalid, stays pending: it is retried after `reclaim_idle_ms`, and after
    `max_deliveries` attempts the queue moves it to the dead-letter stream.
    A handler raising StalePolicyError (its policy version is gone) sends the
    job to the dead-letter stream at once (reason "stale_policy_version").
    A lost Redis connection (reading, acking, writing) is retried with backoff
    until it comes back (REDIS_RECONNECTS{role} counts each outage); a
    computed output is never dropped because Redis blinked or was full
    (maxmemory): writing it is retried until it succeeds or the process is
    told to stop, and then the input stays pending and is replayed.

    Liveness (/livez): the loop beats every round and while it waits for room
    or for Redis; each job's `handle` runs under a guard of probes.job_s.
    """
    log = logging.getLogger(proc.role)
    max_lag = proc.cfg.redis.max_stream_lag
    last_depth = 0.0
    running: dict[Future, str] = {}  # jobs in flight -> their entry ids
    config_key, own_hash = StreamNames(proc.cfg.redis.stream_prefix).config_hash, proc.config_hash

    def take() -> list:
        nonlocal last_depth
        if out_group is not None and not queue.wait_for_room(out_stream, out_group, max_lag, proc.stop,
                                                             on_poll=proc.liveness.beat):
            return []
        if time.monotonic() - last_depth > DEPTH_EVERY_S:  # lag can cost a scan on old servers: not every loop
            queue.depth()
            last_depth = time.monotonic()
        free = max_in_flight - len(running)
        return queue.reclaim(reclaim_idle_ms, count=free) or queue.consume(block_ms, count=free)

    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if out_group is not None:
        metrics.BACKPRESSURE_SECONDS.labels(role=proc.role, stream=out_stream)
    in_flight = metrics.GROUPS_IN_FLIGHT.labels(proc.role)
    # What escapes a job thread (SystemExit from a refused token, a Redis AuthenticationError, ...) ends the
    # loop and is raised here, as it would be with one job at a time.
    escaped: list[BaseException] = []

    # One job at a time runs in this thread, as it always did; more run in a pool.
    pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="job") if max_in_flight > 1 else None
    try:
        while not proc.stop.is_set():
            proc.liveness.beat()
            for f in [f for f in running if f.done()]:
                del running[f]
            in_flight.set(len(running))
            if len(running) >= max_in_flight:  # every slot busy: wait for one (or for stop)
                wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                continue
            # Before taking anything: a worker with another config than the trainer's must not claim (and so
            # count a delivery of) a job it will not do.
            if not _check_trainer_config(proc, queue, config_key, own_hash, log):
                return
            ok, deliveries = retry_redis(proc, "reading jobs", take)
            if not ok:
                return
            for d in deliveries:
                if proc.stop.is_set():
                    return
                if pool is None:
                    in_flight.set(1)
                    _run_job(proc, queue, out_stream, handle, d, reclaim_idle_ms, log)
                elif d.entry_id in running.values():
                    # Our own job, re-claimed after its heartbeats lapsed (a Redis outage): it runs already.
                    log.warning("job %s re-claimed while this worker runs it; not started twice", d.entry_id)
                else:
                    running[pool.submit(_run_job_in_pool, proc, queue, out_stream, handle, d, reclaim_idle_ms, log,
                                        escaped)] = d.entry_id
                in_flight.set(len(running))
    finally:
        if pool is not None:
            pool.shutdown(wait=True)  # jobs in flight finish, or stop at proc.stop and stay pending
        in_flight.set(0)
        if escaped:
            raise escaped[0]


def _check_trainer_config(proc: RoleProcess, queue, config_key: str, own_hash: str, log) -> bool:
    """Stop, fatal, when the config hash the trainer published (at `config_key`) differs from this worker's
    `own_hash` (each container reads its own config file); False when `proc.stop` was set while Redis did not answer."""

    def trainer_config() -> str | None:
        value = queue.client.get(config_key)
        return value.decode() if value is not None else None

    ok, published = retry_redis(proc, "reading the trainer's config hash", trainer_config)
    if not ok:
        return False
    if published is not None and published != own_hash:
        log.error("this %s's config differs from the one the trainer published (config hash %s != %s): in "
                  "containers give every role the run's config file; after `opsd run --resume`, config.yaml "
                  "was changed in a field a run cannot resume with; stopping", proc.role, own_hash[:12],
                  published[:12])
        sys.exit(FATAL_EXIT)
    return True


def _run_job_in_pool(proc: RoleProcess, queue, out_stream: str, handle: Callable[[Any], Any], d, reclaim_idle_ms: int,
                     log, escaped: list[BaseException]) -> None:
    """`_run_job` on a pool thread: what escapes it goes to `escaped` (the loop raises it) and stops the process."""
    try:
        _run_job(proc, queue, out_stream, handle, d, reclaim_idle_ms, log)
    except BaseException as e:  # noqa: BLE001 - re-raised by the loop's thread
        if not isinstance(e, SystemExit):
            log.exception("job %s: unexpected error; stopping", d.entry_id)
        escaped.append(e)
        proc.stop.set()


def _run_job(proc: RoleProcess, queue, out_stream: str, handle: Callable[[Any], Any], d, reclaim_idle_ms: int, log) -> None:
    with _STATUS_LOCK:
        proc.status["busy"] = proc.status.get("busy", 0) + 1  # jobs running (0: idle)
    done = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(queue, d.entry_id, done, reclaim_idle_ms / 3000), daemon=True)
    beat.start()
    try:
        try:
            with proc.liveness.guard(f"job {d.entry_id}", proc.cfg.probes.job_s):
                out = handle(d.msg)
        except StalePolicyError as e:
            error = str(e)
            log.warning("job %s needs a policy version that is gone (%s); dead-lettering it", d.entry_id, error)
            retry_redis(proc, f"dead-lettering job {d.entry_id}",
                        lambda: queue.dead_letter(d.entry_id, d.raw, error, "stale_policy_version"))
            return
        except Exception:  # one bad job must not kill the worker; it will be retried, then dead-lettered
            log.exception("job %s failed (delivery %d); left pending for retry", d.entry_id, d.deliveries)
            return
        try:
            ok, out_id = retry_redis(proc, f"writing job {d.entry_id}'s output",
                                     lambda: queue.produce_then_ack(out_stream, out, d.entry_id))
        except WireError as e:
            log.error("job %s produced an invalid output (%s); left pending for retry", d.entry_id, e)
            return
        except Exception:
            log.exception("job %s: writing its output failed; left pending for retry", d.entry_id)
            return
        if not ok:
            log.warning("stopped before job %s's output was written; it stays pending and will be replayed", d.entry_id)
            return
        if out_id is None:
            log.warning("job %s was re-claimed by another worker, or finished by a retry whose reply was lost; "
                        "its output exists once", d.entry_id)
        with _STATUS_LOCK:
            proc.status["jobs_done"] = proc.status.get("jobs_done", 0) + 1
    finally:
        done.set()
        beat.join()
        with _STATUS_LOCK:
            proc.status["busy"] -= 1


def retry_redis(proc: RoleProcess, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Call `fn()` until it gets through a Redis connection loss; returns (True, its result).

    On redis.ConnectionError/TimeoutError (after the client's own short
    retries) waits REDIS_RETRY_FIRST_S, doubling up to REDIS_RETRY_MAX_S, and
    calls `fn` again; REDIS_RECONNECTS{role} counts one per outage, not per
    attempt; each wait is a liveness beat. Returns (False, None) if `proc.stop` is set while waiting. Any
    other exception propagates, redis.AuthenticationError included. `fn` must
    be safe to repeat (its effect may have happened with only the reply lost).
    opsd.queue.RedisFullError (Redis at maxmemory refused a write, nothing was
    written) is waited out the same way, not counted as an outage: readers
    free memory as they acknowledge, and a computed output is kept, not
    dropped and recomputed.
    """
    log = logging.getLogger(proc.role)
    delay = REDIS_RETRY_FIRST_S
    first = True
    while True:
        try:
            return True, fn()
        except redis.AuthenticationError:  # a ConnectionError subclass, but retrying cannot fix it
            raise
        except (redis.ConnectionError, redis.TimeoutError, RedisFullError) as e:
            if first and not isinstance(e, RedisFullError):
                REDIS_RECONNECTS.labels(role=proc.role).inc()
                first = False
            log.warning("redis unavailable while %s (%s); retrying in %.1fs", what, e, delay)
            proc.liveness.beat()  # waiting out an outage is not a hang: a restart cannot bring Redis back
            if proc.stop.wait(delay):
                return False, None
            delay = min(delay * 2, REDIS_RETRY_MAX_S)


def _heartbeat(queue, entry_id: str, done: threading.Event, period_s: float) -> None:
    while not done.wait(period_s):
        try:
            queue.keep_alive([entry_id])
        except Exception as e:  # a lost heartbeat only risks duplicate work, never loss
            logging.getLogger("heartbeat").warning("keep_alive failed: %s", e)
