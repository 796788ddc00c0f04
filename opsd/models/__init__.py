"""Model backends behind one interface (generate / score / load_weights / save_weights).

Only the transformers backend exists today; a vLLM backend with the same
interface will be selected by a future ``model.backend: hf|vllm`` setting.
"""

from __future__ import annotations

from opsd.config import ModelSection
from opsd.models.hf import Generation, HFBackend, NonFiniteLogitsError, ensure_model, token_logprobs

__all__ = ["Generation", "HFBackend", "NonFiniteLogitsError", "ensure_model", "load_backend", "token_logprobs"]


def load_backend(cfg: ModelSection, device: str = "cpu") -> HFBackend:
    """Build the backend named by ``cfg.backend`` (default "hf"; the only one implemented).

    Raises ValueError for an unknown backend name.
    """
    backend = getattr(cfg, "backend", "hf")  # the config field does not exist yet
    if backend == "hf":
        return HFBackend(cfg, device=device)
    raise ValueError(f"unknown model backend {backend!r} (available: hf)")
