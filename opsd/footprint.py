"""What a run holds: parameters of a model, resident bytes per role, and the disk peak of a run.

Shared by `opsd run` (prints the disk peak, refuses a run that cannot fit its
disk) and the trainer (trainer.checkpoint_every "auto"). `python -m
opsd.footprint` prints the table of docs/how-to/your-model.md ("Memory and disk") (bytes per role of the PRESETS).

Parameters are counted exactly from a transformers config: the architecture is
built on the meta device (no weights read, no memory used) and its parameters
counted, a tied embedding / LM head once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GB = 1e9
# Bytes per parameter of a model's weights in the served dtype (model.dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# AdamW in the trainer, per trainable parameter: fp32 master weight 4 + grad 4 + exp_avg 4 + exp_avg_sq 4.
TRAINER_BYTES_PER_PARAM = 16
# In a checkpoint, per trainable parameter: the fp32 master weight and AdamW's two moments (no gradients).
CHECKPOINT_BYTES_PER_PARAM = 12
# Per checkpoint besides the tensors: tokenizer (a 150k vocab's tokenizer.json is ~7 MB), configs, RNG,
# metrics.jsonl, trainer_state.json (grows with the groups trained). An upper bound for runs of ~10k steps.
CHECKPOINT_SMALL_BYTES = 64 * 10**6
# trainer.checkpoint_every "auto": every step below this many parameters (trainable + frozen), else AUTO_EVERY.
AUTO_LARGE_PARAMS = 10**9
AUTO_EVERY = 10

# Public configs (config.json of each Hub repo) of the models the docs and benchmarks size runs for.
PRESETS: dict[str, dict] = {
    "Qwen2.5-0.5B-Instruct": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True),
    "Qwen2.5-3B-Instruct": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                tie_word_embeddings=False),
    "Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=False),
}
# The embedder's default encoder (embedder.encoder all-MiniLM-L6-v2, a 6-layer BERT): its parameter count.
DEFAULT_ENCODER_PARAMS = 22_713_216


def model_config(name_or_dir: str | Path, trust_remote_code: bool = False):
    """The transformers config of a PRESETS name or of a model directory's config.json; the directory's own
    code (a custom config class) runs only with `trust_remote_code` (model.trust_remote_code).

    Raises KeyError (neither a preset nor a directory), OSError or ValueError (an unreadable config.json),
    opsd.models.trust.UntrustedModelError (a ValueError: a custom config without `trust_remote_code`)."""
    from transformers import AutoConfig

    from opsd.models.trust import remote_code_refused

    if str(name_or_dir) in PRESETS:
        values = dict(PRESETS[str(name_or_dir)])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if not Path(name_or_dir).is_dir():
        raise KeyError(f"{name_or_dir}: neither a model directory nor one of {sorted(PRESETS)}")
    with remote_code_refused(name_or_dir, trust_remote_code, "model.trust_remote_code"):
        return AutoConfig.from_pretrained(name_or_dir, local_files_only=True, trust_remote_code=trust_remote_code)


def _meta_model(cfg, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)


def param_count(cfg, trust_remote_code: bool = False) -> int:
    """Parameters of the causal LM of transformers config `cfg` (trainable + frozen; a tied head counted once).

    Built on the meta device: no weights are read or allocated. `trust_remote_code`: as `model_config` read
    `cfg` (a custom architecture's code runs only with it). Raises ValueError for an architecture
    transformers does not know (or one of the directory's own code without `trust_remote_code`)."""
    return sum(p.numel() for p in _meta_model(cfg, trust_remote_code).parameters())  # a tied tensor once


def lora_param_count(cfg, rank: int, target_modules: list[str], trust_remote_code: bool = False) -> int:
    """Adapter parameters trainer.lora adds to the model of `cfg`: rank * (in + out) per nn.Linear whose last
    name part is in `target_modules` (opsd/lora.py: A [rank, in], B [out, rank]); `trust_remote_code` as in
    `param_count`."""
    import torch

    return sum(rank * (m.in_features + m.out_features)
               for name, m in _meta_model(cfg, trust_remote_code).named_modules()
               if type(m) is torch.nn.Linear and name.rsplit(".", 1)[-1] in target_modules)


def checkpoint_interval(setting: int | str, params: int) -> int:
    """Steps between checkpoints for trainer.checkpoint_every `setting` (an int >= 1, or "auto") and a model of
    `params` parameters (trainable + frozen): "auto" is 1 below AUTO_LARGE_PARAMS, else AUTO_EVERY (a 7B
    checkpoint is ~91 GB of fp32 weights and AdamW moments: writing one every step costs more disk
    bandwidth than the step). Raises ValueError for another string."""
    if setting == "auto":
        return 1 if params < AUTO_LARGE_PARAMS else AUTO_EVERY
    if isinstance(setting, int) and setting >= 1:
        return setting
    raise ValueError(f"trainer.checkpoint_every must be an int >= 1 or 'auto', got {setting!r}")


def role_bytes(params: int, dtype: str = "bfloat16", lora_params: int = 0, ema: bool = False,
               encoder_params: int = DEFAULT_ENCODER_PARAMS, reference: bool = False) -> dict[str, int]:
    """Resident bytes of each role's weights and optimizer state (host or GPU memory, whichever holds them).

    params: the policy's parameters; dtype: model.dtype (what rollout and teacher serve); lora_params:
    trainer.lora's adapter parameters (0: full fine-tuning); ema: teacher.version ema:D (the trainer keeps
    an fp32 average); encoder_params: the embedder's encoder (fp32); reference: trainer.kl_coef > 0 (or ex_opd's
    initial base: services/trainer/reference.py). Returns {"rollout", "teacher",
    "trainer", "embedder"}:
      rollout = teacher = params * dtype bytes
      trainer = params * 16 (fp32 master + grad + AdamW's two moments), or with LoRA
                params * 4 (the frozen base, fp32 like every trainer weight) + lora_params * 16; + params * 4 with ema;
                + params * dtype bytes with a reference under full fine-tuning (its frozen copy; LoRA's is the base)
      embedder = encoder_params * 4
    Excluded: activations, the KV cache, the CUDA context, temporary copies (a checkpoint's optimizer
    state on the host while it is written, FSDP2's full-weight mirror on rank 0). Raises KeyError for an
    unknown dtype.
    """
    served = params * DTYPE_BYTES[dtype]
    trainer = params * TRAINER_BYTES_PER_PARAM if not lora_params else params * 4 + lora_params * TRAINER_BYTES_PER_PARAM
    trainer += (params * 4 if ema else 0) + (served if reference and not lora_params else 0)
    return {"rollout": served, "teacher": served, "trainer": trainer, "embedder": encoder_params * 4}


def disk_peak_bytes(params: int, steps: int, dtype: str = "bfloat16", lora_params: int = 0, max_staleness: int = 0,
                    teacher_lag: int = 0, ema: bool = False, snapshot_every: int = 0,
                    keep_checkpoints: int = 1) -> dict[str, int]:
    """The most disk a run's directory holds at once, as its terms (bytes) and their sum "total".

    Arguments as `role_bytes`, and the config's run.steps, run.max_staleness, the lag K of teacher.version
    lag:K, trainer.snapshot_every and trainer.keep_checkpoints. With F = params * dtype bytes the size of a
    published file (lora_params * dtype bytes with LoRA: adapters only):
      weights     = (max_staleness + 2 + teacher_lag + 1) * F, twice that with ema (an average file beside
                    each): the versions a task in flight can need, and the next one written before the prune
      snapshots   = (steps // snapshot_every + 1) * F (version 0's too, when published), 0 when snapshot_every 0
      checkpoints = (keep_checkpoints + 1) * C (the kept ones and the one being written), where
                    C = params * 12 (fp32 master weights + AdamW's two moments), or with LoRA
                    params * 4 (the frozen base: fp32, as every trainer weight) + lora_params * 12; + params * 4
                    with ema; + CHECKPOINT_SMALL_BYTES
      final_model = params * 4 with LoRA (the merged policy, in the trainer's fp32), else 0 (checkpoint/ is it)
      total       = weights + snapshots + checkpoints + final_model
    An upper bound: final_model is written after weights/ is deleted. Excluded: Redis' append-only file,
    logs, metrics, credit dumps (trainer.dump_credit), the model cache.
    """
    served = params * DTYPE_BYTES[dtype]
    published = lora_params * DTYPE_BYTES[dtype] if lora_params else served
    trained = lora_params or params
    checkpoint = (params * 4 if lora_params else 0) + trained * CHECKPOINT_BYTES_PER_PARAM + (params * 4 if ema else 0)
    terms = {
        "weights": (max_staleness + 3 + teacher_lag) * published * (2 if ema else 1),
        "snapshots": (steps // snapshot_every + 1) * published if snapshot_every else 0,
        "checkpoints": (keep_checkpoints + 1) * (checkpoint + CHECKPOINT_SMALL_BYTES),
        "final_model": params * 4 if lora_params else 0,
    }
    return {**terms, "total": sum(terms.values())}


def run_disk_peak(cfg, model_dir: str | Path) -> dict[str, int]:
    """`disk_peak_bytes` of RunConfig `cfg` whose policy's files are in `model_dir` (its config.json is read,
    no weights). Raises as `model_config` and `param_count`."""
    trust = cfg.model.trust_remote_code
    mcfg = model_config(model_dir, trust)
    lora = cfg.trainer.lora
    return disk_peak_bytes(param_count(mcfg, trust), cfg.run.steps, cfg.model.dtype,
                           lora_param_count(mcfg, lora.r, lora.target_modules, trust) if lora is not None else 0,
                           cfg.run.max_staleness, cfg.teacher_lag, cfg.teacher_ema is not None,
                           cfg.trainer.snapshot_every, cfg.trainer.keep_checkpoints)


def describe(terms: dict[str, int]) -> str:
    """One line: the total and its non-zero terms in GB."""
    parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in terms.items() if k != "total" and v)
    return f"{terms['total'] / GB:.2f} GB ({parts})"


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem of `path`, or of its nearest existing parent (a run dir not made yet)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def disk_problem(peak: int, free: int, where: Path) -> str | None:
    """The one-line refusal when a run's disk peak `peak` exceeds `free` bytes at `where`, else None."""
    if peak <= free:
        return None
    return (f"the run needs up to {peak / GB:.1f} GB of disk (opsd.footprint.disk_peak_bytes) but {where} has "
            f"{free / GB:.1f} GB free: free space, set run.output_dir elsewhere, or lower trainer.keep_checkpoints, "
            f"trainer.snapshot_every or run.max_staleness")


def readme_table(names: tuple[str, ...] = ("Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct", "Qwen2.5-7B-Instruct",
                                           "Llama-3.1-8B-Instruct")) -> str:
    """The table of docs/how-to/your-model.md ("Memory and disk"): parameters and GB per role (model.dtype bfloat16, full fine-tuning), and the disk peak
    of a run at default settings (opsd.config.RunConfig() with model.dtype bfloat16)."""
    from opsd.config import RunConfig

    cfg = RunConfig()
    rows = ["| model | params | rollout | teacher | trainer (AdamW) | embedder | disk peak, default run |",
            "|---|---|---|---|---|---|---|"]
    for name in names:
        params = param_count(model_config(name))
        roles = role_bytes(params, "bfloat16")
        peak = disk_peak_bytes(params, cfg.run.steps, "bfloat16", max_staleness=cfg.run.max_staleness,
                               snapshot_every=cfg.trainer.snapshot_every, keep_checkpoints=cfg.trainer.keep_checkpoints)
        rows.append(f"| {name} | {params / GB:.2f} B | " + " | ".join(f"{roles[r] / GB:.1f} GB" for r in roles)
                    + f" | {peak['total'] / GB:.0f} GB |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(readme_table())
