"""The embedder's HTTP contract (shared by the embedder and its client, the teacher).

Requests and responses are pydantic models: the embedder validates what it
receives, the teacher validates what comes back (`CorrespondResponse.check`),
so a malformed answer becomes a clear error, never an IndexError or a NaN.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from opsd.config import AlignSection


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(max_length=100_000)


class EmbedResponse(BaseModel):
    dim: int
    vectors: list[list[float]]


class CorrespondTurn(BaseModel):
    """One turn of the group, in canonical order. `*_text` is the thinking (or, in the
    action-only format, the action text: a documented deviation for models that do not think)."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    turn_id: int = Field(ge=0)
    data_source: str = "env"
    student_text: str
    teacher_text: str
    student_valid: bool
    teacher_valid: bool
    student_action: str = ""
    teacher_action: str = ""


class CorrespondRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str
    turns: list[CorrespondTurn] = Field(min_length=1)
    align: AlignSection = AlignSection()


class CorrespondResponse(BaseModel):
    """Per target turn t (canonical order): its selected sources (row indices), their
    softmax weights omega, rho and alpha (spec 4.1-4.2); H and eligibility are [source][target]."""

    model_config = ConfigDict(extra="forbid")
    similarity: list[list[float]]  # [source][target]
    eligible: list[list[bool]]
    selected_sources: list[list[int]]
    source_weights: list[list[float]]
    rho: list[float]
    alpha: list[float]

    def check(self, M: int) -> "CorrespondResponse":
        """Raise ValueError unless every field has M rows (M x M matrices), indices are in
        range, weights are finite and non-negative, and each turn's sources and weights align."""
        if len(self.similarity) != M or any(len(r) != M for r in self.similarity):
            raise ValueError(f"similarity must be {M}x{M}")
        if len(self.eligible) != M or any(len(r) != M for r in self.eligible):
            raise ValueError(f"eligible must be {M}x{M}")
        for name in ("selected_sources", "source_weights", "rho", "alpha"):
            if len(getattr(self, name)) != M:
                raise ValueError(f"{name} must have {M} rows, got {len(getattr(self, name))}")
        for t, (src, w) in enumerate(zip(self.selected_sources, self.source_weights)):
            if len(src) != len(w) or any(not 0 <= s < M for s in src):
                raise ValueError(f"turn {t}: sources {src} do not match weights {w} or leave [0, {M})")
            if any(not math.isfinite(x) or x < 0 for x in w):
                raise ValueError(f"turn {t}: weights must be finite and >= 0")
        values = [x for r in self.similarity for x in r] + self.rho + self.alpha
        if any(not math.isfinite(x) for x in values):
            raise ValueError("similarity, rho and alpha must be finite")
        return self
