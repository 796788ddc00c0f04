"""The privileged teacher on a real group: identity and matched views score exactly the sampled ids.

Real SmolLM2 and a real TextWorld game; the embedder is replaced by a fixed
correspondence (a narrow stand-in: its own service is tested in test_embedder.py).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RunConfig
from opsd.envs import make_games
from opsd.types import TaskGroup
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


class FixedEmbedder:
    """Matches every target turn to the first turn of the other rollout with weight 1, alpha 0.5."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.payload = None

    def correspond(self, payload):
        if self.fail:
            raise httpx.ConnectError("embedder down")
        self.payload = payload
        turns = payload["turns"]
        M = len(turns)
        first = {}
        for m, t in enumerate(turns):
            first.setdefault(t["rollout_id"], m)
        sources = [[first[r]] for r in (next(x for x in first if x != t["rollout_id"]) for t in turns)]
        return {"similarity": np.eye(M).tolist(), "eligible": np.zeros((M, M), bool).tolist(),
                "selected_sources": sources, "source_weights": [[1.0]] * M, "rho": [0.625] * M, "alpha": [0.5] * M}


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


def test_embedder_down_falls_back_to_identity(backend, cfg, group):
    chat = ChatFormat(backend.tokenizer, "action")
    scored, stats = score_group(group, backend, chat, cfg, FixedEmbedder(fail=True))
    assert scored.identity_fallback and stats.embedder_fallback
    for a, b in zip(scored.teacher_logprobs_S, scored.corrected_logprobs_S):
        assert np.array_equal(a, b)
    assert all(not s for s in scored.selected_sources_M) and not scored.alpha_M.any()
