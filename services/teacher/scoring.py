"""The privileged teacher: from a RolloutGroup to a ScoredGroup (spec 0, 4.1, 4.2).

For one group of G sibling trajectories with policy version v:
1. Privileged view of turn s = privileged prefix + the student's prompt ids of s.
2. Generate the teacher's own response for every turn (privileged thinking;
   in the action-only format, the privileged action).
3. Ask the embedder for correspondences: H, eligibility, selected sources.
4. Teacher-force every trajectory's exact ids under its own privileged
   history (identity view), and every target turn's response under each
   selected source's privileged history (matched sibling views).
5. Rectify: corrected teacher = (1 - alpha) identity + alpha aggregate.

Besides the result, the ScoredGroup keeps what a credit dump (refvector
AlignOPSD schema) and FiRe-OPD need: the identity view's entropies, the
parsed texts per turn, the embeddings (only with trainer.dump_credit) and
the matched views' log-probs before aggregation.
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import httpx
import numpy as np

from opsd import metrics
from opsd.chat import ChatFormat, decode, parse_response
from opsd.config import RunConfig
from opsd.credit.alignopsd import correspondence
from opsd.embedding_api import CorrespondResponse
from opsd.skills import turn_privileged_text
from opsd.types import RolloutGroup, ScoredGroup

log = logging.getLogger("teacher")


@dataclass
class TeacherStats:
    scored_tokens: int = 0
    generated_tokens: int = 0
    forward_tokens: int = 0  # tokens run through the model: every view's prefix and ids, continuations, generations
    gap_sum: float = 0.0
    gap_tokens: int = 0
    embedder_fallback: bool = False
    sources: int = 0
    dropped_sources: int = 0  # matched views past the context budget or of weight 0 (left out of selected_sources_M)


class EmbedderUnavailable(RuntimeError):
    """The embedder did not answer (connection errors, 5xx, no port announced) before the deadline."""


class EmbedderAuthError(RuntimeError):
    """The embedder refused the token (401/403): OPSD_API_TOKEN differs between teacher and embedder.

    Not a reason to fall back: every later group would fall back too, silently.
    """


class EmbedderClient:
    """The embedder's /correspond over HTTP, with the run's bearer token.

    `locate()` gives the embedder's base URL, or None while it has not
    announced one; it is asked before every attempt, so an embedder that
    starts late, or restarts on another port, is picked up. Connection
    errors, timeouts and 5xx are retried with exponential backoff (0.5 s,
    doubling, at most `max_backoff_s`) until `deadline_s` seconds have
    passed since the call began; 4xx is not retried (a bad request, or a
    wrong token, stays one). Each attempt takes at most min(`timeout_s`,
    the time left before the deadline) in all, the answer's body included:
    the body is streamed and the attempt abandoned at the first piece that
    arrives later (httpx's own timeouts bound each read, not their sum, so
    an answer dripping in byte by byte would pass them). A server that
    stalls mid-body is cut by the read timeout, itself at most that budget.
    """

    def __init__(self, locate: Callable[[], str | None], token: str, timeout_s: float, deadline_s: float,
                 max_backoff_s: float = 8.0):
        self.locate = locate
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.max_backoff_s = max_backoff_s
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"})

    def correspond(self, payload: dict) -> dict:
        """POST /correspond with `payload` (a CorrespondRequest as JSON); returns the decoded JSON answer.

        Raises EmbedderAuthError at once for 401/403, httpx.HTTPStatusError at
        once for another 4xx, EmbedderUnavailable when the deadline passes
        without an answer, ValueError for a body that is not JSON.
        """
        start = time.monotonic()
        delay = 0.5
        attempts = 0
        while True:
            attempts += 1
            left = self.deadline_s - (time.monotonic() - start)
            url = self.locate()
            try:
                if url is None:
                    raise EmbedderUnavailable("the embedder has not announced its port")
                r = self._post(f"{url.rstrip('/')}/correspond", payload, min(self.timeout_s, max(left, 0.1)))
                if r.status_code in (401, 403):
                    raise EmbedderAuthError(
                        f"the embedder at {url} answered {r.status_code} {r.reason_phrase}: the teacher's "
                        f"OPSD_API_TOKEN is not the embedder's (start both with the same one; `opsd run` does)")
                r.raise_for_status()
                return r.json()
            except httpx.HTTPStatusError as e:
                if e.response.status_code < 500:
                    raise
                err: Exception = e
            except (httpx.TransportError, EmbedderUnavailable) as e:
                err = e
            left = self.deadline_s - (time.monotonic() - start)
            if left <= 0:
                raise EmbedderUnavailable(
                    f"no answer after {attempts} attempts in {self.deadline_s:.1f}s; last error: {err}") from err
            log.warning("embedder call failed (%s); attempt %d in %.1fs", err, attempts + 1, min(delay, left))
            time.sleep(min(delay, left))
            delay = min(delay * 2, self.max_backoff_s)

    def _post(self, url: str, payload: dict, budget_s: float) -> httpx.Response:
        """One POST whose whole answer (headers and body) arrives within `budget_s` seconds.

        Returns the response with its body read. Raises httpx.ReadTimeout when
        the answer is still arriving after `budget_s`, other httpx.TransportErrors as httpx does.
        """
        end = time.monotonic() + budget_s
        with self.client.stream("POST", url, json=payload, timeout=budget_s) as r:
            raw = bytearray()
            for chunk in r.iter_raw():
                raw += chunk
                if time.monotonic() > end:
                    raise httpx.ReadTimeout(f"the answer was still arriving after {budget_s:.1f}s "
                                            f"({len(raw)} bytes so far)", request=r.request)
            # A plain response over the received bytes: decoded as the headers say, .json() and .text work.
            return httpx.Response(r.status_code, headers=r.headers, content=bytes(raw), request=r.request)


def score_group(
    group: RolloutGroup, backend, chat: ChatFormat, cfg: RunConfig, embedder: EmbedderClient | None,
    guard: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> tuple[ScoredGroup, TeacherStats]:
    """Score one RolloutGroup with the privileged teacher (`backend` + privileged prefix).

    `backend` is the current policy (teacher.source self) or the frozen external teacher (model), whose
    tokenizer is the student's; `cfg.teacher_model.max_model_len` bounds its matched views (pass 2).

    Returns the ScoredGroup (identity and corrected teacher log-probs aligned
    with each trajectory's token ids, 0 off the loss mask) and stats. Needs
    `backend` to hold the group's policy version already. Every privileged
    view of a trajectory's turns is a prefix of `prefix + token_ids_S`, so
    each trajectory costs one cached forward per pass (`backend.branch`;
    one per distinct privileged text with a per-turn hint, env.privileged
    "remaining", see `_privileged_views`):
    pass 1 gives the identity log-probs and the teacher's own response at
    each turn; pass 2 (only where sources matched) scores the targets'
    responses after each source turn's privileged history. Without an
    embedder (methods other than AlignOPSD) there is no generation and no
    pass 2. When the embedder fails, or answers what it cannot have
    computed (`CorrespondResponse.check` fails, or it marks eligible a pair
    outside `correspondence.structural_mask` of the turns sent), every turn falls
    back to its identity view (alpha = 0), `identity_fallback` is set and
    the group is counted in opsd_embedder_fallbacks_total. Raises
    EmbedderAuthError when the embedder refuses the token (401/403).

    Also filled (see `ScoredGroup`): teacher_entropy_S (pass 1, T = 1; None
    from a backend that reports no entropies, vLLM),
    teacher_response_M / student_thinking_M / student_action_M /
    teacher_action_M, cross_logprobs_M (pass 2, [K_t, n_t] per target) and,
    when `cfg.trainer.dump_credit` and the embedder answered, the four
    embedding matrices. A selected source whose matched view does not fit
    `max_model_len` is removed from selected_sources_M[t] (weights
    renormalized; counted in `stats.dropped_sources`), so the ScoredGroup
    lists exactly the views that were rectified with; rho and alpha stay as
    the embedder computed them.

    Each `backend.branch` call (one cached forward) runs under `guard()` (the
    teacher's liveness guard of probes.generate_s).
    """
    t0 = time.perf_counter()
    stats = TeacherStats()
    turns = group.canonical_turns()
    layout = _view_layout(group, chat, cfg.env.privileged)
    budget = cfg.teacher.thinking_max_new_tokens if embedder is not None else 0
    teacher_S, entropy_S, own = _identity_pass(group, backend, chat, cfg, layout, budget, guard, stats)
    student = [group.trajectories[i].turns[k] for i, k in turns]
    texts = _turn_texts(chat, student, [own.get(tk) for tk in turns])
    corr = _no_correspondence(len(turns))
    if embedder is not None and turns:
        _correspond(group, turns, student, texts, embedder, cfg, corr, stats)
    cross = _matched_pass(group, turns, corr.sources, layout, cfg.teacher_model.max_model_len, backend, guard, stats)
    stats.sources = len(cross)
    corrected_S, cross_M = _rectify(group, turns, teacher_S, cross, corr, cfg.credit.alignopsd.aggregation_mode, stats)
    _count_tokens(group, teacher_S, stats)
    student_thinking, teacher_thinking, student_action, teacher_action = texts
    scored = ScoredGroup(
        rollout=group,
        teacher_version=backend.policy_version,
        teacher_logprobs_S=teacher_S,
        corrected_logprobs_S=corrected_S,
        teacher_thinking_M=teacher_thinking,
        similarity_MM=corr.H_MM,
        eligible_MM=corr.elig_MM,
        selected_sources_M=corr.sources,
        source_weights_M=corr.weights,
        rho_M=corr.rho_M,
        alpha_M=corr.alpha_M,
        identity_fallback=stats.embedder_fallback,
        teacher_seconds=time.perf_counter() - t0,
        teacher_forward_tokens=stats.forward_tokens,
        teacher_entropy_S=entropy_S,
        teacher_response_M=[own.get(tk, "") for tk in turns],
        student_thinking_M=student_thinking,
        student_action_M=student_action,
        teacher_action_M=teacher_action,
        cross_logprobs_M=cross_M,
        teacher=f"self:{cfg.teacher.version}" if cfg.teacher.source == "self" else f"model:{cfg.teacher_model.name}",
    )
    if corr.embeddings is not None:
        (scored.student_thinking_emb_MD, scored.teacher_thinking_emb_MD,
         scored.student_action_emb_MD, scored.teacher_action_emb_MD) = corr.embeddings
    scored.validate(backend.vocab_size)
    return scored, stats


@dataclass
class _ViewLayout:
    """Where a group's trajectories sit in their privileged views (`_privileged_views`), for both passes."""

    views: list[list[tuple[list[int], list[int], int]]]  # [i]: trajectory i's (prefix ids, turn indices, ids end)
    bases: list[list[list[int]]]  # [i][v]: view v's privileged prefix + trajectory i's ids (up to its end)
    view_of: dict[tuple[int, int], int]  # (trajectory, turn) -> the view holding the turn
    turn_cuts: list[list[int]]  # [i][k]: privileged prompt length of turn k (where its response starts)


def _view_layout(group: RolloutGroup, chat: ChatFormat, mode: str) -> _ViewLayout:
    """The privileged views of `group` (privileged mode `mode`) and each turn's view and cut in them."""
    trajs = group.trajectories
    views = _privileged_views(group, chat, mode)
    bases = [[pre + t.token_ids_S[:end].tolist() for pre, _, end in views[i]] for i, t in enumerate(trajs)]
    view_of = {(i, k): v for i in range(len(trajs)) for v, (_, ks, _) in enumerate(views[i]) for k in ks}
    turn_cuts = [[len(views[i][view_of[(i, k)]][0]) + rec.response_start for k, rec in enumerate(t.turns)]
                 for i, t in enumerate(trajs)]
    return _ViewLayout(views, bases, view_of, turn_cuts)


def _identity_pass(group: RolloutGroup, backend, chat: ChatFormat, cfg: RunConfig, layout: _ViewLayout, budget: int,
                   guard: Callable[[], ContextManager[Any]], stats: TeacherStats):
    """Pass 1: every trajectory's log-probs under its own privileged history and, with a `budget` of new tokens
    (AlignOPSD), the teacher's own response at each turn.

    Returns (teacher_S, entropy_S, own): per trajectory float32 [S] log-probs and entropies (clipped to
    [0, log V]), 0 off the loss mask (entropy_S None from a backend that reports no entropies, vLLM); own:
    (trajectory, turn) -> the teacher's response text (the chat's prefill included).
    """
    seed = zlib.crc32(group.group_id.encode()) + 7919 * group.task.policy_version
    teacher_S: list[np.ndarray] = []
    entropy_S: list[np.ndarray] | None = []
    own: dict[tuple[int, int], str] = {}
    max_entropy = float(np.log(backend.vocab_size))
    for i, t in enumerate(group.trajectories):
        lp_S = np.zeros(t.token_ids_S.shape[0], dtype=np.float32)
        ent_S: np.ndarray | None = np.zeros_like(lp_S)
        for v, (pre, ks, end) in enumerate(layout.views[i]):
            # No privileged prefix (env.privileged none): the first id has no prefix to be scored after, and
            # is never a loss token (the prompt comes first), so scoring starts at the second.
            skip = 0 if pre else 1
            with guard():
                res = backend.branch(layout.bases[i][v], len(pre) + skip,
                                     [layout.turn_cuts[i][k] for k in ks] if budget else [],
                                     generate_tokens=budget, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, seed=seed + i + 104729 * v, return_entropy=True,
                                     **_loss_tokens_only(backend, t, ks, end, skip))
            ent_S = _keep_view_turns(t, ks, skip, res, lp_S, ent_S)
            stats.forward_tokens += len(layout.bases[i][v])
            for k, g in zip(ks if budget else [], res.generations):
                if g is not None:
                    own[(i, k)] = chat.prefill_text + decode(backend.tokenizer, g.token_ids)
                    stats.generated_tokens += len(g.token_ids)
                    stats.forward_tokens += len(g.token_ids)
        teacher_S.append(np.where(t.loss_mask_S == 1, lp_S, 0.0).astype(np.float32))
        if ent_S is None:
            entropy_S = None
        elif entropy_S is not None:
            entropy_S.append(np.where(t.loss_mask_S == 1, np.clip(ent_S, 0.0, max_entropy), 0.0).astype(np.float32))
    return teacher_S, entropy_S, own


def _keep_view_turns(traj, ks: list[int], skip: int, res, lp_S: np.ndarray, ent_S: np.ndarray | None):
    """Copy the log-probs (into `lp_S`) and entropies (into `ent_S`) of turns `ks` from one view's `branch`
    result `res`, whose scores start `skip` ids into the trajectory; a view holds only its own turns' responses.

    Returns `ent_S`, or None once a view came without entropies."""
    own_lp = np.r_[np.zeros(skip, np.float32), np.asarray(res.base_logprobs, dtype=np.float32)]
    own_ent = None if res.base_entropies is None else np.r_[
        np.zeros(skip, np.float32), np.asarray(res.base_entropies, dtype=np.float32)]
    for k in ks:
        sl = traj.response_slice(k)
        lp_S[sl] = own_lp[sl]
        if own_ent is None:
            ent_S = None
        elif ent_S is not None:
            ent_S[sl] = own_ent[sl]
    return ent_S


def _turn_texts(chat: ChatFormat, student: list, teacher_own: list[str | None]) -> tuple[list[str], ...]:
    """Per canonical turn: (student thinking, teacher thinking, student action, teacher action), the texts the
    embedder compares. `student`: the student's turn records; `teacher_own`: the teacher's response text of each
    turn, None where it generated none. Action-only format: the action text stands in for the thinking; an
    invalid response's thinking is ""."""
    use_action = chat.prompt_format == "action"
    teacher_parsed = [parse_response(r, chat.prompt_format) if r is not None else None for r in teacher_own]
    teacher_thinking = [(p.action if use_action else p.thinking) if p and p.valid else "" for p in teacher_parsed]
    student_thinking = [(s.action if use_action else s.thinking) if s.format_valid else "" for s in student]
    teacher_action = [p.action if p else "" for p in teacher_parsed]
    return student_thinking, teacher_thinking, [s.action for s in student], teacher_action


@dataclass
class _Correspondence:
    """The embedder's answer for a group's M canonical turns (`CorrespondResponse`), as arrays; no sources and
    alpha 0 (identity views only) until it answers."""

    H_MM: np.ndarray
    elig_MM: np.ndarray
    sources: list[list[int]]
    weights: list[list[float]]
    rho_M: np.ndarray
    alpha_M: np.ndarray
    embeddings: list[np.ndarray] | None = None  # [M, D] student/teacher thinking, student/teacher action


def _no_correspondence(M: int) -> _Correspondence:
    """What an unasked or failed embedder leaves for M turns: identity views only."""
    return _Correspondence(np.zeros((M, M), dtype=np.float32), np.zeros((M, M), dtype=bool), [[] for _ in range(M)],
                           [[] for _ in range(M)], np.zeros(M, dtype=np.float32), np.zeros(M, dtype=np.float32))


def _correspond(group: RolloutGroup, turns: list[tuple[int, int]], student: list, texts: tuple[list[str], ...],
                embedder: EmbedderClient, cfg: RunConfig, corr: _Correspondence, stats: TeacherStats) -> None:
    """Ask the embedder for the correspondences of the group's turns and fill `corr` with its answer.

    An answer the embedder cannot have computed (`CorrespondResponse.check`, or eligible pairs outside the
    structural mask of what was sent), or no answer, leaves `corr` as it was: `_fall_back`. Raises
    EmbedderAuthError (not caught: a wrong token fails the job, loudly, instead of every group falling back).
    """
    M = len(turns)
    payload = _correspond_payload(group, turns, student, texts, cfg)
    # Eligibility as the embedder computes it (spec 4.1), from what we sent it:
    # an answer pairing a turn with itself or a sibling turn of its own rollout is garbage.
    sent = payload["turns"]
    own_elig_MM = correspondence.structural_mask(
        [group.group_id] * M, [t["rollout_id"] for t in sent], [t["data_source"] for t in sent],
        np.array([t["student_valid"] for t in sent]), np.array([t["teacher_valid"] for t in sent]))
    try:
        resp = CorrespondResponse.model_validate(embedder.correspond(payload)).check(M)
        # check() keeps every source inside the answer's eligibility; this keeps that inside ours.
        if (np.asarray(resp.eligible, dtype=bool) & ~own_elig_MM).any():
            raise ValueError("eligible pairs outside the structural mask (same rollout, other task or data "
                             "source, invalid thinking)")
        corr.H_MM = np.asarray(resp.similarity, dtype=np.float32)
        corr.elig_MM = np.asarray(resp.eligible, dtype=bool)
        corr.sources, corr.weights = resp.selected_sources, resp.source_weights
        corr.rho_M = np.asarray(resp.rho, dtype=np.float32)
        corr.alpha_M = np.asarray(resp.alpha, dtype=np.float32)
        if resp.student_thinking_emb is not None:
            corr.embeddings = [np.asarray(v, dtype=np.float32).reshape(M, -1) for v in (
                resp.student_thinking_emb, resp.teacher_thinking_emb, resp.student_action_emb, resp.teacher_action_emb)]
            for emb_MD, txt in zip(corr.embeddings, texts):
                emb_MD[[not x for x in txt]] = 0.0  # empty/invalid text embeds to zero (the embedder does so too)
    except (httpx.HTTPError, EmbedderUnavailable, ValueError) as e:  # pydantic's ValidationError is a ValueError
        _fall_back(group, e, stats)


def _correspond_payload(group: RolloutGroup, turns: list[tuple[int, int]], student: list,
                        texts: tuple[list[str], ...], cfg: RunConfig) -> dict:
    """The CorrespondRequest (as JSON) for the group's canonical turns."""
    student_thinking, teacher_thinking, _, teacher_action = texts
    trajs = group.trajectories
    return {
        "task_id": group.group_id,
        "align": cfg.credit.alignopsd.model_dump(),
        "turns": [
            {
                "rollout_id": trajs[i].rollout_id,
                "turn_id": k,
                "data_source": group.task.env,
                "student_text": student_thinking[m],
                "teacher_text": teacher_thinking[m],
                "student_valid": bool(s.format_valid and student_thinking[m]),
                "teacher_valid": bool(teacher_thinking[m]),
                "student_action": s.action,
                "teacher_action": teacher_action[m],
            }
            for m, ((i, k), s) in enumerate(zip(turns, student))
        ],
        "return_embeddings": bool(cfg.trainer.dump_credit),
    }


def _fall_back(group: RolloutGroup, err: Exception, stats: TeacherStats) -> None:
    """The embedder did not answer, or answered garbage: the group is scored with identity views only."""
    log.warning("group %s: embedder unavailable or its answer unusable (%s); identity views only",
                group.group_id, err)
    stats.embedder_fallback = True
    metrics.EMBEDDER_FALLBACKS.labels("teacher").inc()


def _matched_pass(group: RolloutGroup, turns: list[tuple[int, int]], sources: list[list[int]], layout: _ViewLayout,
                  max_len: int, backend, guard: Callable[[], ContextManager[Any]],
                  stats: TeacherStats) -> dict[tuple[int, int], np.ndarray]:
    """Pass 2: each target's response under each matched source turn's privileged history, one cached forward
    per source view. Returns (target row, source row) -> log-probs [response]; a pair whose view does not fit
    `max_len` is left out."""
    trajs = group.trajectories
    wanted: dict[tuple[int, int], dict[int, list[int]]] = {}  # (source trajectory, view) -> source turn -> target rows
    for t, (ti, tk) in enumerate(turns):
        n_resp = trajs[ti].turns[tk].response_end - trajs[ti].turns[tk].response_start
        for s in sources[t]:
            si, sk = turns[s]
            if layout.turn_cuts[si][sk] + n_resp <= max_len:  # a view past the context budget is dropped
                wanted.setdefault((si, layout.view_of[(si, sk)]), {}).setdefault(sk, []).append(t)
    cross: dict[tuple[int, int], np.ndarray] = {}
    row_of = {turns[m]: m for m in range(len(turns))}
    for (si, v), by_turn in wanted.items():
        ks = sorted(by_turn)
        conts = [[trajs[turns[t][0]].token_ids_S[trajs[turns[t][0]].response_slice(turns[t][1])].tolist() for t in by_turn[k]] for k in ks]
        # start = len(base): only the prefix up to the last cut is run again, nothing re-scored.
        base = layout.bases[si][v]
        with guard():
            res = backend.branch(base, len(base), [layout.turn_cuts[si][k] for k in ks], continuations=conts)
        stats.forward_tokens += max(layout.turn_cuts[si][k] for k in ks) + sum(len(c) for cs in conts for c in cs)
        for k, lps in zip(ks, res.continuation_logprobs):
            for t, lp in zip(by_turn[k], lps):
                cross[(t, row_of[(si, k)])] = lp
    return cross


def _rectify(group: RolloutGroup, turns: list[tuple[int, int]], teacher_S: list[np.ndarray],
             cross: dict[tuple[int, int], np.ndarray], corr: _Correspondence, aggregation_mode: str,
             stats: TeacherStats) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Rectification per target turn: corrected teacher = (1 - alpha) identity + alpha aggregate of its sources.

    Sources without a matched view (past the context budget) or of weight 0 are dropped from `corr` (weights
    renormalized). Returns (corrected_S per trajectory, cross_M: [K_t, n_t] log-probs per target)."""
    trajs = group.trajectories
    corrected_S = [arr.copy() for arr in teacher_S]
    cross_M: list[np.ndarray] = []
    for t, (i, k) in enumerate(turns):
        # A weight-0 source changes nothing in either aggregation mode (and log 0 would): leave it out too.
        kept = [(s, w) for s, w in zip(corr.sources[t], corr.weights[t]) if (t, s) in cross and w > 0]
        stats.dropped_sources += len(corr.sources[t]) - len(kept)
        sl = trajs[i].response_slice(k)
        n_t = sl.stop - sl.start
        w_K = np.asarray([w for _, w in kept], dtype=np.float32)
        w_K = w_K / w_K.sum() if kept else w_K
        corr.sources[t], corr.weights[t] = [s for s, _ in kept], [float(w) for w in w_K]
        cross_KL = np.stack([cross[(t, s)] for s, _ in kept]).astype(np.float32) if kept else np.zeros((0, n_t), np.float32)
        cross_M.append(cross_KL)
        if not kept or corr.alpha_M[t] == 0:
            continue
        _, corrected_L = correspondence.rectify(teacher_S[i][sl], cross_KL, w_K, float(corr.alpha_M[t]), aggregation_mode)
        corrected_S[i][sl] = np.where(trajs[i].loss_mask_S[sl] == 1, corrected_L, 0.0)
    return corrected_S, cross_M


def _count_tokens(group: RolloutGroup, teacher_S: list[np.ndarray], stats: TeacherStats) -> None:
    """Add the group's scored tokens and its teacher-sampler log-prob gap on loss tokens to `stats`."""
    for t, lp in zip(group.trajectories, teacher_S):
        mask = t.loss_mask_S == 1
        stats.gap_sum += float((lp[mask] - t.sampler_logprobs_S[mask]).sum())
        stats.gap_tokens += int(mask.sum())
        stats.scored_tokens += int(t.token_ids_S.shape[0])


def _privileged_views(group: RolloutGroup, chat: ChatFormat, mode: str) -> list[list[tuple[list[int], list[int], int]]]:
    """Per trajectory, its teacher views as (privileged prefix ids, turn indices, ids end).

    Turns whose privileged text is the same share one view, scored in one forward over
    ``prefix + token_ids_S[:end]`` (end: S for a view holding every turn, else its last
    turn's response end). With a task-level privileged context (EnvSection.privileged
    skills / walkthrough / both) that is one view per trajectory; with the per-turn modes
    ("remaining", "skills+remaining") each distinct remaining walkthrough is its own view
    (`opsd.skills.turn_privileged_text`); "none": the empty prefix, the student's own prompt.
    A trajectory without turns has no view.
    """
    cache: dict[str, list[int]] = {}
    out = []
    for t in group.trajectories:
        by_text: dict[str, list[int]] = {}
        for k, rec in enumerate(t.turns):
            by_text.setdefault(turn_privileged_text(group.task.privileged_info, rec.hint, mode), []).append(k)
        views = []
        for text, ks in by_text.items():
            if text not in cache:
                cache[text] = [] if mode == "none" else chat.privileged_prefix_ids(text)
            end = t.token_ids_S.shape[0] if len(ks) == len(t.turns) else t.turns[ks[-1]].response_end
            views.append((cache[text], ks, end))
        out.append(views)
    return out


def _loss_tokens_only(backend, traj, turns: list[int], end: int, skip: int = 0) -> dict:
    """`branch`'s score_mask for one view: only its turns' loss tokens are read from the result, so a
    backend that takes the mask (HFBackend.SCORES_MASKED) skips the LM head, log_softmax and entropy of
    every other position (~11% of a quickstart teacher step). {} for one that scores every position.
    skip: leading trajectory ids not scored (1 when the view has no privileged prefix)."""
    if not getattr(backend, "SCORES_MASKED", False):
        return {}
    want = np.zeros(end, dtype=bool)
    for k in turns:
        want[traj.response_slice(k)] = True
    return {"score_mask": (want & (traj.loss_mask_S[:end] == 1))[skip:]}
