"""Run the trainer role (and the step controller): `python -m services.trainer --config C --run-dir D`.

Synchronous loop, one policy version per step:
  issue the step's TaskGroups (policy version v) -> wait for all their groups
  -> credit assignment -> PPO update -> publish weights v+1 -> ack the groups.
Groups are acknowledged only after the weights they produced are written.
After the last step it saves the final checkpoint, writes <run_dir>/DONE
and keeps serving /metrics until it is told to stop.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import shutil
import time

import numpy as np
import torch

from opsd import metrics
from opsd.envs.textworld import make_games
from opsd.models import load_backend
from opsd.queue import StreamNames
from opsd.service import RoleProcess
from opsd.types import RolloutGroup, ScoredGroup, TaskGroup
from opsd.weights import weights_path
from services.trainer.report import append_metrics, plot_metrics
from services.trainer.step import learn

ROLE = "trainer"
KEEP_VERSIONS = 2  # policy weight files kept on disk (each is ~540 MB for SmolLM2 in fp32)
log = logging.getLogger(ROLE)


def step_tasks(cfg, games: list, step: int, version: int, run_id: str) -> list[TaskGroup]:
    """The step's TaskGroups: `num_games` distinct games drawn from the pool with a per-step seed."""
    rng = random.Random(cfg.run.seed * 7919 + step)
    picked = rng.sample(games, k=min(cfg.env.num_games, len(games)))
    return [
        TaskGroup(
            group_id=f"{run_id}-s{step:05d}-{g.task_id}",
            task_id=g.task_id,
            step=step,
            policy_version=version,
            group_size=cfg.rollout.group_size,
            env=cfg.env.name,
            game=g.to_dict(),
            privileged_info=g.privileged_info(),
            max_turns=cfg.env.max_turns,
        )
        for g in picked
    ]


def summarize(groups: list[RolloutGroup], scored: list[ScoredGroup] | None) -> dict[str, float]:
    """Rollout and teacher statistics of a step (rates in [0, 1], gaps in nats per loss token)."""
    trajs = [t for g in groups for t in g.trajectories]
    turns = [k for t in trajs for k in t.turns]
    out = {
        "episodes": len(trajs),
        "turns": len(turns),
        "reward_mean": float(np.mean([t.reward for t in trajs])) if trajs else 0.0,
        "success_rate": float(np.mean([t.won for t in trajs])) if trajs else 0.0,
        "format_valid_rate": float(np.mean([k.format_valid for k in turns])) if turns else 0.0,
        "truncated_turn_rate": float(np.mean([k.finish_reason == "length" for k in turns])) if turns else 0.0,
        "mixed_groups": sum(len({t.reward for t in g.trajectories}) > 1 for g in groups),
        "rollout_seconds": float(sum(g.rollout_seconds for g in groups)),
        "generated_tokens": int(sum(t.loss_mask_S.sum() for t in trajs)),
    }
    if scored:
        gap = corr = n = 0.0
        for sg in scored:
            for t, lp, clp in zip(sg.rollout.trajectories, sg.teacher_logprobs_S, sg.corrected_logprobs_S):
                m = t.loss_mask_S == 1
                gap += float((lp[m] - t.sampler_logprobs_S[m]).sum())
                corr += float((clp[m] - t.sampler_logprobs_S[m]).sum())
                n += float(m.sum())
        out["teacher_student_gap"] = gap / max(n, 1.0)
        out["corrected_gap"] = corr / max(n, 1.0)
        out["teacher_seconds"] = float(sum(sg.teacher_seconds for sg in scored))
        out["embedder_fallbacks"] = sum(sg.identity_fallback for sg in scored)
        out["matched_turn_rate"] = float(np.mean([bool(s) for sg in scored for s in sg.selected_sources_M])) if turns else 0.0
    return out


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg
    run_dir = proc.run_dir
    run_id = run_dir.name
    proc.serve(port=cfg.trainer.metrics_port)
    torch.manual_seed(cfg.run.seed)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)

    backend = load_backend(cfg.model)
    model = backend.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    # ExOPD extrapolates from the initial policy: keep a frozen copy of it (one more forward a step).
    base_model = None
    if cfg.run.method == "ex_opd" and cfg.credit.ex_opd.base == "initial":
        base_model = copy.deepcopy(model).eval().requires_grad_(False)
    games = make_games(cfg.env, cfg.cache_root)
    streams = StreamNames(cfg.redis.stream_prefix)
    queue = proc.open_queue(streams.scored if cfg.needs_teacher else streams.rollouts,
                            ScoredGroup if cfg.needs_teacher else RolloutGroup, backend.vocab_size)
    client = queue.client
    version = 0
    metrics.POLICY_VERSION.labels(ROLE).set(version)
    proc.status.update(policy_version=version, step=0, ready=True)

    for step in range(cfg.run.steps):
        t_step = time.perf_counter()
        tasks = step_tasks(cfg, games, step, version, run_id)
        for task in tasks:
            queue.produce_to(streams.tasks, task)
        wanted = {t.group_id for t in tasks}
        got: dict[str, tuple[str, object]] = {}
        deadline = time.monotonic() + cfg.run.step_timeout_s
        while wanted - got.keys():
            if proc.stop.is_set():
                log.info("stopped while waiting for step %d", step)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"step {step}: groups {sorted(wanted - got.keys())} did not arrive within {cfg.run.step_timeout_s:.0f}s "
                    f"(dead-letter stream {streams.dead} holds {client.xlen(streams.dead)} entries)"
                )
            # Entries held across this wait stay ours: refresh them so reclaim never hands them back.
            queue.keep_alive([eid for eid, _ in got.values()])
            for d in queue.reclaim(cfg.redis.reclaim_idle_ms, count=8) + queue.consume(cfg.redis.block_ms, count=8):
                gid = d.msg.group_id
                if gid in got and got[gid][0] == d.entry_id:
                    continue
                if gid in wanted and gid not in got:
                    got[gid] = (d.entry_id, d.msg)
                else:
                    # Another step's group (stale) or a redelivered duplicate: never train on it twice.
                    metrics.CREDIT_EVENTS.labels(ROLE, "dropped_group").inc()
                    queue.ack(d.entry_id)
            queue.depth()
        t_compute = time.perf_counter()
        wait_s = t_compute - t_step

        ordered = [got[t.group_id][1] for t in tasks]
        scored = ordered if cfg.needs_teacher else None
        groups = [s.rollout for s in ordered] if cfg.needs_teacher else ordered
        dump = run_dir / "credit" / f"step_{step:05d}.json" if cfg.trainer.dump_credit else None
        result = learn(cfg, model, optimizer, groups, scored, base_model, dump)
        batch, advantages_ML, credit_metrics, update = result.batch, result.advantages_ML, result.credit_metrics, result.update
        version += 1
        backend.save_weights(weights_path(run_dir, version))
        # Roles only ever load the newest version; keep one older for a role still finishing a job.
        if version - KEEP_VERSIONS >= 1:
            weights_path(run_dir, version - KEEP_VERSIONS).unlink(missing_ok=True)
        backend.policy_version = version
        client.set(f"{cfg.redis.stream_prefix}:policy_version", version)
        for entry_id, _ in got.values():
            queue.ack(entry_id)
        compute_s = time.perf_counter() - t_compute

        record = {"step": step, "policy_version": version, **summarize(groups, scored)}
        record.update({k: float(v) for k, v in credit_metrics.items()})
        if "alignopsd/mean_span_turns" in credit_metrics:
            record["mean_span_length"] = float(credit_metrics["alignopsd/mean_span_turns"])
        record.update(update)
        record.update(wait_seconds=wait_s, train_seconds=compute_s, step_seconds=time.perf_counter() - t_step,
                      advantage_abs_mean=float(np.abs(advantages_ML[batch.loss_mask_ML > 0]).mean()) if batch.loss_mask_ML.any() else 0.0)
        append_metrics(run_dir, record)
        plot_metrics(run_dir)

        metrics.POLICY_VERSION.labels(ROLE).set(version)
        metrics.GROUPS.labels(ROLE).inc(len(groups))
        metrics.TOKENS.labels(ROLE).inc(int(update["loss_tokens"]))
        metrics.STEP_SECONDS.labels(ROLE, "waiting").set(wait_s)
        metrics.STEP_SECONDS.labels(ROLE, "computing").set(compute_s)
        metrics.SUCCESS_RATE.labels(ROLE).set(record["success_rate"])
        metrics.INVALID_ACTION_RATE.labels(ROLE).set(1.0 - record["format_valid_rate"])
        if "teacher_student_gap" in record:
            metrics.TEACHER_STUDENT_GAP.labels(ROLE).set(record["teacher_student_gap"])
        if "mean_span_length" in record:
            metrics.MEAN_SPAN_LENGTH.labels(ROLE).set(record["mean_span_length"])
        proc.status.update(policy_version=version, step=step + 1)
        log.info("step %d done: %s", step, json.dumps({k: record[k] for k in ("success_rate", "reward_mean", "loss", "step_seconds")}))

    ckpt = run_dir / "checkpoint"
    backend.save_checkpoint(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": cfg.run.steps, "policy_version": version, "method": cfg.run.method}))
    # The checkpoint now holds the final policy; the per-version files only served the roles.
    shutil.rmtree(run_dir / "weights", ignore_errors=True)
    (run_dir / "DONE").write_text(json.dumps({"steps": cfg.run.steps, "policy_version": version}))
    proc.status["finished"] = True
    log.info("finished %d steps; final checkpoint in %s", cfg.run.steps, ckpt)
    while not proc.stop.wait(1.0):
        pass


if __name__ == "__main__":
    main()
