"""HFEngine (opsd/models/hf_engine.py) on the real SmolLM2: batched waves, per-request seeds, KV kept between turns.

The reference for every request is `HFBackend.generate([prompt], seed=s)`: one
row drawn from one generator seeded s. The engine must give the same ids and
the same log-probs (float32 CPU: batch shape and cached vs recomputed prefixes
change the last bits only, hence 1e-4 nats) whatever else shares its wave.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from opsd.models.engine import SampleRequest
from opsd.models.hf_engine import HFEngine, _Pending

TOL = 1e-4  # nats: float32 rounding of a different batch shape / cached prefix, far below any real difference


@pytest.fixture
def engine(policy_backend):
    eng = HFEngine(policy_backend, max_batch=8, kv_cache_bytes=256 << 20)
    yield eng
    eng.close()


def _prompts(backend) -> list[list[int]]:
    tok = backend.tokenizer
    texts = ["You are in a kitchen. There is a fridge.", "Go north.", "The coin is on the table; take it, then"
             " go east to the hallway and open the door.", "Hello"]
    return [tok(t)["input_ids"] for t in texts]


def _same(got, want) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=TOL, rtol=0)
    np.testing.assert_allclose(got.entropies, want.entropies, atol=TOL, rtol=0)


def test_a_wave_gives_each_request_what_it_would_get_alone(policy_backend, engine):
    prompts = _prompts(policy_backend)
    reqs = [SampleRequest(p, max_new_tokens=6, temperature=0.9, seed=100 + i) for i, p in enumerate(prompts)]
    futures = [engine.submit(r) for r in reqs]  # submitted together: one or two waves of mixed lengths
    for r, f in zip(reqs, futures):
        _same(f.result(timeout=300), policy_backend.generate([list(r.prompt_ids)], 6, 0.9, seed=r.seed)[0])
    s = engine.stats()
    assert s.requests == 4 and s.generated_tokens == sum(len(f.result().token_ids) for f in futures)
    assert (s.running, s.waiting) == (0, 0) and engine.in_flight() == 0
    assert s.prefix_hits == 0 and s.prefix_queries == sum(len(p) for p in prompts)  # no cache_key: nothing kept


def test_siblings_first_prompt_is_prefilled_once_and_each_draws_its_own(policy_backend, engine):
    p, other = _prompts(policy_backend)[2], _prompts(policy_backend)[1]
    reqs = [SampleRequest(p, 5, 1.0, seed=40 + i, cache_key=f"sib{i}") for i in range(3)]
    reqs.append(SampleRequest(other, 5, 1.0, seed=50, cache_key="other"))
    hits0 = engine.stats().prefix_hits
    with engine._cond:  # all four in one wave: submitted while the engine thread cannot take any
        futures = [engine.submit(r) for r in reqs]
    gens = [f.result(timeout=300) for f in futures]
    for r, g in zip(reqs, gens):
        _same(g, policy_backend.generate([list(r.prompt_ids)], 5, 1.0, seed=r.seed)[0])
    assert engine.stats().prefix_hits - hits0 == 2 * len(p)  # two siblings got the first one's prefill
    assert len({tuple(g.token_ids) for g in gens[:3]}) > 1  # their own seeds: not one sample copied
    for key in ("sib0", "sib1", "sib2", "other"):
        engine.release(key)


def test_an_episode_reuses_its_kv_between_turns_and_gets_the_same_tokens(policy_backend, engine):
    tok = policy_backend.tokenizer
    first = _prompts(policy_backend)[:2]
    obs = [tok(" You see a key.")["input_ids"], tok(" Nothing happens.")["input_ids"]]
    # Turn 0 of two episodes, then turn 1 of both beside a fresh request (holes of different widths in one wave).
    turn0 = [engine.submit(SampleRequest(p, 5, 1.0, seed=7 + i, cache_key=f"ep{i}")) for i, p in enumerate(first)]
    gens0 = [f.result(timeout=300) for f in turn0]
    assert engine.stats().kv_cache_usage > 0
    prompts1 = [p + g.token_ids + o for p, g, o in zip(first, gens0, obs)]
    fresh = _prompts(policy_backend)[2]
    hits_before = engine.stats().prefix_hits
    reqs1 = [SampleRequest(p, 5, 1.0, seed=20 + i, cache_key=f"ep{i}") for i, p in enumerate(prompts1)]
    reqs1.append(SampleRequest(fresh, 5, 1.0, seed=30))
    futures = [engine.submit(r) for r in reqs1]
    for r, f in zip(reqs1, futures):
        _same(f.result(timeout=300), policy_backend.generate([list(r.prompt_ids)], 5, 1.0, seed=r.seed)[0])
    # Each episode's prompt and response but its last sampled id came from the store.
    want_hits = sum(len(p) + len(g.token_ids) - 1 for p, g in zip(first, gens0))
    assert engine.stats().prefix_hits - hits_before == want_hits
    engine.release("ep0")
    engine.release("ep1")
    engine.release("never-seen")


def test_a_prompt_that_does_not_extend_the_kept_ids_is_prefilled_in_full(policy_backend, engine):
    p0, p1 = _prompts(policy_backend)[:2]
    engine.submit(SampleRequest(p0, 3, 1.0, seed=1, cache_key="ep")).result(timeout=300)
    hits = engine.stats().prefix_hits
    r = SampleRequest(p1 + p0, 3, 1.0, seed=2, cache_key="ep")  # same key, another history
    _same(engine.submit(r).result(timeout=300), policy_backend.generate([list(r.prompt_ids)], 3, 1.0, seed=2)[0])
    assert engine.stats().prefix_hits == hits


def test_a_store_too_small_keeps_nothing_and_changes_no_result(policy_backend):
    eng = HFEngine(policy_backend, max_batch=4, kv_cache_bytes=1024)  # below one token's KV of SmolLM2 x prompt
    try:
        p = _prompts(policy_backend)[0]
        g0 = eng.submit(SampleRequest(p, 3, 1.0, seed=3, cache_key="ep")).result(timeout=300)
        r = SampleRequest(p + g0.token_ids, 3, 1.0, seed=4, cache_key="ep")
        _same(eng.submit(r).result(timeout=300), policy_backend.generate([list(r.prompt_ids)], 3, 1.0, seed=4)[0])
        s = eng.stats()
        assert s.prefix_hits == 0 and s.kv_cache_usage == 0.0
    finally:
        eng.close()


def test_requests_from_many_threads_all_resolve(policy_backend, engine):
    prompts = _prompts(policy_backend)
    results: dict[int, object] = {}

    def episode(i: int) -> None:
        results[i] = engine.submit(SampleRequest(prompts[i % 4], 4, 1.0, seed=i)).result(timeout=300)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(10))
    for i in range(10):  # the same seed and prompt give the same tokens, whatever wave they fell in
        assert results[i].token_ids == policy_backend.generate([prompts[i % 4]], 4, 1.0, seed=i)[0].token_ids


def test_bad_requests_are_refused_at_submit(policy_backend, engine):
    ok = _prompts(policy_backend)[0]
    for bad, match in [
        (SampleRequest([], 4, 1.0), "empty"),
        (SampleRequest([policy_backend.vocab_size], 4, 1.0), "out of range"),
        (SampleRequest(ok, policy_backend.max_model_len, 1.0), "exceeds max_model_len"),
        (SampleRequest(ok, 0, 1.0), "max_new_tokens"),
        (SampleRequest(ok, 4, 0.0), "temperature"),
        (SampleRequest(ok, 4, 1.0, top_p=1.5), "top_p"),
        (SampleRequest(ok, 4, 1.0, stop_token_ids=(-1,)), "out of range"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad)
    assert engine.in_flight() == 0


def test_weights_load_only_when_idle_and_drop_the_kept_kv(policy_backend, engine, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "v1.safetensors"
    save_file({k: v.contiguous() for k, v in policy_backend.model.state_dict().items()
               if k != "lm_head.weight"}, str(path))  # the same weights, published as version 1
    p = _prompts(policy_backend)[0]
    engine.submit(SampleRequest(p, 2, 1.0, seed=1, cache_key="ep")).result(timeout=300)
    assert engine.stats().kv_cache_usage > 0
    with engine._cond:  # a request waiting (the engine thread cannot take it while we hold the lock): a load refuses
        engine._waiting.append(_Pending(SampleRequest(p, 2, 1.0)))
        with pytest.raises(RuntimeError, match="in flight"):
            engine.load_weights(path, 1)
        held = engine._waiting.pop()
    held.future.cancel()
    assert policy_backend.policy_version == 0
    engine.load_weights(path, 1)
    try:
        assert policy_backend.policy_version == 1 and engine.stats().kv_cache_usage == 0.0
    finally:
        policy_backend.policy_version = 0  # the session backend: same weights, version back


def test_closing_fails_what_still_waits(policy_backend):
    eng = HFEngine(policy_backend, max_batch=1)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(SampleRequest(_prompts(policy_backend)[0], 2, 1.0))
    eng.close()  # idempotent
