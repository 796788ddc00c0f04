"""reasoning-gym adapter: single-turn verifiable tasks (GC-OPD style).

Each task is one procedurally generated item {question, answer, metadata} of a
reasoning-gym dataset (`EnvSection.reasoning_gym.datasets`). The episode is a
single turn: reset() shows the question, step(answer_text) scores the answer
with the dataset's own verifier (`score_answer`) and ends the episode. The
reward is the verifier's score in [0, 1]; won = a score of exactly 1.

Items and seeds. reasoning-gym builds item `i` of a dataset with seed `s`
from `Random(s + i)`, so nearby seeds share items. Each dataset gets a base
seed (a hash of cfg.seed and the dataset name, below 2**30); the train split
uses it, the eval split uses base + 2**30: the two splits never share an RNG
stream. Identical questions can still come out of different streams (short
arithmetic), so questions are de-duplicated within a split, and the eval split
also drops any question of the train pool: train and eval are disjoint.
Items are taken from indices 0..size-1 (`reasoning_gym.size`), round-robin
across the datasets, until the pool (game_pool / eval_pool) is full.

Task.spec holds the dataset name, seed, size and index *and* the item itself
(question, answer, metadata) after a JSON round trip, so `open_env` on another
machine re-creates the dataset object only for its verifier and never
regenerates items. make_tasks refuses a dataset whose items do not survive the
JSON round trip (not JSON-able, or the reference answer no longer scores 1 on
the round-tripped entry: arc_agi and rearc in reasoning-gym 0.1.25).

Privileged information (decision): for single-turn tasks the most useful
privileged context is the reference solution (GC-OPD conditions the teacher
on it), so `Task.gold_path` is `["answer: <reference answer>"]` and the
SkillBank renders it as the walkthrough ("Walkthrough: answer: -4") after the
skills in opsd/skills/reasoning_gym/. Datasets without a single reference
answer (answer None: their verifier accepts any valid solution) get
gold_path []. The reference answer also stays in Task.spec (privileged: the
student only ever sees the question).

Answers are not flattened: some answers span lines (matrices, grids) and the
verifiers compare text. Invalid actions do not exist here: any text is an
answer (the rollout's parser checks the <answer> format).
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from importlib.metadata import version
from typing import Any, Iterator

import reasoning_gym
from reasoning_gym.factory import DATASETS

from opsd.config import EnvSection
from opsd.envs.base import EnvContext, EnvPrompt, EnvStep, Task, cap

NAME = "reasoning_gym"
ACTION_TAGS = ("answer",)
METRIC = "success"

# The eval split's seeds sit this far above the train split's (base seeds are below it).
EVAL_SEED_OFFSET = 2**30
# Answers longer than this are cut before scoring (no real answer comes close).
MAX_ANSWER_CHARS = 16_384

PROMPT = EnvPrompt(
    system={
        "action": (
            "Solve the problem. Reply with only the final answer inside <answer></answer>, "
            "for example <answer>42</answer>."
        ),
        "think": (
            "Solve the problem. First reason step by step inside <think></think>, then give only "
            "the final answer inside <answer></answer>, for example "
            "<think>...</think><answer>42</answer>."
        ),
    },
    # A made-up exchange (not from any dataset) that shows the reply format.
    example=(
        "What is 7 * 6 - 5?",
        [],
        {
            "action": "<answer>37</answer>",
            "think": "<think>7 * 6 = 42, and 42 - 5 = 37.</think><answer>37</answer>",
        },
    ),
    # Shown by the rollout when a reply has no parsable <answer> (the env itself never sees it).
    invalid_feedback="Invalid response. Give only the final answer inside <answer></answer>.",
)


def _base_seed(seed: int, dataset: str) -> int:
    """The train seed of `dataset` under run seed `seed`: a stable hash, in [0, 2**30)."""
    digest = hashlib.sha256(f"reasoning_gym:{seed}:{dataset}".encode()).hexdigest()
    return int(digest[:8], 16) % EVAL_SEED_OFFSET


@lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int) -> Any:
    """reasoning_gym.create_dataset(name, seed=, size=), cached per process (cheap for most
    datasets: items are built on access). ValueError naming the dataset when it cannot be built."""
    if name not in DATASETS:
        raise ValueError(
            f"unknown reasoning-gym dataset {name!r} (reasoning-gym {version('reasoning-gym')}); "
            f"known: {', '.join(sorted(DATASETS))}"
        )
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size)
    except Exception as exc:
        raise ValueError(f"reasoning-gym dataset {name!r} cannot be built from seed and size alone: {exc}") from exc


def _score(ds: Any, answer: str | None, entry: dict[str, Any]) -> float:
    """The verifier's score of `answer`, clamped to [0, 1] (NaN -> 0). Verifier errors propagate."""
    value = float(ds.score_answer(answer, entry))
    return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))


def _roundtrip(name: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    """The item as it will arrive on another machine (through JSON); ValueError if not JSON-able."""
    entry = {"question": item["question"], "answer": item["answer"], "metadata": item.get("metadata", {})}
    try:
        return json.loads(json.dumps(entry, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reasoning-gym dataset {name!r} is not supported: item {index} is not JSON-able ({exc})"
        ) from exc


def _items(name: str, seed: int, size: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, JSON round-tripped entry) for indices 0..size-1 of dataset `name` with `seed`.

    Raises ValueError when an item is not JSON-able, or its reference answer does not score 1
    on the round-tripped entry (the verifier would then misjudge answers on another machine).
    """
    ds = _dataset(name, seed, size)
    for index in range(size):
        raw = ds[index]
        entry = _roundtrip(name, index, raw)
        if isinstance(entry["answer"], str):
            original, travelled = _score(ds, raw["answer"], raw), _score(ds, entry["answer"], entry)
            if travelled != 1.0:
                why = "after a JSON round trip" if original == 1.0 else "even before a JSON round trip"
                raise ValueError(
                    f"reasoning-gym dataset {name!r} is not supported: the reference answer of item {index} "
                    f"scores {travelled} {why}"
                )
        yield index, entry


def _task(name: str, split: str, seed: int, size: int, index: int, entry: dict[str, Any]) -> Task:
    answer = entry["answer"]
    return Task(
        task_id=f"rg-{name}-{split}-s{seed}-i{index}",
        category=name,
        skill_key=name,
        spec={"dataset": name, "seed": seed, "size": size, "index": index, **entry},
        gold_path=[f"answer: {answer}"] if isinstance(answer, str) else [],
        objective=entry["question"],
    )


def _pool(cfg: EnvSection, split: str, count: int, exclude: set[str]) -> list[Task]:
    names = list(cfg.reasoning_gym.datasets)
    if not names:
        raise ValueError("reasoning_gym.datasets is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"reasoning_gym.datasets lists a dataset twice: {names}")
    size = cfg.reasoning_gym.size
    streams = []
    for name in names:
        seed = _base_seed(cfg.seed, name) + (EVAL_SEED_OFFSET if split == "eval" else 0)
        streams.append((name, seed, _items(name, seed, size)))
    seen, tasks = set(exclude), []
    while len(tasks) < count and streams:
        for stream in list(streams):
            name, seed, items = stream
            for index, entry in items:  # the next item of this dataset whose question is new
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    tasks.append(_task(name, split, seed, size, index, entry))
                    break
            else:
                streams.remove(stream)  # exhausted
            if len(tasks) == count:
                break
    if len(tasks) < count:
        raise ValueError(
            f"reasoning-gym {split} pool needs {count} distinct questions but datasets {names} give only "
            f"{len(tasks)} from reasoning_gym.size={size} items each; raise reasoning_gym.size"
        )
    return tasks


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """cfg.game_pool ("train") or cfg.eval_pool ("eval") tasks, round-robin across
    cfg.reasoning_gym.datasets; category = skill_key = the dataset name.

    Deterministic for a config. Eval questions never appear in the train pool. Raises
    ValueError on another split, an unknown or unsupported dataset, or too few distinct items.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if split == "train":
        return _pool(cfg, "train", cfg.game_pool, set())
    train_questions = {t.spec["question"] for t in _pool(cfg, "train", cfg.game_pool, set())}
    return _pool(cfg, "eval", cfg.eval_pool, train_questions)


class ReasoningGymEnv:
    """One single-turn episode: reset() -> the question; step(answer) -> scored, done."""

    def __init__(self, task: Task, max_observation_chars: int) -> None:
        spec = task.spec
        try:
            self.dataset = str(spec["dataset"])
            seed, size = int(spec["seed"]), int(spec["size"])
            self.entry = {"question": str(spec["question"]), "answer": spec["answer"],
                          "metadata": dict(spec.get("metadata") or {})}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed reasoning-gym task spec ({type(exc).__name__}: {exc})") from exc
        self._ds = _dataset(self.dataset, seed, size)
        self._max_chars = max_observation_chars
        self._done = True
        self._started = False

    def reset(self) -> EnvStep:
        """Start (or restart) the episode; the observation is the question (capped)."""
        self._done, self._started = False, True
        answer = self.entry["answer"]
        return EnvStep(
            observation=cap(self.entry["question"], self._max_chars),
            admissible_commands=[],
            won=False,
            lost=False,
            done=False,
            score=0.0,
            policy_commands=[answer] if isinstance(answer, str) else [],
        )

    def step(self, action: str) -> EnvStep:
        """Score `action` (the final answer text) with the dataset's verifier; always ends the episode.

        reward = the verifier's score clamped to [0, 1]; won = reward == 1. A verifier exception
        gives reward 0 and info["verifier_error"]. RuntimeError before reset() or after the end.
        """
        if self._done:
            what = "finished" if self._started else "not yet reset"
            raise RuntimeError(f"ReasoningGymEnv.step called on a {what} episode")
        self._done = True
        answer = (action if isinstance(action, str) else str(action)).strip()[:MAX_ANSWER_CHARS]
        info: dict[str, Any] = {"dataset": self.dataset}
        try:
            reward = _score(self._ds, answer, self.entry)
        except Exception as exc:  # a verifier may choke on odd text; that answer is simply wrong
            reward, info["verifier_error"] = 0.0, f"{type(exc).__name__}: {exc}"[:500]
        won = reward == 1.0
        return EnvStep(
            observation="Correct." if won else "Incorrect.",
            admissible_commands=[],
            won=won,
            lost=not won,
            done=True,
            score=reward,
            reward=reward,
            info=info,
        )

    def close(self) -> None:
        """Nothing to release (no process, no file); safe to call twice."""
        self._done = True


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> ReasoningGymEnv:
    """A ReasoningGymEnv for `task` from its spec alone (the item is in the spec; the dataset object
    is re-created only for its verifier). ValueError on a malformed spec or unknown dataset."""
    return ReasoningGymEnv(task, cfg.max_observation_chars)
