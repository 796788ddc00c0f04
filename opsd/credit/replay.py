"""Replaying credit vector files: `opsd credit check PATH...`.

A vector file (schema: refvectors/README.md in the project's shared folder, which is kept beside the
repository, outside it: ../shared or $OPSD_SHARED) holds one case:
`method`, `config`, `inputs`, `expected` (and, for AgentOPSD,
`expected_variants`). `check_file` runs the file's method with the file's
config on the file's inputs through the same functions the trainer calls,
then compares every `expected` field: floats within
`tol * max(1, |expected|)`, ints, bools, strings and index lists exactly,
`null` in a float field as +inf. A field the replay cannot compute is a
failure, never a skip.

Each method module provides `replay_case(case) -> {"expected": {...},
"expected_variants": {name: {...}}}` with JSON-typed values; a case whose
`expected` is `{"error": "ValueError", ...}` passes when the replay raises
that exception type.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from opsd.config import CreditSection, TrainerSection
from opsd.types import CreditBatch

DEFAULT_TOL = 1e-5
# README: AgentOPSD beliefs saturated at 1 - 1e-4 keep few float32 digits in
# their increments; the authors allow 5e-4 there.
SATURATED_AGENTOPSD_TOL = 5e-4
# Padded [micro-batch, tokens] values per loss-replay micro-batch (`replay_loss`): 4 MB a float32 tensor.
MAX_REPLAY_PADDED = 1 << 20

# refvector `method` -> (module, function).
_REPLAYERS: dict[str, tuple[str, str]] = {
    "alignopsd": ("opsd.credit.reference", "replay_case"),
    "agentopsd": ("opsd.credit.agentopsd", "replay_case"),
    "gc_opd": ("opsd.credit.gc_opd", "replay_case"),
    "uni_opd_lite": ("opsd.credit.opd_baselines", "replay_uni_opd"),
    "poweropd": ("opsd.credit.opd_baselines", "replay_power_opd"),
    "exopd(gopd)": ("opsd.credit.opd_baselines", "replay_ex_opd"),
    "fire_opd": ("opsd.credit.opd_baselines", "replay_fire_opd"),
}


def batch_from_inputs(inputs: Mapping[str, Any]) -> CreditBatch:
    """CreditBatch from the row-per-turn inputs of a run's dump (services/trainer/dump.py).

    Required: uid, traj_uid, turn_step, episode_rewards, response_mask,
    student_log_probs; optional: data_source, is_action_valid (default True),
    teacher_log_probs, corrected_teacher_log_probs, base_log_probs,
    teacher_entropys, student_entropys. Raises KeyError / ValueError on a
    missing or malformed field.
    """
    def arr(name: str) -> np.ndarray | None:
        return None if inputs.get(name) is None else np.asarray(inputs[name], dtype=np.float32)

    B = len(inputs["uid"])
    return CreditBatch(
        task_id=[str(x) for x in inputs["uid"]],
        rollout_id=[str(x) for x in inputs["traj_uid"]],
        turn_id=[int(x) for x in inputs["turn_step"]],
        data_source=[str(x) for x in inputs.get("data_source") or ["unknown"] * B],
        episode_reward=np.asarray(inputs["episode_rewards"], dtype=np.float32),
        is_action_valid=np.asarray(inputs.get("is_action_valid") or [True] * B, dtype=bool),
        loss_mask_ML=np.asarray(inputs["response_mask"], dtype=np.float32),
        student_logprobs_ML=np.asarray(inputs["student_log_probs"], dtype=np.float32),
        teacher_logprobs_ML=arr("teacher_log_probs"),
        corrected_logprobs_ML=arr("corrected_teacher_log_probs"),
        base_logprobs_ML=arr("base_log_probs"),
        teacher_entropy_ML=arr("teacher_entropys"),
        student_entropy_ML=arr("student_entropys"),
    )


def replay_product(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a run's dump: `config.opsd_credit` is a CreditSection, `method` a registered estimator.

    AlignOPSD dumps carry the README's AlignOPSD inputs and re-run selection,
    rectification and allocation with the product's settings
    (`opsd.credit.reference.run_product_case`); other methods run
    `compute_advantages` on `batch_from_inputs`.
    A dump with `inputs.loss` also replays the first PPO epoch's loss and KL (`replay_loss`).
    Returns {"expected": {"advantages": [B][L], ...}}.
    """
    from opsd.credit import compute_advantages

    cfg = CreditSection.model_validate(case["config"]["opsd_credit"])
    method = str(case["method"])
    loss = replay_loss(case["inputs"]["loss"], case["config"], cfg) if "loss" in case["inputs"] else {}
    if method == "alignopsd":
        from opsd.credit.reference import run_product_case

        out = run_product_case(case["inputs"], cfg)
        out["advantages"] = out["final_token_advantage"]
        return {"expected": out | loss}
    adv_ML, _ = compute_advantages(method, batch_from_inputs(case["inputs"]), cfg)
    return {"expected": {"advantages": np.asarray(adv_ML, dtype=np.float64).tolist()} | loss}


def replay_loss(loss: Mapping[str, Any], config: Mapping[str, Any], credit: CreditSection) -> dict[str, float]:
    """The first PPO epoch's loss and KL of a dump's `inputs.loss` (services/trainer/dump.py), recomputed with
    `opsd.credit.policy_loss` under `config.opsd_trainer` (and credit.sdar): at the first epoch pi = pi_old, so
    each loss token's ratio is 1 and the loss is the aggregation of -A w - entropy_coef H + kl_coef KL(pi_old, ref)
    (+ the SDAR term), w the importance weight of pi_old against the sampler.

    Returns {"loss": float, "kl": float (token-mean of the estimator, 0 without reference log-probs)}.
    Raises KeyError / ValueError for a malformed section (arrays of unequal lengths, a missing field).
    """
    import torch

    from opsd.credit.policy_loss import importance_weight, ppo_loss, sdar_loss

    tcfg = TrainerSection.model_validate({k: v for k, v in config["opsd_trainer"].items() if k != "norm_tokens"})
    seqs = list(loss["sequences"])
    lengths = [len(s["advantages"]) for s in seqs]
    tokens = float(sum(lengths))
    with_ref = all("ref_log_probs" in s for s in seqs)
    value, kl_sum = 0.0, 0.0
    for chunk in _micro_batches(lengths):
        T = max(lengths[i] for i in chunk)

        def pad(name: str) -> torch.Tensor:
            out = torch.zeros(len(chunk), T, dtype=torch.float32)
            for b, i in enumerate(chunk):
                v = np.asarray(seqs[i][name], dtype=np.float32)
                if v.shape != (lengths[i],):
                    raise ValueError(f"inputs.loss sequence {i}: {name} has {v.shape} values, advantages {lengths[i]}")
                out[b, : len(v)] = torch.from_numpy(v)
            return out

        mask = (torch.arange(T) < torch.tensor([lengths[i] for i in chunk]).unsqueeze(1)).float()
        old = pad("old_log_probs")
        weight = None
        if tcfg.truncated_is:
            weight = importance_weight(old, pad("sampler_log_probs"), mask, tcfg.tis_level, tcfg.tis_mode, tcfg.tis_cap,
                                       tcfg.tis_cap_low)
        part, metrics = ppo_loss(
            old, old, pad("advantages"), mask, tokens, tcfg.clip_ratio_low, tcfg.clip_ratio_high, tcfg.clip_ratio_c,
            entropy_BT=pad("entropy"), entropy_coef=tcfg.entropy_coef, is_weight_BT=weight,
            ref_logprobs_BT=pad("ref_log_probs") if with_ref else None, kl_coef=tcfg.kl_coef,
            kl_estimator=tcfg.kl_estimator, loss_agg=tcfg.loss_agg, total_sequences=len(seqs),
            norm_tokens=config["opsd_trainer"].get("norm_tokens"), importance_level=tcfg.importance_level,
        )
        value += float(part)
        kl_sum += metrics["ppo/kl_mean"] * float(mask.sum())
        if credit.sdar.coef > 0:
            aux, _ = sdar_loss(old, pad("teacher_log_probs"), mask, tokens, credit.sdar.coef, credit.sdar.beta)
            value += float(aux)
    return {"loss": value, "kl": kl_sum / tokens if with_ref and tokens else 0.0}


def _micro_batches(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in micro-batches of similar lengths, each padded to at most MAX_REPLAY_PADDED values (or
    one sequence): padding all to the longest would take sequences x longest floats, gigabytes for a file of a few
    MB holding thousands of one-token sequences and one long one."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= MAX_REPLAY_PADDED:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def replayer(method: str, config: Mapping[str, Any] | None = None) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The replay function for a vector file's `method` (a run's dump when `config` has
    `opsd_credit`); ValueError if none exists."""
    if config is not None and "opsd_credit" in config:
        return replay_product
    if method not in _REPLAYERS:
        raise ValueError(f"no replay for method {method!r}; known: {', '.join(sorted(_REPLAYERS))}")
    module, fn = _REPLAYERS[method]
    return getattr(importlib.import_module(module), fn)


@dataclass
class FieldResult:
    """One compared field of a vector file: the replay's value against the file's `expected` one.

    - `name`: the field, "field" or, for an AgentOPSD variant, "variant/field"; "error" when the file expects
      the replay to raise, "variant/" for a variant the replay did not compute;
    - `ok`: within tolerance (floats: `tol * max(1, |expected|)`, `tolerance_for`) or equal (ints, bools,
      strings, index lists);
    - `max_abs_error`: the largest absolute difference over the field's floats (inf for a NaN or a mismatched
      infinity); None for exact (non-float) fields and for fields not computed;
    - `detail`: the first mismatch (`advantages[3]: expected 0.5, got 0.51 (|err| 0.01)`), "not computed",
      or what the replay raised; "" for a field that matches.
    """

    name: str
    ok: bool
    max_abs_error: float | None
    detail: str = ""


@dataclass
class FileResult:
    """The result of replaying one vector file (`check_file`) or case (`check_case`).

    - `path`: the file (or the `path` given to `check_case`);
    - `method`: the file's `method` (the `run.method` replayed), "?" when the file could not be read;
    - `case`: the file's `case` name, "?" when the file could not be read;
    - `fields`: a `FieldResult` per compared field, variants included;
    - `error`: why the replay did not run or failed (an unreadable file, a bad schema, an unknown method, an
      exception), "" when it ran;
    - `ok` (property): no error, at least one field compared, and every field ok.
    """

    path: str
    method: str
    case: str
    fields: list[FieldResult] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        """No error, at least one field compared, and every field within tolerance."""
        return not self.error and bool(self.fields) and all(f.ok for f in self.fields)


def _compare(got: Any, exp: Any, tol: float, where: str) -> tuple[bool, float | None, str]:
    """(ok, max abs float error or None, first mismatch) of a computed value against an expected one."""
    if isinstance(exp, dict):
        if not isinstance(got, Mapping):
            return False, None, f"{where}: expected an object, got {type(got).__name__}"
        if not exp:  # an empty object would pass without comparing anything
            return False, None, f"{where}: empty expected object (nothing to compare)"
        ok, worst, msg = True, None, ""
        for k, v in exp.items():
            if k not in got:
                return False, worst, f"{where}.{k}: not computed"
            o, e, m = _compare(got[k], v, tol, f"{where}.{k}")
            worst = e if worst is None else (worst if e is None else max(worst, e))
            if not o and ok:
                ok, msg = False, m
        return ok, worst, msg
    if isinstance(exp, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(exp):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return False, None, f"{where}: expected length {len(exp)}, got {n}"
        ok, worst, msg = True, None, ""
        for i, (g, e) in enumerate(zip(got, exp)):
            o, err, m = _compare(g, e, tol, f"{where}[{i}]")
            worst = err if worst is None else (worst if err is None else max(worst, err))
            if not o and ok:
                ok, msg = False, m
        return ok, worst, msg
    if isinstance(exp, bool) or isinstance(exp, str):
        return got == exp, None, "" if got == exp else f"{where}: expected {exp!r}, got {got!r}"
    if exp is None:  # a float field's +inf (segmentation_threshold), or a genuine null
        ok = got is None or (isinstance(got, float) and math.isinf(got) and got > 0)
        return ok, None, "" if ok else f"{where}: expected null/+inf, got {got!r}"
    if isinstance(exp, int) and not isinstance(got, float):
        ok = isinstance(got, (int,)) and not isinstance(got, bool) and got == exp
        return ok, None, "" if ok else f"{where}: expected {exp}, got {got!r}"
    if isinstance(exp, (int, float)):
        if got is None or isinstance(got, (bool, str, list, dict)):
            return False, None, f"{where}: expected a number, got {got!r}"
        g, e = float(got), float(exp)
        if math.isnan(e) or math.isnan(g):  # no credit value may be NaN: never a match
            return False, math.inf, f"{where}: NaN (expected {e}, got {g})"
        if math.isinf(e) or math.isinf(g):
            ok = e == g
            return ok, 0.0 if ok else math.inf, "" if ok else f"{where}: expected {e}, got {g}"
        err = abs(g - e)
        ok = err <= tol * max(1.0, abs(e))
        return ok, err, "" if ok else f"{where}: expected {e!r}, got {g!r} (|err| {err:.3g})"
    return False, None, f"{where}: unsupported expected value {exp!r}"


def tolerance_for(case: Mapping[str, Any]) -> float:
    """1e-5, or 5e-4 for an AgentOPSD case whose prior B_0 saturates at 1 - 1e-4 (README exception)."""
    if case.get("method") == "agentopsd":
        v0 = case.get("expected", {}).get("v0_per_row")
        if isinstance(v0, list) and any(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 - 1e-4 - 1e-7 for v in v0
        ):
            return SATURATED_AGENTOPSD_TOL
    return DEFAULT_TOL


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return f"{type(exc).__name__}: {exc}"


def check_case(case: Mapping[str, Any], path: str = "<case>") -> FileResult:
    """Replay one parsed vector file and compare every expected field (see module docstring).

    Never raises: a malformed file, a replay error or a comparison it cannot
    make is this file's failure, and the caller goes on with the next file.
    """
    result = FileResult(path=path, method=str(case.get("method", "")), case=str(case.get("case", "")))
    try:
        with np.errstate(all="ignore"):  # a hostile file must not flood the report with warnings
            _check_into(case, result)
    except Exception as exc:  # noqa: BLE001 - reported per file, the run goes on
        result.error = result.error or _describe(exc)
    return result


def _check_into(case: Mapping[str, Any], result: FileResult) -> None:
    expected = case.get("expected")
    if not isinstance(expected, Mapping) or not expected:
        result.error = "file has no `expected` object"
        return
    for key in ("inputs", "config"):
        if not isinstance(case.get(key), Mapping):
            result.error = f"file has no `{key}` object"
            return
    variants = case.get("expected_variants") or {}
    if not isinstance(variants, Mapping) or not all(isinstance(v, Mapping) for v in variants.values()):
        result.error = "`expected_variants` must be an object of objects"
        return
    tol = tolerance_for(case)
    try:
        fn = replayer(result.method, case["config"])
    except ValueError as exc:
        result.error = str(exc)
        return
    if "error" in expected:  # the reference rejects these inputs
        want = str(expected["error"])
        try:
            fn(case)
        except Exception as exc:  # noqa: BLE001 - the expected type is compared by name
            # Only the exception type is compared: the authors' message text is not ours.
            ok = type(exc).__name__ == want
            result.fields.append(FieldResult("error", ok, None, f"raised {type(exc).__name__}: {exc}"))
        else:
            result.fields.append(FieldResult("error", False, None, f"expected {want}, the replay raised nothing"))
        return
    try:
        got = fn(case)
    except Exception as exc:  # noqa: BLE001 - reported per file, the run goes on
        result.error = _describe(exc)
        return
    got_variants = got.get("expected_variants") or {}
    sections = [("", expected, got.get("expected", {}))]
    for name, variant in variants.items():
        if name not in got_variants:
            result.fields.append(FieldResult(f"{name}/", False, None, "variant not computed"))
            continue
        sections.append((f"{name}/", variant, got_variants[name]))
    for prefix, exp_fields, got_fields in sections:
        compared = 0
        for name, exp in exp_fields.items():
            if prefix and name in ("config_override", "note"):
                continue  # descriptions of the variant, not outputs
            compared += 1
            if name not in got_fields:
                result.fields.append(FieldResult(prefix + name, False, None, "not computed"))
                continue
            ok, err, msg = _compare(got_fields[name], exp, tol, prefix + name)
            result.fields.append(FieldResult(prefix + name, ok, err, msg))
        if not compared:
            result.fields.append(FieldResult(prefix or "expected", False, None, "no expected field to compare"))


def check_file(path: str | Path) -> FileResult:
    """Load one JSON vector file and `check_case` it; an unreadable file (or not a regular
    file: a FIFO would block, a dangling link cannot be read) is a failed result."""
    p = Path(path)
    fail = lambda msg: FileResult(path=str(p), method="?", case="?", error=msg)  # noqa: E731
    if not p.is_file():
        return fail("not a regular file (dangling link, link loop, FIFO or folder)")
    try:
        case = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        return fail(f"cannot read: {type(exc).__name__}: {exc}")
    if not isinstance(case, Mapping):
        return fail("not a JSON object")
    return check_case(case, str(p))


def _natural(path: Path) -> list:
    """Sort key reading digit runs as numbers: case_3 before case_11, step_9 before step_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def vector_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every *.json under the given files/folders (recursively, in natural order), skipping none silently:
    a path that does not exist raises FileNotFoundError."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            # Every *.json entry, files or not: check_file reports what it cannot read.
            out.extend(sorted((q for q in p.rglob("*.json") if not q.is_dir()), key=_natural))
        elif p.exists() or p.is_symlink():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return out
