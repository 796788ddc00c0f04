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


def test_a_cancelled_request_leaves_its_wave_and_close_alone(policy_backend):
    eng = HFEngine(policy_backend, max_batch=8)
    try:
        prompts = _prompts(policy_backend)
        with eng._cond:  # one wave of four; the first is cancelled while it waits
            futures = [eng.submit(SampleRequest(p, 3, 1.0, seed=i)) for i, p in enumerate(prompts)]
            assert futures[0].cancel()
        for i, f in enumerate(futures[1:], start=1):
            _same(f.result(timeout=300), policy_backend.generate([prompts[i]], 3, 1.0, seed=i)[0])
        assert eng.in_flight() == 0
        with eng._cond:  # closing with a cancelled and a live request waiting
            waiting = [eng.submit(SampleRequest(p, 3, 1.0)) for p in prompts[:2]]
            waiting[0].cancel()
            eng.close()
        assert waiting[0].cancelled()
        with pytest.raises(RuntimeError, match="closed"):
            waiting[1].result(timeout=10)
    finally:
        eng.close()


def test_the_engine_is_idle_before_a_caller_sees_its_result(policy_backend, engine):
    p = _prompts(policy_backend)[3]
    for i in range(10):  # a version switch loads right after the last result: it must not find a request in flight
        engine.submit(SampleRequest(p, 1, 1.0, seed=i)).result(timeout=300)
        assert engine.in_flight() == 0


def test_seeds_are_integers_taken_mod_2_64_like_generate(policy_backend, engine):
    p = _prompts(policy_backend)[0]
    for bad in (1.5, float("nan"), "7", True):
        with pytest.raises(ValueError, match="seed"):
            engine.submit(SampleRequest(p, 2, 1.0, seed=bad))
    for seed in (-1, 2**63 + 5, np.int64(9)):  # the values generate accepts draw what generate draws
        got = engine.submit(SampleRequest(p, 3, 1.0, seed=seed)).result(timeout=300)
        assert got.token_ids == policy_backend.generate([p], 3, 1.0, seed=int(seed))[0].token_ids
    same = engine.submit(SampleRequest(p, 3, 1.0, seed=2**64 + 5)).result(timeout=300)
    assert same.token_ids == policy_backend.generate([p], 3, 1.0, seed=5)[0].token_ids


def test_a_row_with_non_finite_logits_fails_alone_and_its_wave_mates_keep_their_kv(policy_backend, monkeypatch):
    from opsd.models.hf import NonFiniteLogitsError

    eng = HFEngine(policy_backend, max_batch=8, kv_cache_bytes=256 << 20)
    tok = policy_backend.tokenizer
    poison = tok(" word" * 40)["input_ids"][:37]  # the row whose first new token gets NaN logits
    real = policy_backend.model.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        pos = kwargs.get("position_ids")
        if pos is not None and pos.shape[1] == 1:  # decode steps only: the poisoned row's 2nd new token
            out.logits[(pos[:, -1] == len(poison) + 1).nonzero().flatten()] = float("nan")
        return out

    try:
        first = _prompts(policy_backend)[:2]
        g0 = [eng.submit(SampleRequest(p, 3, 1.0, seed=i, cache_key=f"ep{i}")).result(timeout=300)
              for i, p in enumerate(first)]
        nxt = [p + g.token_ids + tok(" ok")["input_ids"] for p, g in zip(first, g0)]
        s0 = eng.stats()
        monkeypatch.setattr(policy_backend.model, "forward", forward)
        with eng._cond:
            futures = [eng.submit(SampleRequest(p, 4, 1.0, seed=10 + i, cache_key=f"ep{i}")) for i, p in enumerate(nxt)]
            bad = eng.submit(SampleRequest(poison, 4, 1.0, seed=99))
        with pytest.raises(NonFiniteLogitsError):
            bad.result(timeout=300)
        gens = [f.result(timeout=300) for f in futures]
        monkeypatch.setattr(policy_backend.model, "forward", real)
        for p, g, i in zip(nxt, gens, range(2)):
            _same(g, policy_backend.generate([p], 4, 1.0, seed=10 + i)[0])
        s1 = eng.stats()
        # Counted once, for the attempt that succeeded; the retry still resumed from the kept KV.
        assert s1.prefix_queries - s0.prefix_queries == sum(map(len, nxt))
        assert s1.prefix_hits - s0.prefix_hits == sum(len(p) + len(g.token_ids) - 1 for p, g in zip(first, g0))
    finally:
        eng.close()


def test_a_full_store_keeps_what_it_holds_instead_of_evicting_the_next_to_resume(policy_backend):
    tok = policy_backend.tokenizer
    prompts = _prompts(policy_backend)
    eng = HFEngine(policy_backend, max_batch=8, kv_cache_bytes=256 << 20)
    try:
        g = eng.submit(SampleRequest(prompts[0], 2, 1.0, seed=0, cache_key="probe")).result(timeout=300)
        one = eng.stats().kv_cache_usage * eng.kv_cache_bytes  # bytes of one short episode
        eng.release("probe")
    finally:
        eng.close()
    eng = HFEngine(policy_backend, max_batch=8, kv_cache_bytes=int(3.5 * one * 4))  # room for some, not all
    try:
        hist = {i: list(prompts[i % 4]) for i in range(6)}
        hits_by_turn = []
        for turn in range(3):
            h0 = eng.stats().prefix_hits
            futures = {i: eng.submit(SampleRequest(hist[i], 2, 1.0, seed=turn * 10 + i, cache_key=f"e{i}"))
                       for i in hist}
            for i, f in futures.items():
                hist[i] = hist[i] + f.result(timeout=300).token_ids + tok(" ok")["input_ids"]
            hits_by_turn.append(eng.stats().prefix_hits - h0)
        assert hits_by_turn[1] > 0 and hits_by_turn[2] > 0  # the episodes it admitted keep being served
        assert g.token_ids
    finally:
        eng.close()
