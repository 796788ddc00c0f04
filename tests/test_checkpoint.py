"""The trainer's checkpoint: exact round trip, crash-safe swap, config-hash check."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from opsd.config import RunConfig
from services.trainer.checkpoint import (
    CheckpointError, TrainerState, config_hash, find_checkpoint, hashed_config, load_checkpoint, save_checkpoint,
)
from tests.factories import tiny_llama


def _tied_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _adam_step(model, opt) -> None:
    """One AdamW step on a loss whose inputs come from all three global RNGs (so a wrong RNG restore shows)."""
    ids = torch.randint(0, 64, (2, 9))
    ids[0, 0] = random.randrange(64)
    ids[1, 0] = int(np.random.randint(64))
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _state(cfg: RunConfig, step: int) -> TrainerState:
    return TrainerState(step=step, policy_version=step, method=cfg.run.method, config_hash=config_hash(hashed_config(cfg)),
                        applied=[f"s{s:05d}-tw-0001@v{s}" for s in range(step)],
                        counts={"trained": step, "dropped_stale": 1, "dropped_duplicate": 2})


@pytest.mark.parametrize("make", [lambda s: tiny_llama(num_hidden_layers=1, seed=s), _tied_llama], ids=["untied", "tied"])
def test_round_trip_restores_weights_optimizer_and_rng_exactly(tmp_path, make):
    cfg = RunConfig()
    model = make(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    _adam_step(model, opt)
    records = [{"step": 0, "loss": 0.5}]
    path = save_checkpoint(tmp_path, model, opt, _state(cfg, 1), hashed_config(cfg), records)
    assert path == tmp_path / "checkpoint" and not (tmp_path / ".checkpoint-tmp").exists()
    # The directory stays a loadable HF model.
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    for _ in range(2):
        _adam_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # a fresh process: other RNG states, other weights
    other = make(7)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.01)
    state = load_checkpoint(find_checkpoint(tmp_path), other, other_opt, hashed_config(cfg))
    assert state == _state(cfg, 1)
    assert json.loads((path / "trainer_state.json").read_text())["applied"] == ["s00000-tw-0001@v0"]
    assert [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()] == records
    for _ in range(2):
        _adam_step(other, other_opt)
    got = other.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items()), [k for k, v in expected.items() if not torch.equal(got[k], v)]
    step_after = other_opt.state_dict()["state"][0]["step"]
    assert float(step_after) == 3.0


def test_swap_survives_a_crash_between_the_renames(tmp_path, monkeypatch):
    cfg = RunConfig()
    model = tiny_llama(num_hidden_layers=1)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, model, opt, _state(cfg, 1), hashed_config(cfg), [])
    weights_v1 = {k: v.clone() for k, v in model.state_dict().items()}
    _adam_step(model, opt)

    real_rename = Path.rename

    def crash_on_second_rename(self, target):
        if Path(self).name == ".checkpoint-tmp":
            raise OSError("simulated crash: checkpoint -> .checkpoint-old done, .checkpoint-tmp -> checkpoint not")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second_rename)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, model, opt, _state(cfg, 2), hashed_config(cfg), [])
    monkeypatch.setattr(Path, "rename", real_rename)
    assert not (tmp_path / "checkpoint").exists() and (tmp_path / ".checkpoint-old").is_dir()

    found = find_checkpoint(tmp_path)
    assert found == tmp_path / ".checkpoint-old"
    fresh = tiny_llama(num_hidden_layers=1, seed=5)
    state = load_checkpoint(found, fresh, torch.optim.AdamW(fresh.parameters()), hashed_config(cfg))
    assert state.step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights_v1.items())

    # The next save completes the swap and leaves one checkpoint.
    save_checkpoint(tmp_path, model, opt, _state(cfg, 2), hashed_config(cfg), [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())["step"] == 2


def test_no_checkpoint_and_a_half_written_one_are_not_found(tmp_path):
    assert find_checkpoint(tmp_path) is None
    (tmp_path / ".checkpoint-tmp").mkdir()
    (tmp_path / "checkpoint").mkdir()  # no trainer_state.json: not a checkpoint
    assert find_checkpoint(tmp_path) is None


def test_config_hash_mismatch_is_refused_and_names_the_field(tmp_path):
    cfg = RunConfig()
    model = tiny_llama(num_hidden_layers=1)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, model, opt, _state(cfg, 1), hashed_config(cfg), [])
    before = {k: v.clone() for k, v in model.state_dict().items()}

    changed = RunConfig.model_validate({"trainer": {"lr": 1e-3}})
    other = tiny_llama(num_hidden_layers=1, seed=3)
    untouched = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"trainer\.lr"):
        load_checkpoint(tmp_path / "checkpoint", other, torch.optim.AdamW(other.parameters()), hashed_config(changed))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in untouched.items())  # nothing restored

    # Fields a resumed run may change keep the hash.
    resumable = RunConfig.model_validate({
        "run": {"steps": 50, "output_dir": "elsewhere", "step_timeout_s": 5.0, "max_restarts": 9},
        "redis": {"url": "redis://other:6379/0"}, "trainer": {"metrics_port": 9100}, "teacher": {"metrics_port": 9101},
    })
    assert config_hash(hashed_config(resumable)) == config_hash(hashed_config(cfg))
    load_checkpoint(tmp_path / "checkpoint", other, torch.optim.AdamW(other.parameters()), hashed_config(resumable))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert config_hash(hashed_config(RunConfig.model_validate({"run": {"seed": 1}}))) != config_hash(hashed_config(cfg))


def test_a_model_of_another_shape_is_refused_before_any_weight_changes(tmp_path):
    cfg = RunConfig()
    save_checkpoint(tmp_path, tiny_llama(num_hidden_layers=1), torch.optim.AdamW(tiny_llama(num_hidden_layers=1).parameters()),
                    _state(cfg, 1), hashed_config(cfg), [])
    bigger = tiny_llama(num_hidden_layers=2)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path / "checkpoint", bigger, torch.optim.AdamW(bigger.parameters()), hashed_config(cfg))
    assert all(torch.equal(bigger.state_dict()[k], v) for k, v in before.items())
