"""The embedder's HTTP contract (shared by the embedder and its client, the teacher).

Requests and responses are pydantic models: the embedder validates what it
receives, the teacher validates what comes back (`CorrespondResponse.check`),
so a malformed answer becomes a clear error, never an IndexError or a NaN.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from opsd.config import AlignSection
from opsd.types import MAX_EMBEDDING_DIM
from opsd.types import SIMILARITY_TOLERANCE as NORM_TOLERANCE  # a unit vector's float noise

# The embedder sends softmax weights computed in float64 and rounded to float32 one by one:
# each rounding moves a weight by at most 2**-24 of itself, so a turn's sum is off by < 1e-7.
WEIGHT_SUM_TOLERANCE = 1e-5
_F32_MAX = float(np.finfo(np.float32).max)


def _finite32(x: float) -> bool:
    """True when `x` stays finite once the teacher stores it as float32."""
    return math.isfinite(x) and abs(x) <= _F32_MAX


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


EMBEDDING_FIELDS = ("student_thinking_emb", "teacher_thinking_emb", "student_action_emb", "teacher_action_emb")


class CorrespondRequest(BaseModel):
    """`return_embeddings`: also send back the four [M][D] embeddings (for a credit dump;
    about 4 x D floats of JSON per turn, so off by default)."""

    model_config = ConfigDict(extra="forbid")
    task_id: str
    turns: list[CorrespondTurn] = Field(min_length=1)
    align: AlignSection = AlignSection()
    return_embeddings: bool = False


class CorrespondResponse(BaseModel):
    """Per target turn t (canonical order): its selected sources (row indices), their
    softmax weights omega, rho and alpha (spec 4.1-4.2); H and eligibility are [source][target].

    With `return_embeddings`, the four `*_emb` fields hold the [M][D] vectors that
    were compared: thinking texts (the action text in the action-only format) with
    zero rows for invalid turns, action texts with zero rows for empty actions;
    None otherwise.
    """

    model_config = ConfigDict(extra="forbid")
    similarity: list[list[float]]  # [source][target]
    eligible: list[list[bool]]
    selected_sources: list[list[int]]
    source_weights: list[list[float]]
    rho: list[float]
    alpha: list[float]
    student_thinking_emb: list[list[float]] | None = None
    teacher_thinking_emb: list[list[float]] | None = None
    student_action_emb: list[list[float]] | None = None
    teacher_action_emb: list[list[float]] | None = None

    def check(self, M: int) -> "CorrespondResponse":
        """Raise ValueError unless the answer is one the embedder can have computed for M turns.

        Every field has M rows (M x M matrices); similarity is finite in float32 and
        within [-1, 1] (plus float noise); rho and alpha lie in [0, 1]; each turn's
        sources are distinct, in [0, M), marked eligible[s][t], and aligned with
        weights that are finite, >= 0 and (when there are sources) sum to 1 within
        WEIGHT_SUM_TOLERANCE (they are a softmax, spec 4.1); the embeddings are
        absent or all four finite [M][D] with 1 <= D <= MAX_EMBEDDING_DIM and rows
        of length <= 1.
        """
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
            if len(set(src)) != len(src):
                raise ValueError(f"turn {t}: sources {src} list a turn twice")
            if any(not self.eligible[s][t] for s in src):
                raise ValueError(f"turn {t}: sources {src} include one the answer marks not eligible")
            if any(not _finite32(x) or x < 0 for x in w):
                raise ValueError(f"turn {t}: weights must be finite (in float32) and >= 0")
            if src and abs(math.fsum(w) - 1.0) > WEIGHT_SUM_TOLERANCE:
                raise ValueError(f"turn {t}: weights {w} do not sum to 1")
        if any(not _finite32(x) or abs(x) > 1.0 + NORM_TOLERANCE for r in self.similarity for x in r):
            raise ValueError("similarity must be finite cosines in [-1, 1]")
        for name in ("rho", "alpha"):
            if any(not 0.0 <= x <= 1.0 for x in getattr(self, name)):  # NaN fails too
                raise ValueError(f"{name} must lie in [0, 1]")
        embs = [getattr(self, n) for n in EMBEDDING_FIELDS]
        if any(e is not None for e in embs):
            if any(e is None for e in embs):
                raise ValueError(f"embeddings {', '.join(EMBEDDING_FIELDS)} come all four or none")
            D = len(embs[0][0]) if embs[0] else 0
            if M and not 1 <= D <= MAX_EMBEDDING_DIM:
                raise ValueError(f"embedding width {D} outside [1, {MAX_EMBEDDING_DIM}]")
            for name, e in zip(EMBEDDING_FIELDS, embs):
                if len(e) != M or any(len(r) != D for r in e):
                    raise ValueError(f"{name} must be {M}x{D}")
                if any(not math.isfinite(x) for r in e for x in r):
                    raise ValueError(f"{name} must be finite")
                # The encoder L2-normalizes (or zeroes) every row; a longer one is not its output.
                if any(math.fsum(x * x for x in r) > (1.0 + NORM_TOLERANCE) ** 2 for r in e):
                    raise ValueError(f"{name}: a row longer than 1")
        return self


# Search-QA retrieval (POST /retrieve): top-k passages of the corpus the embedder serves.
MAX_RETRIEVE_K = 100  # the most passages one query may ask for (opsd/retrieval.py keeps the same bound)


class RetrieveRequest(BaseModel):
    """One query (non-blank; at most embedder.max_text_chars characters, else 413) and how many passages, 1..MAX_RETRIEVE_K."""

    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=1, pattern=r"\S")
    k: int = Field(3, ge=1, le=MAX_RETRIEVE_K)


class RetrievedPassage(BaseModel):
    """A passage as stored in the corpus (`contents`: title line first, wiki-18 style), its title and cosine score."""

    id: str
    title: str | None = None
    contents: str
    score: float


class RetrieveResponse(BaseModel):
    passages: list[RetrievedPassage]

    def check(self, k: int) -> "RetrieveResponse":
        """Raise ValueError unless this is an answer the embedder can give for `k`: at most k passages,
        finite cosine scores in [-1, 1] (plus float noise), best first."""
        if len(self.passages) > k:
            raise ValueError(f"{len(self.passages)} passages for k={k}")
        scores = [p.score for p in self.passages]
        if any(not math.isfinite(s) or abs(s) > 1.0 + NORM_TOLERANCE for s in scores):
            raise ValueError("passage scores must be finite cosines in [-1, 1]")
        if any(a < b for a, b in zip(scores, scores[1:])):
            raise ValueError("passages must come best first")
        return self
