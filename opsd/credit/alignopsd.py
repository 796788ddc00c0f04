"""AlignOPSD: decision-aligned rectification + semi-Markov span credit (spec §4).

The pipeline runs these pieces in different services, so each is a pure
function named after the role that calls it:

- embedder (§4.1): `similarity_matrix`, `structural_mask`,
  `select_sources` (threshold, one source per sibling rollout, top-K, action
  filter, weights, rho, alpha).
- teacher (§4.2): `rectify` (probability mixture / log mean of the matched
  sibling teachers, blended with the identity view by alpha).
- trainer (§4.3-4.4): `dense_profiles`, `boundary_distances`,
  `segmentation_threshold`, `segment_trajectory`, `allocate_rows`
  (`project_density`), `invalid_action_residual`, and the ablations'
  `random_boundaries` / `token_level_weights`, composed by
  `alignopsd_credit` and the registered `alignopsd` estimator.

`opsd.credit.reference.run_reference_case` runs a refvector file through
exactly these functions.

Speed: the trainer's [M, M] work runs per task block (`task_blocks`; every
pair it reads lies inside one task) in chunks of rows, and the allocation
runs over all trajectories at once (segmented softmax and a batched
bisection), so a 16 x 8 x 50-turn batch takes well under a second on one core.

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

import bisect
import hashlib
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from opsd.config import AlignSection, CreditSection
from opsd.credit import register
from opsd.credit.grpo import Singleton, canonical_permutation, group_zscore, grpo_sequence_advantage, trajectory_index
from opsd.types import CreditBatch

EmptyTurns = Literal["weight_one", "error"]

_CHUNK = 512  # rows per vectorized step over an [M, M] block: bounds temporaries, not results

_WEBSHOP_RE = re.compile(r"\s*(search|click)\[(.*)\]\s*", re.DOTALL)

# ---------------------------------------------------------------- embedder (§4.1)


def similarity_matrix(
    teacher_emb_MD: np.ndarray,
    student_emb_MD: np.ndarray,
    task_id: Sequence[str] | None = None,
) -> np.ndarray:
    """H[s, t] = cosine(teacher embedding of turn s, student embedding of turn t), spec §4.1.

    Args:
      teacher_emb_MD, student_emb_MD: float [M, D] embeddings (need not be
        normalised). An all-zero row (empty/invalid text) has cosine 0 with
        everything, never NaN (bad-input case 19).
      task_id: optional length-M task ids; pairs across tasks are set to 0.
    Returns: float32 [M, M] (source, target), values in [-1, 1].
    Raises: ValueError on shape mismatch or a non-finite embedding.
    """
    T = np.asarray(teacher_emb_MD, dtype=np.float64)
    S = np.asarray(student_emb_MD, dtype=np.float64)
    if T.ndim != 2 or T.shape != S.shape:
        raise ValueError(f"teacher {T.shape} and student {S.shape} embeddings must be equal [M, D] shapes")
    if not (np.isfinite(T).all() and np.isfinite(S).all()):
        raise ValueError("an embedding contains NaN or inf")

    def unit(X: np.ndarray) -> np.ndarray:
        n = np.linalg.norm(X, axis=1, keepdims=True)
        return np.divide(X, n, out=np.zeros_like(X), where=n > 0)

    H = np.clip(unit(T) @ unit(S).T, -1.0, 1.0)
    if task_id is not None:
        if len(task_id) != H.shape[0]:
            raise ValueError(f"task_id has {len(task_id)} entries for {H.shape[0]} turns")
        tasks = np.asarray([str(x) for x in task_id])
        H = np.where(tasks[:, None] == tasks[None, :], H, 0.0)
    return H.astype(np.float32)


def structural_mask(
    task_id: Sequence[str],
    rollout_id: Sequence[str],
    data_source: Sequence[str],
    student_thinking_valid_M: np.ndarray,
    teacher_thinking_valid_M: np.ndarray,
) -> np.ndarray:
    """eligible[s, t] (spec §4.1): same task, different rollout, same data source,
    teacher thinking of s valid and student thinking of t valid.

    Args: length-M ids; thinking validity bool [M] each.
    Returns: bool [M, M] (source, target). Raises: ValueError on length mismatch.
    """
    M = len(task_id)
    if not (len(rollout_id) == len(data_source) == M):
        raise ValueError("task_id, rollout_id and data_source must have one entry per turn")
    sv = np.asarray(student_thinking_valid_M, dtype=bool)
    tv = np.asarray(teacher_thinking_valid_M, dtype=bool)
    if sv.shape != (M,) or tv.shape != (M,):
        raise ValueError(f"thinking validity vectors must have shape ({M},)")
    task = np.asarray([str(x) for x in task_id])
    roll = np.asarray([str(x) for x in rollout_id])
    src = np.asarray([str(x) for x in data_source])
    same = (task[:, None] == task[None, :]) & (src[:, None] == src[None, :])
    return same & (roll[:, None] != roll[None, :]) & tv[:, None] & sv[None, :]


def webshop_actions_agree(source_action: str, target_action: str) -> bool:
    """WebShop symbolic check (spec §4.1): both `search[arg]` or both `click[arg]`
    with a non-empty (stripped) arg; a click also needs the identical arg."""
    a, b = _WEBSHOP_RE.fullmatch(source_action or ""), _WEBSHOP_RE.fullmatch(target_action or "")
    if a is None or b is None or not a.group(2).strip() or not b.group(2).strip():
        return False
    if a.group(1) != b.group(1):
        return False
    return a.group(1) != "click" or a.group(2).strip() == b.group(2).strip()


@dataclass
class SourceSelection:
    """Per target turn t (lists of length M): the matched sibling sources.

    sources_before_filter[t] / sources[t]: canonical source indices in rank
    order, before / after the action filter; weights[t]: float32 [K_t] = omega;
    rho_M, alpha_M: float32 [M] correspondence confidence and correction
    strength (0 where no source survives).
    """

    sources_before_filter: list[list[int]]
    sources: list[list[int]]
    weights: list[np.ndarray]
    rho_M: np.ndarray
    alpha_M: np.ndarray


def _softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(x / temperature), finite for any temperature > 0 and infinite logits.

    The max is subtracted BEFORE dividing, so a tiny temperature gives the
    exact limit (one-hot on the max, ties shared) instead of inf - inf = NaN.
    Logits that are already +inf share all the mass; all -inf gives uniform.
    """
    z = np.asarray(x, dtype=np.float64)
    top = z.max()
    if np.isposinf(top):
        z, top = np.where(np.isposinf(z), 0.0, -np.inf), 0.0
    elif np.isneginf(top):
        z, top = np.zeros_like(z), 0.0
    with np.errstate(over="ignore", under="ignore"):
        z = np.exp((z - top) / temperature)
    return z / z.sum()


def select_sources(
    H_MM: np.ndarray,
    eligible_MM: np.ndarray,
    cfg: AlignSection,
    action_similarity_MM: np.ndarray | None = None,
    student_actions: Sequence[str] | None = None,
    teacher_actions: Sequence[str] | None = None,
    *,
    rollout_id: Sequence[str],
) -> SourceSelection:
    """Sparse sources Psi_t, weights, rho and alpha for every target (spec §4.1-4.2).

    For target t: eligible s with H[s,t] >= cfg.similarity_threshold; at most
    cfg.source_rollout_cap per sibling rollout (highest H, ties -> smaller
    index); rank by (-H, index); keep cfg.top_k. Then, when
    cfg.action_filter_enabled, drop (never refill) s unless both actions are
    valid, action_similarity_MM[s, t] >= cfg.action_filter_threshold and, with
    cfg.webshop_symbolic_checks, `webshop_actions_agree`. omega =
    softmax(H / cfg.aggregation_temperature) over survivors;
    rho = sum omega * clip((H - gamma)/(1 - gamma), 0, 1); alpha = clip(alpha_max * rho, 0, alpha_max),
    with alpha_max taken as 0 under cfg.ablation == "no_rectification" (ablation A).

    Args:
      H_MM: float [M, M] thinking similarity (source, target); eligible_MM bool [M, M].
      action_similarity_MM: float [M, M] cosine(teacher action of s, student
        action of t); required when the action filter is enabled.
      student_actions, teacher_actions: parsed action strings ("" = invalid);
        optional for the cosine filter (an invalid action embeds to 0 and fails
        the threshold anyway), required for the WebShop checks.
      rollout_id: length-M rollout ids (the per-sibling cap).
    Returns: SourceSelection. Raises: ValueError on shapes or missing inputs.
    """
    H = np.asarray(H_MM, dtype=np.float32)
    E = np.asarray(eligible_MM, dtype=bool)
    M = H.shape[0]
    if H.shape != (M, M) or E.shape != (M, M) or len(rollout_id) != M:
        raise ValueError(f"H {H.shape}, eligible {E.shape} and rollout_id ({len(rollout_id)}) must describe M turns")
    gamma = float(cfg.similarity_threshold)
    A = None
    if cfg.action_filter_enabled:
        if action_similarity_MM is None:
            raise ValueError("action filter enabled but action_similarity_MM is None")
        A = np.asarray(action_similarity_MM, dtype=np.float32)
        if A.shape != (M, M):
            raise ValueError(f"action_similarity_MM must be ({M}, {M}), got {A.shape}")
        if cfg.webshop_symbolic_checks and (student_actions is None or teacher_actions is None):
            raise ValueError("webshop_symbolic_checks needs student_actions and teacher_actions")
    for nm, acts in (("student_actions", student_actions), ("teacher_actions", teacher_actions)):
        if acts is not None and len(acts) != M:
            raise ValueError(f"{nm} has {len(acts)} entries for {M} turns")

    before, after, weights = [], [], []
    rho_M = np.zeros(M, dtype=np.float64)
    for t in range(M):
        cands = [s for s in np.flatnonzero(E[:, t]) if H[s, t] >= gamma]
        by_rollout: dict[str, list[int]] = {}
        for s in sorted(cands, key=lambda s: (-float(H[s, t]), s)):
            kept = by_rollout.setdefault(str(rollout_id[s]), [])
            if len(kept) < cfg.source_rollout_cap:
                kept.append(int(s))
        ranked = sorted((s for kept in by_rollout.values() for s in kept), key=lambda s: (-float(H[s, t]), s))
        ranked = ranked[: cfg.top_k]
        before.append(list(ranked))
        if A is not None:
            def ok(s: int) -> bool:
                if student_actions is not None and not student_actions[t]:
                    return False
                if teacher_actions is not None and not teacher_actions[s]:
                    return False
                if not A[s, t] >= cfg.action_filter_threshold:
                    return False
                return not cfg.webshop_symbolic_checks or webshop_actions_agree(teacher_actions[s], student_actions[t])

            ranked = [s for s in ranked if ok(s)]
        after.append(ranked)
        if ranked:
            h = H[ranked, t].astype(np.float64)
            w = _softmax(h, cfg.aggregation_temperature)
            conf = np.clip((h - gamma) / max(1.0 - gamma, 1e-12), 0.0, 1.0)
            rho_M[t] = float((w * conf).sum())
            weights.append(w.astype(np.float32))
        else:
            weights.append(np.zeros(0, dtype=np.float32))
    # Ablation A (no rectification): alpha_max = 0, sources and rho stay for the diagnostics.
    alpha_max = 0.0 if cfg.ablation == "no_rectification" else float(cfg.alpha_max)
    alpha_M = np.clip(alpha_max * rho_M, 0.0, alpha_max)
    return SourceSelection(before, after, weights, rho_M.astype(np.float32), alpha_M.astype(np.float32))


# ---------------------------------------------------------------- teacher (§4.2)


def rectify(
    identity_logprobs_L: np.ndarray,
    cross_logprobs_KL: np.ndarray,
    weights_K: np.ndarray,
    alpha: float,
    mode: Literal["probability_mixture", "log_mean"],
) -> tuple[np.ndarray, np.ndarray]:
    """Corrected teacher log-probs of one target response (spec §4.2).

    Args:
      identity_logprobs_L: float [L], l+_{t->t} (own privileged history).
      cross_logprobs_KL: float [K, L], l+_{s->t} of t's tokens under each
        selected source's privileged history, rows in the order of weights_K.
      weights_K: float [K] omega (sums to 1). alpha: correction strength in [0, 1].
      mode: "probability_mixture" -> log sum_s omega_s exp(l+) (logsumexp);
        "log_mean" -> sum_s omega_s l+.
    Returns: (aggregated_L, corrected_L) float32, corrected =
      (1 - alpha) identity + alpha aggregated. K = 0: aggregated = identity
      and alpha is treated as 0 (plain identity gap).
    Raises: ValueError on shapes, unknown mode or alpha outside [0, 1].
    """
    ident = np.asarray(identity_logprobs_L, dtype=np.float64)
    cross = np.asarray(cross_logprobs_KL, dtype=np.float64)
    w = np.asarray(weights_K, dtype=np.float64).reshape(-1)
    if cross.size == 0 and ident.ndim == 1:
        cross = cross.reshape(0, ident.shape[0])  # no source: [] arrives with any shape
    if ident.ndim != 1 or cross.ndim != 2 or cross.shape != (w.shape[0], ident.shape[0]):
        raise ValueError(f"identity [L]={ident.shape}, cross [K, L]={cross.shape} and weights [K]={w.shape} disagree")
    if mode not in ("probability_mixture", "log_mean"):
        raise ValueError(f"aggregation mode must be probability_mixture or log_mean, got {mode!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if w.size == 0:
        out = ident.astype(np.float32)
        return out, out.copy()
    if mode == "log_mean":
        agg = (w[:, None] * cross).sum(axis=0)
    else:
        with np.errstate(divide="ignore"):
            z = np.log(w)[:, None] + cross
        zmax = z.max(axis=0)
        agg = zmax + np.log(np.exp(z - zmax).sum(axis=0))
    corrected = (1.0 - alpha) * ident + alpha * agg
    return agg.astype(np.float32), corrected.astype(np.float32)


# ---------------------------------------------------------------- trainer (§4.3)


def task_blocks(task_id: Sequence[str]) -> list[tuple[int, int]]:
    """(start, stop) row range of each task, rows grouped by task as in canonical order.

    Every pair the trainer reads (eligibility, similarity, adjacent turns) lies
    inside one task, so the [M, M] work is done per diagonal block: ~(M/G)^2
    per task instead of M^2 per target.
    Raises: ValueError if a task's rows are not contiguous.
    """
    ids = [str(x) for x in task_id]
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] if ids else []
    blocks = list(zip(starts, starts[1:] + [len(ids)]))
    if len({ids[a] for a, _ in blocks}) != len(blocks):
        raise ValueError("the rows of each task must be contiguous (canonical order)")
    return blocks


def _check_blocks(eligible_MM: np.ndarray, blocks: Sequence[tuple[int, int]]) -> None:
    inside = sum(int(np.count_nonzero(eligible_MM[a:b, a:b])) for a, b in blocks)
    if inside != int(np.count_nonzero(eligible_MM)):
        raise ValueError("eligible_MM pairs a source and a target of different tasks (spec §4.1: same task only)")


def dense_profiles(
    H_MM: np.ndarray,
    eligible_MM: np.ndarray,
    cfg: AlignSection,
    blocks: Sequence[tuple[int, int]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """P_t = softmax_s(H[s, t] / cfg.profile_temperature) over ALL eligible s (spec §4.3).

    Args: H_MM float [M, M] (source, target), eligible_MM bool [M, M];
      blocks: task row ranges (`task_blocks`); None = one block of all rows.
      With blocks, eligible pairs across blocks are an error.
    Returns: (profiles_MM float32 [target, source], zero rows where nothing is
      eligible; valid_M bool [M]: something eligible and max eligible H >= gamma_H).
    Raises: ValueError on non-finite H inside a block or eligibility across blocks.
    """
    H = np.asarray(H_MM)
    E = np.asarray(eligible_MM, dtype=bool)
    M = H.shape[0]
    if blocks is None:
        blocks = [(0, M)]
    else:
        _check_blocks(E, blocks)
    P = np.zeros((M, M), dtype=np.float32)  # calloc: only the diagonal blocks get touched
    valid = np.zeros(M, dtype=bool)
    for a, b in blocks:
        for c in range(a, b, _CHUNK):  # targets c:d, so temporaries stay [_CHUNK, block] however large a task
            d = min(c + _CHUNK, b)
            E_ts = E[a:b, c:d].T
            has = E_ts.any(axis=1)
            if not has.any():
                continue
            H_ts = H[a:b, c:d].T.astype(np.float64)
            if not np.isfinite(H_ts).all():
                raise ValueError("similarity_MM contains NaN or inf")
            z = np.where(E_ts, H_ts, -np.inf)
            top = z.max(axis=1, keepdims=True)
            top[~has] = 0.0
            # Max subtracted BEFORE dividing: a tiny temperature gives the one-hot limit, not NaN.
            with np.errstate(over="ignore", under="ignore"):
                w = np.exp((z - top) / cfg.profile_temperature)
            w /= np.where(has, w.sum(axis=1), 1.0)[:, None]
            P[c:d, a:b] = w
            valid[c:d] = has & (top[:, 0] >= cfg.similarity_threshold)
    return P, valid


def _xlogx_sum(p_RN: np.ndarray) -> np.ndarray:
    """sum_n p log p per row, float64 [R] (0 log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p_RN > 0, p_RN * np.log(p_RN), 0.0).sum(axis=-1)


def _jsd_rows(
    p_RN: np.ndarray,
    q_RN: np.ndarray,
    p_xlogx_R: np.ndarray | None = None,
    q_xlogx_R: np.ndarray | None = None,
) -> np.ndarray:
    """Row-wise JSD / ln 2 clamped to [0, 1], float64 [R].

    Uses KL(p||m) + KL(q||m) = sum p log p + sum q log q - 2 sum m log m with
    m = (p + q) / 2; the first two sums may be passed in (`_xlogx_sum`).
    """
    p = np.asarray(p_RN, dtype=np.float64)
    q = np.asarray(q_RN, dtype=np.float64)
    xp = _xlogx_sum(p) if p_xlogx_R is None else p_xlogx_R
    xq = _xlogx_sum(q) if q_xlogx_R is None else q_xlogx_R
    return np.clip(0.5 * (xp + xq - 2.0 * _xlogx_sum(0.5 * (p + q))) / math.log(2.0), 0.0, 1.0)


def jsd_normalized(p_N: np.ndarray, q_N: np.ndarray) -> float:
    """Jensen-Shannon divergence with natural logs divided by ln 2, clamped to [0, 1] (spec §4.3)."""
    return float(_jsd_rows(np.reshape(p_N, (1, -1)), np.reshape(q_N, (1, -1)))[0])


def boundary_distances(
    profiles_MM: np.ndarray,
    profile_valid_M: np.ndarray,
    eligible_MM: np.ndarray,
    traj_M: np.ndarray,
    blocks: Sequence[tuple[int, int]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """D_k = JSD(P_{k-1}, P_k) at each turn k > 0 of a trajectory (spec §4.3).

    Valid only when both profiles are valid and turns k-1 and k have exactly
    the same eligible source set (a change in who is eligible is not
    evidence of a decision boundary).

    Args: profiles_MM float [target, source]; profile_valid_M bool [M];
      eligible_MM bool [source, target]; traj_M int [M] trajectory of each row,
      rows in canonical order (a trajectory's turns are consecutive rows);
      blocks: task row ranges, eligible_MM zero outside them (None = all rows).
    Returns: (D_M float32 [M], 0 where invalid; valid_M bool [M]).
    """
    P = np.asarray(profiles_MM)
    pv = np.asarray(profile_valid_M, dtype=bool)
    E = np.asarray(eligible_MM, dtype=bool)
    traj = np.asarray(traj_M)
    M = traj.shape[0]
    D = np.zeros(M, dtype=np.float32)
    valid = np.zeros(M, dtype=bool)
    k_all = np.flatnonzero((traj[1:] == traj[:-1]) & pv[1:] & pv[:-1]) + 1
    for a, b in blocks if blocks is not None else [(0, M)]:
        k_b = k_all[(k_all > a) & (k_all < b)]
        if k_b.size == 0:
            continue
        # sum P log P once per profile; each pair then needs only its mixture's term (see _jsd_rows).
        xlogx = np.concatenate(
            [_xlogx_sum(P[c : min(c + _CHUNK, b), a:b].astype(np.float64)) for c in range(a, b, _CHUNK)]
        )
        for i in range(0, k_b.size, _CHUNK):
            k = k_b[i : i + _CHUNK]
            k = k[(E[a:b, k - 1] == E[a:b, k]).all(axis=0)]
            D[k] = _jsd_rows(P[k - 1, a:b], P[k, a:b], xlogx[k - 1 - a], xlogx[k - a])
            valid[k] = True
    return D, valid


def segmentation_threshold(D_M: np.ndarray, valid_M: np.ndarray, cfg: AlignSection) -> float:
    """tau = linearly interpolated cfg.segmentation_quantile of all valid D in the batch,
    clipped to [segmentation_threshold_min, segmentation_threshold_max]; +inf if none is valid (spec §4.3)."""
    vals = np.asarray(D_M, dtype=np.float32)[np.asarray(valid_M, dtype=bool)].astype(np.float64)
    if vals.size == 0:
        return math.inf
    q = float(np.quantile(vals, cfg.segmentation_quantile))
    return min(max(q, cfg.segmentation_threshold_min), cfg.segmentation_threshold_max)


@dataclass
class Segmentation:
    """Spans of one trajectory as (start, stop) local turn positions, stop exclusive,
    and the boundary positions (local index of a span's first turn) by kind
    (`random`: ablation D's drawn boundaries)."""

    spans: list[tuple[int, int]]
    semantic: list[int] = field(default_factory=list)
    guided_fallback: list[int] = field(default_factory=list)
    forced_max: list[int] = field(default_factory=list)
    random: list[int] = field(default_factory=list)


def random_boundaries(K: int, cfg: AlignSection, rng: random.Random) -> list[int]:
    """Ablation D (spec §4.4 "random spans"): boundaries of a K-turn trajectory drawn at random.

    Positions L_min..K-L_min are shuffled by `rng` and accepted greedily when
    both pieces of the span they fall in keep >= L_min turns (the released
    code's procedure). Every final span then has L_min..2 L_min - 1 <= L_max
    turns, so `segment_trajectory`'s length repair never fires.
    Returns: sorted local boundary positions.
    """
    lmin = cfg.min_segment_turns
    cuts = [0, K]
    order = list(range(lmin, K - lmin + 1))
    rng.shuffle(order)
    for p in order:
        i = bisect.bisect(cuts, p)
        if p - cuts[i - 1] >= lmin and cuts[i] - p >= lmin:
            cuts.insert(i, p)
    return cuts[1:-1]


def segment_trajectory(
    D_K: np.ndarray,
    valid_K: np.ndarray,
    threshold: float,
    cfg: AlignSection,
    preset: Sequence[int] | None = None,
) -> Segmentation:
    """Split one trajectory's K turns into spans (spec §4.3 "Segmentation").

    1. semantic: candidates k with valid D_k > threshold, tried in order
       (-D, k); accepted when both pieces of the span it falls in keep
       >= cfg.min_segment_turns turns. With `preset` (ablation D's random
       boundaries, recorded as `random`) this step is replaced by the preset cuts.
    2. while a span [l, r) is longer than cfg.max_segment_turns (leftmost
       first): split at the max-D valid position p in [l + L_min, r - L_min]
       with D_p >= cfg.segmentation_threshold_min ("guided_fallback", ties ->
       smaller p), else at the feasible p nearest (l + r) / 2, ties -> smaller
       ("forced_max").

    Args: D_K float [K], valid_K bool [K] (index 0 never valid); threshold may be +inf.
    Returns: Segmentation (boundary lists sorted ascending).
    Raises: ValueError if cfg violates max_segment_turns >= 2*min_segment_turns - 1.
    """
    D = np.asarray(D_K, dtype=np.float32)
    valid = np.asarray(valid_K, dtype=bool)
    K = D.shape[0]
    lmin, lmax = cfg.min_segment_turns, cfg.max_segment_turns
    if lmax < 2 * lmin - 1:
        raise ValueError("max_segment_turns must be >= 2*min_segment_turns - 1")
    cuts = [0, K]  # sorted
    out = Segmentation(spans=[])
    if preset is not None:
        out.random = sorted(int(p) for p in preset)
        cuts = [0, *out.random, K]
    else:
        cands = [k for k in range(1, K) if valid[k] and float(D[k]) > threshold]
        for p in sorted(cands, key=lambda k: (-float(D[k]), k)):
            i = bisect.bisect(cuts, p)
            if p - cuts[i - 1] >= lmin and cuts[i] - p >= lmin:
                cuts.insert(i, p)
                out.semantic.append(p)
    while True:
        long_span = next(((a, b) for a, b in zip(cuts, cuts[1:]) if b - a > lmax), None)
        if long_span is None:
            break
        a, b = long_span
        feasible = range(a + lmin, b - lmin + 1)
        guided = [p for p in feasible if valid[p] and float(D[p]) >= cfg.segmentation_threshold_min]
        if guided:
            p = min(guided, key=lambda k: (-float(D[k]), k))
            out.guided_fallback.append(p)
        else:
            mid = 0.5 * (a + b)
            p = min(feasible, key=lambda k: (abs(k - mid), k))
            out.forced_max.append(p)
        bisect.insort(cuts, p)
    out.spans = list(zip(cuts, cuts[1:]))
    out.semantic.sort()
    out.guided_fallback.sort()
    out.forced_max.sort()
    return out


# ---------------------------------------------------------------- trainer (§4.4)


def density_bounds(cfg: AlignSection) -> tuple[float, float]:
    """[lo, hi] of the credit density: legacy [0, d_max], bounded [1 - band, 1 + band] (spec §4.4)."""
    if cfg.weighting_mode == "bounded":
        return 1.0 - cfg.multiplier_band, 1.0 + cfg.multiplier_band
    return 0.0, float(cfg.density_upper_bound)


def _group_starts(gid_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, group of each row 0..G-1) of contiguous runs of equal ids."""
    new = np.ones(gid_R.shape[0], dtype=bool)
    new[1:] = gid_R[1:] != gid_R[:-1]
    return np.flatnonzero(new), np.cumsum(new) - 1


def _segment_softmax(x_R: np.ndarray, gid_R: np.ndarray) -> np.ndarray:
    """softmax(x) within each contiguous run of equal gid_R, float64 [R] (R >= 1).

    Same limits as `_softmax`: +inf logits share their group's mass, an
    all -inf group is uniform, never NaN.
    """
    x = np.asarray(x_R, dtype=np.float64)
    starts, grp = _group_starts(np.asarray(gid_R))
    top = np.maximum.reduceat(x, starts)[grp]
    with np.errstate(invalid="ignore"):
        z = x - top
    z = np.where(np.isposinf(top), np.where(np.isposinf(x), 0.0, -np.inf), z)
    z = np.where(np.isneginf(top), 0.0, z)
    with np.errstate(under="ignore"):
        e = np.exp(z)
    return e / np.add.reduceat(e, starts)[grp]


def _project_groups(
    h_R: np.ndarray,
    N_R: np.ndarray,
    gid_R: np.ndarray,
    lo: float,
    hi: float,
    tol_rel: float = 1e-7,
    max_iter: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """`project_density` of every contiguous group of rows at once (same bisection, same stops).

    Returns: (projected float64 [R], active_G bool: the group had h outside [lo, hi]).
    """
    h = np.asarray(h_R, dtype=np.float64)
    N = np.asarray(N_R, dtype=np.float64)
    if not lo <= 1.0 <= hi:
        raise ValueError(f"density box [{lo}, {hi}] must contain 1, or the token budget cannot be kept")
    if (N <= 0).any():
        raise ValueError("project_density needs positive token counts")
    out = h.copy()
    if h.size == 0:
        return out, np.zeros(0, dtype=bool)
    starts, grp = _group_starts(np.asarray(gid_R))
    active_G = ~np.logical_and.reduceat((h >= lo) & (h <= hi), starts)
    if not active_G.any():
        return out, active_G
    rows = active_G[grp]
    hr, Nr = h[rows], N[rows]
    st, g = _group_starts(grp[rows])
    target = np.add.reduceat(Nr, st)
    tol = tol_rel * np.maximum(target, 1.0)
    a, b = np.minimum.reduceat(hr - hi, st), np.maximum.reduceat(hr - lo, st)
    searching = np.ones(st.shape[0], dtype=bool)
    for _ in range(max_iter):
        lam = 0.5 * (a + b)
        budget = np.add.reduceat(Nr * np.clip(hr - lam[g], lo, hi), st)
        hit = searching & (np.abs(budget - target) <= tol)
        over = budget > target
        a = np.where(hit | (searching & over), lam, a)
        b = np.where(hit | (searching & ~over), lam, b)
        searching &= ~hit
        if not searching.any():
            break
    o = np.clip(hr - (0.5 * (a + b))[g], lo, hi)
    spreading = np.ones(st.shape[0], dtype=bool)
    for _ in range(3):  # the bisection's leftover, spread per token over the coordinates inside the box
        residual = target - np.add.reduceat(Nr * o, st)
        free = (o > lo) & (o < hi)
        n_free = np.add.reduceat(np.where(free, Nr, 0.0), st)
        spreading &= (np.abs(residual) > tol) & (n_free > 0)
        if not spreading.any():
            break
        step = np.where(spreading, residual / np.where(n_free > 0, n_free, 1.0), 0.0)
        o = np.where(free, o + step[g], o)
    out[rows] = np.clip(o, lo, hi)
    return out, active_G


def project_density(
    h_K: np.ndarray,
    N_K: np.ndarray,
    lo: float,
    hi: float,
    tol_rel: float = 1e-7,
    max_iter: int = 100,
) -> np.ndarray:
    """Token-weighted box projection of a credit density (spec §4.4 "Bounded projection").

    Keeps h when every entry is in [lo, hi]; otherwise finds lambda by
    bisection on sum N clip(h - lambda, lo, hi) = sum N (bracket
    [min h - hi, max h - lo], <= max_iter steps, tolerance tol_rel * max(sum N, 1)),
    then makes up to 3 passes spreading the remaining residual evenly (per
    token) over the coordinates strictly inside (lo, hi).

    Args: h_K float [K] raw density, N_K positive token counts [K], lo <= 1 <= hi.
    Returns: float64 [K] with sum N h' = sum N (to the tolerance).
    Raises: ValueError if the box cannot hold the budget (lo > 1 or hi < 1) or N <= 0.
    """
    h = np.asarray(h_K, dtype=np.float64).reshape(-1)
    return _project_groups(h, N_K, np.zeros(h.shape[0], dtype=np.int64), lo, hi, tol_rel, max_iter)[0]


@dataclass
class Allocation:
    """Hierarchical allocation (spec §4.4); arrays over the R rows given, float32 unless noted.

    score = sign(A) g_k; segment_budget_S = b_m per span id (0 for a span
    without loss tokens); within_budget = q_k; raw_density = h_k;
    projected_density = h'_k; weight = W_k; projection_active: bool per
    trajectory, some h_k fell outside the box. Excluded (N_k = 0) turns
    have q = 0, h = h' = W = 1.
    """

    score_K: np.ndarray
    segment_budget_S: np.ndarray
    within_budget_K: np.ndarray
    raw_density_K: np.ndarray
    projected_density_K: np.ndarray
    weight_K: np.ndarray
    projection_active: np.ndarray


def allocate_rows(
    turn_gap_R: np.ndarray,
    token_count_R: np.ndarray,
    sign_R: np.ndarray,
    span_R: np.ndarray,
    traj_R: np.ndarray,
    cfg: AlignSection,
) -> Allocation:
    """Span and turn weights W_k of many trajectories at once (spec §4.4).

    Per trajectory: s_k = sign(A) g_k; span mass M_m = sum N_k; span score =
    mean of s_k; b_m = softmax_m(log M_m + score_m / T); within span m
    q_k = softmax_k(log N_k + s_k / T); h_k = N_total b_m q_k / N_k;
    h' = `project_density`(h, N, box); W_k = (1 - eta) + eta h'_k, so
    sum N_k W_k = sum N_k. Turns with N_k = 0 are left out of every mass and
    softmax (W = 1).

    Args:
      turn_gap_R: float [R] g_k; token_count_R: int [R] N_k >= 0;
      sign_R: float [R] sign of the trajectory's advantage A_i;
      span_R, traj_R: int [R] span and trajectory ids, each span inside one
        trajectory, rows of a span / trajectory contiguous and in turn order;
        span ids index segment_budget_S (0..S-1).
      cfg: AlignSection (credit_temperature T, mixing_coefficient eta, box).
    Returns: Allocation (projection_active per trajectory in order of appearance).
    """
    g = np.asarray(turn_gap_R, dtype=np.float64)
    N = np.asarray(token_count_R, dtype=np.int64)
    span = np.asarray(span_R, dtype=np.int64)
    traj = np.asarray(traj_R)
    T = float(cfg.credit_temperature)
    s = np.asarray(sign_R, dtype=np.float64) * g
    R = g.shape[0]
    n_spans = int(span.max()) + 1 if R else 0
    budget_S = np.zeros(n_spans, dtype=np.float64)
    q = np.zeros(R, dtype=np.float64)
    h = np.ones(R, dtype=np.float64)
    hp = np.ones(R, dtype=np.float64)
    n_traj = _group_starts(traj)[0].shape[0] if R else 0
    active_T = np.zeros(n_traj, dtype=bool)
    u = np.flatnonzero(N > 0)
    if u.size:
        su, Nu, span_u, traj_u = s[u], N[u].astype(np.float64), span[u], traj[u]
        st_m, m_of = _group_starts(span_u)
        mass_m = np.add.reduceat(Nu, st_m)
        score_m = np.add.reduceat(su, st_m) / np.diff(np.append(st_m, u.size))
        # s / T overflows to +-inf for a tiny T; the softmaxes take that limit without NaN.
        with np.errstate(over="ignore"):
            b_m = _segment_softmax(np.log(mass_m) + score_m / T, traj_u[st_m])
            q_u = _segment_softmax(np.log(Nu) + su / T, span_u)
        budget_S[span_u[st_m]] = b_m
        st_t, t_of = _group_starts(traj_u)
        total_u = np.add.reduceat(Nu, st_t)[t_of]
        h_u = total_u * b_m[m_of] * q_u / Nu
        lo, hi = density_bounds(cfg)
        hp_u, act = _project_groups(h_u, Nu, traj_u, lo, hi)
        q[u], h[u], hp[u] = q_u, h_u, hp_u
        active_T[_group_starts(traj)[1][u][st_t]] = act  # the trajectories that have loss tokens
    eta = float(cfg.mixing_coefficient)
    W = (1.0 - eta) + eta * hp
    W[N == 0] = 1.0
    f32 = np.float32
    return Allocation(
        s.astype(f32), budget_S.astype(f32), q.astype(f32), h.astype(f32), hp.astype(f32), W.astype(f32), active_T
    )


def allocate(
    turn_gap_K: np.ndarray,
    token_count_K: np.ndarray,
    advantage: float,
    spans: Sequence[tuple[int, int]],
    cfg: AlignSection,
) -> Allocation:
    """Span and turn weights W_k of ONE trajectory (spec §4.4): `allocate_rows` with
    its K turns, sign(advantage) and local spans (start, stop) covering 0..K-1 in order.

    Returns: Allocation (projection_active: bool [1]).
    Raises: ValueError if spans do not partition the K turns or N_k < 0.
    """
    g = np.asarray(turn_gap_K, dtype=np.float64)
    N = np.asarray(token_count_K, dtype=np.int64)
    K = g.shape[0]
    if N.shape != (K,) or (N < 0).any():
        raise ValueError("token_count_K must be non-negative with one entry per turn")
    if [i for a, b in spans for i in range(a, b)] != list(range(K)):
        raise ValueError(f"spans {list(spans)} do not partition {K} turns in order")
    span_K = np.repeat(np.arange(len(spans)), [b - a for a, b in spans])
    sign_K = np.full(K, float(np.sign(np.float32(advantage))))
    return allocate_rows(g, N, sign_K, span_K, np.zeros(K, dtype=np.int64), cfg)


def invalid_action_residual(
    rewards_M: np.ndarray,
    is_action_valid_M: np.ndarray,
    task_id: Sequence[str],
    coef: float,
    norm_by_std: bool = True,
    singleton: Singleton = "zero",
) -> np.ndarray:
    """Invalid-action residual per turn row (spec §4.4, reference variant):
    z(R - coef * invalid) - z(R), z over all turn rows of each task with the
    unbiased std + 1e-6 (`group_zscore`; a one-row task follows `singleton`).

    Args: rewards_M float [M] raw episode reward per row; is_action_valid_M bool [M];
      task_id length M; coef >= 0.
    Returns: float32 [M], added to every loss token of the turn.
    """
    r = np.asarray(rewards_M, dtype=np.float64)
    invalid = ~np.asarray(is_action_valid_M, dtype=bool)
    pure = group_zscore(r, task_id, norm_by_std, singleton).astype(np.float64)
    penalised = group_zscore(r - coef * invalid, task_id, norm_by_std, singleton).astype(np.float64)
    return (penalised - pure).astype(np.float32)


def token_level_weights(
    gap_ML: np.ndarray,
    mask_ML: np.ndarray,
    sign_M: np.ndarray,
    traj_M: np.ndarray,
    cfg: AlignSection,
    mix: bool = True,
) -> tuple[np.ndarray, Allocation]:
    """Ablation B, token-level allocation (spec §4.4 "Ablations"), per trajectory.

    Every loss token r of trajectory i is its own unit (N = 1), with no spans
    and no turns: q_r = softmax_r(sign(A_i) gap_r / T) over the trajectory's
    loss tokens, raw density h_r = N_total q_r, h' = `project_density`(h, 1,
    box), token weight w_r = (1 - eta) + eta h'_r (`mix=False`: w_r = h'_r, as
    the released code does). The w_r of a trajectory's loss tokens sum to
    N_total, so the turn means W_k = mean_{r in k} w_r keep sum N_k W_k = sum N_k.

    Args: gap_ML float [M, L] corrected gap; mask_ML bool [M, L]; sign_M float
      [M] sign of A_i; traj_M int [M] contiguous trajectory ids; cfg (T, eta, box).
    Returns: (token_weight_ML float32 [M, L], 1 off the mask; Allocation over
      the M turns: score = sign(A) g_k, within_budget = sum of the turn's q_r,
      raw/projected density and weight = the turn's token means of h, h', w
      (1 for a turn without loss tokens), segment_budget_S empty).
    """
    mask = np.asarray(mask_ML, dtype=bool)
    M, L = mask.shape
    flat = np.flatnonzero(mask.ravel())
    row = flat // max(L, 1)
    sign = np.asarray(sign_M, dtype=np.float64)
    gap = np.asarray(gap_ML, dtype=np.float32).ravel()[flat].astype(np.float64)
    N = mask.sum(axis=1)
    w_ML = np.ones((M, L), dtype=np.float32)
    sums = np.zeros((5, M), dtype=np.float64)
    n_traj = _group_starts(np.asarray(traj_M))[0].shape[0] if M else 0
    active = np.zeros(n_traj, dtype=bool)
    if flat.size:
        traj_r = np.asarray(traj_M)[row]
        s_r = sign[row] * gap
        with np.errstate(over="ignore"):
            q_r = _segment_softmax(s_r / float(cfg.credit_temperature), traj_r)
        st, t_of = _group_starts(traj_r)
        h_r = np.diff(np.append(st, flat.size))[t_of] * q_r
        hp_r, act = _project_groups(h_r, np.ones_like(h_r), traj_r, *density_bounds(cfg))
        active[_group_starts(np.asarray(traj_M))[1][row[st]]] = act
        eta = float(cfg.mixing_coefficient) if mix else 1.0
        w_r = (1.0 - eta) + eta * hp_r
        w_ML.ravel()[flat] = w_r
        for i, v in enumerate((gap, q_r, h_r, hp_r, w_r)):
            sums[i] = np.bincount(row, weights=v, minlength=M)
    means = np.where(N > 0, sums / np.maximum(N, 1), 1.0)
    f32 = np.float32
    alloc = Allocation(
        score_K=(sign * means[0] * (N > 0)).astype(f32),
        segment_budget_S=np.zeros(0, f32),
        within_budget_K=sums[1].astype(f32),
        raw_density_K=means[2].astype(f32),
        projected_density_K=means[3].astype(f32),
        weight_K=means[4].astype(f32),
        projection_active=active,
    )
    return w_ML, alloc


# ---------------------------------------------------------------- composition


@dataclass
class AlignCredit:
    """Every intermediate of `alignopsd_credit` (names follow the refvector fields).

    Arrays are over the M canonical rows unless noted; [M, L] arrays are 0 off
    the loss mask except corrected_gap_ML (the raw gap, as the reference keeps
    it) and token_weight_ML (token-level ablation only, else None).
    Ablations B/C have no spans: segmentations and segment_budget_S are
    empty, segment_index_M is -1, profiles are zero and the threshold is +inf.
    """

    trajectory_advantage_M: np.ndarray
    corrected_gap_ML: np.ndarray
    profiles_MM: np.ndarray
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
    where no source), batch.similarity_MM (H, source x target) and
    batch.eligible_MM. Steps: GRPO advantage A_i on the trajectory's episode
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
      similarity_MM and eligible_MM unless B/C) or has the wrong shape, a
      non-finite gap on a loss token or similarity, eligibility across tasks
      or, with empty_turns="error", a turn without loss tokens.
    """
    acfg = cfg.alignopsd
    mode = acfg.ablation
    spans_mode = mode not in ("token_level", "turn_level")
    teacher_field = "teacher_logprobs_ML" if mode == "no_rectification" else "corrected_logprobs_ML"
    needed = [teacher_field] + (["similarity_MM", "eligible_MM"] if spans_mode else [])
    missing = [nm for nm in needed if getattr(batch, nm) is None]
    if missing:
        raise ValueError(f"alignopsd (ablation {mode!r}) needs CreditBatch fields {missing} (got None)")
    _require_canonical(batch)
    M = batch.num_rows
    shape_ML = np.shape(batch.loss_mask_ML)
    for nm in (teacher_field, "student_logprobs_ML"):
        if np.shape(getattr(batch, nm)) != shape_ML or len(shape_ML) != 2 or shape_ML[0] != M:
            raise ValueError(f"CreditBatch.{nm} {np.shape(getattr(batch, nm))} and loss_mask_ML {shape_ML} must be [{M}, L]")
    for nm in needed[1:]:
        if np.shape(getattr(batch, nm)) != (M, M):
            raise ValueError(f"CreditBatch.{nm} must be ({M}, {M}), got {np.shape(getattr(batch, nm))}")
    mask_ML = np.asarray(batch.loss_mask_ML).astype(bool)
    maskf_ML = mask_ML.astype(np.float32)
    N_M = mask_ML.sum(axis=1).astype(np.int64)
    if empty_turns == "error" and (N_M == 0).any():
        raise ValueError(f"turns without policy-loss tokens: rows {np.flatnonzero(N_M == 0).tolist()}")

    traj_M, keys = trajectory_index(batch.task_id, batch.rollout_id)
    t_starts = _group_starts(traj_M)[0] if M else np.zeros(0, np.int64)
    bounds = list(zip(t_starts.tolist(), t_starts[1:].tolist() + [M]))
    rows_by_traj = [np.arange(a, b) for a, b in bounds]
    raw_reward_M = np.asarray(batch.episode_reward, dtype=np.float32).astype(np.float64)
    n_T = np.bincount(traj_M, minlength=len(keys))
    reward_T = np.bincount(traj_M, weights=raw_reward_M, minlength=len(keys)) / np.maximum(n_T, 1)
    varying = int((np.add.reduceat(np.abs(raw_reward_M - reward_T[traj_M]), t_starts) > 0).sum()) if M else 0
    # float32 like the raw rewards: a trajectory's identical rows then z-score exactly (std 0 -> A = 0).
    rewards_M = reward_T.astype(np.float32)[traj_M]  # = the raw reward for a constant-reward trajectory
    A_M = grpo_sequence_advantage(rewards_M, batch.task_id, batch.rollout_id, cfg.grpo_scope, cfg.norm_adv_by_std, singleton)
    sign_M = np.sign(A_M).astype(np.float64)

    teacher = np.asarray(getattr(batch, teacher_field), dtype=np.float32)
    student = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        gap_ML = (teacher.astype(np.float64) - student).astype(np.float32)
    gap_on_mask = np.where(mask_ML, gap_ML, np.float32(0.0))
    gap_sum_M = gap_on_mask.sum(axis=1, dtype=np.float64)
    if not np.isfinite(gap_sum_M).all():
        raise ValueError("the teacher-student gap is NaN or inf on a loss token")
    g_M = (gap_sum_M / np.maximum(N_M, 1)).astype(np.float32)

    single = sum(1 for n in Counter(k[0] for k in keys).values() if n == 1)
    n_spans = 0
    pvalid = np.zeros(M, dtype=bool)
    D = np.zeros(M, dtype=np.float32)
    bvalid = np.zeros(M, dtype=bool)
    tau = math.inf
    segs: list[Segmentation] = []
    seg_index = np.full(M, -1, dtype=np.int64)
    token_weight_ML = None
    if spans_mode:
        H = np.asarray(batch.similarity_MM)
        E = np.asarray(batch.eligible_MM, dtype=bool)
        blocks = task_blocks(batch.task_id)
        P, pvalid = dense_profiles(H, E, acfg, blocks)
        D, bvalid = boundary_distances(P, pvalid, E, traj_M, blocks)
        tau = segmentation_threshold(D, bvalid, acfg)
        for j, ((a, b), key) in enumerate(zip(bounds, keys)):
            preset = None
            if mode == "random_spans":
                seed = acfg.ablation_seed + j if reference_ablations else _stable_seed(acfg.ablation_seed, key)
                preset = random_boundaries(b - a, acfg, random.Random(seed))
            seg = segment_trajectory(D[a:b], bvalid[a:b], tau, acfg, preset)
            segs.append(seg)
            for lo_, hi_ in seg.spans:
                seg_index[a + lo_ : a + hi_] = n_spans
                n_spans += 1
    else:
        P = np.zeros((M, M), dtype=np.float32)  # B, C: no profiles (calloc, never touched)
    if mode == "token_level":
        token_weight_ML, alloc = token_level_weights(gap_ML, mask_ML, sign_M, traj_M, acfg, mix=not reference_ablations)
        if reference_ablations:  # the released code reports the turn weight in all four fields
            alloc.within_budget_K = alloc.raw_density_K = alloc.projected_density_K = alloc.weight_K
        m2_ML = (maskf_ML * A_M[:, None] * token_weight_ML).astype(np.float32)
    else:
        alloc = allocate_rows(g_M, N_M, sign_M, seg_index if spans_mode else traj_M, traj_M, acfg)
        m2_ML = (maskf_ML * (A_M * alloc.weight_K)[:, None]).astype(np.float32)
    W = alloc.weight_K
    if cfg.use_invalid_action_penalty:
        resid_M = invalid_action_residual(
            rewards_M, batch.is_action_valid, batch.task_id, cfg.invalid_action_penalty_coef, cfg.norm_adv_by_std, singleton
        )
    else:
        resid_M = np.zeros(M, np.float32)
    final_ML = (m2_ML + maskf_ML * resid_M[:, None]).astype(np.float32)

    n_tok = float(N_M.sum())
    adjacent = M - len(keys)
    metrics = {
        "alignopsd/turns": float(M),
        "alignopsd/trajectories": float(len(keys)),
        "alignopsd/turns_without_loss_tokens": float((N_M == 0).sum()),
        "alignopsd/single_trajectory_tasks": float(single),
        "alignopsd/trajectories_with_varying_reward": float(varying),
        "alignopsd/num_spans": float(n_spans),
        "alignopsd/mean_span_turns": float(M / n_spans) if n_spans else 0.0,
        "alignopsd/threshold": float(tau) if math.isfinite(tau) else 0.0,
        "alignopsd/threshold_inf": float(not math.isfinite(tau)),
        "alignopsd/profile_valid_rate": float(pvalid.mean()) if M else 0.0,
        "alignopsd/valid_boundary_rate": float(bvalid.sum() / adjacent) if adjacent else 0.0,
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
        with np.errstate(invalid="ignore", over="ignore"):
            ident_gap = np.where(mask_ML, ident.astype(np.float64) - student, 0.0)
        metrics["alignopsd/mean_identity_gap"] = float(ident_gap.sum() / n_tok)
    return AlignCredit(
        trajectory_advantage_M=A_M,
        corrected_gap_ML=gap_ML,
        profiles_MM=P,
        profile_valid_M=pvalid,
        distance_M=D,
        boundary_valid_M=bvalid,
        threshold=tau,
        trajectories=keys,
        trajectory_rows=rows_by_traj,
        segmentations=segs,
        segment_index_M=seg_index,
        turn_gap_M=g_M,
        token_count_M=N_M,
        outcome_aligned_score_M=alloc.score_K,
        segment_budget_S=alloc.segment_budget_S if spans_mode else np.zeros(0, np.float32),
        within_segment_turn_budget_M=alloc.within_budget_K,
        raw_density_M=alloc.raw_density_K,
        projected_density_M=alloc.projected_density_K,
        turn_weight_M=W,
        m2_token_advantage_ML=m2_ML,
        residual_M=resid_M,
        final_token_advantage_ML=final_ML,
        metrics=metrics,
        token_weight_ML=token_weight_ML,
    )


@register("alignopsd")
def alignopsd_estimator(batch: CreditBatch, cfg: CreditSection) -> tuple[np.ndarray, dict[str, float]]:
    """Registered `alignopsd` (spec §4): `alignopsd_credit` with the product
    settings (one-row groups -> 0, turns without loss tokens -> weight 1,
    cfg.alignopsd.ablation as documented there).
    Returns (final token advantages float32 [M, L], metrics)."""
    out = alignopsd_credit(batch, cfg)
    return out.final_token_advantage_ML, out.metrics
