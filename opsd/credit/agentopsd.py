"""AgentOPSD: recursive belief revision (spec §2), registered as `agentopsd`.

Per trajectory (turn granularity) or per turn row (token granularity) the
teacher-student log-prob gap revises a success belief in logit space,
`c_k = γ c_{k-1} + e_k`, `B_k = clamp(sigmoid(logit B_0 + c_k), eps, 1-eps)`;
the belief increments `ΔB_k = B_k - B_{k-1}` (`B_{-1} = B_0`) are z-scored
inside the unit, steered by the sign of the GRPO advantage into a bounded
multiplier `m_k = clip(1 + b sign(A_seq) z_k, 1-b, 1+b)`, and the token
advantage is `Â = A_seq ((1-λ) + λ m_k)` on the loss tokens. GRPO keeps the
sign and, within ±λb, the size of every advantage.

Variants (cfg.agentopsd.variant):

- "paper" (default): B_0 = clip(S/G, 1e-4, 1-1e-4), S = trajectories of the
  task whose episode reward is > 0, G = trajectories of the task; γ = 0.95;
  A_seq from cfg.grpo_scope; a one-row GRPO group gets A = 0.
- "reference" (released code): B_0 = mean over the task's trajectories of
  the reward of each trajectory's first turn row (invalid-action penalty
  included), clipped; γ = 1; A_seq from the "turn" scope; a one-row group
  gets mean 0, std 1 like verl.

Arithmetic follows the reference's float32 torch code where it changes the
result (a belief saturated near 1 - 1e-4 keeps few float32 digits in its
increments): float32 everywhere, e_k summed in torch's order on short rows,
at turn granularity cumulative sums accumulated in float64 for γ = 1 (torch's
CPU cumsum), a correctly rounded exp in the sigmoid and the std accumulated
in float64, as torch computes them. This reproduces the handed vectors to
~1e-7, the saturated one included. At token granularity only the columns
up to each row's last loss token are computed (`_token_multiplier`), bit
for bit the whole-row result.

Edge cases (all counted in the metrics):

- A turn without loss tokens (`agentopsd/turns_without_loss_tokens`): as in the released
  code its A_seq is taken as 0 (so its advantage is 0) and e_k = 0 (the
  belief only decays), but it still takes part in the GRPO statistics and,
  at turn granularity, in the trajectory's ΔB mean/std: it is a real turn
  of the episode (its reward counts like any other), and this reproduces
  the released code's numbers.
- A task with one trajectory (`agentopsd/single_trajectory_tasks`): the
  success-rate prior is 0 or 1 (clipped); GRPO over its own turn rows gives
  A_seq = 0 unless rewards differ between its turns, so Â = 0: nothing to
  compare with, no push. A trajectory of one turn has z = 0, m = 1.
- Rewards that vary inside a trajectory (`agentopsd/trajectories_with_varying_reward`,
  the episode reward itself, not the per-turn penalty): each row keeps its
  own reward for GRPO (turn scope; the trajectory scope uses the mean of
  its rows), success means mean episode reward > 0, the reference prior
  reads the first turn's reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, NamedTuple, Sequence

import numpy as np
from scipy.signal import lfilter

from opsd.config import AgentOPSDSection, CreditSection
from opsd.credit.batch import check_batch, permute_batch
from opsd.credit.registry import register
from opsd.credit.grpo import (
    Singleton,
    apply_invalid_action_penalty,
    canonical_permutation,
    grpo_sequence_advantage,
)
from opsd.types import CreditBatch

B0_CLIP = 1e-4  # B_0 is clipped to [1e-4, 1 - 1e-4] so logit(B_0) is finite (spec §2)


def leaky_cumsum(x_RK: np.ndarray, gamma: float, acc64: bool = False) -> np.ndarray:
    """`c_k = γ c_{k-1} + x_k`, `c_{-1} = 0`, along axis 1 (spec §2 step 2).

    Args: x_RK float [R, K] evidence; gamma in (0, 1]; acc64: accumulate a
    γ = 1 sum in float64 (torch's CPU cumsum does; used for the small
    per-trajectory turn grids).
    Returns: float32 [R, K]. Otherwise the recursion runs in float32 (as the
    reference's γ < 1 loop) through an IIR filter, vectorized over rows
    (faster than numpy's cumsum along rows).
    """
    x = np.asarray(x_RK, dtype=np.float32)
    if x.shape[1] == 0:
        return x.copy()
    if gamma >= 1.0 and acc64:
        return np.cumsum(x, axis=1, dtype=np.float64).astype(np.float32)
    return lfilter(np.ones(1, np.float32), np.asarray([1.0, -gamma], np.float32), x, axis=1).astype(np.float32, copy=False)


def _sigmoid32(x: np.ndarray, exact: bool) -> np.ndarray:
    """float32 sigmoid `1 / (1 + exp(-x))` of a float32 array.

    exact=True takes a correctly rounded float32 exp (through float64), as
    torch's element-by-element CPU path does on the reference's few turns per
    trajectory; exact=False uses numpy's float32 exp (token rows, where torch
    uses its vectorized exp, not reproducible bit for bit anyway). exp
    overflow gives 1/inf = 0, clamped later.
    """
    if exact:
        with np.errstate(over="ignore"):
            y = np.exp(-np.asarray(x, dtype=np.float64)).astype(np.float32)
        y += np.float32(1.0)
        return np.reciprocal(y, out=y)  # float32 1/y, the same rounding as a division
    return _sigmoid32_of_neg(np.negative(x, dtype=np.float32))


def _sigmoid32_of_neg(y: np.ndarray) -> np.ndarray:
    """`1 / (1 + exp(y))` in place in the float32 array y = -x (numpy's float32 exp); returns y."""
    with np.errstate(over="ignore"):
        np.exp(y, out=y)
    y += np.float32(1.0)
    return np.reciprocal(y, out=y)


def row_sum32(x_ML: np.ndarray) -> np.ndarray:
    """float32 row sums [M] of a float32 [M, L] array.

    Rows shorter than 8 tokens are summed in torch's CPU order (four
    interleaved partial sums, the leftovers added to the first, then
    ((p0+p1)+p2)+p3), so short refvector rows reproduce the reference's e_k
    bit for bit; that matters when B_0 is saturated. Longer rows use numpy's
    pairwise float32 sum.
    """
    x = np.asarray(x_ML, dtype=np.float32)
    M, L = x.shape
    if L >= 8:
        return x.sum(axis=1, dtype=np.float32)
    n4 = 4 if L >= 4 else 0
    p = np.zeros((M, 4), dtype=np.float32)
    p[:, :n4] = x[:, :n4]
    p0 = p[:, 0]
    for j in range(n4, L):  # at most 3 leftover columns
        p0 = p0 + x[:, j]
    return ((p0 + p[:, 1]) + p[:, 2]) + p[:, 3]


def belief_multiplier(
    e_RK: np.ndarray,
    valid_RK: np.ndarray,
    b0_R: np.ndarray,
    sign_RK: np.ndarray,
    *,
    gamma: float,
    band: float,
    eps: float,
    granularity: Literal["turn", "token"],
) -> dict[str, np.ndarray]:
    """Belief recursion and bounded multiplier of R units of K steps (spec §2 steps 2-5).

    A unit is a trajectory (steps = its turns, padded at the end) or a turn
    row (steps = its tokens). Invalid steps carry e = 0; the recursion runs
    through them, the z-score statistics skip them.

    Args:
      e_RK: float32 [R, K] evidence e_k (turn: Σ masked token gaps, nats;
        token: the masked gap of each token).
      valid_RK: 0/1 (bool or float) [R, K] steps that count in mean/std (existing turns;
        loss tokens).
      b0_R: float32 [R] prior B_0, already clipped to [1e-4, 1-1e-4].
      sign_RK: float32 sign(A_seq) of each step, [R, K] or broadcastable ([R, 1]).
      gamma, band, eps: γ, b and the clamp/std epsilon.
      granularity: "turn": z = (ΔB - mean)/(pop std + eps), one step -> z = 0;
        "token": q = ΔB on loss tokens, z = (q - mean)/(sqrt(var + eps) + eps).
    Returns: dict of float32 arrays: logit_b0 [R], c, B, dB, z, m [R, K]
      (z and m are meaningless on invalid steps; callers mask them).
    """
    b0 = np.asarray(b0_R, dtype=np.float32)
    logit_b0 = np.log(b0 / (np.float32(1.0) - b0))
    turn = granularity == "turn"
    c = leaky_cumsum(e_RK, gamma, acc64=turn)
    if turn:
        B = _sigmoid32(logit_b0[:, None] + c, exact=True)
    else:  # -(logit + c) = (-logit) - c exactly: one pass fewer
        B = _sigmoid32_of_neg(np.subtract(-logit_b0[:, None], c))
    np.clip(B, np.float32(eps), np.float32(1.0 - eps), out=B)
    dB = np.empty_like(B)
    if B.shape[1]:
        np.subtract(B[:, 0], b0, out=dB[:, 0])  # B_{-1} = B_0
        np.subtract(B[:, 1:], B[:, :-1], out=dB[:, 1:])
    valid = np.asarray(valid_RK, dtype=np.float32)
    # Steps per unit: a BLAS mat-vec (exact for 0/1), ~3x a row sum.
    n = np.maximum(valid @ np.ones((valid.shape[1], 1), dtype=np.float32), np.float32(1.0))
    if turn:  # torch: float32 mean, population std accumulated in float64
        q = dB.astype(np.float64) * valid
        mean = q.sum(axis=1, keepdims=True) / n
        std = np.sqrt((((q - mean) ** 2) * valid).sum(axis=1, keepdims=True) / n)
        z = (dB - mean.astype(np.float32)) / (std.astype(np.float32) + np.float32(eps))
    else:  # the reference's float32 statistics over the loss tokens (z is 0 off them)
        z = dB - (np.einsum("rk,rk->r", dB, valid)[:, None] / n).astype(np.float32)
        z *= valid
        var = np.einsum("rk,rk->r", z, z)[:, None] / n
        z /= np.sqrt(var + np.float32(eps)) + np.float32(eps)
    m = np.multiply(z, np.float32(band) * np.asarray(sign_RK, np.float32))
    m += np.float32(1.0)
    np.clip(m, np.float32(1.0 - band), np.float32(1.0 + band), out=m)
    return {"logit_b0": logit_b0, "c": c, "B": B, "dB": dB, "z": z, "m": m}


def _einsum_cut() -> int:
    """Smallest cut (16, 32 or 64 columns) after which trailing zeros leave numpy's float32 einsum row
    sums bit for bit; 0 (do not cut) if none does.

    The row sum adds 4 SIMD vectors per step (16 floats for numpy's usual SSE/NEON baseline, 64 for
    AVX-512): cutting at a multiple of that block keeps every product in its place. The block is not
    public, so it is probed once on fixed random rows; a wrong cut would change them with near certainty.
    """
    x = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    for cut in (16, 32, 64):
        ok = True
        for width in range(cut, 512, 2 * cut):  # odd multiples: not multiples of a larger block
            xw = x[:, :width].copy()
            padded = np.zeros_like(x)
            padded[:, :width] = xw
            ok &= np.array_equal(np.einsum("rk,rk->r", xw, xw), np.einsum("rk,rk->r", padded, padded))
        if ok:
            return cut
    return 0


# Token rows are cut at a multiple of this many columns (see _einsum_cut; 0: not cut).
_CUT = _einsum_cut()
_CHUNK_ROWS = 256  # rows per belief_multiplier call: its temporaries stay in cache
_BLOCK_ELEMS = 1 << 17  # elements per row block of the gap row sums


class _Gap:
    """The masked token gap `(teacher - student)·mask` of M rows, built a block of rows at a time.

    No [M, L] array: the row sums pass over cache-sized row blocks and the
    token path rebuilds the rows (and columns) it needs. Padding may hold
    inf/NaN: then, as one [M, L] np.where would, every row is built as
    where(mask, teacher, 0) - where(mask, student, 0).
    """

    def __init__(self, teacher_ML: np.ndarray, student_ML: np.ndarray, mask_ML: np.ndarray):
        self.t, self.s, self.mask, self.clean = teacher_ML, student_ML, mask_ML, True

    def take(self, rows: slice | np.ndarray, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(gap, mask) float32 [R, width] of the given rows (copies)."""
        cols = slice(0, width)
        t, s, valid = self.t[rows, cols], self.s[rows, cols], self.mask[rows, cols]
        with np.errstate(invalid="ignore", over="ignore"):
            if self.clean:
                gap = np.subtract(t, s)
                gap *= valid  # the reference's (teacher - student) * mask
            else:
                v = valid != 0
                gap = np.where(v, t, np.float32(0.0)) - np.where(v, s, np.float32(0.0))
        return gap, valid

    def row_sums(self) -> np.ndarray:
        """e_M float32 [M]: `row_sum32` of every gap row. Raises ValueError on NaN/inf on a loss token."""
        M, L = self.mask.shape
        e_M = np.empty(M, dtype=np.float32)
        step = max(1, _BLOCK_ELEMS // max(L, 1))
        for lo in range(0, M, step):
            e_M[lo:lo + step] = row_sum32(self.take(slice(lo, lo + step))[0])
        if self.clean and not np.isfinite(e_M).all():  # inf/NaN reach their row sum: keep the padding out
            self.clean = False
            for lo in range(0, M, step):
                gap = self.take(slice(lo, lo + step))[0]
                _require_finite("teacher - student log-prob gap on a loss token", gap)
                e_M[lo:lo + step] = row_sum32(gap)
        return e_M


def _token_multiplier(
    gap: _Gap, n_M: np.ndarray, b0_M: np.ndarray, sign_M: np.ndarray, kw: dict
) -> tuple[np.ndarray, np.ndarray]:
    """Token-granularity `belief_multiplier` of M rows, computing only the columns that matter.

    Past a row's last loss token z = 0 and m = 1 exactly, and nothing there
    feeds back (the recursion runs forward; the z statistics skip invalid
    steps). So rows are sorted by their last loss token and run in chunks of
    `_CHUNK_ROWS`, each cut to its longest row rounded up to `_CUT` columns:
    the result is bit for bit that of the whole [M, L] call (the recursion
    and the sigmoid are per element, the statistics per row), at a fraction
    of its cost on ragged rows.
    Args: gap: the masked evidence and the float32 0/1 mask [M, L];
      n_M float32 [M] loss tokens per row; b0_M float32 [M]; sign_M float32
      [M] sign(A_seq); kw: gamma, band, eps, granularity="token".
    Returns: (m_ML float32 [M, L], 0 on the columns not computed (all past
      the row's last loss token, where the whole-row m is 1); B_last_M
      float32 [M] belief at the row's n-th column, i.e. its last loss token
      when the row is right-padded; 0 for a row without loss tokens).
    """
    mask_ML = gap.mask
    M, L = mask_ML.shape
    n = n_M.astype(np.int64)
    # Last loss token + 1: n for right-padded rows (their 1-based positions sum to n(n+1)/2: a float32
    # mat-vec, exact while L(L+1)/2 < 2**24), else searched.
    ext = n.copy()
    padded = np.zeros(M, dtype=bool)
    if L * (L + 1) // 2 < 1 << 24:
        padded = (mask_ML @ np.arange(1, L + 1, dtype=np.float32)) == n * (n + 1) // 2
    if not padded.all():
        ext[~padded] = L - np.argmax(mask_ML[~padded, ::-1] != 0, axis=1)
    width_M = np.minimum(-(-ext // _CUT) * _CUT, L) if _CUT else np.where(ext > 0, L, 0)
    order = np.argsort(width_M, kind="stable")
    m_ML = np.zeros((M, L), dtype=np.float32)
    B_last = np.zeros(M, dtype=np.float32)
    for lo in range(0, M, _CHUNK_ROWS):
        rows = order[lo:lo + _CHUNK_ROWS]
        W = int(width_M[rows[-1]])  # sorted: the chunk's widest row
        if W == 0:
            continue
        g = belief_multiplier(*gap.take(rows, W), b0_M[rows], sign_M[rows, None], **kw)
        m_ML[rows, :W] = g["m"]
        has = n[rows] > 0
        B_last[rows[has]] = g["B"][np.flatnonzero(has), n[rows[has]] - 1]
    return m_ML, B_last


@dataclass
class AgentOPSDResult:
    """Everything `agentopsd_core` computes, rows in the canonical order it was given.

    Per row [M] float32: a_seq (GRPO A_seq, 0 on rows without loss tokens),
    a_seq_raw (before that masking), b0 (B_0), e (Σ masked gap, nats), a_row
    (turn granularity: the turn's scalar Â; token: 0). adv: float32 [M, L]
    final advantages (0 off the loss mask). Turn granularity
    only (else None): traj [M] int64 trajectory index, pos [M] turn position,
    turns_T int64 turns per trajectory, and per trajectory [T, Kmax] grids
    c, B, dB, z, m (valid where k < turns_T) plus logit_b0 [T].
    """

    adv: np.ndarray
    a_seq: np.ndarray
    a_seq_raw: np.ndarray
    b0: np.ndarray
    e: np.ndarray
    a_row: np.ndarray
    metrics: dict[str, float]
    traj: np.ndarray | None = None
    pos: np.ndarray | None = None
    turns_T: np.ndarray | None = None
    grids: dict[str, np.ndarray] | None = None


def _require_finite(name: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")


def _checked_gap(
    task_id: Sequence[str], rollout_id: Sequence[str], turn_id: Sequence[int], loss_mask_ML: np.ndarray,
    teacher_logprobs_ML: np.ndarray, student_logprobs_ML: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, _Gap]:
    """(mask_ML float32 [M, L], n_M float32 [M] loss tokens per row, the masked gap) of agentopsd_core's
    inputs. Raises ValueError on shape mismatch or a non-0/1 mask."""
    mask = np.asarray(loss_mask_ML)
    M = len(task_id)
    if mask.ndim != 2 or mask.shape[0] != M or len(rollout_id) != M or len(turn_id) != M:
        raise ValueError(f"loss_mask_ML must be [M, L] with M = {M} ids, got {mask.shape}")
    mask_ML = np.asarray(mask, dtype=np.float32)  # read only: no copy of a float32 mask
    if np.count_nonzero(mask_ML != 0) != np.count_nonzero(mask_ML == 1):
        raise ValueError("loss_mask_ML must be 0/1")
    n_M = mask_ML @ np.ones(mask_ML.shape[1], dtype=np.float32)  # row sums: a BLAS mat-vec, exact for 0/1
    t = np.asarray(teacher_logprobs_ML, dtype=np.float32)
    s = np.asarray(student_logprobs_ML, dtype=np.float32)
    if t.shape != mask.shape or s.shape != mask.shape:
        raise ValueError(f"teacher {t.shape} / student {s.shape} log-probs must match the mask {mask.shape}")
    return mask_ML, n_M, _Gap(t, s, mask_ML)


def _checked_rewards(
    rewards_M: np.ndarray, episode_reward_M: np.ndarray, prior_scores_M: np.ndarray | None, M: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rewards float32, episode rewards float64, prior scores float32), each [M] and finite, else ValueError."""
    r = np.asarray(rewards_M, dtype=np.float32)
    ep = np.asarray(episode_reward_M, dtype=np.float64)
    prior = r if prior_scores_M is None else np.asarray(prior_scores_M, dtype=np.float32)
    for name, arr in (("rewards_M", r), ("episode_reward_M", ep), ("prior_scores_M", prior)):
        if arr.shape != (M,):
            raise ValueError(f"{name} must have shape ({M},), got {arr.shape}")
        _require_finite(name, arr)
    return r, ep, prior


class _Trajectories(NamedTuple):
    """The trajectories of canonical rows, numbered in order."""

    traj_M: np.ndarray  # trajectory of each row
    start_T: np.ndarray  # first row of each trajectory
    turns_T: np.ndarray  # turn rows per trajectory
    task_T: np.ndarray  # task (numbered in order) of each trajectory
    G_task: np.ndarray  # trajectories per task


def _canonical_trajectories(task_id: Sequence[str], rollout_id: Sequence[str], turn_id: Sequence[int]) -> _Trajectories:
    """Trajectories and tasks of rows in canonical order; ValueError if the rows are not (or repeat a turn)."""
    M = len(task_id)
    # Canonical rows: tasks, then trajectories, contiguous and numbered in order.
    tk, ro, tu = np.asarray(task_id, dtype=str), np.asarray(rollout_id, dtype=str), np.asarray(turn_id, dtype=np.int64)
    same_task = tk[1:] == tk[:-1]
    same_traj = same_task & (ro[1:] == ro[:-1])
    if not ((tk[1:] > tk[:-1]) | (same_task & (ro[1:] > ro[:-1])) | (same_traj & (tu[1:] > tu[:-1]))).all():
        raise ValueError("rows must be in canonical order (task_id, rollout_id, turn_id), each turn once; use compute_advantages")
    first_row = np.ones(min(M, 1), dtype=bool)  # empty for an empty batch
    new_traj = np.concatenate([first_row, ~same_traj])
    traj_M = np.cumsum(new_traj) - 1
    start_T = np.flatnonzero(new_traj)
    T = len(start_T)
    turns_T = np.diff(np.append(start_T, M))
    task_T = (np.cumsum(np.concatenate([first_row, ~same_task])) - 1)[start_T]
    G_task = np.bincount(task_T, minlength=int(task_T[-1]) + 1 if T else 0)
    return _Trajectories(traj_M, start_T, turns_T, task_T, G_task)


def _initial_belief(variant: str, ep: np.ndarray, prior: np.ndarray, trajs: _Trajectories) -> np.ndarray:
    """B_0 per trajectory float32 [T]: its task's success rate S/G ("paper") or mean first-row prior score
    ("reference"), clipped to [B0_CLIP, 1 - B0_CLIP]."""
    start_T, task_T, G_task = trajs.start_T, trajs.task_T, trajs.G_task
    if variant == "paper":  # success rate S/G
        ep_T = np.add.reduceat(ep, start_T) / trajs.turns_T if len(start_T) else np.zeros(0)
        rate = np.bincount(task_T, weights=(ep_T > 0).astype(np.float64), minlength=len(G_task)) / G_task
    else:  # mean of each trajectory's first-row score
        rate = np.bincount(task_T, weights=prior[start_T].astype(np.float64), minlength=len(G_task)) / G_task
    return np.clip(rate.astype(np.float32), np.float32(B0_CLIP), np.float32(1 - B0_CLIP))[task_T]


def _turn_advantages(
    trajs: _Trajectories, e_M: np.ndarray, mask_ML: np.ndarray, a_seq: np.ndarray, a_raw: np.ndarray,
    b0_T: np.ndarray, lam: np.float32, kw: dict,
) -> tuple[AgentOPSDResult, float, np.ndarray]:
    """Turn granularity: one belief recursion per trajectory over its turns, Â_k broadcast to the turn's loss
    tokens. Returns (result without metrics, mean multiplier over rows, final belief per trajectory)."""
    traj_M, start_T, turns_T = trajs.traj_M, trajs.start_T, trajs.turns_T
    M, T = len(traj_M), len(start_T)
    pos_M = np.arange(M) - start_T[traj_M]
    grid = np.zeros((3, T, int(turns_T.max()) if T else 0), dtype=np.float32)  # e, valid, sign
    grid[0, traj_M, pos_M] = e_M
    grid[1, traj_M, pos_M] = 1.0
    grid[2, traj_M, pos_M] = np.sign(a_seq)
    g = belief_multiplier(grid[0], grid[1], b0_T, grid[2], **kw)
    m_used = g["m"][traj_M, pos_M]
    m_mean = float(m_used.mean()) if M else 1.0
    a_row = a_seq * ((np.float32(1.0) - lam) + lam * m_used)
    adv_ML = a_row[:, None] * mask_ML
    B_last = g["B"][np.arange(T), turns_T - 1]
    b0_M = b0_T[traj_M]
    return AgentOPSDResult(adv_ML, a_seq, a_raw, b0_M, e_M, a_row, {}, traj_M, pos_M, turns_T, g), m_mean, B_last


def _token_advantages(
    gap: _Gap, n_M: np.ndarray, a_seq: np.ndarray, a_raw: np.ndarray, b0_M: np.ndarray, e_M: np.ndarray,
    lam: np.float32, kw: dict,
) -> tuple[AgentOPSDResult, float, np.ndarray]:
    """Token granularity: one belief recursion per turn row over its tokens (`_token_multiplier`). Returns
    (result without metrics, mean multiplier over loss tokens, final belief of each row with loss tokens)."""
    mask_ML = gap.mask
    m_ML, B_last = _token_multiplier(gap, n_M, b0_M, np.sign(a_seq), kw)
    m_mean = float(np.vdot(m_ML.ravel(), mask_ML.ravel())) / max(float(n_M.sum()), 1.0)
    adv_ML = m_ML  # Â = A_seq ((1-λ) + λ m), in place
    adv_ML *= lam
    adv_ML += np.float32(1.0) - lam
    adv_ML *= a_seq[:, None]
    adv_ML *= mask_ML
    B_last = B_last[n_M > 0]
    return AgentOPSDResult(adv_ML, a_seq, a_raw, b0_M, e_M, np.zeros(len(n_M), np.float32), {}), m_mean, B_last


def _metrics(
    trajs: _Trajectories, ep: np.ndarray, n_M: np.ndarray, e_M: np.ndarray, a_seq: np.ndarray, b0_T: np.ndarray,
    B_last: np.ndarray, m_mean: float,
) -> dict[str, float]:
    """agentopsd_core's metrics (the module docstring's edge cases are counted here)."""
    M, T = len(n_M), len(trajs.start_T)
    ep_min = np.minimum.reduceat(ep, trajs.start_T) if M else np.zeros(0)
    ep_max = np.maximum.reduceat(ep, trajs.start_T) if M else np.zeros(0)
    return {
        "agentopsd/b0_mean": float(b0_T.mean()) if T else 0.0,
        "agentopsd/belief_final_mean": float(B_last.mean()) if B_last.size else 0.0,
        "agentopsd/turn_gap_mean": float(e_M.mean()) if M else 0.0,
        "agentopsd/seq_adv_abs_mean": float(np.abs(a_seq).mean()) if M else 0.0,
        "agentopsd/multiplier_mean": m_mean,
        "agentopsd/turns_without_loss_tokens": float((~(n_M > 0)).sum()),
        "agentopsd/single_trajectory_tasks": float((trajs.G_task == 1).sum()),
        "agentopsd/single_turn_trajectories": float((trajs.turns_T == 1).sum()),
        "agentopsd/trajectories_with_varying_reward": float((ep_max != ep_min).sum()),
    }


def agentopsd_core(
    task_id: Sequence[str],
    rollout_id: Sequence[str],
    turn_id: Sequence[int],
    loss_mask_ML: np.ndarray,
    teacher_logprobs_ML: np.ndarray,
    student_logprobs_ML: np.ndarray,
    rewards_M: np.ndarray,
    episode_reward_M: np.ndarray,
    acfg: AgentOPSDSection,
    *,
    grpo_scope: Literal["trajectory", "turn"],
    norm_by_std: bool = True,
    singleton: Singleton = "zero",
    prior_scores_M: np.ndarray | None = None,
) -> AgentOPSDResult:
    """AgentOPSD advantages of M canonical turn rows (spec §2), shared by the estimator and the replay.

    Args:
      task_id, rollout_id, turn_id: length-M ids, rows in canonical order
        (a trajectory's turns contiguous, turn ids increasing).
      loss_mask_ML: 0/1 [M, L]; teacher/student_logprobs_ML float [M, L]
        (nats; off-mask values ignored, may be -inf).
      rewards_M: float [M] per-row reward for GRPO (episode reward minus the
        invalid-action penalty where it applies).
      episode_reward_M: float [M] raw episode return (success = > 0).
      acfg: variant, granularity, γ (resolved_gamma), λ, b, eps.
      grpo_scope: scope of A_seq (the reference variant's caller passes "turn").
      norm_by_std, singleton: see opsd.credit.grpo.group_zscore.
      prior_scores_M: float [M]; the reference prior reads it at each
        trajectory's first row (default: rewards_M).
    Returns: AgentOPSDResult (float32 arrays, canonical row order).
    Raises: ValueError on shape mismatch, NaN/inf on a loss token or in a
      reward, non-0/1 mask, or rows that are not canonical.
    """
    mask_ML, n_M, gap = _checked_gap(task_id, rollout_id, turn_id, loss_mask_ML, teacher_logprobs_ML, student_logprobs_ML)
    e_M = gap.row_sums()
    r, ep, prior = _checked_rewards(rewards_M, episode_reward_M, prior_scores_M, len(task_id))
    trajs = _canonical_trajectories(task_id, rollout_id, turn_id)
    # A_seq (spec §0); a row without loss tokens gets 0, like the released code's masked GRPO output.
    a_raw = grpo_sequence_advantage(r, task_id, rollout_id, grpo_scope, norm_by_std, singleton).astype(np.float32)
    a_seq = np.where(n_M > 0, a_raw, np.float32(0.0)).astype(np.float32)
    b0_T = _initial_belief(acfg.variant, ep, prior, trajs)
    lam = np.float32(acfg.mult_lambda)
    kw = dict(gamma=acfg.resolved_gamma, band=acfg.mult_band, eps=acfg.eps, granularity=acfg.granularity)
    if acfg.granularity == "turn":
        out, m_mean, B_last = _turn_advantages(trajs, e_M, mask_ML, a_seq, a_raw, b0_T, lam, kw)
    else:
        out, m_mean, B_last = _token_advantages(gap, n_M, a_seq, a_raw, b0_T[trajs.traj_M], e_M, lam, kw)
    out.metrics = _metrics(trajs, ep, n_M, e_M, a_seq, b0_T, B_last, m_mean)
    return out


def agentopsd_advantages(
    batch: CreditBatch,
    cfg: CreditSection,
    *,
    rewards_M: np.ndarray | None = None,
    prior_scores_M: np.ndarray | None = None,
    singleton: Singleton | None = None,
) -> AgentOPSDResult:
    """Run `agentopsd_core` on a canonical CreditBatch with the run's config (spec §2).

    Args:
      batch: rows in canonical order (compute_advantages guarantees it);
        needs teacher_logprobs_ML.
      cfg: cfg.agentopsd plus grpo_scope, norm_adv_by_std and the
        invalid-action penalty settings. The reference variant always uses
        the "turn" GRPO scope.
      rewards_M: per-row rewards overriding episode_reward minus the penalty
        (the replay passes the refvector's token_level_rewards row sums).
      prior_scores_M: see agentopsd_core (default: the per-row rewards).
      singleton: one-row GRPO groups; default cfg.grpo_singleton, else "zero" (paper) / "reference".
    Returns: AgentOPSDResult. Raises: ValueError (missing teacher, bad input).
    """
    if batch.teacher_logprobs_ML is None:
        raise ValueError("credit method 'agentopsd' needs CreditBatch.teacher_logprobs_ML (got None)")
    a = cfg.agentopsd
    if rewards_M is None:
        rewards_M = np.asarray(batch.episode_reward, dtype=np.float32)
        if cfg.use_invalid_action_penalty:
            rewards_M = apply_invalid_action_penalty(rewards_M, batch.is_action_valid, cfg.invalid_action_penalty_coef)
    paper = a.variant == "paper"
    return agentopsd_core(
        batch.task_id, batch.rollout_id, batch.turn_id, batch.loss_mask_ML,
        batch.teacher_logprobs_ML, batch.student_logprobs_ML, rewards_M, batch.episode_reward, a,
        grpo_scope=cfg.grpo_scope if paper else "turn",
        norm_by_std=cfg.norm_adv_by_std,
        singleton=singleton or cfg.grpo_singleton or ("zero" if paper else "reference"),
        prior_scores_M=prior_scores_M,
    )


@register("agentopsd")
def agentopsd_estimator(batch: CreditBatch, cfg: CreditSection) -> tuple[np.ndarray, dict[str, float]]:
    """Registered `agentopsd` (spec §2): (advantages_ML float32 [M, L], metrics).

    Thin wrapper over `agentopsd_advantages`; see the module docstring for
    variants and edge cases. Raises ValueError on bad input.
    """
    res = agentopsd_advantages(batch, cfg)
    return res.adv, res.metrics


# ---------------------------------------------------------------------------
# Replay of the authors' vector files (refvectors/agentopsd, README schema).

# Launcher flags selecting the spec's route through the released function.
_REQUIRED_FLAGS = {"belief_mult": True, "signed": True, "belief_gate": True, "mult_signed": True,
                   "use_anchoring": False, "use_group_norm": False, "center_delta": False, "tether_seq": False}


def credit_section_from_agentopsd_config(config: Mapping[str, Any], success_rate_prior: bool = False) -> CreditSection:
    """CreditSection reproducing a refvector's released-code run (spec §2 reference variant).

    Maps belief_decay_gamma -> gamma, mult_lambda, mult_band, eps,
    granularity; GRPO over the "turn" scope (verl-agent,
    compute_mean_std_cross_steps=True). success_rate_prior=True selects the
    paper prior B_0 = clip(S/G) (variant "paper" with the turn scope).
    Raises: ValueError for launcher flags off the spec's route (e.g.
    tether_seq, group norm, unsigned multiplier).
    """
    for k in [*_REQUIRED_FLAGS, "norm_adv_by_std_in_grpo"]:
        if k in config and not isinstance(config[k], bool):
            raise ValueError(f"AgentOPSD config {k} must be a JSON boolean, got {config[k]!r}")
    for k, want in _REQUIRED_FLAGS.items():
        if k in config and config[k] != want:
            raise ValueError(f"AgentOPSD config {k}={config[k]!r} is not implemented (only {k}={want})")
    return CreditSection(
        grpo_scope="turn",
        norm_adv_by_std=config.get("norm_adv_by_std_in_grpo", True),
        use_invalid_action_penalty=False,  # the files' token_level_rewards already carry it
        agentopsd=AgentOPSDSection(
            variant="paper" if success_rate_prior else "reference",
            granularity=config.get("granularity", "turn"),
            gamma=float(config.get("belief_decay_gamma", 1.0)),
            mult_lambda=float(config.get("mult_lambda", 0.5)),
            mult_band=float(config.get("mult_band", 0.2)),
            eps=float(config.get("eps", 1e-6)),
        ),
    )


def _fl(x) -> Any:
    return np.asarray(x, dtype=np.float64).tolist()


def run_agentopsd_case(inputs: Mapping[str, Any], cfg: CreditSection) -> dict[str, Any]:
    """Every `expected` field of an AgentOPSD refvector, rows in the file's order.

    Builds a CreditBatch from `inputs` (uid null -> one task; traj_uid null ->
    one trajectory per row), puts it in canonical order and runs
    `agentopsd_advantages` with the reference's readings of the reward: row
    reward = row sum of token_level_rewards (GRPO), prior score = masked row
    sum of the first row met in file order of each (uid, traj_uid), one-row
    GRPO groups as verl (mean 0, std 1).
    Returns: dict of JSON values (grpo_token_advantages, seq_advantage_per_row,
    v0_per_row, turn_gap_sum_e_k, advantages, and per_trajectory_intermediates
    at turn granularity). Raises: ValueError on malformed inputs.
    """
    mask = np.asarray(inputs["response_mask"], dtype=np.float32)
    M = mask.shape[0]
    uid = inputs.get("uid")
    traj = inputs.get("traj_uid")
    steps = inputs.get("turn_step")
    task_id = [""] * M if uid is None else [str(u) for u in uid]
    rollout_id = [str(i) for i in range(M)] if traj is None else [str(x) for x in traj]
    turn_id = [0] * M if traj is None or steps is None else [int(x) for x in steps]
    tlr = np.asarray(inputs["token_level_rewards"], dtype=np.float32)
    rewards = row_sum32(tlr)  # verl's GRPO score: the unmasked row sum
    masked_scores = row_sum32(tlr * mask)  # compute_group_mean_v0 reads the reward through the mask
    first: dict[tuple[str, str], float] = {}
    for i in range(M):
        first.setdefault((task_id[i], rollout_id[i]), masked_scores[i])
    prior = np.asarray([first[(task_id[i], rollout_id[i])] for i in range(M)], dtype=np.float32)
    ep_in = inputs.get("episode_rewards")
    ep = rewards.copy() if ep_in is None else np.asarray(ep_in, dtype=np.float32)
    batch = CreditBatch(
        task_id=task_id, rollout_id=rollout_id, turn_id=turn_id, data_source=[""] * M,
        episode_reward=ep, is_action_valid=~(rewards < ep - 1e-6), loss_mask_ML=mask,
        student_logprobs_ML=np.asarray(inputs["student_log_probs"], dtype=np.float32),
        teacher_logprobs_ML=np.asarray(inputs["teacher_log_probs"], dtype=np.float32),
    )
    check_batch(batch, uses_pairs=False)  # the trainer's input checks, for a file too
    perm = canonical_permutation(task_id, rollout_id, turn_id)

    res = agentopsd_advantages(permute_batch(batch, perm), cfg, rewards_M=rewards[perm],
                               prior_scores_M=prior[perm], singleton="reference")

    def back(x: np.ndarray) -> np.ndarray:  # canonical -> file row order
        y = np.empty_like(x)
        y[perm] = x
        return y

    out: dict[str, Any] = {
        "grpo_token_advantages": _fl(back(res.a_seq_raw[:, None] * np.asarray(batch.loss_mask_ML)[perm])),
        "seq_advantage_per_row": _fl(back(res.a_seq)),
        "v0_per_row": _fl(back(res.b0)),
        "turn_gap_sum_e_k": _fl(back(res.e)),
        "advantages": _fl(back(res.adv)),
    }
    if cfg.agentopsd.granularity == "turn":
        g, inter = res.grids, {}
        for tr in range(len(res.turns_T)):
            k = int(res.turns_T[tr])
            rows = perm[res.traj == tr]
            inter[rollout_id[int(rows[0])]] = {
                "rows_in_turn_order": [int(i) for i in rows],
                "logit_B0": float(g["logit_b0"][tr]),
                "c_k": _fl(g["c"][tr, :k]),
                "B_k": _fl(g["B"][tr, :k]),
                "delta_B_k": _fl(g["dB"][tr, :k]),
                "z_k": _fl(g["z"][tr, :k]),
                "m_k": _fl(g["m"][tr, :k]),
                "A_k": _fl(res.a_row[res.traj == tr]),
            }
        out["per_trajectory_intermediates"] = inter
    return out


def replay_case(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay one parsed AgentOPSD vector file (opsd.credit.replay contract).

    `expected` runs the file's config (released code: reference prior);
    each `expected_variants[name]` applies its `config_override` and, when the
    name says "success_rate", the paper's success-rate prior instead.
    Returns {"expected": {...}, "expected_variants": {name: {...}}}.
    """
    config = dict(case.get("config", {}))
    inputs = case["inputs"]
    result = {"expected": run_agentopsd_case(inputs, credit_section_from_agentopsd_config(config)),
              "expected_variants": {}}
    for name, var in (case.get("expected_variants") or {}).items():
        vcfg = {**config, **dict(var.get("config_override") or {})}
        cfg = credit_section_from_agentopsd_config(vcfg, success_rate_prior="success_rate" in name)
        result["expected_variants"][name] = run_agentopsd_case(inputs, cfg)
    return result
