"""How a role started by a container platform (no `opsd run`) finds its port and its streams."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from opsd.supervisor import Services
from opsd.config import RunConfig
from opsd.queue import StreamNames, StreamQueue
from opsd.service import FATAL_EXIT, RoleProcess, consume_forever, env_port, read_port, service_url
from opsd.types import TaskGroup
from services.trainer.controller import Backoff, RunConflict, claim_prefix, lock_trainer
from tests.factories import make_rollout_group, make_task

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keep_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def write_config(path, **redis_section):
    cfg = RunConfig.model_validate({"redis": redis_section})
    cfg.dump(path)
    return path


def test_a_role_without_a_prefix_derives_it_from_its_run_dir(tmp_path, keep_signals, monkeypatch):
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    run_dir = tmp_path / "runs" / "quickstart"
    run_dir.mkdir(parents=True)
    proc = RoleProcess.start("rollout", str(write_config(tmp_path / "c.yaml")), str(run_dir))
    assert proc.cfg.redis.stream_prefix == "opsd:quickstart"
    # The trailing slash a deployment may write changes nothing.
    proc = RoleProcess.start("teacher", str(tmp_path / "c.yaml"), str(run_dir) + "/")
    assert proc.cfg.redis.stream_prefix == "opsd:quickstart"


def test_a_configured_prefix_is_kept(tmp_path, keep_signals, monkeypatch):
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    path = write_config(tmp_path / "c.yaml", stream_prefix="opsd:cluster-a")
    proc = RoleProcess.start("rollout", str(path), str(tmp_path / "anything"))
    assert proc.cfg.redis.stream_prefix == "opsd:cluster-a"


def test_opsd_port_decides_where_a_role_serves(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port free right now
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("OPSD_PORT", str(free))
    proc = RoleProcess(role="rollout", cfg=RunConfig(), run_dir=tmp_path)
    assert proc.serve(port=0) == free
    assert read_port(tmp_path, "rollout")["port"] == free
    assert httpx.get(f"http://127.0.0.1:{free}/health", timeout=5).json()["role"] == "rollout"


@pytest.mark.parametrize("text", ["http", "-1", "0", "65536", "80.5", " ", "+80", "8_000", "\u0668\u0660\u0660\u0660", "0x1F90"])
def test_a_bad_opsd_port_is_named(text):
    with pytest.raises(ValueError, match="OPSD_PORT"):
        env_port(text)


def test_env_port_accepts_ascii_ports_in_range():
    assert [env_port(t) for t in ("1", "8000", " 8000 ", "65535")] == [1, 8000, 8000, 65535]


@pytest.mark.parametrize("problem", ["missing config", "bad config", "bad port"])
def test_a_role_that_cannot_start_says_why_and_exits_fatal(tmp_path, keep_signals, monkeypatch, capsys, problem):
    """A restart cannot fix these: exit code 3 (opsd run's supervisor and the platforms see why)."""
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    config = tmp_path / "c.yaml"
    if problem == "bad config":
        config.write_text("run: {steps: 0}\n")
    elif problem == "bad port":
        write_config(config)
        monkeypatch.setenv("OPSD_PORT", "8000x")
    with pytest.raises(SystemExit) as exit_:
        RoleProcess.start("rollout", str(config), str(tmp_path))
    assert exit_.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert err.startswith("rollout: cannot start:")
    assert {"missing config": "c.yaml", "bad config": "steps", "bad port": "OPSD_PORT"}[problem] in err


@pytest.mark.parametrize("name", ["a/b", "..", "", "Team-A", "team_a", "a.b", "-a", "a-", "x" * 64, "a b"])
def test_a_run_name_that_is_no_dns_label_is_fatal(tmp_path, keep_signals, monkeypatch, capsys, name):
    """k8s: the run dir is /data/runs/$(OPSD_RUN_NAME); any other name would make the roles' stream prefix
    (the directory's name: "b" for "a/b", "runs" for "") differ from the streams KEDA polls (opsd:<name>)."""
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    monkeypatch.setenv("OPSD_RUN_NAME", name)
    with pytest.raises(SystemExit) as exit_:
        RoleProcess.start("rollout", str(write_config(tmp_path / "c.yaml")), f"{tmp_path}/runs/{name}")
    assert exit_.value.code == FATAL_EXIT
    assert "OPSD_RUN_NAME" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["verbose", "10", "INFO,DEBUG"])
def test_an_unknown_log_level_is_fatal_in_one_line(tmp_path, keep_signals, monkeypatch, capsys, value):
    """OPSD_LOG_LEVEL (compose passes it to every role) that logging does not know: one line and FATAL_EXIT, not
    logging.basicConfig's ValueError traceback (exit 1, restarted to fail the same way)."""
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    monkeypatch.setenv("OPSD_LOG_LEVEL", value)
    with pytest.raises(SystemExit) as exit_:
        RoleProcess.start("rollout", str(write_config(tmp_path / "c.yaml")), str(tmp_path / "run"))
    assert exit_.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert err.startswith("rollout: cannot start: OPSD_LOG_LEVEL=") and len(err.splitlines()) == 1, err


def test_a_log_level_is_read_in_any_case():
    """"debug" is what people type; logging.basicConfig refused it (it knows "DEBUG" only)."""
    from opsd.service import env_log_level

    env = {"debug": logging.DEBUG, " Warning ": logging.WARNING, "ERROR": logging.ERROR, "": logging.INFO}
    for value, level in env.items():
        os.environ["OPSD_LOG_LEVEL"] = value
        try:
            assert env_log_level() == level, value
        finally:
            del os.environ["OPSD_LOG_LEVEL"]
    assert env_log_level() == logging.INFO


def test_a_run_name_must_name_the_run_dir(tmp_path, keep_signals, monkeypatch, capsys):
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    config = str(write_config(tmp_path / "c.yaml"))
    monkeypatch.setenv("OPSD_RUN_NAME", "team-a")
    assert RoleProcess.start("rollout", config, str(tmp_path / "runs" / "team-a")).cfg.redis.stream_prefix == "opsd:team-a"
    monkeypatch.setenv("OPSD_RUN_NAME", "7" + "x" * 62)  # the longest label, a digit first
    assert RoleProcess.start("rollout", config, str(tmp_path / "runs" / ("7" + "x" * 62))).cfg.redis.stream_prefix == \
        "opsd:7" + "x" * 62
    monkeypatch.setenv("OPSD_RUN_NAME", "team-a")
    with pytest.raises(SystemExit):
        RoleProcess.start("rollout", config, str(tmp_path / "runs" / "team-b"))
    assert "the run directory is" in capsys.readouterr().err


def test_a_role_creates_its_event_counters_at_zero(tmp_path, keep_signals, monkeypatch):
    """rate()/increase() need a sample before the first event, or the first outage never shows."""
    monkeypatch.delenv("OPSD_PARENT_PID", raising=False)
    RoleProcess.start("teacher", str(write_config(tmp_path / "c.yaml")), str(tmp_path))
    for name, labels in [("opsd_redis_reconnects_total", {"role": "teacher"}), ("opsd_embedder_fallbacks_total", {"role": "teacher"}),
                         ("opsd_groups_total", {"role": "teacher"})]:
        assert REGISTRY.get_sample_value(name, labels) is not None, name


def test_a_role_can_serve_on_ipv6(tmp_path, monkeypatch):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"this machine has no IPv6 loopback: {e}")
    monkeypatch.setenv("OPSD_BIND_HOST", "::")
    monkeypatch.delenv("OPSD_PORT", raising=False)
    proc = RoleProcess(role="rollout", cfg=RunConfig(), run_dir=tmp_path)
    port = proc.serve(port=0)
    assert httpx.get(f"http://[::1]:{port}/health", timeout=5).json()["role"] == "rollout"


def test_opsd_run_does_not_hand_a_fixed_port_to_its_roles(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSD_PORT", "8000")  # four roles on one port would collide
    services = Services(tmp_path, tmp_path / "c.yaml", "redis://:pw@127.0.0.1:1/0", "t" * 32)
    assert "OPSD_PORT" not in services.env


# ------------------------------------------------- roles that only meet through Redis (compose, k8s)


def proc_for(tmp_path, prefix: str, role: str = "rollout", **sections) -> RoleProcess:
    cfg = RunConfig.model_validate({"redis": {"stream_prefix": prefix, "block_ms": 200}, **sections})
    return RoleProcess(role=role, cfg=cfg, run_dir=tmp_path)


def one_task(client, prefix: str) -> tuple[StreamNames, StreamQueue]:
    """The run's task stream holding one task, and the rollout group's queue on it."""
    names = StreamNames(prefix)
    queue = StreamQueue(client, names.tasks, "rollout", "rollout-0", TaskGroup, role="rollout", max_bytes=1 << 20,
                        dead_stream=names.dead, counts_key=names.counts)
    queue.ensure_group()
    queue.produce_to(names.tasks, make_task(group_size=2, seed=1))
    return names, queue


@pytest.mark.redis
def test_a_worker_with_another_config_than_the_trainers_takes_no_job(redis_client, stream_prefix, tmp_path):
    names, queue = one_task(redis_client, stream_prefix)
    trainer = proc_for(tmp_path, stream_prefix, run={"seed": 1})
    redis_client.set(names.config_hash, trainer.config_hash)
    worker = proc_for(tmp_path, stream_prefix, run={"seed": 2})  # e.g. a config file edited after the run started
    handled = []
    threading.Timer(10.0, worker.stop.set).start()  # without the check the loop would run on: end it
    with pytest.raises(SystemExit) as exit_:
        consume_forever(worker, queue, names.rollouts, handled.append, 60_000, 200)
    assert exit_.value.code == FATAL_EXIT and handled == []
    assert queue.depth() == (1, 0)  # not even claimed: no delivery counted against the job
    assert redis_client.xlen(names.rollouts) == 0


@pytest.mark.redis
def test_a_worker_with_the_trainers_config_works(redis_client, stream_prefix, tmp_path):
    names, queue = one_task(redis_client, stream_prefix)
    worker = proc_for(tmp_path, stream_prefix, run={"seed": 1})
    redis_client.set(names.config_hash, proc_for(tmp_path, stream_prefix, run={"seed": 1}).config_hash)

    def play(task):
        worker.stop.set()  # one job, then leave the loop
        return make_rollout_group(G=task.group_size, turns=1, seed=1)

    consume_forever(worker, queue, names.rollouts, play, 60_000, 200)
    assert redis_client.xlen(names.rollouts) == 1 and queue.depth() == (0, 0)


@pytest.mark.redis
def test_a_run_dir_owns_its_prefix_across_restarts_and_another_is_refused(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    backoff = Backoff("trainer", threading.Event())
    (tmp_path / "a").mkdir()
    first = claim_prefix(redis_client, names, tmp_path / "a", "hash-a", backoff)
    assert redis_client.get(names.owner).decode() == first and redis_client.get(names.config_hash) == b"hash-a"
    assert claim_prefix(redis_client, names, tmp_path / "a", "hash-a", backoff) == first  # a restart, a resume
    (tmp_path / "b").mkdir()  # the run dir deleted and made again, or another dir of the same name
    with pytest.raises(RunConflict, match=f"{stream_prefix}.*redis-cli --scan --pattern '{stream_prefix}:\\*'"):
        claim_prefix(redis_client, names, tmp_path / "b", "hash-b", backoff)
    assert redis_client.get(names.config_hash) == b"hash-a"  # the refused run changed nothing


def test_a_second_trainer_on_a_run_dir_is_refused(tmp_path):
    held = lock_trainer(tmp_path / "run")
    try:
        t0 = time.monotonic()
        with pytest.raises(RunConflict, match=f"pid {os.getpid()}"):
            lock_trainer(tmp_path / "run", wait_s=1.0, poll_s=0.1)
        assert time.monotonic() - t0 >= 1.0  # it waited for the holder first
    finally:
        held.close()
    lock_trainer(tmp_path / "run", wait_s=0).close()  # free again once the first is gone


def test_a_trainer_waits_for_the_one_still_finishing_its_step(tmp_path):
    """`opsd run --resume` right after a crash: the old trainer may still be checkpointing."""
    held = lock_trainer(tmp_path / "run")
    threading.Timer(1.0, held.close).start()
    lock_trainer(tmp_path / "run", wait_s=30, poll_s=0.1).close()


def test_a_worker_waits_for_a_redis_that_is_not_up_yet(tmp_path, monkeypatch):
    """No start order in a cluster: creating the consumer group retries instead of crash-looping the role."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("REDIS_URL", f"redis://:pw@127.0.0.1:{closed}/0")
    # A role name of its own: the reconnect counter is process-wide, and a "rollout" loop left over from
    # another test could add to that label meanwhile. With its own label the count stays exact.
    role = "rollout-waits-for-redis"
    proc = proc_for(tmp_path, "test-nowhere", role=role)
    before = REGISTRY.get_sample_value("opsd_redis_reconnects_total", {"role": role}) or 0.0
    threading.Timer(3.0, proc.stop.set).start()
    t0 = time.monotonic()
    proc.open_queue("test-nowhere:tasks", TaskGroup)  # returns once stopped; it raised ConnectionError before
    assert time.monotonic() - t0 >= 2.5
    # One outage, however many attempts it took (two in these 3 s on an idle machine): counted once.
    assert REGISTRY.get_sample_value("opsd_redis_reconnects_total", {"role": role}) == before + 1


@pytest.mark.redis
def test_the_teacher_of_a_grpo_run_consumes_nothing(redis_url, redis_client, stream_prefix, tmp_path):
    """compose and k8s start every role: a teacher reading the rollouts would take the trainer's groups."""
    config = tmp_path / "grpo.yaml"
    RunConfig.model_validate({"run": {"method": "grpo"}, "redis": {"stream_prefix": stream_prefix}}).dump(config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "REDIS_URL": redis_url, "OPSD_PORT": str(port), "OPSD_API_TOKEN": "t" * 32}
    env.pop("OPSD_PARENT_PID", None)
    teacher = subprocess.Popen([sys.executable, "-m", "services.teacher", "--config", str(config), "--run-dir", str(tmp_path)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.HTTPError:
                assert teacher.poll() is None and time.monotonic() < deadline, teacher.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        assert health["idle"] is True and "grpo" in health["reason"]
        rollouts = StreamNames(stream_prefix).rollouts
        assert not redis_client.exists(rollouts)  # no consumer group was created on the trainer's stream
    finally:
        teacher.terminate()
        teacher.wait(20)
    assert teacher.returncode == 0


@pytest.mark.parametrize("info, url", [
    ({"host": "0.0.0.0", "port": 8000}, "http://127.0.0.1:8000"),
    ({"host": "", "port": 8000}, "http://127.0.0.1:8000"),
    ({"host": "::", "port": 8000}, "http://[::1]:8000"),
    ({"host": "fd00::5", "port": 80}, "http://[fd00::5]:80"),
    ({"host": "embedder", "port": "8000"}, "http://embedder:8000"),
])
def test_a_port_file_gives_a_url_a_client_can_use(info, url):
    assert service_url(info) == url


def test_an_empty_bind_host_means_every_ipv4_interface(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSD_BIND_HOST", "")
    monkeypatch.delenv("OPSD_PORT", raising=False)
    proc = RoleProcess(role="rollout", cfg=RunConfig(), run_dir=tmp_path)
    port = proc.serve(port=0)
    assert httpx.get(service_url(read_port(tmp_path, "rollout")) + "/health", timeout=5).json()["role"] == "rollout"
    assert read_port(tmp_path, "rollout")["port"] == port


@pytest.mark.parametrize("url, reason", [
    (None, "REDIS_URL is not set"),
    ("redis://127.0.0.1:6379/0", "has no password"),
    ("redis://:Zq7/secret-xK9@127.0.0.1:6379/0", "because of its password"),
    ("http://:pw@127.0.0.1:6379/0", "schemes"),
    ("redis://:pw@127.0.0.1:6379/0?foo=bar", "an option redis-py does not know (foo)"),  # was a TypeError traceback
])
def test_a_worker_without_a_usable_redis_url_stops_fatal(tmp_path, monkeypatch, capsys, url, reason):
    monkeypatch.delenv("OPSD_REDIS_ALLOW_NO_AUTH", raising=False)
    if url is None:
        monkeypatch.delenv("REDIS_URL", raising=False)
    else:
        monkeypatch.setenv("REDIS_URL", url)
    with pytest.raises(SystemExit) as exit_:
        proc_for(tmp_path, "test-x").open_queue("test-x:tasks", TaskGroup)
    assert exit_.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert reason in err and "Zq7" not in err and "secret" not in err


@pytest.mark.redis
def test_a_wrong_redis_password_is_fatal_not_an_outage(redis_url, tmp_path, monkeypatch, capsys):
    wrong = redis_url.replace("redis://:", "redis://:wrong-", 1)
    monkeypatch.setenv("REDIS_URL", wrong)
    proc = proc_for(tmp_path, "test-auth")
    # Were it retried as an outage, the call would return (no SystemExit) when this stops it.
    threading.Timer(20.0, proc.stop.set).start()
    with pytest.raises(SystemExit) as exit_:
        proc.open_queue("test-auth:tasks", TaskGroup)
    assert exit_.value.code == FATAL_EXIT
    assert "refused the password" in capsys.readouterr().err


def test_opsd_run_reports_an_unknown_redis_url_option_in_one_line():
    """`opsd run`'s Redis check (opsd.cli.check_redis) turns it into its one-line refusal, no traceback (issue 37, 4)."""
    from opsd.cli import check_redis

    reason = check_redis("redis://:pw@127.0.0.1:1/0?foo=bar", 100)
    assert reason is not None and "redis-py does not know (foo)" in reason and "\n" not in reason and "pw" not in reason
