"""One step's learning: credit assignment with the configured method, then the PPO update.

`learn` is what the trainer's loop runs once all groups of a step have
arrived; it is a function of its arguments so tests run every method through
it without services.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from opsd.config import RunConfig
from opsd.credit import compute_advantages
from opsd.credit.guard import apply_teacher_guard
from opsd.types import CreditBatch, RolloutGroup, ScoredGroup
from services.trainer.batch import build_credit_batch, scatter_advantages
from services.trainer.distributed import Message, World, send
from services.trainer.dump import write_credit_dump
from services.trainer.reference import ReferencePolicy
from services.trainer.update import FirstEpoch, Sequence, loss_norm_tokens, ppo_update


@dataclass
class StepResult:
    batch: CreditBatch  # canonical rows
    advantages_ML: np.ndarray  # float32 [M, L], what the update trained on
    credit_metrics: dict[str, float]
    update: dict[str, float]
    # (group index, trajectory index) -> float32 [S] token advantages (0 off the loss mask): the trackers' table
    trajectory_advantages: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    distributions: dict[str, np.ndarray] = field(default_factory=dict)  # compute_advantages' per-item arrays


def learn(
    cfg: RunConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[RolloutGroup],
    scored: list[ScoredGroup] | None,
    reference: ReferencePolicy | None = None,
    dump_path: Path | None = None,
    world: World | None = None,
) -> StepResult:
    """Advantages of `groups` with `cfg.run.method`, then `ppo_update` on them.

    `scored` (one per group, same order) is required by every method but grpo.
    `reference` (the frozen initial policy, services/trainer/reference.py) supplies ex_opd's base log-probs and,
    with `cfg.trainer.kl_coef > 0`, the reference log-probs of the KL term (one forward pass over the step's
    trajectories, before the update; ValueError without it then).
    With a teacher, `cfg.credit.teacher_guard` acts on the batch first (opsd/credit/guard.py).
    With `dump_path` the step's credit inputs (after the guard) and the first PPO epoch's loss inputs are written
    there after the update (services/trainer/dump.py). The SDAR term uses each trajectory's identity
    teacher log-probs when `cfg.credit.sdar.coef > 0`. `update["reference_seconds"]`: the reference's forward
    pass (s; ~0 without one).
    With a distributed `world` (rank 0 of torchrun; `model` wrapped by
    services.trainer.distributed.parallelize) the step's sequences are first
    sent to the other ranks, which run the update with it (`follow`).
    Raises ValueError when the method needs data the step lacks.
    """
    keys = [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.trajectories))]
    trajs = {key: groups[key[0]].trajectories[key[1]] for key in keys}
    needs_base = cfg.run.method == "ex_opd" and cfg.credit.ex_opd.base == "initial"
    if (cfg.trainer.kl_coef > 0 or needs_base) and reference is None:
        raise ValueError("trainer.kl_coef > 0 and ex_opd's initial base need the reference policy (reference=None)")
    ref, t_ref = None, time.perf_counter()
    if reference is not None and (cfg.trainer.kl_coef > 0 or needs_base):
        plain = [Sequence(t.token_ids_S, t.loss_mask_S, np.zeros(len(t.token_ids_S), np.float32), t.sampler_logprobs_S)
                 for t in trajs.values()]
        ref = dict(zip(keys, reference.logprobs(plain, cfg.model.dtype, cfg.rollout.temperature, cfg.trainer.micro_batch_size)))
    t_ref = time.perf_counter() - t_ref
    batch, rows = build_credit_batch(groups, scored, ref if needs_base else None)
    guard = {}
    if scored:  # a teacher worse than its student on the winning trajectories: reported, maybe shrunk
        batch, guard = apply_teacher_guard(batch, cfg.credit.teacher_guard, cfg.credit.teacher_guard_weight)
    distributions: dict[str, np.ndarray] = {}
    advantages_ML, credit_metrics = compute_advantages(cfg.run.method, batch, cfg.credit, distributions)
    credit_metrics = {**credit_metrics, **guard}
    adv = scatter_advantages(groups, rows, advantages_ML)
    seqs = [
        Sequence(t.token_ids_S, t.loss_mask_S, adv[key], t.sampler_logprobs_S,
                 scored[key[0]].teacher_logprobs_S[key[1]] if scored else None,
                 ref[key] if ref is not None and cfg.trainer.kl_coef > 0 else None)
        for key, t in trajs.items()
    ]
    if world is not None:
        send(world, Message("update", seqs))
    record = FirstEpoch() if dump_path is not None else None
    update = ppo_update(model, optimizer, seqs, cfg.trainer, cfg.model.dtype, cfg.rollout.temperature, cfg.credit.sdar,
                        world, loss_norm_tokens(cfg), record)
    if dump_path is not None:
        write_credit_dump(dump_path, cfg, batch, advantages_ML, groups, scored, record)
    return StepResult(batch, advantages_ML, credit_metrics, update | {"reference_seconds": t_ref}, adv, distributions)
