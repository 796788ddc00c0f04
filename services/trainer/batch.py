"""From a step's groups to the credit estimator's rows, and advantages back onto tokens.

A step's groups become one `CreditBatch`: one row per turn in canonical order
(task_id = group id, rollout_id, turn_id), responses right-padded to the
longest turn L. Estimators return `advantages_ML`; `scatter_advantages` puts
them back at each trajectory's response positions (`advantages_S`).
"""

from __future__ import annotations

import numpy as np

from opsd.types import CreditBatch, RolloutGroup, ScoredGroup, Trajectory


def _rows(groups: list[RolloutGroup]) -> list[tuple[int, int, int]]:
    """(group index, trajectory index, turn index) of every turn, sorted canonically."""
    rows = []
    for g, grp in enumerate(groups):
        for i, traj in enumerate(grp.trajectories):
            for k in range(len(traj.turns)):
                rows.append((g, i, k))
    return sorted(rows, key=lambda r: (groups[r[0]].group_id, groups[r[0]].trajectories[r[1]].rollout_id, r[2]))


def build_credit_batch(
    groups: list[RolloutGroup],
    scored: list[ScoredGroup] | None,
    base_logprobs: dict[tuple[int, int], np.ndarray] | None = None,
) -> tuple[CreditBatch, list[tuple[int, int, int]]]:
    """Stack a step's turns into a CreditBatch; returns it and the (group, trajectory, turn) of each row.

    `scored[g]` (when given) is group g's teacher output: identity and
    corrected teacher log-probs, and the group's H / eligibility over its
    turns (`RolloutGroup.canonical_turns()` order), kept as the group's pair blocks.
    Student log-probs are the sampler's (pi_old of the sampled tokens).
    Entropy fields are filled when every trajectory (sampler) / every scored
    group (teacher) carries them; `base_logprobs[(g, i)]` (float32 [S], the
    initial policy's log-probs, for ex_opd) fills base_logprobs_ML.
    """
    rows = _rows(groups)
    M = len(rows)
    L = max([groups[g].trajectories[i].turns[k].response_end - groups[g].trajectories[i].turns[k].response_start for g, i, k in rows] + [1])
    mask = np.zeros((M, L), dtype=np.float32)
    student = np.zeros((M, L), dtype=np.float32)
    teacher = np.zeros((M, L), dtype=np.float32) if scored else None
    corrected = np.zeros((M, L), dtype=np.float32) if scored else None
    trajs = [t for grp in groups for t in grp.trajectories]
    has_s_ent = bool(trajs) and all(getattr(t, "sampler_entropy_S", None) is not None for t in trajs)
    has_t_ent = bool(scored) and all(getattr(sg, "teacher_entropy_S", None) is not None for sg in scored)
    s_ent = np.zeros((M, L), dtype=np.float32) if has_s_ent else None
    t_ent = np.zeros((M, L), dtype=np.float32) if has_t_ent else None
    base = np.zeros((M, L), dtype=np.float32) if base_logprobs is not None else None
    for m, (g, i, k) in enumerate(rows):
        traj = groups[g].trajectories[i]
        sl = traj.response_slice(k)
        n = sl.stop - sl.start
        mask[m, :n] = traj.loss_mask_S[sl]
        student[m, :n] = traj.sampler_logprobs_S[sl]
        if scored:
            teacher[m, :n] = scored[g].teacher_logprobs_S[i][sl]
            corrected[m, :n] = scored[g].corrected_logprobs_S[i][sl]
        if s_ent is not None:
            s_ent[m, :n] = traj.sampler_entropy_S[sl]
        if t_ent is not None:
            t_ent[m, :n] = scored[g].teacher_entropy_S[i][sl]
        if base is not None:
            base[m, :n] = base_logprobs[(g, i)][sl]
    H = elig = None
    if scored:
        # Each group's [m, m] blocks, re-indexed from its canonical turn order to its rows' order in the batch.
        pos = [{ik: p for p, ik in enumerate(grp.canonical_turns())} for grp in groups]
        order: list[list[int]] = [[] for _ in groups]
        for g, i, k in rows:
            order[g].append(pos[g][(i, k)])
        # A group without turns (every episode failed before its first) has no rows, so no block.
        H = {groups[g].group_id: sg.similarity_MM[np.ix_(order[g], order[g])] for g, sg in enumerate(scored) if order[g]}
        elig = {groups[g].group_id: sg.eligible_MM[np.ix_(order[g], order[g])] for g, sg in enumerate(scored) if order[g]}
    batch = CreditBatch(
        task_id=[groups[g].group_id for g, _, _ in rows],
        rollout_id=[groups[g].trajectories[i].rollout_id for g, i, _ in rows],
        turn_id=[k for _, _, k in rows],
        data_source=[groups[g].task.env for g, _, _ in rows],
        episode_reward=np.array([groups[g].trajectories[i].reward for g, i, _ in rows], dtype=np.float32),
        is_action_valid=np.array([groups[g].trajectories[i].turns[k].format_valid for g, i, k in rows], dtype=bool),
        loss_mask_ML=mask,
        student_logprobs_ML=student,
        teacher_logprobs_ML=teacher,
        corrected_logprobs_ML=corrected,
        similarity_blocks=H,
        eligible_blocks=elig,
        base_logprobs_ML=base,
        teacher_entropy_ML=t_ent,
        student_entropy_ML=s_ent,
    )
    return batch, rows


def scatter_advantages(groups: list[RolloutGroup], rows: list[tuple[int, int, int]], advantages_ML: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Per (group, trajectory): advantages_S float32 [S], the row values at response positions, 0 elsewhere."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for g, grp in enumerate(groups):
        for i, traj in enumerate(grp.trajectories):
            out[(g, i)] = np.zeros(traj.token_ids_S.shape[0], dtype=np.float32)
    for m, (g, i, k) in enumerate(rows):
        traj: Trajectory = groups[g].trajectories[i]
        sl = traj.response_slice(k)
        out[(g, i)][sl] = advantages_ML[m, : sl.stop - sl.start] * traj.loss_mask_S[sl]
    return out
