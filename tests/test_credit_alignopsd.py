"""AlignOPSD (spec §4): the authors' reference vectors, unit cases, ablations and profiles.

Properties (hypothesis) are in tests/test_credit_properties.py.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from opsd.config import ALIGNOPSD_PROFILES, AlignSection, CreditSection, RunConfig
from opsd.credit import compute_advantages, permute_batch
from opsd.credit.alignopsd import alignopsd_credit
from opsd.credit.alignopsd.correspondence import (
    rectify, select_sources, similarity_matrix, structural_mask, webshop_actions_agree,
)
from opsd.credit.alignopsd.spans import (
    boundary_distances, dense_profiles, project_density, random_boundaries, segment_trajectory, task_blocks,
)
from opsd.credit.batch import pair_blocks
from opsd.credit.grpo import trajectory_index
from opsd.credit.reference import (
    credit_section_from_reference_config,
    parse_response,
    replay_case,
    run_product_case,
    run_reference_case,
)
from opsd.credit.replay import check_case, check_file
from opsd.types import CreditBatch
from tests.factories import shared_dir


REF_DIR = shared_dir() / "refvectors" / "alignopsd"
REF_FILES = sorted(REF_DIR.glob("*.json")) if REF_DIR.is_dir() else []


def load_case(path: Path) -> dict:
    if not path.is_file():
        pytest.fail(f"AlignOPSD reference vectors not found at {REF_DIR} (set OPSD_SHARED to the shared/ folder)")
    return json.loads(path.read_text())


def test_reference_vectors_are_present():
    assert REF_DIR.is_dir(), f"missing {REF_DIR}: set OPSD_SHARED to the shared/ folder"
    assert len(REF_FILES) >= 6, f"expected the 6 handed AlignOPSD cases in {REF_DIR}, found {len(REF_FILES)}"
    assert len(ADVANTAGE_FILES) >= 5, f"expected 5 cases with advantages in {REF_DIR}, found {len(ADVANTAGE_FILES)}"


def assert_matches(got, exp, path: str = "") -> None:
    """Floats within 1e-5*max(1,|exp|); ints, bools, strings, None and index lists exact."""
    if isinstance(exp, dict):
        assert isinstance(got, dict), f"{path}: expected a dict, got {type(got).__name__}"
        for k, v in exp.items():
            assert k in got, f"{path}.{k} missing"
            assert_matches(got[k], v, f"{path}.{k}")
    elif isinstance(exp, list):
        assert isinstance(got, list) and len(got) == len(exp), f"{path}: length {len(got) if isinstance(got, list) else got} != {len(exp)}"
        for i, (g, e) in enumerate(zip(got, exp)):
            assert_matches(g, e, f"{path}[{i}]")
    elif isinstance(exp, float):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}: {got!r} is not a number"
        assert abs(got - exp) <= 1e-5 * max(1.0, abs(exp)), f"{path}: got {got}, expected {exp}"
    else:  # bool, int, str, None: exact (bool before int: type must match too)
        assert type(got) is type(exp) and got == exp, f"{path}: got {got!r}, expected {exp!r}"


@pytest.mark.parametrize("path", REF_FILES or [REF_DIR / "missing.json"], ids=lambda p: p.stem)
def test_reference_case(path):
    case = load_case(path)
    expected = case["expected"]
    if "error" in expected:  # upstream rejects the input (e.g. a turn without policy tokens)
        with pytest.raises(ValueError):
            run_reference_case(case["inputs"], case["config"])
        return
    got = run_reference_case(case["inputs"], case["config"])
    for name, value in expected.items():
        assert name in got, f"run_reference_case does not return {name}"
        assert_matches(got[name], value, name)


def batch_from_case(case: dict) -> CreditBatch:
    """The CreditBatch the trainer would receive for this case (teacher/embedder outputs from `expected`)."""
    inp, exp = case["inputs"], case["expected"]
    turns = inp["turns"]
    return CreditBatch(
        task_id=[t["task_id"] for t in turns],
        rollout_id=[t["rollout_id"] for t in turns],
        turn_id=[t["turn_id"] for t in turns],
        data_source=[t["data_source"] for t in turns],
        episode_reward=np.asarray([t["episode_reward"] for t in turns], np.float32),
        is_action_valid=np.asarray([t["is_action_valid"] for t in turns], bool),
        loss_mask_ML=np.asarray(inp["policy_loss_mask"], np.float32),
        student_logprobs_ML=np.asarray(inp["student_log_probs"], np.float32),
        teacher_logprobs_ML=np.asarray(inp["diagonal_teacher_log_probs"], np.float32),
        corrected_logprobs_ML=np.asarray(exp["corrected_teacher_log_probs"], np.float32),
        similarity_blocks=pair_blocks(np.asarray(exp["thinking_similarity_source_by_target"], np.float32),
                                      [t["task_id"] for t in turns]),
        eligible_blocks=pair_blocks(np.asarray(exp["structural_mask_source_by_target"], bool),
                                    [t["task_id"] for t in turns]),
    )


# The cases with an advantage to reproduce (an error case's refusal: test_reference_case, test_turn_without_loss_tokens).
ADVANTAGE_FILES = [p for p in REF_FILES if "error" not in json.loads(p.read_text())["expected"]]


@pytest.mark.parametrize("path", ADVANTAGE_FILES or [REF_DIR / "missing.json"], ids=lambda p: p.stem)
def test_registered_estimator_reproduces_final_advantage(path):
    case = load_case(path)
    batch = batch_from_case(case)
    cfg = credit_section_from_reference_config(case["config"])
    adv, metrics = compute_advantages("alignopsd", batch, cfg)
    assert adv.dtype == np.float32
    assert_matches(adv.tolist(), case["expected"]["final_token_advantage"], "final_token_advantage")
    assert all(math.isfinite(v) for v in metrics.values())
    # Rows arriving in another order get the same advantages, row for row.
    perm = np.random.default_rng(0).permutation(batch.num_rows)
    adv_p, metrics_p = compute_advantages("alignopsd", permute_batch(batch, perm), cfg)
    np.testing.assert_array_equal(adv_p, adv[perm])
    assert metrics_p == metrics


def test_reference_metrics_case1():
    case = load_case(REF_DIR / "case_1.json")
    _, metrics = compute_advantages("alignopsd", batch_from_case(case), credit_section_from_reference_config(case["config"]))
    assert metrics["alignopsd/num_spans"] == 5.0
    assert metrics["alignopsd/mean_span_turns"] == pytest.approx(12 / 5)
    assert metrics["alignopsd/threshold"] == pytest.approx(0.1)
    assert metrics["alignopsd/threshold_inf"] == 0.0
    assert metrics["alignopsd/turns_without_loss_tokens"] == 0.0
    assert metrics["alignopsd/semantic_boundaries"] == 2.0


def test_noncanonical_batch_is_rejected_by_the_core():
    case = load_case(REF_DIR / "case_1.json")
    batch = permute_batch(batch_from_case(case), np.arange(12)[::-1])
    with pytest.raises(ValueError, match="canonical"):
        alignopsd_credit(batch, credit_section_from_reference_config(case["config"]))


def test_turn_without_loss_tokens():
    case = load_case(REF_DIR / "case_1.json")
    case["inputs"]["policy_loss_mask"][7] = [0.0] * 4  # r1 turn 2 (invalid action) loses its tokens
    with pytest.raises(ValueError, match="policy-loss tokens"):
        run_reference_case(case["inputs"], case["config"])  # the reference behaviour
    ref = run_reference_case(case["inputs"], case["config"], empty_turns="weight_one")
    assert ref["turn_weight"][7] == 1.0 and ref["policy_token_count"][7] == 0
    assert ref["final_token_advantage"][7] == [0.0] * 4
    N = np.asarray(ref["policy_token_count"], float)
    W = np.asarray(ref["turn_weight"])
    for rows in (range(0, 5), range(5, 9), range(9, 12)):
        rows = list(rows)
        assert (N[rows] * W[rows]).sum() == pytest.approx(N[rows].sum(), rel=1e-5)
    # the empty turn takes no budget: r1's other turns share all of it
    assert ref["within_segment_turn_budget"][7] == 0.0
    assert ref["within_segment_turn_budget"][8] == pytest.approx(1.0)
    batch = batch_from_case(case)
    batch.loss_mask_ML[7] = 0
    adv, metrics = compute_advantages("alignopsd", batch, credit_section_from_reference_config(case["config"]))
    assert metrics["alignopsd/turns_without_loss_tokens"] == 1.0
    assert np.isfinite(adv).all() and not adv[7].any()


def test_missing_fields_are_reported():
    case = load_case(REF_DIR / "case_5.json")
    batch = batch_from_case(case)
    batch.corrected_logprobs_ML = None
    with pytest.raises(ValueError, match="corrected_logprobs_ML"):
        compute_advantages("alignopsd", batch, CreditSection())


# ---------------------------------------------------------------- embedder / teacher units


def test_parse_response_ignores_actions_inside_thinking():
    text = "<think>maybe <action>go north</action>? no</think><action>open door</action>"
    assert parse_response(text) == ("maybe <action>go north</action>? no", "open door")
    assert parse_response("<THINK> x </THINK><search> q </search>") == ("x", "q")
    assert parse_response("<action>go to b2</action>") == ("", "go to b2")
    assert parse_response("I think <action>go north") == ("", "")


def test_similarity_of_zero_vector_is_zero_not_nan():
    T = np.asarray([[1.0, 0.0], [0.0, 0.0]])
    S = np.asarray([[2.0, 0.0], [1.0, 1.0]])
    H = similarity_matrix(T, S)
    assert H.dtype == np.float32
    np.testing.assert_allclose(H, [[1.0, math.sqrt(0.5)], [0.0, 0.0]], rtol=1e-6)
    assert np.isfinite(H).all()
    assert similarity_matrix(T, S, task_id=["a", "b"])[0, 1] == 0.0
    with pytest.raises(ValueError):
        similarity_matrix(np.asarray([[np.nan, 0.0]]), np.ones((1, 2)))


def test_structural_mask():
    E = structural_mask(["t", "t", "t", "u"], ["a", "b", "b", "c"], ["x", "x", "y", "x"], np.asarray([1, 1, 1, 1], bool), np.asarray([1, 0, 1, 1], bool))
    # source 1's teacher thinking invalid; 2 is another data source; 3 another task; 0 vs 0 same rollout
    assert E.astype(int).tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_select_sources_cap_ties_topk_and_action_filter():
    cfg = AlignSection(similarity_threshold=0.5, top_k=2, action_filter_enabled=False)
    rollout = ["a", "b", "b", "c", "d", "t"]
    H = np.zeros((6, 6), np.float32)
    H[:5, 5] = [0.7, 0.9, 0.95, 0.9, 0.4]
    E = np.zeros((6, 6), bool)
    E[:5, 5] = True
    sel = select_sources(H, E, cfg, rollout_id=rollout)
    # rollout b keeps only 2 (0.95); tie 0.9 between 1 (dropped by the cap) and 3; 4 is below gamma
    assert sel.sources[5] == [2, 3]
    w = np.exp(np.asarray([0.95, 0.9]) / 0.1)
    w /= w.sum()
    assert sel.weights[5] == pytest.approx(w, rel=1e-6)
    rho = (w * np.clip((np.asarray([0.95, 0.9]) - 0.5) / 0.5, 0, 1)).sum()
    assert sel.rho_M[5] == pytest.approx(rho, rel=1e-6)
    assert sel.alpha_M[5] == pytest.approx(0.8 * rho, rel=1e-6)
    assert sel.sources[0] == [] and sel.alpha_M[0] == 0.0
    # action filter: drops without refilling from rank 3
    cfgf = AlignSection(similarity_threshold=0.5, top_k=2, action_filter_enabled=True)
    A = np.ones((6, 6), np.float32)
    A[2, 5] = 0.5
    self = select_sources(H, E, cfgf, A, rollout_id=rollout)
    assert self.sources_before_filter[5] == [2, 3] and self.sources[5] == [3]
    assert self.weights[5].tolist() == [1.0]


def test_webshop_symbolic_checks():
    assert webshop_actions_agree("search[red shoes]", "search[blue hat]")
    assert webshop_actions_agree("click[ Buy Now ]", "click[Buy Now]")
    assert not webshop_actions_agree("click[buy now]", "click[back]")
    assert not webshop_actions_agree("search[x]", "click[x]")
    assert not webshop_actions_agree("search[ ]", "search[x]")
    assert not webshop_actions_agree("go north", "go north")


def test_rectify_probability_mixture_and_log_mean():
    ident = np.log(np.asarray([0.5, 0.1], np.float32))
    cross = np.log(np.asarray([[0.2, 0.2], [0.6, 0.2]], np.float32))
    w = np.asarray([0.5, 0.5], np.float32)
    agg, corr = rectify(ident, cross, w, 0.5, "probability_mixture")
    assert agg == pytest.approx(np.log([0.4, 0.2]), abs=1e-6)
    assert corr == pytest.approx(0.5 * np.log([0.5, 0.1]) + 0.5 * np.log([0.4, 0.2]), abs=1e-6)
    agg, _ = rectify(ident, cross, w, 0.5, "log_mean")
    assert agg == pytest.approx([0.5 * (math.log(0.2) + math.log(0.6)), math.log(0.2)], abs=1e-6)
    agg, corr = rectify(ident, np.zeros((0, 2)), np.zeros(0), 0.7, "probability_mixture")
    assert np.array_equal(agg, ident) and np.array_equal(corr, ident)


# ---------------------------------------------------------------- trainer units


def test_segment_forced_and_guided_splits():
    cfg = AlignSection()
    seg = segment_trajectory(np.zeros(10), np.zeros(10, bool), math.inf, cfg)
    assert seg.spans == [(0, 5), (5, 10)] and seg.forced_max == [5] and seg.semantic == []
    D = np.zeros(10, np.float32)
    valid = np.zeros(10, bool)
    D[3], valid[3] = 0.05, True  # below tau = 0.1 but >= 0.01
    seg = segment_trajectory(D, valid, 0.1, cfg)
    assert seg.spans == [(0, 3), (3, 10)] and seg.guided_fallback == [3] and seg.forced_max == []
    D[[2, 4]], valid[[2, 4]] = 0.5, True  # semantic: 2 accepted; 4 would leave [2,4) fine too
    seg = segment_trajectory(D, valid, 0.1, cfg)
    assert seg.spans == [(0, 2), (2, 4), (4, 10)] and seg.semantic == [2, 4]
    D[1], valid[1] = 0.9, True  # best candidate, but leaves a 1-turn piece: rejected
    assert 1 not in segment_trajectory(D, valid, 0.1, cfg).semantic


def test_projection_matches_case7_by_hand():
    h = np.asarray([12.921311, 5.719261e-05, 0.012184196, 0.007430357])
    N = np.asarray([1.0, 4.0, 4.0, 4.0])
    out = project_density(h, N, 0.0, 4.0)
    assert out == pytest.approx([4.0, 0.7435001, 0.755627, 0.7508732], abs=1e-5)
    assert (N * out).sum() == pytest.approx(13.0, abs=1e-7 * 13)  # the spec's bisection tolerance
    assert project_density(np.asarray([0.5, 1.5]), np.asarray([1.0, 1.0]), 0.0, 4.0).tolist() == [0.5, 1.5]


# ---------------------------------------------------------------- replay contract (`opsd credit check`)


@pytest.mark.parametrize("path", REF_FILES or [REF_DIR / "missing.json"], ids=lambda p: p.stem)
def test_replay_check_file(path):
    case = load_case(path)
    result = check_file(path)
    assert result.ok, (result.error, [(f.name, f.detail) for f in result.fields if not f.ok])
    assert {f.name for f in result.fields} == set(case["expected"])  # every expected field was computed


def test_replay_of_a_turn_without_policy_tokens_raises_value_error():
    case = load_case(REF_DIR / "case_1.json")
    case["inputs"]["policy_loss_mask"][3] = [0.0] * len(case["inputs"]["policy_loss_mask"][3])
    case["expected"] = {"error": "ValueError", "message": "a turn without policy-loss tokens"}
    with pytest.raises(ValueError, match="policy-loss tokens"):
        replay_case(case)
    result = check_case(case)
    assert result.ok and [f.name for f in result.fields] == ["error"]


def test_run_product_case_uses_the_product_settings():
    case = load_case(REF_DIR / "case_1.json")
    case["inputs"]["policy_loss_mask"][7] = [0.0] * 4
    cfg = credit_section_from_reference_config(case["config"])
    got = run_product_case(case["inputs"], cfg)  # a turn without loss tokens: weight 1, no error
    assert got["turn_weight"][7] == 1.0 and got["final_token_advantage"][7] == [0.0] * 4
    ref = run_reference_case(case["inputs"], case["config"], empty_turns="weight_one")
    assert got["final_token_advantage"] == ref["final_token_advantage"]


# ---------------------------------------------------------------- ablations (spec §4.4)


@pytest.mark.parametrize("mode, ablation", [("A", "no_rectification"), ("B", "token_level"), ("C", "turn_level"),
                                            ("D", "random_spans"), ("E", "none"), ("c", "turn_level"), (None, "none")])
def test_reference_ablation_mode_maps_to_the_config(mode, ablation):
    case = load_case(REF_DIR / "case_1.json")
    cfg = credit_section_from_reference_config(dict(case["config"], ablation_mode=mode, ablation_seed=7))
    assert cfg.alignopsd.ablation == ablation and cfg.alignopsd.ablation_seed == 7
    with pytest.raises(ValueError, match="ablation_mode"):
        credit_section_from_reference_config(dict(case["config"], ablation_mode="F"))


def test_ablations_are_selected_by_the_run_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("credit:\n  alignopsd:\n    ablation: random_spans\n    ablation_seed: 3\n")
    cfg = RunConfig.load(path)
    assert cfg.credit.alignopsd.ablation == "random_spans" and cfg.credit.alignopsd.ablation_seed == 3
    case = load_case(REF_DIR / "case_1.json")
    _, metrics = compute_advantages("alignopsd", batch_from_case(case), cfg.credit)
    assert metrics["alignopsd/random_boundaries"] > 0 and metrics["alignopsd/semantic_boundaries"] == 0
    path.write_text("credit:\n  alignopsd:\n    ablation: spans_off\n")
    with pytest.raises(ValueError, match="ablation"):
        RunConfig.load(path)


def test_ablation_a_no_rectification_uses_the_identity_teacher():
    case = load_case(REF_DIR / "case_1.json")
    config_a = dict(case["config"], ablation_mode="A")
    got = run_reference_case(case["inputs"], config_a)
    exp = case["expected"]
    assert got["correction_strength_alpha"] == [0.0] * 12
    assert got["selected_sources"] == exp["selected_sources"]  # correspondence is kept
    assert_matches(got["correspondence_confidence_rho"], exp["correspondence_confidence_rho"])
    assert got["corrected_teacher_log_probs"] == np.asarray(case["inputs"]["diagonal_teacher_log_probs"], np.float32).tolist()
    # Trainer: the gap is the identity gap whatever corrected_logprobs_ML holds (it may be absent).
    batch = batch_from_case(case)
    identity = alignopsd_credit(replace(batch, corrected_logprobs_ML=batch.teacher_logprobs_ML),
                                credit_section_from_reference_config(case["config"]))
    batch.corrected_logprobs_ML = None
    out = alignopsd_credit(batch, credit_section_from_reference_config(config_a))
    np.testing.assert_array_equal(out.final_token_advantage_ML, identity.final_token_advantage_ML)
    assert_matches(got["final_token_advantage"], out.final_token_advantage_ML.astype(float).tolist())
    with pytest.raises(ValueError, match="teacher_logprobs_ML"):
        alignopsd_credit(replace(batch, teacher_logprobs_ML=None), credit_section_from_reference_config(config_a))
    sel = select_sources(np.asarray([[0, 0.9], [0.9, 0]], np.float32), ~np.eye(2, dtype=bool),
                         AlignSection(ablation="no_rectification", action_filter_enabled=False), rollout_id=["a", "b"])
    assert sel.rho_M.tolist() == pytest.approx([(0.9 - 0.65) / 0.35] * 2) and sel.alpha_M.tolist() == [0.0, 0.0]


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_ablation_c_turn_level_allocates_over_the_whole_trajectory():
    case = load_case(REF_DIR / "case_1.json")
    batch = batch_from_case(case)
    cfg = credit_section_from_reference_config(dict(case["config"], ablation_mode="C"))
    out = alignopsd_credit(batch, cfg)
    mask = batch.loss_mask_ML.astype(bool)
    N = mask.sum(axis=1).astype(float)
    g = np.where(mask, batch.corrected_logprobs_ML.astype(float) - batch.student_logprobs_ML, 0).sum(axis=1) / N
    for rows in out.trajectory_rows:  # no spans: b = 1, q over all turns of the trajectory
        s = np.sign(out.trajectory_advantage_M[rows[0]]) * g[rows]
        q = _softmax(np.log(N[rows]) + s / cfg.alignopsd.credit_temperature)
        h = N[rows].sum() * q / N[rows]
        W = 0.5 + 0.5 * project_density(h, N[rows], 0.0, 4.0)
        np.testing.assert_allclose(out.within_segment_turn_budget_M[rows], q, rtol=1e-5)
        np.testing.assert_allclose(out.raw_density_M[rows], h, rtol=1e-5)
        np.testing.assert_allclose(out.turn_weight_M[rows], W, rtol=1e-5)
    assert out.segmentations == [] and (out.segment_index_M == -1).all() and out.segment_budget_S.size == 0
    assert math.isinf(out.threshold) and not any(P.any() for P in out.profiles) and not out.profile_valid_M.any()
    assert out.metrics["alignopsd/num_spans"] == 0.0
    got = replay_case({"inputs": case["inputs"], "config": dict(case["config"], ablation_mode="C")})["expected"]
    assert got["segments_per_trajectory"] == [] and got["boundary_kinds"] == [] and got["segment_budget"] == []
    assert got["segment_index_per_turn"] == [-1] * 12 and got["segmentation_threshold"] is None
    assert_matches(got["final_token_advantage"], out.final_token_advantage_ML.astype(float).tolist())


def test_ablation_c_equals_the_full_method_with_one_span_per_trajectory():
    case = load_case(REF_DIR / "case_3.json")  # tau = +inf: no semantic boundary, only length splits
    batch = batch_from_case(case)
    full = credit_section_from_reference_config(case["config"])
    full.alignopsd.max_segment_turns = 50
    out_e = alignopsd_credit(batch, full)
    assert all(len(s.spans) == 1 for s in out_e.segmentations)
    out_c = alignopsd_credit(batch, credit_section_from_reference_config(dict(case["config"], ablation_mode="C")))
    np.testing.assert_allclose(out_c.turn_weight_M, out_e.turn_weight_M, rtol=1e-6)
    np.testing.assert_allclose(out_c.final_token_advantage_ML, out_e.final_token_advantage_ML, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- ablations A and C by hand (spec §4.4)
# Independent oracles: the expected numbers below are worked out from the spec's formulas on paper, not by
# any opsd function. Shared setup: one task "t", rollouts a (reward 1) and b (reward 0), T = credit_temperature
# = 1, GRPO scope "trajectory", no invalid-action penalty, legacy weighting (box [0, 4], eta = 0.5).
#   A_a = (1 - 0.5) / (std_ddof1([1, 0]) + 1e-6) = 0.5 / (0.70710678 + 1e-6) = 0.70710578, A_b = -0.70710578.
# One span per trajectory (b = 1): q_k = N_k e^{s_k} / sum_j N_j e^{s_j}, s_k = sign(A) g_k,
# h_k = N_total q_k / N_k; every h below lies in [0, 4] (no projection), W_k = 0.5 + 0.5 h_k.
A_HAND = 0.70710578


def hand_batch(N: list[list[int]], gap: list[list[float]], other_gap: list[list[float]]) -> CreditBatch:
    """Rows (t, a, k) then (t, b, k), L = 2 tokens: N[i][k] loss tokens (1 or 2) with mean teacher-student gap
    gap[i][k] in teacher_logprobs_ML (a 2-token turn splits it as g + 0.25, g - 0.25) and other_gap[i][k] the same
    way in corrected_logprobs_ML. Off-mask tokens hold a gap of 5 (never read). Similarity 0 everywhere: no
    profile is valid, tau = +inf, so spans only split by length (max_segment_turns)."""
    rows = [(i, k) for i in range(2) for k in range(len(N[i]))]
    mask = np.asarray([[1.0, float(N[i][k] == 2)] for i, k in rows], np.float32)

    def logprobs(g):
        split = [[g[i][k] + 0.25, g[i][k] - 0.25] if N[i][k] == 2 else [g[i][k], 5.0] for i, k in rows]
        return np.asarray(split, np.float32) - 1.0

    M = len(rows)
    owner = np.asarray([i for i, _ in rows])
    return CreditBatch(
        task_id=["t"] * M, rollout_id=["ab"[i] for i, _ in rows], turn_id=[k for _, k in rows], data_source=["env"] * M,
        episode_reward=np.asarray([1.0 - i for i, _ in rows], np.float32), is_action_valid=np.ones(M, bool),
        loss_mask_ML=mask, student_logprobs_ML=np.full((M, 2), -1.0, np.float32),
        teacher_logprobs_ML=logprobs(gap), corrected_logprobs_ML=logprobs(other_gap),
        similarity_blocks={"t": np.zeros((M, M), np.float32)}, eligible_blocks={"t": owner[:, None] != owner[None, :]},
    )


def hand_config(ablation: str, max_segment_turns: int = 8) -> CreditSection:
    return CreditSection(grpo_scope="trajectory", use_invalid_action_penalty=False, alignopsd=AlignSection(
        ablation=ablation, credit_temperature=1.0, max_segment_turns=max_segment_turns))


def assert_hand_worked(batch, cfg, reference, A_M, q, h, W) -> None:
    """alignopsd_credit's intermediates and the registered estimator's advantages against the hand-worked values;
    the token advantage is A_i W_k on each loss token, 0 off the mask."""
    out = alignopsd_credit(batch, cfg, reference_ablations=reference)
    np.testing.assert_allclose(out.trajectory_advantage_M, A_M, rtol=1e-6)
    np.testing.assert_allclose(out.within_segment_turn_budget_M, q, rtol=1e-6)
    np.testing.assert_allclose(out.raw_density_M, h, rtol=1e-6)
    np.testing.assert_allclose(out.turn_weight_M, W, rtol=1e-6)
    expected_ML = np.asarray(A_M)[:, None] * np.asarray(W)[:, None] * batch.loss_mask_ML
    np.testing.assert_allclose(out.final_token_advantage_ML, expected_ML, rtol=1e-6, atol=1e-7)
    adv_ML, _ = compute_advantages("alignopsd", batch, cfg)
    np.testing.assert_allclose(adv_ML, expected_ML, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reference", [False, True])
def test_ablation_a_by_hand_distills_from_the_identity_teacher(reference):
    """A (no rectification): the gap is identity teacher - student; the rectified teacher is never read.
    Identity gaps g: a (N = 1, 2, 1) [ln 3, 0, 0]; b (N = 2, 1, 1) [0, ln 2, 0].
      a: e^s = [3, 1, 1], sum N e^s = 3 + 2 + 1 = 6, N_total 4: q = [3/6, 2/6, 1/6], h = 4/6 [3, 1, 1]
         = [2, 2/3, 2/3], W = [1.5, 5/6, 5/6] = [1.5, 0.83333333, 0.83333333].
      b: s = -g, e^s = [1, 1/2, 1], sum = 2 + 0.5 + 1 = 3.5: q = [2/3.5, 0.5/3.5, 1/3.5] = [4/7, 1/7, 2/7],
         h = 4/3.5 [1, 1/2, 1] = [8/7, 4/7, 8/7], W = [15/14, 11/14, 15/14] = [1.0714286, 0.78571429, 1.0714286].
    The full method (E) on the same batch uses the rectified gaps a [0, 0, ln 3], b [ln 2, 0, 0]:
      a: e^s = [1, 1, 3], sum 6, h = [2/3, 2/3, 2], W = [5/6, 5/6, 1.5];
      b: e^s = [1/2, 1, 1], sum 3, h = [2/3, 4/3, 4/3], W = [5/6, 7/6, 7/6] = [0.83333333, 1.1666667, 1.1666667].
    """
    ln2, ln3 = math.log(2.0), math.log(3.0)
    batch = hand_batch(N=[[1, 2, 1], [2, 1, 1]], gap=[[ln3, 0, 0], [0, ln2, 0]], other_gap=[[0, 0, ln3], [ln2, 0, 0]])
    A_M = [A_HAND] * 3 + [-A_HAND] * 3
    assert_hand_worked(batch, hand_config("no_rectification"), reference, A_M,
                       q=[0.5, 0.33333333, 0.16666667, 0.57142857, 0.14285714, 0.28571429],
                       h=[2.0, 0.66666667, 0.66666667, 1.1428571, 0.57142857, 1.1428571],
                       W=[1.5, 0.83333333, 0.83333333, 1.0714286, 0.78571429, 1.0714286])
    # The same batch under the full method: the test tells the two teachers apart.
    out = alignopsd_credit(batch, hand_config("none"))
    np.testing.assert_allclose(out.turn_weight_M, [0.83333333, 0.83333333, 1.5, 0.83333333, 1.1666667, 1.1666667],
                               rtol=1e-6)
    # A never reads the rectified teacher: absent, the same numbers.
    out = alignopsd_credit(replace(batch, corrected_logprobs_ML=None), hand_config("no_rectification"))
    np.testing.assert_allclose(out.turn_weight_M, [1.5, 0.83333333, 0.83333333, 1.0714286, 0.78571429, 1.0714286],
                               rtol=1e-6)


@pytest.mark.parametrize("reference", [False, True])
def test_ablation_c_by_hand_allocates_over_the_whole_trajectory(reference):
    """C (turn level, no spans): one softmax over all turns of a trajectory, even where the full method would
    split it (max_segment_turns 3: E cuts each 4-turn trajectory at turn 2, which changes every number below).
    Rectified gaps g: a (N = 1, 2, 1, 2) [ln 2, 0, 0, ln 3]; b (N = 2, 2, 1, 1) [0, ln 2, ln 2, 0].
      a: e^s = [2, 1, 1, 3], sum N e^s = 2 + 2 + 1 + 6 = 11, N_total 6: q = [2/11, 2/11, 1/11, 6/11]
         = [0.18181818, 0.18181818, 0.090909091, 0.54545455], h = 6/11 [2, 1, 1, 3] = [12/11, 6/11, 6/11, 18/11]
         = [1.0909091, 0.54545455, 0.54545455, 1.6363636], W = [23/22, 17/22, 17/22, 29/22]
         = [1.0454545, 0.77272727, 0.77272727, 1.3181818].
      b: s = -g, e^s = [1, 1/2, 1/2, 1], sum = 2 + 1 + 0.5 + 1 = 4.5: q = [4/9, 2/9, 1/9, 2/9]
         = [0.44444444, 0.22222222, 0.11111111, 0.22222222], h = 6/4.5 [1, 1/2, 1/2, 1] = [4/3, 2/3, 2/3, 4/3],
         W = [7/6, 5/6, 5/6, 7/6] = [1.1666667, 0.83333333, 0.83333333, 1.1666667].
    Identity gaps (ignored by C, which reads the rectified teacher): all 0.
    """
    ln2, ln3 = math.log(2.0), math.log(3.0)
    batch = hand_batch(N=[[1, 2, 1, 2], [2, 2, 1, 1]], gap=[[0] * 4, [0] * 4],
                       other_gap=[[ln2, 0, 0, ln3], [0, ln2, ln2, 0]])
    cfg = hand_config("turn_level", max_segment_turns=3)
    assert_hand_worked(batch, cfg, reference, [A_HAND] * 4 + [-A_HAND] * 4,
                       q=[0.18181818, 0.18181818, 0.090909091, 0.54545455, 0.44444444, 0.22222222, 0.11111111, 0.22222222],
                       h=[1.0909091, 0.54545455, 0.54545455, 1.6363636, 1.3333333, 0.66666667, 0.66666667, 1.3333333],
                       W=[1.0454545, 0.77272727, 0.77272727, 1.3181818, 1.1666667, 0.83333333, 0.83333333, 1.1666667])
    out = alignopsd_credit(batch, cfg)
    assert out.segmentations == [] and (out.segment_index_M == -1).all()
    full = alignopsd_credit(batch, hand_config("none", max_segment_turns=3))  # the split the test rules out
    assert [s.spans for s in full.segmentations] == [[(0, 2), (2, 4)]] * 2
    assert not np.allclose(full.turn_weight_M, out.turn_weight_M, rtol=1e-3)


def token_batch() -> CreditBatch:
    # One task, two trajectories of 3 turns x 3 tokens; the corrected gap is 1 on one token per trajectory.
    gap = np.zeros((6, 3), np.float32)
    gap[1, 0] = gap[4, 0] = 1.0
    return CreditBatch(
        task_id=["t"] * 6, rollout_id=["a"] * 3 + ["b"] * 3, turn_id=[0, 1, 2] * 2, data_source=["env"] * 6,
        episode_reward=np.asarray([1, 1, 1, 0, 0, 0], np.float32), is_action_valid=np.ones(6, bool),
        loss_mask_ML=np.ones((6, 3), np.float32), student_logprobs_ML=np.full((6, 3), -1.0, np.float32),
        corrected_logprobs_ML=gap - 1.0,
    )


@pytest.mark.parametrize("reference", [False, True])
def test_ablation_b_token_level_by_hand(reference):
    cfg = CreditSection(grpo_scope="trajectory", use_invalid_action_penalty=False,
                        alignopsd=AlignSection(ablation="token_level", weighting_mode="bounded", credit_temperature=1.0))
    out = alignopsd_credit(token_batch(), cfg, reference_ablations=reference)
    A = 1 / math.sqrt(2)  # two trajectories, rewards 1 and 0, ddof 1
    np.testing.assert_allclose(out.trajectory_advantage_M, [A] * 3 + [-A] * 3, rtol=1e-5)
    # trajectory a (A > 0): h = 9 softmax(gap) = [9e/(e+8), 9/(e+8) x 8]; box [0.8, 1.2] -> [1.2, 0.975 x 8]
    # trajectory b (A < 0): h = [9/(e^-1 * ... )]: the gap-1 token falls to 0.8, the others rise to 1.025
    hp = np.ones((6, 3))
    hp[:3], hp[1, 0] = 0.975, 1.2
    hp[3:], hp[4, 0] = 1.025, 0.8
    w = hp if reference else 0.5 + 0.5 * hp
    np.testing.assert_allclose(out.token_weight_ML, w, rtol=1e-6)
    np.testing.assert_allclose(out.turn_weight_M, w.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(out.m2_token_advantage_ML, out.trajectory_advantage_M[:, None] * w, rtol=1e-6)
    assert out.metrics["alignopsd/projection_active_trajectories"] == 2.0
    assert out.segmentations == [] and (out.segment_index_M == -1).all()
    for rows in out.trajectory_rows:
        assert out.token_weight_ML[rows].sum() == pytest.approx(9.0, rel=1e-6)


def test_ablation_d_random_spans_are_seeded_and_reproducible():
    case = load_case(REF_DIR / "case_3.json")  # trajectories of 10, 6, 5 and 3 turns
    batch = batch_from_case(case)

    def spans(seed, b=batch, reference=False):
        cfg = credit_section_from_reference_config(dict(case["config"], ablation_mode="D", ablation_seed=seed))
        out = alignopsd_credit(b, cfg, reference_ablations=reference)
        return {key: seg.spans for key, seg in zip(out.trajectories, out.segmentations)}, out

    first, out = spans(0)
    assert first == spans(0)[0]  # reproducible
    assert any(spans(s)[0] != first for s in (1, 2, 3))  # the seed matters
    for seg, rows in zip(out.segmentations, out.trajectory_rows):
        lengths = [b - a for a, b in seg.spans]
        assert sum(lengths) == len(rows) and all(2 <= n <= 3 for n in lengths) or len(rows) < 4
        assert seg.semantic == [] and seg.forced_max == [] and seg.random == [a for a, _ in seg.spans[1:]]
    N = out.token_count_M.astype(float)
    for rows in out.trajectory_rows:
        assert (N[rows] * out.turn_weight_M[rows]).sum() == pytest.approx(N[rows].sum(), rel=1e-6)
    # The product seeds by (ablation_seed, task_id, rollout_id): a trajectory's spans do not depend on the others.
    keep = [m for m in range(batch.num_rows) if batch.rollout_id[m] != batch.rollout_id[0]]
    fewer, _ = spans(0, permute_batch(batch, np.asarray(keep)))
    assert all(first[key] == fewer[key] for key in fewer)
    # The released code: random.Random(seed + trajectory ordinal).shuffle(range(L_min, K - L_min + 1)), greedy.
    ref, out = spans(5, reference=True)
    cfg = AlignSection()
    for j, (key, rows) in enumerate(zip(out.trajectories, out.trajectory_rows)):
        cuts = random_boundaries(len(rows), cfg, random.Random(5 + j))
        assert [a for a, _ in ref[key][1:]] == cuts


def test_random_boundaries_follow_the_shuffle():
    cfg = AlignSection()
    order = list(range(2, 9))  # K = 10, L_min = 2
    random.Random(11).shuffle(order)
    cuts = [0, 10]
    for p in order:
        left, right = max(c for c in cuts if c < p), min(c for c in cuts if c > p)
        if p - left >= 2 and right - p >= 2:
            cuts.append(p)
    assert random_boundaries(10, cfg, random.Random(11)) == sorted(cuts)[1:-1]
    assert random_boundaries(3, cfg, random.Random(0)) == []  # no feasible position


# ---------------------------------------------------------------- per-task pair blocks


def test_blocked_profiles_and_distances_equal_the_full_computation():
    case = load_case(REF_DIR / "case_9.json")
    batch = batch_from_case(case)
    cfg = credit_section_from_reference_config(case["config"]).alignopsd
    H = np.asarray(case["expected"]["thinking_similarity_source_by_target"], np.float32)
    E = np.asarray(case["expected"]["structural_mask_source_by_target"], bool)
    # two tasks: the case's task twice, shifted
    M = batch.num_rows
    H2 = np.zeros((2 * M, 2 * M), np.float32)
    E2 = np.zeros((2 * M, 2 * M), bool)
    H2[:M, :M] = H2[M:, M:] = H
    E2[:M, :M] = E2[M:, M:] = E
    blocks = task_blocks(["a"] * M + ["b"] * M)
    assert blocks == [(0, M), (M, 2 * M)]
    P_full, v_full = dense_profiles(H2, E2, cfg)
    P_blk, v_blk = dense_profiles(H, E, cfg)  # one task's block: the same rows as the whole batch's
    for a, b in blocks:
        np.testing.assert_array_equal(P_full[a:b, a:b], P_blk)
        np.testing.assert_array_equal(v_full[a:b], v_blk)
    assert not P_full[:M, M:].any() and not P_full[M:, :M].any()
    traj, _ = trajectory_index(["a"] * M + ["b"] * M, batch.rollout_id * 2)
    D_full, b_full = boundary_distances(P_full, v_full, E2, traj)
    D_blk, b_blk = boundary_distances(P_blk, v_blk, E, traj[:M])
    np.testing.assert_allclose(D_full, np.concatenate([D_blk, D_blk]), atol=1e-7)
    np.testing.assert_array_equal(b_full, np.concatenate([b_blk, b_blk]))
    assert_matches(D_blk.astype(float).tolist(), case["expected"]["profile_distance_jsd"])
    # The estimator on the two-task batch keeps one block per task and gives each task what it gives alone.
    two = permute_batch(batch, np.arange(M))
    two = replace(two, task_id=["a"] * M + ["b"] * M, rollout_id=batch.rollout_id * 2, turn_id=batch.turn_id * 2,
                  data_source=batch.data_source * 2,
                  **{nm: np.concatenate([getattr(batch, nm)] * 2) for nm in (
                      "episode_reward", "is_action_valid", "loss_mask_ML", "student_logprobs_ML",
                      "teacher_logprobs_ML", "corrected_logprobs_ML")},
                  similarity_blocks=pair_blocks(H2, ["a"] * M + ["b"] * M),
                  eligible_blocks=pair_blocks(E2, ["a"] * M + ["b"] * M))
    ccfg = credit_section_from_reference_config(case["config"])
    assert_matches(alignopsd_credit(two, ccfg).distance_M.astype(float).tolist(),
                   case["expected"]["profile_distance_jsd"] * 2)
    E2[0, M + 1] = True  # a source of task a eligible for a target of task b
    with pytest.raises(ValueError, match="different tasks"):
        pair_blocks(E2, ["a"] * M + ["b"] * M)
    with pytest.raises(ValueError, match="contiguous"):
        task_blocks(["a", "b", "a"])


# ---------------------------------------------------------------- launcher profiles (spec §4.5)

SPEC_TABLE = {  # profile: (gamma_H, K, aggregation, alpha_max, T, GRPO scope, action filter, WebShop checks, penalty c)
    "alfworld-3b": (0.65, 2, "probability_mixture", 0.8, 0.5, "turn", True, False, 0.1),
    "alfworld-7b": (0.80, 3, "probability_mixture", 0.8, 0.5, "turn", False, False, 0.1),
    "search-3b": (0.70, 3, "log_mean", 0.2, 1.0, "trajectory", False, False, 0.01),
    "search-7b": (0.70, 3, "probability_mixture", 0.8, 0.5, "turn", False, False, 0.01),
    "webshop-3b": (0.80, 3, "probability_mixture", 0.8, 0.2, "turn", True, True, 0.1),
    "webshop-7b": (0.80, 2, "probability_mixture", 0.8, 0.5, "turn", False, False, 0.1),
}


@pytest.mark.parametrize("profile", sorted(SPEC_TABLE))
def test_profile_presets_load_with_the_spec_values(profile):
    assert set(ALIGNOPSD_PROFILES) == set(SPEC_TABLE)
    cfg = CreditSection(profile=profile)
    a = cfg.alignopsd
    gamma, K, agg, alpha_max, T, scope, action_filter, symbolic, coef = SPEC_TABLE[profile]
    assert (a.similarity_threshold, a.top_k, a.aggregation_mode) == (gamma, K, agg)
    assert (a.alpha_max, a.credit_temperature) == (alpha_max, T)
    assert (cfg.grpo_scope, a.action_filter_enabled, a.webshop_symbolic_checks) == (scope, action_filter, symbolic)
    assert cfg.invalid_action_penalty_coef == coef  # spec §0: 0.1 ALFWorld/WebShop, 0.01 Search
    # Common to all: temperatures 0.10, one source per rollout, quantile 0.80 in [0.01, 0.10],
    # spans 2-8, eta 0.5, d_max 4, legacy weighting, cosine filter threshold 0.80, full method.
    assert (a.aggregation_temperature, a.profile_temperature, a.source_rollout_cap) == (0.10, 0.10, 1)
    assert (a.segmentation_quantile, a.segmentation_threshold_min, a.segmentation_threshold_max) == (0.80, 0.01, 0.10)
    assert (a.min_segment_turns, a.max_segment_turns, a.mixing_coefficient, a.density_upper_bound) == (2, 8, 0.5, 4.0)
    assert (a.weighting_mode, a.action_filter_threshold, a.ablation) == ("legacy", 0.80, "none")
    assert cfg.sdar.coef == (0.01 if profile == "alfworld-3b" else 0.0)


def test_explicit_keys_override_the_preset(tmp_path):
    cfg = CreditSection(profile="search-3b", grpo_scope="turn", alignopsd={"top_k": 5, "ablation": "turn_level"})
    assert cfg.grpo_scope == "turn" and cfg.alignopsd.top_k == 5 and cfg.alignopsd.ablation == "turn_level"
    assert cfg.alignopsd.aggregation_mode == "log_mean" and cfg.alignopsd.alpha_max == 0.2  # the rest of the preset
    assert cfg.alignopsd.credit_temperature == 1.0 and cfg.invalid_action_penalty_coef == 0.01
    path = tmp_path / "run.yaml"
    path.write_text("credit:\n  profile: webshop-3b\n  invalid_action_penalty_coef: 0.05\n"
                    "  alignopsd:\n    credit_temperature: 0.3\n    webshop_symbolic_checks: false\n")
    run = RunConfig.load(path).credit
    assert run.invalid_action_penalty_coef == 0.05 and run.alignopsd.credit_temperature == 0.3
    assert run.alignopsd.webshop_symbolic_checks is False and run.alignopsd.action_filter_enabled is True
    assert run.alignopsd.similarity_threshold == 0.80 and run.alignopsd.top_k == 3
    assert CreditSection().profile is None and CreditSection().alignopsd == AlignSection()
    with pytest.raises(ValueError):
        CreditSection(profile="alfworld-13b")


def test_bad_inputs_raise_clear_errors():
    case = load_case(REF_DIR / "case_1.json")
    cfg = credit_section_from_reference_config(case["config"])
    batch = batch_from_case(case)
    batch.corrected_logprobs_ML[2, 0] = np.nan  # on a loss token
    with pytest.raises(ValueError, match="NaN or inf on a loss token"):
        alignopsd_credit(batch, cfg)
    batch = batch_from_case(case)
    (task,) = batch.similarity_blocks
    batch.similarity_blocks[task] = batch.similarity_blocks[task][:-1]
    with pytest.raises(ValueError, match=r"similarity_blocks\['.*'\] must be"):
        alignopsd_credit(batch, cfg)
    batch = batch_from_case(case)
    batch.eligible_blocks = {"another task": batch.eligible_blocks[task]}
    with pytest.raises(ValueError, match="one block per task"):
        alignopsd_credit(batch, cfg)
    batch = batch_from_case(case)
    batch.corrected_logprobs_ML = batch.corrected_logprobs_ML[:, :-1]
    with pytest.raises(ValueError, match="corrected_logprobs_ML"):
        alignopsd_credit(batch, cfg)
    batch = batch_from_case(case)
    batch.similarity_blocks[task][0, 1] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        alignopsd_credit(batch, cfg)


def test_replay_rejects_what_the_reference_rejects():
    case = load_case(REF_DIR / "case_1.json")  # one task: r0 5 turns, r1 4 turns, r2 3 turns
    one = json.loads(json.dumps(case))
    for t in one["inputs"]["turns"]:
        t["task_id"] = f"{t['task_id']}-{t['rollout_id']}"  # every task now has a single trajectory
    with pytest.raises(ValueError, match="two sibling trajectories"):
        replay_case(one)
    varying = json.loads(json.dumps(case))
    varying["inputs"]["turns"][0]["episode_reward"] = 3.0
    with pytest.raises(ValueError, match="identical across the turns"):
        replay_case(varying)
    # The product handles both (see tests/test_credit_properties.py); so does the relaxed reference run.
    got = run_reference_case(varying["inputs"], varying["config"], strict=False)
    assert len(set(got["trajectory_advantage"][:5])) == 1


def test_credit_memory_grows_with_one_task_not_with_the_step():
    """64 tasks x 4 rollouts x 8 turns (M = 2,048 rows): a dense [M, M] similarity, eligibility and profile
    set would take 36 MiB; per-task blocks (64 x [32, 32]) and the [M, L] arrays take well under 4 MiB."""
    import tracemalloc

    from benchmarks.credit import make_batch

    batch = make_batch(tasks=64, rollouts=4, turns=8, tokens=8)
    assert all(H.shape == (32, 32) for H in batch.similarity_blocks.values()) and len(batch.similarity_blocks) == 64
    tracemalloc.start()
    try:
        adv_ML, _ = compute_advantages("alignopsd", batch, CreditSection())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert adv_ML.shape == (2048, 8) and np.isfinite(adv_ML).all()
    assert peak < 4 * 2**20, f"alignopsd allocated {peak / 2**20:.1f} MiB at its peak"
