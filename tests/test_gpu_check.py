"""scripts/gpu_check.py end to end on the CPU: a random SmolLM2-135M, the transformers backend, every stage
(rollout on a few synthetic episodes).

The device check itself runs on a lent GPU (scripts/gpu_check.sh); this keeps
the script working where CI runs. One subprocess, as the wrapper calls it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

POSITIVE = [  # every stage's headline numbers: seconds, throughputs, counts
    "model_s", "server_load_s", "trainer_load_s", "generate_s", "generated_tokens", "generate_tokens_per_s",
    "score_s", "score_forward_tokens", "scored_tokens", "score_tokens_per_s", "scored_tokens_per_s",
    "weight_save_s", "weight_load_s", "weight_load_http_s", "weight_sync_s", "weight_file_mb", "served_logprob_change_max",
    "train_step_s", "train_loss_tokens", "train_tokens", "train_grad_norm", "total_s",
    "rollout_episodes", "rollout_requests", "rollout_prefix_hit_rate",
    *[f"rollout_{way}_{what}" for way in ("lockstep", "inflight", "alone")
      for what in ("s", "tokens", "tokens_per_s", "episodes_per_s")],
    "rollout_inflight_vs_lockstep", "rollout_inflight_vs_alone",
    "train_nogc_step_s", "train_gc_step_s", "train_gc_params",  # the bf16 step of a random Qwen2-shaped model
]
# The rollout stage's sizes, below --quick's 4 x 2 x 2 x 8 (the CPU here is small and often busy).
GROUPS, GROUP_SIZE, TURNS, NEW, OBS = 3, 2, 2, 4, 4


def test_gpu_check_cpu_quick_random_model(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick", "--model", "random",
         "--batch", "2", "--new-tokens", "8", "--groups", str(GROUPS), "--group-size", str(GROUP_SIZE),
         "--turns", str(TURNS), "--rollout-new-tokens", str(NEW), "--obs-len", str(OBS), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["error"] is None
    assert report["config"]["backend"] == "hf" and report["config"]["dtype"] == "float32"
    m = report["metrics"]
    for key in POSITIVE:
        assert key in m, key
        assert math.isfinite(m[key]) and m[key] > 0, (key, m[key])
    # Sizes: 2 prompts x 32 ids, at most 8 new ids each; every generated id is a scored and a loss token.
    assert 2 <= m["generated_tokens"] <= 16
    assert m["scored_tokens"] == m["generated_tokens"] == m["train_loss_tokens"]
    assert m["score_forward_tokens"] == 2 * 32 + m["generated_tokens"]
    # The server is the same transformers model as the trainer after the sync: identical log-probs in fp32.
    assert m["served_vs_trainer_max_abs"] < 1e-4
    assert m["weight_sync_s"] == m["weight_save_s"] + m["weight_load_s"]
    check_rollout(m)
    # --quick's bf16 step: the tiny Qwen2 shape (vocab 1024, hidden 64, 2 layers, tied), fp32 master weights;
    # checkpointing recomputes the same forward, so the loss is the same to bf16 rounding.
    # Per layer: q (+bias), k and v (32 wide: 2 kv heads of 16, +bias), o, the 3 MLP matrices, 2 norms.
    layer = 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert m["train_gc_params"] == 1024 * 64 + 2 * layer + 64  # the head tied to the embedding: counted once
    assert m["train_gc_loss_diff"] < 1e-3 and math.isfinite(m["train_gc_loss"])
    assert set(report["stage_seconds"]) == {"model", "load", "warmup", "generate", "score", "weight_sync", "train_step",
                                            "train_step_gc", "rollout"}
    assert "| generate (new tokens/s)" in proc.stdout and "OK" in proc.stdout


def check_rollout(m: dict) -> None:
    """The rollout stage's figures make sense: counts, rates = quotients, ratios of the rates, (c) = (b)'s tokens."""
    episodes = GROUPS * GROUP_SIZE
    assert m["rollout_episodes"] == episodes
    assert m["rollout_requests"] == episodes * TURNS  # every episode plays every turn through the engine
    for way in ("lockstep", "inflight"):  # each request samples 1..NEW ids (fewer only at <|im_end|>)
        assert episodes * TURNS <= m[f"rollout_{way}_tokens"] <= episodes * TURNS * NEW, way
    for way in ("lockstep", "inflight", "alone"):
        assert math.isclose(m[f"rollout_{way}_tokens_per_s"], m[f"rollout_{way}_tokens"] / m[f"rollout_{way}_s"])
    assert math.isclose(m["rollout_lockstep_episodes_per_s"], episodes / m["rollout_lockstep_s"])
    assert math.isclose(m["rollout_inflight_episodes_per_s"], episodes / m["rollout_inflight_s"])
    # (c) generated exactly the requests (b) made, EOS ignored: the same tokens, so its episodes/s is over its time.
    assert m["rollout_alone_tokens"] == m["rollout_inflight_tokens"]
    assert math.isclose(m["rollout_alone_episodes_per_s"], episodes / m["rollout_alone_s"])
    assert math.isclose(m["rollout_inflight_vs_lockstep"],
                        m["rollout_inflight_tokens_per_s"] / m["rollout_lockstep_tokens_per_s"])
    assert math.isclose(m["rollout_inflight_vs_alone"],
                        m["rollout_inflight_tokens_per_s"] / m["rollout_alone_tokens_per_s"])
    # Turn 2 resumes every episode from its kept KV; the new ids (last response id + observation) are never hits.
    assert 0 < m["rollout_prefix_hit_rate"] < 1
