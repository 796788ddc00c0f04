"""The one interface every environment adapter implements.

An adapter is a module `opsd/envs/<name>.py` (registered in `opsd/envs/__init__.py`)
that exposes:

    NAME: str                         the EnvSection.name that selects it
    ACTION_TAGS: tuple[str, ...]      the reply tags that hold an action: ("action",);
                                      Search: ("search", "answer"); single-turn: ("answer",)
    METRIC: str                       what `opsd eval` reports: "success", "em", "score" or "f1"
    PROMPT: EnvPrompt                 the student's system prompt and one-shot example
    make_tasks(cfg: EnvSection, ctx: EnvContext, split: "train" | "eval") -> list[Task]
    open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> Env

`make_tasks` is deterministic for a config (same tasks, same ids, on any
machine); `open_env` may run on another machine than `make_tasks`, from the
`Task` alone (it travels in `TaskGroup.game` as `Task.to_dict()`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class EnvStep:
    """What the environment says after reset() or step().

    observation: text for the student (cleaned, at most
    `EnvSection.max_observation_chars` characters). admissible_commands: the
    actions the environment accepts now ([] when it has no such list).
    won: the task is solved (success; Search: exact match; WebShop: score 1).
    done: the episode is over (won, lost, a final answer, a purchase).
    score: the environment's own score (points; WebShop: the purchase score in [0, 1]).
    policy_commands: the remaining gold path from this state (privileged; [] if unknown).
    reward: the RL reward of this step, in [0, 1]; None = 1.0 if won else 0.0.
    Rewards are terminal: the episode's reward is the last step's.
    invalid_action: the environment did not accept the action (not admissible,
    not parsable by it); the turn still counts, and the episode goes on.
    info: anything else worth logging (JSON-able).
    """

    observation: str
    admissible_commands: list[str]
    won: bool
    lost: bool
    done: bool
    score: float
    policy_commands: list[str] = field(default_factory=list)
    reward: float | None = None
    invalid_action: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reward is None:
            self.reward = 1.0 if self.won else 0.0


@dataclass
class Task:
    """One task of an environment, JSON-able (it travels in `TaskGroup.game`).

    task_id: unique within the env and stable across machines.
    category: the reporting bucket (ALFWorld task type, TWX game, ScienceWorld
    task, Search data source, WebShop product category, reasoning-gym dataset).
    skill_key: which per-task-type skill file the SkillBank adds
    (`opsd/skills/<env>/<skill_key>.txt`; "" = general skills only).
    gold_path: the walkthrough / gold action sequence, privileged ([] if none).
    objective: the task statement as the environment gives it ("" if only in the first observation).
    spec: what `open_env` needs to rebuild the task (seed, game name, question, goal index...).
    """

    task_id: str
    category: str
    spec: dict[str, Any]
    skill_key: str = ""
    gold_path: list[str] = field(default_factory=list)
    objective: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        """Inverse of `to_dict`; raises KeyError/TypeError/ValueError on a malformed dict."""
        if not isinstance(d, dict):
            raise TypeError(f"task must be a dict, got {type(d).__name__}")
        spec = d["spec"]
        if not isinstance(spec, dict):
            raise TypeError("task spec must be a dict")
        return cls(
            task_id=str(d["task_id"]),
            category=str(d["category"]),
            spec=dict(spec),
            skill_key=str(d.get("skill_key", "")),
            gold_path=[str(a) for a in d.get("gold_path", [])],
            objective=str(d.get("objective", "")),
        )


class Retriever(Protocol):
    """Top-k passages for a query (Search-QA). The embedder's /retrieve over HTTP, or in-process."""

    def search(self, query: str, k: int) -> list[str]: ...


@dataclass
class EnvContext:
    """Machine-local things an adapter may need beside its config.

    cache_dir: this machine's cache (generated games live under it); None = no cache.
    retriever: the Search-QA retriever; None for every other env.
    """

    cache_dir: Path | None = None
    retriever: Retriever | None = None


@dataclass
class EnvPrompt:
    """The student's prompt pieces for one env.

    system: the system message per prompt format ("action", "think"); it may
    hold "{pick}", replaced by how the action is chosen (admissible list shown or not).
    example: a made-up (observation, admissible commands, reply per format)
    exchange shown as a one-shot turn, or None.
    invalid_feedback: what the student is told after an invalid reply; None =
    `EnvSection.invalid_feedback`.
    """

    system: dict[str, str]
    example: tuple[str, list[str], dict[str, str]] | None = None
    invalid_feedback: str | None = None


class Env(Protocol):
    """One episode at a time. reset() starts (or restarts) it; step() after the end raises RuntimeError."""

    def reset(self) -> EnvStep: ...

    def step(self, action: str) -> EnvStep: ...

    def close(self) -> None: ...


class ClosingEnv:
    """Mixin for an Env whose close() is idempotent: a context manager that closes, and a
    last-resort close when the object is collected (callers should close() explicitly)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def cap(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, a cut one ending in "..." (overlong observations, case 15)."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 3)].rstrip() + "..."
