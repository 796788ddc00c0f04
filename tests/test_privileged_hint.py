"""The per-turn privileged hint (env.privileged "remaining"), the privileged_signal metric and snapshots.

The teacher test uses real SmolLM2 on a real TextWorld group; the hints are set by hand so that
the turns of one trajectory get different privileged prefixes (several views per trajectory).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RunConfig
from opsd.envs.base import Task
from opsd.envs.textworld import make_games
from opsd.skills import privileged_text, turn_privileged_text, walkthrough_text
from opsd.types import RolloutGroup, ScoredGroup, TaskGroup, Trajectory, TurnRecord
from opsd.weights import keep_snapshot, weights_path
from services.rollout.episodes import run_group
from services.teacher.scoring import score_group
from services.trainer.report import privileged_signal, summarize

ENV = EnvSection(game_pool=1, seed=1234, max_turns=2, privileged="remaining")


def test_privileged_text_per_mode(tmp_path):
    (tmp_path / "textworld").mkdir()
    (tmp_path / "textworld" / "general.txt").write_text("Read the objective.")
    task = Task(task_id="t", category="", spec={}, gold_path=["open box", "take coin"])
    assert privileged_text("textworld", task, "remaining", tmp_path) == ""
    assert privileged_text("textworld", task, "skills+remaining", tmp_path) == "Read the objective."
    assert privileged_text("textworld", task, "both", tmp_path) == "Read the objective.\n\nWalkthrough: open box > take coin"
    with pytest.raises(ValueError, match="privileged mode"):
        privileged_text("textworld", task, "everything", tmp_path)
    assert turn_privileged_text("", ["take coin"], "remaining") == "Walkthrough: take coin"
    assert turn_privileged_text("Skills.", ["take coin"], "skills+remaining") == "Skills.\n\nWalkthrough: take coin"
    assert turn_privileged_text("Skills.", [], "skills+remaining") == "Skills."  # the env did not know it
    assert turn_privileged_text("Walkthrough: a > b", ["b"], "both") == "Walkthrough: a > b"  # task-level modes


@pytest.fixture(scope="module")
def cfg():
    return RunConfig.model_validate({"env": ENV.model_dump(), "rollout": {"group_size": 2, "max_new_tokens": 10},
                                     "teacher": {"thinking_max_new_tokens": 8}})


@pytest.fixture(scope="module")
def group(policy_backend, cfg, tmp_path_factory):
    game = make_games(ENV, tmp_path_factory.mktemp("games"))[0]
    task = TaskGroup(group_id="g-hint", task_id=game.task_id, step=0, policy_version=0, group_size=2,
                     env="textworld", game=game.to_dict(), privileged_info="", max_turns=2)
    chat = ChatFormat(policy_backend.tokenizer, "action")
    grp, _ = run_group(task, policy_backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed=5)
    assert grp.trajectories[0].turns[0].hint == list(game.walkthrough)  # recorded from the env at reset
    grp = copy.deepcopy(grp)
    for i, t in enumerate(grp.trajectories):  # distinct hints per turn: one view per turn
        for k, rec in enumerate(t.turns):
            rec.hint = [f"go {'east' if (i + k) % 2 else 'west'}", f"take coin {k}"]
    assert sum(len(t.turns) for t in grp.trajectories) >= 3
    return grp


def test_each_turn_is_scored_under_its_own_remaining_walkthrough(policy_backend, cfg, group):
    chat = ChatFormat(policy_backend.tokenizer, "action")
    scored, _ = score_group(group, policy_backend, chat, cfg, None)
    for i, traj in enumerate(group.trajectories):
        for k, rec in enumerate(traj.turns):
            prefix = chat.privileged_prefix_ids(walkthrough_text(rec.hint))
            ref = policy_backend.score([prefix + traj.token_ids_S[: rec.response_end].tolist()], [len(prefix)])[0]
            sl, m = traj.response_slice(k), traj.loss_mask_S[traj.response_slice(k)] == 1
            np.testing.assert_allclose(scored.teacher_logprobs_S[i][sl][m], ref[sl][m], atol=1e-4, rtol=0)
        assert not scored.teacher_logprobs_S[i][traj.loss_mask_S == 0].any()
    # The same turns under the whole-walkthrough mode score differently: the prefix is not the hint.
    whole = cfg.model_copy(update={"env": cfg.env.model_copy(update={"privileged": "walkthrough"})})
    other, _ = score_group(group, policy_backend, chat, whole, None)
    assert not np.allclose(other.teacher_logprobs_S[0], scored.teacher_logprobs_S[0])


def _scored(turns: list[tuple[str, list[str], float]]) -> ScoredGroup:
    """One trajectory, one 2-token response per turn: (action, hint, teacher - sampler gap per token)."""
    S = 3 * len(turns)
    recs, student, teacher, mask = [], np.full(S, -1.0, np.float32), np.zeros(S, np.float32), np.zeros(S, np.uint8)
    for k, (action, hint, gap) in enumerate(turns):
        a, b = 3 * k + 1, 3 * k + 3
        recs.append(TurnRecord(turn_id=k, response_start=a, response_end=b, text=action, thinking="", action=action,
                               format_valid=True, finish_reason="stop", observation="", hint=hint))
        mask[a:b] = 1
        teacher[a:b] = -1.0 + gap
    student[mask == 0] = 0.0
    traj = Trajectory(rollout_id="r00", token_ids_S=np.arange(S, dtype=np.int32), sampler_logprobs_S=student,
                      loss_mask_S=mask, turns=recs, reward=0.0, won=False, ending="max_turns")
    task = TaskGroup(group_id="g", task_id="t", step=0, policy_version=0, group_size=1, env="textworld", game={},
                     privileged_info="", max_turns=len(turns))
    group = RolloutGroup(task=task, trajectories=[traj], prompt_format="action")
    teacher = np.minimum(teacher * mask, 0.0).astype(np.float32)
    M = len(turns)
    return ScoredGroup(rollout=group, teacher_version=0, teacher_logprobs_S=[teacher], corrected_logprobs_S=[teacher],
                       teacher_thinking_M=[""] * M, similarity_MM=np.zeros((M, M), np.float32),
                       eligible_MM=np.zeros((M, M), bool), selected_sources_M=[[] for _ in range(M)],
                       source_weights_M=[[] for _ in range(M)], rho_M=np.zeros(M, np.float32),
                       alpha_M=np.zeros(M, np.float32))


def test_privileged_signal_compares_hint_turns_with_the_others():
    sg = _scored([("Take  Coin", ["take coin", "eat coin"], 0.75),  # matches (case and spaces ignored)
                  ("go east.", ["go east"], 0.25),  # matches: the envs drop a trailing period too
                  ("look", ["take coin"], -0.25), ("go west", ["take coin"], 0.25),
                  ("inventory", [], 0.5)])  # no hint: not counted
    out = privileged_signal([sg])
    assert out == {"privileged_signal": pytest.approx(0.5 - 0.0), "hint_match_turns": 2, "hint_other_turns": 2}
    # Every hint turn on one side: no comparison, reported as None (null in metrics.jsonl), never 0.
    assert privileged_signal([_scored([("look", ["take coin"], 0.5)])])["privileged_signal"] is None
    assert summarize([sg.rollout], [sg])["privileged_signal"] == pytest.approx(0.5)


def test_snapshots_keep_every_nth_version(tmp_path):
    for v in range(4):
        path = weights_path(tmp_path, v)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"v%d" % v)
        kept = keep_snapshot(tmp_path, v, every=2)
        assert (kept is not None) == (v % 2 == 0)
    path.unlink()  # pruning the published file leaves the snapshot
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["policy-v00000.safetensors", "policy-v00002.safetensors"]
    assert (tmp_path / "snapshots" / "policy-v00002.safetensors").read_bytes() == b"v2"
    assert keep_snapshot(tmp_path, 3, every=0) is None


def test_the_hint_is_a_prefix_of_the_path_and_never_a_cut_command():
    from opsd.envs.base import EnvStep
    from opsd.types import MAX_HINT_ACTIONS, MAX_HINT_CHARS
    from services.rollout.episodes import _hint

    def hint(commands):
        return _hint(EnvStep("o", [], won=False, lost=False, done=False, score=0.0, policy_commands=commands))

    assert hint(["go east", "take coin"]) == ["go east", "take coin"]
    assert hint(["x"] * (MAX_HINT_ACTIONS + 5)) == ["x"] * MAX_HINT_ACTIONS
    long = "a" * (MAX_HINT_CHARS + 1)
    assert hint(["go east", long, "take coin"]) == ["go east"]  # the path up to the command that does not fit
    assert hint([long]) == []  # a long answer (reasoning-gym) gives no hint rather than a cut one
    with pytest.raises(TypeError, match="list of str"):
        hint("take coin")
    with pytest.raises(TypeError, match="list of str"):
        hint([1, 2])


@pytest.mark.parametrize("env", ["search", "webshop"])
def test_a_per_turn_hint_on_an_env_without_a_gold_path_is_a_config_error(env):
    with pytest.raises(ValueError, match="remaining gold path"):
        EnvSection(name=env, privileged="remaining")
    assert EnvSection(name=env, privileged="both").privileged == "both"


def test_the_step_line_says_what_priv_rests_on():
    """`priv` shows the turns it rests on (gold-command turns / others) and "-" when one side is empty: a blank
    said nothing about why (issue 24)."""
    from opsd.progress import format_step

    line = format_step({"step": 3, "privileged_signal": 0.125, "hint_match_turns": 1, "hint_other_turns": 30})
    assert "priv +0.125 (1/30)" in line
    assert "priv - (0/31)" in format_step({"step": 3, "privileged_signal": None, "hint_match_turns": 0,
                                           "hint_other_turns": 31})
    assert "priv" not in format_step({"step": 3, "success_rate": 1.0})  # no teacher: nothing to say
