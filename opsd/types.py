"""The data that flows between roles: TaskGroup -> RolloutGroup -> ScoredGroup.

Every message is a small dataclass whose array fields are numpy arrays with a
fixed dtype (checked on the wire by `opsd.wire`). Shape suffixes follow the
house convention: `_S` = tokens of one trajectory (prompt, responses and
observations in order), `_M` = the turns of one group in canonical order
(sorted by rollout id, then turn id), `_MM` = [source turn, target turn].

Token layout of one trajectory (token-in/token-out, never re-rendered):

    token_ids_S = prompt(turn 0) + response(0) + separator/observation(0)
                  + response(1) + ... + response(K-1)

Turn k's prompt is `token_ids_S[:turns[k].response_start]`; its response is
`token_ids_S[response_start:response_end]`. `loss_mask_S` is 1 exactly on the
sampled tokens; prefilled tokens (e.g. `<action>`), separators and
observations are prompt (mask 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

MAX_GROUP_SIZE = 1024  # sibling rollouts per task: a bigger value on the wire would make a worker build millions of games
# |reward| bound: rewards are z-scored (or centred) in float32 by the trainer; a finite
# float64 reward like 1e39 would become inf there and crash the step.
MAX_ABS_REWARD = 1e9
# Turns of one group (all its trajectories): the teacher and the trainer build [M, M]
# matrices per group (64 MB of float32 at 4096), so an unbounded M is an out-of-memory kill.
MAX_GROUP_TURNS = 4096
SIMILARITY_TOLERANCE = 1e-3  # cosine H may exceed [-1, 1] by float noise (FAISS inner products), not more
LOGPROB_TOLERANCE = 1e-4  # a log-prob is <= 0; tiny positive values are float noise

FINISH_REASONS = ("stop", "length")  # sampler finish reason of one turn
EPISODE_ENDINGS = ("won", "lost", "max_turns", "truncated", "error")


class MessageError(ValueError):
    """A message violates its schema (wrong type, shape, dtype, NaN, bounds)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise MessageError(msg)


def _check_array(name: str, arr: Any, dtype: np.dtype | type, ndim: int) -> None:
    _check(isinstance(arr, np.ndarray), f"{name}: expected numpy array, got {type(arr).__name__}")
    _check(arr.dtype == np.dtype(dtype), f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    _check(arr.ndim == ndim, f"{name}: expected {ndim}-d array, got shape {arr.shape}")
    if arr.dtype.kind == "f":
        _check(bool(np.isfinite(arr).all()), f"{name}: contains NaN or inf")


@dataclass
class TaskGroup:
    """One task to be played G times by the rollout role with policy `policy_version`.

    `game` is an environment-specific JSON-able spec (for TextWorld: the seed
    and generation options); `privileged_info` is the text the teacher sees
    and the student does not (the game's walkthrough).
    """

    group_id: str
    task_id: str
    step: int
    policy_version: int
    group_size: int
    env: str
    game: dict[str, Any]
    privileged_info: str
    max_turns: int

    def validate(self) -> None:
        _check(bool(self.group_id) and bool(self.task_id), "TaskGroup: empty group_id or task_id")
        _check(
            1 <= self.group_size <= MAX_GROUP_SIZE,
            f"TaskGroup: group_size must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}",
        )
        _check(self.max_turns >= 1, f"TaskGroup: max_turns must be >= 1, got {self.max_turns}")
        _check(self.policy_version >= 0 and self.step >= 0, "TaskGroup: negative step or policy_version")


@dataclass
class TurnRecord:
    """One agent turn: where its response lies in the trajectory and what it parsed to."""

    turn_id: int
    response_start: int
    response_end: int
    text: str  # decoded response, including any prefilled opening tag
    thinking: str  # parsed <think> content ("" when absent)
    action: str  # parsed action ("" when invalid)
    format_valid: bool
    finish_reason: str  # "stop" (end of turn token sampled) or "length" (token cap)
    observation: str  # the environment's reply to this turn ("" after the last turn)


@dataclass
class Trajectory:
    """One episode of one sibling rollout, as exact token ids.

    Arrays: token_ids_S int32 [S]; sampler_logprobs_S float32 [S] (natural-log
    probability of each sampled token under the sampling temperature, 0 where
    loss_mask is 0); loss_mask_S uint8 [S]. `reward` is the terminal episode
    reward (TextWorld: 1.0 won, 0.0 otherwise).
    """

    rollout_id: str
    token_ids_S: np.ndarray
    sampler_logprobs_S: np.ndarray
    loss_mask_S: np.ndarray
    turns: list[TurnRecord]
    reward: float
    won: bool
    ending: str

    def validate(self, vocab_size: int | None = None) -> None:
        name = f"Trajectory {self.rollout_id}"
        _check_array(f"{name}.token_ids_S", self.token_ids_S, np.int32, 1)
        _check_array(f"{name}.sampler_logprobs_S", self.sampler_logprobs_S, np.float32, 1)
        _check_array(f"{name}.loss_mask_S", self.loss_mask_S, np.uint8, 1)
        S = self.token_ids_S.shape[0]
        _check(
            self.sampler_logprobs_S.shape[0] == S and self.loss_mask_S.shape[0] == S,
            f"{name}: token_ids, sampler_logprobs and loss_mask lengths differ",
        )
        _check(bool(((self.loss_mask_S == 0) | (self.loss_mask_S == 1)).all()), f"{name}: loss_mask not 0/1")
        _check(bool((self.sampler_logprobs_S <= LOGPROB_TOLERANCE).all()), f"{name}: a log-prob is positive")
        if S:
            _check(int(self.token_ids_S.min()) >= 0, f"{name}: negative token id")
            if vocab_size is not None:
                _check(int(self.token_ids_S.max()) < vocab_size, f"{name}: token id >= vocab size {vocab_size}")
        _check(self.ending in EPISODE_ENDINGS, f"{name}: unknown ending {self.ending!r}")
        _check(math.isfinite(self.reward), f"{name}: reward is not finite")
        _check(abs(self.reward) <= MAX_ABS_REWARD, f"{name}: |reward| {self.reward} > {MAX_ABS_REWARD}")
        prev_end = 0
        for k, t in enumerate(self.turns):
            _check(t.turn_id == k, f"{name}: turn ids must be 0..K-1 in order")
            _check(
                prev_end <= t.response_start <= t.response_end <= S,
                f"{name}: turn {k} span [{t.response_start},{t.response_end}) out of order or bounds",
            )
            _check(t.finish_reason in FINISH_REASONS, f"{name}: turn {k} finish_reason {t.finish_reason!r}")
            prev_end = t.response_end
        inside = np.zeros(S, dtype=bool)
        for t in self.turns:
            inside[t.response_start : t.response_end] = True
        _check(not bool((self.loss_mask_S.astype(bool) & ~inside).any()), f"{name}: loss token outside a response")

    def response_slice(self, k: int) -> slice:
        t = self.turns[k]
        return slice(t.response_start, t.response_end)


@dataclass
class RolloutGroup:
    """The G sibling trajectories of one TaskGroup, all sampled with `task.policy_version`."""

    task: TaskGroup
    trajectories: list[Trajectory]
    prompt_format: str  # "action" (action-only) or "think" (the papers' format)
    rollout_seconds: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def group_id(self) -> str:
        return self.task.group_id

    def validate(self, vocab_size: int | None = None) -> None:
        _check(self.schema_version == SCHEMA_VERSION, f"schema_version {self.schema_version} != {SCHEMA_VERSION}")
        self.task.validate()
        _check(len(self.trajectories) >= 1, "RolloutGroup: no trajectories")
        ids = [t.rollout_id for t in self.trajectories]
        _check(len(set(ids)) == len(ids), "RolloutGroup: duplicate rollout ids")
        _check(self.prompt_format in ("action", "think"), f"unknown prompt_format {self.prompt_format!r}")
        _check(
            len(self.trajectories) <= self.task.group_size,
            f"RolloutGroup: {len(self.trajectories)} trajectories for group_size {self.task.group_size}",
        )
        for t in self.trajectories:
            _check(len(t.turns) <= self.task.max_turns, f"Trajectory {t.rollout_id}: more turns than max_turns {self.task.max_turns}")
        M = sum(len(t.turns) for t in self.trajectories)
        _check(M <= MAX_GROUP_TURNS, f"RolloutGroup: {M} turns > {MAX_GROUP_TURNS}")
        for t in self.trajectories:
            t.validate(vocab_size)

    def canonical_turns(self) -> list[tuple[int, int]]:
        """(trajectory index, turn index) of every turn, sorted by (rollout_id, turn_id)."""
        order = sorted(range(len(self.trajectories)), key=lambda i: self.trajectories[i].rollout_id)
        return [(i, k) for i in order for k in range(len(self.trajectories[i].turns))]


@dataclass
class ScoredGroup:
    """A RolloutGroup plus the teacher's view of it.

    Per trajectory (aligned with token_ids_S, 0 off the loss mask):
    teacher_logprobs_S = identity view (own privileged history), and
    corrected_logprobs_S = after decision-aligned rectification (spec 4.2).
    Per group, over the M turns in `rollout.canonical_turns()` order:
    similarity_MM[s, t] = H (teacher thinking of s vs student thinking of t),
    eligible_MM[s, t] = structural eligibility (spec 4.1), and the selected
    sources / weights / rho / alpha of each target turn.
    """

    rollout: RolloutGroup
    teacher_version: int
    teacher_logprobs_S: list[np.ndarray]
    corrected_logprobs_S: list[np.ndarray]
    teacher_thinking_M: list[str]
    similarity_MM: np.ndarray
    eligible_MM: np.ndarray
    selected_sources_M: list[list[int]]
    source_weights_M: list[list[float]]
    rho_M: np.ndarray
    alpha_M: np.ndarray
    identity_fallback: bool = False  # correspondences unavailable: identity views only
    teacher_seconds: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def group_id(self) -> str:
        return self.rollout.group_id

    def validate(self, vocab_size: int | None = None) -> None:
        _check(self.schema_version == SCHEMA_VERSION, f"schema_version {self.schema_version} != {SCHEMA_VERSION}")
        self.rollout.validate(vocab_size)
        n = len(self.rollout.trajectories)
        _check(len(self.teacher_logprobs_S) == n, "ScoredGroup: teacher_logprobs_S count != trajectories")
        _check(len(self.corrected_logprobs_S) == n, "ScoredGroup: corrected_logprobs_S count != trajectories")
        for i, traj in enumerate(self.rollout.trajectories):
            for nm, arr in (("teacher_logprobs_S", self.teacher_logprobs_S[i]), ("corrected_logprobs_S", self.corrected_logprobs_S[i])):
                _check_array(f"ScoredGroup.{nm}[{i}]", arr, np.float32, 1)
                _check(arr.shape == traj.token_ids_S.shape, f"ScoredGroup.{nm}[{i}]: length != trajectory length")
                # A positive teacher log-prob would silently inflate every gap built from it.
                _check(bool((arr <= LOGPROB_TOLERANCE).all()), f"ScoredGroup.{nm}[{i}]: a log-prob is positive")
        M = sum(len(t.turns) for t in self.rollout.trajectories)
        _check_array("ScoredGroup.similarity_MM", self.similarity_MM, np.float32, 2)
        _check_array("ScoredGroup.eligible_MM", self.eligible_MM, np.bool_, 2)
        _check(self.similarity_MM.shape == (M, M) and self.eligible_MM.shape == (M, M), f"ScoredGroup: H must be [{M},{M}]")
        _check(
            bool((np.abs(self.similarity_MM) <= 1.0 + SIMILARITY_TOLERANCE).all()),
            "ScoredGroup.similarity_MM: a cosine outside [-1, 1]",
        )
        _check_array("ScoredGroup.rho_M", self.rho_M, np.float32, 1)
        _check_array("ScoredGroup.alpha_M", self.alpha_M, np.float32, 1)
        _check(self.rho_M.shape == (M,) and self.alpha_M.shape == (M,), "ScoredGroup: rho/alpha must be [M]")
        _check(len(self.selected_sources_M) == M and len(self.source_weights_M) == M, "ScoredGroup: sources must be [M]")
        _check(len(self.teacher_thinking_M) == M, "ScoredGroup: teacher_thinking must be [M]")
        for t, (src, w) in enumerate(zip(self.selected_sources_M, self.source_weights_M)):
            _check(len(src) == len(w), f"ScoredGroup: turn {t} sources and weights differ in length")
            _check(all(0 <= s < M for s in src), f"ScoredGroup: turn {t} source index out of range")
            _check(all(math.isfinite(x) for x in w), f"ScoredGroup: turn {t} weight not finite")


@dataclass
class CreditBatch:
    """What an advantage estimator sees: every turn of a training batch as one row.

    Rows are in canonical order, sorted by (task_id, rollout_id, turn_id) as
    strings/ints (spec 4). `task_id` is the GRPO group (one TaskGroup's
    group_id), `rollout_id` the trajectory. Arrays ([M] rows, [L] response
    tokens, right-padded with mask 0):

    - loss_mask_ML uint8/float32 0/1, student_logprobs_ML float32 (pi_old of the
      sampled token), teacher_logprobs_ML float32 (identity privileged view),
      corrected_logprobs_ML float32 (after rectification; = teacher where no
      source), similarity_MM float32 and eligible_MM bool ([source, target],
      block-diagonal by task: 0/False across tasks).
    - per row: task_id, rollout_id, turn_id, data_source, episode_reward
      (raw return repeated on every turn), is_action_valid.
    Teacher fields may be None for methods that need no teacher (GRPO).
    """

    task_id: list[str]
    rollout_id: list[str]
    turn_id: list[int]
    data_source: list[str]
    episode_reward: np.ndarray  # float32 [M]
    is_action_valid: np.ndarray  # bool [M]
    loss_mask_ML: np.ndarray
    student_logprobs_ML: np.ndarray
    teacher_logprobs_ML: np.ndarray | None = None
    corrected_logprobs_ML: np.ndarray | None = None
    similarity_MM: np.ndarray | None = None
    eligible_MM: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.task_id)
