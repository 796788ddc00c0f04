"""An external teacher (teacher.source: model): config, the tokenizer check, scoring, and runs through the services.

Student and teacher are tiny random Llamas with SmolLM2's tokenizer (tests/tiny_model.py) of different
seeds, so the teacher's log-probs differ from the student's wherever they are compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from opsd.chat import ChatFormat
from opsd.config import ModelSection, RunConfig
from opsd.envs.textworld import make_games
from opsd.models import HFBackend, check_teacher_model
from opsd.types import TaskGroup
from services.rollout.episodes import run_group
from services.teacher.scoring import score_group
from tests.tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(student dir, teacher dir): tiny models of seeds 0 and 1, one tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return make_tiny_model_dir(root / "student", seed=0), make_tiny_model_dir(root / "teacher", seed=1)


def _cfg(student: Path, teacher: Path | None, **sections) -> RunConfig:
    data = {"model": {"name": str(student), "threads": 1},
            "env": {"game_pool": 1, "seed": 1234, "max_turns": 2, "list_admissible": False, "one_shot": False},
            "rollout": {"group_size": 2, "max_new_tokens": 8}, "teacher": {"thinking_max_new_tokens": 6}}
    if teacher is not None:
        data["teacher"].update(source="model", model={"name": str(teacher)})
    for name, section in sections.items():
        data.setdefault(name, {}).update(section)
    return RunConfig.model_validate(data)


# -- config -------------------------------------------------------------------


def test_config_needs_a_model_for_source_model_and_refuses_one_for_self():
    with pytest.raises(ValidationError, match="teacher.source: model needs a teacher.model section"):
        RunConfig.model_validate({"teacher": {"source": "model"}})
    with pytest.raises(ValidationError, match="teacher.model is set but teacher.source is self"):
        RunConfig.model_validate({"teacher": {"model": {"name": "tiny-random"}}})
    # The live policy without privileged context is the student itself: every gap would be 0.
    # ema:0.0 averages nothing: the live policy under another spelling (issue 37, finding 2).
    for live in ("live", "ema:0.0", "ema:0.000000"):
        with pytest.raises(ValidationError, match="env.privileged none with the live policy as teacher"):
            RunConfig.model_validate({"run": {"method": "opd"}, "env": {"privileged": "none"}, "teacher": {"version": live}})
    for ok in ({"version": "frozen"}, {"version": "lag:1"}, {"version": "ema:0.000001"}, {"version": "ema:0.99"},
               {"source": "model", "model": {"name": "tiny-random"}}):
        RunConfig.model_validate({"run": {"method": "opd"}, "env": {"privileged": "none"}, "teacher": ok})
    RunConfig.model_validate({"run": {"method": "grpo"}, "env": {"privileged": "none"}})


def test_teacher_model_section_defaults_and_backend_rules():
    cfg = RunConfig.model_validate({"model": {"cache_dir": "/tmp/c"},
                                    "teacher": {"source": "model", "model": {"name": "tiny-random", "backend": "vllm"}}})
    assert cfg.teacher_model.name == "tiny-random" and cfg.teacher_model.cache_dir == "/tmp/c"  # the student's cache
    assert cfg.teacher_model is cfg.teacher.model
    self_cfg = RunConfig()
    assert self_cfg.teacher_model == self_cfg.model
    # Groups in flight follow the backend of the model each role serves.
    assert cfg.groups_in_flight("teacher") == 8 and cfg.groups_in_flight("rollout") == 1
    # fire_opd needs entropies: refused for a vLLM teacher, whatever the student's backend.
    with pytest.raises(ValidationError, match="fire_opd needs the teacher's entropies"):
        RunConfig.model_validate({"run": {"method": "fire_opd"},
                                  "teacher": {"source": "model", "model": {"name": "tiny-random", "backend": "vllm"}}})
    RunConfig.model_validate({"run": {"method": "fire_opd"}, "model": {"backend": "vllm"},
                              "teacher": {"source": "model", "model": {"name": "tiny-random"}}})


def test_teacher_versions_of_a_self_teacher():
    live = RunConfig.model_validate({"run": {"method": "opd"}})
    assert [live.teacher_version(v) for v in (0, 3)] == [0, 3] and live.teacher_lag == 0
    frozen = RunConfig.model_validate({"run": {"method": "opd"}, "teacher": {"version": "frozen"}})
    assert [frozen.teacher_version(v) for v in (0, 3)] == [0, 0] and frozen.teacher_lag == 0
    lag = RunConfig.model_validate({"run": {"method": "opd", "max_staleness": 1}, "teacher": {"version": "lag:2"}})
    assert [lag.teacher_version(v) for v in (0, 1, 2, 5)] == [0, 0, 0, 3] and lag.teacher_lag == 2
    assert RunConfig.model_validate({"run": {"method": "grpo"}, "teacher": {"version": "lag:2"}}).teacher_lag == 0  # no teacher
    external = RunConfig.model_validate({"teacher": {"source": "model", "model": {"name": "tiny-random"}}})
    assert external.teacher_version(7) == 0
    ema = RunConfig.model_validate({"run": {"method": "opd"}, "teacher": {"version": "ema:0.99"}})
    assert ema.teacher_ema == 0.99 and ema.teacher_version(4) == 4 and ema.teacher_lag == 0
    assert RunConfig.model_validate({"run": {"method": "grpo"}, "teacher": {"version": "ema:0.9"}}).teacher_ema is None
    with pytest.raises(ValidationError, match="with trainer.lora the trainer publishes adapters only"):
        RunConfig.model_validate({"teacher": {"version": "ema:0.9"}, "trainer": {"lora": {}}})
    for bad in ("lag:0", "lag:-1", "lag:x", "ema", "ema:1.0", "ema:0.", "ema:-0.1", "Live", "lag:12345"):
        with pytest.raises(ValidationError, match="teacher.version|String should match"):
            RunConfig.model_validate({"teacher": {"version": bad}})
    for version in ("lag:1", "ema:0.5"):
        with pytest.raises(ValidationError, match=f"teacher.version {version} needs the live policy's versions"):
            RunConfig.model_validate({"teacher": {"source": "model", "model": {"name": "tiny-random"}, "version": version}})


# -- the tokenizer check ---------------------------------------------------------


def test_same_tokenizer_passes_and_each_difference_is_one_clear_line(dirs, tmp_path):
    student, teacher = dirs
    check_teacher_model(ModelSection(name=str(student)), ModelSection(name=str(teacher)))
    check_teacher_model(ModelSection(name=str(student)), ModelSection(name="tiny-random"))  # packaged, same family

    from transformers import AutoTokenizer

    added = tmp_path / "added"
    shutil.copytree(teacher, added)
    tok = AutoTokenizer.from_pretrained(added)
    tok.add_tokens(["<extra_tool_call>"])
    tok.save_pretrained(added)
    with pytest.raises(ValueError, match=r"vocabularies of 49152 vs 49153 tokens, '<extra_tool_call>' is None vs 49152; "
                                         r"cross-tokenizer distillation is not supported") as err:
        check_teacher_model(ModelSection(name=str(student)), ModelSection(name=str(added)))
    assert "\n" not in str(err.value)

    template = tmp_path / "template"
    shutil.copytree(teacher, template)
    jinja = template / "chat_template.jinja"
    assert jinja.is_file()
    jinja.write_text(jinja.read_text().replace("<|im_start|>system", "<|im_start|>system "))
    with pytest.raises(ValueError, match="the chat templates differ"):
        check_teacher_model(ModelSection(name=str(student)), ModelSection(name=str(template)))

    def variant(name: str, edit) -> ModelSection:
        path = tmp_path / name
        shutil.copytree(teacher, path)
        edit(path)
        return ModelSection(name=str(path))

    def config_edit(**changes):
        def apply(path):
            conf = json.loads((path / "config.json").read_text())
            conf.update(changes)
            (path / "config.json").write_text(json.dumps(conf))
        return apply

    def peft_names(path):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        save_file({k.replace(".q_proj.", ".q_proj.base_layer."): v for k, v in tensors.items()}, path / "model.safetensors")

    cases = [
        (variant("lora-checkpoint", peft_names), "holds LoRA adapters under peft's names .* use that run's final_model/"),
        (ModelSection(name=str(tmp_path / "missing")), r"teacher.model '.*missing': cannot load its tokenizer and config "
                                                       r"\(teacher.model '.*missing' is neither a packaged model"),
        (variant("no-weights", lambda p: (p / "model.safetensors").unlink()), "no weight files"),
        (variant("small-vocab", config_edit(vocab_size=40000)), "vocab_size 40000 < the student's 49152"),
        (variant("short", config_edit(max_position_embeddings=64)), "max_position_embeddings 64 < the student's 2048"),
        (variant("bad-config", lambda p: (p / "config.json").write_text("{not json")), "cannot load its tokenizer and config"),
    ]
    for section, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            check_teacher_model(ModelSection(name=str(student)), section)
        assert "\n" not in str(err.value), str(err.value)
    # A larger, padded embedding (Qwen2.5-7B vs 0.5B) is fine: the student's ids all have logits.
    check_teacher_model(ModelSection(name=str(student)), variant("padded", config_edit(vocab_size=49280)))


# -- scoring ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def played(dirs, tmp_path_factory):
    """(student backend, teacher backend, a RolloutGroup the student played)."""
    student_dir, teacher_dir = dirs
    cfg = _cfg(student_dir, teacher_dir)
    student, teacher = HFBackend(cfg.model), HFBackend(cfg.teacher_model)
    game = make_games(cfg.env, tmp_path_factory.mktemp("games"))[0]
    task = TaskGroup(group_id="g-ext", task_id=game.task_id, step=0, policy_version=0, group_size=2, env="textworld",
                     game=game.to_dict(), privileged_info=game.privileged_info(), max_turns=2)
    group, _ = run_group(task, student, ChatFormat(student.tokenizer, "action"), cfg.env, cfg.rollout,
                         cfg.model.max_model_len, seed=5)
    assert sum(len(t.turns) for t in group.trajectories) >= 2
    return student, teacher, group


@pytest.mark.parametrize("privileged", ["both", "none"])
def test_an_external_teacher_scores_the_students_exact_ids(dirs, played, privileged):
    """Identity view = the teacher model's own `score` of (privileged prefix +) the student's ids; "none" has no
    prefix at all; the log-probs are the teacher's, not the student's; the ScoredGroup names its teacher."""
    student, teacher, group = played
    cfg = _cfg(*dirs, env={"privileged": privileged}, run={"method": "opd"})
    chat = ChatFormat(teacher.tokenizer, "action")
    scored, stats = score_group(group, teacher, chat, cfg, None)
    prefix = [] if privileged == "none" else chat.privileged_prefix_ids(group.task.privileged_info)
    for i, traj in enumerate(group.trajectories):
        ids = prefix + traj.token_ids_S.tolist()
        start = max(len(prefix), 1)
        want = np.r_[np.zeros(start - len(prefix), np.float32), teacher.score([ids], [start])[0]]
        m = traj.loss_mask_S == 1
        np.testing.assert_allclose(scored.teacher_logprobs_S[i][m], want[m], atol=1e-5, rtol=0)
        assert not scored.teacher_logprobs_S[i][~m].any()
        own = student.score([ids], [start])[0]
        assert np.abs(own[m[start - len(prefix):]] - want[m]).max() > 0.1  # not the student's log-probs
    assert scored.teacher == f"model:{dirs[1]}" and scored.teacher_version == 0
    assert stats.gap_tokens == sum(int(t.loss_mask_S.sum()) for t in group.trajectories)


# -- through the services ---------------------------------------------------------


def _opsd_run(cfg: RunConfig, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(tmp_path / "runs"), *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _faults_cfg(student: Path, teacher: Path, method: str, privileged: str, env: str = "textworld") -> RunConfig:
    cfg = RunConfig.load(REPO / "tests/configs/faults.yaml").model_dump(mode="json")
    cfg["run"].update(steps=1, method=method)
    cfg["model"]["name"] = str(student)
    cfg["env"]["privileged"] = privileged
    if env == "evidence":  # the long-context env, single turn, two length buckets of short documents
        cfg["env"].update(name="evidence", max_turns=1, max_observation_chars=4000,
                          evidence={"prompt_tokens": [128, 256]})
    cfg["teacher"].update(source="model", model={"name": str(teacher), "threads": 1})
    return RunConfig.model_validate(cfg)


@pytest.mark.e2e
@pytest.mark.parametrize("method,privileged,env", [("gc_opd", "none", "textworld"), ("agentopsd", "remaining", "textworld"),
                                                    ("alignopsd", "both", "textworld"), ("alignopsd", "both", "evidence")])
def test_a_run_with_an_external_teacher_trains_and_its_dump_replays(dirs, tmp_path, method, privileged, env):
    """Plain OPD-style (gc_opd, no privileged context) and OPSD (agentopsd with per-turn hints, alignopsd with
    privileged context + embedder) with an external teacher, through the real services (alignopsd: all four,
    also on the long-context evidence env); the dumps replay with `opsd credit check`."""
    proc = _opsd_run(_faults_cfg(*dirs, method, privileged, env), tmp_path, "--dump-credit")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["policy_version"] == 1
    assert record["teacher"] == [f"model:{dirs[1]}"] and record["teacher_version_max"] == 0
    # The first line names both models (local directories: no revision, no commit), as model.json does.
    local = {"revision": None, "commit": None}
    assert record["model"] == {"name": str(dirs[0]), **local, "path": str(dirs[0])}
    assert record["teacher_model"] == {"name": str(dirs[1]), **local, "path": str(dirs[1])}
    assert json.loads((run_dir / "model.json").read_text()) == {k: record[k] for k in ("model", "teacher_model")}
    assert record["teacher_student_gap"] != 0.0
    assert record["teacher_guard/judged_groups"] <= 2 and "teacher_guard/worse_groups" in record
    # The teacher-verifier diagnostics of every teacher method: counts for "all" and each prompt-length bucket.
    assert 0 <= record["teacher_verifier/all/groups"] <= 2 and record["teacher_verifier/<1k/groups"] == record[
        "teacher_verifier/all/groups"]
    if env == "evidence":  # categories are the length buckets
        assert {k for k in record if k.startswith("success/")} <= {"success/128", "success/256"}
    log = (run_dir / "logs" / "teacher.log").read_text()
    assert f"external teacher {dirs[1]} (hf, frozen" in log
    check = subprocess.run([sys.executable, "-m", "opsd.cli", "credit", "check", str(run_dir / "credit")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip().endswith("1 passed, 0 failed"), check.stdout + check.stderr


@pytest.mark.e2e
def test_a_lagging_self_teacher_scores_with_the_policy_a_version_back(dirs, tmp_path):
    """teacher.version lag:1 over 3 steps: the groups of versions 0, 1, 2 are scored by versions 0, 0, 1 (the
    trainer kept version 0's file for it), and every ScoredGroup says so."""
    cfg = RunConfig.load(REPO / "tests/configs/faults.yaml").model_dump(mode="json")
    cfg["run"].update(steps=3)
    cfg["model"]["name"] = str(dirs[0])
    cfg["teacher"]["version"] = "lag:1"
    proc = _opsd_run(RunConfig.model_validate(cfg), tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["teacher_version_min"], r["teacher_version_max"]) for r in records] == [(0, 0), (0, 0), (1, 1)]
    assert [r["teacher"] for r in records] == [["self:lag:1"]] * 3
    assert "self teacher, version lag:1" in (run_dir / "logs" / "teacher.log").read_text()


@pytest.mark.e2e
def test_an_ema_teacher_scores_with_the_trainers_average_which_survives_a_resume(dirs, tmp_path):
    """teacher.version ema:0.5: one step, then --resume for a second. The checkpoint's average is exactly
    0.5 (0.5 theta0 + 0.5 theta1) + 0.5 theta2 of the published versions (kept as snapshots): the resumed
    trainer went on with the saved average instead of restarting it; the teacher loaded ema-v00001."""
    from safetensors.numpy import load_file

    cfg = RunConfig.load(REPO / "tests/configs/faults.yaml").model_dump(mode="json")
    cfg["run"].update(steps=1)
    cfg["model"]["name"] = str(dirs[0])
    cfg["teacher"]["version"] = "ema:0.5"
    cfg["trainer"]["snapshot_every"] = 1
    proc = _opsd_run(RunConfig.model_validate(cfg), tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    again = subprocess.run([sys.executable, "-m", "opsd.cli", "run", "--resume", str(run_dir), "--steps", "2"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    theta = [load_file(run_dir / "snapshots" / f"policy-v{v:05d}.safetensors") for v in range(3)]
    ema = load_file(run_dir / "checkpoint" / "ema.safetensors")
    assert set(ema) == set(theta[2])
    for name, value in ema.items():
        want = 0.5 * (0.5 * theta[0][name] + 0.5 * theta[1][name]) + 0.5 * theta[2][name]
        np.testing.assert_allclose(value, want, rtol=0, atol=1e-6, err_msg=name)
    assert any(np.abs(theta[2][n] - theta[0][n]).max() > 1e-4 for n in ema)  # the policy did move
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["teacher"], r["teacher_version_max"]) for r in records] == [(["self:ema:0.5"], 0), (["self:ema:0.5"], 1)]
    assert "ema-v00001.safetensors" in (run_dir / "logs" / "teacher.log").read_text()


def test_a_teacher_of_another_tokenizer_is_refused_before_anything_starts(dirs, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(dirs[1], other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_tool_call>"])
    tok.save_pretrained(other)
    cfg = _faults_cfg(dirs[0], other, "opd", "both")
    proc = _opsd_run(cfg, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not share the student's tokenizer" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/logs/teacher.log"))

    # A teacher started on its own (compose, k8s) refuses it too, with one line and the fatal exit code.
    from opsd.service import FATAL_EXIT

    path = tmp_path / "teacher.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    env = {**os.environ, "OPSD_API_TOKEN": "t" * 32}
    role = subprocess.run([sys.executable, "-m", "services.teacher", "--config", str(path), "--run-dir", str(tmp_path / "r")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert role.returncode == FATAL_EXIT, role.stderr[-3000:]
    assert "teacher: cannot start: teacher.model" in role.stderr and "Traceback" not in role.stderr
