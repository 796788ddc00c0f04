"""scripts/gpu_check.py end to end on the CPU: a random SmolLM2-135M, the transformers backend, every stage.

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
    "weight_save_s", "weight_load_s", "weight_sync_s", "weight_file_mb", "served_logprob_change_max",
    "train_step_s", "train_loss_tokens", "train_tokens", "train_grad_norm", "total_s",
]


def test_gpu_check_cpu_quick_random_model(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick", "--model", "random",
         "--batch", "2", "--new-tokens", "8", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
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
    assert set(report["stage_seconds"]) == {"model", "load", "warmup", "generate", "score", "weight_sync", "train_step"}
    assert "| generate (new tokens/s)" in proc.stdout and "OK" in proc.stdout
