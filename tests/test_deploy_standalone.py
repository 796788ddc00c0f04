"""The compose stack's roles, run as plain processes: each role exactly as docker-compose.yml starts it.

No Docker engine here, so this runs the four role commands of
docker-compose.yml (defaults of `${VAR:-x}` applied) with the environment
compose gives them, on this host: a real redis-server with a password,
OPSD_PORT/OPSD_BIND_HOST, the teacher finding the embedder by
OPSD_EMBEDDER_URL, the stream prefix derived from the run directory, a shared
data directory standing in for the `opsd-data` volume. What it cannot check
is the image itself (see tests/test_deploy_containers.py for the Dockerfiles).
Only the container paths, host names and ports are mapped to this host, and
the model is the tiny one (tests/tiny_model.py) so one AlignOPSD step takes
seconds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from opsd.redis_server import LocalRedis
from tests.soak import stop_sessions, wait_until
from tests.tiny_model import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("embedder", "rollout", "teacher", "trainer")  # start order: the embedder first, as depends_on says
VAR = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def substitute(text: str, values: dict[str, str]) -> str:
    """Compose-style `${VAR}`, `${VAR:-default}`, `${VAR:?error}` with `values`, else the default (error if none)."""

    def one(m: re.Match) -> str:
        name, rest = m.group(1), m.group(0)[len(m.group(1)) + 2:-1]
        if name in values:
            return values[name]
        if rest.startswith((":-", "-")):
            return rest.split("-", 1)[1]
        raise KeyError(f"{name} has no value and no default in {text!r}")

    return VAR.sub(one, text)


def role_commands(compose: dict, values: dict[str, str], host_paths: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each role's (argv, environment) from the compose file, container paths mapped to `host_paths`."""
    out = {}
    for role in ROLES:
        svc = compose["services"][role]
        cmd = svc["command"]
        argv = cmd.split() if isinstance(cmd, str) else list(cmd)
        env = svc.get("environment", {})
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        argv = [substitute(a, values) for a in argv]
        env = {k: substitute(str(v), values) for k, v in env.items()}
        for container, host in host_paths.items():
            argv = [a.replace(container, host) for a in argv]
            env = {k: v.replace(container, host) for k, v in env.items()}
        assert argv[:2] == ["python", "-m"], argv
        out[role] = ([sys.executable, *argv[1:]], env)
    return out


@pytest.mark.e2e
def test_the_compose_roles_train_a_step_as_plain_processes(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    model = make_tiny_model_dir(tmp_path / "tiny")
    configs, data = tmp_path / "configs", tmp_path / "data"
    configs.mkdir()
    data.mkdir()
    # The quickstart config (what compose runs by default) with the tiny model and one short step.
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["run"].update(steps=1, step_timeout_s=300)
    cfg["model"]["name"] = str(model)
    cfg["env"].update(num_games=1, game_pool=2, max_turns=2, list_admissible=False, one_shot=False)
    cfg["rollout"].update(group_size=2, max_new_tokens=8)
    cfg["teacher"]["thinking_max_new_tokens"] = 8
    cfg["trainer"].update(micro_batch_size=4, threads=1)
    cfg["redis"] = {"reclaim_idle_ms": 5000}
    (configs / "standalone.yaml").write_text(yaml.safe_dump(cfg))

    redis_server = LocalRedis(tmp_path / "redis.log").start()
    password, token = redis_server.password, "t" * 32
    ports = {role: free_port() for role in ROLES}
    values = {"OPSD_CONFIG": "standalone.yaml", "OPSD_RUN": "standalone", "REDIS_PASSWORD": password,
              "OPSD_API_TOKEN": token}
    commands = role_commands(compose, values, {"/app/configs": str(configs), "/data": str(data)})
    procs: dict[str, subprocess.Popen] = {}
    try:
        for role, (argv, env) in commands.items():
            env = {**env, "REDIS_URL": env["REDIS_URL"].replace("@redis:6379", f"@127.0.0.1:{redis_server.port}"),
                   "OPSD_PORT": str(ports[role]), "OPSD_BIND_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}
            if "OPSD_EMBEDDER_URL" in env:
                env["OPSD_EMBEDDER_URL"] = env["OPSD_EMBEDDER_URL"].replace("embedder:8000", f"127.0.0.1:{ports['embedder']}")
            with open(tmp_path / f"{role}.log", "wb") as log:
                procs[role] = subprocess.Popen(argv, cwd=ROOT, env={"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], **env},
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        run_dir = data / "runs" / "standalone"

        def done():
            for role, p in procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{role} exited {p.returncode}:\n{(tmp_path / f'{role}.log').read_text()[-4000:]}")
            return (run_dir / "DONE").exists()

        wait_until(done, 600, "the trainer's DONE", poll_s=0.5)
        record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert record["step"] == 0 and record["policy_version"] == 1
        # Every role answers where compose's Prometheus scrapes it (here: its OPSD_PORT), with its own series.
        for role, port in ports.items():
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["role"] == role
            # What the image's HEALTHCHECK asks: ready (model loaded, a probe request answered) and live (the
            # work loop beats: the trainer's after DONE too).
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).json() == {"role": role, "ready": True}
            live = httpx.get(f"http://127.0.0.1:{port}/livez", timeout=10)
            assert live.status_code == 200 and live.json()["since_beat_s"] is not None, (role, live.text)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            if role != "embedder":
                assert re.search(rf'^opsd_groups_total\{{role="{role}"\}} [1-9]', text, re.M), f"{role}:\n{text[:2000]}"
        # The teacher reached the embedder by OPSD_EMBEDDER_URL: no group fell back to identity views.
        teacher = httpx.get(f"http://127.0.0.1:{ports['teacher']}/metrics", timeout=10).text
        assert not re.search(r'^opsd_embedder_fallbacks_total\{role="teacher"\} [1-9]', teacher, re.M)
        # The streams carry the prefix derived from the run directory's name; the run owns it, and the
        # workers checked their config against the one the trainer published.
        client = redis.Redis.from_url(redis_server.url)
        assert client.exists("opsd:standalone:scored")
        assert client.get("opsd:standalone:owner").decode() == (run_dir / "run_id").read_text().strip()
        assert client.get("opsd:standalone:config_hash")
    finally:
        stop_sessions(procs.values())
        redis_server.stop()
