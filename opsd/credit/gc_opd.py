"""GC-OPD: group-calibrated residual + RACA token credit (spec §3), and the row bookkeeping
the OPD-family baselines (opsd.credit.opd_baselines) share.

Multi-turn mapping. The paper (and SolereZhang/GC-OPD's `compute_gc_opd_tensors`)
works on single-turn responses: one batch row = one response i, its group = the
prompt's `uid`, its reward R_i = the verifier score. In this product a batch row
is one TURN of an episode, so:

- a response i is a TRAJECTORY (task_id, rollout_id): all loss tokens of all
  its turn rows;
- its group is the task (task_id), i.e. the G sibling rollouts;
- R_i is the trajectory's episode reward. Rows normally repeat the same value;
  if they differ (a caller lowered some turns' reward), R_i is the mean of the
  trajectory's rows and `gc_opd/trajectories_with_varying_reward` counts such
  trajectories. The invalid-action penalty (spec §0, a GRPO setting) is NOT
  applied: spec §3's R_i is the verifier (episode) reward.

So s_i (the masked mean OPD), the RACA statistics (mean/std of OPD over the
response's valid tokens) and the residual ρ_i are per trajectory, pooled over
its turn rows. All core functions take rows plus a per-row response index and a
per-response group index and reduce with segment sums (np.bincount), so the
product (response = trajectory) and the refvector replay (response = row; uids
-> groups; uids null -> contiguous blocks of `gc_opd_group_size`, else
`rollout_n`, as the reference does) run the same code.

Edge cases (counted in metrics, never a crash):

- a turn without loss tokens (`gc_opd/turns_without_loss_tokens`) adds
  nothing to its trajectory's sums; a trajectory without any
  (`gc_opd/trajectories_without_loss_tokens`) scores s_i = 0 (denominator
  clamped to 1, spec §3) and still takes part in its group's z-scores, as in
  the reference;
- a task with one trajectory (`gc_opd/single_trajectory_tasks`) gets ρ = 0
  (spec §3: fewer than 2 rows), so its advantage is the clipped OPD;
- a response with < 2 valid tokens or token std <= τ_T gets credit 1 (RACA
  falls back to uniform; `gc_opd/token_credit_identifiable_ratio`).

Numerics: token arithmetic in float32 as the reference; per-response and
per-group statistics in float64 from float32 inputs (within 1e-6 of the
reference's float32 values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from opsd.config import CreditSection, GCOPDSection
from opsd.credit.batch import check_batch
from opsd.credit.registry import register
from opsd.types import CreditBatch

CREDIT_MODES = ("raca", "uniform", "teacher_abs", "relative_teacher_support", "relative_opd_leverage")
_SIGN_EPS = 1e-8  # the reference's "non-zero" threshold for sign diagnostics


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class ResponseIndex:
    """Rows -> responses -> groups (see module docstring).

    response_M: int64 [M], response index of each row (0..N-1; responses are
      numbered in sorted (task_id, rollout_id) order, so any row order gives
      the same numbering).
    group_N: int64 [N], group index of each response (0..G-1).
    reward_N: float64 [N], the response's reward (mean over its rows).
    metrics: counts of the edge cases (flat dict of floats, keys without prefix).
    """

    response_M: np.ndarray
    group_N: np.ndarray
    reward_N: np.ndarray
    num_responses: int
    num_groups: int
    metrics: dict[str, float] = field(default_factory=dict)


def response_index(batch: CreditBatch, row_tokens_M: np.ndarray | None = None) -> ResponseIndex:
    """Product mapping: response = trajectory (task_id, rollout_id), group = task_id.

    Args: batch (rows in any order); row_tokens_M: optional int [M] loss
      tokens per row (for the empty-turn/empty-trajectory counts).
    Returns: ResponseIndex; reward_N = mean of the trajectory's rows'
      `episode_reward` (float64).
    Raises: ValueError if ids or episode_reward do not have one entry per row,
      or a reward is not finite.
    """
    M = batch.num_rows
    reward_M = np.asarray(batch.episode_reward, dtype=np.float64)
    if reward_M.shape != (M,) or len(batch.rollout_id) != M:
        raise ValueError(f"CreditBatch.episode_reward {reward_M.shape} and rollout_id ({len(batch.rollout_id)}) "
                         f"need one entry per row ({M})")
    if not np.isfinite(reward_M).all():
        raise ValueError("CreditBatch.episode_reward contains NaN or inf")
    if M == 0:
        empty = np.zeros(0, np.int64)
        return ResponseIndex(empty, empty, np.zeros(0), 0, 0, {
            "trajectories": 0.0, "tasks": 0.0, "single_trajectory_tasks": 0.0, "trajectories_with_varying_reward": 0.0,
            "turns_without_loss_tokens": 0.0, "trajectories_without_loss_tokens": 0.0})
    # Vectorised ids: task index t, rollout index r, response = unique (t, r) pair.
    _, task_M = np.unique(np.asarray(batch.task_id, dtype=str), return_inverse=True)
    _, roll_M = np.unique(np.asarray(batch.rollout_id, dtype=str), return_inverse=True)
    task_M, roll_M = task_M.reshape(-1).astype(np.int64), roll_M.reshape(-1).astype(np.int64)
    _, first_M, response_M = np.unique(task_M * (int(roll_M.max()) + 1) + roll_M, return_index=True, return_inverse=True)
    response_M = response_M.reshape(-1)
    N = first_M.size
    _, group_N = np.unique(task_M[first_M], return_inverse=True)
    group_N = group_N.reshape(-1).astype(np.int64)
    G = int(group_N.max()) + 1
    rows_N = np.bincount(response_M, minlength=N)
    reward_N = np.bincount(response_M, weights=reward_M, minlength=N) / rows_N
    varies_N = np.bincount(response_M, weights=reward_M != reward_M[first_M][response_M], minlength=N) > 0
    sizes_G = np.bincount(group_N, minlength=G)
    # Edge-case counts under the names every estimator uses (opsd.credit.grpo.edge_case_metrics).
    metrics = {
        "trajectories": float(N),
        "tasks": float(G),
        "single_trajectory_tasks": float((sizes_G == 1).sum()),
        "trajectories_with_varying_reward": float(varies_N.sum()),
    }
    if row_tokens_M is not None:
        tok_N = np.bincount(response_M, weights=row_tokens_M, minlength=N)
        metrics["turns_without_loss_tokens"] = float((np.asarray(row_tokens_M) == 0).sum())
        metrics["trajectories_without_loss_tokens"] = float((tok_N == 0).sum())
    return ResponseIndex(response_M, group_N, reward_N, N, G, metrics)


def masked(x_ML: np.ndarray, m_ML: np.ndarray | None, mf_ML: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`x·mask` as float32, exactly 0 off the mask even where x is inf/NaN there (padding).

    Args: x_ML float [M, L]; m_ML bool and mf_ML float32 0/1 [M, L], the same
    mask (m_ML None: derived from mf_ML if the fallback needs it); out:
    optional float32 [M, L] buffer for the result (not x_ML itself).
    A multiply is ~5x faster than np.where on a ragged mask; np.where is the
    fallback when the product's sum says some 0·inf became NaN. NaN/inf ON
    the mask stay (callers check).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.multiply(x_ML, mf_ML, out=out, dtype=np.float32)
        if not np.isfinite(y.sum()):
            y[...] = np.where(mf_ML != 0 if m_ML is None else m_ML, np.asarray(x_ML, dtype=np.float32), np.float32(0))
    return y


def masked_sum(x_ML: np.ndarray, m_ML: np.ndarray | None, mf_ML: np.ndarray) -> float:
    """Σ x over the mask (one BLAS dot pass); exact np.where fallback when x is inf/NaN off the mask.

    m_ML None: derived from mf_ML if the fallback needs it. The dot of an x
    already 0 off the mask (x·mask) with the mask gives the same float32
    result as the dot of x itself: its terms are the same.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        total = float(np.dot(np.asarray(x_ML, dtype=np.float32).ravel(), mf_ML.ravel()))
        if not np.isfinite(total):
            total = float(np.where(mf_ML != 0 if m_ML is None else m_ML, x_ML, np.float32(0)).sum(dtype=np.float64))
    return total


def loss_mask(mask_ML: Any) -> tuple[np.ndarray, np.ndarray]:
    """(m_ML bool, mf_ML float32 0/1) of a loss mask [M, L] (nonzero = loss token).

    mf_ML is the caller's array itself when that already is a float32 0/1
    mask (the batch's usual form; a [M, L] copy costs a pass plus fresh
    pages): read only, never write into it.
    """
    mask = np.asarray(mask_ML)
    m = mask != 0
    if mask.dtype == np.float32 and np.count_nonzero(mask == 1) == np.count_nonzero(m):
        return m, mask
    return m, m.astype(np.float32)


def row_counts(mf_ML: np.ndarray) -> np.ndarray:
    """int64 [M] nonzeros per row of a float32 0/1 mask: a BLAS mat-vec (exact below 2**24 per row), ~4x a bool sum."""
    return (mf_ML @ np.ones(mf_ML.shape[1], dtype=np.float32)).astype(np.int64)


@dataclass
class Gap:
    """The OPD token gap of a batch (spec §1) with its mask.

    opd_ML float32 [M, L] = (teacher − student)·mask (0 off the mask; None
    when masked_gap was asked for the row sums only);
    m_ML bool and mf_ML float32 0/1 [M, L]: the mask (mf_ML may be the
    caller's array: read only); row_tokens_M int64 [M]
    loss tokens per row; row_sum_M float32 [M] Σ OPD per row.
    """

    opd_ML: np.ndarray | None
    m_ML: np.ndarray
    mf_ML: np.ndarray
    row_tokens_M: np.ndarray
    row_sum_M: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.row_tokens_M.sum())


_BLOCK_ELEMS = 1 << 17  # elements per row block of the block-wise passes (512 KiB of float32: stays in cache)


def masked_gap(
    teacher_ML: Any, student_ML: Any, mask_ML: Any, name: str = "teacher/student", keep_opd: bool = True
) -> Gap:
    """OPD token gap `(teacher - student)·mask` (spec §1) and the mask.

    Args: teacher, student float [M, L] log-probs (nats; off-mask may be
      anything, even -inf); mask_ML 0/1 [M, L] (0/1 is validated by
      compute_advantages; here nonzero = loss token); keep_opd=False: only
      the row sums and the checks, over row blocks (no [M, L] result:
      opd_ML is None; the same row sums bit for bit).
    Returns: Gap. Raises: ValueError on shape mismatch or NaN/inf on a loss token.
    """
    t = np.asarray(teacher_ML, dtype=np.float32)
    s = np.asarray(student_ML, dtype=np.float32)
    m, mf = loss_mask(mask_ML)
    if t.ndim != 2 or t.shape != s.shape or t.shape != m.shape:
        raise ValueError(f"{name} log-probs {t.shape}/{s.shape} and mask {m.shape} must be equal [M, L] shapes")
    M, L = t.shape
    step = max(M, 1) if keep_opd else max(1, _BLOCK_ELEMS // max(L, 1))
    opd = np.empty((M, L) if keep_opd else (min(step, M), L), dtype=np.float32)
    row_sum = np.empty(M, dtype=np.float32)
    for lo in range(0, M, step):
        hi = min(lo + step, M)
        d = opd[: hi - lo]
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(t[lo:hi], s[lo:hi], out=d)
            d *= mf[lo:hi]
        row_sum[lo:hi] = d.sum(axis=1)
        # inf/NaN anywhere reaches its row sum (0·inf = NaN off the mask): one cheap check instead of a gather.
        if not np.isfinite(row_sum[lo:hi]).all():
            with np.errstate(invalid="ignore", over="ignore"):
                # Padding out; what is left is on loss tokens.
                d[...] = np.where(m[lo:hi], t[lo:hi] - s[lo:hi], np.float32(0))
            row_sum[lo:hi] = d.sum(axis=1)
            if not np.isfinite(row_sum[lo:hi]).all():
                raise ValueError(f"{name} log-probs have NaN or inf on a loss token")
    return Gap(opd if keep_opd else None, m, mf, row_counts(mf), row_sum)


def group_pairs(group_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All unordered pairs (i, j), i != j, of responses in the same group.

    Args: group_N int [N]. Returns: (i_P, j_P) int64, P = Σ_g n_g (n_g - 1) / 2.
    """
    order = np.argsort(group_N, kind="stable")
    g = np.asarray(group_N)[order]
    pos = np.arange(g.size)
    cnt = np.searchsorted(g, g, side="right") - pos - 1  # partners after each position
    i = np.repeat(pos, cnt)
    j = i + 1 + (np.arange(i.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    return order[i], order[j]


def group_zscore_population(
    x_N: np.ndarray, group_N: np.ndarray, num_groups: int, min_std: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-group z-score with the POPULATION std (spec §3 step 2).

    Args: x_N float [N]; group_N int [N]; min_std τ_G >= 0.
    Returns: (z_N float64 [N], identifiable_N bool [N]); a group with < 2
      members or std <= τ_G gets z = 0 and identifiable False.
    Two-pass variance in float64, so identical values give std exactly 0.
    """
    x = np.asarray(x_N, dtype=np.float64)
    n_G = np.bincount(group_N, minlength=num_groups)
    mean_G = np.bincount(group_N, weights=x, minlength=num_groups) / np.maximum(n_G, 1)
    dev = x - mean_G[group_N]
    std_G = np.sqrt(np.bincount(group_N, weights=dev * dev, minlength=num_groups) / np.maximum(n_G, 1))
    ident_G = (n_G >= 2) & (std_G > min_std)
    z = dev / np.where(ident_G, std_G, 1.0)[group_N]
    ident = ident_G[group_N]
    return np.where(ident, z, 0.0), ident


def order_accuracy(reward_N: np.ndarray, score_N: np.ndarray, pairs: tuple[np.ndarray, np.ndarray], eps: float) -> float:
    """Within-group pairwise ordering accuracy (the reference's `_pairwise_order_accuracy`).

    Over pairs with |ΔR| > eps and |Δscore| > eps: fraction whose score order
    agrees with the reward order; 0.5 when no pair is comparable.
    """
    i, j = pairs
    dr = reward_N[i] - reward_N[j]
    ds = score_N[i] - score_N[j]
    valid = (np.abs(dr) > eps) & (np.abs(ds) > eps)
    if not valid.any():
        return 0.5
    return float((np.sign(dr[valid]) * np.sign(ds[valid]) > 0).mean())


def _row_count(b_ML: np.ndarray) -> np.ndarray:
    """int64 [M] True per row of a bool [M, L] array: a uint16 byte sum (exact for L < 65536), ~4x a bool sum."""
    acc = np.uint16 if b_ML.shape[1] < 65536 else np.int64
    return np.add.reduce(b_ML.view(np.uint8), axis=1, dtype=acc).astype(np.int64)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else 0.0


def response_scores(gap: Gap, index: ResponseIndex) -> tuple[np.ndarray, np.ndarray]:
    """(s_N float64 [N] masked mean OPD per response, 0 without tokens; count_N float64 [N] its tokens)."""
    count_N = np.bincount(index.response_M, weights=gap.row_tokens_M, minlength=index.num_responses)
    sum_N = np.bincount(index.response_M, weights=gap.row_sum_M, minlength=index.num_responses)
    return sum_N / np.maximum(count_N, 1.0), count_N


# --------------------------------------------------------------------------- GC-OPD core


@dataclass
class GCOPDResult:
    """Outputs of `gc_opd_core` (N responses, M rows, L tokens).

    advantages_ML float32 [M, L] (0 off the mask), token_weight_ML float32
    [M, L] (credit c_t, 0 off the mask), residual_N float32 [N] (ρ_i),
    teacher_score_N float32 [N] (s_i), reward_N float64 [N], response_M int
    [M] (row -> response), metrics (the reference's `gc_opd/*` diagnostics
    plus the product's edge-case counts).
    """

    advantages_ML: np.ndarray
    token_weight_ML: np.ndarray
    residual_N: np.ndarray
    teacher_score_N: np.ndarray
    reward_N: np.ndarray
    response_M: np.ndarray
    metrics: dict[str, float]


def credit_weights(
    mode: str,
    gap: Gap,
    response_M: np.ndarray,
    score_N: np.ndarray,
    count_N: np.ndarray,
    credit_cap: float,
    min_token_std: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Token credit c_t (spec §3 step 4 and the credit ablations).

    Args: mode (CREDIT_MODES); gap (OPD and mask); response_M int [M];
      score_N float [N] masked mean OPD of each response; count_N float [N]
      its valid tokens; credit_cap c_max >= 1; min_token_std τ_T.
    Returns: (credit_ML float32 [M, L], 0 off the mask; identifiable_N bool [N]).
      raca: clamp(1 + tanh(u/2), 0, c_max) with u = (OPD - s_i)/σ_i (population
      std over the response's valid tokens); relative_teacher_support:
      clamp(1 + u); relative_opd_leverage: clamp(|u|); a response with < 2
      valid tokens or σ_i <= τ_T gets c = 1. teacher_abs: |OPD|/mean|OPD| over
      the response, capped; c = 1 if Σ|OPD| <= τ_T. uniform: c = 1.
    Raises: ValueError for an unknown mode or c_max < 1.
    """
    if credit_cap < 1.0:
        raise ValueError(f"gc_opd credit_cap must be >= 1 (the uniform fallback is 1), got {credit_cap}")
    if mode not in CREDIT_MODES:
        raise ValueError(f"unknown gc_opd credit_mode {mode!r}; known: {', '.join(CREDIT_MODES)}")
    opd, mf, N, cap = gap.opd_ML, gap.mf_ML, score_N.size, np.float32(credit_cap)
    if mode == "uniform":
        return mf.copy(), count_N > 0
    if mode == "teacher_abs":
        c = np.abs(opd)
        mass_N = np.bincount(response_M, weights=c.sum(axis=1), minlength=N)
        ident_N = (count_N > 0) & (mass_N > min_token_std)
        scale_N = np.where(ident_N, np.maximum(count_N, 1.0) / np.where(ident_N, mass_N, 1.0), 0.0)
        c *= scale_N.astype(np.float32)[response_M][:, None]
        np.minimum(c, cap, out=c)
    else:
        c = opd - score_N.astype(np.float32)[response_M][:, None]
        c *= mf  # centred OPD, 0 off the mask
        sq_N = np.bincount(response_M, weights=np.einsum("ij,ij->i", c, c), minlength=N)
        std_N = np.sqrt(sq_N / np.maximum(count_N, 1.0))
        ident_N = (count_N >= 2) & (std_N > min_token_std)
        inv_N = np.where(ident_N, 1.0 / np.where(ident_N, std_N, 1.0), 0.0)
        if mode == "raca":  # 1 + tanh(u/2): the 1/2 folds into the per-response scale
            c *= (0.5 * inv_N).astype(np.float32)[response_M][:, None]
            np.tanh(c, out=c)
            c += np.float32(1.0)  # in (0, 2): the clamp only matters for c_max < 2
            if credit_cap < 2.0:
                np.minimum(c, cap, out=c)
        else:
            c *= inv_N.astype(np.float32)[response_M][:, None]  # u, 0 off the mask
            if mode == "relative_teacher_support":
                c += np.float32(1.0)
            else:
                np.abs(c, out=c)
            np.clip(c, np.float32(0.0), cap, out=c)
        c *= mf
    fallback_M = ~ident_N[response_M]
    if fallback_M.any():  # responses without identifiable statistics: uniform credit 1
        c[fallback_M] = mf[fallback_M]
    return c, ident_N


def gc_opd_core(gap: Gap, index: ResponseIndex, gcfg: GCOPDSection) -> GCOPDResult:
    """GC-OPD advantages (spec §3 steps 1-5) over rows grouped into responses and groups.

    Args: gap: OPD = (teacher − student)·mask with the mask; index: rows ->
      responses -> groups with the responses' rewards; gcfg: β, credit mode,
      c_max, τ_G, τ_T, a_max (0 disables the clip).
    Returns: GCOPDResult; metrics carry the reference's names and definitions
      with "row" read as "response" (per-response means are over responses,
      per-token ones over all valid tokens). Grouping metrics
      (`gc_opd/group_source_*`, `gc_opd/group_size`, `gc_opd/base_ref_*`) are
      the caller's.
    Raises: ValueError for an unknown credit mode or c_max < 1.
    """
    resp, G = index.response_M, index.num_groups
    opd, reward_N = gap.opd_ML, index.reward_N
    score_N, count_N = response_scores(gap, index)  # step 1: s_i

    # Steps 2-3: residual ρ = z(R) - z(s), 0 where either z is not identifiable.
    zr_N, ident_r = group_zscore_population(reward_N, index.group_N, G, gcfg.min_group_std)
    zs_N, ident_s = group_zscore_population(score_N, index.group_N, G, gcfg.min_group_std)
    ident_N = ident_r & ident_s
    rho_N = np.where(ident_N, zr_N - zs_N, 0.0)

    # Steps 4-5: credit, residual term, clip.
    credit, tok_ident_N = credit_weights(gcfg.credit_mode, gap, resp, score_N, count_N, gcfg.credit_cap, gcfg.min_token_std)
    beta = float(gcfg.residual_beta)
    brho_M = (np.float32(beta) * rho_N.astype(np.float32))[resp]
    adv = credit * brho_M[:, None]  # the residual term, 0 off the mask
    adv += opd
    a_max = float(gcfg.adv_clip)
    n_tok = gap.num_tokens
    clip_ratio = 0.0
    if a_max > 0.0:
        lim = np.float32(a_max)
        if n_tok:  # |A| > a_max, without an |A| array
            clip_ratio = float((np.count_nonzero(adv > lim) + np.count_nonzero(adv < -lim)) / n_tok)
        np.clip(adv, -lim, lim, out=adv)

    pairs = group_pairs(index.group_N)
    order_eps = max(gcfg.min_group_std, 1e-6)
    metrics: dict[str, float] = {
        "gc_opd/enabled": 1.0,
        "gc_opd/base_correction_used": 0.0,
        "gc_opd/reward_mean": _mean(reward_N),
        "gc_opd/teacher_score_mean": _mean(score_N),
        "gc_opd/reward_z_mean": _mean(zr_N),
        "gc_opd/teacher_score_z_mean": _mean(zs_N),
        "gc_opd/residual_mean": _mean(rho_N),
        "gc_opd/residual_abs_mean": _mean(np.abs(rho_N)),
        "gc_opd/residual_std": float(rho_N.std()) if rho_N.size else 0.0,
        "gc_opd/group_identifiable_ratio": _mean(ident_N.astype(np.float64)),
        "gc_opd/token_credit_identifiable_ratio": _mean(tok_ident_N.astype(np.float64)),
        # The reference ranks by z(s) (0 where s is flat) and by the proxy z(s) + β·ρ.
        "gc_opd/order_acc_before": order_accuracy(reward_N, zs_N, pairs, order_eps),
        "gc_opd/order_acc_after_proxy": order_accuracy(reward_N, zs_N + beta * rho_N, pairs, order_eps),
        "gc_opd/residual_beta": beta,
        "gc_opd/credit_cap": float(gcfg.credit_cap),
        "gc_opd/final_adv_clip_ratio": clip_ratio,
    }
    if n_tok:
        n_off = opd.size - n_tok
        scratch = np.abs(opd)  # one [M, L] buffer for the |OPD|, OPD·final and |final| passes
        opd_abs_sum = scratch.sum()
        nz_ML = scratch > _SIGN_EPS  # |OPD| > 1e-8: OPD > 1e-8 or OPD < -1e-8
        nz_M = _row_count(nz_ML)
        pos_M = _row_count(opd > _SIGN_EPS)
        neg_M = nz_M - pos_M
        rho_M = rho_N[resp]
        has_rho_M = np.abs(rho_M) > _SIGN_EPS
        opposed = (nz_M * has_rho_M).sum()
        opposite = (np.where(rho_M > 0, neg_M, pos_M) * has_rho_M).sum()
        nonzero = nz_M.sum()
        # sign(final) != sign(OPD) for |OPD| > 1e-8  <=>  OPD·final <= 0 there.
        flip_ML = np.less_equal(np.multiply(opd, adv, out=scratch), 0)
        flips = np.count_nonzero(np.logical_and(flip_ML, nz_ML, out=flip_ML))
        credit_row_M = credit.sum(axis=1)  # credit >= 0, so |β ρ c| sums per row
        metrics.update({
            "gc_opd/credit_weight_mean": float(credit_row_M.sum() / n_tok),
            "gc_opd/credit_weight_max": float(credit.max()),  # credit >= 0 and 0 off the mask
            "gc_opd/credit_zero_ratio": float((np.count_nonzero(credit <= 0) - n_off) / n_tok),
            "gc_opd/credit_cap_ratio": float(np.count_nonzero(credit >= max(gcfg.credit_cap - 1e-6, 0.0)) / n_tok),
            "gc_opd/opd_adv_mean": float(gap.row_sum_M.sum() / n_tok),
            "gc_opd/opd_adv_abs_mean": float(opd_abs_sum / n_tok),
            "gc_opd/residual_adv_abs_mean": float((np.abs(brho_M) * credit_row_M).sum() / n_tok),
            "gc_opd/opd_residual_opposition_ratio": float(opposite / opposed) if opposed else 0.0,
            "gc_opd/final_sign_flip_ratio": float(flips / nonzero) if nonzero else 0.0,
            "gc_opd/final_adv_mean": float(adv.sum() / n_tok),
            # |clip(A, ±a)| = min(|A|, a): the clipped advantage's magnitude.
            "gc_opd/final_adv_abs_mean": float(np.abs(adv, out=scratch).sum() / n_tok),
        })
    else:
        for k in ("credit_weight_mean", "credit_weight_max", "credit_zero_ratio", "credit_cap_ratio", "opd_adv_mean",
                  "opd_adv_abs_mean", "residual_adv_abs_mean", "opd_residual_opposition_ratio",
                  "final_sign_flip_ratio", "final_adv_mean", "final_adv_abs_mean"):
            metrics[f"gc_opd/{k}"] = 0.0
    metrics.update({f"gc_opd/{k}": v for k, v in index.metrics.items()})
    return GCOPDResult(adv, credit, rho_N.astype(np.float32), score_N.astype(np.float32), reward_N, resp, metrics)


def gc_opd_credit(batch: CreditBatch, cfg: CreditSection) -> GCOPDResult:
    """GC-OPD on a CreditBatch: response = trajectory, group = task (module docstring).

    Teacher = batch.teacher_logprobs_ML (identity privileged view), student =
    batch.student_logprobs_ML, R_i = mean episode_reward of the trajectory's
    rows; settings from cfg.gc_opd. Returns GCOPDResult (arrays in the
    batch's row order). Raises: ValueError if the teacher is None, on bad
    shapes/NaN on a loss token, an unknown credit mode or c_max < 1.
    """
    if batch.teacher_logprobs_ML is None:
        raise ValueError("credit method 'gc_opd' needs CreditBatch.teacher_logprobs_ML (got None)")
    gap = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML)
    index = response_index(batch, gap.row_tokens_M)
    res = gc_opd_core(gap, index, cfg.gc_opd)
    res.metrics["gc_opd/base_ref_input_present_but_unused"] = float(batch.base_logprobs_ML is not None)
    res.metrics["gc_opd/group_source_uid"] = 1.0  # groups are always explicit task ids here
    res.metrics["gc_opd/group_source_contiguous_fallback"] = 0.0
    # The reference logs its configured rollout.n; the product's groups are explicit: their mean size.
    res.metrics["gc_opd/group_size"] = float(index.num_responses / index.num_groups) if index.num_groups else 0.0
    return res


@register("gc_opd")
def gc_opd_estimator(batch, cfg):
    """Registered `gc_opd` (spec §3): `A'_t = clip(OPD_t + β·c_t·ρ_i, ±a_max)·mask` per trajectory.

    Returns (advantages_ML float32 [M, L], metrics). See `gc_opd_credit`.
    """
    res = gc_opd_credit(batch, cfg)
    return res.advantages_ML, res.metrics


# --------------------------------------------------------------------------- refvector replay


def _cfg(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def reference_batch(
    inputs: Mapping[str, Any],
    group_labels: Sequence[str],
    reward_M: np.ndarray | None = None,
    *,
    teacher_key: str = "ref_log_prob",
    student_key: str = "old_log_prob",
) -> CreditBatch:
    """A CreditBatch in which every refvector row is its own response (one-turn trajectory).

    Args: a refvector `inputs` dict (schema: refvectors/README.md);
      group_labels: one group label per row (becomes task_id); reward_M:
      float [B] per-row reward (0 when None).
    Returns: CreditBatch, rows in file order (rollout ids are zero-padded row
      numbers, so trajectory index = row index); base log-probs and entropies
      copied when the file has them.
    """
    teacher = np.asarray(inputs[teacher_key], dtype=np.float32)
    B = teacher.shape[0]
    if len(group_labels) != B:
        raise ValueError(f"{len(group_labels)} group labels for {B} rows")

    def opt(key):
        v = inputs.get(key)
        return None if v is None else np.asarray(v, dtype=np.float32)

    batch = CreditBatch(
        task_id=[str(g) for g in group_labels],
        rollout_id=[f"{i:09d}" for i in range(B)],
        turn_id=[0] * B,
        data_source=[""] * B,
        episode_reward=np.zeros(B, np.float32) if reward_M is None else np.asarray(reward_M, dtype=np.float32),
        is_action_valid=np.ones(B, dtype=bool),
        loss_mask_ML=np.asarray(inputs["response_mask"], dtype=np.float32),
        student_logprobs_ML=np.asarray(inputs[student_key], dtype=np.float32),
        teacher_logprobs_ML=teacher,
        base_logprobs_ML=opt("base_ref_log_prob"),
        teacher_entropy_ML=opt("ref_entropys"),
        student_entropy_ML=opt("student_entropys"),
    )
    check_batch(batch, uses_pairs=False)  # the trainer's input checks, for a file too
    return batch


def gc_opd_section_from_reference_config(config: Mapping[str, Any]) -> GCOPDSection:
    """GCOPDSection from a refvector's `PolicyLossConfig` keys, with the reference's defaults.

    Mapped: gc_opd_residual_beta (default 0.05), gc_opd_credit_mode
    (default relative_opd_leverage), gc_opd_credit_cap (5), gc_opd_min_group_std
    (1e-6), gc_opd_min_token_std (1e-6), gc_opd_adv_clip (10; <= 0 disables).
    Raises: ValueError for values this product does not implement
    (gc_opd_teacher_score_agg != mean, gc_opd_residual_norm != group_zscore)
    and pydantic's ValidationError (a ValueError) for out-of-range values.
    """
    agg = str(_cfg(config, "gc_opd_teacher_score_agg", "mean")).strip().lower()
    if agg != "mean":
        raise ValueError(f"gc_opd_teacher_score_agg={agg!r} is not implemented (only 'mean')")
    norm = str(_cfg(config, "gc_opd_residual_norm", "group_zscore")).strip().lower()
    if norm != "group_zscore":
        raise ValueError(f"gc_opd_residual_norm={norm!r} is not implemented (only 'group_zscore')")
    return GCOPDSection(
        residual_beta=float(_cfg(config, "gc_opd_residual_beta", 0.05)),
        credit_mode=str(_cfg(config, "gc_opd_credit_mode", "relative_opd_leverage")).strip().lower().replace("-", "_"),
        credit_cap=float(_cfg(config, "gc_opd_credit_cap", 5.0)),
        min_group_std=float(_cfg(config, "gc_opd_min_group_std", 1e-6)),
        min_token_std=float(_cfg(config, "gc_opd_min_token_std", 1e-6)),
        adv_clip=max(float(_cfg(config, "gc_opd_adv_clip", 10.0)), 0.0),
    )


def _f(x: np.ndarray) -> list:
    return np.asarray(x, dtype=np.float64).tolist()


def replay_case(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a `gc_opd` refvector file (schema: refvectors/README.md) through `gc_opd_credit`.

    Each row is one response; groups from `uids` (when given for every row),
    else contiguous blocks of `gc_opd_group_size` (default `rollout_n`); reward
    = Σ token_level_scores·mask. `paper_rho_D` / `paper_rho_B` (when the file
    has them) = ρ of the first row with reward 0 / reward 1 (the paper's
    responses D and B).
    Returns: {"expected": {gc_opd_advantages, gc_opd_token_weight,
      gc_opd_residual, gc_opd_teacher_score, metrics, [paper_rho_D, paper_rho_B]},
      "expected_variants": {}}.
    Raises: ValueError for unimplemented config values or missing rows.
    """
    config, inputs = case.get("config", {}), case["inputs"]
    gcfg = gc_opd_section_from_reference_config(config)
    mask = np.asarray(inputs["response_mask"], dtype=np.float32)
    B = mask.shape[0]
    reward_M = (np.asarray(inputs["token_level_scores"], dtype=np.float32) * mask).sum(axis=1)
    uids = inputs.get("uids")
    rollout_n = int(inputs.get("rollout_n", 1) or 1)
    group_size = max(int(_cfg(config, "gc_opd_group_size", rollout_n)), 1)
    from_uid = uids is not None and len(uids) == B
    labels = [f"uid:{u}" for u in uids] if from_uid else [f"block:{i // group_size}" for i in range(B)]
    batch = reference_batch(inputs, labels, reward_M)
    res = gc_opd_credit(batch, CreditSection(gc_opd=gcfg))
    metrics = dict(res.metrics)
    metrics.update({
        "gc_opd/base_ref_input_present_but_unused": float(inputs.get("base_ref_log_prob") is not None),
        "gc_opd/group_source_uid": float(from_uid),
        "gc_opd/group_source_contiguous_fallback": float(not from_uid),
        "gc_opd/group_size": float(group_size),
    })
    out: dict[str, Any] = {
        "gc_opd_advantages": _f(res.advantages_ML),
        "gc_opd_token_weight": _f(res.token_weight_ML),
        "gc_opd_residual": _f(res.residual_N[res.response_M]),
        "gc_opd_teacher_score": _f(res.teacher_score_N[res.response_M]),
        "metrics": metrics,
    }
    expected = case.get("expected", {})
    if "paper_rho_D" in expected or "paper_rho_B" in expected:
        for name, r in (("paper_rho_D", 0.0), ("paper_rho_B", 1.0)):
            rows = np.flatnonzero(reward_M == r)
            if rows.size == 0:
                raise ValueError(f"{name}: no row with reward {r:g}")
            out[name] = float(res.residual_N[res.response_M[rows[0]]])
    return {"expected": out, "expected_variants": {}}

