"""AlignOPSD: decision-aligned rectification + semi-Markov span credit (spec §4).

The pipeline runs these pieces in different services, so each is a pure
function named after the role that calls it:

- embedder (§4.1): `similarity_matrix`, `structural_mask`,
  `select_sources` (threshold, one source per sibling rollout, top-K, action
  filter, weights, rho, alpha).
- teacher (§4.2): `rectify` (probability mixture / log mean of the matched
  sibling teachers, blended with the identity view by alpha).
- trainer (§4.3-4.4): `dense_profiles`, `boundary_distances`,
  `segmentation_threshold`, `segment_trajectory`, `allocate`
  (`project_density`), `invalid_action_residual`, composed by
  `alignopsd_credit` and the registered `alignopsd` estimator.

`opsd.credit.reference.run_reference_case` runs a refvector file through
exactly these functions.

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

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from opsd.config import AlignSection, CreditSection
from opsd.credit import register
from opsd.credit.grpo import Singleton, canonical_permutation, group_zscore, grpo_sequence_advantage, trajectory_index
from opsd.types import CreditBatch

EmptyTurns = Literal["weight_one", "error"]

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
    rho = sum omega * clip((H - gamma)/(1 - gamma), 0, 1); alpha = clip(alpha_max * rho, 0, alpha_max).

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
    alpha_M = np.clip(cfg.alpha_max * rho_M, 0.0, cfg.alpha_max)
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


def dense_profiles(H_MM: np.ndarray, eligible_MM: np.ndarray, cfg: AlignSection) -> tuple[np.ndarray, np.ndarray]:
    """P_t = softmax_s(H[s, t] / cfg.profile_temperature) over ALL eligible s (spec §4.3).

    Args: H_MM float [M, M] (source, target), eligible_MM bool [M, M].
    Returns: (profiles_MM float32 [target, source], zero rows where nothing is
      eligible; valid_M bool [M]: something eligible and max eligible H >= gamma_H).
    """
    H = np.asarray(H_MM, dtype=np.float32)
    E = np.asarray(eligible_MM, dtype=bool)
    M = H.shape[0]
    P = np.zeros((M, M), dtype=np.float32)  # [M, M] can be large: no float64 copy
    valid = np.zeros(M, dtype=bool)
    for t in range(M):
        src = np.flatnonzero(E[:, t])
        if src.size == 0:
            continue
        P[t, src] = _softmax(H[src, t], cfg.profile_temperature)
        valid[t] = bool(H[src, t].max() >= cfg.similarity_threshold)
    return P, valid


def jsd_normalized(p_N: np.ndarray, q_N: np.ndarray) -> float:
    """Jensen-Shannon divergence with natural logs divided by ln 2, clamped to [0, 1] (spec §4.3)."""
    p = np.asarray(p_N, dtype=np.float64)
    q = np.asarray(q_N, dtype=np.float64)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        pos = a > 0  # 0 log 0 = 0; m > 0 wherever a > 0
        return float((a[pos] * (np.log(a[pos]) - np.log(m[pos]))).sum())

    return min(max(0.5 * (kl(p) + kl(q)) / math.log(2.0), 0.0), 1.0)


def boundary_distances(
    profiles_MM: np.ndarray,
    profile_valid_M: np.ndarray,
    eligible_MM: np.ndarray,
    traj_M: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """D_k = JSD(P_{k-1}, P_k) at each turn k > 0 of a trajectory (spec §4.3).

    Valid only when both profiles are valid and turns k-1 and k have exactly
    the same eligible source set (a change in who is eligible is not
    evidence of a decision boundary).

    Args: profiles_MM float [target, source]; profile_valid_M bool [M];
      eligible_MM bool [source, target]; traj_M int [M] trajectory of each row,
      rows in canonical order (a trajectory's turns are consecutive rows).
    Returns: (D_M float32 [M], 0 where invalid; valid_M bool [M]).
    """
    P = np.asarray(profiles_MM, dtype=np.float32)
    pv = np.asarray(profile_valid_M, dtype=bool)
    E = np.asarray(eligible_MM, dtype=bool)
    traj = np.asarray(traj_M)
    M = traj.shape[0]
    D = np.zeros(M, dtype=np.float32)
    valid = np.zeros(M, dtype=bool)
    for k in range(1, M):
        if traj[k] != traj[k - 1] or not (pv[k - 1] and pv[k]):
            continue
        if not np.array_equal(E[:, k - 1], E[:, k]):
            continue
        valid[k] = True
        D[k] = jsd_normalized(P[k - 1], P[k])
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
    and the boundary positions (local index of a span's first turn) by kind."""

    spans: list[tuple[int, int]]
    semantic: list[int] = field(default_factory=list)
    guided_fallback: list[int] = field(default_factory=list)
    forced_max: list[int] = field(default_factory=list)


def segment_trajectory(D_K: np.ndarray, valid_K: np.ndarray, threshold: float, cfg: AlignSection) -> Segmentation:
    """Split one trajectory's K turns into spans (spec §4.3 "Segmentation").

    1. semantic: candidates k with valid D_k > threshold, tried in order
       (-D, k); accepted when both pieces of the span it falls in keep
       >= cfg.min_segment_turns turns.
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
    cuts = {0, K}
    out = Segmentation(spans=[])

    def around(p: int) -> tuple[int, int]:
        return max(c for c in cuts if c < p), min(c for c in cuts if c > p)

    cands = [k for k in range(1, K) if valid[k] and float(D[k]) > threshold]
    for p in sorted(cands, key=lambda k: (-float(D[k]), k)):
        left, right = around(p)
        if p - left >= lmin and right - p >= lmin:
            cuts.add(p)
            out.semantic.append(p)
    while True:
        ordered = sorted(cuts)
        long_span = next(((a, b) for a, b in zip(ordered, ordered[1:]) if b - a > lmax), None)
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
        cuts.add(p)
    ordered = sorted(cuts)
    out.spans = list(zip(ordered, ordered[1:]))
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
    h = np.asarray(h_K, dtype=np.float64)
    N = np.asarray(N_K, dtype=np.float64)
    if not lo <= 1.0 <= hi:
        raise ValueError(f"density box [{lo}, {hi}] must contain 1, or the token budget cannot be kept")
    if (N <= 0).any():
        raise ValueError("project_density needs positive token counts")
    if ((h >= lo) & (h <= hi)).all():
        return h.copy()
    target = N.sum()
    tol = tol_rel * max(target, 1.0)
    a, b = float((h - hi).min()), float((h - lo).max())
    for _ in range(max_iter):
        lam = 0.5 * (a + b)
        budget = (N * np.clip(h - lam, lo, hi)).sum()
        if abs(budget - target) <= tol:
            a = b = lam
            break
        if budget > target:
            a = lam
        else:
            b = lam
    out = np.clip(h - 0.5 * (a + b), lo, hi)
    for _ in range(3):
        residual = target - (N * out).sum()
        free = (out > lo) & (out < hi)
        if abs(residual) <= tol or not free.any():
            break
        out[free] += residual / N[free].sum()
    return np.clip(out, lo, hi)


@dataclass
class Allocation:
    """Hierarchical allocation of one trajectory (spec §4.4); arrays [K] float32 unless noted.

    score_K = sign(A) g_k; segment_budget_S = b_m per span; within_budget_K =
    q_k; raw_density_K = h_k; projected_density_K = h'_k; weight_K = W_k;
    projection_active: some h_k fell outside the box. Excluded (N_k = 0) turns
    have q = 0, h = h' = W = 1.
    """

    score_K: np.ndarray
    segment_budget_S: np.ndarray
    within_budget_K: np.ndarray
    raw_density_K: np.ndarray
    projected_density_K: np.ndarray
    weight_K: np.ndarray
    projection_active: bool


def allocate(
    turn_gap_K: np.ndarray,
    token_count_K: np.ndarray,
    advantage: float,
    spans: Sequence[tuple[int, int]],
    cfg: AlignSection,
) -> Allocation:
    """Span and turn weights W_k of one trajectory (spec §4.4).

    s_k = sign(A) g_k; span mass M_m = sum N_k; span score = mean of s_k;
    b_m = softmax_m(log M_m + score_m / T); q_k = softmax_{k in m}(log N_k + s_k / T);
    h_k = N_total b_m q_k / N_k; h' = project_density(h, N, box);
    W_k = (1 - eta) + eta h'_k, so sum N_k W_k = sum N_k.

    Args:
      turn_gap_K: float [K] g_k, mean corrected gap over the turn's loss tokens.
      token_count_K: int [K] N_k. Turns with N_k = 0 are left out (W = 1).
      advantage: the trajectory's GRPO advantage A_i (only its sign matters).
      spans: (start, stop) local spans covering 0..K-1 in order.
      cfg: AlignSection (credit_temperature T, mixing_coefficient eta, box).
    Returns: Allocation. Raises: ValueError if spans do not partition the K turns.
    """
    g = np.asarray(turn_gap_K, dtype=np.float64)
    N = np.asarray(token_count_K, dtype=np.int64)
    K = g.shape[0]
    if N.shape != (K,) or (N < 0).any():
        raise ValueError("token_count_K must be non-negative with one entry per turn")
    if [i for a, b in spans for i in range(a, b)] != list(range(K)):
        raise ValueError(f"spans {list(spans)} do not partition {K} turns in order")
    T = float(cfg.credit_temperature)
    s = float(np.sign(np.float32(advantage))) * g
    used = N > 0
    Nf = N.astype(np.float64)
    budget_S = np.zeros(len(spans), dtype=np.float64)
    q = np.zeros(K, dtype=np.float64)
    h = np.ones(K, dtype=np.float64)
    live = [m for m, (a, b) in enumerate(spans) if used[a:b].any()]
    if live:
        logits = []
        # s / T overflows to +-inf for a tiny T; `_softmax` takes that limit without NaN.
        with np.errstate(over="ignore"):
            for m in live:
                a, b = spans[m]
                keep = np.arange(a, b)[used[a:b]]
                logits.append(math.log(Nf[keep].sum()) + s[keep].mean() / T)
            budget_S[live] = _softmax(np.asarray(logits))
            total = Nf[used].sum()
            for m in live:
                a, b = spans[m]
                keep = np.arange(a, b)[used[a:b]]
                q[keep] = _softmax(np.log(Nf[keep]) + s[keep] / T)
                h[keep] = total * budget_S[m] * q[keep] / Nf[keep]
    lo, hi = density_bounds(cfg)
    hp = h.copy()
    active = False
    if used.any():
        active = bool(((h[used] < lo) | (h[used] > hi)).any())
        hp[used] = project_density(h[used], Nf[used], lo, hi)
    eta = float(cfg.mixing_coefficient)
    W = (1.0 - eta) + eta * hp
    W[~used] = 1.0
    f32 = np.float32
    return Allocation(
        score_K=s.astype(f32),
        segment_budget_S=budget_S.astype(f32),
        within_budget_K=q.astype(f32),
        raw_density_K=h.astype(f32),
        projected_density_K=hp.astype(f32),
        weight_K=W.astype(f32),
        projection_active=active,
    )


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


# ---------------------------------------------------------------- composition


@dataclass
class AlignCredit:
    """Every intermediate of `alignopsd_credit` (names follow the refvector fields).

    Arrays are over the M canonical rows unless noted; [M, L] arrays are 0 off
    the loss mask except corrected_gap_ML (the raw gap, as the reference keeps it).
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


def _require_canonical(batch: CreditBatch) -> None:
    perm = canonical_permutation(batch.task_id, batch.rollout_id, batch.turn_id)
    if not np.array_equal(perm, np.arange(batch.num_rows)):
        raise ValueError(
            "alignopsd_credit needs rows in canonical order (task_id, rollout_id, turn_id); "
            "use opsd.credit.compute_advantages, which sorts them"
        )


def alignopsd_credit(
    batch: CreditBatch,
    cfg: CreditSection,
    *,
    singleton: Singleton = "zero",
    empty_turns: EmptyTurns = "weight_one",
) -> AlignCredit:
    """AlignOPSD token advantages with every intermediate (spec §4.3-4.4).

    Uses batch.corrected_logprobs_ML (rectified teacher, = identity teacher
    where no source), batch.similarity_MM (H, source x target) and
    batch.eligible_MM. Steps: GRPO advantage A_i on the raw episode rewards
    (cfg.grpo_scope, cfg.norm_adv_by_std); corrected gap; dense profiles,
    boundary distances, batch threshold, per-trajectory segmentation; turn
    gaps g_k over loss tokens; hierarchical allocation W_k; token advantage
    mask * A_i * W_k; plus the invalid-action residual on loss tokens when
    cfg.use_invalid_action_penalty.

    Args:
      batch: rows in canonical order (checked).
      cfg: CreditSection (alignopsd hyper-parameters in cfg.alignopsd).
      singleton: one-row GRPO groups, see opsd.credit.grpo.
      empty_turns: "weight_one" (product, see module docstring) or "error"
        (reference: ValueError for a turn without loss tokens).
    Returns: AlignCredit. Its metrics (flat, finite floats, "alignopsd/"
      prefix): turns, turns_without_loss_tokens, num_spans, mean_span_turns,
      threshold (0.0 when tau = +inf) and threshold_inf (1.0 then),
      profile_valid_rate, valid_boundary_rate, semantic/guided/forced
      boundary counts, mean_corrected_gap (token mean over loss tokens),
      mean_identity_gap (when teacher_logprobs_ML is given),
      projection_active_trajectories, turn_weight_min/max, residual_abs_mean.
    Raises: ValueError for a non-canonical batch, a missing field
      (corrected_logprobs_ML, similarity_MM, eligible_MM) or, with
      empty_turns="error", a turn without loss tokens.
    """
    missing = [nm for nm in ("corrected_logprobs_ML", "similarity_MM", "eligible_MM") if getattr(batch, nm) is None]
    if missing:
        raise ValueError(f"alignopsd needs CreditBatch fields {missing} (got None)")
    _require_canonical(batch)
    acfg = cfg.alignopsd
    M = batch.num_rows
    mask_ML = np.asarray(batch.loss_mask_ML).astype(bool)
    maskf_ML = mask_ML.astype(np.float32)
    N_M = mask_ML.sum(axis=1).astype(np.int64)
    if empty_turns == "error" and (N_M == 0).any():
        raise ValueError(f"turns without policy-loss tokens: rows {np.flatnonzero(N_M == 0).tolist()}")

    rewards_M = np.asarray(batch.episode_reward, dtype=np.float32)
    A_M = grpo_sequence_advantage(rewards_M, batch.task_id, batch.rollout_id, cfg.grpo_scope, cfg.norm_adv_by_std, singleton)

    corrected = np.asarray(batch.corrected_logprobs_ML, dtype=np.float32)
    student = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        gap_ML = (corrected.astype(np.float64) - student).astype(np.float32)
    gap_on_mask = np.where(mask_ML, gap_ML, 0.0).astype(np.float64)
    g_M = (gap_on_mask.sum(axis=1) / np.maximum(N_M, 1)).astype(np.float32)

    H = np.asarray(batch.similarity_MM, dtype=np.float32)
    E = np.asarray(batch.eligible_MM, dtype=bool)
    P, pvalid = dense_profiles(H, E, acfg)
    traj_M, keys = trajectory_index(batch.task_id, batch.rollout_id)
    D, bvalid = boundary_distances(P, pvalid, E, traj_M)
    tau = segmentation_threshold(D, bvalid, acfg)

    rows_by_traj = [np.flatnonzero(traj_M == j) for j in range(len(keys))]
    segs: list[Segmentation] = []
    seg_index = np.full(M, -1, dtype=np.int64)
    score = np.zeros(M, np.float32)
    within = np.zeros(M, np.float32)
    raw = np.ones(M, np.float32)
    proj = np.ones(M, np.float32)
    W = np.ones(M, np.float32)
    budgets: list[np.ndarray] = []
    n_spans = 0
    projected_trajs = 0
    for rows in rows_by_traj:
        seg = segment_trajectory(D[rows], bvalid[rows], tau, acfg)
        segs.append(seg)
        for a, b in seg.spans:
            seg_index[rows[a:b]] = n_spans
            n_spans += 1
        alloc = allocate(g_M[rows], N_M[rows], float(A_M[rows[0]]), seg.spans, acfg)
        score[rows], within[rows] = alloc.score_K, alloc.within_budget_K
        raw[rows], proj[rows], W[rows] = alloc.raw_density_K, alloc.projected_density_K, alloc.weight_K
        budgets.append(alloc.segment_budget_S)
        projected_trajs += int(alloc.projection_active)

    m2_ML = (maskf_ML * (A_M * W)[:, None]).astype(np.float32)
    if cfg.use_invalid_action_penalty:
        resid_M = invalid_action_residual(
            rewards_M, batch.is_action_valid, batch.task_id, cfg.invalid_action_penalty_coef, cfg.norm_adv_by_std, singleton
        )
    else:
        resid_M = np.zeros(M, np.float32)
    final_ML = (m2_ML + maskf_ML * resid_M[:, None]).astype(np.float32)

    n_tok = float(N_M.sum())
    adjacent = int(sum(max(len(r) - 1, 0) for r in rows_by_traj))
    metrics = {
        "alignopsd/turns": float(M),
        "alignopsd/turns_without_loss_tokens": float((N_M == 0).sum()),
        "alignopsd/num_spans": float(n_spans),
        "alignopsd/mean_span_turns": float(M / n_spans) if n_spans else 0.0,
        "alignopsd/threshold": float(tau) if math.isfinite(tau) else 0.0,
        "alignopsd/threshold_inf": float(not math.isfinite(tau)),
        "alignopsd/profile_valid_rate": float(pvalid.mean()) if M else 0.0,
        "alignopsd/valid_boundary_rate": float(bvalid.sum() / adjacent) if adjacent else 0.0,
        "alignopsd/semantic_boundaries": float(sum(len(s.semantic) for s in segs)),
        "alignopsd/guided_boundaries": float(sum(len(s.guided_fallback) for s in segs)),
        "alignopsd/forced_boundaries": float(sum(len(s.forced_max) for s in segs)),
        "alignopsd/mean_corrected_gap": float(gap_on_mask.sum() / n_tok) if n_tok else 0.0,
        "alignopsd/projection_active_trajectories": float(projected_trajs),
        "alignopsd/turn_weight_min": float(W.min()) if M else 1.0,
        "alignopsd/turn_weight_max": float(W.max()) if M else 1.0,
        "alignopsd/residual_abs_mean": float(np.abs(resid_M).mean()) if M else 0.0,
    }
    if batch.teacher_logprobs_ML is not None and n_tok:
        ident_gap = np.where(mask_ML, np.asarray(batch.teacher_logprobs_ML, np.float64) - student, 0.0)
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
        outcome_aligned_score_M=score,
        segment_budget_S=np.concatenate(budgets).astype(np.float32) if budgets else np.zeros(0, np.float32),
        within_segment_turn_budget_M=within,
        raw_density_M=raw,
        projected_density_M=proj,
        turn_weight_M=W,
        m2_token_advantage_ML=m2_ML,
        residual_M=resid_M,
        final_token_advantage_ML=final_ML,
        metrics=metrics,
    )


@register("alignopsd")
def alignopsd_estimator(batch: CreditBatch, cfg: CreditSection) -> tuple[np.ndarray, dict[str, float]]:
    """Registered `alignopsd` (spec §4): `alignopsd_credit` with the product
    settings (one-row groups -> 0, turns without loss tokens -> weight 1).
    Returns (final token advantages float32 [M, L], metrics)."""
    out = alignopsd_credit(batch, cfg)
    return out.final_token_advantage_ML, out.metrics
