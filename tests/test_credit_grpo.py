"""GRPO (spec §0), OPD gap (spec §1), grpo_opsd and the estimator registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opsd.config import CreditSection
from opsd.credit import compute_advantages, get_estimator, permute_batch, registered
from opsd.credit.grpo import (
    apply_invalid_action_penalty,
    canonical_permutation,
    group_zscore,
    grpo_sequence_advantage,
)
from opsd.credit.opd import opd_token_gap
from opsd.types import CreditBatch


def make_batch(rows, L=3, mask=None, teacher=None, student=None):
    """rows: (task, rollout, turn, reward, valid) tuples."""
    M = len(rows)
    return CreditBatch(
        task_id=[r[0] for r in rows],
        rollout_id=[r[1] for r in rows],
        turn_id=[r[2] for r in rows],
        data_source=["env"] * M,
        episode_reward=np.asarray([r[3] for r in rows], dtype=np.float32),
        is_action_valid=np.asarray([r[4] for r in rows], dtype=bool),
        loss_mask_ML=np.ones((M, L), np.float32) if mask is None else np.asarray(mask, np.float32),
        student_logprobs_ML=np.full((M, L), -1.0, np.float32) if student is None else np.asarray(student, np.float32),
        teacher_logprobs_ML=None if teacher is None else np.asarray(teacher, np.float32),
    )


# ---------------------------------------------------------------- bad-input case 1


def test_seven_identical_fp32_rewards_have_std_exactly_zero():
    # A naive E[x^2] - E[x]^2 in float32 leaves ~1e-4 here and divides by it.
    adv = group_zscore(np.full(7, 0.35, dtype=np.float32), ["g"] * 7)
    assert adv.dtype == np.float32
    assert np.array_equal(adv, np.zeros(7, np.float32))


def test_case1_group_095_and_seven_035():
    r = np.asarray([0.95] + [0.35] * 7, dtype=np.float32)
    adv = group_zscore(r, ["g"] * 8)
    # mean 0.425, unbiased std sqrt(0.315 / 7) = 0.2121320
    std = math.sqrt(0.315 / 7)
    assert adv[0] == pytest.approx(0.525 / (std + 1e-6), rel=1e-5)
    assert np.allclose(adv[1:], -0.075 / (std + 1e-6), rtol=1e-5)
    assert np.ptp(adv[1:]) == 0.0  # the seven equal rewards get one identical advantage


CASE1_VALUES = [0.35, 0.1, 1 / 3, 0.95, 0.7, 1000.1, -7.3, 1e-3]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("value", CASE1_VALUES)
def test_case1_identical_rewards_have_std_exactly_zero_in_every_size_and_scope(dtype, value):
    # The kind: any group of equal low-precision rewards, any size, both scopes and both normalizations.
    for n in (2, 3, 7, 8, 64, 1000):
        x = np.full(n, value, dtype)
        assert not group_zscore(x, ["g"] * n).any(), (n, value)
        rollouts = [f"r{i % 4}" for i in range(n)]  # several turn rows per trajectory
        for scope in ("turn", "trajectory"):
            for norm in (True, False):
                assert not grpo_sequence_advantage(x, ["t"] * n, rollouts, scope, norm).any(), (n, scope, norm)


def test_case1_naive_variance_would_have_blown_these_groups_up():
    # Why the kind matters: E[x^2] - E[x]^2 in float32 is not 0 for most of these values (0.35 gives
    # 2.2e-8, std 1.5e-4: the 0.60 gap becomes ~4000), so the test inputs are the dangerous ones.
    naive = [float(np.mean(np.full(7, v, np.float32) ** 2) - np.mean(np.full(7, v, np.float32)) ** 2) for v in CASE1_VALUES]
    assert sum(v != 0.0 for v in naive) >= 5 and math.sqrt(abs(naive[0])) == pytest.approx(1.5e-4, rel=0.01)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("value", CASE1_VALUES)
def test_case1_one_high_and_seven_equal_rewards(dtype, value):
    hi = value + 0.60
    r = np.asarray([hi] + [value] * 7, dtype=dtype)
    gap = float(r[0]) - float(r[1])  # 0.60 up to the dtype's rounding
    adv = group_zscore(r, ["g"] * 8)
    assert np.ptp(adv[1:]) == 0.0  # the seven equal rewards get one advantage
    # Hand value: mean gap/8 above the seven; unbiased std = gap * sqrt(1/8) exactly.
    std = gap * math.sqrt(1 / 8)
    assert adv[0] == pytest.approx(gap * 7 / 8 / (std + 1e-6), rel=1e-4)
    assert adv[1] == pytest.approx(-gap / 8 / (std + 1e-6), rel=1e-4)
    assert abs(adv[0]) <= 7 / math.sqrt(8)  # the largest z-score 8 values can give (ddof 1)
    # Without std normalization the advantages keep the 0.60 gap itself.
    centred = group_zscore(r, ["g"] * 8, norm_by_std=False)
    assert centred[0] - centred[1] == pytest.approx(gap, rel=1e-6)
    assert gap == pytest.approx(0.60, abs=abs(float(np.spacing(np.asarray(hi, dtype)))))  # 0.60 as the dtype holds it


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bumped", [0, 1, 3])
def test_case1_near_equal_groups_stay_bounded(dtype, bumped):
    # `bumped` of 8 equal values moved up by one ulp: the spread is real but tiny; the advantage stays
    # a z-score (|A| <= (n - 1) / sqrt(n)), never a blow-up, and sums to 0 in each group.
    groups = []
    for value in CASE1_VALUES:
        x = np.full(8, value, dtype)
        x[:bumped] = np.nextafter(x[:bumped], np.asarray(np.inf, dtype))
        groups.append(x)
    r = np.concatenate(groups)
    ids = [f"g{g}" for g in range(len(groups)) for _ in range(8)]
    adv = group_zscore(r, ids)
    assert adv.dtype == np.float32 and np.isfinite(adv).all()
    assert np.abs(adv).max() <= 7 / math.sqrt(8) + 1e-6
    for g in range(len(groups)):
        assert abs(float(adv[8 * g : 8 * g + 8].astype(np.float64).sum())) < 1e-5
    if dtype is np.float64 and bumped == 0:
        # float64 sums of equal values round (0.1 + 0.1 + 0.1 != 0.3): not exactly 0, but
        # far below anything a gradient step notices.
        assert np.abs(adv).max() < 1e-6


# ---------------------------------------------------------------- bad-input case 2


def test_group_of_one_row_gives_zero_never_nan():
    adv = group_zscore(np.asarray([1.0, 0.0, 1.0, 10.0], np.float32), ["a", "a", "a", "lonely"])
    assert np.isfinite(adv).all()
    assert adv[3] == 0.0
    # the other group is unaffected by the lonely one
    assert adv[:3] == pytest.approx([0.57735, -1.1547, 0.57735], abs=1e-4)
    assert group_zscore(np.asarray([10.0]), ["x"], norm_by_std=False)[0] == 0.0


def test_group_of_one_row_reference_variant_is_mean0_std1():
    adv = group_zscore(np.asarray([10.0], np.float32), ["x"], singleton="reference")
    assert adv[0] == pytest.approx(10.0 / (1.0 + 1e-6), rel=1e-7)


def test_one_surviving_rollout_trajectory_scope_gives_zero():
    # Task "t" lost all rollouts but r3; grouping is by id, not by a stride of G.
    adv = grpo_sequence_advantage(
        np.asarray([1, 1, 0, 10], np.float32), ["u", "u", "u", "t"], ["r0", "r1", "r2", "r3"], "trajectory"
    )
    assert adv[3] == 0.0
    assert adv[:3] == pytest.approx([0.57735, 0.57735, -1.1547], abs=1e-4)


def test_groups_by_explicit_id_not_stride():
    # Interleaved groups: a stride-based grouping of 2 would pair (a, b).
    adv = group_zscore(np.asarray([1.0, 5.0, 0.0, 5.0], np.float32), ["a", "b", "a", "b"])
    assert adv == pytest.approx([0.70711, 0.0, -0.70711, 0.0], abs=1e-5)


# ---------------------------------------------------------------- scopes


def test_trajectory_and_turn_scopes_on_hand_example():
    # r0 has two turns (reward 1), r1 one turn (reward 0).
    task, roll = ["t", "t", "t"], ["r0", "r0", "r1"]
    r = np.asarray([1, 1, 0], np.float32)
    traj = grpo_sequence_advantage(r, task, roll, "trajectory")
    # values [1, 0]: mean 0.5, std sqrt(0.5)
    assert traj == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6)] * 2 + [-0.5 / (math.sqrt(0.5) + 1e-6)], rel=1e-6)
    turn = grpo_sequence_advantage(r, task, roll, "turn")
    # rows [1, 1, 0]: mean 2/3, std sqrt(1/3)
    s = math.sqrt(1 / 3) + 1e-6
    assert turn == pytest.approx([(1 / 3) / s, (1 / 3) / s, -(2 / 3) / s], rel=1e-6)
    no_std = grpo_sequence_advantage(r, task, roll, "turn", norm_by_std=False)
    assert no_std == pytest.approx([1 / 3, 1 / 3, -2 / 3], rel=1e-6)
    with pytest.raises(ValueError):
        grpo_sequence_advantage(r, task, roll, "episode")


@pytest.mark.parametrize("scope", ["trajectory", "turn"])
def test_all_equal_rewards_give_zero(scope):
    r = np.full(6, 10.0, np.float32)
    adv = grpo_sequence_advantage(r, ["t"] * 6, ["a", "a", "b", "c", "c", "c"], scope)
    assert np.array_equal(adv, np.zeros(6, np.float32))


def test_invalid_action_penalty_lowers_only_invalid_turns():
    out = apply_invalid_action_penalty(np.asarray([1.0, 1.0, 0.0], np.float32), np.asarray([True, False, False]), 0.1)
    assert out == pytest.approx([1.0, 0.9, -0.1])
    with pytest.raises(ValueError):
        apply_invalid_action_penalty(np.zeros(2), np.ones(2, bool), -0.1)


# ---------------------------------------------------------------- registered estimators


def test_registry_lists_methods_and_rejects_unknown():
    assert {"grpo", "opsd", "grpo_opsd", "alignopsd"} <= set(registered())
    with pytest.raises(ValueError, match="grpo_opsd"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="registered"):
        compute_advantages("nope", make_batch([("t", "a", 0, 1.0, True)]), CreditSection())


def test_grpo_estimator_broadcasts_to_mask_with_penalty():
    rows = [("t", "r0", 0, 1.0, True), ("t", "r0", 1, 1.0, False), ("t", "r1", 0, 0.0, True)]
    mask = [[1, 1, 0], [1, 0, 0], [0, 1, 1]]
    cfg = CreditSection(grpo_scope="turn", use_invalid_action_penalty=True, invalid_action_penalty_coef=0.1)
    adv, metrics = compute_advantages("grpo", make_batch(rows, mask=mask), cfg)
    expected = group_zscore(np.asarray([1.0, 0.9, 0.0]), ["t"] * 3)
    assert adv.dtype == np.float32
    assert adv == pytest.approx(np.asarray(mask) * expected[:, None], abs=1e-6)
    assert metrics["grpo/invalid_turns"] == 1.0


def test_grpo_row_order_does_not_matter():
    rows = [("t", "r1", 0, 0.0, True), ("t", "r0", 1, 1.0, True), ("u", "r0", 0, 3.0, True), ("t", "r0", 0, 1.0, True), ("u", "r1", 0, 5.0, True)]
    batch = make_batch(rows)
    cfg = CreditSection(grpo_scope="trajectory")
    adv, _ = compute_advantages("grpo", batch, cfg)
    perm = np.asarray([4, 2, 0, 3, 1])
    adv_p, _ = compute_advantages("grpo", permute_batch(batch, perm), cfg)
    assert np.array_equal(adv_p, adv[perm])
    assert adv[:, 0] == pytest.approx([-0.70711, 0.70711, -0.70711, 0.70711, 0.70711], abs=1e-5)


def test_canonical_permutation_and_duplicate_turns():
    perm = canonical_permutation(["b", "a", "a"], ["r0", "r1", "r0"], [0, 0, 3])
    assert perm.tolist() == [2, 1, 0]
    assert canonical_permutation(["t", "t"], ["r", "r"], [10, 9]).tolist() == [1, 0]  # ints, not strings
    with pytest.raises(ValueError, match="duplicate"):
        compute_advantages("grpo", make_batch([("t", "a", 0, 1.0, True), ("t", "a", 0, 0.0, True)]), CreditSection())


def test_nan_on_a_loss_token_is_rejected():
    student = np.full((1, 3), -1.0, np.float32)
    student[0, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages("grpo", make_batch([("t", "a", 0, 1.0, True)], student=student), CreditSection())


# ---------------------------------------------------------------- OPD (spec §1)


def test_opd_gap_is_teacher_minus_student_on_loss_tokens_only():
    teacher = np.asarray([[-0.5, -1.0, -np.inf]], np.float32)  # -inf padding off the mask
    student = np.asarray([[-1.5, -0.25, -2.0]], np.float32)
    mask = np.asarray([[1, 1, 0]])
    gap = opd_token_gap(teacher, student, mask)
    assert gap.tolist() == [[1.0, -0.75, 0.0]]
    adv, metrics = compute_advantages(
        "opsd", make_batch([("t", "a", 0, 1.0, True)], mask=mask, teacher=teacher, student=student), CreditSection()
    )
    assert adv.tolist() == [[1.0, -0.75, 0.0]]
    assert metrics["opd/mean_gap"] == pytest.approx(0.125)


def test_opsd_needs_teacher():
    with pytest.raises(ValueError, match="teacher_logprobs_ML"):
        compute_advantages("opsd", make_batch([("t", "a", 0, 1.0, True)]), CreditSection())


def test_grpo_opsd_adds_coef_times_gap():
    rows = [("t", "r0", 0, 1.0, True), ("t", "r1", 0, 0.0, True)]
    teacher = np.asarray([[-0.5, -1.0], [-2.0, -0.1]], np.float32)
    student = np.asarray([[-1.0, -1.0], [-1.0, -0.6]], np.float32)
    mask = [[1, 1], [1, 0]]
    cfg = CreditSection(grpo_scope="trajectory", opd_coef=0.5, use_invalid_action_penalty=False)
    adv, _ = compute_advantages("grpo_opsd", make_batch(rows, L=2, mask=mask, teacher=teacher, student=student), cfg)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv == pytest.approx(np.asarray([[a + 0.25, a + 0.0], [-a - 0.5, 0.0]]), abs=1e-6)


# ------------------------------------------------------------ every method: invariants (hypothesis)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.factories import random_credit_batch


@pytest.mark.parametrize("method", registered())
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_every_method_is_row_order_independent_and_survives_edge_cases(method, seed):
    batch = random_credit_batch(seed)
    perm = np.random.default_rng(seed).permutation(batch.num_rows)
    adv, metrics = compute_advantages(method, batch, CreditSection())
    adv_shuffled, metrics_shuffled = compute_advantages(method, permute_batch(batch, perm), CreditSection())
    assert np.isfinite(adv).all() and not adv[batch.loss_mask_ML == 0].any()
    np.testing.assert_allclose(adv_shuffled, adv[perm], rtol=1e-6, atol=1e-6)
    assert metrics == pytest.approx(metrics_shuffled, rel=1e-5, abs=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("method", ["grpo", "opd", "grpo_opd"])
def test_edge_cases_are_counted_in_metrics(method):
    _, metrics = compute_advantages(method, random_credit_batch(3), CreditSection())
    prefix = "grpo" if method == "grpo" else "opd"
    assert metrics[f"{prefix}/turns_without_loss_tokens"] == 1
    assert metrics[f"{prefix}/single_trajectory_tasks"] == 1
    assert metrics[f"{prefix}/trajectories_with_varying_reward"] == 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), value=st.sampled_from([0.0, 1.0, 10.0, 0.1]))
def test_all_equal_rewards_give_zero_outcome_advantage(seed, value):
    batch = random_credit_batch(seed, edge_cases=False)
    batch.episode_reward[:] = value
    batch.is_action_valid[:] = True
    for scope in ("turn", "trajectory"):
        adv, _ = compute_advantages("grpo", batch, CreditSection(grpo_scope=scope))
        assert not adv.any()
