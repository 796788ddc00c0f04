"""How a role started by a container platform (no `opsd run`) finds its port and its streams."""

from __future__ import annotations

import signal
import socket

import httpx
import pytest

from opsd.cli import Services
from opsd.config import RunConfig
from opsd.service import RoleProcess, env_port, read_port


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


@pytest.mark.parametrize("text", ["http", "-1", "65536", "80.5", " "])
def test_a_bad_opsd_port_is_named(text):
    with pytest.raises(ValueError, match="OPSD_PORT"):
        env_port(text)


def test_env_port_accepts_the_whole_range():
    assert [env_port(t) for t in ("0", "8000", "65535")] == [0, 8000, 65535]


def test_opsd_run_does_not_hand_a_fixed_port_to_its_roles(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSD_PORT", "8000")  # four roles on one port would collide
    services = Services(tmp_path, tmp_path / "c.yaml", "redis://:pw@127.0.0.1:1/0", "t" * 32)
    assert "OPSD_PORT" not in services.env
