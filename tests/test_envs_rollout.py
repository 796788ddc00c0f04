"""Every environment through the rollout's episode loop (run_group), with scripted replies.

Per env: replying with the gold path wins (reward 1); malformed replies are
invalid turns that never reach the env and the episode fails when the turn
budget runs out; a well-formed but wrong action never wins. The envs are the
real ones (TextWorld, TextWorld-Express, ScienceWorld, ALFWorld, Search-QA over
the shipped corpus with the real encoder, WebShop through its client against
the tests' stand-in server, reasoning-gym, the evidence env); only the policy is scripted, since
a sampled 135M model cannot be made to follow a gold path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RolloutSection, RunConfig
from opsd.envs import EnvContext, Task, get_adapter, task_group
from services.rollout.episodes import run_group
from tests.test_episodes import ScriptedBackend
from tests.webshop_standin import StandinWebShop


@dataclass
class Case:
    env: EnvSection
    gold: Callable[[Task], list[str]]  # the actions (tag contents; whole tagged replies for Search) that win
    wrong: str  # a well-formed action that does not win


@pytest.fixture(scope="module")
def shop():
    with StandinWebShop() as server:
        yield server


@pytest.fixture(scope="module")
def search_ctx(tmp_path_factory):
    from opsd.envs.search import LocalRetriever

    return LocalRetriever(None, "all-MiniLM-L6-v2", cache_dir=tmp_path_factory.mktemp("retrieval"))


def _case(name: str, shop_url: str) -> Case:
    if name == "textworld":
        return Case(EnvSection(game_pool=1, max_turns=4), lambda t: t.gold_path, "look")
    if name == "twx":
        return Case(EnvSection(name="twx", game_pool=1, eval_pool=1, max_turns=4), lambda t: t.gold_path, "look around")
    if name == "scienceworld":
        return Case(EnvSection(name="scienceworld", game_pool=1, eval_pool=1, max_turns=40, list_admissible=False),
                    lambda t: t.gold_path, "look around")
    if name == "alfworld":
        return Case(EnvSection(name="alfworld", game_pool=1, eval_pool=1, max_turns=50), lambda t: t.gold_path, "look")
    if name == "search":
        return Case(EnvSection(name="search", game_pool=1, eval_pool=1, max_turns=4, list_admissible=False),
                    lambda t: t.gold_path, "<search>the history of chess</search>")
    if name == "webshop":
        cfg = EnvSection(name="webshop", game_pool=1, eval_pool=1, max_turns=6)
        cfg = cfg.model_copy(update={"webshop": cfg.webshop.model_copy(update={"url": shop_url, "goals": [1], "eval_goals": [2]})})
        gold = ["search[wireless noise cancelling headphones]", "click[B0STAND003]", "click[black]", "click[Buy Now]"]
        return Case(cfg, lambda t: gold, "search[garden hose]")
    if name == "reasoning_gym":
        return Case(EnvSection(name="reasoning_gym", game_pool=1, eval_pool=1, max_turns=1, list_admissible=False),
                    lambda t: [str(t.spec["answer"])], "not the answer")
    if name == "evidence":
        return Case(EnvSection(name="evidence", game_pool=1, eval_pool=1, max_turns=1, list_admissible=False,
                               max_observation_chars=6000, evidence={"prompt_tokens": [1024]}),
                    lambda t: [t.gold_path[0].removeprefix("answer: ")], "XX-0000, P0")
    raise AssertionError(name)


ENVS = ["textworld", "twx", "scienceworld", "alfworld", "search", "webshop", "reasoning_gym", "evidence"]
SINGLE_TURN = ("reasoning_gym", "evidence")


def _play(name, policy_backend, shop, search_ctx, tmp_path, replies: Callable[[Task, ChatFormat, int], str], max_turns=None):
    case = _case(name, shop.url)
    env_cfg = case.env if max_turns is None else case.env.model_copy(update={"max_turns": max_turns})
    ctx = EnvContext(cache_dir=tmp_path, retriever=search_ctx if name == "search" else None)
    (task,) = get_adapter(name).make_tasks(env_cfg, ctx, "train")
    cfg = RunConfig(env=env_cfg)
    group = task_group(cfg, task, group_id=f"g-{name}", step=0, policy_version=0, group_size=1)
    chat = ChatFormat.for_env(policy_backend.tokenizer, env_cfg)
    steps: list[str] = []
    adapter = get_adapter(name)

    class Counting:  # counts what reaches the env
        def __init__(self, inner):
            self.inner = inner

        def reset(self):
            return self.inner.reset()

        def step(self, action):
            steps.append(action)
            return self.inner.step(action)

        def close(self):
            self.inner.close()

    real_open = adapter.open_env
    try:
        adapter.open_env = lambda t, c, x: Counting(real_open(t, c, x))
        fake = ScriptedBackend(policy_backend.tokenizer, policy_backend.eos_token_id,
                               lambda call, row: (replies(task, chat, call), "stop", None))
        out, stats = run_group(group, fake, chat, env_cfg, RolloutSection(group_size=1, max_new_tokens=96), 2048,
                               seed=0, ctx=ctx)
    finally:
        adapter.open_env = real_open
    out.validate(policy_backend.vocab_size)
    assert out.task.category == task.category != ""
    return case, task, out.trajectories[0], stats, steps


def _reply(action: str, chat: ChatFormat) -> str:
    """The model's completion after the prefill that makes `action` the turn's action."""
    if not chat.prefill_text:  # several action tags (Search): the reply carries its own tag
        return action
    return f"{action}</{chat.action_tags[0]}>"


@pytest.mark.parametrize("name", ENVS)
def test_following_the_gold_path_wins(name, policy_backend, shop, search_ctx, tmp_path):
    def replies(task, chat, call):
        gold = _case(name, shop.url).gold(task)
        return _reply(gold[min(call, len(gold) - 1)], chat)

    case, task, traj, stats, steps = _play(name, policy_backend, shop, search_ctx, tmp_path, replies)
    gold = case.gold(task)
    assert gold, f"{name}: the task has no gold path to follow"
    assert (traj.ending, traj.won, traj.reward) == ("won", True, 1.0)
    assert len(traj.turns) == len(gold) and all(t.format_valid for t in traj.turns)
    assert stats.wins == 1 and stats.env_invalid_actions == 0
    if name in ("textworld", "twx", "scienceworld", "alfworld"):
        # Each turn carries the gold path left from the state it acted in (the teacher's per-turn hint).
        assert [t.hint for t in traj.turns] == [gold[k:] for k in range(len(gold))]


@pytest.mark.parametrize("name", ENVS)
def test_malformed_replies_are_invalid_turns_and_the_budget_ends_in_failure(name, policy_backend, shop, search_ctx, tmp_path):
    case, task, traj, stats, steps = _play(name, policy_backend, shop, search_ctx, tmp_path,
                                           lambda task, chat, call: "I am not sure what to do here.", max_turns=3)
    assert steps == [], "a malformed reply must never reach the environment"
    assert len(traj.turns) == 3 and not any(t.format_valid for t in traj.turns)
    assert all(t.format_error for t in traj.turns) and stats.format_errors == 3
    assert (traj.ending, traj.won, traj.reward) == ("max_turns", False, 0.0)


@pytest.mark.parametrize("name", ENVS)
def test_a_wrong_action_does_not_win(name, policy_backend, shop, search_ctx, tmp_path):
    case, task, traj, stats, steps = _play(name, policy_backend, shop, search_ctx, tmp_path,
                                           lambda task, chat, call: _reply(_case(name, shop.url).wrong, chat), max_turns=3)
    assert steps and all(t.format_valid for t in traj.turns)
    assert not traj.won and traj.reward < 1.0
    # A wrong single-turn answer ends the episode as lost; the others run out of turns.
    assert traj.ending == ("lost" if name in SINGLE_TURN else "max_turns")


def test_an_env_that_fails_to_start_is_retried_then_fails_the_group(policy_backend, shop, search_ctx, tmp_path, monkeypatch):
    """One flaky start (a WebShop 500, a JVM that did not come up) is retried; an env that never starts
    fails the whole group (redelivered by the queue) instead of training on a missing sibling."""
    import services.rollout.episodes as episodes

    monkeypatch.setattr(episodes, "START_BACKOFF_S", 0.0)
    adapter = get_adapter("textworld")
    real_open, calls = adapter.open_env, []

    def flaky(task, cfg, ctx):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("env server hiccup")
        return real_open(task, cfg, ctx)

    monkeypatch.setattr(adapter, "open_env", flaky)
    case = _case("textworld", shop.url)
    ctx = EnvContext(cache_dir=tmp_path)
    (task,) = adapter.make_tasks(case.env, ctx, "train")
    group = task_group(RunConfig(env=case.env), task, group_id="g-flaky", step=0, policy_version=0, group_size=3)
    chat = ChatFormat.for_env(policy_backend.tokenizer, case.env)
    fake = ScriptedBackend(policy_backend.tokenizer, policy_backend.eos_token_id, lambda call, row: ("look</action>", "stop", None))
    out, _ = run_group(group, fake, chat, case.env, RolloutSection(group_size=3, max_new_tokens=16), 2048, seed=0, ctx=ctx)
    assert len(calls) == 4 and [t.ending for t in out.trajectories] == ["max_turns"] * 3

    monkeypatch.setattr(adapter, "open_env", lambda t, c, x: (_ for _ in ()).throw(ConnectionError("down")))
    with pytest.raises(RuntimeError, match="failed to start 3 times"):
        run_group(group, fake, chat, case.env, RolloutSection(group_size=3, max_new_tokens=16), 2048, seed=0, ctx=ctx)
    monkeypatch.setattr(adapter, "open_env", lambda t, c, x: (_ for _ in ()).throw(KeyError("seed")))
    with pytest.raises(ValueError, match="refused the task"):  # a malformed task is not retried
        run_group(group, fake, chat, case.env, RolloutSection(group_size=3, max_new_tokens=16), 2048, seed=0, ctx=ctx)


def test_the_admissible_list_obeys_the_observation_cap():
    from services.rollout import prompts

    cfg = EnvSection(max_observation_chars=200)
    msg = prompts.observation_message("A page.", [f"click[product {i:04d}]" for i in range(500)], cfg)
    listed = msg.split("Admissible commands:\n", 1)[1]
    assert len(listed) <= 200 + 20 and listed.endswith("more)") and "click[product 0000]" in listed


@pytest.mark.parametrize("how", ["file symlink", "proc symlink", "folder symlink", "fifo"])
def test_skill_files_never_leave_the_skills_folder(tmp_path, monkeypatch, how):
    """Only regular files inside the skills folder are read: a symlink to a secret, to /proc/self/environ
    (whose size reads as 0), a symlinked env folder or a FIFO is refused with one line, and no content leaks."""
    from opsd.skills import privileged_text

    secret = tmp_path / "secret.txt"
    secret.write_text("REDIS_URL=redis://:hunter2@db")
    skills = tmp_path / "skills"
    skills.mkdir()
    if how == "folder symlink":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "general.txt").write_text("REDIS_URL=redis://:hunter2@db")
        (skills / "textworld").symlink_to(tmp_path / "elsewhere")
    else:
        (skills / "textworld").mkdir()
        target = skills / "textworld" / "general.txt"
        if how == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to(secret if how == "file symlink" else Path("/proc/self/environ"))
    monkeypatch.setenv("OPSD_SKILLS_DIR", str(skills))
    with pytest.raises(ValueError, match="not a regular file inside the skills folder"):
        privileged_text("textworld", Task("t", "c", {}), "both")


def test_a_huge_skill_file_is_refused(tmp_path, monkeypatch):
    from opsd.skills import privileged_text

    (tmp_path / "textworld").mkdir()
    (tmp_path / "textworld" / "general.txt").write_text("x" * 70_000)
    monkeypatch.setenv("OPSD_SKILLS_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="at most"):
        privileged_text("textworld", Task("t", "c", {}), "both")
