"""The guard for a teacher worse than its student (opsd/credit/guard.py), on hand-made batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from opsd.config import CreditSection, RunConfig
from opsd.credit import compute_advantages
from opsd.credit.guard import apply_teacher_guard, teacher_worse_groups, winning_rows
from opsd.types import CreditBatch


def batch() -> CreditBatch:
    """Three groups of two one-turn trajectories, L = 3 (the last token of every row off the mask).

    a: the winner (reward 1) is scored -2 by the teacher vs -1 by the student -> worse.
    b: the winner is scored -0.5 vs -1 -> not worse; its loser is scored far lower, which must not count.
    c: nobody won -> not judged.
    """
    mask = np.array([[1, 1, 0]] * 6, dtype=np.float32)
    student = np.full((6, 3), -1.0, dtype=np.float32)
    teacher = np.array([[-2.0, -2.0, -9.0], [-0.1, -0.1, -9.0],   # a: winner, loser
                        [-0.5, -0.5, -9.0], [-7.0, -7.0, -9.0],   # b: winner, loser
                        [-3.0, -3.0, -9.0], [-3.0, -3.0, -9.0]],  # c
                       dtype=np.float32)
    return CreditBatch(
        task_id=["a", "a", "b", "b", "c", "c"], rollout_id=["r0", "r1"] * 3, turn_id=[0] * 6, data_source=["twx"] * 6,
        episode_reward=np.array([1, 0, 1, 0, 0, 0], dtype=np.float32), is_action_valid=np.ones(6, dtype=bool),
        loss_mask_ML=mask, student_logprobs_ML=student, teacher_logprobs_ML=teacher,
        corrected_logprobs_ML=teacher - 0.25,
    )


def test_winners_and_the_groups_whose_teacher_is_worse():
    b = batch()
    assert winning_rows(b).tolist() == [True, False, True, False, False, False]
    assert teacher_worse_groups(b) == (["a"], 2)
    # A teacher exactly as good as the student is not worse.
    b.teacher_logprobs_ML[0, :2] = -1.0
    assert teacher_worse_groups(b) == ([], 2)


def test_report_changes_nothing_and_gives_the_share():
    b = batch()
    out, metrics = apply_teacher_guard(b, "report", 0.5)
    assert out is b
    assert metrics == {"teacher_guard/worse_groups": 1.0, "teacher_guard/judged_groups": 2.0, "teacher_guard/worse_share": 0.5}
    _, none_judged = apply_teacher_guard(batch_without_winners(), "report", 0.5)
    assert none_judged["teacher_guard/judged_groups"] == 0 and math.isnan(none_judged["teacher_guard/worse_share"])


def batch_without_winners() -> CreditBatch:
    b = batch()
    b.episode_reward[:] = 0.0
    return b


def test_downweight_scales_the_flagged_groups_gap_on_the_loss_tokens_only():
    b = batch()
    before = b.teacher_logprobs_ML.copy()
    out, _ = apply_teacher_guard(b, "downweight", 0.25)
    assert np.array_equal(b.teacher_logprobs_ML, before)  # the input batch is left as it was
    # Group a (rows 0-1): student + 0.25 (teacher - student) on the mask; the off-mask token untouched.
    np.testing.assert_allclose(out.teacher_logprobs_ML[0], [-1.25, -1.25, -9.0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(out.teacher_logprobs_ML[1], [-0.775, -0.775, -9.0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(out.corrected_logprobs_ML[0], [-1.3125, -1.3125, -9.25], rtol=0, atol=1e-7)
    assert out.teacher_logprobs_ML.dtype == np.float32
    # Groups b and c unchanged.
    assert np.array_equal(out.teacher_logprobs_ML[2:], before[2:])
    assert np.array_equal(out.corrected_logprobs_ML[2:], before[2:] - 0.25)


@pytest.mark.parametrize("method", ["grpo_opd", "opd"])
def test_skip_leaves_the_flagged_group_its_teacher_free_advantage(method):
    """skip: the flagged group's gap is 0, so grpo_opd gives it GRPO's advantages and opd gives it none;
    the other groups get what they got without the guard."""
    b = batch()
    out, _ = apply_teacher_guard(b, "skip", 0.5)
    assert np.array_equal(out.teacher_logprobs_ML[:2] * b.loss_mask_ML[:2], b.student_logprobs_ML[:2] * b.loss_mask_ML[:2])
    cfg = CreditSection()
    guarded, _ = compute_advantages(method, out, cfg)
    plain, _ = compute_advantages(method, b, cfg)
    grpo, _ = compute_advantages("grpo", b, cfg)
    want_a = grpo[:2] if method == "grpo_opd" else np.zeros_like(grpo[:2])
    np.testing.assert_allclose(guarded[:2] * b.loss_mask_ML[:2], want_a * b.loss_mask_ML[:2], rtol=0, atol=1e-6)
    np.testing.assert_allclose(guarded[2:], plain[2:], rtol=0, atol=1e-6)
    assert np.abs(plain[:2] - guarded[:2]).max() > 0.1  # the guard did change group a


def test_bad_guard_arguments_and_the_alignopsd_refusal():
    with pytest.raises(ValueError, match="unknown mode"):
        apply_teacher_guard(batch(), "halve", 0.5)
    with pytest.raises(ValueError, match=r"weight must be in \[0, 1\]"):
        apply_teacher_guard(batch(), "downweight", 1.5)
    b = batch()
    b.teacher_logprobs_ML = None
    with pytest.raises(ValueError, match="no teacher log-probs"):
        apply_teacher_guard(b, "report", 0.5)
    with pytest.raises(ValidationError, match="teacher_guard skip is not available for alignopsd"):
        RunConfig.model_validate({"run": {"method": "alignopsd"}, "credit": {"teacher_guard": "skip"}})
    RunConfig.model_validate({"run": {"method": "gc_opd"}, "credit": {"teacher_guard": "skip"}})


def test_a_guard_setting_without_effect_is_refused():
    """grpo has no teacher gap to shrink, and a weight is read only by downweight: both would be silently ignored."""
    for mode in ("downweight", "skip"):
        with pytest.raises(ValidationError, match=f"teacher_guard {mode} acts on a teacher's gap"):
            RunConfig.model_validate({"run": {"method": "grpo"}, "credit": {"teacher_guard": mode}})
    assert RunConfig.model_validate({"run": {"method": "grpo"}}).credit.teacher_guard == "report"
    with pytest.raises(ValidationError, match="teacher_guard_weight is used only with"):
        RunConfig.model_validate({"run": {"method": "opsd"}, "credit": {"teacher_guard_weight": 0.2}})
    cfg = RunConfig.model_validate({"run": {"method": "opsd"},
                                    "credit": {"teacher_guard": "downweight", "teacher_guard_weight": 0.2}})
    assert cfg.credit.teacher_guard_weight == 0.2
    for method in ("grpo", "opsd"):  # a config written out in full and read again (opsd run's config.yaml) loads
        full = RunConfig.model_validate({"run": {"method": method}}).model_dump(mode="json")
        assert RunConfig.model_validate(full).credit.teacher_guard == "report"
