"""ScienceWorld adapter (scienceworld 1.2.3, a JVM per env instance).

Tasks are ScienceWorld tasks (find-living-thing, boil, ...) drawn round-robin
from `cfg.scienceworld.tasks`, each on one variation: training tasks on the
task's train variations, eval tasks on its dev variations, so the pools never
share a variation. Reward is terminal and binary: 1.0 when the task is
completed (score 100), else 0.0. `EnvStep.score` is ScienceWorld's score in
points (0..100; -100 after a failing action such as focusing on the wrong
object, which also ends the episode as lost).

Costs (measured on one core): the JVM starts in 1-5 s, loading a variation
takes 0.3-3 s, a step 0.1-0.2 s (ScienceWorld recomputes the valid actions).
Every call into the JVM runs under `cfg.scienceworld.step_timeout_s` (see
`opsd.envs.twx.jvm_deadline`): a JVM that hangs is killed and the call raises
JVMTimeout (a RuntimeError).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import scienceworld
from scienceworld import ScienceWorldEnv
from scienceworld.constants import ID2TASK

from opsd.config import EnvSection
from opsd.envs.base import ClosingEnv, EnvContext, EnvPrompt, EnvStep, Task, cap
from opsd.envs.twx import GoldTracker, JVMTimeout, cached_tasks, clean_action, jvm_deadline, start_jvm, stop_jvm

NAME = "scienceworld"
ACTION_TAGS = ("action",)
METRIC = "success"
TASKS_VERSION = 1  # bump when task building changes: cached pools are keyed by it

PROMPT = EnvPrompt(
    system={
        "action": (
            "You are an agent doing a science task in a simulated world of rooms, objects, substances, "
            "devices and living things. Move between rooms, use objects and devices, and focus on an object "
            "only when the task tells you to: focusing on a wrong one fails the task. "
            "Each turn, {pick} and reply with it inside <action></action>, for example <action>look around</action>."
        ),
        "think": (
            "You are an agent doing a science task in a simulated world of rooms, objects, substances, "
            "devices and living things. Move between rooms, use objects and devices, and focus on an object "
            "only when the task tells you to: focusing on a wrong one fails the task. "
            "Each turn, first reason step by step about the situation and the task inside <think></think>, "
            "then {pick} and reply with it inside <action></action>."
        ),
    },
    # Made up (ScienceWorld has no floating-key task); it only shows the reply format.
    example=(
        "Your task is to find out whether the copper key floats on water. First, focus on the copper key.\n\n"
        "This room is called the bathroom. In it, you see:\n\tthe agent\n\ta bathtub (containing water)\n"
        "\ta copper key\nYou also see:\n\tA door to the kitchen (that is open)",
        ["focus on copper key", "go to kitchen", "inventory", "look around", "pick up copper key"],
        {
            "action": "<action>focus on copper key</action>",
            "think": "<think>The task says to focus on the copper key first, and it is here in the "
            "bathroom.</think><action>focus on copper key</action>",
        },
    ),
)

_REJECTED = re.compile(r"^(no known action matches that input|unknown action)", re.IGNORECASE)
_AMBIGUOUS = re.compile(r"^ambiguous request", re.IGNORECASE)


def _new_env() -> ScienceWorldEnv:
    # A huge step limit: the rollout enforces max_turns, not the env.
    return start_jvm(lambda: ScienceWorldEnv("", envStepLimit=10**9), "ScienceWorld")


def _load(env: ScienceWorldEnv, spec: dict[str, Any], gold: bool) -> None:
    try:
        env.load(spec["task"], spec["variation"], spec["simplifications"], generateGoldPath=gold)
    except ValueError:
        raise  # the package's own clear message (unknown task or simplification)
    except Exception as e:
        java = getattr(e, "java_exception", None)
        why = str(java.toString()) if java is not None else str(e)
        raise ValueError(f"ScienceWorld could not load {spec['task']} variation {spec['variation']} "
                         f"({spec['simplifications']!r}): {why}") from e


def _winning_prefix(env: ScienceWorldEnv, gold: list[str], timeout_s: float, what: str) -> list[str]:
    # Gold paths often go on after the win (grow-plant: 27 of 62 steps). Replay them on the raw
    # server, which skips the valid-action listing that makes a package step slow, and cut at the win.
    with jvm_deadline(env, timeout_s, what):
        env.reset()
    for k, action in enumerate(gold):
        with jvm_deadline(env, timeout_s, what):
            if _AMBIGUOUS.search(str(env.server.step(action)).strip()):
                env.server.step("0")
            won = env.server.getCompleted() or env.server.getScore() >= 1.0
        if won:
            return gold[: k + 1]
    return gold


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """The train pool (cfg.game_pool tasks) or eval pool (cfg.eval_pool tasks) of ScienceWorld variations.

    Tasks come round-robin from cfg.scienceworld.tasks; the j-th task of a
    ScienceWorld task uses its train variation number (cfg.seed + j) mod (its
    train count), or its j-th dev variation (eval does not depend on cfg.seed).
    Each carries the gold path (ScienceWorld's own, less its answers "0" to
    ambiguity prompts, which the env gives itself, replayed and cut at the win)
    and the task description as objective; category and skill_key are the task
    name. Starts one JVM, loads and replays every variation (0.5-5 s each;
    long tasks such as mendelian-genetics more); with ctx.cache_dir the pool is built
    once and reused (see `opsd.envs.twx.cached_tasks`).

    Raises ValueError for another split, an unknown task name or
    simplification, or a pool larger than a task's variations of the split;
    RuntimeError when Java cannot start.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    names = list(dict.fromkeys(cfg.scienceworld.tasks))
    unknown = [t for t in names if t not in ID2TASK.values()]
    if unknown:
        raise ValueError(f"unknown ScienceWorld task(s) {unknown}; known: {', '.join(ID2TASK.values())}")
    n = cfg.game_pool if split == "train" else cfg.eval_pool
    key = {"env": NAME, "version": TASKS_VERSION, "package": scienceworld.__version__, "split": split, "n": n,
           "seed": cfg.seed if split == "train" else 0, "tasks": names, "simpl": cfg.scienceworld.simplifications}
    return cached_tasks(ctx, key, lambda: _build_tasks(cfg, split, names, n))


def _build_tasks(cfg: EnvSection, split: str, names: list[str], n: int) -> list[Task]:
    simpl, timeout = cfg.scienceworld.simplifications, cfg.scienceworld.step_timeout_s
    env = _new_env()
    try:
        variations: dict[str, list[int]] = {}
        for k, name in enumerate(names):
            with jvm_deadline(env, timeout, f"ScienceWorld ({name})"):
                _load(env, {"task": name, "variation": 0, "simplifications": simpl}, gold=False)
                variations[name] = list(env.get_variations_train() if split == "train" else env.get_variations_dev())
            need = len(range(k, n, len(names)))
            if need > len(variations[name]):
                raise ValueError(f"ScienceWorld task {name} has {len(variations[name])} {split} variations; "
                                 f"the pool needs {need}")
        tasks = []
        for i in range(n):
            name, j = names[i % len(names)], i // len(names)
            vs = variations[name]
            var = int(vs[(cfg.seed + j) % len(vs)] if split == "train" else vs[j])
            spec = {"task": name, "variation": var, "simplifications": simpl}
            what = f"ScienceWorld ({name} variation {var})"
            with jvm_deadline(env, timeout, what):
                _load(env, spec, gold=True)
                # A bare number answers ScienceWorld's "Ambiguous request" prompt; ScienceWorldTaskEnv.step
                # answers it itself with 0 (the only choice gold paths make), so the gold path drops them.
                gold = [str(a) for a in env.get_gold_action_sequence() if not str(a).strip().isdigit()]
                objective = str(env.get_task_description()).strip()
            gold = _winning_prefix(env, gold, timeout, what)
            tasks.append(Task(task_id=f"sw-{name}-v{var}-{simpl.replace(',', '+') or 'none'}", category=name,
                              spec=spec, skill_key=name, gold_path=gold, objective=objective))
        return tasks
    finally:
        stop_jvm(env)


def _clean_observation(text: str) -> str:
    lines = [line.rstrip() for line in str(text).replace("\r", "").split("\n")]
    return "\n".join(lines).strip()


class ScienceWorldTaskEnv(ClosingEnv):
    """One ScienceWorld variation, an episode at a time, on its own JVM. close() (or `with`) stops the JVM.

    Each reset/step must finish within `step_timeout_s` seconds, else the JVM is
    killed, the env closed, and the call raises JVMTimeout (a RuntimeError).
    """

    def __init__(self, task: Task, max_observation_chars: int = 2000, step_timeout_s: float = 60.0) -> None:
        spec = task.spec
        missing = {"task", "variation", "simplifications"} - set(spec)
        if missing:
            raise ValueError(f"ScienceWorld task {task.task_id!r} spec lacks {sorted(missing)}")
        if spec["task"] not in ID2TASK.values():
            raise ValueError(f"ScienceWorld task {task.task_id!r}: unknown task {spec['task']!r}")
        self.task, self.max_observation_chars, self.step_timeout_s = task, max_observation_chars, step_timeout_s
        self._spec = {"task": spec["task"], "variation": int(spec["variation"]), "simplifications": str(spec["simplifications"])}
        self._env: ScienceWorldEnv | None = _new_env()
        self._done = True
        self._gold = GoldTracker(task.gold_path)

    def _call(self, fn: Callable[[ScienceWorldEnv], Any]) -> Any:
        # fn(env) under the deadline; on a timeout the (killed) JVM is released before raising.
        try:
            with jvm_deadline(self._env, self.step_timeout_s, f"ScienceWorld ({self.task.task_id})"):
                return fn(self._env)
        except JVMTimeout:
            self.close()
            raise

    def _to_step(self, obs: str, info: dict[str, Any], completed: bool, invalid: bool, extra: dict[str, Any]) -> EnvStep:
        score = float(info.get("score") or 0)
        won = score >= 100 or completed
        lost = score < 0 and not won
        self._done = won or lost
        return EnvStep(
            observation=cap(_clean_observation(obs), self.max_observation_chars),
            admissible_commands=sorted(set(str(a) for a in info.get("valid") or [])),
            won=won, lost=lost, done=self._done, score=score,
            policy_commands=self._gold.remaining(), invalid_action=invalid,
            info={"task": self._spec["task"], "variation": self._spec["variation"], "moves": int(info.get("moves") or 0), **extra},
        )

    def reset(self) -> EnvStep:
        """Load the variation afresh (0.3-3 s): the task description, a blank line, then the room.

        Raises RuntimeError after close(); JVMTimeout (a RuntimeError) past step_timeout_s."""
        if self._env is None:
            raise RuntimeError("ScienceWorldTaskEnv.reset called after close()")

        def run(env: ScienceWorldEnv) -> tuple[str, dict[str, Any], bool]:
            _load(env, self._spec, gold=False)
            obs, info = env.reset()
            return f"{env.get_task_description().strip()}\n\n{obs}", info, bool(env.server.getCompleted())

        obs, info, completed = self._call(run)
        self._gold = GoldTracker(self.task.gold_path)
        return self._to_step(obs, info, completed, False, {})

    def step(self, action: str) -> EnvStep:
        """Run one command (any text; ScienceWorld parses it). An ambiguous command is resolved to
        ScienceWorld's first reading (info["ambiguous"] = True); a command it cannot parse sets
        invalid_action (it answers "No known action matches that input.").

        Raises RuntimeError before reset(), after the episode ended, or after close();
        JVMTimeout (a RuntimeError) when ScienceWorld does not answer within step_timeout_s.
        """
        if self._env is None or self._done:
            raise RuntimeError("ScienceWorldTaskEnv.step called on a finished (or not yet reset, or closed) episode")
        command = clean_action(action)
        extra = {}

        def run(env: ScienceWorldEnv) -> tuple[str, dict[str, Any], bool]:
            obs, _reward, _done, info = env.step(command)
            if _AMBIGUOUS.search(obs.strip()):
                # ScienceWorld waits for a number next; answering it here keeps one action per turn.
                obs, _reward, _done, info = env.step("0")
                extra["ambiguous"] = True
            return obs, info, bool(env.server.getCompleted())

        obs, info, completed = self._call(run)
        invalid = bool(_REJECTED.search(obs.strip()))
        self._gold.advance(command, invalid)
        return self._to_step(obs, info, completed, invalid, extra)

    def close(self) -> None:
        """Stop the JVM; safe to call twice."""
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            stop_jvm(env)
            tmp = getattr(env, "_obj_tree_tempdir", None)
            if tmp is not None:
                tmp.cleanup()


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> ScienceWorldTaskEnv:
    """A ScienceWorldTaskEnv for `task` (starts a JVM; ValueError for a malformed spec, RuntimeError without Java)."""
    return ScienceWorldTaskEnv(task, cfg.max_observation_chars, cfg.scienceworld.step_timeout_s)
