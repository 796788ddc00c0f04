"""The trainer's resume point: `<run_dir>/checkpoint/`, written atomically, no pickle.

Contents:
  model*.safetensors, config.json, tokenizer files   a loadable HF model dir (save_pretrained)
  optimizer.safetensors    optimizer tensors, key "<param index>.<name>" (AdamW: exp_avg, exp_avg_sq, step)
  optimizer.json           param_groups and non-tensor state values
  rng.safetensors          torch CPU RNG state (uint8)
  rng.json                 python `random` and numpy global RNG states
  metrics.jsonl            the run's metric records of every step before `step`
  run_config.json          the hashed config (to name the fields that differ on a mismatch)
  ema.safetensors          teacher.version ema:D only: the policy's moving average (services/trainer/ema.py)
  trackers.json            run.report_to only: the tracker runs' ids and progress (opsd/tracking.py)
  trainer_state.json       TrainerState (below), written last

A save writes `.checkpoint-tmp/`, fsyncs it, then swaps: checkpoint ->
.checkpoint-old, .checkpoint-tmp -> checkpoint, delete the old one. A crash
at any point leaves a complete `checkpoint/` or a complete `.checkpoint-old/`,
which `find_checkpoint` falls back to. With trainer.keep_checkpoints K > 1
the previous `checkpoint/` becomes `checkpoint-<its step:05d>/` instead of
`.checkpoint-old/`, and only the newest K - 1 of those stay.

The trainer writes checkpoints off its step's path (`Checkpointer`): a
background thread, while the next step's groups are awaited.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from opsd.config import RESUMABLE_FIELDS, config_hash
from opsd.models.hf_weights import load_state_strict
from opsd.tracking import STATE_FILE as TRACKER_STATE_FILE
from opsd.tracking import read_state as read_tracker_state
from opsd.weights_io import all_finite
from services.trainer.ema import CHECKPOINT_FILE as EMA_CHECKPOINT_FILE
from services.trainer.report import write_records

log = logging.getLogger("trainer")
NAME, OLD, TMP = "checkpoint", ".checkpoint-old", ".checkpoint-tmp"
KEPT = re.compile(r"checkpoint-([0-9]{5,})")  # an older checkpoint kept by trainer.keep_checkpoints > 1
STATE_FILE = "trainer_state.json"
# Test hook (tests/test_faults.py): seconds a save sleeps after writing the model, so a kill lands mid-write.
WRITE_DELAY_ENV = "OPSD_CHECKPOINT_WRITE_DELAY_S"


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


def _complete_checkpoints(run_dir: Path, problems: list[str]):
    """Yield the checkpoints of `run_dir` that pass `_check_complete`, newest first: `checkpoint/`, then
    `.checkpoint-old/` (a crash mid-swap), then the kept `checkpoint-<step>/`; the problems of the others are
    appended to `problems`. A directory without trainer_state.json is no checkpoint."""
    for name in (NAME, OLD, *[p.name for p in reversed(kept_checkpoints(run_dir))]):
        path = Path(run_dir) / name
        if not (path / STATE_FILE).is_file():
            continue
        try:
            _check_complete(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        yield path


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of `run_dir`, else None (see `_complete_checkpoints`; headers only, values
    unread: `resume_checkpoint` also falls back past one whose tensors do not load).

    When a newer one fails and an older one passes, the older one is
    returned with a warning. Raises CheckpointError (naming each directory's
    problem) when checkpoints exist but none is usable: starting afresh
    would overwrite them.
    """
    problems: list[str] = []
    for path in _complete_checkpoints(run_dir, problems):
        if problems:
            # Groups acked after the newer checkpoint are not in this one: the operator should know.
            log.warning("checkpoint unusable (%s); falling back to the older %s", problems[0], path)
        return path
    if problems:
        raise CheckpointError(f"no usable checkpoint in {run_dir}: {'; '.join(problems)}")
    return None


def resume_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      run_config: dict) -> tuple[Path | None, TrainerState | None]:
    """Restore the newest checkpoint of `run_dir` that loads (`load_checkpoint`: every value checked) into `model`
    and `optimizer`; returns (its path, its TrainerState), or (None, None) when the run dir holds none.

    A newer one that fails (NaN in a tensor, another config, an unreadable file) is skipped for the next older one
    with a warning: the groups trained after the older one were never acked and are trained again. Raises
    CheckpointError naming every problem when checkpoints exist but none loads; the model is then unchanged.
    """
    problems: list[str] = []
    for path in _complete_checkpoints(run_dir, problems):
        try:
            state = load_checkpoint(path, model, optimizer, run_config)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            log.warning("checkpoint unusable (%s); resuming from the older %s", problems[0], path)
        return path, state
    if problems:
        raise CheckpointError(f"no usable checkpoint in {run_dir}: {'; '.join(problems)}")
    return None, None


def kept_checkpoints(run_dir: Path) -> list[Path]:
    """The older checkpoints `checkpoint-<step:05d>/` of `run_dir` (trainer.keep_checkpoints > 1), oldest first."""
    found = [(int(m[1]), p) for p in Path(run_dir).glob("checkpoint-*") if (m := KEPT.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def capture_rng() -> tuple[torch.Tensor, tuple, tuple]:
    """(torch CPU state, python `random` state, numpy global state): copies, what a checkpoint restores."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    run_config: dict, records: list[dict], tokenizer=None, ema=None, rng: tuple | None = None,
                    keep: int = 1) -> Path:
    """Write the checkpoint of `state` (module docstring) atomically; returns `<run_dir>/checkpoint`.

    `run_config` is `hashed_config(cfg)`; `records` the metric records of
    the steps before `state.step`; `tokenizer` (optional) is saved with the
    model; `ema` (optional, services/trainer/ema.PolicyEMA) as ema.safetensors;
    `rng` the `capture_rng()` of the step's end (default: the RNG states now);
    `keep` (trainer.keep_checkpoints, >= 1) complete checkpoints stay; the run's trackers.json (tracker run ids)
    is copied in. Raises
    OSError on write failure (the previous checkpoint stays).
    """
    run_dir = Path(run_dir)
    tmp, final, old = run_dir / TMP, run_dir / NAME, run_dir / OLD
    torch_rng, py_state, np_state = rng if rng is not None else capture_rng()
    shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed half-way
    model.save_pretrained(tmp, safe_serialization=True)
    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if ema is not None:
        ema.save(tmp / EMA_CHECKPOINT_FILE, state.policy_version)
    tensors, values = _optimizer_split(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    _write_json(tmp / "optimizer.json", values)
    save_file({"torch_cpu": torch_rng}, str(tmp / "rng.safetensors"))
    _write_json(tmp / "rng.json", {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    })
    write_records(tmp / "metrics.jsonl", records)
    trackers = read_tracker_state(run_dir)
    if trackers:  # the W&B and MLflow run ids (opsd/tracking.py): a resume continues those runs
        _write_json(tmp / TRACKER_STATE_FILE, trackers)
    _write_json(tmp / "run_config.json", run_config)
    _write_json(tmp / STATE_FILE, asdict(state))
    for p in tmp.iterdir():
        _fsync(p)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # left by a crash after the swap: `final` is newer
        final.rename(_aside(final, state.step, keep))
    tmp.rename(final)
    _fsync(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    # Kept ones from steps at or after this one were abandoned (a resume from an older checkpoint).
    older = [p for p in kept_checkpoints(run_dir) if int(KEPT.fullmatch(p.name)[1]) < state.step]
    for p in [p for p in kept_checkpoints(run_dir) if p not in older] + older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def _aside(final: Path, new_step: int, keep: int) -> Path:
    """Where the previous `checkpoint/` goes when a newer one replaces it: `checkpoint-<step>/` when it is kept
    (keep > 1 and its state readable, of an earlier step), else `.checkpoint-old/` (deleted after the swap)."""
    if keep > 1:
        try:
            step = _read_state(final).step
        except CheckpointError:
            step = new_step
        if step < new_step:
            return final.parent / f"{NAME}-{step:05d}"
    return final.parent / OLD


class Checkpointer:
    """Writes the trainer's checkpoints on a background thread, one at a time.

    `start` captures the cheap parts (TrainerState, records, RNG states) and
    writes the rest (weights, optimizer state, EMA) from the live objects:
    the caller must not change the model, optimizer or EMA until `wait`
    returns. `covered` is whatever the caller attaches to the write (the
    trainer: how many trained groups it covers), handed back by `wait`.
    """

    def __init__(self, run_dir: Path, run_config: dict, tokenizer=None, keep: int = 1, on_written=None):
        self.run_dir, self.run_config, self.tokenizer, self.keep = Path(run_dir), run_config, tokenizer, keep
        self.on_written = on_written  # called with the checkpoint's TrainerState.step once it is on disk (its thread)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._covered = None

    def start(self, model: torch.nn.Module, optimizer, state: TrainerState, records: list[dict], ema=None,
              covered=None) -> None:
        """Begin writing the checkpoint of `state` (see `save_checkpoint`); waits for a write in progress first.
        Raises what that earlier write raised (OSError)."""
        self.wait()
        state = replace(state, applied=list(state.applied), counts=dict(state.counts))
        args = (self.run_dir, model, optimizer, state, self.run_config, list(records), self.tokenizer, ema,
                capture_rng(), self.keep)
        self._covered, self._error = covered, None
        # Not a daemon: a trainer exiting on an error still finishes the write it began.
        self._thread = threading.Thread(target=self._write, args=args, name="checkpoint")
        self._thread.start()

    def _write(self, *args) -> None:
        try:
            t0 = time.perf_counter()
            save_checkpoint(*args)
            log.info("checkpoint of step %d written in %.1f s", args[3].step, time.perf_counter() - t0)
            if self.on_written is not None:
                self.on_written(args[3].step)
        except BaseException as e:  # handed to the main thread by `wait`
            self._error = e

    def done(self) -> bool:
        """No write in progress (none started, or the last one finished, well or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self):
        """Block until the write in progress (if any) is complete on disk; returns its `covered` (None when no
        write was pending). Raises the write's exception (OSError: that checkpoint does not exist)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        covered, self._covered = self._covered, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return covered


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_config: dict) -> TrainerState:
    """Restore model weights, optimizer state and RNG states from checkpoint dir `path`; returns its TrainerState.

    `run_config` is `hashed_config(cfg)` of the run resuming. Every file is
    read and checked before anything is restored: the trainer state (types,
    ranges, step == policy_version, `applied` / `counts` consistent), the
    config hash, model tensors (finite, the model's names, shapes and
    dtypes), optimizer state (finite, the parameters' shapes and dtypes, a
    step count) and RNG states. Raises CheckpointError naming the file and
    the problem (another config names the differing fields); the model,
    optimizer and RNGs are then unchanged.
    """
    path = Path(path)
    state = _read_state(path)
    expected = config_hash(run_config)
    if state.config_hash != expected:
        try:
            saved = _read_json(path / "run_config.json")
        except CheckpointError:
            saved = {}
        stripped = _resumable_since(saved, state.config_hash)
        if stripped == run_config:
            state.config_hash = expected  # its next checkpoint records this run's hash
        else:
            saved = saved if stripped is None else stripped
            raise CheckpointError(
                f"{path} was written by another config (hash {state.config_hash[:12]} != {expected[:12]}; differing "
                f"fields: {', '.join(_diff(saved, run_config) if isinstance(saved, dict) else []) or 'unknown'}); only "
                f"{', '.join('.'.join(f) for f in RESUMABLE_FIELDS)} and *.metrics_port may change on resume"
            )
    weights = _read_model(path, model)
    opt_state = _read_optimizer(path, optimizer)
    torch_rng, py_rng, np_rng = _read_rng(path)
    try:
        load_state_strict(model, weights, f"checkpoint model {path}")  # checks keys and shapes before touching a weight
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint model does not fit: {e}") from e
    try:
        optimizer.load_state_dict(opt_state)
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
    except Exception as e:  # every input was checked above: this is a bug, but say what state the trainer is in
        raise CheckpointError(f"{path}: restoring optimizer/RNG failed after the model weights were loaded: {e!r}") from e
    return state


def _resumable_since(saved, recorded_hash: str):
    """A checkpoint's run_config.json without the fields made resumable after it was written (e.g.
    trainer.checkpoint_every, hashed before the trainer wrote checkpoints in the background), if it is the config
    of `recorded_hash`; else None. Such a checkpoint resumes when the rest equals the resuming run's config."""
    if not isinstance(saved, dict) or config_hash(saved) != recorded_hash:
        return None
    saved = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for section, name in RESUMABLE_FIELDS:
        if isinstance(saved.get(section), dict):
            saved[section].pop(name, None)
    return saved


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


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path}: unreadable JSON: {e}") from e


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError besides OSError
        raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from e


def _is_int(x, lo: int = 0, hi: float = float("inf")) -> bool:
    return type(x) is int and lo <= x <= hi  # not bool, not a string of digits


OPTIMIZER_DROPPED = "optimizer.dropped"  # marker: a finished run dropped its optimizer state (drop_optimizer_state)


def drop_optimizer_state(path: Path) -> int:
    """Delete the optimizer state of the finished run's checkpoint dir `path` (trainer.keep_optimizer_state
    false) and leave a marker saying so; returns the bytes freed. The model, tokenizer and trainer state stay
    (a loadable HF directory). Such a checkpoint is refused on resume (`load_checkpoint`). Raises OSError."""
    path = Path(path)
    freed = 0
    (path / OPTIMIZER_DROPPED).write_text("trainer.keep_optimizer_state was false: the optimizer state was deleted "
                                          "when the run finished; this checkpoint cannot be resumed\n")
    for name in ("optimizer.safetensors", "optimizer.json"):
        f = path / name
        if f.is_file():
            freed += f.stat().st_size
            f.unlink()
    return freed


def _check_complete(path: Path) -> None:
    """The checks that need no model: state file valid, every file present, tensor headers and RNG states readable."""
    _read_state(path)
    if (path / OPTIMIZER_DROPPED).exists():
        raise CheckpointError(f"{path}: the run finished with trainer.keep_optimizer_state false, so its optimizer "
                              f"state was deleted and it cannot be resumed; train on from it in a new run with "
                              f"model.name: {path}")
    for name in ("optimizer.json", "metrics.jsonl"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
    _read_json(path / "optimizer.json")
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: holds no model*.safetensors")
    ema = [path / EMA_CHECKPOINT_FILE] if (path / EMA_CHECKPOINT_FILE).exists() else []
    for f in files + [path / "optimizer.safetensors"] + ema:
        try:
            with safe_open(str(f), framework="pt"):  # reads the header only; a truncated file fails here
                pass
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from e
    _read_rng(path)


def _read_state(path: Path) -> TrainerState:
    """trainer_state.json, checked: see TrainerState for the meaning of the fields."""
    f = path / STATE_FILE
    raw = _read_json(f)
    names = {x.name for x in fields(TrainerState)}
    if not isinstance(raw, dict) or set(raw) != names:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{f}: expected an object with keys {sorted(names)}, got {got}")

    def bad(what: str):
        return CheckpointError(f"{f}: {what}")

    step, version = raw["step"], raw["policy_version"]
    if not _is_int(step) or not _is_int(version):
        raise bad(f"step and policy_version must be non-negative integers, got {step!r} and {version!r}")
    if version != step:  # the trainer publishes one version per step, from 0 (services/trainer/__main__.py)
        raise bad(f"policy_version {version} != step {step}")
    if not isinstance(raw["method"], str) or not isinstance(raw["config_hash"], str):
        raise bad("method and config_hash must be strings")
    applied = raw["applied"]
    if not isinstance(applied, list):
        raise bad(f"applied must be a list, got {type(applied).__name__}")
    ids = set()
    for key in applied:
        m = re.fullmatch(r"(.+)@v([0-9]+)", key) if isinstance(key, str) else None
        if m is None or int(m[2]) > version:
            raise bad(f"applied entry {key!r} is not '<group id>@v<version <= {version}>'")
        if m[1] in ids:
            raise bad(f"group {m[1]} appears twice in applied")
        ids.add(m[1])
    counts = raw["counts"]
    required = {"trained", "dropped_stale", "dropped_duplicate"}
    if not isinstance(counts, dict) or not required <= set(counts) or not all(_is_int(v) for v in counts.values()):
        raise bad(f"counts must map {sorted(required)} (and any other reason) to non-negative integers, got {counts!r}")
    if counts["trained"] != len(applied):  # the collector appends to applied exactly what it counts as trained
        raise bad(f"counts.trained {counts['trained']} != {len(applied)} applied groups")
    return TrainerState(**raw)


def _check_finite(f: Path, name: str, t: torch.Tensor) -> None:
    if not all_finite(t):
        raise CheckpointError(f"{f}: tensor {name} holds NaN or inf")


def _read_model(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All model*.safetensors tensors, checked: finite, and the names, ties, shapes and dtypes of `model`."""
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: holds no model*.safetensors")
    own = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _read_tensors(f).items():
            if name in loaded:
                raise CheckpointError(f"{f}: tensor {name} is also in another model file")
            if name in own and t.dtype != own[name].dtype:  # load_state_dict would cast silently
                raise CheckpointError(f"{f}: tensor {name} is {t.dtype}, the model holds {own[name].dtype}")
            _check_finite(f, name, t)
            loaded[name] = t

    class DryRun:  # load_state_strict's key, tie and shape checks without its final copy into the model
        state_dict = model.state_dict

        def load_state_dict(self, *args, **kwargs):
            pass

    try:
        load_state_strict(DryRun(), loaded, f"checkpoint model {path}")
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint model does not fit: {e}") from e
    return loaded


def _read_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state dict of optimizer.safetensors + optimizer.json, checked against `optimizer`'s parameters."""
    ft, fj = path / "optimizer.safetensors", path / "optimizer.json"
    tensors = _read_tensors(ft)
    values = _read_json(fj)
    if not isinstance(values, dict) or set(values) != {"param_groups", "scalars"} or not isinstance(values["scalars"], dict):
        raise CheckpointError(f"{fj}: expected an object with param_groups and a scalars object")
    live = optimizer.state_dict()["param_groups"]
    groups = values["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live):
        raise CheckpointError(f"{fj}: param_groups must be a list of {len(live)} groups")
    for g, ref in zip(groups, live):
        if not isinstance(g, dict) or set(g) != set(ref) or g["params"] != ref["params"]:
            raise CheckpointError(f"{fj}: a param group does not match the optimizer's (keys {sorted(ref)}, params {ref['params']})")
        for k, v in g.items():
            if isinstance(v, float) and not math.isfinite(v) or k == "betas" and not (
                    isinstance(v, list) and len(v) == 2 and all(isinstance(b, (int, float)) and math.isfinite(b) for b in v)):
                raise CheckpointError(f"{fj}: param group value {k}={v!r} is not finite")
        if isinstance(g.get("betas"), list):  # JSON has no tuples; AdamW unpacks either, keep its own type
            g["betas"] = tuple(g["betas"])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    for f, items in ((ft, tensors), (fj, values["scalars"])):
        for key, value in items.items():
            idx, _, name = key.partition(".")
            if not re.fullmatch("[0-9]+", idx) or int(idx) >= len(params) or not name or int(idx) in state and name in state[int(idx)]:
                raise CheckpointError(f"{f}: key {key!r} is not '<param index below {len(params)}>.<name>', or repeats")
            if not torch.is_tensor(value) and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise CheckpointError(f"{f}: {key} = {value!r} is not a finite number")
            state.setdefault(int(idx), {})[name] = value
    adam = isinstance(optimizer, torch.optim.Adam)  # AdamW subclasses it
    for idx, entry in state.items():
        p, group = params[idx], next(g for g in groups if idx in g["params"])
        if adam:
            want = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
            if set(entry) != want:
                raise CheckpointError(f"{path}: state of parameter {idx} holds {sorted(entry)}, AdamW needs {sorted(want)}")
        step = entry.get("step")
        step = float(step) if torch.is_tensor(step) and step.numel() == 1 else step
        if not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0 or step != int(step):
            raise CheckpointError(f"{path}: parameter {idx} has no valid step count (got {entry.get('step')!r})")
        for name, t in entry.items():
            if not torch.is_tensor(t) or name == "step":
                continue
            if t.shape != p.shape or t.dtype != p.dtype:
                raise CheckpointError(f"{ft}: {idx}.{name} is {t.dtype}{list(t.shape)}, parameter {idx} is {p.dtype}{list(p.shape)}")
            _check_finite(ft, f"{idx}.{name}", t)
    return {"state": state, "param_groups": groups}


def _read_rng(path: Path) -> tuple[torch.Tensor, tuple, tuple]:
    """(torch CPU state, python `random` state, numpy state), each checked by setting it on a scratch generator."""
    ft, fj = path / "rng.safetensors", path / "rng.json"
    t = _read_tensors(ft)
    cpu = t.get("torch_cpu")
    ref = torch.get_rng_state()
    if set(t) != {"torch_cpu"} or cpu.dtype != ref.dtype or cpu.shape != ref.shape:
        raise CheckpointError(f"{ft}: expected one tensor torch_cpu, {ref.dtype}{list(ref.shape)}")
    rng = _read_json(fj)
    try:
        torch.Generator().set_state(cpu)
        version, internal, gauss = rng["python"]
        ok = len(internal) == 625 and all(_is_int(x, 0, 2**32 - 1) for x in internal[:-1])
        if not ok or not (gauss is None or isinstance(gauss, float)):
            raise ValueError("python state is not 624 uint32 words, an index and a gauss value")
        py = (version, tuple(internal), gauss)
        random.Random().setstate(py)
        name, keys, pos, has_gauss, cached = rng["numpy"]
        if not (len(keys) == 624 and all(_is_int(x, 0, 2**32 - 1) for x in keys) and _is_int(pos, 0, 624)
                and _is_int(has_gauss, 0, 1) and isinstance(cached, float) and math.isfinite(cached)):
            raise ValueError("numpy state is not 624 uint32 words, a position, a gauss flag and value")
        np_state = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(np_state)
    except Exception as e:  # wrong types surface as TypeError/ValueError/KeyError/RuntimeError: all mean "corrupt"
        raise CheckpointError(f"{ft.parent}: unusable RNG state: {e!r}") from e
    return cpu, py, np_state


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
