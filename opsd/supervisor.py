"""The role processes of one `opsd run`: start them, restart the dead, scrape their /metrics and /health, stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import httpx

from opsd.service import EXIT_WHEN_DONE_ENV, FATAL_EXIT, read_port, service_url

class Services:
    """The role processes of one run: start, supervise (restart the dead), scrape, stop.

    Every role gets REDIS_URL, OPSD_API_TOKEN and OPSD_PARENT_PID (it stops
    when this process dies) in its environment; `command`
    maps a role to its command line (default `python -m services.<role>
    --config C --run-dir D`, the trainer under torchrun with
    `trainer_ranks` > 1); a role that exits is started again by
    `supervise`, at most `max_restarts` times.
    """

    def __init__(self, run_dir: Path, config_path: Path, redis_url: str, api_token: str, max_restarts: int = 0,
                 command: Callable[[str], list[str]] | None = None, trainer_ranks: int = 1):
        self.run_dir = run_dir
        self.trainer_ranks = trainer_ranks
        self.config_path = config_path
        # OPSD_PARENT_PID: a role stops when this process dies, even by SIGKILL (opsd.service.die_with_parent).
        self.env = {**os.environ, "REDIS_URL": redis_url, "OPSD_API_TOKEN": api_token, "PYTHONUNBUFFERED": "1",
                    "OPSD_PARENT_PID": str(os.getpid())}
        self.env.pop("OPSD_PORT", None)  # a container's fixed port: here every role picks its own
        self.env.pop(EXIT_WHEN_DONE_ENV, None)  # a Job's setting: here the supervisor stops the trainer after DONE
        self.max_restarts = max_restarts
        self.command = command or self.role_command
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}

    def role_command(self, role: str) -> list[str]:
        """The command line of `role`; the trainer runs under torchrun when `trainer.nproc_per_node` > 1."""
        args = ["-m", f"services.{role}", "--config", str(self.config_path), "--run-dir", str(self.run_dir)]
        if role == "trainer" and self.trainer_ranks > 1:
            return [sys.executable, "-m", "services.trainer.torchrun", "--standalone",
                    f"--nproc-per-node={self.trainer_ranks}", *args]
        return [sys.executable, *args]

    def start(self, role: str) -> None:
        with open(self.run_dir / "logs" / f"{role}.log", "ab") as log:
            # Own process group: Ctrl-C reaches only the CLI, which then stops each role in order.
            self.procs[role] = subprocess.Popen(self.command(role), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True)
        self.restarts.setdefault(role, 0)

    def supervise(self) -> list[str]:
        """Start again every role that exited; returns one message per restart (also logged).

        Each restart is appended to logs/supervisor.log and to the role's own
        log. Raises RuntimeError (with the last lines of the role's log) for a
        role that exited after its `max_restarts` restarts were used.
        """
        messages = []
        for role, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            log = self.run_dir / "logs" / f"{role}.log"
            if rc == FATAL_EXIT:  # the role said a restart cannot help (bad config or checkpoint, a failed step)
                raise RuntimeError(f"{role} stopped on an error a restart cannot fix; last lines of its log:\n{tail(log)}")
            if self.restarts[role] >= self.max_restarts:
                raise RuntimeError(f"{role} exited with code {rc} after {self.restarts[role]} restart(s) "
                                   f"(run.max_restarts={self.max_restarts}); last lines of its log:\n{tail(log)}")
            self.restarts[role] += 1
            msg = f"{role} exited with code {rc}; restarting it ({self.restarts[role]}/{self.max_restarts})"
            stamp = datetime.now().isoformat(timespec="seconds")
            for path in (self.run_dir / "logs" / "supervisor.log", log):
                with open(path, "a") as f:
                    f.write(f"{stamp} opsd run: {msg}\n")
            self.start(role)
            messages.append(msg)
        return messages

    def scrape(self) -> dict[str, bool]:
        """GET every role's /metrics and /health; save the answers under scrapes/; returns which answered."""
        out = {}
        (self.run_dir / "scrapes").mkdir(exist_ok=True)
        headers = {"Authorization": f"Bearer {self.env['OPSD_API_TOKEN']}"}
        for role in self.procs:
            info = read_port(self.run_dir, role)
            ok = False
            if info:
                try:
                    url = service_url(info)
                    m = httpx.get(f"{url}/metrics", timeout=10, headers=headers)
                    h = httpx.get(f"{url}/health", timeout=10, headers=headers)
                    ok = m.status_code == 200 and h.status_code == 200
                    (self.run_dir / "scrapes" / f"{role}.prom").write_text(m.text)
                    (self.run_dir / "scrapes" / f"{role}.health.json").write_text(h.text)
                except (httpx.HTTPError, httpx.InvalidURL, KeyError, ValueError):  # a dead role, a bad port file
                    ok = False
            out[role] = ok
        return out

    def stop(self, timeout_s: float = 20.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tail(path: Path, n: int = 30) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
