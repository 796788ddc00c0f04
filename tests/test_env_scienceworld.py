"""ScienceWorld adapter on the real scienceworld package (a JVM per env; steps ~0.1-0.2 s)."""

from __future__ import annotations

import pytest

from opsd.config import EnvSection
from opsd.envs import get_adapter
from opsd.envs.base import EnvContext, Task
from opsd.envs.scienceworld import make_tasks, open_env
from tests.test_env_twx import hang_guard, java_children, stop_and_wait

CFG = EnvSection(name="scienceworld", game_pool=2, eval_pool=1, seed=3,
                 scienceworld={"tasks": ["find-living-thing"], "simplifications": "easy"})


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    train = make_tasks(CFG, EnvContext(cache_dir=cache), "train")
    evals = make_tasks(CFG, EnvContext(), "eval")
    return train, evals, cache


@pytest.fixture(scope="module")
def env_jvm(pools):
    """(task, env, pid of the env's JVM): one env shared by the tests below."""
    task = pools[0][0]
    before = java_children()
    e = open_env(task, CFG, EnvContext())
    (pid,) = java_children() - before  # other JVMs may exit meanwhile (collected envs), none starts
    yield task, e, pid
    e.close()


@pytest.fixture(scope="module")
def env(env_jvm):
    return env_jvm[:2]


def test_registered_adapter_and_prompt():
    mod = get_adapter("scienceworld")
    assert (mod.NAME, mod.ACTION_TAGS, mod.METRIC) == ("scienceworld", ("action",), "success")
    assert set(mod.PROMPT.system) == {"action", "think"} and all("{pick}" in s for s in mod.PROMPT.system.values())
    _obs, admissible, replies = mod.PROMPT.example
    assert replies["action"] == "<action>focus on copper key</action>" and "focus on copper key" in admissible
    assert replies["think"].startswith("<think>") and replies["think"].endswith("<action>focus on copper key</action>")


def test_pools_are_deterministic_disjoint_and_cached(pools):
    train, evals, cache = pools
    # train variations are 0..149 of find-living-thing, dev 150..224; train starts at cfg.seed.
    assert [t.spec["variation"] for t in train] == [3, 4] and [t.spec["variation"] for t in evals] == [150]
    assert [t.task_id for t in train] == ["sw-find-living-thing-v3-easy", "sw-find-living-thing-v4-easy"]
    assert all(t.category == t.skill_key == "find-living-thing" for t in train + evals)
    assert all(t.objective.startswith("Your task is to find a(n) living thing.") and t.gold_path for t in train + evals)
    assert not {t.task_id for t in train} & {t.task_id for t in evals}
    # Cached: the same pool, gold paths included (ScienceWorld samples which living thing to pick).
    assert make_tasks(CFG, EnvContext(cache_dir=cache), "train") == train
    assert len(list((cache / "tasks").glob("scienceworld-*.json"))) == 1


def test_gold_path_wins(env):
    task, e = env
    step = e.reset()
    assert step.observation.startswith(task.objective + "\n\nThis ") and " is called the " in step.observation
    assert not step.done and step.policy_commands == task.gold_path and len(step.admissible_commands) > 20
    for k, action in enumerate(task.gold_path):
        assert not step.done, k
        step = e.step(action)
        assert not step.invalid_action, action
    assert (step.won, step.lost, step.done, step.reward, step.score) == (True, False, True, 1.0, 100.0)
    with pytest.raises(RuntimeError, match="finished"):
        e.step("look around")


def test_bad_sequence_gives_no_reward_and_goes_on(env):
    task, e = env
    e.reset()
    for action in ["look around", "inventory", "look at air", "wait1"]:
        step = e.step(action)
        assert not step.invalid_action and (step.reward, step.done, step.won) == (0.0, False, False)
    assert step.score < 100


def test_invalid_and_weird_actions(env):
    task, e = env
    e.reset()
    for action in ["fly to the moon", "", "\x00\n\t", "é∂ƒ 漢字 🙂", "x" * 10_000, "<action>look around</action>"]:
        step = e.step(action)
        assert step.invalid_action, action
        assert "No known action matches that input" in step.observation
        assert (step.done, step.reward) == (False, 0.0)
    assert step.policy_commands == task.gold_path  # rejected actions change nothing
    # Several doors here: ScienceWorld asks which one; the env answers 0 itself (as gold paths do).
    step = e.step("open door")
    assert step.info.get("ambiguous") and not step.invalid_action and "Ambiguous" not in step.observation


def test_focusing_on_the_wrong_thing_loses(env):
    _task, e = env
    e.reset()
    step = e.step("focus on air")
    assert (step.won, step.lost, step.done, step.reward, step.score) == (False, True, True, 0.0, -100.0)
    with pytest.raises(RuntimeError):
        e.step("look around")


def test_observation_is_capped(env):
    _task, e = env
    e.max_observation_chars = 60
    try:
        step = e.reset()
        assert len(step.observation) == 60 and step.observation.endswith("...")
    finally:
        e.max_observation_chars = CFG.max_observation_chars


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="split"):
        make_tasks(CFG, EnvContext(), "dev")
    bad = CFG.model_copy(update={"scienceworld": CFG.scienceworld.model_copy(update={"tasks": ["find-unicorn"]})})
    with pytest.raises(ValueError, match="unknown ScienceWorld task"):
        make_tasks(bad, EnvContext(), "train")
    with pytest.raises(ValueError, match="lacks"):
        open_env(Task(task_id="t", category="boil", spec={"task": "boil"}), CFG, EnvContext())


def test_no_java_raises_runtime_error_naming_java(pools, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="Java"):
        open_env(pools[0][0], CFG, EnvContext())


def test_close_stops_the_jvm(env_jvm):
    _task, e, pid = env_jvm
    kids = java_children()
    assert pid in kids
    e.close()
    after = java_children()
    # This env's JVM is gone (and reaped) and none started. Other JVMs are not compared: another
    # test's env may be collected (ClosingEnv.__del__ closes it) at any point in between.
    assert pid not in after and after <= kids
    e.close()
    with pytest.raises(RuntimeError):
        e.reset()


def test_stopped_jvm_times_out_kills_java_and_raises(pools):
    """A hung JVM (SIGSTOP) must not block step forever: past step_timeout_s the JVM is killed and reaped,
    step raises a RuntimeError naming the timeout, and the env is closed."""
    import os
    import signal

    before = java_children()
    e = open_env(pools[0][0], CFG, EnvContext())
    (pid,) = java_children() - before
    e.reset()
    assert e.step_timeout_s == CFG.scienceworld.step_timeout_s == 60.0
    e.step_timeout_s = 1.0  # after the (slower) load; CFG's default 60 s applied until here
    stop_and_wait(pid)
    try:
        # The message names the deadline that fired: the 1 s one set above, not CFG's 60 s; without any,
        # the hang guard's kill ends the call with another error.
        with hang_guard(pid), pytest.raises(RuntimeError, match="step_timeout_s=1 s"):
            e.step("look around")
        assert pid not in java_children()  # killed and reaped (other tests' JVMs may come and go meanwhile)
    finally:
        if pid in java_children():
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        e.close()
    with pytest.raises(RuntimeError):
        e.step("look around")
