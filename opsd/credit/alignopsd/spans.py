"""AlignOPSD spans and allocation (spec §4.3-4.4), the trainer's part, one task's turns at a time.

- §4.3: `dense_profiles` (each turn's profile over its eligible siblings),
  `boundary_distances` (JSD between consecutive profiles),
  `segmentation_threshold` and `segment_trajectory` (semi-Markov spans).
- §4.4: `allocate_rows` (`project_density`): the trajectory's budget over
  spans, then over the turns of a span, projected to the density bounds;
  `invalid_action_residual`; the ablations' `random_boundaries` and
  `token_level_weights`.

Speed: pairwise work runs per task (every pair lies inside one task) in
chunks of rows, and the allocation runs over all trajectories at once
(segmented softmax and a batched bisection). Conventions: see
opsd/credit/alignopsd/__init__.py.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from opsd.config import AlignSection
from opsd.credit.grpo import Singleton, group_zscore

_CHUNK = 512  # rows per vectorized step over a task's [m, m] block: bounds temporaries, not results

# ---------------------------------------------------------------- trainer (§4.3)


def task_blocks(task_id: Sequence[str]) -> list[tuple[int, int]]:
    """(start, stop) row range of each task, rows grouped by task as in canonical order.

    Every pair the trainer reads (eligibility, similarity, adjacent turns) lies
    inside one task, so the pairwise work is done per task: ~(M/G)^2 per task
    instead of M^2 per target, and memory of one task's turns.
    Raises: ValueError if a task's rows are not contiguous.
    """
    ids = [str(x) for x in task_id]
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] if ids else []
    blocks = list(zip(starts, starts[1:] + [len(ids)]))
    if len({ids[a] for a, _ in blocks}) != len(blocks):
        raise ValueError("the rows of each task must be contiguous (canonical order)")
    return blocks


def dense_profiles(H_MM: np.ndarray, eligible_MM: np.ndarray, cfg: AlignSection) -> tuple[np.ndarray, np.ndarray]:
    """P_t = softmax_s(H[s, t] / cfg.profile_temperature) over ALL eligible s (spec §4.3), for the M turns of
    one task (a CreditBatch's pair block; a whole batch's [M, M] arrays give the same rows when they are
    zero across tasks).

    Args: H_MM float [M, M] (source, target), eligible_MM bool [M, M].
    Returns: (profiles_MM float32 [target, source], zero rows where nothing is
      eligible; valid_M bool [M]: something eligible and max eligible H >= gamma_H).
    Raises: ValueError on non-finite H.
    """
    H = np.asarray(H_MM)
    E = np.asarray(eligible_MM, dtype=bool)
    M = H.shape[0]
    P = np.zeros((M, M), dtype=np.float32)
    valid = np.zeros(M, dtype=bool)
    for c in range(0, M, _CHUNK):  # targets c:d, so temporaries stay [_CHUNK, M] however large a task
        d = min(c + _CHUNK, M)
        E_ts = E[:, c:d].T
        has = E_ts.any(axis=1)
        if not has.any():
            continue
        H_ts = H[:, c:d].T.astype(np.float64)
        if not np.isfinite(H_ts).all():
            raise ValueError("similarity_MM contains NaN or inf")
        z = np.where(E_ts, H_ts, -np.inf)
        top = z.max(axis=1, keepdims=True)
        top[~has] = 0.0
        # Max subtracted BEFORE dividing: a tiny temperature gives the one-hot limit, not NaN.
        with np.errstate(over="ignore", under="ignore"):
            w = np.exp((z - top) / cfg.profile_temperature)
        w /= np.where(has, w.sum(axis=1), 1.0)[:, None]
        P[c:d] = w
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
) -> tuple[np.ndarray, np.ndarray]:
    """D_k = JSD(P_{k-1}, P_k) at each turn k > 0 of a trajectory (spec §4.3), for the M turns of one task
    (or a whole batch whose arrays are zero across tasks: the same values).

    Valid only when both profiles are valid and turns k-1 and k have exactly
    the same eligible source set (a change in who is eligible is not
    evidence of a decision boundary).

    Args: profiles_MM float [target, source]; profile_valid_M bool [M];
      eligible_MM bool [source, target]; traj_M int [M] trajectory of each row,
      rows in canonical order (a trajectory's turns are consecutive rows).
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
    if k_all.size == 0:
        return D, valid
    # sum P log P once per profile; each pair then needs only its mixture's term (see _jsd_rows).
    xlogx = np.concatenate([_xlogx_sum(P[c : c + _CHUNK].astype(np.float64)) for c in range(0, M, _CHUNK)])
    for i in range(0, k_all.size, _CHUNK):
        k = k_all[i : i + _CHUNK]
        k = k[(E[:, k - 1] == E[:, k]).all(axis=0)]
        D[k] = _jsd_rows(P[k - 1], P[k], xlogx[k - 1], xlogx[k])
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


def group_starts(gid_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    starts, grp = group_starts(np.asarray(gid_R))
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
    starts, grp = group_starts(np.asarray(gid_R))
    active_G = ~np.logical_and.reduceat((h >= lo) & (h <= hi), starts)
    if not active_G.any():
        return out, active_G
    rows = active_G[grp]
    hr, Nr = h[rows], N[rows]
    st, g = group_starts(grp[rows])
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
    n_traj = group_starts(traj)[0].shape[0] if R else 0
    active_T = np.zeros(n_traj, dtype=bool)
    u = np.flatnonzero(N > 0)
    if u.size:
        su, Nu, span_u, traj_u = s[u], N[u].astype(np.float64), span[u], traj[u]
        st_m, m_of = group_starts(span_u)
        mass_m = np.add.reduceat(Nu, st_m)
        score_m = np.add.reduceat(su, st_m) / np.diff(np.append(st_m, u.size))
        # s / T overflows to +-inf for a tiny T; the softmaxes take that limit without NaN.
        with np.errstate(over="ignore"):
            b_m = _segment_softmax(np.log(mass_m) + score_m / T, traj_u[st_m])
            q_u = _segment_softmax(np.log(Nu) + su / T, span_u)
        budget_S[span_u[st_m]] = b_m
        st_t, t_of = group_starts(traj_u)
        total_u = np.add.reduceat(Nu, st_t)[t_of]
        h_u = total_u * b_m[m_of] * q_u / Nu
        lo, hi = density_bounds(cfg)
        hp_u, act = _project_groups(h_u, Nu, traj_u, lo, hi)
        q[u], h[u], hp[u] = q_u, h_u, hp_u
        active_T[group_starts(traj)[1][u][st_t]] = act  # the trajectories that have loss tokens
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
    n_traj = group_starts(np.asarray(traj_M))[0].shape[0] if M else 0
    active = np.zeros(n_traj, dtype=bool)
    if flat.size:
        traj_r = np.asarray(traj_M)[row]
        s_r = sign[row] * gap
        with np.errstate(over="ignore"):
            q_r = _segment_softmax(s_r / float(cfg.credit_temperature), traj_r)
        st, t_of = group_starts(traj_r)
        h_r = np.diff(np.append(st, flat.size))[t_of] * q_r
        hp_r, act = _project_groups(h_r, np.ones_like(h_r), traj_r, *density_bounds(cfg))
        active[group_starts(np.asarray(traj_M))[1][row[st]]] = act
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
