"""The sampling engine a worker with many groups in flight talks to: requests in, futures out.

A rollout worker holding K TaskGroups plays K x G episodes at once, each on
its own (generate -> parse -> environment step -> next turn). Every episode
turn is one `SampleRequest` submitted to the backend's engine; the engine
gathers the requests of all episodes into shared forward passes (continuous
batching on vLLM's async engine, batched waves on transformers) and answers
each with a `concurrent.futures.Future[Generation]`. Token ids in, token ids
out, as `generate`: nothing is detokenized or re-encoded.

An episode names itself with `cache_key`: its next turn's prompt extends this
turn's prompt + response, so an engine may keep the episode's KV between
turns (vLLM: its prefix cache; transformers: the episode's own cache, until
`release`). `EngineStats` reports what the dashboard shows: requests running
and waiting, KV-cache use, prefix-cache hits, tokens generated.

Backends that implement this: `opsd.models.hf_engine.HFEngine` (over an
HFBackend) and `opsd.models.vllm.VLLMBackend` itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from opsd.models.hf import Generation


@dataclass(frozen=True)
class SampleRequest:
    """One response to sample, as `HFBackend.generate` samples one prompt.

    prompt_ids: token ids (non-empty, in the vocabulary; prompt + max_new_tokens
    <= the backend's max_model_len); max_new_tokens >= 1; temperature > 0;
    top_p in (0, 1]; seed: this request's own seed (the draw does not depend
    on which other requests share its batch), None draws from the engine's
    generator; stop_token_ids: stop ids besides ``<|im_end|>`` (kept, finish
    "stop"); cache_key: the episode this turn belongs to, or None.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    cache_key: str | None = None


@dataclass
class EngineStats:
    """A snapshot of an engine (counters are totals since it started).

    running: requests being computed; waiting: submitted, not started;
    kv_cache_usage: share of the KV budget in use, in [0, 1];
    prefix_queries / prefix_hits: prompt tokens looked up in the prefix
    cache / of them served from it (hit rate = hits / queries);
    generated_tokens: tokens sampled; requests: requests finished.
    """

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    generated_tokens: int = 0
    requests: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """prefix_hits / prefix_queries, 0.0 before any query."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class Engine(Protocol):
    """What `services/rollout` needs from a backend to keep many episodes in flight.

    submit: validate `request` now (ValueError for a bad one: empty prompt,
    out-of-vocabulary id, over-long prompt, bad sampling parameters) and
    return a future resolved with its `Generation` (or with the exception
    that failed it, e.g. NonFiniteLogitsError). Safe to call from any thread.
    release: the episode `cache_key` ended; its cached KV may go.
    stats: an EngineStats snapshot. in_flight: requests submitted and not
    yet resolved (0 = idle: weights may be loaded).
    """

    policy_version: int

    def submit(self, request: SampleRequest) -> Future[Generation]: ...

    def release(self, cache_key: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def in_flight(self) -> int: ...
