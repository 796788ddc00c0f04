"""`opsd eval` (services/rollout/evaluate.py, opsd/cli.py eval): bootstrap math, per-category
numbers, checkpoint resolution, the real SmolLM2 policy on reasoning-gym and TextWorld, the CLI.

A scripted backend (real tokenizer) answers known replies to check the numbers per
category exactly; the real model checks the whole path (sampling, env, files).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from opsd.config import RunConfig
from opsd.envs import get_adapter, local_context
from services.rollout.evaluate import (
    bootstrap_interval, category_seed, evaluate, metric_values, report_numbers, resolve_checkpoint, summarize,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# Statistics


def test_bootstrap_degenerate_and_bounds():
    rng = np.random.default_rng(0)
    assert bootstrap_interval([1.0] * 20, 1000, rng) == (1.0, 1.0)
    assert bootstrap_interval([0.0] * 5, 1000, rng) == (0.0, 0.0)
    assert bootstrap_interval([0.7], 1000, rng) == (0.7, 0.7)  # one episode: [x, x]
    v = [0, 0, 1, 1, 1, 0, 1, 0, 1, 1, 0.5, 0.25]
    lo, hi = bootstrap_interval(v, 2000, np.random.default_rng(1))
    assert min(v) <= lo < np.mean(v) < hi <= max(v)
    # Deterministic for a seed; another seed moves it a little, not a lot.
    assert bootstrap_interval(v, 2000, np.random.default_rng(1)) == (lo, hi)
    lo2, hi2 = bootstrap_interval(v, 2000, np.random.default_rng(2))
    assert (lo2, hi2) != (lo, hi) and abs(lo2 - lo) < 0.05 and abs(hi2 - hi) < 0.05
    for bad in ([], [np.nan, 1.0]):
        with pytest.raises(ValueError):
            bootstrap_interval(bad, 100, rng)
    with pytest.raises(ValueError):
        bootstrap_interval([0, 1], 0, rng)


def test_bootstrap_matches_the_normal_approximation():
    # 400 Bernoulli(0.5) outcomes: the mean's 95% interval is about 0.5 +- 1.96 * sqrt(0.25 / 400) = 0.5 +- 0.049.
    v = np.array([0, 1] * 200, dtype=float)
    lo, hi = bootstrap_interval(v, 4000, np.random.default_rng(7))
    assert abs(lo - 0.451) < 0.012 and abs(hi - 0.549) < 0.012


def test_metrics_per_env_kind():
    rewards, wons = [1.0, 0.5, 0.0, 1.0], [True, False, False, True]
    assert metric_values("success", rewards, wons)["success"].tolist() == [1, 0, 0, 1]
    assert metric_values("em", rewards, wons)["em"].tolist() == rewards
    ws = metric_values("score", rewards, wons)
    assert ws["score"].mean() == 62.5 and ws["acc"].mean() == 50.0  # WebShop Score and Acc, in percent
    f1 = metric_values("f1", rewards, wons)  # graded verifiers (the evidence env): mean reward and success
    assert f1["f1"].mean() == 0.625 and f1["success"].mean() == 0.5
    with pytest.raises(ValueError):
        metric_values("bleu", rewards, wons)
    eps = [{"reward": r, "won": w, "turns": t, "valid_turns": vt, "ending": e}
           for r, w, t, vt, e in zip(rewards, wons, [1, 3, 4, 2], [1, 2, 0, 2], ["won", "done", "max_turns", "won"])]
    s = summarize(eps, "score", 500, 0, "shoes", errors=1)
    assert s["episodes"] == 4 and s["errors"] == 1 and s["mean_turns"] == 2.5 and s["format_valid_rate"] == 0.5
    assert s["endings"] == {"done": 1, "max_turns": 1, "won": 2}
    assert s["score"]["value"] == 62.5 and 0 <= s["score"]["ci95"][0] < 62.5 < s["score"]["ci95"][1] <= 100
    assert s["acc"]["value"] == 50.0
    empty = summarize([], "success", 500, 0, "x", errors=2)
    assert empty["success"] == {"value": None, "ci95": None} and empty["mean_turns"] is None
    # A category's generator depends on the seed and its own name only.
    assert category_seed(3, "a").random() == category_seed(3, "a").random() != category_seed(3, "b").random()


# ---------------------------------------------------------------------------
# --checkpoint resolution


def _model_dir(p: Path, tokenizer=True, names=("model.embed_tokens.weight",), state=None) -> Path:
    p.mkdir(parents=True)
    (p / "config.json").write_text("{}")
    save_file({n: torch.zeros(2) for n in names}, str(p / "model.safetensors"))
    if tokenizer:
        (p / "tokenizer.json").write_text("{}")
    if state is not None:
        (p / "trainer_state.json").write_text(json.dumps(state))
    return p


def test_resolve_checkpoint_kinds(tmp_path):
    run = tmp_path / "run"
    ckpt = _model_dir(run / "checkpoint", state={"step": 3, "policy_version": 3})
    (run / "config.yaml").write_text("run: {}\n")
    src = resolve_checkpoint(run)
    assert (src.kind, src.model_dir, src.weights_file, src.run_dir, src.policy_version) == ("run", ckpt, None, run, 3)
    src = resolve_checkpoint(ckpt)  # the checkpoint itself: its parent is the run
    assert (src.kind, src.model_dir, src.run_dir, src.policy_version) == ("model", ckpt, run, 3)
    # A finished LoRA run: final_model/ (the merged policy) wins over the peft-named checkpoint.
    lora = tmp_path / "lora"
    _model_dir(lora / "checkpoint", names=("model.layers.0.self_attn.q_proj.base_layer.weight",))
    with pytest.raises(ValueError, match="LoRA"):
        resolve_checkpoint(lora)
    final = _model_dir(lora / "final_model")
    (lora / "DONE").write_text(json.dumps({"steps": 2, "policy_version": 2}))
    src = resolve_checkpoint(lora)
    assert (src.model_dir, src.policy_version) == (final, 2)
    with pytest.raises(ValueError, match="final_model"):
        resolve_checkpoint(lora / "checkpoint")
    # A model dir without tokenizer files: its weights go into the config's model.
    bare = _model_dir(tmp_path / "bare", tokenizer=False)
    src = resolve_checkpoint(bare)
    assert (src.model_dir, src.weights_file, src.run_dir, src.policy_version) == (None, bare / "model.safetensors", None, None)
    # A published weights file, and a run that only has published weights.
    w = tmp_path / "r2" / "weights" / "policy-v00007.safetensors"
    w.parent.mkdir(parents=True)
    save_file({"x": torch.zeros(1)}, str(w))
    src = resolve_checkpoint(w)
    assert (src.kind, src.weights_file, src.run_dir, src.policy_version) == ("weights", w, tmp_path / "r2", 7)
    assert resolve_checkpoint(tmp_path / "r2").weights_file == w
    # Usage errors: missing, not a weights file, an unrelated folder.
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for bad, msg in (("nope", "no such"), ("notes.txt", "not a .safetensors"), ("empty", "neither a run directory")):
        with pytest.raises(ValueError, match=msg):
            resolve_checkpoint(tmp_path / bad)


# ---------------------------------------------------------------------------
# evaluate() with a scripted policy: known replies, known numbers


@dataclass
class _Gen:
    token_ids: list
    logprobs: list
    finish_reason: str


class AnswerBackend:
    """Answers each reasoning-gym question with answer(question) (real tokenizer); raises for `fail` questions."""

    def __init__(self, real, questions: dict[str, str], answer, fail=()):
        self.tokenizer, self.eos_token_id, self.vocab_size = real.tokenizer, real.eos_token_id, real.vocab_size
        self.stop_token_ids = real.stop_token_ids
        self.policy_version, self.max_model_len = 5, 2048
        self.questions, self.answer, self.fail = questions, answer, set(fail)
        self.temperatures = []

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, seed=None):
        self.temperatures.append((temperature, top_p))
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            (q,) = [q for q in self.questions if q in text]  # the question this episode plays
            if q in self.fail:
                raise RuntimeError("scripted failure")
            reply = f"{self.answer(q)}</answer>"
            if not text.endswith("<answer>"):  # the reply completes the prefilled tag, if any
                reply = "<answer>" + reply
            ids = self.tokenizer.encode(reply, add_special_tokens=False)
            ids = ids[: max_new_tokens - 1] + [self.eos_token_id]
            out.append(_Gen(ids, [-0.1] * len(ids), "stop"))
        return out


def _rg_cfg(tmp_path, **env) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"cache_dir": None}, "run": {"output_dir": str(tmp_path)},
        "env": {"name": "reasoning_gym", "eval_pool": 4, "game_pool": 4, "max_turns": 1,
                "reasoning_gym": {"datasets": ["basic_arithmetic", "chain_sum"], "size": 16}, **env},
        "rollout": {"max_new_tokens": 16}, "eval": {"episodes_per_task": 2, "bootstrap_samples": 500, "seed": 3},
    })


def test_scripted_success_per_category_and_failed_task(policy_backend, tmp_path):
    cfg = _rg_cfg(tmp_path)
    tasks = get_adapter("reasoning_gym").make_tasks(cfg.env, local_context(cfg), "eval")
    by_q = {t.spec["question"]: t for t in tasks}
    # Right on basic_arithmetic, wrong on chain_sum; the second chain_sum task's generation raises.
    fail = tasks[3].spec["question"]
    assert tasks[3].category == "chain_sum"
    answer = lambda q: by_q[q].spec["answer"] if by_q[q].category == "basic_arithmetic" else "123456789"  # noqa: E731
    fake = AnswerBackend(policy_backend, by_q, answer, fail=[fail])
    report = evaluate(cfg, fake, local_context(cfg), tmp_path / "out")
    assert set(fake.temperatures) == {(0.4, 1.0)}  # the validation temperature, not the rollout's
    ba, cs = report["categories"]["basic_arithmetic"], report["categories"]["chain_sum"]
    assert (ba["episodes"], ba["errors"], ba["success"]) == (4, 0, {"value": 1.0, "ci95": [1.0, 1.0]})
    assert (cs["episodes"], cs["errors"], cs["success"]) == (2, 1, {"value": 0.0, "ci95": [0.0, 0.0]})
    ov = report["overall"]
    assert ov["episodes"] == 6 and ov["errors"] == 1 and ov["success"]["value"] == pytest.approx(4 / 6)
    assert 0.0 <= ov["success"]["ci95"][0] < 4 / 6 < ov["success"]["ci95"][1] <= 1.0
    assert ba["format_valid_rate"] == 1.0 and ba["mean_turns"] == 1.0 and ba["endings"] == {"won": 4}
    assert report["policy_version"] == 5 and report["errors"] == 1
    failed = [t for t in report["tasks"] if t["error"]]
    assert [t["task_id"] for t in failed] == [tasks[3].task_id] and "scripted failure" in failed[0]["error"]
    assert failed[0]["episodes"] == [] and failed[0]["alone"]  # its chunk failed together, then replayed task by task
    assert report["tasks_per_call"] >= 1 and all(t["chunk"] == i // report["tasks_per_call"]
                                                  for i, t in enumerate(report["tasks"]))
    # Same config, same numbers (seeds from eval.seed and the task ids).
    again = evaluate(cfg, AnswerBackend(policy_backend, by_q, answer, fail=[fail]), local_context(cfg), tmp_path / "out2")
    assert again["overall"] == ov and [t["seed"] for t in again["tasks"]] == [t["seed"] for t in report["tasks"]]


def test_scripted_f1_per_length_bucket_on_the_evidence_env(policy_backend, tmp_path):
    """The long-context env in `opsd eval`: one category per length bucket, F1 and success per bucket."""
    from opsd.envs.evidence import f1, generate

    cfg = RunConfig.model_validate({
        "model": {"cache_dir": None}, "run": {"output_dir": str(tmp_path)},
        "env": {"name": "evidence", "eval_pool": 4, "max_turns": 1, "max_observation_chars": 4000,
                "evidence": {"prompt_tokens": [128, 256]}},
        "rollout": {"max_new_tokens": 48}, "eval": {"episodes_per_task": 1, "bootstrap_samples": 200},
    })
    tasks = get_adapter("evidence").make_tasks(cfg.env, local_context(cfg), "eval")
    docs = {t.task_id: generate(t.spec["kind"], t.spec["tokens"], t.spec["seed"]) for t in tasks}
    by_key = {docs[t.task_id].text[:120]: t for t in tasks}  # each document's opening (random IDs) names its task
    # Tables: only the first required ID (partial F1); passages: all of them (F1 1).
    ids = lambda t: docs[t.task_id].answer[:1] if t.spec["kind"] == "tables" else docs[t.task_id].answer  # noqa: E731
    report = evaluate(cfg, AnswerBackend(policy_backend, by_key, lambda k: ", ".join(ids(by_key[k]))),
                      local_context(cfg), tmp_path / "out")
    assert report["metrics"] == ["f1", "success"] and list(report["categories"]) == ["128", "256"]
    for bucket in ("128", "256"):
        mine = [t for t in tasks if t.category == bucket]
        expected = np.mean([f1(", ".join(ids(t)), docs[t.task_id].answer) for t in mine])
        assert 0.3 < expected < 1.0  # one partial answer, one whole one
        assert report["categories"][bucket]["f1"]["value"] == pytest.approx(expected)
        assert report["categories"][bucket]["success"]["value"] == 0.5


# ---------------------------------------------------------------------------
# The real policy


def _check_files(report: dict, out: Path) -> dict:
    """eval.json on disk equals the report; its numbers recompute from its own per-task results."""
    data = json.loads((out / "eval.json").read_text())
    assert data["tasks"] and set(data) >= {"config", "env", "checkpoint", "policy_version", "temperature",
                                           "categories", "overall", "tasks", "metric", "metrics"}
    assert data["temperature"] == 0.4
    again = report_numbers(data["tasks"], data["metric"], data["bootstrap_samples"], data["seed"])
    assert again["categories"] == data["categories"] and again["overall"] == data["overall"]
    eps = [e for t in data["tasks"] for e in t["episodes"]]
    assert data["overall"]["episodes"] == len(eps) == len(data["tasks"]) * data["episodes_per_task"]
    assert data["overall"]["success"]["value"] == pytest.approx(np.mean([e["won"] for e in eps]))
    assert sum(c["episodes"] for c in data["categories"].values()) == len(eps)
    assert (out / "eval.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads(json.dumps(report)) == data
    return data


def test_real_policy_reasoning_gym(policy_backend, tmp_path):
    cfg = _rg_cfg(tmp_path, eval_pool=3)
    cfg.rollout.max_new_tokens = 8
    cfg.eval.episodes_per_task = 1
    report = evaluate(cfg, policy_backend, local_context(cfg), tmp_path / "rg", checkpoint="smollm2")
    data = _check_files(report, tmp_path / "rg")
    assert [t["category"] for t in data["tasks"]] == ["basic_arithmetic", "chain_sum", "basic_arithmetic"]
    assert data["errors"] == 0 and all(e["turns"] == 1 for t in data["tasks"] for e in t["episodes"])
    assert data["checkpoint"] == "smollm2" and data["policy_version"] == policy_backend.policy_version


def test_real_policy_textworld(policy_backend, tmp_path):
    cfg = RunConfig.model_validate({
        "model": {}, "env": {"name": "textworld", "eval_pool": 2, "max_turns": 2},
        "rollout": {"max_new_tokens": 8}, "eval": {"bootstrap_samples": 200},
    })
    report = evaluate(cfg, policy_backend, local_context(cfg), tmp_path / "tw")
    data = _check_files(report, tmp_path / "tw")
    assert data["env"] == "textworld" and data["errors"] == 0 and len(data["tasks"]) == 2
    assert all(re.fullmatch(r"\d+-step", c) for c in data["categories"])
    assert all(1 <= e["turns"] <= 2 for t in data["tasks"] for e in t["episodes"])


# ---------------------------------------------------------------------------
# The command line


def test_cli_eval_on_a_saved_checkpoint(policy_backend, tmp_path):
    from typer.testing import CliRunner

    from opsd.cli import app

    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    policy_backend.model.save_pretrained(ckpt, safe_serialization=True)  # a loadable HF dir, like the trainer's
    policy_backend.tokenizer.save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "policy_version": 2}))
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "env": {"name": "reasoning_gym", "eval_pool": 2, "reasoning_gym": {"datasets": ["basic_arithmetic"], "size": 8}},
        "rollout": {"max_new_tokens": 6}, "eval": {"bootstrap_samples": 200},
    }))
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(config), "--checkpoint", str(run), "--max-tasks", "1", "--episodes", "2"])
    assert res.exit_code == 0, res.output
    (out,) = (run / "eval").iterdir()  # <run dir>/eval/<timestamp>/
    data = json.loads((out / "eval.json").read_text())
    assert data["checkpoint"] == str(ckpt) and data["policy_version"] == 2 and len(data["tasks"]) == 1
    assert data["overall"]["episodes"] == 2 and (out / "eval.png").read_bytes()[:8] == PNG_MAGIC
    assert "basic_arithmetic" in res.output and "eval.json" in res.output

    # A model dir without tokenizer files: the config's model loads it with load_weights; same weights and
    # seeds, so the very same episodes.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(ckpt / name)
    res = runner.invoke(app, ["eval", str(config), "--checkpoint", str(bare), "--max-tasks", "1", "--episodes", "2",
                              "--out", str(tmp_path / "out2")])
    assert res.exit_code == 0, res.output
    data2 = json.loads((tmp_path / "out2" / "eval.json").read_text())
    assert data2["checkpoint"] == str(bare) and data2["policy_version"] == 0
    assert data2["tasks"][0]["episodes"] == data["tasks"][0]["episodes"]

    # Without CONFIG: the run directory's own config.yaml (the same env and eval split), the same episodes.
    (run / "config.yaml").write_text(config.read_text())
    res = runner.invoke(app, ["eval", "--checkpoint", str(run), "--max-tasks", "1", "--episodes", "2",
                              "--out", str(tmp_path / "out3")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out3" / "eval.json").read_text())["tasks"][0]["episodes"] == data["tasks"][0]["episodes"]
    res = runner.invoke(app, ["eval", "--checkpoint", str(bare)])
    assert res.exit_code == 2 and "give CONFIG" in res.output

    res = runner.invoke(app, ["eval", str(config), "--checkpoint", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such file or directory" in res.output
    res = runner.invoke(app, ["eval", str(config), "--checkpoint", str(config)])
    assert res.exit_code == 2 and "not a .safetensors" in res.output


def test_cli_eval_prints_no_progress_bar_into_a_file(tmp_path):
    """Output that is not a terminal (here the runner's capture) gets no tqdm bar: transformers drew
    "Loading weights: 100%|...| 20/20 [...it/s]" with carriage returns into every log (issue 24)."""
    from transformers.utils import logging as hf_logging
    from typer.testing import CliRunner

    from opsd.cli import app
    from opsd.config import ModelSection
    from opsd.models import ensure_model

    model_dir = ensure_model(ModelSection(name="tiny-random"))
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "env": {"name": "reasoning_gym", "eval_pool": 1, "reasoning_gym": {"datasets": ["basic_arithmetic"], "size": 8}},
        "rollout": {"max_new_tokens": 4}, "eval": {"bootstrap_samples": 100, "episodes_per_task": 1},
    }))
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process: another test may have turned the bars off
    try:
        res = CliRunner().invoke(app, ["eval", str(config), "--checkpoint", str(model_dir), "--out", str(tmp_path / "out")])
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
    assert res.exit_code == 0, res.output
    assert "policy loaded" in res.output and "eval.json" in res.output
    assert "Loading weights" not in res.output and "it/s]" not in res.output and "\r" not in res.output, res.output


def test_a_half_written_checkpoint_falls_back_to_the_older_one_or_is_a_usage_error(tmp_path):
    """A truncated model.safetensors (a copy in progress, a full disk) is never loaded: the run's
    complete .checkpoint-old/ is used instead, and without one it is a usage error naming the file."""
    from safetensors.numpy import save_file

    run = tmp_path / "run"
    ck, old = run / "checkpoint", run / ".checkpoint-old"
    for d in (ck, old):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "tokenizer.json").write_text("{}")
    (run / "config.yaml").write_text("run: {}\n")
    (ck / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(old / "model.safetensors"))
    assert resolve_checkpoint(run).path == old.resolve()
    (old / "model.safetensors").unlink()
    (old / "config.json").unlink()
    with pytest.raises(ValueError, match="half-written"):
        resolve_checkpoint(run)
