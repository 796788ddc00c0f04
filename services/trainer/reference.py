"""The reference policy: the run's initial policy, frozen, for the KL term (`trainer.kl_coef`) and ExOPD's base.

Why the trainer holds it (and not the teacher role, which also teacher-forces every trajectory): the teacher's
weights follow the policy (teacher.version current, lag:K, ema:β) or are another model, a grpo run has no teacher
at all, and the KL term is part of the trainer's loss; a second model in the teacher would cost the same memory
and add a stream hop. How it is held, cheapest first:
- LoRA (`trainer.lora`), one process or DDP: the policy itself with its adapters switched off (peft's
  `enable_adapters(False)` on each LoRA layer): the frozen base IS the initial policy, no memory at all;
- otherwise (full fine-tuning, or LoRA under FSDP2, whose parameters are sharded so one rank cannot run them
  alone): a frozen copy of the initial weights in `model.dtype` (bf16: 2 bytes a parameter, 14 GB at 7B; fp32
  on the default CPU setup), taken before a resume loads newer weights, so a resumed run keeps the same reference.
Rank 0 runs it once per step, before the update: one forward pass without gradient over the step's sequences at
their loss positions only, at the sampling temperature (verl's compute_ref_log_prob does the same); the
log-probs travel to the other ranks with the sequences. Cost measured by benchmarks/reference_kl.py.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import numpy as np
import torch

from opsd.config import RunConfig
from opsd.lora import is_lora_model
from services.trainer.distributed import Sequence, World, pick_strategy
from services.trainer.update import sequence_logprobs

log = logging.getLogger("trainer")


class ReferencePolicy:
    """The frozen initial policy: `logprobs(seqs)` gives each sequence's token log-probs under it.

    Build with `ReferencePolicy.build` before the checkpoint is resumed and before the model is wrapped for
    torchrun. `adapters_off`: the policy itself with its LoRA adapters disabled during the forward pass.
    """

    def __init__(self, module: torch.nn.Module, adapters_off: bool):
        self.module = module
        self.adapters_off = adapters_off

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: RunConfig, world: World | None = None) -> "ReferencePolicy":
        """The reference of `model` (the unwrapped trainer model, its initial weights loaded, LoRA applied or not).

        A copy's parameters are cast to cfg.model.dtype (its buffers, e.g. rotary frequencies, keep theirs, as a
        bf16 checkpoint loaded by transformers does), in eval mode, without gradients, on the model's device.
        """
        fsdp = world is not None and world.distributed and pick_strategy(world, cfg.trainer.data_parallel) == "fsdp2"
        if is_lora_model(model) and not fsdp:
            log.info("reference policy: the policy with its LoRA adapters switched off (no extra memory)")
            return cls(model, adapters_off=True)
        dtype = getattr(torch, cfg.model.dtype)
        # Each parameter is copied straight into model.dtype (deepcopy takes the memo's entry for it): never a second
        # fp32 model on the GPU on the way (28 GB at 7B). copy=True: an fp32 run must not share the policy's storage.
        # Tied weights are one Parameter, so one entry: still tied.
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False) for p in model.parameters()}
        ref = copy.deepcopy(model, memo).eval()
        n = sum(p.numel() * p.element_size() for p in ref.parameters())
        log.info("reference policy: a frozen copy of the initial weights, %.2f GB in %s", n / 1e9, cfg.model.dtype)
        return cls(ref, adapters_off=False)

    def logprobs(self, seqs: list[Sequence], dtype: str, temperature: float, micro_batch_size: int) -> list[np.ndarray]:
        """float32 [S] per sequence: the reference's log-prob (nats) of each token at the loss positions, 0 elsewhere
        (`services.trainer.update.sequence_logprobs`)."""
        with self._adapters_disabled():
            return sequence_logprobs(self.module, seqs, dtype, temperature, micro_batch_size)

    @contextlib.contextmanager
    def _adapters_disabled(self):
        if not self.adapters_off:
            yield
            return
        layers = [m for m in self.module.modules() if hasattr(m, "enable_adapters") and hasattr(m, "lora_A")]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:  # peft's enable_adapters(True) also makes the adapters trainable again
            for m in layers:
                m.enable_adapters(True)
