"""Reading a run directory for `opsd inspect`: credit dumps, metrics, the tokenizer.

Pure functions over files inside RUN_DIR; the web layer (app.py) only calls
these. A dump is `<run_dir>/credit/step_NNNNN.json` as written by
`opsd run --dump-credit` (services/trainer/dump.py; read here as JSON, opsd/
never imports services/): `method`, `config.opsd_credit`, `inputs` (the
AlignOPSD schema for `alignopsd`, row-per-turn arrays for every other method),
`expected.advantages` [M][L] and, in newer dumps, `display` (per row:
observation, thinking, action, text, token ids).

Every problem with the input is an `InspectError` carrying an HTTP status:
404 (no such step, group or trajectory, or a path in a symlink loop), 403 (a path
that resolves outside RUN_DIR), 413 (a dump too large to open), 422 (a partial or malformed dump, a
bad compare request). Nothing outside RUN_DIR is ever opened: each path is
resolved (symlinks followed) and must stay under the resolved RUN_DIR.
"""

from __future__ import annotations

import gc
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson  # a 16x8x50 step opened in 0.72 s, 1.89 s with json (BENCHMARKS.md section 8)

STEP_FILE = re.compile(r"^step_(\d{1,9})\.json$")
# Parsing a dump peaks at ~9x its size in RSS (orjson's document plus one Python float per value, until
# parse_step has made them float32 arrays) and holds ~2x once parsed (benchmarks/inspect_page.py --memory,
# BENCHMARKS.md section 8). 256 MiB: a ~2.5 GiB peak, where 1 GiB allowed ~10 GiB.
MAX_DUMP_BYTES = 256 << 20
_CACHE_BYTES = 256 << 20  # parsed dumps kept, by their files' sizes (the newest always): ~2x that in RSS


class InspectError(Exception):
    """A request the run directory cannot answer; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


def inside(run_dir: Path, rel: str) -> Path:
    """`run_dir / rel` resolved (symlinks followed); InspectError 403 when it leaves the resolved run_dir, 404 when
    it cannot be resolved (a symlink loop)."""
    try:
        root = Path(run_dir).resolve()
        path = (root / rel).resolve()
    except (OSError, RuntimeError):  # RuntimeError: Python < 3.13's "Symlink loop"
        raise InspectError(404, f"{rel} cannot be resolved (a symlink loop?)") from None
    if not path.is_relative_to(root):
        raise InspectError(403, f"{rel} resolves outside the run directory")
    return path


def step_path(run_dir: Path, step: int) -> Path:
    """The dump file of `step` (resolved, inside run_dir). InspectError 404 when the step has no dump."""
    if not 0 <= step < 10**9:
        raise InspectError(404, f"no step {step}")
    path = inside(run_dir, f"credit/step_{step:05d}.json")
    if not path.is_file():
        raise InspectError(404, f"step {step} has no credit dump (credit/step_{step:05d}.json); "
                                f"dumps are written by `opsd run --dump-credit`")
    return path


def list_steps(run_dir: Path) -> list[dict[str, Any]]:
    """Steps with a dump, ascending: [{"step", "bytes"}]; files resolving outside run_dir are left out."""
    try:
        folder = inside(run_dir, "credit")
    except InspectError:
        return []
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_FILE.match(p.name)
        if not m:
            continue  # step_00003.json.tmp: a dump being written
        try:
            real = inside(run_dir, f"credit/{p.name}")
        except InspectError:
            continue
        if real.is_file():
            out.append({"step": int(m.group(1)), "bytes": real.stat().st_size})
    return sorted(out, key=lambda d: d["step"])


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl's complete lines as dicts, and the count of lines that were not JSON objects.

    A half-written last line (the run is still writing) is left out, as `opsd run` does.
    """
    try:
        path = inside(run_dir, "metrics.jsonl")
    except InspectError:
        return [], 0
    if not path.is_file():
        return [], 0
    text = path.read_text(errors="replace")
    records, bad = [], 0
    for line in text[: text.rfind("\n") + 1].splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def plain_text(s: str) -> str:
    """`s` as valid UTF-8: a lone surrogate (JSON's "\\ud800", a file name's undecodable byte) becomes U+FFFD.
    A response holding one cannot be encoded: a 500 instead of the page."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _finite(v: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, +-Infinity, an int past float range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def metric_series(records: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """{key: [[step, value], ...]} for every numeric key (bools and non-finite values left out; a record whose
    step is not a finite number is left out)."""
    series: dict[str, list[list[float]]] = {}
    for i, rec in enumerate(records):
        step = _finite(rec.get("step", i))
        if step is None:
            continue
        for k, v in rec.items():
            if k != "step" and (f := _finite(v)) is not None:
                series.setdefault(plain_text(k), []).append([step, f])
    return series


# ----------------------------------------------------------------------------- one step's dump


@dataclass
class Step:
    """One parsed dump. Arrays float32 [M, L] (rows = turns, canonical order; L = longest response).

    teacher_ML / corrected_ML are None when the dump has none (grpo; corrected for alignopsd, whose
    rectification is recomputed by the replay). `display` is None for dumps older than that field.
    `groups`: task id -> rollout id -> row indices in turn order.
    """

    step: int
    method: str
    case: dict[str, Any]
    task: list[str]
    rollout: list[str]
    turn: list[int]
    reward: np.ndarray
    valid: np.ndarray
    mask_ML: np.ndarray
    adv_ML: np.ndarray
    student_ML: np.ndarray
    teacher_ML: np.ndarray | None
    corrected_ML: np.ndarray | None
    display: list[dict[str, Any]] | None
    groups: dict[str, dict[str, list[int]]]
    extras: dict[str, Any] | None = None  # method_extras(), computed on first use
    compares: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _matrix(value: Any, name: str, M: int, L: int | None) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InspectError(422, f"malformed dump: {name} is not a numeric [M][L] array ({exc})") from None
    if a.ndim != 2 or a.shape[0] != M or (L is not None and a.shape[1] != L):
        raise InspectError(422, f"malformed dump: {name} has shape {list(a.shape)}, expected [{M}][{L or 'L'}]")
    if not np.isfinite(a).all():
        raise InspectError(422, f"malformed dump: {name} holds NaN or infinite values")
    return a


def parse_step(case: Any, step: int) -> Step:
    """A Step from a dump's parsed JSON. InspectError 422 naming the first missing or malformed field."""
    if not isinstance(case, dict):
        raise InspectError(422, "malformed dump: not a JSON object")
    for key in ("method", "inputs", "expected"):
        if key not in case:
            raise InspectError(422, f"partial dump: no `{key}`")
    inputs, method = case["inputs"], str(case["method"])
    if not isinstance(inputs, dict) or not isinstance(case["expected"], dict):
        raise InspectError(422, "malformed dump: `inputs` and `expected` must be objects")
    try:
        if method == "alignopsd" or "turns" in inputs:
            turns = inputs["turns"]
            task = [str(t["task_id"]) for t in turns]
            rollout = [str(t["rollout_id"]) for t in turns]
            turn = [int(t["turn_id"]) for t in turns]
            reward = [float(t["episode_reward"]) for t in turns]
            valid = [bool(t.get("is_action_valid", True)) for t in turns]
            mask_key, teacher_key, corrected_key = "policy_loss_mask", "diagonal_teacher_log_probs", None
        else:
            task = [str(x) for x in inputs["uid"]]
            rollout = [str(x) for x in inputs["traj_uid"]]
            turn = [int(x) for x in inputs["turn_step"]]
            reward = [float(x) for x in inputs["episode_rewards"]]
            valid = [bool(x) for x in inputs.get("is_action_valid") or [True] * len(task)]
            mask_key, teacher_key, corrected_key = "response_mask", "teacher_log_probs", "corrected_teacher_log_probs"
    except KeyError as exc:
        raise InspectError(422, f"partial dump: inputs has no {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise InspectError(422, f"malformed dump: inputs rows ({type(exc).__name__}: {exc})") from None
    M = len(task)
    if not (len(rollout) == len(turn) == len(reward) == len(valid) == M):
        raise InspectError(422, "malformed dump: the row fields have different lengths")
    if M == 0:
        raise InspectError(422, "malformed dump: no rows")
    if not all(math.isfinite(r) for r in reward):
        raise InspectError(422, "malformed dump: an episode reward is NaN or infinite")
    if mask_key not in inputs or "student_log_probs" not in inputs:
        raise InspectError(422, f"partial dump: inputs has no `{mask_key}` or `student_log_probs`")
    mask = _matrix(inputs[mask_key], mask_key, M, None)
    L = mask.shape[1]
    adv = case["expected"].get("advantages")
    if adv is None:
        raise InspectError(422, "partial dump: expected has no `advantages`")
    opt = lambda k: None if k is None or inputs.get(k) is None else _matrix(inputs[k], k, M, L)  # noqa: E731
    display = case.get("display")
    if display is not None and not (isinstance(display, list) and len(display) == M
                                    and all(isinstance(d, dict) for d in display)):
        display = None  # an unreadable display section costs the texts, not the page
    groups: dict[str, dict[str, list[int]]] = {}
    for m in sorted(range(M), key=lambda m: (task[m], rollout[m], turn[m])):
        groups.setdefault(task[m], {}).setdefault(rollout[m], []).append(m)
    student, teacher, corrected = _matrix(inputs["student_log_probs"], "student_log_probs", M, L), opt(teacher_key), opt(corrected_key)
    if corrected_key is not None:
        # The replay (batch_from_inputs) reads these as float32 arrays: hand it the ones parsed here
        # instead of converting the nested lists a second time (a third of a big step's open time).
        for k, a in ((mask_key, mask), ("student_log_probs", student), (teacher_key, teacher), (corrected_key, corrected)):
            if a is not None:
                inputs[k] = a
        # The other [M][L] fields too, when they convert: as nested lists a cached big step holds ~8x the memory.
        for k in ("base_log_probs", "teacher_entropys", "student_entropys"):
            try:
                a = np.asarray(inputs[k], dtype=np.float32) if isinstance(inputs.get(k), list) else None
            except (TypeError, ValueError):
                a = None  # left as read: the replay reports it
            if a is not None and a.shape == (M, L):
                inputs[k] = a
    adv_ML = _matrix(adv, "expected.advantages", M, L)
    case["expected"] = {**case["expected"], "advantages": adv_ML}  # read from here on, never as lists
    return Step(step=step, method=method, case=case, task=task, rollout=rollout, turn=turn,
                reward=np.asarray(reward, np.float32), valid=np.asarray(valid, bool), mask_ML=mask,
                adv_ML=adv_ML, student_ML=student,
                teacher_ML=teacher, corrected_ML=corrected, display=display, groups=groups)


def _loads(raw: bytes) -> Any:
    """orjson.loads with the cyclic garbage collector paused (ValueError on bad JSON, as orjson).

    A big dump parses into ~40k lists of floats and no cycle; the collections its allocations would
    trigger only walk those lists: about a quarter of the parse of a 16x8x50-turn step at 256 tokens.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(raw)
    finally:
        if was_enabled:
            gc.enable()


_cache: OrderedDict[tuple, tuple[Step, int]] = OrderedDict()  # key -> (step, dump bytes)
_cache_lock = threading.Lock()
# One parse at a time: N requests for an uncached step parse it once (the others wait, then find it
# cached), and two big dumps never peak together. Parallel parses would gain nothing: orjson and the
# list-to-array conversions hold the GIL.
_parse_lock = threading.Lock()


def _cached(key: tuple) -> Step | None:
    with _cache_lock:
        if key not in _cache:
            return None
        _cache.move_to_end(key)
        return _cache[key][0]


def load_step(run_dir: Path, step: int, max_bytes: int = MAX_DUMP_BYTES) -> Step:
    """The parsed dump of `step`, cached by (path, size, mtime) so a rewritten file is read again.

    Concurrent calls for a step not yet cached parse it once (the others wait and get the same Step).
    InspectError 404 (no dump), 413 (over `max_bytes`, `opsd inspect --max-dump-mib`), 422 (truncated: the run is still
    writing it; not JSON; partial or malformed).
    """
    path = step_path(run_dir, step)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if (hit := _cached(key)) is not None:
        return hit
    if st.st_size > max_bytes:
        raise InspectError(413, f"step {step}'s dump is {st.st_size} bytes, over the {max_bytes >> 20} MiB this page "
                                f"opens (parsing takes ~9x the file's size in memory): restart opsd inspect with "
                                f"--max-dump-mib {-(-st.st_size >> 20)} or more where the memory allows")
    with _parse_lock:
        if (hit := _cached(key)) is not None:
            return hit  # parsed by the request this one waited for
        try:
            case = _loads(path.read_bytes())  # the bytes are freed as soon as they are parsed
        except (ValueError, RecursionError) as exc:
            raise InspectError(422, f"step {step}'s dump is not complete JSON (a run still writing it, a damaged "
                                    f"file, or a NaN): {str(exc)[:200]}") from None
        data = parse_step(case, step)
        with _cache_lock:
            _cache[key] = (data, st.st_size)
            while len(_cache) > 1 and sum(size for _, size in _cache.values()) > _CACHE_BYTES:
                _cache.popitem(last=False)
    return data


def row_means(values_ML: np.ndarray, mask_ML: np.ndarray) -> np.ndarray:
    """Mean of each row over its loss tokens, float64 [M]; 0 for a row without any."""
    n = mask_ML.sum(axis=1)
    return np.where(n > 0, (values_ML * mask_ML).sum(axis=1) / np.maximum(n, 1), 0.0)
