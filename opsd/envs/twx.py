"""TextWorld-Express adapter (textworld-express 1.1.0, a JVM per env instance).

Tasks are TWX games (coin, cookingworld, twc, ...) drawn round-robin from
`cfg.twx.games`. Training tasks use the "train" game fold and train seeds
(0..999), eval tasks the "dev" fold and dev seeds (10000..), so the two pools
never share a game. Reward is terminal and binary: 1.0 when TWX reports task
success, else 0.0; `EnvStep.score` is TWX's normalized score in [0, 1].

Every `TWXEnv` starts its own JVM (about 0.6 s; steps take 0.5-2.4 ms) and
`close()` stops it; `make_tasks` starts one for the time it runs. Every call
into a JVM runs under `cfg.twx.step_timeout_s` (see `jvm_deadline`): a JVM that
hangs is killed and the call raises `JVMTimeout`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import textworld_express
from textworld_express import TextWorldExpressEnv

from opsd.config import EnvSection
from opsd.envs.base import ClosingEnv, EnvContext, EnvPrompt, EnvStep, Task, cap

NAME = "twx"
ACTION_TAGS = ("action",)
METRIC = "success"

PROMPT = EnvPrompt(
    system={
        "action": (
            "You are an agent playing a text-based game. Read the task and what you observe, and complete "
            "the task in as few steps as you can. Each turn, {pick} and reply with it inside "
            "<action></action>, for example <action>look around</action>."
        ),
        "think": (
            "You are an agent playing a text-based game. Read the task and what you observe, and complete "
            "the task in as few steps as you can. Each turn, first reason step by step about the situation "
            "inside <think></think>, then {pick} and reply with it inside <action></action>."
        ),
    },
    # Made up (no TWX game has a key in an attic trunk); it only shows the reply format.
    example=(
        "Your task is to find the key and take it.\n\n"
        "You are in the attic. In one part of the room you see a trunk that is closed.\nTo the South you see the hallway.",
        ["inventory", "look around", "move south", "open trunk"],
        {
            "action": "<action>open trunk</action>",
            "think": "<think>No key is in sight. The closed trunk could hold it, so I open it before leaving "
            "the room.</think><action>open trunk</action>",
        },
    ),
)

# The parameters each game accepts (from TWX's generation properties); a shared
# `game_params` string is filtered to these so one string serves several games.
GAME_PARAMS = {
    "coin": {"numLocations", "numDistractorItems", "includeDoors", "limitInventorySize"},
    "cookingworld": {"numLocations", "numIngredients", "numDistractorItems", "includeDoors", "limitInventorySize"},
    "twc": {"numLocations", "numItemsToPutAway", "includeDoors", "limitInventorySize"},
    "mapreader": {"numLocations", "maxDistanceApart", "maxDistractorItemsPerLocation", "includeDoors", "limitInventorySize"},
    "simonsays": {"gameLength", "numDistractors", "memorization", "verbose"},
    "arithmetic": set(),
    "sorting": set(),
    "peckingorder": set(),
}
FOLDS = {"train": "train", "eval": "dev"}
TASKS_VERSION = 1  # bump when task building changes: cached pools are keyed by it
_MAX_ACTION_CHARS = 300
# Actions that change nothing in the world: following them keeps the remaining gold path valid.
_FREE_ACTIONS = {"look around", "inventory"}
_REJECTED = re.compile(r"^unknown action|i'm not sure what you mean", re.IGNORECASE)


# ---------------------------------------------------------------------------
# Helpers shared with the ScienceWorld adapter (both drive a py4j JVM)


def start_jvm(factory: Callable[[], Any], what: str) -> Any:
    """`factory()` (a py4j-backed env constructor), with a RuntimeError naming Java when it cannot start.

    Raises RuntimeError when no `java` is on PATH or the JVM fails to launch.
    """
    if shutil.which("java") is None:
        raise RuntimeError(f"{what} needs Java: no `java` executable on PATH (install a JRE 11+)")
    try:
        return factory()
    except Exception as e:  # py4j raises assorted errors when the JVM dies at launch
        raise RuntimeError(f"{what} could not start its Java VM (java at {shutil.which('java')}): {e}") from e


class JVMTimeout(RuntimeError):
    """A call into a JVM did not return within its deadline; the JVM was killed."""


@contextmanager
def jvm_deadline(env: Any, timeout_s: float, what: str) -> Iterator[None]:
    """Run the block under a deadline of `timeout_s` seconds for the JVM behind `env` (py4j-backed).

    py4j calls have no timeout, so a hung or stopped JVM would block forever. A
    watchdog timer SIGKILLs the java process when the block has not finished in
    time; the blocked py4j call then fails on its closed socket. Raises
    JVMTimeout (a RuntimeError naming `what` and the timeout) when the watchdog
    fired, whether the block then failed or returned; the JVM is dead after that.
    """
    gateway = getattr(env, "_gateway", None)
    proc = getattr(gateway, "java_process", None)
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        if proc is not None:
            try:
                proc.kill()
            except OSError:
                pass

    timer = threading.Timer(timeout_s, kill)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as e:
        if fired.is_set():
            raise JVMTimeout(f"{what} did not answer within step_timeout_s={timeout_s:g} s; its Java VM was killed") from e
        raise
    finally:
        timer.cancel()
    if fired.is_set():
        raise JVMTimeout(f"{what} did not answer within step_timeout_s={timeout_s:g} s; its Java VM was killed")


def stop_jvm(env: Any) -> None:
    """Stop the JVM behind a py4j-backed env (TWX or ScienceWorld) and reap it; safe to call twice.

    The packages' own close() leaves the java process to exit on its own and
    their __del__ calls close() again (a BrokenPipeError on a closed pipe), so
    this shuts the gateway (killing java if that takes over 10 s), closes
    java's stdin (py4j's die-on-exit signal), waits up to 5 s and kills java
    if it is still alive.
    """
    env.close = lambda: None  # the package's __del__ must not close twice
    gateway = getattr(env, "_gateway", None)
    if gateway is None:
        return
    proc = getattr(gateway, "java_process", None)
    try:
        with jvm_deadline(env, 10.0, "py4j shutdown"):  # a hung JVM must not hang close() too
            gateway.shutdown()
    except Exception:
        pass
    env._gateway = None
    if proc is None:
        return
    try:
        proc.stdin.write(b"\n")
        proc.stdin.close()
    except Exception:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def clean_action(action: str) -> str:
    """Model text as one command: whitespace runs (newlines too) become one space, a trailing
    period goes, and it is cut to 300 characters. Never raises on str input."""
    return " ".join(str(action).split()).rstrip(".")[:_MAX_ACTION_CHARS].strip()


class GoldTracker:
    """The remaining gold path while the actions taken so far follow it.

    A rejected or free action (look around, inventory) keeps the agent on the
    path; any other deviation makes the remainder unknown ([]).
    """

    def __init__(self, gold: list[str]) -> None:
        self.gold, self.i, self.on = list(gold), 0, True

    def advance(self, action: str, rejected: bool) -> None:
        """Record one action (as sent to the env)."""
        if not self.on or rejected:
            return
        if self.i < len(self.gold) and action.lower() == self.gold[self.i].lower():
            self.i += 1
        elif action.lower() not in _FREE_ACTIONS:
            self.on = False

    def remaining(self) -> list[str]:
        """The gold actions still to take ([] once off the path)."""
        return self.gold[self.i :] if self.on else []


def cached_tasks(ctx: EnvContext, key: dict[str, Any], build: Callable[[], list[Task]]) -> list[Task]:
    """`build()`'s tasks, stored once under ctx.cache_dir/tasks/ and read back from there after.

    TWX and ScienceWorld sample some gold paths at random (several coins or
    living things to pick from, exploration order), so two builds can differ
    in gold_path; the first build stored for a `key` (JSON-able: everything the
    pool depends on) is the one every later call and process gets. Without a
    cache_dir every call builds afresh (same ids and order, gold paths may differ).
    """
    if ctx.cache_dir is None:
        return build()
    blob = json.dumps(key, sort_keys=True).encode()
    path = Path(ctx.cache_dir) / "tasks" / f"{key['env']}-{hashlib.sha256(blob).hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([t.to_dict() for t in build()]))
        try:
            os.link(tmp, path)  # first writer wins: no process ever sees another's different pool
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        return [Task.from_dict(d) for d in json.loads(path.read_text())]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt task cache {path} ({e}); delete it to rebuild") from e


# ---------------------------------------------------------------------------
# Tasks


def game_params(cfg: EnvSection, game: str) -> str:
    """The TWX parameter string for `game`: its entry when cfg.twx.game_params is a dict ("" if
    absent), else the shared string with the keys `game` does not know dropped."""
    params = cfg.twx.game_params
    if isinstance(params, dict):
        return params.get(game, "")
    pairs = [p.strip() for p in params.split(",") if p.strip()]
    return ",".join(p for p in pairs if p.split("=", 1)[0].strip() in GAME_PARAMS[game])


def _new_env() -> TextWorldExpressEnv:
    # A huge step limit: the rollout enforces max_turns, not the env.
    return start_jvm(lambda: TextWorldExpressEnv(envStepLimit=10**9), "TextWorld-Express")


def _generate(env: TextWorldExpressEnv, spec: dict[str, Any], gold: bool) -> tuple[str, dict[str, Any]]:
    try:
        return env.reset(seed=spec["seed"], gameFold=spec["fold"], gameName=spec["game"],
                         gameParams=spec["params"], generateGoldPath=gold)
    except Exception as e:  # TWX answers bad parameters with a Java exception
        java = getattr(e, "java_exception", None)
        why = str(java.toString()) if java is not None else str(e)
        hint = " (mapreader needs maxDistanceApart < numLocations)" if spec["game"] == "mapreader" else ""
        raise ValueError(f"TWX could not generate {spec['game']} (fold {spec['fold']}, seed {spec['seed']}, "
                         f"params {spec['params']!r}): {why}{hint}") from e


def _winning_prefix(env: TextWorldExpressEnv, gold: list[str]) -> list[str]:
    # Some gold paths (twc) go on after the win; play them (ms a step) and cut at the win.
    for k, action in enumerate(gold):
        _obs, _r, _done, info = env.step(action)
        if info.get("tasksuccess"):
            return gold[: k + 1]
    return gold


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """The train pool (cfg.game_pool tasks) or eval pool (cfg.eval_pool tasks) of TWX games.

    Games come round-robin from cfg.twx.games; the j-th task of a game uses the
    train seed number (cfg.seed + j) mod 1000 in the "train" fold, or the j-th dev
    seed in the "dev" fold (eval does not depend on cfg.seed). Each task carries
    the gold path (replayed and cut at the win, without TWX's leading no-op
    "look around") and the task description as objective. Starts one JVM for the duration (~0.1-0.8 s per game);
    with ctx.cache_dir the pool is built once and reused (see `cached_tasks`).

    Raises ValueError for another split, a pool larger than the fold's 1000
    seeds per game, or parameters TWX rejects; RuntimeError when Java cannot start.
    """
    if split not in FOLDS:
        raise ValueError(f"split must be train or eval, got {split!r}")
    games, n = list(dict.fromkeys(cfg.twx.games)), cfg.game_pool if split == "train" else cfg.eval_pool
    key = {"env": NAME, "version": TASKS_VERSION, "package": textworld_express.__version__, "split": split, "n": n,
           "seed": cfg.seed if split == "train" else 0, "games": games, "params": [game_params(cfg, g) for g in games]}
    return cached_tasks(ctx, key, lambda: _build_tasks(cfg, split, games, n))


def _build_tasks(cfg: EnvSection, split: str, games: list[str], n: int) -> list[Task]:
    env, timeout = _new_env(), cfg.twx.step_timeout_s
    try:
        with jvm_deadline(env, timeout, "TextWorld-Express"):
            seeds = env.getValidSeedsTrain() if split == "train" else env.getValidSeedsDev()
        if -(-n // len(games)) > len(seeds):
            raise ValueError(f"TWX has {len(seeds)} {FOLDS[split]} seeds per game; a pool of {n} over {len(games)} games needs more")
        tasks = []
        for i in range(n):
            game, j = games[i % len(games)], i // len(games)
            seed = seeds[(cfg.seed + j) % len(seeds)] if split == "train" else seeds[j]
            spec = {"game": game, "fold": FOLDS[split], "seed": int(seed), "params": game_params(cfg, game)}
            with jvm_deadline(env, timeout, f"TextWorld-Express ({game} seed {seed})"):  # ms per game
                _obs, info = _generate(env, spec, gold=True)
                gold = _winning_prefix(env, [str(a) for a in env.getGoldActionSequence()])
            if gold[:1] == ["look around"]:  # a no-op TWX puts first
                gold = gold[1:]
            phash = hashlib.sha256(spec["params"].encode()).hexdigest()[:6]
            tasks.append(Task(task_id=f"twx-{game}-{spec['fold']}{seed}-{phash}", category=game, spec=spec,
                              skill_key=game, gold_path=gold, objective=" ".join(str(info["taskDescription"]).split())))
        return tasks
    finally:
        stop_jvm(env)


# ---------------------------------------------------------------------------
# The environment


def _clean_observation(text: str) -> str:
    lines = [" ".join(line.split()) for line in str(text).replace("\r", "").split("\n")]
    return "\n".join(lines).strip()


class TWXEnv(ClosingEnv):
    """One TWX game, an episode at a time, on its own JVM. close() (or `with`) stops the JVM.

    Each reset/step must finish within `step_timeout_s` seconds, else the JVM is
    killed, the env closed, and the call raises JVMTimeout (a RuntimeError).
    """

    def __init__(self, task: Task, max_observation_chars: int = 2000, step_timeout_s: float = 60.0) -> None:
        spec = task.spec
        missing = {"game", "fold", "seed", "params"} - set(spec)
        if missing:
            raise ValueError(f"TWX task {task.task_id!r} spec lacks {sorted(missing)}")
        if spec["game"] not in GAME_PARAMS or spec["fold"] not in ("train", "dev", "test"):
            raise ValueError(f"TWX task {task.task_id!r}: unknown game {spec['game']!r} or fold {spec['fold']!r}")
        self.task, self.max_observation_chars, self.step_timeout_s = task, max_observation_chars, step_timeout_s
        self._spec = {"game": spec["game"], "fold": spec["fold"], "seed": int(spec["seed"]), "params": str(spec["params"])}
        self._env: TextWorldExpressEnv | None = _new_env()
        self._done, self._admissible = True, []
        self._gold = GoldTracker(task.gold_path)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # fn(*args) under the deadline; on a timeout the (killed) JVM is released before raising.
        try:
            with jvm_deadline(self._env, self.step_timeout_s, f"TextWorld-Express ({self.task.task_id})"):
                return fn(*args, **kwargs)
        except JVMTimeout:
            self.close()
            raise

    def _to_step(self, obs: str, info: dict[str, Any], invalid: bool) -> EnvStep:
        won, lost = bool(info.get("tasksuccess")), bool(info.get("taskfailure"))
        self._done = won or lost
        self._admissible = sorted(str(a) for a in info.get("validActions") or [])
        return EnvStep(
            observation=cap(_clean_observation(obs), self.max_observation_chars),
            admissible_commands=list(self._admissible),
            won=won, lost=lost, done=self._done, score=float(info.get("score") or 0.0),
            policy_commands=self._gold.remaining(), invalid_action=invalid,
            info={"game": self._spec["game"], "seed": self._spec["seed"], "moves": int(info.get("numMoves") or 0)},
        )

    def reset(self) -> EnvStep:
        """Start (or restart) the game: the task description, a blank line, then the room.

        Raises RuntimeError after close(); JVMTimeout (a RuntimeError) past step_timeout_s."""
        if self._env is None:
            raise RuntimeError("TWXEnv.reset called after close()")
        obs, info = self._call(_generate, self._env, self._spec, gold=False)
        self._gold = GoldTracker(self.task.gold_path)
        return self._to_step(f"{info['taskDescription']}\n\n{obs}", info, False)

    def step(self, action: str) -> EnvStep:
        """Run one command. TWX only understands its admissible commands verbatim, so a command
        matching one up to case/spacing/a final period is sent as that one; anything else is
        sent as is and flagged invalid_action (TWX answers "Unknown action ...").

        Raises RuntimeError before reset(), after the episode ended, or after close();
        JVMTimeout (a RuntimeError) when TWX does not answer within step_timeout_s.
        """
        if self._env is None or self._done:
            raise RuntimeError("TWXEnv.step called on a finished (or not yet reset, or closed) game")
        command = clean_action(action)
        canonical = {a.lower(): a for a in self._admissible}
        command = canonical.get(command.lower(), command)
        obs, _reward, _done, info = self._call(self._env.step, command)
        invalid = command not in canonical.values() or bool(_REJECTED.search(obs))
        self._gold.advance(command, invalid)
        return self._to_step(obs, info, invalid)

    def close(self) -> None:
        """Stop the JVM; safe to call twice."""
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            tmp = getattr(env, "_obj_tree_tempfile", None)
            stop_jvm(env)
            if tmp is not None:
                tmp.close()


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> TWXEnv:
    """A TWXEnv for `task` (starts a JVM; ValueError for a malformed spec, RuntimeError without Java)."""
    return TWXEnv(task, cfg.max_observation_chars, cfg.twx.step_timeout_s)
