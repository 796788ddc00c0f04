"""AlignOPSD (spec §4): the authors' reference vectors, unit cases and properties."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.config import AlignSection, CreditSection
from opsd.credit import compute_advantages, permute_batch
from opsd.credit.alignopsd import (
    alignopsd_credit,
    project_density,
    rectify,
    segment_trajectory,
    select_sources,
    similarity_matrix,
    structural_mask,
    webshop_actions_agree,
)
from opsd.credit.reference import credit_section_from_reference_config, parse_response, run_reference_case
from opsd.types import CreditBatch


def shared_dir() -> Path:
    # CI clones the repo into another folder with shared/ beside it.
    env = os.environ.get("OPSD_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


REF_DIR = shared_dir() / "refvectors" / "alignopsd"
REF_FILES = sorted(REF_DIR.glob("*.json")) if REF_DIR.is_dir() else []


def load_case(path: Path) -> dict:
    if not path.is_file():
        pytest.fail(f"AlignOPSD reference vectors not found at {REF_DIR} (set OPSD_SHARED to the shared/ folder)")
    return json.loads(path.read_text())


def test_reference_vectors_are_present():
    assert REF_DIR.is_dir(), f"missing {REF_DIR}: set OPSD_SHARED to the shared/ folder"
    assert len(REF_FILES) >= 6, f"expected the 6 handed AlignOPSD cases in {REF_DIR}, found {len(REF_FILES)}"


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
        similarity_MM=np.asarray(exp["thinking_similarity_source_by_target"], np.float32),
        eligible_MM=np.asarray(exp["structural_mask_source_by_target"], bool),
    )


@pytest.mark.parametrize("path", REF_FILES or [REF_DIR / "missing.json"], ids=lambda p: p.stem)
def test_registered_estimator_reproduces_final_advantage(path):
    case = load_case(path)
    if "error" in case["expected"]:
        pytest.skip("error case: the product handles it, see test_turn_without_loss_tokens")
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


# ---------------------------------------------------------------- properties


@st.composite
def random_batches(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    n_tasks = draw(st.integers(1, 2))
    turns = draw(st.lists(st.lists(st.integers(1, 11), min_size=1, max_size=4), min_size=n_tasks, max_size=n_tasks))
    reward_kind = draw(st.sampled_from(["binary10", "float", "equal"]))
    rng = np.random.default_rng(seed)
    L = 4
    rows = []
    for ti, rollouts in enumerate(turns):
        for ri, K in enumerate(rollouts):
            r = {"binary10": float(rng.integers(0, 2) * 10), "float": float(np.round(rng.normal(), 4)), "equal": 1.0}[reward_kind]
            rows += [(f"t{ti}", f"r{ri}", k, r) for k in range(K)]
    M = len(rows)
    task = [r[0] for r in rows]
    roll = [r[1] for r in rows]
    mask = (rng.random((M, L)) < 0.7).astype(np.float32)
    mask[rng.random(M) < 0.05] = 0.0  # a few turns without loss tokens
    student = -rng.exponential(1.0, (M, L)).astype(np.float32)
    teacher = -rng.exponential(1.0, (M, L)).astype(np.float32)
    # Smooth thinking embeddings so consecutive turns often match the same sources.
    emb_t = rng.normal(size=(M, 6)) + 2 * np.eye(6)[np.arange(M) % 3]
    emb_s = emb_t + 0.5 * rng.normal(size=(M, 6))
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
        similarity_MM=H,
        eligible_MM=E,
    )


@settings(max_examples=40, deadline=None)
@given(batch=random_batches(), mode=st.sampled_from(["legacy", "bounded"]), T=st.sampled_from([0.2, 0.5, 1.0]))
def test_property_budget_conserved_and_weights_bounded(batch, mode, T):
    cfg = CreditSection(alignopsd=AlignSection(weighting_mode=mode, credit_temperature=T, similarity_threshold=0.6))
    out = alignopsd_credit(batch, cfg)
    N = out.token_count_M.astype(np.float64)
    W = out.turn_weight_M.astype(np.float64)
    for rows in out.trajectory_rows:
        assert (N[rows] * W[rows]).sum() == pytest.approx(N[rows].sum(), rel=1e-5, abs=1e-5)
    lo, hi = (0.5, 2.5) if mode == "legacy" else (0.9, 1.1)
    assert W.min() >= lo - 1e-6 and W.max() <= hi + 1e-6
    assert (W[N == 0] == 1.0).all()
    for rows, seg in zip(out.trajectory_rows, out.segmentations):
        lengths = [b - a for a, b in seg.spans]
        assert max(lengths) <= 8
        if len(rows) >= 2:
            assert min(lengths) >= 2
    assert np.isfinite(out.final_token_advantage_ML).all()


@settings(max_examples=25, deadline=None)
@given(batch=random_batches())
def test_property_all_equal_rewards_give_zero_advantage(batch):
    batch.episode_reward = np.full(batch.num_rows, 10.0, np.float32)
    batch.is_action_valid = np.ones(batch.num_rows, bool)
    adv, _ = compute_advantages("alignopsd", batch, CreditSection())
    assert np.array_equal(adv, np.zeros_like(adv))
    out = alignopsd_credit(batch, CreditSection())
    assert np.allclose(out.turn_weight_M, 1.0, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(batch=random_batches(), seed=st.integers(0, 1000))
def test_property_row_order_independence(batch, seed):
    cfg = CreditSection(grpo_scope="trajectory")
    adv, metrics = compute_advantages("alignopsd", batch, cfg)
    perm = np.random.default_rng(seed).permutation(batch.num_rows)
    adv_p, metrics_p = compute_advantages("alignopsd", permute_batch(batch, perm), cfg)
    np.testing.assert_array_equal(adv_p, adv[perm])
    assert metrics_p == metrics
