"""Simulated compute (opsd.config.SimulateSection) and the tiny random model it runs on.

The config refuses a simulated run that could slow a real one and nonsense
seconds; the `tiny-random` model has SmolLM2's tokenizer and vocabulary; and a
simulated `opsd run` (configs/overlap.yaml, what benchmarks/overlap.py runs)
trains 2 steps end to end on a real redis-server, every role a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import yaml

from opsd.config import ModelSection, RunConfig, config_hash, hashed_config

REPO = Path(__file__).resolve().parents[1]
TINY = {"model": {"name": "tiny-random"}}


@pytest.mark.parametrize("simulate", [
    {"enabled": True, "rollout_s": -1.0},
    {"enabled": True, "teacher_s": -0.5},
    {"enabled": True, "trainer_s": -2},
    {"enabled": True, "trainer_s": float("nan")},
    {"enabled": True, "rollout_s": float("inf")},
    {"enabled": True, "rollout_s": 1e9},  # over an hour per group: a typo, not a benchmark
    {"enabled": True, "rollout_seconds": 2.0},  # unknown key
])
def test_config_refuses_nonsense(simulate):
    with pytest.raises(pydantic.ValidationError):
        RunConfig.model_validate({**TINY, "simulate": simulate})


@pytest.mark.parametrize("model", [{}, {"name": "smollm2-135m-instruct"}, {"name": "tiny-random", "backend": "vllm"}])
def test_simulated_compute_only_with_the_tiny_model(model):
    # Sleeping on top of a real model's compute would slow a real run and measure nothing.
    with pytest.raises(pydantic.ValidationError, match="simulate.enabled"):
        RunConfig.model_validate({"model": model, "simulate": {"enabled": True, "rollout_s": 1.0}})


def test_off_by_default_and_not_in_the_config_hash():
    assert RunConfig().simulate.enabled is False
    on = RunConfig.model_validate({**TINY, "simulate": {"enabled": True, "rollout_s": 2, "teacher_s": 1, "trainer_s": 4}})
    off = RunConfig.model_validate(TINY)
    # Only timing changes: a run may resume with other simulated times, and old checkpoints keep their hash.
    assert config_hash(hashed_config(on)) == config_hash(hashed_config(off))
    assert "simulate" not in hashed_config(off)


def test_tiny_random_model_has_smollm2_tokenizer_and_vocab():
    from transformers import AutoConfig, AutoTokenizer

    from opsd.models.hf import ensure_model

    tiny = ensure_model(ModelSection(name="tiny-random"))
    assert ensure_model(ModelSection(name="tiny-random")) == tiny  # written once, then reused
    cfg = AutoConfig.from_pretrained(tiny, local_files_only=True)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 49152)
    smol = AutoTokenizer.from_pretrained(ensure_model(ModelSection()), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    text = [{"role": "user", "content": "open the box"}]
    assert tok.apply_chat_template(text, tokenize=False) == smol.apply_chat_template(text, tokenize=False)
    assert tok("go north <action>take key</action>")["input_ids"] == smol("go north <action>take key</action>")["input_ids"]


@pytest.mark.e2e
def test_simulated_run_end_to_end(tmp_path):
    """configs/overlap.yaml, 2 steps one-step-off with short holds: real Redis, every role, metrics, checkpoint."""
    data = yaml.safe_load((REPO / "configs/overlap.yaml").read_text())
    data["run"].update(steps=2, max_staleness=1)
    data["simulate"].update(rollout_s=0.2, teacher_s=0.1, trainer_s=0.3)
    config = tmp_path / "overlap.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the run starts its own redis-server
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(config), "--output-dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["simulated_compute"] is True for r in records)
    assert records[0]["finished_at"] < records[1]["finished_at"]
    groups = data["env"]["num_games"]
    for r in records:
        assert r["episodes"] == groups * data["rollout"]["group_size"]
        # Each group's seconds are at least its hold (set, not timed: max(real work, rollout_s)).
        assert r["rollout_seconds"] >= groups * 0.2 and r["teacher_seconds"] >= groups * 0.1
    assert (run_dir / "metrics.png").stat().st_size > 1000
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert (state["step"], state["policy_version"]) == (2, 2)
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    for role in ("rollout", "teacher", "trainer"):
        assert "simulated compute" in (run_dir / "logs" / f"{role}.log").read_text(), role
