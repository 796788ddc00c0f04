"""The privileged teacher on a real group: identity and matched views score exactly the sampled ids.

Real SmolLM2 and a real TextWorld game; the embedder is replaced by a fixed
correspondence (a narrow stand-in: its own service is tested in test_embedder.py).
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RunConfig
from opsd.credit.alignopsd.correspondence import rectify
from opsd.credit.policy_loss import entropy_from_logits
from opsd.envs.textworld import make_games
from opsd.types import ScoredGroup, TaskGroup
from opsd.wire import decode, encode
from services.rollout.episodes import run_group
from services.teacher.scoring import score_group

ENV = EnvSection(game_pool=1, seed=1234, max_turns=2)


@pytest.fixture(scope="module")
def backend(policy_backend):
    return policy_backend


@pytest.fixture(scope="module")
def cfg():
    return RunConfig.model_validate({"env": ENV.model_dump(), "rollout": {"group_size": 2, "max_new_tokens": 10},
                                     "teacher": {"thinking_max_new_tokens": 8}})


@pytest.fixture(scope="module")
def group(backend, cfg, tmp_path_factory):
    game = make_games(ENV, tmp_path_factory.mktemp("games"))[0]
    task = TaskGroup(group_id="g-teacher", task_id=game.task_id, step=0, policy_version=0, group_size=2,
                     env="textworld", game=game.to_dict(), privileged_info=game.privileged_info(), max_turns=2)
    chat = ChatFormat(backend.tokenizer, "action")
    grp, _ = run_group(task, backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed=3)
    assert sum(len(t.turns) for t in grp.trajectories) >= 2
    return grp


def structural_eligibility(turns: list[dict]) -> list[list[bool]]:
    """eligible[s][t] as spec 4.1 defines it, from a /correspond payload's turns (one task, one data source)."""
    return [[src["rollout_id"] != tgt["rollout_id"] and src["teacher_valid"] and tgt["student_valid"]
             for tgt in turns] for src in turns]


class FixedEmbedder:
    """Matches every target turn to the first eligible turn of the other rollout with weight 1, alpha 0.5.

    zero_weight_source: also list the other rollout's last eligible turn (when it differs) with weight 0.
    edit: a function (payload, answer) -> answer that spoils the answer before it is returned.
    """

    def __init__(self, fail: bool = False, zero_weight_source: bool = False, edit=None):
        self.fail = fail
        self.zero_weight_source = zero_weight_source
        self.edit = edit
        self.payload = None

    def correspond(self, payload):
        if self.fail:
            raise httpx.ConnectError("embedder down")
        self.payload = payload
        turns = payload["turns"]
        M = len(turns)
        elig = structural_eligibility(turns)
        sources, weights = [], []
        for t in range(M):
            ok = [s for s in range(M) if elig[s][t]]
            sources.append(ok[:1])
            weights.append([1.0] if ok else [])
            if self.zero_weight_source and len(ok) > 1 and turns[ok[-1]]["rollout_id"] == turns[ok[0]]["rollout_id"]:
                sources[t].append(ok[-1])
                weights[t].append(0.0)
        answer = {"similarity": np.eye(M).tolist(), "eligible": elig, "selected_sources": sources,
                  "source_weights": weights, "rho": [0.625] * M, "alpha": [0.5] * M}
        return self.edit(payload, answer) if self.edit else answer


def test_identity_and_matched_views(backend, cfg, group):
    chat = ChatFormat(backend.tokenizer, "action")
    emb = FixedEmbedder()
    scored, stats = score_group(group, backend, chat, cfg, emb)
    prefix = chat.privileged_prefix_ids(group.task.privileged_info)
    assert prefix == backend.tokenizer("[Privileged Skill Information]\n" + group.task.privileged_info + "\n\n")["input_ids"]
    turns = group.canonical_turns()
    # Identity view: the privileged prefix, then the trajectory's exact ids, scored at T = 1.
    for i, traj in enumerate(group.trajectories):
        ref = backend.score([prefix + traj.token_ids_S.tolist()], [len(prefix)])[0]
        m = traj.loss_mask_S == 1
        assert np.allclose(scored.teacher_logprobs_S[i][m], ref[m], atol=1e-4)
        assert not scored.teacher_logprobs_S[i][~m].any()
    # Matched view of target t under source s: s's privileged history + t's exact response ids.
    for t, (ti, tk) in enumerate(turns):
        (s,) = scored.selected_sources_M[t]
        si, sk = turns[s]
        src, tgt = group.trajectories[si], group.trajectories[ti]
        sl = tgt.response_slice(tk)
        ctx = prefix + src.token_ids_S[: src.turns[sk].response_start].tolist()
        cross = backend.score([ctx + tgt.token_ids_S[sl].tolist()], [len(ctx)])[0]
        ident = scored.teacher_logprobs_S[ti][sl]
        # probability_mixture with one source of weight 1 is that source's log-prob.
        expect = 0.5 * ident + 0.5 * cross
        m = tgt.loss_mask_S[sl] == 1
        assert np.allclose(scored.corrected_logprobs_S[ti][sl][m], expect[m], atol=1e-4)
    # The embedder saw the student's action texts (action-only format) and the teacher's own responses.
    sent = emb.payload["turns"]
    assert [t["student_action"] for t in sent] == [group.trajectories[i].turns[k].action for i, k in turns]
    assert stats.generated_tokens > 0 and not scored.identity_fallback
    # Compute counted (issue 41): every view (prefix + ids), the teacher's own tokens, and per matched source
    # trajectory its history up to its last matched turn plus every target response scored after it.
    by_source: dict[int, tuple[int, int]] = {}
    for t, (ti, tk) in enumerate(turns):
        for s in scored.selected_sources_M[t]:
            si, sk = turns[s]
            cut, n = by_source.get(si, (0, 0))
            resp = group.trajectories[ti].turns[tk]
            by_source[si] = (max(cut, len(prefix) + group.trajectories[si].turns[sk].response_start),
                             n + resp.response_end - resp.response_start)
    want = (sum(len(prefix) + t.token_ids_S.shape[0] for t in group.trajectories) + stats.generated_tokens
            + sum(c + n for c, n in by_source.values()))
    assert by_source and scored.teacher_forward_tokens == stats.forward_tokens == want
    # The dump texts are what the embedder was sent; the teacher's responses start with the prefill.
    assert scored.student_thinking_M == [t["student_text"] for t in sent]
    assert scored.teacher_thinking_M == [t["teacher_text"] for t in sent]
    assert scored.student_action_M == [t["student_action"] for t in sent]
    assert scored.teacher_action_M == [t["teacher_action"] for t in sent]
    assert all(r.startswith(chat.prefill_text) for r in scored.teacher_response_M)
    # No dump configured: the embeddings are not asked for, nor carried.
    assert emb.payload["return_embeddings"] is False and scored.student_thinking_emb_MD is None
    check_cross_logprobs(backend, group, scored, prefix, cfg)
    check_teacher_entropy(backend, group, scored, prefix)
    back = decode(encode(scored), ScoredGroup, 1 << 24, vocab_size=backend.vocab_size)
    for a, b in zip(back.cross_logprobs_M + back.teacher_entropy_S, scored.cross_logprobs_M + scored.teacher_entropy_S):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def check_cross_logprobs(backend, group, scored, prefix, cfg):
    """cross_logprobs_M[t] = t's whole response under each selected source's privileged history,
    and the corrected log-probs are `rectify` of exactly these rows."""
    turns = group.canonical_turns()
    for t, (ti, tk) in enumerate(turns):
        tgt = group.trajectories[ti]
        sl = tgt.response_slice(tk)
        cross_KL = scored.cross_logprobs_M[t]
        assert cross_KL.dtype == np.float32 and cross_KL.shape == (len(scored.selected_sources_M[t]), sl.stop - sl.start)
        for row, s in enumerate(scored.selected_sources_M[t]):
            si, sk = turns[s]
            src = group.trajectories[si]
            ctx = prefix + src.token_ids_S[: src.turns[sk].response_start].tolist()
            want = backend.score([ctx + tgt.token_ids_S[sl].tolist()], [len(ctx)])[0]
            np.testing.assert_allclose(cross_KL[row], want, atol=1e-4, rtol=0)
        _, corrected_L = rectify(scored.teacher_logprobs_S[ti][sl], cross_KL, np.float32(scored.source_weights_M[t]),
                                 float(scored.alpha_M[t]), cfg.credit.alignopsd.aggregation_mode)
        m = tgt.loss_mask_S[sl] == 1
        np.testing.assert_allclose(scored.corrected_logprobs_S[ti][sl][m], corrected_L[m], atol=1e-6, rtol=0)


def check_teacher_entropy(backend, group, scored, prefix):
    """Entropy (T = 1) of the identity view at each response position: [0, log V], 0 off the mask,
    and equal to a plain forward pass's at the last response token."""
    for traj, ent in zip(group.trajectories, scored.teacher_entropy_S):
        assert ent.dtype == np.float32 and ent.shape == traj.token_ids_S.shape
        assert (ent[traj.loss_mask_S == 0] == 0).all() and (ent >= 0).all() and (ent <= math.log(backend.vocab_size)).all()
    traj, ent = group.trajectories[0], scored.teacher_entropy_S[0]
    pos = traj.turns[0].response_end - 1
    assert traj.loss_mask_S[pos] == 1 and ent[pos] > 0
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prefix + traj.token_ids_S[:pos].tolist()])).logits[0, -1]
    assert abs(float(ent[pos]) - float(entropy_from_logits(logits, 1.0))) < 1e-4


def test_embedder_down_falls_back_to_identity(backend, cfg, group):
    chat = ChatFormat(backend.tokenizer, "action")
    scored, stats = score_group(group, backend, chat, cfg, FixedEmbedder(fail=True))
    assert scored.identity_fallback and stats.embedder_fallback
    for a, b in zip(scored.teacher_logprobs_S, scored.corrected_logprobs_S):
        assert np.array_equal(a, b)
    assert all(not s for s in scored.selected_sources_M) and not scored.alpha_M.any()
    # Fallback: no embeddings, every target has an empty [0, n_t] block of cross log-probs.
    assert scored.student_thinking_emb_MD is None and scored.teacher_action_emb_MD is None
    for (i, k), cross in zip(group.canonical_turns(), scored.cross_logprobs_M):
        sl = group.trajectories[i].response_slice(k)
        assert cross.shape == (0, sl.stop - sl.start) and cross.dtype == np.float32
    assert len(scored.teacher_entropy_S) == len(group.trajectories)


class AppEmbedder:
    """The real embedder app (MiniLM + FAISS) behind the client's interface, in-process."""

    def __init__(self):
        from fastapi.testclient import TestClient

        from opsd.config import EmbedderSection
        from opsd.encoder import Encoder
        from services.embedder.app import build_app

        self.encoder = Encoder("all-MiniLM-L6-v2")
        token = "teacher-test-token-0123456789"
        self.client = TestClient(build_app(EmbedderSection(), self.encoder, token),
                                 headers={"Authorization": f"Bearer {token}"})
        self.payload = None

    def correspond(self, payload):
        self.payload = payload
        r = self.client.post("/correspond", json=payload)
        r.raise_for_status()
        return r.json()


def test_dump_fields_with_the_real_embedder(backend, group):
    cfg = RunConfig.model_validate({"env": ENV.model_dump(), "rollout": {"group_size": 2, "max_new_tokens": 10},
                                    "teacher": {"thinking_max_new_tokens": 8}, "trainer": {"dump_credit": True},
                                    "credit": {"alignopsd": {"similarity_threshold": 0.0, "top_k": 2}}})
    chat = ChatFormat(backend.tokenizer, "action")
    emb = AppEmbedder()
    scored, stats = score_group(group, backend, chat, cfg, emb)
    assert emb.payload["return_embeddings"] is True and not scored.identity_fallback
    assert any(scored.selected_sources_M)  # gamma_H = 0: the cross log-prob check below is not vacuous
    M = len(group.canonical_turns())
    texts = (scored.student_thinking_M, scored.teacher_thinking_M, scored.student_action_M, scored.teacher_action_M)
    arrays = (scored.student_thinking_emb_MD, scored.teacher_thinking_emb_MD, scored.student_action_emb_MD,
              scored.teacher_action_emb_MD)
    for txt, arr in zip(texts, arrays):
        assert arr.dtype == np.float32 and arr.shape == (M, 384)
        # The encoder's own vectors of those texts (zero rows for empty text). The embedder encoded them in
        # other batches (teacher and student texts together) than this call does, and a batch's shape can
        # change the float32 kernels' rounding, so the same text may differ in the last bits: atol=1e-6 as
        # in tests/test_embedder.py, orders of magnitude below any real difference between two texts.
        np.testing.assert_allclose(arr, emb.encoder.embed(txt), rtol=0, atol=1e-6)
    # ... and the very vectors H was computed from.
    H = scored.teacher_thinking_emb_MD @ scored.student_thinking_emb_MD.T
    np.testing.assert_allclose(scored.similarity_MM, np.clip(H, -1, 1), atol=1e-5)
    prefix = chat.privileged_prefix_ids(group.task.privileged_info)
    check_cross_logprobs(backend, group, scored, prefix, cfg)
    back = decode(encode(scored), ScoredGroup, 1 << 24, vocab_size=backend.vocab_size)
    np.testing.assert_array_equal(back.teacher_action_emb_MD, scored.teacher_action_emb_MD)


def test_weight_zero_sources_are_left_out(backend, cfg, group):
    chat = ChatFormat(backend.tokenizer, "action")
    emb = FixedEmbedder(zero_weight_source=True)
    scored, stats = score_group(group, backend, chat, cfg, emb)
    offered = emb.correspond(emb.payload)["selected_sources"]
    assert stats.dropped_sources == sum(len(s) - 1 for s in offered) > 0
    assert scored.selected_sources_M == [s[:1] for s in offered] and scored.source_weights_M == [[1.0]] * len(offered)
    check_cross_logprobs(backend, group, scored, chat.privileged_prefix_ids(group.task.privileged_info), cfg)


def _self_sources(payload, answer):
    """Each turn its own source, and the eligibility claimed for it: only the teacher's own mask can tell."""
    M = len(answer["eligible"])
    for t in range(M):
        answer["eligible"][t][t] = True
    return {**answer, "selected_sources": [[t] for t in range(M)], "source_weights": [[1.0]] * M}


GARBAGE = {
    "alpha outside [0, 1]": lambda p, a: {**a, "alpha": [1.5] * len(a["alpha"])},
    "weights inf in float32": lambda p, a: {**a, "source_weights": [[1e300] * len(w) for w in a["source_weights"]]},
    "a turn its own source": _self_sources,
}


@pytest.mark.parametrize("spoil", GARBAGE.values(), ids=GARBAGE.keys())
def test_an_answer_the_embedder_cannot_have_given_falls_back_to_identity(backend, cfg, group, spoil):
    from prometheus_client import REGISTRY

    def fallbacks():
        return REGISTRY.get_sample_value("opsd_embedder_fallbacks_total", {"role": "teacher"}) or 0.0

    chat = ChatFormat(backend.tokenizer, "action")
    before = fallbacks()
    scored, stats = score_group(group, backend, chat, cfg, FixedEmbedder(edit=spoil))
    assert scored.identity_fallback and stats.embedder_fallback and fallbacks() == before + 1
    assert all(not s for s in scored.selected_sources_M) and not scored.alpha_M.any() and not scored.eligible_MM.any()
    for a, b in zip(scored.teacher_logprobs_S, scored.corrected_logprobs_S):
        assert np.array_equal(a, b)
