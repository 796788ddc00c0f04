"""The embedder role: a frozen sentence encoder + FAISS behind HTTP.

POST /embed       texts -> L2-normalized float32 vectors (empty text -> zero vector)
POST /correspond  one group's student and teacher texts -> H, eligibility and
                  the selected sources with weights omega, rho, alpha (spec 4.1);
                  with return_embeddings, also the embeddings it compared
POST /retrieve    Search-QA: a query -> its top-k corpus passages (opsd/retrieval.py);
                  only when the embedder serves a corpus; 503 when that corpus failed to load

Both (and the OpenAPI schema and docs) need `Authorization: Bearer <OPSD_API_TOKEN>`
(401 otherwise); bodies over embedder.max_request_bytes get 413 (opsd.auth.ApiGuard).

Stateless: every request carries what it needs (including the AlignOPSD
hyper-parameters), so any replica can answer it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, ContextManager

import faiss
import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from opsd import metrics
from opsd.auth import ApiGuard
from opsd.config import EmbedderSection
from opsd.embedding_api import (CorrespondRequest, CorrespondResponse, EmbedRequest, EmbedResponse, RetrievedPassage,
                                RetrieveRequest, RetrieveResponse)
from opsd.credit.alignopsd import correspondence
from opsd.encoder import Encoder
from opsd.retrieval import IndexBuilding

ROLE = "embedder"
# Below this many queries FAISS uses its own loop instead of BLAS; 20 was measured fastest here.
faiss.cvar.distance_compute_blas_threshold = 20


def cosine_matrix_faiss(query_QD: np.ndarray, base_ND: np.ndarray) -> np.ndarray:
    """All-pairs inner products [Q, N] via a FAISS IndexFlatIP (cosine on L2-normalized rows).

    Ids -1 (k larger than the index, bad-input case 18) are dropped, never used as indices.
    """
    Q, N = query_QD.shape[0], base_ND.shape[0]
    out = np.zeros((Q, N), dtype=np.float32)
    if Q == 0 or N == 0:
        return out
    base_ND = np.array(base_ND, dtype=np.float32, order="C")  # a copy: the caller's array stays as it was
    base_ND[~np.isfinite(base_ND).all(axis=1)] = 0.0  # a NaN vector never enters an index (bad-input case 19)
    index = faiss.IndexFlatIP(base_ND.shape[1])
    index.add(base_ND)
    scores, ids = index.search(np.ascontiguousarray(query_QD, dtype=np.float32), N)
    for q in range(Q):
        keep = ids[q] >= 0
        out[q, ids[q][keep]] = scores[q][keep]
    # Float noise puts the inner product of a unit vector with itself at 1.0000001: a cosine is in [-1, 1].
    return np.clip(out, -1.0, 1.0)


def correspond(encoder: Encoder, req: CorrespondRequest) -> CorrespondResponse:
    """Spec 4.1: H = cos(teacher text of s, student text of t); eligibility; top-K selection.

    With `req.return_embeddings` the response also carries the four [M, D]
    embedding matrices it compared (thinking rows zeroed for invalid turns,
    action rows zero for empty actions), for the credit dump.
    """
    turns = req.turns
    M = len(turns)
    texts = [t.teacher_text for t in turns] + [t.student_text for t in turns]
    vecs = encoder.embed(texts)
    teacher_MD, student_MD = vecs[:M], vecs[M:]
    # Invalid thinking is a zero vector in the reference, so its similarity is 0.
    teacher_MD[[not t.teacher_valid for t in turns]] = 0.0
    student_MD[[not t.student_valid for t in turns]] = 0.0
    H_MM = cosine_matrix_faiss(teacher_MD, student_MD)
    eligible_MM = correspondence.structural_mask(
        [req.task_id] * M,
        [t.rollout_id for t in turns],
        [t.data_source for t in turns],
        np.array([t.student_valid for t in turns]),
        np.array([t.teacher_valid for t in turns]),
    )
    action_sim = acts = None
    if req.align.action_filter_enabled or req.return_embeddings:
        acts = encoder.embed([t.teacher_action for t in turns] + [t.student_action for t in turns])
    if req.align.action_filter_enabled:
        action_sim = cosine_matrix_faiss(acts[:M], acts[M:])
    sel = correspondence.select_sources(
        H_MM,
        eligible_MM,
        req.align,
        action_similarity_MM=action_sim,
        student_actions=[t.student_action for t in turns],
        teacher_actions=[t.teacher_action for t in turns],
        rollout_id=[t.rollout_id for t in turns],
    )
    return CorrespondResponse(
        similarity=H_MM.tolist(),
        eligible=eligible_MM.tolist(),
        selected_sources=[list(map(int, s)) for s in sel.sources],
        source_weights=[list(map(float, w)) for w in sel.weights],
        rho=[float(x) for x in sel.rho_M],
        alpha=[float(x) for x in sel.alpha_M],
        # float32 -> Python float -> JSON is exact, so the teacher gets these very vectors back.
        **({"student_thinking_emb": student_MD.tolist(), "teacher_thinking_emb": teacher_MD.tolist(),
            "student_action_emb": acts[M:].tolist(), "teacher_action_emb": acts[:M].tolist()}
           if req.return_embeddings else {}),
    )


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by its name ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def build_app(cfg: EmbedderSection, encoder: Encoder, token: str, retrieval: Any = None,
              guard: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> FastAPI:
    """The embedder's FastAPI app (requests validated by pydantic; limits from `cfg`).

    Every route but the probes' (/health, /metrics, /readyz, /livez) needs `Authorization: Bearer <token>`;
    raises ValueError for an empty token (the app is never served open).
    `retrieval`: the corpus /retrieve searches (a opsd.retrieval.LazyCorpusIndex,
    built at its first use), or None: no /retrieve route (404).
    `guard`: a context manager factory each request's computation runs under
    (the role's liveness guard of probes.generate_s).
    """
    if not token:  # the middleware is built at the first request: check here, at construction
        raise ValueError("the embedder needs a non-empty API token")
    app = FastAPI(title="opsd embedder")
    app.add_middleware(ApiGuard, role=ROLE, token=token, max_body_bytes=cfg.max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the offending input, and a NaN/Infinity input
        # (which Python's JSON parser accepts) cannot be serialized back: a 500 instead of 422.
        return JSONResponse(status_code=422, content={"detail": _json_safe(jsonable_encoder(exc.errors()))})

    def _check_texts(texts: list[str]) -> None:
        if len(texts) > cfg.max_texts:
            raise HTTPException(413, f"{len(texts)} texts exceed the limit of {cfg.max_texts}")
        long = [i for i, t in enumerate(texts) if len(t) > cfg.max_text_chars]
        if long:
            raise HTTPException(413, f"texts {long[:5]} exceed {cfg.max_text_chars} characters")

    @app.post("/embed", response_model=EmbedResponse)
    def embed(req: EmbedRequest) -> EmbedResponse:
        _check_texts(req.texts)
        t0 = time.perf_counter()
        with guard():
            vecs = encoder.embed(req.texts)
        metrics.JOB_SECONDS.labels(ROLE).observe(time.perf_counter() - t0)
        return EmbedResponse(dim=encoder.dim, vectors=vecs.tolist())

    @app.post("/correspond", response_model=CorrespondResponse)
    def correspond_route(req: CorrespondRequest) -> CorrespondResponse:
        _check_texts([t.student_text for t in req.turns] + [t.teacher_text for t in req.turns])
        if req.align.action_filter_enabled or req.return_embeddings:  # the actions are embedded too, under the same limits
            _check_texts([t.student_action for t in req.turns] + [t.teacher_action for t in req.turns])
        t0 = time.perf_counter()
        with guard():
            out = correspond(encoder, req)
        metrics.JOB_SECONDS.labels(ROLE).observe(time.perf_counter() - t0)
        metrics.GROUPS.labels(ROLE).inc()
        return out

    if retrieval is None:  # no corpus: no /retrieve route (404), the API is as it was before Search-QA
        return app

    @app.post("/retrieve", response_model=RetrieveResponse)
    def retrieve(req: RetrieveRequest) -> RetrieveResponse:
        _check_texts([req.query])
        try:
            # Never block a request on a build that may take hours: the client retries a 503 "building".
            index = retrieval.get(wait=False)
        except IndexBuilding as e:
            raise HTTPException(503, str(e), headers={"Retry-After": "5"}) from None
        except RuntimeError as e:
            raise HTTPException(503, str(e)) from None
        t0 = time.perf_counter()
        with guard():
            hits = index.search(req.query, req.k)
        metrics.JOB_SECONDS.labels(ROLE).observe(time.perf_counter() - t0)
        return RetrieveResponse(passages=[RetrievedPassage(id=p.id, title=p.title, contents=p.contents, score=s)
                                          for p, s in hits])

    return app
