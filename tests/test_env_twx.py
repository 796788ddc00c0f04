"""TextWorld-Express adapter on the real textworld-express package (a JVM per env)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from textworld_express import TextWorldExpressEnv

from opsd.config import EnvSection
from opsd.envs import get_adapter
from opsd.envs.base import EnvContext, Task
from opsd.envs.twx import game_params, make_tasks, open_env, stop_jvm

ALL_GAMES = ["coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder"]
PARAMS = {"coin": "numLocations=2,includeDoors=0", "mapreader": "numLocations=3,maxDistanceApart=2",
          "cookingworld": "numLocations=1,numIngredients=2", "twc": "numLocations=1,numItemsToPutAway=2"}
CFG = EnvSection(name="twx", game_pool=8, eval_pool=3, seed=7, twx={"games": ALL_GAMES, "game_params": PARAMS})
CTX = EnvContext()


def java_children() -> set[int]:
    """Live java processes whose parent is this test process (from /proc)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, ...
        if comm == "java" and int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(d.name))
    return out


def stop_and_wait(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped (delivery is asynchronous).

    Garbage is collected first: py4j's finalizer of a collected Java object calls into its JVM, outside
    any deadline, and would block on the stopped one (seen: inside jvm_deadline, before it armed its timer)."""
    import gc
    import time

    gc.collect()
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30  # usually milliseconds; a loaded machine may schedule each thread late
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(st == "T" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"java {pid} did not stop")


@contextmanager
def hang_guard(pid: int) -> Iterator[None]:
    """SIGKILL java `pid` if the block still runs after 60 s: a call into a stopped JVM that no deadline
    of the product's ends then fails (with py4j's error) instead of hanging the test."""
    guard = threading.Timer(60.0, os.kill, (pid, signal.SIGKILL))
    guard.start()
    try:
        yield
    finally:
        guard.cancel()


@pytest.fixture(scope="module")
def train() -> list[Task]:
    return make_tasks(CFG, CTX, "train")


@pytest.fixture(scope="module")
def evals() -> list[Task]:
    return make_tasks(CFG, CTX, "eval")


@pytest.fixture(scope="module")
def coin(train):
    task = train[0]
    env = open_env(task, CFG, CTX)
    yield task, env
    env.close()


def test_registered_adapter_and_prompt():
    mod = get_adapter("twx")
    assert (mod.NAME, mod.ACTION_TAGS, mod.METRIC) == ("twx", ("action",), "success")
    assert set(mod.PROMPT.system) == {"action", "think"} and all("{pick}" in s for s in mod.PROMPT.system.values())
    obs, admissible, replies = mod.PROMPT.example
    assert replies["action"] == "<action>open trunk</action>" and "open trunk" in admissible
    assert replies["think"].startswith("<think>") and replies["think"].endswith("<action>open trunk</action>")


def test_pools_are_deterministic_and_disjoint(train, evals):
    assert [t.category for t in train] == ALL_GAMES and [t.skill_key for t in train] == ALL_GAMES
    assert [t.spec["fold"] for t in train] == ["train"] * 8 and [t.spec["fold"] for t in evals] == ["dev"] * 3
    assert [t.category for t in evals] == ALL_GAMES[:3]
    assert train[0].spec == {"game": "coin", "fold": "train", "seed": 7, "params": "numLocations=2,includeDoors=0"}
    assert evals[0].spec["seed"] == 10000  # the first dev seed, whatever cfg.seed is
    assert not {t.task_id for t in train} & {t.task_id for t in evals}
    assert not {t.spec["seed"] for t in train} & {t.spec["seed"] for t in evals}
    again = make_tasks(CFG.model_copy(update={"game_pool": 3}), CTX, "train")  # a smaller pool is a prefix
    assert [(t.task_id, t.spec, t.objective) for t in again] == [(t.task_id, t.spec, t.objective) for t in train[:3]]
    # cookingworld's gold path is not sampled at random by TWX: identical across builds.
    assert again[1].gold_path == train[1].gold_path and again[1].gold_path[:2] == ["take cookbook", "read cookbook"]
    assert train[0].objective.startswith("Your task is to search the environment and find the coin")
    assert all(t.gold_path and t.gold_path[0] != "look around" for t in train + evals)


def test_cache_dir_pins_the_sampled_gold_paths(tmp_path):
    cfg = CFG.model_copy(update={"game_pool": 2, "twx": CFG.twx.model_copy(update={"games": ["twc"]})})
    first = make_tasks(cfg, EnvContext(cache_dir=tmp_path), "train")
    assert len(list((tmp_path / "tasks").glob("twx-*.json"))) == 1
    assert make_tasks(cfg, EnvContext(cache_dir=tmp_path), "train") == first


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_game_gold_path_wins(train, evals, split):
    for task in train if split == "train" else evals:
        with open_env(task, CFG, CTX) as env:
            step = env.reset()
            assert step.observation.startswith(task.objective) and not step.done
            assert step.policy_commands == task.gold_path
            for k, action in enumerate(task.gold_path):
                assert not step.done, (task.task_id, k)
                assert action in step.admissible_commands
                step = env.step(action)
                assert not step.invalid_action
            assert (step.won, step.done, step.reward, step.score, step.lost) == (True, True, 1.0, 1.0, False), task.task_id


def test_real_gold_path_with_leading_look_around_wins(coin):
    task, env = coin
    raw = TextWorldExpressEnv(envStepLimit=1000)
    try:
        raw.reset(seed=task.spec["seed"], gameFold="train", gameName="coin", gameParams=task.spec["params"],
                  generateGoldPath=True)
        real = list(raw.getGoldActionSequence())
    finally:
        stop_jvm(raw)
    assert real == ["look around", "move north", "take coin"] and real[1:] == task.gold_path
    env.reset()
    steps = [env.step(a) for a in real]
    assert steps[-1].won and steps[-1].reward == 1.0 and not any(s.done for s in steps[:-1])


def test_wrong_and_invalid_actions(coin):
    task, env = coin
    step = env.reset()
    assert step.admissible_commands == ["inventory", "look around", "move north"]
    bad = env.step("fly to the moon")
    assert bad.invalid_action and "not sure what you mean" in bad.observation
    assert (bad.won, bad.done, bad.reward) == (False, False, 0.0)
    assert bad.policy_commands == task.gold_path  # a rejected action changes nothing
    looked = env.step("look around")
    assert not looked.invalid_action and looked.policy_commands == task.gold_path
    for action in ["take the coin", "", "\x00\n\t", "é∂ƒ 漢字 🙂", "x" * 10_000, "<action>take coin</action>"]:
        step = env.step(action)
        assert step.invalid_action and not step.done and step.reward == 0.0
    # Case, spacing, newlines and a final period do not matter: the admissible command is sent.
    moved = env.step("  Move\nNORTH. ")
    assert not moved.invalid_action and "pantry" in moved.observation


def test_bad_sequence_gives_no_reward_and_goes_on(coin):
    task, env = coin
    env.reset()
    for action in ["move north", "move south", "inventory", "look around", "move north", "move south"]:
        step = env.step(action)
        assert not step.invalid_action and (step.reward, step.done, step.won) == (0.0, False, False)
    assert step.policy_commands == []  # left the gold path
    assert step.score == 0.0


def test_step_after_done_raises_and_reset_restarts(coin):
    task, env = coin
    env.reset()
    for action in task.gold_path:
        step = env.step(action)
    assert step.done and step.won
    with pytest.raises(RuntimeError, match="finished"):
        env.step("look around")
    again = env.reset()
    assert not again.done and again.policy_commands == task.gold_path


def test_observation_is_capped(coin):
    task, env = coin
    full = env.reset().observation
    env.max_observation_chars = 50
    try:
        step = env.reset()
        assert len(full) > 200 and len(step.observation) == 50 and step.observation.endswith("...")
        assert step.observation[:40] == full[:40]
        assert len(env.step("look around").observation) <= 50
    finally:
        env.max_observation_chars = CFG.max_observation_chars


def test_game_params_are_filtered_per_game():
    cfg = EnvSection(name="twx", twx={"game_params": "numLocations=1, includeDoors=0,numIngredients=2"})
    assert game_params(cfg, "cookingworld") == "numLocations=1,includeDoors=0,numIngredients=2"
    assert game_params(cfg, "coin") == "numLocations=1,includeDoors=0"
    assert game_params(cfg, "sorting") == ""
    assert game_params(CFG, "sorting") == "" and game_params(CFG, "mapreader") == PARAMS["mapreader"]


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="split"):
        make_tasks(CFG, CTX, "test")
    bad_map = EnvSection(name="twx", game_pool=1, twx={"games": ["mapreader"], "game_params": "numLocations=1"})
    with pytest.raises(ValueError, match="maxDistanceApart"):
        make_tasks(bad_map, CTX, "train")
    with pytest.raises(ValueError, match="lacks"):
        open_env(Task(task_id="t", category="coin", spec={"game": "coin"}), CFG, CTX)
    with pytest.raises(ValueError, match="unknown game"):
        open_env(Task(task_id="t", category="x", spec={"game": "zork", "fold": "train", "seed": 1, "params": ""}), CFG, CTX)


def test_no_java_raises_runtime_error_naming_java(train, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="Java"):
        open_env(train[0], CFG, CTX)


def test_close_stops_the_jvm(train):
    # Compared by pid, not as a whole set: another test's env may be collected (ClosingEnv.__del__
    # closes it) at any point, so JVMs this test did not start may exit meanwhile; none may start.
    before = java_children()
    env = open_env(train[0], CFG, CTX)
    started = java_children() - before
    assert len(started) == 1
    env.reset()
    env.close()
    assert not java_children() & started  # this env's JVM is gone and reaped (zombies are not listed)
    env.close()  # twice is fine
    with pytest.raises(RuntimeError):
        env.step("look around")
    with pytest.raises(RuntimeError):
        env.reset()


def test_stopped_jvm_times_out_kills_java_and_raises(train):
    """A hung JVM (SIGSTOP) must not block step forever: past step_timeout_s the JVM is killed and reaped,
    step raises a RuntimeError naming the timeout, and the env is closed."""
    cfg = CFG.model_copy(update={"twx": CFG.twx.model_copy(update={"step_timeout_s": 30.0})})
    before = java_children()
    env = open_env(train[0], cfg, CTX)
    (pid,) = java_children() - before
    env.reset()
    assert env.step_timeout_s == 30.0
    env.step_timeout_s = 1.0  # after the first load (a cold JVM can take over 1 s on a busy machine)
    stop_and_wait(pid)
    try:
        # The message names the deadline that fired: the 1 s one set above, not the config's 30 s; without
        # any, the hang guard's kill ends the call with another error.
        with hang_guard(pid), pytest.raises(RuntimeError, match="step_timeout_s=1 s"):
            env.step("look around")
        assert pid not in java_children()  # killed and reaped (other tests' JVMs may come and go meanwhile)
    finally:
        if pid in java_children():  # only on failure: never leave a stopped JVM behind
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        env.close()
    with pytest.raises(RuntimeError):
        env.step("look around")
