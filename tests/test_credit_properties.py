"""AlignOPSD (spec §4.4) properties, checked with hypothesis on random batches.

For every allocation mode (the full method and the ablations A-D) and both
weighting modes: the token budget is conserved per trajectory, legacy turn
weights stay in [0.5, 2.5] (bounded: [0.9, 1.1]), all-equal rewards give
advantage 0 and weight 1, a one-turn trajectory gets weight 1, the result does
not depend on the order rows arrive in, and the edge cases (a turn without
loss tokens, a task with one trajectory, rewards that vary inside a
trajectory) run and are counted in the metrics.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.config import AlignSection, CreditSection
from opsd.credit import compute_advantages, permute_batch
from opsd.credit.alignopsd import alignopsd_credit
from opsd.credit.alignopsd.correspondence import similarity_matrix, structural_mask
from opsd.credit.batch import pair_blocks
from opsd.types import CreditBatch

ABLATIONS = ["none", "no_rectification", "token_level", "turn_level", "random_spans"]
L = 5


@st.composite
def batches(draw, max_turns: int = 20):
    """A random valid CreditBatch in canonical order: 1-3 tasks of 1-4 rollouts of
    1..max_turns turns, some turns without loss tokens, smooth thinking
    embeddings (consecutive turns often match the same sources)."""
    seed = draw(st.integers(0, 2**32 - 1))
    n_tasks = draw(st.integers(1, 3))
    rollouts = st.lists(st.integers(1, max_turns), min_size=1, max_size=4)  # turns per rollout
    turns = draw(st.lists(rollouts, min_size=n_tasks, max_size=n_tasks))
    kind = draw(st.sampled_from(["binary10", "float", "equal", "varying"]))
    rng = np.random.default_rng(seed)
    rows = []
    for ti, rollouts in enumerate(turns):
        for ri, K in enumerate(rollouts):
            r = {"binary10": float(rng.integers(0, 2) * 10), "float": float(np.round(rng.normal(), 4)), "equal": 1.0,
                 "varying": float(rng.integers(0, 2))}[kind]
            for k in range(K):
                # "varying": some trajectories lower the reward of some turns (a per-turn penalty upstream)
                rk = r - 0.1 * float(rng.random() < 0.3) if kind == "varying" and ri % 2 == 0 else r
                rows.append((f"t{ti}", f"r{ri}", k, rk))
    M = len(rows)
    task = [r[0] for r in rows]
    roll = [r[1] for r in rows]
    mask = (rng.random((M, L)) < 0.7).astype(np.float32)
    mask[rng.random(M) < 0.05] = 0.0  # a few turns without loss tokens
    student = -rng.exponential(1.0, (M, L)).astype(np.float32)
    teacher = -rng.exponential(1.0, (M, L)).astype(np.float32)
    phase = np.asarray([r[2] for r in rows]) // 3
    emb_t = rng.normal(size=(M, 6)) + 3 * np.eye(6)[phase % 6]
    emb_s = emb_t + 0.4 * rng.normal(size=(M, 6))
    valid_t, valid_s = rng.random(M) > 0.1, rng.random(M) > 0.1
    H = similarity_matrix(emb_t * valid_t[:, None], emb_s * valid_s[:, None], task)
    E = structural_mask(task, roll, ["env"] * M, valid_s, valid_t)
    return CreditBatch(
        task_id=task,
        rollout_id=roll,
        turn_id=[r[2] for r in rows],
        data_source=["env"] * M,
        episode_reward=np.asarray([r[3] for r in rows], np.float32),
        is_action_valid=rng.random(M) > 0.2,
        loss_mask_ML=mask,
        student_logprobs_ML=student,
        teacher_logprobs_ML=teacher,
        corrected_logprobs_ML=(teacher + 0.3 * rng.normal(size=(M, L))).astype(np.float32),
        similarity_blocks=pair_blocks(H, task),
        eligible_blocks=pair_blocks(E, task),
    )


def config(ablation: str = "none", mode: str = "legacy", T: float = 0.5, **credit) -> CreditSection:
    align = AlignSection(ablation=ablation, weighting_mode=mode, credit_temperature=T, similarity_threshold=0.6)
    return CreditSection(alignopsd=align, **credit)


@settings(max_examples=60, deadline=None)
@given(batch=batches(), ablation=st.sampled_from(ABLATIONS), mode=st.sampled_from(["legacy", "bounded"]),
       T=st.sampled_from([0.2, 0.5, 1.0]))
def test_budget_conserved_and_weights_in_their_box(batch, ablation, mode, T):
    out = alignopsd_credit(batch, config(ablation, mode, T))
    N = out.token_count_M.astype(np.float64)
    W = out.turn_weight_M.astype(np.float64)
    for rows in out.trajectory_rows:  # sum_k N_k W_k = sum_k N_k
        assert (N[rows] * W[rows]).sum() == pytest.approx(N[rows].sum(), rel=1e-5, abs=1e-5)
    lo, hi = (0.5, 2.5) if mode == "legacy" else (0.9, 1.1)  # (1 - eta) + eta [lo, hi] with eta = 0.5
    assert W.min() >= lo - 1e-6 and W.max() <= hi + 1e-6
    assert (W[N == 0] == 1.0).all()
    if ablation == "token_level":
        w = out.token_weight_ML.astype(np.float64)
        on = batch.loss_mask_ML == 1
        assert not on.any() or (w[on].min() >= lo - 1e-6 and w[on].max() <= hi + 1e-6)  # a batch may hold no loss token
        for rows in out.trajectory_rows:
            assert w[rows][on[rows]].sum() == pytest.approx(N[rows].sum(), rel=1e-5, abs=1e-5)
    for seg in out.segmentations:
        lengths = [b - a for a, b in seg.spans]
        assert max(lengths) <= 8
        if sum(lengths) >= 2:
            assert min(lengths) >= 2
    assert np.isfinite(out.final_token_advantage_ML).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


@settings(max_examples=40, deadline=None)
@given(batch=batches(), ablation=st.sampled_from(ABLATIONS))
def test_all_equal_rewards_give_zero_advantage_and_weight_one(batch, ablation):
    batch.episode_reward = np.full(batch.num_rows, 10.0, np.float32)
    batch.is_action_valid = np.ones(batch.num_rows, bool)  # no invalid-action residual either
    cfg = config(ablation)
    adv, _ = compute_advantages("alignopsd", batch, cfg)
    assert np.array_equal(adv, np.zeros_like(adv))
    out = alignopsd_credit(batch, cfg)
    assert not out.trajectory_advantage_M.any()
    np.testing.assert_allclose(out.turn_weight_M, 1.0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_turns=1), ablation=st.sampled_from(ABLATIONS), mode=st.sampled_from(["legacy", "bounded"]))
def test_one_turn_trajectories_get_weight_one(batch, ablation, mode):
    out = alignopsd_credit(batch, config(ablation, mode))
    np.testing.assert_allclose(out.turn_weight_M, 1.0, atol=1e-6)
    if ablation != "token_level":  # token level: the turn's mean token weight is 1, its tokens still differ
        expected = batch.loss_mask_ML * out.trajectory_advantage_M[:, None]
        np.testing.assert_allclose(out.m2_token_advantage_ML, expected, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), ablation=st.sampled_from(ABLATIONS), scope=st.sampled_from(["trajectory", "turn"]),
       seed=st.integers(0, 1000))
def test_results_do_not_depend_on_row_order(batch, ablation, scope, seed):
    cfg = config(ablation, grpo_scope=scope)
    adv, metrics = compute_advantages("alignopsd", batch, cfg)
    perm = np.random.default_rng(seed).permutation(batch.num_rows)
    adv_p, metrics_p = compute_advantages("alignopsd", permute_batch(batch, perm), cfg)
    back = np.empty_like(adv_p)
    back[perm] = adv_p  # unshuffle
    np.testing.assert_array_equal(back, adv)
    assert metrics_p == metrics


@settings(max_examples=40, deadline=None)
@given(batch=batches(), ablation=st.sampled_from(ABLATIONS))
def test_edge_cases_run_and_are_counted(batch, ablation):
    # The first turn loses its loss tokens and its reward differs from its trajectory's other turns;
    # the strategy draws tasks with a single trajectory (1-4 rollouts per task).
    M = batch.num_rows
    batch.loss_mask_ML[0] = 0.0
    batch.episode_reward[0] += 1.0  # row 0's trajectory now has varying rewards if it has > 1 turn
    adv, metrics = compute_advantages("alignopsd", batch, config(ablation))
    assert np.isfinite(adv).all() and not adv[0].any()
    assert all(math.isfinite(v) for v in metrics.values())
    N = batch.loss_mask_ML.sum(axis=1)
    assert metrics["alignopsd/turns_without_loss_tokens"] == float((N == 0).sum()) >= 1.0
    keys = list(dict.fromkeys(zip(batch.task_id, batch.rollout_id)))
    per_task = Counter(t for t, _ in keys)
    assert metrics["alignopsd/single_trajectory_tasks"] == float(sum(n == 1 for n in per_task.values()))
    varying = sum(
        len({float(batch.episode_reward[m]) for m in range(M) if (batch.task_id[m], batch.rollout_id[m]) == key}) > 1
        for key in keys
    )
    assert metrics["alignopsd/trajectories_with_varying_reward"] == float(varying)
    assert metrics["alignopsd/turns"] == float(M) and metrics["alignopsd/trajectories"] == float(len(keys))
    out = alignopsd_credit(batch, config(ablation))
    assert out.turn_weight_M[0] == 1.0
    # A is one value per trajectory (the mean of its rows' rewards), whatever the rows say.
    for rows in out.trajectory_rows:
        assert np.unique(out.trajectory_advantage_M[rows]).size == 1
    # A task with one trajectory has no sibling to compare with: A = 0, weight 1.
    single = {t for t, n in per_task.items() if n == 1}
    rows = [m for m in range(M) if batch.task_id[m] in single]
    assert not out.trajectory_advantage_M[rows].any() and np.allclose(out.turn_weight_M[rows], 1.0, atol=1e-6)
