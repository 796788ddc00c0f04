"""One PPO update of the policy on a step's trajectories (spec 5).

Each trajectory is one sequence (all its turns); the loss covers its loss
tokens only. The step's trajectories form one mini-batch split into
micro-batches; the token-mean divides by the loss tokens of the WHOLE
mini-batch, so micro-batch boundaries do not change the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from opsd.config import TrainerSection
from opsd.credit.policy_loss import entropy_from_logits, ppo_loss, token_logprobs
from opsd.models.hf import autocast


@dataclass
class Sequence:
    """One trajectory as the update sees it (all arrays [S])."""

    token_ids_S: np.ndarray
    loss_mask_S: np.ndarray
    advantages_S: np.ndarray
    sampler_logprobs_S: np.ndarray


def _pad(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    S = max(len(s.token_ids_S) for s in seqs)
    B = len(seqs)
    out = {
        "ids": torch.zeros(B, S, dtype=torch.long),
        "attn": torch.zeros(B, S, dtype=torch.long),
        "mask": torch.zeros(B, S, dtype=torch.float32),
        "adv": torch.zeros(B, S, dtype=torch.float32),
        "sampler": torch.zeros(B, S, dtype=torch.float32),
    }
    for b, s in enumerate(seqs):
        n = len(s.token_ids_S)
        out["ids"][b, :n] = torch.from_numpy(s.token_ids_S.astype(np.int64))
        out["attn"][b, :n] = 1
        out["mask"][b, :n] = torch.from_numpy(s.loss_mask_S.astype(np.float32))
        out["adv"][b, :n] = torch.from_numpy(s.advantages_S)
        out["sampler"][b, :n] = torch.from_numpy(s.sampler_logprobs_S)
    return out


def ppo_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, seqs: list[Sequence], cfg: TrainerSection,
    dtype: str = "float32", temperature: float = 1.0,
) -> dict[str, float]:
    """Run `cfg.ppo_epochs` epochs of dual-clip PPO over `seqs`; returns step metrics.

    pi_old is the trainer's own recomputation: the first epoch's forward,
    detached (before any optimizer step, so its ratio is exactly 1); later
    epochs reuse it. Log-probs are taken at the sampling `temperature`, the
    distribution the tokens were drawn from (bad-input case 6); `dtype` is the
    forward-pass convention shared with the sampler. `sampler_logprob_mismatch` = mean |sampler - trainer|
    log-prob over loss tokens (nats), the sampler/trainer agreement check.
    """
    model.train()
    total_tokens = float(sum(float(s.loss_mask_S.sum()) for s in seqs))
    micro = [seqs[j : j + cfg.micro_batch_size] for j in range(0, len(seqs), cfg.micro_batch_size)]
    batches = [_pad(mb) for mb in micro]
    old: list[torch.Tensor | None] = [None] * len(batches)
    sums = {"loss": 0.0, "clip_frac": 0.0, "entropy": 0.0, "mismatch": 0.0, "ratio_dev_max": 0.0}
    grad_norm = 0.0
    for _epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for j, b in enumerate(batches):
            with autocast(dtype):
                logits = model(input_ids=b["ids"], attention_mask=b["attn"]).logits
            logits = logits[:, :-1].float()
            # Position t's log-prob comes from the logits at t-1; position 0 is always prompt.
            lp = token_logprobs(logits, b["ids"][:, 1:], temperature)
            ent = entropy_from_logits(logits, temperature)
            mask = b["mask"][:, 1:]
            if old[j] is None:
                old[j] = lp.detach()
                n = mask.sum().clamp_min(1)
                sums["mismatch"] += float(((lp.detach() - b["sampler"][:, 1:]).abs() * mask).sum() / n) * float(mask.sum()) / max(total_tokens, 1)
            loss, m = ppo_loss(
                lp, old[j], b["adv"][:, 1:], mask, total_tokens,
                cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
                entropy_BT=ent, entropy_coef=cfg.entropy_coef,
            )
            loss.backward()
            sums["loss"] += float(loss.detach())
            share = float(mask.sum()) / max(total_tokens, 1)
            sums["clip_frac"] += float(m.get("clip_frac", 0.0)) * share
            sums["entropy"] += float((ent.detach() * mask).sum()) / max(total_tokens, 1)
            sums["ratio_dev_max"] = max(sums["ratio_dev_max"], float(m.get("ratio_dev_max", 0.0)))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if not np.isfinite(grad_norm):
            # A NaN gradient must never reach the weights: skip this optimizer step.
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError("non-finite gradient norm; update skipped")
        optimizer.step()
    model.eval()
    e = float(cfg.ppo_epochs)
    return {
        "loss": sums["loss"] / e,
        "clip_frac": sums["clip_frac"] / e,
        "entropy": sums["entropy"] / e,
        "grad_norm": grad_norm,
        "ratio_dev_max": sums["ratio_dev_max"],
        "sampler_logprob_mismatch": sums["mismatch"],
        "loss_tokens": total_tokens,
    }
