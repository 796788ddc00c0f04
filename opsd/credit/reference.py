"""Replaying reference vectors: a refvector file's inputs through the product's credit code.

The schema is ../shared/refvectors/README.md. `run_reference_case` takes a
file's `inputs` and `config`, runs the same functions the embedder, teacher
and trainer call (opsd.credit.alignopsd), and returns every `expected` field
by name, so a test (or a researcher) can compare them. `replay_case` is the
replay contract of opsd.credit.replay (`opsd credit check`); `run_product_case`
runs the same pipeline with a run's own CreditSection and the product's
settings (a run's credit dump).

Parsing here is the reference's (spec §0: first <think> block, first action
outside it); the product's stricter turn parser is opsd.chat.parse_response.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping

import numpy as np

from opsd.config import AlignSection, CreditSection
from opsd.credit.batch import check_batch, pair_blocks
from opsd.credit.alignopsd import EmptyTurns, alignopsd_credit
from opsd.credit.alignopsd.correspondence import rectify, select_sources, similarity_matrix, structural_mask
from opsd.credit.alignopsd.spans import task_blocks
from opsd.credit.grpo import Singleton
from opsd.types import CreditBatch

_FLAGS = re.IGNORECASE | re.DOTALL
_THINK_RE = re.compile(r"<think>(.*?)</think>", _FLAGS)
_ACTION_RES = tuple(re.compile(rf"<{tag}>(.*?)</{tag}>", _FLAGS) for tag in ("action", "search", "answer"))


def parse_response(text: str | None) -> tuple[str, str]:
    """(thinking, action) of a decoded response, per spec §0 "Response parsing".

    Thinking = the first case-insensitive `<think>...</think>` content,
    stripped. Action = the first `<action>`, else `<search>`, else `<answer>`
    content, stripped, searched only outside that thinking block (an action
    written inside the thinking never counts). "" means invalid/absent.
    """
    value = "" if text is None else str(text)
    think = _THINK_RE.search(value)
    thinking = think.group(1).strip() if think else ""
    outside = value[: think.start()] + value[think.end() :] if think else value
    for pattern in _ACTION_RES:
        match = pattern.search(outside)
        if match:
            return thinking, match.group(1).strip()
    return thinking, ""


# Refvector `ablation_mode` (the released code's A-E) -> AlignSection.ablation (spec §4.4).
ABLATION_MODES = {
    "A": "no_rectification",
    "B": "token_level",
    "C": "turn_level",
    "D": "random_spans",
    "E": "none",
}


def credit_section_from_reference_config(config: Mapping[str, Any]) -> CreditSection:
    """CreditSection from a refvector `config` (its `m2` sub-dict flattened into AlignSection).

    `ablation_mode` A-E maps through ABLATION_MODES (E, the default, is the
    full method); `ablation_seed` (or `random_seed`, default 0) seeds D.
    Raises: ValueError for settings this product does not implement
    (an unknown ablation_mode, profile_distance other than "jsd") and
    pydantic.ValidationError for out-of-range values.
    """
    m2 = dict(config.get("m2", {}))
    if m2.pop("profile_distance", "jsd") != "jsd":
        raise ValueError("only profile_distance='jsd' is implemented")
    mode = str(config.get("ablation_mode") or "E").upper()
    if mode not in ABLATION_MODES:
        raise ValueError(f"ablation_mode {config.get('ablation_mode')!r} is not one of {', '.join(ABLATION_MODES)}")
    align_keys = (
        "similarity_threshold", "top_k", "source_rollout_cap", "aggregation_temperature", "aggregation_mode",
        "alpha_max", "action_filter_enabled", "action_filter_threshold", "webshop_symbolic_checks",
    )
    align = {k: config[k] for k in align_keys if k in config}
    align.update(m2)
    align["ablation"] = ABLATION_MODES[mode]
    align["ablation_seed"] = int(config.get("ablation_seed", config.get("random_seed", 0)) or 0)
    return CreditSection(
        grpo_scope=config.get("grpo_normalization_scope", "turn"),
        norm_adv_by_std=config.get("norm_adv_by_std_in_grpo", True),
        use_invalid_action_penalty=config.get("use_invalid_action_penalty", True),
        invalid_action_penalty_coef=config.get("invalid_action_penalty_coef", 0.1),
        alignopsd=AlignSection(**align),
    )


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean (0/1 accepted); "false", null or 2 are errors, not truthy values."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def _f(x: np.ndarray) -> list:
    return np.asarray(x, dtype=np.float64).tolist()


def _block_diagonal(blocks: list[np.ndarray], ranges: list[tuple[int, int]]) -> np.ndarray:
    """The [M, M] array the reference reports, from per-task blocks on the row ranges `ranges`."""
    M = ranges[-1][1] if ranges else 0
    out = np.zeros((M, M), dtype=np.float32)
    for (a, b), X in zip(ranges, blocks):
        out[a:b, a:b] = X
    return out


def run_reference_case(
    inputs: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    singleton: Singleton = "reference",
    empty_turns: EmptyTurns = "error",
    strict: bool = True,
) -> dict[str, Any]:
    """Run one AlignOPSD refvector case through the service functions (spec §4).

    Embedder: parse responses (spec §0) -> thinking validity; H from the
    thinking embeddings; structural mask; action similarity from the action
    embeddings (when the filter is on); `select_sources`. Teacher: `rectify`
    with `cross_teacher_log_probs[source][target]`. Trainer: a CreditBatch
    through `alignopsd_credit`, the code the registered estimator runs, with
    the released code's ablation variants (`reference_ablations=True`).

    Args: a refvector file's `inputs` and `config` dicts (schema in
      refvectors/README.md); singleton / empty_turns default to the
      reference behaviour (a turn without loss tokens raises ValueError, as upstream);
      strict: also reject, as the released code does, a task with fewer than
      two trajectories and a trajectory whose rows carry different rewards.
    Returns: dict with every `expected` field name of the AlignOPSD refvectors
      (JSON types: lists, floats, bools; segmentation_threshold None for +inf).
    Raises: ValueError for those inputs and bad configs.
    """
    cfg = credit_section_from_reference_config(config)
    if strict:
        rewards: dict[tuple[str, str], set[float]] = {}
        for t in inputs["turns"]:
            rewards.setdefault((str(t["task_id"]), str(t["rollout_id"])), set()).add(float(t["episode_reward"]))
        if any(len(r) > 1 for r in rewards.values()):
            raise ValueError("episode reward must be identical across the turns of a trajectory (as in the reference)")
        per_task = Counter(task for task, _ in rewards)
        if any(n < 2 for n in per_task.values()):
            raise ValueError("GRPO needs at least two sibling trajectories per task (as in the reference)")
    return _run_case(inputs, cfg, singleton=singleton, empty_turns=empty_turns, reference_ablations=True)


def run_product_case(inputs: Mapping[str, Any], cfg: CreditSection) -> dict[str, Any]:
    """`run_reference_case` with the product's settings: the run's CreditSection
    `cfg`, one-row groups -> credit.grpo_singleton (advantage 0 by default), turns without loss tokens -> weight 1,
    the product's ablation variants. Used to replay a run's credit dump
    (inputs in the AlignOPSD refvector schema); returns the same fields."""
    return _run_case(inputs, cfg, singleton=cfg.grpo_singleton or "zero", empty_turns="weight_one", reference_ablations=False)


def replay_case(case: Mapping[str, Any]) -> dict[str, Any]:
    """Replay contract (opsd.credit.replay) for an AlignOPSD refvector file:
    {"expected": run_reference_case(case["inputs"], case["config"])}.

    Raises ValueError where the reference does (a turn without policy tokens,
    a task with one trajectory, rewards that vary inside a trajectory), which is
    what a file whose `expected` is {"error": "ValueError"} asks for.
    """
    return {"expected": run_reference_case(case["inputs"], case["config"])}


def _run_case(
    inputs: Mapping[str, Any],
    cfg: CreditSection,
    *,
    singleton: Singleton,
    empty_turns: EmptyTurns,
    reference_ablations: bool,
) -> dict[str, Any]:
    acfg = cfg.alignopsd
    turns = inputs["turns"]
    M = len(turns)
    task = [str(t["task_id"]) for t in turns]
    roll = [str(t["rollout_id"]) for t in turns]
    tid = [int(t["turn_id"]) for t in turns]
    src = [str(t["data_source"]) for t in turns]

    ps = [parse_response(x) for x in inputs["student_response_text"]]
    pt = [parse_response(x) for x in inputs["teacher_response_text"]]
    s_valid = np.asarray([bool(th) for th, _ in ps])
    t_valid = np.asarray([bool(th) for th, _ in pt])

    H = similarity_matrix(inputs["teacher_thinking_embedding"], inputs["student_thinking_embedding"], task)
    E = structural_mask(task, roll, src, s_valid, t_valid)
    A = None
    if acfg.action_filter_enabled:
        A = similarity_matrix(inputs["teacher_action_embedding"], inputs["student_action_embedding"], task)
    sel = select_sources(H, E, acfg, A, [a for _, a in ps], [a for _, a in pt], rollout_id=roll)

    diag = np.asarray(inputs["diagonal_teacher_log_probs"], dtype=np.float32)
    L = diag.shape[1] if diag.ndim == 2 else -1
    cross = np.asarray(inputs["cross_teacher_log_probs"], dtype=np.float32)
    if diag.shape != (M, L) or cross.shape != (M, M, L):
        raise ValueError(f"diagonal_teacher_log_probs must be [M, L] and cross_teacher_log_probs [M, M, L] "
                         f"for M = {M} turns; got {diag.shape} and {cross.shape}")
    agg = np.empty((M, L), np.float32)
    corr = np.empty((M, L), np.float32)
    for t in range(M):
        cross_KL = np.asarray([cross[s][t] for s in sel.sources[t]], dtype=np.float32).reshape(-1, L)
        agg[t], corr[t] = rectify(diag[t], cross_KL, sel.weights[t], float(sel.alpha_M[t]), acfg.aggregation_mode)

    batch = CreditBatch(
        task_id=task,
        rollout_id=roll,
        turn_id=tid,
        data_source=src,
        episode_reward=np.asarray([t["episode_reward"] for t in turns], dtype=np.float32),
        is_action_valid=np.asarray([_flag(t["is_action_valid"], "is_action_valid") for t in turns]),
        loss_mask_ML=np.asarray(inputs["policy_loss_mask"], dtype=np.float32),
        student_logprobs_ML=np.asarray(inputs["student_log_probs"], dtype=np.float32),
        teacher_logprobs_ML=diag,
        corrected_logprobs_ML=corr,
        similarity_blocks=pair_blocks(H, task, "thinking_similarity_source_by_target"),
        eligible_blocks=pair_blocks(E, task, "structural_mask_source_by_target"),
    )
    check_batch(batch)  # the trainer's input checks, for a file too
    out = alignopsd_credit(batch, cfg, singleton=singleton, empty_turns=empty_turns, reference_ablations=reference_ablations)
    return {
        "parsed_student": [{"thinking": th, "action": a} for th, a in ps],
        "parsed_teacher": [{"thinking": th, "action": a} for th, a in pt],
        "thinking_similarity_source_by_target": _f(H),
        "structural_mask_source_by_target": E.tolist(),
        "selected_sources_before_action_filter": sel.sources_before_filter,
        "action_similarity_source_by_target": None if A is None else _f(A),
        "selected_sources": sel.sources,
        "selected_source_weights": [_f(w) for w in sel.weights],
        "correspondence_confidence_rho": _f(sel.rho_M),
        "correction_strength_alpha": _f(sel.alpha_M),
        "cross_teacher_log_probs_aggregated": _f(agg),
        "corrected_teacher_log_probs": _f(corr),
        "corrected_token_gap": _f(out.corrected_gap_ML),
        "trajectory_advantage": _f(out.trajectory_advantage_M),
        "dense_profiles_target_by_source": _f(_block_diagonal(out.profiles, task_blocks(task))),
        "profile_valid": out.profile_valid_M.tolist(),
        "profile_distance_jsd": _f(out.distance_M),
        "boundary_valid": out.boundary_valid_M.tolist(),
        "segmentation_threshold": out.threshold if math.isfinite(out.threshold) else None,
        "segments_per_trajectory": [
            [rows[a:b].tolist() for a, b in seg.spans] for rows, seg in zip(out.trajectory_rows, out.segmentations)
        ],
        "boundary_kinds": [
            {"trajectory": list(key), "semantic": seg.semantic, "guided_fallback": seg.guided_fallback, "forced_max": seg.forced_max}
            for key, seg in zip(out.trajectories, out.segmentations)
        ],
        "segment_index_per_turn": out.segment_index_M.tolist(),
        "turn_gap": _f(out.turn_gap_M),
        "policy_token_count": out.token_count_M.tolist(),
        "outcome_aligned_score": _f(out.outcome_aligned_score_M),
        "segment_budget": _f(out.segment_budget_S),
        "within_segment_turn_budget": _f(out.within_segment_turn_budget_M),
        "raw_credit_density": _f(out.raw_density_M),
        "projected_credit_density": _f(out.projected_density_M),
        "turn_weight": _f(out.turn_weight_M),
        "m2_token_advantage": _f(out.m2_token_advantage_ML),
        "invalid_action_residual_scalar": _f(out.residual_M),
        "final_token_advantage": _f(out.final_token_advantage_ML),
    }
