"""Measured host memory of a bf16 run's processes, next to the weights (+ optimizer) bytes they must hold.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory.py [--shape qwen2.5-0.5b|tiny] [--batch 2] [--seq 512]
        [--quick] [--json OUT]

A randomly initialised model of the shape (qwen2.5-0.5b: Qwen2.5-0.5B's architecture, hidden 896, intermediate
4864, 24 layers, 14 heads, 2 kv heads, vocab 151936, tied embeddings; nothing downloaded) is written once in bf16
(as Hub checkpoints ship) with a stand-in word-level tokenizer. Then each measurement runs in its own process
(`--measure NAME --dir D`), which reports its peak resident set (ru_maxrss) and its resident set after the imports
(the interpreter, torch and transformers: the same in every role):

- server: a rollout-like `HFBackend` with `model.dtype: bfloat16` (bf16 weights) sampling 16 new tokens for
  `--batch` prompts of 32 ids; computed: params x 2 bytes.
- trainer / trainer, gradient checkpointing: the trainer's model (`weights_dtype=torch.float32`, the fp32
  master weights) and one `ppo_update` AdamW step under bf16 autocast on `--batch` sequences of `--seq` ids
  (the second half loss tokens); computed: params x 16 bytes (fp32 weights, gradients, AdamW's two moments).

Activations, the bf16 copies autocast makes of the weights, the logits of the loss positions and the allocator's
slack come on top of the computed bytes. `--quick`: the tiny shape (a smoke test). `--json OUT`: the rows as a
benchmark JSON (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

from benchmarks.common import Row, command_line, print_rows, write_json  # noqa: E402
from opsd.footprint import PRESETS  # noqa: E402

# Architecture shapes (transformers Qwen2Config arguments).
SHAPES = {
    # opsd.footprint's public config of Qwen2.5-0.5B-Instruct (one copy of its shape), with its rope and norm values
    "qwen2.5-0.5b": {**{k: v for k, v in PRESETS["Qwen2.5-0.5B-Instruct"].items() if k != "model_type"},
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=4096),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MEASURES = ("server", "trainer", "trainer-gc")
GIB = 2**30


def write_random_model(directory: Path, config, dtype=None, seed: int = 0) -> Path:
    """Write a randomly initialised causal LM of transformers `config` (weights in `dtype`, default float32) and a
    stand-in tokenizer into `directory`; returns it. Nothing is read from the network.

    The tokenizer maps SPECIAL_TOKENS to ids 0-2 and "t<i>" to id i for every other id below the vocab size,
    so any model id is a token (vLLM checks prompt ids against the tokenizer); it has no chat template (turns
    end at its eos, `<|im_end|>`).
    """
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype or torch.float32)
    model.save_pretrained(directory)
    del model
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), config.vocab_size)})
    core = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<|endoftext|>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.save_pretrained(directory)
    return Path(directory)


def qwen_config(shape: str):
    """The transformers Qwen2Config of SHAPES[shape]."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape])


def train_step(model, batch: int, seq: int, dtype: str = "bfloat16", seed: int = 0) -> dict[str, float]:
    """One `ppo_update` AdamW step of `model` (fp32 master weights, already on its device) under `dtype` compute,
    on `batch` random sequences of `seq` ids whose second half are loss tokens (advantage +-1); returns its metrics
    plus "seconds". The optimizer's state is created by the step (AdamW allocates its moments lazily)."""
    import numpy as np
    import torch

    from opsd.config import TrainerSection
    from services.trainer.update import Sequence, ppo_update

    rng = np.random.default_rng(seed)
    vocab = model.get_input_embeddings().num_embeddings
    seqs = []
    for i in range(batch):
        ids = rng.integers(len(SPECIAL_TOKENS), vocab, size=seq).astype(np.int64)
        mask = (np.arange(seq) >= seq // 2).astype(np.uint8)
        adv = (mask * (1.0 if i % 2 else -1.0)).astype(np.float32)
        seqs.append(Sequence(ids, mask, adv, np.where(mask, -np.log(vocab), 0.0).astype(np.float32)))
    cfg = TrainerSection(micro_batch_size=batch, lr=1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    t0 = time.perf_counter()
    out = ppo_update(model, optimizer, seqs, cfg, dtype=dtype)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return {**out, "seconds": time.perf_counter() - t0}


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(name: str, directory: Path, batch: int, seq: int) -> dict:
    """Run one measurement in this process; returns {"base_rss", "peak_rss", "end_rss" (bytes), "params",
    "weights_dtype", "seconds"}. The peak includes the load's transients (safetensors maps the file: its pages
    count while mapped); end_rss is what the process holds once the work is done."""
    import torch

    from opsd.config import ModelSection
    from opsd.models import load_backend
    from services.trainer.update import enable_gradient_checkpointing

    base = _rss_now()
    cfg = ModelSection(name=str(directory), dtype="bfloat16", device="cpu", max_model_len=4096)
    t0 = time.perf_counter()
    if name == "server":
        backend = load_backend(cfg)
        prompts = [[3 + (7 * i + j) % 1000 for j in range(32)] for i in range(batch)]
        backend.generate(prompts, 16, temperature=1.0, seed=0)
    else:
        backend = load_backend(cfg, backend="hf", weights_dtype=torch.float32)
        if name == "trainer-gc":
            enable_gradient_checkpointing(backend.model)
        train_step(backend.model, batch, seq)
    params = sum(p.numel() for p in backend.model.parameters())  # tied weights once
    dtypes = sorted({str(p.dtype) for p in backend.model.parameters()})
    return {"base_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "end_rss": _rss_now(), "params": params,
            "weights_dtype": dtypes, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--measure", choices=MEASURES, help=argparse.SUPPRESS)  # one measurement (a child process)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir, args.batch, args.seq)))
        return []
    if args.quick:
        args.shape, args.seq = "tiny", 64
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="opsd-memory-") as tmp:
        import torch

        write_random_model(Path(tmp), qwen_config(args.shape), torch.bfloat16)
        for name in MEASURES:
            proc = subprocess.run([sys.executable, __file__, "--measure", name, "--dir", tmp, "--batch", str(args.batch),
                                   "--seq", str(args.seq)], capture_output=True, text=True)
            if proc.returncode != 0:
                rows.append(Row(f"{name}: failed", None, note=proc.stderr.strip().splitlines()[-1][:200]))
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            per = 2 if name == "server" else 16
            what = f"{args.shape}, {r['params'] / 1e6:.0f}M params in {'/'.join(r['weights_dtype'])}"
            work = "generate 16 ids" if name == "server" else f"one AdamW step, {args.batch} x {args.seq} ids, bf16 autocast"
            rows += [
                Row(f"{name}: peak RSS", r["peak_rss"] / GIB, "GiB", note=f"{what}; {work}; {r['seconds']:.0f} s"),
                Row(f"{name}: peak RSS - RSS after imports", (r["peak_rss"] - r["base_rss"]) / GIB, "GiB",
                    note=f"after imports {r['base_rss'] / GIB:.2f} GiB"),
                Row(f"{name}: RSS at the end - RSS after imports", (r["end_rss"] - r["base_rss"]) / GIB, "GiB",
                    note="held once the work is done (no load transients)"),
                Row(f"{name}: computed params x {per} bytes", r["params"] * per / GIB, "GiB",
                    note="weights" if per == 2 else "fp32 weights + gradients + AdamW moments"),
            ]
            print_rows(rows[-4:])
    if args.json:
        write_json(args.json, "memory", command_line(), rows)
    return rows


if __name__ == "__main__":
    main()
