"""AlignOPSD: decision-aligned rectification + semi-Markov span credit (spec §4).

The pipeline runs its pieces in different services, so each is a pure
function in the file of its stage, named after the role that calls it:

- correspondence.py (§4.1-4.2, embedder and teacher): `similarity_matrix`,
  `structural_mask`, `select_sources`, `rectify`.
- spans.py (§4.3-4.4, trainer): profiles, boundary distances, the
  segmentation, the hierarchical allocation, the invalid-action residual and
  the ablations' random boundaries / token-level weights.
- here: `alignopsd_credit` composes them with the ablations (A-E) and
  registers the `alignopsd` estimator.

`opsd.credit.reference.run_reference_case` runs a refvector file through
exactly these functions.

Ablations (cfg.alignopsd.ablation, spec §4.4): see `alignopsd_credit`.

Conventions: M turn rows in canonical order (task_id, rollout_id, turn_id);
`_MM` matrices are [source, target] except the dense profiles, which are
[target, source] like the reference's `dense_profiles_target_by_source`.
Log-probs are natural-log probabilities of the sampled token. Outputs are
float32 (the reference computes in float32); intermediate sums run in float64
so our rounding error stays below the reference's own.

Turns without loss tokens (N_k = 0). The reference raises ValueError. The
product (`empty_turns="weight_one"`, the default) gives such a turn weight 1
and turn gap 0, leaves it out of every span mass and softmax (so it takes no
budget from its siblings), and counts it in the metric
`alignopsd/turns_without_loss_tokens`. It still occupies its place in the
segmentation, so span boundaries do not move. `empty_turns="error"`
reproduces the reference.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from opsd.config import AlignSection, CreditSection
from opsd.credit.alignopsd.spans import (
    Allocation, Segmentation, allocate_rows, boundary_distances, dense_profiles, invalid_action_residual,
    random_boundaries, segment_trajectory, segmentation_threshold, task_blocks, token_level_weights, group_starts,
)
from opsd.credit.batch import check_pairs
from opsd.credit.grpo import Singleton, canonical_permutation, grpo_sequence_advantage, trajectory_index
from opsd.credit.registry import register
from opsd.types import CreditBatch

EmptyTurns = Literal["weight_one", "error"]

# ---------------------------------------------------------------- composition


@dataclass
class AlignCredit:
    """Every intermediate of `alignopsd_credit` (names follow the refvector fields).

    Arrays are over the M canonical rows unless noted; [M, L] arrays are 0 off
    the loss mask except corrected_gap_ML (the raw gap, as the reference keeps
    it) and token_weight_ML (token-level ablation only, else None).
    Ablations B/C have no spans: segmentations and segment_budget_S are
    empty, segment_index_M is -1, profiles are zero and the threshold is +inf.
    profiles: per task (canonical order, rows `task_blocks`), float32 [m, m]
    [target, source] over the task's m rows (`dense_pairs` makes the [M, M] view).
    """

    trajectory_advantage_M: np.ndarray
    corrected_gap_ML: np.ndarray
    profiles: list[np.ndarray]
    profile_valid_M: np.ndarray
    distance_M: np.ndarray
    boundary_valid_M: np.ndarray
    threshold: float
    trajectories: list[tuple[str, str]]
    trajectory_rows: list[np.ndarray]
    segmentations: list[Segmentation]
    segment_index_M: np.ndarray
    turn_gap_M: np.ndarray
    token_count_M: np.ndarray
    outcome_aligned_score_M: np.ndarray
    segment_budget_S: np.ndarray
    within_segment_turn_budget_M: np.ndarray
    raw_density_M: np.ndarray
    projected_density_M: np.ndarray
    turn_weight_M: np.ndarray
    m2_token_advantage_ML: np.ndarray
    residual_M: np.ndarray
    final_token_advantage_ML: np.ndarray
    metrics: dict[str, float]
    token_weight_ML: np.ndarray | None = None


def _require_canonical(batch: CreditBatch) -> None:
    perm = canonical_permutation(batch.task_id, batch.rollout_id, batch.turn_id)
    if not np.array_equal(perm, np.arange(batch.num_rows)):
        raise ValueError(
            "alignopsd_credit needs rows in canonical order (task_id, rollout_id, turn_id); "
            "use opsd.credit.compute_advantages, which sorts them"
        )


def _stable_seed(seed: int, key: tuple[str, str]) -> int:
    # hash() is salted per process; blake2b of the key is the same on every run and machine.
    data = json.dumps([int(seed), str(key[0]), str(key[1])]).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _check_fields(batch: CreditBatch, mode: str, spans_mode: bool) -> str:
    """The CreditBatch field the gap's teacher side reads under ablation `mode`, after checking every field
    the mode needs (present, [M, L], canonical rows, one pair block per task). Raises ValueError."""
    teacher_field = "teacher_logprobs_ML" if mode == "no_rectification" else "corrected_logprobs_ML"
    needed = [teacher_field] + (["similarity_blocks", "eligible_blocks"] if spans_mode else [])
    missing = [nm for nm in needed if getattr(batch, nm) is None]
    if missing:
        raise ValueError(f"alignopsd (ablation {mode!r}) needs CreditBatch fields {missing} (got None)")
    _require_canonical(batch)
    M = batch.num_rows
    shape_ML = np.shape(batch.loss_mask_ML)
    for nm in (teacher_field, "student_logprobs_ML"):
        if np.shape(getattr(batch, nm)) != shape_ML or len(shape_ML) != 2 or shape_ML[0] != M:
            raise ValueError(f"CreditBatch.{nm} {np.shape(getattr(batch, nm))} and loss_mask_ML {shape_ML} must be [{M}, L]")
    if spans_mode:
        check_pairs(batch, scan_similarity=False)  # one [m, m] block per task (dense_profiles checks H)
    return teacher_field


def _loss_token_counts(batch: CreditBatch, empty_turns: EmptyTurns) -> tuple[np.ndarray, np.ndarray]:
    """(mask_ML bool [M, L], N_M int64 [M] loss tokens per turn). Raises ValueError for a turn without
    loss tokens under empty_turns="error"."""
    mask_ML = np.asarray(batch.loss_mask_ML).astype(bool)
    N_M = mask_ML.sum(axis=1).astype(np.int64)
    if empty_turns == "error" and (N_M == 0).any():
        raise ValueError(f"turns without policy-loss tokens: rows {np.flatnonzero(N_M == 0).tolist()}")
    return mask_ML, N_M


class _Trajectories(NamedTuple):
    """The trajectories of `alignopsd_credit`'s canonical rows and their GRPO advantage A_i."""

    traj_M: np.ndarray  # trajectory ordinal of each row
    keys: list[tuple[str, str]]  # (task_id, rollout_id) per trajectory
    bounds: list[tuple[int, int]]  # (start, stop) rows per trajectory
    rewards_M: np.ndarray  # float32, the trajectory's mean reward on each of its rows
    A_M: np.ndarray
    varying: int  # trajectories whose rows disagree on the reward


def _trajectory_advantage(batch: CreditBatch, cfg: CreditSection, singleton: Singleton) -> _Trajectories:
    """A_i: GRPO advantage of each trajectory's mean episode reward (cfg.grpo_scope, cfg.norm_adv_by_std)."""
    M = batch.num_rows
    traj_M, keys = trajectory_index(batch.task_id, batch.rollout_id)
    t_starts = group_starts(traj_M)[0] if M else np.zeros(0, np.int64)
    bounds = list(zip(t_starts.tolist(), t_starts[1:].tolist() + [M]))
    raw_reward_M = np.asarray(batch.episode_reward, dtype=np.float32).astype(np.float64)
    n_T = np.bincount(traj_M, minlength=len(keys))
    reward_T = np.bincount(traj_M, weights=raw_reward_M, minlength=len(keys)) / np.maximum(n_T, 1)
    varying = int((np.add.reduceat(np.abs(raw_reward_M - reward_T[traj_M]), t_starts) > 0).sum()) if M else 0
    # float32 like the raw rewards: a trajectory's identical rows then z-score exactly (std 0 -> A = 0).
    rewards_M = reward_T.astype(np.float32)[traj_M]  # = the raw reward for a constant-reward trajectory
    A_M = grpo_sequence_advantage(rewards_M, batch.task_id, batch.rollout_id, cfg.grpo_scope, cfg.norm_adv_by_std, singleton)
    return _Trajectories(traj_M, keys, bounds, rewards_M, A_M, varying)


def _corrected_gap(
    batch: CreditBatch, teacher_field: str, mask_ML: np.ndarray, N_M: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gap_ML float32 [M, L] teacher - student everywhere, gap_sum_M float64 [M] over loss tokens, turn gap
    g_M float32 [M] = mean over loss tokens). Raises ValueError for a NaN/inf gap on a loss token."""
    teacher = np.asarray(getattr(batch, teacher_field), dtype=np.float32)
    student = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        gap_ML = (teacher.astype(np.float64) - student).astype(np.float32)
    gap_on_mask = np.where(mask_ML, gap_ML, np.float32(0.0))
    gap_sum_M = gap_on_mask.sum(axis=1, dtype=np.float64)
    if not np.isfinite(gap_sum_M).all():
        raise ValueError("the teacher-student gap is NaN or inf on a loss token")
    g_M = (gap_sum_M / np.maximum(N_M, 1)).astype(np.float32)
    return gap_ML, gap_sum_M, g_M


class _Spans(NamedTuple):
    """Profiles, boundary distances, threshold and segmentations (spec §4.3), as `AlignCredit` names them."""

    profiles: list[np.ndarray]
    profile_valid_M: np.ndarray
    distance_M: np.ndarray
    boundary_valid_M: np.ndarray
    threshold: float
    segmentations: list[Segmentation]
    segment_index_M: np.ndarray  # span ordinal over the batch, -1 without spans
    num_spans: int


def _no_spans(batch: CreditBatch) -> _Spans:
    """Ablations B/C: zero profiles, no valid boundary, tau = +inf, no span."""
    M = batch.num_rows
    profiles = [np.zeros((b - a, b - a), dtype=np.float32) for a, b in task_blocks(batch.task_id)]
    return _Spans(profiles, np.zeros(M, dtype=bool), np.zeros(M, dtype=np.float32), np.zeros(M, dtype=bool), math.inf,
                  [], np.full(M, -1, dtype=np.int64), 0)


def _segment_spans(batch: CreditBatch, acfg: AlignSection, traj: _Trajectories, reference_ablations: bool) -> _Spans:
    """Dense profiles and boundary distances per task, the batch threshold, then each trajectory's
    segmentation (ablation D: random boundaries, see `alignopsd_credit`)."""
    M = batch.num_rows
    pvalid = np.zeros(M, dtype=bool)
    D = np.zeros(M, dtype=np.float32)
    bvalid = np.zeros(M, dtype=bool)
    profiles: list[np.ndarray] = []
    for a, b in task_blocks(batch.task_id):  # pairs never cross tasks: memory of one task's turns at a time
        task = str(batch.task_id[a])
        E = np.asarray(batch.eligible_blocks[task], dtype=bool)
        P, pvalid[a:b] = dense_profiles(batch.similarity_blocks[task], E, acfg)
        D[a:b], bvalid[a:b] = boundary_distances(P, pvalid[a:b], E, traj.traj_M[a:b])
        profiles.append(P)
    tau = segmentation_threshold(D, bvalid, acfg)
    segs: list[Segmentation] = []
    seg_index = np.full(M, -1, dtype=np.int64)
    n_spans = 0
    for j, ((a, b), key) in enumerate(zip(traj.bounds, traj.keys)):
        preset = None
        if acfg.ablation == "random_spans":
            seed = acfg.ablation_seed + j if reference_ablations else _stable_seed(acfg.ablation_seed, key)
            preset = random_boundaries(b - a, acfg, random.Random(seed))
        seg = segment_trajectory(D[a:b], bvalid[a:b], tau, acfg, preset)
        segs.append(seg)
        for lo_, hi_ in seg.spans:
            seg_index[a + lo_ : a + hi_] = n_spans
            n_spans += 1
    return _Spans(profiles, pvalid, D, bvalid, tau, segs, seg_index, n_spans)


def _allocate(
    acfg: AlignSection, reference_ablations: bool, gap_ML: np.ndarray, mask_ML: np.ndarray, g_M: np.ndarray,
    N_M: np.ndarray, traj: _Trajectories, span_M: np.ndarray,
) -> tuple[Allocation, np.ndarray | None, np.ndarray]:
    """(allocation, token_weight_ML (ablation B only, else None), m2_ML = mask * A_i * W float32 [M, L]).

    W is the turn weight W_k of the hierarchical allocation over the units span_M (spans; the trajectory
    under C) or, under B, the token weight w_r."""
    sign_M = np.sign(traj.A_M).astype(np.float64)
    maskf_ML = mask_ML.astype(np.float32)
    if acfg.ablation == "token_level":
        mix = not reference_ablations
        token_weight_ML, alloc = token_level_weights(gap_ML, mask_ML, sign_M, traj.traj_M, acfg, mix=mix)
        if reference_ablations:  # the released code reports the turn weight in all four fields
            alloc.within_budget_K = alloc.raw_density_K = alloc.projected_density_K = alloc.weight_K
        return alloc, token_weight_ML, (maskf_ML * traj.A_M[:, None] * token_weight_ML).astype(np.float32)
    alloc = allocate_rows(g_M, N_M, sign_M, span_M, traj.traj_M, acfg)
    return alloc, None, (maskf_ML * (traj.A_M * alloc.weight_K)[:, None]).astype(np.float32)


def _metrics(
    batch: CreditBatch, mask_ML: np.ndarray, N_M: np.ndarray, traj: _Trajectories, spans: _Spans,
    gap_sum_M: np.ndarray, alloc: Allocation, resid_M: np.ndarray,
) -> dict[str, float]:
    """`alignopsd_credit`'s metrics (listed in its docstring)."""
    M = batch.num_rows
    keys, segs, n_spans, tau = traj.keys, spans.segmentations, spans.num_spans, spans.threshold
    W = alloc.weight_K
    single = sum(1 for n in Counter(k[0] for k in keys).values() if n == 1)
    n_tok = float(N_M.sum())
    adjacent = M - len(keys)
    metrics = {
        "alignopsd/turns": float(M),
        "alignopsd/trajectories": float(len(keys)),
        "alignopsd/turns_without_loss_tokens": float((N_M == 0).sum()),
        "alignopsd/single_trajectory_tasks": float(single),
        "alignopsd/trajectories_with_varying_reward": float(traj.varying),
        "alignopsd/num_spans": float(n_spans),
        "alignopsd/mean_span_turns": float(M / n_spans) if n_spans else 0.0,
        "alignopsd/threshold": float(tau) if math.isfinite(tau) else 0.0,
        "alignopsd/threshold_inf": float(not math.isfinite(tau)),
        "alignopsd/profile_valid_rate": float(spans.profile_valid_M.mean()) if M else 0.0,
        "alignopsd/valid_boundary_rate": float(spans.boundary_valid_M.sum() / adjacent) if adjacent else 0.0,
        "alignopsd/semantic_boundaries": float(sum(len(s.semantic) for s in segs)),
        "alignopsd/guided_boundaries": float(sum(len(s.guided_fallback) for s in segs)),
        "alignopsd/forced_boundaries": float(sum(len(s.forced_max) for s in segs)),
        "alignopsd/random_boundaries": float(sum(len(s.random) for s in segs)),
        "alignopsd/mean_corrected_gap": float(gap_sum_M.sum() / n_tok) if n_tok else 0.0,
        "alignopsd/projection_active_trajectories": float(alloc.projection_active.sum()),
        "alignopsd/turn_weight_min": float(W.min()) if M else 1.0,
        "alignopsd/turn_weight_max": float(W.max()) if M else 1.0,
        "alignopsd/residual_abs_mean": float(np.abs(resid_M).mean()) if M else 0.0,
    }
    if batch.teacher_logprobs_ML is not None and n_tok:
        ident = np.asarray(batch.teacher_logprobs_ML, dtype=np.float32)
        student = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            ident_gap = np.where(mask_ML, ident.astype(np.float64) - student, 0.0)
        metrics["alignopsd/mean_identity_gap"] = float(ident_gap.sum() / n_tok)
    return metrics


def _with_invalid_action_residual(
    batch: CreditBatch, cfg: CreditSection, singleton: Singleton, traj: _Trajectories, mask_ML: np.ndarray,
    m2_ML: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(residual_M float32 [M], final_ML = m2_ML + mask * residual float32 [M, L]); residual 0 unless
    cfg.use_invalid_action_penalty."""
    if cfg.use_invalid_action_penalty:
        resid_M = invalid_action_residual(
            traj.rewards_M, batch.is_action_valid, batch.task_id, cfg.invalid_action_penalty_coef, cfg.norm_adv_by_std,
            singleton,
        )
    else:
        resid_M = np.zeros(batch.num_rows, np.float32)
    return resid_M, (m2_ML + mask_ML.astype(np.float32) * resid_M[:, None]).astype(np.float32)


def alignopsd_credit(
    batch: CreditBatch,
    cfg: CreditSection,
    *,
    singleton: Singleton = "zero",
    empty_turns: EmptyTurns = "weight_one",
    reference_ablations: bool = False,
) -> AlignCredit:
    """AlignOPSD token advantages with every intermediate (spec §4.3-4.4).

    Uses batch.corrected_logprobs_ML (rectified teacher, = identity teacher
    where no source), batch.similarity_blocks (H, source x target) and
    batch.eligible_blocks, one task at a time. Steps: GRPO advantage A_i on the trajectory's episode
    reward (cfg.grpo_scope, cfg.norm_adv_by_std); corrected gap; dense
    profiles, boundary distances, batch threshold, per-trajectory
    segmentation; turn gaps g_k over loss tokens; hierarchical allocation
    W_k; token advantage mask * A_i * W_k; plus the invalid-action residual
    on loss tokens when cfg.use_invalid_action_penalty.

    Ablations (cfg.alignopsd.ablation, spec §4.4; the released code's A-E):

    - "none" (E): the full method above.
    - "no_rectification" (A): alpha_max = 0, the corrected teacher is the
      identity teacher: the gap uses batch.teacher_logprobs_ML
      (corrected_logprobs_ML is not read; `select_sources` gives alpha = 0).
    - "token_level" (B): no profiles and no spans; every loss token is its own
      allocation unit within its trajectory (`token_level_weights`), the
      token advantage is mask * A_i * w_r.
    - "turn_level" (C): no profiles and no spans ("turn-level allocation
      without spans"): the turn softmax q_k = softmax(log N_k + s_k / T) runs
      over all turns of the trajectory (b = 1), h_k = N_total q_k / N_k.
    - "random_spans" (D): profiles and threshold as in E, but the semantic
      boundaries are replaced by `random_boundaries` drawn with a
      random.Random seeded by blake2b(ablation_seed, task_id, rollout_id):
      reproducible, and independent of row order and of the other
      trajectories in the batch. The length repair still applies.

    reference_ablations=True reproduces the released code instead: B without
    the eta mixing (w_r = h'_r) and D seeded by ablation_seed + the
    trajectory's canonical ordinal.

    Rewards that vary inside a trajectory (e.g. a per-turn penalty applied
    upstream): the trajectory's reward is the mean of its rows (A_i is one
    value per trajectory, as §4.4 needs), used for the GRPO advantage and
    the residual; counted in `trajectories_with_varying_reward`. A task with
    one trajectory gets A = 0 (W = 1) under singleton="zero" (no sibling to
    compare with; its turn rows are identical), counted in `single_trajectory_tasks`.

    Args:
      batch: rows in canonical order (checked).
      cfg: CreditSection (alignopsd hyper-parameters in cfg.alignopsd).
      singleton: one-row GRPO groups, see opsd.credit.grpo.
      empty_turns: "weight_one" (product, see module docstring) or "error"
        (reference: ValueError for a turn without loss tokens).
      reference_ablations: see above.
    Returns: AlignCredit. Its metrics (flat, finite floats, "alignopsd/"
      prefix): turns, trajectories, turns_without_loss_tokens,
      single_trajectory_tasks, trajectories_with_varying_reward, num_spans,
      mean_span_turns, threshold (0.0 when tau = +inf) and threshold_inf
      (1.0 then), profile_valid_rate, valid_boundary_rate,
      semantic/guided/forced/random boundary counts, mean_corrected_gap
      (token mean over loss tokens), mean_identity_gap (when
      teacher_logprobs_ML is given), projection_active_trajectories,
      turn_weight_min/max, residual_abs_mean.
    Raises: ValueError for a non-canonical batch, a field the mode needs
      that is None (corrected_logprobs_ML, or teacher_logprobs_ML under A;
      similarity_blocks and eligible_blocks unless B/C) or has the wrong shape, a
      non-finite gap on a loss token or similarity or, with empty_turns="error",
      a turn without loss tokens.
    """
    acfg = cfg.alignopsd
    spans_mode = acfg.ablation not in ("token_level", "turn_level")
    teacher_field = _check_fields(batch, acfg.ablation, spans_mode)
    mask_ML, N_M = _loss_token_counts(batch, empty_turns)
    traj = _trajectory_advantage(batch, cfg, singleton)
    gap_ML, gap_sum_M, g_M = _corrected_gap(batch, teacher_field, mask_ML, N_M)
    spans = _segment_spans(batch, acfg, traj, reference_ablations) if spans_mode else _no_spans(batch)
    span_M = spans.segment_index_M if spans_mode else traj.traj_M  # C: one allocation span per trajectory
    alloc, token_weight_ML, m2_ML = _allocate(acfg, reference_ablations, gap_ML, mask_ML, g_M, N_M, traj, span_M)
    resid_M, final_ML = _with_invalid_action_residual(batch, cfg, singleton, traj, mask_ML, m2_ML)
    return AlignCredit(
        trajectory_advantage_M=traj.A_M, corrected_gap_ML=gap_ML,
        profiles=spans.profiles, profile_valid_M=spans.profile_valid_M, distance_M=spans.distance_M,
        boundary_valid_M=spans.boundary_valid_M, threshold=spans.threshold,
        trajectories=traj.keys, trajectory_rows=[np.arange(a, b) for a, b in traj.bounds],
        segmentations=spans.segmentations, segment_index_M=spans.segment_index_M,
        turn_gap_M=g_M, token_count_M=N_M, outcome_aligned_score_M=alloc.score_K,
        segment_budget_S=alloc.segment_budget_S if spans_mode else np.zeros(0, np.float32),
        within_segment_turn_budget_M=alloc.within_budget_K, raw_density_M=alloc.raw_density_K,
        projected_density_M=alloc.projected_density_K, turn_weight_M=alloc.weight_K,
        m2_token_advantage_ML=m2_ML, residual_M=resid_M, final_token_advantage_ML=final_ML,
        metrics=_metrics(batch, mask_ML, N_M, traj, spans, gap_sum_M, alloc, resid_M),
        token_weight_ML=token_weight_ML,
    )


@register("alignopsd")
def alignopsd_estimator(batch: CreditBatch, cfg: CreditSection) -> tuple[np.ndarray, dict[str, float]]:
    """Registered `alignopsd` (spec §4): `alignopsd_credit` with the product
    settings (one-row groups -> credit.grpo_singleton, 0 by default; turns without loss tokens -> weight 1,
    cfg.alignopsd.ablation as documented there).
    Returns (final token advantages float32 [M, L], metrics); metrics["alignopsd/span_turns"] is an array, the
    turns of each span (int64 [spans]; empty without spans), which compute_advantages hands to its caller apart."""
    out = alignopsd_credit(batch, cfg, singleton=cfg.grpo_singleton or "zero")
    seg = out.segment_index_M
    spans = np.bincount(seg[seg >= 0]) if (seg >= 0).any() else np.zeros(0, np.int64)
    return out.final_token_advantage_ML, {**out.metrics, "alignopsd/span_turns": spans}
