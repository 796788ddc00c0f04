"""The OPD-family baselines of the GC-OPD paper (spec §3 "Baselines"), as its code implements them.

Registered estimators: `uni_opd` (Uni-OPD-lite margin shift), `power_opd`
(PowerOPD), `ex_opd` (ExOPD / GOPD extrapolated target) and `fire_opd`
(FiRe-OPD entropy-aware weights + trajectory filter). Teacher =
batch.teacher_logprobs_ML (identity privileged view), student =
batch.student_logprobs_ML (π_old).

Multi-turn mapping (the same as opsd.credit.gc_opd, whose row bookkeeping this
module reuses): the reference's "row" (one single-turn response) is here a
TRAJECTORY (task_id, rollout_id), i.e. all loss tokens of all its turn rows,
and its group is the task:

- Uni-OPD: a trajectory's mean OPD score is the masked mean over all its loss
  tokens; it is "correct" when its reward (mean of its rows' episode_reward,
  see gc_opd) is > 0; the shift is per trajectory, added to all its tokens.
- FiRe-OPD: the keep decision is per trajectory (mean teacher log-prob over
  its loss tokens vs the percentile over trajectories); entropy maxima and the
  mean-1 normalisation of the token weights run over all valid tokens.
- PowerOPD and ExOPD are per token: the mapping does not matter.

The refvector replays build a batch where each file row is its own one-turn
trajectory and call the same functions.

Uni-OPD's actor zeroes tokens with |current − teacher| ≥ max_logprob_diff,
where `current` is the log-prob under the policy being updated. Advantages
here are a function of the batch only, so the product takes current = π_old
(the student log-prob) at credit time, i.e. the first, on-policy PPO epoch;
the replay uses the file's `current_log_prob` when present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from opsd.config import CreditSection, ExOPDSection, FiReOPDSection, PowerOPDSection, UniOPDSection
from opsd.credit.registry import register
from opsd.credit.gc_opd import (
    _cfg,
    _f,
    loss_mask,
    masked,
    masked_gap,
    masked_sum,
    reference_batch,
    response_index,
    response_scores,
    row_counts,
)
from opsd.types import CreditBatch

_ON = {"1", "true", "yes", "y", "on"}
_EXP_ZERO = np.float32(-104.0)  # float32 exp(x) rounds to 0 for x < -103.9724 (exp(-104) = 6.8e-46 < 2**-150)


def _as_bool(value: Any) -> bool:
    return value.strip().lower() in _ON if isinstance(value, str) else bool(value)


def _require(batch: CreditBatch, method: str, *fields: str) -> None:
    for name in fields:
        if getattr(batch, name) is None:
            raise ValueError(f"credit method {method!r} needs CreditBatch.{name} (got None)")


def _masked_min_max(x_ML: np.ndarray, m_ML: np.ndarray, n_tok: int, fn) -> float:
    """min or max (fn) over valid tokens of an array that is 0 off the mask; 0.0 without valid tokens.

    The 0s off the mask cannot win when the result is < 0 (min) or > 0 (max):
    only otherwise is the slow masked reduction needed.
    """
    if not n_tok:
        return 0.0
    v = float(fn(x_ML))
    if n_tok == m_ML.size or (v < 0 if fn is np.min else v > 0):
        return v
    return float(fn(x_ML, where=m_ML, initial=np.inf if fn is np.min else -np.inf))


def _valid_mean(x_ML: np.ndarray, n_tok: int) -> float:
    """Mean over valid tokens of an array that is 0 off the mask."""
    return float(x_ML.sum() / n_tok) if n_tok else 0.0


# --------------------------------------------------------------------------- Uni-OPD


@dataclass
class UniOPDResult:
    """advantages_ML float32 [M, L] (0 off the mask and on clipped tokens);
    sample_shift_N float32 [N] (±shift/2 per response); response_M int [M]
    (row -> response); metrics."""

    advantages_ML: np.ndarray
    sample_shift_N: np.ndarray
    response_M: np.ndarray
    metrics: dict[str, float]


def uni_opd_credit(batch: CreditBatch, cfg: CreditSection, current_ML: np.ndarray | None = None) -> UniOPDResult:
    """Uni-OPD-lite (spec §3 Baselines): group margin shift on the OPD advantage.

    Per group (task): correct = reward > 0; gap = mean over correct responses of
    their mean OPD score − the same over incorrect ones; if both sides exist
    and gap < δ, shift = δ − gap: +shift/2 on every token of correct
    responses, −shift/2 on incorrect ones. Token advantage
    `(teacher − student + shift)·mask`, 0 where |current − teacher| ≥
    cfg.uni_opd.max_logprob_diff.

    Args: batch (responses = trajectories, module docstring); cfg.uni_opd;
      current_ML: float [M, L] current-policy log-probs for the clip (None:
      the student's, i.e. current = old).
    Returns: UniOPDResult. Raises: ValueError if the teacher is None, on bad
      shapes or NaN on a loss token.
    """
    _require(batch, "uni_opd", "teacher_logprobs_ML")
    ucfg = cfg.uni_opd
    gap = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML)
    opd, m = gap.opd_ML, gap.m_ML
    index = response_index(batch, gap.row_tokens_M)
    resp, N, G, g = index.response_M, index.num_responses, index.num_groups, index.group_N
    score_N, count_N = response_scores(gap, index)
    correct_N = index.reward_N > 0

    n_G = np.bincount(g, minlength=G)
    nc_G = np.bincount(g, weights=correct_N, minlength=G)
    ni_G = n_G - nc_G
    mc_G = np.bincount(g, weights=score_N * correct_N, minlength=G) / np.maximum(nc_G, 1)
    mi_G = np.bincount(g, weights=score_N * ~correct_N, minlength=G) / np.maximum(ni_G, 1)
    gap_G = mc_G - mi_G
    delta = float(ucfg.margin_delta)
    shifted_G = (nc_G > 0) & (ni_G > 0) & (gap_G < delta)
    shift_G = np.where(shifted_G, delta - gap_G, 0.0)
    shift_N = (np.where(correct_N, 0.5, -0.5) * shift_G[g]).astype(np.float32)

    if current_ML is None:
        keep = np.abs(opd) < ucfg.max_logprob_diff  # current = old: |current − teacher| = |OPD|
    else:
        cur = np.asarray(current_ML, dtype=np.float32)
        if cur.shape != opd.shape:
            raise ValueError(f"current log-probs {cur.shape} must have the mask's shape {opd.shape}")
        with np.errstate(invalid="ignore"):
            keep = np.abs(cur - np.asarray(batch.teacher_logprobs_ML, dtype=np.float32)) < ucfg.max_logprob_diff
    keep &= m
    adv = opd + shift_N[resp][:, None]
    adv *= keep  # opd is finite everywhere (0 off the mask)

    n_tok = int(count_N.sum())
    shifts = shift_G[shifted_G]
    metrics: dict[str, float] = {
        "uni_opd/enabled": 1.0,
        "uni_opd/use_margin_shift": 1.0,
        "uni_opd/margin_delta": delta,
        "uni_opd/margin_scope_group": 1.0,
        "uni_opd/margin_mode_mean": 1.0,
        "uni_opd/margin_direction_both": 1.0,
        "uni_opd/correct_ratio": float(correct_N.mean()) if N else 0.0,
        "uni_opd/shifted_group_count": float(shifted_G.sum()),
        "uni_opd/shift_mean": float(shifts.mean()) if shifts.size else 0.0,
        "uni_opd/shift_max": float(shifts.max()) if shifts.size else 0.0,
        "uni_opd/gap_before_mean": float(gap_G[shifted_G].mean()) if shifts.size else 0.0,
        "uni_opd/gap_after_mean": float((gap_G + shift_G)[shifted_G].mean()) if shifts.size else 0.0,
        "uni_opd/group_source": 1.0,  # explicit task ids (reference: 1 = uid)
        "uni_opd/group_count": float(G),
        "uni_opd/group_size_mean": float(n_G.mean()) if G else 0.0,
        "uni_opd/clip_range": float(ucfg.max_logprob_diff),
        "uni_opd/clip_keep_ratio": float(np.count_nonzero(keep) / max(n_tok, 1)),
    }
    metrics.update({f"uni_opd/{k}": v for k, v in index.metrics.items()})
    return UniOPDResult(adv, shift_N, resp, metrics)


@register("uni_opd")
def uni_opd_estimator(batch, cfg):
    """Registered `uni_opd` (spec §3 Baselines), current = old (module docstring). See `uni_opd_credit`."""
    res = uni_opd_credit(batch, cfg)
    return res.advantages_ML, res.metrics


# --------------------------------------------------------------------------- PowerOPD


@dataclass
class PowerOPDResult:
    """advantages_ML float32 [M, L] (0 off the mask); metrics."""

    advantages_ML: np.ndarray
    metrics: dict[str, float]


def power_opd_credit(batch: CreditBatch, cfg: CreditSection) -> PowerOPDResult:
    """PowerOPD (spec §3 Baselines): `A = exp(min(teacher,0))^α − exp(min(student,0))^α` on the mask.

    Positive log-probs are clamped to 0. Computed as exp(α·min(x, 0)) in
    float32: its absolute error is < 1e-7, while the reference's
    exp(x)^α amplifies exp's float32 rounding α-fold (up to ~3e-6 at α = 100),
    which is the residual seen against the refvectors. Args: batch,
    cfg.power_opd.alpha > 0.
    Returns: PowerOPDResult (advantages in [-1, 1]). Raises: ValueError if the
    teacher is None, on bad shapes or NaN on a loss token.
    """
    _require(batch, "power_opd", "teacher_logprobs_ML")
    alpha = np.float32(cfg.power_opd.alpha)
    if not alpha > 0:
        raise ValueError(f"power_opd alpha must be > 0, got {cfg.power_opd.alpha}")
    gap = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML, keep_opd=False)
    m, mf, n_tok = gap.m_ML, gap.mf_ML, gap.num_tokens
    t = np.asarray(batch.teacher_logprobs_ML, dtype=np.float32)
    s = np.asarray(batch.student_logprobs_ML, dtype=np.float32)

    def power(x: np.ndarray, exact_mask: bool) -> np.ndarray:  # exp(α·min(x, 0)·mask), in one buffer
        y = np.where(m, x, np.float32(0)) if exact_mask else np.multiply(x, mf)
        y *= alpha
        # α > 0: min(α·x, 0) = α·min(x, 0). Below _EXP_ZERO float32 exp is exactly 0, and numpy's exp
        # is ~2x slower on such arguments: clamping there changes no result.
        return np.exp(np.clip(y, _EXP_ZERO, np.float32(0), out=y), out=y)

    with np.errstate(invalid="ignore", under="ignore", over="ignore"):
        adv = power(t, False)
        adv -= power(s, False)  # 0 off the mask (x = 0 there)
        adv_sum = adv.sum()
        if not np.isfinite(adv_sum):  # 0·inf = NaN from padding (on loss tokens the gap check passed)
            adv = power(t, True)
            adv -= power(s, True)
            adv_sum = adv.sum()
    metrics = {
        "power_opd/alpha": float(alpha),
        "power_opd/advantage_abs_mean": _valid_mean(np.abs(adv), n_tok),
        "power_opd/reward_mean": float(adv_sum / n_tok) if n_tok else 0.0,  # = _valid_mean(adv, n_tok)
        # adv is 0 off the mask: include 0 only when the mask has it.
        "power_opd/reward_min": float(_masked_min_max(adv, m, n_tok, np.min)),
        "power_opd/reward_max": float(_masked_min_max(adv, m, n_tok, np.max)),
    }
    # Per-token method: the edge cases change nothing, they are only counted.
    metrics.update({f"power_opd/{k}": v for k, v in response_index(batch, gap.row_tokens_M).metrics.items()})
    return PowerOPDResult(adv, metrics)


@register("power_opd")
def power_opd_estimator(batch, cfg):
    """Registered `power_opd` (spec §3 Baselines). See `power_opd_credit`."""
    res = power_opd_credit(batch, cfg)
    return res.advantages_ML, res.metrics


# --------------------------------------------------------------------------- ExOPD


@dataclass
class ExOPDResult:
    """target_ML, raw_advantages_ML float32 [M, L] (NOT masked, as the reference);
    advantages_ML float32 [M, L] (masked); metrics."""

    target_ML: np.ndarray
    raw_advantages_ML: np.ndarray
    advantages_ML: np.ndarray
    metrics: dict[str, float]


def ex_opd_credit(batch: CreditBatch, cfg: CreditSection) -> ExOPDResult:
    """ExOPD / GOPD (spec §3 Baselines): target = λ·teacher + (1−λ)·base, A = target − student.

    Base = batch.base_logprobs_ML (the initial policy) when cfg.ex_opd.base is
    "initial", falling back to the student (π_old) when the batch has none
    (metric `ex_opd/base_fallback` = 1); base "old" always uses the student
    (then A = λ·(teacher − student)).
    Returns: ExOPDResult. Raises: ValueError if the teacher is None, on bad
    shapes or NaN on a loss token.
    """
    _require(batch, "ex_opd", "teacher_logprobs_ML")
    ecfg = cfg.ex_opd
    gap = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML, keep_opd=False)
    m, mf, n_tok = gap.m_ML, gap.mf_ML, gap.num_tokens
    t = np.asarray(batch.teacher_logprobs_ML, dtype=np.float32)
    s = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
    available = batch.base_logprobs_ML is not None
    use_base = ecfg.base == "initial" and available
    if use_base:
        base_gap = masked_gap(batch.base_logprobs_ML, s, m, name="base/student", keep_opd=False)
        b = np.asarray(batch.base_logprobs_ML, dtype=np.float32)
    else:
        b = s
    lam = np.float32(ecfg.lam)
    with np.errstate(invalid="ignore", over="ignore"):
        target = np.multiply(t, lam)  # λ·teacher + (1−λ)·base, in two buffers
        scratch = np.multiply(b, np.float32(1.0) - lam)
        target += scratch
        raw = np.subtract(target, s)
    adv = masked(raw, m, mf, out=scratch)
    metrics = {
        "ex_opd/lambda": float(lam),
        "ex_opd/base_ref_available": float(available),
        "ex_opd/base_fallback": float(ecfg.base == "initial" and not available),
        "ex_opd/base_is_old": float(not use_base),
        "ex_opd/delta_clip": 0.0,
        "ex_opd/advantage_mean": _valid_mean(adv, n_tok),
        "ex_opd/advantage_abs_mean": _valid_mean(np.abs(adv), n_tok),
        "ex_opd/teacher_delta_mean": float(gap.row_sum_M.sum() / n_tok) if n_tok else 0.0,
        "ex_opd/base_delta_mean": float(base_gap.row_sum_M.sum() / n_tok) if use_base and n_tok else 0.0,
    }
    # Per-token method: the edge cases change nothing, they are only counted.
    metrics.update({f"ex_opd/{k}": v for k, v in response_index(batch, gap.row_tokens_M).metrics.items()})
    return ExOPDResult(target, raw, adv, metrics)


@register("ex_opd")
def ex_opd_estimator(batch, cfg):
    """Registered `ex_opd` (spec §3 Baselines). See `ex_opd_credit`."""
    res = ex_opd_credit(batch, cfg)
    return res.advantages_ML, res.metrics


# --------------------------------------------------------------------------- FiRe-OPD


@dataclass
class FiReOPDResult:
    """FiRe-OPD outputs (N responses = trajectories, M rows, L tokens).

    token_weight_ML float32 [M, L] (mean 1 over valid tokens; defined off the
    mask too, as the reference); keep_N bool [N]; effective_mask_ML float32
    [M, L] = mask·keep; normalized_teacher_logprob_N float32 [N];
    weighted_advantages_ML float32 [M, L] = weight·(teacher − student), NOT
    masked (the reference's); advantages_ML = weighted·effective mask;
    threshold float; response_M int [M] (row -> response); metrics.
    """

    token_weight_ML: np.ndarray
    keep_N: np.ndarray
    effective_mask_ML: np.ndarray
    normalized_teacher_logprob_N: np.ndarray
    weighted_advantages_ML: np.ndarray
    advantages_ML: np.ndarray
    threshold: float
    response_M: np.ndarray
    metrics: dict[str, float]


def _fire_inputs(
    batch: CreditBatch,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(teacher float32, d = teacher − student float32, m bool, mf float32 0/1, h_t, h_s float32, all [M, L],
    row_tokens int [M]) of fire_opd_credit's batch. Raises ValueError on bad shapes or NaN/inf on a loss token."""
    t = np.asarray(batch.teacher_logprobs_ML, dtype=np.float32)
    s = np.asarray(batch.student_logprobs_ML, dtype=np.float32)
    m, mf = loss_mask(batch.loss_mask_ML)
    if t.ndim != 2 or t.shape != s.shape or t.shape != m.shape:
        raise ValueError(
            f"teacher/student log-probs {t.shape}/{s.shape} and mask {m.shape} must be equal [M, L] shapes")
    row_tokens = row_counts(mf)
    # Work on few [M, L] passes and buffers: d = teacher - student becomes the weighted advantage in place.
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(t, s)
        if not np.isfinite(np.einsum("ij,ij->i", d, mf)).all():  # inf/NaN anywhere (0·inf = NaN off the mask)
            if not np.isfinite(np.where(m, d, np.float32(0)).sum(axis=1)).all():
                raise ValueError("teacher/student log-probs have NaN or inf on a loss token")
    h_t = np.asarray(batch.teacher_entropy_ML, dtype=np.float32)
    h_s = np.asarray(batch.student_entropy_ML, dtype=np.float32)
    for name, h in (("teacher_entropy_ML", h_t), ("student_entropy_ML", h_s)):
        if h.shape != m.shape:
            raise ValueError(f"CreditBatch.{name} must have shape {m.shape}, got {h.shape}")
    return t, d, m, mf, h_t, h_s, row_tokens


def _trajectory_filter(
    t: np.ndarray, m: np.ndarray, mf: np.ndarray, row_tokens: np.ndarray, resp: np.ndarray, N: int,
    skip_percentile: float,
) -> tuple[np.ndarray, np.float32, np.ndarray, np.ndarray, int]:
    """FiRe-OPD step 1: (v_N float32 [N] mean teacher log-prob per trajectory, threshold = the skip_percentile
    quantile of v, keep_N = v ≥ threshold, effective mask mask·keep float32 [M, L], its loss tokens)."""
    count_N = np.bincount(resp, weights=row_tokens, minlength=N)
    with np.errstate(invalid="ignore"):
        t_sum_M = np.einsum("ij,ij->i", t, mf)
    if not np.isfinite(t_sum_M).all():  # -inf padding off the mask
        t_sum_M = masked(t, m, mf).sum(axis=1)
    v_N = (np.bincount(resp, weights=t_sum_M, minlength=N) / np.maximum(count_N, 1.0)).astype(np.float32)
    threshold = np.float32(np.quantile(v_N, skip_percentile / 100.0)) if N else np.float32(0)
    keep_N = v_N >= threshold
    keep_M = keep_N[resp]
    eff = mf.copy()  # the loss mask after filtering: mask·keep
    eff[~keep_M] = 0.0
    n_eff = int(row_tokens[keep_M].sum())
    return v_N, threshold, keep_N, eff, n_eff


def _entropy_sums_and_maxima(
    h_t: np.ndarray, h_s: np.ndarray, m: np.ndarray, mf: np.ndarray, n_tok: int, scratch_ML: np.ndarray
) -> tuple[list[float], list[float]]:
    """([Σ H_t, Σ H_s] over valid tokens, [max H_t, max H_s] over valid tokens floored at 1e-6, 1.0 without
    valid tokens). scratch_ML: a float32 [M, L] buffer it overwrites. Raises ValueError on NaN/inf on a loss token."""
    zero = np.float32(0)
    ent_sums, ent_max = [], []
    for h in (h_t, h_s):
        with np.errstate(invalid="ignore", over="ignore"):
            hm = np.multiply(h, mf, out=scratch_ML)
            total = float(np.dot(hm.ravel(), mf.ravel()))  # = masked_sum(h): the same dot terms
            if not np.isfinite(total):  # inf/NaN padding: masked_sum's and masked's exact fallbacks
                hm[...] = np.where(m, h, zero)
                total = float(hm.sum(dtype=np.float64))
        ent_sums.append(total)
        # Max over valid tokens floored at 1e-6: the 0s of h·mask off the mask cannot change that result.
        ent_max.append(max(float(hm.max()), 1e-6) if n_tok else 1.0)
    if not np.isfinite(ent_sums).all():
        raise ValueError("CreditBatch.teacher_entropy_ML/student_entropy_ML have NaN or inf on a loss token")
    return ent_sums, ent_max


def _token_weights(
    h_t: np.ndarray, h_s: np.ndarray, ent_max: list[float], fcfg: FiReOPDSection, m: np.ndarray, mf: np.ndarray,
    eff_b: np.ndarray | None, eff: np.ndarray, n_tok: int, n_eff: int, scratch_ML: np.ndarray,
) -> tuple[np.ndarray, float, float]:
    """FiRe-OPD step 2: (w float32 [M, L], Σ confidence, Σ confusion over the effective mask).

    w = (1 + α·confidence)(1 + β·confusion) divided by its mean over all valid tokens, defined off the mask
    too (as the reference). scratch_ML: a float32 [M, L] buffer it overwrites."""
    zero, one = np.float32(0), np.float32(1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = np.multiply(h_t, np.float32(-1.0 / ent_max[0]))
        w += one
        np.clip(w, zero, one, out=w)  # teacher confidence
        conf_sum = masked_sum(w, eff_b, eff) if n_eff else 0.0
        if fcfg.entropy_alpha != 1.0:  # x·1 = x: skip the pass
            w *= np.float32(fcfg.entropy_alpha)
        w += one
        confu = np.multiply(h_s, np.float32(1.0 / ent_max[1]), out=scratch_ML)
        np.clip(confu, zero, one, out=confu)  # student confusion
        confu_sum = masked_sum(confu, eff_b, eff) if n_eff else 0.0
        if fcfg.entropy_beta != 1.0:
            confu *= np.float32(fcfg.entropy_beta)
        confu += one
        w *= confu
        w *= np.float32(1.0 / max(masked_sum(w, m, mf) / max(n_tok, 1), 1e-6))
    return w, conf_sum, confu_sum


def _token_weight_metrics(
    w: np.ndarray, eff_b: np.ndarray | None, eff: np.ndarray, n_eff: int, conf_sum: float, confu_sum: float,
    scratch_ML: np.ndarray,
) -> dict[str, float]:
    """Token weight mean/max/min and confidence/confusion means over the effective mask (n_eff > 0).
    scratch_ML: a float32 [M, L] buffer it overwrites."""
    with np.errstate(invalid="ignore"):
        w_eff = np.multiply(w, eff, out=scratch_ML)  # masked(w, eff): its check sum is the metric's sum
        w_sum = w_eff.sum()
        if not np.isfinite(w_sum):
            w_eff[...] = np.where(eff != 0, w, np.float32(0))
            w_sum = w_eff.sum()
    # w > 0: the 0s off the effective mask never win the max.
    w_mean, w_max = float(w_sum / n_eff), float(w_eff.max())
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_max = float(np.divide(eff, w, out=scratch_ML).max())  # 1 / min w over the effective mask (0 elsewhere)
        w_min = 1.0 / inv_max if np.isfinite(inv_max) and inv_max > 0 else _masked_min_max(
            masked(w, eff_b, eff, out=scratch_ML), eff != 0, n_eff, np.min)
    return {
        "fire_opd/token_weight_mean": w_mean,
        "fire_opd/token_weight_max": w_max,
        "fire_opd/token_weight_min": w_min,
        "fire_opd/teacher_confidence_mean": conf_sum / n_eff,
        "fire_opd/student_confusion_mean": confu_sum / n_eff,
    }


def fire_opd_credit(batch: CreditBatch, cfg: CreditSection) -> FiReOPDResult:
    """FiRe-OPD (spec §3 Baselines): trajectory filter + entropy-aware token weights.

    1. v_i = mean teacher log-prob over trajectory i's loss tokens (0 if it has
       none, as the reference's clamped denominator); keep v_i ≥ the linear
       `skip_percentile` quantile of v over trajectories.
    2. confidence = clip(1 − H_t/max H_t, 0, 1), confusion = clip(H_s/max H_s,
       0, 1) (maxima over valid tokens, floored at 1e-6);
       w = (1 + α·confidence)(1 + β·confusion), divided by its mean over ALL
       valid tokens (before filtering).
    3. A = w·(teacher − student)·mask·keep.

    Args: batch with teacher_entropy_ML and student_entropy_ML (nats);
      cfg.fire_opd. Returns: FiReOPDResult.
    Raises: ValueError naming a missing field (teacher log-probs or an
      entropy), on bad shapes or NaN on a loss token.
    """
    _require(batch, "fire_opd", "teacher_logprobs_ML", "teacher_entropy_ML", "student_entropy_ML")
    fcfg = cfg.fire_opd
    t, d, m, mf, h_t, h_s, row_tokens = _fire_inputs(batch)
    n_tok = int(row_tokens.sum())
    index = response_index(batch, row_tokens)
    resp, N = index.response_M, index.num_responses
    v_N, threshold, keep_N, eff, n_eff = _trajectory_filter(t, m, mf, row_tokens, resp, N, fcfg.skip_percentile)
    adv = np.empty_like(mf)  # the result; scratch until the end (every [M, L] allocation costs page faults)
    ent_sums, ent_max = _entropy_sums_and_maxima(h_t, h_s, m, mf, n_tok, adv)
    eff_b = m if n_eff == n_tok else None  # bool effective mask for the np.where fallbacks (None: derived there)
    w, conf_sum, confu_sum = _token_weights(h_t, h_s, ent_max, fcfg, m, mf, eff_b, eff, n_tok, n_eff, adv)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # 3. Weighted OPD advantage on the kept trajectories' tokens.
        weighted = d
        weighted *= w

    metrics = {
        "fire_opd/traj_keep_ratio": float(keep_N.mean()) if N else 0.0,
        "fire_opd/logprob_threshold": float(threshold),
        "fire_opd/normalized_teacher_logprob_mean": float(v_N.mean()) if N else 0.0,
        "fire_opd/final_keep_ratio": float(keep_N.mean()) if N else 0.0,
        "fire_opd/effective_tokens": float(n_eff),
    }
    if n_eff:
        metrics.update(_token_weight_metrics(w, eff_b, eff, n_eff, conf_sum, confu_sum, adv))
    if n_tok:
        metrics["fire_opd/teacher_entropy_mean"] = ent_sums[0] / n_tok
        metrics["fire_opd/student_entropy_mean"] = ent_sums[1] / n_tok
    metrics.update({f"fire_opd/{k}": v for k, v in index.metrics.items()})
    masked(weighted, eff_b, eff, out=adv)
    return FiReOPDResult(w, keep_N, eff, v_N, weighted, adv, float(threshold), resp, metrics)


@register("fire_opd")
def fire_opd_estimator(batch, cfg):
    """Registered `fire_opd` (spec §3 Baselines). See `fire_opd_credit`."""
    res = fire_opd_credit(batch, cfg)
    return res.advantages_ML, res.metrics


# --------------------------------------------------------------------------- refvector replays


def _rows(inputs: Mapping[str, Any]) -> int:
    return len(inputs["response_mask"])


def replay_uni_opd(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a `uni_opd_lite` refvector through `uni_opd_credit`.

    Rows are responses; groups from `uids` (all rows), else contiguous blocks
    of `rollout_n` when it divides the batch, else one group (the reference's
    order); reward = Σ token_level_scores (unmasked, as the reference); the clip
    uses `current_log_prob` when the file has it, else old.
    Config (reference keys, reference defaults): uni_opd_margin_delta (0.4),
    uni_opd_teacher_student_logprob_clip_range (10). ValueError for values the
    product does not implement: uni_opd_use_margin_shift false, margin scope
    other than group, mode other than mean, direction other than both, the
    logprob clip disabled.
    Returns: {"expected": {uni_opd_sample_shift, advantages, metrics}}.
    """
    config, inputs = case.get("config", {}), case["inputs"]
    checks = {
        "uni_opd_margin_scope": "group",
        "uni_opd_margin_mode": "mean",
        "uni_opd_margin_direction": "both",
    }
    for key, want in checks.items():
        got = str(_cfg(config, key, want)).strip().lower()
        if got != want:
            raise ValueError(f"{key}={got!r} is not implemented (only {want!r})")
    for key in ("uni_opd_use_margin_shift", "uni_opd_use_teacher_student_logprob_clip"):
        if not _as_bool(_cfg(config, key, True)):
            raise ValueError(f"{key}=false is not implemented")
    ucfg = UniOPDSection(
        margin_delta=float(_cfg(config, "uni_opd_margin_delta", 0.4)),
        max_logprob_diff=float(_cfg(config, "uni_opd_teacher_student_logprob_clip_range", 10.0)),
    )
    B = _rows(inputs)
    uids = inputs.get("uids")
    n = int(inputs.get("rollout_n", 1) or 1)
    if uids is not None and len(uids) == B:
        labels, source = [f"uid:{u}" for u in uids], 1.0
    elif n > 1 and B % n == 0:
        labels, source = [f"block:{i // n}" for i in range(B)], 2.0
    else:
        labels, source = ["all"] * B, 0.0
    reward_M = np.asarray(inputs["token_level_scores"], dtype=np.float32).sum(axis=1)
    batch = reference_batch(inputs, labels, reward_M)
    res = uni_opd_credit(batch, CreditSection(uni_opd=ucfg), current_ML=inputs.get("current_log_prob"))
    metrics = dict(res.metrics, **{"uni_opd/group_source": source})
    return {"expected": {"uni_opd_sample_shift": _f(res.sample_shift_N[res.response_M]), "advantages": _f(res.advantages_ML),
                         "metrics": metrics}, "expected_variants": {}}


def replay_power_opd(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a `poweropd` refvector through `power_opd_credit` (config poweropd_alpha, default 100).

    Returns: {"expected": {poweropd_advantages, metrics}}.
    """
    config, inputs = case.get("config", {}), case["inputs"]
    pcfg = PowerOPDSection(alpha=float(_cfg(config, "poweropd_alpha", 100.0)))
    batch = reference_batch(inputs, ["all"] * _rows(inputs))
    res = power_opd_credit(batch, CreditSection(power_opd=pcfg))
    return {"expected": {"poweropd_advantages": _f(res.advantages_ML), "metrics": res.metrics}, "expected_variants": {}}


def replay_ex_opd(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay an `exopd(gopd)` refvector through `ex_opd_credit`.

    Config: gopd_lambda (reference default 1.0); base = the file's
    base_ref_log_prob, falling back to old when absent. The reference applies
    no mask: the replay returns the unmasked target and advantage.
    ValueError for values the product does not implement: position-aware λ,
    a positive gopd_delta_clip / opd_delta_clip.
    Returns: {"expected": {gopd_advantages, gopd_target_log_prob, metrics}}.
    """
    config, inputs = case.get("config", {}), case["inputs"]
    if _as_bool(_cfg(config, "gopd_position_aware", False)) or _as_bool(_cfg(config, "position_aware_exopd", False)):
        raise ValueError("position-aware ExOPD lambda is not implemented")
    for key in ("gopd_delta_clip", "opd_delta_clip"):
        v = config.get(key)
        if v is not None and not (isinstance(v, str) and v.strip().lower() in ("", "none", "null")) and float(v) > 0:
            raise ValueError(f"{key}={v} is not implemented (ExOPD advantages are not clipped)")
    ecfg = ExOPDSection(lam=float(_cfg(config, "gopd_lambda", 1.0)), base="initial")
    batch = reference_batch(inputs, ["all"] * _rows(inputs))
    res = ex_opd_credit(batch, CreditSection(ex_opd=ecfg))
    return {"expected": {"gopd_advantages": _f(res.raw_advantages_ML), "gopd_target_log_prob": _f(res.target_ML),
                         "metrics": res.metrics}, "expected_variants": {}}


def replay_fire_opd(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a `fire_opd` refvector through `fire_opd_credit`.

    Config: traj_skip_percentile (20), entropy_alpha (1), entropy_beta (1);
    ValueError for multi_teacher_distill (not implemented). Each row is its
    own trajectory. Returns: {"expected": {token_weight, traj_keep_mask,
    effective_mask, normalized_teacher_logprob, weighted_advantages,
    logprob_threshold, metrics}}.
    """
    config, inputs = case.get("config", {}), case["inputs"]
    if _as_bool(_cfg(config, "multi_teacher_distill", False)):
        raise ValueError("multi_teacher_distill FiRe-OPD is not implemented")
    fcfg = FiReOPDSection(
        skip_percentile=float(_cfg(config, "traj_skip_percentile", 20.0)),
        entropy_alpha=float(_cfg(config, "entropy_alpha", 1.0)),
        entropy_beta=float(_cfg(config, "entropy_beta", 1.0)),
    )
    batch = reference_batch(inputs, ["all"] * _rows(inputs))
    res = fire_opd_credit(batch, CreditSection(fire_opd=fcfg))
    return {"expected": {
        "token_weight": _f(res.token_weight_ML),
        "traj_keep_mask": res.keep_N[res.response_M].tolist(),
        "effective_mask": _f(res.effective_mask_ML),
        "normalized_teacher_logprob": _f(res.normalized_teacher_logprob_N[res.response_M]),
        "weighted_advantages": _f(res.weighted_advantages_ML),
        "logprob_threshold": res.threshold,
        "metrics": res.metrics,
    }, "expected_variants": {}}
