"""opsd/footprint.py: exact parameter counts, bytes per role, the disk peak of a run, and `opsd run`'s refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from opsd import footprint
from opsd.config import LoRASection, ModelSection, RunConfig
from opsd.footprint import (
    DEFAULT_ENCODER_PARAMS, checkpoint_interval, disk_peak_bytes, disk_problem, free_bytes, lora_param_count,
    model_config, param_count, role_bytes,
)
from opsd.models.hf import ensure_model

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


@pytest.mark.parametrize("name, published", [
    ("Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen2.5-1.5B-Instruct", 1.54e9), ("Qwen2.5-3B-Instruct", 3.09e9),
    ("Qwen2.5-7B-Instruct", 7.62e9), ("Llama-3.1-8B-Instruct", 8.03e9),
])
def test_preset_counts_match_the_published_sizes(name, published):
    assert abs(param_count(model_config(name)) - published) <= 0.01 * published


def _stored_params(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() for k in f.keys())


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "tiny-random"])
def test_param_count_of_a_model_dir_equals_its_weights_file(name):
    """Counted from config.json alone; the weights file stores a tied embedding once, as the count does."""
    model_dir = ensure_model(ModelSection(name=name))
    assert param_count(model_config(model_dir)) == _stored_params(model_dir)
    if name.startswith("smollm2"):
        assert param_count(model_config(model_dir)) == 134_515_008


def test_lora_param_count_equals_what_apply_lora_trains():
    from transformers import AutoModelForCausalLM

    from opsd.lora import apply_lora

    model_dir = ensure_model(ModelSection(name="tiny-random"))
    section = LoRASection(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), section)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained > 0 and lora_param_count(model_config(model_dir), 4, section.target_modules) == trained


def test_role_bytes_per_role():
    p = 7_615_616_512
    assert role_bytes(p, "bfloat16") == {"rollout": 2 * p, "teacher": 2 * p, "trainer": 16 * p,
                                         "embedder": 4 * DEFAULT_ENCODER_PARAMS}
    assert role_bytes(p, "float32", lora_params=1000, ema=True)["trainer"] == 4 * p + 16 * 1000 + 4 * p
    assert role_bytes(p, "float32")["rollout"] == 4 * p
    assert role_bytes(p, "bfloat16", reference=True)["trainer"] == 16 * p + 2 * p  # the KL's frozen copy, in bf16
    assert role_bytes(p, "bfloat16", lora_params=1000, reference=True)["trainer"] == 4 * p + 16 * 1000  # LoRA: the base


def test_disk_peak_terms():
    p, small = 7_615_616_512, footprint.CHECKPOINT_SMALL_BYTES
    # Defaults: synchronous, no snapshots, one checkpoint kept (+ the one being written), bf16 served.
    peak = disk_peak_bytes(p, steps=100)
    assert peak == {"weights": 3 * 2 * p, "snapshots": 0, "checkpoints": 2 * (12 * p + small), "final_model": 0,
                    "total": 6 * p + 24 * p + 2 * small}
    assert 228 * GB < peak["total"] < 230 * GB
    busy = disk_peak_bytes(p, steps=100, dtype="float32", max_staleness=2, teacher_lag=3, ema=True,
                           snapshot_every=10, keep_checkpoints=3)
    assert busy["weights"] == (2 + 2 + 3 + 1) * 4 * p * 2  # policy and average files
    assert busy["snapshots"] == 11 * 4 * p
    assert busy["checkpoints"] == 4 * (12 * p + 4 * p + small)
    lora = disk_peak_bytes(p, steps=100, lora_params=40_370_176, snapshot_every=50)
    assert lora["weights"] == 3 * 2 * 40_370_176 and lora["snapshots"] == 3 * 2 * 40_370_176
    assert lora["checkpoints"] == 2 * (4 * p + 12 * 40_370_176 + small) and lora["final_model"] == 4 * p
    assert lora["total"] == sum(v for k, v in lora.items() if k != "total")


def test_checkpoint_interval():
    assert checkpoint_interval("auto", 134_515_008) == 1
    assert checkpoint_interval("auto", 10**9 - 1) == 1
    assert checkpoint_interval("auto", 10**9) == 10 == checkpoint_interval("auto", 7_615_616_512)
    assert checkpoint_interval(4, 7_615_616_512) == 4
    with pytest.raises(ValueError, match="'often'"):
        checkpoint_interval("often", 1)
    assert RunConfig().trainer.checkpoint_every == "auto"
    assert RunConfig.model_validate({"trainer": {"checkpoint_every": 3}}).trainer.checkpoint_every == 3
    with pytest.raises(ValueError, match="checkpoint_every"):
        RunConfig.model_validate({"trainer": {"checkpoint_every": 0}})


def test_free_space_of_a_dir_not_made_yet_and_the_refusal_line(tmp_path):
    assert free_bytes(tmp_path / "runs" / "x") == free_bytes(tmp_path) > 0
    assert disk_problem(10 * GB, 10 * GB, tmp_path) is None
    line = disk_problem(229 * GB, 100 * GB, tmp_path)
    assert line == (f"the run needs up to 229.0 GB of disk (opsd.footprint.disk_peak_bytes) but {tmp_path} has "
                    "100.0 GB free: free space, set run.output_dir elsewhere, or lower trainer.keep_checkpoints, "
                    "trainer.snapshot_every or run.max_staleness")


def test_readme_table():
    page = (ROOT / "docs" / "how-to" / "your-model.md").read_text()
    assert footprint.readme_table() in page, ("docs/how-to/your-model.md's table of bytes per role is stale: "
                                              "python -m opsd.footprint")


def test_opsd_run_prints_the_peak_and_refuses_one_the_disk_cannot_hold(tmp_path):
    """A real `opsd run` of the tiny model whose snapshots (every one of 10**9 steps) need petabytes: one red
    line, exit 2, no run directory; the peak line comes first."""
    from typer.testing import CliRunner

    from opsd.cli import app

    config = {"run": {"steps": 10**9, "method": "grpo"}, "model": {"name": "tiny-random"},
              "trainer": {"snapshot_every": 1}}
    (tmp_path / "huge.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["run", str(tmp_path / "huge.yaml"), "--output-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("disk peak ") and "snapshots" in lines[0] and f"GB free at {tmp_path / 'runs'}" in lines[0]
    assert lines[1].startswith("error: the run needs up to ") and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_the_trainer_refuses_a_volume_too_small_for_the_peak(tmp_path, monkeypatch, capsys):
    """compose / k8s start the trainer without `opsd run`: it checks its volume itself, one line, exit FATAL_EXIT."""
    from opsd.service import FATAL_EXIT
    from services.trainer.__main__ import check_disk

    cfg = RunConfig()
    model_dir = ensure_model(ModelSection(name="tiny-random"))
    (tmp_path / "old.bin").write_bytes(b"x" * 1000)  # what the run dir holds counts as available
    peak = footprint.run_disk_peak(cfg, model_dir)["total"]
    monkeypatch.setattr(footprint, "free_bytes", lambda path: peak - 1000)
    check_disk(cfg, model_dir, tmp_path)  # exactly enough: no refusal
    monkeypatch.setattr(footprint, "free_bytes", lambda path: peak - 1001)
    with pytest.raises(SystemExit) as e:
        check_disk(cfg, model_dir, tmp_path)
    assert e.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer: cannot start: the run needs up to" in err
