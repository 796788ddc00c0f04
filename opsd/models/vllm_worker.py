"""Runs inside vLLM's worker processes: in-place weight updates (loaded via `worker_extension_cls`).

vLLM mixes this class into its Worker, so the engine's ``collective_rpc("opsd_reload_weights", ...)``
(``AsyncLLM.collective_rpc``, reached through `VLLMBackend.collective_rpc`)
calls the method on every worker with plain arguments (a path string): no
pickled callables cross the process boundary.
"""

from __future__ import annotations

import torch


class WeightSync:
    """Worker mixin: reload a checkpoint directory in place and re-tie the LM head."""

    def opsd_reload_weights(self, weights_dir: str) -> int:
        """Load every ``*.safetensors`` of `weights_dir` into the running model, in place.

        Uses vLLM's layer-wise in-place reload (weights are re-processed into
        the kernels' layouts, e.g. the CPU build's packed GEMM weights). That
        reload skips a tied LM head (it loads no tensor of its own) and puts
        its OLD kernel tensors back, so with ``tie_word_embeddings`` the head
        is tied to the new embedding again and re-processed here. Returns the
        number of parameters in the model (a sanity figure for the caller).
        """
        runner = self.model_runner  # type: ignore[attr-defined]  (the Worker we are mixed into)
        runner.reload_weights(weights_path=weights_dir, is_checkpoint_format=True)
        model = runner.get_model()
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", False):
            head, embed = model.lm_head, model.model.embed_tokens
            head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)
        return sum(p.numel() for p in model.parameters())

    def opsd_weight_checksum(self) -> list[float]:
        """Sum of |w| of the embedding and of the LM head's effective weight (tests: the tie survived)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        embed = model.model.embed_tokens.weight
        probe = torch.eye(embed.shape[1], dtype=embed.dtype, device=embed.device)[:4]
        logits = model.lm_head.quant_method.apply(model.lm_head, probe)
        return [float(embed.abs().sum()), float(logits.abs().sum())]
