"""The teacher's exponential moving average of the policy (teacher.version ema:D), kept by the trainer.

After each policy version v is trained, ema_v = D * ema_(v-1) + (1 - D) * theta_v, with ema_0 = theta_0
(the initial policy); ema_v is published next to policy v as `<run_dir>/weights/ema-v<v, 5 digits>.safetensors`
(`opsd.weights.ema_path`, the same format as a policy file) and saved in the checkpoint (`ema.safetensors`),
so a resumed run continues the same average. Why over versions, not optimizer steps: the teacher scores a
group of version v with ema_v, one average per published version. D = 0 is the live policy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

CHECKPOINT_FILE = "ema.safetensors"


class PolicyEMA:
    """A float32 CPU copy of the policy's parameters, averaged over versions.

    model: the policy (full weights, not LoRA: its files hold adapters only); decay: D in [0, 1).
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """ema <- D ema + (1 - D) theta for every parameter of `model` (same architecture, any device)."""
        ours, theirs = list(self.model.parameters()), list(model.parameters())
        if len(ours) != len(theirs):
            raise ValueError(f"EMA update: {len(theirs)} parameters for an average of {len(ours)}")
        for e, p in zip(ours, theirs):
            e.mul_(self.decay).add_(p.detach().to(device="cpu", dtype=torch.float32), alpha=1.0 - self.decay)

    def save(self, path: Path, version: int, dtype: torch.dtype | None = None) -> None:
        """Write the average as a policy-format safetensors file at `path`, atomically (a reader sees the old or
        the complete new file); metadata policy_version = `version` and the content digest
        (`opsd.weights.DIGEST_KEY`, computed while `opsd.weights_io.write_weights` streams: a teacher reloads an
        average republished with other values). Floating tensors cast to `dtype` (the dtype workers serve;
        None: float32, as averaged). Raises OSError on write failure."""
        from opsd.weights_io import write_weights

        meta = {"format": "pt", "policy_version": str(version), "ema_decay": repr(self.decay)}
        write_weights(self.model.state_dict(), Path(path), meta, dtype=dtype)

    def load(self, path: Path) -> None:
        """Restore the average from a file `save` wrote; raises ValueError/OSError (names, shapes, a missing file)."""
        from safetensors.torch import load_file

        from opsd.models.hf_weights import load_state_strict

        load_state_strict(self.model, load_file(str(path), device="cpu"), str(path))
