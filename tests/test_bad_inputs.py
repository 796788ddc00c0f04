"""Bad inputs against the real code paths: every case is one that crashed, hung, lost work or
silently produced a wrong number before (see shared/cases/bad-inputs.md for cases 1-19).

Fast (< 60 s): no LLM is loaded. The tokenizer comes from the model cache, the sentence
encoder is the small packaged one, the PPO update runs on a tiny random Llama, and the queue
tests use a real redis-server (the `redis_url` fixture or a private LocalRedis).

Each case of shared/cases/bad-inputs.md -> the tests asserting its right value or its clear
error through the real code path (a blank case number continues the case above). A new case
without a row, or a row naming a test that does not exist, fails
test_every_bad_input_case_has_a_test.

case | tests
-----|---------------------------------------------------------------------------------------
1    | tests/test_credit_grpo.py::test_seven_identical_fp32_rewards_have_std_exactly_zero
     | tests/test_credit_grpo.py::test_case1_group_095_and_seven_035
     | tests/test_credit_grpo.py::test_case1_identical_rewards_have_std_exactly_zero_in_every_size_and_scope
     | tests/test_credit_grpo.py::test_case1_naive_variance_would_have_blown_these_groups_up
     | tests/test_credit_grpo.py::test_case1_one_high_and_seven_equal_rewards
     | tests/test_credit_grpo.py::test_case1_near_equal_groups_stay_bounded
     | tests/test_bad_inputs.py::test_case1_through_the_trainer_path
2    | tests/test_credit_grpo.py::test_group_of_one_row_gives_zero_never_nan
     | tests/test_credit_grpo.py::test_one_surviving_rollout_trajectory_scope_gives_zero
     | tests/test_credit_grpo.py::test_groups_by_explicit_id_not_stride
     | tests/test_bad_inputs.py::test_case2_lone_survivor_next_to_full_groups_through_the_trainer_path
     | tests/test_bad_inputs.py::test_every_method_on_edge_groups_through_the_trainer_path
3    | tests/test_policy_loss.py::test_case3_all_zero_mask_gives_zero_loss_and_gradient
     | tests/test_trainer.py::test_ppo_update_all_zero_mask_is_zero_loss_and_no_nan
     | tests/test_bad_inputs.py::test_case3_all_masked_micro_batch_changes_nothing
     | tests/test_bad_inputs.py::test_all_masked_step_never_moves_the_weights
     | tests/test_bad_inputs.py::test_zero_turn_groups_flow_through_every_trainer_piece
4    | tests/test_policy_loss.py::test_case4_token_mean_uses_the_minibatch_denominator
     | tests/test_bad_inputs.py::test_case4_token_mean_loss_through_ppo_update
     | tests/test_trainer.py::test_micro_batching_does_not_change_the_update
5    | tests/test_wire.py::test_encode_rejects_nan_logprob
     | tests/test_wire.py::test_decode_rejects_nan_logprob_in_array_bytes
     | tests/test_wire.py::test_case5_non_finite_value_in_any_float_array_is_rejected
     | tests/test_queue.py::test_nan_on_the_wire_is_dead_lettered
     | tests/test_episodes.py::test_nan_logprob_length_finish_and_win
     | tests/test_episodes.py::test_scripted_entropies_kept_and_bad_ones_masked
     | tests/test_episodes.py::test_nonfinite_logits_row_ends_as_error
     | tests/test_model.py::test_nonfinite_logprobs_are_never_silent
     | tests/test_bad_inputs.py::test_positive_sampler_logprob_is_masked_and_empty_generation_is_harmless
     | tests/test_bad_inputs.py::test_case5_json_never_holds_nan_and_null_never_reaches_an_array
6    | tests/test_model.py::test_case6_temperature_logprob_arithmetic
     | tests/test_model.py::test_case6_logprob_convention_for_every_temperature_and_dtype
     | tests/test_model.py::test_case6_sampler_and_trainer_agree_and_the_metric_exports_it
     | tests/test_model.py::test_generate_logprobs_equal_score
     | tests/test_policy_loss.py::test_case6_logprob_uses_temperature_scaled_softmax
     | tests/test_trainer.py::test_ppo_update_changes_weights_and_first_ratio_is_one
7    | tests/test_teacher.py::test_identity_and_matched_views
     | tests/test_bad_inputs.py::test_case7_distillation_methods_need_one_temperature_convention
8    | tests/test_chat.py::test_case8_ids_never_reencoded_and_prompts_are_prefixes
     | tests/test_episodes.py::test_case8_sampled_ids_are_kept_even_when_text_would_reencode_otherwise
     | tests/test_episodes.py::test_real_group_token_in_token_out
     | tests/test_model.py::test_score_exact_ids_and_batch_padding
9    | tests/test_chat.py::test_case9_continuation_equals_full_template
     | tests/test_chat.py::test_case9_every_observation_and_format_equals_the_template
     | tests/test_episodes.py::test_real_group_token_in_token_out
10   | tests/test_chat.py::test_case10_prefilled_think_only_closing_tag
     | tests/test_episodes.py::test_case10_think_closing_tag_only_through_an_episode
11   | tests/test_chat.py::test_case11_action_inside_thinking_ignored
     | tests/test_chat.py::test_case11_action_only_inside_thinking_is_no_action
     | tests/test_credit_alignopsd.py::test_parse_response_ignores_actions_inside_thinking
12   | tests/test_chat.py::test_case12_unclosed_tag_is_invalid
13   | tests/test_chat.py::test_case13_duplicate_tags_invalid
     | tests/test_chat.py::test_case13_single_tags_stay_valid
14   | tests/test_chat.py::test_case14_multibyte_decode
     | tests/test_chat.py::test_case14_every_cut_of_a_multibyte_char_decodes_without_fffd
     | tests/test_chat.py::test_case14_a_token_holding_a_space_and_half_an_emoji_keeps_the_space
     | tests/test_chat.py::test_case14_observations_with_multibyte_chars_round_trip
     | tests/test_episodes.py::test_case14_reply_cut_inside_a_multibyte_char_has_no_fffd
     | tests/test_wire.py::test_round_trip_keeps_dtypes_emoji_and_gives_writable_copies
     | tests/test_bad_inputs.py::test_embedder_repairs_invalid_unicode_instead_of_500
15   | tests/test_episodes.py::test_truncation_before_sampling
     | tests/test_episodes.py::test_case15_no_budget_no_request_for_every_context_limit
     | tests/test_model.py::test_too_long_prompt_raises
16   | tests/test_model.py::test_finish_reason_comes_from_the_sampler
     | tests/test_episodes.py::test_case16_cut_inside_think_is_truncated_not_a_format_error
     | tests/test_episodes.py::test_nan_logprob_length_finish_and_win
17   | tests/test_bad_inputs.py::test_case17_sigkilled_worker_job_is_redelivered_and_counted_once
     | tests/test_queue.py::test_unacked_entry_is_reclaimed_by_another_consumer
     | tests/test_controller.py::test_collector_drops_duplicates_and_stale_groups_and_buffers_future_steps
     | tests/test_delivery.py::test_output_is_counted_once_when_the_reply_is_lost_and_the_call_retried
18   | tests/test_embedder.py::test_faiss_similarity_equals_numpy_and_drops_missing_ids
     | tests/test_bad_inputs.py::test_case18_faiss_minus_one_ids_are_dropped
19   | tests/test_embedder.py::test_embed_unit_vectors_and_zero_for_empty
     | tests/test_credit_alignopsd.py::test_similarity_of_zero_vector_is_zero_not_nan
     | tests/test_bad_inputs.py::test_case19_empty_thinking_gives_cosine_zero_and_nan_vectors_never_count
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import re
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import pydantic
import pytest
import torch

from opsd.config import AlignSection, CreditSection, EmbedderSection, RunConfig, TrainerSection
from opsd.credit import compute_advantages, registered
from opsd.credit.alignopsd import correspondence, spans
from opsd.queue import StreamNames, StreamQueue
from opsd.redis_server import LocalRedis, connect
from opsd.types import MessageError, RolloutGroup, ScoredGroup, TaskGroup
from opsd.wire import WireError, decode, encode
from services.trainer.batch import build_credit_batch, scatter_advantages
from services.trainer.update import Sequence, ppo_update
from tests.factories import (
    VOCAB_SIZE, make_rollout_group, make_scored_group, make_task, ppo_sequences, shared_dir, tiny_llama,
)

LIMIT = 1 << 22
ROOT = Path(__file__).resolve().parents[1]


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401  (conftest.py imported it already when present: no extra cost)
    except ImportError:
        return False
    return True


# The tests of the missing-vLLM errors need an interpreter without vLLM (the main venv; `make install-vllm`
# makes its own). The CLI checks importlib.util.find_spec, the roles `import vllm`: each test skips on its own.
VLLM_FOUND = importlib.util.find_spec("vllm") is not None
VLLM_IMPORTABLE = _vllm_importable()


def tamper(data: bytes, edit) -> bytes:
    env = msgpack.unpackb(data, raw=False)
    edit(env)
    return msgpack.packb(env, use_bin_type=True)


# ================================================================ wire / message boundary


def test_huge_group_size_is_rejected_on_the_wire():
    # group_size 2**63 decoded fine and made the rollout worker try to build 9e18 games.
    data = tamper(encode(make_task()), lambda env: env["body"].update(group_size=2**63))
    with pytest.raises(WireError, match="group_size"):
        decode(data, TaskGroup, LIMIT)
    assert decode(encode(make_task(group_size=64)), TaskGroup, LIMIT).group_size == 64


def test_group_shape_must_match_its_task_and_stay_bounded():
    # A RolloutGroup could carry more trajectories than group_size, more turns than max_turns, and
    # any number of turns: the teacher allocates [M, M] matrices per group (M = 10^6 -> 4 TB).
    group = make_rollout_group(G=3, turns=3, seed=2)
    for edit, match in (({"max_turns": 2}, "more turns than max_turns"), ({"group_size": 2}, "trajectories for group_size")):
        bad = copy.deepcopy(group)
        for k, v in edit.items():
            setattr(bad.task, k, v)
        with pytest.raises(WireError, match=match):
            encode(bad)
    huge = make_rollout_group(G=1, turns=1, seed=2)
    traj = huge.trajectories[0]
    S = len(traj.token_ids_S)
    traj.turns += [dataclasses.replace(traj.turns[0], turn_id=k, response_start=S, response_end=S) for k in range(1, 4100)]
    huge.task.max_turns = 5000
    with pytest.raises(WireError, match="4100 turns > 4096"):
        encode(huge)


def test_reward_beyond_float32_is_rejected_not_a_trainer_crash():
    # 1e39 is a finite float64, so it passed validation; the trainer casts rewards to
    # float32 (inf) and compute_advantages raised mid-step, killing the trainer.
    group = make_rollout_group(G=3, turns=2, seed=1)
    data = tamper(encode(group), lambda env: env["body"]["trajectories"][0].update(reward=1e39))
    with pytest.raises(WireError, match="reward"):
        decode(data, RolloutGroup, LIMIT)
    group.trajectories[0].reward = 1e6  # large but sane: finite advantages on every method
    batch, _ = build_credit_batch([group], None)
    for scope in ("turn", "trajectory"):
        for norm in (True, False):
            adv, metrics = compute_advantages("grpo", batch, CreditSection(grpo_scope=scope, norm_adv_by_std=norm))
            assert np.isfinite(adv).all() and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("field", ["teacher_logprobs_S", "corrected_logprobs_S"])
def test_positive_teacher_logprob_is_rejected(field):
    # A teacher log-prob of +50 (probability e^50) was accepted and silently inflated every gap.
    scored = make_scored_group(G=2, turns=2, seed=3)
    traj = scored.rollout.trajectories[0]
    getattr(scored, field)[0][traj.loss_mask_S == 1] = 50.0
    with pytest.raises(WireError, match="log-prob is positive"):
        encode(scored)
    with pytest.raises(MessageError):
        scored.validate()


def test_similarity_outside_unit_interval_is_rejected():
    # H = 3e38 passed (finite) and turned every dense profile into NaN (softmax of inf - inf),
    # silently changing the AlignOPSD segmentation threshold.
    scored = make_scored_group(G=3, turns=2, seed=4)
    bad = copy.deepcopy(scored)
    bad.similarity_MM[0, 1] = 3e38
    with pytest.raises(WireError, match="cosine outside"):
        encode(bad)
    noisy = copy.deepcopy(scored)
    noisy.similarity_MM[0, 1] = np.float32(1.0000001)  # FAISS float noise is fine
    assert decode(encode(noisy), ScoredGroup, LIMIT).similarity_MM[0, 1] > 1.0


def test_token_id_beyond_vocab_is_rejected_when_the_consumer_knows_its_vocab(redis_client, stream_prefix):
    group = make_rollout_group(G=2, turns=2, seed=5)
    group.trajectories[1].token_ids_S[3] = VOCAB_SIZE + 7  # valid int32, not a token
    data = encode(group)
    assert decode(data, RolloutGroup, LIMIT).trajectories[1].token_ids_S[3] == VOCAB_SIZE + 7  # no vocab: unknown
    with pytest.raises(WireError, match="vocab size"):
        decode(data, RolloutGroup, LIMIT, vocab_size=VOCAB_SIZE)
    # A queue that knows the vocabulary dead-letters it instead of handing it to an embedding lookup.
    names = StreamNames(stream_prefix)
    q = StreamQueue(redis_client, names.rollouts, "teacher", "t0", RolloutGroup, "teacher", LIMIT, names.dead,
                    vocab_size=VOCAB_SIZE)
    q.ensure_group()
    redis_client.xadd(names.rollouts, {"data": data})
    good = q.produce(make_rollout_group(G=2, turns=2, seed=6))
    assert [d.entry_id for d in q.consume(block_ms=100, count=5)] == [good]
    ((_, dead),) = redis_client.xrange(names.dead)
    assert b"vocab size" in dead[b"error"]


def test_msgpack_bombs_only_raise_wire_error():
    body = msgpack.unpackb(encode(make_task()), raw=False)["body"]
    deep = msgpack.packb({"schema": 1, "type": "TaskGroup", "body": {**body, "game": {"k": "HOLE"}}})
    deep = deep.replace(msgpack.packb("HOLE"), b"\x91" * 100_000 + b"\xc0")  # 100k nested arrays
    header_bomb = b"\x83" + msgpack.packb("schema") + b"\x01" + msgpack.packb("type") + msgpack.packb("TaskGroup") \
        + msgpack.packb("body") + b"\xdd\xff\xff\xff\xff"  # claims 4 billion elements
    ext = msgpack.packb({"schema": 1, "type": "TaskGroup", "body": {**body, "game": {"t": msgpack.Timestamp(1, 0)}}},
                        datetime=False)
    # Refused up front, each allocates tens of KB (measured: at most 61 KB, for the 100 KB `deep`); a bomb
    # that went off would allocate GBs (4 billion elements, 100k nested frames). Bytes, not seconds.
    tracemalloc.start()
    try:
        for data in (deep, header_bomb, ext, b"\xdf\xff\xff\xff\xff", b"\xc1", b""):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            with pytest.raises(WireError):
                decode(data, TaskGroup, LIMIT)
            assert tracemalloc.get_traced_memory()[1] - before < 1 << 20, data[:16]
    finally:
        tracemalloc.stop()


def _refuse_constant(name: str):
    raise ValueError(f"JSON holds {name}")


def test_case5_json_never_holds_nan_and_null_never_reaches_an_array(tmp_path):
    # Every JSON the project writes or reads for numbers: the trainer's metrics.jsonl (non-finite
    # values become null, never the invalid literal NaN) and the embedder's answer (a null or a NaN
    # in any numeric field is refused before np.asarray could build an object or NaN array).
    from opsd.embedding_api import CorrespondResponse
    from services.trainer.report import append_metrics, read_metrics

    append_metrics(tmp_path, {"step": 0, "loss": float("nan"), "kl": float("inf"), "gap": float("-inf"), "ok": 0.5})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=_refuse_constant) == {"step": 0, "loss": None, "kl": None, "gap": None, "ok": 0.5}
    assert read_metrics(tmp_path) == [{"step": 0, "loss": None, "kl": None, "gap": None, "ok": 0.5}]

    good = {"similarity": [[0.0, 0.5], [0.5, 0.0]], "eligible": [[False, True], [True, False]],
            "selected_sources": [[1], [0]], "source_weights": [[1.0], [1.0]], "rho": [0.5, 0.5], "alpha": [0.5, 0.5]}
    CorrespondResponse.model_validate(good).check(2)
    for field, row in (("similarity", 0), ("source_weights", 1), ("rho", None), ("alpha", None)):
        for value in (None, float("nan"), float("inf")):
            bad = copy.deepcopy(good)
            target = bad[field] if row is None else bad[field][row]
            target[0] = value
            with pytest.raises((pydantic.ValidationError, ValueError)):
                CorrespondResponse.model_validate(json.loads(json.dumps(bad))).check(2)


# ================================================================ credit assignment


def _zero_turns(traj) -> None:
    """Make `traj` an episode whose first prompt was too long: no turn, nothing to train."""
    traj.turns = []
    traj.loss_mask_S[:] = 0
    traj.sampler_logprobs_S[:] = 0
    traj.sampler_entropy_S[:] = 0


def _edge_groups(kind: str) -> list[ScoredGroup]:
    if kind == "one_trajectory":  # case 2: the other rollouts failed to run
        return [make_scored_group(G=1, turns=3, seed=11)]
    sg = make_scored_group(G=4, turns=3, seed=12)
    trajs = sg.rollout.trajectories
    if kind in ("all_fail", "all_success"):
        for t in trajs:
            t.reward = 0.0 if kind == "all_fail" else 1.0
            t.won = kind == "all_success"
        return [sg]
    if kind == "zero_loss_token_turns":  # every turn of one trajectory cut to prompt-only tokens
        t = trajs[1]
        t.loss_mask_S[:] = 0
        t.sampler_logprobs_S[:] = 0
        t.sampler_entropy_S[:] = 0
        sg.teacher_entropy_S[1][:] = 0
        return [sg]
    if kind == "one_zero_turn_trajectory":
        rollout = make_rollout_group(G=4, turns=3, seed=13)
        _zero_turns(rollout.trajectories[2])
        return [_rescore(rollout)]
    if kind == "all_zero_turn_trajectories":
        rollout = make_rollout_group(G=3, turns=2, seed=14)
        for t in rollout.trajectories:
            _zero_turns(t)
        return [_rescore(rollout)]
    if kind == "two_groups_one_empty":
        rollout = make_rollout_group(G=2, turns=1, seed=15)
        for t in rollout.trajectories:
            _zero_turns(t)
        return [make_scored_group(G=3, turns=2, seed=16), _rescore(rollout)]
    raise ValueError(kind)


def _rescore(rollout: RolloutGroup) -> ScoredGroup:
    """A ScoredGroup for `rollout` with identity views only (what the teacher sends without matches)."""
    M = sum(len(t.turns) for t in rollout.trajectories)
    teacher = [np.where(t.loss_mask_S == 1, t.sampler_logprobs_S - 0.1, 0).astype(np.float32) for t in rollout.trajectories]
    sg = ScoredGroup(
        rollout=rollout, teacher_version=0, teacher_logprobs_S=teacher, corrected_logprobs_S=[a.copy() for a in teacher],
        teacher_thinking_M=[""] * M, similarity_MM=np.zeros((M, M), np.float32), eligible_MM=np.zeros((M, M), bool),
        selected_sources_M=[[] for _ in range(M)], source_weights_M=[[] for _ in range(M)],
        rho_M=np.zeros(M, np.float32), alpha_M=np.zeros(M, np.float32),
        teacher_entropy_S=[np.where(t.loss_mask_S == 1, 1.0, 0).astype(np.float32) for t in rollout.trajectories],
    )
    sg.validate()
    return sg


EDGE_KINDS = ["one_trajectory", "all_fail", "all_success", "zero_loss_token_turns", "one_zero_turn_trajectory",
              "all_zero_turn_trajectories", "two_groups_one_empty"]


@pytest.mark.parametrize("kind", EDGE_KINDS)
@pytest.mark.parametrize("scope", ["turn", "trajectory"])
def test_every_method_on_edge_groups_through_the_trainer_path(kind, scope):
    scored = _edge_groups(kind)
    for sg in scored:
        decode(encode(sg), ScoredGroup, LIMIT)  # each edge group is a legal wire message
    groups = [s.rollout for s in scored]
    batch, rows = build_credit_batch(groups, scored)
    cfg = CreditSection(grpo_scope=scope, use_invalid_action_penalty=False)
    for method in registered():
        adv_ML, metrics = compute_advantages(method, batch, cfg)
        assert adv_ML.shape == batch.loss_mask_ML.shape and adv_ML.dtype == np.float32
        assert np.isfinite(adv_ML).all() and not adv_ML[batch.loss_mask_ML == 0].any(), method
        assert all(math.isfinite(v) for v in metrics.values()), (method, metrics)
        adv = scatter_advantages(groups, rows, adv_ML)
        for (g, i), a in adv.items():
            traj = groups[g].trajectories[i]
            assert a.shape == traj.token_ids_S.shape and not a[traj.loss_mask_S == 0].any()
        if method in ("grpo", "alignopsd") and kind in ("one_trajectory", "all_fail", "all_success"):
            assert not adv_ML.any(), (method, "no sibling to compare with / all equal: advantage 0")


def test_case1_through_the_trainer_path():
    # [0.95] + [0.35]*7 in float32: the seven equal rewards must not blow up (std two-pass, float64).
    rewards = [0.95] + [0.35] * 7
    group = make_rollout_group(G=8, turns=2, seed=21, rewards=rewards)
    batch, rows = build_credit_batch([group], None)
    # trajectory scope: std over 8 values (ddof 1); turn scope: each reward twice, std over 16 rows.
    for scope, (hi, lo) in {"trajectory": (2.4748737, -0.35355339), "turn": (2.5617376, -0.36596253)}.items():
        adv_ML, _ = compute_advantages("grpo", batch, CreditSection(grpo_scope=scope, use_invalid_action_penalty=False))
        per_row = np.array([adv_ML[m][batch.loss_mask_ML[m] == 1][0] for m in range(batch.num_rows)])
        first = np.array([traj == 0 for _, traj, _ in rows])
        np.testing.assert_allclose(per_row[first], hi, rtol=1e-5)
        np.testing.assert_allclose(per_row[~first], lo, rtol=1e-5)


def test_case2_lone_survivor_next_to_full_groups_through_the_trainer_path():
    # Three of a group's four rollouts failed: its lone survivor sits between two full groups.
    # Grouping by stride (G = 4 rows) would mix it with a neighbour; by id it gets 0 and the
    # full groups get exactly what they get alone.
    full_a = make_rollout_group(G=4, turns=2, seed=31, rewards=[1.0, 0.0, 0.0, 1.0])
    lone = make_rollout_group(G=1, turns=3, seed=32, rewards=[1.0])
    lone.task.group_size = 4
    full_b = make_rollout_group(G=4, turns=1, seed=33, rewards=[0.0, 1.0, 1.0, 1.0])
    decode(encode(lone), RolloutGroup, LIMIT)  # a legal message: fewer trajectories than group_size
    groups = [full_a, lone, full_b]
    batch, rows = build_credit_batch(groups, None)
    for scope in ("turn", "trajectory"):
        for norm in (True, False):
            cfg = CreditSection(grpo_scope=scope, norm_adv_by_std=norm, use_invalid_action_penalty=False)
            adv, metrics = compute_advantages("grpo", batch, cfg)
            assert np.isfinite(adv).all() and metrics["grpo/single_trajectory_tasks"] == 1.0
            by_row = scatter_advantages(groups, rows, adv)
            assert not by_row[(1, 0)].any()  # the survivor: advantage 0, never NaN
            for g, grp in ((0, full_a), (2, full_b)):
                alone_batch, alone_rows = build_credit_batch([grp], None)
                alone = scatter_advantages([grp], alone_rows, compute_advantages("grpo", alone_batch, cfg)[0])
                for i in range(4):
                    np.testing.assert_array_equal(by_row[(g, i)], alone[(0, i)])
                assert any(by_row[(g, i)].any() for i in range(4))  # mixed rewards: real advantages


@pytest.mark.parametrize("method", registered())
def test_case7_distillation_methods_need_one_temperature_convention(method):
    # The teacher scores at T = 1 and the gap subtracts the sampler's log-probs: a method that
    # distills must sample at T = 1 too, or every gap mixes two conventions. A clear config error.
    RunConfig.model_validate({"run": {"method": method}, "rollout": {"temperature": 1.0}})
    bad = {"run": {"method": method}, "rollout": {"temperature": 0.7}}
    if method == "grpo":  # no teacher: any sampling temperature (the trainer recomputes at it)
        assert RunConfig.model_validate(bad).rollout.temperature == 0.7
    else:
        with pytest.raises(pydantic.ValidationError, match="it must be 1.0 \\(got 0.7\\)"):
            RunConfig.model_validate(bad)


def test_tiny_temperatures_give_the_limit_not_nan():
    # Temperatures only had to be > 0: 1e-320 made H/T overflow and softmax(inf - inf) = NaN,
    # so source weights, rho and alpha came out NaN (sent as JSON null), and a tiny
    # credit temperature raised "non-finite advantage" inside the trainer.
    H = np.array([[0, 0.9, 0.8], [0.9, 0, 0.7], [0.8, 0.7, 0]], np.float32)
    E = ~np.eye(3, dtype=bool)
    cfg = AlignSection(aggregation_temperature=1e-320, profile_temperature=1e-320, action_filter_enabled=False,
                       top_k=2, similarity_threshold=0.5)
    sel = correspondence.select_sources(H, E, cfg, rollout_id=["a", "b", "c"])
    np.testing.assert_array_equal(sel.weights[0], [1.0, 0.0])  # the limit: all weight on the best source
    assert np.isfinite(sel.rho_M).all() and np.isfinite(sel.alpha_M).all()
    P, _ = spans.dense_profiles(H, E, cfg)
    np.testing.assert_array_equal(P[0], [0.0, 1.0, 0.0])
    sg = make_scored_group(G=4, turns=4, seed=3)
    batch, _ = build_credit_batch([sg.rollout], [sg])
    for T in (1e-320, 1e-300, 1e-30):
        adv, metrics = compute_advantages("alignopsd", batch, CreditSection(alignopsd=AlignSection(credit_temperature=T)))
        assert np.isfinite(adv).all() and all(math.isfinite(v) for v in metrics.values())


# ================================================================ PPO update (tiny random Llama, no LLM)


def _tiny_model():
    return tiny_llama(num_hidden_layers=1)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_update_reports_clip_fraction_and_ratio_deviation():
    # The trainer read m["clip_frac"] / m["ratio_dev_max"] but ppo_loss returns "ppo/..." keys:
    # both metrics were always 0 whatever the update did.
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    m = ppo_update(model, opt, ppo_sequences(), TrainerSection(micro_batch_size=2, entropy_coef=0.0, ppo_epochs=3))
    assert m["ratio_dev_max"] > 0.05 and m["clip_frac"] > 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_all_masked_step_never_moves_the_weights():
    # Case 3 for a whole step: zero gradient, but AdamW's momentum and weight decay still moved
    # every weight when the optimizer was stepped on an empty batch.
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ppo_update(model, opt, ppo_sequences(), TrainerSection())  # a real step first: the optimizer has momentum
    before = _state(model)
    m = ppo_update(model, opt, ppo_sequences(mask_on=False), TrainerSection())
    assert _same(before, model.state_dict())
    assert m["loss"] == 0.0 and m["loss_tokens"] == 0.0 and all(math.isfinite(v) for v in m.values())


def _seq(n: int, loss_tokens: int, adv: float, seed: int) -> Sequence:
    """A vocab-64 sequence of n ids whose last `loss_tokens` are loss tokens with advantage `adv`."""
    ids = np.random.default_rng(seed).integers(0, 64, n).astype(np.int32)
    mask = np.zeros(n, np.uint8)
    mask[n - loss_tokens :] = 1
    return Sequence(ids, mask, np.where(mask == 1, adv, 0).astype(np.float32), np.zeros(n, np.float32))


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_case3_all_masked_micro_batch_changes_nothing(micro):
    # A sequence whose every turn was cut (no loss token) inside a step, alone in its micro-batch
    # (micro 1) or beside others: the update, the loss and every metric are as if it were absent.
    masked = _seq(12, 0, 0.0, seed=5)
    masked.sampler_logprobs_S[:] = -np.inf  # off the loss mask anything may sit there
    results = []
    for seqs in (ppo_sequences(0.7), ppo_sequences(0.7)[:1] + [masked] + ppo_sequences(0.7)[1:]):
        model = _tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = ppo_update(model, opt, seqs, TrainerSection(micro_batch_size=micro, entropy_coef=0.01, ppo_epochs=2))
        results.append((_state(model), m))
    (ref, m_ref), (got, m_got) = results
    assert _same(ref, got) and m_got == m_ref and m_got["loss_tokens"] == 5 + 7 + 4
    assert all(math.isfinite(v) for v in m_got.values())


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("order", ["AB", "BA"])
def test_case4_token_mean_loss_through_ppo_update(micro, order):
    # A: 2 loss tokens with loss 1.0 (advantage -1 at ratio 1), B: 6 with loss 0.0. The first epoch's
    # ratio is exactly 1, so the reported loss is the token mean over the mini-batch: 2/8 = 0.25.
    a, b = _seq(6, 2, -1.0, seed=1), _seq(10, 6, 0.0, seed=2)
    seqs = [a, b] if order == "AB" else [b, a]
    cfg = TrainerSection(micro_batch_size=micro, entropy_coef=0.0, ppo_epochs=1)
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the loss only: the weights stay for the next call
    m = ppo_update(model, opt, seqs, cfg)
    assert m["loss"] == pytest.approx(0.25, abs=1e-6) and m["loss_tokens"] == 8.0 and m["ratio_dev_max"] == 0.0
    # The kind: any lengths and advantages, one denominator (2*1 + 6*0 + 3*(-0.5)) / 11.
    c = _seq(7, 3, 0.5, seed=3)
    m = ppo_update(model, opt, seqs + [c], cfg)
    assert m["loss"] == pytest.approx(0.5 / 11, abs=1e-6) and m["loss_tokens"] == 11.0


def test_out_of_vocab_ids_are_dropped_not_a_trainer_crash():
    # An id >= the embedding size crashed the trainer with IndexError (a device assert on GPU).
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    seqs = ppo_sequences()
    seqs[1].token_ids_S[2] = 64
    before = _state(model)
    m = ppo_update(model, opt, seqs, TrainerSection(micro_batch_size=2))
    assert m["dropped_sequences"] == 1.0 and m["loss_tokens"] == 5 + 4  # the two good sequences trained
    assert not _same(before, model.state_dict()) and all(math.isfinite(v) for v in m.values())


def test_nonfinite_gradient_skips_the_step_without_crashing_or_nan_metrics():
    # A NaN loss raised FloatingPointError out of ppo_update, which nothing caught: the trainer died.
    model = _tiny_model()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("inf")  # every logit row holds an inf: NaN log-probs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model)
    m = ppo_update(model, opt, ppo_sequences(), TrainerSection(ppo_epochs=2))
    assert m["skipped_steps"] == 2.0 and _same(before, model.state_dict())
    assert all(math.isfinite(v) for v in m.values()), m


def test_zero_turn_groups_flow_through_every_trainer_piece():
    # All G episodes truncated before their first turn: no rows, no loss tokens, no NaN, no update.
    scored = _edge_groups("all_zero_turn_trajectories")
    groups = [s.rollout for s in scored]
    batch, rows = build_credit_batch(groups, scored)
    assert batch.num_rows == 0
    adv_ML, _ = compute_advantages("alignopsd", batch, CreditSection())
    adv = scatter_advantages(groups, rows, adv_ML)
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seqs = [Sequence(t.token_ids_S % 64, t.loss_mask_S, adv[(0, i)], t.sampler_logprobs_S)
            for i, t in enumerate(groups[0].trajectories)]
    before = _state(model)
    m = ppo_update(model, opt, seqs, TrainerSection())
    assert _same(before, model.state_dict()) and m["loss_tokens"] == 0.0


# ================================================================ rollout episodes (real tokenizer, fake sampler)


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    from opsd.config import ModelSection
    from opsd.models.hf import ensure_model

    return transformers.AutoTokenizer.from_pretrained(ensure_model(ModelSection()), local_files_only=True)


@dataclass
class _Gen:
    token_ids: list
    logprobs: list
    finish_reason: str


class _Sampler:
    """A backend whose turn `call` replies `replies[call]` = (ids, logprobs, finish) to every row."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, 0
        self.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_token_ids = [self.eos_token_id]
        self.vocab_size, self.policy_version, self.max_model_len = len(tokenizer), 0, 2048

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, seed=None):
        assert max_new_tokens >= 1
        ids, lps, finish = self.replies[min(self.calls, len(self.replies) - 1)](self)
        self.calls += 1
        return [_Gen(list(ids), list(lps), finish) for _ in prompts]


def test_positive_sampler_logprob_is_masked_and_empty_generation_is_harmless(tokenizer, tmp_path):
    from opsd.chat import ChatFormat
    from opsd.config import EnvSection, RolloutSection
    from opsd.envs.textworld import make_games
    from services.rollout.episodes import run_group

    env = EnvSection(game_pool=1, seed=1234, max_turns=3)
    game = make_games(env, tmp_path)[0]
    look = tokenizer.encode("look</action>", add_special_tokens=False)

    def positive(b):  # a broken sampler: log-prob +3 means probability e^3
        ids = look + [b.eos_token_id]
        return ids, [3.0] + [-0.5] * (len(ids) - 1), "stop"

    def empty(b):  # a sampler that stops at once: a turn with zero loss tokens
        return [], [], "stop"

    backend = _Sampler(tokenizer, [positive, empty])
    task = TaskGroup(group_id="g-bad", task_id=game.task_id, step=0, policy_version=0, group_size=2, env="textworld",
                     game=game.to_dict(), privileged_info=game.privileged_info(), max_turns=3)
    group, stats = run_group(task, backend, ChatFormat(tokenizer, "action"), env, RolloutSection(group_size=2, max_new_tokens=8),
                             2048, seed=0)
    decode(encode(group), RolloutGroup, LIMIT, vocab_size=len(tokenizer))
    assert stats.nonfinite_logprobs == 2  # one per episode, counted like a NaN (case 5)
    for traj in group.trajectories:
        t0, t1 = traj.turns[:2]
        assert traj.loss_mask_S[t0.response_start] == 0 and traj.sampler_logprobs_S[t0.response_start] == 0.0
        assert (traj.sampler_logprobs_S <= 0).all()
        assert t1.response_start == t1.response_end and not t1.format_valid  # empty reply: invalid, no loss token
    batch, _ = build_credit_batch([group], None)
    adv, _ = compute_advantages("grpo", batch, CreditSection())
    assert np.isfinite(adv).all()


# ================================================================ embedder (real small encoder)


TOKEN = "bad-inputs-token-0123456789"


@pytest.fixture(scope="module")
def encoder():
    from opsd.encoder import Encoder

    return Encoder("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def embedder_client(encoder):
    from fastapi.testclient import TestClient

    from services.embedder.app import build_app

    app = build_app(EmbedderSection(max_texts=64, max_text_chars=500), encoder, TOKEN)
    return TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {TOKEN}"})


def _turn(rid: str, text: str = "go north", **kw) -> dict:
    return {"rollout_id": rid, "turn_id": 0, "student_text": text, "teacher_text": text, "student_valid": True,
            "teacher_valid": True, "student_action": text, "teacher_action": text, **kw}


def test_embedder_repairs_invalid_unicode_instead_of_500(embedder_client):
    # JSON can carry a lone surrogate; the tokenizer cannot encode it: 500 Internal Server Error.
    r = embedder_client.post("/embed", content='{"texts": ["go \\ud800 north", "a\\u0000b", "🙂🙂", ""]}',
                             headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    vecs = np.asarray(r.json()["vectors"], np.float32)
    assert np.isfinite(vecs).all() and np.allclose(np.linalg.norm(vecs[:3], axis=1), 1.0, atol=1e-5)
    assert not vecs[3].any()


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "Infinity"])
def test_embedder_rejects_non_finite_hyper_parameters(embedder_client, value):
    # similarity_threshold -Infinity gave rho = inf/inf = NaN, answered 200 with JSON nulls, and the
    # teacher then failed the whole group in rectify (alpha NaN).
    body = ('{"task_id": "t", "turns": [%s, %s], "align": {"similarity_threshold": %s, "action_filter_enabled": false}}'
            % (str(_turn("a")).replace("'", '"').replace("True", "true"),
               str(_turn("b")).replace("'", '"').replace("True", "true"), value))
    r = embedder_client.post("/correspond", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text


def test_embedder_limits_cover_the_action_texts_and_cosines_stay_in_range(embedder_client):
    long_action = _turn("a", student_action="x" * 10_000)
    r = embedder_client.post("/correspond", json={"task_id": "t", "turns": [long_action, _turn("b")]})
    assert r.status_code == 413  # the action filter embeds actions too: same size limit as the thinking
    r = embedder_client.post("/correspond", json={"task_id": "t", "turns": [_turn("a"), _turn("b"), _turn("c")]})
    assert r.status_code == 200
    H = np.asarray(r.json()["similarity"])
    assert np.abs(H).max() <= 1.0  # identical texts gave 1.0000001 out of FAISS


@pytest.mark.parametrize("Q", [2, 30])  # FAISS searches in its own loop below 20 queries, with BLAS above
def test_case18_faiss_minus_one_ids_are_dropped(Q):
    import faiss

    from services.embedder.app import cosine_matrix_faiss

    rng = np.random.default_rng(Q)
    base = rng.normal(size=(3, 8)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    query = rng.normal(size=(Q, 8)).astype(np.float32)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    # The library fact behind the case: k larger than the index pads with id -1 (and -3.4e38),
    # and items[-1] would silently pick the last vector.
    index = faiss.IndexFlatIP(8)
    index.add(base)
    _, ids = index.search(query, 5)
    assert (ids[:, 3:] == -1).all() and (ids[:, :3] >= 0).all()
    # A vector FAISS cannot rank (NaN) also comes back as -1 even with k = N: that column must be
    # 0 (never the last column's score, never NaN), every other pair the exact inner product.
    bad_base = base.copy()
    bad_base[1] = np.nan
    H = cosine_matrix_faiss(query, bad_base)
    assert H.shape == (Q, 3) and np.isfinite(H).all() and not H[:, 1].any()
    np.testing.assert_allclose(H[:, [0, 2]], query @ base[[0, 2]].T, atol=1e-6)


def test_case19_empty_thinking_gives_cosine_zero_and_nan_vectors_never_count(embedder_client, encoder):
    from services.embedder.app import cosine_matrix_faiss

    # An empty <think></think> (and whitespace-only thinking) embeds to the zero vector: its
    # cosine with anything is 0, never NaN, on the student side and on the teacher side.
    turns = [_turn("a", "go north"), _turn("b", "go north", student_text="", teacher_text=" \n "),
             _turn("c", "open the door"), _turn("d", "go north", teacher_text="")]
    r = embedder_client.post("/correspond", json={"task_id": "t", "turns": turns,
                                                   "align": {"action_filter_enabled": False, "similarity_threshold": 0.0}})
    assert r.status_code == 200, r.text
    H = np.asarray(r.json()["similarity"], np.float64)  # [source (teacher text)][target (student text)]
    assert np.isfinite(H).all() and np.isfinite(r.json()["rho"]).all() and np.isfinite(r.json()["alpha"]).all()
    assert not H[:, 1].any() and not H[1, :].any() and not H[3, :].any()
    assert H[0, 2] > 0.0 and H[2, 0] > 0.0  # the real texts still compare
    # A NaN embedding (a NaN weight in the encoder) becomes the zero vector before any index sees it.
    weight = encoder.model[0].auto_model.embeddings.word_embeddings.weight
    door = encoder.model.tokenizer.convert_tokens_to_ids("door")
    saved = weight[door].detach().clone()
    try:
        with torch.no_grad():
            weight[door] = float("nan")
        vecs = encoder.embed(["open the door", "go north"])
    finally:
        with torch.no_grad():
            weight[door] = saved
    assert not vecs[0].any() and np.linalg.norm(vecs[1]) == pytest.approx(1.0, abs=1e-5)
    # And a NaN query row gives a zero row of cosines, never NaN.
    query = vecs.copy()
    query[0] = np.nan
    H = cosine_matrix_faiss(query, vecs[1:])
    assert np.isfinite(H).all() and not H[0].any() and H[1, 0] == pytest.approx(1.0, abs=1e-5)


# ================================================================ queues on a real redis-server


_VICTIM = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from opsd.redis_server import connect
from opsd.queue import StreamQueue
from opsd.types import RolloutGroup
q = StreamQueue(connect(os.environ["VICTIM_REDIS_URL"], 1000), sys.argv[2], "teacher", "victim", RolloutGroup,
                "teacher", 1 << 22, sys.argv[3])
(d,) = q.consume(block_ms=1000)
print(d.entry_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies holding the job, before any ack
"""


def test_case17_sigkilled_worker_job_is_redelivered_and_counted_once(redis_url, redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    survivor = StreamQueue(redis_client, names.rollouts, "teacher", "survivor", RolloutGroup, "teacher", LIMIT, names.dead)
    survivor.ensure_group()
    entry = survivor.produce(make_rollout_group(seed=17))
    victim = subprocess.run([sys.executable, "-c", _VICTIM, str(ROOT), names.rollouts, names.dead],
                            env={**os.environ, "VICTIM_REDIS_URL": redis_url}, capture_output=True, text=True, timeout=60)
    assert victim.returncode == -signal.SIGKILL and victim.stdout.strip() == entry, victim.stderr
    assert survivor.consume(block_ms=0) == []  # not new any more: only a reclaim can get it
    time.sleep(0.06)
    (d,) = survivor.reclaim(min_idle_ms=50)
    assert d.entry_id == entry and d.deliveries == 2
    assert survivor.produce_then_ack(names.scored, make_scored_group(seed=17), d.entry_id) is not None
    time.sleep(0.06)
    assert survivor.reclaim(min_idle_ms=50) == [] and survivor.depth() == (0, 0)
    assert redis_client.xlen(names.scored) == 1  # one output for one job


def test_redis_restart_does_not_kill_consumers(tmp_path):
    # A restarted redis-server (no persistence) has no consumer groups: every XREADGROUP,
    # XAUTOCLAIM and ack answered NOGROUP forever and the role loops crashed.
    server = LocalRedis(tmp_path / "redis.log").start()
    try:
        # A long block (10 s): the reader is still blocked when the restart comes, however slow the
        # machine; the restart cuts it off long before (the read then gets NOGROUP and returns []).
        client = connect(server.url, block_ms=10_000)
        q = StreamQueue(client, "s:tasks", "rollout", "c1", TaskGroup, "rollout", LIMIT, "s:dead")
        q.ensure_group()
        q.produce(make_task(seed=1))
        (held,) = q.consume(block_ms=100)
        result: dict = {}

        def blocked():
            try:
                result["value"] = q.consume(block_ms=10_000)
            except Exception as e:  # noqa: BLE001 - the assertion below shows it
                result["value"] = e

        reader = threading.Thread(target=blocked)
        reader.start()
        admin = connect(server.url, block_ms=0)
        deadline = time.monotonic() + 30
        # The server lists the reader's connection as blocked (flag b) in XREADGROUP.
        while not any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in admin.client_list()):
            assert reader.is_alive() and time.monotonic() < deadline, f"the reader never blocked: {result}"
            time.sleep(0.02)
        admin.close()
        # Same port and password, back empty (no persistence); returns once the new server answers PING.
        server.restart()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert result["value"] == [], result["value"]
        assert q.ack(held.entry_id) is False and q.keep_alive([held.entry_id]) == 0  # the held job died with the server
        assert q.produce_then_ack("s:rollouts", make_rollout_group(seed=1), held.entry_id) is None
        assert q.reclaim(min_idle_ms=0) == [] and q.depth() == (0, 0)
        again = q.produce(make_task(seed=2))  # work after the restart flows again
        (d,) = q.consume(block_ms=100)
        assert d.entry_id == again and q.ack(d.entry_id)
        client.close()
    finally:
        server.stop()


# ================================================================ config and CLI


@pytest.mark.parametrize("text, where", [
    ("trainer:\n  lr: .inf\n", "trainer.lr"),
    ("credit:\n  opd_coef: .nan\n", "credit.opd_coef"),
    ("credit:\n  alignopsd:\n    similarity_threshold: -.inf\n", "similarity_threshold"),
    ("credit:\n  alignopsd:\n    density_upper_bound: 0.5\n", "density_upper_bound"),  # box [0, 0.5] cannot hold mean 1
])
def test_config_rejects_values_that_fail_mid_run(tmp_path, text, where):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(pydantic.ValidationError, match=where.split(".")[-1]):
        RunConfig.load(path)


@pytest.mark.parametrize("text, args, expect", [
    ("run:\n  stpes: 3\n", [], "run.stpes: Extra inputs are not permitted"),
    ("run: [\n", [], "cannot read it as YAML"),
    ("- 1\n- 2\n", [], "top level must be a mapping"),
    ("run:\n  steps: -1\n", [], "run.steps: Input should be greater than or equal to 1"),
    ("model:\n  dtype: '[bold]fp8'\n", [], "model.dtype"),
    ("run:\n  steps: 2\n", ["--steps", "0"], "run.steps: Input should be greater than or equal to 1"),
    ("trainer:\n  lr: .nan\n", [], "trainer.lr: Input should be a finite number"),
    # Checks across sections print their own message, not the whole config.
    ("model:\n  backend: vllm\nrollout:\n  top_p: 0.9\n", [], "model.backend=vllm reports nucleus-renormalized"),
    ("run:\n  method: fire_opd\nmodel:\n  backend: vllm\n", [], "fire_opd needs the teacher's entropies"),
    # The main environment has no vLLM: refused before any directory or process is made.
    pytest.param("run:\n  steps: 1\n", ["--backend", "vllm"], "needs vLLM in this environment: `make install-vllm`",
                 marks=pytest.mark.skipif(VLLM_FOUND, reason="vLLM is installed in this interpreter: the CLI "
                                          "has no missing-vLLM error to show")),
    ("run:\n  steps: 1\n", ["--backend", "vlm"], "model.backend: Input should be 'hf' or 'vllm'"),
    # Sizes the wire would refuse mid-run are refused at load (issue 23 item 7).
    ("rollout:\n  group_size: 1000000000\n", [], "rollout.group_size: Input should be less than or equal to 1024"),
    ("rollout:\n  group_size: 512\nenv:\n  max_turns: 50\n", [], "25600 turns a group: at most 4096"),
    ("env:\n  num_games: 100000000\n", [], "env.num_games: Input should be less than or equal to 4096"),
])
def test_cli_bad_config_gives_a_short_message_not_a_traceback(tmp_path, text, args, expect):
    from typer.testing import CliRunner

    from opsd.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs"), *args])
    assert result.exit_code == 2, result.output
    assert expect in result.output and "Traceback" not in result.output
    assert len(result.output.splitlines()) <= 8
    assert not (tmp_path / "runs").exists()  # nothing started


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))  # 9**9 values


@contextlib.contextmanager
def lines_run_in(fn, budget: int):
    """Count the lines Python runs in each call of function `fn` (sys.settrace) while the block runs;
    yields the list of counts, one per call. Past `budget` lines in one call the tracer raises
    RuntimeError inside it, so a walk that does not stop ends as an error instead of a hang."""
    counts: list[int] = []

    def in_fn(frame, event, arg):
        if event == "line":
            counts[-1] += 1
            if counts[-1] > budget:
                raise RuntimeError(f"{fn.__qualname__} ran more than {budget} lines")
        return in_fn

    def on_call(frame, event, arg):
        if frame.f_code is not fn.__code__:
            return None
        counts.append(0)
        return in_fn

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield counts
    finally:
        sys.settrace(previous)


def test_a_yaml_anchor_bomb_is_refused_at_once(tmp_path):
    """A few hundred bytes of nested aliases (9**9 values) are refused when read, by the CLI and by every
    role's RunConfig.load, after walking at most MAX_CONFIG_VALUES of them (not 9**9: 39 s and more before
    the cap); so is an alias that refers to itself (a walk without the cap never ends). The work is
    counted in lines run, not seconds: under 10 a value walked."""
    from typer.testing import CliRunner

    from opsd.cli import app
    from opsd.config import MAX_CONFIG_VALUES, read_yaml

    path = tmp_path / "bomb.yaml"
    path.write_text("run:\n  name: &n [1]\n" + "".join("  " + line + "\n" for line in BOMB.splitlines()))
    assert len(path.read_bytes()) < 600
    (tmp_path / "loop.yaml").write_text("run: &r\n  name: *r\n")
    with lines_run_in(read_yaml, budget=10 * MAX_CONFIG_VALUES) as reads:
        result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs")])
        assert result.exit_code == 2 and "expands to more than" in result.output and len(result.output) < 400
        with pytest.raises(ValueError, match="expands to more than"):
            RunConfig.load(path)
        with pytest.raises(ValueError, match="expands to more than"):
            RunConfig.load(tmp_path / "loop.yaml")
    assert len(reads) == 3 and all(MAX_CONFIG_VALUES < n <= 10 * MAX_CONFIG_VALUES for n in reads), reads
    assert not (tmp_path / "runs").exists()


def test_a_weak_api_token_is_refused_before_the_run_directory_exists(tmp_path):
    """OPSD_API_TOKEN too short: refused in one line, as before, but the run directory (config.yaml, logs/,
    model.json) was already made for a run that never started."""
    from typer.testing import CliRunner

    from opsd.cli import app

    path = tmp_path / "ok.yaml"
    path.write_text("run:\n  steps: 1\nmodel:\n  name: tiny-random\n")
    result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs")],
                                env={"OPSD_API_TOKEN": "short"})
    assert result.exit_code == 2 and "OPSD_API_TOKEN" in result.output, result.output
    assert not (tmp_path / "runs").exists()


def test_a_yaml_nested_too_deep_to_parse_is_one_line(tmp_path):
    """`[[[[...` (or `{a: {a: ...`) 20,000 deep: PyYAML's parser recurses and raised RecursionError, a traceback
    out of `opsd run` and out of every role's RunConfig.load (a RuntimeError, outside their one-line paths)."""
    from typer.testing import CliRunner

    from opsd.cli import app

    for i, text in enumerate(["run: " + "[" * 20_000 + "]" * 20_000, "run: " + "{a: " * 20_000 + "1" + "}" * 20_000]):
        path = tmp_path / f"deep{i}.yaml"
        path.write_text(text + "\n")
        result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs")])
        assert result.exit_code == 2 and "nests deeper" in result.output, result.output[-500:]
        assert "Traceback" not in result.output and len(result.output) < 600
        with pytest.raises(ValueError, match="nests deeper"):
            RunConfig.load(path)
    assert not (tmp_path / "runs").exists()


def test_a_bad_value_is_shown_bounded(tmp_path):
    """A wrong value of a huge size (under the alias cap) is named in one short line, not printed whole."""
    from typer.testing import CliRunner

    from opsd.cli import app

    path = tmp_path / "big.yaml"
    path.write_text("run:\n  name: [" + ", ".join(["xxxxxxxxxx"] * 20_000) + "]\n")
    result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "run.name" in result.output and len(result.output) < 600, result.output


@pytest.mark.parametrize("env", ["twx", "scienceworld"])
def test_an_env_that_needs_java_without_java_is_one_line(tmp_path, monkeypatch, env):
    from typer.testing import CliRunner

    import opsd.cli
    from opsd.cli import app

    real_which = opsd.cli.shutil.which
    monkeypatch.setattr(opsd.cli.shutil, "which", lambda name, *a, **k: None if name == "java" else real_which(name, *a, **k))
    path = tmp_path / "c.yaml"
    path.write_text(f"env:\n  name: {env}\n")
    result = CliRunner().invoke(app, ["run", str(path), "--output-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "needs Java 11+: `make java`" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_trainer_refuses_to_run_alone_when_configured_for_several_ranks(tmp_path):
    # trainer.nproc_per_node 2 started without torchrun would silently train on one device.
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  nproc_per_node: 2\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--config", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "torchrun --nproc-per-node 2 -m services.trainer" in proc.stderr

    # Under the launcher `opsd run` uses, a rank's fatal exit stays fatal (torchrun alone exits 1 for
    # any failure, and the supervisor would restart a trainer that cannot start).
    path.write_text("trainer:\n  nproc_per_node: 3\n")
    proc = subprocess.run([sys.executable, "-m", "services.trainer.torchrun", "--standalone", "--nproc-per-node=2",
                           "-m", "services.trainer", "--config", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trainer.nproc_per_node is 3 but 2 rank(s) run on this node" in proc.stdout + proc.stderr


@pytest.mark.skipif(VLLM_IMPORTABLE, reason="vLLM is installed in this interpreter: the roles have no "
                    "missing-vLLM error to show")
@pytest.mark.parametrize("role", ["rollout", "teacher"])
def test_worker_without_the_configured_backend_stops_instead_of_restarting(tmp_path, role):
    # A container image without vLLM given a config with model.backend: vllm: a restart cannot install it.
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text("run:\n  method: gc_opd\nmodel:\n  backend: vllm\n")
    proc = subprocess.run([sys.executable, "-m", f"services.{role}", "--config", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"{role}: cannot start: model.backend=vllm needs vLLM: `make install-vllm`" in proc.stderr


def test_cli_progress_reader_skips_a_half_written_metrics_line(tmp_path):
    # The CLI polled metrics.jsonl while the trainer appended to it; a half-written last line
    # went to json.loads and the JSONDecodeError took the CLI (and every service) down.
    from opsd.progress import complete_lines

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 0.1}\n{"step": 1, "lo')
    assert complete_lines(path) == ['{"step": 0, "loss": 0.1}']
    path.write_text('{"step": 0, "loss": 0.1}\n{"step": 1, "loss": 0.2}\n')
    assert len(complete_lines(path)) == 2
    assert complete_lines(tmp_path / "missing.jsonl") == []


# ================================================================ the case map above covers every case


def _case_map() -> dict[int, list[str]]:
    """Case number -> test node ids, from the table in this module's docstring."""
    table: dict[int, list[str]] = {}
    case = None
    for line in __doc__.splitlines():
        m = re.match(r"^(\d+)?\s*\|\s*(tests/\S+\.py::\w+)\s*$", line)
        if not m:
            continue
        case = int(m.group(1)) if m.group(1) else case
        assert case is not None, f"a table row before any case number: {line!r}"
        table.setdefault(case, []).append(m.group(2))
    return table


def test_every_bad_input_case_has_a_test():
    path = shared_dir() / "cases" / "bad-inputs.md"
    assert path.is_file(), f"{path} is missing: set OPSD_SHARED to the shared folder"
    cases = [int(n) for n in re.findall(r"^(\d+)\. ", path.read_text(), re.MULTILINE)]
    assert cases == list(range(1, len(cases) + 1)) and len(cases) >= 19, cases
    table = _case_map()
    assert sorted(table) == cases, f"cases without a row in the map: {sorted(set(cases) - set(table))}"
    defined: dict[str, set[str]] = {}
    for node_ids in table.values():
        for node in node_ids:
            file, name = node.split("::")
            if file not in defined:
                src = ROOT / file
                assert src.is_file(), f"{node}: no file {file}"
                tree = ast.parse(src.read_text())
                defined[file] = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
            assert name in defined[file], f"{node} is in the map but {file} defines no such test"


def test_help_shows_flags_as_flags():
    """`opsd run --help`: a flag takes no value, so none is shown (typer's rich help printed "<bool>")."""
    from typer.testing import CliRunner

    from opsd.cli import app

    out = CliRunner().invoke(app, ["run", "--help"]).output
    assert "--dump-credit" in out and "<bool>" not in out and "--steps <int>" in out


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/abs", "a/b", ".hidden", "..", "", "x" * 101, "run name"])
def test_a_run_name_is_one_path_component_under_output_dir(name):
    """run.name goes into the run directory's name (output_dir/<name>-<timestamp>): "../../escaped" or an absolute
    name would create it anywhere (issue 37, finding 8)."""
    with pytest.raises(pydantic.ValidationError, match=r"run\.name"):
        RunConfig.model_validate({"run": {"name": name}})
    for ok in ("quickstart", "reasoning_gym", "e2e-tiny", "v1.2", "x" * 100):
        assert RunConfig.model_validate({"run": {"name": ok}}).run.name == ok
