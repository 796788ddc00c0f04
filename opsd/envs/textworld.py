"""TextWorld adapter (opsd/envs/base.py interface): deterministic local game generation and a reset/step env.

Games are generated with TextWorld's Python API from integer seeds and
compiled once into a shared cache:

    <cache_dir>/textworld/<options hash>/game_<seed>.z8   (+ game_<seed>.json)

The `.json` file sits next to the `.z8` because TextWorld reads it to compute
admissible commands, won/lost and the walkthrough. Several processes may
generate the same pool at once: each game is built under an exclusive file
lock in a private temporary folder and published by atomic renames (json
first, z8 last), so the presence of the `.z8` means the game is complete.

Reward is terminal and binary: 1.0 when the game is won, else 0.0.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import textworld
from textworld import EnvInfos, GameOptions
from textworld.generator import compile_game, make_game

from opsd.config import EnvSection
from opsd.envs.base import ClosingEnv, EnvContext, EnvPrompt, EnvStep, Task, cap
from opsd.skills import walkthrough_text

F = TypeVar("F", bound=Callable[..., Any])
# The textworld package keeps module-global state (one tatsu parser for its logic language, used as a game
# loads and as it steps): episodes played in threads (rollout.max_groups_in_flight > 1) call into it one at
# a time. A TextWorld step takes milliseconds and holds the GIL for most of them anyway.
TEXTWORLD_LOCK = threading.RLock()


def one_at_a_time(fn: F) -> F:
    """`fn` run under TEXTWORLD_LOCK (TextWorld's and ALFWorld's env calls)."""

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with TEXTWORLD_LOCK:
            return fn(*args, **kwargs)

    return locked  # type: ignore[return-value]

# Bump when the generation recipe below changes: the options hash (and so the
# cache folder) changes with it, and stale games are never reused.
GENERATOR_VERSION = 1

# Jericho truncates commands past ~198 bytes (with a warning); real commands are far shorter.
_MAX_ACTION_BYTES = 190


@dataclass
class GameSpec:
    """A generated game, JSON-able (it travels in `TaskGroup.game`).

    `path` is the compiled `.z8` file on the machine that generated it; a
    process that lacks it regenerates the same game from `seed` and `options`
    (see `load_game`). `walkthrough` is the winning command sequence
    (privileged information: the student never sees it).
    """

    task_id: str
    seed: int
    path: str
    walkthrough: list[str]
    objective: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # world_size, nb_objects, quest_length, generator

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def privileged_info(self) -> str:
        """The teacher's privileged text for this game: its walkthrough (see `walkthrough_text`)."""
        return walkthrough_text(self.walkthrough)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GameSpec":
        """Inverse of `to_dict`; raises TypeError/KeyError on a malformed dict."""
        return cls(
            task_id=str(d["task_id"]),
            seed=int(d["seed"]),
            path=str(d["path"]),
            walkthrough=[str(c) for c in d["walkthrough"]],
            objective=str(d.get("objective", "")),
            options=dict(d.get("options", {})),
        )


# ---------------------------------------------------------------------------
# Generation and cache


def _options_dict(cfg: EnvSection) -> dict[str, Any]:
    return {
        "generator": GENERATOR_VERSION,
        "textworld": textworld.__version__,
        "world_size": cfg.world_size,
        "nb_objects": cfg.nb_objects,
        "quest_length": cfg.quest_length,
    }


def _options_hash(options: dict[str, Any]) -> str:
    blob = json.dumps(options, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def game_path(cache_dir: Path, options: dict[str, Any], seed: int) -> Path:
    """Where the compiled game for `seed` under `options` lives in the cache."""
    return Path(cache_dir) / "textworld" / _options_hash(options) / f"game_{seed}.z8"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # fcntl locks are released by the kernel if the holder dies, so a crashed
    # generator never blocks the others forever.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _read_game_json(json_path: Path) -> tuple[list[str], str]:
    data = json.loads(json_path.read_text())
    walkthrough = list((data.get("metadata") or {}).get("walkthrough") or [])
    objective = data.get("objective") or ""
    if not walkthrough:  # older files may not carry it in metadata: derive it from the quests
        game = textworld.Game.load(str(json_path))
        walkthrough = list(game.walkthrough or [])
        objective = objective or game.objective
    return walkthrough, objective


def _generate_one(options: dict[str, Any], seed: int, z8: Path) -> None:
    """Build one game into a private temp folder and publish it atomically."""
    opts = GameOptions()
    opts.seeds = seed  # one int seeds map, objects, quest and grammar RNGs deterministically
    opts.nb_rooms = int(options["world_size"])
    opts.nb_objects = int(options["nb_objects"])
    opts.quest_length = int(options["quest_length"])
    game = make_game(opts)
    # Touch the walkthrough before saving so it is stored in the json metadata.
    if not game.walkthrough:
        raise RuntimeError(f"TextWorld generated a game without a walkthrough (seed {seed}, {options})")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{seed}-", dir=z8.parent))
    try:
        opts.path = str(tmp / z8.name)
        built = Path(compile_game(game, opts))
        # json first, z8 last: readers treat the z8 as the completion marker.
        os.replace(built.with_suffix(".json"), z8.with_suffix(".json"))
        os.replace(built, z8)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_game(options: dict[str, Any], seed: int, z8: Path) -> GameSpec:
    z8.parent.mkdir(parents=True, exist_ok=True)
    if not (z8.is_file() and z8.with_suffix(".json").is_file()):
        with _file_lock(z8.with_suffix(".lock")):
            # Re-check under the lock: another process may have finished it meanwhile.
            if not (z8.is_file() and z8.with_suffix(".json").is_file()):
                _generate_one(options, seed, z8)
    walkthrough, objective = _read_game_json(z8.with_suffix(".json"))
    task_id = f"tw-{_options_hash(options)[:8]}-{seed}"
    return GameSpec(task_id=task_id, seed=seed, path=str(z8), walkthrough=walkthrough, objective=objective, options=dict(options))


def make_games(cfg: EnvSection, cache_dir: Path) -> list[GameSpec]:
    """Generate (or reuse from the cache) the game pool of `cfg`.

    Games use seeds `cfg.seed + i` for i in 0..cfg.game_pool-1, with
    `cfg.world_size` rooms, `cfg.nb_objects` objects and a quest of
    `cfg.quest_length` steps. Deterministic: the same config gives the same
    games (same walkthroughs and task ids) on any machine. Safe to call from
    several processes at once. Takes about 1.5-2.5 s per new game on one core,
    a few ms per cached one.

    Returns one `GameSpec` per seed, in seed order. Raises RuntimeError (or
    TextWorld's own errors) when a game cannot be generated or compiled.
    """
    options = _options_dict(cfg)
    return [_ensure_game(options, cfg.seed + i, game_path(cache_dir, options, cfg.seed + i)) for i in range(cfg.game_pool)]


def load_game(spec: GameSpec | dict[str, Any], cache_dir: Path | None = None) -> GameSpec:
    """Return a spec whose `path` exists on this machine, regenerating if needed.

    With `cache_dir`, the game is looked up (or generated) in this machine's
    cache; without it, at `spec.path` itself. Generation is deterministic, so
    the regenerated game is the one the spec describes.
    """
    spec = spec if isinstance(spec, GameSpec) else GameSpec.from_dict(spec)
    if not spec.options:
        if Path(spec.path).is_file():
            return spec
        raise FileNotFoundError(f"game file {spec.path} missing and the spec has no generation options")
    z8 = game_path(cache_dir, spec.options, spec.seed) if cache_dir is not None else Path(spec.path)
    return _ensure_game(spec.options, spec.seed, z8)


# ---------------------------------------------------------------------------
# Observation cleaning

# The prompt line TextWorld appends: ">" then padding then "-= Room =-score/max".
_STATUS_LINE = re.compile(r"^\s*>\s*(-=.*=-\s*[\d/]*)?\s*$")
_END_PROMPT = re.compile(r"would you like to restart, restore a saved game, quit or undo", re.IGNORECASE)
_HAS_WORD = re.compile(r"[^\W_]")  # a letter or digit: the banner art is only underscores, bars, slashes and dollars


def clean_observation(text: str, max_chars: int) -> str:
    """Strip TextWorld's banner, prompt/status lines and excess whitespace; cap length.

    The banner's ASCII art has no word characters, so any line without one is
    dropped (blank lines survive as paragraph breaks). The result is at most
    `max_chars` characters; a cut one ends with "...".
    """
    lines: list[str] = []
    for raw in text.replace("\r", "").split("\n"):
        line = " ".join(raw.split())  # collapse runs of spaces/tabs
        if _STATUS_LINE.match(raw) or _END_PROMPT.search(line):
            continue
        if line and not _HAS_WORD.search(line):
            continue
        if not line and (not lines or not lines[-1]):
            continue  # at most one blank line in a row, none at the start
        lines.append(line)
    return cap("\n".join(lines).strip(), max_chars)


# Interpreter meta-commands: "save"/"restore"/"script" read and write files in the process's working
# directory (and would let sibling episodes share state); "quit"/"restart" end the interpreter's game.
_META_COMMANDS = {"save", "restore", "script", "unscript", "transcript", "noscript", "quit", "q", "restart"}
_REFUSED = "That command is not available in this game."


def _sanitize_action(action: str) -> str:
    # A newline would make the interpreter run several commands in one step.
    flat = " ".join(action.split())
    # Control characters never reach the interpreter: a NUL crashes or hangs Jericho.
    flat = "".join(c for c in flat if c.isprintable())
    # Cut by UTF-8 bytes without splitting a multi-byte character.
    return flat.encode("utf-8")[:_MAX_ACTION_BYTES].decode("utf-8", errors="ignore")


# ---------------------------------------------------------------------------
# The environment


class TextWorldEnv(ClosingEnv):
    """One episode-at-a-time TextWorld game. Use as a context manager or call close().

    Several instances of the same game may run side by side in one process
    (sibling rollouts); each holds its own interpreter state.
    """

    _INFOS = EnvInfos(
        admissible_commands=True,
        policy_commands=True,
        won=True,
        lost=True,
        score=True,
        max_score=True,
        objective=True,
    )

    def __init__(self, spec: GameSpec | dict[str, Any], max_observation_chars: int = 2000) -> None:
        self.spec = spec if isinstance(spec, GameSpec) else GameSpec.from_dict(spec)
        self.max_observation_chars = max_observation_chars
        if not Path(self.spec.path).is_file():
            raise FileNotFoundError(f"TextWorld game not found: {self.spec.path} (use load_game to regenerate it)")
        with warnings.catch_warnings():
            # Jericho warns on every TextWorld game that it lacks its own score
            # detection; TextWorld supplies score/won/lost itself, so it is noise.
            warnings.simplefilter("ignore")
            self._env = textworld.start(self.spec.path, request_infos=self._INFOS)
        self._done = True  # until reset()
        self._admissible: list[str] = []
        self._policy: list[str] = []  # the remaining gold path at the current state (kept across refusals)
        self._score = 0.0

    def _to_step(self, state: Any, done: bool, invalid: bool = False) -> EnvStep:
        won = bool(state.get("won") or False)
        lost = bool(state.get("lost") or False)
        self._done = bool(done or won or lost)
        self._admissible = list(state.get("admissible_commands") or [])
        self._score = float(state.get("score") or 0)
        self._policy = list(state.get("policy_commands") or [])
        return EnvStep(
            observation=clean_observation(state.feedback or "", self.max_observation_chars),
            admissible_commands=list(state.get("admissible_commands") or []),
            won=won,
            lost=lost,
            done=self._done,
            score=float(state.get("score") or 0),
            policy_commands=list(self._policy),
            invalid_action=invalid,
        )

    @one_at_a_time
    def reset(self) -> EnvStep:
        """Start (or restart) the game; returns the opening observation (objective + room)."""
        state = self._env.reset()
        return self._to_step(state, False)

    @one_at_a_time
    def step(self, action: str) -> EnvStep:
        """Run one command (any text; unknown commands get the game's own complaint).

        Raises RuntimeError if called before reset() or after the game ended.
        """
        if self._done:
            raise RuntimeError("TextWorldEnv.step called on a finished (or not yet reset) game")
        command = _sanitize_action(action)
        # The game answers anything; "invalid" = not one of the commands it listed as admissible.
        invalid = command.strip().lower() not in {c.lower() for c in self._admissible}
        if not command.strip() or command.split()[0].lower() in _META_COMMANDS:
            return EnvStep(observation=_REFUSED, admissible_commands=list(self._admissible), won=False, lost=False,
                           done=False, score=self._score, policy_commands=list(self._policy), invalid_action=True)
        state, _score, done = self._env.step(command)
        return self._to_step(state, done, invalid)

    def walkthrough(self) -> str:
        """The game's full winning command sequence as text (privileged; same as
        `GameSpec.privileged_info()`). The remaining walkthrough from the current
        state is `EnvStep.policy_commands`."""
        return walkthrough_text(self.spec.walkthrough)

    @one_at_a_time
    def close(self) -> None:
        """Release the interpreter; safe to call twice."""
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()


# ---------------------------------------------------------------------------
# The adapter interface (opsd/envs/base.py)

NAME = "textworld"
ACTION_TAGS = ("action",)
METRIC = "success"
# Kept short on purpose: SmolLM2-135M has a small context and every prompt token
# costs CPU time on each turn. The measured best setup for that model is an
# action-only reply, the admissible commands listed, one made-up example
# exchange, and the assistant turn prefilled with `<action>`.
PROMPT = EnvPrompt(
    system={
        "action": (
            "You are playing a text adventure game. Reach the objective. "
            "Each turn, {pick} and reply with it inside <action></action>, for example <action>open box</action>."
        ),
        "think": (
            "You are playing a text adventure game. Reach the objective. "
            "Each turn, think briefly inside <think></think>, then {pick} and reply with it "
            "inside <action></action>."
        ),
    },
    # A made-up exchange (not from any generated game) that shows the reply format.
    example=(
        "Your objective is to open the box.\n\n-= Kitchen =-\nYou are in a kitchen. You see a closed box.",
        ["examine box", "go north", "look", "open box"],
        {
            "action": "<action>open box</action>",
            "think": "<think>The objective is to open the box, and the box is here.</think><action>open box</action>",
        },
    ),
)
# Eval games come from seeds far from any training pool's.
EVAL_SEED_OFFSET = 1_000_000


def _task(spec: GameSpec) -> Task:
    return Task(task_id=spec.task_id, category=f"{len(spec.walkthrough)}-step", spec=spec.to_dict(),
                gold_path=list(spec.walkthrough), objective=spec.objective)


def _cache(ctx: EnvContext) -> Path:
    # No cache configured (tests, one-off scripts): the system temp dir's opsd/ folder.
    return Path(ctx.cache_dir) if ctx.cache_dir is not None else Path(tempfile.gettempdir()) / "opsd"


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """The train pool (`make_games`: seeds cfg.seed ..) or the eval pool (cfg.eval_pool games from seed
    cfg.seed + EVAL_SEED_OFFSET) as Tasks; category = walkthrough length ("2-step"). ValueError on another split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    cache = _cache(ctx)
    if split == "train":
        return [_task(g) for g in make_games(cfg, cache)]
    eval_cfg = cfg.model_copy(update={"seed": cfg.seed + EVAL_SEED_OFFSET, "game_pool": cfg.eval_pool})
    return [_task(g) for g in make_games(eval_cfg, cache)]


@one_at_a_time
def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> TextWorldEnv:
    """A TextWorldEnv for `task`, its game looked up (or regenerated) in this machine's cache, never at
    the path the spec names (a path from the wire does not choose where files are written)."""
    spec = load_game(task.spec, _cache(ctx))
    return TextWorldEnv(spec, cfg.max_observation_chars)
