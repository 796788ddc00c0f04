"""GC-OPD + RACA and the OPD-family baselines (spec §3): reference vectors, the paper case study,
multi-turn mapping, properties (hypothesis) and bad inputs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.config import CreditSection
from opsd.credit import compute_advantages, permute_batch
from opsd.credit.gc_opd import CREDIT_MODES, gc_opd_credit, replay_case
from opsd.credit.opd_baselines import (
    ex_opd_credit,
    fire_opd_credit,
    power_opd_credit,
    replay_ex_opd,
    replay_fire_opd,
    replay_uni_opd,
    uni_opd_credit,
)
from opsd.credit.replay import check_file
from opsd.types import CreditBatch
from tests.factories import shared_dir, random_credit_batch


REF_DIRS = [shared_dir() / "refvectors" / "gc_opd", shared_dir() / "refvectors" / "gc_opd_baselines"]
REF_FILES = sorted(p for d in REF_DIRS if d.is_dir() for p in d.glob("*.json"))
METHODS = ["gc_opd", "uni_opd", "power_opd", "ex_opd", "fire_opd"]
PAPER_REWARDS = [0, 0, 0, 1, 0, 0, 0, 1]
PAPER_SCORES = [-1.276079] * 3 + [-1.523554] + [-1.276079] * 3 + [-1.523554]


def load_case(path: Path) -> dict:
    if not path.is_file():
        pytest.fail(f"GC-OPD reference vectors not found at {path} (set OPSD_SHARED to the shared/ folder)")
    return json.loads(path.read_text())


# ------------------------------------------------------------------ reference vectors


def test_reference_vectors_are_present():
    for d in REF_DIRS:
        assert d.is_dir(), f"missing {d}: set OPSD_SHARED to the shared/ folder"
    names = {(p.parent.name, p.name) for p in REF_FILES}
    for n in (1, 3, 5, 7, 9, 11):
        assert ("gc_opd", f"case_{n}.json") in names
    for n in (1, 3, 5, 7):
        assert ("gc_opd_baselines", f"case_{n}.json") in names


@pytest.mark.parametrize("path", REF_FILES or [REF_DIRS[0] / "missing.json"], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_reference_vector(path):
    case = load_case(path)
    result = check_file(path)
    assert result.ok, (result.error, [(f.name, f.max_abs_error, f.detail) for f in result.fields if not f.ok])
    assert {f.name for f in result.fields} == set(case["expected"])  # every field compared, metrics included


def test_reference_gc_opd_metrics_are_all_reproduced():
    case = load_case(REF_DIRS[0] / "case_5.json")
    got = replay_case(case)["expected"]["metrics"]
    assert set(case["expected"]["metrics"]) <= set(got)
    assert got["gc_opd/final_adv_clip_ratio"] == pytest.approx(0.25)
    assert got["gc_opd/order_acc_after_proxy"] == pytest.approx(0.5)


def test_replay_without_uids_uses_contiguous_blocks():
    case = load_case(REF_DIRS[0] / "case_11.json")  # uids a,a,a,a,b,b,b,b
    blocks = copy.deepcopy(case)
    blocks["inputs"]["uids"] = None
    blocks["config"]["gc_opd_group_size"] = 4
    want, got = replay_case(case)["expected"], replay_case(blocks)["expected"]
    for name in ("gc_opd_advantages", "gc_opd_token_weight", "gc_opd_residual", "gc_opd_teacher_score"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
    assert got["metrics"]["gc_opd/group_source_contiguous_fallback"] == 1.0
    assert got["metrics"]["gc_opd/group_size"] == 4.0
    one_group = copy.deepcopy(blocks)
    one_group["config"]["gc_opd_group_size"] = 8  # every row in one group: another residual
    assert not np.allclose(replay_case(one_group)["expected"]["gc_opd_residual"], want["gc_opd_residual"])


@pytest.mark.parametrize(
    "replay, name, key, value",
    [
        (replay_case, "gc_opd/case_1.json", "gc_opd_residual_norm", "batch_zscore"),
        (replay_case, "gc_opd/case_1.json", "gc_opd_teacher_score_agg", "max"),
        (replay_case, "gc_opd/case_1.json", "gc_opd_credit_mode", "softmax"),
        (replay_case, "gc_opd/case_1.json", "gc_opd_credit_cap", 0.5),
        (replay_uni_opd, "gc_opd_baselines/case_1.json", "uni_opd_margin_direction", "correct_up"),
        (replay_uni_opd, "gc_opd_baselines/case_1.json", "uni_opd_margin_scope", "global"),
        (replay_uni_opd, "gc_opd_baselines/case_1.json", "uni_opd_use_teacher_student_logprob_clip", False),
        (replay_ex_opd, "gc_opd_baselines/case_5.json", "gopd_delta_clip", 1.0),
        (replay_ex_opd, "gc_opd_baselines/case_5.json", "gopd_position_aware", True),
        (replay_fire_opd, "gc_opd_baselines/case_7.json", "multi_teacher_distill", True),
    ],
)
def test_unimplemented_reference_config_is_rejected(replay, name, key, value):
    case = load_case(shared_dir() / "refvectors" / name)
    case["config"][key] = value
    with pytest.raises(ValueError):
        replay(case)


def test_reference_defaults_apply_to_missing_config_keys():
    # The reference's own defaults, not the product's: gopd_lambda 1.0 -> target = teacher.
    case = load_case(REF_DIRS[1] / "case_5.json")
    del case["config"]["gopd_lambda"]
    got = replay_ex_opd(case)["expected"]
    np.testing.assert_allclose(got["gopd_target_log_prob"], case["inputs"]["ref_log_prob"], atol=1e-7)


# ------------------------------------------------------------------ the paper case study (spec §3)


def paper_batch(multi_turn: bool) -> CreditBatch:
    """8 trajectories of one task with the paper's rewards and OPD scores.

    Single-turn: one token each (student 0, teacher = score). Multi-turn: three
    turns each (2 tokens, none, 1 token), every token with gap = score, so the
    trajectory's masked mean is still the score.
    """
    rows, L = [], 2
    for i, (r, sc) in enumerate(zip(PAPER_REWARDS, PAPER_SCORES)):
        for k, n_tok in enumerate([1] if not multi_turn else [2, 0, 1]):
            rows.append((f"r{i}", k, r, sc, n_tok))
    M = len(rows)
    mask = np.zeros((M, L), np.float32)
    teacher = np.zeros((M, L), np.float32)
    for j, (_, _, _, sc, n_tok) in enumerate(rows):
        mask[j, :n_tok] = 1
        teacher[j, :n_tok] = sc
    return CreditBatch(
        task_id=["x"] * M, rollout_id=[r[0] for r in rows], turn_id=[r[1] for r in rows], data_source=["math"] * M,
        episode_reward=np.asarray([r[2] for r in rows], np.float32), is_action_valid=np.ones(M, bool),
        loss_mask_ML=mask, student_logprobs_ML=np.zeros((M, L), np.float32), teacher_logprobs_ML=teacher,
    )


@pytest.mark.parametrize("multi_turn", [False, True])
def test_paper_case_study(multi_turn):
    batch = paper_batch(multi_turn)
    res = gc_opd_credit(batch, CreditSection())
    rho_M = res.residual_N[res.response_M]
    rid = np.asarray(batch.rollout_id)
    rho_D, rho_B = rho_M[rid == "r0"], rho_M[rid == "r3"]
    assert rho_D == pytest.approx(-2 / math.sqrt(3), abs=1e-5)  # -1.154701
    assert rho_B == pytest.approx(2 * math.sqrt(3), abs=1e-5)  # +3.464102
    assert rho_D == pytest.approx(-1.154701, abs=1e-5) and rho_B == pytest.approx(3.464102, abs=1e-5)
    # Every token of a trajectory has the same gap: σ = 0, so RACA falls back to credit 1.
    adv_expected = (np.asarray(PAPER_SCORES)[[int(r[1:]) for r in rid]] + 0.1 * rho_M)[:, None] * batch.loss_mask_ML
    np.testing.assert_allclose(res.advantages_ML, adv_expected, atol=2e-6)
    m = res.metrics
    assert m["gc_opd/group_identifiable_ratio"] == 1.0 and m["gc_opd/token_credit_identifiable_ratio"] == 0.0
    assert m["gc_opd/turns_without_loss_tokens"] == (8.0 if multi_turn else 0.0)
    assert m["gc_opd/trajectories"] == 8.0 and m["gc_opd/tasks"] == 1.0


def test_negative_raca_ablation_flips_the_residual():
    # The authors' negative-RACA ablation (SolereZhang/GC-OPD's configs/gc_opd_paper.yaml: raca, residual_beta -0.10):
    # the residual term is subtracted, so the paper's case-study trajectory B is pushed down, not up.
    batch = paper_batch(multi_turn=False)
    neg = gc_opd_credit(batch, CreditSection(gc_opd={"residual_beta": -0.10}))
    pos = gc_opd_credit(batch, CreditSection(gc_opd={"residual_beta": 0.10}))
    opd = opd_of(batch)
    np.testing.assert_allclose(neg.advantages_ML - opd, -(pos.advantages_ML - opd), atol=1e-6)
    rid = np.asarray(batch.rollout_id)
    assert neg.advantages_ML[rid == "r3"][0, 0] == pytest.approx(-1.523554 - 0.1 * 3.464102, abs=1e-5)
    assert neg.metrics["gc_opd/residual_beta"] == -0.10
    with pytest.raises(ValueError):
        CreditSection(gc_opd={"residual_beta": -101.0})


def test_paper_case_study_through_the_replay():
    got = replay_case(load_case(REF_DIRS[0] / "case_1.json"))["expected"]
    assert got["paper_rho_D"] == pytest.approx(-1.154701, abs=1e-5)
    assert got["paper_rho_B"] == pytest.approx(3.464102, abs=1e-5)


# ------------------------------------------------------------------ random batches + properties


def opd_of(batch: CreditBatch) -> np.ndarray:
    return (batch.teacher_logprobs_ML - batch.student_logprobs_ML) * batch.loss_mask_ML


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(CREDIT_MODES))
def test_beta_zero_is_vanilla_opd(seed, mode):
    batch = random_credit_batch(seed)
    cfg = CreditSection(gc_opd={"residual_beta": 0.0, "adv_clip": 0.0, "credit_mode": mode})
    adv, _ = compute_advantages("gc_opd", batch, cfg)
    np.testing.assert_array_equal(adv, opd_of(batch))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(CREDIT_MODES), value=st.sampled_from([0.0, 1.0, 10.0, 0.3]))
def test_all_equal_rewards_give_zero_residual(seed, mode, value):
    batch = random_credit_batch(seed, edge_cases=False)
    batch.episode_reward[:] = value + np.asarray([int(t[1:]) for t in batch.task_id])  # constant within each task
    res = gc_opd_credit(batch, CreditSection(gc_opd={"credit_mode": mode}))
    assert not res.residual_N.any()
    np.testing.assert_array_equal(res.advantages_ML, np.clip(opd_of(batch), -10, 10))
    assert res.metrics["gc_opd/group_identifiable_ratio"] == 0.0


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_results_do_not_depend_on_row_order(method, seed):
    batch = random_credit_batch(seed)
    perm = np.random.default_rng(seed).permutation(batch.num_rows)
    cfg = CreditSection()
    adv, metrics = compute_advantages(method, batch, cfg)
    adv_p, metrics_p = compute_advantages(method, permute_batch(batch, perm), cfg)
    np.testing.assert_array_equal(adv_p, adv[perm])
    assert metrics_p == metrics
    assert np.isfinite(adv).all() and not adv[batch.loss_mask_ML == 0].any()
    assert all(math.isfinite(v) for v in metrics.values())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(CREDIT_MODES))
def test_core_does_not_depend_on_row_order_either(seed, mode):
    # Below compute_advantages (no canonical reordering): segment sums make the core order-free.
    batch = random_credit_batch(seed)
    perm = np.random.default_rng(seed + 1).permutation(batch.num_rows)
    cfg = CreditSection(gc_opd={"credit_mode": mode})
    a, b = gc_opd_credit(batch, cfg), gc_opd_credit(permute_batch(batch, perm), cfg)
    np.testing.assert_allclose(b.advantages_ML, a.advantages_ML[perm], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.residual_N[b.response_M], a.residual_N[a.response_M][perm], rtol=1e-6, atol=1e-6)
    assert b.metrics == pytest.approx(a.metrics, rel=1e-5, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(CREDIT_MODES))
def test_credit_bounds_and_clip(seed, mode):
    batch = random_credit_batch(seed)
    cfg = CreditSection(gc_opd={"credit_mode": mode, "adv_clip": 1.5, "credit_cap": 3.0})
    res = gc_opd_credit(batch, cfg)
    m = batch.loss_mask_ML > 0
    assert (res.token_weight_ML[~m] == 0).all() and (res.token_weight_ML[m] >= 0).all()
    assert (res.token_weight_ML <= 3.0).all()
    assert (np.abs(res.advantages_ML) <= 1.5).all()
    if mode == "uniform":
        np.testing.assert_array_equal(res.token_weight_ML, batch.loss_mask_ML)


@pytest.mark.parametrize("method", METHODS)
def test_edge_cases_are_survived_and_counted(method):
    batch = random_credit_batch(5)
    adv, metrics = compute_advantages(method, batch, CreditSection())
    assert np.isfinite(adv).all()
    assert metrics[f"{method}/turns_without_loss_tokens"] == 1
    assert metrics[f"{method}/single_trajectory_tasks"] == 1
    assert metrics[f"{method}/trajectories_with_varying_reward"] == 1
    assert not adv[batch.num_rows - 1].any()  # the turn without loss tokens


def test_single_trajectory_task_gets_plain_opd():
    batch = random_credit_batch(11)
    res = gc_opd_credit(batch, CreditSection())
    lone = np.asarray(batch.task_id) == "t0"
    assert not res.residual_N[res.response_M][lone].any()
    np.testing.assert_array_equal(res.advantages_ML[lone], np.clip(opd_of(batch)[lone], -10, 10))


def test_reward_varying_inside_a_trajectory_uses_its_mean():
    batch = paper_batch(multi_turn=True)
    rid = np.asarray(batch.rollout_id)
    batch.episode_reward[np.flatnonzero(rid == "r3")[0]] = 3.0  # rows 3, 1, 1 -> mean 5/3
    res = gc_opd_credit(batch, CreditSection())
    assert res.reward_N[res.response_M][rid == "r3"] == pytest.approx(5 / 3)
    assert res.metrics["gc_opd/trajectories_with_varying_reward"] == 1.0


def test_empty_batch_and_all_empty_masks():
    batch = random_credit_batch(2)
    batch.loss_mask_ML[:] = 0
    for method in METHODS:
        adv, metrics = compute_advantages(method, batch, CreditSection())
        assert not adv.any() and all(math.isfinite(v) for v in metrics.values())
    empty = CreditBatch([], [], [], [], np.zeros(0, np.float32), np.zeros(0, bool), np.zeros((0, 4), np.float32),
                        np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32),
                        teacher_entropy_ML=np.zeros((0, 4), np.float32), student_entropy_ML=np.zeros((0, 4), np.float32))
    for method in METHODS:
        adv, _ = compute_advantages(method, empty, CreditSection())
        assert adv.shape == (0, 4)


def test_off_mask_padding_may_be_minus_inf():
    batch = random_credit_batch(4)
    off = batch.loss_mask_ML == 0
    for arr in (batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.base_logprobs_ML):
        arr[off] = -np.inf
    batch.teacher_entropy_ML[off] = np.nan
    for method in METHODS:
        adv, metrics = compute_advantages(method, batch, CreditSection())
        assert np.isfinite(adv).all() and all(math.isfinite(v) for v in metrics.values()), method


# ------------------------------------------------------------------ baselines, multi-turn


def two_trajectory_batch() -> CreditBatch:
    """Task x: trajectory A (reward 1, two turns) and B (reward 0, one turn), 3 tokens a row."""
    gap = np.asarray([[-0.5, -0.5, 0.0], [-1.0, 0.0, 0.0], [0.3, 0.3, 12.0]], np.float32)  # A0, A1, B0
    mask = np.asarray([[1, 1, 0], [1, 0, 0], [1, 1, 1]], np.float32)
    student = np.full((3, 3), -1.0, np.float32)
    return CreditBatch(
        task_id=["x"] * 3, rollout_id=["A", "A", "B"], turn_id=[0, 1, 0], data_source=["w"] * 3,
        episode_reward=np.asarray([1, 1, 0], np.float32), is_action_valid=np.ones(3, bool),
        loss_mask_ML=mask, student_logprobs_ML=student, teacher_logprobs_ML=student + gap,
    )


def test_uni_opd_shift_is_per_trajectory():
    batch = two_trajectory_batch()
    res = uni_opd_credit(batch, CreditSection())
    # A: mean over its 3 loss tokens (-0.5, -0.5, -1.0) = -2/3; B: (0.3, 0.3, 12) / 3 = 4.2.
    gap = -2 / 3 - 4.2
    shift = 0.4 - gap
    np.testing.assert_allclose(res.sample_shift_N[res.response_M], [shift / 2, shift / 2, -shift / 2], rtol=1e-6)
    want = np.asarray([[-0.5 + shift / 2, -0.5 + shift / 2, 0], [-1 + shift / 2, 0, 0],
                       [0.3 - shift / 2, 0.3 - shift / 2, 0]])  # |current - teacher| = 12 >= 10: 0
    np.testing.assert_allclose(res.advantages_ML, want, rtol=1e-6, atol=1e-6)
    assert res.metrics["uni_opd/shifted_group_count"] == 1.0
    assert res.metrics["uni_opd/clip_keep_ratio"] == pytest.approx(5 / 6)


def test_uni_opd_no_shift_when_margin_already_met_or_one_sided():
    batch = two_trajectory_batch()
    batch.teacher_logprobs_ML[2] = batch.student_logprobs_ML[2] - 5.0  # B far below A
    assert not uni_opd_credit(batch, CreditSection()).sample_shift_N.any()
    batch.episode_reward[:] = 1.0  # no incorrect trajectory
    assert not uni_opd_credit(batch, CreditSection()).sample_shift_N.any()


def test_power_opd_values():
    batch = two_trajectory_batch()
    batch.teacher_logprobs_ML[0, 0] = 0.3  # a positive log-prob is clamped to 0
    res = power_opd_credit(batch, CreditSection(power_opd={"alpha": 2.0}))
    t, s = np.minimum(batch.teacher_logprobs_ML, 0), batch.student_logprobs_ML
    np.testing.assert_allclose(res.advantages_ML, (np.exp(t) ** 2 - np.exp(s) ** 2) * batch.loss_mask_ML, rtol=1e-6, atol=1e-7)


def test_power_opd_is_the_plain_float32_formula_bit_for_bit():
    """α = 100 pushes most powers below float32's smallest number: they must still be the exact 0s (and
    every other value the exact float32 result) of exp(α·min(x, 0)·mask), inf padding included."""
    batch = random_credit_batch(11, L=40)
    off = batch.loss_mask_ML == 0
    batch.teacher_logprobs_ML[0, 0] = 0.5  # a positive log-prob is clamped to 0
    batch.student_logprobs_ML[off] = -np.inf
    adv = power_opd_credit(batch, CreditSection()).advantages_ML
    alpha, m = np.float32(100.0), batch.loss_mask_ML != 0
    with np.errstate(under="ignore"):
        want = [np.exp(alpha * np.where(m, np.minimum(x, np.float32(0)), np.float32(0)))
                for x in (batch.teacher_logprobs_ML, batch.student_logprobs_ML)]
    np.testing.assert_array_equal(adv, want[0] - want[1])
    assert (adv[m] == 0).any() and (want[1][m] == 0).mean() > 0.3


def test_masked_gap_row_sums_without_the_array_are_the_same_bits():
    from opsd.credit.gc_opd import masked_gap

    batch = random_credit_batch(12, tasks=4, rollouts=8, max_turns=10, L=3000, edge_cases=False)
    batch.teacher_logprobs_ML[batch.loss_mask_ML == 0] = -np.inf  # the np.where path in some blocks
    batch.teacher_logprobs_ML[:40] = np.minimum(batch.teacher_logprobs_ML[:40], 0)
    full = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML)
    rows = masked_gap(batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML, keep_opd=False)
    assert rows.opd_ML is None and batch.num_rows > 2 * (1 << 17) // 3000
    np.testing.assert_array_equal(rows.row_sum_M, full.row_sum_M)
    np.testing.assert_array_equal(rows.row_tokens_M, full.row_tokens_M)
    np.testing.assert_array_equal(full.row_sum_M, full.opd_ML.sum(axis=1))


def test_ex_opd_base_and_fallback():
    batch = two_trajectory_batch()
    t, s, m = batch.teacher_logprobs_ML, batch.student_logprobs_ML, batch.loss_mask_ML
    res = ex_opd_credit(batch, CreditSection())  # no base: falls back to the student, A = λ (t − s)
    np.testing.assert_allclose(res.advantages_ML, 1.25 * (t - s) * m, rtol=1e-6, atol=1e-6)
    assert res.metrics["ex_opd/base_fallback"] == 1.0
    batch.base_logprobs_ML = s - 0.2
    res = ex_opd_credit(batch, CreditSection(ex_opd={"lam": 1.5}))
    np.testing.assert_allclose(res.advantages_ML, (1.5 * t - 0.5 * (s - 0.2) - s) * m, rtol=1e-6, atol=1e-6)
    assert res.metrics["ex_opd/base_fallback"] == 0.0
    res = ex_opd_credit(batch, CreditSection(ex_opd={"lam": 1.5, "base": "old"}))
    np.testing.assert_allclose(res.advantages_ML, 1.5 * (t - s) * m, rtol=1e-6, atol=1e-6)


def test_fire_opd_filters_whole_trajectories():
    batch = random_credit_batch(7, edge_cases=False)
    res = fire_opd_credit(batch, CreditSection(fire_opd={"skip_percentile": 50.0}))
    m = batch.loss_mask_ML > 0
    assert res.token_weight_ML[m].mean() == pytest.approx(1.0, rel=1e-5)  # mean 1 over ALL valid tokens
    keep_M = res.keep_N[res.response_M]
    assert 0 < res.keep_N.sum() < res.keep_N.size
    assert not res.advantages_ML[~keep_M].any()
    np.testing.assert_allclose(res.advantages_ML[keep_M], (res.token_weight_ML * opd_of(batch))[keep_M], rtol=1e-6, atol=1e-6)
    # The keep decision is per trajectory: mean teacher log-prob over all its turns' loss tokens.
    t_sum = np.bincount(res.response_M, weights=(batch.teacher_logprobs_ML * batch.loss_mask_ML).sum(1))
    n = np.bincount(res.response_M, weights=batch.loss_mask_ML.sum(1))
    np.testing.assert_allclose(res.normalized_teacher_logprob_N, t_sum / n, rtol=1e-6)


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("method", METHODS)
def test_missing_teacher_is_an_error(method):
    batch = random_credit_batch(1)
    batch.teacher_logprobs_ML = None
    with pytest.raises(ValueError, match="teacher_logprobs_ML"):
        compute_advantages(method, batch, CreditSection())


@pytest.mark.parametrize("field", ["teacher_entropy_ML", "student_entropy_ML"])
def test_fire_opd_names_the_missing_entropy(field):
    batch = random_credit_batch(1)
    setattr(batch, field, None)
    with pytest.raises(ValueError, match=field):
        compute_advantages("fire_opd", batch, CreditSection())


@pytest.mark.parametrize("method", METHODS)
def test_nan_on_a_loss_token_is_an_error(method):
    batch = random_credit_batch(1)
    batch.student_logprobs_ML[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        (gc_opd_credit if method == "gc_opd" else {
            "uni_opd": uni_opd_credit, "power_opd": power_opd_credit, "ex_opd": ex_opd_credit,
            "fire_opd": fire_opd_credit}[method])(batch, CreditSection())


def test_nan_entropy_on_a_loss_token_and_bad_shapes_are_errors():
    batch = random_credit_batch(1)
    batch.student_entropy_ML[0, 0] = np.inf
    with pytest.raises(ValueError, match="entropy"):
        fire_opd_credit(batch, CreditSection())
    batch = random_credit_batch(1)
    batch.teacher_logprobs_ML = batch.teacher_logprobs_ML[:, :-1]
    with pytest.raises(ValueError, match="shape"):
        gc_opd_credit(batch, CreditSection())


def test_credit_cap_below_one_is_an_error():
    with pytest.raises(ValueError, match="credit_cap"):
        gc_opd_credit(random_credit_batch(1), CreditSection(gc_opd={"credit_cap": 0.5}))
