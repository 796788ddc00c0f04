"""What a cluster sees of a run's end (k8s/): the Redis list `<prefix>:active` KEDA reads, and the trainer's opt-in
exit at DONE (OPSD_EXIT_WHEN_DONE), so a Job completes and frees its GPUs.

Real parts: a redis-server (tests/conftest.py), the tiny model (tests/tiny_model.py), and the trainer and one
rollout worker as the plain processes compose and Kubernetes start (`python -m services.<role>`), method grpo
(no teacher), one step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from opsd.queue import StreamNames
from opsd.service import EXIT_WHEN_DONE_ENV
from services.trainer.__main__ import exit_when_done
from services.trainer.controller import Backoff, mark_active
from tests.soak import stop_sessions, wait_until, write_config
from tests.tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def test_mark_active_keeps_exactly_one_entry_then_deletes_it(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    backoff = Backoff("trainer", threading.Event())
    mark_active(redis_client, names, "run-a", backoff)
    mark_active(redis_client, names, "run-a", backoff)  # a restarted trainer writes it again: still one entry
    assert names.active == f"{stream_prefix}:active"
    assert redis_client.type(names.active) == b"list" and redis_client.lrange(names.active, 0, -1) == [b"run-a"]
    mark_active(redis_client, names, None, backoff)
    assert redis_client.exists(names.active) == 0 and redis_client.llen(names.active) == 0  # LLEN: what KEDA reads


def test_exit_when_done_is_opt_in_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(EXIT_WHEN_DONE_ENV, raising=False)
    assert exit_when_done() is False
    for value, want in (("1", True), ("true", True), (" TRUE ", True), ("0", False), ("false", False), ("", False)):
        monkeypatch.setenv(EXIT_WHEN_DONE_ENV, value)
        assert exit_when_done() is want, value
    monkeypatch.setenv(EXIT_WHEN_DONE_ENV, "yes")
    with pytest.raises(ValueError, match=EXIT_WHEN_DONE_ENV):
        exit_when_done()


def test_opsd_run_keeps_its_trainer_serving_after_done(monkeypatch, tmp_path):
    """`opsd run` stops its roles itself after DONE (and would restart a trainer that exited): it drops the variable."""
    from opsd.supervisor import Services

    monkeypatch.setenv(EXIT_WHEN_DONE_ENV, "1")
    services = Services(tmp_path, tmp_path / "config.yaml", "redis://:pw@127.0.0.1:1/0", "t" * 32)
    assert EXIT_WHEN_DONE_ENV not in services.env


@pytest.mark.e2e
def test_the_trainer_marks_its_run_active_until_done_then_exits_0_when_asked(tmp_path, redis_url, redis_client,
                                                                             stream_prefix):
    model = make_tiny_model_dir(tmp_path / "tiny")
    config = write_config(tmp_path / "job.yaml", model, run={"method": "grpo", "steps": 1},
                          redis={"stream_prefix": stream_prefix})
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    active = StreamNames(stream_prefix).active
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "OPSD_API_TOKEN": "t" * 32}
    procs: dict[str, subprocess.Popen] = {}

    def start(role: str, **extra: str) -> None:
        with open(tmp_path / f"{role}.log", "wb") as log:
            procs[role] = subprocess.Popen([sys.executable, "-m", f"services.{role}", "--config", str(config), "--run-dir",
                                            str(run_dir)], cwd=REPO, env={**env, **extra}, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def trainer_log() -> str:
        return (tmp_path / "trainer.log").read_text(errors="replace")[-4000:]

    try:
        start("trainer", **{EXIT_WHEN_DONE_ENV: "1"})
        # No rollout worker yet: the run cannot have finished, and the list must already say it is active.
        wait_until(lambda: redis_client.llen(active) == 1 or procs["trainer"].poll() is not None, 300,
                   "the trainer's <prefix>:active list", poll_s=0.2)
        assert procs["trainer"].poll() is None, trainer_log()
        assert redis_client.lrange(active, 0, -1) == [(run_dir / "run_id").read_text().strip().encode()]
        assert not (run_dir / "DONE").exists()
        start("rollout")
        assert procs["trainer"].wait(600) == 0, trainer_log()
        assert (run_dir / "DONE").is_file()
        assert redis_client.exists(active) == 0 and redis_client.llen(active) == 0
        assert f"{EXIT_WHEN_DONE_ENV}: exiting at DONE" in trainer_log()
    finally:
        stop_sessions(procs.values())
