"""Trainer pieces on synthetic groups: batch building, advantage scatter, the PPO update."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from opsd.config import CreditSection, TrainerSection
from opsd.credit import compute_advantages
from services.trainer.batch import build_credit_batch, scatter_advantages
from services.trainer.update import ppo_update
from tests.factories import VOCAB_SIZE, make_rollout_group, make_scored_group, ppo_sequences, tiny_llama


def test_credit_batch_rows_are_canonical_and_blocks_stay_inside_groups():
    scored = [make_scored_group(G=3, turns=2, seed=5), make_scored_group(G=3, turns=2, seed=1)]
    groups = [s.rollout for s in scored]
    batch, rows = build_credit_batch(groups, scored)
    keys = list(zip(batch.task_id, batch.rollout_id, batch.turn_id))
    assert keys == sorted(keys) and len(keys) == 12
    # One block per group, equal to its own H and eligibility in its canonical turn order (its rows' order).
    assert set(batch.similarity_blocks) == set(batch.eligible_blocks) == {s.group_id for s in scored}
    for s in scored:
        assert np.array_equal(batch.similarity_blocks[s.group_id], s.similarity_MM)
        assert np.array_equal(batch.eligible_blocks[s.group_id], s.eligible_MM)
    # Row m carries exactly the response tokens of its turn.
    gi, i, k = rows[3]
    traj = groups[gi].trajectories[i]
    sl = traj.response_slice(k)
    n = sl.stop - sl.start
    assert np.array_equal(batch.student_logprobs_ML[3, :n], traj.sampler_logprobs_S[sl])
    assert batch.loss_mask_ML[3, n:].sum() == 0


def test_scatter_puts_advantages_on_loss_tokens_only():
    scored = [make_scored_group(G=4, turns=3, seed=2)]
    groups = [scored[0].rollout]
    batch, rows = build_credit_batch(groups, scored)
    adv_ML, _ = compute_advantages("alignopsd", batch, CreditSection())
    adv = scatter_advantages(groups, rows, adv_ML)
    for i, traj in enumerate(groups[0].trajectories):
        a = adv[(0, i)]
        assert a.shape == traj.token_ids_S.shape
        assert not a[traj.loss_mask_S == 0].any()
    total = sum(float(adv[(0, i)].sum()) for i in range(4))
    assert np.isclose(total, float((adv_ML * batch.loss_mask_ML).sum()), atol=1e-4)


def test_grpo_on_rollouts_without_teacher_all_fail_is_zero():
    groups = [make_rollout_group(G=4, turns=2, seed=3, rewards=[0.0] * 4)]
    batch, rows = build_credit_batch(groups, None)
    cfg = CreditSection(use_invalid_action_penalty=False)
    adv_ML, _ = compute_advantages("grpo", batch, cfg)
    assert np.isfinite(adv_ML).all() and not adv_ML.any()


def _tiny_model():
    return tiny_llama(num_hidden_layers=2)


def test_ppo_update_changes_weights_and_first_ratio_is_one():
    model = _tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    m = ppo_update(model, opt, ppo_sequences(1.0, True), TrainerSection(micro_batch_size=2, entropy_coef=0.0))
    assert np.isfinite(m["loss"]) and m["ratio_dev_max"] < 1e-6 and m["loss_tokens"] == 5 + 7 + 4
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ppo_update_all_zero_mask_is_zero_loss_and_no_nan():
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = ppo_update(model, opt, ppo_sequences(1.0, False), TrainerSection(micro_batch_size=2, entropy_coef=0.001))
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batching_does_not_change_the_update(micro):
    ref, other = _tiny_model(), _tiny_model()
    for model, mb in ((ref, 2), (other, micro)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ppo_update(model, opt, ppo_sequences(0.7, True), TrainerSection(micro_batch_size=mb, entropy_coef=0.0))
    for (k, a), b in zip(ref.state_dict().items(), other.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def _step_groups(seed: int = 0):
    """Two scored groups (G=3, 3 turns) with entropies filled, as a teacher step would deliver."""
    from dataclasses import replace

    scored = []
    for g in range(2):
        sg = make_scored_group(G=3, turns=3, seed=seed + g)
        rng = np.random.default_rng(seed + 100 + g)
        trajs = [
            replace(t, sampler_entropy_S=np.where(t.loss_mask_S == 1, rng.uniform(0, 3, t.loss_mask_S.shape), 0).astype(np.float32))
            for t in sg.rollout.trajectories
        ]
        rollout = replace(sg.rollout, trajectories=trajs)
        ent = [np.where(t.loss_mask_S == 1, rng.uniform(0, 3, t.loss_mask_S.shape), 0).astype(np.float32) for t in trajs]
        scored.append(replace(sg, rollout=rollout, teacher_entropy_S=ent))
    return [s.rollout for s in scored], scored


@pytest.mark.parametrize("method", sorted(set(__import__("opsd.credit", fromlist=["registered"]).registered())))
def test_every_registered_method_trains_by_name(method, tmp_path):
    """The trainer's step (`learn`) runs each method from a config, with the KL to the reference on: finite
    advantages on loss tokens, an optimizer step, a dump that `opsd credit check` replays exactly, the loss and
    its KL too (alignopsd dumps need teacher embeddings, covered in test_credit_check)."""
    from opsd.config import RunConfig
    from opsd.credit.replay import check_file
    from services.trainer.reference import ReferencePolicy
    from services.trainer.step import learn

    sdar = 0.0 if method == "grpo" else 0.01  # SDAR distills from the teacher: not with grpo
    cfg = RunConfig.model_validate({"run": {"method": method}, "credit": {"sdar": {"coef": sdar}}, "trainer": {"kl_coef": 0.01}})
    groups, scored = _step_groups()
    model = tiny_llama(num_hidden_layers=1, vocab_size=VOCAB_SIZE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    dump = tmp_path / "step.json" if method != "alignopsd" else None
    res = learn(cfg, model, opt, groups, None if method == "grpo" else scored, ReferencePolicy.build(model, cfg), dump)
    mask = res.batch.loss_mask_ML > 0
    assert np.isfinite(res.advantages_ML).all() and not res.advantages_ML[~mask].any()
    assert res.update["loss_tokens"] == mask.sum() and np.isfinite(res.update["loss"])
    assert (res.update["sdar_loss"] != 0.0) == (sdar > 0)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert res.update["kl"] == pytest.approx(0.0, abs=1e-6)  # step 0: the policy is the reference
    if dump is not None:
        r = check_file(dump)
        assert r.ok, (r.error, [(f.name, f.detail) for f in r.fields if not f.ok])
        assert {"advantages", "loss", "kl"} <= {f.name for f in r.fields}


def _with_sampler(seqs, sampler_logprobs):
    from dataclasses import replace

    return [replace(s, sampler_logprobs_S=lp.astype(np.float32)) for s, lp in zip(seqs, sampler_logprobs)]


def test_ppo_update_reports_sampler_mismatch_kl():
    from services.trainer.update import sequence_logprobs

    model = _tiny_model()
    seqs = ppo_sequences(1.0, True)
    trainer_lp = sequence_logprobs(model, seqs, micro_batch_size=2)
    cfg = TrainerSection(micro_batch_size=2, entropy_coef=0.0)
    same = ppo_update(_tiny_model(), torch.optim.SGD(_tiny_model().parameters(), lr=0.0), _with_sampler(seqs, trainer_lp), cfg)
    assert same["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    # Sampler log-probs 0 (ppo_sequences): d = trainer log-prob, k3 = exp(d) - 1 - d, token-mean over loss tokens.
    m = ppo_update(_tiny_model(), torch.optim.SGD(model.parameters(), lr=0.0), seqs, cfg)
    d = np.concatenate([lp[s.loss_mask_S == 1] for s, lp in zip(seqs, trainer_lp)]).astype(np.float64)
    assert m["mismatch_kl"] == pytest.approx(float(np.mean(np.expm1(d) - d)), rel=1e-5)
    assert m["mismatch_kl"] > 0.1


def test_truncated_is_scales_the_gradient_by_the_weight():
    """Sampler log-probs ln 2 below the trainer's: every TIS weight is 2, so the step's gradient is exactly twice as large."""
    from services.trainer.update import sequence_logprobs

    seqs = ppo_sequences(0.7, True)
    trainer_lp = sequence_logprobs(_tiny_model(), seqs, micro_batch_size=2)
    lower = _with_sampler(seqs, [lp - np.log(2.0) * s.loss_mask_S for s, lp in zip(seqs, trainer_lp)])
    grads = {}
    for tis in (False, True):
        model = _tiny_model()
        cfg = TrainerSection(micro_batch_size=2, entropy_coef=0.0, grad_clip=1e9, truncated_is=tis, tis_cap=5.0)
        m = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), lower, cfg)
        grads[tis] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert m["mismatch_kl"] == pytest.approx(1.0 - np.log(2.0), rel=1e-4)
    assert grads[False] and any(g.abs().max() > 0 for g in grads[False].values())
    for n, g in grads[False].items():
        # float32 sums of many terms: compare against the tensor's scale, not element by element
        assert (grads[True][n] - 2.0 * g).abs().max() <= 1e-5 * g.abs().max(), n


def test_a_steps_credit_edge_cases_are_counted_by_event():
    from prometheus_client import REGISTRY

    from services.trainer.__main__ import export_step

    def count(event):
        return REGISTRY.get_sample_value("opsd_credit_events_total", {"role": "trainer", "event": event}) or 0.0

    record = {"policy_version": 1, "loss_tokens": 10, "wait_seconds": 1.0, "train_seconds": 2.0, "success_rate": 0.5,
              "format_valid_rate": 1.0, "mismatch_kl": 0.0, "alignopsd/turns_without_loss_tokens": 3.0,
              "alignopsd/single_trajectory_tasks": 0.0, "credit/nonfinite_metrics_dropped": 2.0, "alignopsd/turns": 40.0}
    before = {e: count(e) for e in ("turns_without_loss_tokens", "single_trajectory_tasks", "nonfinite_metrics_dropped", "turns")}
    export_step(record, n_groups=2)
    export_step(record, n_groups=2)
    assert count("turns_without_loss_tokens") - before["turns_without_loss_tokens"] == 6.0
    assert count("nonfinite_metrics_dropped") - before["nonfinite_metrics_dropped"] == 4.0
    assert count("single_trajectory_tasks") == before["single_trajectory_tasks"]  # zero adds nothing
    assert count("turns") == before["turns"] == 0.0  # a size, not an edge case


def test_step_summary_reports_success_per_task_category():
    from dataclasses import replace

    from services.trainer.report import summarize

    a = make_rollout_group(G=4, seed=1, rewards=[1.0, 0.0, 0.0, 0.0])
    b = make_rollout_group(G=4, seed=2, rewards=[1.0, 1.0, 1.0, 0.0])
    a.task, b.task = replace(a.task, category="heat"), replace(b.task, category="pick")
    for g in (a, b):
        for t in g.trajectories:
            t.won = t.reward == 1.0
    out = summarize([a, b], None)
    assert out["success/heat"] == 0.25 and out["success/pick"] == 0.75 and out["success_rate"] == 0.5


def test_metrics_png_panels_say_what_they_show():
    """metrics.png (issue 24): every panel has a y label; success and reward become one curve when they are equal
    (0/1 rewards), two when not; format-valid rate, loss and priv are plotted; a nearly flat series gets a range
    at least max(0.1, a quarter of its size) wide; panels the run never records are left out."""
    from services.trainer.report import metric_panels

    rows = [{"step": 0, "success_rate": 0.0, "reward_mean": 0.0, "format_valid_rate": 0.8, "loss": 0.1,
             "mean_span_length": 3.875, "privileged_signal": None},
            {"step": 1, "success_rate": 1.0, "reward_mean": 1.0, "format_valid_rate": 0.9, "loss": -0.2,
             "mean_span_length": 4.0, "privileged_signal": 0.02}]
    panels = {title: (ylabel, ylim, curves) for title, ylabel, ylim, curves in metric_panels(rows)}
    assert set(panels) == {"success rate and mean reward", "format-valid turns", "policy loss",
                           "privileged signal (gold-action turns minus others)", "mean AlignOPSD span"}
    assert all(ylabel for ylabel, _, _ in panels.values())
    assert list(panels["success rate and mean reward"][2]) == ["success_rate = reward_mean"]
    assert panels["mean AlignOPSD span"][1] == pytest.approx((3.9375 - 0.4921875, 3.9375 + 0.4921875))  # not 3.875-4.0
    assert panels["privileged signal (gold-action turns minus others)"][2] == {"privileged_signal": [(1, 0.02)]}
    rows[1]["reward_mean"] = 0.7  # graded rewards: two curves
    (first, *_) = metric_panels(rows)
    assert list(first[3]) == ["success_rate", "reward_mean"]


# The trainer as compose and Kubernetes run it (`python -m services.trainer`), with one fault planted: handling a
# group whose first rollout id ends in "-poison" raises, as a bug or an out-of-memory on a bad group would. The
# crash is the process's own uncaught exception; everything else (queue, restart, reclaim, dead letter) is real.
CRASHING_TRAINER = """
from services.trainer import controller
offer = controller.Collector.offer
def crash_on_poison(self, d, version, step):
    if d.msg.trajectories[0].rollout_id.endswith("-poison"):
        raise RuntimeError(f"poison group {d.msg.group_id} (entry {d.entry_id}) crashed the trainer")
    return offer(self, d, version, step)
controller.Collector.offer = crash_on_poison
from services.trainer.__main__ import main
main()
"""


@pytest.mark.e2e
def test_the_trainers_queue_dead_letters_an_entry_that_keeps_killing_it(tmp_path, redis_url, redis_client, stream_prefix):
    """Issue 23 (made real in issue 37): an entry that crashes the trainer at every delivery must end in the
    dead-letter stream after trainer_max_deliveries deliveries, not crash-loop it under a platform that restarts
    without limit. Here redis.max_deliveries 1 and run.max_restarts 0 give a bound of 2: the trainer crashes on
    its first two starts, dead-letters the entry on its third, issues the task again and finishes the run."""
    import subprocess
    import sys
    from pathlib import Path

    from opsd import wire
    from opsd.config import RunConfig
    from opsd.queue import StreamNames
    from opsd.service import EXIT_WHEN_DONE_ENV
    from opsd.types import RolloutGroup, TaskGroup
    from services.trainer.__main__ import trainer_max_deliveries
    from tests.factories import make_trajectory
    from tests.soak import stop_sessions, wait_until, write_config
    from tests.tiny_model import make_tiny_model_dir

    config = write_config(tmp_path / "job.yaml", make_tiny_model_dir(tmp_path / "tiny"),
                          run={"method": "grpo", "steps": 1, "max_restarts": 0},
                          redis={"stream_prefix": stream_prefix, "max_deliveries": 1})
    bound = trainer_max_deliveries(RunConfig.load(config))
    assert bound == 2
    names = StreamNames(stream_prefix)
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           EXIT_WHEN_DONE_ENV: "1"}
    answered, poisoned = "0-0", []

    def answer_tasks() -> None:
        """The rollout worker: one group per task entry; the first answer to the first task is the poison."""
        nonlocal answered
        pipe = redis_client.pipeline(transaction=True)  # one write: the trainer reads both groups at once
        for entry_id, fields in redis_client.xrange(names.tasks, f"({answered}", "+"):
            answered = entry_id.decode()
            task = wire.decode(fields[b"data"], TaskGroup, 1 << 20)
            suffix = "-poison" if not poisoned else ""
            if not poisoned:
                poisoned.append(task.group_id)
            rng = np.random.default_rng(len(poisoned))
            group = RolloutGroup(task=task, prompt_format="action", rollout_seconds=1.0, trajectories=[
                make_trajectory(f"{task.group_id}-r{i}{suffix}", task.max_turns, rng, float(i == 0))
                for i in range(task.group_size)])
            pipe.xadd(names.rollouts, {"data": wire.encode(group, 1 << 24)})
        pipe.execute()

    procs, exits = [], []
    try:
        while not exits or exits[-1] != 0:
            assert len(exits) <= bound, (
                f"the trainer crashed {len(exits)} times on the same entry and was never rid of it (its input queue "
                f"dead-letters after {bound} deliveries):\n" + (tmp_path / "trainer.log").read_text()[-3000:])
            with open(tmp_path / "trainer.log", "ab") as log:  # a restart without limit, as docker or k8s does
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", CRASHING_TRAINER, "--config", str(config), "--run-dir", str(run_dir)],
                    cwd=Path(__file__).resolve().parents[1], env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))

            def exited():
                answer_tasks()
                return procs[-1].poll() is not None

            wait_until(exited, 300, "the trainer's exit", poll_s=0.2)
            exits.append(procs[-1].returncode)
    finally:
        stop_sessions(procs)
    trainer_log = (tmp_path / "trainer.log").read_text()
    # Crashed at deliveries 1 and 2 (the bound), dead-lettered at delivery 3, then trained the step and exited 0.
    assert exits == [1] * bound + [0], trainer_log[-3000:]
    assert trainer_log.count(f"RuntimeError: poison group {poisoned[0]}") == bound
    dead = {wire.decode(f[b"data"], RolloutGroup, 1 << 24).trajectories[0].rollout_id: f
            for _, f in redis_client.xrange(names.dead)}
    poison = dead[f"{poisoned[0]}-r0-poison"]
    assert poison[b"reason"] == b"too_many_deliveries" and poison[b"source_stream"] == names.rollouts.encode()
    assert poison[b"error"] == f"too many deliveries ({bound + 1} > {bound})".encode()
    # Other work went on: the poison's task was issued again and the step trained both its groups. (Its sibling,
    # delivered with it and unacknowledged through the same crashes, reaches the bound too and is issued again.)
    assert f"group {poisoned[0]} was dead-lettered (too_many_deliveries" in trainer_log
    assert (run_dir / "DONE").is_file()
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 1 and len(state["applied"]) == 2 and f"{poisoned[0]}@v0" in state["applied"]
    assert redis_client.xpending(names.rollouts, "trainer")["pending"] == 0
