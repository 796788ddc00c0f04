"""A guard for a teacher worse than its student (credit.teacher_guard).

A teacher that scores the student's winning trajectories lower than the student itself does would pull
the policy away from what just worked: an external teacher weaker than the student on this task, or a
self teacher whose privileged context confuses it. Per group, the guard compares the teacher's mean
log-prob over the loss tokens of the group's winning trajectories with the student's (the sampler's) over
the same tokens, and for the groups where the teacher is lower it shrinks the teacher-student gap before
any estimator sees it: teacher' = student + w (teacher - student), on the identity and the corrected
log-probs alike, w = credit.teacher_guard_weight ("downweight") or 0 ("skip": the group's gap is 0, so
grpo_opd and agentopsd give GRPO's advantage, opd none, ex_opd its extrapolation away from its base
policy, (1 - lambda)(base - student); gc_opd and its baselines apply their own formulas to a zero gap).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from opsd.types import CreditBatch


def winning_rows(batch: CreditBatch) -> np.ndarray:
    """bool [M]: rows of trajectories with their group's highest episode reward, where that reward is above 0
    (binary-reward envs: the won trajectories)."""
    tasks = np.asarray(batch.task_id)
    win = np.zeros(len(tasks), dtype=bool)
    for task in np.unique(tasks):
        rows = tasks == task
        best = float(batch.episode_reward[rows].max())
        if best > 0:
            win |= rows & (batch.episode_reward == best)
    return win


def teacher_worse_groups(batch: CreditBatch) -> tuple[list[str], int]:
    """The groups (task ids) whose teacher scores its winning trajectories below the student, and how many
    groups could be judged (those with a winning trajectory holding loss tokens).

    Mean log-probs (nats per loss token) over the winning rows' loss tokens: teacher_logprobs_ML (the identity
    view) vs student_logprobs_ML (the sampler's). Raises ValueError on a batch without teacher log-probs.
    """
    if batch.teacher_logprobs_ML is None:
        raise ValueError("teacher guard: the batch has no teacher log-probs")
    tasks = np.asarray(batch.task_id)
    win = winning_rows(batch)
    worse, judged = [], 0
    for task in dict.fromkeys(batch.task_id):  # first-seen order
        rows = (tasks == task) & win
        mask = batch.loss_mask_ML[rows] > 0
        if not mask.any():
            continue
        judged += 1
        if batch.teacher_logprobs_ML[rows][mask].mean() < batch.student_logprobs_ML[rows][mask].mean():
            worse.append(task)
    return worse, judged


def apply_teacher_guard(batch: CreditBatch, mode: str, weight: float) -> tuple[CreditBatch, dict[str, float]]:
    """`batch` with the teacher-student gap of the groups `teacher_worse_groups` finds scaled by w, and metrics.

    mode: "report" (nothing changed), "downweight" (w = weight, in [0, 1]) or "skip" (w = 0). The identity
    and corrected teacher log-probs of every row of a flagged group become student + w (teacher - student) on
    its loss tokens (float32, 0 off the mask as before); everything else is unchanged (a new CreditBatch, the
    input is not modified). Metrics: "teacher_guard/worse_groups", "teacher_guard/judged_groups" and
    "teacher_guard/worse_share" (worse / judged; NaN when none could be judged). ValueError on an unknown mode,
    a weight outside [0, 1] or a batch without teacher log-probs.
    """
    if mode not in ("report", "downweight", "skip"):
        raise ValueError(f"teacher guard: unknown mode {mode!r} (report, downweight, skip)")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"teacher guard: weight must be in [0, 1], got {weight}")
    worse, judged = teacher_worse_groups(batch)
    metrics = {"teacher_guard/worse_groups": float(len(worse)), "teacher_guard/judged_groups": float(judged),
               "teacher_guard/worse_share": len(worse) / judged if judged else float("nan")}
    if mode == "report" or not worse:
        return batch, metrics
    w = np.float32(0.0 if mode == "skip" else weight)
    rows = np.isin(np.asarray(batch.task_id), worse)[:, None] & (batch.loss_mask_ML > 0)
    student = batch.student_logprobs_ML

    def shrink(teacher_ML: np.ndarray | None) -> np.ndarray | None:
        if teacher_ML is None:
            return None
        # skip sets the student's own values (no 0 * -inf), downweight the convex combination.
        shrunk = student if w == 0 else student + w * (teacher_ML - student)
        return np.where(rows, shrunk, teacher_ML).astype(np.float32)

    return replace(batch, teacher_logprobs_ML=shrink(batch.teacher_logprobs_ML),
                   corrected_logprobs_ML=shrink(batch.corrected_logprobs_ML)), metrics
