"""Play one TaskGroup with every episode on its own: the rollout worker's path with many groups in flight.

With `rollout.max_groups_in_flight` > 1 the worker holds several TaskGroups at
once (opsd.service.consume_forever runs each in a job thread) and each group
plays its G episodes in threads of their own: sample a turn (a SampleRequest
to the shared engine, which batches the requests of every episode of every
group in flight), parse it, step the environment in this episode's thread
(off the engine's path: a slow JVM step stalls only its own episode), append
the next observation, repeat. No episode waits for a sibling or another group.

The ids, log-probs, loss masks and turn records are built exactly as the
lockstep path builds them (`episodes._play_turn`); what differs is the seed
of each draw, one per (group seed, episode, turn) (`request_seed`), so an
episode's samples do not depend on which requests share its batch. Which
requests share a batch depends on timing, so batched float rounding may
differ run to run; `max_groups_in_flight: 1` keeps the lockstep path, whose
samples are reproducible bit for bit (resume).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager

import numpy as np

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RolloutSection
from opsd.envs import EnvContext
from opsd.models.engine import Engine, SampleRequest
from opsd.models.hf import NonFiniteLogitsError
from opsd.types import RolloutGroup, TaskGroup
from services.rollout.episodes import (
    RolloutStats, _checked_task, _Episode, _fits, _play_turn, _start, checked_adapter, rollout_ids,
)

log = logging.getLogger(__name__)


def request_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of episode `episode`'s turn `turn` in a group of seed `seed` (independent streams)."""
    return int(np.random.SeedSequence([seed & (2**64 - 1), 1 + episode, turn]).generate_state(1)[0])


def play_group(
    task: TaskGroup,
    engine: Engine,
    backend: Any,
    chat: ChatFormat,
    env_cfg: EnvSection,
    rollout_cfg: RolloutSection,
    max_model_len: int,
    seed: int,
    ctx: EnvContext,
    guard: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> tuple[RolloutGroup, RolloutStats]:
    """Play `task.group_size` sibling episodes of `task.game`, each in its own thread, sampling through `engine`.

    Arguments and result as `episodes.run_group` (backend: its tokenizer,
    eos_token_id, vocab_size, max_model_len; the engine samples), with one
    seed per draw from `request_seed`. Each episode's KV may stay in the
    engine between its turns (cache key "<group id>/<rollout id>", released
    when the episode ends). An env that never starts fails the group
    (RuntimeError, the job is redelivered): its siblings stop at their next
    turn. A request failing with non-finite logits ends its episode "error".
    Each wait for the engine's answer runs under `guard()` (the worker's
    liveness guard of probes.generate_s: an engine that stopped answering
    fails its /livez).

    Raises ValueError / MessageError as run_group.
    """
    t_start = time.perf_counter()
    adapter = checked_adapter(chat, env_cfg)
    env_task = _checked_task(task, env_cfg, backend)
    max_model_len = min(max_model_len, getattr(backend, "max_model_len", max_model_len))
    failed = threading.Event()

    def episode(i: int, rid: str) -> tuple[_Episode, RolloutStats]:
        stats = RolloutStats()
        key = f"{task.group_id}/{rid}"
        t0 = time.perf_counter()
        try:
            env, first = _start(adapter, env_task, env_cfg, ctx, task, rid)
        except Exception:
            failed.set()
            raise
        stats.env_seconds += time.perf_counter() - t0
        ep = _Episode(rid, env)
        try:
            ep.begin(chat, env_cfg, first)
            for turn in range(task.max_turns):
                if failed.is_set():
                    ep.ending = "error"
                    break
                if not _fits(len(ep.ids), rollout_cfg.max_new_tokens, max_model_len):
                    ep.ending = "truncated"
                    break
                request = SampleRequest(list(ep.ids), rollout_cfg.max_new_tokens, rollout_cfg.temperature,
                                        rollout_cfg.top_p, request_seed(seed, i, turn), cache_key=key)
                t0 = time.perf_counter()
                try:
                    with guard():
                        gen = engine.submit(request).result()
                except NonFiniteLogitsError:
                    log.warning("group %s %s: non-finite logits, episode ends as error", task.group_id, rid)
                    ep.ending = "error"
                    stats.nonfinite_logprobs += 1
                    break
                finally:
                    stats.generate_seconds += time.perf_counter() - t0
                    stats.generate_calls += 1
                _play_turn(ep, gen, turn, task, chat, backend, env_cfg, rollout_cfg.max_new_tokens, max_model_len,
                           chat.prefill_text, frozenset(backend.stop_token_ids), stats, adapter.ACTION_TAGS)
                if ep.done:
                    break
        except Exception:
            failed.set()
            raise
        finally:
            engine.release(key)
            try:
                ep.env.close()
            except Exception:  # noqa: BLE001 - a failing close must not lose the episode
                log.exception("group %s %s: env.close() failed", task.group_id, rid)
            ep.env = None
        return ep, stats

    with ThreadPoolExecutor(max_workers=task.group_size, thread_name_prefix="episode") as pool:
        futures = [pool.submit(episode, i, rid) for i, rid in enumerate(rollout_ids(task.group_size))]
        errors = [f.exception() for f in futures]
    if any(errors):
        raise next(e for e in errors if e is not None)

    stats = RolloutStats(episodes=task.group_size)
    episodes = []
    for f in futures:
        ep, ep_stats = f.result()
        if not ep.ending:
            ep.ending = "max_turns"
        ep_stats.truncated_episodes += ep.ending == "truncated"
        ep_stats.wins += ep.won
        stats.add(ep_stats)
        episodes.append(ep)
    stats.seconds = time.perf_counter() - t_start
    group = RolloutGroup(task=task, trajectories=[ep.to_trajectory() for ep in episodes],
                         prompt_format=env_cfg.prompt_format, rollout_seconds=stats.seconds)
    group.validate(getattr(backend, "vocab_size", None))
    return group, stats
