"""Token log-probs and the dual-clip PPO loss (spec §5), in torch.

Shapes: B sequences (or turn rows) x T tokens x V vocabulary. Log-probs are
natural-log probabilities of the sampled token. Everything is computed in
float32 whatever the model dtype, because bf16 log-probs make the first PPO
epoch's ratio visibly != 1 (bad-input case 6).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: beyond it a ratio is an error, not a signal


def token_logprobs(logits_BTV: torch.Tensor, token_ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at the sampled ids (spec §5; bad-input cases 6-7).

    The sampler draws from softmax(logits / T), so the trainer and the teacher
    must score with the same T: logits [2, 1, 0], T = 0.5, token 0 gives
    log_softmax([4, 2, 0])[0] = -0.1429 (not -0.4076 without T, nor -0.8152
    for the raw logit divided by T). Distillation scores use T = 1.

    Args: logits_BTV float [B, T, V] (any float dtype, upcast to float32);
      token_ids_BT int [B, T]; temperature > 0.
    Returns: float32 [B, T] (<= 0).
    Raises: ValueError on temperature <= 0 or shape mismatch.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_BTV.shape[:-1] != token_ids_BT.shape:
        raise ValueError(f"logits {tuple(logits_BTV.shape)} and token ids {tuple(token_ids_BT.shape)} disagree")
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return logp_BTV.gather(-1, token_ids_BT.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy in nats of softmax(logits / temperature) at every position.

    Args: logits_BTV float [..., V]; temperature > 0. Returns: float32 [...] (>= 0).
    Computed as logsumexp(z) - sum softmax(z) z, which stays finite for -inf
    (masked) logits where p log p would give 0 * inf.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits_BTV.float() / temperature
    p = torch.softmax(z, dim=-1)
    pz = torch.where(p > 0, p * z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - pz.sum(dim=-1)


def truncated_is_weight(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    """Truncated importance-sampling weight min(exp(clip(old - rollout, -20, 20)), cap) (spec §5).

    The sampler (rollout) and the trainer (old = the trainer's pi_old
    recomputation) compute slightly different log-probs of the same tokens
    (kernels, batching, dtype); the weight re-weights each token's
    policy-gradient term towards the trainer's distribution, and the cap bounds
    its variance. Examples (cap 5): old = rollout -> 1; old - rollout = ln 10 -> 5;
    old - rollout = -30 -> exp(-20).

    Args: old_logprobs_BT, rollout_logprobs_BT float [B, T] (nats); cap > 0.
    Returns: float32 [B, T], detached (the weight carries no gradient).
    Raises: ValueError on cap <= 0 or a shape mismatch.
    """
    if cap <= 0:
        raise ValueError(f"the truncated-IS cap must be > 0, got {cap}")
    if old_logprobs_BT.shape != rollout_logprobs_BT.shape:
        raise ValueError(f"old {tuple(old_logprobs_BT.shape)} and rollout {tuple(rollout_logprobs_BT.shape)} log-probs disagree")
    log_w = (old_logprobs_BT.detach().float() - rollout_logprobs_BT.detach().float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)


def sampler_mismatch_k3(old_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || trainer): exp(d) - 1 - d with d = old - sampler (spec §5 check).

    The tokens were drawn from the sampler, so for d = log pi_trainer - log
    pi_sampler, E_sampler[exp(d) - 1 - d] = KL(sampler || trainer); each term
    is >= 0 and 0 where the two agree. d is clipped to +-20 like the IS ratio.
    The trainer reports the token-mean over the mini-batch's loss tokens as
    `mismatch_kl` (nats/token).

    Args: old_logprobs_BT (the trainer's pi_old), sampler_logprobs_BT float
      [B, T] (nats); loss_mask_BT 0/1 [B, T].
    Returns: float32 [B, T], 0 off the mask (padding may be inf/NaN), detached.
    Raises: ValueError on a shape mismatch.
    """
    if not (old_logprobs_BT.shape == sampler_logprobs_BT.shape == loss_mask_BT.shape):
        raise ValueError(
            f"old {tuple(old_logprobs_BT.shape)}, sampler {tuple(sampler_logprobs_BT.shape)} and mask "
            f"{tuple(loss_mask_BT.shape)} must have one shape"
        )
    mask = loss_mask_BT.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs_BT.device)
    d = torch.where(mask, old_logprobs_BT.detach().float() - sampler_logprobs_BT.detach().float(), zero)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, torch.expm1(d) - d, zero)


def ppo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    total_loss_tokens: int | float | torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weight_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO policy loss of one micro-batch, token-mean over the mini-batch (spec §5).

    Per loss token: ratio = exp(logprob - old); pg = max(-A ratio,
    -A clip(ratio, 1 - clip_low, 1 + clip_high)); for A < 0 additionally
    pg = min(pg, -A clip_c) (dual clip: a huge ratio on a negative advantage
    cannot blow the loss up). Optional terms: - entropy_coef * entropy,
    + kl_coef * low-variance KL (k3) to ref_logprobs_BT, and a per-token
    weight `is_weight_BT` multiplying pg (the truncated-IS weight of spec §5,
    `truncated_is_weight`; detached, so each token's gradient scales by exactly
    its weight).

    Aggregation: sum over this micro-batch's loss tokens divided by
    `total_loss_tokens`, the number of loss tokens of the WHOLE mini-batch
    (all micro-batches, all ranks). Summing the micro-batch losses then gives
    the mini-batch token mean (bad-input case 4: 2 tokens of loss 1 plus 6 of
    loss 0 -> 0.25, where per-micro-batch means would give 0.5).

    Args:
      logprobs_BT: float [B, T] current policy log-probs (carries the gradient).
      old_logprobs_BT, advantages_BT: float [B, T] (no gradient used).
      loss_mask_BT: 0/1 [B, T]. Off-mask values never reach the loss or its
        gradient, even if they are inf/NaN padding.
      total_loss_tokens: >= this micro-batch's mask sum; 0 only if the mask is
        all zero (bad-input case 3: loss 0, zero gradient, metrics 0).
      clip_low, clip_high: epsilon (0.2 / 0.2); clip_c: dual-clip constant > 1 (3.0).
      entropy_BT: float [B, T] entropy (nats), needed when entropy_coef > 0.
      is_weight_BT: float [B, T] per-token weight of the policy-gradient term, or None (weight 1).
    Returns: (loss scalar float32 with grad, metrics of this micro-batch's loss
      tokens: ppo/clip_frac, ppo/dual_clip_frac, ppo/ratio_mean,
      ppo/ratio_dev_max = max |ratio - 1|, ppo/loss_tokens, ppo/pg_loss_sum,
      ppo/entropy_mean, ppo/kl_mean).
    Raises: ValueError on shape mismatch, clip_c <= 1, a missing entropy/ref
      tensor for a non-zero coef, or total_loss_tokens smaller than the mask sum.
    """
    shape = logprobs_BT.shape
    named = (("old_logprobs_BT", old_logprobs_BT), ("advantages_BT", advantages_BT), ("loss_mask_BT", loss_mask_BT),
             ("is_weight_BT", is_weight_BT))
    for nm, t in named:
        if t is not None and t.shape != shape:
            raise ValueError(f"{nm} shape {tuple(t.shape)} != logprobs shape {tuple(shape)}")
    if clip_c <= 1.0:
        raise ValueError(f"dual-clip constant must be > 1, got {clip_c}")
    if entropy_coef and entropy_BT is None:
        raise ValueError("entropy_coef > 0 needs entropy_BT")
    if kl_coef and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT")
    mask = loss_mask_BT.bool()
    n_local = int(mask.sum())
    denom = float(total_loss_tokens)
    if denom < n_local:
        raise ValueError(f"total_loss_tokens={denom} is smaller than this micro-batch's {n_local} loss tokens")
    zero = torch.zeros((), dtype=torch.float32, device=logprobs_BT.device)

    logp = logprobs_BT.float()
    # torch.where (not a multiply) so -inf/NaN padding off the mask gives no NaN gradient.
    log_ratio = torch.where(mask, logp - old_logprobs_BT.detach().float(), zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages_BT.detach().float(), zero)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_clip = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_c
    pg = torch.where(adv < 0, torch.minimum(pg_clip, pg3), pg_clip)
    if is_weight_BT is not None:
        # where: an off-mask weight may be inf/NaN padding.
        pg = pg * torch.where(mask, is_weight_BT.detach().float(), zero)
    per_token = pg
    ent_sum = zero
    if entropy_BT is not None:
        ent = torch.where(mask, entropy_BT.float(), zero)
        ent_sum = ent.sum()
        if entropy_coef:
            per_token = per_token - entropy_coef * ent
    kl_sum = zero
    if ref_logprobs_BT is not None:
        # k3 estimator exp(ref - logp) - (ref - logp) - 1 >= 0, clamped as in verl's low_var_kl.
        d = torch.where(mask, ref_logprobs_BT.detach().float() - logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
        kl_sum = kl.sum()
        if kl_coef:
            per_token = per_token + kl_coef * kl
    total = torch.where(mask, per_token, zero).sum()
    loss = total / denom if denom > 0 else total * 0.0

    with torch.no_grad():
        if n_local:
            r = ratio[mask]
            a = adv[mask]
            metrics = {
                "ppo/clip_frac": float((pg2[mask] > pg1[mask]).float().mean()),
                "ppo/dual_clip_frac": float(((a < 0) & (pg_clip[mask] > pg3[mask])).float().mean()),
                "ppo/ratio_mean": float(r.mean()),
                "ppo/ratio_dev_max": float((r - 1.0).abs().max()),
                "ppo/entropy_mean": float(ent_sum) / n_local,
                "ppo/kl_mean": float(kl_sum) / n_local,
            }
        else:
            metrics = dict.fromkeys(
                ("ppo/clip_frac", "ppo/dual_clip_frac", "ppo/ratio_mean", "ppo/ratio_dev_max", "ppo/entropy_mean", "ppo/kl_mean"), 0.0
            )
        metrics["ppo/loss_tokens"] = float(n_local)
        metrics["ppo/pg_loss_sum"] = float(torch.where(mask, pg, zero).sum())
    return loss, metrics


def sdar_loss(
    logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    total_loss_tokens: int | float,
    coef: float = 0.01,
    beta: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SDAR auxiliary distillation loss (AlignOPSD ALFWorld-3B recipe; issue 3):

        coef * token-mean( sigmoid(beta * (teacher - stopgrad(log pi))) * (teacher - log pi) )

    The sigmoid gate (no gradient) weighs tokens where the privileged teacher
    (identity view) is more confident than the student; minimising the term
    raises log pi there. Token-mean over the WHOLE mini-batch like `ppo_loss`
    (sum over this micro-batch's loss tokens / total_loss_tokens).

    Args: logprobs_BT float [B, T] current policy log-probs (with gradient);
      teacher_logprobs_BT float [B, T] (nats, no gradient); loss_mask_BT 0/1
      [B, T]; total_loss_tokens >= this micro-batch's mask sum; coef >= 0; beta > 0.
    Returns: (loss scalar float32, {"sdar/gate_mean", "sdar/gap_mean"} over this
      micro-batch's loss tokens). An all-zero mask gives 0 with zero gradient.
    Raises: ValueError on shape mismatch or total_loss_tokens < mask sum.
    """
    if teacher_logprobs_BT.shape != logprobs_BT.shape or loss_mask_BT.shape != logprobs_BT.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logprobs_BT.shape)}, mask {tuple(loss_mask_BT.shape)} and logprobs "
            f"{tuple(logprobs_BT.shape)} must have one shape"
        )
    mask = loss_mask_BT.bool()
    n_local = int(mask.sum())
    if float(total_loss_tokens) < n_local:
        raise ValueError(f"total_loss_tokens={total_loss_tokens} is smaller than this micro-batch's {n_local} loss tokens")
    zero = torch.zeros((), dtype=torch.float32, device=logprobs_BT.device)
    logp = logprobs_BT.float()
    gap = torch.where(mask, teacher_logprobs_BT.detach().float() - logp, zero)  # where: padding may be -inf
    gate = torch.sigmoid(beta * gap.detach())
    total = torch.where(mask, gate * gap, zero).sum()
    loss = coef * total / float(total_loss_tokens) if total_loss_tokens else total * 0.0
    with torch.no_grad():
        metrics = {
            "sdar/gate_mean": float(gate[mask].mean()) if n_local else 0.0,
            "sdar/gap_mean": float(gap[mask].mean()) if n_local else 0.0,
        }
    return loss, metrics
