"""What the inspect API returns: one pydantic model per page (opsd/inspect/views.py builds them).

Units: log-probs and gaps in nats per token (a turn's gap is the mean over its loss tokens of
teacher - student); advantages as the trainer used them (a turn's `adv_mean` is the mean over its
loss tokens). `row` is a turn's row in the dump (canonical order: task, rollout, turn).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class GroupSummary(BaseModel):
    group: str
    data_source: str
    rollouts: int
    turns: int
    rewards: list[float]  # one per rollout, in rollout-id order
    adv_mean: float  # over the group's loss tokens


class StepView(BaseModel):
    step: int
    method: str
    rows: int
    tokens: int  # L, the longest response
    has_teacher: bool
    has_display: bool
    config: dict[str, Any]
    total_groups: int
    offset: int
    groups: list[GroupSummary]


class Source(BaseModel):
    rollout: str
    turn: int
    weight: float


class TurnView(BaseModel):
    row: int
    turn: int
    observation: str | None = None  # the env's reply to this turn
    thinking: str | None = None
    action: str | None = None
    text: str | None = None
    valid: bool
    tokens: int  # loss tokens
    adv_mean: float
    adv_sum: float
    gap: float | None = None
    rectified_gap: float | None = None
    sources: list[Source] | None = None  # AlignOPSD's matched sibling turns
    span: int | None = None  # AlignOPSD's semi-Markov span index within the trajectory
    span_start: bool | None = None
    boundary: str | None = None  # what opened the span: semantic / guided_fallback / forced_max
    belief_before: float | None = None  # AgentOPSD B_{k-1}
    belief_after: float | None = None  # AgentOPSD B_k
    residual: float | None = None  # GC-OPD's group-calibrated residual of the trajectory


class TrajectoryTurns(BaseModel):
    rollout: str
    reward: float
    total_turns: int
    turns: list[TurnView]


class GroupView(BaseModel):
    step: int
    method: str
    group: str
    objective: str | None = None  # the task's, from the env ("" when it has none; None: a dump without it)
    opening: str | None = None  # the student's first user message: the env's opening observation
    offset: int
    extras_error: str | None = None  # why a method's intermediates could not be recomputed
    trajectories: list[TrajectoryTurns]


class Token(BaseModel):
    id: int | None  # None when the dump has no token ids (older dumps)
    text: str
    adv: float
    on: bool  # a loss token (trained on)
    student: float
    teacher: float | None = None


class TokenTurn(BaseModel):
    turn: int
    valid: bool
    tokens: list[Token]


class TrajectoryView(BaseModel):
    step: int
    method: str
    group: str
    rollout: str
    reward: float
    decoded: bool  # token text from the run's tokenizer (else ids)
    total_turns: int
    offset: int
    turns: list[TokenTurn]


class CompareTurn(BaseModel):
    turn: int
    dumped: float  # mean advantage over the turn's loss tokens, as trained
    replayed: float  # the same with the other method / settings


class CompareTrajectory(BaseModel):
    rollout: str
    reward: float
    turns: list[CompareTurn]


class CompareView(BaseModel):
    step: int
    dumped_method: str
    method: str
    overrides: dict[str, Any]
    max_abs_diff: float  # over every loss token of the step
    correlation: float | None  # Pearson over the step's loss tokens (None when constant)
    group: str
    trajectories: list[CompareTrajectory]
