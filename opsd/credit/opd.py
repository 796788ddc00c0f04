"""On-policy (self-)distillation token advantage (spec §1) and GRPO + OPSD."""

from __future__ import annotations

import numpy as np

from opsd.credit.registry import register
from opsd.credit.grpo import apply_invalid_action_penalty, edge_case_metrics, grpo_sequence_advantage


def opd_token_gap(teacher_logprobs_ML: np.ndarray, student_logprobs_ML: np.ndarray, loss_mask_ML: np.ndarray) -> np.ndarray:
    """`A_opd[r] = teacher_logprob[r] - student_logprob[r]` on loss tokens, 0 elsewhere (spec §1).

    Args: teacher and student log-probs float [M, L] (nats, of the sampled
    token), loss_mask_ML 0/1 [M, L]. Off-mask entries may hold anything, even
    -inf padding: they never enter the result.
    Returns: float32 [M, L]. Raises: ValueError on shape mismatch.
    """
    t = np.asarray(teacher_logprobs_ML, dtype=np.float32)
    s = np.asarray(student_logprobs_ML, dtype=np.float32)
    m = np.asarray(loss_mask_ML).astype(bool)
    if t.shape != s.shape or t.shape != m.shape or t.ndim != 2:
        raise ValueError(f"teacher {t.shape}, student {s.shape} and mask {m.shape} must be equal [M, L] shapes")
    out = np.zeros(t.shape, dtype=np.float32)
    out[m] = t[m] - s[m]
    return out


def _require_teacher(batch, method: str) -> None:
    if batch.teacher_logprobs_ML is None:
        raise ValueError(f"credit method {method!r} needs CreditBatch.teacher_logprobs_ML (got None)")


def _gap_metrics(gap_ML: np.ndarray, mask_ML: np.ndarray) -> dict[str, float]:
    n = float(mask_ML.sum())
    return {
        "opd/loss_tokens": n,
        "opd/mean_gap": float(gap_ML.sum() / n) if n else 0.0,
        "opd/abs_gap_max": float(np.abs(gap_ML).max()) if gap_ML.size else 0.0,
    }


@register("opd")
@register("opsd")  # the name runs used before the method list grew
def opsd_estimator(batch, cfg):
    """Registered `opd` (alias `opsd`): pure token gap teacher - student (identity privileged view), spec §1."""
    _require_teacher(batch, "opsd")
    gap_ML = opd_token_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML)
    return gap_ML, _gap_metrics(gap_ML, np.asarray(batch.loss_mask_ML, dtype=np.float32)) | edge_case_metrics(batch, "opd")


@register("grpo_opd")
@register("grpo_opsd")  # older name, kept for existing configs
def grpo_opsd_estimator(batch, cfg):
    """Registered `grpo_opd` (alias `grpo_opsd`): GRPO advantage broadcast + cfg.opd_coef * (teacher - student), spec §0-§1.

    The GRPO part is the `grpo` estimator's (same scope, std normalisation and
    invalid-action penalty settings); the sum is masked to loss tokens.
    """
    _require_teacher(batch, "grpo_opsd")
    mask_ML = np.asarray(batch.loss_mask_ML, dtype=np.float32)
    rewards_M = np.asarray(batch.episode_reward, dtype=np.float32)
    if cfg.use_invalid_action_penalty:
        rewards_M = apply_invalid_action_penalty(rewards_M, batch.is_action_valid, cfg.invalid_action_penalty_coef)
    adv_M = grpo_sequence_advantage(rewards_M, batch.task_id, batch.rollout_id, cfg.grpo_scope, cfg.norm_adv_by_std,
                                    cfg.grpo_singleton or "zero")
    gap_ML = opd_token_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML)
    adv_ML = (mask_ML * adv_M[:, None] + np.float32(cfg.opd_coef) * gap_ML).astype(np.float32)
    return adv_ML, _gap_metrics(gap_ML, mask_ML) | edge_case_metrics(batch, "opd")
