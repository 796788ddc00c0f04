"""End to end: one training step through the four services running as processes, real Redis, real model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from opsd.config import RunConfig
from opsd.models.hf import ensure_model

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def check_inspect_pages(run_dir: Path) -> None:
    """`opsd inspect`'s API on a real run's dump (issue 22): the step, a group with AlignOPSD's matched sources
    and spans recomputed, a trajectory's tokens (decoded when the checkpoint holds a tokenizer.json)."""
    from fastapi.testclient import TestClient

    from opsd.inspect.app import create_app

    token = "e2e-inspect-token-0123456789"
    client = TestClient(create_app(run_dir, token), raise_server_exceptions=False)
    auth = {"Authorization": f"Bearer {token}"}
    step = client.get("/api/step", params={"step": 0}, headers=auth)
    assert step.status_code == 200, step.text
    step = step.json()
    assert step["method"] == "alignopsd" and step["has_display"] and step["groups"]
    group = step["groups"][0]["group"]
    gv = client.get("/api/group", params={"step": 0, "group": group}, headers=auth).json()
    assert gv["extras_error"] is None, gv["extras_error"]
    assert all(t["sources"] is not None and t["span"] is not None for tr in gv["trajectories"] for t in tr["turns"])
    tv = client.get("/api/trajectory", params={"step": 0, "group": group, "rollout": gv["trajectories"][0]["rollout"]},
                    headers=auth).json()
    assert tv["turns"] and tv["turns"][0]["tokens"]
    assert tv["decoded"] == (run_dir / "checkpoint" / "tokenizer.json").is_file()


def test_one_step_through_four_services(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the run must start its own redis-server
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli", "run", str(REPO / "tests/configs/tiny.yaml"), "--output-dir", str(tmp_path),
         "--dump-credit", "--report-to", "tensorboard"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    # The summary ends with each tracker run and how to open it (trackers.json's link).
    assert f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}" in proc.stdout, proc.stdout[-2000:]
    # Output to a pipe: plain step lines, and no progress bar drawn once at the end into the file.
    assert "step 0" in proc.stdout and "done in" in proc.stdout, proc.stdout
    assert not re.search(r"\d+/\d+ steps", proc.stdout), proc.stdout

    # The step's AlignOPSD inputs (embeddings, cross-teacher log-probs) replay to the advantages it trained on.
    check = subprocess.run([sys.executable, "-m", "opsd.cli", "credit", "check", str(run_dir / "credit")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip().endswith("1 passed, 0 failed"), check.stdout + check.stderr
    check_inspect_pages(run_dir)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0]
    # The alfworld-7b profile's KL to the reference: step 0 trains at the reference (KL ~ 0); the dump's loss replayed.
    assert abs(records[0]["kl"]) < 1e-4 and records[0]["reference_seconds"] > 0
    case = json.loads(next((run_dir / "credit").iterdir()).read_text())
    assert case["config"]["opsd_trainer"]["kl_coef"] == 0.01 and case["inputs"]["loss"]["sequences"][0]["ref_log_probs"]
    assert records[0]["policy_version"] == 1
    assert records[0]["episodes"] == 2
    assert 0.0 <= records[0]["success_rate"] <= 1.0
    assert (run_dir / "metrics.png").stat().st_size > 1000

    # The policy version advanced and its weights differ from the initial model's.
    v1 = load_file(run_dir / "checkpoint" / "model.safetensors")
    base_dir = ensure_model(RunConfig.load(REPO / "tests/configs/tiny.yaml").model)
    base = {}
    for f in base_dir.glob("*.safetensors"):
        base.update(load_file(f))
    shared = [k for k in v1 if k in base]
    assert shared, "weights file and base model share no tensor names"
    changed = sum(int((v1[k] != base[k]).any()) for k in shared)
    assert changed > 0, "no parameter changed after a training step"
    assert json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["policy_version"] == 1

    # Every service answered /metrics and /health, and exports its role's series.
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["metrics_answered"] == {"embedder": True, "rollout": True, "teacher": True, "trainer": True}
    for role in ("rollout", "teacher", "trainer"):
        text = (run_dir / "scrapes" / f"{role}.prom").read_text()
        assert f'opsd_groups_total{{role="{role}"}}' in text, role
    assert 'opsd_policy_version{role="trainer"} 1.0' in (run_dir / "scrapes" / "trainer.prom").read_text()
    assert 'opsd_reference_kl{role="trainer"}' in (run_dir / "scrapes" / "trainer.prom").read_text()
    for role in ("embedder", "rollout", "teacher", "trainer", "redis"):
        assert (run_dir / "logs" / f"{role}.log").exists(), role


def test_every_other_method_runs_by_name_end_to_end(tmp_path):
    """gc_opd (teacher without embedder) through the real services; its dump replays exactly. With
    trainer.keep_optimizer_state false the finished run keeps its policy and drops the optimizer state."""
    cfg = RunConfig.load(REPO / "tests/configs/tiny.yaml").model_dump(mode="json")
    cfg["run"]["method"] = "gc_opd"
    cfg["trainer"]["keep_optimizer_state"] = False
    path = tmp_path / "gc_opd.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(tmp_path / "runs"), "--dump-credit"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["policy_version"] == 1 and "gc_opd/residual_abs_mean" in record
    assert json.loads((run_dir / "run_summary.json").read_text())["roles"] == ["rollout", "teacher", "trainer"]
    kept = {p.name for p in (run_dir / "checkpoint").iterdir()}
    assert "model.safetensors" in kept and "optimizer.dropped" in kept and not kept & {"optimizer.safetensors",
                                                                                        "optimizer.json"}
    check = subprocess.run([sys.executable, "-m", "opsd.cli", "credit", "check", str(run_dir / "credit")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip().endswith("1 passed, 0 failed"), check.stdout + check.stderr


def test_ctrl_c_stops_every_process(tmp_path):
    """SIGINT to `opsd run` mid-run: the CLI exits, and no role or redis-server process is left."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opsd.cli", "run", str(REPO / "tests/configs/tiny.yaml"), "--output-dir", str(tmp_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A fresh session with default signal dispositions, as a shell's foreground job has.
        start_new_session=True,
    )
    roles = ("embedder", "rollout", "teacher", "trainer")
    deadline = time.time() + 300
    pids: dict[str, int] = {}
    while time.time() < deadline and len(pids) < len(roles):
        for ports in tmp_path.glob("*/ports/*.json"):
            info = json.loads(ports.read_text())
            pids[info["role"]] = info["pid"]
        time.sleep(0.5)
    assert set(pids) == set(roles), f"roles did not all start: {pids}"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1 and "interrupted" in out, out[-2000:]

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()

    assert not [r for r, pid in pids.items() if alive(pid)]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    # redis-server prefixes its log lines with "<pid>:M": the run's own server must be gone too.
    redis_log = (run_dir / "logs" / "redis.log").read_text()
    redis_pid = int(re.search(r"^(\d+):M ", redis_log, re.M).group(1))
    assert not alive(redis_pid)


def test_the_embedder_service_retrieves_for_the_rollouts_search_env(tmp_path):
    """The embedder process of a Search run serves /retrieve over the shipped corpus, and the rollout's
    HTTPRetriever finds it through the run directory's port file with the run's token."""
    from opsd.envs.search import HTTPRetriever
    from opsd.service import embedder_url

    cfg = RunConfig.model_validate({"run": {"method": "grpo"}, "env": {"name": "search"}})
    cfg_path = tmp_path / "search.yaml"
    cfg.dump(cfg_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "OPSD_API_TOKEN": "t" * 32, "OMP_NUM_THREADS": "1"}
    env.pop("OPSD_EMBEDDER_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.embedder", "--config", str(cfg_path), "--run-dir", str(run_dir)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        retriever = HTTPRetriever(lambda: embedder_url(run_dir), "t" * 32, timeout_s=30, retry_s=240)
        passages = retriever.search("How long is a marathon in kilometres?", 3)
        assert len(passages) == 3 and any("42.195" in p for p in passages), passages
        # A wrong token is refused, not retried forever.
        with pytest.raises(Exception, match="401|token"):
            HTTPRetriever(lambda: embedder_url(run_dir), "x" * 32, timeout_s=30, retry_s=5).search("marathon", 3)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_a_search_run_starts_the_embedder_and_trains(tmp_path):
    """`opsd run` on env search (GRPO, no teacher): embedder, rollout and trainer run one step."""
    cfg = RunConfig.model_validate({
        "run": {"name": "e2e-search", "steps": 1, "method": "grpo", "step_timeout_s": 900},
        "model": {"threads": 1},
        "env": {"name": "search", "num_games": 1, "game_pool": 2, "max_turns": 2, "list_admissible": False},
        "rollout": {"group_size": 2, "max_new_tokens": 24},
        "trainer": {"micro_batch_size": 2, "threads": 2},
    })
    path = tmp_path / "search.yaml"
    cfg.dump(path)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert json.loads((run_dir / "run_summary.json").read_text())["roles"] == ["embedder", "rollout", "trainer"]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["policy_version"] == 1 and record["episodes"] == 2


def test_bf16_weights_reach_the_workers_over_http(tmp_path):
    """model.dtype bfloat16 with weights.transport http through the real services: the trainer (fp32 master)
    publishes bf16 versions and serves them; rollout and the self-teacher load version 1 over HTTP, and the
    background checkpoints keep the last 2 (issue 35)."""
    cfg = RunConfig.load(REPO / "tests/configs/tiny.yaml").model_dump(mode="json")
    cfg["run"].update(method="opd", steps=2)
    cfg["model"].update(name="tiny-random", dtype="bfloat16")
    cfg["weights"] = {"transport": "http"}
    cfg["trainer"].update(checkpoint_every=1, keep_checkpoints=2)
    path = tmp_path / "http.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "OPSD_WEIGHTS_TRANSPORT", "OPSD_WEIGHTS_URL")}
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(tmp_path / "runs")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "disk peak" in proc.stdout, proc.stdout
    (run_dir,) = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2]
    assert all(0.0 <= r["mismatch_kl"] < 1.0 for r in records)
    for role in ("rollout", "teacher"):
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert re.search(r"loaded policy version 1 from http://127\.0\.0\.1:\d+/weights/policy-v00001\.safetensors",
                         log), log[-3000:]
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    kept = json.loads((run_dir / "checkpoint-00001" / "trainer_state.json").read_text())
    assert (state["step"], kept["step"]) == (2, 1)
    master = load_file(run_dir / "checkpoint" / "model.safetensors")
    assert {str(t.dtype) for t in master.values()} == {"float32"}  # the trainer's master weights stay fp32
