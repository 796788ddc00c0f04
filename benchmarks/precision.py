"""Sampler / trainer log-prob agreement by precision mode, on real sampled sequences.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--model smollm2-135m-instruct] [--sequences 32]
        [--tokens 128] [--device cpu|cuda] [--quick] [--json OUT]

The sampler (`HFBackend.generate`, KV-cache decoding) draws `--sequences` responses of `--tokens` new tokens at
temperature 1 to chat prompts; the trainer recomputes the log-probs of the same ids with a full forward
(`services.trainer.update.sequence_logprobs`, the trainer's pi_old). Reported per setting: the trainer's
`mismatch_kl` estimator (token-mean of k3 = exp(d) - 1 - d, d = trainer - sampler, over the sampled tokens;
`opsd.credit.policy_loss.sampler_mismatch_k3`) and the mean |d| (`sampler_logprob_mismatch`). Settings:

- fp32: fp32 weights and compute in both (`model.dtype: float32`).
- bf16 weights: the sampler holds bf16 weights (under bf16 autocast); the trainer holds fp32 master weights
  and computes under bf16 autocast (`model.dtype: bfloat16` in one trainer process).
- bf16 autocast (old mode): fp32 weights and bf16 autocast in both (before workers held bf16 weights).
- bf16 weights, trainer on bf16 copies: the trainer's forward on bf16 copies of every weight (what FSDP2's
  MixedPrecisionPolicy(param_dtype=bf16) computes).
- bf16 linears, fp32 embeddings and norms: the sampler's linear layers in bf16, its embedding and RMSNorm
  weights upcast to fp32 (bf16-rounded values), so its residual stream stays fp32 under autocast as the
  trainer's does; the trainer as in "bf16 weights".

`--quick`: 4 sequences x 16 tokens (a smoke test). `--json OUT`: the rows as a benchmark JSON
(benchmarks/common.py), for `make bench`'s table.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import Row, command_line, print_rows, write_json  # noqa: E402
from opsd.config import ModelSection  # noqa: E402
from opsd.credit.policy_loss import sampler_mismatch_k3  # noqa: E402
from opsd.models import load_backend  # noqa: E402
from services.trainer.distributed import Sequence  # noqa: E402
from services.trainer.update import sequence_logprobs  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "List three prime numbers above 50.", "How do I boil an egg?", "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.", "Give me a short story about a lost key.",
    "What is 17 times 23?", "Why is the sky blue?", "Name the planets of the solar system.",
    "Describe a cat to someone who has never seen one.", "What is a binary search?", "Suggest a name for a bakery.",
    "How does a bicycle stay upright?", "What is the difference between weather and climate?",
    "Write two lines of a song about rain.", "Explain what a noun is.", "How many legs does a spider have?",
    "What should I pack for a weekend hike?", "Summarize the plot of Romeo and Juliet.", "What is gravity?",
    "Give a tip for learning a new language.", "What is the boiling point of water in Fahrenheit?",
    "Describe the colour green.", "Why do leaves fall in autumn?", "What is an atom made of?",
    "Recommend a book for a long flight.", "How do vaccines work?", "Write a limerick about a frog.",
    "What is the tallest mountain on Earth?", "How do I make a paper airplane?",
]
TEMPERATURE = 1.0


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts (the questions, cycled), rendered by the model's chat template with a generation prompt."""
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def sample(sampler, prompt_ids: list[list[int]], tokens: int, seed: int) -> list[Sequence]:
    """One response per prompt from `sampler`; each a trainer Sequence (loss mask on the response)."""
    gens = sampler.generate(prompt_ids, max_new_tokens=tokens, temperature=TEMPERATURE, seed=seed)
    seqs = []
    for p, g in zip(prompt_ids, gens):
        ids = np.asarray(p + g.token_ids, np.int64)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(p):] = 1
        lp = np.zeros(len(ids), np.float32)
        lp[len(p):] = g.logprobs
        seqs.append(Sequence(ids, mask, np.zeros(len(ids), np.float32), lp))
    return seqs


def mismatch(model: torch.nn.Module, seqs: list[Sequence], dtype: str) -> tuple[float, float, int]:
    """(mismatch_kl nats/token, mean |trainer - sampler| nats, tokens) of `model`'s full-forward log-probs."""
    trainer = sequence_logprobs(model, seqs, dtype=dtype, temperature=TEMPERATURE, micro_batch_size=4)
    old = torch.from_numpy(np.concatenate(trainer))
    sampler = torch.from_numpy(np.concatenate([s.sampler_logprobs_S for s in seqs]))
    mask = torch.from_numpy(np.concatenate([s.loss_mask_S for s in seqs]).astype(np.float32))
    n = float(mask.sum())
    kl = float(sampler_mismatch_k3(old, sampler, mask).sum()) / n
    return kl, float(((old - sampler).abs() * mask).sum()) / n, int(n)


def fp32_embeddings_and_norms(backend):
    """`backend` (bf16 weights) with its embedding and norm modules' weights upcast to fp32, in place; returns it."""
    for module in backend.model.modules():
        if isinstance(module, torch.nn.Embedding) or "norm" in type(module).__name__.lower():
            module.float()
    return backend


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every weight rounded to bf16 (FSDP2's param_dtype=bf16 forward)."""
    return copy.deepcopy(model).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:
        args.sequences, args.tokens = 4, 16
    fp32 = ModelSection(name=args.model, device=args.device, dtype="float32", max_model_len=2048)
    bf16 = fp32.model_copy(update={"dtype": "bfloat16"})
    master = load_backend(fp32, backend="hf", weights_dtype=torch.float32)  # the trainer's fp32 master weights
    ids = prompts(master.tokenizer, args.sequences)
    bf16_server = load_backend(bf16)  # bf16 weights, as rollout holds them
    old_server = load_backend(bf16, weights_dtype=torch.float32)  # fp32 weights + bf16 autocast
    settings = [  # name, sampler, trainer model, trainer dtype
        ("fp32", load_backend(fp32), master.model, "float32"),
        ("bf16 weights", bf16_server, master.model, "bfloat16"),
        ("bf16 autocast (old mode)", old_server, master.model, "bfloat16"),
        ("bf16 weights, trainer on bf16 copies", bf16_server, bf16_copy(master.model), "bfloat16"),
        ("bf16 linears, fp32 embeddings and norms", fp32_embeddings_and_norms(load_backend(bf16)), master.model, "bfloat16"),
    ]
    rows: list[Row] = []
    samples: dict[int, list[Sequence]] = {}
    for name, sampler, model, dtype in settings:
        t0 = time.perf_counter()
        if id(sampler) not in samples:  # the last setting scores the bf16 sampler's sequences again
            samples[id(sampler)] = sample(sampler, ids, args.tokens, args.seed)
        kl, mean_abs, n = mismatch(model, samples[id(sampler)], dtype)
        note = f"{args.sequences} seqs, {n} sampled tokens, {args.model} on {args.device}, {time.perf_counter() - t0:.0f} s"
        rows += [Row(f"mismatch_kl: {name}", kl, "nats/token", note=note),
                 Row(f"mean |trainer - sampler| log-prob: {name}", mean_abs, "nats", note=note)]
        print_rows(rows[-2:])
    if args.json:
        write_json(args.json, "precision", command_line(), rows)
    return rows


if __name__ == "__main__":
    main()
