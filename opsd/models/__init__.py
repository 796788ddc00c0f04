"""Model backends behind one interface (generate / score / branch / load_weights), chosen by ``model.backend``.

"hf": transformers (opsd/models/hf.py), CPU or one GPU, also the trainer's model.
"vllm": a vLLM engine (opsd/models/vllm.py), imported only when selected, so
the default install does not need vLLM.
"""

from __future__ import annotations

from opsd.config import ModelSection
from opsd.models.hf import Generation, HFBackend, NonFiniteLogitsError, ensure_model, token_logprobs

__all__ = ["Generation", "HFBackend", "NonFiniteLogitsError", "ensure_model", "load_backend", "load_engine",
           "resolve_device", "token_logprobs"]


def resolve_device(cfg: ModelSection) -> str:
    """The torch device of ``cfg.device``: "auto" is "cuda" when torch sees a GPU, else "cpu"."""
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(cfg: ModelSection, device: str | None = None, backend: str | None = None):
    """Build the backend named by `backend` (default ``cfg.backend``) on `device` (default `resolve_device`).

    The trainer passes backend="hf": it needs the transformers model. Raises
    ValueError for an unknown backend name; ImportError (naming the install
    target) for "vllm" without vLLM installed.
    """
    name = backend or cfg.backend
    if name == "hf":
        return HFBackend(cfg, device=device or resolve_device(cfg))
    if name == "vllm":
        from opsd.models.vllm import VLLMBackend

        return VLLMBackend(cfg)
    raise ValueError(f"unknown model backend {name!r} (available: hf, vllm)")


def load_engine(backend, max_batch: int, kv_cache_bytes: int):
    """The Engine (opsd/models/engine.py) that serves `backend`'s requests from many threads at once.

    The vLLM backend is one itself (its async engine); a transformers backend
    gets an `HFEngine` (batched waves of at most `max_batch` rows, episodes'
    KV kept in `kv_cache_bytes`). The caller closes an HFEngine it no longer needs.
    """
    if hasattr(backend, "submit"):
        return backend
    from opsd.models.hf_engine import HFEngine

    return HFEngine(backend, max_batch=max_batch, kv_cache_bytes=kv_cache_bytes)
