"""The long-context evidence-aggregation env (opsd/envs/evidence.py): its graded verifier, that the required
IDs are exactly the document's matching entries, lengths in SmolLM2 tokens, splits and bad specs."""

from __future__ import annotations

import re

import pytest

from opsd.config import EnvSection, RunConfig
from opsd.envs import EnvContext, Task, get_adapter
from opsd.envs.evidence import EvidenceEnv, f1, generate, make_tasks, observation

ENV = EnvSection(name="evidence", game_pool=8, eval_pool=8, max_turns=1, max_observation_chars=40_000,
                 evidence={"prompt_tokens": [1024, 2048, 4096]})


@pytest.mark.parametrize("answer,expected", [
    ("KE-1042, RO-2210, HE-3001", 1.0),
    ("HE-3001 RO-2210 KE-1042 and KE-1042 again", 1.0),  # order, words and repeats do not matter
    ("KE-1042", 2 * 1 / (1 + 3)),  # one of three: precision 1, recall 1/3
    ("KE-1042, RO-2210, XX-9999", 2 * 2 / (3 + 3)),  # an extra ID costs precision
    ("", 0.0), ("none of them", 0.0), ("ke-1042", 0.0),  # IDs are copied exactly
])
def test_f1_is_graded(answer, expected):
    assert f1(answer, ["HE-3001", "KE-1042", "RO-2210"]) == pytest.approx(expected)


def test_long_passage_numbers_are_scored():
    assert f1("P12345, P7", ["P7", "P12345"]) == 1.0 and f1("P123456", ["P12345"]) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_required_ids_are_exactly_the_matching_entries(seed):
    tables = generate("tables", 2048, seed)
    city = re.search(r"destination is (\w+)\.", tables.question).group(1)
    rows = [line.split(" | ") for line in tables.text.splitlines() if re.match(r"\| [A-Z]{2}-\d{4} ", line)]
    assert sorted(r[0].lstrip("| ") for r in rows if r[2] == city) == tables.answer
    assert 2 <= len(tables.answer) <= 6 and len({r[0] for r in rows}) == len(rows)  # unique row IDs
    assert len(tables.text.split("\n\nTable ")) >= 2

    passages = generate("retrieval", 2048, seed)
    city = re.search(r"lives in (\w+) now", passages.question).group(1)
    lives = [m.group(1) for m in re.finditer(rf"^\[(P\d+)\] [\w. ]+? is an? \w+ who lives in {city}\.", passages.text, re.M)]
    assert lives == passages.answer and 2 <= len(lives) <= 6
    # One person a passage, every name distinct (a required person is never also someone living elsewhere).
    long = generate("retrieval", 16384, seed)
    names = [re.match(r"\[P\d+\] ([A-Z][a-z]+(?: [A-Z]\.)? [A-Z][a-z]+)", line).group(1) for line in long.text.splitlines()]
    assert len(names) > 300 and len(set(names)) == len(names)
    # Distractors name the city without the person living there.
    named = [m.group(1) for m in re.finditer(rf"^\[(P\d+)\] .*\b{city}\b", passages.text, re.M)]
    assert set(lives) <= set(named)


def test_documents_are_as_long_as_their_target_in_smollm2_tokens(policy_backend):
    for kind in ("tables", "retrieval"):
        for tokens in (1024, 4096, 7168):
            for seed in range(3):
                n = len(policy_backend.tokenizer(generate(kind, tokens, seed).text)["input_ids"])
                assert 0.85 <= n / tokens <= 1.15, (kind, tokens, seed, n)


def test_splits_categories_and_determinism():
    ctx = EnvContext()
    train, again, evals = make_tasks(ENV, ctx, "train"), make_tasks(ENV, ctx, "train"), make_tasks(ENV, ctx, "eval")
    assert [t.to_dict() for t in train] == [t.to_dict() for t in again]
    assert not {t.spec["seed"] for t in train} & {t.spec["seed"] for t in evals}
    assert {t.objective + t.gold_path[0] for t in train}.isdisjoint({t.objective + t.gold_path[0] for t in evals})
    assert [t.category for t in train[:6]] == ["1k", "1k", "2k", "2k", "4k", "4k"]
    assert [t.skill_key for t in train[:2]] == ["tables", "retrieval"]
    # The task travels as a dict; the env rebuilds the same document from it.
    task = Task.from_dict(train[3].to_dict())
    env = get_adapter("evidence").open_env(task, ENV, ctx)
    first = env.reset()
    assert first.observation == observation(generate(task.spec["kind"], task.spec["tokens"], task.spec["seed"]))
    assert first.policy_commands == [task.gold_path[0].removeprefix("answer: ")]
    step = env.step(first.policy_commands[0])
    assert (step.reward, step.won, step.done) == (1.0, True, True)
    with pytest.raises(RuntimeError, match="finished"):
        env.step("again")


def test_bad_config_and_specs():
    with pytest.raises(ValueError, match="max_observation_chars"):
        EnvSection(name="evidence", evidence={"prompt_tokens": [4096]})  # the 2000-character default would cut
    with pytest.raises(ValueError, match="repeat"):
        EnvSection(name="evidence", max_observation_chars=40_000, evidence={"prompt_tokens": [1024, 1024]})
    with pytest.raises(ValueError):
        EnvSection(name="evidence", max_observation_chars=40_000, evidence={"kinds": ["novels"]})
    for spec in ({}, {"kind": "tables", "tokens": "many", "seed": 1}, {"kind": "tables", "tokens": -5, "seed": 1}):
        with pytest.raises(ValueError, match="evidence task spec"):
            EvidenceEnv(Task("t", "1k", spec), 40_000)
    with pytest.raises(ValueError, match="unknown evidence kind"):
        EvidenceEnv(Task("t", "1k", {"kind": "novels", "tokens": 1024, "seed": 1}), 40_000)
    # A whole run config with the evidence env validates (the config the benchmark and docs use).
    assert RunConfig(env=ENV).env.name == "evidence"


def test_a_prompt_longer_than_the_context_ends_the_episode_truncated(policy_backend):
    """As in every env: the turn is not sampled (no request without budget), the episode ends "truncated" with
    no turn and reward 0, and the group still validates."""
    from opsd.chat import ChatFormat
    from opsd.config import RolloutSection
    from opsd.envs import task_group
    from services.rollout.episodes import run_group
    from tests.test_episodes import ScriptedBackend

    env = ENV.model_copy(update={"evidence": ENV.evidence.model_copy(update={"prompt_tokens": [4096]})})
    (task,) = make_tasks(env.model_copy(update={"game_pool": 1}), EnvContext(), "train")
    group = task_group(RunConfig(env=env), task, group_id="g", step=0, policy_version=0, group_size=2)
    fake = ScriptedBackend(policy_backend.tokenizer, policy_backend.eos_token_id,
                           lambda call, row: pytest.fail("a prompt over the context must not be sampled"))
    out, stats = run_group(group, fake, ChatFormat.for_env(policy_backend.tokenizer, env), env,
                           RolloutSection(group_size=2, max_new_tokens=64), 2048, seed=0, ctx=EnvContext())
    out.validate(policy_backend.vocab_size)
    assert [(t.ending, t.reward, len(t.turns)) for t in out.trajectories] == [("truncated", 0.0, 0)] * 2
    assert stats.truncated_episodes == 2
