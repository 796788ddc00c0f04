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
    max_len = cfg.teacher_model.max_model_len
    trajs = group.trajectories
    turns = group.canonical_turns()
    M = len(turns)
    views = _privileged_views(group, chat, cfg.env.privileged)
    # bases[i][v]: view v's privileged prefix + trajectory i's ids (up to its last turn's response).
    bases = [[pre + t.token_ids_S[:end].tolist() for pre, _, end in views[i]] for i, t in enumerate(trajs)]
    view_of = {(i, k): v for i in range(len(trajs)) for v, (_, ks, _) in enumerate(views[i]) for k in ks}
    turn_cuts = [[len(views[i][view_of[(i, k)]][0]) + rec.response_start for k, rec in enumerate(t.turns)]
                 for i, t in enumerate(trajs)]  # privileged prompt lengths
    seed = zlib.crc32(group.group_id.encode()) + 7919 * group.task.policy_version

    # Pass 1: identity log-probs of every trajectory, and (AlignOPSD) the teacher's own response per turn.
    budget = cfg.teacher.thinking_max_new_tokens if embedder is not None else 0
    teacher_S: list[np.ndarray] = []
    entropy_S: list[np.ndarray] | None = []  # None when the backend reports no entropies (vLLM)
    own: dict[tuple[int, int], str] = {}
    max_entropy = float(np.log(backend.vocab_size))
    for i, t in enumerate(trajs):
        lp_S = np.zeros(t.token_ids_S.shape[0], dtype=np.float32)
        ent_S: np.ndarray | None = np.zeros_like(lp_S)
        for v, (pre, ks, end) in enumerate(views[i]):
            # No privileged prefix (env.privileged none): the first id has no prefix to be scored after, and
            # is never a loss token (the prompt comes first), so scoring starts at the second.
            skip = 0 if pre else 1
            with guard():
                res = backend.branch(bases[i][v], len(pre) + skip, [turn_cuts[i][k] for k in ks] if budget else [],
                                     generate_tokens=budget, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, seed=seed + i + 104729 * v, return_entropy=True,
                                     **_loss_tokens_only(backend, t, ks, end, skip))
            own_lp = np.r_[np.zeros(skip, np.float32), np.asarray(res.base_logprobs, dtype=np.float32)]
            own_ent = None if res.base_entropies is None else np.r_[
                np.zeros(skip, np.float32), np.asarray(res.base_entropies, dtype=np.float32)]
            for k in ks:  # a view holds only its own turns' responses
                sl = t.response_slice(k)
                lp_S[sl] = own_lp[sl]
                if own_ent is None:
                    ent_S = None
                elif ent_S is not None:
                    ent_S[sl] = own_ent[sl]
            for k, g in zip(ks if budget else [], res.generations):
                if g is not None:
                    own[(i, k)] = chat.prefill_text + decode(backend.tokenizer, g.token_ids)
                    stats.generated_tokens += len(g.token_ids)
        teacher_S.append(np.where(t.loss_mask_S == 1, lp_S, 0.0).astype(np.float32))
        if ent_S is None:
            entropy_S = None
        elif entropy_S is not None:
            entropy_S.append(np.where(t.loss_mask_S == 1, np.clip(ent_S, 0.0, max_entropy), 0.0).astype(np.float32))
    teacher_parsed = [parse_response(own[(i, k)], chat.prompt_format) if (i, k) in own else None for i, k in turns]

    # Correspondences. Action-only format: the action text stands in for the thinking.
    use_action = chat.prompt_format == "action"
    student = [trajs[i].turns[k] for i, k in turns]
    teacher_thinking = [(p.action if use_action else p.thinking) if p and p.valid else "" for p in teacher_parsed]
    student_thinking = [(s.action if use_action else s.thinking) if s.format_valid else "" for s in student]
    teacher_action = [p.action if p else "" for p in teacher_parsed]
    embeddings: list[np.ndarray] | None = None
    sources: list[list[int]] = [[] for _ in range(M)]
    weights: list[list[float]] = [[] for _ in range(M)]
    H_MM = np.zeros((M, M), dtype=np.float32)
    elig_MM = np.zeros((M, M), dtype=bool)
    rho_M = np.zeros(M, dtype=np.float32)
    alpha_M = np.zeros(M, dtype=np.float32)
    if embedder is not None and M:
        payload = {
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
            H_MM = np.asarray(resp.similarity, dtype=np.float32)
            elig_MM = np.asarray(resp.eligible, dtype=bool)
            sources, weights = resp.selected_sources, resp.source_weights
            rho_M = np.asarray(resp.rho, dtype=np.float32)
            alpha_M = np.asarray(resp.alpha, dtype=np.float32)
            if resp.student_thinking_emb is not None:
                texts = (student_thinking, teacher_thinking, [s.action for s in student], teacher_action)
                embeddings = [np.asarray(v, dtype=np.float32).reshape(M, -1) for v in (
                    resp.student_thinking_emb, resp.teacher_thinking_emb, resp.student_action_emb, resp.teacher_action_emb)]
                for emb_MD, txt in zip(embeddings, texts):
                    emb_MD[[not x for x in txt]] = 0.0  # empty/invalid text embeds to zero (the embedder does so too)
        # EmbedderAuthError is not caught: a wrong token fails the job, loudly, instead of every group falling back.
        except (httpx.HTTPError, EmbedderUnavailable, ValueError) as e:  # pydantic's ValidationError is a ValueError
            log.warning("group %s: embedder unavailable or its answer unusable (%s); identity views only",
                        group.group_id, e)
            stats.embedder_fallback = True
            metrics.EMBEDDER_FALLBACKS.labels("teacher").inc()

    # Pass 2: each target's response under each matched source turn's privileged history.
    wanted: dict[tuple[int, int], dict[int, list[int]]] = {}  # (source trajectory, view) -> source turn -> target rows
    for t, (ti, tk) in enumerate(turns):
        n_resp = trajs[ti].turns[tk].response_end - trajs[ti].turns[tk].response_start
        for s in sources[t]:
            si, sk = turns[s]
            if turn_cuts[si][sk] + n_resp <= max_len:  # a view past the context budget is dropped
                wanted.setdefault((si, view_of[(si, sk)]), {}).setdefault(sk, []).append(t)
    cross: dict[tuple[int, int], np.ndarray] = {}  # (target row, source row) -> log-probs [response]
    row_of = {turns[m]: m for m in range(M)}
    for (si, v), by_turn in wanted.items():
        ks = sorted(by_turn)
        conts = [[trajs[turns[t][0]].token_ids_S[trajs[turns[t][0]].response_slice(turns[t][1])].tolist() for t in by_turn[k]] for k in ks]
        # start = len(base): only the prefix up to the last cut is run again, nothing re-scored.
        base = bases[si][v]
        with guard():
            res = backend.branch(base, len(base), [turn_cuts[si][k] for k in ks], continuations=conts)
        for k, lps in zip(ks, res.continuation_logprobs):
            for t, lp in zip(by_turn[k], lps):
                cross[(t, row_of[(si, k)])] = lp
    stats.sources = len(cross)

    # Rectification per target turn (sources that did not fit are dropped, weights renormalized).
    corrected_S = [arr.copy() for arr in teacher_S]
    cross_M: list[np.ndarray] = []
    for t, (i, k) in enumerate(turns):
        # A weight-0 source changes nothing in either aggregation mode (and log 0 would): leave it out too.
        kept = [(s, w) for s, w in zip(sources[t], weights[t]) if (t, s) in cross and w > 0]
        stats.dropped_sources += len(sources[t]) - len(kept)
        sl = trajs[i].response_slice(k)
        n_t = sl.stop - sl.start
        w_K = np.asarray([w for _, w in kept], dtype=np.float32)
        w_K = w_K / w_K.sum() if kept else w_K
        sources[t], weights[t] = [s for s, _ in kept], [float(w) for w in w_K]
        cross_KL = np.stack([cross[(t, s)] for s, _ in kept]).astype(np.float32) if kept else np.zeros((0, n_t), np.float32)
        cross_M.append(cross_KL)
        if not kept or alpha_M[t] == 0:
            continue
        _, corrected_L = correspondence.rectify(
            teacher_S[i][sl], cross_KL, w_K, float(alpha_M[t]), cfg.credit.alignopsd.aggregation_mode
        )
        corrected_S[i][sl] = np.where(trajs[i].loss_mask_S[sl] == 1, corrected_L, 0.0)

    for t, lp in zip(trajs, teacher_S):
        mask = t.loss_mask_S == 1
        stats.gap_sum += float((lp[mask] - t.sampler_logprobs_S[mask]).sum())
        stats.gap_tokens += int(mask.sum())
        stats.scored_tokens += int(t.token_ids_S.shape[0])

    scored = ScoredGroup(
        rollout=group,
        teacher_version=backend.policy_version,
        teacher_logprobs_S=teacher_S,
        corrected_logprobs_S=corrected_S,
        teacher_thinking_M=teacher_thinking,
        similarity_MM=H_MM,
        eligible_MM=elig_MM,
        selected_sources_M=sources,
        source_weights_M=weights,
        rho_M=rho_M,
        alpha_M=alpha_M,
        identity_fallback=stats.embedder_fallback,
        teacher_seconds=time.perf_counter() - t0,
        teacher_entropy_S=entropy_S,
        teacher_response_M=[own.get(tk, "") for tk in turns],
        student_thinking_M=student_thinking,
        student_action_M=[s.action for s in student],
        teacher_action_M=teacher_action,
        cross_logprobs_M=cross_M,
        teacher=f"self:{cfg.teacher.version}" if cfg.teacher.source == "self" else f"model:{cfg.teacher_model.name}",
    )
    if embeddings is not None:
        (scored.student_thinking_emb_MD, scored.teacher_thinking_emb_MD,
         scored.student_action_emb_MD, scored.teacher_action_emb_MD) = embeddings
    scored.validate(backend.vocab_size)
    return scored, stats


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
