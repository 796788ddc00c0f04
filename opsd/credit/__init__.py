"""Advantage estimators, registered by name.

They implement the project's credit specification, `spec/credit-methods.md` in the project's shared folder,
which is kept beside the repository, outside it (`../shared` on the project's machines and in CI, or the
folder `OPSD_SHARED` names), so a clone does not have it. The equations it specifies are on the docs page
Credit methods (docs/concepts/credit.md) and in the docstring of each estimator, with the spec's sections (§).

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

import numpy as np

from opsd.config import CreditSection
from opsd.credit.batch import check_batch, permute_batch
from opsd.credit.grpo import canonical_permutation
from opsd.credit.registry import get_estimator, register, registered
from opsd.types import CreditBatch


def compute_advantages(method: str, batch: CreditBatch, cfg: CreditSection,
                       distributions: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Token advantages of every turn row with the estimator registered as `method`.

    Args:
      method: a registered name (`registered()`): grpo, opd, grpo_opd, agentopsd,
        alignopsd, gc_opd, uni_opd, power_opd, ex_opd, fire_opd (opsd, grpo_opsd: aliases).
      batch: a CreditBatch, rows in any order (M rows, L tokens).
      cfg: the run's CreditSection.
      distributions: when given, receives the per-item arrays an estimator reports beside its metrics
        (AlignOPSD: "alignopsd/span_turns", int64 [spans], turns per span), for the trackers' histograms.
    Returns: (advantages_ML float32 [M, L], 0 wherever loss_mask_ML is 0,
      in the caller's row order; metrics: flat dict of finite floats).
    Raises: ValueError for an unknown method (listing the registered ones), a
      malformed batch (shapes, non-0/1 mask, NaN on a loss token, duplicate
      turns) or a field the method needs that is None.
    """
    estimator = get_estimator(method)
    check_batch(batch, uses_pairs=method.startswith("alignopsd"))
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
    arrays = {k: np.asarray(v) for k, v in metrics.items() if isinstance(v, np.ndarray)}
    if distributions is not None:
        distributions.update(arrays)
    out = {k: float(v) for k, v in metrics.items() if k not in arrays}
    # Metrics are diagnostics: an overflowing one (extreme inputs) is dropped and counted, never exported as inf/NaN.
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    for k in bad:
        del out[k]
    out["credit/nonfinite_metrics_dropped"] = float(len(bad))
    return adv_ML, out


# Importing the estimator modules registers them.
from opsd.credit import agentopsd, alignopsd, gc_opd, grpo, opd, opd_baselines  # noqa: E402,F401

__all__ = ["register", "registered", "get_estimator", "compute_advantages", "check_batch", "permute_batch"]
