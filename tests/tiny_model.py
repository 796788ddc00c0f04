"""A tiny randomly initialized Llama with SmolLM2's real tokenizer, for process-level tests.

The fault tests run the real services (real processes, Redis, TextWorld, the
tokenizer, the chat template, the transformers backend) many times; with the
135M model one step takes minutes on 2 cores, with this one and
tests/configs/faults.yaml about 5 s (measured; most of it the trainer's
49,152-wide logits), after about 25 s of process start-up.
Only the network's size differs: same architecture class, same vocabulary.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_tiny_model_dir(out_dir: Path, seed: int = 0) -> Path:
    """Write a 2-layer, hidden-64 LlamaForCausalLM (vocab 49152, fp32 safetensors) plus SmolLM2's tokenizer to `out_dir`.

    Deterministic in `seed`. Returns `out_dir` (a local HF directory usable as `model.name`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from opsd.config import ModelSection
    from opsd.models.hf import ensure_model

    src = ensure_model(ModelSection())  # the packaged SmolLM2 (converted once into the cache)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
