"""Teacher-verifier disagreement diagnostics (opsd/credit/diagnostics.py) on hand-computed groups, and their
way into the step record (services/trainer/report.py) and /metrics (services/trainer/__main__.export_step)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opsd.config import CreditSection
from opsd.credit.diagnostics import bucket_names, group_diagnostics, teacher_verifier_metrics
from services.trainer.report import summarize
from tests.factories import make_scored_group

# Group A (binary rewards). Reward-ordered pairs (better, worse) and the teacher's Δs:
# (0,1) +0.3, (0,2) +0.2 agree; (3,1) -0.1, (3,2) -0.2 disagree -> pairwise 2/4; the teacher's top (0) has
# the best reward -> top-1 0; gap (0.3 + 0.2 - 0.1 - 0.2) / 4 = 0.05.
A_R, A_S = [1.0, 0.0, 0.0, 1.0], [0.5, 0.2, 0.3, 0.1]
# Group B (graded rewards). (1 over 0): Δs = -1 disagrees; (0 over 2) +2, (1 over 2) +1 agree -> 1/3; the
# teacher's top (0) has reward 0.5 < 1 -> top-1 1; gap (-1 + 2 + 1) / 3 = 2/3.
B_R, B_S = [0.5, 1.0, 0.0], [3.0, 2.0, 1.0]


def test_hand_computed_groups():
    a = group_diagnostics(np.array(A_R), np.array(A_S))
    assert (a.pairwise_disagreement, a.top1_mismatch) == (0.5, 0.0) and a.preference_gap == pytest.approx(0.05)
    b = group_diagnostics(np.array(B_R), np.array(B_S))
    assert b.pairwise_disagreement == pytest.approx(1 / 3) and b.top1_mismatch == 1.0
    assert b.preference_gap == pytest.approx(2 / 3)


def test_groups_the_paper_excludes_and_teacher_ties():
    # No verifier preference: all rewards equal (within eps), or one response.
    assert group_diagnostics(np.array([1.0, 1.0, 1.0]), np.array([0.1, 0.5, 0.2])) is None
    assert group_diagnostics(np.array([0.3, 0.3 + 1e-9]), np.array([0.1, 0.5])) is None
    assert group_diagnostics(np.array([1.0]), np.array([0.1])) is None
    # The teacher ties the only reward-ordered pair: no pairwise value; both responses are its top, one of
    # them below the best reward -> top-1 1/2; gap 0.
    tie = group_diagnostics(np.array([1.0, 0.0]), np.array([-0.2, -0.2]))
    assert math.isnan(tie.pairwise_disagreement) and tie.top1_mismatch == 0.5 and tie.preference_gap == 0.0
    # A teacher that reverses the verifier exactly: every pair disagrees, its favourite is the worst.
    rev = group_diagnostics(np.array([0.0, 0.5, 1.0]), np.array([1.0, 0.0, -1.0]))
    assert (rev.pairwise_disagreement, rev.top1_mismatch) == (1.0, 1.0) and rev.preference_gap == pytest.approx(-4 / 3)
    with pytest.raises(ValueError, match="NaN or inf"):
        group_diagnostics(np.array([1.0, 0.0]), np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="equal 1-D"):
        group_diagnostics(np.array([1.0, 0.0]), np.array([0.0]))


def test_macro_average_over_groups_and_prompt_length_buckets():
    # Groups: A (prompts of ~500 tokens), B (~3000), an all-equal group (excluded), the tie group (~500).
    reward = np.array(A_R + B_R + [1.0, 1.0] + [1.0, 0.0])
    score = np.array(A_S + B_S + [0.3, 0.1] + [-0.2, -0.2])
    group = np.array([0] * 4 + [1] * 3 + [2] * 2 + [3] * 2)
    prompt = np.array([400, 600, 500, 500] + [3000] * 3 + [9000] * 2 + [500, 500])
    out = teacher_verifier_metrics(reward, score, group, prompt, [1024, 2048, 4096])
    assert out["teacher_verifier/all/groups"] == 3.0
    # The macro mean: each group weighs 1 (B's 3 pairs count as much as A's 4); the tie group has no pairwise value.
    assert out["teacher_verifier/all/pairwise_disagreement"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert out["teacher_verifier/all/top1_mismatch"] == pytest.approx((0.0 + 1.0 + 0.5) / 3)
    assert out["teacher_verifier/all/preference_gap"] == pytest.approx((0.05 + 2 / 3 + 0.0) / 3)
    assert out["teacher_verifier/<1k/groups"] == 2.0 and out["teacher_verifier/2k-4k/groups"] == 1.0
    assert out["teacher_verifier/<1k/pairwise_disagreement"] == 0.5
    assert out["teacher_verifier/<1k/top1_mismatch"] == 0.25
    assert out["teacher_verifier/2k-4k/top1_mismatch"] == 1.0
    # Empty buckets (the excluded group's prompts are >= 4k) keep only their count.
    assert out["teacher_verifier/1k-2k/groups"] == 0.0 and out["teacher_verifier/>=4k/groups"] == 0.0
    assert not [k for k in out if k.startswith(("teacher_verifier/1k-2k/", "teacher_verifier/>=4k/")) and "groups" not in k]
    with pytest.raises(ValueError, match="increase strictly"):
        teacher_verifier_metrics(reward, score, group, prompt, [2048, 1024])


def test_bucket_names():
    assert bucket_names([1024, 2048, 4096, 8192]) == ["<1k", "1k-2k", "2k-4k", "4k-8k", ">=8k"]
    assert bucket_names([500, 1024]) == ["<500", "500-1k", ">=1k"]
    assert bucket_names([]) == ["all"]
    with pytest.raises(ValueError, match="diagnostic_prompt_buckets"):
        CreditSection(diagnostic_prompt_buckets=[2048, 1024])


def test_step_record_and_prometheus_series():
    from prometheus_client import REGISTRY

    from services.trainer.__main__ import export_step

    groups = [make_scored_group(G=4, seed=s) for s in range(3)]
    for sg, rewards in zip(groups, ([1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.2, 0.9, 0.5, 0.0])):
        for t, r in zip(sg.rollout.trajectories, rewards):
            t.reward = r
    # Expected from the definitions: s_i over each trajectory's loss tokens, groups 0 and 2 count.
    diags = []
    for sg in (groups[0], groups[2]):
        ts = sg.rollout.trajectories
        s = [float((lp[t.loss_mask_S == 1] - t.sampler_logprobs_S[t.loss_mask_S == 1]).mean())
             for t, lp in zip(ts, sg.teacher_logprobs_S)]
        diags.append(group_diagnostics(np.array([t.reward for t in ts]), np.array(s)))
    record = summarize([sg.rollout for sg in groups], groups, [1024])
    assert record["teacher_verifier/all/groups"] == 2.0 and record["teacher_verifier/<1k/groups"] == 2.0
    assert record["teacher_verifier/>=1k/groups"] == 0.0  # the factory's prompts are 8-16 tokens
    assert record["teacher_verifier/all/top1_mismatch"] == pytest.approx(np.mean([d.top1_mismatch for d in diags]))
    assert record["teacher_verifier/all/preference_gap"] == pytest.approx(np.mean([d.preference_gap for d in diags]))
    # Compute counted (issue 41): the teachers' own counts, and every trajectory's tokens.
    assert record["teacher_forward_tokens"] == sum(sg.teacher_forward_tokens for sg in groups)
    assert record["sequence_tokens"] == sum(t.token_ids_S.shape[0] for sg in groups for t in sg.rollout.trajectories) > 0
    # Without a teacher: no diagnostics.
    assert not [k for k in summarize([sg.rollout for sg in groups], None) if k.startswith("teacher_verifier/")]

    record.update({"policy_version": 1, "loss_tokens": 10, "wait_seconds": 1.0, "train_seconds": 2.0,
                   "format_valid_rate": 1.0, "mismatch_kl": 0.0})
    export_step(record, n_groups=3)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, {"role": "trainer", **labels})

    assert value("opsd_teacher_verifier_preference_gap_nats", bucket="all") == pytest.approx(
        record["teacher_verifier/all/preference_gap"])
    assert value("opsd_teacher_verifier_disagreement_ratio", diagnostic="top1", bucket="<1k") == pytest.approx(
        record["teacher_verifier/<1k/top1_mismatch"])
    # A bucket without groups shows no value (NaN), never a stale one.
    assert math.isnan(value("opsd_teacher_verifier_disagreement_ratio", diagnostic="pairwise", bucket=">=1k"))
