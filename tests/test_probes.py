"""Readiness (/readyz) and liveness (/livez) through a role's lifecycle, without Kubernetes.

Ready = the model is loaded and answered a real request, and the role is not
stopping; live = the work loop beats, and no guarded call has run past its
limit. Real parts: a real rollout process on the tiny model, a real Redis,
real HTTP, real signals and real hangs (a guard around a blocking Event wait).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from opsd.config import ModelSection, RunConfig
from opsd.envs import Task
from opsd.probes import Liveness
from opsd.queue import StreamNames, StreamQueue
from opsd.service import RoleProcess, consume_forever
from opsd.types import RolloutGroup, TaskGroup
from services.trainer.controller import Backoff, Collector, DeadLetters, TaskIssuer, wait_for_groups
from tests.factories import make_rollout_group, make_task

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, check, timeout_s: float = 60.0, every_s: float = 0.05):
    """Poll `check()` until it returns something truthy; that value. Fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def get(url: str) -> httpx.Response | None:
    """GET `url`; None while nothing answers there."""
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A rollout RoleProcess (default config) serving on a free loopback port: (proc, base URL)."""
    monkeypatch.delenv("OPSD_PORT", raising=False)
    monkeypatch.delenv("OPSD_BIND_HOST", raising=False)
    proc = RoleProcess(role="rollout", cfg=RunConfig(), run_dir=tmp_path)
    port = proc.serve(port=0)
    return proc, f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------ liveness


def test_a_guarded_call_that_hangs_past_its_limit_fails_livez_until_it_returns(served):
    proc, url = served
    proc.liveness.beat()  # the work loop has started
    assert get(f"{url}/livez").status_code == 200
    release, entered = threading.Event(), threading.Event()

    def engine_call():  # an engine that stopped answering: the call blocks until released
        with proc.liveness.guard("engine generate", 0.2):
            entered.set()
            release.wait(60)

    caller = threading.Thread(target=engine_call)
    caller.start()
    try:
        entered.wait(10)
        r = wait_until("/livez to fail", lambda: (r := get(f"{url}/livez")).status_code == 503 and r)
        body = r.json()
        assert body["role"] == "rollout" and body["live"] is False
        assert body["reason"].startswith("engine generate has run") and "past its limit of 0.2 s" in body["reason"]
        assert [c["name"] for c in body["calls"]] == ["engine generate"] and body["calls"][0]["running_s"] > 0.2
        # Readiness is another question: a hung worker is restarted by liveness, not taken out of a Service.
        assert get(f"{url}/readyz").status_code == 503  # (still "starting": nothing marked it ready)
    finally:
        release.set()
        caller.join(10)
    r = get(f"{url}/livez")
    assert r.status_code == 200 and r.json()["calls"] == [] and r.json()["reason"] is None


def test_a_loop_silent_past_beat_s_is_not_live_and_a_guard_excuses_the_silence():
    now = [1000.0]
    live = Liveness(beat_s=300, clock=lambda: now[0])
    now[0] += 10_000
    assert live.state()["live"] is True  # never beaten: startup, the startup probe's business
    live.beat()
    now[0] += 299
    assert live.state() == {"live": True, "reason": None, "since_beat_s": 299.0, "calls": []}
    now[0] += 2
    state = live.state()
    assert state["live"] is False and state["reason"] == ("the work loop has not beaten for 301 s "
                                                          "(limit probes.beat_s = 300 s)")
    live.beat()
    with live.guard("PPO update", 3600):  # a long update: the loop is silent, the guard has its own limit
        now[0] += 2000
        assert live.state()["live"] is True
        with live.guard("collective", 600):  # nested: each guard against its own limit
            now[0] += 601
            assert live.state()["reason"] == "collective has run 601 s, past its limit of 600 s"
        now[0] += 1600  # the update has now run 4201 s
        assert live.state()["reason"] == "PPO update has run 4201 s, past its limit of 3600 s"
    assert live.state()["live"] is True  # leaving a guard is a beat
    with pytest.raises(ValueError, match="limit_s"):
        with live.guard("nothing", 0):
            pass
    with pytest.raises(ValueError, match="beat_s"):
        Liveness(beat_s=0)


@pytest.mark.redis
def test_a_job_that_hangs_past_probes_job_s_fails_livez_and_the_loop_beats_otherwise(
        redis_client, stream_prefix, tmp_path, monkeypatch):
    monkeypatch.delenv("OPSD_PORT", raising=False)
    cfg = RunConfig.model_validate({"redis": {"stream_prefix": stream_prefix, "block_ms": 200},
                                    "probes": {"job_s": 0.5, "generate_s": 0.5}})
    proc = RoleProcess(role="rollout", cfg=cfg, run_dir=tmp_path)
    url = f"http://127.0.0.1:{proc.serve(port=0)}"
    names = StreamNames(stream_prefix)
    queue = StreamQueue(redis_client, names.tasks, "rollout", "rollout-0", TaskGroup, role="rollout", max_bytes=1 << 20,
                        dead_stream=names.dead, counts_key=names.counts)
    queue.ensure_group()
    release, entered = threading.Event(), threading.Event()

    def play(task):
        entered.set()
        release.wait(60)  # a group whose episodes never come back
        proc.stop.set()  # one job, then leave the loop
        return make_rollout_group(G=task.group_size, turns=1, seed=1)

    loop = threading.Thread(target=consume_forever, args=(proc, queue, names.rollouts, play, 60_000, 200))
    loop.start()
    try:
        # The idle loop beats (a blocking read of 200 ms at a time): live.
        wait_until("the loop's first beat", lambda: get(f"{url}/livez").json()["since_beat_s"] is not None)
        assert get(f"{url}/livez").status_code == 200
        queue.produce_to(names.tasks, make_task(group_size=2, seed=1))
        assert entered.wait(30)
        r = wait_until("/livez to fail", lambda: (r := get(f"{url}/livez")).status_code == 503 and r)
        assert r.json()["reason"].startswith("job ") and "past its limit of 0.5 s" in r.json()["reason"]
    finally:
        release.set()
        loop.join(30)
    assert not loop.is_alive()
    assert redis_client.xlen(names.rollouts) == 1 and queue.depth() == (0, 0)  # the job finished and was acked
    assert get(f"{url}/livez").status_code == 200  # the job returned: that was progress


@pytest.mark.redis
def test_the_trainers_wait_for_groups_beats_while_it_waits(redis_client, stream_prefix):
    """Waiting for a step's groups, however long, is not a hang: the loop beats every round."""
    cfg = RunConfig.model_validate({"run": {"method": "grpo", "step_timeout_s": 600},
                                    "redis": {"stream_prefix": stream_prefix, "block_ms": 100}})
    names = StreamNames(stream_prefix)
    queue = StreamQueue(redis_client, names.rollouts, "trainer", "trainer-0", RolloutGroup, role="trainer-test",
                        max_bytes=1 << 24, dead_stream=names.dead)
    queue.ensure_group()
    live = Liveness(beat_s=2.0)
    beats: list[int] = []

    def beat():  # the loop's beats are counted (rounds), not timed: a loaded machine makes rounds slow
        beats.append(1)
        live.beat()

    stop = threading.Event()
    games = [Task(f"tw-{i:02d}", "1-step", {"seed": i}, gold_path=["go"]) for i in range(2)]
    waiting = threading.Thread(target=wait_for_groups, args=(
        stop, cfg, TaskIssuer(redis_client, cfg, games, 1 << 24), Collector(queue, 0, role="trainer-test"),
        Backoff("trainer-test", stop, beat=live.beat), DeadLetters(redis_client, names.dead), ["s00000-tw-00"], 0, 0),
        kwargs={"beat": beat})
    waiting.start()
    try:
        wait_until("ten beats", lambda: len(beats) >= 10)  # ten rounds of block_ms without the group
        assert waiting.is_alive()  # still waiting for it: every round beat, not only the first
    finally:
        stop.set()
        waiting.join(10)
    assert wait_until("the silence after the wait ended", lambda: not live.state()["live"], timeout_s=30)


@pytest.mark.parametrize("section, message", [
    ({"probes": {"beat_s": 50}}, r"probes.beat_s \(50\) must be at least 60 s"),  # 2 x the 30 s Redis retry wait
    ({"probes": {"beat_s": 300}, "redis": {"block_ms": 200_000}}, "must be at least 400 s"),  # 2 x a 200 s read
    ({"probes": {"job_s": 60, "generate_s": 120}}, r"probes.job_s \(60\) must be at least probes.generate_s"),
    ({"probes": {"update_s": 0}}, "greater than 0"),
    ({"probes": {"generate_s": float("nan")}}, "finite"),
])
def test_probe_limits_that_would_restart_healthy_workers_are_refused(section, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(section)


def test_probe_limits_change_no_run_identity():
    """A run resumes with other limits: they decide when a hang is declared, never what is trained."""
    from opsd.config import config_hash, hashed_config

    longer = RunConfig.model_validate({"probes": {"beat_s": 900, "generate_s": 7200, "job_s": 86400, "update_s": 7200}})
    assert config_hash(hashed_config(longer)) == config_hash(hashed_config(RunConfig()))


# ------------------------------------------------------------------ readiness


def test_ready_follows_a_real_probe_generation_and_health_reports_it(served):
    proc, url = served
    r = get(f"{url}/readyz")
    assert r.status_code == 503 and r.json() == {"role": "rollout", "ready": False, "reason": "starting"}
    proc.unready = "loading the model"
    assert get(f"{url}/readyz").json()["reason"] == "loading the model"
    assert get(f"{url}/health").json()["ready"] is False
    from opsd.models import load_backend

    backend = load_backend(ModelSection(name="tiny-random", threads=1))
    proc.check_engine(backend)  # one group at a time: through backend.generate
    r = get(f"{url}/readyz")
    assert r.status_code == 200 and r.json() == {"role": "rollout", "ready": True}
    health = get(f"{url}/health").json()
    assert health["ready"] is True and health["probe"]["tokens"] == 1 and health["probe"]["seconds"] >= 0


@pytest.mark.parametrize("role", ["embedder", "rollout", "teacher", "trainer"])
def test_the_images_healthcheck_passes_only_when_ready_and_live(served, role, monkeypatch):
    """Docker runs the HEALTHCHECK's exec form as written: run it against a role (python = this interpreter)."""
    proc, url = served
    lines = (ROOT / "services" / role / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    (health,) = [line for line in lines if line.startswith("HEALTHCHECK")]
    command = json.loads(health[health.index("CMD") + 3:])
    assert command[0] == "python"
    env = {**os.environ, "OPSD_PORT": url.rsplit(":", 1)[1]}

    def healthy() -> bool:
        return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30).returncode == 0

    assert not healthy()  # "starting": not ready
    proc.unready = None
    assert healthy()  # ready; never beaten yet, so live
    with proc.liveness.guard("engine generate", 0.01):
        time.sleep(0.05)
        assert not healthy()  # ready but hung
    assert healthy()


def test_sigterm_makes_a_ready_role_unready_at_once(tmp_path, monkeypatch):
    """A rolling update drains the pod: the first SIGTERM takes it out of its Service while the job finishes."""
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    monkeypatch.delenv("OPSD_PORT", raising=False)
    monkeypatch.delenv("OPSD_BIND_HOST", raising=False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    config = tmp_path / "c.yaml"
    RunConfig().dump(config)
    try:
        proc = RoleProcess.start("teacher", str(config), str(tmp_path))  # installs the role's signal handlers
        url = f"http://127.0.0.1:{proc.serve(port=0)}"
        proc.unready = None
        assert get(f"{url}/readyz").status_code == 200
        os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the role's own handler
        r = wait_until("/readyz to fail", lambda: (r := get(f"{url}/readyz")).status_code == 503 and r)
        assert r.json() == {"role": "teacher", "ready": False, "reason": "stopping"}
        assert proc.stop.is_set() and get(f"{url}/health").json()["ready"] is False
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@pytest.mark.redis
def test_a_rollout_process_is_ready_only_once_its_model_is_loaded_and_its_engine_answered(redis_url, stream_prefix, tmp_path):
    """The real role: /readyz is 503 while the model loads (held here by the model cache's conversion lock,
    as a slow first conversion would hold it), 200 once the engine (groups in flight: HFEngine) answered the
    probe generation; /livez is 200 throughout; SIGTERM ends it cleanly."""
    from opsd.models.packaged import TINY_RANDOM, TINY_RANDOM_DIR, packaged_model

    shared = packaged_model(ModelSection(name=TINY_RANDOM))  # the converted tiny model, in the shared cache
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    config = tmp_path / "rollout.yaml"
    RunConfig.model_validate({"model": {"name": TINY_RANDOM, "cache_dir": str(cache), "threads": 1},
                              "rollout": {"max_groups_in_flight": 2},
                              "redis": {"stream_prefix": stream_prefix, "block_ms": 200}}).dump(config)
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "OPSD_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env.pop("OPSD_PARENT_PID", None)
    url = f"http://127.0.0.1:{port}"
    with open(cache / "models" / f".{TINY_RANDOM_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the role's model load waits for this lock
        role = subprocess.Popen([sys.executable, "-m", "services.rollout", "--config", str(config), "--run-dir",
                                 str(tmp_path / "run")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        try:
            def answered():
                assert role.poll() is None, role.stdout.read().decode()[-3000:]
                r = get(f"{url}/readyz")
                # "starting" until the role begins its model load (then held by the lock): a busy machine can answer
                # in between, so wait past it.
                return r if r is not None and r.json().get("reason") != "starting" else None

            r = wait_until("the rollout to serve", answered, timeout_s=120, every_s=0.2)
            assert r.status_code == 503 and r.json() == {"role": "rollout", "ready": False, "reason": "loading the model"}
            assert get(f"{url}/livez").status_code == 200  # loading is not hanging (the startup probe bounds it)
            assert get(f"{url}/health").status_code == 200  # what the old probes asked: it said "ok" already
            # The model appears (atomically, as the converter writes it), and the lock is released.
            staging = cache / "models" / f".tmp-{TINY_RANDOM_DIR}-test"
            shutil.copytree(shared, staging)
            staging.rename(cache / "models" / TINY_RANDOM_DIR)
            fcntl.flock(lock, fcntl.LOCK_UN)
            r = wait_until("/readyz to pass", lambda: (r := answered()).status_code == 200 and r, timeout_s=120,
                           every_s=0.2)
            assert r.json() == {"role": "rollout", "ready": True}
            health = get(f"{url}/health").json()
            assert health["ready"] is True and health["probe"]["tokens"] == 1
            live = get(f"{url}/livez")
            assert live.status_code == 200 and live.json()["reason"] is None
            wait_until("the work loop's first beat", lambda: get(f"{url}/livez").json()["since_beat_s"] is not None)
            role.send_signal(signal.SIGTERM)
            assert role.wait(60) == 0, role.stdout.read().decode()[-3000:]
        finally:
            if role.poll() is None:
                role.kill()
                role.wait(10)
