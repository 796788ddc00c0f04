"""One PPO update of the policy on a step's trajectories (spec 5).

Each trajectory is one sequence (all its turns); the loss covers its loss
tokens only. The step's trajectories form one mini-batch split into
micro-batches; the token-mean divides by the loss tokens of the WHOLE
mini-batch, so micro-batch boundaries do not change the update.

Across torchrun ranks (`services.trainer.distributed`) the same holds: each
rank trains its share of the step's trajectories, divides by the loss tokens
of ALL ranks, and the ranks' gradients are summed, so N ranks make the update
one process would.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from opsd.config import RunConfig, SDARSection, TrainerSection
from opsd.credit.policy_loss import (
    entropy_from_logits, importance_weight, ppo_loss, sampler_mismatch_k3, sdar_loss, token_logprobs,
)
from opsd.models.hf import autocast
from services.trainer.distributed import Parallel, Sequence, World, all_reduce, receive, shard

log = logging.getLogger("trainer")


def _pad(seqs: list[Sequence], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    S = max(len(s.token_ids_S) for s in seqs)
    B = len(seqs)
    out = {
        "ids": torch.zeros(B, S, dtype=torch.long),
        "attn": torch.zeros(B, S, dtype=torch.long),
        "mask": torch.zeros(B, S, dtype=torch.float32),
        "adv": torch.zeros(B, S, dtype=torch.float32),
        "sampler": torch.zeros(B, S, dtype=torch.float32),
        "teacher": torch.zeros(B, S, dtype=torch.float32),
        "ref": torch.zeros(B, S, dtype=torch.float32),
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
        if s.ref_logprobs_S is not None:
            out["ref"][b, :n] = torch.from_numpy(s.ref_logprobs_S)
    # LM-head positions of the update (`_loss_position_logprobs`): t where some row's id t+1 is a loss token;
    # at least one, so a loss-free placeholder micro-batch still runs the same forward and backward.
    keep = out["mask"][:, 1:].any(0).nonzero().flatten()
    out["keep"] = keep if keep.numel() else torch.zeros(1, dtype=torch.long)
    return {k: v.to(device) for k, v in out.items()}


def _placeholder(with_teacher: bool) -> Sequence:
    """A 2-token sequence without loss tokens: a rank with fewer micro-batches than the others runs it so every
    rank makes the same forward/backward collectives; it adds exactly 0 to the loss, gradients and metrics."""
    z = np.zeros(2, np.float32)
    return Sequence(np.zeros(2, np.int64), np.zeros(2, np.uint8), z, z, z if with_teacher else None, z)


@dataclass
class FirstEpoch:
    """What the first PPO epoch computed, for the credit dump's loss replay (services/trainer/dump.py).

    sequences: the sequences trained on, in the step's order; old_logprobs / entropy: float32 [n_i] per sequence,
    the trainer's log-probs (pi_old, nats) and entropies (nats) at its loss tokens; loss: the epoch's loss; kl: its
    `kl` metric (the token-mean of the KL estimator against the reference, nats/token; 0 without one).
    """

    sequences: list[Sequence] = field(default_factory=list)
    old_logprobs: list[np.ndarray] = field(default_factory=list)
    entropy: list[np.ndarray] = field(default_factory=list)
    loss: float = 0.0
    kl: float = 0.0


def loss_norm_tokens(cfg: RunConfig) -> int:
    """Dr. GRPO's constant of `trainer.loss_agg: seq-mean-token-sum-norm`: trainer.loss_agg_norm_tokens, or the
    run's response budget per trajectory, env.max_turns x rollout.max_new_tokens (tokens)."""
    return cfg.trainer.loss_agg_norm_tokens or cfg.env.max_turns * cfg.rollout.max_new_tokens


def _accumulating(model: torch.nn.Module, last: bool):
    """DDP: no gradient all-reduce before the last micro-batch (the gradients accumulate locally, then one sum)."""
    return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()


def ppo_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, seqs: list[Sequence], cfg: TrainerSection,
    dtype: str = "float32", temperature: float = 1.0, sdar: SDARSection | None = None, world: World | None = None,
    norm_tokens: int | None = None, record: FirstEpoch | None = None,
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
    `opsd.credit.policy_loss.importance_weight(pi_old, sampler)` at cfg.tis_level with cfg.tis_mode and the caps
    (spec §5's min(exp(clip(pi_old - sampler, +-20)), tis_cap) by default), fixed from the first epoch like
    pi_old; `is_masked_frac` = share of loss tokens the mask mode zeroed.
    The loss is aggregated with cfg.loss_agg (`norm_tokens`: Dr. GRPO's constant, `loss_norm_tokens`), the ratio
    taken at cfg.importance_level, the dual clip at cfg.clip_ratio_c (None: off).

    With `cfg.kl_coef > 0` every sequence must carry `ref_logprobs_S` (the reference policy's,
    services/trainer/reference.py; ValueError otherwise) and cfg.kl_coef x the cfg.kl_estimator term joins the
    loss; `kl` = the estimator's token-mean over the loss tokens (nats/token, mean over the epochs), reported
    (only) when the sequences carry reference log-probs.

    Sequences without loss tokens add nothing to the loss or its gradient and
    are left out. Sequences holding a token id outside the model's vocabulary
    are left out too and counted in `dropped_sequences` (an embedding lookup
    would crash the trainer). With no loss token at all (bad-input case 3)
    nothing runs: the optimizer is not stepped, so AdamW momentum and weight
    decay cannot move the weights on an empty batch. An epoch whose gradient
    norm or loss is not finite does not step the optimizer either (counted in
    `skipped_steps`); the weights never see a NaN.

    With `sdar.coef > 0` the SDAR auxiliary loss (`opsd.credit.policy_loss.sdar_loss`)
    against each sequence's `teacher_logprobs_S` is added (`sdar_loss` metric);
    ValueError if a sequence lacks teacher log-probs then.

    With `record`, the first epoch's pi_old, entropies and loss are written into it (`FirstEpoch`; on every rank
    under torchrun, gathered from all ranks).

    With a distributed `world` (torchrun), every rank passes the SAME `seqs`
    (the whole step) and `model` wrapped by `services.trainer.distributed`
    (DDP or FSDP2, gradients summed over ranks). Each rank trains its `shard`;
    the token-mean divides by the loss tokens of all ranks; ranks with fewer
    micro-batches run loss-free placeholder ones so the collectives match
    (a rank with no sequence too); the non-finite skip is decided on all
    ranks at once; every rank returns the metrics one process would (sums
    and maxima reduced over ranks). Collective: all ranks must call it.
    RuntimeError if the ranks' `seqs` differ (their loss tokens disagree).
    Batch tensors go to the model's device.
    """
    use_sdar = sdar is not None and sdar.coef > 0
    _check_logprobs(seqs, cfg, use_sdar)
    vocab = _vocab_size(model)
    usable = [s for s in seqs if s.loss_mask_S.any()]
    seqs = [s for s in usable if vocab is None or _ids_in_range(s.token_ids_S, vocab)]
    dropped = len(usable) - len(seqs)
    with_ref = bool(seqs) and all(s.ref_logprobs_S is not None for s in seqs)
    total_tokens = float(sum(float(s.loss_mask_S.sum()) for s in seqs))
    parallel = world is not None and world.distributed
    micro, total_tokens = _micro_batches(seqs, total_tokens, cfg.micro_batch_size, world, use_sdar)
    if record is not None:
        record.sequences = list(seqs)
    if total_tokens == 0:
        return dict.fromkeys(
            ("loss", "clip_frac", "entropy", "grad_norm", "ratio_dev_max", "sampler_logprob_mismatch", "mismatch_kl", "loss_tokens",
             "sdar_loss", "is_masked_frac"), 0.0
        ) | {"dropped_sequences": float(dropped), "skipped_steps": 0.0} | ({"kl": 0.0} if cfg.kl_coef > 0 else {})
    model.train()
    device = next(model.parameters()).device
    batches = [_pad(mb, device) for mb in micro]
    epochs = _Epochs(cfg, dtype, temperature, sdar if use_sdar else None, with_ref, total_tokens, len(seqs), norm_tokens,
                     keep_first=record is not None, old=[None] * len(batches), is_weight=[None] * len(batches))
    sums = dict.fromkeys(_EPOCH_SUMS, 0.0)
    first_loss = first_kl = grad_norm = 0.0
    skipped = 0
    for epoch_i in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch = epochs.run(model, batches, device)  # merged into sums only if the epoch's gradient is finite
        if epoch_i == 0:
            first_loss, first_kl = epoch["loss"], epoch["kl"]
        norm = _step_if_finite(model, optimizer, cfg.grad_clip, epoch["loss"], world)
        if norm is None:
            skipped += 1
            continue
        grad_norm = norm
        for k, v in epoch.items():
            sums[k] = max(sums[k], v) if k == "ratio_dev_max" else sums[k] + v
    model.eval()
    kl_sum, masked_sum = epochs.k3_sum, epochs.masked_sum
    if parallel:  # each rank's sums are over its own tokens, already divided by the step's total
        kl_sum, masked_sum, first_loss, first_kl = _sum_over_ranks(sums, [kl_sum, masked_sum, first_loss, first_kl], world)
    if record is not None:
        _fill_record(record, micro, epochs.first, world)
        record.loss, record.kl = first_loss, first_kl
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
        "is_masked_frac": masked_sum / total_tokens,
    } | ({"kl": sums["kl"] / e} if with_ref else {})


def _check_logprobs(seqs: list[Sequence], cfg: TrainerSection, use_sdar: bool) -> None:
    """ValueError when the SDAR term or the KL term is on and a sequence lacks the log-probs it needs."""
    if use_sdar and any(s.teacher_logprobs_S is None for s in seqs):
        raise ValueError("the SDAR auxiliary loss (credit.sdar.coef > 0) needs teacher log-probs for every sequence")
    if cfg.kl_coef > 0 and any(s.ref_logprobs_S is None for s in seqs):
        raise ValueError("the KL term (trainer.kl_coef > 0) needs the reference policy's log-probs for every sequence")


def _micro_batches(seqs: list[Sequence], total_tokens: float, size: int, world: World | None,
                   use_sdar: bool) -> tuple[list[list[Sequence]], float]:
    """This rank's micro-batches of `seqs` and the loss tokens of all ranks (the token-mean's denominator).

    Under torchrun each rank takes its `shard`, and pads its micro-batches with loss-free placeholders up to the
    most any rank has; RuntimeError (on every rank) if the ranks were given different batches."""
    parallel = world is not None and world.distributed
    local = shard(seqs, world.rank, world.size) if parallel else seqs
    micro = [local[j : j + size] for j in range(0, len(local), size)]
    if not parallel:
        return micro, total_tokens
    # Each rank also holds the whole step, so each must count the same total; the max/min check catches ranks
    # given different batches.
    own_tokens = sum(float(s.loss_mask_S.sum()) for s in local)
    (summed,) = all_reduce([own_tokens], "sum", world)
    n_micro, hi, neg_lo = all_reduce([len(micro), total_tokens, -total_tokens], "max", world)
    if not hi == -neg_lo == summed:  # every rank sees it: all raise, none is left waiting in a collective
        raise RuntimeError(f"the ranks were given different batches ({-neg_lo} to {hi} loss tokens, {summed} summed)")
    log.info("rank %d of %d: my share of the update: %d of %d sequences, %d of %d loss tokens", world.rank,
             world.size, len(local), len(seqs), own_tokens, summed)
    micro += [[_placeholder(use_sdar)]] * (int(n_micro) - len(micro))
    return micro, summed


# An epoch's sums over the micro-batches (see `_Epochs.run`), merged over the epochs that step the optimizer.
_EPOCH_SUMS = ("loss", "clip_frac", "entropy", "mismatch", "ratio_dev_max", "sdar", "kl")


@dataclass
class _Epochs:
    """The settings every epoch of one `ppo_update` shares, and what its first epoch fixes for the later ones.

    old / is_weight: per micro-batch, pi_old [B, S-1] (detached) and its truncated-IS weights (None without
    cfg.truncated_is), set by the first epoch; k3_sum: the first epoch's sum of k3 (sampler_mismatch_k3) over
    this rank's loss tokens; masked_sum: loss tokens the IS mask mode zeroed; first: (pi_old, entropy) per
    micro-batch when keep_first (for the `FirstEpoch` record).
    """

    cfg: TrainerSection
    dtype: str
    temperature: float
    sdar: SDARSection | None  # None: no SDAR term
    with_ref: bool
    total_tokens: float
    n_seqs: int
    norm_tokens: int | None
    keep_first: bool
    old: list[torch.Tensor | None]
    is_weight: list[torch.Tensor | None]
    k3_sum: float = 0.0
    masked_sum: float = 0.0
    first: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def run(self, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, float]:
        """One epoch: forward and backward over every micro-batch, gradients accumulated, not stepped; its sums."""
        epoch = dict.fromkeys(_EPOCH_SUMS, 0.0)
        for j, b in enumerate(batches):
            with _accumulating(model, last=j == len(batches) - 1):
                lp, ent = _loss_position_logprobs(model, b, self.dtype, device, self.temperature)
                mask = b["mask"][:, 1:]
                if self.old[j] is None:
                    epoch["mismatch"] += self._fix(j, lp, ent, b)
                loss, m = self._loss(j, lp, ent, b, epoch)
                loss.backward()
                total = self.total_tokens
                epoch["loss"] += float(loss.detach())
                share = float(mask.sum()) / max(total, 1)
                epoch["clip_frac"] += float(m["ppo/clip_frac"]) * share
                epoch["kl"] += float(m["ppo/kl_mean"]) * share
                epoch["entropy"] += float((ent.detach() * mask).sum()) / max(total, 1)
                epoch["ratio_dev_max"] = max(epoch["ratio_dev_max"], float(m["ppo/ratio_dev_max"]))
        return epoch

    def _fix(self, j: int, lp: torch.Tensor, ent: torch.Tensor, b: dict[str, torch.Tensor]) -> float:
        """The first epoch on micro-batch j: fix pi_old and its IS weights, count k3 and masked tokens; returns its
        share of sampler_logprob_mismatch (mean |sampler - trainer| over the step's loss tokens)."""
        cfg, mask, sampler = self.cfg, b["mask"][:, 1:], b["sampler"][:, 1:]
        self.old[j] = lp.detach()
        n = mask.sum().clamp_min(1)
        mean_abs = float(((lp.detach() - sampler).abs() * mask).sum() / n)
        # A NaN trainer log-prob (its epoch is skipped, see skipped_steps) adds 0, not NaN.
        self.k3_sum += float(sampler_mismatch_k3(self.old[j], sampler, mask).nan_to_num(nan=0.0).sum())
        if cfg.truncated_is:
            self.is_weight[j] = importance_weight(self.old[j], sampler, mask, cfg.tis_level, cfg.tis_mode, cfg.tis_cap,
                                                  cfg.tis_cap_low)
            self.masked_sum += float(((self.is_weight[j] == 0) & mask.bool()).sum())
        if self.keep_first:
            self.first.append((self.old[j], ent.detach()))
        return mean_abs * float(mask.sum()) / max(self.total_tokens, 1)

    def _loss(self, j: int, lp: torch.Tensor, ent: torch.Tensor, b: dict[str, torch.Tensor],
              epoch: dict[str, float]) -> tuple[torch.Tensor, dict]:
        """Micro-batch j's PPO loss (plus the SDAR term, whose value joins epoch["sdar"]) and ppo_loss's metrics."""
        cfg, mask = self.cfg, b["mask"][:, 1:]
        loss, m = ppo_loss(
            lp, self.old[j], b["adv"][:, 1:], mask, self.total_tokens,
            cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
            entropy_BT=ent, entropy_coef=cfg.entropy_coef, is_weight_BT=self.is_weight[j],
            ref_logprobs_BT=b["ref"][:, 1:] if self.with_ref else None, kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator, loss_agg=cfg.loss_agg, total_sequences=self.n_seqs,
            norm_tokens=self.norm_tokens, importance_level=cfg.importance_level,
        )
        if self.sdar is not None:
            aux, _ = sdar_loss(lp, b["teacher"][:, 1:], mask, self.total_tokens, self.sdar.coef, self.sdar.beta)
            epoch["sdar"] += float(aux.detach())
            loss = loss + aux
        return loss, m


def _step_if_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, loss: float,
                    world: World | None) -> float | None:
    """Clip the accumulated gradients and step the optimizer; the gradient norm, or None (gradients dropped, no
    step) when the norm or the epoch's `loss` is not finite on some rank."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a replicated DTensor
    # The same decision on every rank, or one would step while another waits in the next collective.
    if all_reduce([0.0 if np.isfinite(norm) and np.isfinite(loss) else 1.0], "max", world)[0] > 0:
        # A NaN gradient must never reach the weights: skip this optimizer step, count it. A non-finite loss
        # too: a NaN reference log-prob gives k3 a NaN whose gradient its clamp zeroes, k1's never depends on it.
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    return norm


def _sum_over_ranks(sums: dict[str, float], extra: list[float], world: World) -> list[float]:
    """Sum `sums` (max for ratio_dev_max) over the ranks, in place, and `extra` too (returned): a collective."""
    keys = ("loss", "clip_frac", "entropy", "mismatch", "sdar", "kl")
    reduced = all_reduce([sums[k] for k in keys] + extra, "sum", world)
    sums.update(zip(keys, reduced[: len(keys)]))
    sums["ratio_dev_max"] = all_reduce([sums["ratio_dev_max"]], "max", world)[0]
    return reduced[len(keys):]


def _fill_record(record: FirstEpoch, micro: list[list[Sequence]], first: list[tuple[torch.Tensor, torch.Tensor]],
                 world: World | None) -> None:
    """`record`'s per-sequence pi_old and entropies at the loss tokens from this rank's first-epoch micro-batches;
    under torchrun each rank fills its own sequences' slots of one flat buffer and a sum over the ranks gives every
    rank all of them (a collective)."""
    seqs = record.sequences
    counts = [int(np.count_nonzero(s.loss_mask_S[1:])) for s in seqs]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    index = {id(s): i for i, s in enumerate(seqs)}
    flat = np.zeros((2, int(starts[-1])), np.float64)
    for mb, (old_BT, ent_BT) in zip(micro, first):
        for r, s in enumerate(mb):
            i = index.get(id(s))
            if i is None:  # a placeholder
                continue
            pos = np.flatnonzero(s.loss_mask_S[1:])  # position t-1 of the results belongs to token t
            flat[0, starts[i] : starts[i + 1]] = old_BT[r, pos].cpu().numpy()
            flat[1, starts[i] : starts[i + 1]] = ent_BT[r, pos].cpu().numpy()
    if world is not None and world.distributed:
        flat = np.asarray(all_reduce(flat.ravel().tolist(), "sum", world)).reshape(flat.shape)
    record.old_logprobs = [flat[0, starts[i] : starts[i + 1]].astype(np.float32) for i in range(len(seqs))]
    record.entropy = [flat[1, starts[i] : starts[i + 1]].astype(np.float32) for i in range(len(seqs))]


def _loss_position_logprobs(
    model: torch.nn.Module, b: dict[str, torch.Tensor], dtype: str, device: torch.device, temperature: float,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each id given the ids before it, and the entropies they were drawn from: float32 [B, S-1].

    Position t of the results belongs to id t+1 (position 0 is always prompt). Only the positions where
    some row of the micro-batch has a loss token (`b["keep"]`) go through the LM head, log_softmax and
    entropy; the others hold 0 (the loss masks them). A step's loss tokens are about a tenth of its
    positions (the prompts and observations are not trained on), and the full [B, S, V] logits, their
    log_softmax and their entropy were 10% of a quickstart trainer step plus their backward.
    """
    keep = b["keep"]
    with autocast(dtype, device):
        logits = model(input_ids=b["ids"], attention_mask=b["attn"], logits_to_keep=keep, use_cache=False).logits  # [B, K, V]
    logits = logits.float()
    lp_BK = token_logprobs(logits, b["ids"][:, keep + 1], temperature)
    zeros = lp_BK.new_zeros((b["ids"].shape[0], b["ids"].shape[1] - 1))
    if not with_entropy:
        return zeros.index_copy(1, keep, lp_BK), None
    return zeros.index_copy(1, keep, lp_BK), zeros.index_copy(1, keep, entropy_from_logits(logits, temperature))


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, seqs: list[Sequence], dtype: str = "float32", temperature: float = 1.0, micro_batch_size: int = 2,
) -> list[np.ndarray]:
    """Log-probs of every sequence's own tokens under `model` (the reference policy: the KL term, ex_opd's base).

    Returns float32 [S] per sequence: position t holds log softmax(logits_{t-1}/T)[id_t] wherever some sequence
    of its micro-batch has a loss token at t (every loss token of its own), 0 elsewhere (position 0, always
    prompt, included): only those positions go through the LM head, as in the update (`_loss_position_logprobs`),
    so a long prompt never makes a [S, V] logits tensor.
    """
    out: list[np.ndarray] = []
    model.eval()
    device = next(model.parameters()).device
    for j in range(0, len(seqs), micro_batch_size):
        mb = seqs[j : j + micro_batch_size]
        b = _pad(mb, device)
        lp, _ = _loss_position_logprobs(model, b, dtype, device, temperature, with_entropy=False)
        for r, s in enumerate(mb):
            arr = np.zeros(len(s.token_ids_S), dtype=np.float32)
            arr[1:] = lp[r, : len(s.token_ids_S) - 1].cpu().numpy()
            out.append(arr)
    return out


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """trainer.gradient_checkpointing: `model` (a transformers causal LM, LoRA adapters applied or not; not yet
    wrapped by DDP/FSDP2) recomputes each decoder layer's activations in the backward pass, in place.

    Non-reentrant checkpointing (torch.utils.checkpoint use_reentrant=False), active in train mode only (the
    training forward passes use_cache=False). transformers also makes the embeddings' output require grad
    (`enable_input_require_grads`), which LoRA's frozen embeddings need for a gradient to reach the checkpointed
    layers' adapters. Raises ValueError for a model without transformers' gradient checkpointing support.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _vocab_size(model: torch.nn.Module) -> int | None:
    model = model.module if isinstance(model, DDP) else model
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else None


def _ids_in_range(ids: np.ndarray, vocab: int) -> bool:
    return ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)


def follow(par: Parallel, cfg: RunConfig) -> int:
    """Ranks > 0: run rank 0's messages until "stop"; returns the number of updates run.

    "update": ppo_update on the step's sequences with the run's settings
    (this rank trains its `shard`); "gather": join `Parallel.gather`.
    Raises RuntimeError for an unknown message; ppo_update's errors propagate
    (rank 0 raises the same one on the same batch).
    """
    updates = 0
    while True:
        msg = receive(par.world)
        if msg.op == "stop":
            return updates
        if msg.op == "update":
            ppo_update(par.module, par.optimizer, msg.seqs, cfg.trainer, cfg.model.dtype, cfg.rollout.temperature,
                       cfg.credit.sdar, par.world, loss_norm_tokens(cfg), FirstEpoch() if cfg.trainer.dump_credit else None)
            updates += 1
        elif msg.op == "gather":
            par._collect(bool(msg.args.get("optimizer")))
        else:
            raise RuntimeError(f"rank {par.world.rank}: unknown message {msg.op!r} from rank 0")
