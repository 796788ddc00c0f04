"""AlignOPSD correspondence and rectification (spec §4.1-4.2): which sibling turns a target turn's teacher
view borrows from, and how their teacher log-probs are mixed in.

- embedder (§4.1): `similarity_matrix`, `structural_mask`, `select_sources`
  (threshold, one source per sibling rollout, top-K, action filter,
  weights, rho, alpha).
- teacher (§4.2): `rectify` (probability mixture / log mean of the matched
  sibling teachers, blended with the identity view by alpha).

Conventions (opsd/credit/alignopsd/__init__.py): `_MM` matrices are [source, target].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from opsd.config import AlignSection

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
