"""`HFEngine`: the Engine interface (opsd/models/engine.py) on a transformers backend.

One thread serves every submitted request in waves: it takes the requests
waiting (up to `max_batch`, those sampling like the oldest one), prefills
them together and decodes them together with `HFBackend._decode`, each row
drawing from its own seeded generator, so a row's tokens do not depend on
which rows shared its wave. Requests submitted while a wave decodes wait for
the next one (no admission mid-wave: a wave lasts one turn's response).

An episode's KV is kept between its turns: when a row finishes, its keys and
values (prompt and response, but the last sampled id) are copied out under
its `cache_key`; the episode's next prompt extends those ids, so only the new
tokens (the last response id and the next observation) are prefilled. The
copies live in a store of `kv_cache_bytes` that admits while it has room (a
full store evicts nothing: see `_keep`); an episode not kept, or one whose
prompt does not extend its stored ids, is prefilled in full. A row
resumed from the store attends to its cached positions through an attention
mask with holes, as `HFBackend.branch` does:

    [pad .. | cached ids of row i | pad .. | new ids of row i]   (position ids continue the cached ones)

Cached and recomputed prefixes give the same log-probs up to float rounding
(tests/test_hf_engine.py checks it against `HFBackend.generate`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opsd.models.engine import EngineStats, SampleRequest
from opsd.models.hf import Generation, HFBackend, NonFiniteLogitsError, autocast, left_pad

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: SampleRequest
    future: Future = field(default_factory=Future)


@dataclass
class _KV:
    """One episode's cached keys/values: ids [n] and per layer (keys, values) [1, heads, n, head_dim]."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class HFEngine:
    """Continuous requests over an HFBackend (module docstring). Safe to call from any thread.

    backend: the HFBackend whose model serves the requests (load weights
    through the engine's `load_weights`, which also drops the kept KV). max_batch: rows per wave (>= 1);
    kv_cache_bytes: the episodes' KV store budget (0 disables reuse).
    A wave holds `backend.lock`, so direct backend calls from other threads
    wait for it (and the other way round).
    Raises ValueError for a bad max_batch or budget.
    """

    def __init__(self, backend: HFBackend, max_batch: int = 64, kv_cache_bytes: int = 2 << 30):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes must be >= 0, got {kv_cache_bytes}")
        self.backend = backend
        self.max_batch = max_batch
        self.kv_cache_bytes = kv_cache_bytes
        self._cond = threading.Condition()
        self._waiting: list[_Pending] = []
        self._running = 0
        self._store: OrderedDict[str, _KV] = OrderedDict()
        self._store_bytes = 0
        self._stats = EngineStats()
        self._closed = False
        self._stopped = False  # set by the engine thread as it leaves its loop
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
        self._thread.start()

    # -- the Engine interface ----------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.backend.policy_version

    def submit(self, request: SampleRequest) -> Future[Generation]:
        """Queue one request; returns a future of its Generation (see opsd.models.engine.Engine).

        Raises ValueError at once for an empty or over-long prompt
        (prompt + max_new_tokens > max_model_len), an out-of-vocabulary id,
        temperature <= 0, top_p outside (0, 1], max_new_tokens < 1;
        RuntimeError once the engine is closed. The future fails with
        NonFiniteLogitsError when the model returns NaN/inf logits for it.
        """
        b = self.backend
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if not request.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is not supported), got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
        if not b.fits(len(request.prompt_ids), request.max_new_tokens):
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {request.max_new_tokens} "
                             f"exceeds max_model_len {b.max_model_len} (or the prompt is empty)")
        if request.seed is not None and (isinstance(request.seed, (bool, np.bool_))
                                         or not isinstance(request.seed, (int, np.integer))):
            raise ValueError(f"seed must be an integer or None, got {type(request.seed).__name__} {request.seed!r}")
        b._check_ids(request.prompt_ids, "prompt")
        b._check_ids(request.stop_token_ids, "stop_token_ids")
        pending = _Pending(request)
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(pending)
            self._cond.notify_all()
        return pending.future

    def release(self, cache_key: str) -> None:
        """Drop the KV kept for episode `cache_key` (no-op when there is none)."""
        with self._cond:
            kv = self._store.pop(cache_key, None)
            if kv is not None:
                self._store_bytes -= kv.nbytes

    def stats(self) -> EngineStats:
        """A snapshot: kv_cache_usage is the store's bytes / kv_cache_bytes (0 when reuse is off)."""
        with self._cond:
            s = EngineStats(**vars(self._stats))
            s.running, s.waiting = self._running, len(self._waiting)
            s.kv_cache_usage = self._store_bytes / self.kv_cache_bytes if self.kv_cache_bytes else 0.0
            return s

    def in_flight(self) -> int:
        """Requests submitted and not resolved yet."""
        with self._cond:
            return self._running + len(self._waiting)

    def load_weights(self, path: Path, version: int) -> str:
        """`HFBackend.load_weights` while the engine is idle (returns its verified digest); drops every kept KV
        (computed by the old weights).

        Raises RuntimeError when requests are in flight (the caller drains
        first: no request of version v may run after v+1 is loaded), and what
        HFBackend.load_weights raises.
        """
        with self._cond:
            if self._running or self._waiting:
                raise RuntimeError(f"cannot load weights with {self._running + len(self._waiting)} requests in flight")
            with self.backend.lock:
                self._store.clear()
                self._store_bytes = 0
                return self.backend.load_weights(path, version)

    def close(self) -> None:
        """Stop the thread; requests still waiting fail with RuntimeError (cancelled ones stay cancelled).
        Idempotent."""
        with self._cond:
            self._closed = True
            left, self._waiting = self._waiting, []
            self._cond.notify_all()
            if self._thread is not threading.current_thread():
                # wait() lets go of the lock however deep a caller holds it, so the thread can see `_closed`
                # (a join here would wait out its timeout while the caller holds the lock)
                self._cond.wait_for(lambda: self._stopped or not self._thread.is_alive(), timeout=60)
        for p in left:
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(RuntimeError("the engine was closed"))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    # -- the engine thread -------------------------------------------------

    def _loop(self) -> None:
        if self.backend.cfg.threads:  # torch's intra-op thread count is per thread: set it in this one too
            torch.set_num_threads(self.backend.cfg.threads)
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._stopped = True
                    self._cond.notify_all()
                    return
                wave = self._take()
                self._running = len(wave)
            try:
                with self.backend.lock:  # the model is the backend's: its own calls take turns with waves
                    outcomes = self._serve(wave)
            except Exception as err:  # noqa: BLE001 - the futures carry it to the callers
                outcomes = [(p, err) for p in wave]
            with self._cond:  # idle before any caller learns its result: a load right after it is allowed
                self._running = 0
                self._cond.notify_all()
            for p, outcome in outcomes:
                if isinstance(outcome, BaseException):
                    p.future.set_exception(outcome)
                else:
                    p.future.set_result(outcome)

    def _take(self) -> list[_Pending]:
        """The next wave: up to max_batch waiting requests that sample like the oldest one (called locked).

        A request whose future was cancelled while it waited is dropped here;
        the others' futures become running (no longer cancellable).
        """
        self._waiting = [p for p in self._waiting if not p.future.cancelled()]
        if not self._waiting:
            return []
        r0 = self._waiting[0].request
        key = (r0.max_new_tokens, r0.temperature, r0.top_p, tuple(sorted(r0.stop_token_ids)))
        wave, rest = [], []
        for p in self._waiting:
            r = p.request
            same = (r.max_new_tokens, r.temperature, r.top_p, tuple(sorted(r.stop_token_ids))) == key
            (wave if same and len(wave) < self.max_batch else rest).append(p)
        self._waiting = rest
        return [p for p in wave if p.future.set_running_or_notify_cancel()]  # False: cancelled just now

    def _reuse(self, request: SampleRequest) -> _KV | None:
        """The kept KV of `request`'s episode when its ids are a strict prefix of the prompt (taken out of the store)."""
        if request.cache_key is None or not self.kv_cache_bytes:
            return None
        with self._cond:
            kv = self._store.pop(request.cache_key, None)
            if kv is None:
                return None
            self._store_bytes -= kv.nbytes
        n = len(kv.ids)
        if n >= len(request.prompt_ids) or list(request.prompt_ids[:n]) != kv.ids:
            return None
        return kv

    def _keep(self, key: str, kv: _KV) -> None:
        """Keep `kv` under `key` if it fits the budget. A full store admits nothing more, evicting nothing:
        waves serve the oldest requests first, so the least recently kept episode is the one resumed next
        (LRU eviction would drop exactly that one, every time)."""
        with self._cond:
            old = self._store.pop(key, None)
            if old is not None:
                self._store_bytes -= old.nbytes
            if self._store_bytes + kv.nbytes <= self.kv_cache_bytes:
                self._store[key] = kv
                self._store_bytes += kv.nbytes

    @torch.no_grad()
    def _serve(self, wave: list[_Pending]) -> list[tuple[_Pending, Any]]:
        """Prefill and decode one wave; returns (request, Generation or the exception that failed it) per row.

        Rows with non-finite logits fail alone: the others run again, with
        the KV they had kept (taken once for the wave).
        """
        reuse = [self._reuse(p.request) for p in wave]
        outcomes: list[tuple[_Pending, Any]] = []
        while wave:
            try:
                gens = self._run(wave, reuse)
            except NonFiniteLogitsError as err:
                bad = set(err.rows)
                if not bad or not bad <= set(range(len(wave))):
                    raise
                outcomes += [(wave[i], NonFiniteLogitsError(f"non-finite logits for this request: {err}", [0]))
                             for i in sorted(bad)]
                wave = [p for i, p in enumerate(wave) if i not in bad]
                reuse = [kv for i, kv in enumerate(reuse) if i not in bad]
                continue
            return outcomes + list(zip(wave, gens))
        return outcomes

    def _run(self, wave: list[_Pending], reuse_all: list[_KV | None]) -> list[Generation]:
        """One wave's prefill and decode; `reuse_all[i]`: the kept KV row i resumes from (None: prefill in full)."""
        b = self.backend
        dev = b.device
        reqs = [p.request for p in wave]
        B = len(reqs)
        # Rows with the same prompt and nothing kept (an episode's siblings on their first turn) are prefilled once.
        first: dict = {}
        which = [first.setdefault(("row", r) if kv else tuple(req.prompt_ids), len(first))
                 for r, (req, kv) in enumerate(zip(reqs, reuse_all))]
        uniq = [which.index(u) for u in range(len(first))]
        reuse = [reuse_all[r] for r in uniq]
        cached = [len(kv.ids) if kv else 0 for kv in reuse]
        new = [list(reqs[r].prompt_ids[c:]) for r, c in zip(uniq, cached)]
        U, C = len(uniq), max(cached)
        ids, new_mask, _ = left_pad(new, b.pad_token_id)
        # Position ids continue each row's cached ids; padding gets position 0 (masked anyway).
        c_t = torch.tensor(cached, dtype=torch.long).unsqueeze(1)
        pos = ((new_mask.cumsum(-1) - 1).clamp(min=0) + c_t) * new_mask
        past = None
        mask = new_mask
        if C:
            old_mask = torch.zeros((U, C), dtype=torch.long)
            layers = []
            for li, (k0, v0) in enumerate(next(kv for kv in reuse if kv).layers):
                keys = torch.zeros((U, k0.shape[1], C, k0.shape[3]), dtype=k0.dtype, device=dev)
                vals = torch.zeros((U, v0.shape[1], C, v0.shape[3]), dtype=v0.dtype, device=dev)
                for r, kv in enumerate(reuse):
                    if kv:
                        k, v = kv.layers[li]
                        keys[r, :, C - cached[r] :] = k[0]
                        vals[r, :, C - cached[r] :] = v[0]
                layers.append((keys, vals))
            for r, c in enumerate(cached):
                old_mask[r, C - c :] = 1
            from transformers import DynamicCache

            past = DynamicCache(layers, config=b.model.config)
            mask = torch.cat([old_mask, new_mask], dim=1)
        # Kept KV, and the prompts of rows whose twin was prefilled for them (counted once the wave succeeds).
        hits = sum(cached) + sum(len(reqs[r].prompt_ids) for r in range(B) if r not in uniq)
        with autocast(b.dtype, dev):
            out = b.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                          past_key_values=past, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        if U < B:  # every row its own copy of its twin's prefill
            rows = torch.tensor(which, dtype=torch.long, device=dev)
            cache.batch_select_indices(rows)
            logits, mask = logits[rows], mask[rows.cpu()]
        cached = [cached[u] for u in which]
        new = [new[u] for u in which]
        gens_rng: list[torch.Generator | None] = []
        for r in reqs:
            g = None
            if r.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(int(r.seed) % 2**64)  # as generate's manual_seed(seed) for any seed it accepts
            gens_rng.append(g)
        r0 = reqs[0]
        stops = torch.tensor(sorted({*b.stop_token_ids, *r0.stop_token_ids}), dtype=torch.long)
        next_pos = torch.tensor([c + len(x) for c, x in zip(cached, new)], dtype=torch.long).unsqueeze(1).to(dev)

        def on_finish(row: int, cache: Any, row_mask: torch.Tensor, bpos: int) -> None:
            key = reqs[row].cache_key
            if key is None or not self.kv_cache_bytes:
                return
            keep = row_mask[bpos].nonzero().flatten()
            done[row] = [(layer.keys[bpos : bpos + 1, :, keep], layer.values[bpos : bpos + 1, :, keep])  # copies
                         for layer in cache.layers]

        done: dict[int, list] = {}
        gens = b._decode(cache, logits, mask.to(dev), next_pos, r0.max_new_tokens,
                         r0.temperature, r0.top_p, gens_rng, stops, labels=list(range(B)), what="requests",
                         on_finish=on_finish)
        for row, layers in done.items():
            g = gens[row]
            kept_ids = list(reqs[row].prompt_ids) + g.token_ids[:-1]
            if layers and layers[0][0].shape[2] == len(kept_ids):
                self._keep(reqs[row].cache_key, _KV(kept_ids, layers))
        with self._cond:
            self._stats.prefix_queries += sum(len(r.prompt_ids) for r in reqs)
            self._stats.prefix_hits += hits
            self._stats.generated_tokens += sum(len(g.token_ids) for g in gens)
            self._stats.requests += len(gens)
        return gens
