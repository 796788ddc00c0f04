"""The transformers model backend: batched sampling, teacher-forced scoring.

Token ids in, token ids out: nothing here decodes and re-encodes text.

Log-prob convention (shared by sampler, teacher and trainer; bad-input cases 6-7):
the log-prob of token y after logits z at temperature T is
``log_softmax(z.float() / T)[y]`` computed by :func:`token_logprobs`, with the
forward pass run under :func:`autocast` for the configured dtype. With
``dtype="bfloat16"`` a sampler or teacher holds its weights in bf16 (half the
memory) and the trainer keeps fp32 master weights, computing under bf16
autocast (`HFBackend`'s ``weights_dtype``). Top-p truncation changes
which tokens can be sampled but NOT the reported log-prob, so the sampler's
log-probs equal :meth:`HFBackend.score` at the same temperature: within
3e-5 nats in float32, but only to ~0.03 nats on average (0.1-0.2 at worst)
under bf16 autocast, where the incremental KV-cache pass and the full forward
round differently. With bf16, recompute pi_old with a full forward (as the
trainer does) rather than trusting sampler log-probs for the PPO ratio.

Padding: both `generate` and `score` LEFT-pad a batch and pass explicit
position ids (``cumsum(mask) - 1``), so a padded row sees exactly the
positions and keys it would see alone. `branch` batches rows that share one
base sequence's KV cache up to different cuts: each row masks the cached
positions at or after its own cut and numbers its new ids from its cut.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from opsd.config import ModelSection
from opsd.credit.policy_loss import entropy_from_logits, token_logprobs  # noqa: F401  (the one log-prob convention, case 6)
from opsd.models import hf_branch
from opsd.models.hf_weights import load_pretrained, load_state_strict, merge_adapter
from opsd.models.hub import resolve_model

log = logging.getLogger(__name__)



class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN/inf logits or log-probs (bad-input case 5).

    `rows` are the indices (into the caller's list) of the affected sequences.
    """

    def __init__(self, message: str, rows: Sequence[int]):
        super().__init__(message)
        self.rows = list(rows)


# ---------------------------------------------------------------------------
# Model files


def ensure_model(cfg: ModelSection) -> Path:
    """The local HF model directory of `cfg` (`opsd.models.hub.resolve_model(cfg).path`).

    A packaged model (converted once into the opsd cache), a local HF
    directory, or the snapshot of a Hugging Face Hub id (org/name) at
    ``cfg.revision`` in the Hugging Face cache (downloaded unless HF_HUB_OFFLINE).
    Raises FileNotFoundError for a name that is none of these,
    opsd.models.hub.ModelUnavailableError (a ValueError, one line) for a Hub
    model that cannot be had, ValueError for a revision on a packaged model or
    a local directory.
    """
    return resolve_model(cfg).path


# ---------------------------------------------------------------------------
# The shared log-prob convention


def autocast(dtype: Literal["float32", "bfloat16"], device: str | torch.device = "cpu"):
    """Context manager for forward passes: bf16 autocast for "bfloat16", nothing for "float32".

    Weights may be fp32 (the trainer's master copy) or bf16 (a sampler's or teacher's). Sampler, teacher and trainer must all use it
    (a dtype mismatch moves the PPO ratio away from 1).
    """
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"unknown dtype {dtype!r}")


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
    or "length" (max_new_tokens reached without one); entropies: entropy in
    nats (>= 0) of the distribution each id was drawn from (softmax at the
    sampling temperature, renormalized to the top-p nucleus when top_p < 1;
    same length as token_ids), or None from a backend that does not report it.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    entropies: list[float] | None = None


@dataclass
class BranchResult:
    """What :meth:`HFBackend.branch` computes from one base sequence.

    base_logprobs: float32 [len(base) - start], log-prob (nats) of each id of
    ``base[start:]`` given the ids before it, at score_temperature (empty when
    start == len(base)); generations: one entry per cut, in the caller's
    order: the sampled continuation of ``base[:cut]`` (a :class:`Generation`,
    log-probs at the sampling temperature), or None when generate_tokens == 0
    or ``cut + generate_tokens > max_model_len``; continuation_logprobs: per
    cut (caller's order), per continuation (caller's order): float32
    [len(continuation)] log-probs of those exact ids given ``base[:cut]`` at
    score_temperature (an empty list per cut when no continuations were given);
    base_entropies: with ``return_entropy``, float32 [len(base) - start]
    entropy (nats, >= 0) of softmax(logits / score_temperature) at the
    position predicting each id of ``base[start:]``; else None.
    """

    base_logprobs: np.ndarray
    generations: list[Generation | None]
    continuation_logprobs: list[list[np.ndarray]]
    base_entropies: np.ndarray | None = None


def check_branch_args(
    base: Sequence[int],
    start: int,
    cuts: Sequence[int],
    continuations: Sequence[Sequence[Sequence[int]]] | None,
    limit: int,
    ids,
) -> tuple[list[int], list[int], list[list[list[int]]]]:
    """The argument checks of `branch`, shared by both backends; returns (base, cuts, continuations) as int lists.

    limit: the most tokens the base, or a cut's prefix plus a continuation,
    may hold (the model's position limit; vLLM keeps one slot for its dummy
    output token). ids(seq, what) -> list[int] checks one id sequence
    (vocabulary range, integer type) and raises ValueError naming `what`.
    Raises ValueError for an empty or over-long base, start outside
    [1, len(base)], a cut outside (0, len(base)], a continuation list per
    cut that does not match `cuts`, or a continuation past `limit` (the
    message names the cut index and value).
    """
    L = len(base)
    if L == 0:
        raise ValueError("branch: empty base")
    if L > limit:
        raise ValueError(f"branch: base of {L} tokens > model limit {limit}")
    base = ids(base, "base")
    if not 1 <= start <= L:
        raise ValueError(f"branch: start {start} outside [1, {L}]")
    cuts = [int(c) for c in cuts]
    for i, c in enumerate(cuts):
        if not 0 < c <= L:
            raise ValueError(f"branch: cut {i} ({c}) outside (0, {L}]")
    if continuations is not None and len(continuations) != len(cuts):
        raise ValueError(f"branch: {len(continuations)} continuation lists for {len(cuts)} cuts")
    conts: list[list[list[int]]] = [[] for _ in cuts]
    for i, cs in enumerate(continuations or []):
        for j, cont in enumerate(cs):
            if cuts[i] + len(cont) > limit:
                raise ValueError(
                    f"branch: cut {i} (at {cuts[i]}): continuation {j} of {len(cont)} tokens "
                    f"overflows the model limit {limit}"
                )
            conts[i].append(ids(cont, f"cut {i} continuation {j}"))
    return base, cuts, conts


def check_continuations_finite(cont_lps: list[list[np.ndarray]]) -> None:
    """The finiteness check of `branch`'s continuation log-probs (per cut, per continuation), shared by both
    backends: raises NonFiniteLogitsError whose `rows` are the cuts with a NaN/inf log-prob."""
    bad = sorted(i for i, cs in enumerate(cont_lps) if any(not np.isfinite(a).all() for a in cs))
    if bad:
        raise NonFiniteLogitsError(f"branch: non-finite continuation log-probs at cuts {bad}", bad)


def _one_caller(fn):
    """The backend method `fn` under the backend's lock: threads (groups in flight) take turns on the model."""

    @functools.wraps(fn)
    def locked(self, *args, **kwargs):
        with self.lock:
            return fn(self, *args, **kwargs)

    return locked


def quiet_progress_bars() -> None:
    """Turn off transformers' (and the hub's) tqdm bars, such as "Loading weights", when stderr is not a
    terminal: in a log file or a pipe every redraw of a bar is one more line of noise."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def served_dtype(cfg: ModelSection) -> torch.dtype:
    """The dtype rollout and teacher hold weights in, and the trainer publishes them in: ``cfg.dtype`` as a torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


class HFBackend:
    """A causal LM served with transformers on one device (the vLLM backend keeps this interface).

    Attributes: tokenizer, model (eval mode, weights in `weights_dtype`), policy_version (int, 0 at
    load), eos_token_id (the chat template's end-of-turn id, ``<|im_end|>`` in ChatML), stop_token_ids
    (every id that ends a sampled turn: `opsd.models.tokenizer.turn_stop_ids`), vocab_size,
    max_model_len (prompt + new tokens limit for `generate`), dtype ("float32"
    or "bfloat16": autocast convention of every forward pass), weights_dtype (torch dtype the weights are held in).

    weights_dtype: None = the served dtype, `served_dtype(cfg)` (bf16 weights on rollout and teacher with
    ``model.dtype: bfloat16``); the trainer passes torch.float32 for its master weights (bf16 compute
    comes from autocast then). Raises ValueError for a weights_dtype that is not a floating dtype;
    opsd.models.trust.UntrustedModelError (a ValueError, one line) for a model directory that needs its own
    Python code while ``cfg.trust_remote_code`` is false, or whose weights are pickle files only (the weights
    load from safetensors files alone).
    """

    def __init__(self, cfg: ModelSection, device: str = "cpu", weights_dtype: torch.dtype | None = None):
        from opsd.models.tokenizer import load_tokenizer, turn_stop_ids

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.dtype
        self.weights_dtype = served_dtype(cfg) if weights_dtype is None else weights_dtype
        if not self.weights_dtype.is_floating_point:
            raise ValueError(f"weights_dtype must be a floating dtype, got {self.weights_dtype}")
        self.max_model_len = cfg.max_model_len
        self.path = ensure_model(cfg)
        quiet_progress_bars()
        self.tokenizer = load_tokenizer(cfg, self.path)
        self.model = load_pretrained(cfg, self.path, self.weights_dtype)
        self.model.to(self.device)
        self.model.eval()
        self.lock = threading.RLock()  # generate/score/branch/load_weights and HFEngine's waves take turns
        self.policy_version = 0
        self.eos_token_id, self.stop_token_ids = turn_stop_ids(cfg, self.tokenizer, self.path)
        # Padding is always masked out; any in-vocabulary id works.
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_id)
        self.vocab_size: int = int(self.model.config.vocab_size)
        self.max_positions: int = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)

    # -- helpers -----------------------------------------------------------

    def _check_ids(self, seq: Sequence[int], what: str) -> None:
        if len(seq) and (min(seq) < 0 or max(seq) >= self.vocab_size):
            raise ValueError(f"{what}: token id out of range [0, {self.vocab_size})")

    def _ids(self, seq: Sequence[int], what: str) -> list[int]:
        self._check_ids(seq, what)
        return [int(t) for t in seq]

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a prompt of `prompt_len` tokens may be sent with this token budget."""
        return prompt_len >= 1 and max_new_tokens >= 1 and prompt_len + max_new_tokens <= self.max_model_len

    def _forward(self, **inputs):
        """The model's output for `inputs` (the model's keyword arguments), under `autocast` for `dtype`."""
        with autocast(self.dtype, self.device):
            return self.model(**inputs)

    # -- sampling ----------------------------------------------------------

    @_one_caller
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
        stops = torch.tensor(sorted({*self.stop_token_ids, *(stop_token_ids or ())}), dtype=torch.long)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))

        ids, mask, pos = left_pad(prompts, self.pad_token_id)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        return self._decode(
            out.past_key_values, out.logits[:, -1, :].float(), mask, pos[:, -1:] + 1, max_new_tokens,
            temperature, top_p, gen, stops, labels=list(range(len(prompts))), what="prompts",
        )

    def _decode(
        self,
        cache,
        logits: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | list[torch.Generator | None] | None,
        stops: torch.Tensor,
        labels: list[int],
        what: str,
        on_finish: Callable[[int, Any, torch.Tensor, int], None] | None = None,
    ) -> list[Generation]:
        """The sampling loop shared by `generate`, `branch` and `HFEngine`: B rows whose prompts are in `cache`.

        logits: float32 [B, V] raw logits for each row's first new token;
        mask: [B, P] attention mask over the cached positions; pos: [B, 1]
        position id of the first new token. Each step samples, records the
        id, its log-prob at `temperature` and the entropy of the distribution
        it was drawn from (see `_sample`), stops a row when it samples one
        of `stops` (kept, finish "stop") and drops finished rows from the
        batch so later steps pay only for live ones. `labels` name the rows in
        errors (NonFiniteLogitsError for NaN/inf logits of a live row).
        gen: one generator for the batch, or one per row (row r draws from
        gen[r] alone, so its sample does not depend on the other rows).
        on_finish(row, cache, mask, b): called once per row as it finishes,
        before it leaves the batch: the row's keys/values are
        ``cache.layers[*].keys[b]`` at the positions where ``mask[b] == 1``
        (its prompt and every sampled id but the last, which was never fed).
        """
        B = logits.shape[0]
        out_ids = torch.zeros((B, max_new_tokens), dtype=torch.long)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32)
        out_ent = torch.zeros((B, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        finish = ["length"] * B
        live = torch.arange(B)  # batch position -> caller's row
        for t in range(max_new_tokens):
            bad = ~torch.isfinite(logits).all(-1).cpu()
            if bad.any():
                idx = [labels[r] for r in live[bad].tolist()]
                raise NonFiniteLogitsError(f"non-finite logits at new token {t} for {what} {idx}", idx)
            nxt, ent = self._sample(logits, temperature, top_p, [gen[r] for r in live.tolist()] if isinstance(gen, list) else gen)
            nxt_cpu = nxt.cpu()
            out_ids[live, t] = nxt_cpu
            out_lp[live, t] = token_logprobs(logits, nxt, temperature).cpu()
            out_ent[live, t] = ent.cpu()
            lengths[live] += 1
            hit = torch.isin(nxt_cpu, stops)  # the sampler's own stop decision
            for r in live[hit].tolist():
                finish[r] = "stop"
            last = t == max_new_tokens - 1
            if on_finish is not None:
                for b in (range(len(live)) if last else hit.nonzero().flatten().tolist()):
                    on_finish(int(live[b]), cache, mask, b)
            if bool(hit.all()) or last:
                break
            if bool(hit.any()):
                keep = (~hit).nonzero().flatten()
                cache.batch_select_indices(keep.to(self.device))
                k = keep.to(self.device)
                live, nxt, mask, pos = live[keep], nxt[k], mask[k], pos[k]
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device)], dim=1)
            out = self._forward(
                input_ids=nxt.view(-1, 1),
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # raw logits, before any processing
            pos = pos + 1
        return [
            Generation(out_ids[r, : int(lengths[r])].tolist(), out_lp[r, : int(lengths[r])].tolist(), finish[r],  # type: ignore[arg-type]
                       out_ent[r, : int(lengths[r])].tolist())
            for r in range(B)
        ]

    @staticmethod
    def _sample(
        logits: torch.Tensor, temperature: float, top_p: float,
        gen: torch.Generator | list[torch.Generator | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one id per row from softmax(logits / T) truncated to the top-p nucleus.

        logits: float32 [B, V]; gen: one generator for all rows, or one per
        row (each row drawn alone from its own). Returns (ids int64 [B],
        entropy float32 [B]): the entropy in nats of the distribution
        actually sampled from, i.e. of softmax(logits / T) when top_p == 1,
        else of the nucleus renormalized (q = p / Z over the kept ids:
        H = log Z - sum q log p), clamped at 0 (float noise).
        """

        def draw(weights: torch.Tensor) -> torch.Tensor:  # [B, 1]
            if not isinstance(gen, list):
                return torch.multinomial(weights, 1, generator=gen)
            return torch.cat([torch.multinomial(weights[r : r + 1], 1, generator=g) for r, g in enumerate(gen)])

        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            choice = draw(sorted_p)
            logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, order)
            Z = sorted_p.sum(-1, keepdim=True)
            q = sorted_p / Z
            ent = torch.log(Z.squeeze(-1)) - torch.where(q > 0, q * logp, torch.zeros_like(q)).sum(-1)
            return order.gather(-1, choice).squeeze(-1), ent.clamp(min=0.0)
        ent = entropy_from_logits(logits, temperature)
        return draw(probs).squeeze(-1), ent.clamp(min=0.0)

    # -- scoring -----------------------------------------------------------

    @_one_caller
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
            logits = self._forward(
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

    # -- prefix reuse ------------------------------------------------------

    # `branch` runs the rows of a batched forward on copies of the needed
    # prefix of the base KV cache; this caps rows * cached positions per
    # forward (SmolLM2-135M fp32: 46 KB per position, 8192 -> ~380 MB).
    branch_batch_tokens: int = 8192
    SCORES_MASKED = True  # `branch` takes score_mask (the vLLM backend scores every position)
    _ENTROPY_ROWS = 256  # base rows per entropy chunk: temporaries of 256 x V floats (~50 MB for SmolLM2)

    @_one_caller
    @torch.inference_mode()
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
        score_mask: Sequence[bool] | np.ndarray | None = None,
    ) -> BranchResult:
        """Score `base`, then sample and/or teacher-force continuations at cut points, reusing one KV cache.

        Why: the privileged teacher needs, for one trajectory, (a) the
        log-probs of the whole sequence, (b) a sampled response after each
        turn's prompt ``base[:cut]`` and (c) the log-probs of other turns'
        responses after that same prompt. Every prompt is a prefix of `base`,
        so one forward over `base` holds all their keys/values; each cut then
        only pays for its own new tokens instead of re-reading ~700 prompt
        tokens (what vLLM's prefix cache gives for free). Same values as the
        separate calls: `base_logprobs` == ``score([base], [start],
        temperature=score_temperature)[0]``; each continuation's log-probs ==
        ``score([base[:cut] + cont], [cut], temperature=score_temperature)[0]``;
        each generation is drawn exactly as ``generate([base[:cut] for the
        cuts that fit], generate_tokens, temperature, top_p, seed)`` would
        (float32: within ~3e-5 nats, base_logprobs bit-identical in tests;
        under bf16 autocast the cached pass rounds like `generate`'s, up to
        ~0.2 nats from `score`, see the module doc).

        base: token ids (1 <= len <= model position limit); start: 1 <=
        start <= len(base), first scored position; cuts: prompt lengths, each
        in (0, len(base)], any order, duplicates allowed; continuations: None
        or one list per cut of id lists (each scored after ``base[:cut]``);
        generate_tokens: new-token budget per cut (0: no sampling);
        temperature / top_p: sampling as in `generate` (stop at ``<|im_end|>``,
        kept, finish "stop"; else "length"); seed: one torch.Generator for the
        whole call (global RNG untouched; None draws from the global RNG);
        score_temperature: temperature of base and continuation log-probs;
        return_entropy: also compute `base_entropies` (the teacher's entropy
        for FiRe-OPD: a few element-wise passes over the base logits it
        already holds, in row chunks so memory stays at one [chunk, V] block);
        score_mask: None (score every id of ``base[start:]``) or bool
        [len(base) - start]: only the ids where it is True are scored (log-prob,
        entropy, the NaN check); the others are 0.0 in the result. The teacher
        trains on its loss tokens only, about a tenth of a trajectory: the LM
        head, log_softmax and entropy of the other positions were ~11% of a
        quickstart teacher step (profiled with py-spy).

        Work: one forward over `base` (only ``base[:max(cuts)]`` when start ==
        len(base)); the generations of all cuts that fit are sampled as one
        batch (each row attends to its own prefix of the shared cache through
        the attention mask, with explicit position ids); the continuations
        (length >= 2; length 1 needs only the base forward) are teacher-forced
        in batches, longest cut first. A batch holds at most
        `branch_batch_tokens` cached positions (at least one row). The base
        cache itself is never modified: each batch copies the prefix it needs
        (a few ms per row; measured faster than cropping one batch-1 cache cut
        by cut, because a decode step costs about the same for 1 or 4 rows).
        With several generation batches, they draw from the one seeded
        generator in turn (still deterministic for a given call).

        Raises ValueError for an empty/over-long base or out-of-vocabulary
        id, a start or cut out of range, `continuations` not matching `cuts`,
        a continuation with ``cut + len(cont) > max_positions`` (the message
        names the cut index and value; callers apply their own context policy
        first, as with `score`), or bad sampling parameters. A cut with
        ``cut + generate_tokens > max_model_len`` is not an error: its
        generation is None. NonFiniteLogitsError (never silent) when base,
        sampling or continuation log-probs are non-finite; its `rows` are cut
        indices (empty for the base itself).
        """
        L = len(base)
        base, cuts, conts = check_branch_args(base, start, cuts, continuations, self.max_positions, self._ids)
        hf_branch.check_branch_options(generate_tokens, temperature, top_p, score_temperature)
        scored = hf_branch.scored_offsets(score_mask, L - start)
        if not cuts and not len(scored):  # nothing to read from a forward
            return BranchResult(np.zeros(L - start, dtype=np.float32), [], [],
                                np.zeros(L - start, dtype=np.float32) if return_entropy else None)
        cache, base_lp, base_ent, cut_logits = hf_branch.score_base(self, base, start, cuts, scored,
                                                                    score_temperature, return_entropy)
        if not (np.isfinite(base_lp).all() and (base_ent is None or np.isfinite(base_ent).all())):
            raise NonFiniteLogitsError("branch: non-finite log-probs in the base sequence", [])
        generations: list[Generation | None] = [None] * len(cuts)
        if generate_tokens > 0:
            generations = hf_branch.generate_at_cuts(self, cache, cuts, cut_logits, generate_tokens, temperature,
                                                     top_p, seed)
        cont_lps = hf_branch.force_continuations(self, cache, cuts, cut_logits, conts, score_temperature)
        check_continuations_finite(cont_lps)
        return BranchResult(base_lp, generations, cont_lps, base_ent)

    # -- weights -----------------------------------------------------------

    # LoRA state of a worker (see `load_weights`); class defaults, set per instance on first use.
    _lora_base: dict[str, torch.Tensor] | None = None  # CPU copies of the ORIGINAL targeted weights
    _lora_merged = None  # the opsd.lora.Adapter merged into the model now, or None
    _full_file_loaded = False  # a full file replaced the weights before any adapter: the base is gone

    @_one_caller
    def load_weights(self, ref: str | Path, version: int) -> str:
        """Load policy `version` from the weights file `ref` and set policy_version = version; returns the content
        digest of what was loaded (64 hex, computed while reading and checked against the file's record).

        ref: a path (str or Path; `opsd.weights_io.open_weights`), read once
        as a stream. Two formats, told apart by the header's metadata:

        - a full state dict (`save_weights` of a fully fine-tuned model):
          every tensor read (finite values, the recorded digest checked by
          `opsd.weights_io.iter_tensors`), then copied in strictly (see
          `load_state_strict`);
        - an opsd-lora adapter (opsd/lora.py, `trainer.lora`): every targeted
          weight becomes W0 + (B @ A) * alpha / rank, W0 being the ORIGINAL
          base weight (version 0), never the previous version's merge. The
          first adapter load keeps CPU copies of the targeted base weights
          (their size in memory; float32).

        Raises FileNotFoundError for a missing file; for a full file
        opsd.weights_io.WeightsError (a ValueError: bad header, truncated,
        NaN/inf, digest mismatch), KeyError (missing/unexpected keys) or
        ValueError (shape, dtype or tie mismatch); for an adapter
        opsd.lora.AdapterError (a ValueError: metadata, names, shapes, NaN/inf,
        modules that differ from the model's targeted ones or from the first
        adapter's, or base weights already replaced by a full file). On any
        error the model and policy_version are unchanged.
        """
        from opsd import lora
        from opsd.weights_io import iter_tensors, open_weights, read_header

        source = str(ref)
        with open_weights(ref) as stream:
            header = read_header(stream, source)
            if header.metadata.get("format") == lora.FORMAT:
                adapter = lora.adapter_from_stream(stream, header, source)
                self._load_adapter(adapter, source)
                digest = adapter.digest
            else:
                reader = iter_tensors(stream, header, source)
                load_state_strict(self.model, dict(reader), source)
                digest = reader.digest
                self._lora_merged = None
                if self._lora_base is None:
                    self._full_file_loaded = True
        self.policy_version = int(version)
        return digest

    @torch.no_grad()
    def _load_adapter(self, adapter, path: str) -> None:
        """Merge `adapter` (read from the file `path`) onto the kept base weights (see `load_weights`); checks
        everything first."""
        from opsd import lora

        params = dict(self.model.named_parameters())
        names = lora.check_against(adapter, {n: p.shape for n, p in params.items()}, str(path))
        base = self._lora_base
        if base is None:
            if self._full_file_loaded:
                raise lora.AdapterError(
                    f"{path}: an adapter applies to the initial base weights, but a full weights file replaced them"
                )
            base = {n: params[n].detach().to("cpu", copy=True) for n in names}
        elif set(names) != set(base):
            raise lora.AdapterError(f"{path}: adapts other modules than the first adapter loaded ({len(names)} vs {len(base)} weights)")
        try:
            merge_adapter(adapter, base, params)
        except BaseException:
            # Everything was checked above: only an allocation/device failure gets here.
            # Put back what the model held (the previous merge, or the base).
            merge_adapter(self._lora_merged, base, params)
            raise
        self._lora_base, self._lora_merged = base, adapter

    def save_weights(self, path: Path, dtype: torch.dtype | None = None) -> None:
        """Write the policy at `path` atomically (tmp file + rename): a reader sees the old or the complete new file.

        A model prepared by `opsd.lora.apply_lora` (trainer.lora set) writes
        its adapter only (opsd-lora format, `opsd.lora.save_adapter`; float32;
        metadata policy_version = self.policy_version). Otherwise the whole
        state dict (metadata format "pt"), streamed tensor by tensor by
        `opsd.weights_io.write_weights`, floating tensors cast to `dtype`
        (the dtype workers serve; None: the model's own); tied tensors
        (embedding / LM head) are stored once and `load_weights` restores the
        tie. Either way the metadata also records the stored tensors' content
        digest (`opsd.weights.DIGEST_KEY`), which workers compare to reload a
        version rewritten with other weights. Raises OSError on write failure.
        """
        from opsd import lora
        from opsd.weights_io import write_weights

        if lora.is_lora_model(self.model):
            lora.save_adapter(self.model, Path(path), self.policy_version)
            return
        write_weights(self.model.state_dict(), Path(path), {"format": "pt", "policy_version": str(self.policy_version)},
                      dtype=dtype)

    def save_checkpoint(self, directory: Path) -> None:
        """Save a loadable HF checkpoint (safetensors weights, config, tokenizer) into `directory`.

        Written to a temp directory next to it, then renamed, so a reader
        never sees half a checkpoint. Raises OSError on write failure.
        """
        directory = Path(directory)
        tmp = directory.with_name(f".{directory.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
