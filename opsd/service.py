"""What every role process shares: its HTTP endpoints, signals, run directory and Redis.

Each role serves `/health` (JSON) and `/metrics` (Prometheus text) from a
FastAPI app on its own port. The port actually bound is written to
`<run_dir>/ports/<role>.json` so the CLI and tests can find every service.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from opsd.config import RunConfig

DEPTH_EVERY_S = 10.0  # how often a worker exports its stream's lag/pending gauges
BIND_HOST_ENV = "OPSD_BIND_HOST"  # 0.0.0.0 inside containers; loopback by default


def add_observability(app: FastAPI, role: str, health: Callable[[], dict[str, Any]]) -> None:
    """Add GET /health (role, status, pid, plus `health()`'s fields) and GET /metrics to `app`."""

    @app.get("/health")
    def _health() -> dict[str, Any]:
        return {"role": role, "status": "ok", "pid": os.getpid(), **health()}

    @app.get("/metrics")
    def _metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read it from getsockname)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
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
    tmp = ports / f".{role}.json.tmp"
    tmp.write_text(json.dumps({"role": role, "host": host, "port": port, "pid": os.getpid()}))
    tmp.replace(ports / f"{role}.json")


def read_port(run_dir: Path, role: str) -> dict[str, Any] | None:
    path = run_dir / "ports" / f"{role}.json"
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class RoleProcess:
    """One role's process-wide state: config, run dir, stop flag, health fields."""

    role: str
    cfg: RunConfig
    run_dir: Path
    status: dict[str, Any] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

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
        cfg = RunConfig.load(config_path)
        proc = cls(role=role, cfg=cfg, run_dir=Path(run_dir))
        logging.basicConfig(
            level=os.environ.get("OPSD_LOG_LEVEL", "INFO"),
            format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        )
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
        return proc

    def open_queue(self, stream: str, cls: type, vocab_size: int | None = None):
        """A consumer-group reader of `stream` for this role (group = role name, one consumer per process).

        Connects to REDIS_URL (set by `opsd run`, or by the deployment) and
        creates the group if missing. Raises KeyError without REDIS_URL.
        """
        from opsd.queue import StreamNames, StreamQueue
        from opsd.redis_server import connect

        r = self.cfg.redis
        client = connect(os.environ["REDIS_URL"], r.block_ms)
        queue = StreamQueue(
            client, stream, group=self.role, consumer=f"{self.role}-{socket.gethostname()}-{os.getpid()}", cls=cls,
            role=self.role, max_bytes=r.max_message_bytes, dead_stream=StreamNames(r.stream_prefix).dead,
            max_deliveries=r.max_deliveries, vocab_size=vocab_size,
        )
        queue.ensure_group()
        return queue

    def serve(self, app: FastAPI | None = None, port: int = 0) -> int:
        """Serve `app` (or a bare one) with /health and /metrics added; returns the bound port."""
        app = app or FastAPI(title=f"opsd {self.role}")
        add_observability(app, self.role, lambda: dict(self.status))
        host = os.environ.get(BIND_HOST_ENV, "127.0.0.1")
        sock = bind_socket(host, port)
        serve_in_thread(app, sock)
        bound = sock.getsockname()[1]
        write_port(self.run_dir, self.role, host, bound)
        return bound


def consume_forever(proc: RoleProcess, queue, out_stream: str, handle: Callable[[Any], Any], reclaim_idle_ms: int, block_ms: int) -> None:
    """The rollout/teacher job loop: take a message, `handle` it, write the output, then ack.

    The input entry is acknowledged in the same server-side step that writes
    the output (`queue.produce_then_ack`), so a crash before that replays the
    job (re-claimed from the pending list after `reclaim_idle_ms`) and never
    loses it. While a job runs, a heartbeat keeps its entry fresh so live
    workers do not re-claim it. A job whose handler raises, or whose output is
    invalid, stays pending: it is retried after `reclaim_idle_ms`, and after
    `max_deliveries` attempts the queue moves it to the dead-letter stream.
    """
    from opsd.wire import WireError

    import redis

    log = logging.getLogger(proc.role)
    last_depth = 0.0
    backoff = 1.0
    while not proc.stop.is_set():
        try:
            if time.monotonic() - last_depth > DEPTH_EVERY_S:  # lag can cost a scan on old servers: not every loop
                queue.depth()
                last_depth = time.monotonic()
            deliveries = queue.reclaim(reclaim_idle_ms, count=1) or queue.consume(block_ms, count=1)
            backoff = 1.0
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # Redis restarting or unreachable: wait and retry; pending jobs are kept by the server.
            log.warning("redis unavailable (%s); retrying in %.0fs", e, backoff)
            proc.stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)
            continue
        for d in deliveries:
            if proc.stop.is_set():
                return
            proc.status["busy"] = True
            done = threading.Event()
            beat = threading.Thread(target=_heartbeat, args=(queue, d.entry_id, done, reclaim_idle_ms / 3000), daemon=True)
            beat.start()
            try:
                out = handle(d.msg)
                if queue.produce_then_ack(out_stream, out, d.entry_id) is None:
                    log.warning("job %s was re-claimed by another worker; its output is theirs", d.entry_id)
                proc.status["jobs_done"] = proc.status.get("jobs_done", 0) + 1
            except WireError as e:
                log.error("job %s produced an invalid output (%s); left pending for retry", d.entry_id, e)
            except Exception:  # one bad job must not kill the worker; it will be retried, then dead-lettered
                log.exception("job %s failed (delivery %d); left pending for retry", d.entry_id, d.deliveries)
            finally:
                done.set()
                beat.join()
                proc.status["busy"] = False


def _heartbeat(queue, entry_id: str, done: threading.Event, period_s: float) -> None:
    while not done.wait(period_s):
        try:
            queue.keep_alive([entry_id])
        except Exception as e:  # a lost heartbeat only risks duplicate work, never loss
            logging.getLogger("heartbeat").warning("keep_alive failed: %s", e)
