"""A CreditBatch's rows: validation, reordering, and its pairwise arrays kept per task.

Every pair an estimator reads (eligibility, thinking similarity) lies inside
one task (spec §4.1: sources and targets of one task only), so a batch keeps
them as one [m, m] block per task (`CreditBatch.similarity_blocks`,
`eligible_blocks`) rather than one [M, M] array over all turns of a step:
memory grows with the turns of one task (m = G x turns), not with the step
(M = tasks x G x turns; 13 GB dense at 128 tasks x 8 x 50 turns).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from opsd.types import CreditBatch


def task_rows(task_id: Sequence[str]) -> dict[str, np.ndarray]:
    """Row indices (int64, ascending) of each task, tasks in order of first appearance: the rows a task's
    pair block is indexed by (its block's row/column r is the task's r-th row in batch order)."""
    rows: dict[str, list[int]] = {}
    for m, t in enumerate(task_id):
        rows.setdefault(str(t), []).append(m)
    return {t: np.asarray(r, dtype=np.int64) for t, r in rows.items()}


def pair_blocks(X_MM: np.ndarray, task_id: Sequence[str], name: str = "pairs") -> dict[str, np.ndarray]:
    """Split a dense [M, M] pairwise array into per-task blocks (copies), keyed by task id.

    For inputs that come dense (the authors' reference files, small tests).
    Raises: ValueError if X_MM is not [M, M] or is non-zero between rows of two different tasks.
    """
    X = np.asarray(X_MM)
    M = len(task_id)
    if X.shape != (M, M):
        raise ValueError(f"{name} must be ({M}, {M}), got {X.shape}")
    rows = task_rows(task_id)
    blocks = {t: X[np.ix_(r, r)].copy() for t, r in rows.items()}
    inside = sum(int(np.count_nonzero(b)) for b in blocks.values())
    if inside != int(np.count_nonzero(X)):
        raise ValueError(f"{name} pairs rows of different tasks (spec §4.1: same task only)")
    return blocks


def dense_pairs(blocks: dict[str, np.ndarray], task_id: Sequence[str]) -> np.ndarray:
    """The dense [M, M] array of per-task blocks, zero across tasks (the inverse of `pair_blocks`; for
    reports and tests of small batches: O(M^2) memory). Raises ValueError on a missing or misshapen block."""
    M = len(task_id)
    rows = task_rows(task_id)
    _check_blocks(blocks, rows, "blocks")
    dtype = next(iter(blocks.values())).dtype if blocks else np.float32
    out = np.zeros((M, M), dtype=dtype)
    for t, r in rows.items():
        out[np.ix_(r, r)] = blocks[t]
    return out


def _check_blocks(blocks: dict[str, np.ndarray], rows: dict[str, np.ndarray], name: str) -> None:
    if set(blocks) != set(rows):
        missing, extra = sorted(set(rows) - set(blocks)), sorted(set(blocks) - set(rows))
        raise ValueError(f"CreditBatch.{name} must have one block per task: missing {missing[:3]}, extra {extra[:3]}")
    for t, r in rows.items():
        if np.shape(blocks[t]) != (len(r), len(r)):
            raise ValueError(f"CreditBatch.{name}[{t!r}] must be ({len(r)}, {len(r)}) (the task's rows), "
                             f"got {np.shape(blocks[t])}")


def check_batch(batch: CreditBatch, uses_pairs: bool = True) -> None:
    """Validate a CreditBatch (the checks `compute_advantages` runs; replays of vector files run them too).

    Shapes ([M] per row, [M, L] tokens, one [m, m] pair block per task), a
    0/1 loss mask, finite rewards and finite log-probs/entropies on loss
    tokens (padding off the mask may hold anything); `uses_pairs` also scans
    the similarity blocks for NaN/inf. Raises ValueError.
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
    check_pairs(batch, scan_similarity=uses_pairs)


def check_pairs(batch: CreditBatch, scan_similarity: bool = True) -> None:
    """The pair blocks of `batch` (those not None): one [m, m] block per task id, m = the task's rows;
    `scan_similarity` also checks the similarities are finite. Raises ValueError."""
    if batch.similarity_blocks is None and batch.eligible_blocks is None:
        return
    rows = task_rows(batch.task_id)
    for nm in ("similarity_blocks", "eligible_blocks"):
        if getattr(batch, nm) is not None:
            _check_blocks(getattr(batch, nm), rows, nm)
    if scan_similarity and batch.similarity_blocks is not None:
        for t, H in batch.similarity_blocks.items():
            if not np.isfinite(np.asarray(H)).all():
                raise ValueError(f"CreditBatch.similarity_blocks[{t!r}] contains NaN or inf")


def permute_batch(batch: CreditBatch, perm: np.ndarray) -> CreditBatch:
    """A copy of `batch` with rows taken in order `perm` (int [M], or a subset of rows); each task's pair blocks are permuted on
    both axes the way that task's rows are. Assumes check_batch passed."""
    perm = np.asarray(perm, dtype=np.int64)

    def rows(a):
        return None if a is None else np.asarray(a)[perm]

    blocks: dict[str, dict[str, np.ndarray] | None] = {"similarity_blocks": None, "eligible_blocks": None}
    if batch.similarity_blocks is not None or batch.eligible_blocks is not None:
        old = task_rows(batch.task_id)
        position = np.empty(batch.num_rows, dtype=np.int64)  # a row's index inside its task's block
        for r in old.values():
            position[r] = np.arange(len(r))
        new_order = {t: position[perm[r]] for t, r in task_rows([batch.task_id[i] for i in perm]).items()}
        for nm in blocks:
            if getattr(batch, nm) is not None:
                blocks[nm] = {t: np.asarray(getattr(batch, nm)[t])[np.ix_(p, p)] for t, p in new_order.items()}
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
        **blocks,
    )
