"""GRPO sequence advantages (spec §0) and the row bookkeeping every estimator shares.

Rows are turns. A task group is identified by an explicit `task_id` per row and
a trajectory by `(task_id, rollout_id)`; nothing here ever groups by stride,
because a group that lost rollouts (crashed episodes) would silently shift
every later group (bad-input case 2).

Group of one row. The reference (verl's GRPO, spec §0) sets mean 0 and std 1
for a single-row group, so its advantage is the raw reward / (1 + 1e-6).
Bad-input case 2 asks for advantage 0 instead: a lone row has no sibling to
compare with, and pushing its raw reward (10 on the ALFWorld scale) into the
policy gradient is the failure users reported. Both are offered through
`singleton`: "zero" (the product default) or "reference" (reproduces the
released code); a run chooses with `credit.grpo_singleton`. Neither can produce NaN.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from opsd.credit.registry import register

Singleton = Literal["zero", "reference"]
GRPO_EPS = 1e-6  # added to the std, spec §0


def canonical_permutation(task_id: Sequence[str], rollout_id: Sequence[str], turn_id: Sequence[int]) -> np.ndarray:
    """Row order that sorts turns canonically (spec §4: by (task_id, rollout_id, turn_id)).

    Args: three length-M sequences (ids compared as str, turn ids as int).
    Returns: perm int64 [M] such that rows `perm` are in canonical order.
    Raises: ValueError if lengths differ or a (task, rollout, turn) key repeats
    (two rows for one turn would be counted twice by every estimator).
    """
    M = len(task_id)
    if len(rollout_id) != M or len(turn_id) != M:
        raise ValueError(f"task_id/rollout_id/turn_id lengths differ: {M}, {len(rollout_id)}, {len(turn_id)}")
    # numpy's unicode order is Python's str order (code points); lexsort is stable, last key first.
    task = np.asarray([str(x) for x in task_id], dtype=str) if M else np.zeros(0, dtype=str)
    roll = np.asarray([str(x) for x in rollout_id], dtype=str) if M else np.zeros(0, dtype=str)
    turn = np.asarray(turn_id, dtype=np.int64).reshape(M)
    perm = np.lexsort((turn, roll, task)).astype(np.int64)
    if M > 1:
        a, b = perm[:-1], perm[1:]
        dup = np.flatnonzero((task[a] == task[b]) & (roll[a] == roll[b]) & (turn[a] == turn[b]))
        if dup.size:
            i = int(a[dup[0]])
            key = (str(task[i]), str(roll[i]), int(turn[i]))
            raise ValueError(f"duplicate turn {key}: each (task_id, rollout_id, turn_id) must appear once")
    return perm


def trajectory_index(task_id: Sequence[str], rollout_id: Sequence[str]) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Index of each row's trajectory, numbered in order of first appearance.

    Args: two length-M sequences. Returns (traj_M int64 [M], keys: list of
    (task_id, rollout_id) per trajectory index).
    """
    lookup: dict[tuple[str, str], int] = {}
    traj_M = np.empty(len(task_id), dtype=np.int64)
    for i, key in enumerate(zip(map(str, task_id), map(str, rollout_id))):
        traj_M[i] = lookup.setdefault(key, len(lookup))
    return traj_M, list(lookup)


def group_zscore(
    values_M: np.ndarray,
    group_ids_M: Sequence[str],
    norm_by_std: bool = True,
    singleton: Singleton = "zero",
) -> np.ndarray:
    """Per-group z-score `(x - mean) / (std + 1e-6)` (spec §0, GRPO).

    Args:
      values_M: float [M] rewards (any float dtype).
      group_ids_M: length-M group id per row (explicit ids, never stride).
      norm_by_std: False gives `x - mean` (verl's norm_adv_by_std_in_grpo=False).
      singleton: what a group of one row gets: "zero" -> 0, "reference" ->
        mean 0, std 1 as in the released code (see module docstring).
    Returns: float32 [M].
    Raises: ValueError on length mismatch, non-finite values or unknown singleton.

    Mean and std are computed in float64 with a two-pass variance (unbiased,
    ddof=1), so identical float32 rewards give std exactly 0 (bad-input case 1).
    """
    x = np.asarray(values_M, dtype=np.float64)
    if x.ndim != 1 or x.shape[0] != len(group_ids_M):
        raise ValueError(f"values_M must be 1-d with one entry per group id, got {x.shape} and {len(group_ids_M)} ids")
    if not np.isfinite(x).all():
        raise ValueError("values_M contains NaN or inf")
    if singleton not in ("zero", "reference"):
        raise ValueError(f"singleton must be 'zero' or 'reference', got {singleton!r}")
    out = np.zeros_like(x)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids_M):
        groups.setdefault(str(g), []).append(i)
    for rows in groups.values():
        idx = np.asarray(rows)
        v = x[idx]
        if v.size == 1:
            mean, std = (0.0, 1.0) if singleton == "reference" else (v[0], 1.0)
        elif v.min() == v.max():  # equal rewards: exactly 0 (a float64 mean of equal values can round off them)
            mean, std = v[0], 1.0
        else:
            mean = v.mean()
            std = np.sqrt(((v - mean) ** 2).sum() / (v.size - 1))
        out[idx] = (v - mean) / (std + GRPO_EPS) if norm_by_std else v - mean
    return out.astype(np.float32)


def apply_invalid_action_penalty(rewards_M: np.ndarray, is_action_valid_M: np.ndarray, coef: float) -> np.ndarray:
    """Lower the reward of every invalid-action turn by `coef` (spec §0).

    Args: rewards_M float [M] (episode reward repeated per turn), is_action_valid_M
    bool [M], coef >= 0 (0.1 ALFWorld/WebShop, 0.01 Search).
    Returns: float32 [M]. Raises: ValueError on shape mismatch or negative coef.
    """
    r = np.asarray(rewards_M, dtype=np.float64)
    valid = np.asarray(is_action_valid_M, dtype=bool)
    if r.shape != valid.shape or r.ndim != 1:
        raise ValueError(f"rewards_M {r.shape} and is_action_valid_M {valid.shape} must be equal 1-d shapes")
    if coef < 0:
        raise ValueError(f"invalid-action penalty coef must be >= 0, got {coef}")
    return (r - coef * (~valid)).astype(np.float32)


def grpo_sequence_advantage(
    rewards_M: np.ndarray,
    task_id: Sequence[str],
    rollout_id: Sequence[str],
    scope: Literal["trajectory", "turn"],
    norm_by_std: bool = True,
    singleton: Singleton = "zero",
) -> np.ndarray:
    """GRPO advantage of every turn row (spec §0), one scalar per row.

    Args:
      rewards_M: float [M], the reward of each turn row (episode return repeated
        on every turn, possibly lowered by the invalid-action penalty).
      task_id, rollout_id: length-M group and trajectory ids (any row order).
      scope: "turn" z-scores over all turn rows of the task (longer
        trajectories weigh more, the released default); "trajectory" z-scores
        one value per trajectory over the G trajectories. A trajectory's value
        is the mean of its rows' rewards (equal to the episode reward unless
        the per-turn penalty made rows differ), broadcast back to its rows.
      norm_by_std, singleton: see `group_zscore`.
    Returns: float32 [M]. Raises: ValueError on bad scope or shapes.
    """
    r = np.asarray(rewards_M, dtype=np.float64)
    if r.ndim != 1 or r.shape[0] != len(task_id) or len(rollout_id) != len(task_id):
        raise ValueError("rewards_M, task_id and rollout_id must have one entry per row")
    if scope == "turn":
        return group_zscore(r, task_id, norm_by_std, singleton)
    if scope != "trajectory":
        raise ValueError(f"grpo scope must be 'trajectory' or 'turn', got {scope!r}")
    traj_M, keys = trajectory_index(task_id, rollout_id)
    n = len(keys)
    traj_reward_G = np.bincount(traj_M, weights=r, minlength=n) / np.bincount(traj_M, minlength=n)
    adv_G = group_zscore(traj_reward_G, [k[0] for k in keys], norm_by_std, singleton)
    return adv_G[traj_M]


def edge_case_metrics(batch, prefix: str) -> dict[str, float]:
    """Counts of the inputs every estimator must survive (issue 3), as `<prefix>/...` metrics.

    turns_without_loss_tokens: rows whose loss mask is all 0 (they get
    advantage 0); single_trajectory_tasks: task groups with one trajectory
    (no sibling to compare: GRPO advantage 0, see `group_zscore`);
    trajectories_with_varying_reward: trajectories whose rows disagree on the
    episode reward (the trajectory scope uses their mean).
    """
    traj_M, keys = trajectory_index(batch.task_id, batch.rollout_id)
    r = np.asarray(batch.episode_reward, dtype=np.float64)
    n = len(keys)
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, traj_M, r)
    np.maximum.at(hi, traj_M, r)
    per_task: dict[str, int] = {}
    for task, _ in keys:
        per_task[task] = per_task.get(task, 0) + 1
    return {
        f"{prefix}/turns_without_loss_tokens": float((~np.asarray(batch.loss_mask_ML).astype(bool).any(axis=1)).sum()),
        f"{prefix}/single_trajectory_tasks": float(sum(c == 1 for c in per_task.values())),
        f"{prefix}/trajectories_with_varying_reward": float((hi > lo).sum()),
    }


@register("grpo")
def grpo_estimator(batch, cfg, singleton: Singleton | None = None):
    """Registered `grpo`: spec §0 advantage broadcast to the turn's loss tokens.

    Uses cfg.grpo_scope, cfg.norm_adv_by_std and, unless `singleton` is given, cfg.grpo_singleton ("zero" when
    null); with
    cfg.use_invalid_action_penalty the reward of an invalid turn is lowered
    by cfg.invalid_action_penalty_coef before grouping. Returns
    (advantages_ML float32, metrics).
    """
    rewards_M = np.asarray(batch.episode_reward, dtype=np.float32)
    if cfg.use_invalid_action_penalty:
        rewards_M = apply_invalid_action_penalty(rewards_M, batch.is_action_valid, cfg.invalid_action_penalty_coef)
    singleton = singleton or cfg.grpo_singleton or "zero"
    adv_M = grpo_sequence_advantage(rewards_M, batch.task_id, batch.rollout_id, cfg.grpo_scope, cfg.norm_adv_by_std, singleton)
    mask_ML = np.asarray(batch.loss_mask_ML, dtype=np.float32)
    metrics = {
        "grpo/seq_adv_mean": float(adv_M.mean()) if adv_M.size else 0.0,
        "grpo/seq_adv_abs_max": float(np.abs(adv_M).max()) if adv_M.size else 0.0,
        "grpo/invalid_turns": float((~np.asarray(batch.is_action_valid, dtype=bool)).sum()),
        **edge_case_metrics(batch, "grpo"),
    }
    return (mask_ML * adv_M[:, None]).astype(np.float32), metrics
