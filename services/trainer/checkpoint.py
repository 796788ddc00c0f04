"""The trainer's resume point: `<run_dir>/checkpoint/`, written atomically, no pickle.

Contents:
  model*.safetensors, config.json, tokenizer files   a loadable HF model dir (save_pretrained)
  optimizer.safetensors    optimizer tensors, key "<param index>.<name>" (AdamW: exp_avg, exp_avg_sq, step)
  optimizer.json           param_groups and non-tensor state values
  rng.safetensors          torch CPU RNG state (uint8)
  rng.json                 python `random` and numpy global RNG states
  metrics.jsonl            the run's metric records of every step before `step`
  run_config.json          the hashed config (to name the fields that differ on a mismatch)
  trainer_state.json       TrainerState (below), written last

A save writes `.checkpoint-tmp/`, fsyncs it, then swaps: checkpoint ->
.checkpoint-old, .checkpoint-tmp -> checkpoint, delete the old one. A crash
at any point leaves a complete `checkpoint/` or a complete `.checkpoint-old/`,
which `find_checkpoint` falls back to.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from opsd.models.hf import load_state_strict
from services.trainer.report import write_records

NAME, OLD, TMP = "checkpoint", ".checkpoint-old", ".checkpoint-tmp"
STATE_FILE = "trainer_state.json"
# Fields a resumed run may change: how long it runs, where its files and Redis live, its ports.
RESUMABLE_FIELDS = (("run", "steps"), ("run", "output_dir"), ("run", "step_timeout_s"), ("run", "max_restarts"), ("redis", "url"),
                    ("trainer", "dump_credit"))  # diagnostics only: `--resume --dump-credit` is fine


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: another config, or unreadable files."""


@dataclass
class TrainerState:
    """What the trainer needs besides tensors to continue a run exactly.

    step: the next step to run; policy_version: the version the model holds;
    applied: "group_id@v<version>" of every group ever trained, in order;
    counts: trained / dropped_stale / dropped_duplicate groups (cumulative).
    """

    step: int = 0
    policy_version: int = 0
    method: str = ""
    config_hash: str = ""
    applied: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"trained": 0, "dropped_stale": 0, "dropped_duplicate": 0})


def hashed_config(cfg) -> dict:
    """The resolved config (a RunConfig) as JSON data, without RESUMABLE_FIELDS and any section's metrics_port."""
    data = cfg.model_dump(mode="json")
    for section, name in RESUMABLE_FIELDS:
        data[section].pop(name, None)
    for section in data.values():
        if isinstance(section, dict):
            section.pop("metrics_port", None)
    return data


def config_hash(hashed: dict) -> str:
    """sha256 (hex) of a `hashed_config(cfg)` serialized with sorted keys: equal for configs a run may resume under."""
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()


def find_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint of `run_dir`: `checkpoint/`, else `.checkpoint-old/` (a crash mid-swap), else None."""
    for name in (NAME, OLD):
        path = Path(run_dir) / name
        if (path / STATE_FILE).is_file():
            return path
    return None


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    run_config: dict, records: list[dict], tokenizer=None) -> Path:
    """Write the checkpoint of `state` (module docstring) atomically; returns `<run_dir>/checkpoint`.

    `run_config` is `hashed_config(cfg)`; `records` the metric records of
    the steps before `state.step`; `tokenizer` (optional) is saved with the
    model. Raises OSError on write failure (the previous checkpoint stays).
    """
    run_dir = Path(run_dir)
    tmp, final, old = run_dir / TMP, run_dir / NAME, run_dir / OLD
    shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed half-way
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    tensors, values = _optimizer_split(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    _write_json(tmp / "optimizer.json", values)
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    np_state = np.random.get_state()
    py_state = random.getstate()
    _write_json(tmp / "rng.json", {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    })
    write_records(tmp / "metrics.jsonl", records)
    _write_json(tmp / "run_config.json", run_config)
    _write_json(tmp / STATE_FILE, asdict(state))
    for p in tmp.iterdir():
        _fsync(p)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # left by a crash after the swap: `final` is newer
        final.rename(old)
    tmp.rename(final)
    _fsync(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_config: dict) -> TrainerState:
    """Restore model weights, optimizer state and RNG states from checkpoint dir `path`; returns its TrainerState.

    `run_config` is `hashed_config(cfg)` of the run resuming. Raises
    CheckpointError when the checkpoint was written under another config
    (naming the differing fields) or its model files do not fit `model`;
    nothing is restored then.
    """
    path = Path(path)
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    expected = config_hash(run_config)
    if state.config_hash != expected:
        saved = json.loads((path / "run_config.json").read_text()) if (path / "run_config.json").exists() else {}
        raise CheckpointError(
            f"{path} was written by another config (hash {state.config_hash[:12]} != {expected[:12]}; differing fields: "
            f"{', '.join(_diff(saved, run_config)) or 'unknown'}); only {', '.join('.'.join(f) for f in RESUMABLE_FIELDS)} "
            "and *.metrics_port may change on resume"
        )
    _load_model(model, sorted(path.glob("model*.safetensors")))
    tensors = load_file(str(path / "optimizer.safetensors"))
    values = json.loads((path / "optimizer.json").read_text())
    optimizer.load_state_dict(_optimizer_join(tensors, values))
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
    rng = json.loads((path / "rng.json").read_text())
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    return state


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted names of the leaves where two nested dicts differ."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


def _optimizer_split(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_join(tensors: dict[str, torch.Tensor], values: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(values["scalars"].items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = values["param_groups"]
    for g in groups:
        if isinstance(g.get("betas"), list):  # JSON has no tuples; AdamW unpacks either, keep its own type
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def _load_model(model: torch.nn.Module, files: list[Path]) -> None:
    """Copy the tensors of `files` into `model`; all checks run before any weight is touched.

    A parameter missing from the files is accepted only if it shares storage
    with one present (tied embedding / LM head, stored once by save_pretrained).
    """
    if not files:
        raise CheckpointError("checkpoint holds no model*.safetensors")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    try:
        load_state_strict(model, loaded, f"checkpoint model {files[0].parent}")
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint model does not fit: {e}") from e


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
