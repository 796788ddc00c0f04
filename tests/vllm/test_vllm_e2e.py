"""One training step of the quickstart config with `model.backend: vllm`: rollout and teacher on vLLM engines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_step_with_vllm_backend(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli", "run", str(REPO / "configs/quickstart.yaml"), "--steps", "1",
         "--backend", "vllm", "--output-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    cfg = (run_dir / "config.yaml").read_text()
    assert "backend: vllm" in cfg
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["policy_version"] == 1
    assert records[0]["episodes"] == 8 and records[0]["loss_tokens"] > 0
    # Sampler and trainer agree (float32): the vLLM sampler's log-probs are the trainer's convention.
    assert records[0]["sampler_logprob_mismatch"] < 1e-3, records[0]["sampler_logprob_mismatch"]
    for role, in_flight in (("rollout", 16), ("teacher", 8)):
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert "vLLM engine for" in log, role
        assert f"holding up to {in_flight} groups in flight" in log, role  # the vLLM default: several at once
        scrape = (run_dir / "scrapes" / f"{role}.prom").read_text()
        assert f'opsd_policy_version{{role="{role}"}} 0.0' in scrape, role
        assert f'opsd_groups_total{{role="{role}"}} 2.0' in scrape, role
    # The rollout's episodes found their earlier turns (and their siblings' first prompt) in the prefix cache.
    scrape = (run_dir / "scrapes" / "rollout.prom").read_text()
    hit_rate = float(re.search(r'^opsd_prefix_cache_hit_ratio\{role="rollout"\} (\S+)$', scrape, re.M).group(1))
    assert 0 < hit_rate < 1, hit_rate
