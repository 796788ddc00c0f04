"""Teacher-verifier disagreement: does the teacher rank a group's responses as the verifier does?

GC-OPD's paper (arXiv 2608.19181, section 3.2 and its appendix; Figure 1) motivates its residual with three
diagnostics of a teacher against the verifier's reward, over the G sibling responses of one prompt. Here a
response is a trajectory and its teacher score is s_i, the mean teacher - student log-prob over its loss
tokens (spec §3 step 1, nats/token); R_i is its episode reward. Per group with at least two distinct rewards
(|R_i - R_j| > eps for some pair; the paper excludes the others: no verifier preference to disagree with):

- pairwise disagreement: over the pairs with |ΔR| > eps and |Δs| > eps, the share ordered oppositely
  (ΔR·Δs < 0). Pairs the teacher ties are left out, as in the authors' frozen-replay analysis; a group whose
  every reward-ordered pair is a teacher tie has no value and is left out of this average only.
- top-1 mismatch: the share of the teacher's top responses (s within eps of the group's highest s) whose
  reward is below the group's best (more than eps). Without ties: 1 if the teacher's favourite is not a
  best-reward response, else 0.
- OPD preference gap: over the pairs with |ΔR| > eps, the mean of s_better - s_worse (nats/token).
  Positive: the teacher prefers what the verifier prefers; negative: it prefers the worse response.

Each is computed per group and macro-averaged over the groups (every group weighs the same, however many
pairs it has), over all groups and per prompt-length bucket (a group's prompt length: the mean over its
trajectories of the tokens before their first response).

Not the authors' numbers to the digit: their frozen-replay analysis (SolereZhang/GC-OPD,
analyze_gc_opd_frozen_replay.py) pools the comparable pairs of all groups of a bucket (sum of
disagreements / sum of pairs) and takes the top-1 by argmax (the first of tied top scores); here each
group weighs 1 (the issue's "macro-averaged") and tied top scores share the mismatch. On groups of equal
size without ties the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opsd.types import ScoredGroup

DIAGNOSTICS = ("pairwise_disagreement", "top1_mismatch", "preference_gap")


@dataclass
class GroupDiagnostics:
    """One group's values (NaN where the group has none: see the module docstring)."""

    pairwise_disagreement: float
    top1_mismatch: float
    preference_gap: float


def group_diagnostics(reward_N: np.ndarray, score_N: np.ndarray, eps: float = 1e-6) -> GroupDiagnostics | None:
    """The three diagnostics of one group, or None when its rewards do not differ (fewer than two distinct).

    Args: reward_N float [N] verifier rewards; score_N float [N] teacher scores s_i (nats/token);
      eps >= 0, the tolerance under which two rewards or two scores count as equal.
    Raises: ValueError on shapes that differ or are not 1-D, or a NaN/inf value.
    """
    r_N = np.asarray(reward_N, dtype=np.float64)
    s_N = np.asarray(score_N, dtype=np.float64)
    if r_N.ndim != 1 or r_N.shape != s_N.shape:
        raise ValueError(f"reward {r_N.shape} and teacher score {s_N.shape} must be equal 1-D shapes")
    if not (np.isfinite(r_N).all() and np.isfinite(s_N).all()):
        raise ValueError("reward or teacher score has NaN or inf")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    i_P, j_P = np.triu_indices(r_N.size, k=1)  # every unordered pair
    dr_P, ds_P = r_N[i_P] - r_N[j_P], s_N[i_P] - s_N[j_P]
    ordered_P = np.abs(dr_P) > eps
    if not ordered_P.any():
        return None
    comparable_P = ordered_P & (np.abs(ds_P) > eps)
    disagreement = float((dr_P[comparable_P] * ds_P[comparable_P] < 0).mean()) if comparable_P.any() else float("nan")
    top_N = s_N >= s_N.max() - eps
    mismatch = float((r_N[top_N] < r_N.max() - eps).mean())
    gap = float((np.sign(dr_P[ordered_P]) * ds_P[ordered_P]).mean())
    return GroupDiagnostics(disagreement, mismatch, gap)


def trajectory_scores(scored: ScoredGroup) -> list[tuple[float, float, int]]:
    """(reward R_i, teacher score s_i, prompt tokens) of each trajectory of a scored group that can be ranked.

    s_i: the mean identity-view teacher minus sampler log-prob over its loss tokens (nats/token; 0 without any,
    as GC-OPD's s_i); prompt tokens: before its first reply. Left out: a trajectory that ended before its first
    reply (truncated, an env error: no response to rank) or whose score is not finite (a -inf teacher log-prob)."""
    out = []
    for t, lp_S in zip(scored.rollout.trajectories, scored.teacher_logprobs_S):
        m_S = t.loss_mask_S == 1
        s = float((lp_S[m_S] - t.sampler_logprobs_S[m_S]).mean()) if m_S.any() else 0.0
        if t.turns and np.isfinite(s):
            out.append((t.reward, s, t.turns[0].response_start))
    return out


def bucket_names(bounds: list[int]) -> list[str]:
    """Names of the prompt-length buckets cut at `bounds` (tokens, increasing): "<b1", "b1-b2", ..., ">=bn";
    multiples of 1024 print as "Nk" (e.g. [1024, 4096] -> ["<1k", "1k-4k", ">=4k"]). No bounds: ["all"]."""

    def fmt(b: int) -> str:
        return f"{b // 1024}k" if b % 1024 == 0 else str(b)

    if not bounds:
        return ["all"]
    names = [f"<{fmt(bounds[0])}"]
    names += [f"{fmt(lo)}-{fmt(hi)}" for lo, hi in zip(bounds, bounds[1:])]
    return names + [f">={fmt(bounds[-1])}"]


def teacher_verifier_metrics(
    reward_N: np.ndarray,
    score_N: np.ndarray,
    group_N: np.ndarray,
    prompt_tokens_N: np.ndarray,
    bounds: list[int],
    eps: float = 1e-6,
) -> dict[str, float]:
    """Macro-averaged diagnostics over a step's groups, overall and per prompt-length bucket.

    Args: reward_N float [N], score_N float [N] (nats/token), group_N int [N] group of each response,
      prompt_tokens_N int [N] tokens before the response's first reply; bounds: bucket edges (tokens,
      strictly increasing); eps as in `group_diagnostics`.
    Returns: {"teacher_verifier/<bucket>/<diagnostic>": float} with bucket "all" or a `bucket_names` name,
      plus "teacher_verifier/<bucket>/groups" (groups with distinct rewards). A bucket without such groups
      has only its "groups" key (0); a diagnostic no group of the bucket defines is left out.
    Raises: ValueError on mismatched shapes, NaN/inf, or bounds that do not increase.
    """
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"prompt-length bucket bounds must increase strictly, got {bounds}")
    group_N = np.asarray(group_N)
    prompt_N = np.asarray(prompt_tokens_N, dtype=np.float64)
    if not (group_N.shape == prompt_N.shape == np.shape(reward_N) == np.shape(score_N)):
        raise ValueError("reward, teacher score, group and prompt-length arrays need one entry per response")
    names = bucket_names(bounds)
    per_bucket: dict[str, list[GroupDiagnostics]] = {"all": [], **{n: [] for n in names}}
    for g in np.unique(group_N):
        rows = group_N == g
        diag = group_diagnostics(np.asarray(reward_N)[rows], np.asarray(score_N)[rows], eps)
        if diag is None:
            continue
        per_bucket["all"].append(diag)
        if bounds:
            per_bucket[names[int(np.searchsorted(bounds, prompt_N[rows].mean(), side="right"))]].append(diag)
    out: dict[str, float] = {}
    for bucket, diags in per_bucket.items():
        out[f"teacher_verifier/{bucket}/groups"] = float(len(diags))
        for name in DIAGNOSTICS:
            values = [getattr(d, name) for d in diags if not np.isnan(getattr(d, name))]
            if values:
                out[f"teacher_verifier/{bucket}/{name}"] = float(np.mean(values))
    return out
