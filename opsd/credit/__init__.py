"""Advantage estimators, registered by name (spec: ../../shared/spec/credit-methods.md).

A config picks an estimator with a string (`run.method`); a new estimator is a
function decorated with `@register("name")` taking `(batch: CreditBatch,
cfg: CreditSection)` and returning `(advantages_ML float32, metrics)`.

`compute_advantages` is the only entry point the trainer needs: it validates
the batch, puts its rows in canonical order (task_id, rollout_id, turn_id),
runs the estimator there and returns the result in the caller's row order, so
no estimator can depend on the order rows arrived in.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np

from opsd.config import CreditSection
from opsd.types import CreditBatch

Estimator = Callable[[CreditBatch, CreditSection], "tuple[np.ndarray, dict[str, float]]"]
_REGISTRY: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator registering an estimator under `name`; ValueError if the name is taken."""

    def deco(fn: Estimator) -> Estimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"credit estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def registered() -> list[str]:
    """Sorted names of all registered estimators."""
    return sorted(_REGISTRY)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown credit method {name!r}; registered: {', '.join(registered())}") from None


def check_batch(batch: CreditBatch, uses_pairs: bool = True) -> None:
    """Validate a CreditBatch (the checks `compute_advantages` runs; replays of vector files run them too).

    Shapes ([M] per row, [M, L] tokens, [M, M] pairs), a 0/1 loss mask, finite
    rewards and finite log-probs/entropies on loss tokens (padding off the mask
    may hold anything); `uses_pairs` also scans similarity_MM. Raises ValueError.
    """
    M = batch.num_rows
    for nm in ("rollout_id", "turn_id", "data_source"):
        if len(getattr(batch, nm)) != M:
            raise ValueError(f"CreditBatch.{nm} has {len(getattr(batch, nm))} rows, task_id has {M}")
    for nm in ("episode_reward", "is_action_valid"):
        if np.shape(getattr(batch, nm)) != (M,):
            raise ValueError(f"CreditBatch.{nm} must have shape ({M},), got {np.shape(getattr(batch, nm))}")
    if not np.isfinite(np.asarray(batch.episode_reward, dtype=np.float64)).all():
        raise ValueError("CreditBatch.episode_reward contains NaN or inf")
    mask = np.asarray(batch.loss_mask_ML)
    if mask.ndim != 2 or mask.shape[0] != M:
        raise ValueError(f"CreditBatch.loss_mask_ML must be [{M}, L], got {mask.shape}")
    if np.count_nonzero(mask) != np.count_nonzero(mask == 1):  # 0/1 only, without np.isin's copies
        raise ValueError("CreditBatch.loss_mask_ML must be 0/1")
    for nm in ("student_logprobs_ML", "teacher_logprobs_ML", "corrected_logprobs_ML", "base_logprobs_ML",
               "teacher_entropy_ML", "student_entropy_ML"):
        arr = getattr(batch, nm)
        if arr is None:
            continue
        if np.shape(arr) != mask.shape:
            raise ValueError(f"CreditBatch.{nm} must have shape {mask.shape}, got {np.shape(arr)}")
        # Off-mask padding may hold anything (even -inf); only trained tokens must be finite.
        a = np.asarray(arr)
        if not np.isfinite(a).all() and not np.isfinite(a[mask.astype(bool)]).all():
            raise ValueError(f"CreditBatch.{nm} has NaN or inf on a loss token")
    for nm in ("similarity_MM", "eligible_MM"):
        arr = getattr(batch, nm)
        if arr is not None and np.shape(arr) != (M, M):
            raise ValueError(f"CreditBatch.{nm} must have shape ({M}, {M}), got {np.shape(arr)}")
    # [M, M] is the batch's largest array (164 MB at M = 6400): scan it only for a method that reads it.
    if uses_pairs and batch.similarity_MM is not None and not np.isfinite(np.asarray(batch.similarity_MM)).all():
        raise ValueError("CreditBatch.similarity_MM contains NaN or inf")


def permute_batch(batch: CreditBatch, perm: np.ndarray) -> CreditBatch:
    """A copy of `batch` with rows taken in order `perm` (int [M]); [M, M] fields permuted on both axes."""
    def rows(a):
        return None if a is None else np.asarray(a)[perm]

    def both(a):
        return None if a is None else np.asarray(a)[np.ix_(perm, perm)]

    return replace(
        batch,
        task_id=[batch.task_id[i] for i in perm],
        rollout_id=[batch.rollout_id[i] for i in perm],
        turn_id=[batch.turn_id[i] for i in perm],
        data_source=[batch.data_source[i] for i in perm],
        episode_reward=rows(batch.episode_reward),
        is_action_valid=rows(batch.is_action_valid),
        loss_mask_ML=rows(batch.loss_mask_ML),
        student_logprobs_ML=rows(batch.student_logprobs_ML),
        teacher_logprobs_ML=rows(batch.teacher_logprobs_ML),
        corrected_logprobs_ML=rows(batch.corrected_logprobs_ML),
        base_logprobs_ML=rows(batch.base_logprobs_ML),
        teacher_entropy_ML=rows(batch.teacher_entropy_ML),
        student_entropy_ML=rows(batch.student_entropy_ML),
        similarity_MM=both(batch.similarity_MM),
        eligible_MM=both(batch.eligible_MM),
    )


def compute_advantages(method: str, batch: CreditBatch, cfg: CreditSection) -> tuple[np.ndarray, dict[str, float]]:
    """Token advantages of every turn row with the estimator registered as `method`.

    Args:
      method: a registered name (`registered()`): grpo, opd, grpo_opd, agentopsd,
        alignopsd, gc_opd, uni_opd, power_opd, ex_opd, fire_opd (opsd, grpo_opsd: aliases).
      batch: a CreditBatch, rows in any order (M rows, L tokens).
      cfg: the run's CreditSection.
    Returns: (advantages_ML float32 [M, L], 0 wherever loss_mask_ML is 0,
      in the caller's row order; metrics: flat dict of finite floats).
    Raises: ValueError for an unknown method (listing the registered ones), a
      malformed batch (shapes, non-0/1 mask, NaN on a loss token, duplicate
      turns) or a field the method needs that is None.
    """
    estimator = get_estimator(method)
    check_batch(batch, uses_pairs=method.startswith("alignopsd"))
    from opsd.credit.grpo import canonical_permutation  # grpo imports `register` from here

    perm = canonical_permutation(batch.task_id, batch.rollout_id, batch.turn_id)
    if np.array_equal(perm, np.arange(len(perm))):  # trainer batches arrive canonical: skip the copies
        adv_canon_ML, metrics = estimator(batch, cfg)
        adv_ML = np.asarray(adv_canon_ML, dtype=np.float32)  # masked into a new array below
    else:
        adv_canon_ML, metrics = estimator(permute_batch(batch, perm), cfg)
        adv_ML = np.empty_like(adv_canon_ML, dtype=np.float32)
        adv_ML[perm] = adv_canon_ML
    mask_ML = np.asarray(batch.loss_mask_ML, dtype=np.float32)
    adv_ML = adv_ML * mask_ML  # the contract, whatever an estimator did off the mask
    if not np.isfinite(adv_ML).all():
        raise ValueError(f"credit method {method!r} produced a non-finite advantage")
    out = {k: float(v) for k, v in metrics.items()}
    # Metrics are diagnostics: an overflowing one (extreme inputs) is dropped and counted, never exported as inf/NaN.
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    for k in bad:
        del out[k]
    out["credit/nonfinite_metrics_dropped"] = float(len(bad))
    return adv_ML, out


# Importing the estimator modules registers them.
from opsd.credit import agentopsd, alignopsd, gc_opd, grpo, opd, opd_baselines  # noqa: E402,F401

__all__ = ["register", "registered", "get_estimator", "compute_advantages", "check_batch", "permute_batch"]
