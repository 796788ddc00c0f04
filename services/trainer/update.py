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

from opsd.config import SDARSection, TrainerSection
from opsd.credit.policy_loss import (
    entropy_from_logits, ppo_loss, sampler_mismatch_k3, sdar_loss, token_logprobs, truncated_is_weight,
)
from opsd.models.hf import autocast


@dataclass
class Sequence:
    """One trajectory as the update sees it (all arrays [S])."""

    token_ids_S: np.ndarray
    loss_mask_S: np.ndarray
    advantages_S: np.ndarray
    sampler_logprobs_S: np.ndarray
    teacher_logprobs_S: np.ndarray | None = None  # identity privileged view; needed by the SDAR term


def _pad(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    S = max(len(s.token_ids_S) for s in seqs)
    B = len(seqs)
    out = {
        "ids": torch.zeros(B, S, dtype=torch.long),
        "attn": torch.zeros(B, S, dtype=torch.long),
        "mask": torch.zeros(B, S, dtype=torch.float32),
        "adv": torch.zeros(B, S, dtype=torch.float32),
        "sampler": torch.zeros(B, S, dtype=torch.float32),
        "teacher": torch.zeros(B, S, dtype=torch.float32),
    }
    for b, s in enumerate(seqs):
        n = len(s.token_ids_S)
        out["ids"][b, :n] = torch.from_numpy(s.token_ids_S.astype(np.int64))
        out["attn"][b, :n] = 1
        out["mask"][b, :n] = torch.from_numpy(s.loss_mask_S.astype(np.float32))
        out["adv"][b, :n] = torch.from_numpy(s.advantages_S)
        out["sampler"][b, :n] = torch.from_numpy(s.sampler_logprobs_S)
        if s.teacher_logprobs_S is not None:
            out["teacher"][b, :n] = torch.from_numpy(s.teacher_logprobs_S)
    return out


def ppo_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, seqs: list[Sequence], cfg: TrainerSection,
    dtype: str = "float32", temperature: float = 1.0, sdar: SDARSection | None = None,
) -> dict[str, float]:
    """Run `cfg.ppo_epochs` epochs of dual-clip PPO over `seqs`; returns step metrics.

    pi_old is the trainer's own recomputation: the first epoch's forward,
    detached (before any optimizer step, so its ratio is exactly 1); later
    epochs reuse it. Log-probs are taken at the sampling `temperature`, the
    distribution the tokens were drawn from (bad-input case 6); `dtype` is the
    forward-pass convention shared with the sampler. `sampler_logprob_mismatch` = mean |sampler - trainer|
    log-prob over loss tokens (nats), the sampler/trainer agreement check;
    `mismatch_kl` = token-mean of k3 = exp(d) - 1 - d, d = pi_old - sampler
    (an estimate of KL(sampler || trainer), nats/token, >= 0; spec §5).
    With `cfg.truncated_is` each token's policy-gradient term is weighted by
    min(exp(clip(pi_old - sampler, +-20)), cfg.tis_cap) (spec §5), fixed
    from the first epoch like pi_old.

    Sequences without loss tokens add nothing to the loss or its gradient and
    are left out. Sequences holding a token id outside the model's vocabulary
    are left out too and counted in `dropped_sequences` (an embedding lookup
    would crash the trainer). With no loss token at all (bad-input case 3)
    nothing runs: the optimizer is not stepped, so AdamW momentum and weight
    decay cannot move the weights on an empty batch. An epoch whose gradient
    norm is not finite does not step the optimizer either (counted in
    `skipped_steps`); the weights never see a NaN.

    With `sdar.coef > 0` the SDAR auxiliary loss (`opsd.credit.policy_loss.sdar_loss`)
    against each sequence's `teacher_logprobs_S` is added (`sdar_loss` metric);
    ValueError if a sequence lacks teacher log-probs then.
    """
    use_sdar = sdar is not None and sdar.coef > 0
    if use_sdar and any(s.teacher_logprobs_S is None for s in seqs):
        raise ValueError("the SDAR auxiliary loss (credit.sdar.coef > 0) needs teacher log-probs for every sequence")
    vocab = _vocab_size(model)
    usable = [s for s in seqs if s.loss_mask_S.any()]
    seqs = [s for s in usable if vocab is None or _ids_in_range(s.token_ids_S, vocab)]
    dropped = len(usable) - len(seqs)
    total_tokens = float(sum(float(s.loss_mask_S.sum()) for s in seqs))
    if total_tokens == 0:
        return dict.fromkeys(
            ("loss", "clip_frac", "entropy", "grad_norm", "ratio_dev_max", "sampler_logprob_mismatch", "mismatch_kl", "loss_tokens",
             "sdar_loss"), 0.0
        ) | {"dropped_sequences": float(dropped), "skipped_steps": 0.0}
    model.train()
    micro = [seqs[j : j + cfg.micro_batch_size] for j in range(0, len(seqs), cfg.micro_batch_size)]
    batches = [_pad(mb) for mb in micro]
    old: list[torch.Tensor | None] = [None] * len(batches)
    is_weight: list[torch.Tensor | None] = [None] * len(batches)
    sums = {"loss": 0.0, "clip_frac": 0.0, "entropy": 0.0, "mismatch": 0.0, "ratio_dev_max": 0.0, "sdar": 0.0}
    kl_sum = 0.0
    grad_norm = 0.0
    skipped = 0
    for _epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch = dict.fromkeys(sums, 0.0)  # merged into sums only if the epoch's gradient is finite
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
                sampler = b["sampler"][:, 1:]
                n = mask.sum().clamp_min(1)
                epoch["mismatch"] += float(((lp.detach() - sampler).abs() * mask).sum() / n) * float(mask.sum()) / max(total_tokens, 1)
                # A NaN trainer log-prob (its epoch is skipped, see skipped_steps) adds 0, not NaN.
                kl_sum += float(sampler_mismatch_k3(old[j], sampler, mask).nan_to_num(nan=0.0).sum())
                if cfg.truncated_is:
                    is_weight[j] = truncated_is_weight(old[j], sampler, cfg.tis_cap)
            loss, m = ppo_loss(
                lp, old[j], b["adv"][:, 1:], mask, total_tokens,
                cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
                entropy_BT=ent, entropy_coef=cfg.entropy_coef, is_weight_BT=is_weight[j],
            )
            if use_sdar:
                aux, _ = sdar_loss(lp, b["teacher"][:, 1:], mask, total_tokens, sdar.coef, sdar.beta)
                epoch["sdar"] += float(aux.detach())
                loss = loss + aux
            loss.backward()
            epoch["loss"] += float(loss.detach())
            share = float(mask.sum()) / max(total_tokens, 1)
            epoch["clip_frac"] += float(m["ppo/clip_frac"]) * share
            epoch["entropy"] += float((ent.detach() * mask).sum()) / max(total_tokens, 1)
            epoch["ratio_dev_max"] = max(epoch["ratio_dev_max"], float(m["ppo/ratio_dev_max"]))
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if not np.isfinite(norm):
            # A NaN gradient must never reach the weights: skip this optimizer step, count it.
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
        grad_norm = norm
        for k, v in epoch.items():
            sums[k] = max(sums[k], v) if k == "ratio_dev_max" else sums[k] + v
    model.eval()
    e = float(max(cfg.ppo_epochs - skipped, 1))
    return {
        "loss": sums["loss"] / e,
        "clip_frac": sums["clip_frac"] / e,
        "entropy": sums["entropy"] / e,
        "grad_norm": grad_norm,
        "ratio_dev_max": sums["ratio_dev_max"],
        "sampler_logprob_mismatch": sums["mismatch"],
        "mismatch_kl": kl_sum / total_tokens,
        "loss_tokens": total_tokens,
        "dropped_sequences": float(dropped),
        "skipped_steps": float(skipped),
        "sdar_loss": sums["sdar"] / e,
    }


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, seqs: list[Sequence], dtype: str = "float32", temperature: float = 1.0, micro_batch_size: int = 2,
) -> list[np.ndarray]:
    """Log-probs of every sequence's own tokens under `model` (e.g. the frozen initial policy for ex_opd).

    Returns float32 [S] per sequence: position t holds log softmax(logits_{t-1}/T)[id_t],
    position 0 (always prompt) holds 0.
    """
    out: list[np.ndarray] = []
    model.eval()
    for j in range(0, len(seqs), micro_batch_size):
        mb = seqs[j : j + micro_batch_size]
        b = _pad(mb)
        with autocast(dtype):
            logits = model(input_ids=b["ids"], attention_mask=b["attn"]).logits
        lp = token_logprobs(logits[:, :-1].float(), b["ids"][:, 1:], temperature)
        for r, s in enumerate(mb):
            arr = np.zeros(len(s.token_ids_S), dtype=np.float32)
            arr[1:] = lp[r, : len(s.token_ids_S) - 1].numpy()
            out.append(arr)
    return out


def _vocab_size(model: torch.nn.Module) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else None


def _ids_in_range(ids: np.ndarray, vocab: int) -> bool:
    return ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)
