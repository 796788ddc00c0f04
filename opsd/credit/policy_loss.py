"""Token log-probs and the dual-clip PPO loss (spec §5), in torch.

Shapes: B sequences (or turn rows) x T tokens x V vocabulary. Log-probs are
natural-log probabilities of the sampled token. Everything is computed in
float32 whatever the model dtype, because bf16 log-probs make the first PPO
epoch's ratio visibly != 1 (bad-input case 6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: beyond it a ratio is an error, not a signal
SEQ_LOG_RATIO_MAX = 10.0  # GSPO's upper clamp of the sequence log-ratio (verl compute_policy_loss_gspo)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("truncate", "mask")


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


def _sampler_log_ratio(
    old_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool mask [B, T], detached float32 old - sampler on the mask, 0 off it); ValueError on a shape mismatch."""
    if not (old_logprobs_BT.shape == sampler_logprobs_BT.shape == loss_mask_BT.shape):
        raise ValueError(
            f"old {tuple(old_logprobs_BT.shape)}, sampler {tuple(sampler_logprobs_BT.shape)} and mask "
            f"{tuple(loss_mask_BT.shape)} must have one shape"
        )
    mask = loss_mask_BT.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs_BT.device)
    # where, not a multiply: padding off the mask may be inf/NaN.
    return mask, torch.where(mask, old_logprobs_BT.detach().float() - sampler_logprobs_BT.detach().float(), zero)


def importance_weight(
    old_logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 5.0,
    cap_low: float | None = None,
) -> torch.Tensor:
    """Importance-sampling weight pi_old / pi_sampler of each loss token, truncated or masked.

    The sampler (vLLM) and the trainer (old = the trainer's pi_old recomputation)
    score the same tokens slightly differently; the weight re-weights each
    token's policy-gradient term towards the trainer's distribution.
      level "token":    w = exp(clip(old - sampler, +-20)) per token.
      level "sequence": w_b = exp(clip(sum over row b's loss tokens of (old - sampler), +-20)),
                        the same on every token of the row.
      mode "truncate":  w clamped to [cap_low, cap] (cap_low None: no lower bound).
      mode "mask":      w set to 0 where w > cap or w < cap_low (at sequence level the
                        whole row), else kept; ppo_loss reports the zeroed share as
                        ppo/is_masked_frac.
    Spec §5's min(exp(clip(old - rollout, +-20)), 5) is level "token", mode "truncate", cap 5.
    Follows verl b178a3cd (verl/trainer/ppo/rollout_corr_helper.py
    compute_rollout_correction_weights: rollout_is token|sequence, SAFETY_BOUND 20) and
    TRL f2cd5771 (trl/trainer/grpo_trainer.py, vllm_importance_sampling_mode
    token_truncate|token_mask|sequence_truncate|sequence_mask with clip_min/clip_max;
    TRL does not bound the log-ratio at +-20, so the two differ only where |log w| > 20).
    Example: old - sampler = -1 and 0.5 on two 5-token rows, cap 2: token/truncate
    gives 0.368 and 1.649 (verl tests/trainer/ppo/test_rollout_corr.py test_mask_mode);
    with cap_low 0.5, mask mode zeroes the first row.

    Args: old_logprobs_BT, sampler_logprobs_BT float [B, T] (nats; off-mask values may
      be inf/NaN padding); loss_mask_BT 0/1 [B, T]; level "token" | "sequence";
      mode "truncate" | "mask"; cap > 0 (math.inf: no upper bound, TRL's clip_max=None);
      cap_low None or 0 <= cap_low < cap.
    Returns: float32 [B, T], detached, 0 off the mask.
    Raises: ValueError on an unknown level or mode, cap <= 0, cap_low outside [0, cap),
      or a shape mismatch.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance-weight level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"importance-weight mode must be one of {IS_MODES}, got {mode!r}")
    if cap <= 0:
        raise ValueError(f"the IS cap must be > 0, got {cap}")
    if cap_low is not None and not 0 <= cap_low < cap:
        raise ValueError(f"the IS lower cap must satisfy 0 <= cap_low < cap, got cap_low={cap_low}, cap={cap}")
    mask, log_w = _sampler_log_ratio(old_logprobs_BT, sampler_logprobs_BT, loss_mask_BT)
    zero = torch.zeros((), dtype=torch.float32, device=log_w.device)
    if level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "truncate":
        w = w.clamp(min=cap_low, max=cap)
    else:
        outside = (w > cap) if cap_low is None else (w > cap) | (w < cap_low)
        w = torch.where(outside, zero, w)
    return torch.where(mask, w, zero)


def truncated_is_weight(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    """Truncated importance-sampling weight min(exp(clip(old - rollout, -20, 20)), cap) (spec §5).

    `importance_weight` at level "token", mode "truncate" on every position.
    Examples (cap 5): old = rollout -> 1; old - rollout = ln 10 -> 5;
    old - rollout = -30 -> exp(-20).

    Args: old_logprobs_BT, rollout_logprobs_BT float [B, T] (nats); cap > 0.
    Returns: float32 [B, T], detached (the weight carries no gradient).
    Raises: ValueError on cap <= 0 or a shape mismatch.
    """
    everywhere = torch.ones(old_logprobs_BT.shape, dtype=torch.bool, device=old_logprobs_BT.device)
    return importance_weight(old_logprobs_BT, rollout_logprobs_BT, everywhere, cap=cap)


def kl_penalty(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs (J. Schulman, "Approximating KL").

    With d = ref - logp: "k1" = logp - ref (= -d); "k2" = 0.5 (logp - ref)^2;
    "k3" = exp(d) - d - 1 with d clamped to +-20 and the result to [-10, 10]
    (verl's low_var_kl). k1 and k2 are unclamped, as in verl b178a3cd
    verl/trainer/ppo/core_algos.py kl_penalty_forward. TRL f2cd5771 GRPO's KL
    term is k3 without the clamps. Example: logp = 0, ref = ln 2: k1 = -0.693,
    k2 = 0.240, k3 = 2 - ln 2 - 1 = 0.307.

    Args: logprobs_BT float [B, T] (nats, carries the gradient); ref_logprobs_BT
      float [B, T] (nats, detached); estimator "k1" | "k2" | "k3".
    Returns: float32 [B, T]; elementwise, so the caller masks padding first.
    Raises: ValueError on an unknown estimator or a shape mismatch.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(f"logprobs {tuple(logprobs_BT.shape)} and ref {tuple(ref_logprobs_BT.shape)} disagree")
    logp = logprobs_BT.float()
    ref = ref_logprobs_BT.detach().float()
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref).square()
    d = (ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


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
    mask, d = _sampler_log_ratio(old_logprobs_BT, sampler_logprobs_BT, loss_mask_BT)
    zero = torch.zeros((), dtype=torch.float32, device=d.device)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, torch.expm1(d) - d, zero)


def _aggregation(
    loss_agg: str,
    mask_BT: torch.Tensor,
    total_loss_tokens: int | float | torch.Tensor,
    total_sequences: int | float | torch.Tensor | None,
    norm_tokens: int | float | None,
) -> tuple[torch.Tensor, float]:
    """(row scale float32 [B, 1], denominator) with loss = sum_b scale_b sum_t x_bt / denominator.

    Both depend only on the row and on the WHOLE mini-batch, so the micro-batch
    losses sum to the mini-batch loss. Raises ValueError as ppo_loss documents.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    n_B1 = mask_BT.sum(dim=-1, keepdim=True, dtype=torch.float32)
    ones = torch.ones_like(n_B1)  # x * 1.0 is exact: token-mean stays bit-identical to the sum / N it always was
    if loss_agg == "token-mean":
        return ones, float(total_loss_tokens)
    if total_sequences is None:
        raise ValueError(f"loss_agg={loss_agg!r} needs total_sequences (the mini-batch's sequences with >= 1 loss token)")
    n_rows = int((n_B1 > 0).sum())
    if float(total_sequences) < n_rows:
        raise ValueError(f"total_sequences={float(total_sequences)} is smaller than this micro-batch's {n_rows} non-empty rows")
    if loss_agg == "seq-mean-token-mean":
        return 1.0 / n_B1.clamp_min(1.0), float(total_sequences)
    if loss_agg == "seq-mean-token-sum":
        return ones, float(total_sequences)
    if norm_tokens is None or norm_tokens <= 0:
        raise ValueError(
            f"loss_agg='seq-mean-token-sum-norm' needs norm_tokens > 0 (e.g. the generation budget), got {norm_tokens}"
        )
    return ones, float(total_sequences) * float(norm_tokens)


def _log_ratio(logp_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, level: str) -> torch.Tensor:
    """log pi / pi_old per loss token (0 off the mask), at token or sequence (GSPO-token) level; see ppo_loss."""
    zero = torch.zeros((), dtype=torch.float32, device=logp_BT.device)
    # torch.where (not a multiply) so -inf/NaN padding off the mask gives no NaN gradient.
    log_ratio = torch.where(mask_BT, logp_BT - old_logprobs_BT.detach().float(), zero)
    if level == "token":
        return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_B1 = log_ratio.detach().sum(dim=-1, keepdim=True) / mask_BT.sum(dim=-1, keepdim=True).clamp_min(1)
    logp = torch.where(mask_BT, logp_BT, zero)
    return torch.where(mask_BT, logp - logp.detach() + seq_B1, zero).clamp(max=SEQ_LOG_RATIO_MAX)


def _check_ppo_args(
    logprobs_BT: torch.Tensor, named_BT: tuple[tuple[str, torch.Tensor | None], ...], clip_c: float | None,
    importance_level: str, kl_estimator: str, entropy_coef: float, entropy_BT: torch.Tensor | None, kl_coef: float,
    ref_logprobs_BT: torch.Tensor | None,
) -> None:
    """Raises ValueError as ppo_loss documents (shapes, clip_c, modes, a tensor its coef needs)."""
    shape = logprobs_BT.shape
    for nm, t in named_BT:
        if t is not None and t.shape != shape:
            raise ValueError(f"{nm} shape {tuple(t.shape)} != logprobs shape {tuple(shape)}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant must be > 1 (or None for no dual clip), got {clip_c}")
    if importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_level must be one of {IMPORTANCE_LEVELS}, got {importance_level!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if entropy_coef and entropy_BT is None:
        raise ValueError("entropy_coef > 0 needs entropy_BT")
    if kl_coef and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT")


class _PolicyGradient(NamedTuple):
    """The dual-clip policy-gradient term of `ppo_loss` per token [B, T] and the pieces its metrics read."""

    ratio: torch.Tensor
    adv: torch.Tensor  # advantages, 0 off the mask
    pg1: torch.Tensor  # -A ratio
    pg2: torch.Tensor  # -A clip(ratio, 1 - clip_low, 1 + clip_high)
    pg_clip: torch.Tensor  # max(pg1, pg2)
    pg3: torch.Tensor | None  # -A clip_c; None without dual clip
    weight: torch.Tensor | None  # is_weight_BT, 0 off the mask; None without
    pg: torch.Tensor  # dual-clipped and weighted: the term the loss sums


def _dual_clip_pg(
    logp_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor, mask_BT: torch.Tensor,
    is_weight_BT: torch.Tensor | None, clip_low: float, clip_high: float, clip_c: float | None, importance_level: str,
) -> _PolicyGradient:
    """pg = max(-A ratio, -A clip(ratio)), then min(pg, -A clip_c) where A < 0, times the IS weight (see ppo_loss)."""
    zero = torch.zeros((), dtype=torch.float32, device=logp_BT.device)
    ratio = torch.exp(_log_ratio(logp_BT, old_logprobs_BT, mask_BT, importance_level))
    adv = torch.where(mask_BT, advantages_BT.detach().float(), zero)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_clip = torch.maximum(pg1, pg2)
    pg = pg_clip
    pg3 = None
    if clip_c is not None:
        pg3 = -adv * clip_c
        pg = torch.where(adv < 0, torch.minimum(pg_clip, pg3), pg_clip)
    weight = None
    if is_weight_BT is not None:
        # where: an off-mask weight may be inf/NaN padding.
        weight = torch.where(mask_BT, is_weight_BT.detach().float(), zero)
        pg = pg * weight
    return _PolicyGradient(ratio, adv, pg1, pg2, pg_clip, pg3, weight, pg)


def _add_entropy_and_kl(
    pg_BT: torch.Tensor, logp_BT: torch.Tensor, mask_BT: torch.Tensor, entropy_BT: torch.Tensor | None,
    entropy_coef: float, ref_logprobs_BT: torch.Tensor | None, kl_coef: float, kl_estimator: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss pg - entropy_coef * entropy + kl_coef * kl, masked entropy sum, masked kl sum).

    A term whose tensor is given is summed for the metrics even when its coef is 0 (then it adds nothing)."""
    zero = torch.zeros((), dtype=torch.float32, device=logp_BT.device)
    per_token = pg_BT
    ent_sum = zero
    if entropy_BT is not None:
        ent = torch.where(mask_BT, entropy_BT.float(), zero)
        ent_sum = ent.sum()
        if entropy_coef:
            per_token = per_token - entropy_coef * ent
    kl_sum = zero
    if ref_logprobs_BT is not None:
        # Both inputs masked first: the estimator is elementwise and padding may be -inf.
        kl = kl_penalty(
            torch.where(mask_BT, logp_BT, zero), torch.where(mask_BT, ref_logprobs_BT.detach().float(), zero), kl_estimator
        )
        kl_sum = kl.sum()
        if kl_coef:
            per_token = per_token + kl_coef * kl
    return per_token, ent_sum, kl_sum


def _ppo_metrics(
    mask_BT: torch.Tensor, n_local: int, terms: _PolicyGradient, ent_sum: torch.Tensor, kl_sum: torch.Tensor
) -> dict[str, float]:
    """ppo_loss's metrics over this micro-batch's loss tokens (call under torch.no_grad)."""
    if n_local:
        r = terms.ratio[mask_BT]
        a = terms.adv[mask_BT]
        if terms.pg3 is not None:
            dual = (a < 0) & (terms.pg_clip[mask_BT] > terms.pg3[mask_BT])
        else:
            dual = torch.zeros_like(a, dtype=torch.bool)
        weight = terms.weight
        metrics = {
            "ppo/clip_frac": float((terms.pg2[mask_BT] > terms.pg1[mask_BT]).float().mean()),
            "ppo/dual_clip_frac": float(dual.float().mean()),
            "ppo/ratio_mean": float(r.mean()),
            "ppo/ratio_dev_max": float((r - 1.0).abs().max()),
            "ppo/entropy_mean": float(ent_sum) / n_local,
            "ppo/kl_mean": float(kl_sum) / n_local,
            "ppo/is_masked_frac": float((weight[mask_BT] == 0).float().mean()) if weight is not None else 0.0,
        }
    else:
        metrics = dict.fromkeys(
            ("ppo/clip_frac", "ppo/dual_clip_frac", "ppo/ratio_mean", "ppo/ratio_dev_max", "ppo/entropy_mean", "ppo/kl_mean",
             "ppo/is_masked_frac"), 0.0
        )
    zero = torch.zeros((), dtype=torch.float32, device=terms.pg.device)
    metrics["ppo/loss_tokens"] = float(n_local)
    metrics["ppo/loss_sequences"] = float(int(mask_BT.any(dim=-1).sum()))
    metrics["ppo/pg_loss_sum"] = float(torch.where(mask_BT, terms.pg, zero).sum())
    return metrics



def ppo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    total_loss_tokens: int | float | torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weight_BT: torch.Tensor | None = None,
    *,
    loss_agg: str = "token-mean",
    total_sequences: int | float | torch.Tensor | None = None,
    norm_tokens: int | float | None = None,
    importance_level: str = "token",
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO policy loss of one micro-batch, aggregated over the whole mini-batch (spec §5).

    One row of the [B, T] tensors is one whole sequence. Per loss token:
    ratio = exp(logprob - old); pg = max(-A ratio, -A clip(ratio, 1 - clip_low,
    1 + clip_high)); for A < 0 additionally pg = min(pg, -A clip_c) (dual clip;
    clip_c=None turns it off: verl's vanilla loss without dual clip, TRL's
    "grpo"). A per-token weight `is_weight_BT` multiplies pg (`importance_weight`;
    detached, so each token's gradient scales by exactly its weight). Optional
    terms: - entropy_coef * entropy and + kl_coef * kl_penalty(logprob, ref,
    kl_estimator). Follows verl b178a3cd verl/trainer/ppo/core_algos.py
    (compute_policy_loss_vanilla, compute_policy_loss_gspo, agg_loss) and TRL
    f2cd5771 trl/trainer/grpo_trainer.py _compute_loss.

    importance_level "sequence" is GSPO (arXiv 2507.18071) in verl's GSPO-token
    form: log s = logp - sg(logp) + sg(mean over the row's loss tokens of
    (logp - old)), clamped at max 10; its value is the sequence ratio on every
    token, its gradient flows through the token's own log-prob. Clipping as for
    tokens. verl's compute_policy_loss_gspo forces seq-mean-token-mean and has
    no dual clip: with loss_agg="seq-mean-token-mean", clip_c=None this equals
    it; with one advantage per sequence it also equals TRL's
    importance_sampling_level="sequence", gradient included (TRL does not clamp
    at 10).

    Aggregation (loss_agg), the same for the pg, entropy and KL terms (verl's
    dp_actor aggregates all three with loss_agg_mode; TRL keeps its entropy
    bonus a token mean for every loss_type). n_b = row b's loss tokens, S =
    `total_sequences` = the mini-batch's rows with >= 1 loss token, N =
    `total_loss_tokens`; a fully masked row contributes nothing:
      "token-mean":              sum_b sum_t x / N (TRL "dapo"; spec §5)
      "seq-mean-token-mean":     sum_b (sum_t x / n_b) / S (verl; TRL "grpo"
                                 divides by all B rows, empty ones included)
      "seq-mean-token-sum":      sum_b sum_t x / S
      "seq-mean-token-sum-norm": sum_b sum_t x / (S norm_tokens) (Dr. GRPO, arXiv
                                 2503.20783; TRL "dr_grpo" with norm_tokens =
                                 max_completion_length; verl's agg_loss divides by
                                 loss_scale_factor alone, without S)
    All denominators are the WHOLE mini-batch's (all micro-batches, all ranks),
    so the micro-batch losses sum to the mini-batch loss (bad-input case 4:
    2 tokens of loss 1 plus 6 of loss 0 -> 0.25 token-mean, where per-micro-
    batch means would give 0.5). Two rows of 1 and 3 tokens with losses 1 and
    (0, 0, 0): token-mean 1/4, seq-mean-token-mean (1 + 0)/2 = 1/2.

    Args:
      logprobs_BT: float [B, T] current policy log-probs (carries the gradient).
      old_logprobs_BT, advantages_BT: float [B, T] (no gradient used).
      loss_mask_BT: 0/1 [B, T]. Off-mask values never reach the loss or its
        gradient, even if they are inf/NaN padding.
      total_loss_tokens: >= this micro-batch's mask sum; 0 only if the mask is
        all zero (bad-input case 3: loss 0, zero gradient, metrics 0).
      clip_low, clip_high: epsilon (0.2 / 0.2); clip_c: dual-clip constant > 1
        (3.0) or None (no dual clip).
      entropy_BT: float [B, T] entropy (nats), needed when entropy_coef > 0.
      ref_logprobs_BT: float [B, T] reference log-probs, needed when kl_coef > 0.
      is_weight_BT: float [B, T] per-token weight of the policy-gradient term, or None (weight 1).
      loss_agg: one of LOSS_AGG_MODES (above).
      total_sequences: S, needed by the seq-mean modes; >= this micro-batch's non-empty rows.
      norm_tokens: > 0, needed by "seq-mean-token-sum-norm" (a constant such as the generation budget).
      importance_level: "token" | "sequence" (GSPO).
      kl_estimator: "k1" | "k2" | "k3" (`kl_penalty`).
    Returns: (loss scalar float32 with grad, metrics of this micro-batch's loss
      tokens: ppo/clip_frac, ppo/dual_clip_frac, ppo/ratio_mean,
      ppo/ratio_dev_max = max |ratio - 1|, ppo/loss_tokens, ppo/loss_sequences
      (rows with >= 1 loss token), ppo/pg_loss_sum, ppo/entropy_mean,
      ppo/kl_mean (token mean of the chosen estimator), ppo/is_masked_frac
      (share of loss tokens whose is_weight_BT is 0, e.g. rejected by
      importance_weight's mask mode)).
    Raises: ValueError on shape mismatch, clip_c <= 1, an unknown loss_agg,
      importance_level or kl_estimator, a missing entropy/ref tensor for a
      non-zero coef, total_loss_tokens smaller than the mask sum, a missing or
      too small total_sequences for a seq-mean mode, or norm_tokens missing or
      <= 0 for "seq-mean-token-sum-norm".
    """
    named_BT = (("old_logprobs_BT", old_logprobs_BT), ("advantages_BT", advantages_BT), ("loss_mask_BT", loss_mask_BT),
                ("is_weight_BT", is_weight_BT))
    _check_ppo_args(logprobs_BT, named_BT, clip_c, importance_level, kl_estimator, entropy_coef, entropy_BT, kl_coef,
                    ref_logprobs_BT)
    mask = loss_mask_BT.bool()
    n_local = int(mask.sum())
    if float(total_loss_tokens) < n_local:
        raise ValueError(f"total_loss_tokens={float(total_loss_tokens)} is smaller than this micro-batch's {n_local} loss tokens")
    row_scale_B1, denom = _aggregation(loss_agg, mask, total_loss_tokens, total_sequences, norm_tokens)

    logp = logprobs_BT.float()
    terms = _dual_clip_pg(logp, old_logprobs_BT, advantages_BT, mask, is_weight_BT, clip_low, clip_high, clip_c, importance_level)
    per_token, ent_sum, kl_sum = _add_entropy_and_kl(
        terms.pg, logp, mask, entropy_BT, entropy_coef, ref_logprobs_BT, kl_coef, kl_estimator
    )
    zero = torch.zeros((), dtype=torch.float32, device=logprobs_BT.device)
    total = torch.where(mask, per_token * row_scale_B1, zero).sum()
    loss = total / denom if denom > 0 else total * 0.0
    with torch.no_grad():
        metrics = _ppo_metrics(mask, n_local, terms, ent_sum, kl_sum)
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
