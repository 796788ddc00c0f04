"""Rollout episodes: exact ids token-in/token-out, masks, truncation, invalid turns, NaN log-probs.

The real SmolLM2 backend plays short groups (module-scoped: loaded once);
a scripted fake backend (same interface, real tokenizer) covers the cases a
sampled model cannot be forced into (no action, NaN log-prob, token cap, a win).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from opsd.chat import ChatFormat, parse_response
from opsd.config import EnvSection, RolloutSection
from opsd.credit.policy_loss import entropy_from_logits
from opsd.envs.textworld import make_games
from opsd.envs.textworld import TextWorldEnv
from opsd.models.hf import NonFiniteLogitsError
from opsd.types import TaskGroup
from services.rollout import prompts
from services.rollout.episodes import initial_prompt_ids, rollout_ids, run_group, run_groups

ENV = EnvSection(game_pool=1, seed=1234, max_turns=2)


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    return make_games(ENV, tmp_path_factory.mktemp("games"))[0]


@pytest.fixture(scope="module")
def backend(policy_backend):
    return policy_backend


@pytest.fixture(scope="module")
def chat(backend):
    return ChatFormat(backend.tokenizer, "action")


def make_task(game, group_size=2, max_turns=2) -> TaskGroup:
    return TaskGroup(
        group_id="g-test", task_id=game.task_id, step=0, policy_version=0, group_size=group_size,
        env="textworld", game=game.to_dict(), privileged_info=game.privileged_info(), max_turns=max_turns,
    )


class Recorder:
    """Wraps a backend: records every request and checks that none lacks token budget."""

    def __init__(self, inner, max_model_len):
        self.inner, self.max_model_len, self.calls = inner, max_model_len, []
        self.tokenizer, self.eos_token_id = inner.tokenizer, inner.eos_token_id
        self.stop_token_ids = inner.stop_token_ids
        self.vocab_size, self.policy_version = inner.vocab_size, inner.policy_version

    def generate(self, prompts_, max_new_tokens, temperature, top_p=1.0, seed=None):
        for p in prompts_:
            assert max_new_tokens >= 1 and len(p) + max_new_tokens <= self.max_model_len, "request without budget"
        gens = self.inner.generate(prompts_, max_new_tokens, temperature, top_p=top_p, seed=seed)
        self.calls.append(([list(p) for p in prompts_], gens))
        return gens


@pytest.mark.parametrize("fmt", ["action", "think"])
def test_prompts_teach_a_parseable_format(fmt, backend):
    cfg = EnvSection(prompt_format=fmt)
    ((user, reply),) = prompts.one_shot_examples(cfg)
    parsed = parse_response(reply, fmt)
    assert parsed.valid and parsed.action == "open box"  # the example obeys the parser it teaches
    assert (parsed.thinking != "") == (fmt == "think")
    assert "open box" in user.splitlines()  # admissible commands listed, one a line
    assert prompts.one_shot_examples(cfg.model_copy(update={"one_shot": False})) == []
    bare = prompts.observation_message("You see a box.", ["open box"], cfg.model_copy(update={"list_admissible": False}))
    assert bare == "You see a box."
    assert prompts.invalid_message(["look"], cfg).startswith(cfg.invalid_feedback)
    # Short: system + one-shot stay well under 200 tokens for the 135M model's small context.
    chat = ChatFormat(backend.tokenizer, fmt)
    assert len(chat.initial_prompt_ids(prompts.system_prompt(fmt), "x", one_shot=[(user, reply)])) < 200
    with pytest.raises(ValueError):
        prompts.system_prompt("json")


def test_rollout_ids_sort_numerically():
    ids = rollout_ids(12)
    assert ids[:3] == ["r00", "r01", "r02"] and sorted(ids) == ids and len(set(ids)) == 12


def test_real_group_token_in_token_out(game, backend, chat):
    rec = Recorder(backend, 2048)
    group, stats = run_group(make_task(game), rec, chat, ENV, RolloutSection(group_size=2, max_new_tokens=8), 2048, seed=7)
    group.validate(backend.vocab_size)
    assert [t.rollout_id for t in group.trajectories] == ["r00", "r01"]
    # One generate call per turn over the still-active episodes.
    assert len(rec.calls) == max(len(t.turns) for t in group.trajectories) == stats.generate_calls
    sent = [(tuple(p), g) for prompts_, gens in rec.calls for p, g in zip(prompts_, gens)]
    for traj in group.trajectories:
        ids = traj.token_ids_S.tolist()
        assert traj.token_ids_S.dtype == np.int32 and traj.sampler_logprobs_S.dtype == np.float32
        assert traj.loss_mask_S.dtype == np.uint8
        assert traj.ending in ("won", "lost", "max_turns") and traj.reward == (1.0 if traj.won else 0.0)
        expected_mask = np.zeros(len(ids), np.uint8)
        for k, turn in enumerate(traj.turns):
            prompt, response = ids[: turn.response_start], ids[turn.response_start : turn.response_end]
            # Exactly what was sent and sampled: no re-rendering anywhere.
            # (Siblings share their first prompt, so match prompt and response together.)
            match = [g for p, g in sent if p == tuple(prompt) and g.token_ids == response]
            assert match, f"{traj.rollout_id} turn {k}: ids differ from every request/response pair"
            np.testing.assert_allclose(traj.sampler_logprobs_S[turn.response_start : turn.response_end],
                                       np.float32(match[0].logprobs), rtol=0, atol=0)
            np.testing.assert_allclose(traj.sampler_entropy_S[turn.response_start : turn.response_end],
                                       np.float32(match[0].entropies), rtol=0, atol=0)
            assert turn.finish_reason == match[0].finish_reason
            assert 1 <= len(response) <= 8 and turn.text.startswith(chat.prefill_text)
            expected_mask[turn.response_start : turn.response_end] = 1
            if k + 1 < len(traj.turns):
                nxt = traj.turns[k + 1]
                assert ids[: nxt.response_start][: turn.response_end] == prompt + response
                ended = turn.finish_reason == "stop" and response[-1] == backend.eos_token_id
                assert ids[turn.response_end : nxt.response_start] == chat.continuation_ids(turn.observation, ended)
            else:
                assert turn.observation == "" and turn.response_end == len(ids)
        np.testing.assert_array_equal(traj.loss_mask_S, expected_mask)
        assert (traj.sampler_logprobs_S[expected_mask == 0] == 0).all()
        assert (traj.sampler_logprobs_S[expected_mask == 1] <= 0).all()
        ent = traj.sampler_entropy_S
        assert ent.dtype == np.float32 and ent.shape == traj.token_ids_S.shape
        assert (ent[expected_mask == 0] == 0).all() and (ent >= 0).all() and (ent <= math.log(backend.vocab_size)).all()
    assert stats.turns == sum(len(t.turns) for t in group.trajectories)
    assert stats.generated_tokens == sum(int(t.loss_mask_S.sum()) for t in group.trajectories)
    assert stats.nonfinite_logprobs == 0 and stats.seconds > 0
    # The entropy of the distribution the token was drawn from (T = 1, top_p = 1), recomputed
    # for one position from a plain forward pass over the trajectory's ids.
    traj = group.trajectories[0]
    pos = traj.turns[-1].response_end - 1
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([traj.token_ids_S[:pos].tolist()])).logits[0, -1]
    assert abs(float(traj.sampler_entropy_S[pos]) - float(entropy_from_logits(logits, 1.0))) < 1e-4


def test_truncation_before_sampling(game, backend, chat):
    task = make_task(game, group_size=2, max_turns=3)
    with TextWorldEnv(game) as env:
        n0 = len(initial_prompt_ids(chat, ENV, env.reset()))
    ro = RolloutSection(group_size=2, max_new_tokens=8)

    # Room for exactly one turn: the observation after it cannot fit, so each
    # episode ends "truncated" with its first turn kept, and no request lacks budget.
    limit = n0 + 8 + 2
    rec = Recorder(backend, limit)
    group, stats = run_group(task, rec, chat, ENV, ro, limit, seed=3)
    group.validate(backend.vocab_size)
    assert len(rec.calls) == 1 and [len(p) for p in rec.calls[0][0]] == [n0, n0]
    for t in group.trajectories:
        if t.won:  # a lucky one-step win ends before the budget matters
            continue
        assert t.ending == "truncated" and len(t.turns) == 1 and t.loss_mask_S.sum() > 0
        assert t.turns[-1].observation == "" and t.turns[-1].response_end == len(t.token_ids_S)

    # Tighter: the first prompt itself leaves too little room, so nothing is ever sent.
    tight = n0 + 7
    rec = Recorder(backend, tight)
    group, stats = run_group(task, rec, chat, ENV, ro, tight, seed=3)
    group.validate(backend.vocab_size)
    assert rec.calls == [] and stats.turns == 0 and stats.truncated_episodes == 2
    for t in group.trajectories:
        assert t.ending == "truncated" and t.turns == [] and t.loss_mask_S.sum() == 0 and t.reward == 0.0
        assert len(t.token_ids_S) == n0


# ---------------------------------------------------------------------------
# Scripted fake backend (narrow unit tests only)


@dataclass
class FakeGen:
    token_ids: list
    logprobs: list
    finish_reason: str


class ScriptedBackend:
    """Returns scripted replies per call: reply(call_index, row) -> (text, finish, nan_at)."""

    def __init__(self, tokenizer, eos_token_id, reply, raise_rows=None):
        self.tokenizer, self.eos_token_id, self.reply = tokenizer, eos_token_id, reply
        self.stop_token_ids = [eos_token_id]
        self.vocab_size, self.policy_version, self.max_model_len = len(tokenizer), 0, 2048
        self.calls, self.raise_rows = 0, raise_rows

    def generate(self, prompts_, max_new_tokens, temperature, top_p=1.0, seed=None):
        assert prompts_ and max_new_tokens >= 1
        if self.raise_rows is not None:
            rows, self.raise_rows = self.raise_rows, None
            raise NonFiniteLogitsError("nan logits", rows)
        out = []
        for row in range(len(prompts_)):
            text, finish, nan_at = self.reply(self.calls, row)
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
            if finish == "stop":
                ids = ids[: max_new_tokens - 1] + [self.eos_token_id]
            lps = [-0.5] * len(ids)
            if nan_at is not None:
                lps[nan_at] = math.nan
            out.append(FakeGen(ids, lps, finish))
        self.calls += 1
        return out


def test_the_opening_is_the_first_prompts_user_message(game):
    """Trajectory.opening: the text the student read before its first turn, the same for siblings of one game
    (a tokenizer only: the tiny random model's, which is SmolLM2's)."""
    from transformers import AutoTokenizer

    from opsd.config import ModelSection
    from opsd.models.hf import ensure_model

    tok = AutoTokenizer.from_pretrained(ensure_model(ModelSection(name="tiny-random")), local_files_only=True)
    chat = ChatFormat(tok, "action")
    fake = ScriptedBackend(tok, tok.eos_token_id, lambda call, row: ("look</action>", "stop", None))
    group, _ = run_group(make_task(game, 2, 1), fake, chat, ENV, RolloutSection(group_size=2, max_new_tokens=8), 2048, seed=0)
    with TextWorldEnv(game) as env:
        first = env.reset()
    for traj in group.trajectories:
        assert traj.opening == prompts.first_user_message(first.observation, first.admissible_commands, ENV)
        assert first.observation.strip() and first.observation in traj.opening
        assert traj.token_ids_S[: traj.turns[0].response_start].tolist() == initial_prompt_ids(chat, ENV, first)


def test_invalid_response_gets_feedback_and_does_not_step(game, backend, chat, monkeypatch):
    steps = []
    real_step = TextWorldEnv.step
    monkeypatch.setattr(TextWorldEnv, "step", lambda self, a: steps.append(a) or real_step(self, a))
    fake = ScriptedBackend(backend.tokenizer, backend.eos_token_id, lambda call, row: ("I am not sure what to do.", "stop", None))
    group, stats = run_group(make_task(game, 1, 2), fake, chat, ENV, RolloutSection(group_size=1, max_new_tokens=16), 2048, seed=0)
    group.validate(backend.vocab_size)
    (traj,) = group.trajectories
    assert steps == [] and stats.valid_turns == 0 and stats.turns == 2
    t0 = traj.turns[0]
    assert not t0.format_valid and t0.action == "" and t0.finish_reason == "stop"
    assert t0.observation.startswith(ENV.invalid_feedback)
    assert traj.ending == "max_turns" and traj.reward == 0.0


def test_nan_logprob_length_finish_and_win(game, backend, chat):
    win = game.walkthrough[0]

    def reply(call, row):
        if call == 0:  # turn 0: cut by the token cap, one NaN log-prob
            return "open the thing and then look around the room very carefully, then go north and east", "length", 2
        return f"{win}</action>", "stop", None  # turn 1: the winning command (after the prefilled <action>)

    fake = ScriptedBackend(backend.tokenizer, backend.eos_token_id, reply)
    group, stats = run_group(make_task(game, 2, 3), fake, chat, ENV, RolloutSection(group_size=2, max_new_tokens=16), 2048, seed=0)
    group.validate(backend.vocab_size)
    assert stats.nonfinite_logprobs == 2 and stats.length_finishes == 2 and stats.wins == 2
    for traj in group.trajectories:
        t0, t1 = traj.turns
        assert t0.finish_reason == "length" and not t0.format_valid  # cut by the cap: the sampler says so
        assert traj.loss_mask_S[t0.response_start + 2] == 0 and traj.sampler_logprobs_S[t0.response_start + 2] == 0
        assert t0.response_end - t0.response_start == 16 and traj.loss_mask_S[t0.response_start : t0.response_end].sum() == 15
        # The cut turn was closed by the continuation (it did not end with <|im_end|>).
        assert traj.token_ids_S[t0.response_end : t1.response_start].tolist() == chat.continuation_ids(t0.observation, False)
        assert t1.format_valid and t1.action == win and t1.finish_reason == "stop"
        assert traj.won and traj.reward == 1.0 and traj.ending == "won" and t1.observation == ""
        assert traj.sampler_entropy_S is None  # the scripted backend reports no entropies


def test_scripted_entropies_kept_and_bad_ones_masked(game, backend, chat):
    class WithEntropy(ScriptedBackend):
        def generate(self, *args, **kwargs):
            gens = super().generate(*args, **kwargs)
            for g in gens:  # 0.5 nats per token, one NaN and one negative entropy in the first turn
                g.entropies = [0.5] * len(g.token_ids)
                if self.calls == 1:
                    g.entropies[1], g.entropies[3] = math.nan, -1.0
            return gens

    fake = WithEntropy(backend.tokenizer, backend.eos_token_id, lambda c, r: ("look</action>", "stop", None))
    group, stats = run_group(make_task(game, 1, 2), fake, chat, ENV, RolloutSection(group_size=1, max_new_tokens=8), 2048, seed=0)
    group.validate(backend.vocab_size)
    (traj,) = group.trajectories
    t0 = traj.turns[0]
    ent, mask = traj.sampler_entropy_S, traj.loss_mask_S
    assert stats.nonfinite_logprobs == 2 and mask[t0.response_start + 1] == 0 and mask[t0.response_start + 3] == 0
    assert (ent[mask == 1] == 0.5).all() and (ent[mask == 0] == 0).all()
    assert traj.sampler_logprobs_S[t0.response_start + 1] == 0


def test_nonfinite_logits_row_ends_as_error(game, backend, chat):
    fake = ScriptedBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: ("look</action>", "stop", None), raise_rows=[0])
    group, stats = run_group(make_task(game, 2, 2), fake, chat, ENV, RolloutSection(group_size=2, max_new_tokens=8), 2048, seed=0)
    group.validate(backend.vocab_size)
    r0, r1 = group.trajectories
    assert r0.ending == "error" and r0.turns == [] and r1.ending == "max_turns" and len(r1.turns) == 2
    assert stats.nonfinite_logprobs == 1


# ---------------------------------------------------------------------------
# Bad-input cases through run_group with exact scripted ids (real tokenizer)


class IdsBackend:
    """Replies with exact ids: reply(call_index, row) -> (ids, finish); every log-prob -0.5."""

    def __init__(self, tokenizer, eos_token_id, reply):
        self.tokenizer, self.eos_token_id, self.reply = tokenizer, eos_token_id, reply
        self.stop_token_ids = [eos_token_id]
        self.vocab_size, self.policy_version, self.max_model_len = len(tokenizer), 0, 2048
        self.calls = 0

    def generate(self, prompts_, max_new_tokens, temperature, top_p=1.0, seed=None):
        out = []
        for row in range(len(prompts_)):
            ids, finish = self.reply(self.calls, row)
            assert len(ids) <= max_new_tokens
            out.append(FakeGen(list(ids), [-0.5] * len(ids), finish))
        self.calls += 1
        return out


def _enc(backend, text):
    return backend.tokenizer.encode(text, add_special_tokens=False)


def test_case8_sampled_ids_are_kept_even_when_text_would_reencode_otherwise(game, backend, chat):
    he_llo = [255, 31394] + _enc(backend, "</action>") + [2]  # "hello" re-encodes as ONE token
    a_nl = [81, 1116] * 4  # "a" + "\n\n", 4 times: 8 sampled ids (a 512-token reply grows the same way)
    assert len(_enc(backend, backend.tokenizer.decode(a_nl))) == 11  # re-encoded: more than the 8-token cap
    replies = [(he_llo, "stop"), (a_nl, "length")]
    rec = Recorder(IdsBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: replies[c]), 2048)
    group, _ = run_group(make_task(game, 1, 2), rec, chat, ENV, RolloutSection(group_size=1, max_new_tokens=8), 2048, seed=0)
    group.validate(backend.vocab_size)
    (traj,) = group.trajectories
    ids = traj.token_ids_S.tolist()
    t0, t1 = traj.turns
    assert ids[t0.response_start : t0.response_end] == he_llo and t0.action == "hello"
    assert ids[t1.response_start : t1.response_end] == a_nl and t1.response_end - t1.response_start == 8
    # Each request's prompt is exactly the trajectory so far: turn k's prompt + response prefix turn k+1's.
    (p0,), (p1,) = (prompts_ for prompts_, _ in rec.calls)
    assert p0 == ids[: t0.response_start] and p1 == ids[: t1.response_start] and p1[: len(p0) + len(he_llo)] == p0 + he_llo
    assert traj.loss_mask_S.sum() == len(he_llo) + 8


def test_case10_think_closing_tag_only_through_an_episode(game, backend):
    chat = ChatFormat(backend.tokenizer, "think")
    env = ENV.model_copy(update={"prompt_format": "think"})
    reply = _enc(backend, "x\n</think>\n\n<action>a</action>") + [backend.eos_token_id]
    fake = IdsBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: (reply, "stop"))
    group, stats = run_group(make_task(game, 1, 1), fake, chat, env, RolloutSection(group_size=1, max_new_tokens=16), 2048, seed=0)
    (t0,) = group.trajectories[0].turns
    assert (t0.thinking, t0.action, t0.format_valid) == ("x", "a", True) and stats.format_errors == 0
    turn_text = backend.tokenizer.decode(group.trajectories[0].token_ids_S[: t0.response_end].tolist())
    last_turn = turn_text.split("<|im_start|>assistant\n")[-1]
    assert last_turn.count("<think>") == 1 and last_turn.count("</think>") == 1


@pytest.mark.parametrize("char", ["🙂", "🎉", "𝔸", "👨\u200d👩\u200d👧", "한", "日本", "🇫🇷", "ß"])
def test_case14_reply_cut_inside_a_multibyte_char_has_no_fffd(game, backend, chat, char):
    full = _enc(backend, f"go {char}{char}</action>")
    cuts = [k for k in range(1, len(full)) if "\ufffd" in backend.tokenizer.decode(full[:k])]
    assert cuts, "the char must split over tokens for this test to mean anything"
    for k in cuts:
        fake = IdsBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: (full[:k], "length"))
        group, _ = run_group(make_task(game, 1, 1), fake, chat, ENV, RolloutSection(group_size=1, max_new_tokens=k), 2048, seed=0)
        (t0,) = group.trajectories[0].turns
        assert "\ufffd" not in t0.text and (chat.prefill_text + f"go {char}{char}").startswith(t0.text), (k, t0.text)


def test_case15_no_budget_no_request_for_every_context_limit(game, backend, chat):
    """Sweep the context limit through every boundary: a request is sent only with room for the full
    max_new_tokens, earlier turns stay trainable, and the episode ends "truncated" once it cannot go on."""
    max_new = 6
    with TextWorldEnv(game) as env:
        n0 = len(initial_prompt_ids(chat, ENV, env.reset()))
    look = _enc(backend, "look</action>") + [backend.eos_token_id]
    seen = set()
    for limit in range(n0 - 1, n0 + 3 * (max_new + 120), 7):
        rec = Recorder(IdsBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: (look, "stop")), limit)
        group, stats = run_group(make_task(game, 1, 3), rec, chat, ENV, RolloutSection(group_size=1, max_new_tokens=max_new),
                                 limit, seed=0)
        (traj,) = group.trajectories
        assert len(rec.calls) == len(traj.turns) == stats.turns  # Recorder asserted each request's budget
        for t in traj.turns:
            assert traj.loss_mask_S[t.response_start : t.response_end].sum() == len(look)
            assert t.response_start + max_new <= limit
        if len(traj.turns) < 3:
            assert traj.ending == "truncated" and stats.truncated_episodes == 1
        else:
            assert traj.ending == "max_turns"
        if traj.turns:  # ends on its last response, inside the budget
            assert traj.turns[-1].response_end == len(traj.token_ids_S) <= limit
        else:  # the first prompt alone left no room: kept as is, nothing sampled, nothing to train
            assert len(traj.token_ids_S) == n0 and n0 + max_new > limit and not traj.loss_mask_S.any()
        seen.add(len(traj.turns))
    assert seen == {0, 1, 2, 3}  # the sweep crossed every boundary


def test_case16_cut_inside_think_is_truncated_not_a_format_error(game, backend):
    chat = ChatFormat(backend.tokenizer, "think")
    env = ENV.model_copy(update={"prompt_format": "think"})
    tok, eos = backend.tokenizer, backend.eos_token_id
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    text = "I should go north because the key is there and the door is open, so"
    replies = [
        (_enc(backend, text)[:16], "length"),  # cut by the cap inside <think>
        (_enc(backend, text)[:15] + [eos], "length"),  # the last id is eos, yet the sampler says "length"
        (_enc(backend, "hmm, maybe north") + [eos], "stop"),  # ended by the model without </think>
        (_enc(backend, "ok</think><action>look</action>") + [endoftext], "stop"),  # another stop id, not eos
    ]
    fake = IdsBackend(tok, eos, lambda c, r: replies[c])
    group, stats = run_group(make_task(game, 1, 4), fake, chat, env, RolloutSection(group_size=1, max_new_tokens=16), 2048, seed=0)
    (traj,) = group.trajectories
    t0, t1, t2, t3 = traj.turns
    assert [t.finish_reason for t in traj.turns] == ["length", "length", "stop", "stop"]
    assert (t0.truncated, t0.format_error, t0.format_valid) == (True, False, False)
    assert (t1.truncated, t1.format_error, t1.format_valid) == (True, False, False)
    assert (t2.truncated, t2.format_error) == (False, True)
    assert (t3.truncated, t3.format_error, t3.format_valid, t3.action) == (False, False, True, "look")
    assert stats.length_finishes == 2 and stats.format_errors == 1 and stats.valid_turns == 1
    ids = traj.token_ids_S.tolist()
    # The continuation closes a turn exactly when its ids lack <|im_end|>: never two, never none.
    assert ids[t0.response_end - 1 : t0.response_end + 2] == [replies[0][0][-1], eos, 198]  # closed by the continuation
    assert ids[t1.response_end - 1 : t1.response_end + 2] == [eos, 198, 1]  # its own <|im_end|>, only "\n" added
    assert ids[t2.response_end - 1 : t2.response_end + 2] == [eos, 198, 1]
    assert ids[t3.response_end - 1 :] == [endoftext]  # the last turn: nothing appended after it
    assert all(ids[k : k + 2] != [eos, eos] for k in range(len(ids)))


def test_run_groups_batches_groups_and_isolates_a_broken_one(game, backend, chat):
    rollout = RolloutSection(group_size=2, max_new_tokens=8, batch_size=16)
    alone, _ = run_group(make_task(game), backend, chat, ENV, rollout, 2048, seed=11)
    # A group whose task is malformed fails alone; the good ones share each turn's generate call.
    broken = make_task(game)
    broken.game = {"spec": {"seed": "not a seed"}, "task_id": "x"}
    other = make_task(game)
    other.group_id = "g-other"
    rec = Recorder(backend, 2048)
    results = run_groups([make_task(game), broken, other], rec, chat, ENV, rollout, 2048, seeds=[11, 12, 13])
    assert isinstance(results[1], ValueError)
    (g0, s0), (g2, _) = results[0], results[2]
    assert len(rec.calls) == max(len(t.turns) for t in g0.trajectories + g2.trajectories)
    assert len(rec.calls[0][0]) == 4  # both good groups' episodes in the first call
    assert s0.generate_calls == max(len(t.turns) for t in g0.trajectories)  # the calls it took part in
    for g in (g0, g2):
        g.validate(backend.vocab_size)
    # One group alone is played exactly as run_group plays it; a batch is reproducible from its seeds.
    (solo, _), = run_groups([make_task(game)], backend, chat, ENV, rollout, 2048, seeds=[11])
    assert [t.token_ids_S.tolist() for t in solo.trajectories] == [t.token_ids_S.tolist() for t in alone.trajectories]
    again = run_groups([make_task(game), broken, other], backend, chat, ENV, rollout, 2048, seeds=[11, 12, 13])
    assert [t.token_ids_S.tolist() for t in again[2][0].trajectories] == [t.token_ids_S.tolist() for t in g2.trajectories]
    with pytest.raises(ValueError, match="seeds"):
        run_groups([make_task(game)], backend, chat, ENV, rollout, 2048, seeds=[])


def test_run_groups_survives_an_env_that_fails_to_close_or_reports_a_malformed_hint(game, backend, chat, monkeypatch):
    """An env whose close() raises loses no group and leaks no other env; an env reporting policy_commands
    that is not a list of str ends that episode as "error" (not a hint of single characters)."""
    from opsd.envs import textworld as tw

    real_init, real_close, real_step = tw.TextWorldEnv.__init__, tw.TextWorldEnv.close, tw.TextWorldEnv.step
    created, closed = [], []

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        created.append(self)

    # Only this test's envs count: an earlier test's env collected now (ClosingEnv.__del__) closes too.
    def close(self):
        mine = any(self is e for e in created)
        if mine:
            closed.append(self)
        real_close(self)
        if mine and len(closed) == 1:
            raise OSError("close failed")

    def step(self, action):
        return dataclasses.replace(real_step(self, action), policy_commands="take coin")

    monkeypatch.setattr(tw.TextWorldEnv, "__init__", init)
    monkeypatch.setattr(tw.TextWorldEnv, "close", close)
    monkeypatch.setattr(tw.TextWorldEnv, "step", step)
    rollout = RolloutSection(group_size=2, max_new_tokens=8, batch_size=16)
    other = make_task(game)
    other.group_id = "g-other"
    results = run_groups([make_task(game), other], backend, chat, ENV, rollout, 2048, seeds=[11, 12])
    assert len(created) == 4  # 2 groups x 2 siblings
    # Every env closed once by run_groups itself, although the first close raised.
    assert len(closed) == 4 and all(any(c is e for c in closed) for e in created)
    trajectories = [t for r in results for t in r[0].trajectories]  # both groups came back
    stepped = [t for t in trajectories if any(rec.format_valid for rec in t.turns)]
    assert stepped and all(t.ending == "error" for t in stepped)
    assert all(rec.hint != list("take coin") for t in trajectories for rec in t.turns)


def test_a_reply_ending_at_any_stop_id_is_a_finished_turn(game, backend, chat):
    """Issue 34: a turn that ends at a stop id other than the template's end of turn (an eos, as Llama 3's
    <|end_of_text|> beside <|eot_id|>) is finished: the continuation does not close it a second time."""
    other_stop = 0  # SmolLM2's <|endoftext|>, made a stop id of this backend
    look = _enc(backend, "look</action>")
    replies = [(look + [other_stop], "stop"), (look + [backend.eos_token_id], "stop")]
    fake = IdsBackend(backend.tokenizer, backend.eos_token_id, lambda c, r: replies[c])
    fake.stop_token_ids = [other_stop, backend.eos_token_id]
    group, _ = run_group(make_task(game, 1, 2), fake, chat, ENV, RolloutSection(group_size=1, max_new_tokens=8), 2048, seed=0)
    (traj,) = group.trajectories
    ids = traj.token_ids_S.tolist()
    t0, t1 = traj.turns
    after = ids[t0.response_end : t1.response_start]
    assert ids[t0.response_end - 1] == other_stop
    # ChatML's "\n" after the end of turn, then the user turn: no <|im_end|> inserted to close it again.
    assert after[:2] == _enc(backend, "\n") + [backend.tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert t0.format_valid and t0.finish_reason == "stop"
