"""End to end: one training step through the four services running as processes, real Redis, real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from opsd.config import RunConfig
from opsd.models.hf import ensure_model

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_one_step_through_four_services(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the run must start its own redis-server
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli", "run", str(REPO / "tests/configs/tiny.yaml"), "--output-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0]
    assert records[0]["policy_version"] == 1
    assert records[0]["episodes"] == 2
    assert 0.0 <= records[0]["success_rate"] <= 1.0
    assert (run_dir / "metrics.png").stat().st_size > 1000

    # The policy version advanced and its weights differ from the initial model's.
    v1 = load_file(run_dir / "weights" / "policy-v00001.safetensors")
    base_dir = ensure_model(RunConfig.load(REPO / "tests/configs/tiny.yaml").model)
    base = {}
    for f in base_dir.glob("*.safetensors"):
        base.update(load_file(f))
    shared = [k for k in v1 if k in base]
    assert shared, "weights file and base model share no tensor names"
    changed = sum(int((v1[k] != base[k]).any()) for k in shared)
    assert changed > 0, "no parameter changed after a training step"
    assert (run_dir / "checkpoint" / "trainer_state.json").exists()

    # Every service answered /metrics and /health, and exports its role's series.
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["metrics_answered"] == {"embedder": True, "rollout": True, "teacher": True, "trainer": True}
    for role in ("rollout", "teacher", "trainer"):
        text = (run_dir / "scrapes" / f"{role}.prom").read_text()
        assert f'opsd_groups_total{{role="{role}"}}' in text, role
    assert 'opsd_policy_version{role="trainer"} 1.0' in (run_dir / "scrapes" / "trainer.prom").read_text()
    for role in ("embedder", "rollout", "teacher", "trainer", "redis"):
        assert (run_dir / "logs" / f"{role}.log").exists(), role
