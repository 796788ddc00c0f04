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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx
import numpy as np

from opsd.chat import ChatFormat, decode, parse_response
from opsd.config import RunConfig
from opsd.credit import alignopsd
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


class EmbedderClient:
    """httpx client for the embedder's /correspond, with retries and exponential backoff."""

    def __init__(self, base_url: str, timeout_s: float, retries: int):
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.retries = retries

    def correspond(self, payload: dict) -> dict:
        """POST /correspond; raises httpx.HTTPError after `retries` failed retries."""
        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                r = self.client.post("/correspond", json=payload)
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError as e:
                # 4xx is our bug or bad input: retrying cannot help.
                if isinstance(e, httpx.HTTPStatusError) and e.response.status_code < 500:
                    raise
                if attempt == self.retries:
                    raise
                log.warning("embedder call failed (%s); retry %d in %.1fs", e, attempt + 1, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")


def score_group(
    group: RolloutGroup, backend, chat: ChatFormat, cfg: RunConfig, embedder: EmbedderClient | None
) -> tuple[ScoredGroup, TeacherStats]:
    """Score one RolloutGroup with the privileged teacher (the current policy + privileged prefix).

    Returns the ScoredGroup (identity and corrected teacher log-probs aligned
    with each trajectory's token ids, 0 off the loss mask) and stats. Needs
    `backend` to hold the group's policy version already. When the embedder
    is None or fails, every turn falls back to its identity view (alpha = 0)
    and `identity_fallback` is set.
    """
    t0 = time.perf_counter()
    stats = TeacherStats()
    max_len = cfg.model.max_model_len
    prefix = chat.privileged_prefix_ids(group.task.privileged_info)
    trajs = group.trajectories
    turns = group.canonical_turns()
    M = len(turns)

    def prompt_of(i: int, k: int) -> list[int]:
        return trajs[i].token_ids_S[: trajs[i].turns[k].response_start].tolist()

    def response_of(i: int, k: int) -> list[int]:
        return trajs[i].token_ids_S[trajs[i].response_slice(k)].tolist()

    # 2. Privileged generation for every turn whose view fits the context.
    budget = cfg.teacher.thinking_max_new_tokens
    views = [prefix + prompt_of(i, k) for i, k in turns]
    fits = [m for m in range(M) if len(views[m]) + budget <= max_len]
    teacher_text = [""] * M
    teacher_parsed = [None] * M
    if fits:
        gens = backend.generate([views[m] for m in fits], budget, cfg.rollout.temperature, cfg.rollout.top_p)
        for m, g in zip(fits, gens):
            teacher_text[m] = chat.prefill_text + decode(backend.tokenizer, g.token_ids)
            teacher_parsed[m] = parse_response(teacher_text[m], chat.prompt_format)
            stats.generated_tokens += len(g.token_ids)

    # 3. Correspondences. Action-only format: the action text stands in for the thinking.
    use_action = chat.prompt_format == "action"
    student = [trajs[i].turns[k] for i, k in turns]
    teacher_thinking = [(p.action if use_action else p.thinking) if p and p.valid else "" for p in teacher_parsed]
    sources: list[list[int]] = [[] for _ in range(M)]
    weights: list[list[float]] = [[] for _ in range(M)]
    H_MM = np.zeros((M, M), dtype=np.float32)
    elig_MM = np.zeros((M, M), dtype=bool)
    rho_M = np.zeros(M, dtype=np.float32)
    alpha_M = np.zeros(M, dtype=np.float32)
    if embedder is not None:
        payload = {
            "task_id": group.group_id,
            "align": cfg.credit.alignopsd.model_dump(),
            "turns": [
                {
                    "rollout_id": trajs[i].rollout_id,
                    "turn_id": k,
                    "data_source": group.task.env,
                    "student_text": (s.action if use_action else s.thinking) if s.format_valid else "",
                    "teacher_text": teacher_thinking[m],
                    "student_valid": bool(s.format_valid and (s.action if use_action else s.thinking)),
                    "teacher_valid": bool(teacher_thinking[m]),
                    "student_action": s.action,
                    "teacher_action": teacher_parsed[m].action if teacher_parsed[m] else "",
                }
                for m, ((i, k), s) in enumerate(zip(turns, student))
            ],
        }
        try:
            resp = embedder.correspond(payload)
            H_MM = np.asarray(resp["similarity"], dtype=np.float32).reshape(M, M)
            elig_MM = np.asarray(resp["eligible"], dtype=bool).reshape(M, M)
            sources = [list(map(int, s)) for s in resp["selected_sources"]]
            weights = [list(map(float, w)) for w in resp["source_weights"]]
            rho_M = np.asarray(resp["rho"], dtype=np.float32)
            alpha_M = np.asarray(resp["alpha"], dtype=np.float32)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            log.warning("group %s: embedder unavailable (%s); identity views only", group.group_id, e)
            stats.embedder_fallback = True

    # 4a. Identity view: one forward per trajectory covers all of its turns.
    seqs = [prefix + t.token_ids_S.tolist() for t in trajs]
    identity = backend.score(seqs, [len(prefix)] * len(trajs), batch_size=cfg.teacher.score_batch_size)
    teacher_S = [np.where(t.loss_mask_S == 1, lp, 0.0).astype(np.float32) for t, lp in zip(trajs, identity)]

    # 4b. Matched views: target t's response under source s's privileged history.
    pairs = [(t, s) for t in range(M) for s in sources[t]]
    cross_seqs, cross_starts, keep = [], [], []
    for t, s in pairs:
        ctx = prefix + prompt_of(*turns[s])
        seq = ctx + response_of(*turns[t])
        if len(seq) <= max_len:
            cross_seqs.append(seq)
            cross_starts.append(len(ctx))
            keep.append((t, s))
    cross = backend.score(cross_seqs, cross_starts, batch_size=cfg.teacher.score_batch_size) if cross_seqs else []
    cross_by_pair = dict(zip(keep, cross))
    stats.sources = len(keep)

    # 5. Rectification per target turn (sources that did not fit are dropped, weights renormalized).
    corrected_S = [arr.copy() for arr in teacher_S]
    for t, (i, k) in enumerate(turns):
        sl = trajs[i].response_slice(k)
        ident_L = teacher_S[i][sl]
        kept = [(s, w) for s, w in zip(sources[t], weights[t]) if (t, s) in cross_by_pair]
        if not kept or alpha_M[t] == 0:
            continue
        w_K = np.asarray([w for _, w in kept], dtype=np.float32)
        w_K = w_K / w_K.sum()
        cross_KL = np.stack([cross_by_pair[(t, s)] for s, _ in kept]).astype(np.float32)
        _, corrected_L = alignopsd.rectify(
            ident_L, cross_KL, w_K, float(alpha_M[t]), cfg.credit.alignopsd.aggregation_mode
        )
        mask_L = trajs[i].loss_mask_S[sl] == 1
        corrected_S[i][sl] = np.where(mask_L, corrected_L, 0.0)

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
    )
    scored.validate(backend.vocab_size)
    return scored, stats
